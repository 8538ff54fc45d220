"""Models for training: any Hugging Face causal LM (a local folder, a hub id or a GGUF file, see
``iga_ds.models``), or the built-in tiny LLaMA base.

The built-in base needs no download. Its word-level tokenizer is built from the vocabulary
of the text it is pretrained on (generator text), and the model is a small
LLaMA-architecture network (Touvron et al., 2023, "LLaMA: Open and Efficient Foundation
Language Models") pretrained from scratch with next-token cross-entropy. The result is
cached under ``$IGA_DS_CACHE`` (default ``~/.cache/iga-ds``) in a folder named by a hash of
the pretraining settings and the corpus, written atomically (built in a temporary folder,
then renamed), so a second call with the same inputs loads it instantly.
"""
from __future__ import annotations

import hashlib
import json
import math
import os
import shutil
import time
from collections import Counter
from pathlib import Path
from typing import Iterable, Sequence

from iga_ds.config.run import TinyBaseConfig
from iga_ds.errors import ConfigError
from iga_ds.files import atomic_write_json, follow_umask, make_dir
from iga_ds.lora.fused import fuse_lora_layers
from iga_ds.lora.modules import find_lora_modules
from iga_ds.models import EXPECTED, cache_root, load_auto_tokenizer, load_causal_lm
from iga_ds.progress import progress as progress_of
from iga_ds.train.attention import VARLEN_ATTENTION, register_varlen_attention
from iga_ds.train.batching import check_padding_free

# Word-level splitting with the leading space kept on the word: lossless, so decoding is a
# plain concatenation and answer extraction sees the original text. Digits are single tokens
# so that numbers outside the corpus still tokenize.
WORD_PATTERN = r" ?[A-Za-z]+| ?[0-9]| ?[^A-Za-z0-9\s]|\s"
SPECIAL_TOKENS = ("[PAD]", "[UNK]", "<s>", "</s>")
_TOKENIZER_VERSION = 2  # bump when WORD_PATTERN or the vocabulary rule changes


# -- tokenizer -------------------------------------------------------------------------------


def _pre_tokenizer():
    from tokenizers import Regex, pre_tokenizers

    return pre_tokenizers.Split(Regex(WORD_PATTERN), behavior="isolated")


def build_vocab(texts: Iterable[str], extra_words: Sequence[str] = ()) -> list[str]:
    """Special tokens, then every printable ASCII character (with and without a leading space,
    so no single character is unknown), then corpus words by falling frequency, then
    ``extra_words`` the corpus lacks (with and without a leading space). A word outside the
    vocabulary is one [UNK] token: the model cannot tell such words apart."""
    pre = _pre_tokenizer()
    counts: Counter[str] = Counter()
    for text in texts:
        counts.update(piece for piece, _ in pre.pre_tokenize_str(text))
    vocab = list(SPECIAL_TOKENS)
    seen = set(vocab)
    base_chars = [chr(c) for c in range(33, 127)]
    for tok in ["\n", " ", "\t"] + base_chars + [" " + c for c in base_chars]:
        if tok not in seen:
            vocab.append(tok)
            seen.add(tok)
    for tok, _ in sorted(counts.items(), key=lambda kv: (-kv[1], kv[0])):
        if tok not in seen:
            vocab.append(tok)
            seen.add(tok)
    for word in extra_words:
        for tok in (word, " " + word):
            if tok not in seen:
                vocab.append(tok)
                seen.add(tok)
    return vocab


def build_word_tokenizer(vocab: Sequence[str]):
    """A ``PreTrainedTokenizerFast`` over a fixed word list (no merges, no training)."""
    from tokenizers import Tokenizer, decoders, models
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel({t: i for i, t in enumerate(vocab)}, unk_token="[UNK]"))
    tok.pre_tokenizer = _pre_tokenizer()
    tok.decoder = decoders.Fuse()  # tokens carry their own spaces
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        pad_token="[PAD]",
        unk_token="[UNK]",
        bos_token="<s>",
        eos_token="</s>",
        padding_side="right",
        clean_up_tokenization_spaces=False,
    )


