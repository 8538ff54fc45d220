"""Validation of isomer files: a corpus of bad files, each rejected with FILE:LINE and field."""
from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from iga_ds.cli import main
from iga_ds.data.schema import answer_type, read_isomer_jsonl
from iga_ds.errors import DataError

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "data"
BAD = FIXTURES / "bad"

# file -> (line the message must name, words it must contain)
BAD_FILES = {
    "not_json.jsonl": ("2", "not valid JSON"),
    "missing_field.jsonl": ("1", "field 'answer' is missing"),
    "wrong_type.jsonl": ("2", "field 'answer' must be a string"),
    "unknown_field.jsonl": ("2", "unknown field 'problme'"),
    "missing_domain.jsonl": ("3", "group 'g2' lacks legal"),
    "duplicate_domain.jsonl": ("5", "group 'g2' already has a 'math' instance (line 3)"),
    "mixed_answer_types.jsonl": ("1", "mixes answer types"),
    "mixed_seeds.jsonl": ("1", "field 'seed_id': group 'g1' mixes seeds"),
    "bad_score.jsonl": ("2", "field 'alignment_score' must be a number in [0, 1]"),
    "bad_dag.jsonl": ("1", "field 'dag': dag.edges[0].label 'FOO'"),
    "not_object.jsonl": ("2", "expected a JSON object"),
    "empty_problem.jsonl": ("2", "field 'problem' is empty"),
    "not_utf8.jsonl": ("2", "not UTF-8"),
}


def test_good_fixture_reads():
    records = read_isomer_jsonl(FIXTURES / "good_isomers.jsonl")
    assert [r["domain"] for r in records] == ["math", "legal", "math", "legal"]
    assert records[3]["alignment_score"] == 0.9


@pytest.mark.parametrize("name", sorted(BAD_FILES))
def test_bad_file_names_file_line_and_field(name):
    line, words = BAD_FILES[name]
    with pytest.raises(DataError) as info:
        read_isomer_jsonl(BAD / name)
    message = str(info.value)
    assert message.startswith(f"{BAD / name}:{line}:"), message
    assert words in message
    assert "\n" not in message


@pytest.mark.parametrize("name", sorted(BAD_FILES) + ["empty.jsonl"])
def test_cli_validate_bad_file_exits_2_with_one_line(name, capsys):
    assert main(["data", "validate", str(BAD / name)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("iga-ds: error: ") and err.count("\n") == 1
    assert "Traceback" not in err


def test_empty_file():
    with pytest.raises(DataError, match="no records"):
        read_isomer_jsonl(BAD / "empty.jsonl")


def test_missing_file(tmp_path):
    with pytest.raises(DataError, match="no such file"):
        read_isomer_jsonl(tmp_path / "nope.jsonl")


def test_seed_on_both_sides_of_split_is_reported(capsys):
    train, test = BAD / "leak_train.jsonl", BAD / "leak_test.jsonl"
    assert main(["data", "validate", str(train)]) == 0
    assert main(["data", "validate", str(test)]) == 0
    capsys.readouterr()
    assert main(["data", "validate", str(train), str(test)]) == 2
    err = capsys.readouterr().err
    assert f"{test}:1: field 'seed_id': seed 's1' is also in {train}:1" in err


def test_validate_summary(capsys):
    assert main(["data", "validate", str(FIXTURES / "good_isomers.jsonl")]) == 0
    out = capsys.readouterr().out
    assert "OK  2 groups, 4 instances, 2 seeds" in out
    assert "boolean=2, integer=2" in out


def test_validate_domains_option(capsys):
    good = str(FIXTURES / "good_isomers.jsonl")
    assert main(["data", "validate", good, "--domains", "math,legal"]) == 0
    assert main(["data", "validate", good, "--domains", "math,legal,science"]) == 2
    assert capsys.readouterr().err == (f"iga-ds: error: {good}:1: field 'domain': group 'g1' lacks science (--domains "
                                       "asks for math, legal, science; every group needs each once)\n")
    assert main(["data", "validate", good, "--domains", "math"]) == 2  # a domain the run does not train on
    assert f"{good}:2: field 'domain': 'legal' (group 'g1') is not one of the domains --domains asks for, math" in \
        capsys.readouterr().err


def _groups(path: Path, domains_of_groups: list[list[str]]) -> Path:
    """An isomer file: one group per entry, with those domains, in order."""
    lines = [json.dumps({"group_id": f"g{g}", "seed_id": f"s{g}", "domain": d, "problem": f"p {g} {d}",
                         "cot": "c", "answer": "yes"})
             for g, domains in enumerate(domains_of_groups) for d in domains]
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


FOUR = ["math", "medical", "legal", "science"]


def test_a_file_whose_only_group_lacks_a_domain_fails_against_the_runs_domains(tmp_path, capsys):
    """Its one group agrees with itself, so only the run's domains can show what is missing:
    validated alone it passes with a note naming the default domains; with --domains it is one
    line naming the file, the line and the group."""
    path = _groups(tmp_path / "one.jsonl", [["math", "medical", "legal"]])
    assert main(["data", "validate", str(path)]) == 0
    out = capsys.readouterr().out
    assert "OK  1 groups" in out and f"note: {path}: its domains are legal, math, medical" in out, out
    assert main(["data", "validate", str(path), "--domains", ",".join(FOUR)]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"iga-ds: error: {path}:1: field 'domain': group 'g0' lacks science ") and \
        err.count("\n") == 1, err
    assert main(["data", "validate", str(path), "--domains", "math,medical,legal"]) == 0


def test_the_odd_group_is_named_against_the_files_majority(tmp_path):
    """Against the domains most groups have: a group with a domain the others lack is the one
    named (the union of all domains blamed every other group for lacking it)."""
    path = _groups(tmp_path / "odd.jsonl", [FOUR, FOUR, FOUR + ["art"], FOUR])
    with pytest.raises(DataError) as info:
        read_isomer_jsonl(path)
    assert str(info.value) == (f"{path}:9: field 'domain': group 'g2' has art (3 of the file's 4 groups have "
                               "legal, math, medical, science; every group needs each once)")
    short = _groups(tmp_path / "short.jsonl", [FOUR, FOUR[:3], FOUR])
    with pytest.raises(DataError, match=rf"^{re.escape(str(short))}:5: field 'domain': group 'g1' lacks science "):
        read_isomer_jsonl(short)
    assert len(read_isomer_jsonl(_groups(tmp_path / "fine.jsonl", [FOUR, FOUR]))) == 8


@pytest.mark.parametrize("answer, kind", [
    ("yes", "boolean"), ("No", "boolean"), ("12", "integer"), ("-3", "integer"),
    ("2.5", "number"), ("C", "option"), ("(b)", "option"), ("x + 1", "text"),
])
def test_answer_type(answer, kind):
    assert answer_type(answer) == kind
