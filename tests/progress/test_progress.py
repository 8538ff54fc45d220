"""Progress: a bar on a terminal, a few plain lines in a log, nothing when off (iga_ds.progress)."""
from __future__ import annotations

import io
import re

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


def _shown(log: str) -> list[tuple[int, str | None]]:
    """(count, the loss shown beside it or None) of each plain line."""
    out = []
    for line in log.splitlines():
        loss = re.search(r"loss=([\d.]+)", line)
        out.append((int(re.search(r": (\d+)/", line).group(1)), loss.group(1) if loss else None))
    return out


@pytest.mark.parametrize("total", [20, 10])
def test_each_line_shows_the_figures_of_the_update_it_counts(total):
    """The trainer's order (tqdm's): update, then that step's loss. A line shows the loss of the
    step it counts (it showed the previous step's); only a loop's first update, before it has
    shown any figure, has none to wait for."""
    losses = [f"{1.0 / (step + 2):.4f}" for step in range(total)]  # a different loss each step
    log = io.StringIO()
    with progress(total, "train iga", "step", stream=log) as bar:
        for loss in losses:
            bar.update(1)
            bar.set_postfix(loss=loss)
    shown = _shown(log.getvalue())
    assert [count for count, _ in shown] == list(range(total // 10, total + 1, total // 10))
    want = [(count, losses[count - 1]) for count, _ in shown]
    if total == 10:  # the first update is the first line: no figure yet
        want[0] = (1, None)
    assert shown == want


def test_a_loop_without_figures_writes_each_line_at_its_update(monkeypatch):
    """No figures: nothing waits (a slow loop's log stays current)."""
    log = io.StringIO()
    bar = progress(10, "diagnose", "method", stream=log)
    for done in range(1, 11):
        bar.update(1)
        assert len(log.getvalue().splitlines()) == done  # written before the next update comes
    bar.close()
    assert len(log.getvalue().splitlines()) == 10


def test_figures_that_never_come_leave_the_line_as_it_stood_and_refresh_is_no_figure():
    log = io.StringIO()
    with progress(4, "build", "seed", stream=log) as bar:
        bar.update(1)
        bar.set_postfix(kept=1, refresh=False)  # tqdm's keyword: not shown
        bar.update(1)  # due, waits for figures that do not come this time
        bar.update(2)
    lines = log.getvalue().splitlines()
    assert [c for c, _ in _shown(log.getvalue())] == [1, 2, 4], lines
    assert lines[1].endswith(", kept=1") and "refresh" not in log.getvalue(), lines
    term = FakeTerminal()
    bar = progress(3, "build", "seed", stream=term)
    bar.update(3)
    bar.set_postfix(kept=3, refresh=False)
    bar.close()
    assert "kept=3" in term.getvalue() and "refresh" not in term.getvalue()
