"""tools/profile_train_step.py on the CPU: the real trainer on a grid's cells, under torch.profiler."""
from __future__ import annotations

import yaml

import profile_train_step  # tools/ is on the path: pytest's pythonpath option (pyproject.toml)
from test_train_support import tiny_base, write_isomer_jsonl


def tiny_grid(tmp_path, methods: dict):
    """A grid of the tiny base on a small synthetic benchmark, with these methods."""
    data = write_isomer_jsonl(tmp_path / "fixture.jsonl", groups=4, seed=4)
    grid = tmp_path / "grid.yaml"
    grid.write_text(yaml.safe_dump({
        "train": {"model": {"name_or_path": str(tiny_base(tmp_path, data))}, "lora": {"r": 4, "alpha": 8},
                  "data": {"groups_per_step": 2, "groups_per_micro_batch": 1, "max_length": 96}},
        "data": {"synthetic": {"groups": 20, "seed": 1, "shortcut": 1.0, "id_groups": 2, "ood_groups": 2}},
        "methods": methods,
    }))
    return grid


def test_device_busy_time_is_read_from_the_profilers_own_total():
    table = "...\nSelf CPU time total: 2.107s\nSelf CUDA time total: 106.627ms\n"
    assert profile_train_step.device_busy_ms(table) == 106.627
    assert profile_train_step.device_busy_ms("Self CUDA time total: 1.5s") == 1500.0
    assert profile_train_step.device_busy_ms("Self device time total: 250us") == 0.25
    assert profile_train_step.device_busy_ms("Self CPU time total: 2.107s") == 0.0  # a CPU-only profile


def test_it_profiles_each_cell_with_its_own_run_config(tmp_path, capsys):
    grid = tiny_grid(tmp_path, {"erm": {}, "cot_distill": {"method": "erm", "grouping": "none"}})
    out = tmp_path / "out"
    rc = profile_train_step.main(["--grid", str(grid), "--out", str(out), "--methods", "erm,cot_distill",
                                  "--steps", "5", "--warmup", "2", "--active", "2", "--top", "3",
                                  "--set", "model.attn_implementation=sdpa"])
    assert rc == 0
    text = capsys.readouterr().out
    assert "card: CPU" in text and "model.attn_implementation=sdpa" in text
    rows = {line.split("|")[1].strip(): line.split("|")[2].strip() for line in text.splitlines()
            if line.startswith("| ") and "---" not in line and "method" not in line}
    assert set(rows) == {"erm", "cot_distill"} and all(float(ms) > 0 for ms in rows.values())
    for key, domains in (("erm", None), ("cot_distill", ["pooled"])):  # CoT-Distill: single instances, one pool
        resolved = yaml.safe_load((out / f"profile-{key}" / "config.resolved.yaml").read_text())
        assert resolved["model"]["attn_implementation"] == "sdpa" and resolved["schedule"]["max_steps"] == 5
        assert resolved["data"]["domains"] == domains


def test_python_profile_names_the_trainers_functions(tmp_path, capsys):
    grid = tiny_grid(tmp_path, {"iga": {}})
    rc = profile_train_step.main(["--grid", str(grid), "--out", str(tmp_path / "out"), "--methods", "iga",
                                  "--steps", "5", "--warmup", "2", "--active", "2", "--top", "400",
                                  "--python-profile"])
    assert rc == 0
    text = capsys.readouterr().out
    assert "## iga: Python functions by host time over 2 steps" in text
    assert "### sorted by tottime" in text and "### sorted by cumulative" in text
    # the profiled window holds the steps' own work: the trainer's step, the capture's backward
    assert "(train_step)" in text and "(backward)" in text
