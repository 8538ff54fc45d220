"""Evaluate items end to end: generate (resumably), extract, score, summarize, write eval.json.

Generations are appended to ``<out>.partial.jsonl`` after every batch (flushed to disk), so a
killed run resumes where it stopped, without generating an item twice; the first line records
the settings, and a resume with other settings is refused rather than mixed. ``eval.json`` is
written atomically at the end and the partial file removed.
"""
from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any, Callable, Sequence

from iga_ds.data.benchmarks.base import EvalItem
from iga_ds.errors import DataError, UserError
from iga_ds.evaluation import generation
from iga_ds.files import append_lines, atomic_write_json, cut_torn_tail, iter_jsonl
from iga_ds.metrics.accuracy import accuracy, accuracy_by_group, delta_gap
from iga_ds.metrics.answers import extract_answer, score_generation
from iga_ds.metrics.cue import cue_counterfactual_summary, signals_wrong_answer

SCHEMA = "iga-ds.eval/1"


def partial_path(out: Path) -> Path:
    return out.with_name(out.name + ".partial.jsonl")


class PartialGenerations:
    """Append-only store of finished generations, keyed by item id."""

    def __init__(self, path: Path, settings: dict[str, Any], restart: bool = False):
        self.path = path
        self.done: dict[str, str] = {}
        if restart and path.exists():
            path.unlink()
        if path.exists():
            self._load(settings)
        else:
            path.parent.mkdir(parents=True, exist_ok=True)
            append_lines(path, [json.dumps({"settings": settings}, sort_keys=True) + "\n"])

    def _load(self, settings: dict[str, Any]) -> None:
        cut_torn_tail(self.path)  # a line cut off by a kill: its item is generated again
        rows = iter_jsonl(self.path, objects=False)
        try:
            first = next(rows, None)
        except DataError:
            first = None
        header = first[1].get("settings") if first is not None and isinstance(first[1], dict) else None
        if header != json.loads(json.dumps(settings, sort_keys=True)):
            raise UserError(
                f"{self.path}: holds generations made with other settings (model, adapter, data or "
                "generation options); delete it or pass --restart"
            )
        for lineno, row in rows:  # a line that is not JSON at all: iter_jsonl names it
            if not isinstance(row, dict) or "id" not in row or "output" not in row:
                raise DataError(f"{self.path}:{lineno}: malformed generation record; delete the file or pass "
                                "--restart")
            self.done[str(row["id"])] = str(row["output"])

    def add(self, ids: Sequence[str], outputs: Sequence[str]) -> None:
        append_lines(self.path, [json.dumps({"id": i, "output": t}, ensure_ascii=False) + "\n"
                                 for i, t in zip(ids, outputs)])
        self.done.update(zip(ids, outputs))


def score_items(items: Sequence[EvalItem], outputs: dict[str, str]) -> list[dict[str, Any]]:
    rows = []
    for item in items:
        text = outputs[item.id]
        row: dict[str, Any] = {
            "id": item.id,
            "domain": item.domain,
            "split": item.split,
            "kind": item.kind,
            "gold": item.answer,
            "output": text,
        }
        for key in ("group_id", "cue_answer", "counterfactual", "of"):  # isomer items: cue use, pairing
            if item.meta.get(key) is not None:
                row[key] = item.meta[key]
        if item.labeled:
            score = score_generation(text, item.answer, item.kind)
            row.update(prediction=score.prediction, correct=score.correct, correct_symbolic=score.correct_symbolic)
        else:
            row.update(prediction=extract_answer(text, item.kind), correct=None, correct_symbolic=None)
        rows.append(row)
    return rows


