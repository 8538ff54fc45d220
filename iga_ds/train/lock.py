"""One run per output folder: an advisory lock (``fcntl.flock``) on a file in it, held by rank 0.

The kernel releases the lock when the holder exits, however it exits, so a killed run leaves
no stale lock behind; the file itself stays, holding the last holder's pid and host for the
message a second run gets. ``flock`` works across the processes of one host and, on most
cluster filesystems (NFS v4, Lustre with ``flock`` mounted), across hosts.
"""
from __future__ import annotations

import fcntl
import os
import socket
from pathlib import Path

from iga_ds.errors import UserError
from iga_ds.files import make_dir

LOCK_FILE = ".iga-ds.lock"


class RunLock:
    """The lock of ``folder``: :meth:`acquire` refuses in one line while another run holds it."""

    def __init__(self, folder: str | os.PathLike):
        self.folder = Path(folder)
        self.path = self.folder / LOCK_FILE
        self._fd: int | None = None

    def acquire(self) -> "RunLock":
        make_dir(self.folder)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o666)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.read(fd, 256).decode("utf-8", "replace").strip() or "a process that has not said which"
            os.close(fd)
            raise UserError(f"output_dir {self.folder}: another run is writing to it ({holder}); wait for it to "
                            "end, or give this run another output_dir") from None
        os.ftruncate(fd, 0)
        os.write(fd, f"pid {os.getpid()} on host {socket.gethostname()}\n".encode())
        self._fd = fd
        return self

    def release(self) -> None:
        if self._fd is not None:
            fcntl.flock(self._fd, fcntl.LOCK_UN)
            os.close(self._fd)
            self._fd = None
