"""Throughput of the procedural isomer generator (target: >= 5,000 groups/s on one core).

Usage: python bench/bench_synth.py [--groups 20000] [--repeat 3] [--shortcut 0.9]
Prints the best of ``--repeat`` runs of ``iga_ds.data.synth.synthesize`` writing to a
temporary directory, files and manifest included, per second of CPU time of this process
(what one core delivers, unaffected by other jobs on a shared machine) and per second of
wall-clock time.
"""
from __future__ import annotations

import argparse
import tempfile
import time

from common import environment, environment_line
from iga_ds.data.synth import synthesize


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--groups", type=int, default=20000)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--shortcut", type=float, default=0.9)
    args = parser.parse_args()
    print(environment_line(environment("cpu")), flush=True)
    cpu_rates, wall_rates = [], []
    for _ in range(args.repeat):
        with tempfile.TemporaryDirectory() as out:
            wall, cpu = time.perf_counter(), time.process_time()
            synthesize(out, args.groups, seed=0, shortcut=args.shortcut)
            cpu_rates.append(args.groups / (time.process_time() - cpu))
            wall_rates.append(args.groups / (time.perf_counter() - wall))
    best = max(cpu_rates)
    print(f"synth: {best:,.0f} groups per CPU second, {max(wall_rates):,.0f} groups per wall second "
          f"(best of {args.repeat}; {args.groups} groups, 4 domains, shortcut {args.shortcut})")
    print("target >= 5,000 groups/s on one core:", "met" if best >= 5000 else "NOT met")


if __name__ == "__main__":
    main()
