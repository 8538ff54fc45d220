"""Every seed ends exactly once, kept or dropped, whatever the moment a build is killed.

The outputs are read here independently of the pipeline (whole lines only, a last group with
fewer lines than domains is one being written), and checked after kills at random moments of
real `iga-ds data build` processes against a real local server, after cuts at chosen bytes of
the output files, and after outputs of an earlier version that recorded seeds twice.
"""
from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import pytest

from iga_ds.cli import main
from iga_ds.data.teacher.clients import OpenAIChatClient
from iga_ds.data.teacher.pipeline import BuildSettings, build, hold_output_dir
from teacher_server import TOO_LONG, TeacherServer, write_seeds

REPO = Path(__file__).resolve().parents[2]
DOMAINS = 4
# s000 ... s023: every 4th scores low (dropped), s005 has a DAG that never parses (dropped)
PROBLEMS = [("[low] " if i % 4 == 0 else "[dag-bad] " if i == 5 else "") + f"problem {i}" for i in range(24)]
EXPECTED_DROPS = {f"s{i:03d}": "low_score" for i in range(0, 24, 4)} | {"s005": "dag_malformed"}


def outcomes_on_disk(out: Path) -> tuple[Counter, Counter, dict]:
    """(kept seeds, dropped seeds, drop reasons) as a resumed build must see them: whole lines,
    and of the kept file whole groups of DOMAINS lines."""
    def whole_lines(name: str) -> list[dict]:
        path = out / name
        data = path.read_bytes() if path.exists() else b""
        return [json.loads(x) for x in data[:data.rfind(b"\n") + 1].splitlines()]

    kept_lines, kept = whole_lines("isomers.jsonl"), Counter()
    runs: list[list[dict]] = []
    for rec in kept_lines:
        if runs and runs[-1][0]["group_id"] == rec["group_id"]:
            runs[-1].append(rec)
        else:
            runs.append([rec])
    for i, run in enumerate(runs):
        if len(run) < DOMAINS:
            assert i == len(runs) - 1, f"a short group that is not the last one: {run[0]['group_id']}"
            continue  # being written when the kill came: the resume cuts it
        assert len(run) == DOMAINS and {r["seed_id"] for r in run} == {run[0]["seed_id"]}
        kept[run[0]["seed_id"]] += 1
    dropped_lines = whole_lines("dropped.jsonl")
    return kept, Counter(r["seed_id"] for r in dropped_lines), {r["seed_id"]: r["reason"] for r in dropped_lines}


def assert_at_most_once(out: Path) -> tuple[set, set]:
    kept, dropped, _ = outcomes_on_disk(out)
    twice = {s for s, n in (kept + dropped).items() if n > 1}
    assert not twice, f"seeds recorded twice: {sorted(twice)}"
    return set(kept), set(dropped)


def assert_finished_exactly_once(out: Path, seed_ids: set[str]) -> None:
    kept, dropped = assert_at_most_once(out)
    assert kept | dropped == seed_ids, f"missing: {sorted(seed_ids - kept - dropped)}"
    _, _, reasons = outcomes_on_disk(out)
    assert {s: r.split(" (")[0] for s, r in reasons.items()} == EXPECTED_DROPS
    stats = json.loads((out / "stats.json").read_text())
    assert (stats["seeds"], stats["kept_groups"], stats["dropped_groups"], stats["pending_seeds"]) == \
        (len(seed_ids), len(kept), len(dropped), 0)
    assert stats["kept_instances"] == DOMAINS * len(kept)
    assert stats["retention"] == pytest.approx(len(kept) / len(seed_ids))


def build_command(seeds: Path, out: Path, url: str, *extra: str) -> list[str]:
    return [sys.executable, "-m", "iga_ds.cli", "data", "build", "--seeds", str(seeds), "--out", str(out),
            "--base-url", url, "--model", "m", "--concurrency", "4", "--max-regenerations", "1",
            "--backoff", "0.001", "--no-progress", *extra]


@pytest.mark.slow
def test_killed_at_random_moments_every_seed_ends_exactly_once(tmp_path):
    seeds = write_seeds(tmp_path / "seeds.jsonl", PROBLEMS)
    ids = {f"s{i:03d}" for i in range(len(PROBLEMS))}
    rng = random.Random(23)
    kills = builds = 0
    with TeacherServer() as server:
        server.teacher.delay = 0.003
        start = time.monotonic()
        calibrate = build_command(seeds, tmp_path / "whole", server.url)
        assert subprocess.run(calibrate, capture_output=True, timeout=120, check=False).returncode == 0
        whole = time.monotonic() - start
        assert_finished_exactly_once(tmp_path / "whole", ids)
        deadline = start + 40
        while time.monotonic() < deadline:
            out = tmp_path / f"out{builds}"
            while True:  # kill at a random moment, resume, ... until a run ends by itself
                proc = subprocess.Popen(build_command(seeds, out, server.url), stdout=subprocess.DEVNULL,
                                        stderr=subprocess.PIPE)
                try:
                    _, err = proc.communicate(timeout=rng.uniform(0, 1.1 * whole))
                    break
                except subprocess.TimeoutExpired:
                    os.kill(proc.pid, signal.SIGKILL)
                    proc.communicate()
                    kills += 1
                    assert_at_most_once(out)
            assert proc.returncode == 0, err.decode()
            assert_finished_exactly_once(out, ids)
            builds += 1
    print(f"{kills} kills, {builds} builds")
    assert kills >= 10 and builds >= 2, (kills, builds)