# -- tiny base -------------------------------------------------------------------------------


def corpus_digest(texts: Sequence[str]) -> str:
    h = hashlib.sha256()
    for t in texts:
        h.update(t.encode("utf-8"))
        h.update(b"\0")
    return h.hexdigest()


def tiny_base_key(config: TinyBaseConfig, texts: Sequence[str], extra_words: Sequence[str] = (),
                  device: str = "cpu") -> str:
    import torch
    import transformers

    payload = {
        "config": config.to_dict(),
        "corpus": corpus_digest(texts),
        "extra_words": corpus_digest(extra_words),
        "tokenizer_version": _TOKENIZER_VERSION,
        # a different major library version may initialize or compute differently
        "torch": torch.__version__.split("+")[0].rsplit(".", 1)[0],
        "transformers": transformers.__version__.split(".")[0],
        "device": device,  # a GPU rounds differently: its base is cached apart from a CPU build
    }
    return hashlib.sha256(json.dumps(payload, sort_keys=True).encode()).hexdigest()[:16]


def build_tiny_llama(vocab_size: int, config: TinyBaseConfig, special_ids: dict[str, int]):
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=config.hidden_size,
        intermediate_size=config.intermediate_size,
        num_hidden_layers=config.num_layers,
        num_attention_heads=config.num_heads,
        num_key_value_heads=config.num_heads,
        max_position_embeddings=config.max_length,
        rms_norm_eps=1e-6,
        tie_word_embeddings=True,
        pad_token_id=special_ids["pad"],
        bos_token_id=special_ids["bos"],
        eos_token_id=special_ids["eos"],
    )
    torch.manual_seed(config.seed)
    return LlamaForCausalLM(cfg)


def pretrain_device() -> str:
    """Where the base is pretrained: the GPU when there is one (minutes on a CPU, seconds there)."""
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def _pretrain(model, tokenizer, texts: Sequence[str], config: TinyBaseConfig, progress: bool,
              device: str = "cpu") -> list[float]:
    """Next-token pretraining on whole texts; returns the loss curve."""
    import torch

    ids = [
        [tokenizer.bos_token_id] + tokenizer(t, add_special_tokens=False)["input_ids"][: config.max_length - 2]
        + [tokenizer.eos_token_id]
        for t in texts
    ]
    gen = torch.Generator().manual_seed(config.seed)
    opt = torch.optim.AdamW(model.parameters(), lr=config.lr, weight_decay=config.weight_decay, betas=(0.9, 0.95))

    def lr_at(step: int) -> float:
        if step < config.warmup_steps:
            return (step + 1) / config.warmup_steps
        t = (step - config.warmup_steps) / max(1, config.steps - config.warmup_steps)
        return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * t))

    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_at)
    model.train()
    losses: list[float] = []
    order = torch.randperm(len(ids), generator=gen).tolist()
    cursor = 0
    bar = progress_of(config.steps, "pretrain tiny base", "step", enabled=progress)
    for _ in range(config.steps):
        if cursor + config.batch_size > len(order):
            order, cursor = torch.randperm(len(ids), generator=gen).tolist(), 0
        batch = [ids[i] for i in order[cursor : cursor + config.batch_size]]
        cursor += config.batch_size
        width = max(len(b) for b in batch)
        input_ids = torch.full((len(batch), width), tokenizer.pad_token_id)
        labels = torch.full((len(batch), width), -100)
        mask = torch.zeros((len(batch), width), dtype=torch.long)
        for row, seq in enumerate(batch):
            input_ids[row, : len(seq)] = torch.tensor(seq)
            labels[row, : len(seq)] = torch.tensor(seq)
            mask[row, : len(seq)] = 1
        loss = model(input_ids=input_ids.to(device), attention_mask=mask.to(device), labels=labels.to(device)).loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        losses.append(float(loss.detach()))  # one sync per step: the bar shows it anyway
        bar.update(1)
        bar.set_postfix(loss=f"{losses[-1]:.3f}")
    bar.close()
    model.eval()
    return losses


