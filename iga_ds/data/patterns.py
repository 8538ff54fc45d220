"""Samplers of typed logical DAGs, one per reasoning pattern.

Each sampler returns a DAG (``iga_ds.data.dag``) whose answer is fixed by construction and
then re-derived by the solver, so a bug here shows up as a mismatch rather than a silent
mislabel. Patterns (paper section 3.3 speaks of implication, causation and conditional
dependencies; these are their smallest concrete forms):

- ``rule_chain``: modus ponens along a chain of implications, with a distractor chain;
- ``conjunction``: a chain where some steps need two premises ("if a and b then c");
- ``syllogism``: class inclusion ("every A is a B") with one disjointness rule
  ("no A is a B"), which can refute the goal;
- ``arithmetic``: a dependency chain of small integer quantities (add, subtract, multiply).

Statements are shuffled at the DAG level, so every domain of a group shows them in the
same order and the instances differ only in vocabulary.
"""
from __future__ import annotations

import random

PATTERNS = ("rule_chain", "conjunction", "syllogism", "arithmetic")
BOOLEAN_ANSWERS = ("yes", "no")
MAX_VALUE = 20  # arithmetic answers are integers 0..MAX_VALUE
INTEGER_ANSWERS = tuple(str(v) for v in range(MAX_VALUE + 1))

# how many lexicon words each pattern may need at depth 4 (domains hold at least this many)
SLOT_KIND = {"rule_chain": "properties", "conjunction": "properties",
             "syllogism": "classes", "arithmetic": "quantities"}


class _Builder:
    """Accumulates nodes and statements (lists of edges that render as one sentence)."""

    def __init__(self, slot_prefix: str, slot_type: str, slot_description: str):
        self.nodes: list[dict] = [
            {"id": "s", "type": "ENTITY", "description": "the subject of the problem", "role": "subject"}
        ]
        self.rules: list[list[dict]] = []  # shuffled before output
        self.facts: list[dict] = []
        self.n_slots = 0
        self._prefix, self._type, self._desc = slot_prefix, slot_type, slot_description
        self.n_aux = 0

    def slot(self, **extra) -> str:
        nid = f"{self._prefix}{self.n_slots}"
        node = {"id": nid, "type": self._type, "description": f"{self._desc} {self.n_slots}",
                "slot": self.n_slots}
        node.update(extra)
        self.nodes.append(node)
        self.n_slots += 1
        return nid

    def aux(self, node_type: str, description: str, **extra) -> str:
        nid = f"{node_type[0].lower()}{self.n_aux}"
        self.n_aux += 1
        node = {"id": nid, "type": node_type, "description": description}
        node.update(extra)
        self.nodes.append(node)
        return nid

    def finish(self, rng: random.Random, target: str, logical_form: str, step_count: int) -> dict:
        self.nodes.append({"id": "goal", "type": "GOAL", "description": "the question asked"})
        rng.shuffle(self.rules)
        edges = [e for statement in self.rules for e in statement] + self.facts
        edges.append({"from": "goal", "to": target, "label": "REQUIRES"})
        return {"nodes": self.nodes, "edges": edges, "logical_form": logical_form,
                "step_count": step_count}


def _edge(a: str, b: str, label: str) -> dict:
    return {"from": a, "to": b, "label": label}


def rule_chain(rng: random.Random, depth: int, want_yes: bool) -> dict:
    b = _Builder("p", "PROPOSITION", "property")
    chain = [b.slot() for _ in range(depth + 1)]
    distractor = [b.slot() for _ in range(rng.randint(2, 3))]
    for path in (chain, distractor):
        for x, y in zip(path, path[1:]):
            b.rules.append([_edge(x, y, "IMPLIES")])
    b.facts.append(_edge("s", chain[0], "HAS_PROPERTY"))
    target = chain[-1] if want_yes else distractor[-1]
    form = f"modus ponens along {depth} implications; a second chain is never triggered"
    return b.finish(rng, target, form, depth + 1)


