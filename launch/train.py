#!/usr/bin/env python
"""Entry script for the DeepSpeed launcher (and torchrun, srun, mpirun):

    deepspeed --num_gpus 8 launch/train.py --config configs/llama2_7b_iga.yaml --deepspeed ds_configs/zero2.json
    deepspeed --hostfile hosts launch/train.py --config CFG.yaml --deepspeed ds_configs/zero2.json

Ranks come from the launcher's variables, then SLURM_*, then OMPI_* (iga_ds.cluster.ranks).
Exit codes: 0 done or stopped by SIGUSR1/SIGTERM after a checkpoint, 2 bad input.
"""
from __future__ import annotations

import argparse
import sys


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", required=True, help="run YAML")
    parser.add_argument("--deepspeed", default=None, help="DeepSpeed JSON (overrides the YAML's `deepspeed`)")
    parser.add_argument("--local_rank", "--local-rank", type=int, default=None, help="set by the DeepSpeed launcher")
    parser.add_argument("overrides", nargs="*", metavar="KEY=VALUE")
    args = parser.parse_args(argv)

    from iga_ds.errors import UserError

    try:
        from iga_ds.config.run import load_run_config
        from iga_ds.train.trainer import train

        overrides = list(args.overrides) + ([f"deepspeed={args.deepspeed}"] if args.deepspeed else [])
        result = train(load_run_config(args.config, overrides), local_rank=args.local_rank)
    except UserError as exc:
        print(f"launch/train.py: error: {exc}", file=sys.stderr)
        return exc.exit_code
    import torch.distributed as dist

    if dist.is_initialized():  # this process is done with it: exit without live group threads
        dist.destroy_process_group()
    return 0 if result.status in ("completed", "stopped") else 1


if __name__ == "__main__":
    sys.exit(main())
