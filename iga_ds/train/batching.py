"""Isomer-group batching: whole groups per step, sharded over ranks by a deterministic sampler.

Every optimizer step holds ``K = groups_per_step`` isomer groups with all N domains (so each
domain is present in every step, as the per-domain gradients of IGA need). The order of
groups is a permutation seeded by (seed, epoch), so the batch of global step ``s`` does not
depend on the world size: rank ``r`` of ``W`` takes the ``r``-th slice of the step's groups.
The loss is token-level cross-entropy on the target (chain of thought and answer); prompt and
padding tokens are masked.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

from iga_ds.data.prompts import format_prompt, format_target
from iga_ds.data.schema import read_isomer_jsonl
from iga_ds.errors import ConfigError, DataError

IGNORE_INDEX = -100


# -- records ---------------------------------------------------------------------------------


def read_records(path: str | Path) -> list[dict[str, Any]]:
    """Isomer JSON Lines, every record and group checked (:func:`iga_ds.data.schema.read_isomer_jsonl`)."""
    path = Path(path)
    if not path.is_file():
        raise DataError(f"{path}: data file not found (data.train)")
    return read_isomer_jsonl(path)


def format_example(record: dict[str, Any]) -> tuple[str, str]:
    """(prompt, target): the prompt evaluation decodes from, and the target after it."""
    return format_prompt(record), format_target(record)


# -- sampler ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class GroupSampler:
    """Which groups each rank sees at each global step; stateless apart from the step index."""

    num_groups: int
    groups_per_step: int
    seed: int

    def __post_init__(self):
        if self.num_groups < self.groups_per_step:
            raise ConfigError(
                f"data.groups_per_step: {self.groups_per_step} groups per step but the data has only "
                f"{self.num_groups} complete groups"
            )

    @property
    def steps_per_epoch(self) -> int:
        return self.num_groups // self.groups_per_step  # the incomplete last batch is dropped

    def epoch_order(self, epoch: int) -> list[int]:
        import torch

        gen = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch)
        return torch.randperm(self.num_groups, generator=gen).tolist()

    def step_groups(self, step: int) -> list[int]:
        epoch, within = divmod(step, self.steps_per_epoch)
        order = self.epoch_order(epoch)
        return order[within * self.groups_per_step : (within + 1) * self.groups_per_step]

    def rank_groups(self, step: int, rank: int, world_size: int) -> list[int]:
        groups = self.step_groups(step)
        per_rank = len(groups) // world_size
        return groups[rank * per_rank : (rank + 1) * per_rank]


def check_batch_layout(groups_per_step: int, groups_per_micro_batch: int, world_size: int) -> int:
    """Gradient accumulation steps that make K groups per step over ``world_size`` ranks."""
    per_rank, rem = divmod(groups_per_step, world_size)
    if rem or per_rank == 0:
        raise ConfigError(
            f"data.groups_per_step: expected a multiple of the world size {world_size}, got {groups_per_step}"
        )
    accum, rem = divmod(per_rank, groups_per_micro_batch)
    if rem or accum == 0:
        raise ConfigError(
            f"data.groups_per_micro_batch: expected a divisor of groups_per_step / world size = {per_rank}, "
            f"got {groups_per_micro_batch}"
        )
    return accum


# -- tensors ---------------------------------------------------------------------------------


@dataclass
class MicroBatch:
    input_ids: Any  # (B, T) long
    attention_mask: Any  # (B, T) long
    labels: Any  # (B, T) long, IGNORE_INDEX on prompt and padding
    domain_ids: Any  # (B,) long, index into the domain list
    num_target_tokens: int
    num_tokens: int

    def to(self, device) -> "MicroBatch":
        return MicroBatch(
            self.input_ids.to(device),
            self.attention_mask.to(device),
            self.labels.to(device),
            self.domain_ids.to(device),
            self.num_target_tokens,
            self.num_tokens,
        )


def unknown_words(tokenizer, records: Sequence[dict[str, Any]], limit: int = 2000) -> tuple[float, list[str]]:
    """(fraction of [UNK] tokens, up to 5 example words) over the first ``limit`` records' text.
    A word the tokenizer maps to [UNK] is invisible to the model, e.g. a planted cue."""
    unk = tokenizer.unk_token_id
    if unk is None:
        return 0.0, []
    total = unknown = 0
    examples: list[str] = []
    for rec in records[:limit]:
        prompt, target = format_example(rec)
        enc = tokenizer(prompt + target, add_special_tokens=False, return_offsets_mapping=True)
        total += len(enc["input_ids"])
        for tok_id, (a, b) in zip(enc["input_ids"], enc["offset_mapping"]):
            if tok_id == unk:
                unknown += 1
                word = (prompt + target)[a:b].strip()
                if word and word not in examples and len(examples) < 5:
                    examples.append(word)
    return (unknown / total if total else 0.0), examples


def encode_example(tokenizer, prompt: str, target: str, max_length: int) -> tuple[list[int], list[int]]:
    """Token ids and labels for one instance: [bos] prompt target [eos], prompt labels masked.
    Too long: the prompt loses tokens from its start, then the target from its end."""
    p = tokenizer(prompt, add_special_tokens=False)["input_ids"]
    t = tokenizer(target, add_special_tokens=False)["input_ids"]
    bos = [tokenizer.bos_token_id] if tokenizer.bos_token_id is not None else []
    eos = [tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else []
    t = t + eos
    room = max_length - len(bos)
    if len(t) > room - 1:
        t = t[: room - 1]  # keep at least one prompt token so the first target has a context
    p = p[-(room - len(t)) :] if len(p) > room - len(t) else p
    ids = bos + p + t
    labels = [IGNORE_INDEX] * (len(bos) + len(p)) + t
    return ids, labels


def collate(tokenizer, groups: Sequence[Sequence[dict]], domains: Sequence[str], max_length: int) -> MicroBatch:
    import torch

    rows, dom = [], []
    index = {d: i for i, d in enumerate(domains)}
    for group in groups:
        for rec in group:
            prompt, target = format_example(rec)
            rows.append(encode_example(tokenizer, prompt, target, max_length))
            dom.append(index[rec["domain"]])
    width = max(len(ids) for ids, _ in rows)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    input_ids = torch.full((len(rows), width), pad, dtype=torch.long)
    labels = torch.full((len(rows), width), IGNORE_INDEX, dtype=torch.long)
    mask = torch.zeros((len(rows), width), dtype=torch.long)
    for i, (ids, lab) in enumerate(rows):
        input_ids[i, : len(ids)] = torch.tensor(ids)
        labels[i, : len(lab)] = torch.tensor(lab)
        mask[i, : len(ids)] = 1
    return MicroBatch(
        input_ids,
        mask,
        labels,
        torch.tensor(dom, dtype=torch.long),
        int((labels != IGNORE_INDEX).sum()),
        int(mask.sum()),
    )


def sequence_losses(logits, labels):
    """Each sequence's mean token cross-entropy over its target tokens, shape (B,), float32.

    Position t predicts token t+1, so logits drop the last position and labels the first."""
    import torch.nn.functional as F

    shift_logits = logits[:, :-1, :].float()
    shift_labels = labels[:, 1:]
    tok = F.cross_entropy(
        shift_logits.reshape(-1, shift_logits.size(-1)),
        shift_labels.reshape(-1),
        ignore_index=IGNORE_INDEX,
        reduction="none",
    ).view(shift_labels.shape)
    counts = (shift_labels != IGNORE_INDEX).sum(dim=1)
    return tok.sum(dim=1) / counts.clamp(min=1).to(tok.dtype)
