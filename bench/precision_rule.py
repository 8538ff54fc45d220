"""The precision rule: how much error the method may add, measured from bf16 training itself.

The per-domain LoRA gradients that feed IGA come out of a bf16 forward and backward. Their own
noise is measured here on a real model and a real batch: the same batch, the same LoRA weights,
once with the model in float32 and once in bfloat16 (as DeepSpeed's bf16 mode runs it), per
domain by plain autograd. Two figures per module, relative Frobenius differences bf16 against
float32:

- ``factor``: of the per-domain factor gradients (gA[n] and gB[n] together);
- ``reconstruction``: of the reconstructed full-weight gradients G[n] = s (gB[n] A + B gA[n]).

What the rule compares a variant's error with is that noise carried through the method: per
module, the difference between the float64 method's results on the bf16 gradients and on the
float32 ones (same sketches). Where the rank-r truncation is ill-conditioned (close singular
values at rank r) both the noise and any rounding are amplified alike; the reconstruction
noise alone is no yardstick there (float32 itself is that far from float64 on such modules).
A fast variant passes the rule when its error against the float64 reference on the float32
gradients stays below that module's carried noise on every module where the float32 path's
own error does (the others, where not even float32 is that close to float64, are counted and
reported as undetermined), and its rank-r approximation error stays within 1% of the optimal
one (exact truncated SVD of the masked matrix). Reported beside it: each variant's error over
the float32 path's, and the earlier form of the first half (the largest error against the
median reconstruction noise). ``bench/bench_method.py --model``
prints both and fails when a variant breaks the rule.

The LoRA B factors start from small random values instead of PEFT's zeros, as after some
training: with B = 0 every gA[n] is zero and the noise of half the factors is undefined.
"""
from __future__ import annotations

import statistics
from typing import Sequence

import torch

from iga_ds.data.prompts import format_prompt, format_target
from iga_ds.data.synth import DEFAULT_DOMAINS, generate_groups
from iga_ds.methods import ModuleGrads
from iga_ds.methods.iga.reference import mean_and_variance, normalize_variance
from iga_ds.models import load_auto_tokenizer, load_causal_lm

TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj")
# std of the random LoRA B factors (PEFT's A init is Kaiming-uniform; this B makes B A a few
# percent of a typical weight's scale, as after a few hundred steps)
B_STD = 0.01


def domain_texts(domains: Sequence[str], per_domain: int, seed: int = 0) -> list[list[str]]:
    """Training texts of ``per_domain`` isomer groups from the project's generator, one list per
    domain (the same problems in each domain)."""
    records = generate_groups(per_domain, seed, domains)
    return [[format_prompt(r) + format_target(r) for r in records if r["domain"] == d] for d in domains]


def lora_model(spec: str, rank: int, alpha: float, seed: int, device):
    """The model at ``spec`` (float32) with LoRA on q, k, v, o and random small B factors."""
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(seed)
    base = load_causal_lm(spec, dtype=torch.float32)
    model = get_peft_model(base, LoraConfig(r=rank, lora_alpha=alpha, lora_dropout=0.0,
                                            target_modules=list(TARGETS)))
    gen = torch.Generator().manual_seed(seed + 1)
    for name, p in model.named_parameters():
        if "lora_B" in name:
            p.data.copy_(torch.randn(p.shape, generator=gen) * B_STD)
    return model.to(device)


def lora_layers(model) -> list[tuple[str, torch.nn.Module]]:
    """(name, PEFT LoRA layer) for every adapted module, in model order."""
    return [(name, m) for name, m in model.named_modules()
            if hasattr(m, "lora_A") and "default" in getattr(m, "lora_A", {})]


