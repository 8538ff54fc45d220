"""Padding-free micro-batches (``data.padding_free``): one row of sequences back to back gives
the per-sequence losses, the per-domain captured gradients and the trained adapters of the
padded layout, each against a reference that never packs."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import yaml

from dist_helpers import launch
from iga_ds.errors import ConfigError
from iga_ds.lora.capture import DomainGradientCapture, add_span_products, domain_mask, domain_spans
from iga_ds.lora.fused import fuse_lora_layers
from iga_ds.lora.modules import find_lora_modules
from iga_ds.train.batching import (IGNORE_INDEX, check_padding_free, pack_rows, packed_sequence_losses, pad_rows,
                                   sequence_losses)
from test_train_support import run_config_dict, tiny_base, write_isomer_jsonl
from tiny_models import relative_error, tiny_peft_llama

REPO = Path(__file__).resolve().parents[2]
N = 3
VOCAB = 61


def rows_of(lengths, seed=0, prompt=3):
    """(token ids, labels) rows of these lengths, the first ``prompt`` labels masked."""
    g = torch.Generator().manual_seed(seed)
    rows = []
    for n in lengths:
        ids = torch.randint(0, VOCAB, (n,), generator=g).tolist()
        rows.append((ids, [IGNORE_INDEX] * prompt + ids[prompt:]))
    return rows


def reference_losses(logits, labels):
    """One sequence's mean target-token cross-entropy, token by token, in float64."""
    terms = [-torch.log_softmax(logits[0, t].double(), -1)[labels[t + 1]] for t in range(len(labels) - 1)
             if labels[t + 1] != IGNORE_INDEX]
    return torch.stack(terms).mean().reshape(1)


def float64_model(seed=1, attn="sdpa"):
    model = tiny_peft_llama(seed=seed, dtype=torch.float64)
    model.base_model.model.set_attn_implementation(attn)
    return model


def packed_forward(model, packed):
    return model(**packed.model_inputs()).logits


# -- the layout ------------------------------------------------------------------------------


def test_pack_rows_lays_sequences_back_to_back():
    rows = [([5, 6, 7], [IGNORE_INDEX, 6, 7]), ([8, 9], [8, 9]), ([1, 2, 3, 4], [IGNORE_INDEX, IGNORE_INDEX, 3, 4])]
    packed, padded = pack_rows(rows, [0, 1, 2]), pad_rows(rows, [0, 1, 2], pad=0)
    assert packed.input_ids.tolist() == [[5, 6, 7, 8, 9, 1, 2, 3, 4]]
    assert packed.position_ids.tolist() == [[0, 1, 2, 0, 1, 0, 1, 2, 3]]
    # each sequence's first label ignored: it would be predicted from the previous sequence
    assert packed.labels.tolist() == [[-100, 6, 7, -100, 9, -100, -100, 3, 4]]
    assert packed.sequence_lengths.tolist() == [3, 2, 4]
    assert packed.token_index.tolist() == [[0, 1, 2, 9], [3, 4, 9, 9], [5, 6, 7, 8]]
    assert (packed.num_tokens, packed.num_target_tokens) == (padded.num_tokens, padded.num_target_tokens) == (9, 6)
    assert "attention_mask" not in packed.model_inputs() and packed.model_inputs()["use_cache"] is False
    # what varlen kernels take: the cumulative lengths (int32) and the longest, a host int
    assert packed.cu_seq_lens.tolist() == [0, 3, 5, 9] and packed.cu_seq_lens.dtype == torch.int32
    assert packed.model_inputs()["max_length_q"] == 4 and type(packed.model_inputs()["max_length_q"]) is int


def test_domain_spans_merge_consecutive_sequences_of_a_domain():
    assert domain_spans(torch.tensor([0, 1, 2]), [3, 2, 4]) == ([(0, 0, 3), (1, 3, 5), (2, 5, 9)], 9)
    assert domain_spans(torch.tensor([0, 0, 2, 1, 1]), [1, 2, 3, 4, 5]) == ([(0, 0, 3), (2, 3, 6), (1, 6, 15)], 15)
    with pytest.raises(ValueError, match="sequence_lengths: expected 2 positive token counts"):
        domain_spans(torch.tensor([0, 1]), [3])


