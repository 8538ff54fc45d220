"""launch/grid_parallel.sh's scheduling, against a stand-in for `iga-ds experiment` that keeps
each cell's state in a file: the order cells start in, the JOBS limit, LAUNCH_FOR, and rows
released by their own selection choice. The real program runs through the script in
tests/experiments/test_experiment_run.py."""
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]

# Cells: selection candidates a_lr1, a_lr2 (row a), b_lr1 (row b); cells a-s0, a-s1, b-s0.
# A candidate's run also writes the choice of its row once all of the row's candidates are done,
# as `iga-ds experiment --only selection/...` does; CHOOSE_NEVER leaves that to the script's
# final `--only 'selection/*'`.
FAKE = textwrap.dedent("""\
    import fnmatch, json, os, sys, time
    from pathlib import Path
    args = sys.argv[1:]
    out = Path(args[args.index("--out") + 1])
    rows = {"a": ["selection/a_lr1", "selection/a_lr2"], "b": ["selection/b_lr1"]}
    cells = {"a-s0": "a", "a-s1": "a", "b-s0": "b"}
    seconds = json.loads(os.environ["FAKE_SECONDS"])
    def done(name): return (out / "done" / name.replace("/", "_")).is_file()
    def chosen(row): return (out / "chosen" / row).is_file()
    def choose():
        for row, cands in rows.items():
            if all(done(c) for c in cands):
                (out / "chosen").mkdir(parents=True, exist_ok=True)
                (out / "chosen" / row).touch()
    if "--dry-run" in args:
        keep = [args[i + 1] for i, a in enumerate(args) if a == "--only"]
        wanted = {row for c, row in cells.items() if not keep or any(fnmatch.fnmatchcase(c, p) for p in keep)}
        for c in [c for row in wanted for c in rows[row]]:
            print(f"{c} {'done' if done(c) else 'todo'} method x")
        listed = [c for c in cells if cells[c] in wanted]
        if "--launch-order" in args and os.environ.get("FAKE_FIRST"):  # the CLI's longest-first order
            listed.sort(key=lambda c: c != os.environ["FAKE_FIRST"])
        for c in listed:
            state = "done" if done(c) else "todo" if chosen(cells[c]) else "waiting"
            print(f"{c} {state} method x")
        sys.exit(0)
    if "--prepare" in args:
        sys.exit(0)
    only = args[args.index("--only") + 1]
    with open(out / "events", "a") as f:
        f.write(f"{time.monotonic():.3f} start {only}\\n")
    if only == "selection/*":
        choose()
        sys.exit(0)
    if only in os.environ.get("FAKE_FAIL", "").split():
        sys.exit(1)
    oomed = out / f"oom_{only.replace('/', '_')}"
    if only in os.environ.get("FAKE_OOM", "").split() and (os.environ.get("FAKE_OOM_ALWAYS") or not oomed.exists()):
        oomed.touch()
        time.sleep(0.3)
        print("torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 160.00 MiB.", file=sys.stderr)
        sys.exit(1)
    time.sleep(seconds.get(only, 0.3))
    (out / "done").mkdir(parents=True, exist_ok=True)
    (out / "done" / only.replace("/", "_")).touch()
    if only.startswith("selection/") and not os.environ.get("CHOOSE_NEVER"):
        choose()
    with open(out / "events", "a") as f:
        f.write(f"{time.monotonic():.3f} end {only}\\n")
    """)


def _run(tmp_path, jobs, seconds=None, patterns=(), **env):
    fake = tmp_path / "fake_cli.py"
    fake.write_text(FAKE)
    out = tmp_path / "out"
    out.mkdir(exist_ok=True)
    full_env = dict(os.environ, IGA_DS_CLI=f"{sys.executable} {fake}", NO_REPORT="1", CUDA_VISIBLE_DEVICES="",
                    FAKE_SECONDS=json.dumps(seconds or {}), PATH="/usr/bin:/bin", **env)
    proc = subprocess.run(["bash", str(REPO / "launch/grid_parallel.sh"), "grid.yaml", str(out), str(jobs), *patterns],
                          env=full_env, capture_output=True, text=True, timeout=120)
    events = []
    if (out / "events").is_file():
        events = [line.split() for line in (out / "events").read_text().splitlines()]
    return proc, [(float(t), what, name) for t, what, name in events]


def _time(events, what, name):
    return next(t for t, w, n in events if w == what and n == name)


