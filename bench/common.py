"""What the benchmarks share: the model shapes, synthetic per-domain module gradients, timing,
and the environment line every benchmark prints.

Not a script. The benchmarks import it by name (``import common``): Python puts the directory
of the script it runs (``python bench/x.py``) first on the module search path, and the tests get
``bench/`` on it from pytest's ``pythonpath`` option (``pyproject.toml``).

- Shapes: :data:`LLAMA2_7B` (the one definition), :func:`model_config` (shrunk for smoke
  tests), :func:`lora_shapes` (q, k, v, o of every layer, grouped-query aware), :data:`SMALL`
  (the CPU smoke-test size).
- Module gradients: :func:`make_modules`, factors and per-domain gradients as
  :class:`iga_ds.methods.ModuleGrads` at the scale of a LoRA run some steps in.
- Timing: :func:`time_ms` (CUDA events, or the wall clock with the device synchronized, after
  warm-up calls), :func:`spread` (median and spread of the times), :func:`do_bench_ms`
  (Triton's ``do_bench``: time budgets, L2 cache flushed between calls), :func:`peak_extra_mib`,
  :func:`gpu_busy_ms`, :func:`tf32_matmuls`.
- Environment: :func:`environment` (card, Python, torch, CUDA and library versions) and
  :func:`environment_line`.
"""
from __future__ import annotations

import argparse
import contextlib
import importlib.metadata
import json
import math
import platform
import random
import statistics
import time

import torch

from iga_ds.errors import ConfigError
from iga_ds.methods import ModuleGrads
from iga_ds.methods.iga.batched import resolve_batch_bytes

# LLaMA-2-7B (Touvron et al., 2023, "Llama 2: Open Foundation and Fine-Tuned Chat Models"),
# the fields of its Hugging Face config that set the shapes
LLAMA2_7B = {
    "model_type": "llama",
    "vocab_size": 32000,
    "hidden_size": 4096,
    "intermediate_size": 11008,
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "num_key_value_heads": 32,
    "max_position_embeddings": 4096,
    "rms_norm_eps": 1e-5,
    "rope_theta": 10000.0,
    "hidden_act": "silu",
    "tie_word_embeddings": False,
}
# the LoRA target modules of every benchmark
LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj")
# a CPU smoke test's size: 2 layers, hidden 256, LoRA r 8, 3 timed calls after 1
SMALL = dict(layers=2, hidden=256, rank=8, reps=3, warmup=1)
# config fields that are not LlamaConfig arguments
_NOT_FIELDS = ("architectures", "model_type", "torch_dtype", "dtype")
_PACKAGES = ("triton", "deepspeed", "transformers", "peft")


def load_config(path: str) -> dict:
    """A Hugging Face model config JSON; ConfigError naming the file when it is unreadable or
    lacks an integer ``hidden_size``, ``num_attention_heads`` or ``num_hidden_layers``."""
    try:
        with open(path) as fh:
            config = json.load(fh)
    except OSError as exc:
        raise ConfigError(f"{path}: cannot read the model config ({exc.strerror})") from None
    except json.JSONDecodeError as exc:
        raise ConfigError(f"{path}: line {exc.lineno}: not valid JSON ({exc.msg})") from None
    for key in ("hidden_size", "num_attention_heads", "num_hidden_layers"):
        if not isinstance(config.get(key), int):
            raise ConfigError(f"{path}: field {key!r}: expected an integer, got {config.get(key)!r}")
    return config


