"""The run YAML of ``iga-ds train``: model, tokenizer, LoRA, data, schedule, method, outputs.

Defaults follow the paper's implementation details (LoRA r 16, alpha 32 on q, k, v, o; AdamW
lr 2e-4, cosine decay with 3% linear warmup, weight decay 0.01, betas 0.9/0.999). Every key is
typed; a wrong key or type raises ``ConfigError`` naming the dotted key and what was expected.
"""
from __future__ import annotations

import copy
import dataclasses
import os
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional, Union

import yaml

from iga_ds.errors import ConfigError

BUILTIN_TINY = "builtin:tiny"


@dataclass
class ModelConfig:
    # a local Hugging Face causal-LM directory, or "builtin:tiny" (pretrained here, cached)
    name_or_path: str = BUILTIN_TINY
    dtype: str = "float32"  # float32 | bfloat16 | float16
    gradient_checkpointing: bool = False
    attn_implementation: Optional[str] = "eager"
    # builtin:tiny only: its shape and pretraining (fields of iga_ds.train.model.TinyBaseConfig,
    # e.g. {hidden_size: 256, num_layers: 4, steps: 1500}); each setting is its own cached base
    tiny: dict[str, Any] = field(default_factory=dict)


@dataclass
class LoraSettings:
    r: int = 16
    alpha: float = 32.0
    dropout: float = 0.0
    target_modules: list[str] = field(default_factory=lambda: ["q_proj", "k_proj", "v_proj", "o_proj"])
    rslora: bool = False


@dataclass
class DataConfig:
    train: str = ""  # isomer JSON Lines
    # None: take the domains of the DeepSpeed config's "iga" block
    domains: Optional[list[str]] = None
    groups_per_step: int = 8  # K whole isomer groups per optimizer step, over all ranks
    groups_per_micro_batch: int = 2  # per rank and forward pass; the rest is accumulation
    max_length: int = 512  # prompt + target tokens; longer sequences lose prompt tokens first


@dataclass
class ScheduleConfig:
    lr: float = 2e-4
    warmup_ratio: float = 0.03
    min_lr_ratio: float = 0.0
    weight_decay: float = 0.01
    betas: list[float] = field(default_factory=lambda: [0.9, 0.999])
    eps: float = 1e-8
    epochs: float = 1.0
    max_steps: Optional[int] = None  # overrides epochs when set


@dataclass
class MethodConfig:
    name: str = "erm"
    params: dict[str, Any] = field(default_factory=dict)


@dataclass
class CheckpointConfig:
    every_steps: int = 0  # 0: only at the end and on SIGUSR1/SIGTERM
    keep_last: int = 2
    # save and exit 0 at this global step, as SIGUSR1 would: splits a run over time-boxed jobs
    stop_at_step: Optional[int] = None


@dataclass
class LoggingConfig:
    every_steps: int = 1
    tensorboard: bool = True
    progress: bool = True


