"""Would the method hide under backward? Forward+backward and the fused method on two streams.

    python tools/probe_overlap.py [--layers 32] [--reps 6] [--out probe_overlap.json]

The per-domain sums of the top layers are final before the last micro-batch's backward
reaches the bottom ones, so the method could in principle start on a second CUDA stream while
backward runs. This probe measures the most such overlap could give, before anything is built:

- a forward and backward of LLaMA-2-7B's decoder layers (random bf16 weights, frozen, input
  4 x 512 tokens that needs a gradient: the kernels of a LoRA step's backward);
- the fused method's work up to the small SVDs (the tile pass and the power iterations,
  which wait for nothing on the host) on 128 modules of 4096 x 4096, r 16, N 4, 1 GiB stacks;
- each alone, one after the other, and both at once on two streams, in both launch orders and
  with the method's stream at low and high priority.

It prints, for each way of running both, the share of the method's time that disappeared:
``(backward + method - both) / method``. With no dependence between the two, this is an upper
bound of what overlapping the method with backward could save. Needs CUDA and Triton.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))  # bench/common.py: the shared shapes and timers
from common import LLAMA2_7B, environment, environment_line, llama_config, lora_shapes, make_modules, spread, time_ms
from iga_ds.files import atomic_write_json
from iga_ds.methods.iga import triton_kernels
from iga_ds.methods.iga.batched import DEFAULT_BATCH_BYTES, DEFAULT_TILE_ELEMENTS, project_stack, stack_modules


def timed(fn, reps: int) -> dict:
    """Wall ms of ``fn`` with the device synchronized around each call, after 2 untimed calls:
    median, min, max."""
    times = spread(time_ms(fn, "cuda", warmup=2, reps=reps, clock="wall"))
    return {key: times[key] for key in ("median", "min", "max")}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--layers", type=int, default=32, help="decoder layers in the forward and backward")
    p.add_argument("--reps", type=int, default=6)
    p.add_argument("--out", default="probe_overlap.json")
    args = p.parse_args(argv)
    if not (torch.cuda.is_available() and triton_kernels.available()):
        print("probe_overlap.py needs CUDA and Triton", file=sys.stderr)
        return 2
    from transformers import LlamaModel

    device = torch.device("cuda")
    env = environment(device)
    print(environment_line(env), flush=True)
    torch.manual_seed(0)
    config = llama_config({**LLAMA2_7B, "num_hidden_layers": args.layers})
    config._attn_implementation = "sdpa"
    with torch.device(device):
        model = LlamaModel(config).to(torch.bfloat16)
    model.requires_grad_(False)
    x = torch.randn(4, 512, 4096, device=device, dtype=torch.bfloat16, requires_grad=True)

    def forward_backward():
        model(inputs_embeds=x).last_hidden_state.float().pow(2).mean().backward()
        x.grad = None

    # the 128 q, k, v, o modules of LLaMA-2-7B, 4096 x 4096 each
    modules = make_modules(lora_shapes(LLAMA2_7B), rank=16, alpha=32.0, domains=4, device=device)

    def method():
        gens = [torch.Generator(device=device).manual_seed(i) for i in range(len(modules))]
        return [project_stack(st, tau=0.5, normalize="mean", rank=None, oversample=10, power_iters=2,
                              tile_elements=DEFAULT_TILE_ELEMENTS, use_triton=True, triton_precision="ieee",
                              svd="randomized")
                for st in stack_modules(modules, gens, DEFAULT_BATCH_BYTES)]

    def both(method_first: bool, priority: int):
        side = torch.cuda.Stream(priority=priority)

        def run():
            main_stream = torch.cuda.current_stream()
            side.wait_stream(main_stream)
            if method_first:
                with torch.cuda.stream(side):
                    kept = method()
                forward_backward()
            else:
                forward_backward()
                with torch.cuda.stream(side):
                    kept = method()
            main_stream.wait_stream(side)
            return kept

        return run

    result = {"environment": env, "layers": args.layers,
              "forward_backward_ms": timed(forward_backward, args.reps),
              "method_ms": timed(method, args.reps),
              "serial_ms": timed(lambda: (forward_backward(), method()), args.reps)}
    for method_first in (True, False):
        for priority in (0, -1):  # 0: the default (low) priority; -1: high
            name = f"both_{'method' if method_first else 'backward'}_first_priority{priority}_ms"
            result[name] = timed(both(method_first, priority), args.reps)
    fb, m = result["forward_backward_ms"]["median"], result["method_ms"]["median"]
    print(f"{result['environment']['card']}: forward+backward of {args.layers} layers {fb:.1f} ms, "
          f"method (tile pass and power iterations, 128 modules) {m:.1f} ms")
    for key, value in result.items():
        if key == "serial_ms" or key.startswith("both_"):
            value["method_share_hidden"] = (fb + m - value["median"]) / m
            print(f"{key:38s} {value['median']:8.1f} ms   {value['method_share_hidden']:5.2f} of the method hidden")
    atomic_write_json(args.out, result, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
