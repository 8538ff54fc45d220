"""Run config, schedule, batching, loss and tokenizer, each against a plain reference."""
from __future__ import annotations

import math
from pathlib import Path

import pytest

from iga_ds.errors import ConfigError
from test_train_support import DOMAINS, run_config_dict, write_isomer_jsonl


# -- config ----------------------------------------------------------------------------------


def test_defaults_follow_the_paper():
    from iga_ds.config.run import RunConfig

    cfg = RunConfig()
    assert (cfg.lora.r, cfg.lora.alpha, cfg.lora.target_modules) == (16, 32.0, ["q_proj", "k_proj", "v_proj", "o_proj"])
    s = cfg.schedule
    assert (s.lr, s.warmup_ratio, s.weight_decay, s.betas) == (2e-4, 0.03, 0.01, [0.9, 0.999])


@pytest.mark.parametrize(
    "override, message",
    [
        ("lora.r=sixteen", "lora.r: expected an integer"),
        ("lora.rank=4", "lora.rank: unknown key"),
        ("schedule.lr=fast", "schedule.lr: expected a number"),
        ("schedule.betas=[0.9]", "schedule.betas: expected two numbers"),
        ("data.groups_per_step=0", "data.groups_per_step: expected a positive integer"),
        ("logging.progress=3", "logging.progress: expected true or false"),
        ("data.domains=math", "data.domains: expected a list of a string or null"),
        ("lora=4", "lora: expected a mapping"),
        ("model.tiny={width: 3}", "model.tiny.width: unknown key"),
        ("model.tiny={num_layers: 0}", "model.tiny.num_layers: expected a positive integer, got 0"),
        ("model.tiny={steps: 2.5}", "model.tiny.steps: expected a positive integer"),
        ("model.tiny={hidden_size: 30, num_heads: 4}", "hidden_size 30 is not a multiple of num_heads 4"),
    ],
)
def test_config_errors_name_the_key_and_the_expected_type(tmp_path, override, message):
    from iga_ds.config.run import load_run_config

    path = tmp_path / "run.yaml"
    path.write_text("output_dir: out\n")
    with pytest.raises(ConfigError) as err:
        load_run_config(path, [override])
    assert message in str(err.value)
    # the key came from the command line: the override is named, not the file it overrides
    assert str(err.value).startswith(f"override {override!r}: ") and str(path) not in str(err.value)
    path.write_text(f"output_dir: out\n{_as_yaml(override)}")
    with pytest.raises(ConfigError) as err:  # the same key in the file: the file is named
        load_run_config(path, ["seed=1"])
    assert message in str(err.value) and str(err.value).startswith(f"{path}: ")


def _as_yaml(override: str) -> str:
    """``a.b=value`` as the YAML that sets it in a file."""
    import yaml

    from iga_ds.config.run import parse_override

    keys, value = parse_override(override)
    for key in reversed(keys):
        value = {key: value}
    return yaml.safe_dump(value)


def test_overrides_are_yaml_values_and_scientific_notation_is_a_number(tmp_path):
    from iga_ds.config.run import load_run_config

    path = tmp_path / "run.yaml"
    path.write_text("schedule:\n  lr: 2e-4\n")  # YAML 1.1 reads this as a string
    cfg = load_run_config(path, ["schedule.max_steps=7", "method.name=vrex", "data.domains=[math, legal]"])
    assert cfg.schedule.lr == 2e-4 and cfg.schedule.max_steps == 7
    assert cfg.method.name == "vrex" and cfg.data.domains == ["math", "legal"]


def test_broken_yaml_reports_the_line(tmp_path):
    from iga_ds.config.run import load_run_config

    path = tmp_path / "bad.yaml"
    path.write_text("lora:\n  r: 4\n  alpha: [8\n")
    with pytest.raises(ConfigError, match=r"bad.yaml:\d+: not valid YAML"):
        load_run_config(path)


