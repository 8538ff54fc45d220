"""Teacher replies as LLMs write them: a corpus of verification, DAG and instance replies.

Each file under tests/fixtures/teacher_replies/ is one reply; expected.json states, written by
hand from reading the reply, what it must parse to, or a fragment of the error it must raise.
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from iga_ds.data.teacher.parse import (MalformedOutput, json_objects, parse_dag, parse_instance,
                                       parse_verification, split_steps)

CORPUS = Path(__file__).resolve().parents[1] / "fixtures" / "teacher_replies"
EXPECTED = json.loads((CORPUS / "expected.json").read_text(encoding="utf-8"))


def cases(kind: str) -> list[str]:
    return sorted(name for name in EXPECTED if name.startswith(kind + "/"))


def test_corpus_is_complete():
    on_disk = {p.relative_to(CORPUS).as_posix() for p in CORPUS.rglob("*.txt")}
    assert on_disk == set(EXPECTED)
    assert len(on_disk) >= 30
    for kind in ("verification", "dag", "instance"):
        parsed = [n for n in cases(kind) if "error" not in EXPECTED[n]]
        refused = [n for n in cases(kind) if "error" in EXPECTED[n]]
        assert len(parsed) >= 5 and len(refused) >= 3, kind


def reply(name: str) -> str:
    return (CORPUS / name).read_text(encoding="utf-8")


def check_refused(parse, name: str) -> bool:
    """Whether ``name`` is expected to fail; if so, that it fails with the stated message."""
    fragment = EXPECTED[name].get("error")
    if fragment is None:
        return False
    with pytest.raises(MalformedOutput) as err:
        parse(reply(name))
    assert fragment in str(err.value)
    return True


@pytest.mark.parametrize("name", cases("verification"))
def test_verification_replies(name):
    if check_refused(parse_verification, name):
        return
    v = parse_verification(reply(name))
    assert v.score == pytest.approx(EXPECTED[name]["score"], abs=1e-12)
    assert v.verdict == EXPECTED[name]["verdict"]


@pytest.mark.parametrize("name", cases("dag"))
def test_dag_replies(name):
    if check_refused(parse_dag, name):
        return
    dag, want = parse_dag(reply(name)), EXPECTED[name]
    assert [[n["id"], n["type"]] for n in dag["nodes"]] == want["nodes"]
    assert [[e["from"], e["to"], e["label"]] for e in dag["edges"]] == want["edges"]
    assert dag["step_count"] == want["step_count"]


@pytest.mark.parametrize("name", cases("instance"))
def test_instance_replies(name):
    if check_refused(parse_instance, name):
        return
    inst, want = parse_instance(reply(name)), EXPECTED[name]
    assert (inst.problem, inst.steps, inst.answer) == (want["problem"], want["steps"], want["answer"])
    assert inst.self_score == want["self_score"]
    deps = None if inst.dependencies is None else [
        {"uses": list(d.uses), "derives": list(d.derives)} for d in inst.dependencies]
    assert deps == want["dependencies"]
    assert inst.cot_text().endswith("\nAnswer: " + want["answer"])


def test_the_issue_reply_in_the_papers_own_format_is_read():
    # the paper's appendix asks for four numbered answers, the fourth the score, then PASS or FAIL
    assert parse_verification("1. yes\n2. yes\n3. yes\n4. 0.92\nPASS").score == 0.92


@pytest.mark.parametrize("text", ["", "   \n", "<think>Score: 0.9, PASS</think>"])
def test_empty_replies_say_so(text):
    with pytest.raises(MalformedOutput, match="empty|no structural alignment score"):
        parse_verification(text)
    with pytest.raises(MalformedOutput, match="empty|no JSON object"):
        parse_instance(text)


@pytest.mark.parametrize("text, count", [
    ('{"a": 1,}', 1),                             # a trailing comma: one reading, repaired
    ('{"a": "x,}"}', 1),                          # ",}" inside a string is text, not a comma to drop
    ('{"a": "\\" {"}  {"b": [1, 2,],}', 2),       # an escaped quote and a brace inside a string
    ('{"a": 1', 0),                               # cut off
    ("{'a': 1}", 0),                              # single quotes: not JSON, not repaired
    ('{"a": 1} // a comment {"b": 2}', 2),
])
def test_json_objects_in_prose(text, count):
    assert len(json_objects(text)[0]) == count


def test_trailing_comma_repair_keeps_string_content():
    objects, _ = json_objects('note: {"text": "a, ]", "list": ["x", "y",],}')
    assert objects == [{"text": "a, ]", "list": ["x", "y"]}]


def test_cut_off_object_is_reported_where_it_starts():
    objects, cut_off = json_objects('ok {"a": 1} then {"b": [1, 2')
    assert objects == [{"a": 1}] and cut_off == 17


@pytest.mark.parametrize("cot, steps", [
    (["Step 1: a", "2) b", "- c", "Answer: d"], ["a", "b", "c"]),
    ("Step 1: a. Step 2: b. Final answer: c", ["a.", "b."]),
    ([{"step": 1, "text": "a", "uses": "x"}, "b"], ["a", "b"]),
])
def test_split_steps(cot, steps):
    assert split_steps(cot) == steps


def test_a_mixed_list_gives_every_step_its_dependencies():
    inst = parse_instance('{"problem": "p", "answer": "yes", "cot_solution": '
                          '["given a", {"text": "so b", "uses": ["a"], "derives": "b"}]}')
    assert [(d.uses, d.derives) for d in inst.dependencies] == [((), ()), (("a",), ("b",))]


def test_a_verdict_stated_both_ways_in_prose_is_left_unknown():
    # the score decides; a verdict the reply does not commit to is not guessed either
    v = parse_verification("Score: 0.9\nStep 2 alone would FAIL, but the whole does PASS.")
    assert (v.score, v.verdict) == (0.9, None)
