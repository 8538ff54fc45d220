"""Answer extraction and exact match, including MATH's \\boxed normalization."""
from __future__ import annotations

import pytest

from iga_ds.metrics import (
    extract_answer,
    infer_answer_kind,
    last_boxed,
    math_equal_strict,
    math_equal_symbolic,
    normalize_math_answer,
    score_generation,
)


@pytest.mark.parametrize(
    "text, expected",
    [
        ("Step 1 ...\nStep 2 ...\nAnswer: C", "C"),
        ("reasoning\n**Answer:** (B).", "B"),
        ("So the answer is (D), clearly.", "D"),
        ("Option (A) fails, option (C) holds", "C"),
        ("B", "B"),
        ("Answer: A\nwait, re-check\nAnswer: D", "D"),  # the last Answer line wins
        ("I am not sure.", None),
        ("A big dog", None),  # a capital word is not an option letter
    ],
)
def test_extract_choice(text, expected):
    assert extract_answer(text, "choice") == expected


@pytest.mark.parametrize(
    "text, expected",
    [
        ("We get 12 apples, then 3 more.\nAnswer: 15", "15"),
        ("total 1,234 units", "1,234"),
        ("Answer: -3.5 meters", "-3.5"),
        ("ratio is 3/4", "3/4"),
        ("no digits here", None),
    ],
)
def test_extract_number(text, expected):
    assert extract_answer(text, "number") == expected


def test_number_match_is_numeric():
    assert score_generation("Answer: 1,000", "1000.0", "number").correct
    assert score_generation("Answer: 3/4", "0.75", "number").correct
    assert not score_generation("Answer: 1001", "1000", "number").correct


def test_last_boxed_nested_and_variants():
    assert last_boxed(r"so \boxed{1} then \boxed{\frac{1}{2}}.") == r"\frac{1}{2}"
    assert last_boxed(r"\boxed 5$") == "5"
    assert last_boxed(r"\fbox{x+1}") == "x+1"
    assert last_boxed(r"\boxed{\frac{1}{2}") is None  # cut off mid-box
    assert last_boxed("no box") is None


@pytest.mark.parametrize(
    "raw, normalized",
    [
        (r"\dfrac{1}{2}", r"\frac{1}{2}"),
        (r"\frac12", r"\frac{1}{2}"),
        ("0.5", r"\frac{1}{2}"),
        ("3/4", r"\frac{3}{4}"),
        (r"\left( 1, 2 \right)", "(1,2)"),
        (r"90^\circ", "90"),
        (r"\$5", "5"),
        (r"10\%", "10"),
        (r"5 \text{ cm}", "5"),
        ("x = 7", "7"),
        (r"\sqrt3", r"\sqrt{3}"),
        (".25", "0.25"),
        (".5", r"\frac{1}{2}"),
    ],
)
def test_math_normalization(raw, normalized):
    assert normalize_math_answer(raw) == normalized


def test_math_strict_vs_symbolic():
    # same string after normalization: both scores agree
    assert math_equal_strict(r"\dfrac{1}{2}", "0.5")
    # equal value, different form: only the symbolic score accepts it
    assert not math_equal_strict(r"2\sqrt{2}", r"\sqrt{8}")
    assert math_equal_symbolic(r"2\sqrt{2}", r"\sqrt{8}")
    assert math_equal_symbolic("x+1", "1+x")
    assert math_equal_symbolic(r"\frac{\pi}{2}", r"\pi/2")
    assert math_equal_symbolic("(1,2)", r"\left(1, 2\right)")
    assert not math_equal_symbolic(r"\sqrt{2}", "1.4142")
    assert not math_equal_symbolic("x+2", "x+1")
    assert not math_equal_symbolic("(1,2)", "(1,2,3)")
    assert not math_equal_symbolic(r"\unknowncmd{3}", "3")  # unparsable: not shown equal
    assert not math_equal_symbolic(None, "3")


def test_score_math_uses_last_box():
    out = r"First \boxed{3}. Actually the result is $\boxed{\dfrac{3}{6}}$."
    s = score_generation(out, r"\frac{1}{2}", "math")
    assert s.prediction == r"\dfrac{3}{6}"
    assert not s.correct and s.correct_symbolic


def test_infer_kind():
    assert infer_answer_kind("C") == "choice"
    assert infer_answer_kind("42") == "number"
    assert infer_answer_kind(r"\frac{1}{2}") == "math"
    assert infer_answer_kind("liable") == "text"


def test_text_answers_ignore_case_and_punctuation():
    assert score_generation("...\nAnswer: Not Liable.", "not liable", "text").correct
    assert not score_generation("...\nAnswer: liable", "not liable", "text").correct
