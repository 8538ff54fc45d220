"""What a new user met on a fresh clone (issue 61, "tried as a new user would"), each as it
must be now: overrides anywhere on the command line, the model card's accuracy as eval.json
holds it, the container's cache inside its mounted volume, `iga-ds report` printing the table
it writes, Ctrl-C stopping like SIGTERM, a rerun that finds no checkpoint saying so."""
from __future__ import annotations

import json
import re
import shlex
import signal
from pathlib import Path

import pytest
import yaml

from iga_ds.cli import build_parser, main

REPO = Path(__file__).resolve().parents[2]
TINY_CPU = str(REPO / "configs" / "tiny_cpu.yaml")


# -- KEY=VALUE overrides anywhere ------------------------------------------------------------------


def test_overrides_stand_anywhere_on_the_command_line(tmp_path, capsys):
    """Before, between and after options, in their order (the later of two settings of a key
    wins); it failed with a bare "unrecognized arguments" for any override after an option."""
    out = tmp_path / "x"
    words = ["train", "--config", TINY_CPU, "schedule.max_steps=3", "--dry-run", f"output_dir={out}",
             "--world-size", "1", "seed=5", "schedule.max_steps=4"]
    args = build_parser().parse_args(words)
    assert args.overrides == ["schedule.max_steps=3", f"output_dir={out}", "seed=5", "schedule.max_steps=4"]
    assert args.dry_run and args.world_size == 1 and args.config == TINY_CPU
    assert main(words) == 0
    resolved = yaml.safe_load(capsys.readouterr().out)
    assert (resolved["output_dir"], resolved["seed"], resolved["schedule"]["max_steps"]) == (str(out), 5, 4)


@pytest.mark.parametrize("stray", ["stray", "--bogus", "--bogus=1"])
def test_a_word_that_is_no_override_is_still_refused_in_one_line(stray, capsys):
    with pytest.raises(SystemExit) as done:
        main(["train", "--config", TINY_CPU, "seed=1", "--dry-run", stray, "seed=2"])
    err = capsys.readouterr().err
    assert done.value.code == 2 and err == f"iga-ds: error: unrecognized arguments: {stray} (see 'iga-ds --help')\n"


# -- the model card's accuracy ---------------------------------------------------------------------


def _eval_json(out: Path, outputs: dict[str, tuple[str, str]]) -> dict:
    """eval.json as `iga-ds eval` writes it (iga_ds.evaluation.runner.evaluate), every
    generation already in its partial file, so that no model is needed: ``outputs`` maps an
    item id to (its split, the model's text); every gold answer is 7."""
    from iga_ds.data.benchmarks.base import EvalItem
    from iga_ds.evaluation.runner import evaluate, partial_path

    items = [EvalItem(id=i, benchmark="synthetic", problem=f"problem {i}", answer="7", kind="number",
                      domain="math", split=split) for i, (split, _) in outputs.items()]
    settings = {"benchmark": "synthetic"}
    lines = [{"settings": settings}] + [{"id": i, "output": text} for i, (_, text) in outputs.items()]
    partial_path(out).write_text("".join(json.dumps(x, sort_keys=True) + "\n" for x in lines), encoding="utf-8")
    return evaluate(items, None, None, out, settings, lambda record: record["problem"], progress=False)


def test_the_model_card_shows_the_accuracy_eval_json_holds(tmp_path):
    """4 of 6 right (ID 3 of 4, OOD 1 of 2): the card says 66.7, 75.0 and 50.0 %; it said 100
    times that (eval.json holds percentages already)."""
    from iga_ds.train.model_card import model_card, run_facts

    run = tmp_path / "run"
    run.mkdir()
    (run / "config.resolved.yaml").write_text(yaml.safe_dump({"method": {"name": "iga"},
                                                              "resolved": {"total_steps": 3}}))
    right, wrong = "Answer: 7", "Answer: 8"
    result = _eval_json(run / "eval.json", {"a": ("id", right), "b": ("id", right), "c": ("id", right),
                                            "d": ("id", wrong), "e": ("ood", right), "f": ("ood", wrong)})
    assert result["n_scored"] == 6
    for merged in (False, True):
        card = model_card(run_facts(run, "builtin:tiny"), merged=merged)
        assert "| synthetic | 66.7 | 75.0 | 50.0 | 6 |" in card, card


