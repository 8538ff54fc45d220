"""Training throughput of ``iga-ds train`` beside what users would run instead, on one machine.

The variants, each in a process of its own (started by this one, one after the other), on the
same records, token ids, batches and schedule:

- ``torch``: a plain PyTorch loop: PEFT LoRA, SDPA attention, bf16 autocast (float32 on the
  CPU), fused AdamW on CUDA, clipping at 1.0, no DeepSpeed; ``torch_no_cudnn``: the same loop
  with SDPA's cuDNN kernel off, as ``iga-ds train`` runs by default (``model.cudnn_attention``);
  both load the base in bf16 on CUDA and take the trainer's per-sequence losses on the full logits;
- ``torch_user``: the loop as users write it, the anchor to hold iga-ds against: float32
  weights under bf16 autocast, SDPA's default kernels, the model's own ``labels=`` loss (the
  token mean over a micro-batch's targets, not the trainer's mean over sequences), otherwise
  ``torch``'s loop (its skeleton, micro-batches, optimizer, clipping, schedule);
- ``hf_trainer``: the Hugging Face ``Trainer`` with PEFT and the DeepSpeed JSON iga-ds uses
  (the shipped ``ds_configs/zero2.json`` on a GPU, the package's default fp32
  ``zero2_fp32.json`` on the CPU), SDPA attention; needs ``accelerate`` (skipped with the
  reason where it is absent);
- ``sft_trainer_iga``: TRL's ``SFTTrainer`` as an iga-ds run of IGA
  (``iga_ds.integrations.sft.IGASFTTrainer``), given ``iga_ds.integrations.recipe``'s run of
  ``iga_ds_iga``'s run YAML: the same model, adapters, token rows, groups, optimizer and schedule,
  so that beside ``iga_ds_iga`` it shows what the integration costs; timed as ``hf_trainer`` is,
  logging every step as ``iga-ds train`` does; needs ``trl`` and ``accelerate`` (skipped with the
  reason where either is absent);
- ``iga_ds_erm`` and ``iga_ds_iga``: ``python -m iga_ds train --config RUN.yaml`` with a run YAML
  written here (method ``erm``, then ``iga`` with its defaults), and ``iga_ds_erm_packed`` and
  ``iga_ds_iga_packed``, the same with ``data.padding_free: true``, and ``iga_ds_erm_captured``,
  method ``erm_captured``: ERM's update through the engine hook's capture and boundary instead of
  DeepSpeed's per-micro-batch reduction (IGA's path without the method), and ``iga_ds_erm_liger`` and
  ``iga_ds_iga_liger``, with ``model.liger_kernel: true`` (CUDA only), and ``iga_ds_erm_packed_liger``
  and ``iga_ds_iga_packed_liger``, with both, and the ``_unfused`` variants, with ``model.fused_lora:
  false`` (PEFT's own LoRA forward); their step times are the ones
  the trainer logs in ``metrics.jsonl`` (``step_interval_s``: from one step's end to the next,
  the previous step's logging included, as the Trainer's callbacks see it), so process start-up,
  model loading and tokenization are not counted. The trainer does not log its memory peak: the command runs
  under ``runpy`` in a thin wrapper that reads ``torch.cuda.max_memory_allocated`` at the end.

The records are a synthetic isomer set (``iga_ds.data.synth``, as ``iga-ds data synth`` writes
it). Every variant tokenizes with the trainer's own functions (``tokenize_groups``, its prompt
format, its cache) and takes step ``s``'s groups from the trainer's ``GroupSampler`` in the
trainer's micro-batches (``TokenizedGroups.micro_batch``), so all of them see the same token ids
in the same batches; the JSON's token counts let a reader (and the smoke test) check it. The
model is ``--model PATH`` or ``--shape NAME``: a LLaMA of that shape with random weights (the
step time does not depend on the values) and the built-in tiny base's word-level tokenizer
(built offline from the generator's vocabulary), saved once into the work folder and handed to
every variant. The named shapes keep their own vocabulary size (larger than the tokenizer's:
the output layer costs what it costs in the real model).

A step's time: the plain loops synchronize the device and read the clock around each optimizer step
(building the micro-batches included, as the trainer's step times include them);
``hf_trainer`` times from one ``on_step_end`` to the next, the device synchronized there (its
loop fetches a step's batches before ``on_step_begin``). The median and its spread (10th-90th
percentile) are over the steps after ``--warmup-steps``; tokens/s is the tokens of those steps
(prompt and target, no padding) over their summed time.

MFU counts the FLOPs of a frozen base with LoRA adapters, per step of sequences of ``n_i``
tokens (``T = sum n_i``)::

    FLOPs = (2 + 2) * N_base * T  +  6 * N_lora * T  +  12 * L * d_attn * sum(n_i ** 2)

``N_base``: the weights of the base's linear layers (the output layer included, the embedding
lookup not); forward 2 FLOPs a weight and token, backward 2 more for the activations' gradient
only (a frozen weight gets no gradient). ``N_lora``: the adapters' weights, 6 (forward, input
and weight gradients). Attention (no weights): ``Q K^T`` and ``P V`` are ``4 d_attn n`` FLOPs a
token and layer forward (``d_attn``: heads x head size), twice that backward (both operands'
gradients): 12, counted over the full ``n x n`` as PaLM's appendix does (a causal kernel skips
about half). MFU = FLOPs of the timed steps / their time / the card's dense bf16 peak (``PEAK_BF16``;
``--peak-tflops`` overrides); n/a on the CPU.

``--profile``: the 3 steps after the warm-up ones run under ``torch.profiler`` in the plain loops and the
``iga_ds_*`` variants (``logging.profile_steps`` and ``profile_after`` in their run YAML; the plain
loop through the trainer's own ``iga_ds.train.profiling.StepProfiler``) and are left out of the
figures; each variant's ``profile.json`` and ``profile.txt`` are copied beside ``--out`` as
``<out stem>_profile_<variant>.json`` and ``.txt``, their paths in its entry of the JSON.

``--rounds R`` runs every variant R times, in alternating order (as listed, then reversed), each
round with its own warm-up steps, and pools the rounds' timed steps: drift of the machine over
minutes then favours no variant. ``--profile`` profiles the first round only.

One GPU (SmolLM2-135M's shape, then LLaMA-2-7B's), a model folder, and the CPU smoke run::

    python bench/bench_train.py --shape smollm2-135m --out bench_train.json
    python bench/bench_train.py --shape llama2-7b --out bench_train_7b.json
    python bench/bench_train.py --small --out bench_train_small.json
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import math
import os
import runpy
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from common import LLAMA2_7B, LORA_TARGETS, environment, environment_line, paired_ratio, spread, synchronize
from iga_ds.config.deepspeed import default_ds_config
from iga_ds.config.run import shipped_file
from iga_ds.data.domains import DEFAULT_DOMAINS
from iga_ds.data.groups import complete_groups
from iga_ds.data.prompts import prompt_format
from iga_ds.data.synth import synthesize
from iga_ds.engine.internals import disable_cpu_shm_comm_op
from iga_ds.errors import ConfigError, UserError
from iga_ds.files import atomic_write_json, atomic_write_text, read_json, read_jsonl
from iga_ds.train.attention import VARLEN_ATTENTION, varlen_unavailable
from iga_ds.train.batching import (GroupSampler, check_batch_layout, read_records, sequence_losses, tokenize_groups,
                                   tokenized_cache_root)
from iga_ds.train.model import (add_lora, allow_cudnn_attention, build_vocab, build_word_tokenizer, load_base_model,
                                load_tokenizer, require_liger_kernel)
from iga_ds.train.optim import lr_lambda
from iga_ds.train.pretrain import corpus_texts, generator_words
from iga_ds.train.profiling import PROFILE_JSON, PROFILE_TXT, StepProfiler

VARIANTS = ("torch", "torch_no_cudnn", "torch_user", "hf_trainer", "sft_trainer_iga", "iga_ds_erm", "iga_ds_iga",
            "iga_ds_erm_packed", "iga_ds_iga_packed", "iga_ds_erm_captured", "iga_ds_erm_liger", "iga_ds_iga_liger",
            "iga_ds_erm_packed_liger", "iga_ds_iga_packed_liger", "iga_ds_erm_unfused", "iga_ds_iga_unfused",
            "iga_ds_erm_packed_liger_unfused", "iga_ds_iga_packed_liger_unfused")
LABELS = {"torch": "PyTorch + PEFT loop", "torch_no_cudnn": "PyTorch + PEFT loop, cuDNN attention off",
          "torch_user": "PyTorch + PEFT loop as users write it (fp32 weights, model's loss)",
          "hf_trainer": "HF Trainer + PEFT + DeepSpeed",
          "sft_trainer_iga": "TRL SFTTrainer + iga-ds IGA (IGASFTTrainer)",
          "iga_ds_erm": "iga-ds train, ERM", "iga_ds_iga": "iga-ds train, IGA",
          "iga_ds_erm_packed": "iga-ds train, ERM, padding-free",
          "iga_ds_iga_packed": "iga-ds train, IGA, padding-free",
          "iga_ds_erm_captured": "iga-ds train, ERM through the hook",
          "iga_ds_erm_liger": "iga-ds train, ERM, liger-kernel", "iga_ds_iga_liger": "iga-ds train, IGA, liger-kernel",
          "iga_ds_erm_packed_liger": "iga-ds train, ERM, padding-free, liger-kernel",
          "iga_ds_iga_packed_liger": "iga-ds train, IGA, padding-free, liger-kernel",
          "iga_ds_erm_unfused": "iga-ds train, ERM, PEFT's LoRA forward",
          "iga_ds_iga_unfused": "iga-ds train, IGA, PEFT's LoRA forward",
          "iga_ds_erm_packed_liger_unfused": "iga-ds train, ERM, padding-free, liger-kernel, PEFT's LoRA forward",
          "iga_ds_iga_packed_liger_unfused": "iga-ds train, IGA, padding-free, liger-kernel, PEFT's LoRA forward"}
TRAINER_VARIANTS = ("hf_trainer", "sft_trainer_iga")  # through the Hugging Face Trainer (and accelerate)
# the variants' name parts: data.padding_free on, model.liger_kernel on, model.fused_lora off
PACKED, LIGER, UNFUSED = "_packed", "_liger", "_unfused"
# shapes with random weights: Hugging Face LLaMA config fields (SmolLM2-135M-Instruct's
# config.json; LLaMA-2-7B from common); "tiny" is the smoke run's, its vocabulary the tokenizer's
SHAPES = {
    "smollm2-135m": {"vocab_size": 49152, "hidden_size": 576, "intermediate_size": 1536, "num_hidden_layers": 30,
                     "num_attention_heads": 9, "num_key_value_heads": 3, "max_position_embeddings": 8192,
                     "rms_norm_eps": 1e-5, "rope_theta": 100000.0, "hidden_act": "silu", "tie_word_embeddings": True},
    "llama2-7b": {k: v for k, v in LLAMA2_7B.items() if k != "model_type"},
    "tiny": {"vocab_size": None, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
             "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 512,
             "tie_word_embeddings": True},
}
# dense bf16 tensor-core peak (no sparsity), FLOP/s, by a part of the card's name (first match)
PEAK_BF16 = (("H200", 989e12), ("H100 PCIe", 756e12), ("H100", 989e12), ("A100", 312e12))
SMALL = dict(shape="tiny", steps=5, warmup_steps=1, groups=20, max_length=96)
PROFILE_STEPS = 3  # --profile: the steps after the warm-up ones profiled (and left out of the figures)
DEFAULTS = dict(shape="smollm2-135m", steps=120, warmup_steps=10, groups=700, max_length=224)


# -- the shared plan: records, tokens, batches ----------------------------------------------------


def load_plan(spec: dict):
    """(tokenized groups, micro-batches of each step): the trainer's tokenization (its prompt
    format, its cache) and its sampler's groups for each step, cut into its micro-batches."""
    tokenizer = load_tokenizer(spec["model_dir"])
    fmt = prompt_format(tokenizer, "auto")
    groups = complete_groups(read_records(spec["train"]), spec["domains"], spec["train"])
    batches = tokenize_groups(tokenizer, groups, spec["max_length"], tokenized_cache_root(), 1, fmt)
    sampler = GroupSampler(len(groups), spec["groups_per_step"], spec["seed"])
    per = spec["groups_per_micro_batch"]
    plan = []
    for step in range(spec["steps"]):
        mine = sampler.rank_groups(step, 0, 1)
        plan.append([mine[i:i + per] for i in range(0, len(mine), per)])
    return batches, plan


