"""Benchmark loaders on invented fixture files in the public layouts; clear errors otherwise."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from iga_ds.data.benchmarks import BENCHMARKS, benchmark_defaults, load_benchmark
from iga_ds.errors import ConfigError, DataError
from iga_ds.metrics import score_generation

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "benchmarks"


def test_logiqa2_default_split_and_letters():
    items = load_benchmark("logiqa2", FIXTURES / "logiqa2")
    assert [(i.split, i.answer) for i in items] == [("id", "C"), ("id", "A"), ("id", "D"), ("ood", "B"), ("ood", "A")]
    assert items[0].domain == "Categorical Reasoning"
    assert items[1].domain == "Sufficient Conditional Reasoning"  # first type marked true
    assert items[3].domain == "untyped"
    # the "A." prefixes of the raw options are replaced by one clean lettering
    assert "C. Mara plays piano" in items[0].problem and "A.Mara" not in items[0].problem
    assert "A. The bridge is open" in items[1].problem
    assert len({i.id for i in items}) == len(items)


def test_logiqa2_repository_checkout_layout(tmp_path):
    nested = tmp_path / "LogiQA2.0" / "logiqa" / "DATA" / "LOGIQA"
    shutil.copytree(FIXTURES / "logiqa2", nested)
    assert len(load_benchmark("logiqa2", tmp_path / "LogiQA2.0")) == 5


def test_logiqa2_configurable_files():
    items = load_benchmark("logiqa2", FIXTURES / "logiqa2", id_files=[], ood_files=["test.txt"])
    assert {i.split for i in items} == {"ood"} and len(items) == 3


def test_reclor_val_and_test_hard_split():
    val = load_benchmark("reclor", FIXTURES / "reclor")
    assert [(i.answer, i.split) for i in val] == [("A", "id"), ("C", "id")]
    test = load_benchmark("reclor", FIXTURES / "reclor", split="test", hard_start=2)
    assert [(i.domain, i.split, i.labeled) for i in test] == [
        ("easy", "id", False), ("easy", "id", False), ("hard", "ood", False)
    ]
    assert test[0].id == "reclor/test_0"


def test_math_default_split_skips_prealgebra_and_reads_boxed_answers():
    items = load_benchmark("math", FIXTURES / "MATH")
    by_domain = {}
    for item in items:
        by_domain.setdefault(item.domain, []).append(item)
    assert set(by_domain) == {
        "algebra", "number_theory", "counting_and_probability", "geometry", "precalculus", "intermediate_algebra"
    }
    assert {i.split for i in by_domain["counting_and_probability"]} == {"id"}
    assert {i.split for i in by_domain["intermediate_algebra"]} == {"ood"}
    assert [i.answer for i in by_domain["algebra"]] == ["6", r"\frac{1}{2}"]
    assert all(i.kind == "math" for i in items)
    # a correct model answer in another form scores under the symbolic rule only
    s = score_generation(r"so y = \boxed{0.5}", by_domain["algebra"][1].answer, "math")
    assert s.correct and s.correct_symbolic  # 0.5 -> \frac{1}{2} by the MATH normalization


def test_math_levels_and_subject_checks(tmp_path):
    only1 = load_benchmark("math", FIXTURES / "MATH", levels=[1])
    assert all(i.meta["level"] == "Level 1" for i in only1) and only1
    with pytest.raises(DataError, match="both in-distribution and OOD"):
        load_benchmark("math", FIXTURES / "MATH", id_subjects=["algebra"], ood_subjects=["algebra"])
    with pytest.raises(DataError, match="unknown subject"):
        load_benchmark("math", FIXTURES / "MATH", ood_subjects=["probability"])
    # the archive's own top folder is accepted
    shutil.copytree(FIXTURES / "MATH", tmp_path / "MATH")
    assert len(load_benchmark("math", tmp_path)) == len(load_benchmark("math", FIXTURES / "MATH"))


def test_arb_kinds_domains_and_split():
    items = load_benchmark("arb", FIXTURES / "arb")
    got = {(i.domain, i.kind, i.split, i.answer) for i in items}
    assert ("law", "choice", "ood", "B") in got
    assert ("mcat_science", "choice", "ood", "C") in got
    assert ("math_numerical", "math", "id", "1") in got
    assert ("physics_numerical", "math", "id", "6") in got
    assert not any(i.domain == "math_prooflike" for i in items)  # no exact answer to score
    laws = [i for i in items if i.domain == "law"]
    assert [i.answer for i in laws] == ["B", "B"]  # letter and full option text both map to B
    with_proofs = load_benchmark("arb", FIXTURES / "arb", include_prooflike=True)
    assert len(with_proofs) == len(items) + 1


@pytest.mark.parametrize(
    "name, words",
    [
        ("logiqa2", ["github.com/csitfun/LogiQA2.0", "CC BY-NC-SA 4.0"]),
        ("reclor", ["whyu.me/reclor", "may not be redistributed"]),
        ("math", ["hendrycks/math", "MIT"]),
        ("arb", ["arb.duckai.org", "GPL-3.0"]),
    ],
)
def test_missing_benchmark_says_where_and_licence(tmp_path, name, words):
    with pytest.raises(DataError) as err:
        load_benchmark(name, tmp_path / "nowhere")
    message = str(err.value)
    assert "\n" not in message and "not bundled" in message and "--benchmark-dir" in message
    for word in words:
        assert word in message


def test_malformed_logiqa_line_names_file_line_field(tmp_path):
    d = tmp_path / "lq"
    shutil.copytree(FIXTURES / "logiqa2", d)
    lines = (d / "test.txt").read_text().splitlines()
    bad = json.loads(lines[1])
    bad["answer"] = 7
    lines[1] = json.dumps(bad)
    (d / "test.txt").write_text("\n".join(lines) + "\n")
    with pytest.raises(DataError, match=r"test.txt:2: field 'answer'"):
        load_benchmark("logiqa2", d)
    (d / "test.txt").write_text(lines[0] + "\n{not json\n")
    with pytest.raises(DataError, match=r"test.txt:2: not valid JSON"):
        load_benchmark("logiqa2", d)


def test_malformed_reclor_math_arb(tmp_path):
    (tmp_path / "reclor").mkdir()
    (tmp_path / "reclor" / "val.json").write_text(json.dumps([{"context": "c", "question": "q", "answers": ["a", "b"], "label": 0}]))
    with pytest.raises(DataError, match=r"val.json: item 0: field 'answers': expected 4 options"):
        load_benchmark("reclor", tmp_path / "reclor")
    math_dir = tmp_path / "M"
    shutil.copytree(FIXTURES / "MATH", math_dir)
    (math_dir / "test" / "geometry" / "1.json").write_text(json.dumps({"problem": "p", "solution": "no box"}))
    with pytest.raises(DataError, match=r"geometry/1.json: field 'solution'"):
        load_benchmark("math", math_dir)
    (tmp_path / "arb").mkdir()
    (tmp_path / "arb" / "law.json").write_text(json.dumps([{"problemStatement": "p", "answerCandidates": ["A. x", "B. y"], "finalAnswer": "Q"}]))
    with pytest.raises(DataError, match=r"law.json: item 0: field 'finalAnswer'"):
        load_benchmark("arb", tmp_path / "arb")


def test_registry_options():
    assert BENCHMARKS == ("arb", "logiqa2", "math", "reclor")
    assert benchmark_defaults("math")["ood_subjects"] == ("geometry", "precalculus", "intermediate_algebra")
    with pytest.raises(ConfigError, match="unknown benchmark"):
        load_benchmark("gsm8k", FIXTURES)
    with pytest.raises(ConfigError, match="no option 'subjects'"):
        load_benchmark("math", FIXTURES / "MATH", subjects=["algebra"])