# -- the container's cache -------------------------------------------------------------------------


def _docker_run_commands() -> list[tuple[str, list[str]]]:
    """Every `docker run` line the project shows (README, docs/DOCKER.md, the Dockerfile's
    header), continuation lines joined, as (where, words)."""
    found = []
    for path in (REPO / "README.md", REPO / "docs" / "DOCKER.md", REPO / "Dockerfile"):
        text = re.sub(r"\\\n[#\s]*", " ", path.read_text(encoding="utf-8"))
        for line in text.splitlines():
            line = line.lstrip("#").strip()
            if line.startswith("docker run "):
                found.append((path.name, shlex.split(line)))
    return found


def _option_values(words: list[str], option: str) -> list[str]:
    return [words[i + 1] for i, word in enumerate(words[:-1]) if word == option]


def test_the_documented_docker_run_keeps_the_iga_ds_cache_in_its_mounted_volume(monkeypatch):
    """In the container of each documented `docker run` (its -e variables, a home of its own),
    iga-ds's cache folder lies inside a -v mount: the line set XDG_CACHE_HOME=/cache while the
    code read only IGA_DS_CACHE, so the cache went to the container's home and was lost."""
    from iga_ds.models import cache_root

    commands = _docker_run_commands()
    assert {where for where, _ in commands} == {"README.md", "DOCKER.md", "Dockerfile"}
    for where, words in commands:
        mounts = [Path(v.split(":")[1]) for v in _option_values(words, "-v")]
        for name in ("IGA_DS_CACHE", "XDG_CACHE_HOME"):
            monkeypatch.delenv(name, raising=False)
        monkeypatch.setenv("HOME", "/home/nobody-in-the-container")
        for pair in _option_values(words, "-e"):
            monkeypatch.setenv(*pair.split("=", 1))
        root = cache_root()
        assert any(root.is_relative_to(m) for m in mounts), (where, root, mounts)


def test_the_cache_folder_follows_iga_ds_cache_then_xdg_cache_home_then_home(monkeypatch, tmp_path):
    from iga_ds.models import cache_root

    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.delenv("XDG_CACHE_HOME", raising=False)
    monkeypatch.delenv("IGA_DS_CACHE", raising=False)
    assert cache_root() == tmp_path / "home" / ".cache" / "iga-ds"
    monkeypatch.setenv("XDG_CACHE_HOME", "relative/cache")  # the XDG rule: ignored
    assert cache_root() == tmp_path / "home" / ".cache" / "iga-ds"
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert cache_root() == tmp_path / "xdg" / "iga-ds"
    monkeypatch.setenv("IGA_DS_CACHE", str(tmp_path / "mine"))
    assert cache_root() == tmp_path / "mine"


# -- `iga-ds report` prints the table it writes ----------------------------------------------------


def _table_rows(markdown_text: str, first_cell: str) -> list[str]:
    """The cells of the Markdown table row that starts with ``first_cell``."""
    line = next(x for x in markdown_text.splitlines() if x.startswith(f"| {first_cell} |"))
    return [c.strip() for c in line.strip("|").split("|")]


def test_report_of_the_demo_folder_prints_its_table(tmp_path, capsys):
    """The figures results.json holds, on the lines the command prints, as report.md has them;
    it printed only "wrote demo_out/report.md"."""
    demo = tmp_path / "demo_out"
    demo.mkdir()
    rows = [{"method": "erm", "id_accuracy": 50.0, "ood_accuracy": 42.5, "delta_gap": 7.5, "final_loss": 0.61,
             "train_seconds": 14.2, "eval_seconds": 3.1},
            {"method": "iga", "id_accuracy": 47.5, "ood_accuracy": 45.0, "delta_gap": 2.5, "final_loss": 0.66,
             "train_seconds": 9.4, "eval_seconds": 2.9}]
    (demo / "results.json").write_text(json.dumps({"settings": {"steps": 50}, "rows": rows, "total_seconds": 31.0}))
    assert main(["report", str(demo), "--no-figures"]) == 0
    printed = capsys.readouterr().out.splitlines()
    assert printed[-1] == f"wrote {demo / 'report.md'}"
    report = (demo / "report.md").read_text(encoding="utf-8")
    for row in rows:
        line = next(x.split() for x in printed if x.split()[:1] == [row["method"]])
        assert line[1:4] == [f"{row[k]:.1f}" for k in ("id_accuracy", "ood_accuracy", "delta_gap")], line
        assert line == [c for c in _table_rows(report, row["method"]) if c], line  # ("–": no cue data)
    header = next(x for x in printed if x.startswith("Method"))
    assert header.split()[:3] == ["Method", "acc", "ID"]


