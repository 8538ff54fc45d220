"""The planted cue's two benchmark variants, the adversarial test cue and the counterfactual twins.

Negative control: ``shortcut=s``, the same agreement in every domain. Diverse environments:
``shortcut_by_domain``, one agreement per domain. Rates are checked on a fixed seed with a
6-sigma binomial bound, so the tests cannot flake. The hashes below are those of files the
generator wrote before the per-domain cue, the adversarial test cue and the counterfactual
twins existed: the same arguments must still give the same bytes.
"""
from __future__ import annotations

import hashlib
import json
import math
import re
from collections import defaultdict

import pytest

from iga_ds.cli import main
from iga_ds.data.domains import DOMAINS
from iga_ds.data.patterns import MAX_VALUE
from iga_ds.data.synth import generate_groups, parse_shortcut_by_domain, synthesize
from iga_ds.errors import UserError
from test_data_synth import canonical, parse_problem

DIVERSE = {"math": 1.0, "medical": 0.9, "legal": 0.7, "science": 0.3}
_encode = json.JSONEncoder(ensure_ascii=False, separators=(",", ":")).encode

# (arguments, sha256 of train.jsonl, of test.jsonl, of manifest.json or None where it now
# also reports the agreement by domain); test.jsonl hashed without meta.cue_counterfactual
EARLIER_FILES = {
    "default": ({"groups": 40, "seed": 0},
                "82297bd6b3936909b01a8adb0921df34fbf501341279cf8e06a93b684a1e9cdf",
                "9fa596ed71784c98be5de49361fd2c3526a60403cf18b73bcf36abdcd54161e2",
                "9448d31cf32eed70623fe832ceb71e29f8e0918b8a31d1608a93e3a33756aad3"),
    "two_domains": ({"groups": 30, "seed": 7, "domains": ("legal", "math")},
                    "8ffe5d05b5e7f2933b49dd3d77353f05627a58e255a474f3d3627e1b97326045",
                    "a039f0c5c6bafcee73274d2912465b65de6a191acfd1efef55af2e9fd64e8942",
                    "a177e3fe37e6df480a6e464b4e78bd8b9c32bb359d323fa18b00da918e7f800a"),
    "shortcut": ({"groups": 40, "seed": 1, "shortcut": 0.7},
                 "b80fbe675c4557ed28be7f625de40216eaab7d1f33bcd9e95ae18d51f35d35f6",
                 "4afe5614f5c86e5b2238dd7306c57afd000c3fa0b41c3b9cadaa09152fa2b4ac", None),
    "neutral": ({"groups": 30, "seed": 2, "neutral_cue": True},
                "65216c8b6c90452de06280bff451ef4674a3ddda104cca069fc4842550b1d003",
                "5651bc0c481d3ae5a44670b39b77fed7e1b6d365f1821e9b3549722b6902ee07", None),
    "answer_only": ({"groups": 30, "seed": 3, "shortcut": 0.9, "answer_only": True},
                    "8a1a2f314ef9a643be5f4e9b9355c73872d66eedffa2c9eb014171fdccbb2c6f",
                    "69a97b3940ac56ed8f88ae1aa70b3a663efc6fe11267501596e7c6a3cc958967", None),
}


def _sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _without_counterfactual(data: bytes) -> bytes:
    lines = []
    for line in data.decode("utf-8").splitlines():
        record = json.loads(line)
        record["meta"].pop("cue_counterfactual", None)
        lines.append(_encode(record) + "\n")
    return "".join(lines).encode("utf-8")


@pytest.mark.parametrize("name", list(EARLIER_FILES))
def test_earlier_arguments_write_the_same_files(tmp_path, name):
    kwargs, train, test, manifest = EARLIER_FILES[name]
    synthesize(tmp_path, **kwargs)
    assert _sha((tmp_path / "train.jsonl").read_bytes()) == train
    assert _sha(_without_counterfactual((tmp_path / "test.jsonl").read_bytes())) == test
    if manifest is not None:
        assert _sha((tmp_path / "manifest.json").read_bytes()) == manifest
    if not kwargs.get("shortcut"):  # no planted shortcut: no twin, the test file as it was
        assert _sha((tmp_path / "test.jsonl").read_bytes()) == test


def _rates(records, split):
    """domain -> (agreement, instances), over the instances of ``split``."""
    agrees, counts = defaultdict(int), defaultdict(int)
    for r in records:
        if r["meta"]["split"] == split:
            agrees[r["domain"]] += r["meta"]["cue_agrees"]
            counts[r["domain"]] += 1
    return {d: (agrees[d] / counts[d], counts[d]) for d in counts}


def _within(rate: float, p: float, n: int) -> bool:
    return abs(rate - p) <= 6 * math.sqrt(p * (1 - p) / n) + 1e-12


@pytest.fixture(scope="module")
def diverse():
    return generate_groups(3000, seed=21, shortcut_by_domain=DIVERSE)


def test_training_agreement_follows_each_domains_probability(diverse):
    rates = _rates(diverse, "train")
    assert set(rates) == set(DIVERSE)
    for domain, (rate, n) in rates.items():
        assert n == 2400
        assert _within(rate, DIVERSE[domain], n), (domain, rate)
    assert rates["math"][0] == 1.0