def test_a_packed_micro_batch_of_several_groups_goes_domain_by_domain():
    """Several groups: the packed row holds the padded batch's sequences, each domain's together
    (one product per domain in the capture), groups in their order within a domain."""
    import datasets

    from iga_ds.train.batching import TokenizedGroups

    rows = rows_of([4, 5, 6, 7, 8, 9, 3, 4, 5], seed=3)  # 3 groups x 3 domains, row g * 3 + d
    table = datasets.Dataset.from_dict({"input_ids": [r[0] for r in rows], "labels": [r[1] for r in rows]})
    groups = TokenizedGroups(table, N, 0, Path("unused"), built=True)
    padded, packed = groups.micro_batch([2, 0]), groups.micro_batch([2, 0], padding_free=True)
    assert padded.domain_ids.tolist() == [0, 1, 2, 0, 1, 2]
    assert packed.domain_ids.tolist() == [0, 0, 1, 1, 2, 2]
    order = [6, 0, 7, 1, 8, 2]  # the records, domain by domain
    assert packed.input_ids[0].tolist() == [t for i in order for t in rows[i][0]]
    assert packed.sequence_lengths.tolist() == [len(rows[i][0]) for i in order]
    spans, _ = domain_spans(packed.domain_ids, packed.sequence_lengths)
    assert [d for d, _, _ in spans] == [0, 1, 2]


def test_halves_follow_each_group_and_a_packed_row_goes_half_by_half():
    """With each group's half of the step (variance: debiased), every sequence carries its group's
    half; a packed row is ordered by half, then domain, so each (domain, half) is one span."""
    import datasets

    from iga_ds.train.batching import GroupSampler, TokenizedGroups

    rows = rows_of([4, 5, 6, 7, 8, 9, 3, 4, 5], seed=3)
    table = datasets.Dataset.from_dict({"input_ids": [r[0] for r in rows], "labels": [r[1] for r in rows]})
    groups = TokenizedGroups(table, N, 0, Path("unused"), built=True)
    padded = groups.micro_batch([2, 0, 1], halves=[0, 1, 0])
    assert padded.domain_ids.tolist() == [0, 1, 2] * 3 and padded.halves.tolist() == [0] * 3 + [1] * 3 + [0] * 3
    assert padded.to("cpu").halves.tolist() == padded.halves.tolist()  # the halves stay with the batch
    packed = groups.micro_batch([2, 0, 1], padding_free=True, halves=[0, 1, 0])
    order = [6, 3, 7, 4, 8, 5, 0, 1, 2]  # half 0 (groups 2, 1) domain by domain, then half 1 (group 0)
    assert packed.input_ids[0].tolist() == [t for i in order for t in rows[i][0]]
    assert packed.halves.tolist() == [0] * 6 + [1] * 3 and packed.domain_ids.tolist() == [0, 0, 1, 1, 2, 2, 0, 1, 2]
    assert groups.micro_batch([2, 0]).halves is None  # not asked for: none
    with pytest.raises(ValueError, match=r"halves: expected one per group \(2\), got 1"):
        groups.micro_batch([2, 0], halves=[0])
    # the halves of the step's groups alternate over the step, whichever rank holds a group
    sampler = GroupSampler(num_groups=12, groups_per_step=6, seed=1)
    assert sampler.rank_halves(0, 1) == [0, 1, 0, 1, 0, 1]
    assert sampler.rank_halves(0, 2) + sampler.rank_halves(1, 2) == [0, 1, 0, 1, 0, 1]


# -- losses ----------------------------------------------------------------------------------


