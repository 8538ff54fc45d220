"""End-to-end optimizer-step benchmark: ERM against IGA in a DeepSpeed ZeRO-2 engine.

LLaMA-2-7B architecture from a config dict (random bf16 weights, nothing downloaded; any
Hugging Face config JSON with ``--config``), PEFT LoRA r 16 alpha 32 on q, k, v, o, ZeRO-2,
micro-batch 4 x 512 tokens, gradient accumulation 4: one optimizer step is 4 isomer groups
x 4 domains, each micro-batch one group (one sequence per domain).

One command, each method in its own process (clean peak memory), on 1, 2 or 4 GPUs:

    python bench/bench_step.py --gpus 1 --out bench_step_1gpu.json
    python bench/bench_step.py --gpus 4 --out bench_step_4gpu.json

Under a launcher the script is one rank and runs the methods one after the other:

    deepspeed --num_gpus 2 bench/bench_step.py --methods erm,iga --out step.json
    torchrun --nproc_per_node 2 bench/bench_step.py --methods erm,iga --out step.json

CPU smoke run: ``DS_ACCELERATOR=cpu python bench/bench_step.py --dtype fp32 --layers 1
--hidden 64 --seq 16 --steps 2 --warmup 1``.

Methods: ``erm`` (DeepSpeed's own path: LoRA gradients reduced after every micro-batch),
``erm_captured`` (the same update through the hook's capture, reduced once per step),
``iga`` (the registered method, module by module), ``iga_fused``
(the same method through :func:`iga_ds.methods.iga.batched.batched_iga`), ``iga_bf16`` (that
path with ``precision: bf16``) and ``iga_svd_bf16_q1p16`` (``iga_svd``, the rank-r SVD truncation,
in bf16, one power iteration, oversampling 16).
Measured per method: median optimizer-step time over ``--steps`` steps after ``--warmup``
(``torch.cuda.synchronize`` around each), tokens per second (all ranks), peak memory
(``torch.cuda.max_memory_allocated``, max over ranks), each step's forward-and-backward and
boundary phases (split by a CUDA event where ``engine.step()`` begins: the benchmark adds no
wait of its own there), and from the engine hook the time of the method and of its
collectives (its own events). The hook's capture overhead is derived: IGA step minus
ERM step minus method minus communication.

Profiling: ``--profile DIR`` runs 2 more optimizer steps per method after the timed ones under
``torch.profiler`` (CPU, and CUDA where present; the timed steps are not affected) and writes,
per method and rank, ``DIR/<method>_rank<r>_ops.txt`` (the 40 ops of most self CUDA time, or
self CPU time without CUDA) and ``DIR/<method>_rank<r>_summary.json`` (wall time of the profiled
steps, total self CPU and CUDA time, the top 25 ops, and the script's ranges ``forward``,
``loss``, ``backward`` and ``optimizer_step``); ``--profile-trace`` adds a Chrome trace
``DIR/<method>_rank<r>_trace.json`` (large; ``--profile-stack`` records Python stacks in it,
which slows the host, and ``tools/trace_gaps.py`` reads it). Total self CUDA time well below the wall time
means the GPU waits for the host; the ranges say in which phase:

    python bench/bench_step.py --gpus 1 --steps 5 --profile prof --out step.json
"""
from __future__ import annotations

import argparse
import contextlib
import functools
import gc
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

import torch

from common import environment, environment_line, lora_llama, model_config, synchronize
from iga_ds.engine import HookConfig, attach
from iga_ds.engine.internals import disable_cpu_shm_comm_op
from iga_ds.engine.phase_clock import PhaseClock
from iga_ds.files import atomic_write_json
from iga_ds.train.batching import sequence_losses
from iga_ds.train.profiling import ranked_ops

METHODS = ("erm", "erm_captured", "iga", "iga_fused", "iga_bf16", "iga_svd_bf16_q1p16")
# the fused variants that fix their precision (iga_fused takes --precision) and projection
FIXED_VARIANTS = {"iga_bf16": {"precision": "bf16"},
                  "iga_svd_bf16_q1p16": {"precision": "bf16", "power_iters": 1, "oversample": 16}}
DOMAINS = ["math", "medical", "legal", "science"]
LAUNCHER_VARS = ("RANK", "LOCAL_RANK", "OMPI_COMM_WORLD_RANK", "PMI_RANK")
PROFILE_STEPS = 2
# the record_function ranges of one optimizer step (see optimizer_step)
RANGES = ("forward", "loss", "backward", "optimizer_step",
          # the engine hook's parts of the boundary (iga_ds/engine/hook.py), inside optimizer_step
          "boundary/nonfinite_check", "boundary/combine", "boundary/method", "boundary/results",
          "boundary/statistics", "boundary/write_grads", "boundary/deepspeed_step", "boundary/reset")


