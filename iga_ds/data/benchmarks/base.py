"""What every benchmark loader returns, and the checks they share.

A loader reads a user's local copy of a public benchmark and returns ``EvalItem``s: the text the
model sees, the gold answer, how to score it, and whether the item is in-distribution (``"id"``)
or out-of-distribution (``"ood"``) under the configured split.

A loader's ``root`` is a folder in the benchmark's published layout, or one dataset holding the
records of one published file with the same fields (:func:`dataset_source`): a Parquet or Arrow
file, a ``save_to_disk`` folder, or a Hugging Face hub id ``org/name[@revision][:split]``, read
through ``datasets`` as isomer sets are (``iga_ds.data.sources``). Both go through the same
per-record item builder; a dataset's errors name ``SOURCE: row I``.
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Iterator

from iga_ds.data.sources import (
    HUB_DATASET,
    RecordSource,
    is_dataset_folder,
    is_hub_dataset_id,
    load_rows,
    resolve_source,
)
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


def missing_benchmark(name: str, root: str | Path, source: BenchmarkSource, detail: str = "") -> DataError:
    what = f" ({detail})" if detail else ""
    return DataError(
        f"{name}: no usable copy at {root}{what}; expected {source.layout}. "
        f"{source.title} is not bundled with iga-ds: obtain it from {source.where} "
        f"({source.licence}) and pass its folder (or one Parquet or Arrow file, save_to_disk folder or "
        f"hub id of its records) with --benchmark-dir."
    )


def dataset_source(root: str | Path, hub_split: str | None) -> RecordSource | None:
    """The one dataset ``root`` names, or None where ``root`` is to be read in the published layout.

    A dataset is a ``.parquet`` or ``.arrow`` file, a folder ``save_to_disk`` wrote, or, where no
    file or folder of that name exists, a name spelled as a hub id; a hub id naming no split
    reads ``hub_split`` (None: the caller requires one). Any other folder, file or missing path
    is left to the published layout, whose loader says what it expected there.
    """
    text = str(root)
    path = Path(text)
    if (path.is_dir() and not is_dataset_folder(path)) or (not path.exists() and not is_hub_dataset_id(text)):
        return None
    source = resolve_source(text)
    if source.kind == "jsonl":  # any other file: a published one
        return None
    if source.kind == "hub" and HUB_DATASET.match(text)["split"] is None:
        source = replace(source, split=hub_split)
    return source


def dataset_records(name: str, info: BenchmarkSource,
                    source: RecordSource) -> Iterator[tuple[int, str, dict[str, Any]]]:
    """(row index, ``SOURCE: row I``, record) of each row of a dataset source. A null is dropped
    from the record: Arrow stores a field that a record lacks as null in its row, and the item
    builders treat it as absent, as in a published record. A hub id that cannot be loaded is
    reported as a missing benchmark (with where to obtain it), the reason kept."""
    try:
        rows = load_rows(source)
    except DataError as exc:
        if source.kind != "hub":
            raise
        reason = str(exc).removeprefix(f"{source.spec}: ")
        raise missing_benchmark(name, source.spec, info, reason) from None
    for index, row in enumerate(rows):
        yield index, source.where(index), {key: value for key, value in row.items() if value is not None}


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
