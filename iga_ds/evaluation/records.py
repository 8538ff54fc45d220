"""Isomer sets (JSON Lines files, or the sources of :mod:`iga_ds.data.sources`) as evaluation items.

Record fields: ``group_id``, ``seed_id``, ``domain``, ``problem``, ``cot``, ``answer``; optional
``dag``, ``alignment_score``, ``meta``. The optional ``meta.answer_kind`` overrides the answer
kind inferred from the gold answer.
"""
from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any, Sequence

from iga_ds.data.benchmarks.base import EvalItem
from iga_ds.data.sources import iter_source, resolve_source
from iga_ds.errors import DataError
from iga_ds.metrics.answers import ANSWER_KINDS, infer_answer_kind

REQUIRED = ("group_id", "domain", "problem", "answer")


def read_isomer_records(path: str | Path) -> list[dict[str, Any]]:
    """Records of an isomer set (a JSON Lines file, or Parquet, Arrow, a saved dataset folder or
    a hub id: :mod:`iga_ds.data.sources`); a missing file or field is an error naming the file
    and the line (or row)."""
    source = resolve_source(Path(path), missing="no such isomer file (JSON Lines, one record per domain instance)")
    records = []
    seen: dict[tuple[str, str], int] = {}
    for position, rec in iter_source(source, objects=True):
        where = source.where(position)
        for key in REQUIRED:
            if key not in rec or rec[key] is None or (isinstance(rec[key], str) and not rec[key].strip()):
                raise DataError(f"{where}: missing field {key!r}")
            # a number serves as an id or an answer; the domain and the problem are text
            kinds = (str,) if key in ("domain", "problem") else (str, int, float)
            if isinstance(rec[key], bool) or not isinstance(rec[key], kinds):
                raise DataError(f"{where}: field {key!r}: expected a string, got {rec[key]!r:.60}")
        key = (str(rec["group_id"]), str(rec["domain"]))
        if key in seen:
            raise DataError(f"{where}: group {key[0]!r} already has a {key[1]!r} instance ({source.ref(seen[key])})")
        seen[key] = position
        kind = (rec.get("meta") or {}).get("answer_kind") if isinstance(rec.get("meta"), dict) else None
        if kind is not None and kind not in ANSWER_KINDS:
            raise DataError(f"{where}: field 'meta.answer_kind': expected one of {ANSWER_KINDS}, got {kind!r}")
        records.append(rec)
    if not records:
        raise DataError(f"{source.spec}: no records")
    return records


def isomer_items(
    records: Sequence[dict[str, Any]], name: str = "isomer", ood_domains: Sequence[str] = ()
) -> list[EvalItem]:
    """Evaluation items; domains listed in ``ood_domains`` are marked OOD, the rest ID."""
    items = []
    for rec in records:
        meta = rec.get("meta") if isinstance(rec.get("meta"), dict) else {}
        answer = str(rec["answer"]).strip()
        items.append(
            EvalItem(
                id=f"{rec['group_id']}/{rec['domain']}",
                benchmark=name,
                problem=str(rec["problem"]),
                answer=answer,
                kind=meta.get("answer_kind") or infer_answer_kind(answer),
                domain=str(rec["domain"]),
                split="ood" if rec["domain"] in set(ood_domains) else "id",
                meta={"group_id": rec["group_id"],
                      # the answer a planted cue signals (synthetic data): shortcut reliance
                      **({"cue_answer": str(meta["cue_answer"])} if meta.get("cue_answer") is not None else {})},
            )
        )
    return items


def counterfactual_items(item: EvalItem, record: dict[str, Any]) -> list[EvalItem]:
    """The two rewrites of an OOD item whose record carries ``meta.cue_counterfactual``: the same
    text with the cue pointing to the right answer (``cf-right/<id>``) and to a wrong one
    (``cf-wrong/<id>``). They are scored apart from the item itself (``iga_ds.metrics.cue``)."""
    meta = record.get("meta") if isinstance(record.get("meta"), dict) else {}
    versions = meta.get("cue_counterfactual")
    if not isinstance(versions, dict):
        return []
    out = []
    for side in ("right", "wrong"):
        version = versions.get(side)
        if not isinstance(version, dict) or not isinstance(version.get("problem"), str):
            continue
        extra = {"counterfactual": side, "of": item.id}
        if version.get("cue_answer") is not None:
            extra["cue_answer"] = str(version["cue_answer"])
        out.append(dataclasses.replace(item, id=f"cf-{side}/{item.id}", problem=version["problem"],
                                       meta={**item.meta, **extra}))
    return out


def with_counterfactuals(items: Sequence[EvalItem], records: Sequence[dict[str, Any]]) -> list[EvalItem]:
    """``items`` followed by the counterfactual rewrites of its OOD items (``records`` in the same order)."""
    extra = [cf for item, rec in zip(items, records) if item.split == "ood" for cf in counterfactual_items(item, rec)]
    return list(items) + extra


def isomer_eval_items(id_records: Sequence[dict[str, Any]], ood_records: Sequence[dict[str, Any]],
                      name: str) -> list[EvalItem]:
    """One evaluation set from an in-distribution and an out-of-distribution file of the same
    domains: the OOD items are marked so and their ids prefixed ``ood/`` (a group may be in both);
    then the counterfactual-cue rewrites of the OOD items, where the records carry them."""
    ood = [dataclasses.replace(item, split="ood", id=f"ood/{item.id}") for item in isomer_items(ood_records, name=name)]
    return isomer_items(id_records, name=name) + with_counterfactuals(ood, ood_records)
