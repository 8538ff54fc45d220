"""Where isomer records come from, and a built set written out as a dataset.

One spec names a source, wherever a set is read (``data.train``, ``iga-ds data validate``,
``iga-ds data split --in``, ``iga-ds data export``, ``iga-ds eval --data``):

- **a JSON Lines file** (any file not named below): read line by line by
  :func:`iga_ds.files.iter_jsonl`, not by ``datasets``. Its JSON loader parses blocks of lines with
  pyarrow: a bad line is reported without its line number (the exception says only that the
  dataset could not be generated), values of mixed types are kept, cast or refused depending on
  the library's version, the rule for a line cut off by a kill does not apply, and a converted
  copy is written to the cache. The strict reader keeps every error at ``FILE:LINE``.
- **a Parquet file** (``.parquet``): ``Dataset.from_parquet`` (converted once into the
  ``datasets`` cache, ``HF_DATASETS_CACHE``);
- **an Arrow file** (``.arrow``): ``Dataset.from_file``, memory-mapped where it lies (the IPC
  stream format that ``datasets`` writes; the IPC file format, Feather v2, is read too);
- **a folder written by** ``Dataset.save_to_disk``: ``load_from_disk``, memory-mapped. A
  ``DatasetDict`` folder holds one such folder per split: name the split's folder;
- **a Hugging Face hub id**, ``org/name``, ``org/name@revision``, ``org/name:split`` or
  ``org/name@revision:split`` (split ``train`` by default), when no file or folder of that name
  exists: ``load_dataset``, which needs the network, or the ``datasets`` cache with
  ``HF_HUB_OFFLINE=1``. A name ending in a data file's suffix (``.jsonl``, ``.parquet``, ...) is
  always a path.

A row's position is its line number (from 1) in a JSON Lines file and its row index (from 0,
``dataset[i]``) otherwise; :meth:`RecordSource.where` writes ``FILE:LINE`` or ``SOURCE: row I``.

Rows of the ``datasets`` formats come back as JSON Lines records would: a ``dag`` or ``meta``
column holding JSON text is parsed (:func:`write_dataset` writes them so: Arrow gives a column
of objects the union of every row's keys, a missing key null), and an optional field that is
null is dropped. ``datasets`` is imported when such a source is read, not with this module.
"""
from __future__ import annotations

import json
import logging
import os
import re
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator, Sequence

from iga_ds.errors import DataError, UserError
from iga_ds.files import iter_jsonl, jsonl_text, make_dir

# huggingface_hub's rule for a repository id (owner/name), then an optional @revision and :split
HUB_DATASET = re.compile(r"^(?P<repo>[A-Za-z0-9][\w.-]*/[\w.-]*[A-Za-z0-9_])"
                         r"(?:@(?P<revision>[\w./-]+?))?(?::(?P<split>[\w.-]+))?$")
# names with these suffixes are files, never hub ids
FILE_SUFFIXES = (".jsonl", ".json", ".txt", ".parquet", ".arrow", ".csv")
# what :func:`write_dataset` writes
EXPORT_FORMATS = ("jsonl", "parquet", "dataset")
# record fields whose JSON objects are stored as JSON text in the datasets formats
JSON_TEXT_FIELDS = ("dag", "meta")
OPTIONAL_FIELDS = ("dag", "alignment_score", "meta")
_SAVED_DATASET = ("dataset_info.json", "state.json")
_DATASET_DICT = "dataset_dict.json"


@dataclass(frozen=True)
class RecordSource:
    """A resolved spec. ``kind``: ``jsonl``, ``parquet``, ``arrow``, ``dataset`` (a
    ``save_to_disk`` folder) or ``hub``; ``location``: the path, or the hub repository id."""

    kind: str
    spec: str
    location: str
    revision: str | None = None
    split: str | None = None

    @property
    def by_row(self) -> bool:
        """Positions are row indices (from 0), not line numbers."""
        return self.kind != "jsonl"

    def where(self, position: int) -> str:
        """``FILE:LINE`` or ``SOURCE: row I``: how an error message names one record."""
        return f"{self.spec}: row {position}" if self.by_row else f"{self.spec}:{position}"

    def ref(self, position: int) -> str:
        """``line N`` or ``row N``: another record of the same source, in a message."""
        return f"row {position}" if self.by_row else f"line {position}"


