"""What the tile kernel costs per output element in machine instructions, read without a GPU.

    python tools/kernel_sass.py [--arch 90] [--domains 4] [--normalize snr] [--json FILE]

Compiles the tile kernel for a CUDA architecture (``--arch 90``: H100 and H200) with Triton's
own compiler, as it runs on LLaMA-like modules (bf16, 64 x 64 tiles, strips of 32 tiles),
once with the mask's division exact and once approximate (the default on a GPU), disassembles
the strip's loop (one tile per iteration) and prints its instructions per output element: all
of them, those of the float32 pipe (FMUL, FADD, FFMA, FMNMX, FSETP, FSET, F2FP), those of the
special-function unit (MUFU: reciprocal and exp2), and the tensor-core products and their
waits per tile. The tile kernel's time follows its elementwise instructions (6 fewer of 29 per
element took 13% off it on an H200), so the count
weighs a change before any device time is spent on it; the device's timings
(``tune_method.py``) decide.

The counts depend on the Triton version: the card's are what the installed Triton compiles.
"""
from __future__ import annotations

import argparse
import collections
import re
import sys

from iga_ds.files import atomic_write_json
from iga_ds.methods.iga import triton_kernels

FP32_PIPE = ("FMUL", "FADD", "FFMA", "FMNMX", "FSETP", "FSET", "F2FP")
_INSTRUCTION = re.compile(r"\t(?:@!?U?P\w+ )?([A-Z0-9_]+(?:\.[A-Z0-9_]+)*)")


def loop_instructions(sass: str) -> collections.Counter:
    """Opcodes of the body of the kernel's longest loop (the strip's loop over tiles; the code
    ends in a one-instruction loop of its own), counted by their first two parts (``FMUL``,
    ``MUFU.RCP``, ``HGMMA.64``)."""
    lines = sass.splitlines()
    branches = [(i, m.group(1)) for i, line in enumerate(lines) if (m := re.search(r"BRA (\w+);", line))]
    labels = {line[:-1]: i for i, line in enumerate(lines) if re.fullmatch(r"\w+:", line)}
    loops = [(labels[target], i) for i, target in branches if target in labels and labels[target] < i]
    if not loops:
        raise ValueError("no loop found in the kernel's machine code")
    start, end = max(loops, key=lambda loop: loop[1] - loop[0])
    ops = collections.Counter()
    for line in lines[start:end + 1]:
        match = _INSTRUCTION.search(line)
        if match:
            ops[".".join(match.group(1).split(".")[:2])] += 1
    return ops


def per_element(ops: collections.Counter, elements: int) -> dict:
    """Instructions per output element of one loop iteration (``elements`` per thread)."""
    def count(prefixes):
        return sum(n for op, n in ops.items() if op.split(".")[0] in prefixes)

    return {"total": sum(ops.values()) / elements, "fp32_pipe": count(FP32_PIPE) / elements,
            "mufu": count(("MUFU",)) / elements, "mma_per_tile": count(("HGMMA", "HMMA")),
            "mma_waits_per_tile": sum(n for op, n in ops.items() if "DEPBAR" in op and op.startswith("WARPGROUP"))}


def measure(args) -> list[dict]:
    from triton.tools.disasm import get_sass

    rows = []
    for fast in (False, True):
        kernel = triton_kernels.compile_tile_kernel(arch=args.arch, num_domains=args.domains,
                                                    normalize=args.normalize, fast=fast)
        ops = loop_instructions(get_sass(kernel.asm["cubin"]))
        elements = 64 * 64 // (4 * 32)  # a 64 x 64 tile over 4 warps of 32 threads
        rows.append({"division": "approximate" if fast else "exact", **per_element(ops, elements),
                     "top": ops.most_common(8)})
    return rows


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--arch", type=int, default=90, help="CUDA compute capability times ten (90: H100, H200)")
    p.add_argument("--domains", type=int, default=4, help="N, the domains per isomer group")
    p.add_argument("--normalize", default="snr", choices=("none", "mean", "snr"))
    p.add_argument("--json", help="also write the rows here")
    args = p.parse_args(argv)
    if not triton_kernels.available():
        print("kernel_sass.py needs Triton", file=sys.stderr)
        return 2
    import triton

    rows = measure(args)
    print(f"tile kernel, bf16, sm_{args.arch}, N {args.domains}, {args.normalize}, Triton {triton.__version__}: "
          "instructions per output element of the strip's loop")
    print(f"{'division':>12} {'total':>7} {'fp32 pipe':>10} {'MUFU':>6} {'MMA/tile':>9} {'waits/tile':>11}")
    for r in rows:
        print(f"{r['division']:>12} {r['total']:7.2f} {r['fp32_pipe']:10.2f} {r['mufu']:6.2f} "
              f"{r['mma_per_tile']:9d} {r['mma_waits_per_tile']:11d}")
    if args.json:
        atomic_write_json(args.json, {"arch": args.arch, "triton": triton.__version__, "rows": rows}, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
