"""Which code a cell ran: the git commit of the checkout and whether its tree was clean.

A copy of the tree without its ``.git`` (a container image, a GPU machine given the files
only) names its source in ``IGA_DS_SOURCE_COMMIT`` and ``IGA_DS_SOURCE_CLEAN`` (``1`` or
``0``), set by whoever made the copy; without either, the commit is unknown (None).
"""
from __future__ import annotations

import os
import subprocess
from pathlib import Path
from typing import Any

COMMIT_ENV, CLEAN_ENV = "IGA_DS_SOURCE_COMMIT", "IGA_DS_SOURCE_CLEAN"
_ROOT = Path(__file__).resolve().parents[2]  # the checkout that holds the package


def _git(*args: str) -> str | None:
    try:
        done = subprocess.run(["git", "-C", str(_ROOT), *args], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.SubprocessError):
        return None
    return done.stdout if done.returncode == 0 else None


def source_state() -> dict[str, Any]:
    """``{"commit": sha or None, "clean": bool or None}`` for the code running now."""
    if os.environ.get(COMMIT_ENV):
        flag = os.environ.get(CLEAN_ENV, "")
        return {"commit": os.environ[COMMIT_ENV], "clean": {"1": True, "0": False}.get(flag)}
    commit = _git("rev-parse", "HEAD")
    if commit is None:
        return {"commit": None, "clean": None}
    # tracked files only: a grid's own outputs and caches are untracked or ignored
    status = _git("status", "--porcelain", "--untracked-files=no")
    return {"commit": commit.strip(), "clean": None if status is None else status.strip() == ""}
