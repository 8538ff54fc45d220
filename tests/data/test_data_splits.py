"""Splits and group-sampling helpers: no seed leaks, exact fractions, ablation helpers."""
from __future__ import annotations

from collections import Counter, defaultdict

import pytest

from iga_ds.cli import main
from iga_ds.data.schema import answer_type, read_isomer_jsonl
from iga_ds.data.splits import random_pairing, split_by_instance, split_by_seed, subset_domains
from iga_ds.data.synth import generate_groups
from iga_ds.errors import UserError


@pytest.fixture(scope="module")
def records():
    recs = generate_groups(60, seed=3, test_frac=0.0)
    # two groups per seed, as a teacher run with several groups per seed would give
    for r in recs:
        r["seed_id"] = "seed-" + str(int(r["group_id"].rsplit("-", 1)[1]) // 2)
    return recs


def seeds(recs):
    return {r["seed_id"] for r in recs}


def test_split_by_seed_never_leaks_and_is_exact(records):
    train, test = split_by_seed(records, 0.2, seed=1)
    assert not seeds(train) & seeds(test)
    assert len(seeds(test)) == 6 and len(seeds(train)) == 24
    assert len(train) + len(test) == len(records)
    # order within each side is the input order
    assert [r for r in records if r in test] == test
    assert split_by_seed(records, 0.2, seed=1) == (train, test)
    assert split_by_seed(records, 0.2, seed=2)[1] != test


def test_split_by_instance_leaks_by_design(records):
    train, test = split_by_instance(records, 0.2, seed=0)
    assert len(test) == round(0.2 * len(records))
    assert seeds(train) & seeds(test)  # the leakage the ablation measures


@pytest.mark.parametrize("frac", [0.0, 1.0, -0.1])
def test_bad_fraction(records, frac):
    with pytest.raises(UserError, match="--test-frac"):
        split_by_seed(records, frac)


def test_random_pairing_makes_complete_fake_groups(records):
    paired = random_pairing(records, seed=0)
    groups = defaultdict(list)
    for r in paired:
        groups[r["group_id"]].append(r)
    domains = sorted({r["domain"] for r in records})
    originals = 0
    for group in groups.values():
        assert sorted(r["domain"] for r in group) == domains
        assert len({answer_type(r["answer"]) for r in group}) == 1
        assert len({r["seed_id"] for r in group}) == 1
        originals += len({r["meta"]["orig_group_id"] for r in group}) == 1
    assert originals < len(groups) / 4  # pairing really mixes groups
    # every instance is used at most once and kept verbatim
    keys = Counter((r["meta"]["orig_group_id"], r["domain"]) for r in paired)
    assert max(keys.values()) == 1
    source = {(r["group_id"], r["domain"]): r["problem"] for r in records}
    assert all(source[(r["meta"]["orig_group_id"], r["domain"])] == r["problem"] for r in paired)
    assert random_pairing(records, seed=0) == paired


def test_subset_domains(records):
    two = subset_domains(records, ["math", "legal"])
    assert {r["domain"] for r in two} == {"math", "legal"} and len(two) == len(records) // 2
    with pytest.raises(UserError, match="cooking not in the data"):
        subset_domains(records, ["cooking"])


def test_cli_split(tmp_path, capsys):
    src = tmp_path / "all.jsonl"
    import json

    src.write_text("".join(json.dumps(r) + "\n" for r in generate_groups(30, seed=1, test_frac=0.0)))
    assert main(["data", "split", "--in", str(src), "--out", str(tmp_path / "s"), "--seed", "4"]) == 0
    train = read_isomer_jsonl(tmp_path / "s" / "train.jsonl")
    test = read_isomer_jsonl(tmp_path / "s" / "test.jsonl")
    assert len(seeds(test)) == 6 and not seeds(train) & seeds(test)
    assert main(["data", "validate", str(tmp_path / "s" / "train.jsonl"),
                 str(tmp_path / "s" / "test.jsonl")]) == 0
    capsys.readouterr()
    assert main(["data", "split", "--in", str(src), "--out", str(tmp_path / "i"), "--by", "instance"]) == 0
    assert "leakage ablation" in capsys.readouterr().err
    assert main(["data", "validate", str(tmp_path / "i" / "train.jsonl")]) == 2
    assert main(["data", "validate", "--allow-partial-groups", str(tmp_path / "i" / "train.jsonl")]) == 0
