"""Teacher replies as LLMs write them. Anything that does not parse is a failed attempt
(``MalformedOutput``, saying what was missing), never a crash, and never a guess.

Every reply may carry prose before and after, markdown (bold, headings) and code fences. A
reasoning model's ``<think>...</think>`` draft is set aside: only what follows it is the reply.

- **JSON** (the DAG and instance replies): the JSON objects of the reply are found wherever
  they are, also inside a ```json fence. One repair is made: a trailing comma before ``}`` or
  ``]`` is removed, since such a text has one reading. Single quotes, comments and anything
  else that is not JSON are refused: repairing them could change what the teacher wrote. A
  reply with two different objects of the expected shape is ambiguous and refused.
- **DAG**: the object with ``nodes`` (also wrapped as ``{"dag": {...}}``); node types and edge
  labels in any case; ``source``/``target``/``type`` for ``from``/``to``/``label``.
- **Instance**: ``problem``, ``cot_solution`` (a list of steps or one string, numbered or
  not), ``answer``, ``alignment_score``; a step may be an object whose ``uses`` and
  ``derives`` name the DAG nodes it relies on and establishes (the dependency structure
  that ``filters`` compares with the graph).
- **Verification**: the score comes from item 4 of the paper's numbered list (``4. 0.92``),
  a number after "score" or "alignment" (``Structural alignment score (0.0-1.0): **0.92**``),
  a JSON field whose name contains ``score`` (or ``"4"``), or a line holding only a decimal;
  percentages (``92%``) and ``x/10``, ``x/100`` scales are read as fractions. The range
  ``(0.0-1.0)`` and thresholds (``>= 0.85``, ``threshold 0.85``) echoed from the prompt are
  not scores. Two different scores make the reply ambiguous: it is refused, not guessed. The
  verdict is PASS or FAIL from a ``Verdict:`` line (or ``Result:``, a JSON ``verdict``), else
  from the words PASS/FAIL in capitals; before or after the score. The score decides
  acceptance, as in the paper's template, where the verdict follows from the score.
"""
from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass

from iga_ds.data.dag import DagError, check_dag


class MalformedOutput(ValueError):
    """The model's reply does not have the expected shape."""


# ---------------------------------------------------------------- JSON objects in prose

_THINKING = re.compile(r"<think>.*?(?:</think>|$)", re.DOTALL | re.IGNORECASE)


def without_thinking(text: str) -> str:
    """``text`` minus ``<think>`` blocks (a block never closed runs to the end: a cut-off draft)."""
    return _THINKING.sub(" ", text)


def _outside_strings(text: str, quote_opens):
    """(index, character) of each character of ``text`` outside JSON strings; a ``"`` opens a
    string only where ``quote_opens()`` says so (it is asked at that moment)."""
    in_string, escaped = False, False
    for i, c in enumerate(text):
        if in_string:
            if escaped:
                escaped = False
            elif c == "\\":
                escaped = True
            elif c == '"':
                in_string = False
        elif c == '"' and quote_opens():
            in_string = True
        else:
            yield i, c


def _block_ends(text: str) -> tuple[dict[int, int], int | None]:
    """Where each bracket opening a ``{...}`` or ``[...]`` block closes, in one pass (brackets in
    JSON strings ignored, quotes outside any block taken for prose); and the first ``{"`` left open."""
    ends, stack = {}, []
    for i, c in _outside_strings(text, lambda: bool(stack)):
        if c in "{[":
            stack.append(i)
        elif c in "}]" and stack:
            ends[stack.pop()] = i
    cut_off = next((p for p in stack if _OBJECT_START.match(text, p)), None)
    return ends, cut_off


_OBJECT_START = re.compile(r'\{\s*"')
_TRAILING_COMMA = re.compile(r",\s*[}\]]")


def _without_trailing_commas(block: str) -> str:
    """``block`` minus each comma (outside strings) that only a ``}`` or ``]`` follows."""
    dropped = {i for i, c in _outside_strings(block, lambda: True) if c == "," and _TRAILING_COMMA.match(block, i)}
    return "".join(c for i, c in enumerate(block) if i not in dropped)


