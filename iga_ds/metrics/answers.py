"""Final-answer extraction from a chain-of-thought generation, and exact-match scoring.

Answer kinds:

- ``choice``: a letter option (A-E). Taken from the last ``Answer: X`` line, else from
  "the answer is (X)", else from the last parenthesized ``(X)``.
- ``number``: a number; compared numerically (``1,000`` == ``1000.0``, ``3/4`` == ``0.75``).
- ``math``: the last ``\\boxed{...}`` (else the ``Answer:`` line), MATH normalization; both a
  strict and a symbolic score (``iga_ds.metrics.math_answers``).
- ``text``: the ``Answer:`` line, compared case- and punctuation-insensitively.

The paper (Appendix "Evaluation") extracts answers "using regex pattern matching followed by
exact match comparison"; the rules above are that regex made explicit.
"""
from __future__ import annotations

import re
import string
from dataclasses import dataclass

from iga_ds.metrics.math_answers import last_boxed, math_equal_strict, math_equal_symbolic

ANSWER_KINDS = ("choice", "number", "math", "text")
CHOICE_LETTERS = "ABCDE"

# "Answer: X" at the start of a line (markdown bold and "Final answer" tolerated)
_ANSWER_LINE = re.compile(r"^[\s*#>]*(?:final\s+)?answer\s*[:：]\s*(.+?)\s*$", re.IGNORECASE | re.MULTILINE)
_ANSWER_IS = re.compile(r"answer\s+is\s*[:：]?\s*\(?([A-E])\)?(?![A-Za-z])", re.IGNORECASE)
_LETTER_TOKEN = re.compile(r"(?<![A-Za-z])\(?([A-E])\)?(?![A-Za-z])")
_PAREN_LETTER = re.compile(r"\(([A-E])\)")
_NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?(?:\s*/\s*\d+)?|-?\.\d+")


def answer_line(text: str) -> str | None:
    """The content of the last ``Answer: ...`` line, or None."""
    matches = _ANSWER_LINE.findall(text or "")
    return matches[-1].strip() if matches else None


def extract_choice(text: str) -> str | None:
    line = answer_line(text)
    if line is not None:
        match = _LETTER_TOKEN.search(line)
        if match:
            return match.group(1).upper()
    matches = _ANSWER_IS.findall(text or "")
    if matches:
        return matches[-1].upper()
    matches = _PAREN_LETTER.findall(text or "")
    if matches:
        return matches[-1]
    stripped = (text or "").strip().rstrip(".")
    return stripped if len(stripped) == 1 and stripped in CHOICE_LETTERS else None


def parse_number(text: str) -> float | None:
    """``"1,234.5"`` -> 1234.5, ``"3/4"`` -> 0.75, ``"50%"`` -> 50.0; None if not a number."""
    s = (text or "").strip().replace("$", "").replace("\\%", "").rstrip("%.").replace(",", "")
    s = s.replace(" ", "")
    try:
        if "/" in s:
            num, den = s.split("/")
            return float(num) / float(den)
        return float(s)
    except (ValueError, ZeroDivisionError):
        return None


def extract_number(text: str) -> str | None:
    line = answer_line(text)
    for source in (line, text):
        if source:
            numbers = _NUMBER.findall(source)
            if numbers:
                return numbers[-1 if source is text else 0].replace(" ", "")
    return None


def extract_math(text: str) -> str | None:
    boxed = last_boxed(text or "")
    if boxed is not None:
        return boxed
    return answer_line(text)


def normalize_text_answer(text: str) -> str:
    text = text.lower().strip()
    text = text.translate(str.maketrans("", "", string.punctuation))
    return " ".join(text.split())


def extract_answer(text: str, kind: str) -> str | None:
    """The final answer in a generation, as a string, or None if none is found."""
    if kind == "choice":
        return extract_choice(text)
    if kind == "number":
        return extract_number(text)
    if kind == "math":
        return extract_math(text)
    if kind == "text":
        return answer_line(text)
    raise ValueError(f"unknown answer kind {kind!r}; expected one of {ANSWER_KINDS}")


def infer_answer_kind(gold: str) -> str:
    """A kind for a gold answer that does not declare one (isomer records)."""
    s = str(gold).strip()
    if len(s) == 1 and s.upper() in CHOICE_LETTERS:
        return "choice"
    if parse_number(s) is not None:
        return "number"
    if "\\" in s or "^" in s:
        return "math"
    return "text"


@dataclass(frozen=True)
class Score:
    prediction: str | None
    correct: bool  # exact match (strict normalization for math)
    correct_symbolic: bool  # equal in value (math); same as correct for other kinds


def answers_match(pred: str | None, gold: str, kind: str) -> bool:
    """Exact match after the normalization of the kind (strict for math)."""
    if pred is None:
        return False
    if kind == "choice":
        return pred.strip().upper() == str(gold).strip().upper()
    if kind == "number":
        a, b = parse_number(pred), parse_number(str(gold))
        if a is None or b is None:
            return False
        return abs(a - b) <= 1e-6 * max(1.0, abs(b))
    if kind == "math":
        return math_equal_strict(pred, str(gold))
    if kind == "text":
        return normalize_text_answer(pred) == normalize_text_answer(str(gold))
    raise ValueError(f"unknown answer kind {kind!r}; expected one of {ANSWER_KINDS}")


def score_generation(text: str, gold: str, kind: str) -> Score:
    """Extract the answer from a generation and score it against the gold answer."""
    pred = extract_answer(text, kind)
    correct = answers_match(pred, gold, kind)
    symbolic = math_equal_symbolic(pred, str(gold)) if kind == "math" else correct
    return Score(prediction=pred, correct=correct, correct_symbolic=symbolic or correct)
