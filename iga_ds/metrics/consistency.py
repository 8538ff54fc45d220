"""Logical Consistency Score (LCS) and Gradient Invariance Residual (GIR).

LCS (paper Sec. "Logical Consistency Score", Eq. lcs): for K isomer groups with hidden states
z_k^(1..N) in R^H, LCS = 1/K sum_k Tr Cov(z_k^(1), ..., z_k^(N)), Cov the H x H *sample*
covariance (ddof=1) of the N vectors. Since Tr Cov = sum_h Var_h, no H x H matrix is formed.
The paper reports LCS x 1e-2 (a table entry 3.10 is LCS = 0.031): ``lcs_paper_units``.

GIR (paper Appendix, Definition "Gradient Invariance Residual"): 1/N sum_n ||g_n - gbar||^2 =
sum over elements of the *population* variance (1/N) across domains.
"""
from __future__ import annotations

from collections import OrderedDict
from typing import TYPE_CHECKING, Any, Callable, Iterable, Mapping, Sequence

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


def isomer_groups(
    records: Iterable[Mapping[str, Any]],
    domains: Sequence[str] | None = None,
) -> tuple[list[list[Mapping[str, Any]]], list[str]]:
    """Group isomer records by ``group_id`` into lists ordered by domain.

    Only groups holding exactly one instance of every domain are kept (LCS compares the same
    problem across the same N domains). ``domains`` defaults to every domain seen, sorted.
    Returns (groups, domains).
    """
    by_group: "OrderedDict[str, dict[str, Mapping[str, Any]]]" = OrderedDict()
    seen: set[str] = set()
    for rec in records:
        by_group.setdefault(str(rec["group_id"]), {})[str(rec["domain"])] = rec
        seen.add(str(rec["domain"]))
    order = list(domains) if domains is not None else sorted(seen)
    groups = [
        [members[d] for d in order]
        for members in by_group.values()
        if all(d in members for d in order)
    ]
    return groups, order


def _resolve_layers(layers: Sequence[int] | None, num_hidden_states: int) -> list[int]:
    """Layer indices into ``hidden_states`` (0 = embeddings, L = last layer); negatives count back.

    The default is the penultimate layer, ``hidden_states[L - 1]`` (layer 31 of a 32-layer model,
    as in the paper's Table 6).
    """
    if layers is None:
        layers = [-2]
    resolved = []
    for layer in layers:
        idx = layer + num_hidden_states if layer < 0 else layer
        if not 0 <= idx < num_hidden_states:
            raise ValueError(
                f"layer {layer} out of range: the model has hidden states 0..{num_hidden_states - 1} "
                "(0 = embeddings)"
            )
        resolved.append(idx)
    return resolved


def token_averaged_hidden_states(
    model: Any,
    tokenizer: Any,
    texts: Sequence[str],
    layers: Sequence[int] | None = None,
    batch_size: int = 8,
    max_length: int | None = None,
    progress: bool = False,
) -> dict[int, "torch.Tensor"]:
    """``{layer: len(texts) x H}`` float64 means of hidden states over non-padding tokens."""
    import torch
    from tqdm.auto import tqdm

    device = next(model.parameters()).device
    was_training = model.training
    model.eval()
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    # Right padding keeps every real token at the position it has unpadded (causal attention
    # never looks right), so a text's hidden states do not depend on its batch neighbours.
    padding_side, tokenizer.padding_side = tokenizer.padding_side, "right"
    out: dict[int, list[torch.Tensor]] = {}
    resolved: list[int] | None = None
    try:
        with torch.no_grad():
            for start in tqdm(range(0, len(texts), batch_size), desc="hidden states", disable=not progress):
                batch = tokenizer(
                    list(texts[start:start + batch_size]),
                    return_tensors="pt",
                    padding=True,
                    truncation=max_length is not None,
                    max_length=max_length,
                )
                batch = {k: v.to(device) for k, v in batch.items() if k in ("input_ids", "attention_mask")}
                hidden = model(**batch, output_hidden_states=True).hidden_states
                if resolved is None:
                    resolved = _resolve_layers(layers, len(hidden))
                mask = batch["attention_mask"].to(torch.float64).unsqueeze(-1)
                for idx in resolved:
                    h = hidden[idx].to(torch.float64)
                    mean = (h * mask).sum(dim=1) / mask.sum(dim=1).clamp_min(1.0)
                    out.setdefault(idx, []).append(mean.cpu())
    finally:
        model.train(was_training)
        tokenizer.padding_side = padding_side
    return {idx: torch.cat(chunks) for idx, chunks in out.items()}


def lcs_of_model(
    model: Any,
    tokenizer: Any,
    groups: Sequence[Sequence[Mapping[str, Any]]] | Sequence[Mapping[str, Any]],
    layers: Sequence[int] | None = None,
    text_fn: Callable[[Mapping[str, Any]], str] | None = None,
    batch_size: int = 8,
    max_length: int | None = None,
    progress: bool = False,
) -> dict[int, float]:
    """LCS of a model on isomer groups at each layer: ``{layer index: LCS}`` (raw, not x1e-2).

    ``groups`` is a list of groups (each the N domain instances of one problem, same domain
    order in every group) or a flat list of isomer records, grouped here by ``group_id``.
    Each instance is rendered by ``text_fn`` (default: the evaluation prompt, so LCS sees what
    the model sees at test time) and its hidden states are averaged over non-padding tokens.
    """
    if groups and isinstance(groups[0], Mapping):
        groups, _ = isomer_groups(groups)  # type: ignore[arg-type]
    if not groups:
        raise ValueError("lcs_of_model needs at least one complete isomer group")
    n = len(groups[0])
    if any(len(g) != n for g in groups):
        raise ValueError("every isomer group must hold the same number of domain instances")
    if text_fn is None:
        from iga_ds.evaluation.prompts import format_prompt

        text_fn = format_prompt
    texts = [text_fn(rec) for group in groups for rec in group]
    states = token_averaged_hidden_states(
        model, tokenizer, texts, layers=layers, batch_size=batch_size, max_length=max_length, progress=progress
    )
    return {idx: lcs(h.reshape(len(groups), n, -1)) for idx, h in states.items()}
