#!/usr/bin/env python
"""Entry script for the DeepSpeed launcher (and torchrun, srun, mpirun):

    deepspeed --num_gpus 8 launch/train.py --config configs/llama2_7b_iga.yaml --deepspeed ds_configs/zero2.json
    deepspeed --hostfile hosts launch/train.py --config CFG.yaml --deepspeed ds_configs/zero2.json

``--deepspeed_config JSON`` (DeepSpeed's own flag) is accepted for ``--deepspeed JSON``;
``--dry-run [--world-size N]`` resolves everything and trains nothing.

Ranks come from the launcher's variables, then SLURM_*, then OMPI_* (iga_ds.cluster.ranks).
Exit codes: 0 done, or stopped by SIGUSR1, SIGTERM or SIGINT after a checkpoint; 2 bad input;
3 a rank never came to the rendezvous; 4 a peer rank was lost during training; 5 stopped by a
signal during setup (nothing saved).
"""
from __future__ import annotations

import argparse
import sys

from iga_ds.train.cli import add_deepspeed_arguments, add_dry_run_arguments, deepspeed_overrides, dry_run


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", required=True, help="run YAML")
    add_deepspeed_arguments(parser)
    add_dry_run_arguments(parser)
    parser.add_argument("--local_rank", "--local-rank", type=int, default=None, help="set by the DeepSpeed launcher")
    parser.add_argument("overrides", nargs="*", metavar="KEY=VALUE")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_intermixed_args(argv)  # KEY=VALUE words anywhere

    from iga_ds.errors import UserError

    try:
        from iga_ds.config.run import load_run_config
        from iga_ds.train.trainer import train

        config = load_run_config(args.config, list(args.overrides) + deepspeed_overrides(args))
        if args.dry_run:
            return dry_run(config, args.world_size)
        result = train(config, local_rank=args.local_rank)
    except UserError as exc:
        print(f"launch/train.py: error: {exc}", file=sys.stderr)
        return exc.exit_code
    import torch.distributed as dist

    if dist.is_initialized():  # this process is done with it: exit without live group threads
        dist.destroy_process_group()
    return 0 if result.status in ("completed", "stopped") else 1


if __name__ == "__main__":
    sys.exit(main())
