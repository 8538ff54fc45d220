"""Isomer records gathered into groups: the N domain instances of one logical problem."""
from __future__ import annotations

from collections import OrderedDict
from typing import Any, Mapping, Sequence

from iga_ds.errors import DataError


def complete_groups(records: Sequence[Mapping[str, Any]], domains: Sequence[str], source: str = "data") -> list[list]:
    """Groups (in first-seen order) that have exactly one instance of every domain, each
    ordered like ``domains``; groups missing a domain are dropped (the caller reports it), a
    group with two instances of one domain is an error naming ``source``."""
    by_group: "OrderedDict[str, dict[str, Mapping[str, Any]]]" = OrderedDict()
    wanted = set(domains)
    for rec in records:
        if rec["domain"] not in wanted:
            continue
        slot = by_group.setdefault(str(rec["group_id"]), {})
        if rec["domain"] in slot:
            raise DataError(f"{source}: group {rec['group_id']!r} has two {rec['domain']!r} instances")
        slot[rec["domain"]] = rec
    return [[slot[d] for d in domains] for slot in by_group.values() if len(slot) == len(domains)]


def isomer_groups(records: Sequence[Mapping[str, Any]], domains: Sequence[str] | None = None,
                  source: str = "data") -> tuple[list[list], list[str]]:
    """(complete groups, their domains): :func:`complete_groups` over ``domains``, by default
    every domain the records have, sorted."""
    order = list(domains) if domains is not None else sorted({str(r["domain"]) for r in records})
    return complete_groups(records, order, source), order


def first_groups(records: Sequence[Mapping[str, Any]], n: int) -> list:
    """The records of the first ``n`` groups, in file order (a group's records are contiguous)."""
    out, seen = [], []
    for rec in records:
        if rec["group_id"] not in seen:
            if len(seen) == n:
                break
            seen.append(rec["group_id"])
        out.append(rec)
    return out
