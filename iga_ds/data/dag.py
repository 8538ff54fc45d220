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
    chainer = _ForwardChainer(nodes)
    chainer.read_edges(dag["edges"], subject, goal)
    chainer.queue_given_values()
    if chainer.target is None:
        raise DagError("the GOAL node has no REQUIRES edge naming its target")
    chainer.run()
    return chainer.solution()


class _ForwardChainer:
    """One forward-chaining run: the rules indexed by premise, what is known, and the trace."""

    def __init__(self, nodes: dict[str, dict]):
        self.nodes = nodes
        self.target: str | None = None
        self.truth: dict[str, bool] = {}
        self.value: dict[str, int] = {}
        self.queue: list[str] = []  # facts in the order they became known
        self.steps: list[tuple] = []
        # rules that fire when their key becomes known (the first premise that does so)
        self.by_premise: dict[str, list[tuple]] = defaultdict(list)
        self.conj_premises: dict[str, list[str]] = defaultdict(list)
        self.conj_conclusion: dict[str, str] = {}
        self.rel_out: dict[str, str] = {}

    def read_edges(self, edges: list[dict], subject: str | None, goal: str) -> None:
        """Read the target, the given facts and every rule from the edges, in edge order."""
        rel_in: dict[str, str] = {}
        for e in edges:
            a, b, label = e["from"], e["to"], e["label"]
            kind_a = self.nodes[a]["type"]
            if a == goal and label == "REQUIRES":
                self.target = b
            elif a == subject and label in ("HAS_PROPERTY", "IS_A"):
                self._learn(b, True)
            elif kind_a == "CONSTRAINT":
                if label == "REQUIRES":
                    self.conj_premises[a].append(b)
                elif label == "IMPLIES":
                    self.conj_conclusion[a] = b
            elif label in ("IMPLIES", "IS_A"):
                self.by_premise[a].append(("isa" if label == "IS_A" else "implies", a, b))
            elif label == "CONTRADICTS":
                self.by_premise[a].append(("disjoint", a, b))
                self.by_premise[b].append(("disjoint", b, a))
            elif label == "CAUSES":
                if self.nodes[b]["type"] == "RELATION":
                    rel_in[b] = a
                else:
                    self.rel_out[a] = b
        # compound rules are complete only once every edge is read; they fire after the simple ones
        for c, premises in self.conj_premises.items():
            if c in self.conj_conclusion:
                for p in premises:
                    self.by_premise[p].append(("conj", c))
        for r, x in rel_in.items():
            if r in self.rel_out:
                self.by_premise[x].append(("arith", r))

    def queue_given_values(self) -> None:
        """Queue the quantities whose value the DAG gives, after the given facts."""
        for nid, node in self.nodes.items():
            if "value" in node:
                self.value[nid] = int(node["value"])
                self.queue.append(nid)

    def _learn(self, node: str, true: bool) -> None:
        """Record a yes/no fact not known before; only true facts can fire further rules."""
        if node not in self.truth:
            self.truth[node] = true
            if true:
                self.queue.append(node)

    def _decided(self) -> bool:
        """Whether the goal's target has a truth value or a number yet."""
        return self.target in self.truth or self.target in self.value

    def run(self) -> None:
        """Apply rules fact by fact in queue order until the goal is decided or nothing is left."""
        head = 0
        # stop as soon as the goal is decided: the chain of thought holds no idle derivations
        while head < len(self.queue) and not self._decided():
            fact = self.queue[head]
            head += 1
            for rule in self.by_premise.get(fact, ()):
                self._apply(rule, fact)
                if self._decided():
                    break

    def _apply(self, rule: tuple, fact: str) -> None:
        """Fire one rule whose premise ``fact`` just became known; record a step if it derives."""
        kind = rule[0]
        if kind in ("implies", "isa", "disjoint"):
            b = rule[2]
            if b not in self.truth:
                self._learn(b, kind != "disjoint")
                self.steps.append(rule)
        elif kind == "conj":
            c = rule[1]
            b = self.conj_conclusion[c]
            premises = self.conj_premises[c]
            if b not in self.truth and all(self.truth.get(p) is True for p in premises):
                self._learn(b, True)
                self.steps.append(("conj", c, list(premises), b))
        else:  # arith
            self._apply_arith(rule[1], fact)

    def _apply_arith(self, relation: str, x: str) -> None:
        """Compute ``y = op(x, arg)`` through a RELATION node unless ``y`` is known already."""
        y = self.rel_out[relation]
        if y in self.value:
            return
        op, arg = self.nodes[relation]["op"], int(self.nodes[relation]["arg"])
        if op not in ARITH_OPS:
            raise DagError(f"relation {relation}: unknown op {op!r}")
        self.value[y] = ARITH_OPS[op](self.value[x], arg)
        self.steps.append(("arith", op, x, arg, y, self.value[x], self.value[y]))
        self.queue.append(y)

    def solution(self) -> Solution:
        """The answer to the goal from what was derived."""
        target = self.target
        if self.nodes[target].get("kind") == "quantity":
            if target not in self.value:
                raise DagError(f"the value of {target} cannot be derived")
            return Solution(str(self.value[target]), "value", target, self.steps)
        t = self.truth.get(target)
        status = "proven" if t is True else "refuted" if t is False else "unknown"
        return Solution("yes" if t is True else "no", status, target, self.steps)
