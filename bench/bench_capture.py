"""What the per-domain gradient capture costs a micro-batch: its host work alone, or all of it at a
real model's shape on a GPU.

    python bench/bench_capture.py [--layers 32] [--rounds 7] [--iters 20] [--owns]
    python bench/bench_capture.py --device cuda --owns [--layers 32] [--micro 4] [--seq 512]
    python bench/bench_capture.py --device cuda --owns --lora-only

Host cost (the default, no GPU needed): a LLaMA-shaped model so small that its arithmetic is
nearly free (hidden 32, LoRA r 4 on q, k, v, o of every layer, 4 sequences of 8 tokens, one
CPU thread): what is left of a forward and backward is Python and operator dispatch, the work
a host must do per micro-batch whatever the card. On a GPU each of the capture's operators is
also a kernel launch, so this is a lower bound of its host cost there; when the host is the
bottleneck (several ranks that wait for one another every micro-batch), this is time the step
pays.

``--device cuda``: the LLaMA-2-7B shape (``--layers``/``--hidden`` shrink it) in bfloat16,
adapters included (as DeepSpeed's bf16 engine casts them), with LoRA r 16 on q, k, v, o,
micro-batches of ``--micro`` sequences of ``--seq`` tokens, one domain per sequence. Each
micro-batch is timed on the host's clock with the device synchronized, so the figure is
everything the capture adds: its kernels, its launches and its Python. The plain variant is
PyTorch's own LoRA gradients (what DeepSpeed's ERM computes before it reduces them); with
``--owns`` the captured variant skips those and keeps the per-domain sums instead, as under
ZeRO-2.

The capture's extra is the time with ``DomainGradientCapture`` attached minus the time
without. Rounds alternate the two variants; the medians of the rounds are printed. On a GPU
the device's busy time per micro-batch (the sum of its kernels' time, profiled) is printed
too: the capture's kernels are the difference of the two, and whatever the wall time adds
beyond that is the host's pace (a model whose host work takes as long as its kernels waits
for the host, and then every microsecond of Python shows).

``--lora-only`` (CUDA): the LoRA layers of that shape with nothing around them, so that the
network's own kernels and its run-to-run spread do not bury the capture: each layer's input
and output gradient are given (bf16 random tensors), one micro-batch is every layer's forward
and ``torch.autograd.backward`` of all outputs with their gradients. Device time is the sum
of the kernels' times (profiled, one micro-batch a round), the host's the median time to
issue a micro-batch (the device is idle before each).
"""
from __future__ import annotations

import argparse
import contextlib
import statistics
import sys
import time

import torch

from common import (LORA_TARGETS, environment, environment_line, gpu_busy_ms, lora_llama, lora_shapes, model_config,
                    time_ms)
from iga_ds.lora.capture import DomainGradientCapture
from iga_ds.lora.modules import LoraModule, find_lora_modules

RANK = 16


def build(args):
    """The model and its micro-batch's token ids for ``args`` (see the module docstring)."""
    if args.device == "cuda":
        config = model_config(layers=args.layers, hidden=args.hidden)
        model = lora_llama(config, rank=RANK, alpha=2.0 * RANK, dtype=torch.bfloat16, device="cuda")
        # PEFT keeps the adapters in fp32 (and casts their input up); DeepSpeed's bf16 engine
        # casts the whole model, adapters too, and so does this
        model.to(torch.bfloat16)
        ids = torch.randint(0, config["vocab_size"], (args.micro, args.seq), device="cuda")
        return model, ids
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=args.layers, num_attention_heads=2,
                      num_key_value_heads=2, vocab_size=64, max_position_embeddings=64)
    lora = LoraConfig(r=4, lora_alpha=8, target_modules=list(LORA_TARGETS))
    return get_peft_model(LlamaForCausalLM(cfg), lora), torch.randint(0, 64, (4, 8))


