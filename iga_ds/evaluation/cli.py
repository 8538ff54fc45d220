"""``iga-ds eval``.

Everything here imports at the top but :mod:`iga_ds.evaluation.bases` (the base a run recorded,
or the built-in tiny base: it reads the run config's pydantic models), imported by the command:
the evaluation modules import torch and transformers only inside the functions that load and
run a model, so ``iga-ds --help`` and every other command's start-up stay free of them.
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from iga_ds.data.benchmarks import load_benchmark, resolve_options
from iga_ds.data.sources import is_hub_dataset_id, resolve_source
from iga_ds.errors import UserError
from iga_ds.evaluation.consistency import lcs_block
from iga_ds.evaluation.generation import eval_prompt_format, load_model
from iga_ds.evaluation.records import isomer_items, read_isomer_records, with_counterfactuals
from iga_ds.evaluation.runner import evaluate
from iga_ds.files import check_output_file
from iga_ds.metrics.accuracy import format_percent
from iga_ds.models import check_model_source

DTYPES = ("auto", "float32", "bfloat16", "float16")


def _int_list(text: str) -> list[int]:
    try:
        return [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None


def _option(text: str) -> tuple[str, Any]:
    """``key=value``; the value is JSON if it parses (numbers, lists, true) else a comma list or string."""
    if "=" not in text:
        raise argparse.ArgumentTypeError(f"expected KEY=VALUE, got {text!r}")
    key, value = text.split("=", 1)
    try:
        parsed: Any = json.loads(value)
    except json.JSONDecodeError:
        parsed = [v for v in value.split(",") if v] if "," in value else value
    return key.strip().replace("-", "_"), parsed


def register(subparsers: Any) -> None:
    ev = subparsers.add_parser(
        "eval",
        help="greedy chain-of-thought evaluation of a model (+ adapter) on isomer data or a benchmark",
        description="Generate greedily, extract final answers, score exact match per domain and "
        "ID/OOD split, and write eval.json (resumable: rerun the same command after a kill).",
    )
    ev.add_argument("--base",
                    help="the causal LM, any base training takes: a local folder, a Hugging Face hub id "
                    "(org/name[@revision]; downloaded, or read from the Hugging Face cache when HF_HUB_OFFLINE=1), "
                    "a .gguf file, packaged:NAME, or builtin:tiny (the cached built-in base; its settings with --tiny); "
                    "default: the base the run of --run or --adapter trained")
    trained = ev.add_mutually_exclusive_group()
    trained.add_argument("--adapter", help="PEFT adapter directory (from training)")
    trained.add_argument("--run", metavar="RUN_DIR",
                         help="a training run's folder (its final adapter, and its base unless --base is given) "
                         "or an adapter folder, e.g. demo_out/erm")
    ev.add_argument("--tiny", action="append", type=_option, default=[], metavar="KEY=VALUE",
                    help="with --base builtin:tiny: a setting of the built-in base, as model.tiny in the run YAML, "
                    "e.g. hidden_size=256 (repeatable; default: the run's, else the defaults)")
    ev.add_argument("--tokenizer", help="a tokenizer folder, hub id or .gguf file (default: the adapter's if saved "
                    "there, else the base's)")
    ev.add_argument("--prompt-format", choices=("auto", "plain", "chat"), default=None,
                    help="how an item becomes the prompt: chat (the tokenizer's chat template, the problem as the user "
                    "turn), plain, or auto (chat when the tokenizer has a template); default: the format the adapter "
                    "was trained with, else auto")
    src = ev.add_mutually_exclusive_group(required=True)
    src.add_argument("--data", help="isomer JSON Lines file")
    src.add_argument("--benchmark", help="logiqa2, reclor, math or arb (a local copy, see --benchmark-dir)")
    ev.add_argument("--benchmark-dir", help="your local copy of the benchmark: its folder, or a Parquet or Arrow "
                    "file, a saved dataset folder or a hub id (docs/DATA.md)")
    ev.add_argument(
        "--benchmark-option", action="append", type=_option, default=[], metavar="KEY=VALUE",
        help="override a loader default, e.g. ood_subjects=geometry,precalculus or split=test (repeatable)",
    )
    ev.add_argument("--name", help="name of this evaluation set in eval.json and the report (default: benchmark or file stem)")
    ev.add_argument("--ood-domains", default="", help="isomer data: comma-separated domains to count as OOD")
    ev.add_argument("--max-new-tokens", type=int, default=512)
    ev.add_argument("--batch-size", type=int, default=8)
    ev.add_argument("--limit", type=int, help="evaluate only the first N items, N >= 1 (quick checks)")
    ev.add_argument("--dtype", default="auto", help="auto (bfloat16 on GPUs that support it, else float32), float32, bfloat16, float16")
    ev.add_argument("--device", default="auto", help="auto, cpu, cuda, cuda:1, ...")
    ev.add_argument("--no-stop-after-answer", action="store_true", help="generate until EOS or the token limit even after an Answer line")
    ev.add_argument("--lcs-layers", type=_int_list, help="isomer data: hidden-state layers for LCS (0 = embeddings; default: penultimate, -2)")
    ev.add_argument("--lcs-max-groups", type=int, default=500, help="isomer groups used for LCS (the paper uses 500)")
    ev.add_argument("--no-lcs", action="store_true", help="isomer data: skip the LCS computation")
    ev.add_argument("--restart", action="store_true", help="discard saved partial generations and start over")
    ev.add_argument("--no-progress", action="store_true")
    ev.add_argument("--out", required=True, help="output eval.json")
    ev.set_defaults(func=run_eval)


def _load_items(args: argparse.Namespace) -> tuple[list, dict[str, Any], list[dict] | None]:
    """(items, source description, isomer records or None)."""
    if args.data:
        records = read_isomer_records(args.data)
        name = args.name or Path(args.data).stem
        ood = [d.strip() for d in args.ood_domains.split(",") if d.strip()]
        unknown = sorted(set(ood) - {r["domain"] for r in records})
        if unknown:
            have = ", ".join(sorted({r["domain"] for r in records}))
            raise UserError(f"--ood-domains: {', '.join(unknown)} not in {args.data} (it has {have})")
        items = with_counterfactuals(isomer_items(records, name=name, ood_domains=ood), records)
        where = args.data if resolve_source(args.data).kind == "hub" else str(Path(args.data).resolve())
        source = {"benchmark": name, "data": where, "ood_domains": ood}
        return items, source, records
    if not args.benchmark_dir:
        raise UserError("--benchmark needs --benchmark-dir: your local copy (its folder, a file or a hub id)")
    effective = resolve_options(args.benchmark, dict(args.benchmark_option))
    items = load_benchmark(args.benchmark, args.benchmark_dir, **effective)
    source = {
        "benchmark": args.name or args.benchmark,
        # a hub id is recorded as written: it is no path
        "benchmark_dir": (args.benchmark_dir if is_hub_dataset_id(args.benchmark_dir)
                          and not Path(args.benchmark_dir).exists() else str(Path(args.benchmark_dir).resolve())),
        "benchmark_options": effective,
    }
    return items, source, None


def _check_args(args: argparse.Namespace) -> None:
    """Numbers in range and an output that can be written, before any data or model is read."""
    for flag, value in (("--max-new-tokens", args.max_new_tokens), ("--batch-size", args.batch_size),
                        ("--limit", args.limit), ("--lcs-max-groups", args.lcs_max_groups)):
        if value is not None and value < 1:
            raise UserError(f"{flag} {value}: expected a positive integer")
    if args.dtype not in DTYPES:
        raise UserError(f"--dtype {args.dtype}: expected one of {', '.join(DTYPES)}")
    check_output_file(args.out)


def run_eval(args: argparse.Namespace) -> int:
    from iga_ds.evaluation.bases import resolve_eval_base

    _check_args(args)
    items, source, records = _load_items(args)  # bad data fails before the model loads
    if args.limit is not None:
        items = items[: args.limit]
    if not items:
        raise UserError("no items to evaluate")
    chosen = resolve_eval_base(args.base, args.adapter, args.run, args.tiny)
    adapter = str(chosen.adapter) if chosen.adapter is not None else None
    model, tokenizer = load_model(chosen.base, adapter, args.tokenizer, dtype=args.dtype, device=args.device)
    fmt = eval_prompt_format(tokenizer, adapter, args.prompt_format)
    settings = {
        "model": {
            "base": check_model_source(chosen.base, "--base").label,  # a hub id stays an id
            "adapter": str(Path(adapter).resolve()) if adapter else None,
            **chosen.settings(),  # where the base came from: builtin:tiny, the run
        },
        **source,
        "generation": {
            "greedy": True,
            "max_new_tokens": args.max_new_tokens,
            "stop_after_answer": not args.no_stop_after_answer,
            **fmt.settings(),
            "limit": args.limit,
        },
    }
    extra: dict[str, Any] = {}
    if records is not None and not args.no_lcs:
        try:
            extra["lcs"] = lcs_block(model, tokenizer, records, args.lcs_layers, args.lcs_max_groups,
                                     args.batch_size, not args.no_progress, fmt)
        except ValueError as exc:
            raise UserError(f"--lcs-layers: {exc}") from None
    result = evaluate(
        items, model, tokenizer, args.out, settings, fmt.prompt,
        max_new_tokens=args.max_new_tokens, batch_size=args.batch_size,
        stop_after_answer=not args.no_stop_after_answer, progress=not args.no_progress,
        restart=args.restart, extra=extra, add_special_tokens=fmt.add_special_tokens,
    )
    _print_summary(result, args.out)
    return 0


def _print_summary(result: dict[str, Any], out: str) -> None:
    line = f"{result['benchmark']}: accuracy {format_percent(result['accuracy'], 'n/a')} on {result['n_scored']} scored items"
    if result.get("ood_accuracy") is not None:
        line += f" (ID {format_percent(result['id_accuracy'], 'n/a')}, OOD {format_percent(result['ood_accuracy'], 'n/a')})"
    print(line)
    for domain, acc in result["per_domain"].items():
        print(f"  {domain}: {format_percent(acc['accuracy'], 'n/a')} ({acc['correct']}/{acc['n']})")
    if result.get("lcs"):
        for layer, value in result["lcs"]["layers_x1e-2"].items():
            print(f"  LCS layer {layer}: {value:.3f} x1e-2")
    print(f"wrote {out}")