def _decode_at(text: str, pos: int, block_end: int | None):
    """(value, end) of the JSON value starting at ``pos``, trailing commas forgiven; (None, pos)."""
    try:
        return _DECODER.raw_decode(text, pos)
    except (ValueError, RecursionError):
        pass
    if block_end is None or not _TRAILING_COMMA.search(text, pos, block_end + 1):
        return None, pos
    try:
        return json.loads(_without_trailing_commas(text[pos:block_end + 1])), block_end + 1
    except (ValueError, RecursionError):
        return None, pos


_DECODER = json.JSONDecoder()


def json_objects(text: str) -> tuple[list[dict], int | None]:
    """The top-level JSON objects in ``text``, in order, and where a cut-off one starts (or None).

    Linear in practice: a candidate that is not JSON fails where it stops being JSON, and the
    block a trailing-comma repair needs comes from one pass over the text."""
    ends, cut_off = _block_ends(text)
    objects = []
    pos = text.find("{")
    while pos != -1:
        value, end = _decode_at(text, pos, ends.get(pos))
        if isinstance(value, dict):
            objects.append(value)
            pos = text.find("{", end)
        else:
            pos = text.find("{", pos + 1)
    return objects, cut_off


def extract_json_object(text: str) -> dict:
    """The first JSON object in ``text``, also inside a ```json fence or after chatter."""
    if not isinstance(text, str) or not text.strip():
        raise MalformedOutput("empty reply")
    objects, cut_off = json_objects(without_thinking(text))
    if not objects:
        raise MalformedOutput("no JSON object in the reply" + _cut_off_note(cut_off))
    return objects[0]


def _cut_off_note(cut_off: int | None) -> str:
    if cut_off is None:
        return ""
    return f" (the JSON object at character {cut_off} never closes: reply cut off by the token limit?)"


def _keys(obj: dict) -> str:
    return ", ".join(sorted(map(str, obj)))


def _the_object(text: str, what: str, keys: tuple[str, ...]) -> dict:
    """The one JSON object of the reply having one of ``keys`` (or wrapping one that has)."""
    if not isinstance(text, str) or not text.strip():
        raise MalformedOutput(f"{what} reply: empty")
    objects, cut_off = json_objects(without_thinking(text))
    found, seen = [], set()
    for obj in objects:
        if not any(k in obj for k in keys):
            inner = [v for v in obj.values() if isinstance(v, dict) and any(k in v for k in keys)]
            obj = inner[0] if len(inner) == 1 else None
        if obj is not None and json.dumps(obj, sort_keys=True) not in seen:
            seen.add(json.dumps(obj, sort_keys=True))
            found.append(obj)
    if len(found) > 1:
        raise MalformedOutput(f"{what} reply: {len(found)} different JSON objects with '{keys[0]}'; "
                              "which one is meant is unclear")
    if not found:
        seen_keys = f" (found only objects with keys {_keys(objects[0])})" if objects else ""
        quotes = " (single-quoted text is not JSON)" if re.search(r"\{\s*'", text) else ""
        raise MalformedOutput(f"{what} reply: no JSON object with '{keys[0]}'{seen_keys}{quotes}"
                              f"{_cut_off_note(cut_off)}")
    return found[0]


# ---------------------------------------------------------------- DAG

_EDGE_ALIASES = {"from": ("source",), "to": ("target",), "label": ("type", "relation")}


def _normalised_dag(dag: dict) -> dict:
    """``dag`` with upper-case types and labels and the canonical edge keys; nothing else changed."""
    out = dict(dag)
    if isinstance(dag.get("nodes"), list):
        out["nodes"] = [dict(n, type=n["type"].strip().upper()) if isinstance(n, dict)
                        and isinstance(n.get("type"), str) else n for n in dag["nodes"]]
    if isinstance(dag.get("edges"), list):
        out["edges"] = [_normalised_edge(e) if isinstance(e, dict) else e for e in dag["edges"]]
    count = dag.get("step_count")
    if isinstance(count, str) and count.strip().isdigit():
        out["step_count"] = int(count)
    return out


def _normalised_edge(edge: dict) -> dict:
    edge = dict(edge)
    for key, aliases in _EDGE_ALIASES.items():
        if key not in edge:
            alias = next((a for a in aliases if a in edge), None)
            if alias is not None:
                edge[key] = edge.pop(alias)
    if isinstance(edge.get("label"), str):
        edge["label"] = edge["label"].strip().upper()
    return edge


