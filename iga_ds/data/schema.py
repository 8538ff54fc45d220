"""Isomer record schema, file reading and corpus checks.

One JSON object per line, one line per domain instance (paper section 3.3; the split rule is
appendix "Data Split"):

    group_id  str   the isomer group (all domains of one logical problem)
    seed_id   str   the seed problem the group came from; the train/test split is by seed
    domain    str   e.g. math, medical, legal, science
    problem   str
    cot       str   step-by-step solution; by convention its last line is "Answer: X"
    answer    str   the final answer
    dag       obj   optional: the typed logical DAG (see iga_ds.data.dag)
    alignment_score  number in [0, 1], optional: the teacher's structural alignment score
    meta      obj   optional: anything else (pattern, depth, planted cue, ...)

Every error is a ``DataError`` whose message starts with ``FILE:LINE:`` (``SOURCE: row I:`` for
the sources read through ``datasets``: Parquet, Arrow, saved folders, hub ids; see
:mod:`iga_ds.data.sources`) and names the field.
"""
from __future__ import annotations

import math
import re
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Sequence

from iga_ds.data.dag import DagError, check_dag
from iga_ds.data.sources import RecordSource, iter_source, resolve_source
from iga_ds.errors import DataError

REQUIRED_FIELDS = ("group_id", "seed_id", "domain", "problem", "cot", "answer")
OPTIONAL_FIELDS = ("dag", "alignment_score", "meta")
ALL_FIELDS = REQUIRED_FIELDS + OPTIONAL_FIELDS

_INTEGER = re.compile(r"^[+-]?\d+$")
_NUMBER = re.compile(r"^[+-]?(\d+\.?\d*|\.\d+)([eE][+-]?\d+)?$")
_OPTION = re.compile(r"^\(?[A-Ea-e]\)?$")


def answer_type(answer: str) -> str:
    """Coarse answer type: boolean, integer, number, option (A-E) or text."""
    a = answer.strip()
    if a.lower() in ("yes", "no", "true", "false"):
        return "boolean"
    if _INTEGER.match(a):
        return "integer"
    if _NUMBER.match(a):
        return "number"
    if _OPTION.match(a):
        return "option"
    return "text"


def validate_record(obj, where: str) -> dict:
    """Check one parsed line; ``where`` is ``FILE:LINE`` for the message."""
    if not isinstance(obj, dict):
        raise DataError(f"{where}: expected a JSON object, found {type(obj).__name__}")
    for name in REQUIRED_FIELDS:
        if name not in obj:
            raise DataError(f"{where}: field {name!r} is missing (required: {', '.join(REQUIRED_FIELDS)})")
        value = obj[name]
        if not isinstance(value, str):
            raise DataError(f"{where}: field {name!r} must be a string, found {type(value).__name__}")
        if name != "cot" and not value.strip():
            raise DataError(f"{where}: field {name!r} is empty")
    for name in obj:
        if name not in ALL_FIELDS:
            raise DataError(f"{where}: unknown field {name!r} (allowed: {', '.join(ALL_FIELDS)}; "
                            "put extra information in 'meta')")
    dag = obj.get("dag")
    if dag is not None:
        if not isinstance(dag, dict):
            raise DataError(f"{where}: field 'dag' must be an object or null, found {type(dag).__name__}")
        try:
            check_dag(dag)
        except DagError as exc:
            raise DataError(f"{where}: field 'dag': {exc}") from None
    score = obj.get("alignment_score")
    if score is not None:
        if isinstance(score, bool) or not isinstance(score, (int, float)) or not math.isfinite(score) \
                or not 0.0 <= score <= 1.0:
            raise DataError(f"{where}: field 'alignment_score' must be a number in [0, 1], found {score!r}")
    meta = obj.get("meta")
    if meta is not None and not isinstance(meta, dict):
        raise DataError(f"{where}: field 'meta' must be an object or null, found {type(meta).__name__}")
    return obj


