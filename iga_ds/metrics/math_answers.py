"""MATH-style answers: the last ``\\boxed{...}``, the usual string normalization, symbolic equality.

The normalization follows the equivalence check published with MATH (Hendrycks et al., 2021,
"Measuring Mathematical Problem Solving With the MATH Dataset", ``is_equiv``/``strip_string``):
strip spaces, units, ``\\left``/``\\right``, degrees, dollar signs; unify ``\\dfrac``/``\\tfrac``;
add braces to ``\\frac12`` and ``\\sqrt3``; turn ``a/b`` into ``\\frac{a}{b}``. Two answers are
*strictly* equal when their normalized strings are equal.

The *symbolic* score also accepts answers that differ in form but not in value (``0.5`` and
``\\frac{1}{2}``, ``2\\sqrt{2}`` and ``\\sqrt{8}``, ``x+1`` and ``1+x``). It translates the
common LaTeX subset to SymPy and compares values at a few random points, which is cheap and
never hangs the way ``simplify`` can on odd input. Anything it cannot parse falls back to the
strict result, so symbolic >= strict always.
"""
from __future__ import annotations

import math
import random
import re

_BOXED_COMMANDS = ("\\boxed", "\\fbox")


def last_boxed(text: str) -> str | None:
    """The content of the last ``\\boxed{...}`` (or ``\\fbox{...}``, ``\\boxed 5``), braces balanced."""
    if not text:
        return None
    start = max(text.rfind(cmd) for cmd in _BOXED_COMMANDS)
    if start < 0:
        return None
    cmd = next(c for c in _BOXED_COMMANDS if text.startswith(c, start))
    rest = text[start + len(cmd):]
    if rest.startswith(" "):  # "\boxed 5": the argument runs to the next space or dollar
        match = re.match(r" +([^\s$]+)", rest)
        return match.group(1) if match else None
    if not rest.startswith("{"):
        return None
    depth = 0
    for i, ch in enumerate(rest):
        if ch == "{":
            depth += 1
        elif ch == "}":
            depth -= 1
            if depth == 0:
                return rest[1:i]
    return None  # unbalanced: the generation was cut off inside the box


def _fix_fracs(s: str) -> str:
    """``\\frac12`` -> ``\\frac{1}{2}``, ``\\frac1{2}`` -> ``\\frac{1}{2}``."""
    parts = s.split("\\frac")
    out = parts[0]
    for part in parts[1:]:
        out += "\\frac"
        if not part or part[0] == "{":
            out += part
            continue
        if len(part) < 2:
            return s
        a, b, tail = part[0], part[1], part[2:]
        if b == "{":
            out += "{" + a + "}" + b + tail
        else:
            out += "{" + a + "}{" + b + "}" + tail
    return out


def _fix_slash(s: str) -> str:
    """``3/4`` -> ``\\frac{3}{4}`` for two plain integers only."""
    match = re.fullmatch(r"(-?\d+)/(\d+)", s)
    return f"\\frac{{{match.group(1)}}}{{{match.group(2)}}}" if match else s


def _fix_sqrt(s: str) -> str:
    return re.sub(r"\\sqrt(\w)", r"\\sqrt{\1}", s)


def normalize_math_answer(answer: str) -> str:
    """The MATH normalization of an answer string (see module docstring)."""
    s = str(answer).strip()
    s = s.replace("\n", "").replace("\\!", "")
    s = s.replace("\\\\", "\\")
    s = s.replace("tfrac", "frac").replace("dfrac", "frac")
    s = s.replace("\\left", "").replace("\\right", "")
    s = s.replace("^{\\circ}", "").replace("^\\circ", "")
    s = s.replace("\\$", "").replace("$", "")
    # units written as text: "5 \text{ cm}" -> "5"
    s = re.sub(r"\\(?:text|mbox|mathrm)\{\s*[a-zA-Z ]*\}$", "", s).strip()
    s = re.sub(r"\\(?:text|mbox|mathrm)\{(.*?)\}", r"\1", s)
    s = s.replace("\\%", "").replace("%", "")
    s = s.replace(" .", " 0.").replace("{.", "{0.")
    if s.startswith("."):
        s = "0" + s
    # "x = 5" -> "5" when the left side is a short variable name
    if s.count("=") == 1:
        left, right = s.split("=")
        if len(left.strip()) <= 2:
            s = right
    s = _fix_sqrt(s)
    s = s.replace(" ", "")
    s = _fix_fracs(s)
    if s == "0.5":
        s = "\\frac{1}{2}"
    s = _fix_slash(s)
    s = s.rstrip(".")
    return s


def math_equal_strict(pred: str | None, gold: str) -> bool:
    if pred is None:
        return False
    return normalize_math_answer(pred) == normalize_math_answer(gold)


