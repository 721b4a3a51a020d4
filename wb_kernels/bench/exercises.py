"""Lesson 08's exercises: what each answer must equal (computed from the package when graded).

The worked answers are in ``solutions.py`` next to this file: open it when you want them.
"""

from __future__ import annotations

from ..exercises import Exercise, check_answers
from .sweeps import attention_flops, minimum_bytes

__all__ = ["EXERCISES", "check"]

EXERCISES = (
    Exercise("exercise 1", lambda: attention_flops(4, 16, 4096, 4096, 128, causal=True) / 0.5e-3 / 1e12,
             "4*B*H*L*L*D FLOPs, halved for causal, divided by the seconds; then / 1e12.", rel=1e-3),
    Exercise("exercise 2", lambda: attention_flops(1, 1, 4096, 4096, 128, causal=False)
             / minimum_bytes(1, 1, 4096, 4096, 128, itemsize=2),
             "4*L*L*D FLOPs over 2 bytes x (q, k, v, out) = 2 * 4*L*D bytes.", rel=1e-3),
    Exercise("exercise 3", lambda: 760e12 / 2970e9, "Peak FLOP/s divided by bytes/s.", rel=1e-2),
    Exercise("exercise 4", lambda: "async",
             "0.02 ms is about the time to queue a kernel; how long would that much work take on the GPU?"),
)


def check(answer_1, answer_2, answer_3, answer_4) -> None:
    """Grade lesson 08's exercises (``...`` means not answered yet)."""
    check_answers(EXERCISES, answer_1, answer_2, answer_3, answer_4)
