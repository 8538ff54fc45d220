"""model.liger_kernel: liger-kernel's fused RMSNorm, rotary embedding and SwiGLU in place of the
model's own. On a GPU, a LoRA LLaMA's logits and adapter gradients with the kernels match the same
model without them (float32: to rounding); without a GPU or the package, the trainer stops with a
one-line error that names the field, before it loads anything."""
from __future__ import annotations

import importlib.util

import pytest
import torch
import yaml

from iga_ds.config.run import load_run_config
from iga_ds.errors import ConfigError
from iga_ds.train import model as model_module
from iga_ds.train.model import apply_liger_kernel
from iga_ds.train.trainer import Trainer
from test_train_support import run_config_dict, write_isomer_jsonl
from tiny_models import assert_within_bf16_yardstick, relative_error, tiny_peft_llama

GPU_AND_LIGER = pytest.mark.skipif(not torch.cuda.is_available() or importlib.util.find_spec("liger_kernel") is None,
                                   reason="needs a CUDA device and liger-kernel (pip install 'iga-ds[liger]')")


def test_the_trainer_refuses_liger_kernel_where_it_cannot_run(tmp_path, monkeypatch):
    """On this machine either the package or the GPU is missing (or both): each gets its reason."""
    data = write_isomer_jsonl(tmp_path / "train.jsonl", groups=2, seed=3)
    cfg = run_config_dict(tmp_path, data, **{"model.liger_kernel": True})
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(cfg))
    config = load_run_config(path)
    for missing, says in (("package", "not installed"), ("gpu", "needs a CUDA device")):
        with monkeypatch.context() as m:
            if missing == "package":
                m.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "liger_kernel" else spec(name))
            else:
                m.setattr(importlib.util, "find_spec", lambda name, *a: object() if name == "liger_kernel" else spec(name))
                m.setattr(torch.cuda, "is_available", lambda: False)
            with pytest.raises(ConfigError, match=f"model.liger_kernel: .*{says}") as err:
                Trainer(config, quiet=True).run()
        assert "\n" not in str(err.value)
    assert not (tmp_path / "run").exists() or not any((tmp_path / "run").iterdir())


spec = importlib.util.find_spec


def test_an_unknown_model_type_is_named(monkeypatch):
    monkeypatch.setattr(model_module, "require_liger_kernel", lambda: None)
    if importlib.util.find_spec("liger_kernel") is None:
        pytest.skip("liger-kernel is not installed")
    fake = type("Model", (), {"config": type("Config", (), {"model_type": "no-such-type"})()})()
    with pytest.raises(ConfigError, match="no kernels for model type 'no-such-type'"):
        apply_liger_kernel(fake)


def _logits_and_grads(model, ids, mask):
    model.zero_grad(set_to_none=True)
    logits = model(input_ids=ids, attention_mask=mask).logits
    (logits.float().log_softmax(-1)[..., 0] * mask).sum().backward()
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.requires_grad}
    return logits.detach().float(), grads


@pytest.mark.gpu
@GPU_AND_LIGER
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_liger_kernels_match_the_model_s_own_layers(dtype, monkeypatch):
    """float32: the fused kernels agree with the model's own layers to rounding. bfloat16: both are
    rounded; the kernels' distance from the float32 result stays within twice the model's own."""
    from transformers.models.llama import modeling_llama

    # the rotary swap is a module-level function: put it back for the rest of the session
    monkeypatch.setattr(modeling_llama, "apply_rotary_pos_emb", modeling_llama.apply_rotary_pos_emb)
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 97, (3, 21), generator=gen).cuda()
    mask = torch.ones_like(ids)
    mask[1, 15:] = 0  # a padded row
    exact = _logits_and_grads(tiny_peft_llama(seed=1, hidden=128, layers=3, vocab=97).cuda(), ids, mask)
    model = tiny_peft_llama(seed=1, dtype=dtype, hidden=128, layers=3, vocab=97).cuda()
    own = _logits_and_grads(model, ids, mask)
    apply_liger_kernel(model.base_model.model)
    layer = model.base_model.model.model.layers[0]
    assert layer.mlp._get_name() == "LigerSwiGLUMLP" and "Liger" in layer.input_layernorm.forward.__qualname__
    assert modeling_llama.apply_rotary_pos_emb.__module__.startswith("liger_kernel")
    fused = _logits_and_grads(model, ids, mask)
    pairs = [("logits", fused[0], own[0], exact[0])] + [(n, fused[1][n], own[1][n], exact[1][n]) for n in exact[1]]
    for name, got, theirs, want in pairs:
        if dtype == torch.float32:
            assert relative_error(got, want) <= 1e-4, f"{name}: {relative_error(got, want):.2e}"
        else:
            assert_within_bf16_yardstick(name, got, theirs, want, "the model's own")
