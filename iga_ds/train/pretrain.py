"""The default built-in base: the tiny LLaMA pretrained on text of the procedural generator.

``iga-ds pretrain-tiny`` and ``model.name_or_path: builtin:tiny`` both land here. The corpus
is shortcut-free generator output (its own seed, apart from the demo's data seeds), rendered
with the same prompt and target format as fine-tuning. Its cue sentences are neutral (the
slot word is independent of the answer): the base reads the cue words without learning the
shortcut, so that a shortcut planted in fine-tuning data is visible to the model and not an
unknown token. The tokenizer's vocabulary is the corpus's words plus every word the
generator can emit. See ``iga_ds.train.model`` for the model and the cache.
"""
from __future__ import annotations

import dataclasses
import re
from pathlib import Path
from typing import Sequence

from iga_ds.config.run import TinyBaseConfig
from iga_ds.data.domains import DOMAINS
from iga_ds.data.patterns import BOOLEAN_ANSWERS
from iga_ds.data.prompts import format_prompt, format_target
from iga_ds.data.synth import generate_groups
from iga_ds.errors import ConfigError
from iga_ds.train.batching import format_example
from iga_ds.train.model import ensure_tiny_base

PRETRAIN_GROUPS = TinyBaseConfig().corpus_groups
PRETRAIN_SEED = 9_001  # far from the seeds the demo and the example configs use


def corpus_texts(records: Sequence[dict]) -> list[str]:
    out = []
    for rec in records:
        prompt, target = format_example(rec)
        out.append(prompt + target)
    return out


def generator_corpus(groups: int = PRETRAIN_GROUPS, seed: int = PRETRAIN_SEED) -> list[str]:
    """Texts of ``groups`` freshly generated, shortcut-free isomer groups: the training split's,
    then the test split's (the order ``iga-ds data synth`` writes them in)."""
    if groups < 1:
        raise ConfigError(f"the pretraining corpus needs at least one group, got {groups}")
    records = generate_groups(groups, seed, shortcut=0.0, neutral_cue=True)
    ordered = [r for split in ("train", "test") for r in records if r["meta"]["split"] == split]
    return corpus_texts(ordered)


def generator_words() -> list[str]:
    """Every word the procedural generator can write in any domain (sorted), so that the base's
    vocabulary covers data generated with other seeds, patterns or cues than its corpus."""
    words: set[str] = set()

    def visit(value) -> None:
        if isinstance(value, str):
            words.update(re.findall(r"[A-Za-z]+", re.sub(r"\{[^}]*\}", " ", value)))
        elif isinstance(value, dict):
            for v in value.values():
                visit(v)
        elif isinstance(value, (tuple, list)):
            for v in value:
                visit(v)

    visit(BOOLEAN_ANSWERS)
    visit(format_prompt({"problem": ""}) + format_target({"cot": "", "answer": ""}))
    for domain in DOMAINS.values():
        for f in dataclasses.fields(domain):
            visit(getattr(domain, f.name))
        for status in ("proven", "refuted", "unknown"):  # closing lines are written in code
            visit(domain.conclusion("class", status, z="", b=""))
            visit(domain.conclusion("prop", status, s="", q=""))
    return sorted(words)


def default_tiny_base(
    config: TinyBaseConfig | None = None,
    groups: int | None = None,
    seed: int = PRETRAIN_SEED,
    cache_dir: str | None = None,
    progress: bool = True,
    log=print,
) -> Path:
    """Folder of the cached tiny base, pretraining it first on a cache miss. ``groups``: the
    corpus size, default ``config.corpus_groups``."""
    config = config or TinyBaseConfig()
    texts = generator_corpus(config.corpus_groups if groups is None else groups, seed)
    return ensure_tiny_base(texts, config, cache_dir, progress=progress, log=log, extra_words=generator_words())
