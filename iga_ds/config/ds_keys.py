"""The keys of a DeepSpeed JSON, read from the installed DeepSpeed, and the check that stops a
run on a key DeepSpeed does not know.

DeepSpeed ignores a top-level key it does not know: ``zero_optimisation`` (British spelling) or
``gradient_clip`` would train to the end without ZeRO or clipping. Here such a key is one line
naming the file, the key and the nearest known key, before anything starts.

What is known comes from the installed DeepSpeed's public modules, so that an upgrade needs no
list kept by hand:

- the top level: every key DeepSpeed's config constants name (:data:`CONSTANT_MODULES`; the
  constants do not say at which level a key sits, so a key of a section is also accepted at the
  top level: the check finds misspellings, not keys in the wrong place), the fields of its
  pydantic models whose fields are top-level sections (:data:`TOP_LEVEL_MODELS`), and the
  section names below;
- inside a section with a pydantic model (:data:`SECTION_MODELS`): the model's fields and their
  aliases, and below them the fields of the models they hold (``zero_optimization.offload_optimizer``);
- inside a section DeepSpeed reads from constants of one prefix (:data:`SECTION_CONSTANTS`):
  those constants.

Where DeepSpeed has neither, a short list here says what is known (:data:`SECTION_KEYS`,
:data:`LITERAL_KEYS`, :data:`OTHER_KEYS`). The contents of any other section are left to
DeepSpeed; the ``iga`` block is checked by :class:`iga_ds.config.hook.HookConfig`.
DeepSpeed is imported when a file is checked (it must see ``DS_ACCELERATOR`` first), and only
its public modules and names are read.
"""
from __future__ import annotations

import difflib
import functools
import importlib
import re
import types
import typing
from typing import Any, Optional, Union

from pydantic import BaseModel

from iga_ds.config.hook import BLOCK
from iga_ds.errors import ConfigError

# DeepSpeed's config constants: every upper-case constant whose value is spelled like a key
CONSTANT_MODULES = (
    "deepspeed.runtime.constants",
    "deepspeed.runtime.config",
    "deepspeed.runtime.zero.config",
    "deepspeed.runtime.precision_config",
    "deepspeed.runtime.activation_checkpointing.config",
    "deepspeed.runtime.data_pipeline.constants",
    "deepspeed.runtime.swap_tensor.constants",
    "deepspeed.runtime.model_checkpointing.constants",
    "deepspeed.profiling.constants",
    "deepspeed.autotuning.constants",
    "deepspeed.comm.constants",
    "deepspeed.utils.config",
    "deepspeed.datastates.config",
)
# DeepSpeed's pydantic models whose fields are top-level sections (the monitors)
TOP_LEVEL_MODELS = (("deepspeed.monitor.config", "DeepSpeedMonitorConfig"),)
# a section -> the DeepSpeed pydantic model that reads it
SECTION_MODELS = {
    "zero_optimization": ("deepspeed.runtime.zero.config", "DeepSpeedZeroConfig"),
    "bf16": ("deepspeed.runtime.precision_config", "DeepSpeedBF16Config"),
    "bfloat16": ("deepspeed.runtime.precision_config", "DeepSpeedBF16Config"),  # the older name of bf16
    "fp16": ("deepspeed.runtime.precision_config", "DeepSpeedFP16Config"),
    "comms_logger": ("deepspeed.comm.config", "CommsLoggerConfig"),
    "compile": ("deepspeed.compile.config", "CompileConfig"),
    "tensor_parallel": ("deepspeed.runtime.tensor_parallel.config", "TPTrainingConfig"),
}
# a section -> (the module, the prefix of the constants that name its keys)
SECTION_CONSTANTS = {
    "activation_checkpointing": ("deepspeed.runtime.activation_checkpointing.config", "ACT_CHKPT_"),
    "flops_profiler": ("deepspeed.profiling.constants", "FLOPS_PROFILER_"),
}
# sections DeepSpeed reads as plain dicts, by hand: their keys (runtime/config.py's optimizer and
# scheduler readers; iga-ds then checks the blocks against the run YAML)
SECTION_KEYS = {
    "optimizer": ("type", "params", "legacy_fusion"),
    "scheduler": ("type", "params"),
}
# top-level keys DeepSpeed reads by a literal name rather than a constant
LITERAL_KEYS = ("pipeline", "hybrid_engine", "weight_quantization", "compile", "tensor_parallel")
# top-level keys known to iga-ds though not read by DeepSpeed: its own block; Apex's amp and
# elasticity (dropped when off, refused when on); comms_config and monitor_config, which
# LLaMA-Factory's published ZeRO configs carry (DeepSpeed reads neither: left as they are)
OTHER_KEYS = (BLOCK, "amp", "elasticity", "comms_config", "monitor_config")
_KEY = re.compile(r"^[a-z][a-z0-9_]*$")

