"""`iga-ds train`, `iga-ds pretrain-tiny` and `iga-ds demo` (torch is imported inside the commands)."""
from __future__ import annotations

import argparse


def register(subparsers) -> None:
    p = subparsers.add_parser(
        "train",
        help="LoRA fine-tuning on isomer groups through the DeepSpeed ZeRO-2 IGA hook",
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

    p = subparsers.add_parser(
        "demo",
        help="ERM vs IGA on synthetic isomers with planted shortcuts (tiny base, CPU, a few minutes)",
    )
    p.add_argument("--out", default="demo_out", help="output folder")
    p.add_argument("--steps", type=int, default=None, help="LoRA steps per method")
    p.add_argument("--methods", default="erm,iga", help="comma-separated method names")
    p.set_defaults(func=_demo)


def _train(args: argparse.Namespace) -> int:
    from iga_ds.train.config import load_run_config
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
    import dataclasses

    from iga_ds.train.model import TinyBaseConfig, ensure_tiny_base
    from iga_ds.train.pretrain import PRETRAIN_GROUPS, corpus_texts, generator_corpus, generator_words

    cfg = TinyBaseConfig()
    if args.steps is not None:
        cfg = dataclasses.replace(cfg, steps=args.steps)
    if args.data:
        from iga_ds.train.batching import read_records

        texts = corpus_texts([r for path in args.data for r in read_records(path)])
    else:
        texts = generator_corpus(args.groups or PRETRAIN_GROUPS)
    # the generator's words always join the vocabulary: generated data stays readable
    print(ensure_tiny_base(texts, cfg, args.cache_dir, extra_words=generator_words()))
    return 0


def _demo(args: argparse.Namespace) -> int:
    from iga_ds.train.demo import run_demo

    run_demo(args.out, methods=[m for m in args.methods.split(",") if m], steps=args.steps)
    return 0
