"""The paper's group filter: pure functions against hand-made cases and independent references,
then through a build (in-process teacher, and one real local HTTP server for the command line)."""
from __future__ import annotations

import json
import random
import re
import threading
from collections import Counter
from http.server import BaseHTTPRequestHandler

import pytest

from iga_ds.cli import main
from iga_ds.data.dag import solve
from iga_ds.data.patterns import PATTERNS, arithmetic, conjunction, rule_chain, syllogism
from iga_ds.data.teacher.filters import (check_group, dependency_arcs, given_nodes, leads_to,
                                         step_count_outlier, structure_problems)
from iga_ds.data.teacher.parse import Instance, StepDependencies
from iga_ds.data.teacher.pipeline import BuildSettings, build
from iga_ds.errors import UserError
from teacher_server import DAG as SEED_DAG  # the seed DAG the scripted teachers return
from teacher_server import QuietServer

SAMPLERS = {"rule_chain": rule_chain, "conjunction": conjunction, "syllogism": syllogism,
            "arithmetic": arithmetic}
# a -> b -> c, the goal asks about c; d is a distractor that a implies too
DAG = {"nodes": [{"id": n, "type": "PROPOSITION"} for n in "abcd"] + [{"id": "g", "type": "GOAL"}],
       "edges": [{"from": "a", "to": "b", "label": "IMPLIES"}, {"from": "b", "to": "c", "label": "IMPLIES"},
                 {"from": "a", "to": "d", "label": "IMPLIES"}, {"from": "g", "to": "c", "label": "REQUIRES"}]}


def steps(*pairs) -> list[StepDependencies]:
    """``steps(("a", "b"), ("ab", "c"))``: each step's used nodes, then its derived nodes."""
    return [StepDependencies(tuple(uses), tuple(derives)) for uses, derives in pairs]


# ---------------------------------------------------------------- the dependency arcs


def test_each_label_gives_the_direction_of_dependency():
    labels = ("IMPLIES", "CAUSES", "IS_A", "HAS_PROPERTY", "REQUIRES", "CONTRADICTS")
    dag = {"nodes": [{"id": n, "type": "ENTITY"} for n in "abcdefghijkl"],
           "edges": [{"from": a, "to": b, "label": label} for a, b, label in zip("acegik", "bdfhjl", labels)]}
    arcs = {node: after for node, after in dependency_arcs(dag).items() if after}
    assert arcs == {"a": {"b"}, "c": {"d"}, "e": {"f"}, "g": {"h"}, "j": {"i"}, "k": {"l"}, "l": {"k"}}


def warshall(nodes: list[str], arcs: dict[str, set[str]]) -> dict[tuple[str, str], bool]:
    """Paths of one or more arcs, the textbook triple loop."""
    reach = {(u, v): v in arcs.get(u, ()) for u in nodes for v in nodes}
    for k in nodes:
        for u in nodes:
            for v in nodes:
                reach[u, v] = reach[u, v] or (reach[u, k] and reach[k, v])
    return reach


def test_leads_to_matches_the_transitive_closure_on_random_graphs():
    rng = random.Random(0)
    for _ in range(150):
        nodes = [f"n{i}" for i in range(rng.randint(1, 8))]
        arcs = {u: {v for v in nodes if rng.random() < 0.2} for u in nodes}
        reach = warshall(nodes, arcs)
        for u in nodes:
            for v in nodes:
                assert leads_to(arcs, u, v) == reach[u, v], (arcs, u, v)


# ---------------------------------------------------------------- one solution against the graph


def test_a_solution_following_the_graph_has_no_problem():
    assert structure_problems(steps(("", "a"), ("a", "b"), ("b", "c")), DAG) == []
    # the given premise may be used without being restated
    assert structure_problems(steps(("a", "b"), ("b", "c")), DAG) == []
    # deriving the GOAL node itself answers the goal too
    assert structure_problems(steps(("a", "b"), ("b", "c"), ("c", "g")), DAG) == []


