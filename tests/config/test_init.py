"""The shipped configs in the installed package: a wheel carries configs/ and ds_configs/,
`iga-ds init DIR` writes them out (atomically, never over a file unless --force), and what it
writes resolves from any working directory."""
from __future__ import annotations

import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def repo_configs() -> list[str]:
    """The repository's shipped configs, as paths relative to the repository root."""
    patterns = ("configs/*.yaml", "configs/experiments/*.yaml", "ds_configs/*.json")
    return sorted(p.relative_to(REPO).as_posix() for pattern in patterns for p in REPO.glob(pattern))


def test_the_package_ships_every_config_of_the_repository_and_only_one_copy():
    from iga_ds.config.run import SHIPPED, shipped_names

    names = shipped_names()
    assert names == repo_configs() and {"configs/tiny_cpu.yaml", "ds_configs/zero2_fp32.json"} <= set(names)
    for name in names:  # in a checkout, the package's files are the repository's (one copy)
        assert (SHIPPED / name).resolve() == (REPO / name).resolve(), name


def test_default_ds_config_is_the_packaged_file():
    from iga_ds.config.deepspeed import default_ds_config

    path = default_ds_config()
    assert Path(path).read_bytes() == (REPO / "ds_configs" / "zero2_fp32.json").read_bytes()


def test_a_wheel_built_from_the_repository_carries_the_configs(tmp_path):
    """`pip wheel` on a copy of the sources (the build leaves nothing in the checkout)."""
    src = tmp_path / "src"
    src.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy2(REPO / name, src / name)
    for name in ("iga_ds", "configs", "ds_configs"):
        shutil.copytree(REPO / name, src / name, symlinks=True, ignore=shutil.ignore_patterns("__pycache__"))
    out = tmp_path / "wheel"
    build = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", ".",
                            "-w", str(out)], cwd=src, capture_output=True, text=True, timeout=600)
    assert build.returncode == 0, build.stderr[-3000:]
    [wheel] = out.glob("iga_ds-*.whl")
    with zipfile.ZipFile(wheel) as zf:
        shipped = {n.split("iga_ds/config/shipped/", 1)[1]: zf.read(n) for n in zf.namelist()
                   if n.startswith("iga_ds/config/shipped/")}
        assert "iga_ds/data/templates/dag_extraction.txt" in zf.namelist()  # the package data already there
    assert sorted(shipped) == repo_configs()
    for name, data in shipped.items():
        assert data == (REPO / name).read_bytes(), name


def test_init_writes_configs_that_resolve_from_anywhere(tmp_path, monkeypatch, capsys):
    from iga_ds.cli import main
    from iga_ds.config.deepspeed import build_ds_config, load_ds_json
    from iga_ds.config.run import load_run_config
    from iga_ds.train.batching import check_batch_layout

    target = tmp_path / "mine"
    assert main(["init", str(target)]) == 0
    assert f"wrote {len(repo_configs())} files" in capsys.readouterr().out
    written = sorted(p.relative_to(target).as_posix() for p in target.rglob("*") if p.is_file())
    assert written == repo_configs()
    for name in written:
        assert (target / name).read_bytes() == (REPO / name).read_bytes(), name
    monkeypatch.chdir(tmp_path)
    cfg = load_run_config(target / "configs" / "tiny_cpu.yaml")
    assert cfg.deepspeed == str(target / "ds_configs" / "zero2_fp32.json")  # the written copy, not the package's
    assert cfg.data.train == str(target / "data" / "synth" / "train.jsonl")
    accum = check_batch_layout(cfg.data.groups_per_step, cfg.data.groups_per_micro_batch, 1)
    ds, hook = build_ds_config(cfg, load_ds_json(cfg.deepspeed), 1, accum, cfg.deepspeed, cpu=True,
                               run_source=cfg.source)
    assert hook.method == "iga" and ds["train_batch_size"] == 16


def test_init_never_overwrites_without_force_and_writes_nothing_then(tmp_path, capsys):
    from iga_ds.cli import main

    target = tmp_path / "mine"
    assert main(["init", str(target)]) == 0
    mine = target / "configs" / "tiny_cpu.yaml"
    mine.write_text("output_dir: edited\n")
    (target / "ds_configs" / "zero2.json").unlink()
    capsys.readouterr()
    assert main(["init", str(target)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"iga-ds: error: {target / 'configs'}") and "pass --force to overwrite (nothing was " \
        "written)" in err and "\n" not in err
    assert mine.read_text() == "output_dir: edited\n" and not (target / "ds_configs" / "zero2.json").exists()
    assert main(["init", "--force", str(target)]) == 0
    assert mine.read_bytes() == (REPO / "configs" / "tiny_cpu.yaml").read_bytes()
    assert (target / "ds_configs" / "zero2.json").is_file()
    assert not [p for p in target.rglob("*.tmp")]  # atomic writes leave no temporaries


def test_init_into_a_file_is_an_error(tmp_path, capsys):
    from iga_ds.cli import main

    (tmp_path / "file").write_text("x")
    assert main(["init", str(tmp_path / "file")]) == 2
    assert capsys.readouterr().err.strip() == f"iga-ds: error: {tmp_path / 'file'}: exists and is not a folder"
