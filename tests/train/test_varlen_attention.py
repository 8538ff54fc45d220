"""``model.attn_implementation: torch_varlen``: PyTorch's varlen flash-attention kernel on
padding-free rows. A LoRA LLaMA's logits and adapter gradients on a packed row match the padded
model's; the kernel's layout (one row, heads, the cumulative lengths) is checked on the CPU with
a float64 per-sequence stand-in, the kernel itself on a GPU. Where it cannot run, the trainer
stops with a one-line error before it loads anything."""
from __future__ import annotations

import re
import sys

import pytest
import torch
import torch.nn.functional as F
import yaml

from iga_ds.config.run import load_run_config
from iga_ds.errors import ConfigError
from iga_ds.train.attention import (VARLEN_ATTENTION, register_varlen_attention, varlen_attention_forward,
                                   varlen_unavailable)
from iga_ds.train.batching import IGNORE_INDEX, check_padding_free, pack_rows, pad_rows
from iga_ds.train.trainer import Trainer
from test_train_support import run_config_dict, write_isomer_jsonl
from tiny_models import assert_within_bf16_yardstick, relative_error, tiny_peft_llama

LENGTHS = (9, 17, 5, 12)
VOCAB = 97


def test_a_run_yaml_with_torch_varlen_on_padded_rows_is_refused(tmp_path):
    data = write_isomer_jsonl(tmp_path / "train.jsonl", groups=2, seed=3)
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(run_config_dict(tmp_path, data, **{"model.attn_implementation": VARLEN_ATTENTION})))
    with pytest.raises(ConfigError, match=f"run.yaml: model.attn_implementation: {VARLEN_ATTENTION} attends "
                                          "within packed sequences only; set data.padding_free: true") as err:
        load_run_config(path)
    assert "\n" not in str(err.value)


def test_the_trainer_refuses_torch_varlen_where_it_cannot_run(tmp_path, monkeypatch):
    data = write_isomer_jsonl(tmp_path / "train.jsonl", groups=2, seed=3)
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(run_config_dict(tmp_path, data, **{"model.attn_implementation": VARLEN_ATTENTION,
                                                                       "data.padding_free": True})))
    for case, says in (("no varlen module", "needs torch.nn.attention.varlen"), ("no gpu", "needs a CUDA device")):
        with monkeypatch.context() as m:
            if case == "no varlen module":
                m.setitem(sys.modules, "torch.nn.attention.varlen", None)  # import fails
            m.setattr(torch.cuda, "is_available", lambda: False)
            with pytest.raises(ConfigError, match=f"model.attn_implementation: {VARLEN_ATTENTION} .*{says}") as err:
                Trainer(load_run_config(path), quiet=True).run()
        assert "\n" not in str(err.value), case
    assert not (tmp_path / "run").exists() or not any((tmp_path / "run").iterdir())


def per_sequence_attention(q, k, v, cu_q, cu_k, max_q, max_k, *, scale=None, window_size=(-1, -1)):
    """A float64 stand-in for the kernel (torch 2.11's signature): each sequence's causal attention
    on its own."""
    assert torch.equal(cu_q, cu_k) and tuple(window_size) == (-1, 0)
    assert q.shape[0] == int(cu_q[-1]) and max_q == max(torch.diff(cu_q).tolist())
    out = []
    for a, b in zip(cu_q[:-1].tolist(), cu_q[1:].tolist()):
        qs, ks, vs = (t[a:b].transpose(0, 1).double() for t in (q, k, v))
        out.append(F.scaled_dot_product_attention(qs, ks, vs, is_causal=True, scale=scale).transpose(0, 1))
    return torch.cat(out).to(q.dtype)


def _rows():
    g = torch.Generator().manual_seed(0)
    return [(ids := torch.randint(0, VOCAB, (n,), generator=g).tolist(), [IGNORE_INDEX] * 2 + ids[2:])
            for n in LENGTHS]


def _logits_and_grads(model, inputs, positions):
    """The logits at each sequence's tokens (rows of ``positions``) and the adapters' gradients."""
    model.zero_grad(set_to_none=True)
    logits = model(**inputs).logits.reshape(-1, VOCAB)[positions]
    (logits.float().log_softmax(-1)[:, 0]).sum().backward()
    return [logits.detach().float()] + [p.grad.detach().float() for p in model.parameters() if p.requires_grad]


def test_torch_varlen_hands_the_kernel_each_sequence(monkeypatch):
    """On the CPU: the layout around the kernel, with the float64 stand-in in its place."""
    import torch.nn.attention.varlen as varlen
    monkeypatch.setattr(varlen, "varlen_attn", per_sequence_attention)
    check_against_padded_rows("cpu")


