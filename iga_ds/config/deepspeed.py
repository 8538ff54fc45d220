"""The DeepSpeed JSON of a run: read it, fill in what the run YAML decides, and resolve the
hook's settings from both files.

The file is read as DeepSpeed reads it, with hjson (comments and trailing commas allowed, a key
given twice an error). Configs written for the Hugging Face Trainer, axolotl or LLaMA-Factory
work as they are where iga-ds can honour them: ``"auto"`` is resolved wherever the HF Trainer
resolves it, from the run YAML:

- ``train_micro_batch_size_per_gpu``, ``gradient_accumulation_steps``, ``train_batch_size``:
  from ``data`` (batches are counted in isomer groups);
- ``gradient_clipping``: ``schedule.gradient_clipping``;
- ``zero_optimization.reduce_bucket_size``: hidden_size x hidden_size of the base model's config
  (read from its ``config.json``, GGUF header or the Hugging Face cache; nothing is downloaded
  for it, so a hub model not yet in the cache needs a number there);
- ``bf16.enabled`` / ``fp16.enabled``: from ``model.dtype`` (bfloat16: bf16, float16: fp16,
  float32: neither);
- an ``optimizer`` block of type AdamW: its ``lr``, ``betas``, ``eps``, ``weight_decay`` from
  ``schedule``; a ``scheduler`` block of DeepSpeed's warm-up types whose every parameter is
  ``"auto"``: the run YAML's schedule. The trainer builds that AdamW and schedule itself, so both
  blocks are checked and then left out of what DeepSpeed gets.

Any of these given as a value must agree with the run YAML (an error naming both files
otherwise): the run YAML is their one home. ``method`` (with its ``params``) and ``domains``
may be set in either file: in the run YAML as ``method.name``, ``method.params`` and
``data.domains``, in the JSON's ``iga`` block as ``method``, ``params`` and ``domains``; a
setting given in both with different values is an error naming both. What the engine hook
cannot run (ZeRO stage 3, optimizer or parameter offload, Apex AMP, elasticity, fp16 with a
method that captures per-domain gradients) and any ``"auto"`` left over are refused here, as one
line naming the key, before anything starts.
"""
from __future__ import annotations

import copy
import math
import os
from pathlib import Path
from typing import Any

from iga_ds.config.base import validate_section
from iga_ds.config.ds_keys import check_known_keys
from iga_ds.config.hook import BLOCK, HookConfig, check_method_params
from iga_ds.config.run import (BUILTIN_TINY, DEFAULT_DEEPSPEED, SHIPPED, RunConfig, TinyBaseConfig, shipped_file,
                               shipped_names)
from iga_ds.errors import ConfigError, UserError
from iga_ds.files import read_text
from iga_ds.models import resolve_model_source

AUTO = "auto"
SHIPPED_BF16 = "ds_configs/zero2.json"
# model.dtype -> the precision block that "auto" enables
PRECISION_OF_DTYPE = {"bfloat16": "bf16", "float16": "fp16"}
# the AdamW parameters an optimizer block may carry, each the run YAML's schedule key of that name
OPTIMIZER_PARAMS = ("lr", "betas", "eps", "weight_decay")
# DeepSpeed's warm-up schedules and the parameters each takes
SCHEDULERS = {
    "warmuplr": ("warmup_min_lr", "warmup_max_lr", "warmup_num_steps", "warmup_type", "last_batch_iteration"),
    "warmupdecaylr": ("warmup_min_lr", "warmup_max_lr", "warmup_num_steps", "warmup_type", "last_batch_iteration",
                      "total_num_steps"),
    "warmupcosinelr": ("warmup_min_ratio", "warmup_num_steps", "warmup_type", "last_batch_iteration",
                       "total_num_steps", "cos_min_ratio"),
}


def use_cpu() -> bool:
    """Whether DeepSpeed runs on the CPU here: asked for with DS_ACCELERATOR=cpu, or no CUDA."""
    import torch  # a config read for --help must not load torch

    return os.environ.get("DS_ACCELERATOR", "") == "cpu" or not torch.cuda.is_available()


class _DuplicateKey(Exception):
    pass


def _no_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in pairs:
        if key in out:
            raise _DuplicateKey(key)
        out[key] = value
    return out