def ds_config(args, world: int) -> dict:
    cfg = {
        "train_micro_batch_size_per_gpu": args.micro,
        "gradient_accumulation_steps": args.gas,
        "train_batch_size": args.micro * args.gas * world,
        "gradient_clipping": 1.0,
        "zero_allow_untested_optimizer": True,
        "zero_optimization": {
            "stage": 2,
            "overlap_comm": True,
            "contiguous_gradients": True,
            "reduce_bucket_size": 50_000_000,
            "allgather_bucket_size": 50_000_000,
        },
        "steps_per_print": 10**9,
        "wall_clock_breakdown": False,
    }
    if args.dtype == "bf16":
        cfg["bf16"] = {"enabled": True}
    return cfg


def build_model(config: dict, args, device):
    dtype = torch.bfloat16 if args.dtype == "bf16" else torch.float32
    return lora_llama(config, rank=args.rank, alpha=args.alpha, dtype=dtype, device=device,
                      grad_ckpt=args.grad_ckpt)


def micro_batches(args, vocab: int, device, step: int):
    """Whole isomer groups per micro-batch: sequence i is domain i % 4 (random tokens, all targets)."""
    gen = torch.Generator().manual_seed(step)
    for _ in range(args.gas):
        ids = torch.randint(0, vocab, (args.micro, args.seq), generator=gen).to(device)
        # domain ids stay on the host, as a training loop has them: read back from the device
        # they would cost a sync per micro-batch
        yield ids, torch.ones_like(ids), torch.arange(args.micro) % len(DOMAINS)


def check_method(name: str) -> str:
    """``name`` if it is one of METHODS; else ValueError naming what was expected."""
    if name not in METHODS:
        raise ValueError(f"unknown {name!r}; expected one of {', '.join(METHODS)}")
    return name


def optimizer_step(engine, hook, args, vocab: int, device, step: int, mark, clock: PhaseClock | None = None) -> None:
    """One optimizer step of the benchmark: every micro-batch's forward, loss and backward
    inside the hook's micro-batch, then ``engine.step()`` (at the accumulation boundary: the
    hook's method, then AdamW).

    ``mark``: ``torch.profiler.record_function`` when profiled, a no-op context in the timed
    steps; ``clock``: gets the mark ``boundary`` where the boundary begins, on the device's own
    clock (a CUDA event: no wait of the benchmark's own there).
    """
    for ids, attn, domains in micro_batches(args, vocab, device, step):
        with hook.micro_batch(domains):
            with mark("forward"):
                logits = engine(input_ids=ids, attention_mask=attn).logits
            with mark("loss"):
                loss = hook.objective(sequence_losses(logits, ids), domains)
            with mark("backward"):
                engine.backward(loss)
        if clock is not None and engine.is_gradient_accumulation_boundary():
            clock.mark("boundary")
        with mark("optimizer_step"):
            engine.step()


class FullCollections:
    """Python's full garbage collections (generation 2, explicit ones included) while the block
    runs: how many and their host milliseconds. A full collection scans every object of the
    process (about a million in a 7B run), so a step that holds one pays for it whatever the
    method; recorded per step, an outlier step can be told apart from a slow method."""

    def __init__(self):
        self.count, self.ms, self._start = 0, 0.0, None

    def __call__(self, phase: str, info: dict) -> None:
        if info["generation"] != 2:
            return
        if phase == "start":
            self._start = time.perf_counter()
        elif self._start is not None:
            self.count += 1
            self.ms += 1e3 * (time.perf_counter() - self._start)
            self._start = None

    def __enter__(self) -> "FullCollections":
        gc.callbacks.append(self)
        return self

    def __exit__(self, *exc) -> None:
        gc.callbacks.remove(self)