def test_torch_varlen_hands_gradients_back_in_the_projections_layout(monkeypatch):
    """q, k and v come in as transformers lays them out, (1, heads, T, d) views of the
    projections' (1, T, heads x d) outputs; their gradients must go back in that layout, as
    views of the kernel's (T, heads, d) gradients. Any other layout costs a copy of each one at
    every layer (and the rotary embedding's backward another)."""
    import torch.nn.attention.varlen as varlen
    monkeypatch.setattr(varlen, "varlen_attn", lambda q, k, v, *args, **kwargs: q * k + v)
    heads, tokens, d = 4, 11, 8
    projections = [torch.randn(1, tokens, heads * d, dtype=torch.bfloat16, requires_grad=True) for _ in range(3)]
    q, k, v = (p.view(1, tokens, heads, d).transpose(1, 2) for p in projections)
    grads = []
    for t in (q, k, v):
        t.register_hook(grads.append)
    out, _ = varlen_attention_forward(None, q, k, v, None, cu_seq_lens_q=torch.tensor([0, 5, 11], dtype=torch.int32),
                                      max_length_q=6)
    out.backward(torch.randn_like(out))
    assert len(grads) == 3 and all(g.shape == (1, heads, tokens, d) and g.transpose(1, 2).is_contiguous()
                                   for g in grads)


@pytest.mark.gpu
def test_torch_varlen_matches_padded_rows_on_a_gpu():
    if reason := varlen_unavailable():
        pytest.skip(reason)
    check_against_padded_rows("cuda")


def check_against_padded_rows(device: str):
    """bf16, grouped-query heads: the packed row through torch_varlen against padded rows through
    sdpa, both measured from the same model in float64; torch_varlen's distance stays within
    twice (plus 1e-3) that of sdpa on padded rows in bf16."""
    rows, domains = _rows(), [0, 1, 2, 3]
    packed, padded = pack_rows(rows, domains).to(device), pad_rows(rows, domains, pad=0).to(device)
    width = padded.input_ids.shape[1]
    padded_positions = torch.cat([torch.arange(n) + i * width for i, n in enumerate(LENGTHS)])
    padded_inputs = {"input_ids": padded.input_ids, "attention_mask": padded.attention_mask, "use_cache": False}

    def model(dtype, attn):
        m = tiny_peft_llama(seed=1, dtype=dtype, hidden=128, layers=2, vocab=VOCAB).to(device)
        m.base_model.model.set_attn_implementation(attn)
        return m

    register_varlen_attention()
    exact = _logits_and_grads(model(torch.float64, "sdpa"), padded_inputs, padded_positions)
    sdpa = _logits_and_grads(model(torch.bfloat16, "sdpa"), padded_inputs, padded_positions)
    varlen_model = model(torch.bfloat16, VARLEN_ATTENTION)
    assert check_padding_free(varlen_model.base_model.model) is None  # a kernel that skips across sequences
    varlen = _logits_and_grads(varlen_model, packed.model_inputs(), torch.arange(sum(LENGTHS)))
    assert len(varlen) == len(exact) > 1
    for i, (got, theirs, want) in enumerate(zip(varlen, sdpa, exact)):
        assert_within_bf16_yardstick("logits" if i == 0 else f"adapter gradient {i}", got, theirs, want, "sdpa")
    # activation checkpointing recomputes each layer with the same lengths: the same numbers
    varlen_model.base_model.model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    varlen_model.train()
    again = _logits_and_grads(varlen_model, packed.model_inputs(), torch.arange(sum(LENGTHS)))
    assert all(relative_error(got, want) <= 1e-6 for got, want in zip(again, varlen))


def test_torch_varlen_names_what_the_model_needs_and_the_kernel_lacks(monkeypatch):
    import torch.nn.attention.varlen as varlen
    monkeypatch.setattr(varlen, "varlen_attn", per_sequence_attention)
    q = torch.zeros(1, 4, 10, 8, dtype=torch.bfloat16)
    lengths = {"cu_seq_lens_q": torch.tensor([0, 6, 10], dtype=torch.int32), "max_length_q": 6}
    for extra, says in (({"sliding_window": 4}, "has no sliding window (4 tokens; a sequence here has 6)"),
                        ({"softcap": 50.0}, "has no logit soft-capping"), ({"s_aux": torch.zeros(4)}, "attention sinks")):
        with pytest.raises(ConfigError, match=re.escape(says) + ".*use sdpa"):
            varlen_attention_forward(None, q, q, q, None, **lengths, **extra)
    # a window wider than every sequence is no window at all
    out, _ = varlen_attention_forward(None, q, q, q, None, **lengths, sliding_window=4096)
    assert out.shape == (1, 10, 4, 8)


def test_torch_varlen_refuses_padded_rows_and_float32(monkeypatch):
    import torch.nn.attention.varlen as varlen
    monkeypatch.setattr(varlen, "varlen_attn", per_sequence_attention)
    register_varlen_attention()
    model = tiny_peft_llama(seed=1, dtype=torch.bfloat16, vocab=VOCAB)
    model.base_model.model.set_attn_implementation(VARLEN_ATTENTION)
    padded = pad_rows(_rows(), [0, 1, 2, 3], pad=0)
    with pytest.raises(ConfigError, match="needs padding-free micro-batches"):
        model(input_ids=padded.input_ids, attention_mask=padded.attention_mask, use_cache=False)
    with pytest.raises(ConfigError, match="runs in bfloat16 or float16, not torch.float32"):
        model.float()(**pack_rows(_rows(), [0, 1, 2, 3]).model_inputs())
