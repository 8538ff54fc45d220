"""Typed logical DAGs and a forward-chaining solver.

The DAG follows the paper's DAG-extraction prompt (appendix "Prompts for Logical Isomer
Construction"): ``nodes`` are ``{id, type, description}`` with type in ENTITY, RELATION,
CONSTRAINT, PROPOSITION, GOAL, and ``edges`` are ``{from, to, label}`` with label in IMPLIES,
REQUIRES, CAUSES, CONTRADICTS, IS_A, HAS_PROPERTY, plus ``logical_form`` and ``step_count``.

Procedurally generated DAGs add a few keys the solver needs (the paper leaves the encoding
free):

- the ENTITY node with ``"role": "subject"`` is what the problem talks about; its
  HAS_PROPERTY / IS_A edges are the given facts;
- PROPOSITION / ENTITY nodes carry a ``slot``: the index of their word in the domain
  lexicon of each instance (``meta.lexicon``), so one DAG serves every domain;
- ``A -IMPLIES-> B`` and ``A -IS_A-> B`` between non-subject nodes are rules; a CONSTRAINT
  node ``C`` with ``C -REQUIRES-> A``, ``C -REQUIRES-> B``, ``C -IMPLIES-> D`` is the
  conjunctive rule "A and B imply D"; ``A -CONTRADICTS-> B`` says A and B exclude each other;
- a quantity is an ENTITY with ``"kind": "quantity"``, optionally a given ``value``; a
  RELATION node with ``op`` (add, sub, mul) and ``arg`` computes ``X -CAUSES-> R -CAUSES-> Y``
  as ``Y = op(X, arg)``;
- the GOAL node's REQUIRES edge names the node asked about.

Forward chaining processes facts in the order they become known (a queue) and stops once
the goal is decided, so the trace is the natural step-by-step chain of thought.
"""
from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field

NODE_TYPES = ("ENTITY", "RELATION", "CONSTRAINT", "PROPOSITION", "GOAL")
EDGE_LABELS = ("IMPLIES", "REQUIRES", "CAUSES", "CONTRADICTS", "IS_A", "HAS_PROPERTY")
ARITH_OPS = {
    "add": lambda x, k: x + k,
    "sub": lambda x, k: x - k,
    "mul": lambda x, k: x * k,
}


class DagError(ValueError):
    """The DAG is not well formed or cannot be solved (no goal, cycle in values, ...)."""


@dataclass
class Solution:
    """Result of forward chaining.

    ``steps`` are tuples, in derivation order:
    ("implies", a, b), ("conj", c_node, [premises], b), ("isa", a, b), ("disjoint", a, b),
    ("arith", op, x, arg, y, value_x, value_y). ``status`` is proven, refuted or unknown
    for a yes/no goal and "value" for a numeric one.
    """

    answer: str
    status: str
    target: str
    steps: list[tuple] = field(default_factory=list)


def check_dag(dag: dict) -> None:
    """Structural checks shared by the validator and the teacher pipeline."""
    if not isinstance(dag, dict):
        raise DagError("dag must be a JSON object")
    nodes, edges = dag.get("nodes"), dag.get("edges")
    if not isinstance(nodes, list) or not nodes:
        raise DagError("dag.nodes must be a non-empty list")
    if not isinstance(edges, list):
        raise DagError("dag.edges must be a list")
    ids = set()
    for i, node in enumerate(nodes):
        if not isinstance(node, dict) or "id" not in node:
            raise DagError(f"dag.nodes[{i}] must be an object with an id")
        if node.get("type") not in NODE_TYPES:
            raise DagError(f"dag.nodes[{i}].type {node.get('type')!r} is not one of {', '.join(NODE_TYPES)}")
        ids.add(str(node["id"]))
    for i, edge in enumerate(edges):
        if not isinstance(edge, dict):
            raise DagError(f"dag.edges[{i}] must be an object")
        if edge.get("label") not in EDGE_LABELS:
            raise DagError(f"dag.edges[{i}].label {edge.get('label')!r} is not one of {', '.join(EDGE_LABELS)}")
        for end in ("from", "to"):
            if str(edge.get(end)) not in ids:
                raise DagError(f"dag.edges[{i}].{end} {edge.get(end)!r} names no node")