def load_ds_json(path: str) -> dict[str, Any]:
    """A DeepSpeed config file, read as DeepSpeed reads it (hjson: JSON with comments and trailing
    commas); bad syntax is one line with the file and the line."""
    import hjson  # a DeepSpeed dependency; only the commands that read a DeepSpeed config pay for it

    if Path(path).is_dir():
        raise ConfigError(f"deepspeed: config {path!r} is a folder; expected a DeepSpeed JSON file in it "
                          "(e.g. ds_configs/zero2.json)")
    if not Path(path).is_file():
        raise ConfigError(f"deepspeed: config {path!r} not found")
    text = read_text(path, "DeepSpeed config", error=ConfigError)
    try:
        value = hjson.loads(text, object_pairs_hook=_no_duplicates)
    except hjson.HjsonDecodeError as exc:
        raise ConfigError(f"{path}:{exc.lineno}: not valid JSON or hjson ({exc.msg})") from None
    except _DuplicateKey as exc:
        raise ConfigError(f"{path}: key {exc.args[0]!r} is given twice in one object") from None
    if not isinstance(value, dict):
        raise ConfigError(f"{path}: expected a JSON object, got {type(value).__name__}")
    return value


def resolve_hook_config(run: RunConfig, block: dict[str, Any] | None, source: str = "deepspeed",
                        run_source: str = "the run YAML") -> HookConfig:
    """The hook's settings from the JSON's ``iga`` block and the run YAML's method and domains."""
    block = dict(block or {})
    _check_params_of_both(run, block, source, run_source)
    from_run = {}
    if run.method is not None:
        from_run["method"] = (run.method.name, "method.name")
        if "params" in run.method.model_fields_set:
            from_run["params"] = (dict(run.method.params), "method.params")
    if run.data.domains is not None:
        from_run["domains"] = (list(run.data.domains), "data.domains")
    for key, (value, run_key) in from_run.items():
        if key in block and block[key] != value:
            raise ConfigError(f"{key}: {run_source} sets {run_key}: {value!r} and {source} sets "
                              f"{BLOCK}.{key}: {block[key]!r}; set it in one of them")
    # the keys only the JSON sets are checked first, so that an error there names iga.KEY
    validate_section(HookConfig, {k: v for k, v in block.items() if k not in from_run}, f"{source}: {BLOCK}")
    block.update({key: value for key, (value, _) in from_run.items()})
    where = "method" if run.method is not None else f"{source}: {BLOCK}"
    return HookConfig.from_dict(block, where=where)


def _check_params_of_both(run: RunConfig, block: dict[str, Any], source: str, run_source: str) -> None:
    """The method parameters each file gives, against the signature of the method that file
    names (or, where it names none, the other file's): a misspelt parameter is named as one,
    before the two files are compared."""
    run_method = run.method.name if run.method is not None else None
    block_method = block.get("method") if isinstance(block.get("method"), str) else None
    method = run_method or block_method or HookConfig().method
    if run.method is not None and "params" in run.method.model_fields_set:
        check_method_params(method, run.method.params, f"{run_source}: method.params")
    if isinstance(block.get("params"), dict):
        check_method_params(block_method or method, block["params"], f"{source}: {BLOCK}.params")


def check_base_model(run: RunConfig, run_source: str = "the run YAML") -> None:
    """``model.name_or_path`` names a model that is there, as far as the local disk tells (a
    folder with a config.json, a .gguf file, or a name spelled as a hub id; nothing is looked up
    on the hub): checked before the tokenizer, which is read from the same place unless
    ``tokenizer`` says otherwise, so that a missing folder is named as the model's."""
    spec = run.model.name_or_path
    if spec == BUILTIN_TINY:
        return
    try:
        source = resolve_model_source(spec, "model.name_or_path", ConfigError)
    except ConfigError as exc:
        raise ConfigError(f"{run_source}: {exc}") from None
    if source.kind == "folder" and not (Path(source.location) / "config.json").is_file():
        raise ConfigError(f"{run_source}: model.name_or_path: {source.location} is not a Hugging Face model folder "
                          "(no config.json)")