def lora_layers(args) -> tuple[list[LoraModule], list[torch.Tensor], list[torch.Tensor]]:
    """The model's LoRA layers alone in bf16 (``args.layers`` layers of q, k, v, o), each with
    its own input (needing a gradient, as a layer's input in a network does) and output
    gradient."""
    g = torch.Generator(device="cuda").manual_seed(0)
    modules, inputs, out_grads = [], [], []
    for i, (name, d_in, d_out) in enumerate(lora_shapes(model_config(layers=args.layers, hidden=args.hidden))):
        lora_A = torch.nn.Linear(d_in, RANK, bias=False, device="cuda", dtype=torch.bfloat16)
        lora_B = torch.nn.Linear(RANK, d_out, bias=False, device="cuda", dtype=torch.bfloat16)
        torch.nn.init.normal_(lora_B.weight, 0.0, 1e-3)  # B != 0, as some steps into a run
        modules.append(LoraModule(name, i, lora_A, lora_B, 2.0))
        shape = (args.micro, args.seq)
        inputs.append(torch.randn(*shape, d_in, device="cuda", dtype=torch.bfloat16, generator=g).requires_grad_())
        out_grads.append(torch.randn(*shape, d_out, device="cuda", dtype=torch.bfloat16, generator=g))
    return modules, inputs, out_grads


def capture_buffers(modules, device) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """The capture's fp32 per-domain sums (4 domains) for ``modules``."""
    return [(torch.zeros(4, *m.lora_A.weight.shape, device=device),
             torch.zeros(4, *m.lora_B.weight.shape, device=device)) for m in modules]


def alternating_rounds(args, modules, buffers, one_micro_batch, time_round, busy: bool):
    """``args.rounds`` rounds (after one that warms up), each timing the plain variant and the
    captured one, their order reversed every other round: per variant (keyed by "captured"),
    each round's ``time_round(fn)`` and, with ``busy``, its device busy time."""
    times: dict[bool, list[float]] = {False: [], True: []}
    kernels: dict[bool, list[float]] = {False: [], True: []}
    for r in range(args.rounds + 1):  # round 0 warms up
        for with_capture in ((False, True) if r % 2 == 0 else (True, False)):
            capture = DomainGradientCapture(modules, buffers, 4, owns_gradients=args.owns) if with_capture else None
            figure = time_round(lambda: one_micro_batch(capture))
            if r:
                times[with_capture].append(figure)
                if busy:
                    kernels[with_capture].append(gpu_busy_ms(lambda: one_micro_batch(capture)))
            if capture is not None:
                capture.remove()
    return times, kernels


def capture_mode(args) -> str:
    return "owning the factors' gradients" if args.owns else "alongside autograd"


def issue_ms(fn) -> float:
    """Host ms to issue ``fn``'s work, the device idle before: its kernels run as they come, so
    this is the host's pace, unless the host issues faster than the device runs them."""
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    fn()
    host = 1e3 * (time.perf_counter() - t0)
    torch.cuda.synchronize()
    return host