def run_method(method: str, args, rank: int, world: int, device) -> dict:
    import deepspeed

    cuda = device.type == "cuda"
    if cuda:
        torch.cuda.reset_peak_memory_stats(device)
    config = model_config(args.config, layers=args.layers, hidden=args.hidden, vocab=args.vocab)
    model = build_model(config, args, device)
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=1e-5, weight_decay=0.0)
    engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, config=ds_config(args, world))
    # "iga" is the per-module reference path, "iga_fused" the batched fast path, "iga_bf16" that
    # path in bf16: one method
    base = check_method(method)
    iga_params = {} if base.startswith("erm") else {
        "tau": args.tau, "normalize": args.normalize,
        "implementation": "reference" if base == "iga" else "batched",
        **({"precision": args.precision} if base == "iga_fused" else FIXED_VARIANTS.get(base, {})),
    }
    registered = base if base.startswith("erm") else "iga_svd" if base.startswith("iga_svd") else "iga"
    hook = attach(engine, HookConfig(method=registered, params=iga_params,
                                    domains=list(DOMAINS)))
    one_step = functools.partial(optimizer_step, engine, hook, args, config["vocab_size"], device)

    # each timed step in two phases, split where engine.step() begins on the device (an event,
    # the same for every method: no wait of the benchmark's own): the micro-batches' forward and
    # backward (IGA's capture runs there), then the boundary (IGA's collectives and method,
    # DeepSpeed's reduction and AdamW)
    times, fwd_bwd, boundary, hook_stats, full_gc, starts = [], [], [], [], [], []
    from tqdm import tqdm

    for step in tqdm(range(args.warmup + args.steps), desc=method, disable=rank != 0):
        if step == args.warmup:
            # what a full collection scans, and what the hook froze out of it
            tracked = {"gc_tracked": len(gc.get_objects()), "gc_frozen": gc.get_freeze_count()}
            if cuda:
                torch.cuda.reset_peak_memory_stats(device)
                allocs_before = allocator_calls(device)
        synchronize(device)
        t0 = time.perf_counter()
        clock = PhaseClock(device)
        clock.mark("start")
        with FullCollections() as collections:
            one_step(step, contextlib.nullcontext, clock)
        clock.mark("end")
        synchronize(device)
        t1 = time.perf_counter()
        if step >= args.warmup:
            times.append(t1 - t0)
            starts.append(t0)
            full_gc.append(collections.ms)
            fwd_bwd.append(clock.seconds("start", "boundary"))
            boundary.append(clock.seconds("boundary", "end"))
            stats = hook.pop_stats()
            hook_stats.append({k: stats.get(k, 0.0) for k in ("time/comm_s", "time/method_s", "time/boundary_s")})
    steady_peak = torch.cuda.max_memory_allocated(device) if cuda else 0
    # memory the caching allocator had to take from the driver (or free and retry for) during
    # the timed steps: each such call waits for the device
    allocs = [after - before for after, before in zip(allocator_calls(device), allocs_before)] if cuda else None
    # the whole run's peak (model build included) is not resettable back; report steady-state peak
    peak = torch.tensor([float(steady_peak)], device=device)
    if world > 1:
        torch.distributed.all_reduce(peak, op=torch.distributed.ReduceOp.MAX)
    # every rank's phases, for the boundary's wait for the last rank (rank 0 writes the report)
    per_rank = gather_per_rank({
        "fwd_bwd_ms_all": [1e3 * t for t in fwd_bwd], "boundary_ms_all": [1e3 * t for t in boundary],
        "full_gc_ms_all": full_gc, "method_ms_all": [1e3 * s["time/method_s"] for s in hook_stats],
        "start_s_all": starts}, world) if world > 1 else None
    step_s = statistics.median(times)
    tokens = args.micro * args.seq * args.gas * world
    result = {
        "method": method,
        "step_ms": 1e3 * step_s,
        "step_ms_all": [1e3 * t for t in times],
        "fwd_bwd_ms": 1e3 * statistics.median(fwd_bwd),
        "fwd_bwd_ms_all": [1e3 * t for t in fwd_bwd],
        "boundary_ms": 1e3 * statistics.median(boundary),
        "boundary_ms_all": [1e3 * t for t in boundary],
        "full_gc_ms_all": full_gc,  # per timed step: its full garbage collections' host ms (0: none)
        **tracked,
        "tokens_per_s": tokens / step_s,
        "tokens_per_s_per_gpu": tokens / step_s / world,
        "peak_gib": float(peak.item()) / 2**30 if cuda else None,
        "method_ms": 1e3 * statistics.median(s["time/method_s"] for s in hook_stats),
        "comm_ms": 1e3 * statistics.median(s["time/comm_s"] for s in hook_stats),
        "trainable_params": sum(p.numel() for p in params),
        "fused_gradient_checks": hook.fused_checks,
        "device_allocs_per_step": allocs[0] / args.steps if cuda else None,
        "alloc_retries": allocs[1] if cuda else None,
        **(rank_skew(per_rank) if per_rank else {}),
    }
    if args.profile:  # after the timed steps and the peak-memory reading: neither sees the profiler
        summary = profile_steps(one_step, args.warmup + args.steps, args, method, rank, device)
        result["profile_wall_ms"] = summary["wall_ms"]
    hook.detach()
    # the next method's model must not find this one's in memory: no reference may stay
    del one_step, engine, hook, model, optimizer, params
    gc.collect()
    if cuda:
        torch.cuda.empty_cache()
    return result


