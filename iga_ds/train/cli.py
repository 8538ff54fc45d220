"""``iga-ds train`` and ``iga-ds pretrain-tiny``.

The commands import the training code when they run, not when the parser is built: that keeps
``iga-ds --help`` and every other command's start-up free of torch, DeepSpeed and pydantic.
"""
from __future__ import annotations

import argparse
import json
import os

from iga_ds.errors import UserError


def register(subparsers) -> None:
    p = subparsers.add_parser(
        "train",
        help="LoRA fine-tuning on isomer groups through the DeepSpeed ZeRO-2 engine hook",
        description="One process (CPU or one GPU). For several GPUs or nodes use "
        "`deepspeed launch/train.py --config CFG.yaml --deepspeed ds_configs/zero2.json`.",
    )
    p.add_argument("--config", required=True, help="run YAML (see configs/)")
    add_deepspeed_arguments(p)
    add_dry_run_arguments(p)
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

    overrides = list(args.overrides) + deepspeed_overrides(args)
    config = load_run_config(args.config, overrides)
    if args.dry_run:
        return dry_run(config, args.world_size)
    result = train(config)
    print(result_line(result))
    return 0


def result_line(result) -> str:
    """The last line of ``iga-ds train``: stopped, done, or already complete (a rerun of a
    finished run resumes at its last step and trains nothing)."""
    if result.status == "stopped":
        return f"stopped at step {result.step}/{result.total_steps}; checkpoint in {result.output_dir}/checkpoints"
    if not result.history and result.step >= result.total_steps:
        return (f"already complete: all {result.total_steps} steps ran before; nothing trained; adapter in "
                f"{result.adapter_dir} (another output_dir, or delete this one, to train again)")
    return f"done: {result.step} steps in {result.wall_seconds:.0f}s; adapter in {result.adapter_dir}"


def _pretrain_tiny(args: argparse.Namespace) -> int:
    from iga_ds.config.base import validate_section
    from iga_ds.config.run import TinyBaseConfig
    from iga_ds.train.batching import read_records
    from iga_ds.train.model import ensure_tiny_base
    from iga_ds.train.pretrain import corpus_texts, default_tiny_base, generator_words

    cfg = validate_section(TinyBaseConfig, {} if args.steps is None else {"steps": args.steps}, "pretrain-tiny")
    if args.data and args.groups is not None:
        raise UserError("--groups sizes the generator's corpus; with --data the corpus is your files")
    if args.groups is not None and args.groups < 1:
        raise UserError(f"--groups {args.groups}: expected a positive number of groups")
    if args.data:
        texts = corpus_texts([r for path in args.data for r in read_records(path)])
        # the generator's words always join the vocabulary: generated data stays readable
        print(ensure_tiny_base(texts, cfg, args.cache_dir, extra_words=generator_words()))
    else:
        # the generator's corpus, as builtin:tiny builds it: its recipe is recorded, so that a
        # later lookup of the same base generates no corpus
        print(default_tiny_base(cfg, args.groups, cache_dir=args.cache_dir))
    return 0


def add_dry_run_arguments(parser: argparse.ArgumentParser) -> None:
    """``--dry-run`` and ``--world-size``; shared with launch/train.py."""
    parser.add_argument("--dry-run", action="store_true",
                        help="resolve the run YAML, the overrides, every path and the DeepSpeed JSON as training would, "
                        "print the resolved config, and train nothing")
    parser.add_argument("--world-size", type=int, default=None, metavar="N",
                        help="--dry-run: the number of ranks to check the batch layout for (default: the launcher's, "
                        "else 1)")


def dry_run(config, world_size: int | None) -> int:
    """Print the run as training would resolve it (YAML), or fail with the same one-line error."""
    import yaml

    from iga_ds.train.dry_run import resolve_run

    world = world_size if world_size is not None else int(os.environ.get("WORLD_SIZE", "1") or 1)
    print(yaml.safe_dump(resolve_run(config, world), sort_keys=False), end="")
    return 0


def add_deepspeed_arguments(parser: argparse.ArgumentParser) -> None:
    """``--deepspeed JSON`` (the Hugging Face Trainer's spelling) and ``--deepspeed_config JSON``
    (DeepSpeed's own, beside which a bare ``--deepspeed`` is DeepSpeed's on-switch); shared with
    launch/train.py."""
    parser.add_argument("--deepspeed", nargs="?", const="", default=None, metavar="JSON",
                        help="DeepSpeed JSON (or hjson), optionally with an \"iga\" block; overrides the run YAML's "
                        "`deepspeed` (relative to the working directory)")
    parser.add_argument("--deepspeed_config", "--deepspeed-config", default=None, metavar="JSON",
                        help="the same, under DeepSpeed's own name")


def deepspeed_overrides(args: argparse.Namespace) -> list[str]:
    """The ``deepspeed=PATH`` override that ``--deepspeed`` / ``--deepspeed_config`` give, if any."""
    paths = list(dict.fromkeys(p for p in (args.deepspeed, args.deepspeed_config) if p))
    if len(paths) > 1:
        raise UserError(f"--deepspeed {paths[0]} and --deepspeed_config {paths[1]} name two files; give one")
    return [f"deepspeed={json.dumps(paths[0])}"] if paths else []  # quoted: the path stays a string
