"""A LoRA linear layer as one autograd function, its product added by the base GEMM's epilogue.

PEFT computes ``base(x) + lora_B(lora_A(x)) * scaling`` as five kernels: the base product, two
skinny products, a multiply and an add over the whole output. Backward pays the multiply again
and an add of the two input gradients: passes over whole activations, which at LLaMA-2-7B's
shape cost a share of the step that docs/PERFORMANCE.md gives. Here

    out  = x W^T (+ b),  then  out += scaling * h B^T  with  h = x A^T     (one addmm, in place)
    dx   = dy W,         then  dx  += (scaling * dy B) A                  (one addmm, in place)

and the factors' gradients are the same skinny products autograd would take. The scaling is
applied to (tokens x r) and (out x r) tensors only.

:func:`fuse_lora_layers` installs it on each adapted layer where it computes what PEFT computes
(up to the order of rounding): plain LoRA on a frozen ``nn.Linear``, no dropout, one active adapter, one dtype, no
autocast; any other call falls through to PEFT's own forward. The capture (``lora.capture``)
takes the per-domain gradients of a fused layer from this function's backward instead of
through hooks on ``lora_A`` and ``lora_B``, which a fused layer does not call."""
from __future__ import annotations

from typing import Callable, Protocol, Sequence

import torch
from torch import nn

from iga_ds.lora.modules import LoraModule


class DomainSink(Protocol):
    """What the capture hands a fused layer's backward for one forward (see ``lora.capture``)."""

    # set when the capture owns the factors' gradients (autograd then gets none): it needs a
    # gradient, so backward reaches the layer even where nothing else below it needs one
    anchor: torch.Tensor | None

    def add(self, grad_out: torch.Tensor, h: torch.Tensor, grad_h: torch.Tensor, x: torch.Tensor,
            scaling: float) -> None:
        """Add each domain's ``scaling * dy^T h`` (B) and ``grad_h^T x`` (A) into its sums."""


class _LoRALinear(torch.autograd.Function):
    """``x W^T + b + scaling (x A^T) B^T`` and its gradients, the adds done by GEMM epilogues."""

    @staticmethod
    def forward(ctx, x, weight, bias, weight_A, weight_B, anchor, scaling, sink):
        x2 = x.reshape(-1, x.shape[-1])
        h = x2 @ weight_A.t()
        out = torch.addmm(bias, x2, weight.t()) if bias is not None else x2 @ weight.t()
        out.addmm_(h, weight_B.t(), alpha=scaling)
        ctx.save_for_backward(x, h, weight, weight_A, weight_B)
        ctx.scaling, ctx.sink, ctx.has_bias = scaling, sink, bias is not None
        return out.view(*x.shape[:-1], out.shape[-1])

    @staticmethod
    def backward(ctx, grad_out):
        x, h, weight, weight_A, weight_B = ctx.saved_tensors
        s = ctx.scaling
        g = grad_out.reshape(-1, grad_out.shape[-1])
        x2 = x.reshape(-1, x.shape[-1])
        grad_h = (g @ weight_B).mul_(s)  # dL/dh = scaling dy B: tokens x r
        if ctx.sink is not None:
            lead = grad_out.shape[:-1]
            ctx.sink.add(grad_out, h.view(*lead, -1), grad_h.view(*lead, -1), x, s)
        needs = ctx.needs_input_grad
        grad_x = (g @ weight).addmm_(grad_h, weight_A).view_as(x) if needs[0] else None
        grad_bias = g.sum(0) if ctx.has_bias and needs[2] else None
        grad_A = grad_h.t() @ x2 if needs[3] else None
        grad_B = (g.t() @ h).mul_(s) if needs[4] else None
        return grad_x, None, grad_bias, grad_A, grad_B, None, None, None


class FusedForward:
    """A PEFT LoRA layer's forward, installed on the layer: :class:`_LoRALinear` where it computes
    what PEFT computes, PEFT's own forward otherwise. ``capture``, where set, gives the sink of
    each training forward (None where there is nothing to capture)."""

    def __init__(self, module: LoraModule):
        self.module = module
        self.original = type(module.layer).forward.__get__(module.layer)
        self.capture: Callable[[], DomainSink | None] | None = None

    def _applies(self, x: torch.Tensor, args, kwargs) -> bool:
        layer, m = self.module.layer, self.module
        return (not args and not kwargs and not layer.disable_adapters and not layer.merged
                and list(layer.active_adapters) == [m.adapter]
                and x.dtype == layer.base_layer.weight.dtype == m.lora_A.weight.dtype == m.lora_B.weight.dtype
                and not torch.is_autocast_enabled(x.device.type))

    def __call__(self, x: torch.Tensor, *args, **kwargs) -> torch.Tensor:
        if not self._applies(x, args, kwargs):
            return self.original(x, *args, **kwargs)
        m, base = self.module, self.module.layer.base_layer
        sink = self.capture() if self.capture is not None and torch.is_grad_enabled() else None
        A, B, anchor = m.lora_A.weight, m.lora_B.weight, None
        if sink is not None and sink.anchor is not None:  # owning: the factors stay out of autograd
            A, B, anchor = A.detach(), B.detach(), sink.anchor
        scaling = float(self.module.layer.scaling[m.adapter])  # read per call: PEFT's set_scale may change it
        return _LoRALinear.apply(x, base.weight, base.bias, A, B, anchor, scaling, sink)


def unfusable(module: LoraModule) -> str | None:
    """Why ``module``'s layer cannot be fused, or None."""
    from peft.tuners.lora.layer import Linear as PeftLinear

    layer = module.layer
    if layer is None or type(layer) is not PeftLinear:
        return f"not a plain PEFT LoRA linear layer ({type(layer).__name__})"
    if type(layer.base_layer) is not nn.Linear:
        return f"its base is a {type(layer.base_layer).__name__}, not an nn.Linear"
    if layer.base_layer.weight.requires_grad:
        return "its base weight trains"
    if not isinstance(layer.lora_dropout[module.adapter], nn.Identity):
        return "LoRA dropout"
    if module.adapter in getattr(layer, "lora_variant", {}):
        return "a LoRA variant (e.g. DoRA)"
    return None


def fused_forward(module: LoraModule) -> FusedForward | None:
    """The fused forward installed on ``module``'s layer, or None."""
    installed = vars(module.layer).get("forward") if module.layer is not None else None
    return installed if isinstance(installed, FusedForward) else None


def fuse_lora_layers(modules: Sequence[LoraModule]) -> list[LoraModule]:
    """Install the fused forward on each module's layer that can take it (idempotent); returns
    the modules fused."""
    fused = []
    for module in modules:
        if fused_forward(module) is None:
            if unfusable(module):
                continue
            module.layer.forward = FusedForward(module)  # an instance attribute: nn.Module.__call__ calls it
        fused.append(module)
    return fused


def unfuse_lora_layers(modules: Sequence[LoraModule]) -> None:
    """Give each module's layer PEFT's own forward back."""
    for module in modules:
        if fused_forward(module) is not None:
            del module.layer.forward
