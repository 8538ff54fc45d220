"""``iga-ds eval`` and ``iga-ds report``."""
from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from iga_ds.errors import UserError


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
    ev.add_argument("--base", required=True, help="local Hugging Face causal-LM directory")
    ev.add_argument("--adapter", help="PEFT adapter directory (from training)")
    ev.add_argument("--tokenizer", help="tokenizer directory (default: the adapter's if saved there, else the base's)")
    src = ev.add_mutually_exclusive_group(required=True)
    src.add_argument("--data", help="isomer JSON Lines file")
    src.add_argument("--benchmark", help="logiqa2, reclor, math or arb (a local copy, see --benchmark-dir)")
    ev.add_argument("--benchmark-dir", help="folder holding your local copy of the benchmark")
    ev.add_argument(
        "--benchmark-option", action="append", type=_option, default=[], metavar="KEY=VALUE",
        help="override a loader default, e.g. ood_subjects=geometry,precalculus or split=test (repeatable)",
    )
    ev.add_argument("--name", help="name of this evaluation set in eval.json and the report (default: benchmark or file stem)")
    ev.add_argument("--ood-domains", default="", help="isomer data: comma-separated domains to count as OOD")
    ev.add_argument("--max-new-tokens", type=int, default=512)
    ev.add_argument("--batch-size", type=int, default=8)
    ev.add_argument("--limit", type=int, help="evaluate only the first N items (quick checks)")
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

    rep = subparsers.add_parser(
        "report",
        help="tables shaped like the paper's Tables 2, 3, 4, 6 and figures from a results folder",
        description="Read DIR/<cell>/cell.json, eval.json (or eval/*.json) and metrics.jsonl; write "
        "DIR/report.md and PNG figures under DIR/figures (see docs/EVALUATION.md for the layout).",
    )
    rep.add_argument("dir", help="results folder")
    rep.add_argument("--out", help="report file (default: DIR/report.md)")
    rep.add_argument("--no-figures", action="store_true")
    rep.add_argument("--title", default="IGA results", help="the report's heading")
    rep.add_argument("--discussion", help="Markdown file appended after the tables (interpretation)")
    rep.set_defaults(func=run_report)

    pk = subparsers.add_parser(
        "pack",
        help="a results folder as one .tar.xz, or parts of a given size, without weights and data",
        description="Archive DIR for copying elsewhere: cells' results, logs and evaluations; leaves out "
        "adapter/ and checkpoints/ folders and the grid's data/ unless asked. With --part-size the "
        "archive is cut into OUT.part000, OUT.part001, ...; `cat OUT.part* > OUT` joins them, "
        "`tar xJf OUT` unpacks.",
    )
    pk.add_argument("dir", help="results folder (e.g. the --out of `iga-ds experiment`)")
    pk.add_argument("--out", required=True, help="archive to write, e.g. replication.tar.xz")
    pk.add_argument("--part-size", metavar="SIZE", help="cut into parts of at most SIZE (15M, 512K, 2G)")
    pk.add_argument("--with-weights", action="store_true", help="keep adapter/ and checkpoints/ folders")
    pk.add_argument("--with-data", action="store_true", help="keep the grid's generated data/ folder")
    pk.set_defaults(func=run_pack)

    exp = subparsers.add_parser(
        "experiment",
        help="train and evaluate a grid of methods x seeds x ablations, then write the report",
        description="Expand GRID.yaml into cells DIR/<variant>-s<seed>; each cell trains LoRA, evaluates, "
        "and writes cell.json last. Resumable: rerun the same command; finished cells are skipped and a "
        "killed cell is wiped and run again. Ready-made grids: configs/experiments/*.yaml.",
    )
    exp.add_argument("--grid", required=True, help="grid YAML (see docs/EVALUATION.md)")
    exp.add_argument("--out", required=True, help="results folder (the one `iga-ds report` reads)")
    exp.add_argument("--only", action="append", default=[], metavar="PATTERN",
                     help="run only cells whose name matches this glob, e.g. 'iga-*' or '*-s0' (repeatable)")
    exp.add_argument("--dry-run", action="store_true", help="list the cells and their state; run nothing")
    exp.add_argument("--prepare", action="store_true",
                     help="only prepare what the cells share (the data, the built-in tiny bases), then exit: "
                     "the first step of running cells in parallel processes")
    exp.add_argument("--launcher", metavar="COMMAND",
                     help="train each cell through this launcher on several devices, e.g. 'deepspeed --num_gpus 8' "
                     "or 'torchrun --nproc_per_node 4' (default: in this process, one device)")
    exp.add_argument("--no-report", action="store_true", help="do not write DIR/report.md at the end")
    exp.add_argument("--no-progress", action="store_true", help="no progress bars (the per-cell lines stay)")
    exp.set_defaults(func=run_experiment)


