"""The training set tokenized once by Dataset.map: the rows are encode_example's, a second call
reads the cache without tokenizing, anything the ids depend on changes the key, and with two real
gloo ranks only rank 0 tokenizes."""
from __future__ import annotations

import json
import shutil
import textwrap
from pathlib import Path

import pytest
import torch

from dist_helpers import launch
from test_train_support import DOMAINS, run_config_dict, write_isomer_jsonl

from iga_ds.data.groups import complete_groups
from iga_ds.train import batching
from iga_ds.train.batching import collate, encode_example, format_example, read_records, tokenize_groups
from iga_ds.train.model import build_vocab, build_word_tokenizer


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("tok")
    path = write_isomer_jsonl(tmp / "train.jsonl", groups=6, seed=5)
    records = read_records(path)
    groups = complete_groups(records, DOMAINS)
    tokenizer = build_word_tokenizer(build_vocab([p + t for p, t in map(format_example, records)]))
    return path, groups, tokenizer


@pytest.fixture
def counted(monkeypatch):
    """Calls of encode_example (Dataset.map runs it in this process with one process)."""
    calls = []

    def counting(tokenizer, prompt, target, *rest):
        calls.append(prompt)
        return encode_example(tokenizer, prompt, target, *rest)

    monkeypatch.setattr(batching, "encode_example", counting)
    return calls


@pytest.mark.parametrize("max_length", [96, 24])  # 24 cuts prompts and targets
def test_rows_are_encode_example_of_each_record(data, tmp_path, max_length):
    _, groups, tokenizer = data
    tokens = tokenize_groups(tokenizer, groups, max_length, tmp_path)
    assert tokens.built and tokens.num_groups == len(groups) and tokens.per_group == len(DOMAINS)
    for g, group in enumerate(groups):
        for d, rec in enumerate(group):
            ids, labels = encode_example(tokenizer, *format_example(rec), max_length)
            row = tokens.rows[g * len(DOMAINS) + d]
            assert (row["input_ids"], row["labels"]) == (ids, labels)
    # a micro-batch of pre-tokenized rows is what collate makes of the records
    got, want = tokens.micro_batch([4, 1]), collate(tokenizer, [groups[4], groups[1]], DOMAINS, max_length)
    for name in ("input_ids", "attention_mask", "labels", "domain_ids"):
        assert torch.equal(getattr(got, name), getattr(want, name)), name
    assert (got.num_tokens, got.num_target_tokens) == (want.num_tokens, want.num_target_tokens)


def test_a_second_call_reads_the_cache_without_tokenizing(data, tmp_path, counted):
    _, groups, tokenizer = data
    first = tokenize_groups(tokenizer, groups, 96, tmp_path)
    assert first.built and len(counted) == 4 * len(groups)
    second = tokenize_groups(tokenizer, groups, 96, tmp_path)
    assert not second.built and len(counted) == 4 * len(groups)  # nothing tokenized again
    assert second.path == first.path and second.rows[:] == first.rows[:]
    assert [p.name for p in tmp_path.iterdir()] == [first.path.name]  # no temporary left


def test_whatever_the_ids_depend_on_changes_the_key(data, tmp_path, counted):
    _, groups, tokenizer = data
    base = tokenize_groups(tokenizer, groups, 96, tmp_path).path
    edited = [list(g) for g in groups]
    edited[2][1] = dict(edited[2][1], cot=edited[2][1]["cot"] + " so")
    other_vocab = build_word_tokenizer(build_vocab(["just a few words"]))
    paths = {base,
             tokenize_groups(tokenizer, groups, 95, tmp_path).path,            # max_length
             tokenize_groups(tokenizer, edited, 96, tmp_path).path,            # one text
             tokenize_groups(tokenizer, groups[::-1], 96, tmp_path).path,      # the order of the rows
             tokenize_groups(other_vocab, groups, 96, tmp_path).path}          # the tokenizer
    assert len(paths) == 5 and len(counted) == 5 * 4 * len(groups)
    # the same tokenizer files give the same key in every process, however the tokenizer was used
    from transformers import AutoTokenizer

    folder = tmp_path / "tok"
    tokenizer.save_pretrained(folder)
    used = AutoTokenizer.from_pretrained(folder)
    used(["a text", "another text here"], truncation=True, max_length=3, padding="max_length")
    loaded = tokenize_groups(AutoTokenizer.from_pretrained(folder), groups, 96, tmp_path).path
    assert tokenize_groups(used, groups, 96, tmp_path).path == loaded
    assert len(counted) == 6 * 4 * len(groups)