def parse_dag(text: str) -> dict:
    dag = _normalised_dag(_the_object(text, "DAG", ("nodes",)))
    try:
        check_dag(dag)
    except DagError as exc:
        raise MalformedOutput(f"DAG: {exc}") from None
    return dag


# ---------------------------------------------------------------- instance


@dataclass(frozen=True)
class StepDependencies:
    """The DAG nodes a CoT step relies on and the ones it establishes (ids as strings)."""

    uses: tuple[str, ...] = ()
    derives: tuple[str, ...] = ()


@dataclass
class Instance:
    problem: str
    steps: list[str]
    answer: str
    self_score: float | None
    # one entry per step when the reply annotated its steps with uses/derives, else None
    dependencies: list[StepDependencies] | None = None

    @property
    def step_count(self) -> int:
        return len(self.steps)

    def cot_text(self) -> str:
        """Steps, one per line, then ``Answer: X`` (the convention answer extraction uses)."""
        return "\n".join(self.steps + [f"Answer: {self.answer}"])


_STEP_PREFIX = re.compile(r"^\s*(?:step\s*\d+\s*[:.)-]|\d+\s*[.)]|[-*•])\s*", re.IGNORECASE)
_ANSWER_LINE = re.compile(r"^\s*(?:final\s+)?answer\s*:", re.IGNORECASE)
_INLINE_STEP = re.compile(r"(?<![a-z])step\s*\d+\s*[:.)]", re.IGNORECASE)
# where a one-line CoT "Step 1: ... Step 2: ... Answer: X" is cut into steps
_INLINE_CUT = re.compile(r"(?<![a-z])(?<!final\s)(?=step\s*\d+\s*[:.)]|(?:final\s+)?answer\s*:)",
                         re.IGNORECASE)
# "step" last: it may hold the step's number ({"step": "1", "description": ...})
_STEP_TEXT_KEYS = ("text", "description", "content", "explanation", "step")
_USES_KEYS = ("uses", "premises")
_DERIVES_KEYS = ("derives", "conclusion", "concludes")


def _step_text(line: str) -> str | None:
    """A step's text without its number or bullet; None for an empty or ``Answer:`` line."""
    line = " ".join(line.replace("**", "").split())
    if not line or _ANSWER_LINE.match(line):
        return None  # the answer line is added back from the answer field
    return _STEP_PREFIX.sub("", line, count=1).strip() or line


def _node_ids(value, where: str) -> tuple[str, ...]:
    if value is None:
        return ()
    if isinstance(value, (str, int)) and not isinstance(value, bool):
        return (str(value).strip(),) if str(value).strip() else ()
    if isinstance(value, list) and all(isinstance(v, (str, int)) and not isinstance(v, bool) for v in value):
        return tuple(str(v).strip() for v in value if str(v).strip())
    raise MalformedOutput(f"{where} must be a node id or a list of node ids")


def _first_key(item: dict, keys: tuple[str, ...]):
    return next((item[k] for k in keys if k in item), None)


def _object_step(item: dict, where: str) -> tuple[str | None, StepDependencies, bool]:
    """Text, dependencies, and whether the step was annotated, of one step given as an object."""
    text = next((item[k] for k in _STEP_TEXT_KEYS if isinstance(item.get(k), str) and item[k].strip()), None)
    if text is None:
        raise MalformedOutput(f"{where} has no step text (a 'text' or 'step' string)")
    deps = StepDependencies(_node_ids(_first_key(item, _USES_KEYS), f"{where}.uses"),
                            _node_ids(_first_key(item, _DERIVES_KEYS), f"{where}.derives"))
    annotated = any(k in item for k in _USES_KEYS + _DERIVES_KEYS)
    return _step_text(text), deps, annotated