def run_pack(args: argparse.Namespace) -> int:
    from iga_ds.evaluation.pack import pack, parse_size

    part_size = parse_size(args.part_size) if args.part_size else None
    written = pack(args.dir, args.out, with_weights=args.with_weights, with_data=args.with_data,
                   part_size=part_size)
    total = sum(p.stat().st_size for p in written)
    size = f"{total / 2**20:.1f} MiB" if total >= 2**20 else f"{total / 2**10:.1f} KiB"
    print(f"packed {args.dir} into {len(written)} file(s), {size}: "
          + ", ".join(str(p) for p in written))
    if part_size is not None:
        print(f"join with: cat {args.out}.part* > {args.out}")
    return 0


def _load_items(args: argparse.Namespace) -> tuple[list, dict[str, Any], list[dict] | None]:
    """(items, source description, isomer records or None)."""
    if args.data:
        from iga_ds.evaluation.records import isomer_items, read_isomer_records

        records = read_isomer_records(args.data)
        name = args.name or Path(args.data).stem
        ood = [d for d in args.ood_domains.split(",") if d]
        items = isomer_items(records, name=name, ood_domains=ood)
        source = {"benchmark": name, "data": str(Path(args.data).resolve()), "ood_domains": ood}
        return items, source, records
    from iga_ds.data.benchmarks import load_benchmark, resolve_options

    if not args.benchmark_dir:
        raise UserError("--benchmark needs --benchmark-dir: the folder of your local copy")
    effective = resolve_options(args.benchmark, dict(args.benchmark_option))
    items = load_benchmark(args.benchmark, args.benchmark_dir, **effective)
    source = {
        "benchmark": args.name or args.benchmark,
        "benchmark_dir": str(Path(args.benchmark_dir).resolve()),
        "benchmark_options": effective,
    }
    return items, source, None


def run_eval(args: argparse.Namespace) -> int:
    if args.max_new_tokens < 1 or args.batch_size < 1:
        raise UserError("--max-new-tokens and --batch-size must be positive")
    items, source, records = _load_items(args)  # bad data fails before the model loads
    if args.limit is not None:
        items = items[: args.limit]
    if not items:
        raise UserError("no items to evaluate")
    from iga_ds.evaluation.generation import load_model
    from iga_ds.evaluation.prompts import PROMPT_TEMPLATE, format_prompt
    from iga_ds.evaluation.runner import evaluate

    model, tokenizer = load_model(args.base, args.adapter, args.tokenizer, dtype=args.dtype, device=args.device)
    settings = {
        "model": {
            "base": str(Path(args.base).resolve()),
            "adapter": str(Path(args.adapter).resolve()) if args.adapter else None,
        },
        **source,
        "generation": {
            "greedy": True,
            "max_new_tokens": args.max_new_tokens,
            "stop_after_answer": not args.no_stop_after_answer,
            "prompt_template": PROMPT_TEMPLATE,
            "limit": args.limit,
        },
    }
    extra: dict[str, Any] = {}
    if records is not None and not args.no_lcs:
        try:
            extra["lcs"] = lcs_block(model, tokenizer, records, args.lcs_layers, args.lcs_max_groups,
                                     args.batch_size, not args.no_progress)
        except ValueError as exc:
            raise UserError(f"--lcs-layers: {exc}") from None
    result = evaluate(
        items, model, tokenizer, args.out, settings, format_prompt,
        max_new_tokens=args.max_new_tokens, batch_size=args.batch_size,
        stop_after_answer=not args.no_stop_after_answer, progress=not args.no_progress,
        restart=args.restart, extra=extra,
    )
    _print_summary(result, args.out)
    return 0


