"""Small fixtures for the trainer tests: isomer JSON Lines written here, a tiny base built
from them in a few steps, and run configs pointing at both."""
from __future__ import annotations

import json
import random
from pathlib import Path

DOMAINS = ["math", "medical", "legal", "science"]
_NOUNS = {
    "math": ("x", "y", "plus"),
    "medical": ("dose", "level", "added to"),
    "legal": ("fine", "penalty", "added to"),
    "science": ("mass", "weight", "added to"),
}


def write_isomer_jsonl(path: Path, groups: int, seed: int = 0, domains=DOMAINS) -> Path:
    """``groups`` isomer groups, one record per domain, in the public field layout."""
    rng = random.Random(seed)
    lines = []
    for g in range(groups):
        a, b = rng.randint(1, 9), rng.randint(1, 9)
        for d in domains:
            first, second, op = _NOUNS[d]
            lines.append(json.dumps({
                "group_id": f"g{g:04d}",
                "seed_id": f"s{g:04d}",
                "domain": d,
                "problem": f"the {first} is {a} . the {second} is the {first} {op} {b} . what is the {second} ?",
                "cot": f"the {second} is {a} + {b} = {a + b} .",
                "answer": str(a + b),
            }))
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


def tiny_base(tmp_path: Path, data: Path) -> Path:
    """A tiny base pretrained for a handful of steps on the fixture text (cached under tmp)."""
    from iga_ds.train.batching import read_records
    from iga_ds.config.run import TinyBaseConfig
    from iga_ds.train.model import ensure_tiny_base
    from iga_ds.train.pretrain import corpus_texts

    cfg = TinyBaseConfig(hidden_size=32, intermediate_size=64, num_layers=1, num_heads=2, max_length=128,
                         steps=3, batch_size=4, warmup_steps=1)
    return ensure_tiny_base(corpus_texts(read_records(data)), cfg, cache_dir=tmp_path / "cache",
                            progress=False, log=lambda *_: None)


def run_config_dict(tmp_path: Path, data: Path, **over) -> dict:
    cfg = {
        "output_dir": str(tmp_path / "run"),
        "deepspeed": str(Path(__file__).resolve().parents[1] / "ds_configs" / "zero2_fp32.json"),
        "lora": {"r": 4, "alpha": 8},
        "data": {"train": str(data), "groups_per_step": 2, "groups_per_micro_batch": 1, "max_length": 96},
        "schedule": {"lr": 5e-3, "max_steps": 4},
        "method": {"name": "erm"},
        "logging": {"progress": False},
        "seed": 3,
    }
    for key, value in over.items():
        node = cfg
        *parents, last = key.split(".")
        for p in parents:
            node = node.setdefault(p, {})
        node[last] = value
    return cfg


def test_fixture_groups_are_complete(tmp_path):
    from iga_ds.data.groups import complete_groups
    from iga_ds.train.batching import read_records

    path = write_isomer_jsonl(tmp_path / "d.jsonl", groups=5)
    groups = complete_groups(read_records(path), DOMAINS)
    assert len(groups) == 5
    assert all([r["domain"] for r in g] == DOMAINS for g in groups)
    # isomers share the answer: the same logical problem in four surface forms
    assert all(len({r["answer"] for r in g}) == 1 for g in groups)


def test_a_training_after_the_process_group_was_destroyed_in_this_process(tmp_path):
    # DeepSpeed keeps a clone of the first world group per process; a second training after
    # destroy_process_group (a notebook, launch/train.py's exit) must not reach for that clone
    import torch.distributed as tdist

    from iga_ds.config.run import config_from_dict
    from iga_ds.train.trainer import Trainer

    data = write_isomer_jsonl(tmp_path / "train.jsonl", groups=4, seed=3)
    base = tiny_base(tmp_path, data)
    for attempt in ("first", "second"):
        over = {"model.name_or_path": str(base), "schedule.max_steps": 1, "output_dir": str(tmp_path / attempt)}
        result = Trainer(config_from_dict(run_config_dict(tmp_path, data, **over)), quiet=True).run()
        assert result.status == "completed", attempt
        assert tdist.is_initialized()
        tdist.destroy_process_group()
