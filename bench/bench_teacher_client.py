"""Requests per second of the teacher client against a local zero-latency server.

Usage: python bench/bench_teacher_client.py [--concurrency 64] [--requests 4000] [--repeat 3]
                                            [--seeds 150] [--out JSON]

The server is an asyncio HTTP/1.1 server (keep-alive, no delay) in a process of its own,
answering every chat-completions request at once: the three prompts of the pipeline with
replies that pass it, anything else with "ok". Three rows, each the median of ``--repeat`` runs:

- ``server alone``: a raw asyncio client (``--concurrency`` connections, a few lines per
  request) against the server: what the server can serve on this machine, so that the rows
  below are known not to be limited by it;
- ``OpenAIChatClient``: ``--concurrency`` threads sharing one client (httpx, a keep-alive
  connection per thread), each sending chat requests until ``--requests`` are done;
- ``pipeline``: ``iga_ds.data.teacher.pipeline.build`` of ``--seeds`` seeds at concurrency
  ``--concurrency`` (9 requests a seed, parsing, filters, one fsync'd write a seed).

Prints the machine (CPU model, cores, load before and after) and a table.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import re
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from iga_ds.data.teacher.clients import OpenAIChatClient
from iga_ds.data.teacher.pipeline import BuildSettings, build

DAG = {"nodes": [{"id": "a", "type": "PROPOSITION", "description": "premise"},
                 {"id": "b", "type": "PROPOSITION", "description": "conclusion"},
                 {"id": "g", "type": "GOAL", "description": "is b true"}],
       "edges": [{"from": "a", "to": "b", "label": "IMPLIES"}, {"from": "g", "to": "b", "label": "REQUIRES"}],
       "step_count": 2, "logical_form": "modus ponens"}
STEPS = [{"text": "premise holds", "uses": [], "derives": "a"},
         {"text": "so the conclusion holds", "uses": ["a"], "derives": "b"}]
MESSAGES = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "hello"}]


def reply_for(body: bytes) -> str:
    """The pipeline's three prompts get replies that pass it; anything else "ok"."""
    if b"extracting logical structure" in body:
        return json.dumps(DAG)
    if b"creating domain-specific" in body:
        domain = re.search(rb"Target domain: (\w+)", body)
        name = domain[1].decode() if domain else "math"
        return json.dumps({"problem": f"A {name} problem: if a then b; a. Is b true?", "cot_solution": STEPS,
                           "answer": "yes", "alignment_score": 0.9})
    if b"rigorous logical reasoning evaluator" in body:
        return "1. yes\n2. yes\n3. yes\nScore: 0.93\nVerdict: PASS"
    return "ok"


class ChatServer(asyncio.Protocol):
    """One keep-alive connection: parse each request by its Content-Length, answer at once."""

    def connection_made(self, transport):
        self.transport, self.buffer = transport, b""
        transport.get_extra_info("socket").setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def data_received(self, data: bytes) -> None:
        self.buffer += data
        while (end := self.buffer.find(b"\r\n\r\n")) >= 0:
            length = re.search(rb"(?i)\r\ncontent-length:\s*(\d+)", self.buffer[:end + 2])
            total = end + 4 + (int(length[1]) if length else 0)
            if len(self.buffer) < total:
                return
            body, self.buffer = self.buffer[end + 4:total], self.buffer[total:]
            payload = json.dumps({"id": "x", "object": "chat.completion", "choices": [
                {"index": 0, "finish_reason": "stop", "message": {"role": "assistant", "content": reply_for(body)}}]})
            data = payload.encode()
            self.transport.write(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n"
                                 % len(data) + data)


def serve() -> None:
    """Run the server on a free port of 127.0.0.1; print the port; serve until stdin closes."""
    async def main():
        loop = asyncio.get_running_loop()
        server = await loop.create_server(ChatServer, "127.0.0.1", 0, backlog=1024)
        print(server.sockets[0].getsockname()[1], flush=True)
        await loop.run_in_executor(None, sys.stdin.read)  # the parent closes it to stop us
        server.close()

    asyncio.run(main())


async def _raw_load(port: int, connections: int, requests: int) -> None:
    body = json.dumps({"model": "m", "messages": MESSAGES}).encode()
    request = (b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
               b"Content-Length: %d\r\n\r\n" % len(body)) + body
    left = [requests]

    async def one_connection():
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        while left[0] > 0:
            left[0] -= 1
            writer.write(request)
            head = await reader.readuntil(b"\r\n\r\n")
            await reader.readexactly(int(re.search(rb"(?i)content-length:\s*(\d+)", head)[1]))
        writer.close()

    await asyncio.gather(*(one_connection() for _ in range(connections)))


def time_server_alone(port: int, concurrency: int, requests: int) -> float:
    start = time.perf_counter()
    asyncio.run(_raw_load(port, concurrency, requests))
    return time.perf_counter() - start


