"""Isomer-group batching: whole groups per step, sharded over ranks by a deterministic sampler.

Every optimizer step holds ``K = groups_per_step`` isomer groups with all N domains (so each
domain is present in every step, as the per-domain gradients of IGA need). The order of
groups is a permutation seeded by (seed, epoch), so the batch of global step ``s`` does not
depend on the world size: rank ``r`` of ``W`` takes the ``r``-th slice of the step's groups.
The loss is token-level cross-entropy on the target (chain of thought and answer); prompt and
padding tokens are masked. How a record becomes prompt and target text is
:class:`iga_ds.data.prompts.PromptFormat`'s, which evaluation shares: plain text for a base
model, the tokenizer's chat template for an instruction model (the target then being the
assistant turn alone).

Tokenization runs once per training set, not per step: :func:`tokenize_groups` maps
:func:`encode_example` over every instance with ``datasets.Dataset.map`` and keeps the result in
a folder of the ``datasets`` cache named by a key of everything the token ids depend on (the
prompt and target texts, whether special tokens are added, the tokenizer's full definition,
``max_length``, the encoder's code and the library versions), so that a cached result can only be the one a fresh tokenization would
give. Each step then pads pre-tokenized rows (:meth:`TokenizedGroups.micro_batch`), or with
``data.padding_free`` lays them back to back in one row (:func:`pack_rows`)."""
from __future__ import annotations

import hashlib
import importlib.metadata
import inspect
import json
import marshal
import os
import shutil
import socket
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

from iga_ds.config.run import VARLEN_ATTENTION
from iga_ds.data.prompts import PLAIN, PromptFormat, leading_ids
from iga_ds.data.schema import read_isomer_jsonl
from iga_ds.errors import ConfigError
from iga_ds.files import make_dir

IGNORE_INDEX = -100
PLAIN_FORMAT = PromptFormat(PLAIN)  # the format of a tokenizer without a chat template


# -- records ---------------------------------------------------------------------------------


def read_records(path: str | Path) -> list[dict[str, Any]]:
    """An isomer set (JSON Lines, Parquet, Arrow, a saved dataset folder or a hub id), every
    record and group checked (:func:`iga_ds.data.schema.read_isomer_jsonl`)."""
    return read_isomer_jsonl(path, missing="data file not found (data.train)")


def format_example(record: dict[str, Any], prompt_format: PromptFormat | None = None) -> tuple[str, str]:
    """(prompt, target): the prompt evaluation decodes from, and the target after it (plain
    text unless ``prompt_format`` says otherwise)."""
    return (prompt_format or PLAIN_FORMAT).example(record)


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

    def rank_halves(self, rank: int, world_size: int) -> list[int]:
        """The half of the step's groups each of :meth:`rank_groups` is in: 0 at an even place of the
        step's (randomly ordered) groups, 1 at an odd one, so that an even K gives equal halves."""
        per_rank = self.groups_per_step // world_size
        return [(rank * per_rank + i) % 2 for i in range(per_rank)]


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
    halves: Any = None  # (B,) long on the host: each sequence's half of the step's groups, where asked for

    sequence_lengths = None  # padded: the capture reads each sequence from its own row

    def to(self, device) -> "MicroBatch":
        return MicroBatch(
            self.input_ids.to(device),
            self.attention_mask.to(device),
            self.labels.to(device),
            self.domain_ids.to(device),
            self.num_target_tokens,
            self.num_tokens,
            self.halves,
        )

    def model_inputs(self) -> dict[str, Any]:
        # no cache: training never reads one, and building it costs host time every layer
        return {"input_ids": self.input_ids, "attention_mask": self.attention_mask, "use_cache": False}

    def sequence_losses(self, logits):
        return sequence_losses(logits, self.labels)