def step_sizes(batches, plan) -> tuple[list[int], list[int]]:
    """Per step: tokens (no padding), and the sum of the squared sequence lengths (attention)."""
    tokens, squares = [], []
    for step in plan:
        lengths = [int(n) for groups in step for n in batches.micro_batch(groups).attention_mask.sum(dim=1)]
        tokens.append(sum(lengths))
        squares.append(sum(n * n for n in lengths))
    return tokens, squares


# -- variants: plain PyTorch loops ---------------------------------------------------------------


def plain_setup(spec: dict, weights: str):
    """(device, model, its trainable weights, optimizer, schedule) of a plain loop: the base in
    ``weights`` on CUDA (float32 on the CPU), PEFT LoRA, AdamW (fused on CUDA), iga-ds's schedule."""
    device = torch.device(spec["device"])
    cuda = device.type == "cuda"
    base = load_base_model(spec["model_dir"], weights if cuda else "float32", "sdpa")
    torch.manual_seed(spec["seed"])  # the adapters' initial values: one loop's run is the other's
    model = add_lora(base, spec["r"], spec["alpha"], 0.0, spec["targets"]).to(device)
    model.train()
    trainable = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(trainable, lr=spec["lr"], betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01,
                            fused=cuda or None)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_lambda(spec["steps"], spec["warmup_ratio"], 0.0))
    return device, model, trainable, opt, sched


