"""Builds split into shards: which seeds shard I of N builds, and where it writes.

A seed belongs to shard ``sha256(seed_id) mod N``: the partition depends on the seed's id
alone, not on the order of the seeds file, the machine or the Python version, so N jobs given
the same file split it the same way, and a seed added to the file later lands in one shard.
Shard I of N writes into ``OUT/shard-I-of-N``; ``iga-ds data merge`` joins them into ``OUT``.
"""
from __future__ import annotations

import hashlib
import re
from pathlib import Path

from iga_ds.errors import UserError

_SHARD = re.compile(r"^\s*(\d+)\s*/\s*(\d+)\s*$")
SHARD_DIR = re.compile(r"^shard-(\d+)-of-(\d+)$")


def parse_shard(text: str, option: str = "--shard") -> tuple[int, int]:
    """``"I/N"`` as ``(I, N)`` with ``0 <= I < N``; a one-line UserError otherwise."""
    match = _SHARD.match(text or "")
    if not match:
        raise UserError(f"{option} {text!r}: expected I/N, the shard index I (from 0) of N shards, e.g. 0/4")
    index, count = int(match[1]), int(match[2])
    if count < 1 or index >= count:
        raise UserError(f"{option} {text}: expected 0 <= I < N (shards are numbered 0 to N-1)")
    return index, count


def shard_of(seed_id: str, count: int) -> int:
    """The shard (0 to ``count``-1) that builds ``seed_id``."""
    digest = hashlib.sha256(seed_id.encode("utf-8")).digest()
    return int.from_bytes(digest[:8], "big") % count


def in_shard(seeds: list[dict], index: int, count: int) -> list[dict]:
    """The seeds of shard ``index`` of ``count``, in file order."""
    return [s for s in seeds if shard_of(s["seed_id"], count) == index]


def shard_dir(out: str | Path, index: int, count: int) -> Path:
    """Where shard ``index`` of ``count`` writes its outputs."""
    return Path(out) / f"shard-{index}-of-{count}"
