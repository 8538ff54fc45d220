"""``iga-ds export``: a trained adapter merged into its base for serving, or the adapter alone
with its base named portably; both with a model card.

The source is a training run's folder (its final ``adapter/``), an adapter folder (a run's, a
checkpoint's ``RUN/checkpoints/TAG/adapter``, or one on its own) or a checkpoint's folder. The
base is the one the adapter names (``adapter_config.json``, a relative path against the
adapter's folder, ``builtin:tiny`` in the shape ``tiny_base.json`` records), read from the run's
own ``resolved.base_model_dir`` where that folder is still there.

- merge (the default): base + adapter in float32, PEFT's ``merge_and_unload``, cast to
  ``--dtype``; safetensors weights, the tokenizer (with its chat template, if any), the prompt
  format the adapter was trained with, and a model card. ``AutoModelForCausalLM.from_pretrained``
  loads the folder alone.
- ``--adapter-only``: the adapter's files with ``base_model_name_or_path`` written portably (a hub
  id, ``packaged:NAME``, ``builtin:tiny``, or a path relative to the output folder) and the card.

Everything is written into a temporary folder beside ``--out`` and renamed at the end. Only
safetensors are read or written, and no remote code runs unless asked (``--trust-remote-code``).
"""
from __future__ import annotations

import os
import shutil
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from iga_ds.config.run import ADAPTER_CONFIG, RUN_CONFIG, locate_adapter
from iga_ds.data.prompts import PROMPT_FORMAT_FILE, saved_prompt_format
from iga_ds.errors import UserError
from iga_ds.files import follow_umask, make_dir, read_json, read_yaml_file
from iga_ds.models import TOKENIZER_FILES, check_model_source, load_auto_tokenizer, load_causal_lm
from iga_ds.train.model_card import (CARD_FILE, TINY_FILE, CardFacts, adapter_base,
                                     base_location, name_base, read_tiny, run_facts, set_base,
                                     write_card)

DTYPES = ("float32", "bfloat16", "float16")
ADAPTER_WEIGHTS = "adapter_model.safetensors"
EXPECTED = "a training run's folder (with adapter/), an adapter folder (adapter_config.json) or a checkpoint's folder"


@dataclass
class Found:
    """The adapter to export, and the run whose settings apply (None: an adapter on its own)."""

    adapter: Path
    run: Path | None = None
    step: int | None = None  # a checkpoint's step; None: the run's end


@dataclass
class ExportSettings:
    source: str
    out: str
    adapter_only: bool = False
    dtype: str = "float32"
    overwrite: bool = False
    trust_remote_code: bool = False
    progress: bool = True


def _checkpoint_step(adapter: Path) -> int | None:
    meta = adapter.parent / "meta.json"
    if not meta.is_file():
        return None
    step = read_json(meta, objects=True, error=UserError).get("step")
    return int(step) if isinstance(step, int) else None


def find_adapter(given: str) -> Found:
    """What ``given`` names: a run folder, an adapter folder or a checkpoint's folder."""
    path = Path(given).expanduser()
    if not path.exists():
        raise UserError(f"{given}: no such folder; expected {EXPECTED}")
    if not path.is_dir():
        raise UserError(f"{given}: not a folder; expected {EXPECTED}")
    found = locate_adapter(path, given)
    if found is None:
        raise UserError(f"{given}: no {ADAPTER_CONFIG} in it; expected {EXPECTED}")
    path, run = found
    if not (path / ADAPTER_WEIGHTS).is_file():
        raise UserError(f"{given}: no {ADAPTER_WEIGHTS} in it (only safetensors weights are read); expected {EXPECTED}")
    return Found(path) if run is None else Found(path, run, _checkpoint_step(path))


def check_out(out: str, overwrite: bool, found: Found) -> Path:
    """``--out`` as a path: refused when it exists and holds something (unless ``overwrite``), or
    when it holds the adapter being exported."""
    path = Path(out).expanduser()
    if path.exists() and not path.is_dir():
        raise UserError(f"--out {out}: exists and is not a folder; expected a new or empty folder")
    if path.is_dir() and any(path.iterdir()) and not overwrite:
        raise UserError(f"--out {out}: exists and is not empty; give --overwrite to replace it")
    if path.exists() and found.adapter.resolve().is_relative_to(path.resolve()):
        raise UserError(f"--out {out}: holds the adapter being exported ({found.adapter}); choose another folder")
    make_dir(path.parent)  # a parent that cannot be made: one line naming it
    return path


def base_to_load(found: Found, spec: str, tiny: dict | None, progress: bool, log: Callable[[str], None]) -> str:
    """What loads the base the adapter names (``spec``, resolved; ``tiny``: the built-in base's
    shape): the run's own base folder where it is still there, else ``spec`` through the resolvers."""
    if found.run is not None:
        cfg = read_yaml_file(found.run / RUN_CONFIG, "run config")
        folder = ((cfg or {}).get("resolved") or {}).get("base_model_dir") if isinstance(cfg, dict) else None
        if folder and Path(folder).is_dir():
            return str(folder)
    return base_location(spec, tiny, progress=progress, log=log)


