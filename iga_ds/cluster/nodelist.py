"""Slurm node lists and hostfiles.

Slurm writes node sets compactly (``SLURM_JOB_NODELIST=gpu[01-03,07],login2``) and task counts
run-length encoded (``SLURM_TASKS_PER_NODE=8(x2),4``); ``scontrol show hostnames`` expands the
first but is not always on PATH inside a container, so both are expanded here in plain Python.
A hostfile in the ``host slots=N`` layout is read by both the DeepSpeed launcher and Open MPI.
"""
from __future__ import annotations

import re
from collections.abc import Iterable

from iga_ds.errors import UserError

_RANGE = re.compile(r"^(\d+)(?:-(\d+))?$")


def _split_top_level(text: str, sep: str = ",") -> list[str]:
    """Split on ``sep`` outside brackets: ``a[1,2],b`` -> ``['a[1,2]', 'b']``."""
    parts, depth, start = [], 0, 0
    for i, ch in enumerate(text):
        if ch == "[":
            depth += 1
            if depth > 1:
                raise ValueError("nested '['")
        elif ch == "]":
            depth -= 1
            if depth < 0:
                raise ValueError("unbalanced ']'")
        elif ch == sep and depth == 0:
            parts.append(text[start:i])
            start = i + 1
    if depth != 0:
        raise ValueError("unbalanced '['")
    parts.append(text[start:])
    return parts


def _expand_bracket(body: str) -> list[str]:
    """``01-03,07`` -> ``['01', '02', '03', '07']``; zero padding follows the lower bound."""
    out = []
    for item in body.split(","):
        m = _RANGE.match(item.strip())
        if not m:
            raise ValueError(f"bad range {item!r}")
        lo_text, hi_text = m.group(1), m.group(2)
        if hi_text is None:
            out.append(lo_text)
            continue
        lo, hi = int(lo_text), int(hi_text)
        if hi < lo:
            raise ValueError(f"descending range {item!r}")
        width = len(lo_text)
        out.extend(str(i).zfill(width) for i in range(lo, hi + 1))
    return out


def _expand_one(pattern: str) -> list[str]:
    # Several bracket groups in one name multiply out: rack[1-2]-n[1-2] -> 4 hosts, as in Slurm.
    m = re.search(r"\[([^\]]*)\]", pattern)
    if m is None:
        if "[" in pattern or "]" in pattern:
            raise ValueError("unbalanced bracket")
        return [pattern]
    head, tail = pattern[: m.start()], pattern[m.end():]
    return [head + value + rest for value in _expand_bracket(m.group(1)) for rest in _expand_one(tail)]


def expand_nodelist(nodelist: str, source: str = "node list") -> list[str]:
    """Expand Slurm hostlist syntax into host names, in Slurm's order (as ``scontrol show hostnames``).

    ``node[01-03,07]`` -> ``node01 node02 node03 node07``. ``source`` names where the text came
    from (e.g. ``SLURM_JOB_NODELIST``) for the error message.
    """
    text = nodelist.strip()
    if not text:
        raise UserError(f"{source} is empty; expected Slurm node list syntax such as node[01-03,07]")
    hosts: list[str] = []
    try:
        for part in _split_top_level(text):
            part = part.strip()
            if not part:
                raise ValueError("empty entry")
            hosts.extend(_expand_one(part))
    except ValueError as exc:
        raise UserError(
            f"{source}={nodelist!r} is not a Slurm node list ({exc}); expected e.g. node[01-03,07]"
        ) from None
    return hosts


def expand_tasks_per_node(spec: str, source: str = "SLURM_TASKS_PER_NODE") -> list[int]:
    """``8(x2),4`` -> ``[8, 8, 4]`` (Slurm's run-length encoding of per-node task counts)."""
    counts: list[int] = []
    for item in spec.split(","):
        m = re.fullmatch(r"\s*(\d+)(?:\(x(\d+)\))?\s*", item)
        if not m:
            raise UserError(f"{source}={spec!r} is not a task count list; expected e.g. 8(x2),4")
        counts.extend([int(m.group(1))] * int(m.group(2) or 1))
    return counts


def hostfile_text(hosts: Iterable[str], slots: int | Iterable[int]) -> str:
    """A hostfile, one ``host slots=N`` line per host (DeepSpeed and Open MPI both read it)."""
    hosts = list(hosts)
    slot_list = [slots] * len(hosts) if isinstance(slots, int) else list(slots)
    if len(slot_list) != len(hosts):
        raise UserError(f"{len(hosts)} hosts but {len(slot_list)} slot counts")
    for host, n in zip(hosts, slot_list):
        if n < 1:
            raise UserError(f"host {host}: slots must be >= 1, got {n}")
    return "".join(f"{host} slots={n}\n" for host, n in zip(hosts, slot_list))
