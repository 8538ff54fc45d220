"""Per-domain LoRA weight gradients from the one normal backward.

Opacus computes per-sample gradients from each layer's input and output-gradient; here the
same outer products are summed per domain instead of per sample. For a linear layer
y = x W^T, dL/dW = sum_t dy_t^T x_t, so the part owed to domain n is the sum over the tokens
of that domain's sequences: one small batched matmul per factor and micro-batch.

They are taken through forward hooks on lora_A and lora_B or, for a layer that ``lora.fused``
has fused (it calls neither), in that layer's own backward; either way in one of two modes:

- alongside autograd (default): lora_B's output is wrapped in an autograd function that is the
  identity forward and, backward, adds dy^T x per domain for both factors into fp32 buffers;
  autograd still computes the factors' plain gradients;
- owning the factors' gradients (``owns_gradients=True``): lora_B's output goes on through an
  autograd function that takes the layer's two products detached (computed once, by the layer)
  and holds both factors out of autograd; backward passes the input gradient on (dy B A) and
  adds the per-domain sums, and the factors get no ``.grad``. A method that combines
  per-domain gradients overwrites the plain gradient at the step boundary anyway, so this
  saves two products per layer and, under DeepSpeed, the bucket copies and the reduction of
  the factors' gradients every micro-batch.

In bf16 the sums over sequences and micro-batches are fp32. When a micro-batch is one sequence
per domain in domain order (the hook's layout), each factor's products are added into the sums
by one GEMM (``add_products``); on CUDA with torch 2.8 or later cuBLAS writes the fp32 sums of
bf16 operands directly, so the per-sequence products are never rounded to bf16. Elsewhere
each sequence's product is rounded to bf16 like autograd's own weight gradient, then added.
Inputs are kept with ``save_for_backward``, so non-reentrant activation checkpointing
recomputes them like any other saved tensor, and dropout is accounted for (lora_A sees the
dropped-out input).

A padding-free micro-batch (its sequences back to back in one row, ``sequence_lengths`` given
to ``micro_batch``) is attributed token by token: each run of consecutive same-domain
sequences is one span of the row. One span's dy^T x is one GEMM into its domain's sums; several
spans take one GEMM over the row, the narrow operand (the r side) laid out once per domain.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Callable, Iterator, Sequence

import torch

from iga_ds.lora.fused import FusedForward, fused_forward
from iga_ds.lora.modules import LoraModule
from iga_ds.methods.device_copies import host_to_device


@dataclass
class _MicroBatch:
    """What backward needs to know about the micro-batch a forward saw."""

    domain_ids: torch.Tensor | None  # (B,) on the buffers' device; None when one_per_domain
    factor: float  # turns gradients of the (mean, GAS-scaled) loss into sums over sequences
    batch_size: int
    # sequence n is domain n, one each (one isomer group per micro-batch, in domain order):
    # per-sequence products are then per-domain sums and are added in place, no index_add
    one_per_domain: bool = False
    # called once, at the micro-batch's first captured backward (owning capture only)
    on_backward: Callable[[], None] | None = None
    # padding-free: the one row's (domain, first token, end token) runs of same-domain
    # sequences, and its token count; None when each sequence has its own row
    domain_spans: list[tuple[int, int, int]] | None = None
    num_tokens: int = 0
    num_domains: int = 0
    _mask: torch.Tensor | None = None

    def domain_mask(self, like: torch.Tensor) -> torch.Tensor:
        """The padding-free row's :func:`domain_mask`, made once per micro-batch (every layer's
        backward takes it)."""
        if self._mask is None or self._mask.dtype != like.dtype or self._mask.device != like.device:
            self._mask = domain_mask(self.domain_spans, self.num_tokens, self.num_domains, like)
        return self._mask

    def backward_started(self) -> None:
        if self.on_backward is not None:
            self.on_backward()
            self.on_backward = None


class _CaptureFn(torch.autograd.Function):
    """Identity on lora_B's output; backward adds both factors' per-domain gradients.

    With h = lora_A(x) and y = lora_B(h): dL/dB = dy^T h, dL/dh = dy B, dL/dA = (dy B)^T x.
    One function per LoRA layer (not one per linear) halves the Python work per layer.
    """

    @staticmethod
    def forward(ctx, out, x, h, weight_B, bufA, bufB, micro):
        ctx.save_for_backward(x, h, weight_B)
        ctx.buffers = (bufA, bufB)
        ctx.micro = micro
        return out.view_as(out)

    @staticmethod
    def backward(ctx, grad_out):
        x, h, weight_B = ctx.saved_tensors
        micro: _MicroBatch = ctx.micro
        bufA, bufB = ctx.buffers
        _add_per_domain(bufB, grad_out, h, micro)
        _add_per_domain(bufA, grad_out @ weight_B, x, micro)  # dL/dh = dy B
        return grad_out, None, None, None, None, None, None


class _CapturedLoRA(torch.autograd.Function):
    """``(x A^T) B^T`` with A and B held out of autograd: backward returns dL/dx = dy B A and,
    instead of the factors' gradients, adds each domain's sums of dy^T h and (dy B)^T x into
    ``bufB`` and ``bufA``. One function per LoRA layer, not one per factor: autograd's Python
    work is per function."""

    @staticmethod
    def forward(ctx, x, h, out, weight_A, weight_B, anchor, bufA, bufB, micro):
        # h = x A^T and out = h B^T come detached from the layer's own forward (computed once);
        # the weights come detached too: were they inputs that need a gradient, autograd would
        # still visit their accumulators (and DeepSpeed's hooks there, which expect a gradient);
        # anchor is the capture's input that needs one (see DomainGradientCapture)
        ctx.save_for_backward(x, h, weight_A, weight_B)
        ctx.buffers = (bufA, bufB)
        ctx.micro = micro
        return out.view_as(out)

    @staticmethod
    def backward(ctx, grad_out):
        x, h, weight_A, weight_B = ctx.saved_tensors
        micro: _MicroBatch = ctx.micro
        bufA, bufB = ctx.buffers
        micro.backward_started()
        _add_per_domain(bufB, grad_out, h, micro)
        grad_h = grad_out @ weight_B  # dL/dh = dy B
        _add_per_domain(bufA, grad_h, x, micro)
        grad_x = grad_h @ weight_A if ctx.needs_input_grad[0] else None
        return grad_x, None, None, None, None, None, None, None, None


@dataclass
class _FusedSink:
    """A fused layer's backward (``lora.fused``) adds into the sums through this: the same
    products as :class:`_CapturedLoRA`, with dy unscaled and the scaling folded into the add."""

    anchor: torch.Tensor | None
    bufA: torch.Tensor
    bufB: torch.Tensor
    micro: _MicroBatch

    def add(self, grad_out, h, grad_h, x, scaling: float) -> None:
        self.micro.backward_started()
        _add_per_domain(self.bufB, grad_out, h, self.micro, scale=scaling)  # dL/dB = scaling dy^T h
        _add_per_domain(self.bufA, grad_h, x, self.micro)  # dL/dA = (scaling dy B)^T x


def _add_per_domain(buf: torch.Tensor, grad_out: torch.Tensor, x: torch.Tensor, micro: "_MicroBatch",
                    scale: float = 1.0) -> None:
    """buf[n] += scale * factor * sum over domain n's sequences of dy^T x."""
    alpha = micro.factor * scale
    if micro.domain_spans is not None:
        _add_per_domain_span(buf, grad_out, x, micro, alpha)
        return
    b = micro.batch_size
    if grad_out.shape[0] != b:
        raise RuntimeError(
            f"LoRA output has leading dimension {grad_out.shape[0]}, expected the micro-batch size "
            f"{b}: the capture needs inputs shaped (batch, ..., features)"
        )
    # one batched matmul gives every sequence's weight gradient (small for LoRA: one side is
    # r); no activation is copied
    dy_t = grad_out.reshape(b, -1, grad_out.shape[-1]).mT
    xs = x.reshape(b, -1, x.shape[-1])
    if micro.one_per_domain:  # sequence n is domain n: the products add in place
        add_products(buf, dy_t, xs, alpha)
    else:
        buf.index_add_(0, micro.domain_ids, torch.bmm(dy_t, xs).float(), alpha=alpha)