def test_training_agreement_of_each_answer_type_follows_the_domain(diverse):
    # below chance is below chance for yes/no answers too: 0.3 < 1/2
    for boolean in (True, False):
        part = [r for r in diverse if (r["meta"]["pattern"] != "arithmetic") == boolean]
        for domain, (rate, n) in _rates(part, "train").items():
            assert _within(rate, DIVERSE[domain], n), (domain, boolean, rate)


def test_independent_test_cue_is_at_chance_in_every_domain(diverse):
    for boolean, chance in ((True, 0.5), (False, 1 / (MAX_VALUE + 1))):
        part = [r for r in diverse if (r["meta"]["pattern"] != "arithmetic") == boolean]
        for domain, (rate, n) in _rates(part, "test").items():
            assert _within(rate, chance, n), (domain, boolean, rate)


def test_a_domain_at_zero_always_signals_a_wrong_answer():
    recs = generate_groups(200, seed=4, shortcut_by_domain={"math": 0.0, "legal": 1.0}, domains=("math", "legal"))
    rates = _rates(recs, "train")
    assert rates["math"][0] == 0.0 and rates["legal"][0] == 1.0


def test_adversarial_test_cue_never_agrees_and_leaves_train_alone():
    fair = generate_groups(600, seed=8, shortcut_by_domain=DIVERSE)
    hostile = generate_groups(600, seed=8, shortcut_by_domain=DIVERSE, test_cue="adversarial")
    assert [r for r in hostile if r["meta"]["split"] == "train"] == [r for r in fair if r["meta"]["split"] == "train"]
    test = [r for r in hostile if r["meta"]["split"] == "test"]
    assert len(test) == 480
    for r in test:
        assert r["meta"]["cue_agrees"] is False and r["meta"]["cue_answer"] != r["answer"]
        assert _signalled(r["domain"], r["problem"]) == r["meta"]["cue_answer"]
    uniform = generate_groups(300, seed=8, shortcut=0.8, test_cue="adversarial")
    assert not any(r["meta"]["cue_agrees"] for r in uniform if r["meta"]["split"] == "test")


def _signalled(domain: str, problem: str) -> str:
    """The answer the cue word of ``problem`` signals."""
    word = parse_problem(domain, problem)[2]
    assert word is not None, problem
    return {w: a for a, w in DOMAINS[domain].cue_words.items()}.get(word, word)


def _first_sentence_split(problem: str) -> tuple[str, str]:
    cue, rest = problem.split(" . ", 1)
    return cue, rest


@pytest.mark.parametrize("kwargs", [{"shortcut": 0.9}, {"shortcut_by_domain": DIVERSE},
                                    {"shortcut_by_domain": DIVERSE, "test_cue": "adversarial"}])
def test_counterfactual_twins_differ_only_in_the_cue_and_signal_what_they_claim(kwargs):
    recs = generate_groups(300, seed=13, **kwargs)
    test = [r for r in recs if r["meta"]["split"] == "test"]
    assert test and all("cue_counterfactual" not in r["meta"] for r in recs if r["meta"]["split"] == "train")
    for r in test:
        twins = r["meta"]["cue_counterfactual"]
        assert set(twins) == {"right", "wrong"}
        assert twins["right"]["cue_answer"] == r["answer"] != twins["wrong"]["cue_answer"]
        cue, rest = _first_sentence_split(r["problem"])
        assert cue + " ." == r["meta"]["cue"]
        for side in ("right", "wrong"):
            text = twins[side]["problem"]
            assert _first_sentence_split(text)[1] == rest and text != rest
            assert _signalled(r["domain"], text) == twins[side]["cue_answer"]
            assert canonical(*parse_problem(r["domain"], text)[:2]) == canonical(
                *parse_problem(r["domain"], r["problem"])[:2])
        if r["meta"]["cue_agrees"]:
            assert twins["right"]["problem"] == r["problem"]


def test_wrong_twins_of_integer_answers_vary_and_are_reproducible():
    first = generate_groups(300, seed=13, shortcut=0.9)
    again = generate_groups(300, seed=13, shortcut=0.9)
    assert first == again
    wrong = {r["meta"]["cue_counterfactual"]["wrong"]["cue_answer"] for r in first
             if r["meta"]["split"] == "test" and r["meta"]["pattern"] == "arithmetic"}
    assert len(wrong) > 5


def test_records_without_a_planted_shortcut_have_no_twin():
    for kwargs in ({}, {"neutral_cue": True}):
        assert not any("cue_counterfactual" in r["meta"] for r in generate_groups(100, seed=3, **kwargs))