@pytest.mark.parametrize("solution, problems", [
    # one step beside the graph's chain of three: the goal's node from nothing
    (steps(("", "c"),), ["step 1 derives 'c' from no node, but the problem does not give it (it depends on 'b')"]),
    # two steps that each derive b from nothing, and never reach the goal
    (steps(("", "b"), ("", "b")), [
        "step 1 derives 'b' from no node, but the problem does not give it (it depends on 'a')",
        "step 2 derives 'b' from no node, but the problem does not give it (it depends on 'a')",
        "no step derives the goal or a node it depends on (c, g)"]),
    # the goal from nothing, though the graph derives it from the given a
    (steps(("", "a"), ("", "g")), ["step 2 derives 'g' from no node, but the problem does not give it "
                                   "(it depends on 'c')"]),
    # assuming a node of the chain instead of deriving it
    (steps(("c", "g"),), ["step 1 uses 'c', which no step derives and the problem does not give"]),
    # a summary that skips a node of the chain
    (steps(("a", "c"),), ["step 1 goes from 'a' to 'c' through 'b', which no earlier step derives"]),
])
def test_a_shortcut_beside_the_chain_is_refused(solution, problems):
    assert structure_problems(solution, DAG) == problems


def test_a_shortcut_is_refused_where_the_last_node_of_the_chain_is_the_goal():
    # a -> b -> c with c the GOAL node itself: b, which c depends on directly, answers the goal
    dag = {"nodes": [{"id": "a", "type": "PROPOSITION"}, {"id": "b", "type": "PROPOSITION"},
                     {"id": "c", "type": "GOAL"}],
           "edges": [{"from": "a", "to": "b", "label": "IMPLIES"}, {"from": "b", "to": "c", "label": "IMPLIES"}]}
    assert structure_problems(steps(("", "a"), ("a", "b"), ("b", "c")), dag) == []
    assert structure_problems(steps(("a", "b"),), dag) == []
    assert structure_problems(steps(("", "c"),), dag) == [
        "step 1 derives 'c' from no node, but the problem does not give it (it depends on 'b')"]
    assert structure_problems(steps(("", "b"), ("", "b")), dag) == [
        f"step {n} derives 'b' from no node, but the problem does not give it (it depends on 'a')" for n in (1, 2)]


def test_a_step_passes_through_a_rule_or_an_operation_but_not_a_fact():
    # "x and y imply z" (a CONSTRAINT node k), then z implies w; the problem gives x and y
    dag = {"nodes": [{"id": n, "type": "PROPOSITION"} for n in "xyzw"] + [{"id": "k", "type": "CONSTRAINT"},
                                                                          {"id": "g", "type": "GOAL"}],
           "edges": [{"from": "k", "to": "x", "label": "REQUIRES"}, {"from": "k", "to": "y", "label": "REQUIRES"},
                     {"from": "k", "to": "z", "label": "IMPLIES"}, {"from": "z", "to": "w", "label": "IMPLIES"},
                     {"from": "g", "to": "w", "label": "REQUIRES"}]}
    assert structure_problems(steps(("xy", "z"), ("z", "w")), dag) == []
    assert structure_problems(steps(("xy", "w"),), dag) == [
        "step 1 goes from 'x' to 'w' through 'z', which no earlier step derives",
        "step 1 goes from 'y' to 'w' through 'z', which no earlier step derives"]


def test_the_givens_of_a_marked_subject_are_its_facts_and_the_valued_quantities():
    dag = {"nodes": [{"id": "s", "type": "ENTITY", "role": "subject"}, {"id": "q", "type": "ENTITY", "value": 3},
                     *({"id": n, "type": "PROPOSITION"} for n in "pdu")],
           "edges": [{"from": "s", "to": "p", "label": "HAS_PROPERTY"}, {"from": "d", "to": "u", "label": "IMPLIES"}]}
    assert given_nodes(dag) == {"s", "q", "p"}  # d enters by no arc, but the subject does not have it
    unmarked = {**dag, "nodes": [dict(n, role="") for n in dag["nodes"]]}
    assert given_nodes(unmarked) == {"s", "q", "p", "d"}  # roots, and the properties of a root entity


def test_the_goal_from_nothing_is_a_closed_world_no_only_where_the_givens_cannot_reach_it():
    # the subject has p; the goal asks about u, which only the never-given d implies
    dag = {"nodes": [{"id": "s", "type": "ENTITY", "role": "subject"}, {"id": "g", "type": "GOAL"},
                     *({"id": n, "type": "PROPOSITION"} for n in "pqdu")],
           "edges": [{"from": "s", "to": "p", "label": "HAS_PROPERTY"}, {"from": "p", "to": "q", "label": "IMPLIES"},
                     {"from": "d", "to": "u", "label": "IMPLIES"}, {"from": "g", "to": "u", "label": "REQUIRES"}]}
    assert structure_problems(steps(("p", "q"), ("", "g")), dag) == []
    reached = {**dag, "edges": dag["edges"] + [{"from": "q", "to": "u", "label": "IMPLIES"}]}
    assert structure_problems(steps(("p", "q"), ("", "g")), reached) == [
        "step 2 derives 'g' from no node, but the problem does not give it (it depends on 'u')"]