def parse_steps(cot) -> tuple[list[str], list[StepDependencies] | None]:
    """Step texts and, when any step names its uses/derives, each step's dependencies."""
    if isinstance(cot, str):
        lines = cot.splitlines()
        if len(lines) == 1 and len(_INLINE_STEP.findall(cot)) > 1:
            lines = _INLINE_CUT.split(cot)  # "Step 1: ... Step 2: ..." on one line
        items = lines
    elif isinstance(cot, list):
        items = cot
    else:
        raise MalformedOutput("cot_solution must be a list of steps or a string")
    steps, deps, annotated = [], [], False
    for i, item in enumerate(items):
        if isinstance(item, dict):
            text, dep, marked = _object_step(item, f"cot_solution[{i}]")
            annotated = annotated or marked
        elif isinstance(item, (str, int, float)) and not isinstance(item, bool):
            text, dep = _step_text(str(item)), StepDependencies()
        else:
            raise MalformedOutput(f"cot_solution[{i}] is neither a step text nor a step object")
        if text is not None:
            steps.append(text)
            deps.append(dep)
    if not steps:
        raise MalformedOutput("cot_solution has no steps")
    return steps, (deps if annotated else None)


def split_steps(cot) -> list[str]:
    return parse_steps(cot)[0]


_INSTANCE_KEYS = {
    "problem": ("problem", "problem_statement"),
    "cot_solution": ("cot_solution", "cot", "chain_of_thought", "solution", "steps"),
    "answer": ("answer", "final_answer"),
    "alignment_score": ("alignment_score", "structural_alignment_score"),
}


def _instance_field(obj: dict, name: str):
    """The value of ``name`` or of one of its spellings; two different values are ambiguous."""
    present = [k for k in _INSTANCE_KEYS[name] if k in obj]
    values = {json.dumps(obj[k], sort_keys=True) for k in present}
    if len(values) > 1:
        raise MalformedOutput(f"instance reply: both {present[0]!r} and {present[1]!r}, with different "
                              "values; which one is meant is unclear")
    return obj[present[0]] if present else None


def _answer_text(answer) -> str:
    if isinstance(answer, bool):
        answer = "yes" if answer else "no"
    if isinstance(answer, (int, float)):
        answer = f"{answer:g}" if isinstance(answer, float) else str(answer)
    if not isinstance(answer, str):
        raise MalformedOutput("'answer' missing or empty")
    answer = _ANSWER_LINE.sub("", " ".join(answer.replace("**", "").split())).strip()
    if not answer:
        raise MalformedOutput("'answer' missing or empty")
    return answer


def _self_score(value) -> float | None:
    if value is None:
        return None
    score = _number(value)
    if score is None:
        raise MalformedOutput("'alignment_score' is not a number")
    if not math.isfinite(score):
        raise MalformedOutput("'alignment_score' is not finite")
    return score


def parse_instance(text: str) -> Instance:
    obj = _the_object(text, "instance", _INSTANCE_KEYS["problem"])
    problem = _instance_field(obj, "problem")
    if not isinstance(problem, str) or not problem.strip():
        raise MalformedOutput("instance reply: 'problem' missing or not a string")
    cot = _instance_field(obj, "cot_solution")
    if cot is None:
        raise MalformedOutput(f"instance reply: 'cot_solution' missing (the object has {_keys(obj)})")
    steps, dependencies = parse_steps(cot)
    answer = _answer_text(_instance_field(obj, "answer"))
    score = _self_score(_instance_field(obj, "alignment_score"))
    return Instance(" ".join(problem.split()), steps, answer, score, dependencies)


# ---------------------------------------------------------------- verification

_NUM = r"(?<![\d.])(\d+(?:\.\d+)?|\.\d+)(?!\.?\d|,\d)"
# a number, a percentage, or a fraction of a 1, 10 or 100 scale; not the start of "3/5"
_SCORE_TOKEN = re.compile(_NUM + r"(?:\s*(%)|\s*(?:/|out\s+of)\s*(100|10|1(?:\.0+)?)(?![\d.]))?(?!\s*/\s*\d)",
                          re.IGNORECASE)
# echoed from the prompt: the range "(0.0-1.0)" and the threshold are not scores
_RANGE = re.compile(r"[(\[]?\s*(?:from\s+|between\s+)?(?<![\d.])0(?:\.0+)?\s*(?:-|–|—|to|and)\s*"
                    r"1(?:\.0+)?(?![\d.])\s*[)\]]?|\[\s*0(?:\.0+)?\s*,\s*1(?:\.0+)?\s*\]", re.IGNORECASE)
