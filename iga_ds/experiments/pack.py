"""`iga-ds pack`: a results folder as one compressed archive (or parts of a size), to copy off a cluster.

What a report needs stays: every cell's ``cell.json``, spec, resolved config, training log and
evaluations (with each item's generated text), and the logs. What is large and can be rebuilt
is left out unless asked for: the weights (``adapter/`` and ``checkpoints/`` folders) and the
generated data (``data/`` at the top and an ungrouped cell's own ``train.jsonl``; the grid file
regenerates both). Lock files never go in: they belong to the processes that held them. Parts let the archive
pass limits on file size; ``cat OUT.part* > OUT`` joins them.
"""
from __future__ import annotations

import os
import re
import tarfile
from pathlib import Path

from iga_ds.errors import UserError
from iga_ds.files import atomic_write_bytes, check_output_file, make_dir, temp_file_beside

_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([KMG]i?B?|B)?\s*$", re.IGNORECASE)
_UNITS = {"": 1, "B": 1, "K": 2**10, "M": 2**20, "G": 2**30}
WEIGHT_FOLDERS = ("adapter", "checkpoints")
CELL_DATA = "train.jsonl"  # a cell's own training set (rows that regroup the grid's data), as experiment.py writes it
MAX_PARTS = 1000


def parse_size(text: str) -> int:
    """'15M', '512KiB', '2G', '1000' -> bytes (binary units)."""
    match = _SIZE.match(text)
    if not match:
        raise UserError(f"--part-size {text!r}: expected a size such as 15M, 512K or 2G")
    unit = (match.group(2) or "").upper()[:1]
    size = int(float(match.group(1)) * _UNITS[unit])
    if size < 1024:
        raise UserError(f"--part-size {text!r}: parts must be at least 1K")
    return size


def excluded(rel: Path, with_weights: bool, with_data: bool) -> bool:
    """Whether a path inside the results folder stays out of the archive."""
    if rel.name.endswith(".lock"):
        return True
    if not with_data and (rel.parts[:1] == ("data",) or (len(rel.parts) >= 2 and rel.name == CELL_DATA)):
        return True
    return not with_weights and any(part in WEIGHT_FOLDERS for part in rel.parts)


def _members(root: Path, with_weights: bool, with_data: bool) -> list[Path]:
    """Files to archive, sorted so that two packs of one folder list alike."""
    kept = []
    for dirpath, dirnames, filenames in os.walk(root, onerror=_raise):  # an unreadable folder fails
        here = Path(dirpath).relative_to(root)
        dirnames[:] = sorted(d for d in dirnames if not excluded(here / d, with_weights, with_data))
        kept += [here / f for f in sorted(filenames) if not excluded(here / f, with_weights, with_data)]
    return kept


def pack(root: str | Path, out: str | Path, *, with_weights: bool = False, with_data: bool = False,
         part_size: int | None = None) -> list[Path]:
    """Write ``out`` (a ``.tar.xz``) or, with ``part_size``, ``out.part000``, ``out.part001``, ...
    of at most that many bytes; returns the files written. Nothing is left half-written: the
    archive is built under a temporary name, and parts left by an earlier pack of the same name
    are removed."""
    root, out = Path(root), Path(out)
    if not root.is_dir():
        raise UserError(f"{root}: no such results folder")
    if out.resolve().is_relative_to(root.resolve()):
        raise UserError(f"--out {out}: must lie outside the folder being packed")
    check_output_file(out)
    files = _members(root, with_weights, with_data)
    if not files:
        raise UserError(f"{root}: nothing to pack (empty, or only weights and data)")
    make_dir(out.parent)
    fd, name = temp_file_beside(out)
    os.close(fd)
    tmp = Path(name)
    try:
        with tarfile.open(tmp, "w:xz") as tar:
            for rel in files:
                tar.add(root / rel, arcname=str(Path(root.name) / rel), recursive=False)
        if part_size is None:
            os.replace(tmp, out)
            return [out]
        count = -(-tmp.stat().st_size // part_size)
        if count > MAX_PARTS:
            raise UserError(f"--part-size: the archive would take {count} parts, at most {MAX_PARTS}; "
                            "choose larger parts")
        stale = set(out.parent.glob(f"{_glob_escape(out.name)}.part[0-9][0-9][0-9]"))
        written = _split(tmp, out, part_size)
        for old in stale - set(written):
            old.unlink()
        return written
    finally:
        tmp.unlink(missing_ok=True)


def _raise(exc: OSError) -> None:
    raise exc


def _glob_escape(name: str) -> str:
    return re.sub(r"([*?\[])", r"[\1]", name)


def _split(archive: Path, out: Path, part_size: int) -> list[Path]:
    written = []
    with open(archive, "rb") as src:
        while chunk := src.read(part_size):
            part = out.with_name(f"{out.name}.part{len(written):03d}")
            atomic_write_bytes(part, chunk)
            written.append(part)
    return written