@dataclass
class PackedMicroBatch:
    """A padding-free micro-batch: its sequences back to back in one row, as Hugging Face's
    ``DataCollatorWithFlattening`` lays them out. Position ids restart at 0 with each sequence
    and there is no attention mask, from which transformers keeps attention within each
    sequence; each sequence's first label is ignored, so no loss crosses a boundary. The
    cumulative lengths go to the model too, as varlen attention kernels take them."""

    input_ids: Any  # (1, T) long, T the micro-batch's tokens
    position_ids: Any  # (1, T) long, 0, 1, ... within each sequence
    labels: Any  # (1, T) long, IGNORE_INDEX on prompts and each sequence's first token
    domain_ids: Any  # (B,) long, index into the domain list
    sequence_lengths: Any  # (B,) long on the host: each sequence's tokens, in row order
    token_index: Any  # (B, W) long: row positions of each sequence's tokens, T past its end
    num_target_tokens: int
    num_tokens: int
    cu_seq_lens: Any  # (B + 1,) int32: 0 and the running sum of the sequence lengths
    halves: Any = None  # (B,) long on the host: each sequence's half of the step's groups, where asked for

    def to(self, device) -> "PackedMicroBatch":
        # the lengths (and halves) stay on the host: the capture slices the row by them
        return PackedMicroBatch(self.input_ids.to(device), self.position_ids.to(device), self.labels.to(device),
                                self.domain_ids.to(device), self.sequence_lengths, self.token_index.to(device),
                                self.num_target_tokens, self.num_tokens, self.cu_seq_lens.to(device), self.halves)

    def model_inputs(self) -> dict[str, Any]:
        # no cache: transformers looks for packed sequences only without one (and without a mask);
        # the longest length is a host int, so that no layer waits on the device for it
        longest = int(self.sequence_lengths.max())
        return {"input_ids": self.input_ids, "position_ids": self.position_ids, "use_cache": False,
                "cu_seq_lens_q": self.cu_seq_lens, "cu_seq_lens_k": self.cu_seq_lens,
                "max_length_q": longest, "max_length_k": longest}

    def sequence_losses(self, logits):
        return packed_sequence_losses(logits, self.labels, self.token_index)


def unknown_words(tokenizer, records: Sequence[dict[str, Any]], limit: int = 2000,
                  prompt_format: PromptFormat | None = None) -> tuple[float, list[str]]:
    """(fraction of [UNK] tokens, up to 5 example words) over the first ``limit`` records' text.
    A word the tokenizer maps to [UNK] is invisible to the model, e.g. a planted cue."""
    unk = tokenizer.unk_token_id
    if unk is None:
        return 0.0, []
    total = unknown = 0
    examples: list[str] = []
    for rec in records[:limit]:
        prompt, target = format_example(rec, prompt_format)
        enc = tokenizer(prompt + target, add_special_tokens=False, return_offsets_mapping=True)
        total += len(enc["input_ids"])
        for tok_id, (a, b) in zip(enc["input_ids"], enc["offset_mapping"]):
            if tok_id == unk:
                unknown += 1
                word = (prompt + target)[a:b].strip()
                if word and word not in examples and len(examples) < 5:
                    examples.append(word)
    return (unknown / total if total else 0.0), examples


def encode_example(tokenizer, prompt: str, target: str, max_length: int,
                   add_special_tokens: bool = True) -> tuple[list[int], list[int]]:
    """Token ids and labels for one instance: [bos] prompt target [eos], prompt labels masked
    (without ``add_special_tokens``, chat text that carries its own: prompt target). Too long:
    the prompt loses tokens from its start, then the target from its end."""
    p = tokenizer(prompt, add_special_tokens=False)["input_ids"]
    t = tokenizer(target, add_special_tokens=False)["input_ids"]
    bos = leading_ids(tokenizer, add_special_tokens)  # what evaluation's prompts start with too
    eos = [tokenizer.eos_token_id] if add_special_tokens and tokenizer.eos_token_id is not None else []
    t = t + eos
    room = max_length - len(bos)
    if len(t) > room - 1:
        t = t[: room - 1]  # keep at least one prompt token so the first target has a context
    p = p[-(room - len(t)) :] if len(p) > room - len(t) else p
    ids = bos + p + t
    labels = [IGNORE_INDEX] * (len(bos) + len(p)) + t
    return ids, labels


