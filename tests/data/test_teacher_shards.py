"""Sharded builds: the partition of seeds by id, `iga-ds data merge` and what it refuses, and
slurm/data_build_array.sbatch building shards in parallel on a real one-node Slurm against a
real local teacher server, then merging."""
from __future__ import annotations

import hashlib
import json
import random
import re
import shutil
import sys
from collections import Counter
from pathlib import Path

import pytest

from iga_ds.cli import main
from iga_ds.data.teacher import merge as merge_module
from iga_ds.data.teacher.clients import OpenAIChatClient
from iga_ds.data.teacher.pipeline import BuildSettings, build, hold_output_dir
from iga_ds.data.teacher.shards import in_shard, parse_shard, shard_of
from iga_ds.errors import UserError
from slurm_helpers import local_slurm_fixture
from teacher_server import TeacherServer, write_seeds

REPO = Path(__file__).resolve().parents[2]
TEMPLATE = REPO / "slurm" / "data_build_array.sbatch"
PROBLEMS = [("[low] " if i % 5 == 0 else "") + f"problem {i}" for i in range(30)]
IDS = [f"s{i:03d}" for i in range(len(PROBLEMS))]

local_slurm = pytest.fixture(scope="module")(local_slurm_fixture)


def test_each_seed_is_in_one_shard_whatever_the_file_order():
    seeds = [{"seed_id": f"seed-{i}", "problem": "p"} for i in range(400)]
    for count in (1, 2, 3, 7):
        parts = [in_shard(seeds, i, count) for i in range(count)]
        assert sorted(s["seed_id"] for part in parts for s in part) == sorted(s["seed_id"] for s in seeds)
        assert min(len(p) for p in parts) > 0.6 * len(seeds) / count  # balanced, roughly
        shuffled = random.Random(count).sample(seeds, len(seeds))
        assert [in_shard(shuffled, i, count) for i in range(count)] == \
            [sorted(p, key=shuffled.index) for p in parts]
        # the rule, independently: the first 16 hex digits of the id's sha256, modulo N
        for s in seeds[:50]:
            assert shard_of(s["seed_id"], count) == int(hashlib.sha256(s["seed_id"].encode()).hexdigest()[:16], 16) \
                % count


@pytest.mark.parametrize("text, message", [("3/3", "expected 0 <= I < N"), ("0/0", "expected 0 <= I < N"),
                                           ("1", "expected I/N"), ("-1/3", "expected I/N")])
def test_a_bad_shard_is_one_line(text, message):
    with pytest.raises(UserError, match=message):
        parse_shard(text)


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """The seeds built whole and in 3 shards against one server."""
    root = tmp_path_factory.mktemp("shards")
    seeds = write_seeds(root / "seeds.jsonl", PROBLEMS)
    with TeacherServer() as server:
        client = OpenAIChatClient(server.url, "m", backoff=0.001, max_backoff=0.01, timeout=10)
        settings = {"model": "m", "max_regenerations": 1}
        build(seeds, root / "whole", client, BuildSettings(**settings), concurrency=4, progress=False)
        for i in range(3):
            build(seeds, root / "sharded", client, BuildSettings(**settings), concurrency=4, progress=False,
                  shard=f"{i}/3")
    return root


@pytest.fixture
def shards(built, tmp_path):
    shutil.copytree(built / "sharded", tmp_path / "out")
    return built / "seeds.jsonl", tmp_path / "out"


def merge(seeds: Path, out: Path) -> int:
    return main(["data", "merge", "--seeds", str(seeds), "--out", str(out)])


def lines(path: Path) -> list[dict]:
    return [json.loads(x) for x in path.read_text().splitlines()]


def test_merged_shards_equal_the_whole_build(built, shards, capsys):
    seeds, out = shards
    for i in range(3):  # each shard holds its own seeds only
        kept = {r["seed_id"] for r in lines(out / f"shard-{i}-of-3" / "isomers.jsonl")}
        assert kept and all(shard_of(s, 3) == i for s in kept)
    assert merge(seeds, out) == 0
    assert "merged 3 shards: 30 seeds, each exactly once" in capsys.readouterr().out
    whole = built / "whole"
    merged = {name: lines(out / name) for name in ("isomers.jsonl", "dropped.jsonl")}
    for name, records in merged.items():  # the whole build's records, in the seeds file's order
        assert [r["seed_id"] for r in records] == sorted(r["seed_id"] for r in records)
        assert records == sorted(lines(whole / name), key=lambda r: IDS.index(r["seed_id"]))
    stats, reference = json.loads((out / "stats.json").read_text()), json.loads((whole / "stats.json").read_text())
    for key in ("seeds", "kept_groups", "kept_instances", "dropped_groups", "pending_seeds", "retention",
                "drop_reasons"):
        assert stats[key] == reference[key], key
    kept = Counter(r["seed_id"] for r in lines(out / "isomers.jsonl"))
    dropped = Counter(r["seed_id"] for r in lines(out / "dropped.jsonl"))
    assert set(kept.values()) == {4} and set(dropped.values()) == {1} and set(kept) | set(dropped) == set(IDS)
    # the merged folder resumes as an unsharded build with nothing left to do
    args = ["data", "build", "--seeds", str(seeds), "--out", str(out), "--base-url", "http://127.0.0.1:9/v1",
            "--model", "m", "--max-regenerations", "1", "--no-progress"]
    assert main(args) == 0
    assert merge(seeds, out) == 0  # and merges again to the same files
    assert lines(out / "isomers.jsonl") == merged["isomers.jsonl"]