def summarize(rows: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """Accuracy overall, per domain and per split (strict and symbolic), and the Delta-gap, over
    the items themselves; the counterfactual-cue rewrites of OOD items are summarized apart
    (``cue_counterfactual``: cue effect and flip rate, :mod:`iga_ds.metrics.cue`)."""
    rewrites = [r for r in rows if r.get("counterfactual")]
    rows = [r for r in rows if not r.get("counterfactual")]
    scored = [r for r in rows if r["correct"] is not None]
    summary: dict[str, Any] = {
        "n": len(rows),
        "n_scored": len(scored),
        "accuracy": accuracy([r["correct"] for r in scored]),
        "accuracy_symbolic": accuracy([r["correct_symbolic"] for r in scored]),
        "per_domain": accuracy_by_group(scored, "domain"),
        "per_domain_symbolic": accuracy_by_group(scored, "domain", "correct_symbolic"),
        "per_split": accuracy_by_group(scored, "split"),
    }
    per_split = summary["per_split"]
    summary["id_accuracy"] = per_split.get("id", {}).get("accuracy")
    summary["ood_accuracy"] = per_split.get("ood", {}).get("accuracy")
    summary["delta_gap"] = delta_gap(summary["id_accuracy"], summary["ood_accuracy"])
    summary["cue_conflict"] = cue_conflict(scored)
    summary["ood_cue_follow"] = summary["cue_conflict"].get("ood", {}).get("follow_cue")
    if rewrites:  # absent without rewrites: evaluations of older data keep their fields
        summary["cue_counterfactual"] = cue_counterfactual_summary(rewrites)
    return summary


def cue_conflict(rows: Sequence[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Per split, over the items whose planted cue signals a wrong answer: how often the model
    answered what the cue signals (``follow_cue``, % ; shortcut reliance) and how often it was
    right (``accuracy``, %). Empty when no item carries a cue."""
    out: dict[str, dict[str, Any]] = {}
    for split in sorted({r["split"] for r in rows}):
        conflict = [r for r in rows if r["split"] == split and signals_wrong_answer(r)]
        if conflict:
            out[split] = {
                "n": len(conflict),
                "follow_cue": 100.0 * sum(r["prediction"] == r["cue_answer"] for r in conflict) / len(conflict),
                "accuracy": 100.0 * sum(bool(r["correct"]) for r in conflict) / len(conflict),
            }
    return out


def evaluate(
    items: Sequence[EvalItem],
    model: Any,
    tokenizer: Any,
    out: str | Path,
    settings: dict[str, Any],
    format_prompt: Callable[[dict[str, Any]], str],
    max_new_tokens: int = 512,
    batch_size: int = 8,
    stop_after_answer: bool = True,
    progress: bool = True,
    restart: bool = False,
    extra: dict[str, Any] | None = None,
    add_special_tokens: bool = True,
) -> dict[str, Any]:
    """Generate for every item not yet done, score all, write ``out`` (eval.json); return it.
    ``format_prompt`` and ``add_special_tokens``: a :class:`iga_ds.data.prompts.PromptFormat`'s
    ``prompt`` and ``add_special_tokens``, as training had them."""
    out = Path(out)
    ids = [item.id for item in items]
    if len(set(ids)) != len(ids):
        dup = next(i for i in ids if ids.count(i) > 1)
        raise DataError(f"item id {dup!r} occurs twice in the evaluation data")
    started = time.time()
    store = PartialGenerations(partial_path(out), settings, restart=restart)
    todo = [item for item in items if item.id not in store.done]
    if todo:
        prompts = [format_prompt(item.as_record()) for item in todo]
        generation.generate(
            model,
            tokenizer,
            prompts,
            max_new_tokens=max_new_tokens,
            batch_size=batch_size,
            stop_after_answer=stop_after_answer,
            progress=progress,
            on_batch=lambda idx, texts: store.add([todo[i].id for i in idx], texts),
            add_special_tokens=add_special_tokens,
        )
    rows = score_items(items, store.done)
    result = {"schema": SCHEMA, **settings, **summarize(rows), **(extra or {})}
    result["wall_time_s"] = time.time() - started
    result["resumed_items"] = len(items) - len(todo)
    result["items"] = rows
    atomic_write_json(out, result)
    store.path.unlink(missing_ok=True)
    return result
