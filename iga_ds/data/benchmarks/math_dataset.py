"""MATH (Hendrycks et al., 2021, "Measuring Mathematical Problem Solving With the MATH Dataset").

Public layout: one JSON file per problem under ``{train,test}/<subject>/``, fields ``problem``,
``level``, ``type`` and ``solution``; the gold answer is the last ``\\boxed{...}`` of the
solution. Subjects: algebra, counting_and_probability, geometry, intermediate_algebra,
number_theory, prealgebra, precalculus.

Cross-domain split, corrected: the paper trains on "algebra, number theory, combinatorics" and
tests on "probability, geometry, precalculus", but combinatorics and probability are one MATH
subject (counting_and_probability), so that split puts the same subject on both sides. The
default here keeps counting_and_probability in-distribution and replaces it on the OOD side
by intermediate_algebra: ID = {algebra, number_theory, counting_and_probability}, OOD =
{geometry, precalculus, intermediate_algebra}. Both sets are configurable; subjects in
neither (prealgebra by default) are skipped. Items come from the ``test`` folder.

A Parquet copy is read too, where ``ROOT`` has no ``test/`` folder: ``ROOT/<subject>/test-*.parquet``
(``<split>-*.parquet``), the layout of the copies on the Hugging Face hub (such as
``EleutherAI/hendrycks_math``; a local snapshot, e.g. from ``huggingface-cli download --repo-type
dataset``), with the same fields and checks, read through ``datasets``. Its item ids are row
numbers (``math/test/algebra/12``: row 12 of the subject's files in name order), not the numbers of
the JSON files, which the Parquet copies do not keep.

One dataset of every subject is read too: ``root`` a ``.parquet`` or ``.arrow`` file, a
``save_to_disk`` folder, or a hub id ``org/name[@revision][:split]`` of a single-table copy
(``datasets`` loads no per-subject configuration from a hub id: read such a repository from a
local snapshot, as above). Its rows hold the records of one split, fields as published; the
subject is read from ``type`` (``Counting & Probability`` is ``counting_and_probability``), and
ids number each subject's rows in their order (``math/test/algebra/0``, ...), as for the Parquet copy
above, since the records do not hold their JSON files' numbers. A hub id without
``:split`` reads the split named by ``split``. Errors name ``SOURCE: row I``.
"""
from __future__ import annotations

import re
from pathlib import Path
from typing import Callable, Iterable, Iterator, Sequence

from iga_ds.data.benchmarks.base import (
    BenchmarkSource,
    EvalItem,
    dataset_records,
    dataset_source,
    missing_benchmark,
    require,
)
from iga_ds.data.sources import RecordSource
from iga_ds.errors import DataError
from iga_ds.files import read_json
from iga_ds.metrics.math_answers import last_boxed

NAME = "math"
SOURCE = BenchmarkSource(
    title="MATH",
    where=(
        "your own copy of the dataset released with Hendrycks et al. 2021 "
        "(https://github.com/hendrycks/math; its public download was withdrawn)"
    ),
    licence="MIT licence",
    layout="test/<subject>/<n>.json files with fields problem, level, type, solution (or a Parquet copy: "
           "<subject>/test-*.parquet)",
)
SUBJECTS = (
    "algebra",
    "counting_and_probability",
    "geometry",
    "intermediate_algebra",
    "number_theory",
    "prealgebra",
    "precalculus",
)
DEFAULTS = {
    "id_subjects": ("algebra", "number_theory", "counting_and_probability"),
    "ood_subjects": ("geometry", "precalculus", "intermediate_algebra"),
    "split": "test",
    "levels": None,
}


def _split_dir(root: Path, split: str) -> Path | None:
    for base in (root, root / "MATH"):  # the archive unpacks into a MATH/ folder
        if (base / split).is_dir():
            return base / split
    return None


def _parquet_files(root: Path, split: str, subject: str) -> list[Path]:
    return sorted((root / subject).glob(f"{split}-*.parquet")) if root.is_dir() else []


