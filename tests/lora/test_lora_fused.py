"""The fused LoRA layer (``lora.fused``) against PEFT's own forward and backward."""
from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from iga_ds.lora.fused import fuse_lora_layers, fused_forward, unfusable, unfuse_lora_layers
from iga_ds.lora.modules import find_lora_modules
from tiny_models import assert_within_bf16_yardstick, batch, relative_error, sequence_losses, tiny_peft_llama


def _logits_and_grads(model, ids, attn, labels, others=()):
    """The logits, every adapter gradient and the gradients of ``others`` (below LoRA layers)."""
    model.zero_grad(set_to_none=True)
    logits = model(input_ids=ids, attention_mask=attn).logits
    sequence_losses(logits, labels).sum().backward()
    skip = {id(p) for p in others}
    adapters = [p.grad for p in model.parameters() if p.requires_grad and id(p) not in skip]
    return [logits.detach()] + adapters + [p.grad for p in others]


def _with_trainable_norms(model):
    """Norm and embedding weights train too: their gradients pass through each layer's dx."""
    others = [p for n, p in model.named_parameters() if "lora_" not in n and ("norm" in n or "embed" in n)]
    for p in others:
        p.requires_grad_(True)
    return others


@pytest.mark.parametrize("rslora", [False, True])
def test_fused_layers_compute_what_peft_computes_in_float64(rslora):
    """Logits, adapter gradients and the input gradients (through the norms and embeddings)
    agree with PEFT's forward to float64 rounding; mixed ranks and rsLoRA's scaling included."""
    runs = []
    for fuse in (False, True):
        model = tiny_peft_llama(seed=1, dtype=torch.float64, rslora=rslora)
        others = _with_trainable_norms(model)
        modules = find_lora_modules(model)
        if fuse:
            assert fuse_lora_layers(modules) == modules and all(fused_forward(m) for m in modules)
        ids, attn, labels, _ = batch(seed=2)
        runs.append(_logits_and_grads(model, ids, attn, labels, others))
    plain, fused = runs
    assert len(plain) == len(fused) == 1 + 16 + len(_with_trainable_norms(tiny_peft_llama(seed=1)))
    for got, want in zip(fused, plain):
        assert want.abs().sum() > 0 and relative_error(got, want) < 1e-12


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=[
    pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")])])
def test_fused_layers_in_bf16_stay_as_close_to_the_exact_result_as_peft(device):
    """bf16: the fused layers' logits and gradients, and PEFT's, each measured from the float64
    model; the fused ones within twice PEFT's distance (plus 1e-3)."""
    model = tiny_peft_llama(seed=3, dtype=torch.bfloat16, hidden=64).to(device)
    ids, attn, labels, _ = (t.to(device) for t in batch(seed=4))
    exact = _logits_and_grads(copy.deepcopy(model).double(), ids, attn, labels)
    peft = _logits_and_grads(model, ids, attn, labels)
    fuse_lora_layers(find_lora_modules(model))
    fused = _logits_and_grads(model, ids, attn, labels)
    assert len(fused) == len(exact) == 17
    for i, (got, theirs, want) in enumerate(zip(fused, peft, exact)):
        assert_within_bf16_yardstick("logits" if i == 0 else f"adapter gradient {i}", got, theirs, want, "PEFT")


def test_a_biased_base_layer_fuses_with_its_bias_and_its_gradient():
    """A plain PEFT model on biased linear layers, the bias training: float64 agreement."""
    from peft import LoraConfig, get_peft_model

    runs = []
    for fuse in (False, True):
        torch.manual_seed(0)
        base = nn.Sequential(nn.Linear(12, 20), nn.Tanh(), nn.Linear(20, 7)).double()
        model = get_peft_model(base, LoraConfig(r=3, lora_alpha=5, target_modules=["0", "2"]))
        with torch.no_grad():
            for n, p in model.named_parameters():
                if "lora_B" in n:
                    p.normal_(0, 0.3)
        base_biases = [model.base_model.model[i].base_layer.bias for i in (0, 2)]
        for b in base_biases:
            b.requires_grad_(True)
        if fuse:
            assert len(fuse_lora_layers(find_lora_modules(model))) == 2
        x = torch.randn(2, 5, 12, dtype=torch.float64, generator=torch.Generator().manual_seed(1), requires_grad=True)
        out = model(x)
        out.pow(2).sum().backward()
        runs.append([out.detach(), x.grad] + [p.grad for p in model.parameters() if p.requires_grad])
    assert len(runs[1]) == 2 + 4 + 2
    for got, want in zip(*runs):
        assert want.abs().sum() > 0 and relative_error(got, want) < 1e-12


def _activation_sized_elementwise_ops(model, ids, attn) -> int:
    """Adds and multiplies over at least tokens x 16 elements (a whole layer output here, not
    LoRA's tokens x r) in one forward and backward, as dispatched (not nested in other ops)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    size, seen = ids.numel() * 16, []

    class Count(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            if func.overloadpacket in (torch.ops.aten.add, torch.ops.aten.add_, torch.ops.aten.mul) \
                    and isinstance(out, torch.Tensor) and out.numel() >= size:
                seen.append(func)
            return out

    with Count():
        model(input_ids=ids, attention_mask=attn).logits.sum().backward()
    return len(seen)


def test_fusion_takes_the_scale_and_add_out_of_each_layer():
    """PEFT's forward multiplies and adds over each adapted layer's whole output, and backward
    multiplies again and adds the two input gradients where the input needs one (all but the
    first layer's q, k and v here); fused, the GEMMs do it."""
    model = tiny_peft_llama(seed=5)
    modules = find_lora_modules(model)
    ids, attn, _, _ = batch(seed=6)
    plain = _activation_sized_elementwise_ops(model, ids, attn)
    fuse_lora_layers(modules)
    fused = _activation_sized_elementwise_ops(model, ids, attn)
    assert plain - fused == 3 * len(modules) + (len(modules) - 3), (plain, fused)


def test_what_fusion_leaves_to_peft():
    """Dropout is not fused; a disabled adapter, a merged one, autocast and a dtype other than
    the weights' fall through to PEFT's forward; unfusing gives PEFT's forward back."""
    assert unfusable(find_lora_modules(tiny_peft_llama(seed=7, dropout=0.1))[0]) == "LoRA dropout"
    model = tiny_peft_llama(seed=7)
    modules = find_lora_modules(model)
    ids, attn, _, _ = batch(seed=8)
    with torch.no_grad():
        plain = model(input_ids=ids, attention_mask=attn).logits
        fuse_lora_layers(modules)
        fuse_lora_layers(modules)  # idempotent
        fused = model(input_ids=ids, attention_mask=attn).logits
        assert relative_error(fused, plain) < 1e-5
        with model.disable_adapter():
            off = model(input_ids=ids, attention_mask=attn).logits
        unfuse_lora_layers(modules)
        with model.disable_adapter():
            assert torch.equal(off, model(input_ids=ids, attention_mask=attn).logits)
        assert all(fused_forward(m) is None for m in modules) and "forward" not in vars(modules[0].layer)

    calls = []
    fuse_lora_layers(modules)
    for m in modules:
        original = fused_forward(m).original
        fused_forward(m).original = lambda x, *a, _o=original, **k: (calls.append(1), _o(x, *a, **k))[1]
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        model(input_ids=ids, attention_mask=attn)
    assert len(calls) == len(modules)
    model.merge_adapter()
    with torch.no_grad():
        model(input_ids=ids, attention_mask=attn)
    assert len(calls) == 2 * len(modules)
