"""Parsing teacher output. Anything that does not parse is a failed attempt, never a crash."""
from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass

from iga_ds.data.dag import DagError, check_dag


class MalformedOutput(ValueError):
    """The model's reply does not have the expected shape."""


_FENCE = re.compile(r"```(?:json)?\s*(.*?)```", re.DOTALL | re.IGNORECASE)
_SCORE = re.compile(r"score[^0-9\n]{0,40}?([01](?:\.\d+)?|\.\d+)", re.IGNORECASE)
_VERDICT = re.compile(r"\b(PASS|FAIL)\b")
# the prompt's own "(0.0-1.0)" is often echoed back; it is a range, not a score
_RANGE = re.compile(r"\(\s*0(?:\.0+)?\s*(?:-|–|to)\s*1(?:\.0+)?\s*\)")
_STEP_PREFIX = re.compile(r"^\s*(?:step\s*\d+\s*[:.)-]|\d+\s*[.)]|[-*•])\s*", re.IGNORECASE)
_ANSWER_LINE = re.compile(r"^\s*(?:final\s+)?answer\s*:", re.IGNORECASE)


def extract_json_object(text: str) -> dict:
    """The first JSON object in ``text``, also inside a ```json fence or after chatter."""
    if not isinstance(text, str) or not text.strip():
        raise MalformedOutput("empty reply")
    candidates = [m.group(1) for m in _FENCE.finditer(text)] + [text]
    decoder = json.JSONDecoder()
    for cand in candidates:
        start = cand.find("{")
        while start != -1:
            try:
                obj, _ = decoder.raw_decode(cand, start)
            except json.JSONDecodeError:
                start = cand.find("{", start + 1)
                continue
            if isinstance(obj, dict):
                return obj
            start = cand.find("{", start + 1)
    raise MalformedOutput("no JSON object in the reply")


def parse_dag(text: str) -> dict:
    dag = extract_json_object(text)
    try:
        check_dag(dag)
    except DagError as exc:
        raise MalformedOutput(f"DAG: {exc}") from None
    return dag


@dataclass
class Instance:
    problem: str
    steps: list[str]
    answer: str
    self_score: float | None

    @property
    def step_count(self) -> int:
        return len(self.steps)

    def cot_text(self) -> str:
        """Steps, one per line, then ``Answer: X`` (the convention answer extraction uses)."""
        return "\n".join(self.steps + [f"Answer: {self.answer}"])


def split_steps(cot) -> list[str]:
    if isinstance(cot, list):
        raw = [str(s) for s in cot]
    elif isinstance(cot, str):
        raw = cot.splitlines()
    else:
        raise MalformedOutput("cot_solution must be a list of steps or a string")
    steps = []
    for line in raw:
        line = " ".join(line.split())
        if not line or _ANSWER_LINE.match(line):
            continue  # the answer line is added back from the answer field
        stripped = _STEP_PREFIX.sub("", line, count=1).strip()
        steps.append(stripped or line)
    if not steps:
        raise MalformedOutput("cot_solution has no steps")
    return steps


def parse_instance(text: str) -> Instance:
    obj = extract_json_object(text)
    problem = obj.get("problem")
    if not isinstance(problem, str) or not problem.strip():
        raise MalformedOutput("'problem' missing or not a string")
    cot = obj.get("cot_solution", obj.get("cot"))
    if cot is None:
        raise MalformedOutput("'cot_solution' missing")
    steps = split_steps(cot)
    answer = obj.get("answer")
    if isinstance(answer, bool):
        answer = "yes" if answer else "no"
    if isinstance(answer, (int, float)) and not isinstance(answer, bool):
        answer = f"{answer:g}" if isinstance(answer, float) else str(answer)
    if not isinstance(answer, str) or not answer.strip():
        raise MalformedOutput("'answer' missing or empty")
    score = obj.get("alignment_score")
    if score is not None:
        try:
            score = float(score)
        except (TypeError, ValueError):
            raise MalformedOutput("'alignment_score' is not a number") from None
        if not math.isfinite(score):
            raise MalformedOutput("'alignment_score' is not finite")
    return Instance(" ".join(problem.split()), steps, " ".join(answer.split()), score)


@dataclass
class Verification:
    score: float
    verdict: str | None


def parse_verification(text: str) -> Verification:
    """The last "score ... <number in [0, 1]>" in the reply, and PASS/FAIL if stated."""
    if not isinstance(text, str) or not text.strip():
        raise MalformedOutput("empty verification reply")
    scores = [float(m.group(1)) for m in _SCORE.finditer(_RANGE.sub(" ", text))]
    scores = [s for s in scores if 0.0 <= s <= 1.0]
    if not scores:
        raise MalformedOutput("no structural alignment score in the verification reply")
    verdicts = _VERDICT.findall(text)
    return Verification(scores[-1], verdicts[-1] if verdicts else None)