def gather_per_rank(record: dict, world: int) -> list[dict]:
    """Every rank's ``record``, in rank order."""
    records = [None] * world
    torch.distributed.all_gather_object(records, record)
    return records


def rank_skew(per_rank: list[dict]) -> dict:
    """How far apart the ranks reached the boundary, step by step.

    A rank reaches it at its step's start (host clock, after waiting for its device) plus its
    forward and backward on the device; one host has one monotonic clock for all its processes.
    The boundary's first collective cannot finish before the last rank reaches it, so rank 0's
    boundary holds its wait for the last rank: ``wait_ms_all``; ``boundary_less_wait_ms_all``
    is what rank 0's boundary took beyond it. ``per_rank``: each rank's phases, collections and
    method per step, and ``lag_ms_all``, how long after the first rank it got there.
    """
    arrivals = [[start + 1e-3 * ms for start, ms in zip(r["start_s_all"], r["fwd_bwd_ms_all"])] for r in per_rank]
    first = [min(step) for step in zip(*arrivals)]
    last = [max(step) for step in zip(*arrivals)]
    wait = [1e3 * (end - own) for end, own in zip(last, arrivals[0])]
    ranks = [{**{k: v for k, v in r.items() if k != "start_s_all"},
              "lag_ms_all": [1e3 * (own - early) for own, early in zip(mine, first)]}
             for r, mine in zip(per_rank, arrivals)]
    return {"per_rank": ranks, "skew_ms_all": [1e3 * (end - early) for end, early in zip(last, first)],
            "wait_ms_all": wait,
            "boundary_less_wait_ms_all": [b - w for b, w in zip(per_rank[0]["boundary_ms_all"], wait)]}


def allocator_calls(device) -> tuple[int, int]:
    """The caching allocator's calls to the driver for memory so far, and its retries after
    freeing its cache (torch.cuda.memory_stats)."""
    stats = torch.cuda.memory_stats(device)
    return int(stats.get("num_device_alloc", 0)), int(stats.get("num_alloc_retries", 0))


def profile_steps(one_step, first_step: int, args, method: str, rank: int, device) -> dict:
    """Run PROFILE_STEPS more optimizer steps under torch.profiler; write the op table and a summary."""
    from torch.profiler import ProfilerActivity, profile, record_function

    cuda = device.type == "cuda"
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    synchronize(device)
    with profile(activities=activities, record_shapes=False, with_stack=args.profile_stack) as prof:
        t0 = time.perf_counter()
        for step in range(first_step, first_step + PROFILE_STEPS):
            one_step(step, record_function)
        synchronize(device)  # inside the profiler: the last step's kernels are recorded too
        wall_s = time.perf_counter() - t0
    os.makedirs(args.profile, exist_ok=True)
    stem = os.path.join(args.profile, f"{method}_rank{rank}")
    averages = prof.key_averages()
    sort_by = "self_cuda_time_total" if cuda else "self_cpu_time_total"
    with open(f"{stem}_ops.txt", "w") as fh:
        fh.write(averages.table(sort_by=sort_by, row_limit=40, max_name_column_width=80) + "\n")
    summary = {"method": method, "rank": rank, "steps": PROFILE_STEPS, "cuda": cuda,
               **profile_summary(averages, wall_s, cuda)}
    with open(f"{stem}_summary.json", "w") as fh:
        json.dump(summary, fh, indent=1)
    if args.profile_trace:
        prof.export_chrome_trace(f"{stem}_trace.json")
    if rank == 0:
        print(f"profile: wrote {stem}_ops.txt and {stem}_summary.json", file=sys.stderr)
    return summary


