"""The measures of ``iga-ds diagnose`` (its module's docstring says what they are): each
method's combined gradient U, and where asked the optimizer's update u(U), against the task and
cue directions, in the factor and the weight space, from sums over modules of their inner
products (every figure a ratio of float64 sums, so the module count does not matter)."""
from __future__ import annotations

import math
from dataclasses import replace
from typing import Any, Callable, Sequence

import torch

from iga_ds.methods import GradientMethod, ModuleGrads

REFERENCE = "erm"  # the plain mean: every share is measured against it
Pairs = list[tuple[torch.Tensor, torch.Tensor]]  # (gA, gB) per module
# a method's (gA, gB) per module -> the optimizer's (uA, uB) per module, and its clipping factor
Precondition = Callable[[Pairs], tuple[Pairs, float]]


def apply_method(method: GradientMethod, modules: Sequence[ModuleGrads]) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(gA, gB) per module: ERM's mean over domains, or the method's ``combine`` at step 0."""
    if method.scope == "loss":
        return [(m.gA.mean(dim=0), m.gB.mean(dim=0)) for m in modules]
    # copies: what a method does to its inputs cannot reach the measures or the next method
    own = [replace(m, A=m.A.clone(), B=m.B.clone(), gA=m.gA.clone(), gB=m.gB.clone()) for m in modules]
    return [(u.gA, u.gB) for u in method.combine(own, 0)]


# -- the measures ----------------------------------------------------------------------------


SPACES = ("weight", "factor")


def _vectors(m: ModuleGrads, pairs: Sequence[tuple[torch.Tensor, torch.Tensor]]) -> dict[str, list[torch.Tensor]]:
    """Each (gA, gB) of one module as a flat float64 vector in both spaces."""
    A, B = m.A.double(), m.B.double()
    return {"factor": [torch.cat([a.double().reshape(-1), b.double().reshape(-1)]) for a, b in pairs],
            "weight": [(m.scaling * (b.double() @ A + B @ a.double())).reshape(-1) for a, b in pairs]}


def module_figures(cue: ModuleGrads, plain: ModuleGrads, updates: Sequence[tuple[torch.Tensor, torch.Tensor]]
                   ) -> dict[str, dict[str, Any]]:
    """One module's share of the sums the measures are ratios of, per space: ``gram``, the inner
    products of [t, c, U_1, ...] (ERM first among the updates), and ``spread``, the mean over
    domains of ||t[n] - t||^2 and of ||c[n] - c||^2."""
    tA, tB = plain.gA.double().mean(dim=0), plain.gB.double().mean(dim=0)
    cA, cB = cue.gA.double().mean(dim=0) - tA, cue.gB.double().mean(dim=0) - tB
    vectors = _vectors(cue, [(tA, tB), (cA, cB), *updates])
    out = {}
    for space in SPACES:
        v = vectors[space]
        gram = torch.tensor([[float(torch.dot(x, y)) for y in v] for x in v], dtype=torch.float64)
        out[space] = {"gram": gram, "spread": torch.zeros(2, dtype=torch.float64)}
    del vectors
    n = cue.num_domains
    for i in range(n):  # one domain at a time: a few module-sized matrices alive, whatever N
        task = (plain.gA[i].double() - tA, plain.gB[i].double() - tB)
        shortcut = (cue.gA[i].double() - plain.gA[i].double() - cA, cue.gB[i].double() - plain.gB[i].double() - cB)
        for space, (dt, dc) in _vectors(cue, [task, shortcut]).items():
            out[space]["spread"] += torch.tensor([float(dt.pow(2).sum()), float(dc.pow(2).sum())],
                                                 dtype=torch.float64) / n
    return out


def _ratio(a: float, b: float) -> float | None:
    value = a / b if b != 0 else math.nan
    return value if math.isfinite(value) else None


def _cos(g: torch.Tensor, i: int, j: int) -> float | None:
    return _ratio(float(g[i, j]), math.sqrt(float(g[i, i]) * float(g[j, j])))


def summarize(gram: torch.Tensor, spread: torch.Tensor, labels: Sequence[str]) -> dict[str, Any]:
    """The measures of one space from its summed ``gram`` ([t, c, ERM, the others]) and ``spread``."""
    g = gram.tolist()
    t, c, erm = 0, 1, 2
    directions = {"task_norm": math.sqrt(g[t][t]), "cue_norm": math.sqrt(g[c][c]), "cos_task_cue": _cos(gram, t, c),
                  "task_spread": _ratio(math.sqrt(float(spread[0])), math.sqrt(g[t][t])),
                  "cue_spread": _ratio(math.sqrt(float(spread[1])), math.sqrt(g[c][c]))}
    methods = {}
    for k, label in enumerate(labels, start=erm):
        methods[label] = {"task": _ratio(g[k][t], g[erm][t]), "cue": _ratio(g[k][c], g[erm][c]),
                          "cos_task": _cos(gram, k, t), "cos_cue": _cos(gram, k, c),
                          "size": _ratio(math.sqrt(g[k][k]), math.sqrt(g[erm][erm]))}
    return {"directions": directions, "methods": methods}


def _sub(gram: torch.Tensor, keep: Sequence[int]) -> torch.Tensor:
    return gram[list(keep)][:, list(keep)]


def measure(cue: Sequence[ModuleGrads], plain: Sequence[ModuleGrads], methods: dict[str, GradientMethod],
            on_method: Callable[[str], None] | None = None, precondition: Precondition | None = None
            ) -> dict[str, Any]:
    """Every method's update of the cue gradients, measured against the task and cue directions:
    the whole model's figures per space, and each module's shares in the weight space; with
    ``precondition`` (a method's (gA, gB) per module -> the optimizer's update and its clipping
    factor), the same shares of the optimizer's updates (``after_optimizer``)."""
    labels = list(methods)
    if labels[0] != REFERENCE:
        raise ValueError(f"the first method must be {REFERENCE}, the reference")
    updates, stepped, scales = {}, {}, {}
    for label, method in methods.items():
        updates[label] = apply_method(method, cue)
        if precondition is not None:
            stepped[label], scales[label] = precondition(updates[label])
        if on_method is not None:
            on_method(label)
    # one gram over [t, c, U_1..U_M, u_1..u_M]: the gradients' block, then the updates'
    m = len(labels)
    blocks = {"gradient": [0, 1, *range(2, 2 + m)], "update": [0, 1, *range(2 + m, 2 + 2 * m)]}
    totals = {s: {"gram": 0.0, "spread": 0.0} for s in SPACES}
    per_module = []
    for i, (mc, mp) in enumerate(zip(cue, plain)):
        mine = [updates[label][i] for label in labels] + [stepped[label][i] for label in stepped]
        figures = module_figures(mc, mp, mine)
        for space in SPACES:
            for key in ("gram", "spread"):
                totals[space][key] = totals[space][key] + figures[space][key]
        per_module.append(_module_entry(mc.name, figures["weight"], labels, blocks, bool(stepped)))
    out = {s: summarize(_sub(totals[s]["gram"], blocks["gradient"]), totals[s]["spread"], labels) for s in SPACES}
    if stepped:
        out["after_optimizer"] = {"clip_scale": scales, **{
            s: {"methods": summarize(_sub(totals[s]["gram"], blocks["update"]), totals[s]["spread"], labels)["methods"]}
            for s in SPACES}}
    return {**out, "modules": per_module}


def _module_entry(name: str, weight: dict[str, Any], labels: Sequence[str], blocks: dict[str, list[int]],
                  stepped: bool) -> dict[str, Any]:
    """One module's directions and the weight-space shares of its gradients (and updates)."""
    own = summarize(_sub(weight["gram"], blocks["gradient"]), weight["spread"], labels)
    entry = {"name": name, **own["directions"],
             "methods": {k: {"task": v["task"], "cue": v["cue"]} for k, v in own["methods"].items()}}
    if stepped:
        after = summarize(_sub(weight["gram"], blocks["update"]), weight["spread"], labels)["methods"]
        entry["after_optimizer"] = {k: {"task": v["task"], "cue": v["cue"]} for k, v in after.items()}
    return entry