def model_config(path: str | None = None, *, layers: int | None = None, hidden: int | None = None,
                 vocab: int | None = None) -> dict:
    """The config at ``path`` (default LLaMA-2-7B), shrunk: ``hidden`` sets the width with heads
    of 64 and an MLP of 8/3 the width, ``layers`` the depth, ``vocab`` the vocabulary."""
    config = load_config(path) if path else dict(LLAMA2_7B)
    if hidden:
        heads = max(1, hidden // 64)
        config.update(hidden_size=hidden, num_attention_heads=heads, num_key_value_heads=heads,
                      intermediate_size=int(hidden * 8 / 3 // 16 * 16) or 16)
        config.pop("head_dim", None)
    if layers:
        config["num_hidden_layers"] = layers
    if vocab:
        config["vocab_size"] = vocab
    return config


def llama_config(config: dict):
    """A ``transformers.LlamaConfig`` from a config dict such as :data:`LLAMA2_7B`."""
    from transformers import LlamaConfig

    return LlamaConfig(**{k: v for k, v in config.items() if k not in _NOT_FIELDS})


def lora_llama(config: dict, *, rank: int, alpha: float, dtype, device, grad_ckpt: bool = False):
    """A random-weight LLaMA of ``config`` with PEFT LoRA on q, k, v, o, built on ``device`` in
    ``dtype`` (a float32 7B would not fit first), B drawn non-zero as some steps into a run."""
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaForCausalLM

    torch.manual_seed(0)
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            base = LlamaForCausalLM(llama_config(config))
    finally:
        torch.set_default_dtype(previous)
    lora = LoraConfig(r=rank, lora_alpha=alpha, lora_dropout=0.0, target_modules=list(LORA_TARGETS))
    model = get_peft_model(base, lora)
    with torch.no_grad():  # B = 0 at PEFT's start; a run some steps in has B != 0
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 1e-3)
    if grad_ckpt:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        model.enable_input_require_grads()
    return model


def lora_shapes(config: dict) -> list[tuple[str, int, int]]:
    """(name, in, out) of q, k, v, o for every layer of a LLaMA-style config (grouped-query aware)."""
    hidden, heads = config["hidden_size"], config["num_attention_heads"]
    head_dim = config.get("head_dim") or hidden // heads
    kv = config.get("num_key_value_heads") or heads
    per_layer = [("q_proj", hidden, heads * head_dim), ("k_proj", hidden, kv * head_dim),
                 ("v_proj", hidden, kv * head_dim), ("o_proj", heads * head_dim, hidden)]
    return [(f"layers.{i}.{n}", d_in, d_out)
            for i in range(config["num_hidden_layers"]) for n, d_in, d_out in per_layer]


def make_modules(shapes, *, rank: int, alpha: float, domains: int, device, seed: int = 0,
                 dtype=torch.float32) -> list[ModuleGrads]:
    """Factors and per-domain gradients at the scale of a LoRA run some steps in, one module per
    ``(name, in, out)`` of ``shapes``, deterministic for a seed and device.

    A as PEFT initialises it (uniform, bound 1/sqrt(in)); B small but non-zero; per-domain
    gradients near 1e-4 with a part shared by all domains (isomers agree on much) and a part
    of their own.
    """
    gen = torch.Generator(device=device).manual_seed(seed)

    def randn(*size):
        return torch.randn(*size, generator=gen, device=device, dtype=dtype)

    mods = []
    for index, (name, d_in, d_out) in enumerate(shapes):
        A = (torch.rand(rank, d_in, generator=gen, device=device, dtype=dtype) * 2 - 1) / math.sqrt(d_in)
        B = randn(d_out, rank) * 2e-3
        gA = 1e-4 * (randn(1, rank, d_in) + randn(domains, rank, d_in))
        gB = 1e-4 * (randn(1, d_out, rank) + randn(domains, d_out, rank))
        mods.append(ModuleGrads(name, index, A, B, gA, gB, alpha / rank))
    return mods


def synchronize(device) -> None:
    """Wait for the device's queued work (nothing to wait for on the CPU)."""
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


def time_ms(fn, device, *, warmup: int, reps: int, clock: str = "events") -> list[float]:
    """Milliseconds of each of ``reps`` calls of ``fn``, after ``warmup`` untimed calls.

    ``clock="events"``: CUDA events around the call (device time from the first kernel queued
    to the last done); ``"wall"``: the host's clock with the device synchronized before and
    after (host time included: what a caller waits). On the CPU both are ``perf_counter``.
    """
    if clock not in ("events", "wall"):
        raise ValueError(f"clock must be 'events' or 'wall', got {clock!r}")
    device = torch.device(device)
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(reps):
        synchronize(device)
        if device.type == "cuda" and clock == "events":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            synchronize(device)
            times.append(start.elapsed_time(end))
        else:
            t0 = time.perf_counter()
            fn()
            synchronize(device)
            times.append(1e3 * (time.perf_counter() - t0))
    return times


def spread(times: list[float]) -> dict[str, float]:
    """Median, 10th and 90th percentile (nearest rank), minimum and maximum of ``times``."""
    ordered = sorted(times)
    n = len(ordered)
    return {"median": statistics.median(ordered), "p10": ordered[n // 10],
            "p90": ordered[min(n - 1, (9 * n) // 10)], "min": ordered[0], "max": ordered[-1]}


def paired_ratio(times: list[float], baseline: list[float], level: float = 0.9, resamples: int = 2000,
                 seed: int = 0) -> tuple[float, float, float]:
    """sum(times) / sum(baseline) over the same steps, with a bootstrap interval that resamples
    steps, both lists at the same indices. Paired: the steps hold the same tokens in both, so
    the spread that comes from the data (short and long batches) cancels. Deterministic."""
    if len(times) != len(baseline) or not times:
        raise ValueError(f"paired_ratio: {len(times)} steps against {len(baseline)}")
    rng = random.Random(seed)
    n = len(times)
    ratios = []
    for _ in range(resamples):
        picks = rng.choices(range(n), k=n)
        ratios.append(sum(times[i] for i in picks) / sum(baseline[i] for i in picks))
    ratios.sort()
    tail = (1.0 - level) / 2
    return (sum(times) / sum(baseline), ratios[int(tail * resamples)],
            ratios[min(resamples - 1, int((1.0 - tail) * resamples))])


def do_bench_ms(fn, warmup: int = 25, rep: int = 200) -> float:
    """Median ms of ``fn`` by ``triton.testing.do_bench`` (CUDA events, L2 cache flushed before
    each call; ``warmup`` and ``rep`` are time budgets in ms, as do_bench takes them)."""
    import triton

    return float(triton.testing.do_bench(fn, warmup=warmup, rep=rep, return_mode="median"))


def peak_extra_mib(fn, device) -> float | None:
    """MiB that one call of ``fn`` raises the device's allocation peak above what is allocated
    before it (its result included); None on the CPU."""
    device = torch.device(device)
    if device.type != "cuda":
        return None
    synchronize(device)
    base = torch.cuda.memory_allocated(device)
    torch.cuda.reset_peak_memory_stats(device)
    result = fn()
    synchronize(device)
    peak = torch.cuda.max_memory_allocated(device) - base
    del result
    return peak / 2**20


def gpu_busy_ms(fn) -> float:
    """Sum of the device time of the kernels of one call of ``fn``, after one untimed call
    (kernels on several streams at once would be counted twice)."""
    fn()
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    return sum(e.self_device_time_total for e in prof.key_averages()) / 1e3


@contextlib.contextmanager
def tf32_matmuls(enabled: bool):
    """float32 matrix products on TF32 tensor cores inside the block (``enabled``) or not."""
    previous = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = enabled
    try:
        yield
    finally:
        torch.backends.cuda.matmul.allow_tf32 = previous


def _version(package: str) -> str | None:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return None


def environment(device, world_size: int | None = None) -> dict:
    """What a result depends on besides the code: the card (the CPU without CUDA), Python,
    torch, CUDA and the versions of Triton, DeepSpeed, transformers and PEFT (None when absent);
    ``world_size`` when given."""
    device = torch.device(device)
    card = torch.cuda.get_device_name(device) if device.type == "cuda" else (platform.processor() or "cpu")
    env = {"card": card, "device": str(device), "python": platform.python_version(), "torch": torch.__version__,
           "cuda": torch.version.cuda, **{name: _version(name) for name in _PACKAGES}}
    if world_size is not None:
        env["world_size"] = world_size
    return env


def environment_line(env: dict) -> str:
    """``card: NAME [x WORLD] | python V | torch V | CUDA V | ...``, the libraries that are installed."""
    card = env.get("card", "?") + (f" x {env['world_size']}" if env.get("world_size") else "")
    parts = [f"card: {card}", f"python {env.get('python')}", f"torch {env.get('torch')}", f"CUDA {env.get('cuda')}"]
    parts += [f"{name} {env[name]}" for name in _PACKAGES if env.get(name)]
    return " | ".join(parts)


def batch_bytes_option(text: str):
    """--batch-bytes: 'auto' or a byte count, checked by the batched path's own rule."""
    if text == "auto":
        return text
    try:
        return resolve_batch_bytes(int(text), torch.device("cpu"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected 'auto' or a positive number of bytes, got {text!r}") from None