# ---------------------------------------------------------------------------------------------
# symbolic comparison


def _braced(s: str, i: int) -> tuple[str, int]:
    """The balanced ``{...}`` group starting at s[i] == '{': (content, index after it)."""
    depth = 0
    for j in range(i, len(s)):
        if s[j] == "{":
            depth += 1
        elif s[j] == "}":
            depth -= 1
            if depth == 0:
                return s[i + 1:j], j + 1
    raise ValueError("unbalanced braces")


def latex_to_sympy_text(s: str) -> str:
    """Translate the LaTeX subset used in final answers to SymPy's input syntax."""
    out: list[str] = []
    i = 0
    while i < len(s):
        if s.startswith("\\frac", i):
            num, i = _braced(s, i + 5)
            den, i = _braced(s, i)
            out.append(f"(({latex_to_sympy_text(num)})/({latex_to_sympy_text(den)}))")
        elif s.startswith("\\sqrt[", i):
            close = s.index("]", i)
            root = s[i + 6:close]
            arg, i = _braced(s, close + 1)
            out.append(f"(({latex_to_sympy_text(arg)})**(1/({latex_to_sympy_text(root)})))")
        elif s.startswith("\\sqrt", i):
            arg, i = _braced(s, i + 5)
            out.append(f"sqrt({latex_to_sympy_text(arg)})")
        elif s[i] == "{":
            arg, i = _braced(s, i)
            out.append(f"({latex_to_sympy_text(arg)})")
        elif s[i] == "^":
            out.append("**")
            i += 1
        elif s[i] == "\\":
            match = re.match(r"\\([a-zA-Z]+)", s[i:])
            if not match:
                raise ValueError(f"stray backslash in {s!r}")
            name = match.group(1)
            replacement = {
                "pi": "pi", "cdot": "*", "times": "*", "infty": "oo", "div": "/",
                "sin": "sin", "cos": "cos", "tan": "tan", "log": "log", "ln": "log", "exp": "exp",
            }.get(name)
            if replacement is None:
                raise ValueError(f"unsupported command \\{name}")
            out.append(f" {replacement} " if replacement.isalpha() else replacement)
            i += match.end()
        else:
            out.append(s[i])
            i += 1
    return "".join(out)


def _split_top_level(s: str) -> list[str]:
    """Split a tuple or list answer ``(1,2)`` / ``1,2`` on commas outside brackets."""
    body = s
    if len(s) >= 2 and s[0] in "([" and s[-1] in ")]":
        body = s[1:-1]
    parts, depth, current = [], 0, []
    for ch in body:
        if ch in "([{":
            depth += 1
        elif ch in ")]}":
            depth -= 1
        if ch == "," and depth == 0:
            parts.append("".join(current))
            current = []
        else:
            current.append(ch)
    parts.append("".join(current))
    return parts


def _to_sympy(s: str):
    from sympy.parsing.sympy_parser import (
        convert_xor,
        implicit_multiplication_application,
        parse_expr,
        standard_transformations,
    )

    text = latex_to_sympy_text(s)
    transformations = standard_transformations + (implicit_multiplication_application, convert_xor)
    return parse_expr(text, transformations=transformations, evaluate=True)


def _values_agree(a, b, trials: int = 4, rel_tol: float = 1e-6) -> bool:
    """Numerical identity test: equal at a few random points (and both free of the same symbols)."""
    symbols = sorted(a.free_symbols | b.free_symbols, key=str)
    rng = random.Random(0)  # fixed so the score of an answer never changes between runs
    for _ in range(trials if symbols else 1):
        point = {sym: rng.uniform(0.5, 2.5) for sym in symbols}
        va, vb = complex(a.evalf(subs=point)), complex(b.evalf(subs=point))
        if not all(math.isfinite(x) for x in (va.real, va.imag, vb.real, vb.imag)):
            return False
        if abs(va - vb) > rel_tol * max(1.0, abs(va), abs(vb)):
            return False
    return True


def math_equal_symbolic(pred: str | None, gold: str) -> bool:
    """True when strictly equal or equal in value after translation to SymPy."""
    if pred is None:
        return False
    if math_equal_strict(pred, gold):
        return True
    a, b = normalize_math_answer(pred), normalize_math_answer(gold)
    if not a or not b or len(a) > 200 or len(b) > 200:
        return False
    parts_a, parts_b = _split_top_level(a), _split_top_level(b)
    if len(parts_a) != len(parts_b):
        return False
    try:
        return all(_values_agree(_to_sympy(x), _to_sympy(y)) for x, y in zip(parts_a, parts_b))
    except Exception:  # noqa: BLE001 - any parse or evaluation failure means "not shown equal"
        return False
