"""Files: atomic writes (a reader never sees a half-written file), YAML and JSON Lines.

JSON Lines follow one rule for a torn line. Every writer here ends each line with a newline,
so a last line without one was cut off by a killed writer: appenders cut it off before they
append (:func:`cut_torn_tail`), readers skip it when it is not valid JSON (a file written by
hand may lack the final newline) and say so in the log. Any other line that is not valid JSON
is an error naming the file and the line.
"""
from __future__ import annotations

import json
import logging
import os
import tempfile
from pathlib import Path
from typing import Any, Iterable, Iterator

from iga_ds.errors import ConfigError, DataError

log = logging.getLogger(__name__)


def temp_file_beside(path: Path) -> tuple[int, str]:
    """(fd, name) of a new temporary file in ``path``'s folder, to be renamed onto ``path``.

    mkstemp creates it 0600; it gets the permissions a new file gets under the umask instead,
    so that what is renamed into place (results, reports, archives) is readable as usual.
    """
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(tmp, 0o666 & ~umask)
    return fd, tmp


def atomic_write_bytes(path: str | os.PathLike, data: bytes) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = temp_file_beside(path)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        raise


def atomic_write_text(path: str | os.PathLike, text: str) -> None:
    atomic_write_bytes(path, text.encode("utf-8"))


def atomic_write_json(path: str | os.PathLike, obj: Any, indent: int = 2) -> None:
    atomic_write_text(path, json.dumps(obj, indent=indent, sort_keys=True) + "\n")


def read_yaml_file(path: str | os.PathLike, what: str = "file") -> Any:
    """``yaml.safe_load`` of a file; a missing file or bad YAML is a one-line ConfigError with
    the file and line."""
    import yaml  # only the commands that read YAML pay for it

    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"{path}: {what} not found")
    try:
        return yaml.safe_load(path.read_text(encoding="utf-8"))
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f"{path}:{mark.line + 1}" if mark else str(path)
        raise ConfigError(f"{where}: not valid YAML ({getattr(exc, 'problem', exc)})") from None


# -- JSON ----------------------------------------------------------------------------------------


def read_json(path: str | os.PathLike, objects: bool = False, error: type[Exception] = DataError) -> Any:
    """A JSON file; bad JSON (or, with ``objects``, anything but an object) is ``error`` naming
    the file and the line."""
    path = Path(path)
    try:
        value = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as exc:
        raise error(f"{path}:{exc.lineno}: not valid JSON ({exc.msg})") from None
    if objects and not isinstance(value, dict):
        raise error(f"{path}: expected a JSON object, got {type(value).__name__}")
    return value


# -- JSON Lines ----------------------------------------------------------------------------------


def _open_binary(path: Path):
    try:
        return path.open("rb")
    except FileNotFoundError:
        raise DataError(f"{path}: no such file") from None
    except IsADirectoryError:
        raise DataError(f"{path}: is a directory, expected a JSONL file") from None
    except OSError as exc:
        raise DataError(f"{path}: cannot read ({exc.strerror})") from None


def iter_jsonl(path: str | os.PathLike, objects: bool = True) -> Iterator[tuple[int, Any]]:
    """(line number, parsed value) of each non-blank line, under the module's torn-line rule.

    ``objects``: every value must be a JSON object. Bytes that are not UTF-8 and values that
    are not JSON are errors naming the file and the line (decoded line by line, so a bad byte
    is reported on its own line).
    """
    path = Path(path)
    with _open_binary(path) as f:
        for lineno, raw in enumerate(f, 1):
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError:
                raise DataError(f"{path}:{lineno}: not UTF-8 text") from None
            if not line.strip():
                continue
            try:
                value = json.loads(line)
            except json.JSONDecodeError as exc:
                if not raw.endswith(b"\n") and not f.peek(1):
                    log.warning("%s:%d: last line is cut off (no newline, not valid JSON): skipped", path, lineno)
                    return
                raise DataError(f"{path}:{lineno}: not valid JSON ({exc.msg} at column {exc.colno})") from None
            if objects and not isinstance(value, dict):
                raise DataError(f"{path}:{lineno}: expected a JSON object, got {type(value).__name__}")
            yield lineno, value


def read_jsonl(path: str | os.PathLike, objects: bool = True) -> list[Any]:
    """Every value of a JSON Lines file (:func:`iter_jsonl`)."""
    return [value for _, value in iter_jsonl(path, objects)]


def jsonl_text(rows: Iterable[Any]) -> str:
    return "".join(json.dumps(row, ensure_ascii=False) + "\n" for row in rows)


def write_jsonl(path: str | os.PathLike, rows: Iterable[Any]) -> None:
    """The whole file at once, atomically."""
    atomic_write_text(path, jsonl_text(rows))


def torn_tail_start(data: bytes) -> int:
    """Where a cut-off last line starts in ``data`` (``len(data)`` when the last line is whole)."""
    return data.rfind(b"\n") + 1


def cut_torn_tail(path: str | os.PathLike, keep: int | None = None) -> bool:
    """Truncate ``path`` to its last whole line (or to ``keep`` bytes), so that an append starts
    on a fresh line; True when something was cut. A missing file is left alone."""
    path = Path(path)
    if not path.exists():
        return False
    size = path.stat().st_size
    if keep is None:
        with path.open("rb") as f:
            keep = torn_tail_start(f.read())
    if keep == size:
        return False
    with path.open("r+b") as f:
        f.truncate(keep)
        f.flush()
        os.fsync(f.fileno())
    return True


def append_lines(path: str | os.PathLike, lines: Iterable[str]) -> None:
    """Append whole lines in one write and fsync: a kill leaves at most the last one torn."""
    data = "".join(lines).encode("utf-8")
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view):]
        os.fsync(fd)
    finally:
        os.close(fd)