def plain_loop(spec: dict, name: str, weights: str, micro_loss, dtype: str) -> dict:
    """The plain loops' skeleton: the plan's steps, each micro-batch's ``micro_loss(model, mb)``
    (a mean) averaged over the step, clipping at 1.0; each step timed with the device
    synchronized (building the micro-batches included, as the trainer's step times include them)."""
    batches, plan = load_plan(spec)
    device, model, trainable, opt, sched = plain_setup(spec, weights)
    # --profile: the window iga-ds train profiles (logging.profile_steps after profile_after), by its helper
    profiler = StepProfiler(Path(spec["work"]) / "runs" / name, spec["profile_steps"], spec["warmup_steps"],
                            device, total_steps=len(plan))
    times, tokens, losses = [], [], []
    for index, step in enumerate(plan):
        with profiler.step(index):
            synchronize(device)
            t0 = time.perf_counter()
            loss_sum, count = torch.zeros((), device=device), 0
            for groups in step:
                mb = batches.micro_batch(groups).to(device)
                loss = micro_loss(model, mb)
                (loss / len(step)).backward()
                loss_sum += loss.detach()
                count += mb.num_tokens
            torch.nn.utils.clip_grad_norm_(trainable, 1.0)
            opt.step()
            sched.step()
            opt.zero_grad(set_to_none=True)
            losses.append(float(loss_sum) / len(step))  # the host waits for the step here
            synchronize(device)
            times.append(time.perf_counter() - t0)
            tokens.append(count)
    paths = profiler.finish()
    return {"step_times_s": times, "step_tokens": tokens, "losses": losses, "attn_implementation": "sdpa",
            "dtype": dtype if device.type == "cuda" else "float32",
            "profile": [str(p) for p in paths] if paths else None}


def sequence_mean_loss(model, mb):
    """``torch``'s loss: the trainer's per-sequence losses (``sequence_losses``) on the full logits, their mean."""
    with torch.autocast(mb.input_ids.device.type, dtype=torch.bfloat16, enabled=mb.input_ids.is_cuda):
        logits = model(input_ids=mb.input_ids, attention_mask=mb.attention_mask).logits
    return sequence_losses(logits, mb.labels).mean()


def labels_loss(model, mb):
    """``torch_user``'s loss: the model's own from ``labels=`` (the token mean over the micro-batch's targets)."""
    with torch.autocast(mb.input_ids.device.type, dtype=torch.bfloat16, enabled=mb.input_ids.is_cuda):
        return model(input_ids=mb.input_ids, attention_mask=mb.attention_mask, labels=mb.labels).loss


def run_torch(spec: dict, cudnn: bool = True) -> dict:
    """bf16 weights under bf16 autocast, the trainer's loss on the full logits."""
    allow_cudnn_attention(cudnn)  # True: PyTorch's default; False: what iga-ds train does by default
    return plain_loop(spec, "torch" if cudnn else "torch_no_cudnn", "bfloat16", sequence_mean_loss, "bf16 autocast")


def run_torch_user(spec: dict) -> dict:
    """The loop as users write it: fp32 weights under bf16 autocast, SDPA's default kernels, the model's own loss."""
    return plain_loop(spec, "torch_user", "float32", labels_loss, "fp32 weights, bf16 autocast")


# -- variant: the Hugging Face Trainer ------------------------------------------------------------


def hf_ds_config(spec: dict) -> dict:
    """The DeepSpeed JSON iga-ds uses, without its ``iga`` block (iga-ds's own, not DeepSpeed's)."""
    config = read_json(spec["deepspeed"], objects=True)
    config.pop("iga", None)
    return config


def run_hf_trainer(spec: dict) -> dict:
    from transformers import Trainer, TrainerCallback, TrainingArguments

    batches, plan = load_plan(spec)
    micro = [groups for step in plan for groups in step]
    fed: list[int] = []

    class MicroBatches(torch.utils.data.Dataset):  # item i: the trainer's micro-batch i, as it pads it
        def __len__(self):
            return len(micro)

        def __getitem__(self, i):
            mb = batches.micro_batch(micro[i])
            fed.append(mb.num_tokens)
            return {"input_ids": mb.input_ids, "attention_mask": mb.attention_mask, "labels": mb.labels}

    class InOrder(Trainer):  # the plan's order, not a shuffle
        def _get_train_sampler(self, train_dataset=None):
            return torch.utils.data.SequentialSampler(train_dataset if train_dataset is not None else self.train_dataset)

    clock = StepClock(torch.device(spec["device"]), TrainerCallback)
    cuda = spec["device"] == "cuda"
    if not cuda and not os.environ.get("IGA_DS_CPU_SHM_OP"):
        disable_cpu_shm_comm_op()  # as iga-ds train does on the CPU: gloo, no C++ build of an inference op
    base = load_base_model(spec["model_dir"], "bfloat16" if cuda else "float32", "sdpa")
    model = add_lora(base, spec["r"], spec["alpha"], 0.0, spec["targets"])
    accum = len(plan[0])
    args = TrainingArguments(
        output_dir=spec["work"] + "/hf_trainer", per_device_train_batch_size=1, gradient_accumulation_steps=accum,
        max_steps=spec["steps"], learning_rate=spec["lr"], lr_scheduler_type="cosine",
        warmup_steps=math.ceil(spec["warmup_ratio"] * spec["steps"]), weight_decay=0.01, max_grad_norm=1.0,
        bf16=cuda, deepspeed=hf_ds_config(spec), save_strategy="no", logging_steps=10**9, report_to="none",
        dataloader_num_workers=0, remove_unused_columns=False, seed=spec["seed"], disable_tqdm=True)
    trainer = InOrder(model=model, args=args, train_dataset=MicroBatches(), data_collator=lambda items: items[0],
                      callbacks=[clock.callback])
    out = trainer.train()
    tokens = [sum(fed[i * accum:(i + 1) * accum]) for i in range(len(plan))]
    return {"step_times_s": clock.times, "step_tokens": tokens, "losses": [float(out.training_loss)],
            "attn_implementation": "sdpa", "dtype": "bf16 (DeepSpeed)" if cuda else "float32"}


