"""Captured per-domain sums against autograd's per-domain gradients (no DeepSpeed)."""
from __future__ import annotations

import contextlib
import copy

import pytest
import torch

from iga_ds.lora.capture import DomainGradientCapture, add_products
from iga_ds.lora.fused import fuse_lora_layers
from iga_ds.lora.modules import find_lora_modules
from tiny_models import assert_within_bf16_yardstick, batch, sequence_losses, tiny_peft_llama

N = 3


def reference_domain_grads(model, modules, ids, attn, labels, domains):
    """autograd.grad of each domain's summed sequence losses, all from one forward."""
    losses = sequence_losses(model(input_ids=ids, attention_mask=attn).logits, labels)
    params = [p for m in modules for p in (m.lora_A.weight, m.lora_B.weight)]
    out = []
    for d in range(N):
        grads = torch.autograd.grad(losses[domains == d].sum(), params, retain_graph=True)
        out.append([g.double() for g in grads])
    return out


def run_capture(model, modules, ids, attn, labels, domains, micro_splits, owns=False):
    buffers = [
        (torch.zeros(N, *m.lora_A.weight.shape), torch.zeros(N, *m.lora_B.weight.shape)) for m in modules
    ]
    cap = DomainGradientCapture(modules, buffers, N, owns_gradients=owns)
    for rows in micro_splits:
        with cap.micro_batch(domains[rows], loss_scale=1.0 / len(rows)):
            losses = sequence_losses(model(input_ids=ids[rows], attention_mask=attn[rows]).logits, labels[rows])
            losses.mean().backward()
    cap.remove()
    return buffers, cap.counts