def _drop_last_line(path: Path) -> None:
    path.write_text("".join(path.read_text().splitlines(keepends=True)[:-1]))


def _edit_settings(path: Path, **changes) -> None:
    path.write_text(json.dumps({**json.loads(path.read_text()), **changes}))


def _move_a_drop(out: Path) -> None:
    line = (out / "shard-0-of-3" / "dropped.jsonl").read_text().splitlines(keepends=True)[0]
    _drop_last_line_matching(out / "shard-0-of-3" / "dropped.jsonl", line)
    with open(out / "shard-1-of-3" / "dropped.jsonl", "a") as fh:
        fh.write(line)


def _drop_last_line_matching(path: Path, line: str) -> None:
    path.write_text(path.read_text().replace(line, "", 1))


BROKEN = {
    "a shard missing": (lambda out: shutil.rmtree(out / "shard-1-of-3"),
                        r"--out \S+: shard 1 of 3 missing \(no shard-1-of-3\): build it with --shard 1/3"),
    "shards of two splits": (lambda out: (out / "shard-0-of-2").mkdir(),
                             r"shards of 2 and 3 builds side by side"),
    "other settings": (lambda out: _edit_settings(out / "shard-2-of-3" / "build.json", min_score=0.5),
                       r"shard-2-of-3/build.json: min_score=0.5, but shard 0 was built with 0.85"),
    "other prompts": (lambda out: _edit_settings(out / "shard-1-of-3" / "build.json", templates_sha256="x"),
                      r"shard-1-of-3/build.json: templates_sha256='x'"),
    "a seed pending": (lambda out: _drop_last_line(out / "shard-2-of-3" / "dropped.jsonl"),
                       r"^1 of 30 seeds have no outcome yet \(shard 2/3: 1\): run those shards' builds again"),
    "a seed in the wrong shard": (_move_a_drop, r"shard-1-of-3: seed 's\d+' belongs to shard 0/3, not 1/3"),
    "a group cut off": (lambda out: (out / "shard-0-of-3" / "isomers.jsonl").write_text(
        "".join((out / "shard-0-of-3" / "isomers.jsonl").read_text().splitlines(keepends=True)[:-1])),
        r"shard-0-of-3/isomers.jsonl: ends in a record cut off by a kill: run the build of shard 0/3 again"),
    "a build of its own in OUT": (lambda out: (out / "build.json").write_text("{}"),
                                  r"--out \S+: holds a build of its own \(build.json\); merge the shards elsewhere"),
    "a seed twice": (lambda out: (out / "shard-1-of-3" / "dropped.jsonl").write_text(
        (out / "shard-1-of-3" / "dropped.jsonl").read_text() * 2), r"shard-1-of-3: seed 's\d+' is recorded twice"),
}


@pytest.mark.parametrize("case", BROKEN, ids=list(BROKEN))
def test_merge_refuses_shards_that_would_lose_or_repeat_seeds(shards, capsys, case):
    seeds, out = shards
    breakage, message = BROKEN[case]
    breakage(out)
    assert merge(seeds, out) == 2
    err = capsys.readouterr().err
    assert re.search(message, err.removeprefix("iga-ds: error: ")), err
    assert err.count("\n") == 1 and not (out / "isomers.jsonl").exists()


class Killed(BaseException):
    """The merge's process killed between two writes."""


@pytest.mark.parametrize("writes_before_the_kill", [0, 1, 2, 3])
def test_a_merge_killed_between_its_writes_is_refused_until_merged_again(shards, monkeypatch, capsys,
                                                                          writes_before_the_kill):
    seeds, out = shards
    assert merge(seeds, out) == 0  # a finished merge first: the next one rewrites every file
    finished = {name: (out / name).read_bytes() for name in ("isomers.jsonl", "dropped.jsonl", "build.json")}
    written = []

    def kill_at_a_write(write):
        def write_or_die(path, *args, **kwargs):
            if len(written) == writes_before_the_kill:
                raise Killed
            written.append(Path(path).name)
            write(path, *args, **kwargs)
        return write_or_die

    for name in ("write_jsonl", "atomic_write_json"):
        monkeypatch.setattr(merge_module, name, kill_at_a_write(getattr(merge_module, name)))
    with pytest.raises(Killed):
        merge_module.merge_shards(seeds, out)
    monkeypatch.undo()
    assert written == ["dropped.jsonl", "isomers.jsonl", "stats.json"][:writes_before_the_kill]
    assert not (out / "build.json").exists()  # the earlier merge's went first, the new one was to go last
    resume = ["data", "build", "--seeds", str(seeds), "--out", str(out), "--base-url", "http://127.0.0.1:9/v1",
              "--model", "m", "--max-regenerations", "1", "--no-progress"]
    assert main(resume) == 2
    assert "holds a merge of shards that did not finish" in capsys.readouterr().err
    assert merge(seeds, out) == 0  # merging again finishes it
    assert {name: (out / name).read_bytes() for name in finished} == finished
    assert main(resume) == 0


