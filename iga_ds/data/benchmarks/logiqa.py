"""LogiQA 2.0 (Liu et al., 2023, "LogiQA 2.0 - An Improved Dataset for Logical Reasoning in
Natural Language Understanding"), the multiple-choice (MRC) part.

Public layout (the authors' repository, folder ``logiqa/DATA/LOGIQA``): JSON Lines files
``train.txt``, ``dev.txt``, ``test.txt`` and ``ood_test.jsonl``; each line has ``id``,
``answer`` (0-3), ``text``, ``question``, ``options`` (4 strings) and, in the in-domain files,
``type`` (a map of reasoning types to true).

Split: the paper's "domain-shuffled" split (business/academic vs news/government) cannot be
rebuilt from the public fields, which carry no genre. The default uses what the authors
publish for this purpose: ``test.txt`` is in-distribution, ``ood_test.jsonl`` (their
out-of-distribution test set) is OOD. Both lists of files are configurable.
"""
from __future__ import annotations

from pathlib import Path
from typing import Sequence

from iga_ds.data.benchmarks.base import (
    BenchmarkSource,
    EvalItem,
    check_options,
    format_choice_problem,
    missing_benchmark,
    require,
)
from iga_ds.errors import DataError
from iga_ds.files import iter_jsonl

NAME = "logiqa2"
SOURCE = BenchmarkSource(
    title="LogiQA 2.0",
    where="the authors' repository https://github.com/csitfun/LogiQA2.0 (folder logiqa/DATA/LOGIQA)",
    licence="CC BY-NC-SA 4.0",
    layout="JSON Lines files test.txt and ood_test.jsonl (fields id, answer, text, question, options)",
)
DEFAULTS = {"id_files": ("test.txt",), "ood_files": ("ood_test.jsonl",)}
_NESTED = Path("logiqa") / "DATA" / "LOGIQA"  # a checkout of the whole repository also works


def _data_dir(root: Path) -> Path:
    return root / _NESTED if (root / _NESTED).is_dir() else root


def _domain(obj: dict, where: str) -> str:
    types = obj.get("type")
    if types is None:
        return "untyped"
    if not isinstance(types, dict):
        raise DataError(f"{where}: field 'type': expected an object of reasoning types, got {types!r:.60}")
    chosen = [name for name, on in types.items() if on]
    return chosen[0] if chosen else "untyped"


def load(
    root: str | Path,
    id_files: Sequence[str] = DEFAULTS["id_files"],
    ood_files: Sequence[str] = DEFAULTS["ood_files"],
) -> list[EvalItem]:
    root = Path(root)
    data = _data_dir(root)
    wanted = [(name, "id") for name in id_files] + [(name, "ood") for name in ood_files]
    missing = [name for name, _ in wanted if not (data / name).is_file()]
    if not root.is_dir() or missing:
        raise missing_benchmark(NAME, root, SOURCE, f"missing {', '.join(missing)}" if root.is_dir() else "")
    items: list[EvalItem] = []
    for name, split in wanted:
        path = data / name
        for lineno, obj in iter_jsonl(path):
            where = f"{path}:{lineno}"
            answer = require(obj, "answer", int, where, "an option index 0-3")
            options = check_options(require(obj, "options", list, where, "a list of 4 strings"), where, "options")
            if not 0 <= answer < len(options):
                raise DataError(f"{where}: field 'answer': expected an index 0-{len(options) - 1}, got {answer}")
            text = require(obj, "text", str, where, "the passage")
            question = require(obj, "question", str, where, "the question")
            item_id = obj.get("id", lineno)
            items.append(
                EvalItem(
                    id=f"{NAME}/{Path(name).stem}/{item_id}",
                    benchmark=NAME,
                    problem=format_choice_problem(text, question, options),
                    answer="ABCDE"[answer],
                    kind="choice",
                    domain=_domain(obj, where),
                    split=split,
                )
            )
    return items
