"""The ZeRO engine hook: per-domain LoRA gradients in, the method's gradient out, before the step.

Flow of one optimizer step (K isomer groups over R ranks and G accumulation micro-steps):

1. Each micro-batch's forward and backward run inside ``micro_batch(domain_ids)``; the
   capture adds each domain's LoRA weight-gradient sums into one flat fp32 buffer laid out
   by owner rank (DeepSpeed's own reduction of the plain gradient goes on untouched).
2. At the accumulation boundary DeepSpeed calls the optimizer's ``step``, which this hook
   wraps: domain counts are summed over ranks; the buffer is reduce-scattered so that each
   module's N sums land on its owner; owners divide by the counts and run the method with a
   sketch seeded by (step, module index), so the result does not depend on the world size;
   an all-gather brings every module's new factor gradients to every rank.
3. The new gradients replace the reduced ones in ZeRO's partitions, then the original step
   runs (clipping and AdamW see the method's gradient).

Everything the hook does to DeepSpeed's objects goes through ``engine.internals``, which
checks at attach that each internal it uses is there. What serves the flow without being it
sits beside it: ``layout`` (where each module's sums and results sit), ``collectives``,
``packing`` (the gathered output), ``float32_copies`` (the factors the method gets),
``finite`` (the device flags of the non-finite check) and ``phase_clock`` (the boundary's
phase times).
"""
from __future__ import annotations

import contextlib
import logging
import time
from dataclasses import dataclass, field
from typing import Iterator

import torch
from torch.profiler import record_function

from iga_ds.config.hook import HookConfig
from iga_ds.engine.collectives import Collectives
from iga_ds.engine.collector import FrozenCollector
from iga_ds.engine.finite import results_finite
from iga_ds.engine.float32_copies import Float32Copies
from iga_ds.engine.internals import (
    FullGradWriter,
    check_engine,
    fuse_gradient_checks,
    lora_gradients_can_be_left_out,
    prepare_backward,
    reuse_zero_gradients,
    skip_optimizer_step,
    stop_reusing_zero_gradients,
    unfuse_gradient_checks,
    unwrap_step,
    wrap_step,
    written_gradient_lost,
)
from iga_ds.engine.layout import build_layout
from iga_ds.engine.packing import OutputPacking
from iga_ds.engine.phase_clock import PhaseClock
from iga_ds.errors import ConfigError
from iga_ds.lora.capture import DomainGradientCapture
from iga_ds.lora.modules import LoraModule, find_lora_modules
from iga_ds.methods.base import ModuleGrads
from iga_ds.methods.device_copies import host_to_device
from iga_ds.methods.iga.tiles import StableModules
from iga_ds.metrics.mask import aggregate_module_stats

log = logging.getLogger(__name__)