def _rows(root: Path, base: Path | None, split: str, subject: str) -> Iterator[tuple[str, str, object]]:
    """(where, item number, object) of each problem of a subject: the JSON files of the
    published layout (``base``), else the rows of the Parquet copy."""
    if base is not None:
        folder = base / subject
        if not folder.is_dir():
            raise missing_benchmark(NAME, root, SOURCE, f"no {split}/{subject}/ folder")
        for path in sorted(folder.glob("*.json"), key=lambda p: (len(p.stem), p.stem)):
            yield str(path), path.stem, read_json(path)
        return
    files = _parquet_files(root, split, subject)
    if not files:
        raise missing_benchmark(NAME, root, SOURCE, f"no {split}/{subject}/ folder and no {subject}/{split}-*.parquet")
    number = 0
    for path in files:
        for _, where, row in dataset_records(NAME, SOURCE, RecordSource("parquet", str(path), str(path))):
            yield where, str(number), row
            number += 1


def _item(obj: object, where: str, item_id: str, subject: str, item_split: str) -> EvalItem:
    if not isinstance(obj, dict):
        raise DataError(f"{where}: expected a JSON object, got {type(obj).__name__}")
    problem = require(obj, "problem", str, where, "the problem statement")
    solution = require(obj, "solution", str, where, "a worked solution ending in \\boxed{...}")
    answer = last_boxed(solution)
    if not answer:
        raise DataError(f"{where}: field 'solution': expected a final \\boxed{{...}} answer")
    return EvalItem(
        id=item_id,
        benchmark=NAME,
        problem=problem.strip() + "\n\nPut the final answer in \\boxed{}.",
        answer=answer,
        kind="math",
        domain=subject,
        split=item_split,
        meta={"level": str(obj.get("level", ""))},
    )


def _subject(obj: dict, where: str) -> str:
    """The subject folder name of a record's ``type`` (``Counting & Probability``: counting_and_probability)."""
    kind = require(obj, "type", str, where, "the subject, e.g. 'Counting & Probability'")
    subject = re.sub(r"[^a-z]+", "_", kind.lower().replace("&", "and")).strip("_")
    if subject not in SUBJECTS:
        raise DataError(f"{where}: field 'type': expected a MATH subject ({', '.join(SUBJECTS)}), got {kind!r:.60}")
    return subject


def _dataset_rows(source: RecordSource) -> Callable[[str], Iterable[tuple[str, str, object]]]:
    """(where, item number, object) of each problem of a subject, from one dataset of all subjects."""
    by_subject: dict[str, list[tuple[str, dict]]] = {subject: [] for subject in SUBJECTS}
    for _, where, obj in dataset_records(NAME, SOURCE, source):
        by_subject[_subject(obj, where)].append((where, obj))
    return lambda subject: [(where, str(number), obj) for number, (where, obj) in enumerate(by_subject[subject])]


def _folder_rows(root: Path, split: str) -> Callable[[str], Iterable[tuple[str, str, object]]]:
    """(where, item number, object) of each problem of a subject, from a folder of either layout."""
    base = _split_dir(root, split)
    if base is None and not any(_parquet_files(root, split, s) for s in SUBJECTS):
        raise missing_benchmark(NAME, root, SOURCE, f"no {split}/ folder" if root.is_dir() else "")
    return lambda subject: _rows(root, base, split, subject)


def load(
    root: str | Path,
    id_subjects: Sequence[str] = DEFAULTS["id_subjects"],
    ood_subjects: Sequence[str] = DEFAULTS["ood_subjects"],
    split: str = DEFAULTS["split"],
    levels: Sequence[int] | None = DEFAULTS["levels"],
) -> list[EvalItem]:
    overlap = sorted(set(id_subjects) & set(ood_subjects))
    if overlap:
        raise DataError(f"{NAME}: subjects {overlap} are both in-distribution and OOD; pick one side")
    unknown = sorted((set(id_subjects) | set(ood_subjects)) - set(SUBJECTS))
    if unknown:
        raise DataError(f"{NAME}: unknown subject(s) {unknown}; expected some of {', '.join(SUBJECTS)}")
    source = dataset_source(root, hub_split=split)
    rows_of = _dataset_rows(source) if source is not None else _folder_rows(Path(root), split)
    wanted = None if levels is None else {str(lv) for lv in levels}
    items: list[EvalItem] = []
    for subjects, item_split in ((id_subjects, "id"), (ood_subjects, "ood")):
        for subject in subjects:
            for where, number, obj in rows_of(subject):
                item = _item(obj, where, f"{NAME}/{split}/{subject}/{number}", subject, item_split)
                if wanted is None or item.meta["level"].replace("Level ", "") in wanted:
                    items.append(item)
    return items
