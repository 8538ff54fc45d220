"""The Gaussian test matrices of the randomized SVD, counter based: each element a function of
its module's key and its own place, nothing else.

A module's sketch used to come from a ``torch.Generator`` seeded per module: one generator
and one draw per module, 128 of each for LLaMA-2-7B's q, k, v and o, which the host issued
more slowly than the device ran them. A counter-based stream draws the test matrices of
any number of modules in one operation (:func:`gaussian_stack`; on CUDA one Triton launch,
:func:`iga_ds.methods.iga.triton_kernels.gaussian_stack_triton`), and still gives every
module the same matrix on any rank, at any world size, in any stack.

The stream (Steele, Lea and Flood, "Fast splittable pseudorandom number generators",
OOPSLA 2014, the SplitMix64 finaliser): element ``e`` of the stream of key ``k`` is
``h = mix(mix(k) + (e + 1) * golden)``, 64-bit arithmetic modulo 2^64; its top 24 bits and
the 24 below them make two uniforms, and Box and Muller (1958) turn them into a standard
normal, ``sqrt(-2 log u1) cos(2 pi u2)``. A matrix of ``rows x cols`` takes elements
``offset .. offset + rows * cols - 1`` in row-major order, so a second matrix from the same
key (the single-pass SVD's psi after omega) starts where the first ended.

A ``torch.Generator`` (or None, the default generator) is still accepted wherever a key is:
:func:`gaussian` draws from it with ``torch.randn`` as before.
"""
from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from iga_ds.methods.device_copies import host_to_device

_MASK64 = (1 << 64) - 1
GOLDEN = 0x9E3779B97F4A7C15
MIX1 = 0xBF58476D1CE4E5B9
MIX2 = 0x94D049BB133111EB
# 24-bit uniforms: exact in float32
UNIFORM_BITS = 24


@dataclass(frozen=True)
class SketchKey:
    """One module's stream of Gaussian test matrices (in place of a ``torch.Generator``)."""

    value: int

    def __post_init__(self):
        if isinstance(self.value, bool) or not isinstance(self.value, int) or not 0 <= self.value <= _MASK64:
            raise ValueError(f"a sketch key is an integer in [0, 2**64), got {self.value!r}")


# large odd constants, so that neighbouring (step, index) pairs give unrelated keys
_SEED_FACTOR, _STEP_FACTOR, _INDEX_FACTOR, _KEY_MODULUS = 0x9E3779B1, 0x85EBCA77, 0xC2B2AE3D, 2**63 - 1


def sketch_key(seed: int, step: int, index: int) -> SketchKey:
    """The key of module ``index`` at optimizer step ``step`` of a run seeded ``seed``: the
    same sketch on any rank, any world size."""
    return SketchKey((seed * _SEED_FACTOR + step * _STEP_FACTOR + index * _INDEX_FACTOR) % _KEY_MODULUS)


class SketchKeys(Sequence):
    """The keys of several modules at one step, held as integers: item ``i`` is the
    :class:`SketchKey` of ``values[i]``, built only when asked for. The method needs the keys
    of every module each step, while the device waits; one frozen dataclass per module cost
    more host time than the integers (build them with :func:`sketch_keys`)."""

    def __init__(self, values: Sequence[int]):
        self.values = list(values)

    def __len__(self) -> int:
        return len(self.values)

    def __getitem__(self, index):
        if isinstance(index, slice):
            return SketchKeys(self.values[index])
        return SketchKey(self.values[index])

    def take(self, positions: Sequence[int]) -> "SketchKeys":
        """The keys at ``positions``, in that order."""
        return SketchKeys([self.values[i] for i in positions])


def sketch_keys(seed: int, step: int, indices: Sequence[int]) -> SketchKeys:
    """:func:`sketch_key` of each module index in ``indices``, at one step."""
    base = seed * _SEED_FACTOR + step * _STEP_FACTOR
    return SketchKeys([(base + i * _INDEX_FACTOR) % _KEY_MODULUS for i in indices])


def mix64(z: int) -> int:
    """The SplitMix64 finaliser on a Python integer (modulo 2^64)."""
    z &= _MASK64
    z = ((z ^ (z >> 30)) * MIX1) & _MASK64
    z = ((z ^ (z >> 27)) * MIX2) & _MASK64
    return z ^ (z >> 31)


def mixed_keys(keys: Sequence[SketchKey]) -> list[int]:
    """``mix(k)`` of each key as a signed 64-bit integer (the bits a device tensor holds)."""
    values = keys.values if isinstance(keys, SketchKeys) else [k.value for k in keys]
    return [_signed(mix64(v)) for v in values]


def _signed(u: int) -> int:
    return u - (1 << 64) if u >= 1 << 63 else u


def _shift_right(x: torch.Tensor, bits: int) -> torch.Tensor:
    """Logical right shift of int64 tensors holding unsigned 64-bit values."""
    return (x >> bits) & ((1 << (64 - bits)) - 1)


def _mix_tensor(z: torch.Tensor) -> torch.Tensor:
    # int64 products wrap modulo 2^64: the same bits as unsigned arithmetic
    z = (z ^ _shift_right(z, 30)) * _signed(MIX1)
    z = (z ^ _shift_right(z, 27)) * _signed(MIX2)
    return z ^ _shift_right(z, 31)


def box_muller(high: torch.Tensor, low: torch.Tensor) -> torch.Tensor:
    """Standard normals from two float tensors holding 24-bit integers, in their dtype."""
    scale = 2.0 ** -UNIFORM_BITS
    u1 = (high + 0.5) * scale  # in (0, 1): the logarithm stays finite
    u2 = low * scale
    return torch.sqrt(-2.0 * torch.log(u1)) * torch.cos((2.0 * math.pi) * u2)


def gaussian_stack(keys: Sequence[SketchKey], rows: int, cols: int, *, dtype: torch.dtype = torch.float32,
                   device: torch.device | str = "cpu", offset: int = 0) -> torch.Tensor:
    """``len(keys) x rows x cols`` standard normals, matrix ``i`` from the stream of
    ``keys[i]`` starting at element ``offset``: plain PyTorch, on any device (the reference
    of the Triton kernel, and the path for float64)."""
    work = torch.float64 if dtype == torch.float64 else torch.float32
    mixed = host_to_device(torch.tensor(mixed_keys(keys), dtype=torch.int64), device).view(-1, 1)
    counter = torch.arange(offset + 1, offset + rows * cols + 1, dtype=torch.int64, device=device)
    h = _mix_tensor(mixed + counter * _signed(GOLDEN))
    high = _shift_right(h, 64 - UNIFORM_BITS).to(work)
    low = (_shift_right(h, 64 - 2 * UNIFORM_BITS) & ((1 << UNIFORM_BITS) - 1)).to(work)
    return box_muller(high, low).to(dtype).view(len(keys), rows, cols)


def gaussian(source: SketchKey | torch.Generator | None, rows: int, cols: int, *, dtype: torch.dtype,
             device: torch.device | str, offset: int = 0) -> torch.Tensor:
    """A ``rows x cols`` test matrix: from a key's stream at element ``offset``, or from a
    ``torch.Generator`` (None: the default one) by ``torch.randn``, which continues the
    generator's own stream (``offset`` does not apply)."""
    if isinstance(source, SketchKey):
        return gaussian_stack([source], rows, cols, dtype=dtype, device=device, offset=offset)[0]
    return torch.randn(rows, cols, dtype=dtype, device=device, generator=source)