def test_merge_refuses_another_seeds_file_and_a_shard_being_built(shards, tmp_path, capsys):
    seeds, out = shards
    fewer = write_seeds(tmp_path / "fewer.jsonl", PROBLEMS[:-1])
    assert merge(fewer, out) == 2
    assert "seed 's029' is not in " + str(fewer) in capsys.readouterr().err
    with hold_output_dir(out / "shard-1-of-3"):
        assert merge(seeds, out) == 2
    assert "shard-1-of-3: another build (pid " in capsys.readouterr().err


def test_the_template_header_opens_with_its_command_and_documents_its_variables():
    text = TEMPLATE.read_text()
    header = text.split("#SBATCH", 1)[0]
    assert text.startswith("#!/usr/bin/env bash\n") and "sbatch --array=0-7 slurm/data_build_array.sbatch" in header
    used = set(re.findall(r"\$\{?(IGA_[A-Z_]+)", text.split("set -euo pipefail", 1)[1]))
    assert used and all(v in header for v in used), sorted(v for v in used if v not in header)


def shards_in_flight_at_once(requests) -> int:
    """The most shards that had a request in flight at one moment, from the server's records."""
    shard_of_port = {}  # each connection is one build process's, hence one shard's
    for r in requests:
        seed = re.search(r"\bproblem (\d+)\b", r.body["messages"][-1]["content"])  # the DAG prompt's seed
        if seed:
            shard_of_port[r.client_port] = shard_of(IDS[int(seed[1])], 3)
    assert set(shard_of_port.values()) == {0, 1, 2}
    # answers before arrivals at one instant: touching is not overlapping
    events = sorted([(r.arrived, 1, r.client_port) for r in requests] + [(r.answered, -1, r.client_port)
                                                                         for r in requests])
    in_flight, most = Counter(), 0
    for _, change, port in events:
        in_flight[shard_of_port[port]] += change
        most = max(most, sum(1 for n in in_flight.values() if n > 0))
    return most


@pytest.mark.slow
def test_the_slurm_array_builds_shards_in_parallel_then_merges(local_slurm, tmp_path):
    seeds = write_seeds(tmp_path / "seeds.jsonl", PROBLEMS)
    out, logs = tmp_path / "out", tmp_path / "logs"
    logs.mkdir()
    with TeacherServer() as server:
        server.teacher.delay = 0.03  # a shard's requests then span a second or two
        env = {"IGA_SEEDS": str(seeds), "IGA_OUT": str(out), "IGA_BASE_URL": server.url, "IGA_MODEL": "m",
               "IGA_BUILD_ARGS": "--concurrency 2 --max-regenerations 1 --backoff 0.001",
               "IGA_PYTHON": sys.executable, "IGA_LOG_DIR": str(logs)}
        # one CPU a task (the template asks 2): the test cluster's 4 CPUs then run the 3 tasks at once
        res = local_slurm.run("sbatch", "--parsable", "--array=0-2", "--cpus-per-task=1",
                              f"--output={logs}/%x-%A_%a.out", str(TEMPLATE), cwd=REPO, env=env)
        array = res.stdout.strip().split(";")[0]
        assert array.isdigit(), res.stdout + res.stderr
        for task in range(3):
            state, code = local_slurm.wait_done(f"{array}_{task}", 180)
            log = (logs / f"iga-data-{array}_{task}.out").read_text()
            assert (state, code) == ("COMPLETED", 0), log
            assert f"shard {task}/3 ended with status 0" in log
        merge_job = re.search(r"merge job (\d+) submitted", (logs / f"iga-data-{array}_0.out").read_text())[1]
        state, code = local_slurm.wait_done(merge_job, 120)
        merge_log = (logs / f"iga-data-merge-{merge_job}.out").read_text()
        assert (state, code) == ("COMPLETED", 0), merge_log
        requests = list(server.teacher.requests)
    assert "merged 3 shards: 30 seeds, each exactly once" in merge_log
    kept = Counter(r["seed_id"] for r in lines(out / "isomers.jsonl"))
    dropped = {r["seed_id"] for r in lines(out / "dropped.jsonl")}
    assert set(kept.values()) == {4} and not set(kept) & dropped and set(kept) | dropped == set(IDS)
    assert dropped == {f"s{i:03d}" for i in range(0, 30, 5)}
    # the tasks ran side by side: requests of different shards were in flight at one moment
    assert shards_in_flight_at_once(requests) >= 2