def build_ds_config(run: RunConfig, ds_raw: dict[str, Any], world_size: int, accum: int, source: str = "deepspeed",
                    cpu: bool | None = None, run_source: str = "the run YAML",
                    check_model: bool = False) -> tuple[dict[str, Any], HookConfig]:
    """The DeepSpeed dict and the hook's settings for this run: ``"auto"`` resolved from the run
    YAML, the values both files give checked against each other, what the hook cannot run refused
    (the module docstring lists them). A key the installed DeepSpeed does not know is an error
    naming the nearest known one (:mod:`iga_ds.config.ds_keys`).

    ``cpu``: whether the run is on the CPU; None: this machine decides, being the one that
    trains. ``check_model``: whether the base model must be here (:func:`check_base_model`): the
    trainer asks it; a dry run does not, since a local model folder may live only on the machine
    the config is written for."""
    check_known_keys(ds_raw, source)
    if check_model:
        check_base_model(run, run_source)
    ds = copy.deepcopy({k: v for k, v in ds_raw.items() if k != BLOCK})
    hook = resolve_hook_config(run, ds_raw.get(BLOCK), source, run_source)
    _refuse_unsupported(ds, source)
    _resolve_batch_sizes(ds, run, hook, world_size, accum, source)
    _resolve_clipping(ds, run, source, run_source)
    _resolve_bucket_size(ds, run, source)
    _resolve_precision(ds, run, hook, source, run_source, use_cpu() if cpu is None else cpu)
    _check_optimizer(ds.pop("optimizer", None), run, source, run_source)
    _check_scheduler(ds.pop("scheduler", None), source, run_source)
    _refuse_auto_left(ds, source)
    ds.setdefault("zero_allow_untested_optimizer", True)  # a torch AdamW, built by the trainer
    ds.setdefault("steps_per_print", 10**9)
    ds["zero_optimization"].setdefault("elastic_checkpoint", True)  # resume at another world size
    return ds, hook


def _mapping(ds: dict[str, Any], key: str, source: str) -> dict[str, Any]:
    """``ds[key]`` as a mapping (created empty when absent)."""
    value = ds.setdefault(key, {})
    if not isinstance(value, dict):
        raise ConfigError(f"{source}: {key}: expected an object, got {value!r}")
    return value


def _refuse_unsupported(ds: dict[str, Any], source: str) -> None:
    """The settings the engine hook cannot run, refused as one line naming the key; an Apex
    ``amp`` block that is off (or ``"auto"``: off here) is dropped."""
    zero = _mapping(ds, "zero_optimization", source)
    stage = zero.get("stage", 0)
    if stage not in (0, 1, 2) or isinstance(stage, bool):
        raise ConfigError(f"{source}: zero_optimization.stage: expected 0, 1 or 2, got {stage!r} (the engine hook "
                          "needs whole parameters on every rank; ZeRO stage 3 partitions them)")
    for key in ("offload_optimizer", "offload_param"):
        value = zero.get(key)
        device = value.get("device", "none") if isinstance(value, dict) else value
        if device not in (None, "none"):
            raise ConfigError(f"{source}: zero_optimization.{key}: device {device!r} is not supported by the engine "
                              "hook (it writes gradients into ZeRO's partitions on the accelerator); remove "
                              f"{key} (LoRA's optimizer state is small)")
    if zero.get("cpu_offload"):
        raise ConfigError(f"{source}: zero_optimization.cpu_offload: CPU offload is not supported by the engine "
                          "hook; remove it")
    amp = ds.pop("amp", None)  # NVIDIA Apex: off ("auto" under the HF Trainer without --fp16_backend apex)
    if isinstance(amp, dict) and amp.get("enabled") not in (None, False, AUTO):
        raise ConfigError(f"{source}: amp.enabled: Apex AMP does not run with ZeRO; remove the amp block "
                          "(use bf16)")
    if isinstance(ds.get("elasticity"), dict) and ds["elasticity"].get("enabled"):
        raise ConfigError(f"{source}: elasticity.enabled: DeepSpeed elasticity picks its own batch sizes; the run "
                          "YAML decides them (in isomer groups): remove the elasticity block")


def _resolve_batch_sizes(ds: dict[str, Any], run: RunConfig, hook: HookConfig, world_size: int, accum: int,
                         source: str) -> None:
    micro = run.data.groups_per_micro_batch * hook.num_domains
    want = {
        "train_micro_batch_size_per_gpu": micro,
        "gradient_accumulation_steps": accum,
        "train_batch_size": micro * accum * world_size,
    }
    for key, value in want.items():
        given = ds.get(key, AUTO)
        if given not in (AUTO, value):
            raise ConfigError(
                f"{source}: {key} is {given!r} but the run YAML's data settings give {value}; "
                f'set it to "auto" (batches are counted in isomer groups in the run YAML)'
            )
        ds[key] = value


