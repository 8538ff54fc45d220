"""Loading a causal LM (plus an optional PEFT adapter) and batched greedy generation.

The base is a local folder, a Hugging Face hub id or a .gguf file (``iga_ds.models``): only a
hub id is downloaded (or read from the Hugging Face cache offline), and no remote code runs.
Prompts are left-padded so every continuation starts right after its prompt; a batch is formed
from prompts of similar length to waste little compute on padding. Prompts are written as
training wrote them (:func:`eval_prompt_format`: the format the adapter records).
"""
from __future__ import annotations

import re
from pathlib import Path
from typing import Any, Callable, Sequence

from iga_ds.data.prompts import AUTO, PromptFormat, prompt_format, prompt_token_ids, saved_prompt_format
from iga_ds.errors import UserError
from iga_ds.models import TOKENIZER_FILES, check_model_source, load_auto_tokenizer, load_causal_lm
from iga_ds.progress import progress as progress_of

# a complete "Answer: ..." line (it ends in a newline): generation can stop there
_ANSWER_DONE = re.compile(r"(?:^|\n)[\s*#>]*(?:final\s+)?answer\s*[:：][^\n]*\S[^\n]*\n", re.IGNORECASE)


def _pick_dtype(dtype: str, device: str):
    import torch

    if dtype == "auto":
        if device.startswith("cuda") and torch.cuda.is_bf16_supported():
            return torch.bfloat16
        return torch.float32
    try:
        return {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[dtype]
    except KeyError:
        raise UserError(f"--dtype: expected auto, float32, bfloat16 or float16, got {dtype!r}") from None


def resolve_device(device: str = "auto") -> str:
    import torch

    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    return device


def load_model(
    base: str | Path,
    adapter: str | Path | None = None,
    tokenizer_dir: str | Path | None = None,
    dtype: str = "auto",
    device: str = "auto",
) -> tuple[Any, Any]:
    """(model in eval mode, tokenizer). ``base`` and ``tokenizer_dir``: a local folder, a Hugging
    Face hub id or a .gguf file (``iga_ds.models``); the adapter, a local PEFT folder, is merged
    for speed."""
    check_model_source(base, "--base")  # a misspelled or absent base fails before anything loads
    if adapter is not None and not (Path(adapter) / "adapter_config.json").is_file():
        raise UserError(f"--adapter: {adapter} is not a PEFT adapter directory (no adapter_config.json)")
    device = resolve_device(device)
    model = load_causal_lm(base, "--base", _pick_dtype(dtype, device))
    if adapter is not None:
        from peft import PeftModel

        model = PeftModel.from_pretrained(model, str(adapter), is_trainable=False)
        model = model.merge_and_unload()  # same outputs, no per-layer adapter overhead
    model.to(device).eval()
    what = "--tokenizer"
    if tokenizer_dir is None:
        # an adapter saved with its tokenizer (added tokens) takes precedence over the base's
        has_own = adapter is not None and any((Path(adapter) / f).is_file() for f in TOKENIZER_FILES)
        tokenizer_dir, what = (adapter, "--adapter") if has_own else (base, "--base")
    tokenizer = load_auto_tokenizer(tokenizer_dir, what)
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    return model, tokenizer


def eval_prompt_format(tokenizer: Any, adapter: str | Path | None = None, wanted: str | None = None) -> PromptFormat:
    """The prompt format of an evaluation: ``wanted`` (``--prompt-format``), else the one the
    adapter was trained with, else ``auto`` (the chat template when the tokenizer has one)."""
    if wanted:
        return prompt_format(tokenizer, wanted, "--prompt-format", UserError)
    saved = saved_prompt_format(adapter)
    what = f"{adapter}: the adapter's prompt format" if saved else "prompt format"
    return prompt_format(tokenizer, saved or AUTO, what, UserError)


class _StopAfterAnswer:
    """Stopping criterion: a sequence is done once its continuation holds a full Answer line."""

    def __init__(self, tokenizer: Any, prompt_len: int):
        self.tokenizer = tokenizer
        self.prompt_len = prompt_len

    def __call__(self, input_ids, scores, **kwargs):
        import torch

        texts = self.tokenizer.batch_decode(input_ids[:, self.prompt_len:], skip_special_tokens=True)
        return torch.tensor([bool(_ANSWER_DONE.search(t)) for t in texts], device=input_ids.device)


def generate(
    model: Any,
    tokenizer: Any,
    prompts: Sequence[str],
    max_new_tokens: int = 512,
    batch_size: int = 8,
    stop_after_answer: bool = True,
    progress: bool = True,
    on_batch: Callable[[list[int], list[str]], None] | None = None,
    add_special_tokens: bool = True,
) -> list[str]:
    """Greedy continuations of ``prompts`` (same order).

    ``on_batch(indices, texts)`` is called after each batch so a caller can save progress.
    With ``stop_after_answer`` a sequence stops after its first complete ``Answer:`` line.
    ``add_special_tokens``: False for chat-template text, which carries its own
    (:attr:`iga_ds.data.prompts.PromptFormat.add_special_tokens`); True puts the tokenizer's BOS
    first, as training did (:func:`iga_ds.data.prompts.prompt_token_ids`).
    """
    import torch
    from transformers import StoppingCriteriaList

    device = next(model.parameters()).device
    padding_side, tokenizer.padding_side = tokenizer.padding_side, "left"
    # the prompt's ids exactly as training's rows begin (the same leading BOS, or none)
    encoded = [prompt_token_ids(tokenizer, p, add_special_tokens) for p in prompts]
    lengths = [len(ids) for ids in encoded]
    order = sorted(range(len(prompts)), key=lambda i: -lengths[i])
    outputs: list[str | None] = [None] * len(prompts)
    try:
        bar = progress_of(len(prompts), "generating", "prompt", enabled=progress)
        for start in range(0, len(order), batch_size):
            idx = order[start:start + batch_size]
            batch = tokenizer.pad({"input_ids": [encoded[i] for i in idx]}, padding=True, return_tensors="pt")
            batch = {k: v.to(device) for k, v in batch.items() if k in ("input_ids", "attention_mask")}
            prompt_len = batch["input_ids"].shape[1]
            stops = StoppingCriteriaList([_StopAfterAnswer(tokenizer, prompt_len)]) if stop_after_answer else None
            with torch.no_grad():
                out = model.generate(
                    **batch,
                    max_new_tokens=max_new_tokens,
                    do_sample=False,
                    num_beams=1,
                    pad_token_id=tokenizer.pad_token_id,
                    stopping_criteria=stops,
                )
            texts = tokenizer.batch_decode(out[:, prompt_len:], skip_special_tokens=True)
            for i, text in zip(idx, texts):
                outputs[i] = text
            if on_batch is not None:
                on_batch(idx, texts)
            bar.update(len(idx))
        bar.close()
    finally:
        tokenizer.padding_side = padding_side
    return [o or "" for o in outputs]