def collate(tokenizer, groups: Sequence[Sequence[dict]], domains: Sequence[str], max_length: int,
            prompt_format: PromptFormat | None = None) -> MicroBatch:
    """Records of whole groups encoded (:func:`encode_example`) and padded into one micro-batch:
    what :meth:`TokenizedGroups.micro_batch` gives from the pre-tokenized rows."""
    fmt = prompt_format or PLAIN_FORMAT
    rows, dom = [], []
    index = {d: i for i, d in enumerate(domains)}
    for group in groups:
        for rec in group:
            prompt, target = fmt.example(rec)
            rows.append(encode_example(tokenizer, prompt, target, max_length, fmt.add_special_tokens))
            dom.append(index[rec["domain"]])
    return pad_rows(rows, dom, pad_id(tokenizer))


def pack_rows(rows: Sequence[tuple[Sequence[int], Sequence[int]]], domain_ids: Sequence[int]) -> PackedMicroBatch:
    """(token ids, labels) rows back to back in one row, without padding: a padding-free
    micro-batch whose per-sequence losses are those of :func:`pad_rows`' batch."""
    import torch

    lengths = [len(ids) for ids, _ in rows]
    total, width = sum(lengths), max(lengths)
    labels = torch.tensor([lab for _, row in rows for lab in row], dtype=torch.long)
    # counted before the first labels are masked, as the padded batch counts them
    num_target_tokens = int((labels != IGNORE_INDEX).sum())
    starts = torch.tensor([0, *lengths[:-1]], dtype=torch.long).cumsum(0)
    labels[starts] = IGNORE_INDEX  # else predicted from the previous sequence's last token
    steps = torch.arange(width)
    token_index = torch.where(steps < torch.tensor(lengths).unsqueeze(1), starts.unsqueeze(1) + steps, total)
    return PackedMicroBatch(
        torch.tensor([t for ids, _ in rows for t in ids], dtype=torch.long).unsqueeze(0),
        torch.cat([torch.arange(n) for n in lengths]).unsqueeze(0),
        labels.unsqueeze(0),
        torch.tensor(domain_ids, dtype=torch.long),
        torch.tensor(lengths, dtype=torch.long),
        token_index,
        num_target_tokens,
        total,
        torch.tensor([0, *lengths]).cumsum(0).to(torch.int32),
    )


# the attention implementations that keep within each packed sequence: eager, sdpa and flex through
# the mask transformers builds from position ids, flash attention and torch_varlen through varlen kernels
PACKED_ATTENTION = ("eager", "sdpa", "flex_attention", "flash_attention_2", "flash_attention_3", "flash_attention_4",
                    VARLEN_ATTENTION)


# these mask a packed row's full T x T scores: with B sequences about B times a padded batch's attention work
DENSE_PACKED_ATTENTION = ("eager", "sdpa")


def check_padding_free(model) -> str | None:
    """A ConfigError unless ``model``'s attention keeps packed sequences apart; a note for the
    user when it does so by masking the whole row (correct, but attention costs more than padding)."""
    implementation = getattr(model.config, "_attn_implementation", None)
    if implementation not in PACKED_ATTENTION:
        raise ConfigError(f"data.padding_free: attention implementation {implementation!r} would attend across "
                          f"packed sequences; set model.attn_implementation to one of {', '.join(PACKED_ATTENTION)}, "
                          "or data.padding_free: false")
    if implementation in DENSE_PACKED_ATTENTION:
        return (f"note: data.padding_free with {implementation} attention scores the whole packed row and masks "
                "across sequences, more attention work than padded rows; torch_varlen and flash_attention_2 (varlen "
                "kernels) or flex_attention skip it")
    return None


def pad_id(tokenizer) -> int:
    return tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0