_THRESHOLD_GAP = (r"(?:[\s:=(_\-\"']|(?<![a-z])(?:the|a|an|of|is|score|threshold|minimum|required|passing|"
                  r"value)(?![a-z]))*")
_THRESHOLD = re.compile(r"(?<![-=])(?:>=|<=|≥|≤|⩾|⩽|>|<)\s*" + _NUM
                        + r"|(?<![a-z])(?:threshold|cut-?off|minimum|min|required|passing|at\s+least|"
                        r"at\s+most|above|below|exceeds?|exceeding|under|over|(?:greater|less|more)\s+than)"
                        r"(?![a-z])" + _THRESHOLD_GAP + _NUM, re.IGNORECASE)
_SCORE_LABEL = re.compile(r"(?<![a-z])(?:scores?|alignment|rating|rated)(?![a-z])", re.IGNORECASE)
# a number after one of these words is an item or a count, not the score
_NOT_A_SCORE = re.compile(r"(?<![a-z])(?:items?|questions?|q|steps?|problems?|parts?|nodes?|edges?|"
                          r"criteri(?:on|a)|points?)(?![a-z])|[{\[\d]", re.IGNORECASE)
_ITEM_4 = re.compile(r"^[ \t>#\-]*(?:\(4\)|4[ \t]*[.):])[ \t:=\-–—]*(.*)$", re.MULTILINE)
_LONE_SCORE = re.compile(r"^[ \t>\-]*(\S[^\n]*?)[ \t]*\.?[ \t]*$", re.MULTILINE)
_THRESHOLD_KEY = re.compile(r"min|threshold|cut|required|pass", re.IGNORECASE)
_VERDICT_LABELLED = re.compile(r"(?<![a-z])(?:verdict|result|decision|outcome|conclusion|output|status)"
                               r"[^\w\n]{0,6}(pass(?:ed|es)?|fail(?:ed|s)?)(?![a-z])", re.IGNORECASE)
_VERDICT_WORD = re.compile(r"(?<![A-Za-z])(PASS(?:ED|ES)?|FAIL(?:ED|S)?)(?![A-Za-z])")
_VERDICT_ECHO = re.compile(r"PASS\s*(?:/|or|\|)\s*FAIL|FAIL\s*(?:/|or|\|)\s*PASS|\boutput\s+(?:PASS|FAIL)\b",
                           re.IGNORECASE)


@dataclass
class Verification:
    score: float
    verdict: str | None


def _token_value(match: re.Match) -> float:
    value = float(match.group(1))
    if match.group(2):
        return value / 100
    if match.group(3):
        return value / float(match.group(3))
    return value


def _number(value) -> float | None:
    """A JSON value as a number: a number, or a string holding only a score token."""
    if isinstance(value, bool):
        return None
    if isinstance(value, (int, float)):
        return float(value)
    if isinstance(value, str):
        match = _SCORE_TOKEN.fullmatch(value.strip())
        if match:
            return _token_value(match)
        try:
            return float(value)
        except ValueError:
            return None
    return None


def _plain(text: str) -> str:
    """The reply without markdown emphasis, the echoed range, and thresholds."""
    text = text.replace("`", "").replace("*", "").replace("__", "")
    text = _RANGE.sub(" ", text)
    return _THRESHOLD.sub(" ", text)


def _line_at(text: str, pos: int) -> str:
    start = text.rfind("\n", 0, pos) + 1
    end = text.find("\n", pos)
    return text[start:end if end != -1 else len(text)].strip()[:60]


def _labelled_scores(plain: str):
    """(value, line) of each number after "score" or "alignment" (on its line, or alone on the next);
    the value is None where a number follows that is no score token (``4/5``)."""
    for label in _SCORE_LABEL.finditer(plain):
        end = plain.find("\n", label.end())
        end = len(plain) if end == -1 else end
        rest = plain[label.end():end]
        if not re.search(r"[A-Za-z0-9]", rest):  # "Score:" alone on its line, the value below it
            below = plain.find("\n", end + 1)
            rest += "\n" + plain[end + 1:below if below != -1 else len(plain)]
        digit = re.search(r"\d", rest)
        if digit is None or digit.start() > 45 or _NOT_A_SCORE.search(rest[:digit.start()]):
            continue
        token = _SCORE_TOKEN.match(rest, digit.start() - (rest[digit.start() - 1:digit.start()] == "."))
        yield (_token_value(token) if token else None), _line_at(plain, label.start())