def run_sft_trainer_iga(spec: dict) -> dict:
    """IGASFTTrainer of the recipe of ``iga_ds_iga``'s run YAML (see the module docstring)."""
    from transformers import TrainerCallback
    from trl import SFTConfig

    from iga_ds.integrations.hf import IsomerCollator, pad_token_id
    from iga_ds.integrations.recipe import run_recipe
    from iga_ds.integrations.sft import IGASFTTrainer

    cuda = spec["device"] == "cuda"
    if not cuda and not os.environ.get("IGA_DS_CPU_SHM_OP"):
        disable_cpu_shm_comm_op()  # as iga-ds train does on the CPU
    out = Path(spec["work"]) / "runs" / "sft_trainer_iga"
    config = Path(spec["work"]) / "sft_trainer_iga.yaml"
    atomic_write_text(config, run_yaml(spec, "iga", str(out)))
    recipe = run_recipe(str(config))
    fed: list[int] = []  # each micro-batch's tokens (no padding), as the Trainer's loop takes them
    collate = IsomerCollator(pad_token_id(recipe.tokenizer), recipe.iga.num_domains)

    def counting(features):
        batch = collate(features)
        fed.append(int(batch["attention_mask"].sum()))
        return batch

    clock = StepClock(torch.device(spec["device"]), TrainerCallback)
    args = recipe.training_arguments(str(out), SFTConfig, logging_steps=1, disable_tqdm=True)
    trainer = IGASFTTrainer(args=args, data_collator=counting, callbacks=[clock.callback], **recipe.trainer_kwargs())
    trainer.train()
    accum = recipe.accumulation_steps
    return {"step_times_s": clock.times, "step_tokens": [sum(fed[i * accum:(i + 1) * accum]) for i in
                                                          range(recipe.total_steps)],
            "losses": [entry["loss"] for entry in trainer.state.log_history if "loss" in entry],
            "attn_implementation": recipe.config.model.attn_implementation,
            "dtype": "bf16 (DeepSpeed)" if cuda else "float32"}


class StepClock:
    """A ``TrainerCallback`` timing each optimizer step from the end of the one before (the
    first from its ``on_step_begin``), the device synchronized at each reading."""

    def __init__(self, device, base):
        self.times: list[float] = []
        clock = self

        class Callback(base):
            last = None

            def on_step_begin(self, args, state, control, **kwargs):
                if self.last is None:
                    synchronize(device)
                    self.last = time.perf_counter()

            def on_step_end(self, args, state, control, **kwargs):
                synchronize(device)
                now = time.perf_counter()
                clock.times.append(now - self.last)
                self.last = now

        self.callback = Callback()


# -- variants: iga-ds train -----------------------------------------------------------------------


def run_yaml(spec: dict, method: str, out_dir: str, padding_free: bool = False, liger: bool = False,
             fused_lora: bool = True) -> str:
    """The run YAML of ``iga-ds train`` for this benchmark (JSON is YAML)."""
    model = {"name_or_path": spec["model_dir"], "dtype": "bfloat16" if spec["device"] == "cuda" else "float32"}
    if liger:
        model["liger_kernel"] = True
    if not fused_lora:
        model["fused_lora"] = False
    attn = spec["packed_attn"] if padding_free and spec["packed_attn"] != "default" else spec["trainer_attn"]
    if attn != "default":
        model["attn_implementation"] = attn
    config = {
        "output_dir": out_dir, "deepspeed": spec["deepspeed"], "model": model,
        "lora": {"r": spec["r"], "alpha": spec["alpha"], "target_modules": spec["targets"]},
        "data": {"train": spec["train"], "domains": spec["domains"], "groups_per_step": spec["groups_per_step"],
                 "groups_per_micro_batch": spec["groups_per_micro_batch"], "max_length": spec["max_length"],
                 "padding_free": padding_free},
        "schedule": {"lr": spec["lr"], "warmup_ratio": spec["warmup_ratio"], "max_steps": spec["steps"]},
        "method": {"name": method},
        "checkpoint": {"every_steps": 0},
        "logging": {"every_steps": 1, "tensorboard": False, "progress": False,
                    "profile_steps": spec["profile_steps"], "profile_after": spec["warmup_steps"]},
        "seed": spec["seed"], "resume": "never",
    }
    return "# written by bench/bench_train.py\n" + json.dumps(config, indent=2) + "\n"


def run_iga_cli(config: str) -> int:
    """``python -m iga_ds train --config CONFIG`` in this process (runpy: what ``-m`` does)."""
    sys.argv = ["iga_ds", "train", "--config", config]
    try:
        runpy.run_module("iga_ds", run_name="__main__", alter_sys=True)
    except SystemExit as exc:
        return exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
    return 0


def iga_result(out_dir: Path) -> dict:
    """Step times and tokens from the trainer's metrics.jsonl; its attention from the resolved config."""
    rows = read_jsonl(out_dir / "metrics.jsonl")
    resolved = (out_dir / "config.resolved.yaml").read_text(encoding="utf-8")
    attn = next((line.split(":", 1)[1].strip() for line in resolved.splitlines()
                 if line.strip().startswith("attn_implementation:")), None)
    profile = [out_dir / PROFILE_JSON, out_dir / PROFILE_TXT]
    return {"step_times_s": [r["step_interval_s"] for r in rows],
            "step_tokens": [round(r["tokens_per_s"] * r["step_time_s"]) for r in rows],
            "losses": [r["loss"] for r in rows], "attn_implementation": attn,
            "profile": [str(p) for p in profile] if all(p.is_file() for p in profile) else None}


# -- one variant's process ------------------------------------------------------------------------


def worker(variant: str, spec_path: str, result_path: str) -> int:
    spec = read_json(spec_path, objects=True)
    if variant.startswith("iga_ds_"):
        out_dir = Path(spec["work"]) / "runs" / variant
        config = Path(spec["work"]) / f"{variant}.yaml"
        shutil.rmtree(out_dir, ignore_errors=True)  # an earlier run's, with the same --work-dir
        method = variant.removeprefix("iga_ds_").removesuffix(UNFUSED).removesuffix(LIGER).removesuffix(PACKED)
        atomic_write_text(config, run_yaml(spec, method, str(out_dir), PACKED in variant, LIGER in variant,
                                           UNFUSED not in variant))
        rc = run_iga_cli(str(config))
        result = iga_result(out_dir) if rc == 0 else {}
        result.update(rc=rc, dtype="bf16 (DeepSpeed)" if spec["device"] == "cuda" else "float32")
    else:
        result = {"torch": run_torch, "torch_no_cudnn": lambda s: run_torch(s, cudnn=False),
                  "torch_user": run_torch_user, "hf_trainer": run_hf_trainer,
                  "sft_trainer_iga": run_sft_trainer_iga}[variant](spec)
        result["rc"] = 0
    cuda = spec["device"] == "cuda"
    result["peak_memory_bytes"] = torch.cuda.max_memory_allocated() if cuda else None
    atomic_write_json(result_path, result)
    return result["rc"]