def pad_rows(rows: Sequence[tuple[Sequence[int], Sequence[int]]], domain_ids: Sequence[int], pad: int) -> MicroBatch:
    """(token ids, labels) rows padded on the right to the longest: a micro-batch."""
    import torch

    width = max(len(ids) for ids, _ in rows)
    input_ids = torch.full((len(rows), width), pad, dtype=torch.long)
    labels = torch.full((len(rows), width), IGNORE_INDEX, dtype=torch.long)
    mask = torch.zeros((len(rows), width), dtype=torch.long)
    for i, (ids, lab) in enumerate(rows):
        input_ids[i, : len(ids)] = torch.tensor(ids, dtype=torch.long)
        labels[i, : len(lab)] = torch.tensor(lab, dtype=torch.long)
        mask[i, : len(ids)] = 1
    return MicroBatch(
        input_ids,
        mask,
        labels,
        torch.tensor(domain_ids, dtype=torch.long),
        int((labels != IGNORE_INDEX).sum()),
        int(mask.sum()),
    )


# -- tokenization, once per training set -----------------------------------------------------

TOKENIZED_FORMAT = 2  # bump when the rows' layout or what the key covers changes
TOKENIZED_FOLDER = "iga_ds-tokenized"  # under the datasets cache


def _code_digest(fn) -> str:
    try:
        code = inspect.getsource(fn).encode("utf-8")
    except (OSError, TypeError):  # no source installed: the compiled code
        code = marshal.dumps(fn.__code__)
    return hashlib.sha256(code).hexdigest()


def tokenizer_digest(tokenizer) -> str:
    """A hash of everything that decides what ``tokenizer`` turns a text into: its class, special
    token ids, simple settings and, for a fast tokenizer, the backend's whole definition (vocabulary,
    normalizer, pre-tokenizer, added tokens; without the truncation and padding a call may leave
    set), else every file ``save_pretrained`` writes."""
    h = hashlib.sha256()
    settings = {k: v for k, v in sorted(getattr(tokenizer, "init_kwargs", {}).items())
                if isinstance(v, (str, int, float, bool, type(None))) and k != "name_or_path"}
    head = {"class": type(tokenizer).__name__, "bos": tokenizer.bos_token_id, "eos": tokenizer.eos_token_id,
            "unk": getattr(tokenizer, "unk_token_id", None), "settings": settings}
    h.update(json.dumps(head, sort_keys=True, default=str).encode("utf-8"))
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None:
        state = json.loads(backend.to_str())
        state.pop("truncation", None)
        state.pop("padding", None)
        h.update(json.dumps(state, sort_keys=True).encode("utf-8"))
    else:
        with tempfile.TemporaryDirectory() as folder:
            tokenizer.save_pretrained(folder)
            for path in sorted(Path(folder).rglob("*")):
                if path.is_file():
                    h.update(path.name.encode("utf-8") + b"\0" + path.read_bytes())
    return h.hexdigest()


def _version(package: str) -> str | None:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return None


def tokenized_key(tokenizer, prompts: Sequence[str], targets: Sequence[str], max_length: int,
                  add_special_tokens: bool = True) -> str:
    """The cache key of a tokenization: every prompt and target text in order, the tokenizer,
    ``max_length``, whether special tokens are added, the code of :func:`encode_example` and
    :func:`_encode_rows`, the versions of the libraries that tokenize."""
    h = hashlib.sha256()
    header = {"format": TOKENIZED_FORMAT, "max_length": max_length, "tokenizer": tokenizer_digest(tokenizer),
              "special_tokens": add_special_tokens,
              "encoder": [_code_digest(encode_example), _code_digest(_encode_rows), _code_digest(leading_ids)],
              "versions": {name: _version(name) for name in ("tokenizers", "transformers", "datasets")}}
    h.update(json.dumps(header, sort_keys=True).encode("utf-8"))
    for prompt, target in zip(prompts, targets, strict=True):
        for text in (prompt, target):
            data = text.encode("utf-8")
            h.update(len(data).to_bytes(8, "little") + data)  # length-prefixed: no two splits collide
    return h.hexdigest()[:32]


def _encode_rows(batch: dict[str, list], tokenizer, max_length: int, add_special_tokens: bool) -> dict[str, list]:
    """``Dataset.map``'s function: :func:`encode_example` of each (prompt, target) of a batch."""
    input_ids, labels = [], []
    for prompt, target in zip(batch["prompt"], batch["target"]):
        ids, lab = encode_example(tokenizer, prompt, target, max_length, add_special_tokens)
        input_ids.append(ids)
        labels.append(lab)
    return {"input_ids": input_ids, "labels": labels}


