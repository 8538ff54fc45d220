"""Small PEFT LLaMA models for tests (random weights, nothing downloaded)."""
from __future__ import annotations

import torch


def tiny_peft_llama(seed=0, dropout=0.0, dtype=torch.float32, r=4, hidden=32, layers=2, vocab=61, rslora=False):
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(
        vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
        # larger than the usual 0.02: peaked attention gives q/k gradients of the same order as
        # the others; near-uniform attention makes them tiny differences of large terms, all
        # float32 rounding noise, and comparisons across world sizes meaningless
        initializer_range=0.3,
    )
    base = LlamaForCausalLM(cfg).to(dtype)
    lora = LoraConfig(
        r=r, lora_alpha=2 * r, lora_dropout=dropout, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"],
        use_rslora=rslora,
        # one module of a different rank: exercises mixed shapes and, with 2 ranks, puts the
        # ZeRO partition boundary inside a LoRA tensor instead of between two
        rank_pattern={"layers.0.self_attn.q_proj": r + 2},
    )
    model = get_peft_model(base, lora)
    # B starts at zero in PEFT; give it values so both factor gradients carry signal
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.05)
    # PEFT keeps the adapters in float32 over a half-precision base; DeepSpeed's bf16 engine
    # casts the whole model, adapters too, and that is the model ``dtype`` means here
    return model.to(dtype)


def batch(seed=0, B=6, T=10, vocab=61, num_domains=3):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, (B, T), generator=g)
    attention = torch.ones(B, T, dtype=torch.long)
    attention[1, -3:] = 0  # some padding
    labels = ids.clone()
    labels[:, :3] = -100  # prompt masked
    labels[attention == 0] = -100
    domains = torch.arange(B) % num_domains
    return ids, attention, labels, domains


def sequence_losses(logits, labels):
    """Mean token cross-entropy per sequence over target tokens (next-token shifted)."""
    logits = logits[:, :-1].float()
    targets = labels[:, 1:]
    mask = targets != -100
    ce = torch.nn.functional.cross_entropy(
        logits.reshape(-1, logits.shape[-1]), targets.clamp_min(0).reshape(-1), reduction="none"
    ).view(targets.shape)
    return (ce * mask).sum(1) / mask.sum(1).clamp_min(1)


# the built-in base shrunk to train in seconds: enough for pipelines, not for accuracy
SHRUNK_TINY_BASE = {"hidden_size": 32, "intermediate_size": 64, "num_layers": 1, "num_heads": 2, "steps": 5,
                    "batch_size": 4, "warmup_steps": 1}


def shrunk_tiny_base_config():
    from iga_ds.config.run import TinyBaseConfig

    return TinyBaseConfig(**SHRUNK_TINY_BASE)


def relative_error(got, want) -> float:
    """||got - want|| / ||want||, in float64."""
    return float((got.double() - want.double()).norm() / want.double().norm())


def assert_within_bf16_yardstick(name: str, got, theirs, want, baseline: str) -> None:
    """A bf16 fast path (``got``) stays as close to the exact result (``want``) as the bf16 path it
    replaces (``theirs``, named ``baseline``) does: within twice its distance, plus 1e-3."""
    err, own = relative_error(got, want), relative_error(theirs, want)
    assert err <= 2 * own + 1e-3, f"{name}: {err:.2e} against {baseline}'s {own:.2e}"
