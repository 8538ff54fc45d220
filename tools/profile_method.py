"""Where the IGA method's time goes: a torch.profiler table of the batched path on LLaMA-2-7B shapes.

    python tools/profile_method.py [--rows 30] [--precision ieee|tf32|bf16] [--batch-bytes 4294967296]
        [--projection tangent|svd] [--power-iters 2] [--oversample 10] [--factors chain_rule|split] [--trace FILE]

Prints the CUDA kernels (or CPU ops without CUDA) sorted by total device time, for one
`batched_iga` call over the 128 q/k/v/o modules after a warm-up call, then the call's wall
time against the device's busy time (median of ``--reps`` calls): when the wall time is the
larger, the host issues launches slower than the device runs them. ``--trace FILE`` also writes
the profiled call's Chrome trace, its call inside the range ``method``, for ``trace_gaps.py``:

    python tools/profile_method.py --precision bf16 --trace method_trace.json
    python tools/trace_gaps.py method_trace.json --range method
"""
from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))  # bench/common.py: the shared shapes and timers
from common import (
    SMALL, batch_bytes_option, environment, environment_line, gpu_busy_ms, lora_shapes, make_modules, model_config,
    synchronize, time_ms,
)
from iga_ds.methods import sketch_key
from iga_ds.methods.iga.batched import batched_iga
from iga_ds.methods.iga.options import IGAOptions


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rows", type=int, default=30)
    p.add_argument("--precision", choices=("ieee", "tf32x3", "tf32", "bf16"), default="ieee",
                   help="the tile kernel's precision (batched_iga's triton_precision)")
    p.add_argument("--batch-bytes", type=batch_bytes_option, default="auto",
                   help="bytes of masked matrices per stack, or 'auto' (the training default)")
    p.add_argument("--reps", type=int, default=5, help="timed calls for the wall and busy times")
    p.add_argument("--projection", choices=("tangent", "svd"), default="tangent",
                   help="the shipped update (iga: tangent) or the paper's rank-r truncation (iga_svd: svd)")
    p.add_argument("--power-iters", type=int, default=None, help="svd: power iterations (default 2)")
    p.add_argument("--oversample", type=int, default=None, help="svd: sketch columns beyond the rank (default 10)")
    p.add_argument("--factors", choices=("chain_rule", "split"), default=None,
                   help="svd: how the rank-r direction becomes factor gradients (default chain_rule)")
    p.add_argument("--small", action="store_true")
    p.add_argument("--trace", metavar="FILE", help="also write the profiled call's Chrome trace (range 'method')")
    args = p.parse_args(argv)
    truncation = {k: v for k, v in (("power_iters", args.power_iters), ("oversample", args.oversample),
                                    ("factors", args.factors)) if v is not None}
    try:  # the truncation's flags act under --projection svd only, and are refused otherwise
        options = IGAOptions(projection=args.projection, **truncation)
    except ValueError as exc:
        p.error(str(exc))
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    config = model_config(layers=SMALL["layers"], hidden=SMALL["hidden"]) if args.small else model_config()
    modules = make_modules(lora_shapes(config), rank=16, alpha=32.0, domains=4, device=device)
    print(environment_line(environment(device)), flush=True)
    precision = args.precision if device.type == "cuda" else "ieee"

    def run():
        gens = [sketch_key(0, 1, m.index) if options.projection == "svd" else None for m in modules]
        return batched_iga(modules, options, generators=gens, batch_bytes=args.batch_bytes,
                           triton_precision=precision)

    run()
    synchronize(device)
    activities = [torch.profiler.ProfilerActivity.CPU]
    if device.type == "cuda":
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    with torch.profiler.profile(activities=activities) as prof:
        with torch.profiler.record_function("method"):
            run()
        synchronize(device)
    if args.trace:
        prof.export_chrome_trace(args.trace)
    key = "cuda_time_total" if device.type == "cuda" else "cpu_time_total"
    print(prof.key_averages().table(sort_by=key, row_limit=args.rows, max_name_column_width=60))
    wall = statistics.median(time_ms(run, device, warmup=1, reps=args.reps, clock="wall"))
    shown = f", power_iters {options.power_iters}, oversample {options.oversample}, factors {options.factors}"
    line = (f"{len(modules)} modules, projection {options.projection}, precision {precision}, batch_bytes "
            f"{args.batch_bytes}{shown if options.projection == 'svd' else ''}: wall {wall:.2f} ms")
    if device.type == "cuda":
        busy = statistics.median(gpu_busy_ms(run) for _ in range(args.reps))
        line += f", device busy {busy:.2f} ms"
    print(line)
    return 0


if __name__ == "__main__":
    sys.exit(main())
