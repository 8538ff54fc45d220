"""Evaluation metrics usable outside the CLI: pure functions of text, numbers and tensors.

- answers: ``extract_answer``, ``score_generation`` (choice / number / math / text kinds)
- math_answers: ``last_boxed``, ``normalize_math_answer``, strict and symbolic equality
- accuracy: ``accuracy_per_domain``, ``delta_gap``, ``accuracy_per_compute_hour``, ``mean_std``
- consistency: ``lcs``, ``gir`` (paper Sec. LCS, Appendix Definition GIR); a model's LCS is
  ``iga_ds.evaluation.consistency.lcs_of_model``
- mask: ``mask_statistics``, ``aggregate_module_stats``, ``metric_series``, ``mask_keys``

Nothing here imports torch at module load; functions that need it import it when called.
"""
from __future__ import annotations

from iga_ds.metrics.accuracy import (
    accuracy,
    accuracy_by_group,
    accuracy_per_compute_hour,
    accuracy_per_domain,
    delta_gap,
    mean_std,
)
from iga_ds.metrics.answers import (
    ANSWER_KINDS,
    Score,
    answers_match,
    extract_answer,
    infer_answer_kind,
    score_generation,
)
from iga_ds.metrics.consistency import (
    LCS_PAPER_SCALE,
    gir,
    lcs,
    lcs_paper_units,
)
from iga_ds.metrics.mask import (
    aggregate_module_stats,
    mask_keys,
    mask_statistics,
    metric_series,
)
from iga_ds.metrics.math_answers import (
    last_boxed,
    math_equal_strict,
    math_equal_symbolic,
    normalize_math_answer,
)

__all__ = [
    "ANSWER_KINDS",
    "LCS_PAPER_SCALE",
    "Score",
    "accuracy",
    "accuracy_by_group",
    "accuracy_per_compute_hour",
    "accuracy_per_domain",
    "aggregate_module_stats",
    "answers_match",
    "delta_gap",
    "extract_answer",
    "gir",
    "infer_answer_kind",
    "last_boxed",
    "lcs",
    "lcs_paper_units",
    "mask_keys",
    "mask_statistics",
    "math_equal_strict",
    "math_equal_symbolic",
    "mean_std",
    "metric_series",
    "normalize_math_answer",
    "score_generation",
]
