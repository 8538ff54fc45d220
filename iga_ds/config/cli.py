"""``iga-ds init``: the shipped configs written out, for an installed iga-ds.

The repository's ``configs/`` (run YAMLs and ``experiments/`` grids) and ``ds_configs/``
(DeepSpeed JSONs) ship inside the package; ``iga-ds init DIR`` writes them under ``DIR`` in
the same layout, so that each file's opening command runs from ``DIR`` as it does from the
repository root. The command imports the config package, which loads pydantic, when it runs,
not when the parser is built (start-up: ``iga-ds --help`` loads neither pydantic nor torch).
"""
from __future__ import annotations

import argparse
import shlex
from pathlib import Path

from iga_ds.errors import UserError
from iga_ds.files import atomic_write_bytes


def register(subparsers) -> None:
    p = subparsers.add_parser(
        "init",
        help="write the shipped run YAMLs, experiment grids and DeepSpeed JSONs into a folder",
        description="Writes DIR/configs/ (run YAMLs; experiments/: grids) and DIR/ds_configs/ (DeepSpeed "
        "JSONs) as the repository has them; each file's opening command then runs from DIR, e.g. "
        "`cd DIR && iga-ds train --config configs/tiny_cpu.yaml`. A file that exists is not overwritten "
        "(nothing is written) unless --force.",
    )
    p.add_argument("dir", metavar="DIR", help="the folder to write into (created if missing)")
    p.add_argument("--force", action="store_true", help="overwrite files that exist")
    p.set_defaults(func=_init)


def write_shipped_configs(out: str | Path, force: bool = False) -> list[Path]:
    """Write every shipped config under ``out`` (each file atomically); the paths written. An
    existing file stops it before anything is written, unless ``force``."""
    from iga_ds.config.run import SHIPPED, shipped_names

    out = Path(out)
    if out.exists() and not out.is_dir():
        raise UserError(f"{out}: exists and is not a folder")
    names = shipped_names()
    if not names:
        raise UserError("the shipped configs are missing from this installation of iga-ds; reinstall it")
    taken = [name for name in names if (out / name).exists()]
    if taken and not force:
        more = f" (and {len(taken) - 1} more of the {len(names)})" if len(taken) > 1 else ""
        raise UserError(f"{out / taken[0]}: exists{more}; pass --force to overwrite (nothing was written)")
    for name in names:
        atomic_write_bytes(out / name, (SHIPPED / name).read_bytes())
    return [out / name for name in names]


def _init(args: argparse.Namespace) -> int:
    written = write_shipped_configs(args.dir, args.force)
    for path in written:
        print(path)
    print(f"wrote {len(written)} files; next: cd {shlex.quote(str(args.dir))} && iga-ds data synth --out data/synth "
          "--groups 300 --shortcut 0.9 && iga-ds train --config configs/tiny_cpu.yaml")
    return 0
