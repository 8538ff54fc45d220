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
"""
from __future__ import annotations

from pathlib import Path
from typing import Sequence

from iga_ds.data.benchmarks.base import BenchmarkSource, EvalItem, missing_benchmark, require
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
    layout="test/<subject>/<n>.json files with fields problem, level, type, solution",
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


def load(
    root: str | Path,
    id_subjects: Sequence[str] = DEFAULTS["id_subjects"],
    ood_subjects: Sequence[str] = DEFAULTS["ood_subjects"],
    split: str = DEFAULTS["split"],
    levels: Sequence[int] | None = DEFAULTS["levels"],
) -> list[EvalItem]:
    root = Path(root)
    overlap = sorted(set(id_subjects) & set(ood_subjects))
    if overlap:
        raise DataError(f"{NAME}: subjects {overlap} are both in-distribution and OOD; pick one side")
    unknown = sorted((set(id_subjects) | set(ood_subjects)) - set(SUBJECTS))
    if unknown:
        raise DataError(f"{NAME}: unknown subject(s) {unknown}; expected some of {', '.join(SUBJECTS)}")
    base = _split_dir(root, split)
    if base is None:
        raise missing_benchmark(NAME, root, SOURCE, f"no {split}/ folder" if root.is_dir() else "")
    items: list[EvalItem] = []
    for subjects, item_split in ((id_subjects, "id"), (ood_subjects, "ood")):
        for subject in subjects:
            folder = base / subject
            if not folder.is_dir():
                raise missing_benchmark(NAME, root, SOURCE, f"no {split}/{subject}/ folder")
            files = sorted(folder.glob("*.json"), key=lambda p: (len(p.stem), p.stem))
            for path in files:
                obj = read_json(path)
                where = str(path)
                if not isinstance(obj, dict):
                    raise DataError(f"{where}: expected a JSON object, got {type(obj).__name__}")
                problem = require(obj, "problem", str, where, "the problem statement")
                solution = require(obj, "solution", str, where, "a worked solution ending in \\boxed{...}")
                answer = last_boxed(solution)
                if not answer:
                    raise DataError(f"{where}: field 'solution': expected a final \\boxed{{...}} answer")
                level = str(obj.get("level", ""))
                if levels is not None and level.replace("Level ", "") not in {str(lv) for lv in levels}:
                    continue
                items.append(
                    EvalItem(
                        id=f"{NAME}/{split}/{subject}/{path.stem}",
                        benchmark=NAME,
                        problem=problem.strip() + "\n\nPut the final answer in \\boxed{}.",
                        answer=answer,
                        kind="math",
                        domain=subject,
                        split=item_split,
                        meta={"level": level},
                    )
                )
    return items