def is_hub_dataset_id(text: str) -> bool:
    """Whether ``text`` is spelled like a hub dataset id (``org/name[@revision][:split]``, the
    name without a data file's suffix); says nothing of whether it exists."""
    match = HUB_DATASET.match(text)
    return bool(match) and ".." not in text and "--" not in match["repo"] \
        and Path(match["repo"]).suffix.lower() not in FILE_SUFFIXES


def _one_saved_dataset(path: Path) -> bool:
    """Whether ``path`` is a folder ``save_to_disk`` wrote for one dataset (not a DatasetDict)."""
    return all((path / name).is_file() for name in _SAVED_DATASET)


def is_dataset_folder(path: str | os.PathLike) -> bool:
    """Whether ``path`` is a folder ``save_to_disk`` wrote: one dataset, or a DatasetDict's splits."""
    path = Path(path)
    return _one_saved_dataset(path) or (path / _DATASET_DICT).is_file()


def resolve_source(spec: str | os.PathLike, missing: str = "no such file") -> RecordSource:
    """Which kind of source ``spec`` names; a missing file that cannot be a hub id is a
    DataError ``SPEC: <missing>``. Nothing is read or downloaded."""
    text = str(spec)
    path = Path(text)
    if path.is_dir():
        if _one_saved_dataset(path):
            return RecordSource("dataset", text, text)
        if (path / _DATASET_DICT).is_file():
            splits = sorted(p.name for p in path.iterdir() if (p / "state.json").is_file())
            raise DataError(f"{text}: a dataset with the splits {', '.join(splits) or '(none)'}; "
                            f"name one split's folder, e.g. {path / (splits[0] if splits else 'train')}")
        raise DataError(f"{text}: is a directory, expected a JSONL, Parquet or Arrow file or a folder "
                        "written by datasets' save_to_disk")
    if path.exists() or not is_hub_dataset_id(text):
        if not path.exists():
            raise DataError(f"{text}: {missing}")
        suffix = path.suffix.lower()
        kind = "parquet" if suffix == ".parquet" else "arrow" if suffix == ".arrow" else "jsonl"
        return RecordSource(kind, text, text)
    match = HUB_DATASET.match(text)
    return RecordSource("hub", text, match["repo"], match["revision"], match["split"] or "train")


def iter_source(source: RecordSource, objects: bool = False) -> Iterator[tuple[int, Any]]:
    """(position, value) of every record of ``source``: a JSON Lines file by the strict reader
    (``objects``: every line must be a JSON object), the other kinds through ``datasets``."""
    if source.kind == "jsonl":
        yield from iter_jsonl(source.location, objects=objects)
        return
    for index, row in enumerate(load_rows(source)):
        yield index, normalize_row(row, source.where(index))


def load_rows(source: RecordSource):
    """The ``datasets.Dataset`` of a source that is not JSON Lines; any failure to read it is
    one DataError naming the source (a hub id while offline says so)."""
    import datasets

    datasets.disable_progress_bars()
    try:
        if source.kind == "parquet":
            return datasets.Dataset.from_parquet(source.location)
        if source.kind == "arrow":
            return _arrow_file(source.location)
        if source.kind == "dataset":
            return datasets.load_from_disk(source.location)
        return _from_hub(source)
    except UserError:
        raise
    except Exception as exc:  # pyarrow, fsspec, huggingface_hub and datasets errors alike
        raise DataError(_load_failure(source, exc)) from None


def _from_hub(source: RecordSource):
    """``load_dataset`` of a hub id, the libraries' warnings held back: a failure is one line."""
    import datasets

    loggers = [logging.getLogger(name) for name in ("datasets", "huggingface_hub", "fsspec")]
    levels = [logger.level for logger in loggers]
    for logger in loggers:
        logger.setLevel(logging.ERROR)
    try:
        return datasets.load_dataset(source.location, revision=source.revision, split=source.split)
    finally:
        for logger, level in zip(loggers, levels):
            logger.setLevel(level)


def _arrow_file(path: str):
    """An Arrow file: the IPC stream format (what ``datasets`` writes), else the file format."""
    import datasets
    import pyarrow as pa

    try:
        return datasets.Dataset.from_file(path)
    except (pa.ArrowInvalid, OSError):
        with pa.memory_map(path) as source:
            return datasets.Dataset(pa.ipc.open_file(source).read_all())


