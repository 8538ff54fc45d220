"""Evaluation: prompts shared with training, greedy generation, ``iga-ds eval`` and ``iga-ds report``."""
