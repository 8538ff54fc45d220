"""What every benchmark loader returns, and the checks they share.

A loader reads a user's local copy of a public benchmark in its published layout and returns
``EvalItem``s: the text the model sees, the gold answer, how to score it, and whether the item
is in-distribution (``"id"``) or out-of-distribution (``"ood"``) under the configured split.
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from iga_ds.errors import DataError

SPLITS = ("id", "ood")
_OPTION_PREFIX = re.compile(r"^\s*\(?[A-Ea-e]\s*[.．):]\s*")


@dataclass(frozen=True)
class EvalItem:
    """One evaluation question.

    ``answer`` is "" when the benchmark withholds labels (ReClor test): such items are
    generated and extracted but not scored.
    """

    id: str
    benchmark: str
    problem: str
    answer: str
    kind: str  # an iga_ds.metrics.ANSWER_KINDS value
    domain: str
    split: str  # "id" or "ood"
    meta: dict[str, Any] = field(default_factory=dict)

    @property
    def labeled(self) -> bool:
        return self.answer != ""

    def as_record(self) -> dict[str, Any]:
        """The fields ``iga_ds.data.prompts.format_prompt`` reads."""
        return {"problem": self.problem, "domain": self.domain, "answer": self.answer}


@dataclass(frozen=True)
class BenchmarkSource:
    """Where users obtain a benchmark and under which terms (shown when it is missing)."""

    title: str
    where: str
    licence: str
    layout: str


def missing_benchmark(name: str, root: Path, source: BenchmarkSource, detail: str = "") -> DataError:
    what = f" ({detail})" if detail else ""
    return DataError(
        f"{name}: no usable copy at {root}{what}; expected {source.layout}. "
        f"{source.title} is not bundled with iga-ds: obtain it from {source.where} "
        f"({source.licence}) and pass its folder with --benchmark-dir."
    )


def strip_option_prefix(option: str) -> str:
    """``"A.Some text"`` -> ``"Some text"`` (LogiQA and ARB options carry their letter)."""
    return _OPTION_PREFIX.sub("", str(option), count=1).strip()


def format_choice_problem(context: str, question: str, options: list[str]) -> str:
    """Passage, question and lettered options: the text a multiple-choice item shows the model."""
    letters = "ABCDE"
    lines = [context.strip(), "", question.strip(), ""] if context.strip() else [question.strip(), ""]
    lines += [f"{letters[i]}. {strip_option_prefix(opt)}" for i, opt in enumerate(options)]
    lines += ["", "Choose the letter of the correct option."]
    return "\n".join(lines)


def require(obj: dict[str, Any], key: str, types: type | tuple[type, ...], where: str, expected: str) -> Any:
    """``obj[key]`` if present and of the given type, else a DataError naming where and what."""
    if key not in obj:
        raise DataError(f"{where}: missing field {key!r} ({expected})")
    value = obj[key]
    if isinstance(value, bool) or not isinstance(value, types):
        raise DataError(f"{where}: field {key!r}: expected {expected}, got {value!r:.60}")
    return value


def check_options(options: Any, where: str, key: str, count: int | None = 4) -> list[str]:
    if not isinstance(options, list) or not all(isinstance(o, str) for o in options):
        raise DataError(f"{where}: field {key!r}: expected a list of strings")
    if count is not None and len(options) != count:
        raise DataError(f"{where}: field {key!r}: expected {count} options, got {len(options)}")
    if not 2 <= len(options) <= 5:
        raise DataError(f"{where}: field {key!r}: expected 2 to 5 options, got {len(options)}")
    return options
