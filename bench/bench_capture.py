"""Host cost of the per-domain gradient capture, per micro-batch, without a GPU.

    python bench/bench_capture.py [--layers 32] [--rounds 7] [--iters 20] [--owns]

A LLaMA-shaped model so small that its arithmetic is nearly free (hidden 32, LoRA r 4 on
q, k, v, o of every layer, 4 sequences of 8 tokens, one CPU thread): what is left of a
forward and backward is Python and operator dispatch, the work a host must do per
micro-batch whatever the card. The capture's extra is the time with
``DomainGradientCapture`` attached minus the time without, per micro-batch and per LoRA
layer. On a GPU each of the capture's operators is also a kernel launch, so this is a lower
bound of its host cost there; when the host is the bottleneck (several ranks that wait for
one another every micro-batch, docs/results/h200x2-2026-11-26-method-syncs/README.md), this is time the step pays.

Rounds alternate the two variants; the medians of the rounds are printed.
"""
from __future__ import annotations

import argparse
import statistics
import sys

import torch

from common import LORA_TARGETS, environment, environment_line, time_ms
from iga_ds.lora.capture import DomainGradientCapture
from iga_ds.lora.modules import find_lora_modules


def build(layers: int):
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=layers, num_attention_heads=2,
                      num_key_value_heads=2, vocab_size=64, max_position_embeddings=64)
    lora = LoraConfig(r=4, lora_alpha=8, target_modules=list(LORA_TARGETS))
    return get_peft_model(LlamaForCausalLM(cfg), lora)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--layers", type=int, default=32)
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--iters", type=int, default=20, help="micro-batches per round and variant")
    p.add_argument("--owns", action="store_true",
                   help="the capture that owns the factors' gradients (ZeRO-2's path): the plain "
                        "variant's LoRA weight gradients are then work the captured one skips")
    args = p.parse_args(argv)
    print(environment_line(environment("cpu")), flush=True)
    torch.set_num_threads(1)
    model = build(args.layers)
    ids = torch.randint(0, 64, (4, 8))
    modules = find_lora_modules(model)
    buffers = [(torch.zeros(4, *m.lora_A.weight.shape), torch.zeros(4, *m.lora_B.weight.shape)) for m in modules]
    domains = torch.arange(4)

    def micro_batches(capture) -> float:
        """Mean ms of ``--iters`` micro-batches' forward and backward, captured or not."""
        def one():
            if capture is None:
                model(input_ids=ids, labels=ids).loss.backward()
            else:
                with capture.micro_batch(domains, 0.25):
                    model(input_ids=ids, labels=ids).loss.backward()

        return statistics.fmean(time_ms(one, "cpu", warmup=0, reps=args.iters))

    times: dict[bool, list[float]] = {False: [], True: []}
    for r in range(args.rounds + 1):  # round 0 warms up
        for with_capture in ((False, True) if r % 2 == 0 else (True, False)):
            capture = DomainGradientCapture(modules, buffers, 4, owns_gradients=args.owns) if with_capture else None
            ms = micro_batches(capture)
            if capture is not None:
                capture.remove()
            if r:
                times[with_capture].append(ms)
    plain, captured = statistics.median(times[False]), statistics.median(times[True])
    extra = captured - plain
    mode = "owning the factors' gradients" if args.owns else "alongside autograd"
    print(f"{len(modules)} LoRA layers, capture {mode}, one CPU thread, "
          f"median of {args.rounds} rounds of {args.iters} micro-batches")
    print(f"forward+backward: {plain:.2f} ms without the capture, {captured:.2f} ms with it: "
          f"+{extra:.2f} ms per micro-batch, {extra / len(modules) * 1e3:.1f} us per LoRA layer")
    print("rounds without:", ", ".join(f"{t:.2f}" for t in times[False]))
    print("rounds with:   ", ", ".join(f"{t:.2f}" for t in times[True]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