# what a usable base folder holds; the cache checks for these before trusting a folder
BASE_FILES = ("config.json", "model.safetensors", "tokenizer.json", "pretrain.json")


def _is_complete(folder: Path) -> bool:
    return all((folder / name).is_file() for name in BASE_FILES)


def save_model_files(model, folder: Path) -> None:
    """config.json and model.safetensors of ``model``, written by this process whatever its rank.

    ``save_pretrained`` writes nothing on a rank other than 0 once torch.distributed is
    initialized, so a base built on such a rank would lack its weights. Tied tensors (the
    embedding and the output head) are stored once, under the first name, as
    ``save_pretrained`` stores them; loading ties them again.
    """
    from safetensors.torch import save_file

    folder.mkdir(parents=True, exist_ok=True)
    model.config.save_pretrained(folder)
    if getattr(model, "generation_config", None) is not None:
        model.generation_config.save_pretrained(folder)
    tensors, seen = {}, set()
    for name, tensor in model.state_dict().items():
        key = (tensor.untyped_storage().data_ptr(), tensor.storage_offset(), tuple(tensor.shape))
        if key in seen:
            continue
        seen.add(key)
        tensors[name] = tensor.detach().contiguous()
    save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})
    follow_umask(folder / "model.safetensors")  # save_file makes it 0600


def ensure_tiny_base(
    texts: Sequence[str],
    config: TinyBaseConfig | None = None,
    cache_dir: str | os.PathLike | None = None,
    progress: bool = True,
    log=print,
    extra_words: Sequence[str] = (),
    device: str | None = None,
) -> Path:
    """Return the folder of the tiny base pretrained on ``texts``; build it on a cache miss.
    ``extra_words`` join the vocabulary even where the corpus lacks them. ``device``: where to
    pretrain (default: the GPU if there is one); it is part of the cache key.

    The folder is a normal Hugging Face model directory (``config.json``,
    ``model.safetensors``, ``tokenizer.json``) plus ``pretrain.json`` (settings, corpus hash,
    loss curve), so ``from_pretrained`` and PEFT accept it like any local model.
    """
    if not texts:
        raise ConfigError("tiny base: the pretraining corpus is empty")
    config = config or TinyBaseConfig()
    root = Path(cache_dir) if cache_dir else cache_root()
    device = device or pretrain_device()
    key = tiny_base_key(config, texts, extra_words, device)
    final = root / "tiny-base" / key
    if final.is_dir():
        if _is_complete(final):
            log(f"tiny base: cached at {final}")
            return final
        _remove_incomplete(final, key)
        log(f"tiny base: the cached folder {final} was incomplete; building it again")
    make_dir(final.parent)  # a bad --cache-dir: one line naming it
    # one temporary folder per process: builds of the same key in parallel do not collide
    tmp = final.parent / f".{key}.{os.getpid()}.tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    log(f"tiny base: pretraining from scratch on {len(texts)} texts ({config.steps} steps, {device}); cached afterwards")
    start = time.perf_counter()
    losses = _build_tiny_base(tmp, key, texts, config, extra_words, device, progress, start)
    _move_into_place(tmp, final)
    log(f"tiny base: done in {time.perf_counter() - start:.0f}s, loss {losses[0]:.2f} -> {losses[-1]:.2f}")
    return final


def _remove_incomplete(final: Path, key: str) -> None:
    """Delete a cached base folder that lacks some of BASE_FILES."""
    # older versions could leave one behind on a rank other than 0; renaming it first frees
    # the name at once, even if the removal is slow or fails half-way
    aside = final.parent / f".{key}.incomplete.{os.getpid()}"
    os.rename(final, aside)
    shutil.rmtree(aside, ignore_errors=True)


