"""The default built-in base: the tiny LLaMA pretrained on text of the procedural generator.

``iga-ds pretrain-tiny`` and ``model.name_or_path: builtin:tiny`` both land here. The corpus
is shortcut-free generator output (its own seed, apart from the demo's data seeds), rendered
with the same prompt and target format as fine-tuning; the tokenizer's vocabulary is that
corpus's words. See ``iga_ds.train.model`` for the model and the cache.
"""
from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Sequence

from iga_ds.train.model import TinyBaseConfig, ensure_tiny_base

PRETRAIN_GROUPS = 600
PRETRAIN_SEED = 9_001  # far from the seeds the demo and the example configs use


def corpus_texts(records: Sequence[dict]) -> list[str]:
    from iga_ds.train.batching import format_example

    out = []
    for rec in records:
        prompt, target = format_example(rec)
        out.append(prompt + target)
    return out


def generator_corpus(groups: int = PRETRAIN_GROUPS, seed: int = PRETRAIN_SEED) -> list[str]:
    """Texts of ``groups`` freshly generated, shortcut-free isomer groups (all splits)."""
    from iga_ds.data.synth import synthesize
    from iga_ds.train.batching import read_records

    with tempfile.TemporaryDirectory(prefix="iga-ds-corpus-") as tmp:
        synthesize(tmp, groups=groups, seed=seed, shortcut=0.0)
        records = []
        for name in ("train.jsonl", "test.jsonl"):
            if (Path(tmp) / name).is_file():
                records += read_records(Path(tmp) / name)
    return corpus_texts(records)


def default_tiny_base(
    config: TinyBaseConfig | None = None,
    groups: int = PRETRAIN_GROUPS,
    seed: int = PRETRAIN_SEED,
    cache_dir: str | None = None,
    progress: bool = True,
    log=print,
) -> Path:
    """Folder of the cached tiny base, pretraining it first on a cache miss."""
    return ensure_tiny_base(generator_corpus(groups, seed), config, cache_dir, progress=progress, log=log)
