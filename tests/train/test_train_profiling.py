"""logging.profile_steps: torch.profiler over a window of optimizer steps (iga_ds.train.profiling),
alone on a tiny torch model, and in ``iga-ds train`` on the tiny CPU setup."""
from __future__ import annotations

import json

import torch
import yaml

from iga_ds.train.profiling import PROFILE_JSON, PROFILE_TXT, StepProfiler
from test_train_support import run_config_dict, tiny_base, write_isomer_jsonl


def _loop(profiler: StepProfiler, steps: int) -> None:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(steps):
        with profiler.step(step):
            model(torch.randn(8, 16)).square().mean().backward()
            opt.step()
            opt.zero_grad()
    profiler.finish()


def test_a_window_of_steps_is_profiled_into_json_and_a_table(tmp_path):
    profiler = StepProfiler(tmp_path / "out", steps=2, after=1)
    _loop(profiler, 5)
    report = json.loads((tmp_path / "out" / PROFILE_JSON).read_text())
    assert report["steps"] == 2 and (report["first_step"], report["last_step"]) == (2, 3)  # 1-based, as metrics
    assert report["wall_s"] > 0 and report["device_busy_ms"] == 0.0 and report["device"] == "cpu"
    ops = {row["name"]: row for row in report["ops"]}
    linear = [name for name in ("aten::addmm", "aten::mm") if name in ops]
    assert linear and all(ops[name]["count"] >= 2 for name in linear)  # two steps' forward (and backward)
    assert {"name", "count", "self_cpu_time_us", "cpu_time_total_us", "self_device_time_us",
            "device_time_total_us"} <= set(report["ops"][0])
    assert [r["self_cpu_time_us"] for r in report["ops"]] == sorted((r["self_cpu_time_us"] for r in report["ops"]),
                                                                    reverse=True)
    text = (tmp_path / "out" / PROFILE_TXT).read_text()
    assert text.startswith("# 2 optimizer steps profiled (steps 2-3, cpu): wall ")
    assert "aten::" in text and "Self CPU time total" in text
    assert profiler.paths == (tmp_path / "out" / PROFILE_JSON, tmp_path / "out" / PROFILE_TXT)


def test_a_window_past_the_loops_end_profiles_what_there_is(tmp_path):
    _loop(StepProfiler(tmp_path, steps=10, after=2), 4)  # steps 2 and 3 of the window's ten
    report = json.loads((tmp_path / PROFILE_JSON).read_text())
    assert report["steps"] == 2 and report["last_step"] == 4
    assert (tmp_path / PROFILE_TXT).read_text().startswith("# 2 optimizer steps profiled")


def test_no_profile_outside_the_window_off_rank_zero_or_with_zero_steps(tmp_path):
    notes: list[str] = []
    for name, profiler in {
        "resumed_past": StepProfiler(tmp_path / "a", 2, 1, log=notes.append, start_step=3, total_steps=6),
        "run_too_short": StepProfiler(tmp_path / "b", 2, 5, log=notes.append, total_steps=5),
        "other_rank": StepProfiler(tmp_path / "c", 2, 1, active=False),
        "zero_steps": StepProfiler(tmp_path / "d", 0, 1),
    }.items():
        _loop(profiler, 6)
        assert profiler.paths is None and not list(tmp_path.glob("*/profile.*")), name
    assert notes == ["profile: nothing profiled: this run starts at step 3, the window is steps 2-3",
                     "profile: nothing profiled: this run has 5 steps, the window is steps 6-7"]


def test_iga_ds_train_writes_the_profile_of_its_steps(tmp_path):
    from iga_ds.cli import main

    data = write_isomer_jsonl(tmp_path / "train.jsonl", groups=4, seed=4)
    base = tiny_base(tmp_path, data)
    cfg = run_config_dict(tmp_path, data, **{"model.name_or_path": str(base), "schedule.max_steps": 3,
                                             "logging.profile_steps": 2, "logging.profile_after": 1,
                                             "logging.tensorboard": False})
    (tmp_path / "run.yaml").write_text(yaml.safe_dump(cfg))
    assert main(["train", "--config", str(tmp_path / "run.yaml")]) == 0
    report = json.loads((tmp_path / "run" / PROFILE_JSON).read_text())
    assert report["steps"] == 2 and (report["first_step"], report["last_step"]) == (2, 3)
    assert any(row["name"] in ("aten::mm", "aten::addmm") for row in report["ops"])
    assert (tmp_path / "run" / PROFILE_TXT).read_text().startswith("# 2 optimizer steps profiled (steps 2-3")
