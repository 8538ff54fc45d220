"""Atomic writes: the file appears whole under its name, with the permissions of a new file."""
from __future__ import annotations

import os
import stat

import pytest

from iga_ds.files import atomic_write_bytes, atomic_write_text


def test_atomic_write_gives_umask_permissions_and_leaves_no_temporary(tmp_path):
    old = os.umask(0o027)
    try:
        atomic_write_text(tmp_path / "sub" / "report.md", "# hi\n")
    finally:
        os.umask(old)
    path = tmp_path / "sub" / "report.md"
    assert path.read_text() == "# hi\n"
    assert stat.S_IMODE(path.stat().st_mode) == 0o640  # not mkstemp's 0600
    assert [p.name for p in path.parent.iterdir()] == ["report.md"]


def test_a_failed_write_leaves_the_old_file_and_no_temporary(tmp_path):
    path = tmp_path / "x.json"
    path.write_text("old")
    with pytest.raises(TypeError):
        atomic_write_bytes(path, "not bytes")  # type: ignore[arg-type]
    assert path.read_text() == "old" and [p.name for p in tmp_path.iterdir()] == ["x.json"]
