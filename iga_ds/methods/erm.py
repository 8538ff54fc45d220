"""ERM: the plain mean gradient (DeepSpeed's own path, nothing captured)."""
from __future__ import annotations

from iga_ds.methods.base import GradientMethod


class ERM(GradientMethod):
    """Empirical risk minimization (Vapnik, 1998): mean loss over all instances."""

    name = "erm"
    scope = "loss"
    paper = "Vapnik, The Nature of Statistical Learning Theory, 1998"

    def __init__(self, seed: int = 0):
        super().__init__(seed)