def per_domain_gradients(model, tokenizer, texts: list[list[str]], max_len: int, device) -> dict:
    """{module name: (gA N x r x in, gB N x out x r)} in float32, one plain backward per domain."""
    layers = lora_layers(model)
    grads: dict[str, tuple[list, list]] = {name: ([], []) for name, _ in layers}
    for domain_texts_ in texts:
        batch = tokenizer(domain_texts_, return_tensors="pt", padding=True, truncation=True, max_length=max_len)
        batch = {k: v.to(device) for k, v in batch.items()}
        labels = batch["input_ids"].masked_fill(batch["attention_mask"] == 0, -100)
        model.zero_grad(set_to_none=True)
        model(**batch, labels=labels).loss.backward()
        for name, layer in layers:
            grads[name][0].append(layer.lora_A["default"].weight.grad.float().clone())
            grads[name][1].append(layer.lora_B["default"].weight.grad.float().clone())
    return {name: (torch.stack(a), torch.stack(b)) for name, (a, b) in grads.items()}


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    b64 = b.double()
    return float((a.double() - b64).norm() / b64.norm().clamp_min(1e-300))


def measure_noise(spec: str, *, rank: int = 16, alpha: float = 32.0, domains: Sequence[str] = DEFAULT_DOMAINS,
                  per_domain: int = 4, max_len: int = 256, seed: int = 0, device=None) -> dict:
    """The bf16 training noise of the per-domain gradients of the model at ``spec`` and the
    float32 per-domain gradients as :class:`ModuleGrads` (the real inputs the variants run on).

    Returns ``{"factor": [...], "reconstruction": [...], "modules": [...], "half_modules": [...],
    "names": [...]}``, one noise figure per module; ``half_modules`` are the bf16 model's
    per-domain gradients with its bf16-rounded factors (what a bf16 run hands the method)."""
    device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    model = lora_model(spec, rank, alpha, seed, device)
    tokenizer = load_auto_tokenizer(spec)
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    texts = domain_texts(domains, per_domain, seed)
    full = per_domain_gradients(model, tokenizer, texts, max_len, device)
    weights = {name: (layer.lora_A["default"].weight.detach().float().clone(),
                      layer.lora_B["default"].weight.detach().float().clone(),
                      float(layer.scaling["default"])) for name, layer in lora_layers(model)}
    half = per_domain_gradients(model.to(torch.bfloat16), tokenizer, texts, max_len, device)
    out: dict = {"factor": [], "reconstruction": [], "modules": [], "half_modules": [], "names": []}
    for index, (name, (gA, gB)) in enumerate(full.items()):
        hA, hB = half[name]
        A, B, s = weights[name]
        out["factor"].append(_rel(torch.cat([hA.flatten(), hB.flatten()]), torch.cat([gA.flatten(), gB.flatten()])))
        G32 = s * (gB.double() @ A.double() + B.double() @ gA.double())
        G16 = s * (hB.double() @ A.double() + B.double() @ hA.double())
        out["reconstruction"].append(_rel(G16, G32))
        out["modules"].append(ModuleGrads(name, index, A, B, gA, gB, s))
        out["half_modules"].append(ModuleGrads(name, index, A.bfloat16().float(), B.bfloat16().float(), hA, hB, s))
        out["names"].append(name)
    return out


def masked_matrix(m: ModuleGrads, tau: float, normalize: str) -> torch.Tensor:
    """The float64 masked matrix Gbar * exp(-tau V') of one module (what rank r approximates)."""
    A, B, gA, gB = (t.double() for t in (m.A, m.B, m.gA, m.gB))
    mean, var = mean_and_variance(A, B, gA, gB, m.scaling)
    return mean * torch.exp(-tau * normalize_variance(var, mean, normalize))


def approximation_ratio(m: ModuleGrads, gA: torch.Tensor, gB: torch.Tensor, masked: torch.Tensor,
                        rank: int) -> float:
    """||M - s gB gA|| / ||M - M_r||, M the float64 masked matrix, M_r its exact rank-r
    truncation (1.0 is optimal). For split factors (s gB gA is the rank-r result itself)."""
    S = torch.linalg.svdvals(masked)
    optimal = float(S[rank:].pow(2).sum().sqrt())
    err = float((masked - m.scaling * gB.double() @ gA.double()).norm())
    return err / optimal if optimal > 0 else 1.0


def summary(values: Sequence[float]) -> dict[str, float]:
    ordered = sorted(values)
    return {"median": statistics.median(ordered), "min": ordered[0], "max": ordered[-1],
            "p90": ordered[min(len(ordered) - 1, int(0.9 * len(ordered)))]}
