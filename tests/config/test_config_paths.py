"""Paths in a config file are relative to that file's folder (then to the working directory where
they exist only there); paths on the command line are relative to the working directory. One
rule for run YAMLs and grid files."""
from __future__ import annotations

from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parents[2]


def _files(folder: Path, *names: str) -> None:
    for name in names:
        path = folder / name
        path.parent.mkdir(parents=True, exist_ok=True)
        if name.endswith("/"):
            path.mkdir(exist_ok=True)
        else:
            path.write_text("{}\n")


def _run_yaml(folder: Path, **keys) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "run.yaml"
    path.write_text(yaml.safe_dump({"output_dir": "out", **keys}))
    return path


def test_the_shipped_tiny_cpu_config_resolves_from_another_working_directory(tmp_path, monkeypatch):
    from iga_ds.config.deepspeed import build_ds_config, load_ds_json
    from iga_ds.config.run import load_run_config

    monkeypatch.chdir(REPO / "configs")  # the config named relative to a working directory beside it
    assert load_run_config("tiny_cpu.yaml").deepspeed == str(REPO / "ds_configs" / "zero2_fp32.json")
    monkeypatch.chdir(tmp_path)
    cfg = load_run_config(REPO / "configs" / "tiny_cpu.yaml")
    assert cfg.deepspeed == str(REPO / "ds_configs" / "zero2_fp32.json")
    assert cfg.data.train == str(REPO / "data" / "synth" / "train.jsonl")
    assert cfg.output_dir == "runs/tiny_cpu"  # an output: relative to the working directory
    ds, hook = build_ds_config(cfg, load_ds_json(cfg.deepspeed), 1, 1, cfg.deepspeed, cpu=True)
    assert hook.method == "iga" and ds["zero_optimization"]["stage"] == 2


def test_every_shipped_run_yaml_names_files_beside_it(tmp_path, monkeypatch):
    from iga_ds.config.run import load_run_config

    monkeypatch.chdir(tmp_path)
    for path in sorted((REPO / "configs").glob("*.yaml")):
        cfg = load_run_config(path)
        assert Path(cfg.deepspeed).is_file() and Path(cfg.deepspeed).parent == REPO / "ds_configs", path.name


def test_relative_paths_are_beside_the_file_that_names_them(tmp_path, monkeypatch):
    from iga_ds.config.run import load_run_config

    conf = tmp_path / "conf"
    _files(conf, "ds.json", "data/train.jsonl", "model/", "tok/")
    run = _run_yaml(conf, deepspeed="ds.json", data={"train": "data/train.jsonl"}, model={"name_or_path": "model"},
                    tokenizer="tok")
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    _files(elsewhere, "ds.json", "data/train.jsonl", "model/", "tok/")  # the same names here lose to the file's
    monkeypatch.chdir(elsewhere)
    cfg = load_run_config(run)
    assert (cfg.deepspeed, cfg.data.train, cfg.model.name_or_path, cfg.tokenizer) == (
        str(conf / "ds.json"), str(conf / "data" / "train.jsonl"), str(conf / "model"), str(conf / "tok"))


def test_a_path_found_only_in_the_working_directory_is_taken_from_there(tmp_path, monkeypatch):
    from iga_ds.config.run import load_run_config

    run = _run_yaml(tmp_path / "conf", deepspeed="ds.json", data={"train": "data/train.jsonl"})
    _files(tmp_path / "conf", "ds.json")
    _files(tmp_path, "data/train.jsonl")  # beside the file: nothing
    monkeypatch.chdir(tmp_path)
    cfg = load_run_config(Path("conf") / "run.yaml")
    assert cfg.deepspeed == str(tmp_path / "conf" / "ds.json")
    assert cfg.data.train == str(tmp_path / "data" / "train.jsonl")
    assert run.is_file()


def test_a_path_found_nowhere_is_reported_beside_the_file(tmp_path, monkeypatch):
    from iga_ds.config.deepspeed import load_ds_json
    from iga_ds.config.run import load_run_config
    from iga_ds.errors import ConfigError

    run = _run_yaml(tmp_path / "conf", deepspeed="missing.json")
    monkeypatch.chdir(tmp_path)
    cfg = load_run_config(run)
    assert cfg.deepspeed == str(tmp_path / "conf" / "missing.json")
    with pytest.raises(ConfigError, match=f"deepspeed: config '{tmp_path / 'conf' / 'missing.json'}' not found"):
        load_ds_json(cfg.deepspeed)


def test_a_model_or_tokenizer_found_nowhere_is_kept_as_written(tmp_path, monkeypatch):
    """It may be a hub id (org/name); a missing data file or DeepSpeed JSON is named beside the file."""
    from iga_ds.config.run import load_run_config

    run = _run_yaml(tmp_path / "conf", model={"name_or_path": "org/name"}, tokenizer="org/tok@v1",
                    data={"train": "data/missing.jsonl"})
    monkeypatch.chdir(tmp_path)
    cfg = load_run_config(run, ["deepspeed=nowhere.json"])
    assert (cfg.model.name_or_path, cfg.tokenizer) == ("org/name", "org/tok@v1")
    assert cfg.data.train == str(tmp_path / "conf" / "data" / "missing.jsonl")
    assert cfg.deepspeed == str(tmp_path / "nowhere.json")
    _files(tmp_path / "conf", "org/name/")  # a folder of that name wins, as in from_pretrained
    assert load_run_config(run).model.name_or_path == str(tmp_path / "conf" / "org" / "name")
    # not the shape of a hub id: a path, named where it was looked for
    assert load_run_config(run, ["model.name_or_path=../models/llama"]).model.name_or_path == \
        str(tmp_path.parent / "models" / "llama")
    run = _run_yaml(tmp_path / "conf", model={"name_or_path": "../models/llama"})
    assert load_run_config(run).model.name_or_path == str(tmp_path / "models" / "llama")