@pytest.mark.parametrize("solution, problem", [
    (steps(("a", "b"), ("b", "z")), "step 2 names 'z', which is not a node of the graph"),
    (steps(("b", "c"), ("a", "b")), "step 1 uses 'b', which step 2 derives"),
    (steps(("c", "c"),), "step 1 uses 'c', which step 1 derives"),
    (steps(("a", "b"), ("c", "b")), "step 2: 'c' does not lead to 'b' in the graph"),
    (steps(("a", "d"),), "no step derives the goal or a node it depends on (c, g)"),
    (steps(("a", "b"), ("d", "c")), "step 2: 'd' does not lead to 'c' in the graph"),
])
def test_a_solution_off_the_graph_is_named(solution, problem):
    assert problem in structure_problems(solution, DAG)


def test_without_a_goal_node_the_goal_rule_does_not_apply():
    dag = {"nodes": [{"id": "a", "type": "PROPOSITION"}, {"id": "b", "type": "PROPOSITION"}],
           "edges": [{"from": "a", "to": "b", "label": "IMPLIES"}]}
    assert structure_problems(steps(("a", "b"),), dag) == []
    assert structure_problems(steps(("b", "a"),), dag) == [
        "step 1 uses 'b', which no step derives and the problem does not give",
        "step 1: 'b' does not lead to 'a' in the graph"]


def test_integer_node_ids_compare_as_text():
    dag = {"nodes": [{"id": 1, "type": "PROPOSITION"}, {"id": 2, "type": "GOAL"}],
           "edges": [{"from": 2, "to": 1, "label": "REQUIRES"}]}
    assert structure_problems(steps(("", "1"),), dag) == []


def solver_solution(dag: dict) -> list[StepDependencies]:
    """The forward-chaining trace of a generated DAG as annotated steps, and a closing step."""
    sol = solve(dag)
    out = []
    for step in sol.steps:
        if step[0] == "conj":
            out.append(StepDependencies(tuple(step[2]), (step[3],)))
        elif step[0] == "arith":
            out.append(StepDependencies((step[2],), (step[4],)))
        else:  # implies, isa, disjoint
            out.append(StepDependencies((step[1],), (step[2],)))
    if sol.status != "value":  # yes/no: a closing step answers the goal from the target, if decided
        decided = (sol.target,) if sol.status in ("proven", "refuted") else ()
        out.append(StepDependencies(decided, ("goal",)))
    return out


def generated_dags(count: int):
    rng = random.Random(1)
    for i in range(count):
        pattern = PATTERNS[i % len(PATTERNS)]
        yield SAMPLERS[pattern](rng, rng.randint(1, 4), rng.random() < 0.5)


def test_every_forward_chaining_solution_of_a_generated_dag_passes():
    statuses = Counter()
    for dag in generated_dags(200):
        assert structure_problems(solver_solution(dag), dag) == [], dag
        statuses[solve(dag).status] += 1
    # "unknown": a closed-world no, whose last step concludes the goal from nothing
    assert set(statuses) == {"proven", "refuted", "unknown", "value"}, statuses


def test_a_forward_chaining_solution_missing_a_step_of_its_chain_is_refused():
    removed = 0
    for dag in generated_dags(200):
        solution = solver_solution(dag)
        for i, step in enumerate(solution):
            if any(set(step.derives) & set(later.uses) for later in solution[i + 1:]):
                assert structure_problems(solution[:i] + solution[i + 1:], dag), (dag, i)
                removed += 1
    assert removed > 200


def test_a_reversed_step_is_refused_exactly_when_the_graph_has_no_path_back():
    reversed_seen = refused = 0
    for dag in generated_dags(200):
        solution = solver_solution(dag)
        arcs = dependency_arcs(dag)
        reach = warshall([str(n["id"]) for n in dag["nodes"]], arcs)
        for i, step in enumerate(solution):
            if len(step.uses) != 1 or len(step.derives) != 1:
                continue
            (used,), (derived,) = step.uses, step.derives
            flipped = solution[:i] + [StepDependencies((derived,), (used,))] + solution[i + 1:]
            said = f"step {i + 1}: {derived!r} does not lead to {used!r} in the graph"
            assert (said in structure_problems(flipped, dag)) == (not reach[derived, used])
            reversed_seen += 1
            refused += not reach[derived, used]
    assert reversed_seen > 300 and 0 < refused < reversed_seen  # both outcomes were exercised