def test_a_damaged_cache_is_tokenized_again(data, tmp_path, counted):
    _, groups, tokenizer = data
    path = tokenize_groups(tokenizer, groups, 96, tmp_path).path
    for arrow in path.glob("*.arrow"):
        arrow.write_bytes(b"cut")
    again = tokenize_groups(tokenizer, groups, 96, tmp_path)
    assert again.built and len(counted) == 2 * 4 * len(groups) and again.rows[0]["input_ids"]
    shutil.rmtree(path)
    assert tokenize_groups(tokenizer, groups, 96, tmp_path).built


def test_two_processes_give_the_same_rows(data, tmp_path):
    _, groups, tokenizer = data
    one = tokenize_groups(tokenizer, groups, 96, tmp_path / "one", num_proc=1)
    two = tokenize_groups(tokenizer, groups, 96, tmp_path / "two", num_proc=2)
    assert two.built and two.path.name == one.path.name and two.rows[:] == one.rows[:]


WORKER = textwrap.dedent("""
    import json, sys
    from iga_ds.config.run import config_from_dict
    from iga_ds.data.groups import complete_groups
    from iga_ds.train import batching
    from iga_ds.train.batching import format_example, read_records
    from iga_ds.train.distributed import init_distributed, resolve_dist
    from iga_ds.train.model import build_vocab, build_word_tokenizer
    from iga_ds.train.trainer import Trainer

    calls = []
    real = batching.encode_example

    def counting(*args):
        calls.append(1)
        return real(*args)

    batching.encode_example = counting
    trainer = Trainer(config_from_dict(json.loads(sys.argv[1])), quiet=True)
    trainer.dist = resolve_dist(None)
    init_distributed(trainer.dist)
    records = read_records(trainer.cfg.data.train)
    groups = complete_groups(records, ["math", "medical", "legal", "science"])
    tokenizer = build_word_tokenizer(build_vocab([p + t for p, t in map(format_example, records)]))
    tokens = trainer._tokenize(tokenizer, groups)
    print("RESULT " + json.dumps({"rank": trainer.dist.rank, "calls": len(calls), "built": tokens.built,
                                  "path": str(tokens.path), "rows": tokens.rows[:]["input_ids"]}))
""")


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_two_gloo_ranks_only_rank_zero_tokenizes(data, tmp_path):
    path, groups, _ = data
    script = tmp_path / "worker.py"
    script.write_text(WORKER)
    cfg = run_config_dict(tmp_path, path, output_dir=str(tmp_path / "out"))
    outputs = launch(script, 2, [json.dumps(cfg)], extra_env={"HF_DATASETS_CACHE": str(tmp_path / "hf-cache")})
    results = {}
    for code, out in outputs:
        assert code == 0, out[-3000:]
        line = next(x for x in out.splitlines() if x.startswith("RESULT "))
        result = json.loads(line[len("RESULT "):])
        results[result["rank"]] = result
    assert results[0]["calls"] == 4 * len(groups) and results[0]["built"]
    assert results[1]["calls"] == 0 and not results[1]["built"]
    assert results[0]["path"] == results[1]["path"] and results[0]["rows"] == results[1]["rows"]
    assert Path(results[0]["path"]).parent == tmp_path / "hf-cache" / "iga_ds-tokenized"


def test_bench_tokenize_measures_cold_and_cached(tmp_path, capsys):
    import bench_tokenize

    from iga_ds.data.synth import generate_groups

    groups = complete_groups(generate_groups(6, 0, shortcut=0.9), DOMAINS)
    tokenizer = build_word_tokenizer(build_vocab([p + t for g in groups for p, t in map(format_example, g)]))
    args = type("Args", (), {"procs": [1], "repeat": 2, "max_length": 64})()
    rows = bench_tokenize.measure("tiny", tokenizer, groups, args)
    assert [r["processes"] for r in rows] == [1, "cached"] and len(rows[0]["seconds"]) == 2
    assert rows[0]["records"] == 24 and rows[0]["min_s"] <= rows[0]["median_s"] <= rows[0]["max_s"]
    text = bench_tokenize.table(rows)
    assert text.count("\n") == 3 and "| tiny " in text and "cached" in text
    assert bench_tokenize.machine()["cores"] >= 1 and bench_tokenize.cpu_model()