def test_command_line_paths_are_relative_to_the_working_directory(tmp_path, monkeypatch):
    from iga_ds.config.run import load_run_config

    conf = tmp_path / "conf"
    _files(conf, "ds.json", "model/")
    run = _run_yaml(conf, deepspeed="ds.json", model={"name_or_path": "model"})
    _files(tmp_path, "ds.json", "model/", "other/")
    monkeypatch.chdir(tmp_path)
    cfg = load_run_config(run, ["deepspeed=ds.json", "model.dtype=bfloat16"])
    assert cfg.deepspeed == str(tmp_path / "ds.json")  # the override's, from the working directory
    assert cfg.model.name_or_path == str(conf / "model")  # not overridden: still the file's
    cfg = load_run_config(run, ["model={name_or_path: other}", "tokenizer=other"])
    assert cfg.model.name_or_path == str(tmp_path / "other") and cfg.tokenizer == str(tmp_path / "other")
    assert load_run_config(None, ["data.train=d.jsonl"]).data.train == str(tmp_path / "d.jsonl")


def test_absolute_home_and_builtin_paths(tmp_path, monkeypatch):
    from iga_ds.config.run import load_run_config

    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    run = _run_yaml(tmp_path / "conf", deepspeed=str(tmp_path / "x" / ".." / "ds.json"),
                    data={"train": "~/train.jsonl"}, model={"name_or_path": "builtin:tiny"})
    cfg = load_run_config(run)
    assert cfg.deepspeed == str(tmp_path / "ds.json")
    assert cfg.data.train == str(tmp_path / "home" / "train.jsonl")
    assert cfg.model.name_or_path == "builtin:tiny" and cfg.tokenizer is None


def test_without_a_deepspeed_key_the_shipped_fp32_config_is_used(tmp_path, monkeypatch):
    from iga_ds.config.run import RunConfig, load_run_config

    monkeypatch.chdir(tmp_path)
    cfg = load_run_config(_run_yaml(tmp_path / "conf"))
    assert Path(cfg.deepspeed).read_bytes() == (REPO / "ds_configs" / "zero2_fp32.json").read_bytes()
    assert RunConfig().deepspeed == cfg.deepspeed
    assert load_run_config(_run_yaml(tmp_path / "conf2", deepspeed=None)).deepspeed == cfg.deepspeed


def test_grid_files_follow_the_same_rule(tmp_path, monkeypatch):
    from iga_ds.experiments.grid import Cell, cell_run_dict, load_grid

    runs, grids = tmp_path / "runs", tmp_path / "grids"
    _files(runs, "zero2.json", "base/")
    _run_yaml(runs, deepspeed="zero2.json", model={"name_or_path": "base"})
    _files(grids, "tok/", "variant.json", "bench/")
    _files(tmp_path, "data/train.jsonl")  # only in the working directory
    grid = grids / "grid.yaml"
    grid.write_text(yaml.safe_dump({
        "train_config": "../runs/run.yaml",
        "train": {"tokenizer": "tok"},
        "data": {"train": "data/train.jsonl"},
        "benchmarks": [{"benchmark": "reclor", "dir": "bench"}],
        "methods": {"erm": {}, "iga": {"train": {"deepspeed": "variant.json"}}},
    }))
    monkeypatch.chdir(tmp_path)
    g = load_grid(Path("grids") / "grid.yaml")
    assert g.run["deepspeed"] == str(runs / "zero2.json")  # the run YAML's: beside the run YAML
    assert g.run["model"]["name_or_path"] == str(runs / "base")
    assert g.run["tokenizer"] == str(grids / "tok")  # the grid's own: beside the grid
    assert g.data["train"] == str(tmp_path / "data" / "train.jsonl")  # found only in the working directory
    assert g.benchmarks[0]["dir"] == str(grids / "bench")
    iga = next(v for v in g.variants if v.key == "iga")
    assert cell_run_dict(g, Cell(iga, 0), tmp_path / "cell", "d.jsonl")["deepspeed"] == str(grids / "variant.json")


def test_a_grid_without_deepspeed_gets_the_packaged_config(tmp_path):
    from iga_ds.config.run import shipped_file
    from iga_ds.experiments.grid import cell_run_dict, load_grid

    grid = tmp_path / "grid.yaml"
    grid.write_text(yaml.safe_dump({"data": {"synthetic": {"groups": 4}}, "methods": {"erm": {}}}))
    g = load_grid(grid)
    out = tmp_path / "out"
    run = cell_run_dict(g, g.cells()[0], out / "cell", "d.jsonl", out=out)
    assert run["deepspeed"] == shipped_file("ds_configs/zero2_fp32.json")
    assert not out.exists()  # nothing written: the packaged file is used as it is
