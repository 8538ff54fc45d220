"""The one place where a record becomes model text, for training and for evaluation alike.

A training example is ``format_prompt(record) + format_target(record)``; evaluation feeds
``format_prompt(record)`` and reads the answer from the generated continuation. Changing the
wording here changes both sides together (and invalidates trained adapters' prompt format).
"""
from __future__ import annotations

import re
from typing import Any, Mapping

INSTRUCTION = 'Think step by step, then give the final answer on the last line as "Answer: <answer>".'
PROMPT_TEMPLATE = "Problem: {problem}\n{instruction}\nSolution:\n"
_FINAL_ANSWER_LINE = re.compile(r"(?:^|\n)\s*Answer\s*:[^\n]*\s*$")


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