@pytest.mark.parametrize("fused", [False, True])
@pytest.mark.parametrize("owns", [False, True])
@pytest.mark.parametrize("checkpointing", [False, True])
@pytest.mark.parametrize("dropout", [0.0, 0.2])
def test_capture_equals_autograd_per_domain(dropout, checkpointing, owns, fused):
    """Through hooks on PEFT's layers, or through the fused layers' backward (the reference is
    PEFT's own autograd either way; with dropout no layer is fused)."""
    model = tiny_peft_llama(seed=1, dropout=dropout)
    model.train()
    if checkpointing:
        model.base_model.model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        model.base_model.model.enable_input_require_grads()
    modules = find_lora_modules(model)
    assert len(modules) == 8
    ids, attn, labels, domains = batch(seed=2)
    torch.manual_seed(5)
    ref = reference_domain_grads(model, modules, ids, attn, labels, domains)
    model.zero_grad()
    if fused:
        assert len(fuse_lora_layers(modules)) == (8 if dropout == 0 else 0)
    torch.manual_seed(5)  # same dropout masks
    buffers, counts = run_capture(model, modules, ids, attn, labels, domains, [torch.arange(6)], owns=owns)
    assert counts.tolist() == [2.0, 2.0, 2.0]
    for d in range(N):
        for i, (bA, bB) in enumerate(buffers):
            torch.testing.assert_close(bA[d].double(), ref[d][2 * i], rtol=1e-4, atol=1e-6)
            torch.testing.assert_close(bB[d].double(), ref[d][2 * i + 1], rtol=1e-4, atol=1e-6)
    if owns:  # the capture took the factors' gradients over: autograd leaves them unset
        assert all(m.lora_A.weight.grad is None and m.lora_B.weight.grad is None for m in modules)
        return
    # the domain sums add up to the plain gradient (times the batch size, the mean's divisor)
    for i, m in enumerate(modules):
        torch.testing.assert_close(buffers[i][0].sum(0), m.lora_A.weight.grad * 6, rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("fused", [False, True])
@pytest.mark.parametrize("checkpointing", [False, True])
def test_owning_capture_passes_the_same_gradient_to_other_parameters(checkpointing, fused):
    """Owning the factors' gradients, the capture passes dL/dx on itself (dy W): every
    parameter below a LoRA layer must get the gradient it gets without the capture (and
    without fusion: the plain pass is PEFT's own; fused, in float64, the products' order apart)."""
    grads = []
    dtype = torch.float64 if fused else torch.float32
    for attach in (False, True):
        model = tiny_peft_llama(seed=1, dropout=0.0, dtype=dtype)
        model.train()
        if checkpointing:
            model.base_model.model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        others = [p for n, p in model.named_parameters() if "lora_" not in n and ("norm" in n or "embed" in n)]
        for p in others:
            p.requires_grad_(True)
        modules = find_lora_modules(model)
        if attach and fused:
            assert len(fuse_lora_layers(modules)) == len(modules)
        ids, attn, labels, domains = batch(seed=2)
        if attach:
            run_capture(model, modules, ids, attn, labels, domains, [torch.arange(6)], owns=True)
        else:
            losses = sequence_losses(model(input_ids=ids, attention_mask=attn).logits, labels)
            losses.mean().backward()
        grads.append([p.grad.clone() for p in others])
    assert len(grads[0]) > 2
    for plain, captured in zip(*grads):
        assert plain.abs().sum() > 0
        torch.testing.assert_close(captured, plain, rtol=1e-5, atol=1e-8 if dtype == torch.float32 else 1e-12)


@pytest.mark.parametrize("fused", [False, True])
@pytest.mark.parametrize("owns", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_capture_leaves_the_forward_bit_for_bit(owns, dtype, fused):
    """The capture reuses the layer's own x A^T and (x A^T) B^T: logits with it equal those
    without it exactly, in both modes, fused or not."""
    model = tiny_peft_llama(seed=4, dropout=0.0, dtype=dtype)
    modules = find_lora_modules(model)
    if fused:
        fuse_lora_layers(modules)
    ids, attn, _, domains = batch(seed=5)
    plain = model(input_ids=ids, attention_mask=attn).logits
    buffers = [(torch.zeros(N, *m.lora_A.weight.shape), torch.zeros(N, *m.lora_B.weight.shape)) for m in modules]
    cap = DomainGradientCapture(modules, buffers, N, owns_gradients=owns)
    with cap.micro_batch(domains, loss_scale=1.0):
        captured = model(input_ids=ids, attention_mask=attn).logits
    cap.remove()
    assert captured.grad_fn is not None and torch.equal(captured, plain)


def _forward_products(model, ids, attn) -> int:
    """Matrix products the CPU runs in one forward (profiler op names)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        model(input_ids=ids, attention_mask=attn)
    return sum(e.count for e in prof.key_averages() if e.key in ("aten::mm", "aten::addmm", "aten::bmm"))


def test_owning_capture_adds_no_product_to_the_forward():
    """The owning capture takes x A^T and (x A^T) B^T from the layer's own forward instead of
    computing them again: the forward runs exactly the products it runs without the capture."""
    model = tiny_peft_llama(seed=4, dropout=0.0)
    modules = find_lora_modules(model)
    ids, attn, _, domains = batch(seed=5)
    plain = _forward_products(model, ids, attn)
    buffers = [(torch.zeros(N, *m.lora_A.weight.shape), torch.zeros(N, *m.lora_B.weight.shape)) for m in modules]
    cap = DomainGradientCapture(modules, buffers, N, owns_gradients=True)
    with cap.micro_batch(domains, loss_scale=1.0):
        captured = _forward_products(model, ids, attn)
    cap.remove()
    assert plain >= 2 * len(modules) and captured == plain


@pytest.mark.parametrize("fused", [False, True])
@pytest.mark.parametrize("owns", [False, True])
def test_capture_accumulates_over_micro_batches(owns, fused):
    model = tiny_peft_llama(seed=3)
    modules = find_lora_modules(model)
    ids, attn, labels, domains = batch(seed=4)
    ref = reference_domain_grads(model, modules, ids, attn, labels, domains)
    if fused:
        fuse_lora_layers(modules)
    buffers, counts = run_capture(model, modules, ids, attn, labels, domains, [torch.arange(0, 4), torch.arange(4, 6)],
                                  owns=owns)
    assert counts.tolist() == [2.0, 2.0, 2.0]
    for d in range(N):
        torch.testing.assert_close(buffers[0][0][d].double(), ref[d][0], rtol=1e-4, atol=1e-6)
        torch.testing.assert_close(buffers[-1][1][d].double(), ref[d][-1], rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("fused", [False, True])
@pytest.mark.parametrize("owns", [False, True])
def test_capture_in_bf16_accumulates_in_fp32(owns, fused):
    model = tiny_peft_llama(seed=6, dtype=torch.bfloat16)
    modules = find_lora_modules(model)
    assert modules[0].lora_A.weight.dtype == torch.bfloat16
    ids, attn, labels, domains = batch(seed=7)
    ref = reference_domain_grads(model, modules, ids, attn, labels, domains)
    if fused:  # rounded otherwise than PEFT's bf16 autograd: both are measured from the float64 model
        exact_model = copy.deepcopy(model).double()
        exact = reference_domain_grads(exact_model, find_lora_modules(exact_model), ids, attn, labels, domains)
        fuse_lora_layers(modules)
    buffers, _ = run_capture(model, modules, ids, attn, labels, domains, [torch.arange(6)], owns=owns)
    assert buffers[0][0].dtype == torch.float32
    for d in range(N):
        for i, (bA, bB) in enumerate(buffers):
            for j, got in enumerate((bA[d], bB[d])):
                if fused:
                    assert_within_bf16_yardstick(f"domain {d}, factor {2 * i + j}", got, ref[d][2 * i + j],
                                                 exact[d][2 * i + j], "PEFT's bf16 autograd")
                else:
                    want = ref[d][2 * i + j]
                    assert (got.double() - want).norm() <= 0.02 * want.norm() + 1e-4


@pytest.mark.parametrize("fused", [False, True])
@pytest.mark.parametrize("owns", [False, True])
def test_forward_outside_micro_batch_is_a_clear_error_and_eval_is_free(owns, fused):
    model = tiny_peft_llama(seed=8)
    modules = find_lora_modules(model)
    if fused:
        fuse_lora_layers(modules)
    buffers = [(torch.zeros(N, *m.lora_A.weight.shape), torch.zeros(N, *m.lora_B.weight.shape)) for m in modules]
    cap = DomainGradientCapture(modules, buffers, N, owns_gradients=owns)
    ids, attn, _, _ = batch()
    with torch.no_grad():
        model(input_ids=ids, attention_mask=attn)  # evaluation: nothing captured, no error
    with pytest.raises(RuntimeError, match="outside micro_batch"):
        model(input_ids=ids, attention_mask=attn)
    with pytest.raises(ValueError, match="domain ids"):
        with cap.micro_batch(torch.tensor([0, 5]), 1.0):
            pass


def test_rslora_scaling_is_found():
    model = tiny_peft_llama(seed=9, rslora=True, r=4)
    mods = find_lora_modules(model)
    assert mods[1].scaling == pytest.approx(8 / 4**0.5)  # alpha / sqrt(r)
    assert mods[0].rank == 6 and mods[0].scaling == pytest.approx(8 / 6**0.5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_one_sequence_per_domain_fast_path_equals_index_add(dtype, monkeypatch):
    """Micro-batches of one group in domain order add in place; any other order takes index_add."""
    model = tiny_peft_llama(seed=10, dtype=dtype)
    modules = find_lora_modules(model)
    assert modules[0].lora_A.weight.dtype == dtype
    ids, attn, labels, domains = batch(seed=11)  # domains 0, 1, 2, 0, 1, 2
    taken = []
    real = DomainGradientCapture.micro_batch

    @contextlib.contextmanager
    def spy(self, domain_ids, loss_scale):
        with real(self, domain_ids, loss_scale):
            taken.append(self._micro.one_per_domain)
            yield

    monkeypatch.setattr(DomainGradientCapture, "micro_batch", spy)
    in_order = [torch.arange(0, 3), torch.arange(3, 6)]
    shuffled = [torch.tensor([2, 0, 1]), torch.tensor([4, 3, 5])]
    fast, _ = run_capture(model, modules, ids, attn, labels, domains, in_order)
    slow, _ = run_capture(model, modules, ids, attn, labels, domains, shuffled)
    assert taken == [True, True, False, False]
    # fp32: the fast path adds each product in its GEMM (one rounding), index_add after it (two);
    # bf16 off CUDA: both round each product to bf16, then add
    close = dict(rtol=1e-6, atol=1e-9) if dtype == torch.bfloat16 else dict(rtol=1e-5, atol=1e-7)
    for (fA, fB), (sA, sB) in zip(fast, slow):
        torch.testing.assert_close(fA, sA, **close)
        torch.testing.assert_close(fB, sB, **close)
        assert fA.abs().sum() > 0


def _product_operands(dtype, device, seed=12, b=3, tokens=40, out=24, r=5):
    """A capture's operands as it hands them over: dy^T a transposed (strided) view, x contiguous."""
    g = torch.Generator().manual_seed(seed)
    dy_t = torch.randn(b, tokens, out, generator=g).to(device, dtype).mT
    x = torch.randn(b, tokens, r, generator=g).to(device, dtype)
    return dy_t, x


def test_add_products_adds_into_the_sums_as_the_obvious_product():
    # same dtype (fp32): one in-place GEMM, twice, against the float64 sum of the two products
    dy_t, x = _product_operands(torch.float32, "cpu")
    buf = torch.zeros(3, 24, 5)
    add_products(buf, dy_t, x, 0.25)
    add_products(buf, dy_t, x, 0.75)
    want = dy_t.double() @ x.double()
    torch.testing.assert_close(buf.double(), want, rtol=1e-6, atol=1e-6 * float(want.abs().max()))
    # bf16 operands off CUDA: each product rounded to bf16, then added (the path autograd takes)
    dy_t, x = _product_operands(torch.bfloat16, "cpu")
    buf = torch.zeros(3, 24, 5)
    add_products(buf, dy_t, x, 0.5)
    assert torch.equal(buf, torch.bmm(dy_t, x).float() * 0.5)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_add_products_on_cuda_sums_half_precision_operands_in_fp32(dtype):
    """One GEMM writes fp32 sums: float32 summation error only, where rounding each product to
    the operands' dtype first (the unfused path) is 2^-9 off or worse."""
    dy_t, x = _product_operands(dtype, "cuda", tokens=512, out=4096, r=16, b=4)
    want = (dy_t.double() @ x.double()) * (0.25 + 0.5)
    buf = torch.zeros(4, 4096, 16, device="cuda")
    add_products(buf, dy_t, x, 0.25)
    add_products(buf, dy_t, x, 0.5)
    rounded = torch.bmm(dy_t, x).double() * 0.75

    def rel(t):
        return float((t.double() - want).norm() / want.norm())

    assert rel(buf) < 1e-6 < 1e-4 < rel(rounded), (rel(buf), rel(rounded))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("owns", [False, True])
def test_capture_on_cuda_in_bf16_in_place_sums_equal_index_add(owns):
    """A bf16 model on CUDA (adapters too, as under DeepSpeed): micro-batches of one sequence per
    domain in order (one GEMM per factor writes the fp32 sums) against the same sequences
    shuffled (per-sequence products rounded to bf16, then index_add): the same sums up to that
    rounding."""
    model = tiny_peft_llama(seed=6, dtype=torch.bfloat16).to("cuda")
    modules = find_lora_modules(model)
    assert modules[0].lora_A.weight.dtype == torch.bfloat16
    ids, attn, labels, domains = (t.cuda() for t in batch(seed=7))
    sums = []
    for splits in ([[0, 1, 2], [3, 4, 5]], [[2, 0, 1], [4, 3, 5]]):
        buffers = [(torch.zeros(N, *m.lora_A.weight.shape, device="cuda"),
                    torch.zeros(N, *m.lora_B.weight.shape, device="cuda")) for m in modules]
        cap = DomainGradientCapture(modules, buffers, N, owns_gradients=owns)
        for rows in splits:
            with cap.micro_batch(domains[rows].cpu(), loss_scale=1.0 / len(rows)):
                sequence_losses(model(input_ids=ids[rows], attention_mask=attn[rows]).logits,
                                labels[rows]).mean().backward()
        cap.remove()
        sums.append([t.double() for pair in buffers for t in pair])
    for fast, slow in zip(*sums):
        assert fast.norm() > 0 and (fast - slow).norm() <= 2 ** -8 * slow.norm()


@pytest.mark.slow
def test_bench_capture_runs_and_reports_the_extra(tmp_path):
    import os
    import subprocess
    import sys

    bench = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "bench", "bench_capture.py")
    for mode, words in (([], "alongside autograd"), (["--owns"], "owning the factors' gradients")):
        proc = subprocess.run([sys.executable, bench, "--layers", "2", "--rounds", "1", "--iters", "2", *mode],
                              capture_output=True, text=True, timeout=300)
        assert proc.returncode == 0, proc.stderr[-2000:]
        assert f"8 LoRA layers, capture {words}" in proc.stdout and "us per LoRA layer" in proc.stdout, proc.stdout


def test_bench_capture_lora_only_needs_cuda(capsys):
    import bench_capture  # bench/ is on the path: pytest's pythonpath option (pyproject.toml)

    with pytest.raises(SystemExit) as exc:
        bench_capture.main(["--lora-only"])
    assert exc.value.code == 2 and "--lora-only needs --device cuda" in capsys.readouterr().err