def skip_reason(variant: str, spec: dict) -> str | None:
    """Why ``variant`` cannot run here, or None."""
    if variant in TRAINER_VARIANTS and importlib.util.find_spec("accelerate") is None:
        return "accelerate is not installed (the Hugging Face Trainer needs it: pip install accelerate)"
    if variant == "sft_trainer_iga" and importlib.util.find_spec("trl") is None:
        return "trl is not installed (IGASFTTrainer needs it: pip install 'iga-ds[trl]')"
    if LIGER in variant:
        try:
            require_liger_kernel()  # the trainer's own check
        except ConfigError as exc:
            return f"liger-kernel runs on CUDA only: {exc}"
    if PACKED in variant and spec["packed_attn"] == VARLEN_ATTENTION and (reason := varlen_unavailable()):
        return f"{VARLEN_ATTENTION} attention {reason}"
    return None


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_variant(variant: str, spec: dict, spec_path: Path, timeout_s: float) -> dict:
    """One variant in a process of its own; its result, or ``error`` with the end of its log."""
    work = Path(spec["work"])
    result_path, log_path = work / f"{variant}.result.json", work / "logs" / f"{variant}.log"
    log_path.parent.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ)
    if spec["device"] == "cpu":
        env["DS_ACCELERATOR"] = "cpu"
    if variant in TRAINER_VARIANTS:  # one rank for accelerate's DeepSpeed state
        env.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", LOCAL_WORLD_SIZE="1", MASTER_ADDR="127.0.0.1",
                   MASTER_PORT=str(free_port()))
    command = [sys.executable, os.path.abspath(__file__), "--worker", variant, "--spec", str(spec_path),
               "--result", str(result_path)]
    started = time.perf_counter()
    try:
        with open(log_path, "w") as log:
            rc = subprocess.run(command, env=env, stdout=log, stderr=subprocess.STDOUT, timeout=timeout_s).returncode
    except subprocess.TimeoutExpired:
        rc = "timeout"
    wall = time.perf_counter() - started
    if rc != 0 or not result_path.is_file():
        tail = log_path.read_text(errors="replace")[-3000:]
        return {"error": f"exit status {rc} after {wall:.0f}s; the end of {log_path}:\n{tail}", "wall_s": wall}
    result = read_json(result_path, objects=True)
    result["wall_s"] = wall
    result["log"] = str(log_path)
    return result


# -- FLOPs, the summary, the table ----------------------------------------------------------------


def parameter_counts(model_dir: str, rank: int, targets) -> dict:
    """Weights of the base's linear layers (output layer included), the LoRA adapters' weights,
    layers and attention width, from the model's config (built on the meta device)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(model_dir)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    base = lora = 0
    for name, module in model.named_modules():
        if isinstance(module, torch.nn.Linear):
            base += module.weight.numel()
            if name.rsplit(".", 1)[-1] in targets:
                lora += rank * (module.in_features + module.out_features)
    heads = config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    return {"base_linear": base, "lora": lora, "layers": config.num_hidden_layers, "attn_width": heads * head_dim,
            "total": sum(p.numel() for p in model.parameters())}


def step_flops(counts: dict, tokens: list[int], squares: list[int]) -> list[float]:
    """The module docstring's formula, per step."""
    per_token = 4 * counts["base_linear"] + 6 * counts["lora"]
    attention = 12 * counts["layers"] * counts["attn_width"]
    return [per_token * t + attention * q for t, q in zip(tokens, squares)]


def peak_flops(card: str, override_tflops: float | None) -> float | None:
    if override_tflops:
        return override_tflops * 1e12
    return next((peak for name, peak in PEAK_BF16 if name in card), None)


def timed_ranges(total: int, steps: int, warmup: int, profiled: int = 0) -> list[list[int]]:
    """[start, end) of the timed steps of each round in ``total`` steps of rounds of ``steps``:
    each round's first ``warmup``, and the first round's ``profiled`` after them, left out."""
    return [[start + warmup + (profiled if start == 0 else 0), start + steps] for start in range(0, total, steps)]


def timed_index(ranges: list[list[int]]) -> list[int]:
    """The step indices of ``ranges`` ([start, end) pairs), in order."""
    return [i for start, end in ranges for i in range(start, end)]


def summarize(result: dict, warmup: int, flops: list[float], peak: float | None, profiled: int = 0,
              steps: int | None = None) -> dict:
    """Median step and spread, tokens/s and MFU over the steps after ``warmup`` and the
    ``profiled`` ones that follow it (``--profile``: the profiler's cost is in their time); with
    ``--rounds``, ``result`` holds the rounds back to back, ``steps`` each, each with its warm-up."""
    times, tokens = result["step_times_s"], result["step_tokens"]
    steps = steps or len(times)
    ranges = timed_ranges(len(times), steps, warmup, profiled)
    index = timed_index(ranges)
    timed, timed_tokens = [times[i] for i in index], [tokens[i] for i in index]
    row = {"steps": len(times), "timed_steps": len(timed), "tokens": sum(tokens), "step_tokens": tokens,
           "step_times_s": times, **({"profiled_steps": profiled} if profiled else {})}
    if len(ranges) > 1:
        row.update(rounds=len(ranges), timed_ranges=ranges)
    if not timed:
        return {**row, "error": f"no steps after the {warmup} warm-up" + (f" and {profiled} profiled" if profiled
                                                                          else "") + " steps"}
    stats = spread(timed)
    seconds = sum(timed)
    row.update(median_step_s=stats["median"], p10_step_s=stats["p10"], p90_step_s=stats["p90"],
               tokens_per_s=sum(timed_tokens) / seconds,
               mfu=(sum(flops[i % len(flops)] for i in index) / seconds / peak) if peak else None)
    if result.get("peak_memory_bytes") is not None:
        row["peak_memory_gb"] = result["peak_memory_bytes"] / 1e9
    return row


