"""Worked solutions to lesson 04's exercises and its puzzle. Try them first: the lesson's check cells tell you
when you are right."""

import math

answer_1 = 16 * 17 // 2                      # 16 query tiles; query tile i computes key tiles 0..i
answer_2 = 4 * 16 * 65536 * (64 + 1) / 2**20  # O (D floats) and the LSE (1 float) per row, float32, in MiB
answer_3 = math.exp(2.0 - 5.0)               # alpha = exp(m_old - m_new)

# The puzzle's solution is the package's own step, which the lesson shows right after the puzzle
# (region online_softmax_step of online_softmax.py).
from .online_softmax import online_softmax_step  # noqa: E402,F401
