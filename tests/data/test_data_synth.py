"""Procedural generator: determinism, exact isomorphism, planted shortcut rates, speed bounds.

Isomorphism is checked from the rendered text, not from the generator's own data: each
problem is parsed back with the domain's sentence frames into facts and rules, solved by a
naive fixpoint loop written here, and compared with the record's answer; the parsed
structures of a group, with words replaced by first-appearance indices, must be identical.
"""
from __future__ import annotations

import json
import math
import re
from collections import defaultdict

import pytest

from iga_ds.cli import main
from iga_ds.data.dag import solve
from iga_ds.data.domains import DOMAINS
from iga_ds.data.patterns import MAX_VALUE, PATTERNS
from iga_ds.data.schema import read_isomer_jsonl
from iga_ds.data.synth import generate_groups, synthesize
from iga_ds.errors import UserError

WORD = r"[a-z]+"
NAME = r"[a-z]+(?: [a-z])?"
NUM = r"\d+"
SLOT_RE = {"a": WORD, "b": WORD, "c": WORD, "q": WORD, "A": WORD, "B": WORD,
           "x": NAME, "y": NAME, "v": NUM, "k": NUM}


def frame_regex(frame: str, fixed: dict[str, str]) -> re.Pattern:
    """'{s} is {a}' -> regex with named groups; fixed slots (subject, individual) are literal."""
    out, pos = [], 0
    for m in re.finditer(r"\{(\w+)\}", frame):
        out.append(re.escape(frame[pos:m.start()]))
        name = m.group(1)
        out.append(re.escape(fixed[name]) if name in fixed else f"(?P<{name}>{SLOT_RE[name]})")
        pos = m.end()
    out.append(re.escape(frame[pos:]))
    return re.compile("^" + "".join(out) + "$")


def parse_problem(domain_name: str, problem: str):
    """(structure as tuples of words/numbers, question) from the rendered problem text."""
    d = DOMAINS[domain_name]
    fixed = {"s": d.subject, "z": d.individual}
    frames = [("conj", d.conj_rule), ("rule", d.rule), ("isa", d.isa_rule), ("disjoint", d.disjoint_rule),
              ("member", d.member_fact), ("fact", d.fact), ("add", d.add), ("sub", d.sub),
              ("mul", d.mul), ("given", d.given)]
    frames = [(k, frame_regex(f, fixed)) for k, f in frames]
    body, question = problem.rsplit(" . ", 1)
    sentences = body.split(" . ")
    cue = None
    cue_re = re.compile("^" + re.escape(d.cue[:-2]).replace(re.escape("{c}"), r"(?P<c>\S+)") + "$")
    m = cue_re.match(sentences[0])
    if m:
        cue = m.group("c")
        sentences = sentences[1:]
    statements = []
    for sent in sentences:
        for kind, rx in frames:
            m = rx.match(sent)
            if m:
                statements.append((kind, m.groupdict()))
                break
        else:
            raise AssertionError(f"{domain_name}: unparsed sentence {sent!r}")
    q = None
    for kind, frame in (("num", d.num_question), ("class", d.class_question), ("prop", d.prop_question)):
        m = frame_regex(frame, fixed).match(question)
        if m:
            q = (kind, m.groupdict())
            break
    assert q is not None, question
    return statements, q, cue


def reference_answer(statements, question) -> str:
    """Naive fixpoint over parsed sentences; closed world for yes/no questions."""
    true, false, values = set(), set(), {}
    for kind, g in statements:
        if kind in ("fact",):
            true.add(g["a"])
        elif kind == "member":
            true.add(g["A"])
        elif kind == "given":
            values[g["x"]] = int(g["v"])
    changed = True
    while changed:
        changed = False
        for kind, g in statements:
            new_true = None
            if kind == "rule" and g["a"] in true:
                new_true = g["b"]
            elif kind == "conj" and g["a"] in true and g["b"] in true:
                new_true = g["c"]
            elif kind == "isa" and g["A"] in true:
                new_true = g["B"]
            elif kind == "disjoint":
                for x, y in ((g["A"], g["B"]), (g["B"], g["A"])):
                    if x in true and y not in false:
                        false.add(y)
                        changed = True
            elif kind in ("add", "sub", "mul") and g["x"] in values and g["y"] not in values:
                v, k = values[g["x"]], int(g["k"])
                values[g["y"]] = {"add": v + k, "sub": v - k, "mul": v * k}[kind]
                changed = True
            if new_true is not None and new_true not in true:
                true.add(new_true)
                changed = True
    kind, g = question
    if kind == "num":
        return str(values[g["y"]])
    target = g["B"] if kind == "class" else g["q"]
    assert not (target in true and target in false), "inconsistent premises"
    return "yes" if target in true else "no"


