"""Lesson 01's exercises: what each answer must equal (computed from the package when graded).

The worked answers are in ``solutions.py`` next to this file: open it when you want them.
"""

from __future__ import annotations

import numpy as np

from ...exercises import Exercise, check_answers
from .slider import attention_probabilities, materialized_bytes

__all__ = ["EXERCISES", "check"]


def _causal_pairs(L: int) -> int:
    ones = np.ones((1, 1, L, 1))
    return int(attention_probabilities(ones, ones, causal=True).astype(bool).sum())


EXERCISES = (
    Exercise("exercise 1", lambda: materialized_bytes(8192, B=8, H=32, itemsize=2) / 2**30,
             "Two matrices, B*H*L*L entries each, 2 bytes per float16; GiB = bytes / 2**30."),
    Exercise("exercise 2", lambda: float(np.log(np.finfo(np.float16).max)),
             "Take the natural log of float16's largest finite value.", rel=1e-3),
    Exercise("exercise 3", lambda: _causal_pairs(1000), "Row i sees keys 0..i."),
)


def check(answer_1, answer_2, answer_3) -> None:
    """Grade lesson 01's exercises (``...`` means not answered yet)."""
    check_answers(EXERCISES, answer_1, answer_2, answer_3)
