"""Files: atomic writes (a reader never sees a half-written file), text, YAML and JSON Lines.

Reading a file the user named fails with one line naming the file (and the line where there
is one): missing, a directory, unreadable, not UTF-8, not valid YAML or JSON. A failed write
raises the ``OSError`` with the target's name as its ``filename`` (never the temporary's), which
the command line shows as one line; :func:`check_output_file` and :func:`check_output_dir` let a
command refuse an output it could not write before it does the work.

JSON Lines follow one rule for a torn line. Every writer here ends each line with a newline,
so a last line without one was cut off by a killed writer: appenders cut it off before they
append (:func:`cut_torn_tail`), readers skip it when it is not valid JSON (a file written by
hand may lack the final newline) and say so in the log. Any other line that is not valid JSON
is an error naming the file and the line.
"""
from __future__ import annotations

import errno
import fcntl
import json
import logging
import os
import socket
import tempfile
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator

from iga_ds.errors import ConfigError, DataError, UserError

log = logging.getLogger(__name__)


def temp_file_beside(path: Path) -> tuple[int, str]:
    """(fd, name) of a new temporary file in ``path``'s folder, to be renamed onto ``path``.

    mkstemp creates it 0600; it gets the permissions a new file gets under the umask instead,
    so that what is renamed into place (results, reports, archives) is readable as usual. When
    it cannot be made, the ``OSError`` names ``path``, the file the user asked for.
    """
    try:
        fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    except OSError as exc:
        raise _naming(exc, path) from None
    os.chmod(tmp, new_file_mode())
    return fd, tmp


def new_file_mode() -> int:
    """The permissions a new file gets under this process's umask (0o644 under umask 022)."""
    umask = os.umask(0)
    os.umask(umask)
    return 0o666 & ~umask


def follow_umask(path: str | os.PathLike) -> None:
    """Give ``path`` (a file, or every file under a folder) the permissions a new file gets
    under the umask: writers that create files 0600 (safetensors' ``save_file``) would
    otherwise leave adapters and optimizer states unreadable to everyone else."""
    path = Path(path)
    mode = new_file_mode()
    for file in (path.rglob("*") if path.is_dir() else [path]):
        if file.is_file() and not file.is_symlink():
            os.chmod(file, mode)


def atomic_write_bytes(path: str | os.PathLike, data: bytes) -> None:
    """Write ``data`` to ``path`` through a temporary file beside it; on failure the old file
    stays, no temporary is left, and an ``OSError`` names ``path``."""
    path = Path(path)
    try:
        if path.is_dir():
            raise IsADirectoryError(errno.EISDIR, os.strerror(errno.EISDIR), str(path))
        make_dir(path.parent)
        fd, tmp = temp_file_beside(path)
    except OSError as exc:
        raise _naming(exc, path) from None
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException as exc:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        if isinstance(exc, OSError):
            raise _naming(exc, path) from None
        raise


def _naming(exc: OSError, path: Path) -> OSError:
    """``exc`` as the same kind of OSError about ``path``: a failed mkdir names a parent, a failed
    temporary file or rename names the temporary, but the user asked for ``path``."""
    if exc.errno is None:
        return exc
    blocker = _file_in_the_way(path) if exc.errno in (errno.ENOTDIR, errno.EEXIST) else None
    if blocker is not None:
        return NotADirectoryError(errno.ENOTDIR, f"{blocker} is a file, expected a directory", str(path))
    return type(exc)(exc.errno, exc.strerror, str(path))


def _file_in_the_way(path: Path, itself: bool = False) -> Path | None:
    """The nearest of ``path``'s parents (or ``path`` itself) that exists but is not a
    directory, if any."""
    for here in (path, *path.parents) if itself else path.parents:
        if here.exists():
            return None if here.is_dir() else here
    return None


def make_dir(path: str | os.PathLike) -> Path:
    """``mkdir -p path``; when it fails, an ``OSError`` about ``path`` (naming the file in the
    way where a file stands at its place or a parent's)."""
    path = Path(path)
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        blocker = _file_in_the_way(path, itself=True)
        if blocker is not None:
            raise NotADirectoryError(errno.ENOTDIR, f"{blocker} is a file, expected a directory",
                                     str(path)) from None
        raise _naming(exc, path) from None
    return path


def atomic_write_text(path: str | os.PathLike, text: str) -> None:
    atomic_write_bytes(path, text.encode("utf-8"))


def atomic_write_json(path: str | os.PathLike, obj: Any, indent: int = 2) -> None:
    atomic_write_text(path, json.dumps(obj, indent=indent, sort_keys=True) + "\n")


def check_output_dir(path: str | os.PathLike, option: str = "--out") -> None:
    """Refuse, before any work, a folder that cannot be created or written: a file stands at its
    place or at one of its parents', or the nearest existing folder is not writable."""
    path = Path(path)
    if _file_in_the_way(path, itself=True) == path:
        raise UserError(f"{option} {path}: is a file, expected a directory")
    _check_parents(path, option)