def _build_tiny_base(folder: Path, key: str, texts: Sequence[str], config: TinyBaseConfig,
                     extra_words: Sequence[str], device: str, progress: bool, start: float) -> list[float]:
    """Pretrain the tiny base and write all of BASE_FILES to ``folder``; return the loss curve."""
    import torch

    tokenizer = build_word_tokenizer(build_vocab(texts, extra_words))
    special = {"pad": tokenizer.pad_token_id, "bos": tokenizer.bos_token_id, "eos": tokenizer.eos_token_id}
    # CPU generators only: the initialization and batch order are the same on either device
    with torch.random.fork_rng(devices=[]):
        model = build_tiny_llama(len(tokenizer), config, special).to(device)
        losses = _pretrain(model, tokenizer, texts, config, progress, device)
    model = model.to("cpu")
    save_model_files(model, folder)
    tokenizer.save_pretrained(folder)
    atomic_write_json(
        folder / "pretrain.json",
        {
            "key": key,
            "config": config.to_dict(),
            "corpus_sha256": corpus_digest(texts),
            "num_texts": len(texts),
            "vocab_size": len(tokenizer),
            "parameters": sum(p.numel() for p in model.parameters()),
            "loss_first": losses[0],
            "loss_last": losses[-1],
            "losses": losses,
            "seconds": round(time.perf_counter() - start, 2),
            "device": device,
        },
    )
    return losses


def _move_into_place(tmp: Path, final: Path) -> None:
    """Rename the built folder ``tmp`` to ``final`` if it is complete; otherwise delete it and fail."""
    if not _is_complete(tmp):
        shutil.rmtree(tmp, ignore_errors=True)
        raise RuntimeError(f"tiny base: not every one of {', '.join(BASE_FILES)} was written; nothing was cached")
    try:
        os.rename(tmp, final)
    except OSError:
        # another process finished the same key first: theirs is identical, keep it
        shutil.rmtree(tmp, ignore_errors=True)
        if not _is_complete(final):
            raise


# -- loading for fine-tuning -----------------------------------------------------------------

_DTYPES = {"float32": "float32", "bfloat16": "bfloat16", "float16": "float16"}


def load_base_model(path: str, dtype: str = "float32", attn_implementation: str | None = "sdpa"):
    """The causal LM at ``path``: a local folder, a Hugging Face hub id or a .gguf file
    (``iga_ds.models``; downloaded only for a hub id, never remote code). ``torch_varlen``
    attention is registered with transformers first (``iga_ds.train.attention``)."""
    import torch

    if attn_implementation == VARLEN_ATTENTION:
        register_varlen_attention()

    return load_causal_lm(path, "model.name_or_path", getattr(torch, _DTYPES[dtype]), attn_implementation,
                          error=ConfigError, expected=f"{EXPECTED}, or builtin:tiny")


def allow_cudnn_attention(allowed: bool) -> None:
    """Whether SDPA may pick cuDNN's attention kernel, for this process (a no-op without CUDA).

    cuDNN's attention costs host time at each call, most when the batch width changes from batch
    to batch, as padded isomer batches' does; small steps then wait on the host (docs/PERFORMANCE.md)."""
    import torch

    torch.backends.cuda.enable_cudnn_sdp(allowed)


def require_liger_kernel() -> None:
    """Raise a ConfigError unless liger-kernel can run here: the package and a CUDA device."""
    import importlib.util

    import torch

    if importlib.util.find_spec("liger_kernel") is None:
        raise ConfigError("model.liger_kernel: the liger-kernel package is not installed "
                          "(pip install 'iga-ds[liger]')")
    if not torch.cuda.is_available():
        raise ConfigError("model.liger_kernel: needs a CUDA device (liger-kernel's kernels are Triton GPU kernels)")


