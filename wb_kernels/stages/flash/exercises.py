"""Lesson 04's exercises and its coding puzzle: what each answer must equal, and the grader of the puzzle.

The worked answers (and a solution to the puzzle) are in ``solutions.py`` next to this file: open it when you
want them.
"""

from __future__ import annotations

import math

import numpy as np

from ...check import CheckResult
from ...exercises import Exercise, check_answers, check_puzzle
from .kernel import STAGE
from .online_softmax import blockwise_attention
from .slider import causal_work

__all__ = ["EXERCISES", "check", "check_online_softmax_puzzle"]

EXERCISES = (
    Exercise("exercise 1", lambda: causal_work(1024, 1024, 64, 64)["computed"],
             "Query tile i (0-based) sees key tiles 0..i."),
    Exercise("exercise 2", lambda: STAGE.workspace_bytes(1, 16, 65536, 65536, 64) / 2**20,
             "B*H*L rows, each with D output floats and one LSE float, 4 bytes each; MiB = bytes / 2**20."),
    Exercise("exercise 3", lambda: math.exp(2.0 - 5.0), "The rescaling factor is exp(m_old - m_new).", rel=1e-9),
)


def check(answer_1, answer_2, answer_3) -> None:
    """Grade lesson 04's exercises (``...`` means not answered yet)."""
    check_answers(EXERCISES, answer_1, answer_2, answer_3)


def check_online_softmax_puzzle(step) -> None:
    """Run FlashAttention's loop in NumPy (:func:`blockwise_attention`) with the learner's ``step`` in place of
    ``online_softmax_step`` and check its output and LSE against the float64 reference: keys in blocks of 8,
    causal, with the first key masked so that row 0 sees no key at all."""
    import wb_kernels as wb

    def run():
        q, k, v = wb.random_qkv(1, 1, 21, 16, Lk=37, dtype="float64", seed=15, std=3.0)
        keep = np.ones(37, dtype=bool)
        keep[0] = False
        out, lse, history = blockwise_attention(q[0, 0], k[0, 0], v[0, 0], block_n=8, causal=True, key_mask=keep,
                                                step=step)
        if any(np.isnan(h["l"]).any() for h in history):
            # the final division hides a NaN sum in a row without keys; the kernel would not: it has to fail here
            return CheckResult("your online softmax", math.nan, 0.0)
        return wb.check("your online softmax", out[None, None], q, k, v, lse=lse[None, None], causal=True,
                        key_padding_mask=keep[None], verbose=False, raise_on_failure=False)

    check_puzzle("puzzle", run, hint="The new max is the larger of the old one and the block's; rescale l and "
                        "acc by exp(m_old - m_new); a row whose max is still -inf must not turn into NaN.")