def check_output_file(path: str | os.PathLike, option: str = "--out") -> None:
    """Refuse, before any work, an output file that could not be written: a directory stands at
    its place, or its folder cannot be created or written."""
    path = Path(path)
    if path.is_dir():
        raise UserError(f"{option} {path}: is a directory, expected a file name")
    _check_parents(path, option)


def _check_parents(path: Path, option: str) -> None:
    """``path`` can be created: no file in the way, and the nearest existing folder is writable."""
    blocker = _file_in_the_way(path)
    if blocker is not None:
        raise UserError(f"{option} {path}: {blocker} is a file, expected a directory")
    here = next((p for p in (path, *path.parents) if p.is_dir()), None)  # the nearest existing folder
    if here is not None and not os.access(here, os.W_OK | os.X_OK):
        raise UserError(f"{option} {path}: {here} is not writable")


def read_text(path: str | os.PathLike, what: str = "file", error: type[Exception] = DataError) -> str:
    """The text of a UTF-8 file (a leading byte-order mark dropped). Missing, a directory,
    unreadable or not UTF-8: ``error`` naming the file (and the line of the first bad byte)."""
    path = Path(path)
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        raise error(f"{path}: {what} not found") from None
    except IsADirectoryError:
        raise error(f"{path}: is a directory, expected a {what}") from None
    except OSError as exc:
        raise error(f"{path}: cannot read the {what} ({exc.strerror})") from None
    try:
        return data.decode("utf-8-sig")
    except UnicodeDecodeError as exc:
        line = data.count(b"\n", 0, exc.start) + 1
        raise error(f"{path}:{line}: not UTF-8 text (byte 0x{data[exc.start]:02x}); "
                    f"save the {what} as UTF-8") from None


def read_yaml_file(path: str | os.PathLike, what: str = "file") -> Any:
    """``yaml.safe_load`` of a file; a missing file, bytes that are not UTF-8 or bad YAML is a
    one-line ConfigError with the file and line."""
    import yaml  # only the commands that read YAML pay for it

    path = Path(path)
    text = read_text(path, what, ConfigError)
    try:
        return yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise ConfigError(f"{yaml_error_where(exc, path, text)}: not valid YAML "
                          f"({yaml_error_problem(exc)})") from None


def yaml_error_where(exc: Exception, path: str | os.PathLike, text: str) -> str:
    """``FILE:LINE`` of a YAML error (``FILE`` where the error has no position)."""
    mark = getattr(exc, "problem_mark", None) or getattr(exc, "context_mark", None)
    if mark is not None:
        return f"{path}:{mark.line + 1}"
    position = getattr(exc, "position", None)  # a ReaderError: a character YAML does not allow
    if isinstance(position, int):
        return f"{path}:{text.count(chr(10), 0, position) + 1}"
    return str(path)


def yaml_error_problem(exc: Exception) -> str:
    """What a YAML error says, on one line."""
    if isinstance(getattr(exc, "character", None), int):  # a ReaderError: a character YAML refuses
        text = f"unacceptable character #x{exc.character:04x}: {getattr(exc, 'reason', '')}"
    else:
        text = str(getattr(exc, "problem", None) or exc)
    return " ".join(text.split()) or type(exc).__name__


# -- JSON ----------------------------------------------------------------------------------------


def read_json(path: str | os.PathLike, objects: bool = False, error: type[Exception] = DataError) -> Any:
    """A JSON file; a missing or unreadable file, bytes that are not UTF-8, bad JSON (or, with
    ``objects``, anything but an object) is ``error`` naming the file and the line."""
    path = Path(path)
    text = read_text(path, "JSON file", error)
    try:
        value = json.loads(text)
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
            try:  # parsed without its line break: a line cut short fails at its own end, not at column 1
                value = json.loads(line.rstrip("\r\n"))
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


class FolderLock:
    """One writer at a time in a folder: an exclusive ``flock`` on ``folder/name``. The kernel
    releases it when the holder exits, however it exits, so a killed holder leaves no stale lock;
    the file keeps the last holder's pid and host for the one line a second writer gets,
    ``refusal(folder, holder)``. ``flock`` holds across the processes of one host and, on most
    cluster filesystems (NFS v4, Lustre mounted with ``flock``), across hosts."""

    def __init__(self, folder: str | os.PathLike, name: str, refusal: Callable[[Path, str], str]):
        self.folder = Path(folder)
        self.path = self.folder / name
        self._refusal = refusal
        self._fd: int | None = None

    def acquire(self) -> "FolderLock":
        make_dir(self.folder)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o666)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.read(fd, 256).decode("utf-8", "replace").strip() or "a process that has not said which"
            os.close(fd)
            raise UserError(self._refusal(self.folder, holder)) from None
        os.ftruncate(fd, 0)
        os.write(fd, f"pid {os.getpid()} on host {socket.gethostname()}\n".encode())
        self._fd = fd
        return self

    def release(self) -> None:
        if self._fd is not None:
            fcntl.flock(self._fd, fcntl.LOCK_UN)
            os.close(self._fd)
            self._fd = None

    def __enter__(self) -> "FolderLock":
        return self.acquire()

    def __exit__(self, *exc) -> None:
        self.release()
