"""``iga-ds experiment``, ``report``, ``pack``, ``demo``, ``diagnose`` and ``export``.

``experiment``, ``report``, ``demo``, ``diagnose`` and ``export`` import what they run when they
run, not when the parser is built: it loads torch, which would slow ``iga-ds --help`` and every
other command's start-up. ``pack`` loads no heavy library and is imported at the top.
"""
from __future__ import annotations

import argparse
import fnmatch
from pathlib import Path
from typing import Any

from iga_ds.errors import ConfigError, UserError
from iga_ds.experiments import pack as archive
from iga_ds.files import check_output_dir, check_output_file


def register(subparsers: Any) -> None:
    _register_report(subparsers)
    _register_diagnose(subparsers)
    _register_export(subparsers)

    pk = subparsers.add_parser(
        "pack",
        help="a results folder as one .tar.xz, or parts of a given size, without weights and data",
        description="Archive DIR for copying elsewhere: cells' results, logs and evaluations; leaves out "
        "adapter/ and checkpoints/ folders, the grid's data/ and the cells' own train.jsonl unless asked, and lock "
        "files always. With --part-size the "
        "archive is cut into OUT.part000, OUT.part001, ...; `cat OUT.part* > OUT` joins them, "
        "`tar xJf OUT` unpacks.",
    )
    pk.add_argument("dir", help="results folder (e.g. the --out of `iga-ds experiment`)")
    pk.add_argument("--out", required=True, help="archive to write, e.g. replication.tar.xz")
    pk.add_argument("--part-size", metavar="SIZE", help="cut into parts of at most SIZE (15M, 512K, 2G)")
    pk.add_argument("--with-weights", action="store_true", help="keep adapter/ and checkpoints/ folders")
    pk.add_argument("--with-data", action="store_true", help="keep the generated data: the grid's data/ folder, the cells' train.jsonl")
    pk.set_defaults(func=run_pack)

    exp = subparsers.add_parser(
        "experiment",
        help="train and evaluate a grid of methods x seeds x ablations, then write the report",
        description="Expand GRID.yaml into cells DIR/<variant>-s<seed>; each cell trains LoRA, evaluates, "
        "and writes cell.json last. Resumable: rerun the same command; finished cells are skipped and a "
        "killed cell is wiped and run again. Ready-made grids: configs/experiments/*.yaml.",
    )
    exp.add_argument("--grid", required=True, help="grid YAML (see docs/EXPERIMENTS.md)")
    exp.add_argument("--out", required=True, help="results folder (the one `iga-ds report` reads)")
    exp.add_argument("--only", action="append", default=[], metavar="PATTERN",
                     help="run only cells whose name matches this glob, e.g. 'iga-*' or '*-s0' (repeatable)")
    exp.add_argument("--dry-run", action="store_true",
                     help="list the cells, their state and expected seconds (from finished cells); run nothing")
    exp.add_argument("--launch-order", action="store_true",
                     help="with --dry-run: list in the order launch/grid_parallel.sh starts them (selection "
                     "candidates first, then the longest expected cell first)")
    exp.add_argument("--prepare", action="store_true",
                     help="only prepare what the cells share (the data, the built-in tiny bases), then exit: "
                     "the first step of running cells in parallel processes")
    exp.add_argument("--launcher", metavar="COMMAND",
                     help="train each cell through this launcher on several devices, e.g. 'deepspeed --num_gpus 8' "
                     "or 'torchrun --nproc_per_node 4' (default: in this process, one device)")
    exp.add_argument("--no-report", action="store_true", help="do not write DIR/report.md at the end")
    exp.add_argument("--no-progress", action="store_true", help="no progress bars (the per-cell lines stay)")
    exp.set_defaults(func=run_experiment)

    p = subparsers.add_parser(
        "demo",
        help="ERM vs IGA on synthetic isomers with planted shortcuts (tiny base, CPU, a few minutes)",
    )
    p.add_argument("--out", default="demo_out", help="output folder")
    p.add_argument("--steps", type=int, default=None, help="LoRA steps per method")
    p.add_argument("--methods", default="erm,iga", help="comma-separated method names")
    p.add_argument("--quiet", action="store_true",
                   help="no progress (bar on a terminal, a few lines in a log); the step lines and the table stay")
    p.set_defaults(func=run_demo)


