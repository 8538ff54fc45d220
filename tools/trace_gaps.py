"""Where the device waits inside a profiled range: its idle gaps between kernels, and what the host did.

    python tools/trace_gaps.py prof/iga_bf16_q1p16_rank0_trace.json --range boundary/method
    python tools/trace_gaps.py method_trace.json --range method --json gaps.json

Reads a Chrome trace of ``torch.profiler`` (``bench_step.py --profile DIR --profile-trace``,
``profile_method.py --trace FILE``). The range is a ``record_function`` name (its last
occurrence unless ``--occurrence`` says otherwise); without one, the whole trace. Of the device
work launched inside the range it prints: the range's host time, the device's span from the first
kernel's start to the last one's end, its busy time (the union of the kernels, copies and sets),
and its idle time, split into gaps where the device waited for the host (the next launch came
after the device had run out of work) and gaps the device left on its own (a launch queued in
time). Host-bound gaps are grouped by the innermost operator (or Python function, for a trace
taken with stacks) that issued the late launch, so the table names where host time goes; the
host's synchronizing calls in the range are listed with their times.
"""
from __future__ import annotations

import argparse
import json
import sys
from collections import defaultdict

DEVICE_CATEGORIES = ("kernel", "gpu_memcpy", "gpu_memset")
LAUNCH_CATEGORIES = ("cuda_runtime", "cuda_driver")
HOST_CATEGORIES = ("cpu_op", "python_function", "user_annotation")
SYNC_CALLS = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize", "cudaMemcpy",
              "cudaMemcpyAsync", "cudaStreamWaitEvent")
# a launch this close to the device's running out of work still kept it waiting: the launch call
# returns before the kernel starts
LAUNCH_SLACK_US = 2.0


def load_events(path: str) -> list[dict]:
    """The complete ("X") events of a Chrome trace, or a one-line error naming the file."""
    try:
        with open(path) as fh:
            data = json.load(fh)
    except (OSError, ValueError) as exc:
        raise SystemExit(f"{path}: not a readable Chrome trace ({exc})") from None
    try:
        return load_events_from(data)
    except ValueError as exc:
        raise SystemExit(f"{path}: {exc}") from None


def load_events_from(data) -> list[dict]:
    """The complete ("X") events of a parsed Chrome trace (an object with ``traceEvents``, or
    the list itself)."""
    events = data.get("traceEvents") if isinstance(data, dict) else data
    if not isinstance(events, list):
        raise ValueError("expected a JSON object with a 'traceEvents' list")
    return [e for e in events if isinstance(e, dict) and e.get("ph") == "X" and "ts" in e]


def host_window(events: list[dict], name: str | None, occurrence: int) -> tuple[float, float]:
    """The host interval of the ``occurrence``-th range called ``name`` (whole trace without one)."""
    if name is None:
        return min(e["ts"] for e in events), max(e["ts"] + e.get("dur", 0) for e in events)
    ranges = sorted((e for e in events if e.get("name") == name and e.get("cat") == "user_annotation"),
                    key=lambda e: e["ts"])
    if not ranges:
        raise SystemExit(f"no range {name!r} in the trace (record_function names are matched exactly)")
    if not -len(ranges) <= occurrence < len(ranges):
        raise SystemExit(f"--occurrence {occurrence}: the trace has {len(ranges)} range(s) {name!r}")
    chosen = ranges[occurrence]
    return chosen["ts"], chosen["ts"] + chosen.get("dur", 0)


def innermost(host: list[dict], thread, ts: float) -> str:
    """The name of the shortest host event on ``thread`` that contains time ``ts``."""
    best = None
    for e in host:
        if e.get("tid") == thread and e["ts"] <= ts <= e["ts"] + e.get("dur", 0):
            if best is None or e.get("dur", 0) < best.get("dur", 0):
                best = e
    return best["name"] if best is not None else "(no host event)"