# ---------------------------------------------------------------- the group


def inst(n_steps: int, answer: str = "yes", deps: list[StepDependencies] | None = None,
         annotated: bool = True) -> Instance:
    if deps is None and annotated:
        deps = steps(("", "a"), ("a", "b"), ("b", "c")) + steps(*[("a", "b")] * (n_steps - 3))
    return Instance("p", [f"s{i}" for i in range(n_steps)], answer, None, deps)


DOMAINS = ("math", "medical", "legal", "science")


def group(**overrides) -> dict[str, Instance]:
    return {d: overrides.get(d, inst(3)) for d in DOMAINS}


def test_step_count_outlier_is_furthest_from_the_median():
    assert step_count_outlier({"math": 3, "medical": 3, "legal": 7, "science": 4}) == "legal"
    assert step_count_outlier({"math": 1, "medical": 5, "legal": 5, "science": 5}) == "math"
    assert step_count_outlier({"math": 2, "medical": 4, "legal": 4, "science": 2}) == "math"  # tie: first


def test_a_spread_of_two_passes_and_of_three_fails():
    assert check_group(group(legal=inst(5)), DAG, 2) is None
    failure = check_group(group(legal=inst(6)), DAG, 2)
    assert (failure.reason, failure.domain) == ("step_count_spread", "legal")
    assert check_group(group(legal=inst(6)), DAG, 3) is None


def test_structure_failures_name_the_domain_and_the_first_problem():
    off_graph = inst(3, deps=steps(("", "a"), ("a", "z"), ("d", "c")))
    failure = check_group(group(medical=off_graph), DAG, 2)
    assert failure.domain == "medical"
    # the other two: step 3 assumes d, which the graph derives from a, and d does not lead to c
    assert failure.reason == ("structure_mismatch (medical: step 2 names 'z', which is not a node "
                              "of the graph; 2 more)")
    failure = check_group(group(science=inst(3, annotated=False)), DAG, 2)
    assert failure.domain == "science" and failure.reason.startswith("structure_unannotated (science")


def test_answer_types_must_agree_and_the_minority_is_the_outlier():
    failure = check_group(group(legal=inst(3, answer="14")), DAG, 2)
    assert (failure.reason, failure.domain) == ("answer_type_mismatch", "legal")


def test_the_paper_rules_come_before_the_answer_type():
    both = group(legal=inst(7, answer="14"))
    assert check_group(both, DAG, 2).reason == "step_count_spread"


# ---------------------------------------------------------------- through a build

GOOD_STEPS = [{"text": "a holds", "uses": [], "derives": "a"},
              {"text": "so b holds", "uses": ["a"], "derives": "b"}]


class Teacher:
    """Answers the three prompts as a teacher would; directives in the seed steer it:
    ``[long]`` the legal CoT always has 6 steps, ``[long-once]`` only the first time,
    ``[offgraph]`` the medical CoT names a node the DAG lacks, ``[plain]`` steps are bare strings."""

    def __init__(self):
        self.lock = threading.Lock()
        self.requests: list[str] = []
        self.asked: dict[tuple[str, str], int] = {}

    def chat(self, messages: list[dict], json_reply: bool = False) -> str:
        system, user = messages[0]["content"], messages[-1]["content"]
        directives = set(re.findall(r"\[([a-z-]+)\]", user))
        if "extracting logical structure" in system:
            kind, reply = "dag", "```json\n" + json.dumps(dict(SEED_DAG, logical_form=" ".join(
                f"[{d}]" for d in sorted(directives)))) + "\n```"
        elif "creating domain-specific" in system:
            domain = re.search(r"Target domain: (\w+)", user).group(1)
            kind, reply = "instance", self.instance(domain, directives)
        else:  # the paper's own verification format: four numbered answers, then the verdict
            kind, reply = "verification", "1. yes\n2. yes\n3. yes\n4. 0.92\nPASS"
        with self.lock:
            self.requests.append(kind)
        return reply

    def instance(self, domain: str, directives: set[str]) -> str:
        with self.lock:
            self.asked[domain, " ".join(sorted(directives))] = n = self.asked.get(
                (domain, " ".join(sorted(directives))), 0) + 1
        cot = list(GOOD_STEPS)
        if domain == "legal" and ("long" in directives or ("long-once" in directives and n == 1)):
            cot += [{"text": f"restating {i}", "uses": ["a"], "derives": "b"} for i in range(4)]
        if domain == "medical" and "offgraph" in directives:
            cot[1] = dict(cot[1], uses=["x"])
        if "plain" in directives:
            cot = [step["text"] for step in cot]
        return "Here it is:\n" + json.dumps({"problem": f"A {domain} problem.", "cot_solution": cot,
                                             "answer": "yes", "alignment_score": 0.9})