@dataclass
class GroupIndex:
    """What the group checks need: per group its domains, answer types, seeds, first line."""

    domains: dict[str, list[str]] = field(default_factory=lambda: defaultdict(list))
    answer_types: dict[str, set] = field(default_factory=lambda: defaultdict(set))
    seeds: dict[str, set] = field(default_factory=lambda: defaultdict(set))
    first_line: dict[str, int] = field(default_factory=dict)


def _as_source(path: str | Path | RecordSource) -> RecordSource:
    """How messages name the records of ``path``: a RecordSource as it is, a path as JSON Lines."""
    return path if isinstance(path, RecordSource) else RecordSource("jsonl", str(path), str(path))


def check_groups(records: list[dict], lines: list[int], path: str | Path | RecordSource,
                 allow_partial: bool = False, domains: Sequence[str] | None = None) -> None:
    """Every group has each domain exactly once, one seed and one answer type. The domains a
    group needs: ``domains`` where given (``--domains``; then no record may have another), else
    the domain set most of the file's groups have (on a tie the larger one), so that the odd
    group is the one named. ``allow_partial``: groups may miss domains (instance-level splits
    cut groups). ``lines``: each record's position in ``path`` (a line number, or a row index of
    a source read through ``datasets``)."""
    src = _as_source(path)
    idx = _index_groups(records, lines, src, domains)
    for g in idx.domains:
        where = src.where(idx.first_line[g])
        if len(idx.seeds[g]) > 1:
            raise DataError(f"{where}: field 'seed_id': group {g!r} mixes seeds "
                            f"{', '.join(sorted(idx.seeds[g]))}; a group comes from one seed")
        if len(idx.answer_types[g]) > 1:
            raise DataError(f"{where}: field 'answer': group {g!r} mixes answer types "
                            f"{', '.join(sorted(idx.answer_types[g]))}; its instances share one answer")
    if allow_partial:
        return
    if domains is not None:
        _check_complete(idx, src, list(domains), "--domains asks for")
        return
    counts = Counter(tuple(sorted(ds)) for ds in idx.domains.values())
    want = min(counts, key=lambda ds: (-counts[ds], -len(ds), ds))  # the most groups', on a tie the larger set
    verb = "has" if counts[want] == 1 else "have"
    _check_complete(idx, src, list(want), f"{counts[want]} of the file's {len(idx.domains)} groups {verb}")


def _index_groups(records: list[dict], lines: list[int], src: RecordSource,
                  domains: Sequence[str] | None) -> GroupIndex:
    """Each group's domains, answer types, seeds and first line; a domain twice in one group,
    or one outside ``domains`` (when given), is an error at its record's line."""
    idx = GroupIndex()
    seen: dict[tuple[str, str], int] = {}
    for rec, line in zip(records, lines):
        g, d = rec["group_id"], rec["domain"]
        if domains is not None and d not in domains:
            raise DataError(f"{src.where(line)}: field 'domain': {d!r} (group {g!r}) is not one of the domains "
                            f"--domains asks for, {', '.join(domains)}")
        if (g, d) in seen:
            raise DataError(f"{src.where(line)}: field 'domain': group {g!r} already has a {d!r} "
                            f"instance ({src.ref(seen[(g, d)])})")
        seen[(g, d)] = line
        idx.domains[g].append(d)
        idx.answer_types[g].add(answer_type(rec["answer"]))
        idx.seeds[g].add(rec["seed_id"])
        idx.first_line.setdefault(g, line)
    return idx


def _check_complete(idx: GroupIndex, src: RecordSource, want: list[str], reference: str) -> None:
    """Every group has exactly the domains ``want`` (``reference`` says whose they are)."""
    for g, ds in idx.domains.items():
        missing, extra = [d for d in want if d not in ds], sorted(set(ds) - set(want))
        if missing or extra:
            what = " and ".join(x for x in (f"lacks {', '.join(missing)}" if missing else "",
                                             f"has {', '.join(extra)}" if extra else "") if x)
            raise DataError(f"{src.where(idx.first_line[g])}: field 'domain': group {g!r} {what} ({reference} "
                            f"{', '.join(want)}; every group needs each once)")