# eager attention takes its softmax in float32, whose sums round differently over the padded
# batch's, the packed row's and a lone sequence's widths; sdpa stays float64
@pytest.mark.parametrize("attn, tolerance", [("sdpa", 1e-12), ("eager", 1e-6)])
def test_packed_sequence_losses_equal_padded_and_one_by_one(attn, tolerance):
    """float64: the packed row's per-sequence losses are the padded batch's and those of each
    sequence alone; sequences of other lengths around a sequence change nothing, so no
    attention and no loss crosses a boundary."""
    model = float64_model(attn=attn).eval()
    rows = rows_of([7, 4, 9, 5, 8, 6], seed=2)
    domains = [0, 1, 2, 0, 1, 2]
    with torch.no_grad():
        padded = pad_rows(rows, domains, pad=0)
        padded_losses = sequence_losses(model(**padded.model_inputs()).logits, padded.labels)
        packed = pack_rows(rows, domains)
        packed_losses = packed.sequence_losses(packed_forward(model, packed))
        alone = torch.cat([reference_losses(model(input_ids=torch.tensor([ids])).logits, labels)
                           for ids, labels in rows])
    assert packed_losses.dtype == torch.float64
    torch.testing.assert_close(packed_losses, padded_losses, rtol=tolerance, atol=tolerance)
    torch.testing.assert_close(packed_losses, alone, rtol=tolerance, atol=tolerance)


def test_packed_sequence_losses_match_in_float32_and_give_each_sequence_its_gradient():
    """float32 logits as in training: the same losses to rounding, and the gradient of one
    sequence's loss reaches only its own positions."""
    logits = torch.randn(1, 12, 7, dtype=torch.float32, requires_grad=True)
    rows = [([1] * 5, [IGNORE_INDEX, 2, 3, 4, 5]), ([1] * 7, [IGNORE_INDEX] * 2 + [6, 5, 4, 3, 2])]
    packed = pack_rows(rows, [0, 1])
    losses = packed_sequence_losses(logits, packed.labels, packed.token_index)
    split = [logits[:, :5], logits[:, 5:]]
    alone = torch.cat([sequence_losses(part, torch.tensor([lab])) for part, (_, lab) in zip(split, rows)])
    torch.testing.assert_close(losses, alone, rtol=1e-6, atol=1e-7)
    (grad,) = torch.autograd.grad(losses[1], logits)
    assert grad[0, :5].abs().sum() == 0 and grad[0, 5:11].abs().sum() > 0 and grad[0, 11].abs().sum() == 0


# -- per-domain capture ----------------------------------------------------------------------


def loop_reference(model, modules, rows, domains):
    """Per-domain sums of LoRA gradients from one backward per sequence, each alone in its batch."""
    sums = [[torch.zeros_like(p) for m in modules for p in (m.lora_A.weight, m.lora_B.weight)] for _ in range(N)]
    params = [p for m in modules for p in (m.lora_A.weight, m.lora_B.weight)]
    for (ids, labels), d in zip(rows, domains):
        loss = reference_losses(model(input_ids=torch.tensor([ids])).logits, labels)
        for acc, g in zip(sums[d], torch.autograd.grad(loss.sum(), params)):
            acc += g
    return sums


@pytest.mark.parametrize("fused", [False, True])
@pytest.mark.parametrize("owns", [False, True])
@pytest.mark.parametrize("domains", [[0, 1, 2], [0, 1, 2, 0, 1, 2], [2, 2, 0, 1, 1, 0]],
                         ids=["one_group", "two_groups", "runs"])
