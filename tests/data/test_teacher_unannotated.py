"""A teacher that does not annotate its steps (the paper's own format) against a real local server.

Its instance replies number their steps and name no uses/derives nodes, so the default structure
check fails every group as ``structure_unannotated``. The build stops within the first seeds,
drops none of them, and names ``--structure-check verdict``; with it the same replies are kept on
the teacher's verification verdict, and stats.json says which check judged how many groups.
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from iga_ds.cli import main
from iga_ds.data.teacher.clients import OpenAIChatClient
from iga_ds.data.teacher.filters import check_group
from iga_ds.data.teacher.parse import Instance, StepDependencies
from iga_ds.data.teacher.pipeline import BuildSettings, build
from iga_ds.errors import UserError
from teacher_server import DAG, TeacherServer, write_seeds


@pytest.fixture
def server():
    with TeacherServer() as server:
        yield server


def lines(path: Path) -> list[dict]:
    return [json.loads(x) for x in path.read_text().splitlines()] if path.exists() else []


def cli(seeds: Path, out: Path, server, *extra: str) -> list[str]:
    return ["data", "build", "--seeds", str(seeds), "--out", str(out), "--base-url", server.url, "--model", "m",
            "--backoff", "0.001", "--no-progress", *extra]


def dag_requests(server) -> int:
    return sum("extracting logical structure" in json.dumps(r.body) for r in server.teacher.requests)


def test_stops_after_k_seeds_then_the_verdict_keeps_them(tmp_path, server, capsys):
    server.teacher.annotate = False
    seeds = write_seeds(tmp_path / "seeds.jsonl",
                        [("[verdict-fail] " if i == 30 else "") + f"problem {i}" for i in range(40)])
    out = tmp_path / "out"
    assert main(cli(seeds, out, server, "--concurrency", "2", "--stop-unannotated", "3")) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1, err
    assert "first 3 seeds" in err and "structure_unannotated" in err and "--structure-check verdict" in err
    # stopped after K seeds, not after the whole run: at most the 2 x concurrency in flight more
    assert dag_requests(server) <= 3 + 4
    stats = json.loads((out / "stats.json").read_text())
    assert stats["pending_seeds"] == 40 and stats["dropped_groups"] == 0 and stats["kept_groups"] == 0
    assert stats["this_run"]["held_unannotated"] == 3 and stats["structure_check"] == "dag"
    assert lines(out / "dropped.jsonl") == [] and lines(out / "isomers.jsonl") == []

    # the same folder, the option the message names: every seed is kept on the teacher's verdict
    assert main(cli(seeds, out, server, "--concurrency", "2", "--structure-check", "verdict")) == 0
    stats = json.loads((out / "stats.json").read_text())
    assert stats["kept_groups"] == 39 and stats["pending_seeds"] == 0
    assert stats["structure_check"] == "verdict"
    assert stats["structure_check_groups"] == {"verdict": {"kept": 39, "dropped": 1}}
    assert [r["reason"] for r in lines(out / "dropped.jsonl")] == [
        "verdict_fail (math: the teacher's verification says FAIL)"]
    kept = lines(out / "isomers.jsonl")
    assert {r["meta"]["structure_check"] for r in kept} == {"verdict"} and len(kept) == 39 * 4
    assert json.loads((out / "build.json").read_text())["structure_check"] == "verdict"


def test_a_mixed_run_does_not_stop(tmp_path, server):
    plain = {0, 1, 3, 4, 6, 7, 9, 10}  # never three in a row
    seeds = write_seeds(tmp_path / "seeds.jsonl", [("[plain] " if i in plain else "") + f"p{i}" for i in range(12)])
    client = OpenAIChatClient(server.url, "m", backoff=0.001, timeout=10)
    stats = build(seeds, tmp_path / "out", client, BuildSettings(model="m"), concurrency=1, progress=False,
                  stop_unannotated=3)
    assert stats["kept_groups"] == 4 and stats["drop_reasons"] == {"structure_unannotated": 8}
    assert stats["structure_check_groups"] == {"dag": {"kept": 4, "dropped": 8}}
    assert "held_unannotated" not in stats["this_run"]
    # the held seeds were recorded as drops once an annotated one got through
    assert sorted(r["seed_id"] for r in lines(tmp_path / "out" / "dropped.jsonl")) == [f"s{i:03d}" for i in sorted(plain)]
    # groups were judged by the DAG check: switching the check is refused
    with pytest.raises(UserError, match="structure_check='dag'"):
        build(seeds, tmp_path / "out", client, BuildSettings(model="m", structure_check="verdict"), progress=False)


def test_a_run_shorter_than_k_stops_at_its_end(tmp_path, server, capsys):
    server.teacher.annotate = False
    seeds = write_seeds(tmp_path / "seeds.jsonl", ["p0", "p1"])
    assert main(cli(seeds, tmp_path / "out", server)) == 2
    assert "first 2 seeds" in capsys.readouterr().err
    assert json.loads((tmp_path / "out" / "stats.json").read_text())["pending_seeds"] == 2
    # 0 turns the stop off: the paper-format seeds are dropped as the filter says
    assert main(cli(seeds, tmp_path / "out", server, "--stop-unannotated", "0")) == 0
    assert [r["reason"].split(" (")[0] for r in lines(tmp_path / "out" / "dropped.jsonl")] == [
        "structure_unannotated"] * 2
    assert main(cli(seeds, tmp_path / "o2", server, "--stop-unannotated", "-1")) == 2
    assert "--stop-unannotated -1: expected a number >= 0" in capsys.readouterr().err


def test_the_verdict_check_on_its_own():
    steps = [StepDependencies((), ("a",)), StepDependencies(("a",), ("b",))]
    annotated, plain = Instance("p", ["x", "y"], "yes", None, steps), Instance("p", ["x", "y"], "yes", None)
    group = {"math": plain, "legal": plain}
    assert check_group(group, DAG, 2).reason.startswith("structure_unannotated (math")
    assert check_group(group, DAG, 2, "verdict", {"math": "PASS", "legal": None}) is None  # no verdict: the score
    assert check_group(group, DAG, 2, "verdict", {"math": "PASS", "legal": "FAIL"}).domain == "legal"
    assert check_group({"math": annotated, "legal": annotated}, DAG, 2) is None
