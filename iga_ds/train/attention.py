"""``torch_varlen``: attention for padding-free rows through PyTorch's own variable-length
flash-attention kernel (``torch.nn.attention.varlen.varlen_attn``), registered with transformers.

A padding-free micro-batch holds its sequences back to back in one row. Eager and sdpa attention
score the whole row and mask across sequences; this kernel is given the sequences' cumulative
lengths and scores each sequence on its own, causally, with no padding and no mask. The lengths
come from the micro-batch (``cu_seq_lens_q`` and ``max_length_q``, transformers' names for them),
so no layer reads them back from the device. It needs nothing beyond torch: CUDA, bf16 or fp16."""
from __future__ import annotations

import inspect
from functools import cache

from iga_ds.config.run import VARLEN_ATTENTION
from iga_ds.errors import ConfigError


def varlen_unavailable() -> str | None:
    """Why ``torch_varlen`` cannot run in this process, or None."""
    import torch

    try:
        from torch.nn.attention.varlen import varlen_attn  # noqa: F401
    except ImportError:
        return f"needs torch.nn.attention.varlen, which torch {torch.__version__} lacks"
    if not torch.cuda.is_available():
        return "needs a CUDA device (PyTorch's varlen kernel is flash attention's)"
    return None


def require_varlen_attention() -> None:
    """Raise a ConfigError unless ``torch_varlen`` can run here (the run YAML's check has made
    sure its micro-batches are padding-free)."""
    if reason := varlen_unavailable():
        raise ConfigError(f"model.attn_implementation: {VARLEN_ATTENTION} {reason}")


def register_varlen_attention() -> None:
    """Make ``torch_varlen`` a transformers attention implementation (idempotent). With no mask
    function registered beside it, transformers builds no attention mask for it."""
    from transformers import AttentionInterface

    AttentionInterface.register(VARLEN_ATTENTION, varlen_attention_forward)


@cache
def _causal(kernel) -> dict:
    # varlen_attn's first release took is_causal; later ones take a window, (-1, 0) being causal
    return {"is_causal": True} if "is_causal" in inspect.signature(kernel).parameters else {"window_size": (-1, 0)}


def _unsupported(max_length: int, sliding_window=None, softcap=None, s_aux=None, **_) -> str | None:
    """What of the model's attention this kernel call would leave out, or None."""
    if sliding_window is not None and sliding_window < max_length:  # a wider window is no window
        return f"sliding window ({sliding_window} tokens; a sequence here has {max_length})"
    if softcap is not None:
        return "logit soft-capping"
    return "attention sinks" if s_aux is not None else None


def varlen_attention_forward(module, query, key, value, attention_mask, dropout: float = 0.0, scaling=None,
                             cu_seq_lens_q=None, max_length_q=None, **kwargs):
    """transformers' attention contract: ``query`` (1, heads, T, head_dim), ``key`` and ``value``
    (1, kv_heads, T, head_dim) of one packed row; returns ((1, T, heads, head_dim), None)."""
    import torch
    from torch.nn.attention.varlen import varlen_attn

    if cu_seq_lens_q is None or query.shape[0] != 1:
        raise ConfigError(f"model.attn_implementation: {VARLEN_ATTENTION} needs padding-free micro-batches "
                          "(data.padding_free: true): one row and its sequences' cumulative lengths")
    if dropout:
        raise ConfigError(f"model.attn_implementation: {VARLEN_ATTENTION} has no attention dropout; "
                          f"the model's is {dropout}")
    if what := _unsupported(max_length_q, **kwargs):
        raise ConfigError(f"model.attn_implementation: {VARLEN_ATTENTION} has no {what}; this model needs it: "
                          "use sdpa or flash_attention_2")
    if query.dtype not in (torch.bfloat16, torch.float16):
        raise ConfigError(f"model.attn_implementation: {VARLEN_ATTENTION} runs in bfloat16 or float16, not "
                          f"{query.dtype}: set model.dtype: bfloat16, or bf16 in the DeepSpeed JSON")
    # squeeze, not [0]: its gradient is a view, where indexing's writes a zero-filled copy
    q, k, v = (t.squeeze(0).transpose(0, 1) for t in (query, key, value))  # (T, heads, head_dim)
    if k.shape[1] != q.shape[1]:  # grouped-query attention: each key/value head serves a group of queries
        k, v = (t.repeat_interleave(q.shape[1] // k.shape[1], dim=1) for t in (k, v))
    out = varlen_attn(q, k, v, cu_seq_lens_q, cu_seq_lens_q, max_length_q, max_length_q, scale=scaling,
                      **_causal(varlen_attn))
    return out.unsqueeze(0), None
