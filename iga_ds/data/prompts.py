"""The one place where a record becomes model text, for training and for evaluation alike.

Two formats, chosen per tokenizer by :func:`prompt_format` (``data.prompt_format`` in the run
YAML, ``--prompt-format`` for ``iga-ds eval``):

- **plain**, for a base model (the built-in tiny base, any tokenizer without a chat template):
  a training example is ``format_prompt(record) + format_target(record)``; evaluation feeds
  ``format_prompt(record)`` and reads the answer from the continuation.
- **chat**, for an instruction model (a tokenizer with a chat template): the problem and the
  instruction are the user turn, the chain of thought and answer the assistant turn, both
  rendered by the tokenizer's own template. The prompt is the conversation up to the opening
  of the assistant turn (``add_generation_prompt=True``); the target is what the template adds
  for the assistant turn, up to and including its end-of-turn marker, so the loss covers the
  assistant turn only. The template writes its own special tokens into the text, so neither
  side adds any when tokenizing (:attr:`PromptFormat.add_special_tokens`).

:class:`PromptFormat` is what training (``iga_ds.train.batching``) and evaluation
(``iga_ds.evaluation``) both call, so the prompt of an example is the same text, and the same
tokens, on either side: :func:`leading_ids` is the one rule for the special token in front
(the tokenizer's BOS in the plain format, none in the chat format), whether or not the
tokenizer's own post-processor would add it, and :func:`prompt_token_ids` is a prompt's ids as
training's rows begin. Changing the wording here changes both sides together (and invalidates
trained adapters' prompt format). An adapter records the format it was trained with
(:data:`PROMPT_FORMAT_FILE`); evaluation reads it.
"""
from __future__ import annotations

import json
import re
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from iga_ds.errors import ConfigError, UserError
from iga_ds.files import atomic_write_json, read_json

INSTRUCTION = 'Think step by step, then give the final answer on the last line as "Answer: <answer>".'
PROMPT_TEMPLATE = "Problem: {problem}\n{instruction}\nSolution:\n"
USER_TEMPLATE = "Problem: {problem}\n{instruction}"  # the chat format's user turn
_FINAL_ANSWER_LINE = re.compile(r"(?:^|\n)\s*Answer\s*:[^\n]*\s*$")

PLAIN, CHAT, AUTO = "plain", "chat", "auto"
PROMPT_FORMATS = (AUTO, PLAIN, CHAT)
PROMPT_FORMAT_FILE = "prompt_format.json"  # in an adapter folder: the format it was trained with


def format_prompt(record: Mapping[str, Any]) -> str:
    """Problem text plus the fixed instruction; ends with a newline so the target starts a line."""
    return PROMPT_TEMPLATE.format(problem=str(record["problem"]).strip(), instruction=INSTRUCTION)


def format_target(record: Mapping[str, Any]) -> str:
    """Chain of thought ending in ``Answer: X``; a CoT that already ends so is kept as is."""
    cot = str(record.get("cot") or "").rstrip()
    if _FINAL_ANSWER_LINE.search(cot):
        return cot
    answer = str(record["answer"]).strip()
    return f"{cot}\nAnswer: {answer}" if cot else f"Answer: {answer}"


def format_user_message(record: Mapping[str, Any]) -> str:
    """The chat format's user turn: the problem and the instruction."""
    return USER_TEMPLATE.format(problem=str(record["problem"]).strip(), instruction=INSTRUCTION)


def leading_ids(tokenizer: Any, add_special_tokens: bool = True) -> list[int]:
    """What every row starts with, in training and evaluation alike: ``[bos]`` when the format
    adds special tokens and the tokenizer has a BOS token, else nothing. Spelled out rather than
    left to ``tokenizer(..., add_special_tokens=True)``: some tokenizers' post-processors add no
    BOS (the built-in tiny base's), and the rows must not depend on that."""
    bos = getattr(tokenizer, "bos_token_id", None)
    return [bos] if add_special_tokens and bos is not None else []