def _finished_build(tmp_path: Path, server: TeacherServer) -> tuple[Path, Path]:
    seeds = write_seeds(tmp_path / "seeds.jsonl", PROBLEMS)
    out = tmp_path / "out"
    client = OpenAIChatClient(server.url, "m", backoff=0.001, max_backoff=0.01, timeout=10)
    build(seeds, out, client, BuildSettings(model="m", max_regenerations=1), concurrency=4, progress=False)
    return seeds, out


def _cut_points(data: bytes, rng: random.Random) -> list[int]:
    """Offsets to cut a file at: each line's end, a byte either side of it, and some inside lines."""
    ends = [i + 1 for i, b in enumerate(data) if b == ord("\n")]
    points = {0, len(data)} | {e + d for e in ends for d in (-1, 0, 1) if 0 <= e + d <= len(data)}
    return sorted(points | {rng.randrange(len(data)) for _ in range(10)})


def test_a_cut_at_any_byte_of_either_file_resumes_to_exactly_once(tmp_path):
    """What a kill in the middle of a write leaves: each file cut at many offsets, then a resume."""
    rng = random.Random(5)
    ids = {f"s{i:03d}" for i in range(len(PROBLEMS))}
    with TeacherServer() as server:
        seeds, out = _finished_build(tmp_path, server)
        full = {name: (out / name).read_bytes() for name in ("isomers.jsonl", "dropped.jsonl")}
        client = OpenAIChatClient(server.url, "m", backoff=0.001, max_backoff=0.01, timeout=10)
        cuts = [(name, at) for name in full for at in _cut_points(full[name], rng)]
        for name, at in rng.sample(cuts, 40) + [("isomers.jsonl", 0), ("dropped.jsonl", 7)]:
            for other, data in full.items():
                (out / other).write_bytes(data[:at] if other == name else data)
            assert_at_most_once(out)
            stats = build(seeds, out, client, BuildSettings(model="m", max_regenerations=1), concurrency=4,
                          progress=False)
            assert_finished_exactly_once(out, ids)
            assert stats["pending_seeds"] == 0


def test_seeds_recorded_twice_by_an_earlier_version_end_once_and_counts_stay_positive(tmp_path, capsys):
    """The reported failure: a resumed build had 18 drop records for 13 seeds and 'pending -5'."""
    ids = {f"s{i:03d}" for i in range(len(PROBLEMS))}
    with TeacherServer() as server:
        seeds, out = _finished_build(tmp_path, server)
        kept = (out / "isomers.jsonl").read_bytes().splitlines(keepends=True)
        dropped = (out / "dropped.jsonl").read_bytes().splitlines(keepends=True)
        fake_drop = json.dumps({"seed_id": "s001", "reason": "low_score (math)"}).encode() + b"\n"
        # every drop twice, the first kept group twice, and a kept seed dropped as well
        (out / "dropped.jsonl").write_bytes(b"".join(dropped + dropped) + fake_drop)
        (out / "isomers.jsonl").write_bytes(b"".join(kept + kept[:DOMAINS]))
        args = ["data", "build", "--seeds", str(seeds), "--out", str(out), "--base-url", server.url,
                "--model", "m", "--max-regenerations", "1", "--no-progress"]
        assert main(args) == 0
        assert_finished_exactly_once(out, ids)
        assert "pending 0" in capsys.readouterr().out
        # a seeds file that lost seeds: they no longer count, nothing goes negative
        write_seeds(seeds, PROBLEMS[:10])
        assert main(args) == 0
        stats = json.loads((out / "stats.json").read_text())
        assert (stats["seeds"], stats["pending_seeds"], stats["recorded_not_in_seeds"]) == (10, 0, 14)
        assert stats["kept_groups"] + stats["dropped_groups"] == 10