def test_ds_config_batch_sizes_and_one_home_for_the_method(tmp_path):
    from iga_ds.config.run import config_from_dict
    from iga_ds.config.deepspeed import build_ds_config

    data = write_isomer_jsonl(tmp_path / "d.jsonl", 2)
    cfg = config_from_dict(run_config_dict(tmp_path, data, **{"data.groups_per_step": 8,
                                                              "data.groups_per_micro_batch": 2}))
    raw = {"train_batch_size": "auto", "zero_optimization": {"stage": 2}, "iga": {"domains": DOMAINS}}
    ds, iga = build_ds_config(cfg, raw, world_size=2, accum=2, cpu=True)
    assert iga.method == "erm"  # the run YAML names the method; the JSON does not
    # one home per setting: the same value in both files is fine, two values are an error naming both
    assert build_ds_config(cfg, {**raw, "iga": {"method": "erm"}}, world_size=2, accum=2, cpu=True)[1].method == "erm"
    with pytest.raises(ConfigError, match=r"^method: run.yaml sets method.name: 'erm' and zero2.json sets "
                                          r"iga.method: 'iga'; set it in one of them$"):
        build_ds_config(cfg, {**raw, "iga": {"method": "iga"}}, world_size=2, accum=2, source="zero2.json", cpu=True,
                        run_source="run.yaml")
    assert (ds["train_micro_batch_size_per_gpu"], ds["gradient_accumulation_steps"], ds["train_batch_size"]) == (8, 2, 32)
    with pytest.raises(ConfigError, match="train_batch_size is 64"):
        build_ds_config(cfg, {**raw, "train_batch_size": 64}, world_size=2, accum=2, cpu=True)
    with pytest.raises(ConfigError, match="'optimizer'"):
        build_ds_config(cfg, {**raw, "optimizer": {"type": "Adam"}}, world_size=2, accum=2, cpu=True)
    with pytest.raises(ConfigError, match="bf16.enabled: true, but this run is on the CPU"):
        build_ds_config(cfg, {**raw, "bf16": {"enabled": True}}, world_size=2, accum=2, cpu=True)


def test_batch_layout_errors():
    from iga_ds.train.batching import check_batch_layout

    assert check_batch_layout(8, 2, 2) == 2
    with pytest.raises(ConfigError, match="multiple of the world size 3"):
        check_batch_layout(8, 2, 3)
    with pytest.raises(ConfigError, match="groups_per_micro_batch"):
        check_batch_layout(8, 3, 2)


# -- schedule --------------------------------------------------------------------------------


def test_lr_schedule_matches_a_literal_warmup_cosine():
    from iga_ds.train.optim import lr_lambda

    total, ratio, floor = 100, 0.03, 0.1
    f = lr_lambda(total, ratio, floor)
    warm = 3  # ceil(0.03 * 100)
    for step in range(total):
        if step < warm:
            ref = (step + 1) / warm
        else:
            progress = (step - warm) / (total - warm)
            ref = floor + (1 - floor) * (1 + math.cos(math.pi * progress)) / 2
        assert f(step) == pytest.approx(ref, abs=1e-12)
    assert f(warm) == pytest.approx(1.0) and f(total - 1) > floor


# -- batching --------------------------------------------------------------------------------


def test_sampler_batches_do_not_depend_on_the_world_size():
    from iga_ds.train.batching import GroupSampler

    s = GroupSampler(num_groups=23, groups_per_step=4, seed=5)
    assert s.steps_per_epoch == 5
    for step in range(12):
        whole = s.step_groups(step)
        assert len(set(whole)) == 4
        assert sum((s.rank_groups(step, r, 2) for r in range(2)), []) == whole
        assert sum((s.rank_groups(step, r, 4) for r in range(4)), []) == whole
    # an epoch visits distinct groups; the next epoch is another permutation
    epoch0 = sum((s.step_groups(i) for i in range(5)), [])
    assert len(set(epoch0)) == 20
    assert s.epoch_order(0) != s.epoch_order(1)