def _agrees(given: Any, want: Any) -> bool:
    """A number (or list of numbers) given in the JSON that equals the run YAML's."""
    if isinstance(want, (list, tuple)):
        return isinstance(given, (list, tuple)) and len(given) == len(want) and all(map(_agrees, given, want))
    return isinstance(given, (int, float)) and not isinstance(given, bool) and math.isclose(given, want, rel_tol=1e-9,
                                                                                            abs_tol=0.0)


def _resolve_clipping(ds: dict[str, Any], run: RunConfig, source: str, run_source: str) -> None:
    want = run.schedule.gradient_clipping
    given = ds.get("gradient_clipping", AUTO)
    if given != AUTO and not _agrees(given, want):
        raise ConfigError(f"gradient_clipping: {source} sets gradient_clipping: {given!r} and {run_source} "
                          f"schedule.gradient_clipping: {want}; set \"auto\" in {source} and the value in "
                          f"{run_source}")
    ds["gradient_clipping"] = want


def _resolve_bucket_size(ds: dict[str, Any], run: RunConfig, source: str) -> None:
    """``zero_optimization.reduce_bucket_size: "auto"``: hidden_size squared, as the Hugging Face
    Trainer fills it from the model it was given."""
    zero = ds["zero_optimization"]
    if zero.get("reduce_bucket_size") != AUTO:
        return
    hidden_size, why_unknown = base_model_hidden_size(run)
    if hidden_size is None:
        raise ConfigError(f"{source}: zero_optimization.reduce_bucket_size: \"auto\" is hidden_size x hidden_size "
                          f"of the base model, but {why_unknown}; give a number of elements (e.g. 5e8)")
    zero["reduce_bucket_size"] = hidden_size * hidden_size


def base_model_hidden_size(run: RunConfig) -> tuple[int | None, str]:
    """The hidden size of the base model the run trains, from its config alone (no weights are
    loaded, nothing is downloaded): the number, or None and why it cannot be known here."""
    spec = run.model.name_or_path
    if spec == BUILTIN_TINY:
        return TinyBaseConfig.model_validate(run.model.tiny).hidden_size, ""
    try:
        source = resolve_model_source(spec, "model.name_or_path")
    except UserError as exc:
        return None, str(exc)
    from transformers import AutoConfig  # heavy: only for a config that asks for it

    try:  # local_files_only: a hub id is read from the Hugging Face cache or not at all
        config = AutoConfig.from_pretrained(source.location, **{**source.pretrained_kwargs(),
                                                                "local_files_only": True})
    except (OSError, ValueError, ImportError) as exc:  # ImportError: a .gguf file without the gguf package
        if source.kind == "hub":  # the library's message speaks of a connection it was told not to make
            return None, (f"the config of model.name_or_path {source.label} is not in the Hugging Face cache yet "
                          "(nothing is downloaded to read it)")
        first = next((line.strip() for line in str(exc).splitlines() if line.strip()), type(exc).__name__)
        return None, f"the config of model.name_or_path {source.label} could not be read ({first})"
    # the Hugging Face Trainer's order: hidden_size, the widest of hidden_sizes, the text model's
    text_config = getattr(config, "text_config", None)
    for size in (getattr(config, "hidden_size", None), max(getattr(config, "hidden_sizes", None) or [0]) or None,
                 getattr(text_config, "hidden_size", None)):
        if isinstance(size, int) and size > 0:
            return size, ""
    return None, f"the config of model.name_or_path {source.label} gives no hidden_size"


