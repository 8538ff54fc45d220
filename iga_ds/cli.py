"""`iga-ds` command line: each subcommand lives in its own module and registers itself.

A subcommand module exposes ``register(subparsers)``, which adds its parser and sets
``func`` (called with the parsed namespace, returning an exit code). Modules are imported
here by name so that a missing optional dependency only breaks its own subcommand.
"""
from __future__ import annotations

import argparse
import importlib
import os
import sys

from iga_ds.errors import UserError

# name shown in help -> module that registers it
SUBCOMMAND_MODULES = (
    "iga_ds.data.cli",
    "iga_ds.train.cli",
    "iga_ds.evaluation.cli",
    "iga_ds.launch.cli",
    "iga_ds.bench.cli",
)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="iga-ds",
        description="Invariant Gradient Alignment for LoRA fine-tuning on logical isomer groups.",
    )
    from iga_ds import __version__

    parser.add_argument("--version", action="version", version=f"iga-ds {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name in SUBCOMMAND_MODULES:
        try:
            module = importlib.import_module(name)
        except ModuleNotFoundError as exc:
            if exc.name and name.startswith(exc.name):
                continue  # that part of the package is not built yet
            raise
        module.register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    try:
        return int(args.func(args) or 0)
    except UserError as exc:
        # Bad input is the user's to fix: one line, no traceback.
        print(f"iga-ds: error: {exc}", file=sys.stderr)
        return exc.exit_code
    except KeyboardInterrupt:
        print("iga-ds: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:
        # the reader went away (`iga-ds experiment --dry-run | head`): stop quietly, and point
        # stdout at nothing so the interpreter's final flush does not raise again
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 141


if __name__ == "__main__":
    sys.exit(main())