def read_isomer_jsonl(path: str | Path, check_group_structure: bool = True,
                      allow_partial_groups: bool = False, missing: str = "no such file") -> list[dict]:
    """Read and validate an isomer set; return its records in order. ``path``: any source of
    :mod:`iga_ds.data.sources` (a JSON Lines file, Parquet, Arrow, a saved folder, a hub id).

    Raises ``DataError`` with ``FILE:LINE: field ...`` (``SOURCE: row I: ...``) on the first
    problem found; ``missing`` says what a file that does not exist is.
    """
    source, records, lines = read_source(path, missing)
    if check_group_structure:
        check_groups(records, lines, source, allow_partial=allow_partial_groups)
    return records


def read_source(path: str | Path, missing: str = "no such file") -> tuple[RecordSource, list[dict], list[int]]:
    """(the source, its records each checked by :func:`validate_record`, their positions)."""
    source = resolve_source(path, missing)
    records, lines = [], []
    for position, obj in iter_source(source):
        records.append(validate_record(obj, source.where(position)))
        lines.append(position)
    if not records:
        what = "one JSON object per line" if source.kind == "jsonl" else "one record per row"
        raise DataError(f"{path}: no records (expected {what})")
    return source, records, lines


def check_no_leak(files: dict[str | RecordSource, tuple[list[dict], list[int]]]) -> None:
    """No seed_id and no group_id may appear in two files (e.g. train and test). ``files``
    maps each file (a path, or a RecordSource) to its records and their positions."""
    owner_seed: dict[str, tuple[RecordSource, int]] = {}
    owner_group: dict[str, tuple[RecordSource, int]] = {}
    for path, (records, lines) in files.items():
        src = _as_source(path)
        local_seed, local_group = {}, {}
        for rec, line in zip(records, lines):
            local_seed.setdefault(rec["seed_id"], line)
            local_group.setdefault(rec["group_id"], line)
        for sid, line in local_seed.items():
            if sid in owner_seed and owner_seed[sid][0].spec != src.spec:
                other, other_line = owner_seed[sid]
                raise DataError(f"{src.where(line)}: field 'seed_id': seed {sid!r} is also in "
                                f"{other.where(other_line)}; a seed must stay on one side of a split")
            owner_seed.setdefault(sid, (src, line))
        for gid, line in local_group.items():
            if gid in owner_group and owner_group[gid][0].spec != src.spec:
                other, other_line = owner_group[gid]
                raise DataError(f"{src.where(line)}: field 'group_id': group {gid!r} is also in "
                                f"{other.where(other_line)}")
            owner_group.setdefault(gid, (src, line))


def summarize(records: list[dict]) -> dict:
    """Counts a user wants to see after validation."""
    groups = {r["group_id"] for r in records}
    domains = Counter(r["domain"] for r in records)
    summary = {
        "groups": len(groups),
        "instances": len(records),
        "seeds": len({r["seed_id"] for r in records}),
        "domains": dict(sorted(domains.items())),
        "answer_types": dict(sorted(Counter(answer_type(r["answer"]) for r in records).items())),
    }
    patterns = Counter((r.get("meta") or {}).get("pattern") for r in records)
    patterns.pop(None, None)
    if patterns:
        summary["patterns"] = dict(sorted(patterns.items()))
    agrees = [(r.get("meta") or {}).get("cue_agrees") for r in records]
    agrees = [a for a in agrees if a is not None]
    if agrees:
        summary["cue_agreement"] = sum(agrees) / len(agrees)
    scores = [r["alignment_score"] for r in records if r.get("alignment_score") is not None]
    if scores:
        summary["mean_alignment_score"] = sum(scores) / len(scores)
    return summary
