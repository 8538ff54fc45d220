"""``iga-ds train`` and ``iga-ds pretrain-tiny``.

The commands import the training code when they run, not when the parser is built: that keeps
``iga-ds --help`` and every other command's start-up free of torch and DeepSpeed.
"""
from __future__ import annotations

import argparse


def register(subparsers) -> None:
    p = subparsers.add_parser(
        "train",
        help="LoRA fine-tuning on isomer groups through the DeepSpeed ZeRO-2 engine hook",
        description="One process (CPU or one GPU). For several GPUs or nodes use "
        "`deepspeed launch/train.py --config CFG.yaml --deepspeed ds_configs/zero2.json`.",
    )
    p.add_argument("--config", required=True, help="run YAML (see configs/)")
    p.add_argument("--deepspeed", default=None, help="DeepSpeed JSON with an \"iga\" block (overrides the YAML's)")
    p.add_argument("overrides", nargs="*", metavar="KEY=VALUE", help="e.g. schedule.max_steps=100 method.name=erm")
    p.set_defaults(func=_train)

    p = subparsers.add_parser(
        "pretrain-tiny",
        help="pretrain (or find cached) the built-in tiny LLaMA base on generator text",
        description="Builds the word-level tokenizer and tiny LLaMA used by `model.name_or_path: builtin:tiny`, "
        "pretrained from scratch and cached by a hash of its settings and corpus under $IGA_DS_CACHE "
        "(default ~/.cache/iga-ds). Prints the model folder.",
    )
    p.add_argument("--data", nargs="*", default=None, help="isomer JSON Lines to pretrain on (default: generator text)")
    p.add_argument("--groups", type=int, default=None, help="generator groups in the default corpus")
    p.add_argument("--steps", type=int, default=None, help="pretraining steps")
    p.add_argument("--cache-dir", default=None, help="cache root (default $IGA_DS_CACHE or ~/.cache/iga-ds)")
    p.set_defaults(func=_pretrain_tiny)


def _train(args: argparse.Namespace) -> int:
    from iga_ds.config.run import load_run_config
    from iga_ds.train.trainer import train

    overrides = list(args.overrides)
    if args.deepspeed:
        overrides.append(f"deepspeed={args.deepspeed}")
    result = train(load_run_config(args.config, overrides))
    if result.status == "stopped":
        print(f"stopped at step {result.step}/{result.total_steps}; checkpoint in {result.output_dir}/checkpoints")
    else:
        print(f"done: {result.step} steps in {result.wall_seconds:.0f}s; adapter in {result.adapter_dir}")
    return 0


def _pretrain_tiny(args: argparse.Namespace) -> int:
    from iga_ds.config.base import validate_section
    from iga_ds.config.run import TinyBaseConfig
    from iga_ds.train.batching import read_records
    from iga_ds.train.model import ensure_tiny_base
    from iga_ds.train.pretrain import PRETRAIN_GROUPS, corpus_texts, generator_corpus, generator_words

    cfg = validate_section(TinyBaseConfig, {} if args.steps is None else {"steps": args.steps}, "pretrain-tiny")
    if args.data:
        texts = corpus_texts([r for path in args.data for r in read_records(path)])
    else:
        texts = generator_corpus(args.groups or PRETRAIN_GROUPS)
    # the generator's words always join the vocabulary: generated data stays readable
    print(ensure_tiny_base(texts, cfg, args.cache_dir, extra_words=generator_words()))
    return 0
