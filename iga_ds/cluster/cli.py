"""``iga-ds selfcheck`` and ``iga-ds hostfile``.

``selfcheck`` imports the self-check when it runs, not when the parser is built: that module
loads importlib.metadata (tens of milliseconds) to read package versions, and torch once it
checks. That keeps ``iga-ds --help`` and every other command's start-up fast.
"""
from __future__ import annotations

import argparse
import json
import os
import sys

from iga_ds.cluster.nodelist import expand_nodelist, expand_tasks_per_node, hostfile_text
from iga_ds.errors import UserError
from iga_ds.files import atomic_write_text, check_output_file


def register(subparsers) -> None:
    p = subparsers.add_parser(
        "selfcheck",
        help="check versions, accelerator, DeepSpeed ops, memory and an all-reduce across the job's ranks",
        description=(
            "Run on every rank before training (srun, mpirun or the deepspeed launcher). Ranks come "
            "from launcher variables, then SLURM_*, then OMPI_*, then mpi4py. Exit 0 when all "
            "checks pass; 1 with a one-line reason when one fails; 3 when the all-reduce hangs."
        ),
    )
    p.add_argument("--json", action="store_true", help="print one JSON object per rank instead of text")
    p.add_argument("--backend", choices=("auto", "gloo", "nccl"), default="auto",
                   help="collective backend for the all-reduce (auto: nccl on CUDA, else gloo)")
    p.add_argument("--timeout", type=float, default=120.0, metavar="SECONDS",
                   help="rendezvous and all-reduce timeout (default 120)")
    p.add_argument("--require-ops", default="", metavar="OP[,OP]",
                   help="fail unless these DeepSpeed ops are prebuilt or buildable, e.g. fused_adam")
    p.add_argument("--skip-ops", action="store_true", help="do not probe DeepSpeed ops (saves a few seconds)")
    p.add_argument("--min-free-gib", type=float, default=0.0, metavar="GIB",
                   help="fail when less device (or host, on CPU) memory than this is free")
    # The DeepSpeed launcher appends --local_rank=N to the command line.
    p.add_argument("--local_rank", "--local-rank", type=int, default=None, help=argparse.SUPPRESS)
    p.set_defaults(func=_selfcheck)

    h = subparsers.add_parser(
        "hostfile",
        help="write a 'host slots=N' hostfile (DeepSpeed launcher, mpirun) from the Slurm node list",
    )
    h.add_argument("--nodelist", default=None,
                   help="Slurm node list, e.g. gpu[01-04] (default: $SLURM_JOB_NODELIST)")
    h.add_argument("--slots", type=int, default=None,
                   help="processes per host (default: $SLURM_GPUS_ON_NODE, else Slurm's tasks per node)")
    h.add_argument("-o", "--output", default=None, help="file to write (default: standard output)")
    h.set_defaults(func=_hostfile)


def _selfcheck(args) -> int:
    from iga_ds.cluster.selfcheck import EXIT_FAILED, failure_line, format_report, run_selfcheck

    if not 0 < args.timeout < float("inf"):  # nan too
        raise UserError(f"--timeout {args.timeout}: expected a positive number of seconds")
    if not 0 <= args.min_free_gib < float("inf"):
        raise UserError(f"--min-free-gib {args.min_free_gib}: expected a number of GiB >= 0")
    ops = tuple(op.strip() for op in args.require_ops.split(",") if op.strip())
    report = run_selfcheck(local_rank=args.local_rank, backend=args.backend, timeout_s=args.timeout,
                           require_ops=ops, check_ops=not args.skip_ops, min_free_gib=args.min_free_gib)
    if args.json:
        print(json.dumps(report.as_dict(), sort_keys=True), flush=True)
    else:
        print(format_report(report), flush=True)
    if not report.ok:
        print(failure_line(report), file=sys.stderr, flush=True)
        return EXIT_FAILED
    return 0


def _hostfile(args) -> int:
    if args.output:
        check_output_file(args.output, "--output")
    if args.slots is not None and args.slots < 1:
        raise UserError(f"--slots {args.slots}: expected a positive number of processes per host")
    nodelist = args.nodelist or os.environ.get("SLURM_JOB_NODELIST")
    if not nodelist:
        raise UserError("no node list: pass --nodelist or run inside a Slurm allocation (SLURM_JOB_NODELIST)")
    hosts = expand_nodelist(nodelist, "--nodelist" if args.nodelist else "SLURM_JOB_NODELIST")
    slots: int | list[int]
    if args.slots is not None:
        slots = args.slots
    elif os.environ.get("SLURM_GPUS_ON_NODE"):
        slots = _env_count("SLURM_GPUS_ON_NODE")
    elif os.environ.get("SLURM_TASKS_PER_NODE") and not args.nodelist:
        slots = expand_tasks_per_node(os.environ["SLURM_TASKS_PER_NODE"])
    else:
        slots = 1
    text = hostfile_text(hosts, slots)
    if args.output:
        atomic_write_text(args.output, text)
    else:
        sys.stdout.write(text)
    return 0


def _env_count(name: str) -> int:
    """A positive count from the environment, or a UserError naming the variable."""
    value = os.environ[name]
    if not value.strip().isdigit() or int(value) < 1:
        raise UserError(f"environment variable {name}={value!r}: expected a positive integer")
    return int(value)
