"""tools/trace_gaps.py on a hand-made Chrome trace whose gaps are known by construction."""
from __future__ import annotations

import json

import pytest

import trace_gaps  # tools/ is on the path: pytest's pythonpath option (pyproject.toml)


def _event(cat, name, ts, dur, tid=1, **args):
    return {"ph": "X", "cat": cat, "name": name, "ts": ts, "dur": dur, "pid": 1, "tid": tid, "args": args}


def _trace():
    """Range "r" on the host from 0 to 100 us. Device work launched inside it: kernel 1 at
    30-40; kernel 2 at 57-62, launched at 55 by aten::b when the device had run out of work at
    40 (a 17 us gap the host caused); kernel 3 at 70-80, launched at 58 (inside aten::c, inside
    aten::b), before the device ran out at 62 (an 8 us gap the device left on its own); kernel 4
    at 75-85 on another stream, overlapping kernel 3. A launch after the range (kernel 5) is
    not counted."""
    return {"traceEvents": [
        _event("user_annotation", "r", 0, 100),
        _event("cpu_op", "aten::a", 10, 10),
        _event("cuda_runtime", "cudaLaunchKernel", 12, 2, correlation=1),
        _event("kernel", "k1", 30, 10, tid=7, correlation=1),
        _event("cpu_op", "aten::b", 50, 10),
        _event("cuda_runtime", "cudaLaunchKernel", 55, 1, correlation=2),
        _event("kernel", "k2", 57, 5, tid=7, correlation=2),
        _event("cpu_op", "aten::c", 57.5, 1),
        _event("cuda_runtime", "cudaLaunchKernel", 58, 0.5, correlation=3),
        _event("kernel", "k3", 70, 10, tid=7, correlation=3),
        _event("cuda_runtime", "cudaLaunchKernel", 59, 0.5, correlation=4),
        _event("kernel", "k4", 75, 10, tid=8, correlation=4),
        _event("cuda_runtime", "cudaStreamSynchronize", 90, 5),
        _event("cuda_runtime", "cudaLaunchKernel", 150, 1, correlation=5),
        _event("kernel", "k5", 160, 10, tid=7, correlation=5),
        {"ph": "i", "name": "marker", "ts": 1},  # not a complete event: ignored
    ]}


def test_gaps_are_split_into_host_bound_and_not_and_named_after_the_late_launch():
    report = trace_gaps.analyse(trace_gaps.load_events_from(_trace()), "r")
    assert report["device_ops"] == 4
    assert report["host_us"] == 100
    assert report["span_us"] == 85 - 30
    assert report["busy_us"] == 10 + 5 + 10 + 5  # kernel 4 adds only what kernel 3 does not cover
    assert report["idle_us"] == 17 + 8
    assert report["host_bound_us"] == 17
    assert [(g["us"], g["host_bound"], g["issuer"]) for g in report["gaps"]] == [(17, True, "aten::b"),
                                                                               (8, False, "aten::c")]
    assert trace_gaps.by_issuer(report["gaps"]) == [("aten::b", 1, 17)]
    assert report["syncs"] == {"cudaStreamSynchronize": {"calls": 1, "us": 5}}
    # without a range: every launch, so kernel 5 too, 75 us after kernel 4, launched by no operator
    # after the device had run out of work
    whole = trace_gaps.analyse(trace_gaps.load_events_from(_trace()))
    assert whole["device_ops"] == 5 and whole["idle_us"] == 17 + 8 + 75 and whole["host_bound_us"] == 17 + 75
    assert trace_gaps.by_issuer(whole["gaps"])[0] == ("(no host event)", 1, 75)


def test_command_line_prints_the_report_and_names_what_is_wrong(tmp_path, capsys):
    path = tmp_path / "trace.json"
    path.write_text(json.dumps(_trace()))
    out = tmp_path / "gaps.json"
    assert trace_gaps.main([str(path), "--range", "r", "--json", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "busy 0.030 ms" in printed and "aten::b" in printed
    assert json.loads(out.read_text())["host_bound_us"] == 17
    with pytest.raises(SystemExit, match="no range 'nope'"):
        trace_gaps.main([str(path), "--range", "nope"])
    with pytest.raises(SystemExit, match="--occurrence 3"):
        trace_gaps.main([str(path), "--range", "r", "--occurrence", "3"])
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(SystemExit, match="bad.json: not a readable Chrome trace"):
        trace_gaps.main([str(bad)])
