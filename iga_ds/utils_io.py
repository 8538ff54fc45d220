"""Atomic file writes: a reader never sees a half-written file."""
from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path
from typing import Any


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
    import yaml

    from iga_ds.errors import ConfigError

    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"{path}: {what} not found")
    try:
        return yaml.safe_load(path.read_text(encoding="utf-8"))
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f"{path}:{mark.line + 1}" if mark else str(path)
        raise ConfigError(f"{where}: not valid YAML ({getattr(exc, 'problem', exc)})") from None