def test_packed_capture_equals_a_loop_of_single_sequences(domains, owns, fused):
    """float64: one packed forward and backward, each token attributed to its sequence's domain
    (through hooks on PEFT's layers, or the fused layers' backward)."""
    model = float64_model(seed=3)
    model.train()
    modules = find_lora_modules(model)
    rows = rows_of([6, 9, 4, 8, 5, 7][: len(domains)], seed=4)
    ref = loop_reference(model, modules, rows, domains)
    model.zero_grad()
    if fused:
        assert len(fuse_lora_layers(modules)) == len(modules)
    buffers = [(torch.zeros(N, *m.lora_A.weight.shape, dtype=torch.float64),
                torch.zeros(N, *m.lora_B.weight.shape, dtype=torch.float64)) for m in modules]
    capture = DomainGradientCapture(modules, buffers, N, owns_gradients=owns)
    packed = pack_rows(rows, domains)
    # the sum, not the mean: LLaMA's RMSNorm rounds gradients to float32, and a gradient
    # scaled by 1/6 there rounds otherwise than the reference's unscaled one
    with capture.micro_batch(packed.domain_ids, 1.0, packed.sequence_lengths):
        packed.sequence_losses(packed_forward(model, packed)).sum().backward()
    capture.remove()
    assert capture.counts.tolist() == torch.bincount(torch.tensor(domains), minlength=N).double().tolist()
    for d in range(N):
        for i, (bA, bB) in enumerate(buffers):
            torch.testing.assert_close(bA[d], ref[d][2 * i], rtol=1e-10, atol=1e-12)
            torch.testing.assert_close(bB[d], ref[d][2 * i + 1], rtol=1e-10, atol=1e-12)
    assert all(buf.abs().sum() > 0 for pair in buffers for buf in pair)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=[
    pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")])])
@pytest.mark.parametrize("narrow", ["right", "left"])
def test_span_products_take_one_gemm_and_equal_one_product_per_span(narrow, device):
    """Several spans' products in one GEMM (the narrow operand laid out per domain) against one
    float64 product per span of the same values. On the CPU in float64: to rounding; on CUDA
    with bf16 operands: the fp32 sums the GEMM writes, never rounded to bf16."""
    g = torch.Generator().manual_seed(0)
    spans = [(2, 0, 7), (0, 7, 12), (2, 12, 20), (1, 20, 29)]  # domain 2 twice, domain 3 of 4 absent
    wide, thin = torch.randn(29, 40, generator=g), torch.randn(29, 5, generator=g)
    dy, xs = (wide, thin) if narrow == "right" else (thin, wide)
    dtype = torch.float64 if device == "cpu" else torch.bfloat16
    dy, xs = dy.to(device, dtype), xs.to(device, dtype)
    buf = torch.ones(4, dy.shape[1], xs.shape[1], dtype=torch.float64 if device == "cpu" else torch.float32,
                     device=device)
    add_span_products(buf, dy, xs, spans, 0.5, lambda like: domain_mask(spans, 29, 4, like))
    want = torch.ones(4, dy.shape[1], xs.shape[1], dtype=torch.float64)
    for domain, start, end in spans:
        want[domain] += 0.5 * dy[start:end].double().cpu().mT @ xs[start:end].double().cpu()
    assert (want[3] == 1).all() and relative_error(buf.cpu(), want) < (1e-14 if device == "cpu" else 1e-6)


def test_capture_of_a_padded_shape_in_a_packed_micro_batch_is_a_clear_error():
    model = float64_model(seed=5)
    modules = find_lora_modules(model)
    buffers = [(torch.zeros(N, *m.lora_A.weight.shape, dtype=torch.float64),
                torch.zeros(N, *m.lora_B.weight.shape, dtype=torch.float64)) for m in modules]
    capture = DomainGradientCapture(modules, buffers, N)
    padded = pad_rows(rows_of([5, 6, 7]), [0, 1, 2], pad=0)
    with pytest.raises(RuntimeError, match="expected one padding-free row of 18 tokens"):
        with capture.micro_batch(padded.domain_ids, 1 / 3, [5, 6, 7]):
            sequence_losses(model(**padded.model_inputs()).logits, padded.labels).mean().backward()


def test_an_attention_that_cannot_separate_packed_sequences_is_a_clear_error():
    model = float64_model(seed=6)
    # sdpa keeps them apart by masking the whole row: allowed, with a note on its cost
    assert "whole packed row" in check_padding_free(model) and "flex_attention" in check_padding_free(model)
    model.config._attn_implementation = "flash_attention_2"  # varlen: nothing to say
    assert check_padding_free(model) is None
    model.config._attn_implementation = "paged|eager"  # the mask of paged attention ignores position ids
    with pytest.raises(ConfigError, match=r"^data.padding_free: attention implementation 'paged\|eager' "):
        check_padding_free(model)


# -- training runs ---------------------------------------------------------------------------

# 4 groups a step; at world size 1, two micro-batches of 2 groups (8 sequences of 4 domains)
RUN = {"schedule.max_steps": 2, "data.groups_per_step": 4, "data.groups_per_micro_batch": 2}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("padding_free")
    data = write_isomer_jsonl(tmp / "train.jsonl", groups=8, seed=2)
    return tmp, data, tiny_base(tmp, data)


def write_config(runs, name, method, padding_free, **over) -> Path:
    tmp, data, base = runs
    cfg = run_config_dict(tmp, data, output_dir=str(tmp / name), **RUN, **{"method.name": method},
                          **{"data.padding_free": padding_free, "model.name_or_path": str(base)}, **over)
    path = tmp / f"{name}.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def train_here(path: Path):
    from iga_ds.config.run import load_run_config
    from iga_ds.train.trainer import Trainer

    return Trainer(load_run_config(path), quiet=True).run()


def adapter(folder: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(str(folder / "adapter" / "adapter_model.safetensors"))


def assert_same_training(got: Path, want: Path) -> None:
    """float32 training: a packed row's forward and backward round otherwise than padded
    rows' (~1e-7 relative), and 2 AdamW steps carry that into the factors: 1.5e-7 at most
    here, against atol 1e-6, while IGA's adapter and ERM's differ by 2e-2."""
    losses = [[json.loads(x)["loss"] for x in (f / "metrics.jsonl").read_text().splitlines()] for f in (got, want)]
    assert len(losses[0]) == RUN["schedule.max_steps"]
    assert losses[0] == pytest.approx(losses[1], rel=1e-5)
    a, b = adapter(got), adapter(want)
    assert a.keys() == b.keys()
    for key in a:
        torch.testing.assert_close(a[key], b[key], rtol=1e-4, atol=1e-6)
    assert any(k.endswith("lora_B.weight") and a[k].abs().max() > 0 for k in a)  # training moved them


@pytest.mark.slow
@pytest.mark.parametrize("method", ["erm", "iga"])
def test_padding_free_training_gives_the_padded_adapter(runs, method, monkeypatch):
    from iga_ds.train import batching

    padded = train_here(write_config(runs, f"{method}_padded", method, False))
    rows, pack = [], batching.pack_rows
    monkeypatch.setattr(batching, "pack_rows", lambda *args: rows.append(pack(*args)) or rows[-1])
    packed = train_here(write_config(runs, f"{method}_packed", method, True))
    # 2 steps of 2 micro-batches, each one row of 2 groups of 4 domains
    assert [(r.input_ids.shape[0], len(r.domain_ids)) for r in rows] == [(1, 8)] * 4
    assert packed.status == padded.status == "completed"
    assert [h["target_tokens"] for h in packed.history] == [h["target_tokens"] for h in padded.history]
    assert_same_training(packed.output_dir, padded.output_dir)


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_padding_free_iga_on_two_zero2_ranks_gives_the_padded_adapter(runs):
    """2 real processes (gloo): each rank packs its 2 groups into one row; the adapter is the
    padded single-rank run's (the engine hook's result does not depend on the world size)."""
    tmp = runs[0]
    padded = tmp / "iga_padded"
    if not (padded / "adapter").is_dir():
        train_here(write_config(runs, "iga_padded", "iga", False))
    config = write_config(runs, "iga_packed_2ranks", "iga", True)
    outputs = launch(REPO / "launch" / "train.py", 2, ["--config", str(config)], timeout=200)
    assert [rc for rc, _ in outputs] == [0, 0], outputs[0][1][-3000:] + outputs[1][1][-3000:]
    assert_same_training(tmp / "iga_packed_2ranks", padded)


@pytest.mark.slow
def test_padding_free_with_an_attention_that_mixes_sequences_stops_before_training(runs):
    path = write_config(runs, "paged", "erm", True, **{"model.attn_implementation": "paged|eager"})
    with pytest.raises(ConfigError, match=r"^data.padding_free: attention implementation 'paged\|eager' .*"
                                          r"model.attn_implementation"):
        train_here(path)