def profile_summary(averages, wall_s: float, cuda: bool, top: int = 25) -> dict:
    """Totals, the ``top`` ops by self CUDA (else CPU) time, and the RANGES, in ms, from key_averages()."""
    from torch.autograd import DeviceType

    def self_cuda_us(evt) -> float:
        # self_device_time_total since torch 2.4, where the older self_cuda_time_total warns
        value = getattr(evt, "self_device_time_total", None)
        return float(evt.self_cuda_time_total if value is None else value)

    def total_cuda_us(evt) -> float:
        value = getattr(evt, "device_time_total", None)
        return float(evt.cuda_time_total if value is None else value)

    def ms(us: float) -> float:
        return round(us / 1e3, 3)

    ranked = ops = ranked_ops(averages, cuda)  # the trainer's profiler ranks them the same way
    kernels = [e for e in ops if e.device_type != DeviceType.CPU]
    # inclusive times: a range whose CPU time is well above its CUDA time is host-bound
    ranges = {e.key: {"calls": e.count, "cpu_ms": ms(e.cpu_time_total),
                      "cuda_ms": ms(total_cuda_us(e)) if cuda else 0.0}
              for e in ops if e.key in RANGES and e.device_type == DeviceType.CPU}
    return {
        "wall_ms": ms(1e6 * wall_s),
        "self_cpu_ms": ms(sum(e.self_cpu_time_total for e in ops)),
        # kernels carry the device time (their launching ops repeat it), as in the table's footer
        "self_cuda_ms": ms(sum(self_cuda_us(e) for e in kernels)) if cuda else 0.0,
        "ranges": ranges,
        "top_ops": [{"name": e.key, "calls": e.count, "self_cpu_ms": ms(e.self_cpu_time_total),
                     "self_cuda_ms": ms(self_cuda_us(e)) if cuda else 0.0} for e in ranked[:top]],
    }


def worker(args) -> int:
    """One rank: run the methods of --methods one after the other, rank 0 writes --out."""
    import datetime

    import deepspeed

    rank = int(os.environ.get("RANK", "0"))
    local = int(os.environ.get("LOCAL_RANK", args.local_rank if args.local_rank is not None else 0))
    world = int(os.environ.get("WORLD_SIZE", "1"))
    cuda = torch.cuda.is_available() and os.environ.get("DS_ACCELERATOR", "cuda") != "cpu"
    if cuda:
        torch.cuda.set_device(local)
    device = torch.device("cuda", local) if cuda else torch.device("cpu")
    if not cuda and args.dtype == "bf16":
        print("no CUDA: running in float32", file=sys.stderr)
        args.dtype = "fp32"
    os.environ.setdefault("RANK", str(rank))
    os.environ.setdefault("WORLD_SIZE", str(world))
    os.environ.setdefault("LOCAL_RANK", str(local))
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(29500 + os.getpid() % 1000))
    if not cuda:  # as the trainer does: gloo needs no C++ build of DeepSpeed's shared-memory op
        disable_cpu_shm_comm_op()
    deepspeed.init_distributed(dist_backend="nccl" if cuda else "gloo", timeout=datetime.timedelta(seconds=1800))
    results = [run_method(m, args, rank, world, device) for m in args.methods]
    if rank == 0:
        report = summarize(results, environment(device, world_size=world), args)
        atomic_write_json(args.out, report)
        if not args.as_worker:  # the driver prints the merged table
            print_table(report)
            print(f"wrote {args.out}")
    torch.distributed.destroy_process_group()
    return 0


def ratio_interval(steps: list[float], baseline: list[float], level: float = 0.9, resamples: int = 2000,
                   seed: int = 0) -> tuple[float, float]:
    """Bootstrap interval of median(steps) / median(baseline), resampling each method's steps.

    Step times on a shared machine spread by 10-20% (docs/PERFORMANCE.md); this says how far a
    ratio of medians over a few steps can be trusted. Deterministic for a given seed.
    """
    import random

    rng = random.Random(seed)
    ratios = sorted(
        statistics.median(rng.choices(steps, k=len(steps))) / statistics.median(rng.choices(baseline, k=len(baseline)))
        for _ in range(resamples)
    )
    tail = (1.0 - level) / 2
    return ratios[int(tail * resamples)], ratios[min(resamples - 1, int((1.0 - tail) * resamples))]