def _resolve_precision(ds: dict[str, Any], run: RunConfig, hook: HookConfig, source: str, run_source: str,
                       cpu: bool) -> None:
    """``bf16.enabled`` / ``fp16.enabled``: ``"auto"`` from ``model.dtype``; then the two files
    checked against each other, against the CPU (before anything that would suggest a half
    precision there) and against the method. ``model.dtype`` is named where it was given: on the
    command line or in ``run_source``."""
    dtype = run.model.dtype
    enabled, auto = _precision_blocks(ds, dtype, source)
    on = [key for key, value in enabled.items() if value]
    if len(on) > 1:
        raise ConfigError(f"{source}: {on[0]}.enabled and {on[1]}.enabled are both true; enable one at most")
    have = on[0] if on else None
    dtype_from = "the command line" if run.set_on_command_line("model.dtype") else run_source
    if cpu:
        _check_cpu_precision(have, bool(have and auto[have]), dtype, dtype_from, source)
    want = PRECISION_OF_DTYPE.get(dtype)
    if want is not None and (have or "").replace("bfloat16", "bf16") != want:
        got = f"sets {have}.enabled: true" if have else "enables neither bf16 nor fp16"
        raise ConfigError(f"model.dtype: {dtype_from} sets model.dtype: {dtype} but {source} {got}; "
                          f"{_precision_fix(want, source)}, or {_dtype_fix(dtype_from)}")
    if have == "fp16" and hook.build_method().needs_domain_gradients:
        raise ConfigError(f"{source}: fp16.enabled: the engine hook supports bf16 and fp32 with method "
                          f"{hook.method!r} (dynamic loss scaling is not handled); use bf16")


def _precision_blocks(ds: dict[str, Any], dtype: str, source: str) -> tuple[dict[str, bool], dict[str, bool]]:
    """({block: enabled}, {block: whether it was "auto"}) of the JSON's precision blocks, "auto"
    resolved from ``dtype`` and written back into ``ds``."""
    enabled, auto = {}, {}
    for key in ("bf16", "bfloat16", "fp16"):  # "bfloat16": DeepSpeed's older name of the bf16 block
        if key not in ds:
            continue
        block = _mapping(ds, key, source)
        value = block.get("enabled", False)
        auto[key] = value == AUTO
        if auto[key]:
            value = PRECISION_OF_DTYPE.get(dtype) == ("fp16" if key == "fp16" else "bf16")
        elif not isinstance(value, bool):
            raise ConfigError(f"{source}: {key}.enabled: expected true, false or \"auto\", got {value!r}")
        block["enabled"] = enabled[key] = value
    return enabled, auto


def _dtype_fix(dtype_from: str) -> str:
    """How to give ``model.dtype: float32`` where the current value came from."""
    return "model.dtype=float32 on the command line" if dtype_from == "the command line" else \
        f"model.dtype: float32 in {dtype_from}"


def _check_cpu_precision(have: str | None, auto: bool, dtype: str, dtype_from: str, source: str) -> None:
    """On the CPU only fp32 trains: a half ``model.dtype`` or an enabled bf16/fp16 block is
    refused with what to change (both, where both are half), nothing that the CPU refuses too."""
    half_dtype, block_on = dtype in PRECISION_OF_DTYPE, bool(have) and not auto
    if not (half_dtype or block_on):
        return
    shipped = _shipped_name(source) is not None
    config_fix = (f"point deepspeed (or --deepspeed) at the shipped fp32 config, {default_ds_config()}"
                  + ("" if shipped else f", or set {have}.enabled: false in {source}"))
    cpu = "but this run is on the CPU, where only fp32 trains"
    if not half_dtype:
        raise ConfigError(f"{source}: {have}.enabled: true, {cpu}; {config_fix}")
    what = f"{dtype_from} sets model.dtype: {dtype}"
    what += f" (which turns {have}.enabled \"auto\" in {source} on)" if auto and have else ""
    what += f" and {source} sets {have}.enabled: true" if block_on else ""
    raise ConfigError(f"model.dtype: {what}, {cpu}; use {_dtype_fix(dtype_from)}"
                      + (f" and {config_fix}" if block_on else ""))


def _shipped_name(path: str) -> str | None:
    """``ds_configs/NAME.json`` when ``path`` is a DeepSpeed config installed with iga-ds (not a
    file to edit), else None."""
    resolved = Path(path).resolve()
    return next((name for name in shipped_names()
                 if name.startswith("ds_configs/") and (SHIPPED / name).resolve() == resolved), None)


def _precision_fix(want: str, source: str) -> str:
    """How to enable ``want`` (bf16 or fp16): in the user's own file, there; for a shipped one,
    the shipped bf16 config, or an editable copy from ``iga-ds init``."""
    shipped = _shipped_name(source)
    if shipped is None:
        return f"set {want}.enabled to \"auto\" or true in {source}"
    if want == "bf16":
        return f"point deepspeed (or --deepspeed) at the shipped bf16 config, {(SHIPPED / SHIPPED_BF16).resolve()}"
    return (f"write an editable copy of the shipped configs (iga-ds init DIR) and set fp16.enabled to \"auto\" in "
            f"its {shipped}")