# a section's known keys -> what is known inside each (None: not checked)
KeyTree = dict[str, Optional["KeyTree"]]


def _module(name: str) -> types.ModuleType | None:
    """One of DeepSpeed's public modules, or None where this release has none of that name."""
    try:
        return importlib.import_module(name)
    except ImportError:
        return None


def _constant_keys(name: str, prefix: str = "") -> set[str]:
    """The values of a module's upper-case string constants (those starting with ``prefix``)
    that are spelled like keys; defaults and format examples left out."""
    module = _module(name)
    if module is None:
        return set()
    return {value for const, value in vars(module).items()
            if const.isupper() and const.startswith(prefix) and const != prefix.rstrip("_")
            and not const.endswith(("_DEFAULT", "_FORMAT")) and isinstance(value, str) and _KEY.match(value)}


def _model_class(annotation: Any) -> type | None:
    """The pydantic model a field holds (through Optional and Union), or None."""
    if typing.get_origin(annotation) in (Union, types.UnionType):
        found = [m for m in map(_model_class, typing.get_args(annotation)) if m is not None]
        return found[0] if found else None
    return annotation if isinstance(annotation, type) and issubclass(annotation, BaseModel) else None


def _model_tree(model: type, depth: int = 0) -> KeyTree:
    """The keys a pydantic model accepts (field names and aliases), each with the keys of the
    model it holds, if any."""
    tree: KeyTree = {}
    for name, info in model.model_fields.items():
        inner = _model_class(info.annotation)
        child = _model_tree(inner, depth + 1) if inner is not None and depth < 4 else None
        aliases = [info.alias, info.validation_alias]
        choices = getattr(info.validation_alias, "choices", None)
        aliases += list(choices or ())
        for key in [name, *aliases]:
            if isinstance(key, str):
                tree[key] = child
    return tree


def _section_trees() -> KeyTree:
    """The sections whose contents are checked, each with its known keys."""
    sections: KeyTree = {key: dict.fromkeys(keys) for key, keys in SECTION_KEYS.items()}
    for key, (module_name, prefix) in SECTION_CONSTANTS.items():
        keys = _constant_keys(module_name, prefix)
        sections[key] = dict.fromkeys(keys) if keys else None
    for module_name, class_name in TOP_LEVEL_MODELS:
        model = getattr(_module(module_name), class_name, None)
        sections.update(_model_tree(model) if model is not None else {})
    for key, (module_name, class_name) in SECTION_MODELS.items():
        model = getattr(_module(module_name), class_name, None)
        sections[key] = _model_tree(model) if model is not None else None
    return sections


@functools.lru_cache(maxsize=1)
def known_keys() -> KeyTree:
    """Every top-level key the installed DeepSpeed (and iga-ds) knows, each with what is known
    inside it (None: its contents are not checked)."""
    tree: KeyTree = {}
    for name in CONSTANT_MODULES:
        tree.update(dict.fromkeys(_constant_keys(name)))
    tree.update(dict.fromkeys(LITERAL_KEYS + OTHER_KEYS))
    tree.update(_section_trees())
    tree[BLOCK] = None  # checked by the hook's own validator
    return tree


def deepspeed_version() -> str:
    import deepspeed  # heavy: only when a DeepSpeed config is checked

    return str(getattr(deepspeed, "__version__", "?"))


def check_known_keys(ds: dict[str, Any], source: str) -> None:
    """A ConfigError naming ``source``, the key's dotted path and the nearest known key, for the
    first key of ``ds`` that the installed DeepSpeed does not know."""
    _check_level(ds, known_keys(), source, "")


def _check_level(node: dict[str, Any], known: KeyTree, source: str, where: str) -> None:
    for key, value in node.items():
        dotted = f"{where}.{key}" if where else str(key)
        if key not in known:
            raise ConfigError(_unknown(dotted, str(key), known, source))
        inner = known[key]
        if inner is not None and isinstance(value, dict):
            _check_level(value, inner, source, dotted)


def _unknown(dotted: str, key: str, known: KeyTree, source: str) -> str:
    """The one line for an unknown key: the nearest known one, or (in a section) all of them."""
    where = f"DeepSpeed {deepspeed_version()}"
    near = difflib.get_close_matches(key, list(known), n=1, cutoff=0.6)
    if near:
        return f"{source}: {dotted}: not a key of {where}; did you mean {near[0]!r}?"
    listed = f" (expected one of: {', '.join(sorted(known))})" if "." in dotted else ""
    return f"{source}: {dotted}: not a key of {where}{listed}; remove it"