def solve(dag: dict) -> Solution:
    """Forward-chain a generated DAG to its goal (closed world: not derivable means "no")."""
    nodes = {n["id"]: n for n in dag["nodes"]}
    subject = next((i for i, n in nodes.items() if n.get("role") == "subject"), None)
    goal = next((i for i, n in nodes.items() if n["type"] == "GOAL"), None)
    if goal is None:
        raise DagError("dag has no GOAL node")

    truth: dict[str, bool] = {}
    value: dict[str, int] = {}
    queue: list[str] = []
    by_premise: dict[str, list[tuple]] = defaultdict(list)
    conj_premises: dict[str, list[str]] = defaultdict(list)
    conj_conclusion: dict[str, str] = {}
    rel_in: dict[str, str] = {}
    rel_out: dict[str, str] = {}
    target = None

    for e in dag["edges"]:
        a, b, label = e["from"], e["to"], e["label"]
        kind_a = nodes[a]["type"]
        if a == goal and label == "REQUIRES":
            target = b
        elif a == subject and label in ("HAS_PROPERTY", "IS_A"):
            if b not in truth:
                truth[b] = True
                queue.append(b)
        elif kind_a == "CONSTRAINT":
            if label == "REQUIRES":
                conj_premises[a].append(b)
            elif label == "IMPLIES":
                conj_conclusion[a] = b
        elif label in ("IMPLIES", "IS_A"):
            by_premise[a].append(("isa" if label == "IS_A" else "implies", a, b))
        elif label == "CONTRADICTS":
            by_premise[a].append(("disjoint", a, b))
            by_premise[b].append(("disjoint", b, a))
        elif label == "CAUSES":
            if nodes[b]["type"] == "RELATION":
                rel_in[b] = a
            else:
                rel_out[a] = b
    for c, premises in conj_premises.items():
        if c in conj_conclusion:
            for p in premises:
                by_premise[p].append(("conj", c))
    for r, x in rel_in.items():
        if r in rel_out:
            by_premise[x].append(("arith", r))
    for nid, node in nodes.items():
        if "value" in node:
            value[nid] = int(node["value"])
            queue.append(nid)
    if target is None:
        raise DagError("the GOAL node has no REQUIRES edge naming its target")

    steps: list[tuple] = []
    head = 0
    # stop as soon as the goal is decided: the chain of thought holds no idle derivations
    while head < len(queue) and target not in truth and target not in value:
        fact = queue[head]
        head += 1
        for rule in by_premise.get(fact, ()):
            kind = rule[0]
            if kind in ("implies", "isa"):
                b = rule[2]
                if b not in truth:
                    truth[b] = True
                    steps.append(rule)
                    queue.append(b)
            elif kind == "disjoint":
                b = rule[2]
                if b not in truth:
                    truth[b] = False
                    steps.append(rule)
            elif kind == "conj":
                c = rule[1]
                b = conj_conclusion[c]
                premises = conj_premises[c]
                if b not in truth and all(truth.get(p) is True for p in premises):
                    truth[b] = True
                    steps.append(("conj", c, list(premises), b))
                    queue.append(b)
            else:  # arith
                r = rule[1]
                y = rel_out[r]
                if y not in value:
                    op, arg = nodes[r]["op"], int(nodes[r]["arg"])
                    if op not in ARITH_OPS:
                        raise DagError(f"relation {r}: unknown op {op!r}")
                    value[y] = ARITH_OPS[op](value[fact], arg)
                    steps.append(("arith", op, fact, arg, y, value[fact], value[y]))
                    queue.append(y)
            if target in truth or target in value:
                break

    if nodes[target].get("kind") == "quantity":
        if target not in value:
            raise DagError(f"the value of {target} cannot be derived")
        return Solution(str(value[target]), "value", target, steps)
    t = truth.get(target)
    status = "proven" if t is True else "refuted" if t is False else "unknown"
    return Solution("yes" if t is True else "no", status, target, steps)