def _check_optimizer(block: Any, run: RunConfig, source: str, run_source: str) -> None:
    """An ``optimizer`` block: AdamW whose values are ``"auto"`` or the run YAML's schedule."""
    if block is None:
        return
    fix = "set its values to \"auto\" or remove the block: the trainer's AdamW takes them from the run YAML's schedule"
    if not isinstance(block, dict) or set(block) - {"type", "params"}:
        raise ConfigError(f"{source}: optimizer: expected {{\"type\": \"AdamW\", \"params\": {{...}}}}, got {block!r}")
    if str(block.get("type", "")).lower() != "adamw":
        raise ConfigError(f"{source}: optimizer.type: {block.get('type')!r}: iga-ds trains with the AdamW of the "
                          "run YAML's schedule; set the type to \"AdamW\" (values \"auto\") or remove 'optimizer'")
    params = block.get("params") or {}
    if not isinstance(params, dict):
        raise ConfigError(f"{source}: optimizer.params: expected an object, got {params!r}")
    for key, given in params.items():
        if key not in OPTIMIZER_PARAMS:
            raise ConfigError(f"{source}: optimizer.params.{key}: not a setting of iga-ds's AdamW (it takes "
                              f"{', '.join(OPTIMIZER_PARAMS)} from the run YAML's schedule); remove it")
        want = getattr(run.schedule, key)
        if given != AUTO and not _agrees(given, want):
            raise ConfigError(f"optimizer.params.{key}: {source} sets {given!r} but {run_source} has "
                              f"schedule.{key}: {want}; {fix}")


def _check_scheduler(block: Any, source: str, run_source: str) -> None:
    """A ``scheduler`` block: one of DeepSpeed's warm-up schedules with every value ``"auto"``,
    which then stands for the run YAML's schedule."""
    if block is None:
        return
    fix = (f"set its values to \"auto\" or remove the block: {run_source}'s schedule decides the learning rate "
           "(lr, warmup_ratio, min_lr_ratio: linear warm-up, then cosine decay)")
    if not isinstance(block, dict) or set(block) - {"type", "params"}:
        raise ConfigError(f"{source}: scheduler: expected {{\"type\": \"WarmupLR\", \"params\": {{...}}}}, "
                          f"got {block!r}")
    kind = str(block.get("type", ""))
    if kind.lower() not in SCHEDULERS:
        raise ConfigError(f"{source}: scheduler.type: {kind!r} is not run by iga-ds; remove the block: "
                          f"{run_source}'s schedule decides the learning rate (linear warm-up, then cosine decay)")
    params = block.get("params") or {}
    if not isinstance(params, dict):
        raise ConfigError(f"{source}: scheduler.params: expected an object, got {params!r}")
    for key, given in params.items():
        if key not in SCHEDULERS[kind.lower()]:
            raise ConfigError(f"{source}: scheduler.params.{key}: not a parameter of {kind}; remove it")
        if given != AUTO:
            raise ConfigError(f"{source}: scheduler.params.{key}: {given!r}; {fix}")


def _refuse_auto_left(node: Any, source: str, where: str = "") -> None:
    """An ``"auto"`` that iga-ds does not resolve, named, instead of DeepSpeed's own error."""
    items = node.items() if isinstance(node, dict) else enumerate(node) if isinstance(node, list) else ()
    for key, value in items:
        dotted = f"{where}[{key}]" if isinstance(key, int) else f"{where}.{key}" if where else str(key)
        if value == AUTO:
            raise ConfigError(f"{source}: {dotted}: \"auto\" is not resolved by iga-ds (it resolves the batch "
                              "sizes, gradient_clipping, zero_optimization.reduce_bucket_size, bf16/fp16.enabled "
                              "and the optimizer and scheduler); "
                              "give a value")
        _refuse_auto_left(value, source, dotted)


def default_ds_config() -> str:
    """The shipped fp32 ZeRO-2 config (CPU or GPU), from the installed package. Its ``iga`` block
    names no method: runs set their own."""
    return shipped_file(DEFAULT_DEEPSPEED)