def prompt_token_ids(tokenizer: Any, prompt: str, add_special_tokens: bool = True) -> list[int]:
    """A prompt's token ids exactly as a training row begins: :func:`leading_ids`, then the text."""
    return leading_ids(tokenizer, add_special_tokens) + tokenizer(prompt, add_special_tokens=False)["input_ids"]


def has_chat_template(tokenizer: Any) -> bool:
    return bool(getattr(tokenizer, "chat_template", None))


@dataclass(frozen=True)
class PromptFormat:
    """How records become model text for one tokenizer: ``name`` is ``plain`` or ``chat``
    (``tokenizer`` is needed for ``chat`` only)."""

    name: str
    tokenizer: Any = None

    @property
    def add_special_tokens(self) -> bool:
        """Whether tokenizing adds the tokenizer's special tokens: not for chat text, which
        carries the template's own."""
        return self.name == PLAIN

    def prompt(self, record: Mapping[str, Any]) -> str:
        """What the model reads before its answer."""
        if self.name == PLAIN:
            return format_prompt(record)
        return self._render([{"role": "user", "content": format_user_message(record)}], True)

    def example(self, record: Mapping[str, Any]) -> tuple[str, str]:
        """(prompt, target) of a training example; the prompt is :meth:`prompt`'s."""
        prompt = self.prompt(record)
        if self.name == PLAIN:
            return prompt, format_target(record)
        turns = [{"role": "user", "content": format_user_message(record)},
                 {"role": "assistant", "content": format_target(record)}]
        whole = self._render(turns, False)
        if not whole.startswith(prompt):
            raise ConfigError("data.prompt_format: the tokenizer's chat template does not render a conversation as "
                              "its prompt (add_generation_prompt) followed by the assistant turn, so the loss cannot "
                              "be put on the assistant turn alone; set data.prompt_format: plain")
        # what the template writes after the turn's end-of-turn marker separates turns: not the model's to say
        return prompt, whole[len(prompt):].rstrip()

    def settings(self) -> dict[str, Any]:
        """What an evaluation records about its prompts."""
        if self.name == PLAIN:
            return {"prompt_format": PLAIN, "prompt_template": PROMPT_TEMPLATE}
        return {"prompt_format": CHAT, "prompt_template": USER_TEMPLATE, "chat_template": self.tokenizer.chat_template}

    def _render(self, turns: list[dict[str, str]], generation_prompt: bool) -> str:
        return self.tokenizer.apply_chat_template(turns, tokenize=False, add_generation_prompt=generation_prompt)


def prompt_format(tokenizer: Any, wanted: str = AUTO, what: str = "data.prompt_format",
                  error: type[UserError] = ConfigError) -> PromptFormat:
    """The format for ``tokenizer``: ``auto`` is ``chat`` when it has a chat template, else
    ``plain``; ``chat`` without a template is an error naming ``what``."""
    if wanted not in PROMPT_FORMATS:
        raise error(f"{what}: expected one of {', '.join(PROMPT_FORMATS)}, got {wanted!r}")
    if wanted == AUTO:
        wanted = CHAT if has_chat_template(tokenizer) else PLAIN
    if wanted == CHAT and not has_chat_template(tokenizer):
        raise error(f"{what}: chat needs a tokenizer with a chat template, and this one has none; use plain or auto")
    return PromptFormat(wanted, tokenizer if wanted == CHAT else None)


def save_prompt_format(folder: str | Path, fmt: PromptFormat) -> None:
    """Record in an adapter folder the format it was trained with."""
    atomic_write_json(Path(folder) / PROMPT_FORMAT_FILE, {"prompt_format": fmt.name})


def saved_prompt_format(folder: str | Path | None) -> str | None:
    """The format an adapter folder records, or None (no adapter, or one saved without it)."""
    path = Path(folder) / PROMPT_FORMAT_FILE if folder is not None else None
    if path is None or not path.is_file():
        return None
    name = read_json(path, objects=True).get("prompt_format")
    if name not in (PLAIN, CHAT):
        raise UserError(f"{path}: field 'prompt_format': expected {PLAIN} or {CHAT}, got {json.dumps(name)}")
    return name
