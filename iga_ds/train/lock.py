"""One run per output folder: :class:`iga_ds.files.FolderLock` on a file in it, held by rank 0."""
from __future__ import annotations

import os

from iga_ds.files import FolderLock

LOCK_FILE = ".iga-ds.lock"


class RunLock(FolderLock):
    """The lock of a run's ``output_dir``: :meth:`acquire` refuses in one line while another run holds it."""

    def __init__(self, folder: str | os.PathLike):
        super().__init__(folder, LOCK_FILE, lambda folder, holder: (
            f"output_dir {folder}: another run is writing to it ({holder}); wait for it to end, or give this "
            "run another output_dir"))
