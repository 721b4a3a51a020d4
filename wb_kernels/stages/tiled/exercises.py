"""Lesson 03's exercises and its bug hunt: what each answer must equal, and the grader of the puzzle.

The worked answers (and the fixed kernel) are in ``solutions.py`` next to this file: open it when you want them.
"""

from __future__ import annotations

import math

from ...exercises import Exercise, check_answers, check_puzzle
from .kernel import make_block_softmax_kernel, make_tiled_kernels, shared_bytes_per_block, tiled_forward

__all__ = ["EXERCISES", "check", "check_scores_puzzle"]

EXERCISES = (
    Exercise("exercise 1", lambda: 2 * 16 * 16 * math.ceil(64 / 16),
             "Each step loads one Q tile and one K tile of T*T numbers; there are D/T steps."),
    Exercise("exercise 2", lambda: shared_bytes_per_block(32)["tiled_scores_kernel"],
             "q_tile is T x T, k_tile is T x (T + 1), 4 bytes each."),
    Exercise("exercise 3", lambda: 2 * (1 + int(math.log2(128))) + 1,
             "Each reduction: one barrier after writing the partials, one per halving step; plus one in between."),
)


def check(answer_1, answer_2, answer_3) -> None:
    """Grade lesson 03's exercises (``...`` means not answered yet)."""
    check_answers(EXERCISES, answer_1, answer_2, answer_3)


def check_scores_puzzle(make_scores_kernel, tile: int = 8) -> None:
    """Run tiled attention with the learner's scores kernel (``make_scores_kernel(tile)``) and our softmax and
    weighted sum, on a problem of several tiles with both masks, and check it against the float64 reference."""
    import wb_kernels as wb

    def run():
        q, k, v = wb.random_qkv(1, 2, 19, 32, Lk=21, seed=13)
        mask = wb.random_padding_mask(1, 21, seed=14)
        kernels = (make_scores_kernel(tile), make_block_softmax_kernel(16), make_tiled_kernels(tile)[1])
        out, lse = tiled_forward(q, k, v, causal=True, key_padding_mask=mask, tile=tile, softmax_threads=16,
                                 kernels=kernels)
        return wb.check("your scores kernel", out, q, k, v, lse=lse, causal=True, key_padding_mask=mask,
                        verbose=False, raise_on_failure=False)

    check_puzzle("bug hunt", run, hint="Compare the kernel with make_tiled_kernels above, line by line: "
                        "what must every thread of the block wait for before it reads a tile?")
