"""Throughput of the procedural isomer generator (target: >= 5,000 groups/s on one core).

Usage: python bench/bench_synth.py [--groups 20000] [--repeat 3] [--shortcut 0.9]
Prints the best of ``--repeat`` runs of ``iga_ds.data.synth.synthesize`` writing to a
temporary directory, files and manifest included.
"""
from __future__ import annotations

import argparse
import tempfile
import time

from iga_ds.data.synth import synthesize


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--groups", type=int, default=20000)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--shortcut", type=float, default=0.9)
    args = parser.parse_args()
    rates = []
    for _ in range(args.repeat):
        with tempfile.TemporaryDirectory() as out:
            start = time.perf_counter()
            synthesize(out, args.groups, seed=0, shortcut=args.shortcut)
            rates.append(args.groups / (time.perf_counter() - start))
    best = max(rates)
    print(f"synth: {best:,.0f} groups/s (best of {args.repeat}; runs: "
          + ", ".join(f"{r:,.0f}" for r in rates) + f"; {args.groups} groups, 4 domains)")
    print("target >= 5,000 groups/s on one core:", "met" if best >= 5000 else "NOT met")


if __name__ == "__main__":
    main()