def _register_report(subparsers: Any) -> None:
    rep = subparsers.add_parser(
        "report",
        help="the report of an experiment grid (the paper's Tables 2, 3, 4, 6 and figures), the demo's folder "
        "or a single training run",
        description="DIR is an experiment grid (DIR/<cell>/cell.json, eval.json or eval/*.json, metrics.jsonl, "
        "update_norms.json: the paper's tables and figures), the demo's folder (results.json: its table, "
        "accuracy per domain, training loss and its figure) or a training run (config.resolved.yaml: its "
        "settings, loss curve and any evaluation beside it); the first line says which was read. Writes "
        "DIR/report.md and PNG figures under DIR/figures (see docs/EXPERIMENTS.md). Several grids, one --name "
        "each, share one report (--out): their headline columns side by side, then each one's tables under its name.",
    )
    rep.add_argument("dir", nargs="+", help="results folder(s): a grid, the demo's folder or a training run")
    rep.add_argument("--name", action="append", metavar="NAME",
                     help="the name of each results folder, in order (repeatable; one per folder when several)")
    rep.add_argument("--out", help="report file (default: DIR/report.md; required with several folders)")
    rep.add_argument("--no-figures", action="store_true")
    rep.add_argument("--title", default="IGA results", help="the report's heading")
    rep.add_argument("--discussion", help="Markdown file appended after the tables (interpretation)")
    rep.add_argument("--against", action="append", default=[], metavar="ROW",
                     help="also pair every row of a grid against the row with this label (repeatable), as "
                          "against ERM-SFT: e.g. the grouping cost at another batch size")
    rep.set_defaults(func=run_report)


def run_pack(args: argparse.Namespace) -> int:
    part_size = archive.parse_size(args.part_size) if args.part_size else None
    written = archive.pack(args.dir, args.out, with_weights=args.with_weights, with_data=args.with_data,
                   part_size=part_size)
    total = sum(p.stat().st_size for p in written)
    size = f"{total / 2**20:.1f} MiB" if total >= 2**20 else f"{total / 2**10:.1f} KiB"
    print(f"packed {args.dir} into {len(written)} file(s), {size}: "
          + ", ".join(str(p) for p in written))
    if part_size is not None:
        print(f"join with: cat {args.out}.part* > {args.out}")
    return 0


def list_cells(grid, out: Path, candidates, cells, launch: bool = False) -> None:
    """The --dry-run listing: selection candidates first (``selection/<cell>``), then the cells,
    each with its expected seconds; ``launch``: in the order grid_parallel.sh starts them."""
    import dataclasses

    from iga_ds.experiments.experiment import SELECTION_DIR, cell_estimates, cell_status, launch_order

    unselected = dataclasses.replace(grid, selection=None)
    rows = [(f"{SELECTION_DIR}/{c.name}", cell_status(unselected, c, out / SELECTION_DIR), c) for c in candidates]
    rows += [(c.name, cell_status(grid, c, out), c) for c in cells]
    estimates, work = cell_estimates(grid, out, candidates, cells)
    if launch:
        order = {name: i for i, name in enumerate(launch_order([r[0] for r in rows], estimates, work))}
        rows.sort(key=lambda r: order[r[0]])
    for name, status, cell in rows:
        est = "-" if estimates[name] is None else f"{estimates[name]:.0f}s"
        print(f"{name:<28} {status:<8} {cell.variant.kind:<9} method {cell.variant.method:<14} est {est}")
    print(f"{len(rows)} cells")


def run_experiment(args: argparse.Namespace) -> int:
    from iga_ds.experiments.experiment import prepare_grid, run_grid, selection_cells
    from iga_ds.experiments.grid import load_grid

    grid = load_grid(args.grid)
    cells = [c for c in grid.cells() if not args.only or any(fnmatch.fnmatchcase(c.name, p) for p in args.only)]
    candidates = selection_cells(grid, args.only, {c.variant.key for c in cells})
    if not cells and not candidates:
        raise UserError(f"--only {' '.join(args.only)}: no cell of {grid.path} matches")
    if args.dry_run:
        list_cells(grid, Path(args.out), candidates, cells, launch=args.launch_order)
        return 0
    check_output_dir(args.out)  # before the data is generated or a cell trains
    if args.prepare:
        prepare_grid(grid, args.out, progress=not args.no_progress)
        return 0
    run_grid(grid, args.out, only=args.only, progress=not args.no_progress, report=not args.no_report,
             launcher=args.launcher)
    return 0