def test_incomplete_groups_are_dropped_and_domains_ordered(tmp_path):
    from iga_ds.data.groups import complete_groups
    from iga_ds.train.batching import read_records

    recs = read_records(write_isomer_jsonl(tmp_path / "d.jsonl", 3))
    recs = [r for r in recs if not (r["group_id"] == "g0001" and r["domain"] == "legal")]
    groups = complete_groups(list(reversed(recs)), DOMAINS)
    assert sorted(g[0]["group_id"] for g in groups) == ["g0000", "g0002"]
    assert all([r["domain"] for r in g] == DOMAINS for g in groups)


class _CharTokenizer:
    """One id per character: makes the expected masks easy to write down."""

    bos_token_id, eos_token_id, pad_token_id = 1, 2, 0

    def __call__(self, text, add_special_tokens=False):
        return {"input_ids": [3 + ord(c) % 50 for c in text]}


def test_prompt_is_masked_and_target_kept():
    from iga_ds.train.batching import IGNORE_INDEX, encode_example

    ids, labels = encode_example(_CharTokenizer(), "abc", "xy", max_length=64)
    assert len(ids) == 1 + 3 + 2 + 1
    assert labels == [IGNORE_INDEX] * 4 + ids[4:]
    # too long: the prompt loses its beginning, the target stays whole
    ids, labels = encode_example(_CharTokenizer(), "abcdefgh", "xy", max_length=6)
    assert len(ids) == 6 and labels[-3:] == ids[-3:] and labels.count(IGNORE_INDEX) == 3


def test_collate_pads_and_assigns_domain_ids(tmp_path):
    from iga_ds.data.groups import complete_groups
    from iga_ds.train.batching import IGNORE_INDEX, collate, read_records

    groups = complete_groups(read_records(write_isomer_jsonl(tmp_path / "d.jsonl", 2)), DOMAINS)
    mb = collate(_CharTokenizer(), groups, DOMAINS, max_length=512)
    assert mb.domain_ids.tolist() == [0, 1, 2, 3, 0, 1, 2, 3]
    assert (mb.labels[mb.attention_mask == 0] == IGNORE_INDEX).all()
    assert mb.num_target_tokens == int((mb.labels != IGNORE_INDEX).sum())


def test_sequence_losses_match_a_float64_loop():
    import torch

    from iga_ds.train.batching import IGNORE_INDEX, sequence_losses

    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(3, 7, 11, generator=gen)
    labels = torch.randint(0, 11, (3, 7), generator=gen)
    labels[0, :3] = IGNORE_INDEX
    labels[1, 5:] = IGNORE_INDEX
    labels[2, :6] = IGNORE_INDEX
    got = sequence_losses(logits, labels)
    for b in range(3):
        terms = []
        for t in range(6):
            y = int(labels[b, t + 1])
            if y != IGNORE_INDEX:
                logp = torch.log_softmax(logits[b, t].double(), dim=-1)
                terms.append(-float(logp[y]))
        assert float(got[b]) == pytest.approx(sum(terms) / len(terms), rel=1e-6)


# -- tokenizer and tiny base -----------------------------------------------------------------


def test_word_tokenizer_is_lossless_and_word_level():
    from iga_ds.train.model import build_vocab, build_word_tokenizer

    corpus = ["the dose is 12 .\nAnswer: yes", "the fine is 3 ."]
    tok = build_word_tokenizer(build_vocab(corpus))
    for text in corpus + ["the 907 !"]:
        assert tok.decode(tok(text, add_special_tokens=False)["input_ids"]) == text
    # words outside the generator's vocabulary are unknown; digits and punctuation never are
    assert tok.decode(tok("an unseen dose, 907!", add_special_tokens=False)["input_ids"]) == "[UNK][UNK] dose, 907!"
    pieces = tok.convert_ids_to_tokens(tok("the dose is 12", add_special_tokens=False)["input_ids"])
    assert pieces == ["the", " dose", " is", " 1", "2"]


