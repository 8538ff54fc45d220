"""Isomer data in the conventions Hugging Face and TRL users have, tokenized for :class:`IGATrainer`.

A row is TRL's conversational (``messages``: a list of ``{"role", "content"}``, the last one the
assistant's) or prompt-completion (``prompt`` and ``completion``: two strings, or two lists of
messages) example, plus a group column and a domain column (names configurable). The result
has one row per sequence, group by group and within a group in the domains' order, with the
loss on the completion (the last assistant turn) only: what the group-aware sampler and the
collator of :mod:`iga_ds.integrations.hf` take."""
from __future__ import annotations

import os
from typing import Any, Iterable, Sequence

from iga_ds.errors import DataError
from iga_ds.files import read_jsonl
from iga_ds.train.batching import IGNORE_INDEX, encode_example

GROUP_INDEX = "group_index"  # the group's place in the dataset, 0, 1, ...
DOMAIN_IDS = "domain_ids"  # the sequence's domain, an index into the method's domains
COLUMNS = ("input_ids", "labels", DOMAIN_IDS, GROUP_INDEX)


def load_rows(data: Any) -> tuple[list[dict], str]:
    """(rows, where they came from): a JSON Lines file, a ``datasets.Dataset`` or a list of dicts."""
    if isinstance(data, (str, os.PathLike)):
        return read_jsonl(data), str(data)
    return [dict(row) for row in data], "train_dataset"


def group_rows(rows: Sequence[dict], domains: Sequence[str], group_column: str = "group_id",
               domain_column: str = "domain", source: str = "train_dataset") -> list[list[dict]]:
    """Rows gathered into isomer groups (first-seen order), each ordered like ``domains``; a row
    without the columns, of another domain, or a group without every domain once, is an error."""
    by_group: dict[str, dict[str, dict]] = {}
    for i, row in enumerate(rows):
        for column in (group_column, domain_column):
            if row.get(column) is None:
                raise DataError(f"{source}: row {i + 1} has no {column!r} column (expected the isomer group and "
                                f"the domain of every row; set group_column / domain_column to the names you use)")
        domain = str(row[domain_column])
        if domain not in domains:
            raise DataError(f"{source}: row {i + 1}: {domain_column} {domain!r} is not one of the domains "
                            f"{list(domains)}")
        slot = by_group.setdefault(str(row[group_column]), {})
        if domain in slot:
            raise DataError(f"{source}: row {i + 1}: group {row[group_column]!r} has two {domain!r} rows")
        slot[domain] = row
    for group, slot in by_group.items():
        if len(slot) < len(domains):
            missing = [d for d in domains if d not in slot]
            raise DataError(f"{source}: group {group!r} lacks domain(s) {missing}; every group needs one row of "
                            f"each of {list(domains)}")
    return [[slot[d] for d in domains] for slot in by_group.values()]


def example_texts(row: dict, tokenizer, where: str) -> tuple[str, str, bool]:
    """(prompt, completion, whether to add special tokens) of one TRL-style row: chat rows are
    rendered by the tokenizer's chat template, which carries its own special tokens."""
    if "messages" in row:
        messages = row["messages"]
        if not isinstance(messages, list) or not messages or not isinstance(messages[-1], dict) \
                or messages[-1].get("role") != "assistant":
            raise DataError(f"{where}: messages: expected a list of messages whose last one has role 'assistant'")
        return chat_texts(tokenizer, messages[:-1], messages[-1:], where)
    if "prompt" in row and "completion" in row:
        prompt, completion = row["prompt"], row["completion"]
        if isinstance(prompt, str) and isinstance(completion, str):
            return prompt, completion, True
        if isinstance(prompt, list) and isinstance(completion, list):
            return chat_texts(tokenizer, prompt, completion, where)
        raise DataError(f"{where}: prompt and completion: expected two strings or two lists of messages")
    raise DataError(f"{where}: expected 'messages' (conversational) or 'prompt' and 'completion' "
                    f"(prompt-completion), got the columns {sorted(row)}")


def chat_texts(tokenizer, prompt: list, completion: list, where: str) -> tuple[str, str, bool]:
    """The prompt as the chat template writes it before the model's turn, and the rest of the
    whole conversation after it: the completion, on which the loss is taken."""
    if not getattr(tokenizer, "chat_template", None):
        raise DataError(f"{where}: a conversational row, but the tokenizer has no chat template")
    head = tokenizer.apply_chat_template(prompt, tokenize=False, add_generation_prompt=True)
    whole = tokenizer.apply_chat_template(prompt + completion, tokenize=False)
    if not whole.startswith(head):
        raise DataError(f"{where}: the chat template writes the conversation with another beginning than its "
                        "prompt (add_generation_prompt=True), so the completion cannot be told apart")
    return head, whole[len(head):], False


def encode_groups(groups: Iterable[Sequence[dict]], tokenizer, domains: Sequence[str], max_length: int,
                  source: str = "train_dataset") -> dict[str, list]:
    """The columns of :data:`COLUMNS` for these groups, group by group, domain by domain."""
    columns: dict[str, list] = {name: [] for name in COLUMNS}
    for g, group in enumerate(groups):
        for d, row in enumerate(group):
            prompt, completion, special = example_texts(row, tokenizer, f"{source}: group {g + 1}, {domains[d]}")
            ids, labels = encode_example(tokenizer, prompt, completion, max_length, special)
            if all(label == IGNORE_INDEX for label in labels):
                raise DataError(f"{source}: group {g + 1}, {domains[d]}: no completion token left within "
                                f"max_length {max_length}")
            for name, value in zip(COLUMNS, (ids, labels, d, g)):
                columns[name].append(value)
    return columns


def isomer_dataset(data: Any, tokenizer, domains: Sequence[str], group_column: str = "group_id",
                   domain_column: str = "domain", max_length: int = 1024):
    """A ``datasets.Dataset`` of :data:`COLUMNS` for :class:`iga_ds.integrations.hf.IGATrainer`
    from TRL-style rows (a ``datasets.Dataset``, a list of dicts or a JSON Lines file)."""
    import datasets

    rows, source = load_rows(data)
    domains = [str(d) for d in domains]
    groups = group_rows(rows, domains, group_column, domain_column, source)
    if not groups:
        raise DataError(f"{source}: no rows")
    return datasets.Dataset.from_dict(encode_groups(groups, tokenizer, domains, max_length, source))