class EngineHook(OutputPacking):
    """Attach with :func:`attach`; see the package docstring for the training loop. The
    packing of the gathered output is :class:`~iga_ds.engine.packing.OutputPacking`'s."""

    def __init__(self, engine, config: HookConfig):
        self.engine = engine
        self.config = config
        self.method = config.build_method()
        # the per-module statistics the method declares, carried back from owners in fixed slots
        self.stat_keys = tuple(stat.name for stat in self.method.statistics if stat.combine != "model")
        self.modules: list[LoraModule] = []
        if self.method.needs_domain_gradients:
            self.modules = find_lora_modules(engine.module)
            if not self.modules:
                raise ConfigError("the model has no trainable LoRA linear layers: wrap it with peft.get_peft_model "
                                  "first")
        # before anything is changed: every DeepSpeed internal used below is there
        check_engine(engine, self.method.needs_domain_gradients, self._factors())
        self.num_domains = config.num_domains
        # a method that asks for halves gets 2N means, domain n's halves of the step's groups at n and N + n
        self.domain_halves = bool(self.method.domain_halves)
        self.num_slots = 2 * self.num_domains if self.domain_halves else self.num_domains
        self.device = torch.device(engine.device)
        self._stats: dict = {}
        self._loss_finite: torch.Tensor | None = None  # device flag: no host sync per micro-batch
        self.skipped_last_step = False
        self.skipped_steps = 0
        self.writes = 0  # optimizer steps whose gradient the hook wrote
        self.check_every_steps = config.check_every_steps  # iga.check_every_steps
        self._micro_batch_seconds = 0.0
        self.comm = Collectives(timeout_s=config.timeout_s)
        self.capture: DomainGradientCapture | None = None
        if self.method.needs_domain_gradients:
            self._setup_capture()
        # for every method, ERM included: a host-bound step pays for DeepSpeed's per-tensor checks
        self.fused_checks = fuse_gradient_checks(engine.optimizer)
        self._original_step = wrap_step(engine.optimizer, self._boundary_step)
        # IGA's capture would otherwise bring on full collections of every object in the process
        self.collector = FrozenCollector()
        self.collector.start()

    # -- setup ---------------------------------------------------------------------------------
    def _factors(self) -> list[torch.nn.Parameter]:
        """The LoRA factors the method's gradient is written into: A then B of each module."""
        return [w for m in self.modules for w in (m.lora_A.weight, m.lora_B.weight)]

    def _setup_capture(self) -> None:
        lora_ids = {id(p) for m in self.modules for p in (m.lora_A.weight, m.lora_B.weight)}
        others = [n for n, p in self.engine.module.named_parameters() if p.requires_grad and id(p) not in lora_ids]
        if others:
            log.warning("%s acts on LoRA factors only; %d other trainable tensors (e.g. %s) keep the plain gradient",
                        self.method.name, len(others), others[0])
        N, W = self.num_slots, self.comm.world_size
        self.layout = build_layout(self.modules, W, N, num_stats=len(self.stat_keys))
        self.flat_in = torch.zeros(self.layout.in_size, dtype=torch.float32, device=self.device)
        buffers = []
        for m in self.modules:
            off = self.layout.in_offsets[m.index]
            nA, nB = N * m.rank * m.in_features, N * m.out_features * m.rank
            gA = self.flat_in[off: off + nA].view(N, m.rank, m.in_features)
            gB = self.flat_in[off + nA: off + nA + nB].view(N, m.out_features, m.rank)
            buffers.append((gA, gB))
        self.buffers = buffers
        # the method takes the factors in float32; A then B of each module, in module order
        self._weights = Float32Copies(self._factors())
        self._stable_grads: StableModules | None = None  # the modules of every step, where stable (bf16)
        self._writer = FullGradWriter(self._weights.tensors, self.engine.optimizer)
        # the capture owns the factors' gradients where DeepSpeed copes with none from backward:
        # the method's result replaces them at the boundary, so computing and reducing them
        # every micro-batch would be wasted
        owns = lora_gradients_can_be_left_out(self.engine)
        self.capture = DomainGradientCapture(self.modules, buffers, N, owns_gradients=owns,
                                             before_backward=lambda: prepare_backward(self.engine.optimizer),
                                             storage=self.flat_in)
        # ZeRO-2 would allocate a zero gradient for each left-out factor after every backward
        self.reused_zeros = owns and reuse_zero_gradients(self.engine.optimizer, self._weights.tensors)
        self._stat_index = self._stat_positions()
        # the modules this rank combines: fixed for the hook's life
        self.owned = [m for m in self.modules if self.layout.owners[m.index] == self.comm.rank]

    # -- 1. per micro-batch: each domain's gradient sums, captured in backward -----------------
    @contextlib.contextmanager
    def micro_batch(self, domain_ids: torch.Tensor, sequence_lengths=None, halves=None) -> Iterator["EngineHook"]:
        """Run one micro-batch's forward and backward inside this context. ``sequence_lengths``
        (host): a padding-free micro-batch, its sequences back to back in one row with these
        token counts, attributed token by token to their domains. ``halves`` (host, a 0 or 1 per
        sequence): the half of the step's groups each sequence's group is in, which a method with
        ``domain_halves`` needs (ignored otherwise)."""
        if self.capture is None:
            yield self
            return
        batch = int(torch.as_tensor(domain_ids).numel())
        # the loss is a mean over the micro-batch's sequences (packed or not) and DeepSpeed
        # divides it by the accumulation steps
        scale = 1.0 / (batch * self.engine.gradient_accumulation_steps())
        start = time.perf_counter()
        with self.capture.micro_batch(self._capture_slots(domain_ids, halves), scale, sequence_lengths):
            yield self
        self._micro_batch_seconds += time.perf_counter() - start

    def _capture_slots(self, domain_ids, halves):
        """What the capture sums by: each sequence's domain, or with ``domain_halves`` its slot
        domain + N * half (on the host)."""
        if not self.domain_halves:
            return domain_ids
        N = self.num_domains
        ids = torch.as_tensor(domain_ids).reshape(-1).cpu()
        if halves is None:
            raise ValueError(f"method {self.method.name!r} compares two halves of each domain's groups: pass "
                             "micro_batch(domain_ids, halves=...), the half (0 or 1) of each sequence's group")
        halves = torch.as_tensor(halves).reshape(-1).cpu().to(ids.dtype)
        if halves.shape != ids.shape or not bool(((halves == 0) | (halves == 1)).all()):
            raise ValueError(f"halves: expected a 0 or 1 for each of the {ids.numel()} sequences, "
                             f"got {halves.tolist()}")
        if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= N):
            raise ValueError(f"domain ids must be in [0, {N}), got {ids.tolist()}")
        return ids + N * halves

    def dummy_scale(self) -> torch.Tensor | None:
        if self.method.needs_dummy_scale():
            return torch.ones((), requires_grad=True, device=self.device)
        return None

    def objective(self, sequence_losses: torch.Tensor, domain_ids: torch.Tensor, dummy_scale=None) -> torch.Tensor:
        loss = self.method.objective(sequence_losses, domain_ids.to(sequence_losses.device, non_blocking=True),
                                     self.num_domains, dummy_scale)
        # kept on the device and read once at the boundary: a host read here would stall the
        # launch queue before every backward
        finite = torch.isfinite(loss.detach()).all()
        self._loss_finite = finite if self._loss_finite is None else self._loss_finite & finite
        return loss

    # -- 2. at the accumulation boundary: reduce-scatter, combine with the method, all-gather ---
    def _boundary_step(self, *args, **kwargs):
        """The optimizer's step, wrapped: the method's gradient in, then the original step.

        The host waits for the device once here (the non-finite verdict, every flag folded
        into one); anything the host only reports (statistics, phase times) is read after the
        original step has been queued, while the device works on it."""
        step = int(self.engine.global_steps)
        started = time.perf_counter()
        combined = None
        flags = [] if self._loss_finite is None else [self._loss_finite]
        if self.capture is not None:
            with record_function("boundary/combine"):
                combined = self._combine(step)
            flags += combined.finite
        with record_function("boundary/nonfinite_check"):
            bad = self._any_rank_bad(flags, combined is not None and combined.failed)
        self._loss_finite = None
        self.skipped_last_step = bad
        if bad and not self.config.skip_nonfinite:
            raise FloatingPointError(
                f"step {step}: non-finite loss or gradient (set iga.skip_nonfinite: true to skip such steps)")
        if bad:
            self.skipped_steps += 1
            log.warning("step %d: non-finite loss or gradient; skipping the optimizer step", step)
            skip_optimizer_step(self.engine.optimizer)
            result = None
        else:
            if combined is not None and combined.updates is not None:
                with record_function("boundary/write_grads"):
                    self._write(combined.updates, step)
            with record_function("boundary/deepspeed_step"):
                result = self._original_step(*args, **kwargs)
        stats: dict = {"step": step}
        if combined is not None:
            with record_function("boundary/statistics"):
                stats.update(self._report(combined))
            with record_function("boundary/reset"):
                self.capture.reset()
        stats["skipped"] = bad
        # forward and backward of the step's micro-batches, capture included: the capture runs
        # inside autograd and has no clock of its own (bench_step.py derives its cost)
        stats["time/micro_batches_s"] = self._micro_batch_seconds
        stats["time/boundary_s"] = time.perf_counter() - started
        self._micro_batch_seconds = 0.0
        self._stats = stats
        return result

    def _combine(self, step: int) -> "_Combined":
        """Reduce to owners, run the method, gather: every module's (gA, gB) for the write, and
        what the boundary reports once the step is queued."""
        clock = PhaseClock(self.device)
        clock.mark("start")
        counts = self._global_counts()
        self._check_counts(counts, step)
        out = _Combined(clock, counts)
        if self.method.scope == "global":  # every rank needs every module: all-reduce, compute redundantly
            summed = self.comm.all_reduce_sum(self.flat_in)
            clock.mark("received")
            out.results = self._run_method(summed, self.modules, 0, counts, step, out)
            clock.mark("computed")
            out.updates = [(u.gA, u.gB) for u in out.results] or None
        elif self.comm.world_size == 1:  # this rank owns every module: no collective, no packing
            out.results = self._run_method(self.flat_in, self.modules, 0, counts, step, out)
            clock.mark("computed")
            with record_function("boundary/results"):
                out.updates = self._results_direct(self.modules, out.results)
        else:
            out.gathered = self._combine_across_ranks(step, counts, out)
            out.updates = self._unpack(out.gathered)
            clock.mark("gathered")
        return out

    def _global_counts(self) -> torch.Tensor:
        """Sequences per domain in the whole batch, on the host (summed over ranks where
        there are several: one rank has them on the host already)."""
        counts = self.capture.counts
        if self.comm.world_size > 1:
            counts = self.comm.all_reduce_sum(host_to_device(counts, self.device)).cpu()
        return counts.clone()

    def _check_counts(self, counts: torch.Tensor, step: int) -> None:
        """Every domain in the global batch; with ``domain_halves``, in both halves, equally."""
        domains = list(self.config.domains)
        if not self.domain_halves:
            if bool((counts == 0).any()):
                missing = [d for d, c in zip(domains, counts.tolist()) if c == 0]
                raise RuntimeError(f"step {step}: no sequence of domain(s) {missing} in the global batch; "
                                   "each optimizer step needs every domain (whole isomer groups)")
            return
        first, second = counts.view(2, -1).tolist()
        uneven = [f"{d} ({a:g} and {b:g})" for d, a, b in zip(domains, first, second) if a != b or a == 0]
        if uneven:
            raise RuntimeError(f"step {step}: method {self.method.name!r} needs each domain's sequences split in two "
                               f"equal, non-empty halves of the step's groups (an even number of whole groups a "
                               f"step); got {', '.join(uneven)}")

    def _combine_across_ranks(self, step: int, counts: torch.Tensor, out: "_Combined") -> torch.Tensor:
        """Owners combine their modules: the sums reduce-scattered to them, their results
        all-gathered back; returns the gathered output (every module's new gradients and
        statistics), marking on ``out``'s clock when the sums had arrived and the method had
        been run."""
        lay, W, rank = self.layout, self.comm.world_size, self.comm.rank
        gathered = torch.empty(lay.out_size, dtype=torch.float32, device=self.device)
        summed = self.comm.start_reduce_scatter_sum(self.flat_in[: W * lay.in_chunk]).wait()
        out.clock.mark("received")
        results = self._run_method(summed, self.owned, rank * lay.in_chunk, counts, step, out)
        out.clock.mark("computed")
        self.comm.start_all_gather(self._pack(self.owned, results), gathered).wait()
        return gathered

    def _run_method(self, summed: torch.Tensor, mine: list[LoraModule], base: int, counts: torch.Tensor,
                    step: int, out: "_Combined") -> list:
        """The method's results on the modules in ``mine``, whose sums start at ``base`` in
        ``summed``; their finiteness and that of the results go into ``out`` as device flags."""
        if not mine:
            return []
        # the summed buffer holds exactly these modules: one check for all, read with the rest.
        # Their sum is finite exactly when every element is (short of float32 overflow of the
        # sum, at sums above about 1e38): one reduction, where isfinite(summed).all() made four
        # passes over the buffer (0.5 ms of device time a step for LLaMA-2-7B's 128 modules)
        out.finite.append(torch.isfinite(summed.sum()))
        try:
            with record_function("boundary/method"):
                results = self.method.combine(self._module_grads(summed, mine, base, counts), step)
        except Exception:
            # a method may fail on what non-finite sums make of its inputs (an SVD that does
            # not converge): then the step is skipped like any other non-finite one
            if bool(out.finite[-1]):
                raise
            out.failed = True
            return []
        out.finite.append(results_finite(results, self.device))
        return results

    def _module_grads(self, summed: torch.Tensor, mine: list[LoraModule], base: int, counts: torch.Tensor):
        """Per-domain means (sums / global sequence counts) of the modules in ``mine``, as views.

        Scales ``summed`` in place (the buffer is reset after the step). Whole isomer groups give
        every domain the same count: then one multiply covers every module.
        """
        N = self.num_slots
        equal = bool((counts == counts[0]).all())
        if equal:
            summed.mul_(1.0 / float(counts[0]))
        else:
            scale = host_to_device((1.0 / counts).to(torch.float32), self.device).view(-1, 1, 1)
        weights = self._weights.refresh()
        # the capture's own buffers are views of flat_in already (a module's index is its place
        # in self.modules): no slicing per module, while the device waits for the host
        views = self.buffers if summed is self.flat_in else None
        # with the weights' float32 copies too (bf16 training), every tensor is written in place
        # each step: the same modules serve every step, and the method may keep their stacking
        stable = views is not None and equal and self._weights.copies is not None
        if stable and self._stable_grads is not None:
            return self._stable_grads
        grads = []
        for m in mine:
            if views is not None:
                gA, gB = views[m.index]
            else:
                off = self.layout.in_offsets[m.index] - base
                nA, nB = N * m.rank * m.in_features, N * m.out_features * m.rank
                gA = summed[off: off + nA].view(N, m.rank, m.in_features)
                gB = summed[off + nA: off + nA + nB].view(N, m.out_features, m.rank)
            if not equal:
                gA, gB = gA * scale, gB * scale
            # the weights' own dtype is the forward's and backward's (bf16 under DeepSpeed's bf16)
            grads.append(ModuleGrads(m.name, m.index, weights[2 * m.index], weights[2 * m.index + 1], gA, gB,
                                     m.scaling, self._weights.tensors[2 * m.index].dtype))
        if stable:
            self._stable_grads = StableModules(grads)
            return self._stable_grads
        return grads

    def _any_rank_bad(self, flags: list[torch.Tensor], failed: bool) -> bool:
        """Whether any rank saw a non-finite loss, sum or result: the device flags folded into
        one and read once (with every rank's verdict where there are several)."""
        ok = torch.stack([f.reshape(()) for f in flags]).all() if flags else None
        if self.comm.world_size == 1:
            return failed or (ok is not None and not bool(ok))
        flag = torch.zeros(1, dtype=torch.float32, device=self.device) if ok is None else (~ok).float().reshape(1)
        if failed:
            flag.fill_(1.0)
        return bool(self.comm.all_reduce_max(flag).item() > 0)

    # -- 3. write back: the method's gradient where the optimizer's step reads it --------------
    def _write(self, updates: list, step: int) -> None:
        """The method's gradient into the optimizer's; at the first write and every
        ``check_every_steps`` after (0: the first only), read back from where the optimizer's step
        reads it, on every rank: any rank's difference stops every rank with one line."""
        every = self.check_every_steps
        check = self.writes == 0 or (every > 0 and self.writes % every == 0)
        self.writes += 1
        result = self._writer.write([g for pair in updates for g in pair], check=check)
        if result is None:
            return
        difference, tolerance = result
        # every rank's difference in its own slot, so that each can name the ranks that differ
        slots = torch.zeros(self.comm.world_size, dtype=torch.float32, device=self.device)
        slots[self.comm.rank] = torch.where(difference > tolerance, difference, 0.0)
        if self.comm.world_size > 1:
            slots = self.comm.all_reduce_max(slots)
        apart = {rank: value for rank, value in enumerate(slots.tolist()) if value > 0}
        if apart:
            raise written_gradient_lost(self.engine.optimizer, step + 1, list(apart), max(apart.values()))

    # -- what the boundary reports, read once the optimizer step is queued ---------------------
    def _report(self, out: _Combined) -> dict:
        """Statistics and phase times of the combination, read once the step is queued. The
        phases are timed on the device's own clock where there is one (CUDA events: no wait
        while the step is prepared): the communication, until the sums had arrived and after the
        method had been run, and the method's time."""
        if out.gathered is not None:
            per_module = self._unpack_stats(out.gathered)
        elif self.method.scope == "global":
            per_module = {m.name: dict(u.stats) for m, u in zip(self.modules, out.results)}
        else:
            per_module = self._results_stats(self.modules, out.results)
        clock = out.clock
        received = "received" if "received" in clock.marks else "start"
        ended = "gathered" if "gathered" in clock.marks else "computed"
        stats = {
            "time/comm_s": clock.seconds("start", received) + clock.seconds("computed", ended),
            "time/method_s": clock.seconds(received, "computed"),
            "domain_counts": out.counts.tolist(),
            "modules": per_module,
        }
        if self.method.scope == "global" and out.results:
            stats.update({f"method/{k}": v for k, v in out.results[0].stats.items()})
        stats.update(self._summarize(per_module))
        return stats

    def _summarize(self, per_module: dict[str, dict[str, float]]) -> dict[str, float]:
        """Model-level figures, each combined from the modules' as the method declares."""
        mine = [m for m in self.modules if m.name in per_module]
        rules = {stat.name: stat.combine for stat in self.method.statistics if stat.combine != "model"}
        return aggregate_module_stats([per_module[m.name] for m in mine], [m.full_rank_cost for m in mine], rules)

    # -- the method's state, for checkpoints ---------------------------------------------------
    def method_state(self) -> dict[str, torch.Tensor]:
        """This rank's share of the method's state (:meth:`GradientMethod.state_dict`): module
        scope, the entries of the modules it combines; global scope, all of it on rank 0 only
        (every rank holds the same). A checkpoint saves each rank's share and merges them."""
        state = self.method.state_dict()
        if self.method.scope != "module":
            return state if self.comm.rank == 0 else {}
        return {key: t for key, t in state.items() if self._state_owner(key) == self.comm.rank}

    def load_method_state(self, state: dict[str, torch.Tensor]) -> None:
        """The method's state back from a checkpoint's merged shares, saved at any world size:
        module scope, this rank takes the entries of the modules it combines."""
        if self.method.scope == "module":
            state = {key: t for key, t in state.items() if self._state_owner(key) == self.comm.rank}
        self.method.load_state_dict(state)

    def _state_owner(self, key: str) -> int:
        """The rank that combines the module a module-scope state entry ``"<index>.<name>"`` is of."""
        index = key.partition(".")[0]
        if not index.isdigit() or not 0 <= int(index) < len(self.modules):
            raise ValueError(f"method state: key {key!r} names no module (expected '<module index>.<name>', "
                             f"index below {len(self.modules)})")
        return self.layout.owners[int(index)]

    # -- results -------------------------------------------------------------------------------
    def pop_stats(self) -> dict:
        """Statistics of the last optimizer step ({} if none happened since the last call)."""
        stats, self._stats = self._stats, {}
        return stats

    def detach(self) -> None:
        """Restore the engine: remove capture hooks and the step wrapper, and release the
        hook's own process group (left alive, its threads can abort the process at exit)."""
        if self.capture is not None:
            self.capture.remove()
            self.capture = None
            if self.reused_zeros:
                stop_reusing_zero_gradients(self.engine.optimizer)
        unwrap_step(self.engine.optimizer, self._original_step)
        if self.fused_checks:
            unfuse_gradient_checks(self.engine.optimizer)
        self.comm.destroy()
        self.collector.stop()


@dataclass
class _Combined:
    """What :meth:`EngineHook._combine` leaves for the rest of the boundary: the updates to
    write, the non-finite flags (device tensors, read once with the loss's), and what
    :meth:`EngineHook._report` reads once the optimizer step is queued."""

    clock: PhaseClock
    counts: torch.Tensor
    results: list = field(default_factory=list)  # this rank's; the statistics at world size 1
    updates: list | None = None
    gathered: torch.Tensor | None = None  # several ranks: the statistics travel in it
    finite: list[torch.Tensor] = field(default_factory=list)
    failed: bool = False  # the method raised on sums that were not finite


def attach(engine, config: HookConfig) -> EngineHook:
    """Hook a method into a DeepSpeed engine made by deepspeed.initialize over a PEFT LoRA model."""
    return EngineHook(engine, config)