def conjunction(rng: random.Random, depth: int, want_yes: bool) -> dict:
    b = _Builder("p", "PROPOSITION", "property")
    chain = [b.slot() for _ in range(depth + 1)]
    n_conj = 1 if depth < 3 else rng.randint(1, 2)
    conj_steps = sorted(rng.sample(range(depth), n_conj))
    extra = {j: b.slot() for j in conj_steps}
    for i in range(depth):
        if i in extra:
            c = b.aux("CONSTRAINT", "both premises must hold")
            premises = [chain[i], extra[i]]
            rng.shuffle(premises)
            b.rules.append([_edge(c, premises[0], "REQUIRES"), _edge(c, premises[1], "REQUIRES"),
                            _edge(c, chain[i + 1], "IMPLIES")])
        else:
            b.rules.append([_edge(chain[i], chain[i + 1], "IMPLIES")])
    d0, d1 = b.slot(), b.slot()
    b.rules.append([_edge(d0, d1, "IMPLIES")])
    given = [chain[0]] + [extra[j] for j in conj_steps]
    if not want_yes:
        # drop one extra premise, and give an unrelated fact so the fact count stays the same
        given.remove(extra[rng.choice(conj_steps)])
        given.append(b.slot())
    for g in given:
        b.facts.append(_edge("s", g, "HAS_PROPERTY"))
    form = f"chain of {depth} rules, {n_conj} of them needing two premises"
    # step count: derivations that fire plus the conclusion, filled in by the solver's caller
    return b.finish(rng, chain[-1], form, 0)


def syllogism(rng: random.Random, depth: int, want_yes: bool) -> dict:
    b = _Builder("c", "ENTITY", "class")
    chain = [b.slot() for _ in range(depth + 1)]
    for x, y in zip(chain, chain[1:]):
        b.rules.append([_edge(x, y, "IS_A")])
    b.facts.append(_edge("s", chain[0], "IS_A"))
    if want_yes:
        target = chain[-1]
        if rng.random() < 0.5:
            b.rules.append([_edge(chain[-1], b.slot(), "CONTRADICTS")])
        else:
            b.rules.append([_edge(b.slot(), b.slot(), "CONTRADICTS")])
        form = f"class inclusion through {depth} universal premises"
    elif rng.random() < 0.5:
        target = b.slot()
        b.rules.append([_edge(chain[rng.randrange(depth + 1)], target, "CONTRADICTS")])
        form = f"class inclusion through {depth} universal premises, then a disjointness refutes the goal"
    else:
        u, target = b.slot(), b.slot()
        b.rules.append([_edge(u, target, "IS_A")])
        b.rules.append([_edge(u, b.slot(), "CONTRADICTS")])
        form = f"class inclusion through {depth} universal premises; the goal class is never reached"
    return b.finish(rng, target, form, 0)


def _arith_step(rng: random.Random, v: int) -> tuple[str, int, int]:
    options = []
    if v + 1 <= MAX_VALUE:
        options.append("add")
    if v - 1 >= 0:
        options.append("sub")
    if 1 <= v and v * 2 <= MAX_VALUE:
        options.append("mul")
    op = rng.choice(options)
    if op == "add":
        k = rng.randint(1, min(5, MAX_VALUE - v))
        return op, k, v + k
    if op == "sub":
        k = rng.randint(1, min(5, v))
        return op, k, v - k
    k = 2 if v * 3 > MAX_VALUE else rng.choice((2, 3))
    return op, k, v * k


def arithmetic(rng: random.Random, depth: int, want_yes: bool) -> dict:
    del want_yes  # numeric answers
    b = _Builder("q", "ENTITY", "quantity")
    v = rng.randint(0, 12)
    chain = [b.slot(kind="quantity", value=v)]
    for _ in range(depth):
        op, k, v = _arith_step(rng, v)
        y = b.slot(kind="quantity")
        r = b.aux("RELATION", f"{op} {k}", op=op, arg=k)
        b.rules.append([_edge(chain[-1], r, "CAUSES"), _edge(r, y, "CAUSES")])
        chain.append(y)
    if rng.random() < 0.5:
        b.slot(kind="quantity", value=rng.randint(0, 12))  # a given quantity nobody needs
    form = f"dependency chain of {depth} arithmetic operations"
    return b.finish(rng, chain[-1], form, depth)


SAMPLERS = {
    "rule_chain": rule_chain,
    "conjunction": conjunction,
    "syllogism": syllogism,
    "arithmetic": arithmetic,
}
