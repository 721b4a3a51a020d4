"""Lesson 02's exercises and its coding puzzle: what each answer must equal, and the grader of the puzzle.

The worked answers (and a solution to the puzzle) are in ``solutions.py`` next to this file: open it when you
want them.
"""

from __future__ import annotations

import math

from ...exercises import Exercise, check_answers, check_puzzle
from .kernel import global_memory_traffic, grid_shapes, naive_forward, scores_kernel, weighted_sum_kernel, workspace_bytes

__all__ = ["EXERCISES", "check", "check_softmax_puzzle"]


def _threads_launched() -> int:
    grid, block = grid_shapes(B=2, H=8, Lq=1000, Lk=1000, D=64)["scores_kernel"]
    return math.prod(grid) * math.prod(block)


EXERCISES = (
    Exercise("exercise 1", _threads_launched,
             "Round 1000/16 up in both directions, times 256 threads per block, times B*H."),
    Exercise("exercise 2", lambda: workspace_bytes(1, 16, 16384, 16384, 64) / 2 / 2**30,
             "S alone: H * L * L float32 numbers; GiB = bytes / 2**30."),
    Exercise("exercise 3", lambda: global_memory_traffic(1, 1, 8, 8, 16)["row_softmax_kernel"]["read_requested"]
             // (4 * 8 * 8), "Count the loops over j that read scores[bh, i, j]."),
)


def check(answer_1, answer_2, answer_3) -> None:
    """Grade lesson 02's exercises (``...`` means not answered yet)."""
    check_answers(EXERCISES, answer_1, answer_2, answer_3)


def check_softmax_puzzle(row_softmax_kernel) -> None:
    """Run the three-kernel attention with the learner's softmax kernel in the middle and check the result.

    Small problems (the simulator runs one Python thread per CUDA thread): a causal one, so that row 0 sees one
    key, and one with a batch element whose keys are all masked, so that its rows see none."""
    import wb_kernels as wb

    def run():
        q, k, v = wb.random_qkv(2, 1, 12, 16, Lk=20, seed=11)
        mask = wb.random_padding_mask(2, 20, seed=12)
        mask[1] = False  # batch element 1 has no key at all: its rows must be zeros, their LSE -inf
        kernels = (scores_kernel, row_softmax_kernel, weighted_sum_kernel)
        out, lse = naive_forward(q, k, v, causal=True, key_padding_mask=mask, kernels=kernels)
        return wb.check("your softmax", out, q, k, v, lse=lse, causal=True, key_padding_mask=mask,
                        verbose=False, raise_on_failure=False)

    check_puzzle("puzzle", run, hint="Three passes over the row: its maximum, the sum of exp(s - max), "
                        "then each probability; a row whose maximum is -inf gets zeros and lse = -inf.")