def summarize(results: list[dict], env: dict, args) -> dict:
    by_name = {r["method"]: r for r in results}
    erm = by_name.get("erm")
    for r in results:
        if erm is not None and r["method"] != "erm":
            r["ratio_step"] = r["step_ms"] / erm["step_ms"]
            if r.get("step_ms_all") and erm.get("step_ms_all"):
                r["ratio_step_interval90"] = list(ratio_interval(r["step_ms_all"], erm["step_ms_all"]))
            r["ratio_tokens_per_s"] = r["tokens_per_s"] / erm["tokens_per_s"]
            if r["peak_gib"] and erm["peak_gib"]:
                r["ratio_peak"] = r["peak_gib"] / erm["peak_gib"]
            r["extra_ms"] = r["step_ms"] - erm["step_ms"]
            # the capture adds work inside forward/backward, which no clock in the hook isolates
            r["capture_ms_derived"] = r["extra_ms"] - r["method_ms"] - r["comm_ms"]
            if "fwd_bwd_ms" in r and "fwd_bwd_ms" in erm:
                # phase by phase: the capture is the forward/backward phase's difference, and what
                # the boundary adds beyond the method and its collectives is the rest of the hook
                # (writing the results into ZeRO's partitions, bookkeeping)
                r["capture_ms"] = r["fwd_bwd_ms"] - erm["fwd_bwd_ms"]
                r["boundary_other_ms"] = r["boundary_ms"] - erm["boundary_ms"] - r["method_ms"] - r["comm_ms"]
    settings = {k: getattr(args, k, None) for k in ("micro", "seq", "gas", "rank", "alpha", "dtype", "tau", "normalize",
                                                    "warmup", "steps", "rounds", "layers", "hidden", "config",
                                                    "grad_ckpt")}
    return {"env": env, "settings": settings, "results": results}


def print_table(report: dict) -> None:
    env, s = report["env"], report["settings"]
    print("\n" + environment_line(env))
    print(f"micro-batch {s['micro']} x {s['seq']} tokens, accumulation {s['gas']}, "
          f"LoRA r {s['rank']} alpha {s['alpha']}, {s['dtype']}, median of {s['steps']} steps after {s['warmup']}")
    head = ["method", "step ms", "tok/s", "tok/s/GPU", "peak GiB", "fwd+bwd ms", "boundary ms", "method ms",
            "comm ms", "capture ms", "other ms", "step x", "peak x"]
    print("".join(f"{h:>12}" for h in head))

    def cell(value, fmt):
        return f"{'-' if value is None else format(value, fmt):>12}"

    for r in report["results"]:
        print(f"{r['method']:>12}" + cell(r["step_ms"], ".1f") + cell(r["tokens_per_s"], ",.0f")
              + cell(r["tokens_per_s_per_gpu"], ",.0f") + cell(r["peak_gib"], ".2f")
              + cell(r.get("fwd_bwd_ms"), ".1f") + cell(r.get("boundary_ms"), ".1f")
              + cell(r["method_ms"] if r["method"] != "erm" else None, ".1f")
              + cell(r["comm_ms"] if r["method"] != "erm" else None, ".1f")
              + cell(r.get("capture_ms"), ".1f") + cell(r.get("boundary_other_ms"), ".1f")
              + cell(r.get("ratio_step"), ".3f") + cell(r.get("ratio_peak"), ".3f"))
    print("capture: IGA's forward+backward phase - ERM's; other: IGA's boundary - ERM's - method - communication. "
          "Targets on one H100: step x <= 1.03, peak x <= 1.03, method <= 15 ms, other <= 3 ms.")
    for r in report["results"]:
        if r.get("device_allocs_per_step") is not None:
            print(f"{r['method']}: {r['device_allocs_per_step']:g} device allocations per timed step (most of "
                  f"any round), {r['alloc_retries']} allocator retries")
    for r in report["results"]:
        held = [t for t in r.get("full_gc_ms_all", []) if t > 0]
        if held:
            print(f"{r['method']}: full garbage collections in {len(held)} of {len(r['full_gc_ms_all'])} timed steps, "
                  f"{max(held):.0f} ms at most")
        if "gc_tracked" in r:
            print(f"{r['method']}: {r['gc_tracked']:,} objects tracked by the garbage collector, "
                  f"{r['gc_frozen']:,} frozen")
    print_ranks(report)
    for r in report["results"]:
        if "rounds" in r:
            print(f"{r['method']}: median step per round {', '.join(f'{t:.1f}' for t in r['rounds'])} ms "
                  "(rounds alternate the order of the methods)")
    for r in report["results"]:
        if "ratio_step_interval90" in r:
            lo, hi = r["ratio_step_interval90"]
            print(f"{r['method']}/erm step ratio {r['ratio_step']:.3f}: 90% bootstrap interval {lo:.3f}-{hi:.3f} "
                  f"over the steps (an interval that holds 1.0 cannot tell the two apart)")


