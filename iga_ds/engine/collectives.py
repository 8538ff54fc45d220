"""Every collective the hook runs, in one place, on one process group with its own timeout."""
from __future__ import annotations

import datetime

import torch
import torch.distributed as dist


class Pending:
    """A collective in flight; ``wait()`` returns its result.

    Under NCCL the wait makes the current CUDA stream wait for the collective, not the host,
    so work queued after it still overlaps with collectives started later.
    """

    def __init__(self, result: torch.Tensor, work=None):
        self._result, self._work = result, work

    def wait(self) -> torch.Tensor:
        if self._work is not None:
            self._work.wait()
            self._work = None
        return self._result


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

    def start_reduce_scatter_sum(self, flat: torch.Tensor) -> Pending:
        """Start summing ``flat`` (world_size equal chunks) over ranks; the result is this rank's chunk."""
        chunks = flat.view(self.world_size, -1)
        if self.world_size == 1:
            return Pending(chunks[0])
        if self.backend == "nccl":
            out = torch.empty_like(chunks[0])
            work = dist.reduce_scatter_tensor(out, flat, op=dist.ReduceOp.SUM, group=self.group, async_op=True)
            return Pending(out, work)
        # gloo has no reduce-scatter: all-reduce, keep our chunk (same result, more traffic)
        work = dist.all_reduce(flat, op=dist.ReduceOp.SUM, group=self.group, async_op=True)
        return Pending(chunks[self.rank], work)

    def start_all_gather(self, chunk: torch.Tensor, out: torch.Tensor | None = None) -> Pending:
        """Start concatenating equal-sized chunks from every rank, in rank order, into ``out``
        (a new tensor when None)."""
        if out is None:
            out = torch.empty(self.world_size * chunk.numel(), dtype=chunk.dtype, device=chunk.device)
        elif out.numel() != self.world_size * chunk.numel():
            raise ValueError(f"all-gather output holds {out.numel()} elements, expected "
                             f"{self.world_size} x {chunk.numel()}")
        if self.world_size == 1:
            out.copy_(chunk.reshape(-1))
            return Pending(out)
        if self.backend == "nccl":
            work = dist.all_gather_into_tensor(out, chunk, group=self.group, async_op=True)
        else:
            work = dist.all_gather(list(out.view(self.world_size, -1).unbind(0)), chunk, group=self.group,
                                   async_op=True)
        return Pending(out, work)

    def destroy(self) -> None:
        if self.group is not None and dist.is_initialized():
            dist.destroy_process_group(self.group)
            self.group = None
