"""`iga-ds` command line: each package's commands live in its own ``cli`` module.

A ``cli`` module exposes ``register(subparsers)``, which adds its parsers and sets ``func``
(called with the parsed namespace, returning an exit code). ``cli`` modules import at the top
whatever loads no heavy library, and inside a command only the modules that load one (torch,
DeepSpeed, transformers, pydantic, httpx, ...): every command starts without them.

Every expected failure ends in one line on stderr, ``iga-ds: error: ...``, and exit status 2:
a ``UserError`` (bad input: the message names the file, line or key), a usage error of the
parser, and an ``OSError`` about a file (missing, a directory, permission denied, no space),
shown as ``FILE: reason``. Anything else is a bug and keeps its traceback.
"""
from __future__ import annotations

import argparse
import os
import sys

from iga_ds import __version__
from iga_ds.cluster import cli as cluster_cli
from iga_ds.config import cli as config_cli
from iga_ds.data import cli as data_cli
from iga_ds.errors import UserError
from iga_ds.evaluation import cli as evaluation_cli
from iga_ds.experiments import cli as experiments_cli
from iga_ds.models import cli as models_cli
from iga_ds.train import cli as train_cli

SUBCOMMAND_MODULES = (config_cli, data_cli, models_cli, train_cli, evaluation_cli, experiments_cli, cluster_cli)


OVERRIDES_METAVAR = "KEY=VALUE"  # the positional of a command's config overrides (``iga-ds train``)


class Parser(argparse.ArgumentParser):
    """A usage error is one line like every other error (with where to find the usage), not the
    usage block and the error; every sub-command's parser is one of these too. ``KEY=VALUE``
    overrides may stand anywhere on a command line, before, between or after its options."""

    def error(self, message: str):
        self.exit(2, f"iga-ds: error: {message} (see '{self.prog} --help')\n")

    def parse_known_args(self, args=None, namespace=None):
        namespace, extras = super().parse_known_args(args, namespace)
        dest = self._overrides_dest()
        if dest is not None and extras:
            # argparse gives a positional one run of words: overrides after an option come
            # back as extras, in their order, after the run it took
            later = [a for a in extras if is_override(a)]
            setattr(namespace, dest, list(getattr(namespace, dest) or []) + later)
            extras = [a for a in extras if not is_override(a)]
        return namespace, extras

    def _overrides_dest(self) -> str | None:
        """The destination of this parser's ``KEY=VALUE`` positional, if it has one."""
        return next((a.dest for a in self._actions
                     if not a.option_strings and a.metavar == OVERRIDES_METAVAR and a.nargs == "*"), None)


def is_override(word: str) -> bool:
    """A ``KEY=VALUE`` word of a command line (not an option, not an option's ``--opt=value``)."""
    return not word.startswith(("-", "=")) and "=" in word


def build_parser() -> argparse.ArgumentParser:
    parser = Parser(
        prog="iga-ds",
        description="Invariant Gradient Alignment for LoRA fine-tuning on logical isomer groups.",
    )
    parser.add_argument("--version", action="version", version=f"iga-ds {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for module in SUBCOMMAND_MODULES:
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
    except OSError as exc:  # after BrokenPipeError, one of its kind
        if exc.filename is None or not exc.strerror:
            raise  # not about a file: unexpected, keep the traceback
        print(f"iga-ds: error: {os_error_line(exc)}", file=sys.stderr)
        return 2


def os_error_line(exc: OSError) -> str:
    """``FILE: reason`` of an OSError about a file (``SOURCE -> TARGET: reason`` for a rename)."""
    where = str(exc.filename) if exc.filename2 is None else f"{exc.filename} -> {exc.filename2}"
    return f"{where}: {exc.strerror}"


if __name__ == "__main__":
    sys.exit(main())