@dataclass
class TokenizedGroups:
    """Token ids and labels of every instance of the training groups: row ``g * per_group + d``
    is domain ``d`` (in the method's order) of group ``g``. ``built``: this process tokenized
    (False: it loaded the cached result)."""

    rows: Any  # a datasets.Dataset with the columns input_ids and labels
    per_group: int
    pad: int
    path: Path
    built: bool

    @property
    def num_groups(self) -> int:
        return len(self.rows) // self.per_group

    def micro_batch(self, groups: Sequence[int], padding_free: bool = False,
                    halves: Sequence[int] | None = None) -> MicroBatch | PackedMicroBatch:
        """The padded micro-batch of these groups, as :func:`collate` of their records; with
        ``padding_free``, the same sequences in one row (:func:`pack_rows`), domain by domain (half
        by half, then domain by domain, with ``halves``), so that the capture takes each domain's
        tokens in one product. ``halves``: each group's half of the step (0 or 1), carried to
        each of its sequences as the micro-batch's ``halves``."""
        import torch

        group_halves = [0] * len(groups) if halves is None else list(halves)
        if len(group_halves) != len(groups):
            raise ValueError(f"halves: expected one per group ({len(groups)}), got {len(group_halves)}")
        triples = [(g, d, h) for g, h in zip(groups, group_halves) for d in range(self.per_group)]
        if padding_free:
            triples.sort(key=lambda gdh: (gdh[2], gdh[1]))  # stable: groups keep their order within a domain
        batch = self.rows[[g * self.per_group + d for g, d, _ in triples]]
        rows = list(zip(batch["input_ids"], batch["labels"]))
        domain_ids = [d for _, d, _ in triples]
        mb = pack_rows(rows, domain_ids) if padding_free else pad_rows(rows, domain_ids, self.pad)
        if halves is not None:
            mb.halves = torch.tensor([h for _, _, h in triples], dtype=torch.long)
        return mb


def tokenized_cache_root() -> Path:
    """Where tokenized training sets are kept: ``iga_ds-tokenized`` in the ``datasets`` cache
    (``HF_DATASETS_CACHE``, by default ``~/.cache/huggingface/datasets``)."""
    import datasets

    return Path(datasets.config.HF_DATASETS_CACHE) / TOKENIZED_FOLDER


def tokenize_groups(tokenizer, groups: Sequence[Sequence[dict]], max_length: int, cache_root: str | Path,
                    num_proc: int = 1, prompt_format: PromptFormat | None = None) -> TokenizedGroups:
    """Every instance of ``groups`` (each ordered like the domains) as ``prompt_format`` writes
    it (default plain), tokenized by ``Dataset.map`` with ``num_proc`` processes, or loaded from
    ``cache_root/KEY`` (:func:`tokenized_key`) when an earlier call wrote it. A result is renamed
    into place only once whole."""
    import datasets

    datasets.disable_progress_bars()
    fmt = prompt_format or PLAIN_FORMAT
    prompts, targets = [], []
    for group in groups:
        for rec in group:
            prompt, target = fmt.example(rec)
            prompts.append(prompt)
            targets.append(target)
    per_group = len(groups[0]) if groups else 0
    key = tokenized_key(tokenizer, prompts, targets, max_length, fmt.add_special_tokens)
    folder = Path(cache_root) / key
    built = False
    rows = _load_tokenized(folder, len(prompts))
    if rows is None:
        mapped = _map_tokenize(tokenizer, prompts, targets, max_length, num_proc, key, fmt.add_special_tokens)
        _save_tokenized(mapped, folder)
        rows, built = _load_tokenized(folder, len(prompts)), True
    return TokenizedGroups(rows, per_group, pad_id(tokenizer), folder, built)