def run(tmp_path, problems: list[str], teacher: Teacher | None = None, **settings) -> tuple[dict, dict]:
    seeds = tmp_path / "seeds.jsonl"
    seeds.write_text("".join(json.dumps({"seed_id": f"s{i}", "problem": p}) + "\n"
                             for i, p in enumerate(problems)))
    stats = build(seeds, tmp_path / "out", teacher or Teacher(), BuildSettings(model="m", **settings),
                  concurrency=2, progress=False)
    dropped = {}
    if (tmp_path / "out" / "dropped.jsonl").exists():
        for line in (tmp_path / "out" / "dropped.jsonl").read_text().splitlines():
            dropped[json.loads(line)["seed_id"]] = json.loads(line)["reason"]
    return stats, dropped


def test_the_paper_filter_discards_without_regenerating(tmp_path):
    teacher = Teacher()
    stats, dropped = run(tmp_path, ["[long-once] p", "[offgraph] p", "[plain] p", "fine"], teacher)
    assert dropped == {"s0": "step_count_spread",
                       "s1": "structure_mismatch (medical: step 2 names 'x', which is not a node of the graph)",
                       "s2": "structure_unannotated (math: the steps name no uses/derives nodes)"}
    assert stats["kept_groups"] == 1 and stats["this_run"].get("regenerations", 0) == 0
    # one DAG and four instances, each verified, per seed: nothing was asked twice
    assert teacher.requests.count("instance") == 16 and teacher.requests.count("dag") == 4
    kept = [json.loads(x) for x in (tmp_path / "out" / "isomers.jsonl").read_text().splitlines()]
    assert {r["alignment_score"] for r in kept} == {0.92}  # read from "4. 0.92"
    assert {r["meta"]["verdict"] for r in kept} == {"PASS"}


def test_regenerating_outliers_is_an_option(tmp_path):
    teacher = Teacher()
    _, dropped = run(tmp_path, ["[long-once] p", "[long] p"], teacher, outliers="regenerate",
                     max_regenerations=2)
    assert dropped == {"s1": "step_count_spread"}
    kept = [json.loads(x) for x in (tmp_path / "out" / "isomers.jsonl").read_text().splitlines()]
    legal = next(r for r in kept if r["domain"] == "legal")
    assert legal["meta"]["regenerations"] == 1 and legal["meta"]["step_count"] == 2
    assert teacher.asked["legal", "long"] == 3  # the first reply and two regenerations
    assert json.loads((tmp_path / "out" / "build.json").read_text())["outliers"] == "regenerate"


def test_resuming_with_the_other_policy_is_refused(tmp_path):
    run(tmp_path, ["fine"])
    with pytest.raises(UserError, match="outliers"):
        run(tmp_path, ["fine"], outliers="regenerate")


class Handler(BaseHTTPRequestHandler):
    def log_message(self, *args):
        pass

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        content = self.server.teacher.chat(body["messages"])
        data = json.dumps({"choices": [{"index": 0, "finish_reason": "stop",
                                        "message": {"role": "assistant", "content": content}}]}).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)


def test_command_line_option_over_http(tmp_path, capsys):
    httpd = QuietServer(("127.0.0.1", 0), Handler)
    httpd.teacher = Teacher()
    threading.Thread(target=httpd.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start()
    try:
        seeds = tmp_path / "seeds.jsonl"
        seeds.write_text('{"seed_id": "a", "problem": "[long-once] p"}\n{"seed_id": "b", "problem": "q"}\n')
        url = f"http://127.0.0.1:{httpd.server_address[1]}/v1"
        args = ["data", "build", "--seeds", str(seeds), "--base-url", url, "--model", "m", "--no-progress",
                "--out"]
        assert main(args + [str(tmp_path / "paper")]) == 0
        assert "kept 1 groups, dropped 1" in capsys.readouterr().out
        httpd.teacher = Teacher()  # asked afresh: its first legal reply is long again
        assert main(args + [str(tmp_path / "regen"), "--outliers", "regenerate"]) == 0
        assert "kept 2 groups, dropped 0" in capsys.readouterr().out
        assert json.loads((tmp_path / "paper" / "build.json").read_text())["outliers"] == "discard"
    finally:
        httpd.shutdown()
        httpd.server_close()
