"""`iga-ds pack`: what goes into the archive, parts that join back, and bad input."""
from __future__ import annotations

import os
import tarfile
from pathlib import Path

import pytest

from iga_ds.cli import main
from iga_ds.experiments.pack import pack, parse_size

KEPT = ["grid.yaml", "logs/iga-s0.log", "iga-s0/cell.json", "iga-s0/metrics.jsonl", "iga-s0/eval/synthetic.json",
        "erm-s1/cell.json", "erm-s1/eval/synthetic.json"]
WEIGHTS = ["iga-s0/adapter/adapter_model.safetensors", "iga-s0/adapter/adapter_config.json",
           "erm-s1/checkpoints/step_2/state.pt"]
DATA = ["data/train.jsonl", "data/ood.jsonl", "erm-s1/train.jsonl", "selection/erm_lr0.1-s0/train.jsonl"]
LOCKS = ["iga-s0/.iga-ds.lock", "selection.json.lock"]


def _results(root: Path) -> dict[str, bytes]:
    """A results folder; returns every file's bytes by relative path. Random bytes in one file
    keep the archive larger than a few KiB after compression."""
    content = {}
    for i, rel in enumerate(KEPT + WEIGHTS + DATA + LOCKS):
        data = os.urandom(6000) if rel.endswith("metrics.jsonl") else f"{rel} {i}\n".encode() * 20
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_bytes(data)
        if rel not in LOCKS:  # never archived
            content[rel] = data
    return content


def _unpack(archive: Path, where: Path) -> dict[str, bytes]:
    with tarfile.open(archive) as tar:
        tar.extractall(where, filter="data")
    return {str(p.relative_to(where / "runs")): p.read_bytes() for p in (where / "runs").rglob("*") if p.is_file()}


def test_pack_leaves_out_weights_and_data_unless_asked(tmp_path):
    content = _results(tmp_path / "runs")
    [archive] = pack(tmp_path / "runs", tmp_path / "out" / "runs.tar.xz")
    assert _unpack(archive, tmp_path / "a") == {k: content[k] for k in KEPT}
    assert oct(archive.stat().st_mode & 0o777) != oct(0o600)  # made to be shared, not mkstemp's 0600
    [full] = pack(tmp_path / "runs", tmp_path / "out" / "full.tar.xz", with_weights=True, with_data=True)
    assert _unpack(full, tmp_path / "b") == content
    # nothing else beside the archives (no temporary files)
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == ["full.tar.xz", "runs.tar.xz"]


def test_parts_join_into_the_archive_and_a_repack_replaces_them(tmp_path):
    _results(tmp_path / "runs")
    [whole] = pack(tmp_path / "runs", tmp_path / "whole.tar.xz")
    out = tmp_path / "parts" / "runs.tar.xz"
    parts = pack(tmp_path / "runs", out, part_size=2048)
    assert len(parts) >= 3 and [p.name for p in parts] == [f"runs.tar.xz.part{i:03d}" for i in range(len(parts))]
    assert all(p.stat().st_size <= 2048 for p in parts)
    assert b"".join(p.read_bytes() for p in parts) == whole.read_bytes()
    # larger parts: fewer files, and the earlier pack's extra parts are gone
    fewer = pack(tmp_path / "runs", out, part_size=parse_size("1M"))
    assert [p.name for p in fewer] == ["runs.tar.xz.part000"]
    assert sorted(p.name for p in out.parent.iterdir()) == ["runs.tar.xz.part000"]
    assert fewer[0].read_bytes() == whole.read_bytes()


def test_sizes():
    assert parse_size("15M") == 15 * 2**20 and parse_size("512KiB") == 512 * 2**10
    assert parse_size("2G") == 2 * 2**30 and parse_size("4096") == 4096 and parse_size("1.5k") == 1536


def test_cli_packs_and_rejects_bad_input(tmp_path, capsys):
    _results(tmp_path / "runs")
    out = tmp_path / "o" / "r.tar.xz"
    assert main(["pack", str(tmp_path / "runs"), "--out", str(out), "--part-size", "4K"]) == 0
    printed = capsys.readouterr().out
    assert f"join with: cat {out}.part* > {out}" in printed and "file(s)" in printed

    cases = [
        (["pack", str(tmp_path / "none"), "--out", str(tmp_path / "x.tar.xz")], "no such results folder"),
        (["pack", str(tmp_path / "runs"), "--out", str(tmp_path / "x.tar.xz"), "--part-size", "lots"],
         "expected a size such as 15M"),
        (["pack", str(tmp_path / "runs"), "--out", str(tmp_path / "x.tar.xz"), "--part-size", "10"],
         "at least 1K"),
        (["pack", str(tmp_path / "runs"), "--out", str(tmp_path / "runs" / "x.tar.xz")], "outside the folder"),
        (["pack", str(tmp_path / "big"), "--out", str(tmp_path / "x.tar.xz"), "--part-size", "1K"],
         "at most 1000"),
    ]
    (tmp_path / "big").mkdir()
    (tmp_path / "big" / "metrics.jsonl").write_bytes(os.urandom(1100 * 1024))  # > 1000 parts of 1K
    for argv, message in cases:
        assert main(argv) == 2, argv
        err = capsys.readouterr().err
        assert message in err and err.count("\n") == 1, err
    (tmp_path / "empty" / "data").mkdir(parents=True)
    (tmp_path / "empty" / "data" / "x.jsonl").write_text("{}\n")
    assert main(["pack", str(tmp_path / "empty"), "--out", str(tmp_path / "e.tar.xz")]) == 2
    assert "nothing to pack" in capsys.readouterr().err
    assert not list(tmp_path.glob("*.tar.xz*")) and not list(tmp_path.glob(".*.tmp"))


@pytest.mark.parametrize("name", ["run[1].tar.xz", "a*b.tar.xz"])
def test_stale_parts_are_found_under_names_with_glob_characters(tmp_path, name):
    _results(tmp_path / "runs")
    out = tmp_path / "o" / name
    assert len(pack(tmp_path / "runs", out, part_size=2048)) >= 3
    pack(tmp_path / "runs", out, part_size=2**20)
    assert sorted(p.name for p in out.parent.iterdir()) == [f"{name}.part000"]