def _add_per_domain_span(buf: torch.Tensor, grad_out: torch.Tensor, x: torch.Tensor, micro: "_MicroBatch",
                         alpha: float) -> None:
    """buf[n] += alpha * sum over domain n's tokens of dy^T x, for one padding-free row."""
    tokens = micro.num_tokens
    if grad_out.shape[0] != 1 or grad_out.numel() != tokens * grad_out.shape[-1]:
        raise RuntimeError(
            f"LoRA output of shape {tuple(grad_out.shape)}, expected one padding-free row of {tokens} tokens "
            "(1, tokens, features): the capture slices that row by the sequence lengths"
        )
    add_span_products(buf, grad_out.reshape(tokens, grad_out.shape[-1]), x.reshape(tokens, x.shape[-1]),
                      micro.domain_spans, alpha, micro.domain_mask)


def add_span_products(buf: torch.Tensor, dy: torch.Tensor, xs: torch.Tensor, spans: Sequence[tuple[int, int, int]],
                      alpha: float, mask_like: Callable[[torch.Tensor], torch.Tensor]) -> None:
    """``buf[n] += alpha * dy[s:e]^T xs[s:e]`` for each (n, s, e) of ``spans`` (``dy``: tokens x out,
    ``xs``: tokens x in, ``buf``: N x out x in); ``mask_like(t)``: the spans' (tokens, N) 0/1
    domain mask in ``t``'s dtype and device (:func:`domain_mask`)."""
    if len(spans) == 1:
        domain, start, end = spans[0]
        add_products(buf[domain: domain + 1], dy[start:end].mT.unsqueeze(0), xs[start:end].unsqueeze(0), alpha)
        return
    # one GEMM over the whole row instead of one per span: the narrow operand (LoRA's r side)
    # laid out once per domain, zero outside its tokens. The wide operand is read once, as by
    # autograd's own weight gradient; a span's GEMM alone has too few output tiles to fill the SMs
    tokens, num, narrow_on_right = dy.shape[0], buf.shape[0], xs.shape[-1] <= dy.shape[-1]
    narrow = xs if narrow_on_right else dy
    per_domain = (narrow.unsqueeze(1) * mask_like(narrow).unsqueeze(2)).reshape(tokens, -1)
    if narrow_on_right:  # (out, N in), added into buf (N, out, in) transposed
        product = product_fp32(dy.mT, per_domain) if buf.dtype == torch.float32 else dy.mT @ per_domain
        buf.add_(product.view(dy.shape[-1], num, -1).transpose(0, 1), alpha=alpha)
    else:  # (N out, in): buf's own layout
        add_products(buf.view(1, -1, xs.shape[-1]), per_domain.mT.unsqueeze(0), xs.unsqueeze(0), alpha)