def table(rows: list[dict], card: str) -> str:
    lines = [f"{'variant':<19} {'median step s':>13}  {'[p10-p90]':<17} {'tokens/s':>10} {'peak GB':>8} {'MFU %':>6}"]
    lines.append("-" * len(lines[0]))
    for row in rows:
        if "median_step_s" not in row:
            why = row.get("skipped") or (row.get("error") or "").splitlines()[0]
            lines.append(f"{row['variant']:<19} {'skipped' if row.get('skipped') else 'FAILED'}: {why}")
            continue
        spread_text = f"[{row['p10_step_s']:.3f}-{row['p90_step_s']:.3f}]"
        peak = f"{row['peak_memory_gb']:.2f}" if row.get("peak_memory_gb") is not None else "n/a"
        mfu = f"{100 * row['mfu']:.1f}" if row.get("mfu") is not None else "n/a"
        lines.append(f"{row['variant']:<19} {row['median_step_s']:>13.3f}  {spread_text:<17} "
                     f"{row['tokens_per_s']:>10,.0f} {peak:>8} {mfu:>6}")
    lines.append(f"card: {card}")
    return "\n".join(lines)


# -- the driver -----------------------------------------------------------------------------------


def shape_folder(name: str, folder: Path, train: str, device: torch.device) -> str:
    """A LLaMA of shape ``name`` with random weights and the word-level tokenizer, saved once."""
    from transformers import LlamaConfig, LlamaForCausalLM

    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    marker = {"shape": name, "fields": SHAPES[name], "dtype": str(dtype), "train": train}
    if (folder / "bench_shape.json").is_file() and read_json(folder / "bench_shape.json") == marker:
        return str(folder)  # built by an earlier run with this --work-dir
    shutil.rmtree(folder, ignore_errors=True)
    tokenizer = build_word_tokenizer(build_vocab(corpus_texts(read_records(train)), generator_words()))
    fields = dict(SHAPES[name])
    fields["vocab_size"] = fields["vocab_size"] or len(tokenizer)
    config = LlamaConfig(**fields, pad_token_id=tokenizer.pad_token_id, bos_token_id=tokenizer.bos_token_id,
                         eos_token_id=tokenizer.eos_token_id)
    torch.manual_seed(0)
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            model = LlamaForCausalLM(config)
    finally:
        torch.set_default_dtype(previous)
    model.save_pretrained(str(folder))
    tokenizer.save_pretrained(str(folder))
    atomic_write_json(folder / "bench_shape.json", marker)  # last: the folder is whole
    del model
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return str(folder)


def plan_spec(args, work: Path, device: torch.device) -> dict:
    """The spec file's content, before anything is built (the model folder where ``--model`` names one)."""
    micro = args.groups_per_micro_batch or args.groups_per_step
    check_batch_layout(args.groups_per_step, micro, 1)  # the trainer's rule, before anything runs
    ds = shipped_file("ds_configs/zero2.json") if device.type == "cuda" else default_ds_config()
    return {"work": str(work), "device": device.type, "model_dir": args.model or str(work / "model"),
            "train": str(work / "data" / "train.jsonl"),
            "domains": list(DEFAULT_DOMAINS), "groups_per_step": args.groups_per_step,
            "groups_per_micro_batch": micro,
            "max_length": args.max_length, "steps": args.steps, "lr": args.lr, "warmup_ratio": args.lr_warmup_ratio,
            "seed": args.seed, "r": args.rank, "alpha": args.alpha, "targets": list(LORA_TARGETS),
            "deepspeed": ds, "trainer_attn": args.trainer_attn, "packed_attn": args.packed_attn, "warmup_steps": args.warmup_steps,
            "profile_steps": PROFILE_STEPS if args.profile else 0}


def prepare(args, spec: dict, device: torch.device) -> dict:
    """The data, the model folder and the tokens (cached for every variant): the spec, completed."""
    synthesize(Path(spec["train"]).parent, args.groups, args.seed, DEFAULT_DOMAINS, max_depth=4)
    model_dir = args.model or shape_folder(args.shape, Path(spec["model_dir"]), spec["train"], device)
    return {**spec, "model_dir": model_dir}


def run_settings(args, spec: dict) -> dict:
    settings = {k: spec[k] for k in ("model_dir", "groups_per_step", "groups_per_micro_batch", "max_length", "steps",
                                     "lr", "warmup_ratio", "seed", "r", "alpha", "targets", "deepspeed",
                                     "trainer_attn")}
    settings.update(shape=None if args.model else args.shape, warmup_steps=args.warmup_steps, groups=args.groups)
    if spec["packed_attn"] != "default":  # recorded only when set: older reports still resume
        settings["packed_attn"] = spec["packed_attn"]
    if spec["profile_steps"]:  # its steps are left out of the figures: --resume keeps like with like
        settings["profile_steps"] = spec["profile_steps"]
    return settings


def earlier_rows(path: str, settings: dict, card: str) -> dict[str, dict]:
    """``--resume``: the variants that ``path`` already measured with these settings on this card."""
    if not Path(path).is_file():
        return {}
    earlier = read_json(path, objects=True, error=UserError)

    def comparable(s: dict) -> dict:  # a named shape is rebuilt in each work folder: its path differs
        return {k: v for k, v in s.items() if not (k == "model_dir" and s.get("shape"))}

    before, now = comparable(earlier.get("settings") or {}), comparable(settings)
    if earlier.get("card") != card or before != now:
        changed = sorted(k for k in before.keys() | now.keys() if before.get(k) != now.get(k))
        what = f"card {earlier.get('card')!r}" if earlier.get("card") != card else f"other {', '.join(changed)}"
        raise UserError(f"--resume: {path} was measured with {what}; give another --out, or leave out --resume")
    return {row["variant"]: row for row in earlier.get("variants", []) if "median_step_s" in row}


# (variant, baseline) step-time ratios paired by step: the method's cost, each layout's, the anchors
PAIRS = (("iga_ds_iga", "iga_ds_erm"), ("iga_ds_iga_packed", "iga_ds_erm_packed"), ("iga_ds_erm_packed", "iga_ds_erm"),
         ("iga_ds_erm_captured", "iga_ds_erm"), ("iga_ds_erm", "torch"), ("iga_ds_iga", "torch"),
         ("iga_ds_erm", "torch_user"), ("iga_ds_iga", "torch_user"), ("torch", "torch_user"),
         ("iga_ds_erm", "hf_trainer"), ("iga_ds_iga", "hf_trainer"), ("sft_trainer_iga", "iga_ds_iga"),
         ("sft_trainer_iga", "hf_trainer"), ("torch_no_cudnn", "torch"),
         ("iga_ds_erm", "torch_no_cudnn"), ("iga_ds_iga", "torch_no_cudnn"), ("iga_ds_erm_liger", "iga_ds_erm"),
         ("iga_ds_iga_liger", "iga_ds_iga"), ("iga_ds_iga_liger", "iga_ds_erm_liger"),
         ("iga_ds_iga_packed_liger", "iga_ds_erm_packed_liger"), ("iga_ds_erm_packed_liger", "iga_ds_erm_liger"),
         ("iga_ds_iga_packed_liger", "iga_ds_iga_liger"), ("iga_ds_erm", "iga_ds_erm_unfused"),
         ("iga_ds_iga", "iga_ds_iga_unfused"), ("iga_ds_iga_unfused", "iga_ds_erm_unfused"),
         ("iga_ds_erm_packed_liger", "iga_ds_erm_packed_liger_unfused"),
         ("iga_ds_iga_packed_liger", "iga_ds_iga_packed_liger_unfused"),
         ("iga_ds_iga_packed_liger_unfused", "iga_ds_erm_packed_liger_unfused"))