def test_generator_words_cover_everything_the_generator_writes():
    # the built-in base's vocabulary: a cue word missing from it is one [UNK] for every domain,
    # and a planted shortcut becomes invisible to the model
    from iga_ds.data.synth import generate_groups
    from iga_ds.train.batching import unknown_words
    from iga_ds.train.model import build_vocab, build_word_tokenizer
    from iga_ds.train.pretrain import generator_words

    tok = build_word_tokenizer(build_vocab([], generator_words()))
    records = generate_groups(300, seed=11, shortcut=0.9) + generate_groups(100, seed=12, neutral_cue=True)
    assert unknown_words(tok, records, limit=len(records)) == (0.0, [])
    bare = build_word_tokenizer(build_vocab(["x is convex ."]))
    rate, examples = unknown_words(bare, records[:20])
    assert rate > 0.1 and len(examples) == 5 and all(w.isalpha() for w in examples)


def test_tiny_base_is_cached_by_content(tmp_path):
    from iga_ds.config.run import TinyBaseConfig
    from iga_ds.train.model import ensure_tiny_base

    cfg = TinyBaseConfig(hidden_size=16, intermediate_size=32, num_layers=1, num_heads=2, max_length=32,
                         steps=2, batch_size=2, warmup_steps=1)
    calls = []
    texts = ["the dose is 3 .", "the fine is 4 ."]
    first = ensure_tiny_base(texts, cfg, tmp_path, progress=False, log=calls.append)
    again = ensure_tiny_base(texts, cfg, tmp_path, progress=False, log=calls.append)
    other = ensure_tiny_base(texts + ["more text"], cfg, tmp_path, progress=False, log=calls.append)
    assert first == again != other
    assert sum("pretraining" in c for c in calls) == 2 and any("cached" in c for c in calls)
    assert not list((tmp_path / "tiny-base").glob(".*tmp"))  # nothing half-written left behind
    from transformers import AutoModelForCausalLM

    assert AutoModelForCausalLM.from_pretrained(first).config.model_type == "llama"


def test_tiny_base_settings_need_the_built_in_base(tmp_path):
    from iga_ds.config.run import load_run_config

    path = tmp_path / "run.yaml"
    path.write_text("output_dir: out\n")
    with pytest.raises(ConfigError, match="shapes the built-in base only"):
        load_run_config(path, ["model.name_or_path=" + str(tmp_path), "model.tiny={steps: 20}"])


def test_trainer_builds_the_tiny_base_the_config_shapes(tmp_path, monkeypatch):
    import json
    from types import SimpleNamespace

    from iga_ds.config.run import load_run_config
    from iga_ds.config.run import TinyBaseConfig
    from iga_ds.train.trainer import Trainer

    monkeypatch.setenv("IGA_DS_CACHE", str(tmp_path / "cache"))
    from tiny_models import SHRUNK_TINY_BASE as shape
    path = tmp_path / "run.yaml"
    path.write_text("output_dir: out\n")
    cfg = load_run_config(path, ["model.tiny=" + json.dumps(shape)])
    trainer = Trainer(cfg, quiet=True)
    trainer.dist = SimpleNamespace(rank=0)
    base = trainer._resolve_base([])
    written = json.loads((Path(base) / "pretrain.json").read_text())
    assert written["config"] == TinyBaseConfig(**shape).to_dict()
    assert Path(base).parent == tmp_path / "cache" / "tiny-base"


def test_tiny_base_key_keeps_cpu_builds_apart_from_gpu_builds():
    from iga_ds.config.run import TinyBaseConfig
    from iga_ds.train.model import tiny_base_key

    cfg, texts = TinyBaseConfig(), ["the dose is 3 ."]
    cpu = tiny_base_key(cfg, texts)
    assert tiny_base_key(cfg, texts, device="cpu") == cpu
    assert tiny_base_key(cfg, texts, device="cuda") != cpu
    assert tiny_base_key(TinyBaseConfig(corpus_groups=601), texts) != cpu