def domain_mask(spans: Sequence[tuple[int, int, int]], tokens: int, num_domains: int, like: torch.Tensor) -> torch.Tensor:
    """(tokens, N): 1 where a token of the row is of that domain, in ``like``'s dtype and device."""
    mask = torch.zeros(tokens, num_domains, dtype=like.dtype)
    for domain, start, end in spans:
        mask[start:end, domain] = 1
    return host_to_device(mask, like.device)


# cuBLAS writes fp32 products of bf16 or fp16 operands (the "dtype" overloads, torch >= 2.8, CUDA)
_MIXED_GEMM = "dtype_out" in torch.ops.aten.baddbmm.overloads()


def _writes_fp32(a: torch.Tensor) -> bool:
    """Whether the BLAS can write fp32 products of ``a``'s dtype on its device."""
    return _MIXED_GEMM and a.is_cuda and a.dtype in (torch.bfloat16, torch.float16)


def product_fp32(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``a @ b`` in float32: written as fp32 by the BLAS where it can (bf16/fp16 on CUDA), never
    rounded to the operands' dtype there; elsewhere the operands' product, cast."""
    if _writes_fp32(a):
        return torch.mm(a, b, out_dtype=torch.float32)
    return (a @ b).float()


def add_products(buf: torch.Tensor, a: torch.Tensor, b: torch.Tensor, alpha: float) -> None:
    """``buf += alpha * a @ b`` for batched ``a`` and ``b``: one GEMM that adds into ``buf`` where
    the BLAS can write ``buf``'s dtype (the operands' own, or fp32 from bf16/fp16 on CUDA), the
    product then never rounded to the operands' dtype; else a product in the operands' dtype,
    then an add."""
    if a.dtype == buf.dtype:
        buf.baddbmm_(a, b, alpha=alpha)
    elif buf.dtype == torch.float32 and buf.is_cuda and _writes_fp32(a):
        torch.baddbmm(buf, a, b, out_dtype=buf.dtype, alpha=alpha, out=buf)
    else:  # mixed-dtype add: the cast to buf's dtype happens inside the kernel
        buf.add_(torch.bmm(a, b), alpha=alpha)


def domain_spans(domain_ids: torch.Tensor, sequence_lengths: torch.Tensor | Sequence[int]
                 ) -> tuple[list[tuple[int, int, int]], int]:
    """The (domain, first token, end token) runs of consecutive same-domain sequences of a
    padding-free row, and the row's token count: one GEMM per run in backward."""
    ids = domain_ids.tolist()
    lengths = torch.as_tensor(sequence_lengths).reshape(-1).tolist()
    if len(lengths) != len(ids) or min(lengths) < 1:
        raise ValueError(f"sequence_lengths: expected {len(ids)} positive token counts, one per domain id, "
                         f"got {lengths}")
    spans: list[tuple[int, int, int]] = []
    start = 0
    for domain, length in zip(ids, lengths):
        if spans and spans[-1][0] == domain:  # extends the run: one product for both sequences
            spans[-1] = (domain, spans[-1][1], start + length)
        else:
            spans.append((domain, start, start + length))
        start += length
    return spans, start