def run_report(args: argparse.Namespace) -> int:
    from iga_ds.experiments.report import headline_table, write_report
    from iga_ds.experiments.tables import plain_table

    out = write_report(args.dir, out=args.out, figures=not args.no_figures, title=args.title,
                       discussion=args.discussion, names=args.name, against=args.against)
    table = headline_table(out.read_text(encoding="utf-8"))  # the report's leading table, as written
    if table is not None:
        print(plain_table(table))
    print(f"wrote {out}")
    return 0


def run_demo(args: argparse.Namespace) -> int:
    from iga_ds.experiments.demo import run_demo as demo
    from iga_ds.methods import method_class

    # checked before the data is generated and the base pretrained: a bad flag writes nothing
    methods = [m.strip() for m in args.methods.split(",") if m.strip()]
    if not methods:
        raise UserError(f"--methods {args.methods!r}: expected comma-separated method names, e.g. erm,iga")
    if len(set(methods)) != len(methods):
        raise UserError(f"--methods {args.methods}: a method is listed twice")
    for name in methods:
        try:
            method_class(name)
        except ConfigError as exc:
            raise ConfigError(f"--methods: {exc}") from None
    if args.steps is not None and args.steps < 1:
        raise UserError(f"--steps {args.steps}: expected a positive number of steps")
    check_output_dir(args.out)
    demo(args.out, methods=methods, steps=args.steps, progress=not args.quiet)
    return 0


def _register_diagnose(subparsers: Any) -> None:
    dg = subparsers.add_parser(
        "diagnose",
        help="how much of the task and of a planted cue each method's gradient, and the optimizer's update of it, "
        "keeps, as shares of ERM's; on one model or over a run's checkpoints",
        description="On a run's adapter (or a base with a fresh adapter) and the first K isomer groups of --data "
        "(records with meta.cue): per-domain LoRA gradients of the cue records and of their no-cue twins; the task "
        "direction t (no-cue mean) and the cue direction c (cue mean minus t); each method's combined gradient U of "
        "the cue gradients, and <U, d> / <U_erm, d>, cosines and spreads in weight and factor space; the same for "
        "the optimizer's update u(U), one AdamW (or SGD-momentum) step from the checkpoint's own moments. With "
        "--every N, on each of a run's checkpoints at a multiple of N steps: one resumable JSON and a figure "
        "(docs/DIAGNOSE.md).",
    )
    dg.add_argument("--run", required=True, help="a training run's folder, an adapter folder, or a base model "
                    "(builtin:tiny, a folder, a hub id, a .gguf file) given a fresh adapter")
    dg.add_argument("--data", required=True, help="isomer records whose problems carry their meta.cue sentence")
    dg.add_argument("--groups", type=int, required=True, metavar="K", help="use the first K complete groups")
    dg.add_argument("--method", action="append", default=[], metavar="NAME[:KEY=VALUE,...]",
                    help="a method and its parameters, e.g. iga:tau=0.5 or sand_mask (repeatable; erm, the "
                    "reference, is always measured)")
    dg.add_argument("--out", required=True, help="JSON file to write (with --every: the trajectory's, resumed "
                    "where it holds steps already, and its figure beside it, OUT with .png)")
    dg.add_argument("--every", type=int, metavar="N", help="--run is a training run's folder: diagnose each of its "
                    "checkpoints at a multiple of N steps (1: every one), the same groups for all")
    dg.add_argument("--batch-size", type=int, default=4, help="instances per backward (one domain at a time)")
    dg.add_argument("--max-length", type=int, help="tokens per instance (default: the run's, else 512)")
    dg.add_argument("--dtype", default="float32", choices=("float32", "bfloat16", "float16"))
    dg.add_argument("--device", default="auto", help="auto, cpu, cuda, cuda:1, ...")
    dg.add_argument("--lora-r", type=int, help="fresh adapter only: the LoRA rank (default 16)")
    dg.add_argument("--lora-alpha", type=float, help="fresh adapter only: LoRA alpha (default 32)")
    dg.add_argument("--target-modules", help="fresh adapter only: comma-separated layer names (default q,k,v,o_proj)")
    dg.add_argument("--init-b-std", type=float, default=0.0,
                    help="fresh adapter only: draw B from N(0, STD^2) (PEFT starts B at zero: no A gradient)")
    dg.add_argument("--seed", type=int, default=0, help="fresh adapter only: the seed of its initialization")
    dg.add_argument("--no-progress", action="store_true")
    dg.set_defaults(func=run_diagnose)


