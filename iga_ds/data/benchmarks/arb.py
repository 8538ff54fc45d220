"""ARB (Sawada et al., 2023, "ARB: Advanced Reasoning Benchmark for Large Language Models").

ARB is served through its API (``https://arb.duckai.org/api/lib/<category>``), not as files.
Local layout read here: one file per API category, saved as returned (a JSON array, or JSON
Lines), named after the category: ``math_numerical.json``, ``math_symbolic.json``,
``physics_numerical.json``, ``physics_symbolic.json``, ``law.json``, ``mcat_reading.json``,
``mcat_science.json``, ... The file name (without extension) is the item's domain.
Fields: ``Problem_Statement``, ``Final_Answer``, ``Topic`` (math, physics) and camelCase
``problemStatement``, ``finalAnswer``, ``answerCandidates`` (law, MCAT); keys are matched
ignoring case, spaces and underscores.

Scoring: items with answer candidates are multiple choice; the others are scored as MATH-style
answers (strict and symbolic). Proof-like problems have no exact answer (ARB grades them with a
rubric) and are skipped unless ``include_prooflike=True``.

Split: the paper withholds "law and biology". ARB's biology questions are in MCAT Science, so
the default OOD domains are ``law`` and ``mcat_science``; all other files are in-distribution.

One dataset in place of the folder (``root`` a ``.parquet`` or ``.arrow`` file, a ``save_to_disk``
folder, or a hub id ``org/name[@revision]:split``, read through ``datasets``) holds the records of
one category, with the same fields. The category is the file's or folder's name without its
suffix (``law.parquet``, a saved ``law/`` folder), or a hub id's split, which must be given
(``org/name:law``). Items, ids and checks are those of the category file, errors at
``SOURCE: row I``.
"""
from __future__ import annotations

import re
from pathlib import Path
from typing import Any, Sequence

from iga_ds.data.benchmarks.base import (
    BenchmarkSource,
    EvalItem,
    check_options,
    dataset_records,
    dataset_source,
    format_choice_problem,
    missing_benchmark,
    strip_option_prefix,
)
from iga_ds.data.sources import RecordSource
from iga_ds.errors import DataError
from iga_ds.files import iter_jsonl, read_json

NAME = "arb"
SOURCE = BenchmarkSource(
    title="ARB",
    where="its API https://arb.duckai.org/api/lib/ (save each category as <category>.json)",
    licence="see the ARB project's terms; its repository github.com/TheDuckAI/arb is GPL-3.0",
    layout="<category>.json files (JSON arrays) such as math_numerical.json, law.json, mcat_science.json",
)
DEFAULTS = {"ood_domains": ("law", "mcat_science"), "include_prooflike": False}


def _key(name: str) -> str:
    return re.sub(r"[^a-z0-9]", "", name.lower())


def _field(obj: dict[str, Any], name: str) -> Any:
    wanted = _key(name)
    for key, value in obj.items():
        if _key(key) == wanted:
            return value
    return None


def _records(path: Path) -> list[tuple[str, dict[str, Any]]]:
    if path.suffix == ".jsonl":
        return [(f"{path}:{lineno}", obj) for lineno, obj in iter_jsonl(path)]
    data = read_json(path)
    if isinstance(data, dict):  # some API answers wrap the list
        lists = [v for v in data.values() if isinstance(v, list)]
        data = lists[0] if len(lists) == 1 else data
    if not isinstance(data, list):
        raise DataError(f"{path}: expected a JSON array of problems, got {type(data).__name__}")
    out = []
    for index, obj in enumerate(data):
        if not isinstance(obj, dict):
            raise DataError(f"{path}: item {index}: expected an object, got {type(obj).__name__}")
        out.append((f"{path}: item {index}", obj))
    return out


def _choice_letter(final: str, options: list[str], where: str) -> str:
    final = final.strip()
    match = re.fullmatch(r"\(?([A-Ea-e])\)?[.)]?", final) or re.match(r"^\(?([A-E])\)?[.):]\s", final)
    if match:
        letter = match.group(1).upper()
        if "ABCDE".index(letter) < len(options):
            return letter
    bare = [strip_option_prefix(o).lower() for o in options]
    if strip_option_prefix(final).lower() in bare:
        return "ABCDE"[bare.index(strip_option_prefix(final).lower())]
    raise DataError(f"{where}: field 'finalAnswer': {final!r:.60} is neither an option letter nor an option")


def _item(obj: dict[str, Any], where: str, index: int, domain: str, ood_domains: Sequence[str]) -> EvalItem:
    """The item of problem ``index`` (from 0) of category ``domain``."""
    problem = _field(obj, "problem_statement")
    final = _field(obj, "final_answer")
    if not isinstance(problem, str) or not problem.strip():
        raise DataError(f"{where}: missing field 'Problem_Statement'/'problemStatement' (the problem text)")
    if final is None or (isinstance(final, str) and not final.strip()):
        raise DataError(f"{where}: missing field 'Final_Answer'/'finalAnswer' (the answer)")
    candidates = _field(obj, "answer_candidates")
    if candidates:
        options = check_options(candidates, where, "answerCandidates", count=None)
        text = format_choice_problem("", problem, options)
        answer, kind = _choice_letter(str(final), options, where), "choice"
    else:
        text, answer, kind = problem.strip(), str(final).strip().strip("$").strip(), "math"
        text += "\n\nPut the final answer in \\boxed{}."
    return EvalItem(
        id=f"{NAME}/{domain}/{obj.get('_id', obj.get('id', index))}",
        benchmark=NAME,
        problem=text,
        answer=answer,
        kind=kind,
        domain=domain,
        split="ood" if domain in set(ood_domains) else "id",
        meta={"topic": _field(obj, "topic")} if _field(obj, "topic") else {},
    )


def _dataset_category(source: RecordSource, include_prooflike: bool) -> str:
    """The category a dataset root holds: its file's or folder's stem, or a hub id's split."""
    if source.kind == "hub":
        if source.split is None:
            raise DataError(f"{NAME}: {source.spec}: a hub id names its category as the split, "
                            f"e.g. {source.spec}:law")
        category = source.split
    else:
        category = Path(source.location).stem
    if "proof" in category and not include_prooflike:
        raise DataError(f"{NAME}: {source.spec}: category {category} is proof-like, with no exact answer to "
                        "score; pass include_prooflike=true to read it")
    return category


def load(
    root: str | Path,
    ood_domains: Sequence[str] = DEFAULTS["ood_domains"],
    include_prooflike: bool = DEFAULTS["include_prooflike"],
) -> list[EvalItem]:
    source = dataset_source(root, hub_split=None)
    if source is not None:
        domain = _dataset_category(source, include_prooflike)
        return [_item(obj, where, index, domain, ood_domains)
                for index, where, obj in dataset_records(NAME, SOURCE, source)]
    root = Path(root)
    files = sorted(p for p in root.glob("*.json*") if p.suffix in (".json", ".jsonl")) if root.is_dir() else []
    if not include_prooflike:
        files = [p for p in files if "proof" not in p.stem]
    if not files:
        raise missing_benchmark(NAME, root, SOURCE, "no category files" if root.is_dir() else "")
    return [_item(obj, where, index, path.stem, ood_domains)
            for path in files for index, (where, obj) in enumerate(_records(path))]