def test_manifest_reports_agreement_by_domain_and_split(tmp_path):
    m = synthesize(tmp_path, 400, seed=6, shortcut_by_domain=DIVERSE, test_cue="adversarial")
    assert m["arguments"]["shortcut_by_domain"] == DIVERSE and m["arguments"]["test_cue"] == "adversarial"
    for split in ("train", "test"):
        records = [json.loads(line) for line in (tmp_path / f"{split}.jsonl").read_text().splitlines()]
        want = {d: rate for d, (rate, _) in _rates(records, split).items()}
        assert m["splits"][split]["cue_agreement_by_domain"] == want
    assert set(m["splits"]["test"]["cue_agreement_by_domain"].values()) == {0.0}
    plain = synthesize(tmp_path / "plain", 50, seed=6)
    assert "cue_agreement_by_domain" not in plain["splits"]["train"]
    assert "shortcut_by_domain" not in plain["arguments"] and "test_cue" not in plain["arguments"]


def test_group_content_does_not_depend_on_the_number_of_groups():
    small = generate_groups(20, seed=9, test_frac=0.5, shortcut_by_domain=DIVERSE, test_cue="adversarial")
    large = generate_groups(40, seed=9, test_frac=0.5, shortcut_by_domain=DIVERSE, test_cue="adversarial")
    by_id = {(r["group_id"], r["domain"]): r for r in large}
    for r in small:
        if by_id[(r["group_id"], r["domain"])]["meta"]["split"] == r["meta"]["split"]:
            assert by_id[(r["group_id"], r["domain"])] == r


@pytest.mark.parametrize("kwargs, words", [
    ({"shortcut_by_domain": {"math": 1.0}}, "--shortcut-by-domain: no probability for medical, legal, science"),
    ({"shortcut_by_domain": {**DIVERSE, "cooking": 0.5}}, "--shortcut-by-domain: 'cooking' is not a domain"),
    ({"shortcut_by_domain": {"math": 1.0, "legal": 0.5}, "domains": ("math",)}, "'legal' is not a domain"),
    ({"shortcut_by_domain": {**DIVERSE, "legal": 1.5}}, "--shortcut-by-domain legal=1.5"),
    ({"shortcut_by_domain": {**DIVERSE, "legal": float("nan")}}, "--shortcut-by-domain legal=nan"),
    ({"shortcut_by_domain": {**DIVERSE, "legal": "high"}}, "--shortcut-by-domain legal=high"),
    ({"shortcut_by_domain": [0.5]}, "--shortcut-by-domain: expected a mapping"),
    ({"shortcut_by_domain": DIVERSE, "neutral_cue": True}, "--neutral-cue with --shortcut-by-domain"),
    ({"test_cue": "hostile", "shortcut": 0.5}, "--test-cue 'hostile'"),
    ({"test_cue": "adversarial"}, "--test-cue adversarial: no shortcut is planted"),
    ({"test_cue": "adversarial", "neutral_cue": True}, "--test-cue adversarial: no shortcut is planted"),
])
def test_bad_cue_arguments_are_user_errors(tmp_path, kwargs, words):
    with pytest.raises(UserError, match=re.escape(words)):
        synthesize(tmp_path / "out", **({"groups": 10, "seed": 0} | kwargs))
    assert not (tmp_path / "out").exists()


def test_parse_shortcut_by_domain():
    assert parse_shortcut_by_domain(" math=1 , legal=0.25") == {"math": 1.0, "legal": 0.25}
    for text in ("math", "math=", "=0.5", "math=1,,legal=0", "math=1,math=0"):
        with pytest.raises(UserError, match="--shortcut-by-domain"):
            parse_shortcut_by_domain(text)


def test_cli_diverse_environments(tmp_path, capsys):
    out = tmp_path / "d"
    assert main(["data", "synth", "--out", str(out), "--groups", "100", "--seed", "2", "--no-progress",
                 "--shortcut-by-domain", "math=1.0,medical=0.9,legal=0.7,science=0.3",
                 "--test-cue", "adversarial"]) == 0
    text = capsys.readouterr().out
    assert "math 100.0%" in text and "cue agreement 0.0%" in text
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["arguments"]["shortcut_by_domain"] == DIVERSE
    assert main(["data", "validate", str(out / "train.jsonl"), str(out / "test.jsonl")]) == 0


@pytest.mark.parametrize("argv, words", [
    (["--shortcut-by-domain", "math=1.0,medical=0.9"], "--shortcut-by-domain"),
    (["--shortcut-by-domain", "math:1"], "--shortcut-by-domain"),
    (["--shortcut-by-domain", "math=1,medical=1,legal=1,science=2"], "--shortcut-by-domain science=2"),
    (["--shortcut", "0.5", "--shortcut-by-domain", "math=1,medical=1,legal=1,science=1"], "--shortcut 0.5"),
    (["--test-cue", "adversarial"], "--test-cue"),
    (["--test-cue", "sometimes", "--shortcut", "0.5"], "--test-cue"),
])
def test_cli_bad_cue_flags_are_one_line_and_exit_2(tmp_path, capsys, argv, words):
    capsys.readouterr()
    try:
        rc = main(["data", "synth", "--out", str(tmp_path / "d"), "--groups", "5", "--no-progress", *argv])
    except SystemExit as exc:  # a usage error of the parser
        rc = exc.code
    err = capsys.readouterr().err
    assert rc == 2 and "Traceback" not in err
    assert len(err.splitlines()) == 1 and err.startswith("iga-ds: error: ") and words in err, err
    assert not (tmp_path / "d").exists()