@dataclass
class RunConfig:
    output_dir: str = "runs/default"
    deepspeed: str = "ds_configs/zero2_fp32.json"
    model: ModelConfig = field(default_factory=ModelConfig)
    tokenizer: Optional[str] = None  # defaults to the model directory
    lora: LoraSettings = field(default_factory=LoraSettings)
    data: DataConfig = field(default_factory=DataConfig)
    schedule: ScheduleConfig = field(default_factory=ScheduleConfig)
    # None: the method of the DeepSpeed config's "iga" block
    method: Optional[MethodConfig] = None
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    seed: int = 0
    resume: str = "auto"  # auto | never | path to a checkpoint directory

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def validate(self) -> None:
        """Value checks beyond types (types are checked while loading)."""
        checks = [
            (self.lora.r >= 1, "lora.r", "a positive integer"),
            (self.lora.alpha > 0, "lora.alpha", "a positive number"),
            (0 <= self.lora.dropout < 1, "lora.dropout", "a number in [0, 1)"),
            (len(self.lora.target_modules) > 0, "lora.target_modules", "a non-empty list of module names"),
            (self.data.groups_per_step >= 1, "data.groups_per_step", "a positive integer"),
            (self.data.groups_per_micro_batch >= 1, "data.groups_per_micro_batch", "a positive integer"),
            (self.data.max_length >= 8, "data.max_length", "an integer >= 8"),
            (self.schedule.lr > 0, "schedule.lr", "a positive number"),
            (0 <= self.schedule.warmup_ratio < 1, "schedule.warmup_ratio", "a number in [0, 1)"),
            (0 <= self.schedule.min_lr_ratio <= 1, "schedule.min_lr_ratio", "a number in [0, 1]"),
            (self.schedule.weight_decay >= 0, "schedule.weight_decay", "a non-negative number"),
            (len(self.schedule.betas) == 2 and all(0 <= b < 1 for b in self.schedule.betas),
             "schedule.betas", "two numbers in [0, 1)"),
            (self.schedule.epochs > 0, "schedule.epochs", "a positive number"),
            (self.schedule.max_steps is None or self.schedule.max_steps >= 1, "schedule.max_steps",
             "a positive integer or null"),
            (self.checkpoint.every_steps >= 0, "checkpoint.every_steps", "an integer >= 0"),
            (self.checkpoint.stop_at_step is None or self.checkpoint.stop_at_step >= 1,
             "checkpoint.stop_at_step", "a positive integer or null"),
            (self.checkpoint.keep_last >= 1, "checkpoint.keep_last", "an integer >= 1"),
            (self.logging.every_steps >= 1, "logging.every_steps", "a positive integer"),
            (self.model.dtype in ("float32", "bfloat16", "float16"), "model.dtype",
             '"float32", "bfloat16" or "float16"'),
            (bool(self.output_dir), "output_dir", "a directory path"),
        ]
        for ok, key, expected in checks:
            if not ok:
                raise ConfigError(f"{key}: expected {expected}, got {_get_dotted(self, key)!r}")
        if self.model.tiny:
            self._check_tiny()
        if self.data.domains is not None and len(set(self.data.domains)) != len(self.data.domains):
            raise ConfigError(f"data.domains: names must be unique, got {self.data.domains}")
        if self.method is not None and not self.method.name:
            raise ConfigError("method.name: expected a method name")


    def _check_tiny(self) -> None:
        from iga_ds.train.model import TinyBaseConfig

        if self.model.name_or_path != BUILTIN_TINY:
            raise ConfigError(f"model.tiny: shapes the built-in base only; model.name_or_path is {self.model.name_or_path!r}")
        fields = {f.name: f.type for f in dataclasses.fields(TinyBaseConfig)}
        for key, value in self.model.tiny.items():
            if key not in fields:
                raise ConfigError(f"model.tiny.{key}: unknown key; expected one of: {', '.join(fields)}")
            want_int = fields[key] in (int, "int")
            may_be_zero = key in ("seed", "weight_decay", "warmup_steps")
            ok = not isinstance(value, bool) and (isinstance(value, int) if want_int else isinstance(value, (int, float)))
            if not ok or value < 0 or (value == 0 and not may_be_zero):
                kind = "integer" if want_int else "number"
                raise ConfigError(f"model.tiny.{key}: expected a {'non-negative' if may_be_zero else 'positive'} {kind}, got {value!r}")
        try:
            TinyBaseConfig(**self.model.tiny).check()
        except ValueError as exc:
            raise ConfigError(f"model.tiny: {exc}") from None


# -- loading ---------------------------------------------------------------------------------


