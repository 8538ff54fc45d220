"""Progress: a bar on a terminal, a few plain lines in a log, nothing when off (iga_ds.progress)."""
from __future__ import annotations

import io

import pytest

from iga_ds import progress as progress_module
from iga_ds.progress import BarProgress, LineProgress, Progress, clock, progress


class FakeTerminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_a_log_gets_a_line_per_tenth_not_a_redraw_per_update():
    log = io.StringIO()
    with progress(1000, "train erm", "step", stream=log) as bar:
        assert isinstance(bar, LineProgress)
        for _ in range(1000):
            bar.update(1)
            bar.set_postfix(loss="0.123")
    lines = log.getvalue().splitlines()
    assert len(lines) == 10, lines  # 10%, 20%, ..., 100%; close adds none after 100%
    assert "\r" not in log.getvalue()
    assert lines[0].startswith("train erm: 100/1000 step (10%), ") and lines[0].endswith(", loss=0.123")
    assert lines[-1].startswith("train erm: 1000/1000 step (100%)")


def test_a_log_also_gets_a_line_every_30_seconds(monkeypatch):
    now = [0.0]
    monkeypatch.setattr(progress_module.time, "monotonic", lambda: now[0])
    log = io.StringIO()
    bar = progress(10_000, "generating", "prompt", stream=log)
    for _ in range(5):  # 5 updates, 31 s apart, far below a tenth of the total
        now[0] += 31.0
        bar.update(1)
    assert len(log.getvalue().splitlines()) == 5
    bar.close()  # nothing new since the last line
    assert len(log.getvalue().splitlines()) == 5
    assert "generating: 5/10000 prompt (0%), 2:35 elapsed" in log.getvalue()


def test_a_loop_that_ends_early_gets_a_last_line_and_a_resumed_one_counts_from_its_start():
    log = io.StringIO()
    bar = progress(100, "build", "seed", initial=40, stream=log)
    bar.update(3)  # 43%: still in the fifth tenth, where it started
    assert log.getvalue() == ""
    bar.close()
    assert log.getvalue().startswith("build: 43/100 seed (43%)")


def test_a_terminal_gets_a_bar():
    term = FakeTerminal()
    bar = progress(50, "pretrain tiny base", "step", stream=term)
    assert isinstance(bar, BarProgress)
    for _ in range(50):
        bar.update(1)
    bar.set_postfix(loss="1.000")
    bar.close()
    text = term.getvalue()
    assert "\r" in text and "pretrain tiny base" in text and "50/50" in text and "|" in text


@pytest.mark.parametrize("stream", [io.StringIO(), FakeTerminal()], ids=["log", "terminal"])
def test_disabled_writes_nothing(stream, capsys):
    with progress(1000, "train", "step", enabled=False, stream=stream) as bar:
        assert type(bar) is Progress
        for _ in range(1000):
            bar.update(1)
        bar.set_postfix(loss=1.0)
    assert bar.n == 1000
    assert stream.getvalue() == ""
    assert capsys.readouterr() == ("", "")


def test_the_default_stream_is_stderr_at_call_time(capsys):
    with progress(2, "synth", "group") as bar:
        bar.update(2)
    err = capsys.readouterr().err
    assert err.splitlines() == [err.splitlines()[0]] and err.startswith("synth: 2/2 group (100%)")


def test_without_a_total_only_time_makes_a_line():
    log = io.StringIO()
    with progress(None, "hidden states", "text", stream=log) as bar:
        for _ in range(1000):
            bar.update(1)
    assert log.getvalue().splitlines() == [log.getvalue().splitlines()[0]]  # the last line only
    assert log.getvalue().startswith("hidden states: 1000 text, ")


def test_clock():
    assert clock(5) == "0:05" and clock(75.4) == "1:15" and clock(3725) == "1:02:05"


@pytest.mark.parametrize("flags, shown", [([], True), (["--quiet"], False)], ids=["default", "quiet"])
def test_demo_quiet_turns_progress_off(flags, shown, tmp_path, monkeypatch):
    from iga_ds.cli import main

    calls = []
    monkeypatch.setattr("iga_ds.experiments.demo.run_demo", lambda out, **kw: calls.append(kw))
    assert main(["demo", "--out", str(tmp_path / "demo"), *flags]) == 0
    assert calls[0]["progress"] is shown


def test_the_demo_says_how_to_reach_iga_ds(monkeypatch):
    from iga_ds.experiments.demo import path_hint

    monkeypatch.setattr("shutil.which", lambda name: None)
    assert "pip install -e ." in path_hint() and "iga-ds" in path_hint()
    monkeypatch.setattr("shutil.which", lambda name: "/somewhere/bin/iga-ds")
    assert path_hint().startswith("next: iga-ds --help")
