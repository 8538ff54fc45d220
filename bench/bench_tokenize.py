"""Tokenizing a training set the paper's size once, through the trainer's Dataset.map path.

Usage: python bench/bench_tokenize.py [--groups 39000] [--procs 1,2] [--repeat 3]
                                      [--max-length 512] [--tokenizer HF_TOKENIZER_FOLDER] [--out JSON]

Generates ``--groups`` isomer groups of 4 domains with the procedural generator (39,000 groups:
156,000 records, the paper's size), then times ``iga_ds.train.batching.tokenize_groups``, what
the trainer runs on each node's local rank 0: the prompt and target texts, the cache key, the
``Dataset.map`` of ``encode_example`` with ``num_proc`` processes, ``save_to_disk`` and the
memory-mapped reload. Every timed call starts from an empty cache folder (cold); the process
counts alternate from one repeat to the next, so a change in the machine's load reaches both.
Tokenizers: the built-in tiny base's (its word-level vocabulary, built as the base builds it,
without pretraining the model) and, with ``--tokenizer``, a Hugging Face tokenizer folder.
Prints the machine (CPU model, cores, load) and a table of the median and spread.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import tempfile
import time

from common import environment, environment_line, spread
from iga_ds.data.groups import complete_groups
from iga_ds.data.domains import DEFAULT_DOMAINS
from iga_ds.data.synth import generate_groups
from iga_ds.train.batching import tokenize_groups
from iga_ds.train.model import build_vocab, build_word_tokenizer, load_tokenizer
from iga_ds.train.pretrain import generator_corpus, generator_words


def cpu_model() -> str:
    """The ``model name`` of /proc/cpuinfo (Linux), else what ``platform`` knows."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as fh:
            for line in fh:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def machine() -> dict:
    usable = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return {"cpu": cpu_model(), "cores": os.cpu_count(), "usable_cores": usable,
            "load_1m_5m_15m": [round(x, 2) for x in os.getloadavg()]}


def versions() -> dict:
    import datasets
    import tokenizers

    return {"datasets": datasets.__version__, "tokenizers": tokenizers.__version__}


def time_cold(tokenizer, groups, max_length: int, procs: int) -> float:
    with tempfile.TemporaryDirectory() as cache:
        start = time.perf_counter()
        tokens = tokenize_groups(tokenizer, groups, max_length, cache, procs)
        seconds = time.perf_counter() - start
        assert tokens.built and len(tokens.rows) == sum(len(g) for g in groups)
    return seconds


def time_warm(tokenizer, groups, max_length: int) -> float:
    with tempfile.TemporaryDirectory() as cache:
        tokenize_groups(tokenizer, groups, max_length, cache)
        start = time.perf_counter()
        tokens = tokenize_groups(tokenizer, groups, max_length, cache)
        seconds = time.perf_counter() - start
        assert not tokens.built
    return seconds


def measure(name: str, tokenizer, groups, args) -> list[dict]:
    records = sum(len(g) for g in groups)
    times: dict[int, list[float]] = {p: [] for p in args.procs}
    for rep in range(args.repeat):
        for procs in args.procs if rep % 2 == 0 else args.procs[::-1]:
            times[procs].append(time_cold(tokenizer, groups, args.max_length, procs))
            print(f"  {name}: {procs} process(es), repeat {rep + 1}: {times[procs][-1]:.2f} s", flush=True)
    rows = []
    for procs, seconds in times.items():
        s = spread(seconds)
        rows.append({"tokenizer": name, "records": records, "processes": procs, "seconds": seconds,
                     "median_s": s["median"], "min_s": s["min"], "max_s": s["max"],
                     "records_per_s": records / s["median"]})
    rows.append({"tokenizer": name, "records": records, "processes": "cached", "seconds": [],
                 "median_s": time_warm(tokenizer, groups, args.max_length), "min_s": None, "max_s": None})
    rows[-1]["records_per_s"] = records / rows[-1]["median_s"]
    return rows


def table(rows: list[dict]) -> str:
    head = f"| {'tokenizer':<14} | {'records':>8} | {'processes':>9} | {'median s':>8} | {'min-max s':>13} | {'records/s':>9} |"
    lines = [head, "|" + "|".join("-" * (len(c) + 2) for c in head.strip("| ").split(" | ")) + "|"]
    for r in rows:
        span = f"{r['min_s']:.2f}-{r['max_s']:.2f}" if r["min_s"] is not None else "-"
        lines.append(f"| {r['tokenizer']:<14} | {r['records']:>8,} | {str(r['processes']):>9} | "
                     f"{r['median_s']:>8.2f} | {span:>13} | {r['records_per_s']:>9,.0f} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--groups", type=int, default=39000, help="isomer groups of 4 domains (39,000: 156,000 records)")
    parser.add_argument("--procs", default="1,2", help="Dataset.map num_proc values, comma-separated")
    parser.add_argument("--repeat", type=int, default=3, help="cold tokenizations per process count")
    parser.add_argument("--max-length", type=int, default=512, help="data.max_length")
    parser.add_argument("--tokenizer", help="also a Hugging Face tokenizer folder")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", help="write the results as JSON here")
    args = parser.parse_args()
    args.procs = [int(p) for p in args.procs.split(",") if p.strip()]
    where = machine()
    print(environment_line(environment("cpu")) + " | " + " | ".join(f"{k} {v}" for k, v in versions().items()))
    print(f"machine: {where['cpu']}, {where['cores']} cores ({where['usable_cores']} usable), "
          f"load {where['load_1m_5m_15m']}", flush=True)
    start = time.perf_counter()
    groups = complete_groups(generate_groups(args.groups, args.seed, shortcut=0.9), DEFAULT_DOMAINS)
    print(f"{len(groups)} groups, {sum(len(g) for g in groups):,} records generated in "
          f"{time.perf_counter() - start:.1f} s", flush=True)
    tokenizers = [("tiny base", build_word_tokenizer(build_vocab(generator_corpus(), generator_words())))]
    if args.tokenizer:
        tokenizers.append((os.path.basename(os.path.normpath(args.tokenizer)), load_tokenizer(args.tokenizer)))
    rows = [row for name, tok in tokenizers for row in measure(name, tok, groups, args)]
    after = machine()["load_1m_5m_15m"]
    print(f"\ntokenize_groups, cold cache (Dataset.map + save_to_disk + reload), max_length {args.max_length}, "
          f"median of {args.repeat}; load before {where['load_1m_5m_15m']}, after {after}")
    print(table(rows))
    if args.out:
        with open(args.out, "w", encoding="utf-8") as fh:
            json.dump({"machine": where, "load_after": after, "environment": environment("cpu"),
                       "versions": versions(), "args": vars(args), "rows": rows}, fh, indent=2)


if __name__ == "__main__":
    main()
