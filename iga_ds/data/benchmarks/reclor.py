"""ReClor (Yu et al., 2020, "ReClor: A Reading Comprehension Dataset Requiring Logical Reasoning").

Public layout (the archive users download after accepting the terms): ``train.json``,
``val.json``, ``test.json``, each a JSON array of objects with ``context``, ``question``,
``answers`` (4 strings), ``label`` (0-3; absent in test) and ``id_string``.

Split: the paper evaluates on ReClor's "hard" set. The ReClor authors define it on the test
file: its first 440 questions are EASY, the remaining ones HARD; test labels are withheld and
scored by the authors' leaderboard. With ``split="test"`` items are marked EASY -> ``id`` and
HARD -> ``ood``; predictions are written but not scored locally. The default ``split="val"``
(labelled, all ``id``) gives a local accuracy.

One dataset in place of the folder (``root`` a ``.parquet`` or ``.arrow`` file, a ``save_to_disk``
folder, or a hub id ``org/name[@revision][:split]``, read through ``datasets``) holds the records
of the file ``split`` names, with the same fields, rows in the file's order (the EASY/HARD cut is
by position); items, ids and checks are those of the file, errors at ``SOURCE: row I``. A hub id
without ``:split`` reads the split named as the option (``val``; a copy that calls it
``validation`` is named ``org/name:validation``).
"""
from __future__ import annotations

from pathlib import Path

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
from iga_ds.files import read_json

NAME = "reclor"
SOURCE = BenchmarkSource(
    title="ReClor",
    where="https://whyu.me/reclor/ (password-protected download after accepting its terms)",
    licence="research use only; derived data may not be redistributed",
    layout="train.json / val.json / test.json, JSON arrays of {context, question, answers, label, id_string}",
)
DEFAULTS = {"split": "val", "hard_start": 440}


def _item(obj: object, where: str, index: int, split: str, hard_start: int) -> EvalItem:
    """The item of question ``index`` (from 0) of the ``split`` file."""
    if not isinstance(obj, dict):
        raise DataError(f"{where}: expected an object, got {type(obj).__name__}")
    options = check_options(require(obj, "answers", list, where, "a list of 4 strings"), where, "answers")
    context = require(obj, "context", str, where, "the passage")
    question = require(obj, "question", str, where, "the question")
    answer = ""
    if split != "test" or "label" in obj:
        label = require(obj, "label", int, where, "an option index 0-3")
        if not 0 <= label < len(options):
            raise DataError(f"{where}: field 'label': expected an index 0-{len(options) - 1}, got {label}")
        answer = "ABCDE"[label]
    if split == "test":
        subset, item_split = ("easy", "id") if index < hard_start else ("hard", "ood")
    else:
        subset, item_split = split, "id"
    return EvalItem(
        id=f"{NAME}/{obj.get('id_string', f'{split}_{index}')}",
        benchmark=NAME,
        problem=format_choice_problem(context, question, options),
        answer=answer,
        kind="choice",
        domain=subset,
        split=item_split,
        meta={"index": index},
    )


def load(root: str | Path, split: str = DEFAULTS["split"], hard_start: int = DEFAULTS["hard_start"]) -> list[EvalItem]:
    if split not in ("train", "val", "test"):
        raise DataError(f"{NAME}: split must be train, val or test, got {split!r}")
    if hard_start < 0:
        raise DataError(f"{NAME}: hard_start must be >= 0 (the index of the first HARD question), got {hard_start}")
    source = dataset_source(root, hub_split=split)
    if source is not None:
        return [_item(obj, where, index, split, hard_start)
                for index, where, obj in dataset_records(NAME, SOURCE, source)]
    root = Path(root)
    path = root / f"{split}.json"
    if not path.is_file():
        raise missing_benchmark(NAME, root, SOURCE, f"missing {split}.json" if root.is_dir() else "")
    data = read_json(path)
    if not isinstance(data, list):
        raise DataError(f"{path}: expected a JSON array of questions, got {type(data).__name__}")
    return [_item(obj, f"{path}: item {index}", index, split, hard_start) for index, obj in enumerate(data)]
