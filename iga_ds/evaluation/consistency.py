"""The Logical Consistency Score of a model: hidden states of isomer groups, then
:func:`iga_ds.metrics.consistency.lcs` at each layer asked for."""
from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable, Mapping, Sequence

from iga_ds.data.groups import isomer_groups
from iga_ds.data.prompts import PromptFormat, format_prompt, prompt_token_ids
from iga_ds.metrics.consistency import lcs, lcs_paper_units
from iga_ds.progress import progress as progress_of

if TYPE_CHECKING:  # torch is imported when a model runs
    import torch


def _resolve_layers(layers: Sequence[int] | None, num_hidden_states: int) -> list[int]:
    """Layer indices into ``hidden_states`` (0 = embeddings, L = last layer); negatives count back.

    The default is the penultimate layer, ``hidden_states[L - 1]`` (layer 31 of a 32-layer model,
    as in the paper's Table 6).
    """
    if layers is None:
        layers = [-2]
    resolved = []
    for layer in layers:
        idx = layer + num_hidden_states if layer < 0 else layer
        if not 0 <= idx < num_hidden_states:
            raise ValueError(
                f"layer {layer} out of range: the model has hidden states 0..{num_hidden_states - 1} "
                "(0 = embeddings)"
            )
        resolved.append(idx)
    return resolved


def token_averaged_hidden_states(
    model: Any,
    tokenizer: Any,
    texts: Sequence[str],
    layers: Sequence[int] | None = None,
    batch_size: int = 8,
    max_length: int | None = None,
    progress: bool = False,
    add_special_tokens: bool = True,
) -> dict[int, "torch.Tensor"]:
    """``{layer: len(texts) x H}`` float64 means of hidden states over non-padding tokens
    (``add_special_tokens``: False for chat-template text, which carries its own)."""
    import torch

    device = next(model.parameters()).device
    was_training = model.training
    model.eval()
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    # Right padding keeps every real token at the position it has unpadded (causal attention
    # never looks right), so a text's hidden states do not depend on its batch neighbours.
    padding_side, tokenizer.padding_side = tokenizer.padding_side, "right"
    out: dict[int, list[torch.Tensor]] = {}
    resolved: list[int] | None = None
    keep = _one_logit(model)
    try:
        with torch.no_grad(), progress_of(len(texts), "hidden states", "text", enabled=progress) as bar:
            for start in range(0, len(texts), batch_size):
                ids = [prompt_token_ids(tokenizer, text, add_special_tokens)[:max_length]
                       for text in texts[start:start + batch_size]]  # as training's rows begin
                batch = tokenizer.pad({"input_ids": ids}, padding=True, return_tensors="pt")
                batch = {k: v.to(device) for k, v in batch.items() if k in ("input_ids", "attention_mask")}
                hidden = model(**batch, output_hidden_states=True, **keep).hidden_states
                if resolved is None:
                    resolved = _resolve_layers(layers, len(hidden))
                mask = batch["attention_mask"].to(torch.float64).unsqueeze(-1)
                for idx in resolved:
                    h = hidden[idx].to(torch.float64)
                    mean = (h * mask).sum(dim=1) / mask.sum(dim=1).clamp_min(1.0)
                    out.setdefault(idx, []).append(mean.cpu())
                bar.update(len(ids))
    finally:
        model.train(was_training)
        tokenizer.padding_side = padding_side
    return {idx: torch.cat(chunks) for idx, chunks in out.items()}


def _one_logit(model: Any) -> dict[str, int]:
    """Ask a causal LM for the last position's logits only: the hidden states are what is read,
    and a batch's logits over the whole vocabulary are the largest tensor of the forward."""
    import inspect

    inner = model.get_base_model() if hasattr(model, "get_base_model") else model
    return {"logits_to_keep": 1} if "logits_to_keep" in inspect.signature(inner.forward).parameters else {}


def lcs_of_model(
    model: Any,
    tokenizer: Any,
    groups: Sequence[Sequence[Mapping[str, Any]]] | Sequence[Mapping[str, Any]],
    layers: Sequence[int] | None = None,
    text_fn: Callable[[Mapping[str, Any]], str] | None = None,
    batch_size: int = 8,
    max_length: int | None = None,
    progress: bool = False,
    add_special_tokens: bool = True,
) -> dict[int, float]:
    """LCS of a model on isomer groups at each layer: ``{layer index: LCS}`` (raw, not x1e-2).

    ``groups`` is a list of groups (each the N domain instances of one problem, same domain
    order in every group) or a flat list of isomer records, grouped here by ``group_id``.
    Each instance is rendered by ``text_fn`` (default: the plain evaluation prompt, so LCS sees
    what the model sees at test time; an instruction model's is its prompt format's ``prompt``,
    tokenized with its ``add_special_tokens``) and its hidden states are averaged over
    non-padding tokens.
    """
    if groups and isinstance(groups[0], Mapping):
        groups, _ = isomer_groups(groups)  # type: ignore[arg-type]
    if not groups:
        raise ValueError("lcs_of_model needs at least one complete isomer group")
    n = len(groups[0])
    if any(len(g) != n for g in groups):
        raise ValueError("every isomer group must hold the same number of domain instances")
    if text_fn is None:
        text_fn = format_prompt
    texts = [text_fn(rec) for group in groups for rec in group]
    states = token_averaged_hidden_states(
        model, tokenizer, texts, layers=layers, batch_size=batch_size, max_length=max_length, progress=progress,
        add_special_tokens=add_special_tokens,
    )
    return {idx: lcs(h.reshape(len(groups), n, -1)) for idx, h in states.items()}


def lcs_block(model: Any, tokenizer: Any, records: list[dict], layers: list[int] | None, max_groups: int,
              batch_size: int, progress: bool, prompt_format: PromptFormat | None = None) -> dict[str, Any] | None:
    """The ``lcs`` entry of eval.json: LCS at ``layers`` (default penultimate) over the first
    ``max_groups`` complete isomer groups of ``records``, each read as ``prompt_format`` writes
    its prompt (default plain); None without two domains."""
    groups, domains = isomer_groups(records)
    groups = groups[:max_groups]
    if not groups or len(domains) < 2:
        return None
    special = prompt_format.add_special_tokens if prompt_format else True
    values = lcs_of_model(model, tokenizer, groups, layers=layers, batch_size=batch_size, progress=progress,
                          text_fn=prompt_format.prompt if prompt_format else None, add_special_tokens=special)
    num_layers = getattr(model.config, "num_hidden_layers", None)
    return {
        "groups": len(groups),
        "domains": domains,
        "num_layers": num_layers,
        "default_layer": num_layers - 1 if num_layers else None,
        "layers": {str(k): v for k, v in sorted(values.items())},
        "layers_x1e-2": {str(k): lcs_paper_units(v) for k, v in sorted(values.items())},
    }