class DomainGradientCapture:
    """Accumulates per-domain sums of LoRA weight gradients into given fp32 buffers.

    ``buffers[i]`` is (gA_sum N x r x in, gB_sum N x out x r) for ``modules[i]``. Each
    forward must run inside ``micro_batch(domain_ids, loss_scale[, sequence_lengths])``;
    ``loss_scale`` is what the gradient of one sequence's loss is multiplied by in the loss
    given to backward (1 / (B * gradient_accumulation_steps) for a mean over the micro-batch
    that DeepSpeed divides by the accumulation steps), so the buffers end up holding plain sums.
    ``storage``: one tensor that the buffers are views of, if there is one; :meth:`reset`
    then zeroes it in one kernel.
    """

    def __init__(self, modules: Sequence[LoraModule], buffers: Sequence[tuple[torch.Tensor, torch.Tensor]], num_domains: int,
                 owns_gradients: bool = False, before_backward: Callable[[], None] | None = None,
                 storage: torch.Tensor | None = None):
        self.modules = list(modules)
        self.buffers = list(buffers)
        self.storage = storage
        self.num_domains = num_domains
        self.owns_gradients = owns_gradients
        # owning capture: called at each micro-batch's first captured backward, where the plain
        # path would see its first LoRA gradient (the hook sets up DeepSpeed's buckets there)
        self.before_backward = before_backward
        self._micro: _MicroBatch | None = None
        self.counts = torch.zeros(num_domains, dtype=torch.float64)  # sequences seen per domain
        self._handles = []
        self._fused: list[FusedForward] = []
        if owns_gradients:
            # needs a gradient and gets none: it makes backward reach the capture's function
            # where nothing else would (the first layer's input needs no gradient when the
            # embeddings are frozen)
            device = self.buffers[0][0].device if self.buffers else None
            self._anchor = torch.zeros((), device=device, requires_grad=True)
        for module, (bufA, bufB) in zip(self.modules, self.buffers):
            if owns_gradients:
                for layer in (module.lora_A, module.lora_B):
                    if layer.bias is not None:
                        raise ValueError(f"{module.name}: LoRA factor with a bias; the capture needs bias-free factors")
            if (fused := fused_forward(module)) is not None:  # no hooks: the fused layer's backward adds the sums
                fused.capture = self._fused_sink(module, bufA, bufB)
                self._fused.append(fused)
                continue
            stash: dict[str, torch.Tensor] = {}
            self._handles.append(module.lora_A.register_forward_hook(self._stash_input(stash)))
            self._handles.append(module.lora_B.register_forward_hook(self._capture(stash, module, bufA, bufB)))

    def _fused_sink(self, module: LoraModule, bufA: torch.Tensor, bufB: torch.Tensor):
        """A fused layer's source of sinks: one per training forward, bound to its micro-batch."""
        def sink() -> _FusedSink | None:
            if not module.lora_A.weight.requires_grad:
                return None  # a frozen adapter: nothing to capture
            return _FusedSink(self._anchor if self.owns_gradients else None, bufA, bufB, self._current_micro(module))

        return sink

    def _current_micro(self, module: LoraModule) -> _MicroBatch:
        """The micro-batch a training forward of ``module`` belongs to; an error outside one."""
        if self._micro is None:
            raise RuntimeError(
                f"{module.name}: forward with gradients outside micro_batch(domain_ids); "
                "wrap each training forward and backward in hook.micro_batch(...)"
            )
        return self._micro

    @staticmethod
    def _stash_input(stash: dict):
        # lora_A's input is the (dropped-out) layer input; lora_B's hook, which runs next in
        # the same layer's forward (also when checkpointing recomputes it), takes it
        def hook(layer, inputs, output):
            stash["x"] = inputs[0]

        return hook

    def _capture(self, stash: dict, module: LoraModule, bufA: torch.Tensor, bufB: torch.Tensor):
        owns = self.owns_gradients

        def hook(layer, inputs, output):
            x = stash.pop("x", None)
            # owning, autograd's own path is dropped, so the factor's requires_grad decides
            trains = layer.weight.requires_grad if owns else output.requires_grad
            if not torch.is_grad_enabled() or not trains:
                return None  # evaluation forward, or a frozen adapter: nothing to capture
            micro = self._current_micro(module)
            if x is None:
                raise RuntimeError(f"{module.name}: lora_B ran without lora_A before it; unsupported LoRA variant")
            if owns:  # both factors' own outputs are dropped, and with them autograd's paths to the weights
                return _CapturedLoRA.apply(x, inputs[0].detach(), output.detach(), module.lora_A.weight.detach(),
                                           layer.weight.detach(), self._anchor, bufA, bufB, micro)
            return _CaptureFn.apply(output, x, inputs[0], layer.weight, bufA, bufB, micro)

        return hook

    @contextlib.contextmanager
    def micro_batch(self, domain_ids: torch.Tensor, loss_scale: float,
                    sequence_lengths: torch.Tensor | Sequence[int] | None = None) -> Iterator[None]:
        """``sequence_lengths``: the micro-batch is padding-free, its sequences back to back in
        one row with these token counts (in the order of ``domain_ids``); backward then
        attributes each token to its sequence's domain."""
        domain_ids = torch.as_tensor(domain_ids).reshape(-1)
        # ids on the host cost nothing here; ids on the device are read back, which waits for
        # the device to drain its queue (pass host ids where the loop has them)
        ids_cpu = domain_ids.cpu()
        if ids_cpu.numel() == 0:
            raise ValueError("empty micro-batch")
        if int(ids_cpu.min()) < 0 or int(ids_cpu.max()) >= self.num_domains:
            raise ValueError(f"domain ids must be in [0, {self.num_domains}), got {ids_cpu.tolist()}")
        device = self.buffers[0][0].device
        self.counts += torch.bincount(ids_cpu, minlength=self.num_domains).double()
        spans, tokens = (None, 0) if sequence_lengths is None else domain_spans(ids_cpu, sequence_lengths)
        one_per_domain = spans is None and ids_cpu.tolist() == list(range(self.num_domains))
        if one_per_domain or spans is not None:  # backward adds in place and needs no ids on the device
            ids_dev = None
        else:  # pinned on CUDA, so the copy is queued without a stream sync
            ids_dev = host_to_device(ids_cpu, device)
        self._micro = _MicroBatch(ids_dev, 1.0 / loss_scale, int(ids_cpu.numel()), one_per_domain,
                                  self.before_backward if self.owns_gradients else None, spans, tokens,
                                  self.num_domains)
        try:
            yield
        finally:
            self._micro = None

    def reset(self) -> None:
        if self.storage is not None:
            self.storage.zero_()
        elif self.buffers:  # one multi-tensor launch for all of them, not two per layer
            torch._foreach_zero_([buf for pair in self.buffers for buf in pair])
        self.counts.zero_()

    def remove(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()
        for fused in self._fused:
            fused.capture = None
        self._fused.clear()