def _map_tokenize(tokenizer, prompts: Sequence[str], targets: Sequence[str], max_length: int, num_proc: int,
                  key: str, add_special_tokens: bool = True):
    """``Dataset.map`` of :func:`encode_example` over (prompt, target) rows, in memory: a
    ``datasets.Dataset`` with ``input_ids`` and ``labels`` (int32 lists). ``key`` is its
    fingerprint (``datasets`` need not hash the tokenizer)."""
    import datasets

    source = datasets.Dataset.from_dict({"prompt": list(prompts), "target": list(targets)})
    ints = datasets.Sequence(datasets.Value("int32"))
    return source.map(_encode_rows, batched=True, batch_size=1000, remove_columns=["prompt", "target"],
                      fn_kwargs={"tokenizer": tokenizer, "max_length": max_length,
                                 "add_special_tokens": add_special_tokens},
                      features=datasets.Features({"input_ids": ints, "labels": ints}),
                      num_proc=num_proc if num_proc > 1 else None, keep_in_memory=True, new_fingerprint=key)


def _load_tokenized(folder: Path, rows: int):
    """The cached rows in ``folder`` (memory-mapped), or None when there are none or they are
    unreadable or of the wrong length (the folder is then removed)."""
    import datasets

    if not folder.is_dir():
        return None
    try:
        loaded = datasets.load_from_disk(str(folder))
        if len(loaded) == rows and set(loaded.column_names) == {"input_ids", "labels"}:
            return loaded
    except Exception:  # an unreadable leftover: tokenized again below
        pass
    aside = folder.with_name(f".{folder.name}.bad.{socket.gethostname()}.{os.getpid()}")
    try:
        os.rename(folder, aside)
        shutil.rmtree(aside, ignore_errors=True)
    except OSError:
        pass
    return None


def _save_tokenized(mapped, folder: Path) -> None:
    """``save_to_disk`` under a temporary name, then renamed to ``folder``; another process that
    renamed the same key first wins (its rows are the same)."""
    make_dir(folder.parent)
    tmp = folder.with_name(f".{folder.name}.{socket.gethostname()}.{os.getpid()}.tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        mapped.save_to_disk(str(tmp))
        os.rename(tmp, folder)
    except OSError:
        if not folder.is_dir():
            raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def sequence_losses(logits, labels):
    """Each sequence's mean token cross-entropy over its target tokens, shape (B,), float32
    (float64 for float64 logits).

    Position t predicts token t+1, so logits drop the last position and labels the first."""
    import torch.nn.functional as F

    shift_logits = _at_least_float32(logits[:, :-1, :])
    shift_labels = labels[:, 1:]
    tok = F.cross_entropy(
        shift_logits.reshape(-1, shift_logits.size(-1)),
        shift_labels.reshape(-1),
        ignore_index=IGNORE_INDEX,
        reduction="none",
    ).view(shift_labels.shape)
    counts = (shift_labels != IGNORE_INDEX).sum(dim=1)
    return tok.sum(dim=1) / counts.clamp(min=1).to(tok.dtype)


def packed_sequence_losses(logits, labels, token_index):
    """:func:`sequence_losses` of a padding-free row (:class:`PackedMicroBatch`): logits and
    labels (1, T), ``token_index`` (B, W) each sequence's row positions (T past its end).

    Position t's loss, which predicts token t + 1, counts with the sequence that holds t: a
    sequence's last position predicts the next one's first token, whose label is ignored. The
    losses gathered per sequence are summed in the order the padded batch sums them."""
    import torch.nn.functional as F

    targets = labels[0, 1:]
    tok = F.cross_entropy(_at_least_float32(logits[0, :-1, :]), targets, ignore_index=IGNORE_INDEX,
                          reduction="none")
    # positions T - 1 (the row's last, predicting nothing) and T (past a sequence's end) add 0
    per_sequence = F.pad(tok, (0, 2))[token_index]
    counts = F.pad((targets != IGNORE_INDEX).to(tok.dtype), (0, 2))[token_index].sum(dim=1)
    return per_sequence.sum(dim=1) / counts.clamp(min=1)


def _at_least_float32(t):
    """float32 for the cross-entropy of half-precision logits; float64 logits stay float64."""
    import torch

    return t if t.dtype == torch.float64 else t.float()