def lcs_block(model: Any, tokenizer: Any, records: list[dict], layers: list[int] | None, max_groups: int,
              batch_size: int, progress: bool) -> dict[str, Any] | None:
    """The ``lcs`` entry of eval.json: LCS at ``layers`` (default penultimate) over the first
    ``max_groups`` complete isomer groups of ``records``; None without two domains."""
    from iga_ds.metrics.consistency import isomer_groups, lcs_of_model, lcs_paper_units

    groups, domains = isomer_groups(records)
    groups = groups[:max_groups]
    if not groups or len(domains) < 2:
        return None
    values = lcs_of_model(model, tokenizer, groups, layers=layers, batch_size=batch_size, progress=progress)
    num_layers = getattr(model.config, "num_hidden_layers", None)
    return {
        "groups": len(groups),
        "domains": domains,
        "num_layers": num_layers,
        "default_layer": num_layers - 1 if num_layers else None,
        "layers": {str(k): v for k, v in sorted(values.items())},
        "layers_x1e-2": {str(k): lcs_paper_units(v) for k, v in sorted(values.items())},
    }


def _fmt(x: float | None) -> str:
    return "n/a" if x is None else f"{x:.1f}%"


def _print_summary(result: dict[str, Any], out: str) -> None:
    line = f"{result['benchmark']}: accuracy {_fmt(result['accuracy'])} on {result['n_scored']} scored items"
    if result.get("ood_accuracy") is not None:
        line += f" (ID {_fmt(result['id_accuracy'])}, OOD {_fmt(result['ood_accuracy'])})"
    print(line)
    for domain, acc in result["per_domain"].items():
        print(f"  {domain}: {_fmt(acc['accuracy'])} ({acc['correct']}/{acc['n']})")
    if result.get("lcs"):
        for layer, value in result["lcs"]["layers_x1e-2"].items():
            print(f"  LCS layer {layer}: {value:.3f} x1e-2")
    print(f"wrote {out}")


def run_experiment(args: argparse.Namespace) -> int:
    from iga_ds.evaluation.experiment import cell_status, run_grid
    from iga_ds.evaluation.grid import load_grid

    grid = load_grid(args.grid)
    if args.dry_run:
        import fnmatch

        cells = [c for c in grid.cells() if not args.only or any(fnmatch.fnmatchcase(c.name, p) for p in args.only)]
        for cell in cells:
            v = cell.variant
            print(f"{cell.name:<28} {cell_status(grid, cell, Path(args.out)):<8} {v.kind:<9} method {v.method}")
        print(f"{len(cells)} cells")
        return 0
    if args.prepare:
        from iga_ds.evaluation.experiment import prepare_grid

        prepare_grid(grid, args.out, progress=not args.no_progress)
        return 0
    run_grid(grid, args.out, only=args.only, progress=not args.no_progress, report=not args.no_report,
             launcher=args.launcher)
    return 0


def run_report(args: argparse.Namespace) -> int:
    from iga_ds.evaluation.report import write_report

    out = write_report(args.dir, out=args.out, figures=not args.no_figures, title=args.title,
                       discussion=args.discussion)
    print(f"wrote {out}")
    return 0
