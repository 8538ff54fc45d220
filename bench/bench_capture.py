"""What the per-domain gradient capture costs a micro-batch: its host work alone, or all of it at a
real model's shape on a GPU.

    python bench/bench_capture.py [--layers 32] [--rounds 7] [--iters 20] [--owns]
    python bench/bench_capture.py --device cuda --owns [--layers 32] [--micro 4] [--seq 512]

Host cost (the default, no GPU needed): a LLaMA-shaped model so small that its arithmetic is
nearly free (hidden 32, LoRA r 4 on q, k, v, o of every layer, 4 sequences of 8 tokens, one
CPU thread): what is left of a forward and backward is Python and operator dispatch, the work
a host must do per micro-batch whatever the card. On a GPU each of the capture's operators is
also a kernel launch, so this is a lower bound of its host cost there; when the host is the
bottleneck (several ranks that wait for one another every micro-batch,
docs/results/h200x2-2026-11-26-method-syncs/README.md), this is time the step pays.

``--device cuda``: the LLaMA-2-7B shape (``--layers``/``--hidden`` shrink it) in bfloat16
with LoRA r 16 on q, k, v, o, micro-batches of ``--micro`` sequences of ``--seq`` tokens, one
domain per sequence. Each micro-batch is timed on the host's clock with the device
synchronized, so the figure is everything the capture adds: its kernels, its launches and its
Python. The plain variant is PyTorch's own LoRA gradients (what DeepSpeed's ERM computes
before it reduces them); with ``--owns`` the captured variant skips those and keeps the
per-domain sums instead, as under ZeRO-2.

The capture's extra is the time with ``DomainGradientCapture`` attached minus the time
without. Rounds alternate the two variants; the medians of the rounds are printed. On a GPU
the device's busy time per micro-batch (the sum of its kernels' time, profiled) is printed
too: the capture's kernels are the difference of the two, and whatever the wall time adds
beyond that is the host's pace (a model whose host work takes as long as its kernels waits
for the host, and then every microsecond of Python shows).
"""
from __future__ import annotations

import argparse
import statistics
import sys

import torch

from common import LORA_TARGETS, environment, environment_line, gpu_busy_ms, lora_llama, model_config, time_ms
from iga_ds.lora.capture import DomainGradientCapture
from iga_ds.lora.modules import find_lora_modules


def build(args):
    """The model and its micro-batch's token ids for ``args`` (see the module docstring)."""
    if args.device == "cuda":
        config = model_config(layers=args.layers, hidden=args.hidden)
        model = lora_llama(config, rank=16, alpha=32.0, dtype=torch.bfloat16, device="cuda")
        ids = torch.randint(0, config["vocab_size"], (args.micro, args.seq), device="cuda")
        return model, ids
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=args.layers, num_attention_heads=2,
                      num_key_value_heads=2, vocab_size=64, max_position_embeddings=64)
    lora = LoraConfig(r=4, lora_alpha=8, target_modules=list(LORA_TARGETS))
    return get_peft_model(LlamaForCausalLM(cfg), lora), torch.randint(0, 64, (4, 8))


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
    args = p.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        p.error("--device cuda: no CUDA device")
    device = torch.device(args.device)
    print(environment_line(environment(device)), flush=True)
    if device.type == "cpu":
        torch.set_num_threads(1)
    model, ids = build(args)
    modules = find_lora_modules(model)
    buffers = [(torch.zeros(4, *m.lora_A.weight.shape, device=device),
                torch.zeros(4, *m.lora_B.weight.shape, device=device)) for m in modules]
    # domain ids stay on the host, as a training loop has them
    domains = torch.arange(ids.shape[0]) % 4

    def one_micro_batch(capture):
        if capture is None:
            model(input_ids=ids, labels=ids).loss.backward()
        else:
            with capture.micro_batch(domains, 0.25):
                model(input_ids=ids, labels=ids).loss.backward()

    times: dict[bool, list[float]] = {False: [], True: []}
    busy: dict[bool, list[float]] = {False: [], True: []}
    for r in range(args.rounds + 1):  # round 0 warms up
        for with_capture in ((False, True) if r % 2 == 0 else (True, False)):
            capture = DomainGradientCapture(modules, buffers, 4, owns_gradients=args.owns) if with_capture else None
            # the mean of --iters micro-batches' forward and backward
            ms = statistics.fmean(time_ms(lambda: one_micro_batch(capture), device, warmup=1, reps=args.iters,
                                          clock="wall"))
            if r and device.type == "cuda":
                busy[with_capture].append(gpu_busy_ms(lambda: one_micro_batch(capture)))
            if capture is not None:
                capture.remove()
            if r:
                times[with_capture].append(ms)
    plain, captured = statistics.median(times[False]), statistics.median(times[True])
    extra = captured - plain
    mode = "owning the factors' gradients" if args.owns else "alongside autograd"
    where = ("one CPU thread" if device.type == "cpu"
             else f"{args.micro} x {args.seq} tokens per micro-batch, bfloat16, {torch.cuda.get_device_name()}")
    print(f"{len(modules)} LoRA layers, capture {mode}, {where}, "
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