def test_the_table_printed_for_a_grid_is_its_main_results():
    from iga_ds.experiments.report import headline_table

    text = (REPO / "results" / "shift-smollm2" / "report.md").read_text(encoding="utf-8")
    section = text.split("## Main results", 1)[1].split("\n## ", 1)[0]
    want = [line for line in section.splitlines() if line.startswith("|")]
    assert headline_table(text).splitlines() == want and len(want) > 3


# -- Ctrl-C, and a rerun with nothing to resume ----------------------------------------------------


def test_ctrl_c_asks_for_the_same_stop_as_sigterm():
    """SIGINT (Ctrl-C) only raises the stop flag, as SIGTERM does: the trainer then saves a
    checkpoint and says "rerun with resume: auto" (tests/train/test_train_processes.py, SIGTERM). It
    raised KeyboardInterrupt mid-step instead, and nothing was saved."""
    from iga_ds.train.checkpoint import StopSignal

    seen = []
    before = signal.signal(signal.SIGINT, lambda *_: seen.append("the old handler"))  # never pytest's
    try:
        stop = StopSignal(None).install()
        signal.raise_signal(signal.SIGINT)
        stop.uninstall()
        assert stop.received == signal.SIGINT and not seen
        assert stop.requested() and stop.reason == "SIGINT"
        # a second Ctrl-C while the stop is pending: out at once
        stop = StopSignal(None).install()
        signal.raise_signal(signal.SIGINT)
        with pytest.raises(KeyboardInterrupt):
            signal.raise_signal(signal.SIGINT)
        stop.uninstall()
    finally:
        signal.signal(signal.SIGINT, before)


@pytest.mark.slow
def test_a_rerun_that_finds_no_checkpoint_says_so(tmp_path, capsys):
    """A run stopped before its first checkpoint (Ctrl-C, a kill) leaves its resolved config and
    no checkpoint: the rerun (resume: auto) says that it starts at step 0, and why."""
    from test_train_support import run_config_dict, tiny_base, write_isomer_jsonl

    from iga_ds.config.run import config_from_dict
    from iga_ds.train.trainer import Trainer

    data = write_isomer_jsonl(tmp_path / "train.jsonl", groups=2)
    base = tiny_base(tmp_path, data)
    out = tmp_path / "run"
    out.mkdir()
    (out / "config.resolved.yaml").write_text("seed: 3\n")  # what the stopped run had written
    raw = run_config_dict(tmp_path, data, output_dir=str(out), **{"schedule.max_steps": 1})
    result = Trainer(config_from_dict(raw), base_model_dir=str(base)).run()
    assert result.status == "completed" and result.step == 1
    assert f"no checkpoint in {out / 'checkpoints'} to resume; starting at step 0" in capsys.readouterr().out


def test_the_launcher_script_takes_overrides_anywhere(capsys):
    """launch/train.py (the deepspeed launcher's entry) reads KEY=VALUE words between options too."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("launch_train", Path(__file__).resolve().parents[2] / "launch" /
                                                  "train.py")
    launch = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(launch)
    code = launch.main(["--config", str(REPO / "configs" / "tiny_cpu.yaml"), "schedule.max_steps=3", "--dry-run",
                        "output_dir=runs/launcher_x"])
    out = capsys.readouterr().out
    assert code == 0 and re.search(r"^\s+max_steps: 3$", out, re.M) and "output_dir: runs/launcher_x" in out, out


def test_a_rerun_of_a_finished_run_says_it_is_complete():
    from iga_ds.train.cli import result_line
    from iga_ds.train.trainer import TrainResult

    done = TrainResult("completed", 10, 10, Path("runs/x"), Path("runs/x/adapter"), 1.0)
    assert result_line(done).startswith("already complete: all 10 steps ran before; nothing trained")
    done.history = [{"step": 10}]
    assert result_line(done).startswith("done: 10 steps")