def apply_liger_kernel(model) -> None:
    """Swap ``model``'s RMSNorm, rotary embedding and SwiGLU for liger-kernel's fused Triton kernels
    (Hsu et al., 2024, "Liger Kernel: Efficient Triton Kernels for LLM Training"), in place.

    Fewer kernel launches and fewer passes over the activations; the logits and the loss stay ours
    (no fused cross-entropy: the per-domain loss needs per-token values). The rotary embedding is a
    function of the model's module, so the swap holds for every model of that type in the process."""
    require_liger_kernel()
    from liger_kernel.transformers import _apply_liger_kernel_to_instance
    from liger_kernel.transformers.monkey_patch import MODEL_TYPE_TO_APPLY_LIGER_FN

    model_type = getattr(model.config, "model_type", None)
    if model_type not in MODEL_TYPE_TO_APPLY_LIGER_FN:  # liger-kernel itself would only log it
        raise ConfigError(f"model.liger_kernel: liger-kernel has no kernels for model type {model_type!r}; "
                          f"it has {sorted(MODEL_TYPE_TO_APPLY_LIGER_FN)}")
    # it passes on the switches the model type's patch takes
    _apply_liger_kernel_to_instance(model, rope=True, rms_norm=True, swiglu=True, cross_entropy=False,
                                    fused_linear_cross_entropy=False)


def load_tokenizer(path: str):
    """The tokenizer at ``path`` (a local folder, a hub id or a .gguf file), with a pad token."""
    tok = load_auto_tokenizer(path, "tokenizer", error=ConfigError)
    if tok.pad_token_id is None:
        tok.pad_token = tok.eos_token  # causal LMs often ship without one; padding is masked anyway
    return tok


def add_lora(model, r: int, alpha: float, dropout: float, target_modules: list[str], rslora: bool = False):
    """Wrap ``model`` with PEFT LoRA adapters (Hu et al., 2021) on ``target_modules``."""
    from peft import LoraConfig, get_peft_model

    names = {name.rsplit(".", 1)[-1] for name, _ in model.named_modules()}
    missing = [t for t in target_modules if t not in names]
    if missing:
        raise ConfigError(
            f"lora.target_modules: {missing} not found in the model; it has e.g. "
            f"{sorted(n for n in names if n.endswith('proj'))[:8]}"
        )
    cfg = LoraConfig(
        r=r,
        lora_alpha=alpha,
        lora_dropout=dropout,
        target_modules=list(target_modules),
        use_rslora=rslora,
        bias="none",
        task_type="CAUSAL_LM",
    )
    return get_peft_model(model, cfg)


def build_lora_model(cfg, base_dir: str, note=print):
    """The LoRA model a run trains (``cfg`` a RunConfig): the base in ``model.dtype`` with its
    attention, liger-kernel and activation checkpointing where asked, PEFT LoRA of the ``lora:``
    block (its initial A drawn from the random state as it stands), fused LoRA layers where
    ``model.fused_lora``. ``note`` gets what padding-free rows cost with this attention."""
    model = load_base_model(base_dir, cfg.model.dtype, cfg.model.attn_implementation)
    if cfg.model.liger_kernel:
        apply_liger_kernel(model)
    if cfg.data.padding_free and (message := check_padding_free(model)):
        note(message)
    if cfg.model.gradient_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        model.enable_input_require_grads()
    model = add_lora(model, cfg.lora.r, cfg.lora.alpha, cfg.lora.dropout, cfg.lora.target_modules, cfg.lora.rslora)
    if cfg.model.fused_lora:
        fuse_lora_layers(find_lora_modules(model))
    return model


def seed_everything(seed: int) -> None:
    """Python's, numpy's and torch's random state, as a run sets it before its tokenizer, its
    token rows and its model (the LoRA initialisation draws from it)."""
    import numpy as np
    import random
    import torch

    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