def paired_ratios(rows: list[dict]) -> list[dict]:
    """PAIRS' step-time ratios over the timed steps both measured, with 90% bootstrap intervals
    over steps (every variant runs the same steps: the same tokens at the same index)."""
    by_name = {row["variant"]: row for row in rows if "median_step_s" in row}
    out = []
    for name, base in PAIRS:
        a, b = by_name.get(name), by_name.get(base)
        if a is None or b is None or a["step_tokens"] != b["step_tokens"]:
            continue
        ranges = a.get("timed_ranges") or [[len(a["step_times_s"]) - a["timed_steps"], len(a["step_times_s"])]]
        index = timed_index(ranges)
        ratio, lo, hi = paired_ratio([a["step_times_s"][i] for i in index], [b["step_times_s"][i] for i in index])
        out.append({"variant": name, "baseline": base, "step_ratio": ratio, "interval90": [lo, hi]})
    return out


REPO = Path(__file__).resolve().parents[1]
PATH_FIELDS = ("model_dir", "deepspeed", "log")  # settings' and rows' paths in the work folder or the repository
BESIDE_OUT = ("profile_json", "profile_txt")  # rows' files copied beside --out


def portable(record: dict, work: str, out: str) -> dict:
    """``record`` with its paths as another machine reads them: under the work folder as
    ``WORK_DIR/...``, in the repository relative to it, the files beside ``--out`` by their
    names; any other path (a model folder elsewhere) as given."""
    def relative(value, roots):
        if not isinstance(value, str) or not os.path.isabs(value):
            return value
        path = Path(value).resolve()
        for root, prefix in roots:
            if path.is_relative_to(root):
                return prefix + path.relative_to(root).as_posix()
        return value

    inside = ((Path(work).resolve(), "WORK_DIR/"), (REPO, ""))
    beside = ((Path(out).resolve().parent, ""),)
    return {k: relative(v, inside) if k in PATH_FIELDS else relative(v, beside) if k in BESIDE_OUT else v
            for k, v in record.items()}


def report(settings: dict, spec: dict, out: str, rows: list[dict], counts: dict, env: dict, card: str,
           peak) -> dict:
    """The JSON: ``settings`` as recorded (portable), the rows' paths made portable, the paired ratios."""
    rows = [portable(row, spec["work"], out) for row in rows]
    return {"benchmark": "bench_train", "card": card, "peak_flops": peak, "environment": env, "settings": settings,
            "parameters": counts, "flops_formula": "4*N_base*T + 6*N_lora*T + 12*L*d_attn*sum(n_i^2)",
            "variants": rows, "paired": paired_ratios(rows)}


def drive(args) -> int:
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.type == "cpu":
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
    card = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"
    env, peak = environment(device), peak_flops(card, args.peak_tflops)
    work = Path(args.work_dir or tempfile.mkdtemp(prefix="bench_train."))
    work.mkdir(parents=True, exist_ok=True)
    try:
        spec = plan_spec(args, work.resolve(), device)
        settings = portable(run_settings(args, spec), spec["work"], args.out)  # as the JSON records them
        kept = earlier_rows(args.out, settings, card) if args.resume else {}
        spec = prepare(args, spec, device)
        spec_path = work / "spec.json"
        atomic_write_json(spec_path, spec)
        batches, plan = load_plan(spec)  # tokenized once here: the variants read the cache
        tokens, squares = step_sizes(batches, plan)
        counts = parameter_counts(spec["model_dir"], args.rank, LORA_TARGETS)
        flops = step_flops(counts, tokens, squares)
        print(f"{len(plan)} steps of {sum(tokens) / len(plan):.0f} tokens on average, "
              f"{counts['base_linear']:,} base linear weights, {counts['lora']:,} LoRA weights; work folder {work}",
              flush=True)
        # later rounds profile nothing: the profiled steps stay the first round's
        later_spec = work / "spec_later_rounds.json"
        atomic_write_json(later_spec, {**spec, "profile_steps": 0})
        done = {v: row for v, row in kept.items() if v in args.variants}
        for v, row in done.items():
            print(f"{v}: {row.get('rounds', 1)} of {args.rounds} rounds measured earlier, kept from {args.out}",
                  flush=True)
        written = {"paired": []}
        for r in range(args.rounds):
            order = args.variants if r % 2 == 0 else args.variants[::-1]  # drift over minutes favours none
            for variant in order:
                earlier = done.get(variant)
                if earlier is not None and ("median_step_s" not in earlier or earlier.get("rounds", 1) > r):
                    continue  # failed or skipped (no more rounds), or this round measured already
                done[variant] = measure(variant, spec, spec_path if r == 0 else later_spec, args, flops, peak,
                                        earlier, r)
                rows = [done[v] for v in args.variants if v in done]
                written = report(settings, spec, args.out, rows, counts, env, card, peak)
                atomic_write_json(args.out, written)
        rows = [done[v] for v in args.variants if v in done]
    finally:
        if not args.work_dir:
            shutil.rmtree(work, ignore_errors=True)
    print("\n" + table(rows, card))
    for pair in written["paired"]:  # as the JSON has them
        lo, hi = pair["interval90"]
        print(f"{pair['variant']} / {pair['baseline']}: step time {pair['step_ratio']:.3f}, paired by step "
              f"(90% bootstrap interval {lo:.3f}-{hi:.3f})")
    print(environment_line(env))
    print(f"wrote {args.out}")
    return 1 if any("error" in row for row in rows) else 0


