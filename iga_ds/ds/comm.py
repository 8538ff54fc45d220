"""Every collective the hook runs, in one place, on one process group with its own timeout."""
from __future__ import annotations

import datetime

import torch
import torch.distributed as dist


class Collectives:
    """Collectives over the data-parallel ranks; single-process when torch.distributed is off."""

    def __init__(self, ranks: list[int] | None = None, timeout_s: float = 600.0):
        self.enabled = dist.is_available() and dist.is_initialized()
        self.group = None
        if self.enabled:
            # A group of our own carries our timeout: a dead rank makes the others fail
            # within timeout_s instead of hanging until the launcher's timeout.
            self.group = dist.new_group(ranks=ranks, timeout=datetime.timedelta(seconds=timeout_s))
            self.rank = dist.get_rank(self.group)
            self.world_size = dist.get_world_size(self.group)
            self.backend = dist.get_backend(self.group)
        else:
            self.rank, self.world_size, self.backend = 0, 1, "none"

    def all_reduce_sum(self, tensor: torch.Tensor) -> torch.Tensor:
        if self.world_size > 1:
            dist.all_reduce(tensor, op=dist.ReduceOp.SUM, group=self.group)
        return tensor

    def all_reduce_max(self, tensor: torch.Tensor) -> torch.Tensor:
        if self.world_size > 1:
            dist.all_reduce(tensor, op=dist.ReduceOp.MAX, group=self.group)
        return tensor

    def reduce_scatter_sum(self, flat: torch.Tensor) -> torch.Tensor:
        """Sum ``flat`` (world_size equal chunks) over ranks; return this rank's chunk."""
        chunks = flat.view(self.world_size, -1)
        if self.world_size == 1:
            return chunks[0]
        if self.backend == "nccl":
            out = torch.empty_like(chunks[0])
            dist.reduce_scatter_tensor(out, flat, op=dist.ReduceOp.SUM, group=self.group)
            return out
        # gloo has no reduce-scatter: all-reduce, keep our chunk (same result, more traffic)
        dist.all_reduce(flat, op=dist.ReduceOp.SUM, group=self.group)
        return chunks[self.rank]

    def all_gather(self, chunk: torch.Tensor) -> torch.Tensor:
        """Concatenate equal-sized chunks from every rank, in rank order."""
        if self.world_size == 1:
            return chunk.clone()
        out = torch.empty(self.world_size * chunk.numel(), dtype=chunk.dtype, device=chunk.device)
        if self.backend == "nccl":
            dist.all_gather_into_tensor(out, chunk, group=self.group)
        else:
            dist.all_gather(list(out.view(self.world_size, -1).unbind(0)), chunk, group=self.group)
        return out

    def destroy(self) -> None:
        if self.group is not None and dist.is_initialized():
            dist.destroy_process_group(self.group)
            self.group = None