def facts_of(found: Found, ref: str, tiny: dict | None) -> CardFacts:
    """What the card says: the run's record, else what the adapter folder itself tells."""
    if found.run is not None:
        return run_facts(found.run, ref, found.step, tiny)
    config = read_json(found.adapter / ADAPTER_CONFIG, objects=True, error=UserError)
    modules = config.get("target_modules")
    lora = {"r": config.get("r"), "alpha": config.get("lora_alpha"), "dropout": config.get("lora_dropout"),
            "target_modules": sorted(modules) if isinstance(modules, (list, tuple)) else modules,
            "rslora": config.get("use_rslora")}
    return CardFacts(base=ref, tiny=tiny, lora={k: v for k, v in lora.items() if v is not None},
                     prompt_format=saved_prompt_format(found.adapter))


def _load_base(location: str, trust_remote_code: bool):
    """The base in float32: through iga_ds.models (no remote code), or with remote code when asked."""
    import torch

    if not trust_remote_code:
        return load_causal_lm(location, "base model", torch.float32)
    from transformers import AutoModelForCausalLM

    source = check_model_source(location, "base model")
    kwargs = {**source.pretrained_kwargs(), "trust_remote_code": True, "dtype": torch.float32}
    return AutoModelForCausalLM.from_pretrained(source.location, **kwargs)


def write_merged(found: Found, location: str, folder: Path, dtype: str, trust_remote_code: bool) -> None:
    """Base + adapter merged, cast to ``dtype``, saved as safetensors with the tokenizer."""
    import torch
    from peft import PeftModel

    model = PeftModel.from_pretrained(_load_base(location, trust_remote_code), str(found.adapter),
                                      is_trainable=False)
    merged = model.merge_and_unload().to(getattr(torch, dtype)).eval()
    merged.save_pretrained(str(folder), safe_serialization=True)
    has_own = any((found.adapter / f).is_file() for f in TOKENIZER_FILES)
    tokenizer = load_auto_tokenizer(str(found.adapter) if has_own else location, "tokenizer")
    tokenizer.save_pretrained(str(folder))
    if (found.adapter / PROMPT_FORMAT_FILE).is_file():
        shutil.copy2(found.adapter / PROMPT_FORMAT_FILE, folder / PROMPT_FORMAT_FILE)
    follow_umask(folder)  # safetensors writes the weights 0600; the model is read like every other output


def write_adapter(found: Found, spec: str, tiny: dict | None, folder: Path) -> str:
    """The adapter's files (not PEFT's card, nor a .bin) with its base named portably from ``folder``."""
    skip = {CARD_FILE, TINY_FILE}
    shutil.copytree(found.adapter, folder, ignore=lambda _, names: [n for n in names if n in skip
                                                                    or n.endswith((".bin", ".pt", ".pth"))])
    base = set_base(folder, spec, tiny)
    follow_umask(folder)  # an adapter copied from a run of an earlier release may be 0600
    return base


def _replace(tmp: Path, out: Path) -> None:
    """``tmp`` becomes ``out``; an existing ``out`` (empty, or given up with --overwrite) goes."""
    old = out.with_name(f".{out.name}.{os.getpid()}.old")
    if out.exists():
        os.rename(out, old)
    os.rename(tmp, out)
    shutil.rmtree(old, ignore_errors=True)


def export(settings: ExportSettings, log: Callable[[str], None] | None = None) -> Path:
    """Write the export ``settings`` ask for; returns the output folder."""
    log = log or (lambda msg: print(msg, file=sys.stderr, flush=True))
    if settings.dtype not in DTYPES:
        raise UserError(f"--dtype {settings.dtype}: expected one of {', '.join(DTYPES)}")
    found = find_adapter(settings.source)
    out = check_out(settings.out, settings.overwrite, found)
    spec, tiny = adapter_base(found.adapter), read_tiny(found.adapter)  # the base, as the adapter names it
    tmp = out.with_name(f".{out.name}.{os.getpid()}.tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        if settings.adapter_only:
            ref = write_adapter(found, spec, tiny, tmp)
        else:
            location = base_to_load(found, spec, tiny, settings.progress, log)
            log(f"merging {found.adapter} into its base ({settings.dtype})")
            write_merged(found, location, tmp, settings.dtype, settings.trust_remote_code)
            ref, tiny = name_base(spec, tmp, tiny)  # for the card
        write_card(tmp, facts_of(found, ref, read_tiny(tmp) if settings.adapter_only else tiny),
                   merged=not settings.adapter_only)
        _replace(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out


def describe(settings: ExportSettings, out: Path) -> str:
    what = "adapter" if settings.adapter_only else f"merged model ({settings.dtype})"
    return f"wrote the {what} to {out}"