def run_diagnose(args: argparse.Namespace) -> int:
    from iga_ds.experiments import diagnose as dg

    for flag, value in (("--groups", args.groups), ("--batch-size", args.batch_size), ("--max-length", args.max_length),
                        ("--lora-r", args.lora_r), ("--every", args.every)):
        if value is not None and value < 1:
            raise UserError(f"{flag} {value}: expected a positive integer")
    if not args.init_b_std >= 0 or (args.lora_alpha is not None and not args.lora_alpha > 0):
        raise UserError("--init-b-std must be >= 0 and --lora-alpha > 0")
    given = [args.lora_r, args.lora_alpha, args.target_modules, args.init_b_std or None, args.seed or None]
    fresh = _fresh_adapter(dg.FreshLora(seed=args.seed, init_b_std=args.init_b_std), args) \
        if any(x is not None for x in given) else None  # None: none of them given, the run's adapter is welcome
    check_output_file(args.out)
    dg.build_methods(args.method)  # a bad --method fails before the data and the model are read
    settings = dg.Settings(args.run, args.data, args.groups, args.method, args.out, args.batch_size,
                           args.max_length, args.dtype, args.device, fresh, not args.no_progress)
    if args.every is not None:
        from iga_ds.experiments import diagnose_trajectory as dt

        if fresh is not None:
            raise UserError("--every diagnoses a run's own adapters: --lora-r, --lora-alpha, --target-modules, "
                            "--init-b-std and --seed are for a base given a fresh one")
        result = dt.trajectory(settings, args.every)
        print(dt.format_trajectory(result))
        print(f"wrote {args.out}" + (f" and {Path(args.out).with_name(result['figure'])}" if result["figure"] else ""))
        return 0
    result = dg.diagnose(settings)
    print(dg.format_table(result))
    print(f"wrote {args.out}")
    return 0


def _fresh_adapter(fresh: Any, args: argparse.Namespace) -> Any:
    """The fresh adapter's settings with its rank, alpha and layers, where given."""
    fresh.r = args.lora_r or fresh.r
    fresh.alpha = args.lora_alpha or fresh.alpha
    if args.target_modules is not None:
        fresh.target_modules = [t.strip() for t in args.target_modules.split(",") if t.strip()]
        if not fresh.target_modules:
            raise UserError(f"--target-modules {args.target_modules!r}: expected comma-separated layer names")
    return fresh


def _register_export(subparsers: Any) -> None:
    ex = subparsers.add_parser(
        "export",
        help="merge a trained adapter into its base for serving, or write the adapter with a portable base reference",
        description="SOURCE: a training run's folder (its adapter/), an adapter folder or a checkpoint's folder. By "
        "default the adapter is merged into the base it trained on (PEFT's merge_and_unload) and OUT gets safetensors "
        "weights, the tokenizer with its chat template and a model card: AutoModelForCausalLM.from_pretrained(OUT) "
        "loads it. With --adapter-only, OUT gets the adapter with its base named portably (a hub id, packaged:NAME, "
        "builtin:tiny, or a path relative to OUT) and the model card. Written into a temporary folder beside OUT, "
        "renamed at the end.",
    )
    ex.add_argument("source", metavar="SOURCE", help="a run folder, an adapter folder or a checkpoint's folder")
    ex.add_argument("--out", required=True, help="the folder to write (new or empty, unless --overwrite)")
    ex.add_argument("--adapter-only", action="store_true", help="write the adapter and its card, merge nothing")
    ex.add_argument("--dtype", default="float32", choices=("float32", "bfloat16", "float16"),
                    help="the merged weights' dtype (the merge itself is done in float32)")
    ex.add_argument("--overwrite", action="store_true", help="replace an existing, non-empty --out")
    ex.add_argument("--trust-remote-code", action="store_true",
                    help="let a hub base run its own modelling code (off by default)")
    ex.add_argument("--quiet", action="store_true", help="no progress lines on stderr")
    ex.set_defaults(func=run_export)


def run_export(args: argparse.Namespace) -> int:
    from iga_ds.experiments import export as ex

    settings = ex.ExportSettings(args.source, args.out, adapter_only=args.adapter_only, dtype=args.dtype,
                                 overwrite=args.overwrite, trust_remote_code=args.trust_remote_code,
                                 progress=not args.quiet)
    out = ex.export(settings, log=(lambda msg: None) if args.quiet else None)
    print(ex.describe(settings, out))
    return 0