def measure(variant: str, spec: dict, spec_path: Path, args, flops, peak, earlier: dict | None = None,
            round_index: int = 0) -> dict:
    """Round ``round_index`` of ``variant``: its row, the earlier rounds' steps (``earlier``) and its own."""
    why = skip_reason(variant, spec)
    if why:
        print(f"{variant}: skipped: {why}", flush=True)
        return {"variant": variant, "label": LABELS[variant], "skipped": why}
    of = f", round {round_index + 1} of {args.rounds}" if args.rounds > 1 else ""
    print(f"{variant}: running ({LABELS[variant]}{of})", flush=True)
    result = run_variant(variant, spec, spec_path, args.timeout_s)
    if "error" in result:
        print(f"{variant}: FAILED: {result['error']}", flush=True)
        return {"variant": variant, "label": LABELS[variant], **result}
    if earlier is not None:  # the rounds back to back; the first round's losses, the highest peak
        peaks = [result.get("peak_memory_bytes"), earlier.get("peak_memory_gb") and earlier["peak_memory_gb"] * 1e9]
        result = {**result, "step_times_s": earlier["step_times_s"] + result["step_times_s"],
                  "step_tokens": earlier["step_tokens"] + result["step_tokens"], "losses": earlier["losses"],
                  "wall_s": earlier["wall_s"] + result["wall_s"],
                  "peak_memory_bytes": max((p for p in peaks if p is not None), default=None)}
    row = {"variant": variant, "label": LABELS[variant],
           **summarize(result, args.warmup_steps, flops, peak, spec["profile_steps"], args.steps),
           **{k: result.get(k) for k in ("attn_implementation", "dtype", "losses", "wall_s")}}
    if args.work_dir:  # a temporary work folder is gone at the end, its logs with it
        row["log"] = result.get("log")
    if earlier is not None and earlier.get("profile_json"):
        row["profile_json"], row["profile_txt"] = earlier["profile_json"], earlier["profile_txt"]
    elif result.get("profile"):
        row["profile_json"], row["profile_txt"] = keep_profile(result["profile"], args.out, variant)
    if "median_step_s" in row:
        print(f"{variant}: median step {row['median_step_s']:.3f} s, {row['tokens_per_s']:,.0f} tokens/s", flush=True)
    return row


def keep_profile(paths: list[str], out: str, variant: str) -> list[str]:
    """The variant's profile.json and profile.txt copied beside ``--out``: ``<stem>_profile_<variant>.*``."""
    kept = []
    for path in paths:
        target = Path(out).with_name(f"{Path(out).stem}_profile_{variant}{Path(path).suffix}")
        atomic_write_text(target, Path(path).read_text(encoding="utf-8"))
        kept.append(str(target))
    return kept


def variant_list(text: str) -> list[str]:
    names = [v.strip() for v in text.split(",") if v.strip()]
    unknown = [v for v in names if v not in VARIANTS]
    if unknown or not names:
        raise argparse.ArgumentTypeError(f"expected a comma list of {', '.join(VARIANTS)}, got {text!r}")
    return names


def positive_int(text: str) -> int:
    if not text.isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}")
    return int(text)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description="Training throughput: iga-ds train (ERM, IGA) beside a plain PyTorch "
                                "loop and the Hugging Face Trainer, same records, tokens, batches and schedule")
    what = p.add_mutually_exclusive_group()
    what.add_argument("--model", help="a model folder (or hub id) to train on, with its tokenizer")
    what.add_argument("--shape", choices=[s for s in SHAPES if s != "tiny"],
                      help=f"a named shape with random weights (default {DEFAULTS['shape']})")
    p.add_argument("--variants", type=variant_list, default=list(VARIANTS), help=f"comma list of {', '.join(VARIANTS)}")
    p.add_argument("--steps", type=int, help=f"optimizer steps per variant (default {DEFAULTS['steps']})")
    p.add_argument("--warmup-steps", type=int, help=f"first steps left out of the figures (default "
                   f"{DEFAULTS['warmup_steps']})")
    p.add_argument("--max-length", type=int, help=f"tokens per sequence at most (default {DEFAULTS['max_length']})")
    p.add_argument("--groups-per-step", type=int, default=4, help="isomer groups per step (x 4 domains = sequences)")
    p.add_argument("--groups-per-micro-batch", type=int, help="groups per forward pass (default: all of a step's)")
    p.add_argument("--groups", type=int, help=f"synthetic isomer groups generated (default {DEFAULTS['groups']}; "
                   "80%% of them train)")
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--lr-warmup-ratio", type=float, default=0.03, help="share of the steps with a linear lr warm-up")
    p.add_argument("--rank", type=int, default=16, help="LoRA rank (alpha: twice it)")
    p.add_argument("--trainer-attn", choices=("default", "eager", "sdpa"), default="default",
                   help="iga-ds train's attention (default: the trainer's own default); the anchors use SDPA")
    p.add_argument("--packed-attn", choices=("default", "eager", "sdpa", "flex_attention", "flash_attention_2",
                                             VARLEN_ATTENTION),
                   default="default", help="the padding-free variants' attention (default: --trainer-attn's); "
                   "eager and sdpa score the whole packed row, flex_attention, flash_attention_2 and "
                   f"{VARLEN_ATTENTION} skip across-sequence blocks (flash_attention_2 needs the flash-attn "
                   f"package; {VARLEN_ATTENTION}, PyTorch's own varlen kernel, CUDA)")
    p.add_argument("--peak-tflops", type=float, help="the card's dense bf16 peak in TFLOP/s (default: from its name)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--rounds", type=positive_int, default=1,
                   help="run every variant this many times, in alternating order (as listed, then reversed), "
                        "each round with its own warm-up; the figures pool the rounds' timed steps")
    p.add_argument("--timeout-s", type=float, default=1800, help="limit per variant and round")
    p.add_argument("--work-dir", help="keep the data, model, runs and logs here (default: a temporary folder, removed)")
    p.add_argument("--small", action="store_true", help="CPU smoke run: a tiny shape, a few steps, seconds")
    p.add_argument("--profile", action="store_true",
                   help=f"torch.profiler over the {PROFILE_STEPS} steps after the warm-up ones (left out of the "
                        "figures) of the plain loops and iga-ds variants; their profile.json/.txt beside --out as "
                        "<out stem>_profile_<variant>.json/.txt")
    p.add_argument("--out", default="bench_train.json")
    p.add_argument("--resume", action="store_true",
                   help="keep the variants that --out already measured with the same settings (a run cut short "
                        "goes on where it stopped); other settings there are an error")
    p.add_argument("--worker", choices=VARIANTS, help=argparse.SUPPRESS)
    p.add_argument("--spec", help=argparse.SUPPRESS)
    p.add_argument("--result", help=argparse.SUPPRESS)
    return p


def resolve_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The command line, with ``--small``'s settings or the defaults where it gives none."""
    args = build_parser().parse_args(argv)
    defaults = SMALL if args.small else DEFAULTS
    for key, value in defaults.items():
        if getattr(args, key) is None and not (key == "shape" and args.model):
            setattr(args, key, value)
    args.alpha = 2 * args.rank
    return args


def main(argv: list[str] | None = None) -> int:
    args = resolve_args(argv)
    if args.worker:
        return worker(args.worker, args.spec, args.result)
    try:
        return drive(args)
    except UserError as exc:  # a bad option or input: one line
        print(f"bench_train.py: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