def analyse(events: list[dict], name: str | None = None, occurrence: int = -1, min_gap_us: float = 1.0) -> dict:
    """Times in microseconds of the device work launched in the range: span, busy, idle; the
    gaps longer than ``min_gap_us``, each host-bound or not and named after the late launch's
    issuer; and the range's synchronizing calls."""
    start, end = host_window(events, name, occurrence)
    launches = {e["args"]["correlation"]: e for e in events
                if e.get("cat") in LAUNCH_CATEGORIES and start <= e["ts"] <= end
                and isinstance(e.get("args"), dict) and "correlation" in e["args"]}
    work = sorted((e for e in events if e.get("cat") in DEVICE_CATEGORIES
                   and e.get("args", {}).get("correlation") in launches), key=lambda e: e["ts"])
    report = {"range": name, "host_us": end - start, "device_ops": len(work), "span_us": 0.0, "busy_us": 0.0,
              "idle_us": 0.0, "host_bound_us": 0.0, "gaps": [], "syncs": {}}
    syncs = defaultdict(lambda: [0, 0.0])
    for e in events:
        if e.get("cat") in LAUNCH_CATEGORIES and e.get("name") in SYNC_CALLS and start <= e["ts"] <= end:
            syncs[e["name"]][0] += 1
            syncs[e["name"]][1] += e.get("dur", 0)
    report["syncs"] = {k: {"calls": c, "us": round(us, 1)} for k, (c, us) in sorted(syncs.items())}
    if not work:
        return report
    host = [e for e in events if e.get("cat") in HOST_CATEGORIES and e.get("name") != name
            and e["ts"] <= end and e["ts"] + e.get("dur", 0) >= start]
    ran_to = work[0]["ts"]
    for op in work:
        gap = op["ts"] - ran_to
        if gap > min_gap_us:
            launch = launches[op["args"]["correlation"]]
            waited = launch["ts"] + LAUNCH_SLACK_US >= ran_to
            report["gaps"].append({"us": gap, "host_bound": waited, "before": op["name"],
                                   "issuer": innermost(host, launch.get("tid"), launch["ts"])})
        if gap > 0:
            report["idle_us"] += gap
        report["busy_us"] += max(0.0, op["ts"] + op.get("dur", 0) - max(op["ts"], ran_to))
        ran_to = max(ran_to, op["ts"] + op.get("dur", 0))
    report["span_us"] = ran_to - work[0]["ts"]
    report["host_bound_us"] = sum(g["us"] for g in report["gaps"] if g["host_bound"])
    return report


def by_issuer(gaps: list[dict]) -> list[tuple[str, int, float]]:
    """Host-bound gaps grouped by their issuer: (issuer, count, microseconds), largest first."""
    groups = defaultdict(lambda: [0, 0.0])
    for g in gaps:
        if g["host_bound"]:
            groups[g["issuer"]][0] += 1
            groups[g["issuer"]][1] += g["us"]
    return sorted(((k, c, us) for k, (c, us) in groups.items()), key=lambda row: -row[2])


def render(report: dict, rows: int) -> str:
    def ms(us: float) -> str:
        return f"{us / 1e3:.3f} ms"

    lines = [f"range {report['range'] or '(whole trace)'}: host {ms(report['host_us'])}, "
             f"{report['device_ops']} device ops",
             f"device span {ms(report['span_us'])}, busy {ms(report['busy_us'])}, idle {ms(report['idle_us'])} "
             f"(waiting for the host {ms(report['host_bound_us'])})"]
    grouped = by_issuer(report["gaps"])
    if grouped:
        lines.append(f"{'host-bound gaps by issuer':<64} {'gaps':>5} {'ms':>8}")
        lines += [f"{name[:64]:<64} {count:>5} {us / 1e3:>8.3f}" for name, count, us in grouped[:rows]]
    for name, s in report["syncs"].items():
        lines.append(f"sync {name}: {s['calls']} calls, {ms(s['us'])}")
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("trace", help="Chrome trace JSON written by torch.profiler")
    p.add_argument("--range", help="a record_function name (default: the whole trace)")
    p.add_argument("--occurrence", type=int, default=-1, help="which occurrence of the range (default: the last)")
    p.add_argument("--min-gap-us", type=float, default=1.0, help="shorter gaps are counted as idle, not listed")
    p.add_argument("--rows", type=int, default=25)
    p.add_argument("--json", help="also write the report (with every gap) to this file")
    args = p.parse_args(argv)
    report = analyse(load_events(args.trace), args.range, args.occurrence, args.min_gap_us)
    print(render(report, args.rows))
    if args.json:
        from iga_ds.files import atomic_write_json

        atomic_write_json(args.json, report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
