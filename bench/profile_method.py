"""Where the IGA method's time goes: a torch.profiler table of the fused path on LLaMA-2-7B shapes.

    python bench/profile_method.py [--rows 30]

Prints the CUDA kernels (or CPU ops without CUDA) sorted by total device time, for one
`batched_iga` call over the 128 q/k/v/o modules after a warm-up call.
"""
from __future__ import annotations

import argparse
import sys

import torch

from common import SMALL, environment, environment_line, lora_shapes, make_modules, model_config, synchronize
from iga_ds.methods import module_generator
from iga_ds.methods.iga.fused import batched_iga


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rows", type=int, default=30)
    p.add_argument("--small", action="store_true")
    args = p.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    config = model_config(layers=SMALL["layers"], hidden=SMALL["hidden"]) if args.small else model_config()
    modules = make_modules(lora_shapes(config), rank=16, alpha=32.0, domains=4, device=device)
    print(environment_line(environment(device)), flush=True)

    def run():
        gens = [module_generator(0, 1, m.index, device) for m in modules]
        return batched_iga(modules, generators=gens)

    run()
    synchronize(device)
    activities = [torch.profiler.ProfilerActivity.CPU]
    if device.type == "cuda":
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    with torch.profiler.profile(activities=activities) as prof:
        run()
        synchronize(device)
    key = "cuda_time_total" if device.type == "cuda" else "cpu_time_total"
    print(prof.key_averages().table(sort_by=key, row_limit=args.rows, max_name_column_width=60))
    return 0


if __name__ == "__main__":
    sys.exit(main())
