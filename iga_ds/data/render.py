"""Render a solved DAG as a problem and a chain of thought in one domain's vocabulary.

The DAG is turned once per group into abstract statements (tuples of node slots); each domain
then only fills its frames, which keeps generation fast and guarantees that all instances
of a group state exactly the same facts and rules in the same order.
"""
from __future__ import annotations

from iga_ds.data.dag import Solution
from iga_ds.data.domains import Domain

_LEXICON_FIELD = {"properties": "properties", "classes": "classes", "quantities": "quantities"}


def abstract_statements(dag: dict) -> tuple[list[tuple], tuple]:
    """(statements in problem order, question) with node ids; rules first, then facts."""
    nodes = {n["id"]: n for n in dag["nodes"]}
    conj: dict[str, list] = {}
    rel_out: dict[str, str] = {}
    for e in dag["edges"]:
        if nodes[e["from"]]["type"] == "CONSTRAINT":
            parts = conj.setdefault(e["from"], [[], None])
            if e["label"] == "REQUIRES":
                parts[0].append(e["to"])
            elif e["label"] == "IMPLIES":
                parts[1] = e["to"]
        elif e["label"] == "CAUSES" and nodes[e["from"]]["type"] == "RELATION":
            rel_out[e["from"]] = e["to"]

    rules: list[tuple] = []
    facts: list[tuple] = []
    question = None
    seen_constraints = set()
    for e in dag["edges"]:
        a, b, label = e["from"], e["to"], e["label"]
        node_a = nodes[a]
        if node_a["type"] == "GOAL":
            kind = "num" if nodes[b].get("kind") == "quantity" else (
                "class" if _is_class_problem(dag) else "prop")
            question = (kind, b)
        elif node_a.get("role") == "subject":
            facts.append(("member" if label == "IS_A" else "fact", b))
        elif node_a["type"] == "CONSTRAINT":
            if a not in seen_constraints:
                seen_constraints.add(a)
                (p, q), c = conj[a]
                rules.append(("conj", p, q, c))
        elif label == "IMPLIES":
            rules.append(("rule", a, b))
        elif label == "IS_A":
            rules.append(("isa", a, b))
        elif label == "CONTRADICTS":
            rules.append(("disjoint", a, b))
        elif label == "CAUSES" and nodes[b]["type"] == "RELATION":
            rel = nodes[b]
            rules.append((rel["op"], rel_out[b], a, rel["arg"]))
    for n in dag["nodes"]:
        if "value" in n:
            facts.append(("given", n["id"], n["value"]))
    if question is None:
        raise ValueError("dag has no goal")
    return rules + facts, question


def _is_class_problem(dag: dict) -> bool:
    return any(e["label"] == "IS_A" for e in dag["edges"])


def slot_words(dag: dict, lexicon: list[str]) -> dict[str, str]:
    """node id -> the word this instance uses for it (the subject maps to itself)."""
    return {n["id"]: lexicon[n["slot"]] for n in dag["nodes"] if "slot" in n}


def render_problem(domain: Domain, statements: list[tuple], question: tuple,
                   words: dict[str, str], cue: str | None = None) -> str:
    s, z = domain.subject, domain.individual
    out = [cue] if cue else []
    for st in statements:
        kind = st[0]
        if kind == "rule":
            text = domain.rule.format(s=s, a=words[st[1]], b=words[st[2]])
        elif kind == "conj":
            text = domain.conj_rule.format(s=s, a=words[st[1]], b=words[st[2]], c=words[st[3]])
        elif kind == "fact":
            text = domain.fact.format(s=s, a=words[st[1]])
        elif kind == "member":
            text = domain.member_fact.format(z=z, A=words[st[1]])
        elif kind == "isa":
            text = domain.isa_rule.format(A=words[st[1]], B=words[st[2]])
        elif kind == "disjoint":
            text = domain.disjoint_rule.format(A=words[st[1]], B=words[st[2]])
        elif kind == "given":
            text = domain.given.format(x=words[st[1]], v=st[2])
        else:  # add / sub / mul: (op, y, x, k)
            frame = {"add": domain.add, "sub": domain.sub, "mul": domain.mul}[kind]
            text = frame.format(y=words[st[1]], x=words[st[2]], k=st[3])
        out.append(text + " .")
    qkind, target = question
    if qkind == "num":
        out.append(domain.num_question.format(y=words[target]))
    elif qkind == "class":
        out.append(domain.class_question.format(z=z, B=words[target]))
    else:
        out.append(domain.prop_question.format(s=s, q=words[target]))
    return " ".join(out)


def replace_cue(problem: str, cue: str, new_cue: str) -> str:
    """``problem`` (rendered with the cue sentence ``cue``) with ``new_cue`` in its place."""
    if not problem.startswith(cue + " "):
        raise ValueError(f"problem does not open with the cue {cue!r}")
    return new_cue + problem[len(cue):]


def render_cot(domain: Domain, solution: Solution, question: tuple, words: dict[str, str]) -> str:
    """One line per derivation, a closing line for yes/no goals, then ``Answer: X``."""
    s, z = domain.subject, domain.individual
    lines = []
    for step in solution.steps:
        kind = step[0]
        if kind == "implies":
            lines.append(domain.prop_step.format(s=s, a=words[step[1]], b=words[step[2]]))
        elif kind == "conj":
            p, q = step[2]
            lines.append(domain.conj_step.format(s=s, a=words[p], b=words[q], c=words[step[3]]))
        elif kind == "isa":
            lines.append(domain.isa_step.format(z=z, A=words[step[1]], B=words[step[2]]))
        elif kind == "disjoint":
            lines.append(domain.disjoint_step.format(z=z, A=words[step[1]], B=words[step[2]]))
        else:  # ("arith", op, x, k, y, vx, vy)
            frame = {"add": domain.add_step, "sub": domain.sub_step, "mul": domain.mul_step}[step[1]]
            lines.append(frame.format(y=words[step[4]], vx=step[5], k=step[3], v=step[6]))
    qkind, target = question
    if qkind == "class":
        lines.append(domain.conclusion("class", solution.status, z=z, b=words[target]))
    elif qkind == "prop":
        lines.append(domain.conclusion("prop", solution.status, s=s, q=words[target]))
    lines.append(f"Answer: {solution.answer}")
    return "\n".join(lines)