def time_client(url: str, concurrency: int, requests: int) -> float:
    left, lock = [requests], threading.Lock()
    with OpenAIChatClient(url, "m", max_retries=0, timeout=30) as client:
        client.chat(MESSAGES)  # the pool warmed by one request

        def worker():
            while True:
                with lock:
                    if left[0] <= 0:
                        return
                    left[0] -= 1
                assert client.chat(MESSAGES) == "ok"

        threads = [threading.Thread(target=worker) for _ in range(concurrency)]
        start = time.perf_counter()
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        return time.perf_counter() - start


def time_pipeline(url: str, concurrency: int, seeds: int) -> tuple[float, int]:
    """Seconds for a build of ``seeds`` seeds, and the requests it made."""
    with tempfile.TemporaryDirectory() as tmp, \
            OpenAIChatClient(url, "m", max_retries=0, timeout=30) as client:
        path = Path(tmp, "seeds.jsonl")
        path.write_text("".join(json.dumps({"seed_id": f"s{i}", "problem": f"if a then b; a. b? #{i}"}) + "\n"
                                for i in range(seeds)))
        start = time.perf_counter()
        stats = build(path, Path(tmp, "out"), client, BuildSettings(model="m"), concurrency=concurrency,
                      progress=False)
        seconds = time.perf_counter() - start
        assert stats["pending_seeds"] == 0, stats
        return seconds, stats["this_run"]["requests"]


def machine() -> dict:
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as fh:
            cpu = next((line.split(":", 1)[1].strip() for line in fh if line.startswith("model name")), cpu)
    except OSError:
        pass
    usable = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return {"cpu": cpu, "cores": os.cpu_count(), "usable_cores": usable,
            "load_1m_5m_15m": [round(x, 2) for x in os.getloadavg()]}


def measure(args, port: int) -> list[dict]:
    from common import spread  # imports torch: not in the server's process, which must start fast

    url = f"http://127.0.0.1:{port}/v1"
    runs: dict[str, list[tuple[float, int]]] = {"server alone": [], "OpenAIChatClient": [], "pipeline": []}
    for rep in range(args.repeat):
        runs["server alone"].append((time_server_alone(port, args.concurrency, args.requests), args.requests))
        runs["OpenAIChatClient"].append((time_client(url, args.concurrency, args.requests), args.requests))
        if args.seeds:
            runs["pipeline"].append(time_pipeline(url, args.concurrency, args.seeds))
        print(f"  repeat {rep + 1}: " + ", ".join(f"{k} {n / s:,.0f} req/s" for k, v in runs.items() if v
                                                 for s, n in v[-1:]), flush=True)
    rows = []
    for what, timed in runs.items():
        if timed:
            rates = [n / s for s, n in timed]
            s = spread(rates)
            rows.append({"what": what, "concurrency": args.concurrency, "requests": timed[0][1],
                         "rates": rates, "median": s["median"], "min": s["min"], "max": s["max"]})
    return rows


def table(rows: list[dict]) -> str:
    head = f"| {'what':<16} | {'concurrency':>11} | {'requests':>8} | {'requests/s (median)':>19} | {'min-max':>13} |"
    lines = [head, "|" + "|".join("-" * (len(c) + 2) for c in head.strip("| ").split(" | ")) + "|"]
    for r in rows:
        lines.append(f"| {r['what']:<16} | {r['concurrency']:>11} | {r['requests']:>8,} | {r['median']:>19,.0f} | "
                     f"{r['min']:>6,.0f}-{r['max']:<6,.0f} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--concurrency", type=int, default=64, help="threads (and connections) in flight")
    parser.add_argument("--requests", type=int, default=4000, help="requests per timed run")
    parser.add_argument("--repeat", type=int, default=3, help="timed runs per row")
    parser.add_argument("--seeds", type=int, default=150, help="seeds of the pipeline row (0: no pipeline row)")
    parser.add_argument("--serve", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--out", help="write the results as JSON here")
    args = parser.parse_args()
    if args.serve:
        return serve()
    import httpx
    from common import environment, environment_line

    before = machine()
    print(environment_line(environment("cpu")) + f" | httpx {httpx.__version__}")
    print(f"machine: {before['cpu']}, {before['cores']} cores ({before['usable_cores']} usable), "
          f"load {before['load_1m_5m_15m']}", flush=True)
    server = subprocess.Popen([sys.executable, __file__, "--serve"], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                              text=True)
    try:
        rows = measure(args, int(server.stdout.readline()))
    finally:
        server.stdin.close()
        server.wait(timeout=30)
    after = machine()["load_1m_5m_15m"]
    print(f"\nzero-latency local server in its own process; median of {args.repeat}; "
          f"load before {before['load_1m_5m_15m']}, after {after}")
    print(table(rows))
    if args.out:
        with open(args.out, "w", encoding="utf-8") as fh:
            json.dump({"machine": before, "load_after": after, "environment": environment("cpu"),
                       "httpx": httpx.__version__, "args": vars(args), "rows": rows}, fh, indent=2)


if __name__ == "__main__":
    main()