def print_ranks(report: dict) -> None:
    """With several ranks: how far apart they reached the boundary, rank 0's boundary with and
    without its wait for the last one, and each rank's full collections and method."""
    for r in report["results"]:
        if "per_rank" not in r:
            continue
        skew, mine, less = r["skew_ms_all"], r["boundary_ms_all"], r["boundary_less_wait_ms_all"]
        print(f"{r['method']}: the ranks reached the boundary {statistics.median(skew):.1f} ms apart (median; "
              f"{max(skew):.1f} at most); rank 0's boundary {statistics.median(mine):.1f} ms (longest "
              f"{max(mine):.1f}), beyond its wait for the last rank {statistics.median(less):.1f} ms "
              f"(longest {max(less):.1f})")
        for rank, own in enumerate(r["per_rank"]):
            held = [t for t in own["full_gc_ms_all"] if t > 0]
            # the last rank's lag is the step's skew
            latest = sum(lag == end for lag, end in zip(own["lag_ms_all"], skew))
            print(f"  rank {rank}: fwd+bwd {statistics.median(own['fwd_bwd_ms_all']):.1f} ms, boundary "
                  f"{statistics.median(own['boundary_ms_all']):.1f}, method "
                  f"{statistics.median(own['method_ms_all']):.1f}; the last to arrive in {latest} of {len(skew)} "
                  f"steps; full collections in {len(held)} steps ({sum(held):.0f} ms)")


def drive(args, argv: list[str]) -> int:
    """Run each method in its own torch.distributed launch of --gpus processes, then merge.

    With --rounds R the methods run R times, in reverse order every other round (erm, iga,
    iga, erm, ...), so that a machine that drifts over minutes weighs on every method alike;
    each method's steps are pooled over the rounds and the per-round medians are kept.
    """
    rounds: list[list[dict]] = []
    worker_argv = strip_driver_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        for index in range(args.rounds):
            order = args.methods if index % 2 == 0 else args.methods[::-1]
            parts = []
            for method in order:
                part = os.path.join(tmp, f"{method}-{index}.json")
                # profiled steps come after the timed ones; one round of them is enough
                extra = worker_argv if index == 0 else strip_profile_args(worker_argv)
                cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={args.gpus}",
                       os.path.abspath(__file__), *extra, "--methods", method, "--out", part, "--as-worker"]
                print(f"+ [round {index + 1}/{args.rounds}]", " ".join(cmd), flush=True)
                rc = subprocess.call(cmd)
                if rc != 0:
                    print(f"method {method} failed (exit {rc})", file=sys.stderr)
                    return rc
                parts.append(json.load(open(part)))
            rounds.append([r for p in parts for r in p["results"]])
            env = parts[0]["env"]
    report = summarize(pool_rounds(rounds, args.methods), env, args)
    atomic_write_json(args.out, report)
    print_table(report)
    print(f"wrote {args.out}")
    return 0


def pool_rounds(rounds: list[list[dict]], methods: list[str]) -> list[dict]:
    """One result per method from several rounds: steps pooled (median over all of them), the
    hook's phase times as the median of the rounds' medians, the largest peak, and
    ``rounds``: each round's median step, in the order the rounds ran."""
    if len(rounds) == 1:
        return rounds[0]
    pooled = []
    for method in methods:
        runs = [r for results in rounds for r in results if r["method"] == method]
        steps = [t for r in runs for t in r["step_ms_all"]]
        step_ms = statistics.median(steps)
        phases = {}
        if all("full_gc_ms_all" in r for r in runs):
            phases["full_gc_ms_all"] = [t for r in runs for t in r["full_gc_ms_all"]]
        for phase in ("fwd_bwd_ms", "boundary_ms"):
            if all(f"{phase}_all" in r for r in runs):
                pooled_phase = [t for r in runs for t in r[f"{phase}_all"]]
                phases.update({phase: statistics.median(pooled_phase), f"{phase}_all": pooled_phase})
        tokens = runs[0]["tokens_per_s"] * runs[0]["step_ms"] / 1e3  # tokens per optimizer step
        world = runs[0]["tokens_per_s"] / runs[0]["tokens_per_s_per_gpu"]
        peaks = [r["peak_gib"] for r in runs if r["peak_gib"] is not None]
        merged = dict(runs[0])
        merged.update(
            step_ms=step_ms, step_ms_all=steps, tokens_per_s=tokens / (step_ms / 1e3),
            tokens_per_s_per_gpu=tokens / (step_ms / 1e3) / world, peak_gib=max(peaks) if peaks else None,
            method_ms=statistics.median(r["method_ms"] for r in runs),
            comm_ms=statistics.median(r["comm_ms"] for r in runs),
            rounds=[r["step_ms"] for r in runs], **phases,
        )
        if all("per_rank" in r for r in runs):
            merged.update(pool_per_rank(runs))
        if all(r.get("device_allocs_per_step") is not None for r in runs):
            merged.update(device_allocs_per_step=max(r["device_allocs_per_step"] for r in runs),
                          alloc_retries=sum(r["alloc_retries"] for r in runs))
        pooled.append(merged)
    return pooled