def test_a_second_build_on_the_same_directory_is_refused(tmp_path, capsys):
    seeds = write_seeds(tmp_path / "seeds.jsonl", ["p"])
    out = tmp_path / "out"
    out.mkdir()
    with hold_output_dir(out):
        assert main(["data", "build", "--seeds", str(seeds), "--out", str(out), "--base-url",
                     "http://127.0.0.1:9/v1", "--model", "m", "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert f"{out}: another build (pid {os.getpid()} on host " in err and ") is writing here" in err and err.count("\n") == 1
    assert not (out / "isomers.jsonl").exists() and not (out / "dropped.jsonl").exists()


def test_two_builds_started_on_one_directory_record_each_seed_once(tmp_path):
    """How the reported duplicates arise: a second build started while the first still runs
    (a wrapper killed, its build not). One of the two now refuses to start."""
    seeds = write_seeds(tmp_path / "seeds.jsonl", [f"[low] p{i}" for i in range(13)])
    out = tmp_path / "out"
    with TeacherServer() as server:
        server.teacher.delay = 0.01
        procs = [subprocess.Popen(build_command(seeds, out, server.url), stdout=subprocess.PIPE,
                                  stderr=subprocess.PIPE) for _ in range(2)]
        results = [(p.wait(timeout=120), p.stderr.read().decode()) for p in procs]
    assert sorted(rc for rc, _ in results) in ([0, 0], [0, 2]), results
    assert all("another build" in err for rc, err in results if rc == 2)
    kept, dropped = assert_at_most_once(out)
    assert not kept and dropped == {f"s{i:03d}" for i in range(13)}
    assert json.loads((out / "stats.json").read_text())["pending_seeds"] == 0


def _build_args(seeds: Path, out: Path, url: str, *extra: str) -> list[str]:
    return ["data", "build", "--seeds", str(seeds), "--out", str(out), "--base-url", url, "--model", "m",
            "--backoff", "0.001", "--no-progress", *extra]


def test_a_refusal_that_repeats_for_every_seed_stops_early_and_drops_nothing(tmp_path, capsys):
    seeds = write_seeds(tmp_path / "seeds.jsonl", [f"p{i}" for i in range(20)])
    out = tmp_path / "out"
    message = "max_tokens is too large: 100000. This model's maximum context length is 8192 tokens"
    with TeacherServer() as server:
        server.teacher.refuse_all = (400, message)
        assert main(_build_args(seeds, out, server.url, "--max-tokens", "100000", "--concurrency", "2")) == 2
        err = capsys.readouterr().err
        assert err.startswith("iga-ds: error: stopped: 3 seeds in a row were refused by the teacher server (HTTP 400 "
                              f"from {server.url}/chat/completions: {message}); nothing was dropped") and \
            err.count("\n") == 1, err
        assert len(server.teacher.requests) <= 3 + 2 * 2  # the first few, not one per seed
        assert not (out / "dropped.jsonl").exists()
        assert json.loads((out / "stats.json").read_text())["pending_seeds"] == 20
        server.teacher.refuse_all = None  # the setting fixed: the same command finishes the build
        assert main(_build_args(seeds, out, server.url, "--max-tokens", "100000", "--concurrency", "2")) == 0
    assert json.loads((out / "stats.json").read_text())["kept_groups"] == 20


def test_a_seed_refused_while_others_get_through_is_dropped_with_the_message(tmp_path):
    seeds = write_seeds(tmp_path / "seeds.jsonl", ["p0", "[reject] p1", "p2", "[reject] p3"])
    out = tmp_path / "out"
    with TeacherServer() as server:
        assert main(_build_args(seeds, out, server.url, "--concurrency", "1")) == 0
    dropped = [json.loads(x) for x in (out / "dropped.jsonl").read_text().splitlines()]
    assert [(d["seed_id"], d["reason"]) for d in dropped] == [
        (s, f"request_rejected (HTTP 400 from {server.url}/chat/completions: {TOO_LONG})") for s in ("s001", "s003")]
    assert json.loads((out / "stats.json").read_text())["drop_reasons"] == {"request_rejected": 2}


def test_refused_seeds_stay_to_do_until_some_seed_gets_through(tmp_path, capsys):
    seeds = write_seeds(tmp_path / "seeds.jsonl", ["[reject] p0", "[reject] p1"])
    out = tmp_path / "out"
    with TeacherServer() as server:
        assert main(_build_args(seeds, out, server.url)) == 1
    err = capsys.readouterr().err
    assert "2 seeds still to do (this run: 0 failed after retries, 2 refused by the server; last: HTTP 400" in err
    assert not (out / "dropped.jsonl").exists()


def test_seeds_failing_in_a_row_stop_the_build_with_the_cause(tmp_path, capsys):
    seeds = write_seeds(tmp_path / "seeds.jsonl", [f"p{i}" for i in range(30)])
    out = tmp_path / "out"
    url = "http://127.0.0.1:9/v1"  # the discard port: nothing listens
    assert main(_build_args(seeds, out, url, "--max-retries", "0", "--concurrency", "2")) == 1
    err = capsys.readouterr().err
    assert ("iga-ds: error: stopped: 3 seeds in a row failed (gave up after 1 attempt: connection refused to "
            f"{url}/chat/completions); nothing was dropped") in err
    stats = json.loads((out / "stats.json").read_text())
    assert stats["pending_seeds"] == 30 and 3 <= stats["this_run"]["requests"] <= 3 + 2 * 2