def canonical(statements, question):
    """Replace every word/number slot by its first-appearance index (numbers kept)."""
    index: dict[str, int] = {}

    def c(value: str):
        if value.isdigit():
            return value
        return index.setdefault(value, len(index))

    out = [(kind, tuple(sorted((k, c(v)) for k, v in g.items()))) for kind, g in statements]
    qkind, g = question
    return out, (qkind, tuple(sorted((k, c(v)) for k, v in g.items())))


@pytest.fixture(scope="module")
def records():
    return generate_groups(400, seed=11, shortcut=0.7)


def by_group(records):
    groups = defaultdict(list)
    for r in records:
        groups[r["group_id"]].append(r)
    return groups


def test_every_instance_solves_to_its_answer_from_its_own_text(records):
    for r in records:
        statements, question, _ = parse_problem(r["domain"], r["problem"])
        assert reference_answer(statements, question) == r["answer"], r["problem"]


def test_instances_of_a_group_are_isomorphic(records):
    for gid, group in by_group(records).items():
        assert [r["domain"] for r in group] == list(DOMAINS)
        shapes = {json.dumps(canonical(*parse_problem(r["domain"], r["problem"])[:2])) for r in group}
        assert len(shapes) == 1, gid
        assert len({r["answer"] for r in group}) == 1
        assert len({json.dumps(r["dag"], sort_keys=True) for r in group}) == 1
        assert len({r["cot"].count("\n") for r in group}) == 1


def test_dag_solver_matches_record_and_cot(records):
    for r in records:
        sol = solve(r["dag"])
        assert sol.answer == r["answer"]
        lines = r["cot"].split("\n")
        assert lines[-1] == f"Answer: {r['answer']}"
        assert len(lines) - 1 == r["dag"]["step_count"]


def test_patterns_depths_answers_cover_the_design(records):
    metas = [r["meta"] for r in records if r["domain"] == "math"]
    assert {m["pattern"] for m in metas} == set(PATTERNS)
    assert {m["depth"] for m in metas} == {1, 2, 3, 4}
    booleans = [r["answer"] for r in records if r["meta"]["pattern"] != "arithmetic"]
    assert 0.35 < booleans.count("yes") / len(booleans) < 0.65
    ints = [int(r["answer"]) for r in records if r["meta"]["pattern"] == "arithmetic"]
    assert min(ints) >= 0 and max(ints) <= MAX_VALUE


def test_small_vocabulary_and_short_problems(records):
    vocab = {w for r in records for w in (r["problem"] + " " + r["cot"]).split()}
    assert len(vocab) < 400
    lengths = [len(r["problem"].split()) for r in records]
    assert sum(lengths) / len(lengths) < 60 and max(lengths) < 90
    cot_lines = [line for r in records for line in r["cot"].split("\n")[:-1]]
    assert max(len(line.split()) for line in cot_lines) <= 13


def test_cue_in_text_is_what_meta_says(records):
    for r in records:
        _, _, cue = parse_problem(r["domain"], r["problem"])
        d = DOMAINS[r["domain"]]
        signalled = {w: a for a, w in d.cue_words.items()}.get(cue, cue)
        assert signalled == r["meta"]["cue_answer"]
        assert (signalled == r["answer"]) == r["meta"]["cue_agrees"]


def test_cues_differ_per_domain():
    cues = [d.cue for d in DOMAINS.values()]
    words = [w for d in DOMAINS.values() for w in d.cue_words.values()]
    assert len(set(cues)) == len(cues) and len(set(words)) == len(words)


def _agreement(records, split, boolean):
    xs = [r["meta"]["cue_agrees"] for r in records
          if r["meta"]["split"] == split and (r["meta"]["pattern"] != "arithmetic") == boolean]
    return sum(xs) / len(xs), len(xs)


@pytest.mark.parametrize("strength", [0.9, 0.6])
def test_shortcut_rate_train_matches_strength_test_is_chance(strength):
    recs = generate_groups(1500, seed=5, shortcut=strength)
    for boolean, chance in ((True, 0.5), (False, 1 / (MAX_VALUE + 1))):
        rate, n = _agreement(recs, "train", boolean)
        assert abs(rate - strength) < 4 * math.sqrt(strength * (1 - strength) / n)
        rate, n = _agreement(recs, "test", boolean)
        assert abs(rate - chance) < 4 * math.sqrt(chance * (1 - chance) / n) + 1e-9