def pool_per_rank(runs: list[dict]) -> dict:
    """:func:`rank_skew`'s per-step lists of several runs, concatenated in run order (rank by
    rank for ``per_rank``)."""
    pooled = {k: [t for r in runs for t in r[k]] for k in ("skew_ms_all", "wait_ms_all", "boundary_less_wait_ms_all")}
    pooled["per_rank"] = [{k: [t for r in runs for t in r["per_rank"][rank][k]] for k in ranked}
                          for rank, ranked in enumerate(runs[0]["per_rank"])]
    return pooled


def strip_options(argv: list[str], with_value: tuple[str, ...], flags: tuple[str, ...] = ()) -> list[str]:
    """``argv`` without the options ``with_value`` (``--x V`` or ``--x=V``) and ``flags``."""
    out, skip = [], False
    for arg in argv:
        if skip:
            skip = False
            continue
        name = arg.split("=", 1)[0]
        if name in with_value:
            skip = "=" not in arg
            continue
        if name not in flags:
            out.append(arg)
    return out


def strip_driver_args(argv: list[str]) -> list[str]:
    """The command line without the options the driver sets itself."""
    return strip_options(argv, ("--methods", "--out", "--gpus", "--rounds"))


def strip_profile_args(argv: list[str]) -> list[str]:
    return strip_options(argv, ("--profile",), ("--profile-trace", "--profile-stack"))


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--methods", default="erm,iga_fused,iga",
                   help=f"comma-separated, from {', '.join(METHODS)}")
    p.add_argument("--gpus", type=int, default=1, help="processes per method when not under a launcher")
    p.add_argument("--config", help="Hugging Face config JSON (default: LLaMA-2-7B)")
    p.add_argument("--layers", type=int, help="keep this many layers (smoke tests)")
    p.add_argument("--hidden", type=int, help="override hidden_size (smoke tests)")
    p.add_argument("--vocab", type=int, help="override vocab_size (smoke tests)")
    p.add_argument("--micro", type=int, default=4, help="sequences per micro-batch (one isomer group)")
    p.add_argument("--seq", type=int, default=512)
    p.add_argument("--gas", type=int, default=4, help="gradient accumulation steps")
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--alpha", type=float, default=32.0)
    p.add_argument("--dtype", choices=["bf16", "fp32"], default="bf16")
    p.add_argument("--tau", type=float, default=0.5)
    p.add_argument("--normalize", choices=["none", "mean", "snr"], default="snr",
                   help="the mask's normalization (default: the method's own, snr)")
    p.add_argument("--precision", choices=["ieee", "tf32"], default="ieee",
                   help="iga_fused: float32 throughout, or TF32 tensor cores in the tile pass and power iterations")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--rounds", type=int, default=1,
                   help="run the methods this many times, reversing their order every other round; steps pooled")
    p.add_argument("--grad-ckpt", action="store_true", help="activation checkpointing (non-reentrant)")
    p.add_argument("--out", default="bench_step.json")
    p.add_argument("--profile", metavar="DIR",
                   help=f"after the timed steps, profile {PROFILE_STEPS} more per method; tables, summaries to DIR")
    p.add_argument("--profile-trace", action="store_true", help="with --profile: also a Chrome trace (large)")
    p.add_argument("--profile-stack", action="store_true",
                   help="with --profile: record Python stacks too (names the host's functions; slows the host)")
    p.add_argument("--as-worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--local_rank", "--local-rank", type=int, default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    args.methods = [m.strip() for m in args.methods.split(",") if m.strip()]
    for name in args.methods:
        try:
            check_method(name)
        except ValueError as exc:
            p.error(f"--methods: {exc}")
    if args.rounds < 1:
        p.error("--rounds must be at least 1")
    if args.profile_trace and not args.profile:
        p.error("--profile-trace needs --profile DIR")
    if args.profile_stack and not args.profile:
        p.error("--profile-stack needs --profile DIR")
    if args.micro % len(DOMAINS):
        p.error(f"--micro must be a multiple of {len(DOMAINS)}: a micro-batch holds whole isomer groups")
    return args


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    under_launcher = args.as_worker or any(v in os.environ for v in LAUNCHER_VARS) or args.local_rank is not None
    if under_launcher or (args.gpus == 1 and len(args.methods) == 1 and args.rounds == 1):
        return worker(args)
    return drive(args, argv)


if __name__ == "__main__":
    sys.exit(main())