def lora_only(args) -> int:
    """--lora-only: the capture's operators against autograd's LoRA gradients, layers alone."""
    modules, inputs, out_grads = lora_layers(args)
    buffers = capture_buffers(modules, "cuda")
    domains = torch.arange(args.micro) % 4

    def one_micro_batch(capture):
        for x in inputs:
            x.grad = None  # each micro-batch's input gradient is new, as in a network
        with capture.micro_batch(domains, 0.25) if capture else contextlib.nullcontext():
            outputs = [m.lora_B(m.lora_A(x)) for m, x in zip(modules, inputs)]
            torch.autograd.backward(outputs, out_grads)

    host, busy = alternating_rounds(args, modules, buffers, one_micro_batch, busy=True,
                                    time_round=lambda fn: statistics.median(issue_ms(fn) for _ in range(args.iters)))
    print(f"{len(modules)} LoRA layers alone (r {RANK}, bf16), capture {capture_mode(args)}, "
          f"{args.micro} x {args.seq} tokens per micro-batch, {torch.cuda.get_device_name()}, "
          f"medians of {args.rounds} rounds")
    for part, runs in (("device busy (the kernels' sum)", busy), ("host time to issue", host)):
        plain, captured = statistics.median(runs[False]), statistics.median(runs[True])
        print(f"{part}: {plain:.2f} ms without the capture ({min(runs[False]):.2f}-{max(runs[False]):.2f}), "
              f"{captured:.2f} ms with it ({min(runs[True]):.2f}-{max(runs[True]):.2f}): "
              f"{captured - plain:+.2f} ms per micro-batch")
    return 0


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                   help="cpu: the host cost on a model too small to compute; cuda: all of it at a real shape")
    p.add_argument("--layers", type=int, default=32)
    p.add_argument("--hidden", type=int, default=None, help="--device cuda: shrink the width (default 4096)")
    p.add_argument("--micro", type=int, default=4, help="--device cuda: sequences per micro-batch")
    p.add_argument("--seq", type=int, default=512, help="--device cuda: tokens per sequence")
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--iters", type=int, default=20, help="micro-batches per round and variant")
    p.add_argument("--owns", action="store_true",
                   help="the capture that owns the factors' gradients (ZeRO-2's path): the plain "
                        "variant's LoRA weight gradients are then work the captured one skips")
    p.add_argument("--lora-only", action="store_true",
                   help="--device cuda: the LoRA layers alone, kernels' time and host time apart (see above)")
    args = p.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        p.error("--device cuda: no CUDA device")
    if args.lora_only and args.device != "cuda":
        p.error("--lora-only needs --device cuda")
    if args.lora_only:
        print(environment_line(environment(torch.device("cuda"))), flush=True)
        return lora_only(args)
    device = torch.device(args.device)
    print(environment_line(environment(device)), flush=True)
    if device.type == "cpu":
        torch.set_num_threads(1)
    model, ids = build(args)
    modules = find_lora_modules(model)
    buffers = capture_buffers(modules, device)
    # domain ids stay on the host, as a training loop has them
    domains = torch.arange(ids.shape[0]) % 4

    def one_micro_batch(capture):
        if capture is None:
            model(input_ids=ids, labels=ids).loss.backward()
        else:
            with capture.micro_batch(domains, 0.25):
                model(input_ids=ids, labels=ids).loss.backward()

    # each round: the mean of --iters micro-batches' forward and backward
    times, busy = alternating_rounds(
        args, modules, buffers, one_micro_batch, busy=device.type == "cuda",
        time_round=lambda fn: statistics.fmean(time_ms(fn, device, warmup=1, reps=args.iters, clock="wall")))
    plain, captured = statistics.median(times[False]), statistics.median(times[True])
    extra = captured - plain
    where = ("one CPU thread" if device.type == "cpu"
             else f"{args.micro} x {args.seq} tokens per micro-batch, bfloat16, {torch.cuda.get_device_name()}")
    print(f"{len(modules)} LoRA layers, capture {capture_mode(args)}, {where}, "
          f"median of {args.rounds} rounds of {args.iters} micro-batches")
    print(f"forward+backward: {plain:.2f} ms without the capture, {captured:.2f} ms with it: "
          f"{extra:+.2f} ms per micro-batch, {extra / len(modules) * 1e3:.1f} us per LoRA layer")
    if device.type == "cuda":
        idle, kernels = statistics.median(busy[False]), statistics.median(busy[True])
        print(f"device busy per micro-batch: {idle:.2f} ms without, {kernels:.2f} ms with: "
              f"{kernels - idle:+.2f} ms of the capture's kernels; the rest of the difference is the host's pace")
    print("rounds without:", ", ".join(f"{t:.2f}" for t in times[False]))
    print("rounds with:   ", ", ".join(f"{t:.2f}" for t in times[True]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