def test_no_shortcut_plants_no_cue():
    for r in generate_groups(50, seed=2):
        assert r["meta"]["cue"] is None and r["meta"]["cue_agrees"] is None
        assert parse_problem(r["domain"], r["problem"])[2] is None


def test_neutral_cue_is_present_everywhere_and_independent_of_the_answer():
    recs = generate_groups(1500, seed=5, neutral_cue=True)
    for r in recs[:200]:
        _, _, cue = parse_problem(r["domain"], r["problem"])
        assert cue is not None and r["meta"]["cue"] is not None
    for split in ("train", "test"):
        for boolean, chance in ((True, 0.5), (False, 1 / (MAX_VALUE + 1))):
            rate, n = _agreement(recs, split, boolean)
            assert abs(rate - chance) < 4 * math.sqrt(chance * (1 - chance) / n) + 1e-9


def test_answer_only_changes_nothing_but_the_cot():
    full = generate_groups(40, seed=3, shortcut=0.9)
    bare = generate_groups(40, seed=3, shortcut=0.9, answer_only=True)
    assert all(r["cot"] == "" for r in bare)
    assert [{**r, "cot": ""} for r in full] == bare


def test_neutral_cue_with_a_shortcut_is_refused(tmp_path):
    with pytest.raises(UserError, match="--neutral-cue"):
        synthesize(tmp_path, 10, seed=0, shortcut=0.5, neutral_cue=True)


def test_synthesize_is_byte_identical_and_manifest_matches(tmp_path):
    import hashlib

    m1 = synthesize(tmp_path / "a", 120, seed=4, shortcut=0.5)
    m2 = synthesize(tmp_path / "b", 120, seed=4, shortcut=0.5)
    for name in ("train.jsonl", "test.jsonl", "manifest.json"):
        assert (tmp_path / "a" / name).read_bytes() == (tmp_path / "b" / name).read_bytes()
    for name, info in m1["files"].items():
        data = (tmp_path / "a" / name).read_bytes()
        assert hashlib.sha256(data).hexdigest() == info["sha256"]
        assert data.count(b"\n") == info["records"]
    assert m1 == m2
    m3 = synthesize(tmp_path / "c", 120, seed=5, shortcut=0.5)
    assert m3["files"]["train.jsonl"]["sha256"] != m1["files"]["train.jsonl"]["sha256"]


def test_seed_level_split_80_20_without_leak(tmp_path):
    m = synthesize(tmp_path, 250, seed=1, domains=("math", "legal"))
    assert m["splits"]["test"]["groups"] == 50 and m["splits"]["train"]["groups"] == 200
    train = read_isomer_jsonl(tmp_path / "train.jsonl")
    test = read_isomer_jsonl(tmp_path / "test.jsonl")
    assert not {r["seed_id"] for r in train} & {r["seed_id"] for r in test}
    assert {r["domain"] for r in train} == {"math", "legal"}
    assert sum(m["splits"]["train"]["patterns"].values()) == 200


def test_group_content_does_not_depend_on_the_number_of_groups():
    # group i is a function of (seed, i, split): a larger run starts with the same DAGs
    small = by_group(generate_groups(20, seed=9, test_frac=0.0))
    large = by_group(generate_groups(40, seed=9, test_frac=0.0))
    for gid, group in small.items():
        assert group == large[gid]


@pytest.mark.parametrize("kwargs, words", [
    ({"groups": 0}, "--groups"),
    ({"shortcut": 1.5}, "--shortcut"),
    ({"domains": ("math", "cooking")}, "unknown domain 'cooking'"),
    ({"patterns": ("riddle",)}, "unknown pattern"),
    ({"max_depth": 7}, "--max-depth"),
])
def test_bad_arguments_are_user_errors(tmp_path, kwargs, words):
    args = {"groups": 10, "seed": 0} | kwargs
    with pytest.raises(UserError, match=re.escape(words)):
        synthesize(tmp_path, **args)


def test_cli_synth_then_validate(tmp_path, capsys):
    out = tmp_path / "d"
    assert main(["data", "synth", "--out", str(out), "--groups", "60", "--seed", "3",
                 "--shortcut", "0.8", "--domains", "math,science", "--no-progress"]) == 0
    assert main(["data", "validate", str(out / "train.jsonl"), str(out / "test.jsonl")]) == 0
    text = capsys.readouterr().out
    assert "48 groups, 96 instances" in text and "no seed or group shared" in text
    assert main(["data", "synth", "--out", str(out), "--groups", "5", "--domains", "math,,x"]) == 2