def test_a_row_starts_when_its_own_choice_is_made_and_jobs_bound_the_processes(tmp_path):
    # a_lr2 is slow: row b's cell starts as soon as b_lr1 is done, long before row a is chosen
    proc, events = _run(tmp_path, 2, {"selection/a_lr2": 3.0})
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert _time(events, "start", "b-s0") < _time(events, "end", "selection/a_lr2")
    assert _time(events, "start", "a-s0") > _time(events, "end", "selection/a_lr2")
    assert {n for _, w, n in events if w == "end"} == {"selection/a_lr1", "selection/a_lr2", "selection/b_lr1",
                                                      "a-s0", "a-s1", "b-s0"}
    # never more than JOBS at once
    live, most = 0, 0
    for _, what, name in sorted(events):
        if name != "selection/*":
            live += 1 if what == "start" else -1
            most = max(most, live)
    assert most == 2


def test_rows_whose_choice_was_not_written_are_released_by_one_final_choice(tmp_path):
    proc, events = _run(tmp_path, 3, CHOOSE_NEVER="1")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    starts = [n for _, w, n in sorted(events) if w == "start"]
    assert starts.count("selection/*") == 1
    assert starts.index("selection/*") < min(starts.index(c) for c in ("a-s0", "a-s1", "b-s0"))


def test_launch_for_starts_no_cell_after_its_window_and_the_rerun_finishes(tmp_path):
    # a window of 0 s is over before the first cell: nothing starts, nothing is half-run
    proc, events = _run(tmp_path, 3, LAUNCH_FOR="0")
    assert proc.returncode == 1 and "6 cells unfinished; rerun the same command" in proc.stderr
    assert not events
    again, events = _run(tmp_path, 3, LAUNCH_FOR="600")
    assert again.returncode == 0, again.stdout + again.stderr
    assert len([n for _, w, n in events if w == "end"]) == 6
    bad, _ = _run(tmp_path, 3, LAUNCH_FOR="soon")
    assert bad.returncode == 2 and "LAUNCH_FOR must be a number of seconds, got 'soon'" in bad.stderr


def test_a_failed_cell_is_not_retried_and_the_run_fails(tmp_path):
    proc, events = _run(tmp_path, 2, FAKE_FAIL="a-s1")
    assert proc.returncode == 1 and "a-s1 FAILED" in proc.stderr
    assert [n for _, w, n in events if w == "start"].count("a-s1") == 1
    assert "1 cells unfinished" in proc.stderr


def test_patterns_keep_their_cells_and_rows_candidates(tmp_path):
    proc, events = _run(tmp_path, 2, patterns=("b-*",))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert {n for _, w, n in events if w == "end"} == {"selection/b_lr1", "b-s0"}
    assert "2 cells to run" in proc.stdout


def test_cells_start_in_the_listings_launch_order(tmp_path):
    # the CLI's --launch-order listing puts b-s0 first (as the longest): it starts before a's cells
    proc, events = _run(tmp_path, 1, FAKE_FIRST="b-s0")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    starts = [n for _, w, n in sorted(events) if w == "start" and not n.startswith("selection/")]
    assert starts == ["b-s0", "a-s0", "a-s1"]


def _live_beside(events, name, nth):
    """How many other cells ran when ``name`` started for the ``nth`` time (0-based)."""
    live, starts = set(), 0
    for _, what, cell in sorted(events):
        if cell == "selection/*":
            continue
        if what == "start" and cell == name:
            if starts == nth:
                return len(live - {name})
            starts += 1
        if what == "start":
            live.add(cell)
        else:
            live.discard(cell)
    raise AssertionError(f"{name} did not start {nth + 1} times")


def test_a_cell_out_of_gpu_memory_runs_once_more_with_fewer_cells_beside_it(tmp_path):
    # a-s1 fails with CUDA's out-of-memory error the first time, among 3 cells; its retry waits
    # until at most JOBS - 2 others run, and the run succeeds
    seconds = {"a-s0": 1.5, "b-s0": 1.5}
    proc, events = _run(tmp_path, 3, seconds, FAKE_OOM="a-s1")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert [n for _, w, n in events if w == "start"].count("a-s1") == 2
    assert "a-s1 ran out of GPU memory; it runs once more" in proc.stderr and "FAILED" not in proc.stderr
    assert _live_beside(events, "a-s1", 1) <= 1
    assert "CUDA out of memory" in (tmp_path / "out" / "logs" / "a-s1.oom.log").read_text()


def test_a_cell_out_of_gpu_memory_twice_or_alone_fails_the_run(tmp_path):
    proc, events = _run(tmp_path, 3, FAKE_OOM="a-s1", FAKE_OOM_ALWAYS="1")
    assert proc.returncode == 1 and "a-s1 FAILED" in proc.stderr and "1 cells unfinished" in proc.stderr
    assert [n for _, w, n in events if w == "start"].count("a-s1") == 2
    (tmp_path / "alone").mkdir()
    alone, events = _run(tmp_path / "alone", 1, FAKE_OOM="b-s0")  # nothing beside it to blame: no retry
    assert alone.returncode == 1 and "b-s0 FAILED" in alone.stderr
    assert [n for _, w, n in events if w == "start"].count("b-s0") == 1