def _type_name(tp: Any) -> str:
    origin = typing.get_origin(tp)
    if origin in (Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        inner = " or ".join(_type_name(a) for a in args)
        return f"{inner} or null" if len(args) < len(typing.get_args(tp)) else inner
    if origin is list:
        (arg,) = typing.get_args(tp) or (Any,)
        return f"a list of {_type_name(arg)}"
    if origin is dict:
        return "a mapping"
    if dataclasses.is_dataclass(tp):
        return "a mapping"
    return {str: "a string", int: "an integer", float: "a number", bool: "true or false", Any: "any value"}.get(
        tp, getattr(tp, "__name__", str(tp))
    )


def _coerce(value: Any, tp: Any, key: str) -> Any:
    """Check ``value`` against the annotation ``tp``; return it converted (int -> float, dicts ->
    dataclasses) or raise ConfigError naming ``key``."""
    origin = typing.get_origin(tp)
    if tp is Any:
        return value
    if origin in (Union, types.UnionType):
        args = typing.get_args(tp)
        if value is None and type(None) in args:
            return None
        for arg in args:
            if arg is type(None):
                continue
            try:
                return _coerce(value, arg, key)
            except ConfigError:
                continue
        raise ConfigError(f"{key}: expected {_type_name(tp)}, got {value!r}")
    if dataclasses.is_dataclass(tp):
        if not isinstance(value, dict):
            raise ConfigError(f"{key}: expected a mapping, got {value!r}")
        return _build(tp, value, key)
    if origin is list:
        if not isinstance(value, list):
            raise ConfigError(f"{key}: expected {_type_name(tp)}, got {value!r}")
        (arg,) = typing.get_args(tp)
        return [_coerce(v, arg, f"{key}[{i}]") for i, v in enumerate(value)]
    if origin is dict:
        if not isinstance(value, dict):
            raise ConfigError(f"{key}: expected a mapping, got {value!r}")
        return copy.deepcopy(value)
    if tp is bool:
        if not isinstance(value, bool):
            raise ConfigError(f"{key}: expected true or false, got {value!r}")
        return value
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(f"{key}: expected an integer, got {value!r}")
        return value
    if tp is float:
        # YAML reads "2e-4" (no dot) as a string; accept it as a number
        if isinstance(value, str):
            try:
                return float(value)
            except ValueError:
                pass
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ConfigError(f"{key}: expected a number, got {value!r}")
        return float(value)
    if tp is str:
        if not isinstance(value, str):
            raise ConfigError(f"{key}: expected a string, got {value!r}")
        return value
    raise TypeError(f"unsupported annotation {tp!r} for {key}")


def _build(cls: type, values: dict[str, Any], prefix: str = "") -> Any:
    hints = typing.get_type_hints(cls)
    names = [f.name for f in dataclasses.fields(cls)]
    kwargs = {}
    for key, value in values.items():
        dotted = f"{prefix}.{key}" if prefix else str(key)
        if key not in hints:
            raise ConfigError(f"{dotted}: unknown key; expected one of: {', '.join(names)}")
        kwargs[key] = _coerce(value, hints[key], dotted)
    return cls(**kwargs)


def _get_dotted(obj: Any, key: str) -> Any:
    for part in key.split("."):
        obj = getattr(obj, part)
    return obj


def parse_override(text: str) -> tuple[list[str], Any]:
    """``schedule.lr=1e-4`` -> (["schedule", "lr"], 1e-4); the value is read as YAML."""
    if "=" not in text:
        raise ConfigError(f"override {text!r}: expected KEY=VALUE, e.g. schedule.max_steps=100")
    key, raw = text.split("=", 1)
    if not key or any(not p for p in key.split(".")):
        raise ConfigError(f"override {text!r}: expected a dotted key such as data.train")
    try:
        value = yaml.safe_load(raw) if raw != "" else ""
    except yaml.YAMLError:
        value = raw
    return key.split("."), value


def apply_overrides(raw: dict[str, Any], overrides: list[str]) -> dict[str, Any]:
    raw = copy.deepcopy(raw)
    for text in overrides:
        path, value = parse_override(text)
        node = raw
        for part in path[:-1]:
            child = node.get(part)
            if child is None:
                child = node[part] = {}
            if not isinstance(child, dict):
                raise ConfigError(f"override {text!r}: {part} is not a mapping")
            node = child
        node[path[-1]] = value
    return raw


def resolve_relative(path: str, base: Path) -> str:
    """Paths in a config are relative to the working directory; fall back to the config's folder."""
    if not path or path.startswith("builtin:") or os.path.isabs(path) or os.path.exists(path):
        return path
    candidate = base / path
    return str(candidate) if candidate.exists() else path


def load_run_config(path: str | os.PathLike | None, overrides: list[str] | None = None) -> RunConfig:
    """Read a run YAML (or only overrides when ``path`` is None), check every key and type."""
    raw: dict[str, Any] = {}
    base = Path.cwd()
    if path is not None:
        from iga_ds.utils_io import read_yaml_file

        path = Path(path)
        raw = read_yaml_file(path, "config file") or {}
        if not isinstance(raw, dict):
            raise ConfigError(f"{path}: expected a mapping at the top level")
        base = path.parent
    raw = apply_overrides(raw, overrides or [])
    try:
        cfg = _build(RunConfig, raw)
        cfg.validate()
    except ConfigError as exc:
        raise ConfigError(f"{path}: {exc}" if path is not None else str(exc)) from None
    cfg.deepspeed = resolve_relative(cfg.deepspeed, base)
    cfg.data.train = resolve_relative(cfg.data.train, base)
    cfg.model.name_or_path = resolve_relative(cfg.model.name_or_path, base)
    return cfg


def config_from_dict(raw: dict[str, Any]) -> RunConfig:
    cfg = _build(RunConfig, raw)
    cfg.validate()
    return cfg
