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

One dataset in place of the folder (``root`` a ``.parquet`` or ``.arrow`` file, a ``save_to_disk``
folder, or a hub id ``org/name[@revision][:split]``, read through ``datasets``) holds the records
of one of those files, with the same fields: the one file ``id_files`` names (by default
``test.txt``, in-distribution), or, where ``id_files`` is empty, the one ``ood_files`` names
(``id_files= ood_files=ood_test.jsonl`` reads a copy of the OOD set as OOD). Items are those of
that file: ids ``logiqa2/<file stem>/<id>`` (a row without ``id`` is numbered from 1, as the
published files' lines are), checks the same, errors at ``SOURCE: row I``. A hub id without
``:split`` reads the split named after the file's stem (``test``, ``ood_test``). A reasoning
``type`` read from Arrow lists every type of the column in the column's order, those a record
lacks as null; the domain is the first type marked true in that order, the published one
wherever the records list their types in one order.
"""
from __future__ import annotations

from pathlib import Path
from typing import Sequence

from iga_ds.data.benchmarks.base import (
    BenchmarkSource,
    EvalItem,
    check_options,
    dataset_records,
    dataset_source,
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


def _item(obj: dict, where: str, file_name: str, number: int, split: str) -> EvalItem:
    """The item of one record of ``file_name``; ``number`` stands in for a missing ``id``."""
    answer = require(obj, "answer", int, where, "an option index 0-3")
    options = check_options(require(obj, "options", list, where, "a list of 4 strings"), where, "options")
    if not 0 <= answer < len(options):
        raise DataError(f"{where}: field 'answer': expected an index 0-{len(options) - 1}, got {answer}")
    text = require(obj, "text", str, where, "the passage")
    question = require(obj, "question", str, where, "the question")
    return EvalItem(
        id=f"{NAME}/{Path(file_name).stem}/{obj.get('id', number)}",
        benchmark=NAME,
        problem=format_choice_problem(text, question, options),
        answer="ABCDE"[answer],
        kind="choice",
        domain=_domain(obj, where),
        split=split,
    )


def load(
    root: str | Path,
    id_files: Sequence[str] = DEFAULTS["id_files"],
    ood_files: Sequence[str] = DEFAULTS["ood_files"],
) -> list[EvalItem]:
    # a dataset root stands for one file: id_files' one name, else (id_files empty) ood_files'
    names, split, option = (id_files, "id", "id_files") if id_files else (ood_files, "ood", "ood_files")
    source = dataset_source(root, hub_split=Path(names[0]).stem if names else None)
    if source is not None:
        if len(names) != 1:
            raise DataError(f"{NAME}: {root} is one dataset, the records of one file; expected {option} to name "
                            f"one file, got {len(names)} (e.g. id_files=test.txt, or id_files= and "
                            "ood_files=ood_test.jsonl)")
        return [_item(obj, where, names[0], index + 1, split)
                for index, where, obj in dataset_records(NAME, SOURCE, source)]
    root = Path(root)
    data = _data_dir(root)
    wanted = [(name, "id") for name in id_files] + [(name, "ood") for name in ood_files]
    missing = [name for name, _ in wanted if not (data / name).is_file()]
    if not root.is_dir() or missing:
        raise missing_benchmark(NAME, root, SOURCE, f"missing {', '.join(missing)}" if root.is_dir() else "")
    items: list[EvalItem] = []
    for name, split in wanted:
        path = data / name
        items += [_item(obj, f"{path}:{lineno}", name, lineno, split) for lineno, obj in iter_jsonl(path)]
    return items