def _load_failure(source: RecordSource, exc: Exception) -> str:
    detail = " ".join(str(exc).split())[:300] or type(exc).__name__
    what = {"parquet": "a readable Parquet file", "arrow": "a readable Arrow file",
            "dataset": "a readable save_to_disk folder"}.get(source.kind)
    if what is not None:
        return f"{source.spec}: not {what} ({detail})"
    import datasets

    # HF_HUB_OFFLINE, or (datasets before 2.20) HF_DATASETS_OFFLINE, as datasets read them
    if getattr(datasets.config, "HF_HUB_OFFLINE", False) or getattr(datasets.config, "HF_DATASETS_OFFLINE", False):
        return (f"{source.spec}: no such file or folder, and as a Hugging Face hub dataset it is not in the datasets "
                f"cache while HF_HUB_OFFLINE is set ({detail})")
    return f"{source.spec}: no such file or folder, and it could not be loaded from the Hugging Face hub ({detail})"


def normalize_row(row: dict[str, Any], where: str) -> dict[str, Any]:
    """A ``datasets`` row as the JSON Lines record it stands for: JSON text in ``dag`` or
    ``meta`` parsed, optional fields that are null dropped."""
    out = {}
    for key, value in row.items():
        if key in JSON_TEXT_FIELDS and isinstance(value, str):
            try:
                value = json.loads(value)
            except json.JSONDecodeError as exc:
                raise DataError(f"{where}: field {key!r}: not valid JSON text ({exc.msg})") from None
        if key in OPTIONAL_FIELDS and value is None:
            continue
        out[key] = value
    return out


# -- writing ---------------------------------------------------------------------------------


def dataset_of(records: Sequence[dict[str, Any]]):
    """The records as a ``datasets.Dataset``: the required fields as strings, ``alignment_score``
    a nullable number, ``dag`` and ``meta`` JSON text (null where absent)."""
    import datasets

    datasets.disable_progress_bars()
    required = ("group_id", "seed_id", "domain", "problem", "cot", "answer")
    columns: dict[str, list] = {name: [str(r[name]) for r in records] for name in required}
    columns["alignment_score"] = [r.get("alignment_score") for r in records]
    for name in JSON_TEXT_FIELDS:
        columns[name] = [None if r.get(name) is None else json.dumps(r[name], ensure_ascii=False, sort_keys=True)
                         for r in records]
    features = datasets.Features({**{name: datasets.Value("string") for name in required},
                                  "alignment_score": datasets.Value("float64"),
                                  **{name: datasets.Value("string") for name in JSON_TEXT_FIELDS}})
    return datasets.Dataset.from_dict(columns, features=features)


def write_dataset(records: Sequence[dict[str, Any]], out: str | os.PathLike, fmt: str) -> Path:
    """Write validated records to ``out`` as ``jsonl``, ``parquet`` (one file) or ``dataset``
    (a ``save_to_disk`` folder), atomically: built under a temporary name beside ``out``, then
    renamed onto it (an earlier file or folder of that name is replaced only then)."""
    if fmt not in EXPORT_FORMATS:
        raise UserError(f"--format {fmt}: expected one of {', '.join(EXPORT_FORMATS)}")
    out = Path(out)
    if out.is_dir() and not _one_saved_dataset(out):
        raise UserError(f"--out {out}: a folder that save_to_disk did not write is in the way; "
                        "remove it or name another")
    make_dir(out.parent)
    tmp = out.with_name(f".{out.name}.{os.getpid()}.tmp")
    _remove(tmp)
    try:
        if fmt == "jsonl":
            tmp.write_text(jsonl_text(records), encoding="utf-8")
        elif fmt == "parquet":
            dataset_of(records).to_parquet(str(tmp))
        else:
            dataset_of(records).save_to_disk(str(tmp))
        _replace(tmp, out)
    except BaseException:
        _remove(tmp)
        raise
    return out


def _replace(tmp: Path, out: Path) -> None:
    """Rename ``tmp`` onto ``out``; a folder or file already there is moved aside first and
    removed after (a rename cannot replace a non-empty folder)."""
    old = out.with_name(f".{out.name}.{os.getpid()}.old")
    _remove(old)
    if out.exists() or out.is_symlink():
        os.rename(out, old)
    os.rename(tmp, out)
    _remove(old)


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    elif path.exists() or path.is_symlink():
        path.unlink()