def _item_4_scores(plain: str):
    """(value, line) of item 4 of the paper's numbered list when it opens with a number."""
    for item in _ITEM_4.finditer(plain):
        content = item.group(1)
        token = _SCORE_TOKEN.match(content)
        if token is None:
            continue
        tail = content[token.end():]
        if re.search(r"[.%/]|out", token.group(0)) or re.match(r"\s*(?:$|[^\w\s]|PASS|FAIL)", tail):
            yield _token_value(token), _line_at(plain, item.start())


def _lone_scores(plain: str):
    """(value, line) of each line holding only a decimal number or a percentage."""
    for line in _LONE_SCORE.finditer(plain):
        token = _SCORE_TOKEN.fullmatch(line.group(1))
        if token and re.search(r"[.%/]|out", token.group(0)):
            yield _token_value(token), line.group(0).strip()


def _json_scores(value, path: str = ""):
    """(value, field) of every JSON field named like a score (not a threshold), or "4"."""
    if isinstance(value, list):
        for item in value:
            yield from _json_scores(item, path)
    elif isinstance(value, dict):
        for key, item in value.items():
            name = str(key).strip()
            if isinstance(item, (dict, list)):
                yield from _json_scores(item, f"{path}{name}.")
            elif name == "4" or ("score" in name.lower() and not _THRESHOLD_KEY.search(name)):
                number = _number(item)
                if number is not None:
                    yield number, f'"{path}{name}": {json.dumps(item)}'


def _score_candidates(text: str) -> list[tuple[float, str]]:
    plain = _plain(text)
    found = list(_labelled_scores(plain)) + list(_item_4_scores(plain)) + list(_lone_scores(plain))
    for obj in json_objects(text)[0]:
        found += list(_json_scores(obj))
    return found


def _the_score(text: str, verdict: str | None) -> float:
    found = _score_candidates(text)
    valid = [(v, where) for v, where in found if v is not None and 0.0 <= v <= 1.0]
    distinct = {}
    for value, where in valid:
        distinct.setdefault(round(value, 9), where)
    if len(distinct) > 1:
        shown = "; ".join(f"{v:g} ({where!r})" for v, where in distinct.items())
        raise MalformedOutput(f"verification reply gives different scores: {shown}; expected one")
    if distinct:
        return next(iter(distinct))
    if found:
        value, where = found[0]
        if value is None:
            raise MalformedOutput(f"verification reply: the score in {where!r} is not a number in [0, 1], "
                                  "a percentage or a fraction of 1, 10 or 100")
        raise MalformedOutput(f"verification reply: score {value:g} ({where!r}) is not in [0, 1]; "
                              "expected a number such as 0.92 or a percentage such as 92%")
    says = f"; it says {verdict}" if verdict else ""
    raise MalformedOutput("no structural alignment score in the verification reply (expected item 4 of "
                          f"the numbered list, a 'Score: <number>' line or a JSON 'score' field){says}")


def _the_verdict(text: str) -> str | None:
    """PASS or FAIL: the labelled verdict if any (two different ones are ambiguous), else the
    capitalised word if only one is used; None when the reply states none or both."""
    plain = _VERDICT_ECHO.sub(" ", text.replace("*", "").replace("`", ""))
    labelled = {m.group(1)[:4].upper() for m in _VERDICT_LABELLED.finditer(plain)}
    if len(labelled) > 1:
        raise MalformedOutput("verification reply gives both verdicts, PASS and FAIL; expected one")
    if labelled:
        return labelled.pop()
    words = {m.group(1)[:4] for m in _VERDICT_WORD.finditer(plain)}
    return words.pop() if len(words) == 1 else None


def parse_verification(text: str) -> Verification:
    """The structural alignment score in [0, 1], and PASS/FAIL if stated (module docstring)."""
    if not isinstance(text, str) or not text.strip():
        raise MalformedOutput("empty verification reply")
    text = without_thinking(text)
    verdict = _the_verdict(text)
    return Verification(_the_score(text, verdict), verdict)
