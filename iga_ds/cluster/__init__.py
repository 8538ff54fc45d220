"""Starting jobs: rank resolution for every launcher, Slurm hostfiles, and ``iga-ds selfcheck``.

The trainer calls::

    from iga_ds.cluster.ranks import apply_dist_env, resolve_dist_env
    env = resolve_dist_env(local_rank=args.local_rank)   # --local_rank from the DeepSpeed launcher
    apply_dist_env(env)                                   # RANK, WORLD_SIZE, ... for env://
    deepspeed.init_distributed(dist_backend=...)

Once the process group is up, the trainer also starts ``iga_ds.cluster.liveness.PeerWatch``:
heartbeats beside the group, so that a lost rank is named within the configured timeout
instead of leaving the others waiting in a collective.

Nothing here imports torch at module level, so ``iga-ds --help`` stays fast.
"""
from __future__ import annotations

from iga_ds.cluster.nodelist import expand_nodelist, expand_tasks_per_node, hostfile_text
from iga_ds.cluster.ranks import DistEnv, apply_dist_env, resolve_dist_env

__all__ = [
    "DistEnv",
    "apply_dist_env",
    "expand_nodelist",
    "expand_tasks_per_node",
    "hostfile_text",
    "resolve_dist_env",
]