def test_corpus_groups_sizes_the_pretraining_corpus(tmp_path, monkeypatch):
    from iga_ds.train import pretrain
    from iga_ds.config.run import load_run_config
    from iga_ds.config.run import TinyBaseConfig

    asked = []
    monkeypatch.setenv("IGA_DS_CACHE", str(tmp_path / "cache"))  # no record of the user's cache answers
    monkeypatch.setattr(pretrain, "generator_corpus", lambda groups, seed: asked.append(groups) or ["a b ."])
    folder = tmp_path / "tiny-base" / ("0" * 16)
    monkeypatch.setattr(pretrain, "ensure_tiny_base", lambda texts, config, *a, **k: folder)
    pretrain.default_tiny_base(TinyBaseConfig(corpus_groups=7))
    pretrain.default_tiny_base(TinyBaseConfig(corpus_groups=7), groups=3)  # an explicit size wins
    pretrain.default_tiny_base()
    assert asked == [7, 3, TinyBaseConfig().corpus_groups]
    path = tmp_path / "run.yaml"
    path.write_text("output_dir: out\n")
    assert load_run_config(path, ["model.tiny={corpus_groups: 2000}"]).model.tiny == {"corpus_groups": 2000}
    with pytest.raises(ConfigError, match="model.tiny.corpus_groups: expected a positive integer"):
        load_run_config(path, ["model.tiny={corpus_groups: 0}"])


def _build_on_rank(rank: int, world: int, port: int, root: str) -> None:
    import os

    import torch.distributed as tdist

    from iga_ds.config.run import TinyBaseConfig
    from iga_ds.train.model import ensure_tiny_base

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    tdist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        cfg = TinyBaseConfig(hidden_size=16, intermediate_size=32, num_layers=1, num_heads=2, max_length=32,
                             steps=2, batch_size=2, warmup_steps=1)
        ensure_tiny_base(["the dose is 3 ."], cfg, f"{root}/rank{rank}", progress=False, log=lambda m: None)
    finally:
        tdist.destroy_process_group()


def test_a_base_built_on_a_rank_other_than_0_is_complete(tmp_path):
    """save_pretrained writes nothing on rank 1 once torch.distributed is up; the base must not depend on it."""
    import socket

    import torch.multiprocessing as mp
    from transformers import AutoModelForCausalLM

    from iga_ds.train.model import BASE_FILES

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(_build_on_rank, args=(2, port, str(tmp_path)), nprocs=2, join=True)
    for rank in (0, 1):
        (folder,) = (tmp_path / f"rank{rank}" / "tiny-base").iterdir()
        assert all((folder / name).is_file() for name in BASE_FILES), sorted(p.name for p in folder.iterdir())
        assert AutoModelForCausalLM.from_pretrained(folder).config.model_type == "llama"


def test_an_incomplete_cached_base_is_built_again(tmp_path):
    from iga_ds.config.run import TinyBaseConfig
    from iga_ds.train.model import ensure_tiny_base

    cfg = TinyBaseConfig(hidden_size=16, intermediate_size=32, num_layers=1, num_heads=2, max_length=32,
                         steps=2, batch_size=2, warmup_steps=1)
    texts = ["the dose is 3 ."]
    first = ensure_tiny_base(texts, cfg, tmp_path, progress=False, log=lambda m: None)
    (first / "model.safetensors").unlink()  # what an older version could leave behind
    calls = []
    again = ensure_tiny_base(texts, cfg, tmp_path, progress=False, log=calls.append)
    assert again == first and (again / "model.safetensors").is_file()
    assert any("incomplete" in c for c in calls) and any("pretraining" in c for c in calls)
    assert [p.name for p in (tmp_path / "tiny-base").iterdir()] == [first.name]
