"""Logical Consistency Score (LCS) and Gradient Invariance Residual (GIR).

LCS (paper Sec. "Logical Consistency Score", Eq. lcs): for K isomer groups with hidden states
z_k^(1..N) in R^H, LCS = 1/K sum_k Tr Cov(z_k^(1), ..., z_k^(N)), Cov the H x H *sample*
covariance (ddof=1) of the N vectors. Since Tr Cov = sum_h Var_h, no H x H matrix is formed.
The paper reports LCS x 1e-2 (a table entry 3.10 is LCS = 0.031): ``lcs_paper_units``.

GIR (paper Appendix, Definition "Gradient Invariance Residual"): 1/N sum_n ||g_n - gbar||^2 =
sum over elements of the *population* variance (1/N) across domains.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any, Mapping, Sequence

if TYPE_CHECKING:  # torch is imported lazily so that `iga-ds --help` stays fast
    import torch

LCS_PAPER_SCALE = 1e-2


def lcs_paper_units(value: float) -> float:
    """LCS as printed in the paper's tables (in units of 1e-2)."""
    return float(value) / LCS_PAPER_SCALE


def lcs(hidden: "torch.Tensor | Any") -> float:
    """LCS of hidden states ``K x N x H`` (groups x domains x features), computed in float64."""
    import torch

    h = torch.as_tensor(hidden).to(torch.float64)
    if h.dim() != 3:
        raise ValueError(f"lcs expects a K x N x H tensor, got shape {tuple(h.shape)}")
    k, n, _ = h.shape
    if k == 0:
        raise ValueError("lcs needs at least one group")
    if n < 2:
        raise ValueError(f"lcs needs at least 2 domain instances per group, got N={n}")
    centered = h - h.mean(dim=1, keepdim=True)
    trace_cov = centered.pow(2).sum(dim=(1, 2)) / (n - 1)  # one trace per group
    return float(trace_cov.mean())


def gir(per_domain_grads: "torch.Tensor | Sequence[torch.Tensor] | Mapping[str, torch.Tensor]") -> float:
    """Sum of per-element population variance across domains (float64).

    Accepts one tensor ``N x ...`` (domains first), a sequence of N same-shape tensors, or a
    mapping ``module name -> N x ...`` tensor (the GIR of the whole adapter is the sum).
    """
    import torch

    if isinstance(per_domain_grads, Mapping):
        return float(sum(gir(g) for g in per_domain_grads.values()))
    if isinstance(per_domain_grads, (list, tuple)):
        grads = torch.stack([torch.as_tensor(g) for g in per_domain_grads])
    else:
        grads = torch.as_tensor(per_domain_grads)
    if grads.dim() < 1 or grads.shape[0] < 1:
        raise ValueError("gir needs gradients of at least one domain")
    g = grads.to(torch.float64)
    return float((g - g.mean(dim=0, keepdim=True)).pow(2).mean(dim=0).sum())
