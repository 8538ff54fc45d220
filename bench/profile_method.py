"""Where the IGA method's time goes: a torch.profiler table of the fused path on LLaMA-2-7B shapes.

    python bench/profile_method.py [--rows 30]

Prints the CUDA kernels (or CPU ops without CUDA) sorted by total device time, for one
`batched_iga` call over the 128 q/k/v/o modules after a warm-up call.
"""
from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from bench_method import SMALL, lora_shapes, make_modules  # noqa: E402
from iga_ds.lora.fused import batched_iga  # noqa: E402
from iga_ds.methods import module_generator  # noqa: E402

LLAMA2_7B = {"hidden_size": 4096, "num_attention_heads": 32, "num_key_value_heads": 32, "num_hidden_layers": 32}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rows", type=int, default=30)
    p.add_argument("--small", action="store_true")
    args = p.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    config = dict(LLAMA2_7B)
    if args.small:
        config.update(num_hidden_layers=SMALL["layers"], hidden_size=SMALL["hidden"], num_attention_heads=8,
                      num_key_value_heads=8)
    modules = make_modules(lora_shapes(config), rank=16, alpha=32.0, domains=4, device=device)

    def run():
        gens = [module_generator(0, 1, m.index, device) for m in modules]
        return batched_iga(modules, generators=gens)

    run()
    if device.type == "cuda":
        torch.cuda.synchronize()
    activities = [torch.profiler.ProfilerActivity.CPU]
    if device.type == "cuda":
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    with torch.profiler.profile(activities=activities) as prof:
        run()
        if device.type == "cuda":
            torch.cuda.synchronize()
    key = "cuda_time_total" if device.type == "cuda" else "cpu_time_total"
    print(prof.key_averages().table(sort_by=key, row_limit=args.rows, max_name_column_width=60))
    return 0


if __name__ == "__main__":
    sys.exit(main())
