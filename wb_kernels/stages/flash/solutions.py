"""Worked solutions to lesson 04's exercises and its puzzle. Try them first: the lesson's check cells tell you
when you are right."""

import math

answer_1 = 16 * 17 // 2                        # 16 query tiles; query tile i computes key tiles 0..i
answer_2 = 4 * 2 * 32 * 32768 * (128 + 1) / 2**20  # O (D floats) and the LSE (1 float) per row, float32, in MiB
answer_3 = math.exp(2.0 - 5.0)                 # alpha = exp(m_old - m_new)

# The puzzle's solution is the package's own step (region online_softmax_step of online_softmax.py): the new max,
# a "safe" max of 0 for a row that has seen no key yet, alpha = exp(m_old - m_new), and l and acc both rescaled.
from .online_softmax import online_softmax_step  # noqa: E402,F401
