"""Lesson 03's exercises and its bug hunt: what each answer must equal, and the grader of the puzzle.

The worked answers (and the fixed kernel) are in ``solutions.py`` next to this file: open it when you want them.
"""

from __future__ import annotations

import inspect
import math
import re
from types import SimpleNamespace

from ...check import check as check_against_reference
from ...inputs import random_padding_mask, random_qkv
from ...backend import BACKEND
from ...exercises import Exercise, Puzzle, check_answers, check_puzzle, hands_copies
from .kernel import make_block_softmax_kernel, make_tiled_weighted_sum_kernel, shared_bytes_per_block, tiled_forward

__all__ = ["EXERCISES", "PUZZLE", "RACES", "check", "check_scores_puzzle"]

EXERCISES = (
    Exercise("exercise 1", lambda: 2 * 16 * 16 * math.ceil(64 / 16),
             "Each step loads one Q tile and one K tile of T*T numbers; there are D/T steps.",
             wrong={"one tile per step": 16 * 16 * 4, "one step": 2 * 16 * 16,
                    "lesson 02's loads (2D per thread)": 2 * 64 * 16 * 16}),
    Exercise("exercise 2", lambda: shared_bytes_per_block(24)["tiled_scores_kernel"],
             "q_tile is T x T, k_tile is T x (T + 1), 4 bytes each.",
             wrong={"without the padding column": 4 * 2 * 24 * 24,
                    "numbers, not bytes": 24 * 24 + 24 * 25,
                    "the table's T = 32": lambda: shared_bytes_per_block(32)["tiled_scores_kernel"]}),
    Exercise("exercise 3", lambda: 2 * (1 + int(math.log2(128))) + 1,
             "Each reduction: one barrier after writing the partials, one per halving step; plus one in between.",
             wrong={"without the one in between": 2 * (1 + 7), "halving steps only": 2 * 7,
                    "one reduction": 1 + 7}),
)


def check(answer_1, answer_2, answer_3) -> None:
    """Grade lesson 03's exercises (``...`` means not answered yet)."""
    check_answers(EXERCISES, answer_1, answer_2, answer_3)


# On a GPU the bug hunt's wrong kernels are races: whether a missing barrier shows depends on how the warps of a
# block happen to interleave, which the simulator (a Python thread per CUDA thread, switched often) does reliably and
# a GPU may not. So on a GPU the grader also runs the kernel at tile 32 (32 warps per block, each free to run ahead
# of the others), on a problem of 4 steps of the head dim (so a tile is overwritten while others may still read it)
# and 800 blocks, and launches it several times: any wrong result fails the puzzle.
_GPU_TILE, _GPU_LAUNCHES, _GPU_PROBLEM = 32, 8, (2, 4, 300, 290, 128)  # (B, H, Lq, Lk, D)


@hands_copies
def check_scores_puzzle(make_scores_kernel, tile: int = 8) -> None:
    """Run tiled attention with the learner's scores kernel (``make_scores_kernel(tile)``) and our softmax and
    weighted sum, on a problem of several tiles with both masks, and check it against the float64 reference. On a
    GPU, also :data:`_GPU_LAUNCHES` launches at tile 32 on a larger problem (see above). A kernel that raises (an
    index past an array's end on the simulator, say) is not solved either, and the verdict says what it raised."""
    def grade(q, k, v, mask, tile, softmax_threads):
        kernels = (make_scores_kernel(tile), make_block_softmax_kernel(softmax_threads),
                   make_tiled_weighted_sum_kernel(tile))
        out, lse = tiled_forward(q, k, v, causal=True, key_padding_mask=mask, tile=tile,
                                 softmax_threads=softmax_threads, kernels=kernels)
        return check_against_reference("your scores kernel", out, q, k, v, lse=lse, causal=True, key_padding_mask=mask,
                        verbose=False, raise_on_failure=False)

    def run():
        try:
            q, k, v = random_qkv(1, 2, 19, 32, Lk=21, seed=13)
            result = grade(q, k, v, random_padding_mask(1, 21, seed=14), tile, 16)
            if result.passed and BACKEND.is_gpu:
                B, H, Lq, Lk, D = _GPU_PROBLEM
                q, k, v = random_qkv(B, H, Lq, D, Lk=Lk, seed=13)
                mask = random_padding_mask(B, Lk, seed=14)
                for _ in range(_GPU_LAUNCHES):
                    result = grade(q, k, v, mask, _GPU_TILE, 128)
                    if not result.passed:
                        break
            return result
        except Exception as error:  # the learner's code raised: a verdict, not a traceback
            return SimpleNamespace(passed=False, reason=f"your kernel raised {_describe(error)}. {_HINT}")

    check_puzzle("bug hunt", run, hint=_HINT)


_HINT = ("Compare the kernel with make_tiled_scores_kernel above, line by line: what must every thread of the block "
         "wait for before it reads a tile?")


def _describe(error: Exception) -> str:
    """``IndexError (index 9 is out of bounds ...)``: the simulator's note of which thread raised dropped, so that
    the line is the same from run to run."""
    message = re.sub(r"^tid=\[[^\]]*\] ctaid=\[[^\]]*\]:\s*", "", str(error).strip()).splitlines()
    return f"{type(error).__name__} ({message[0][:160]})" if message else type(error).__name__


def _scores_kernel_with(*edits):
    """``make_tiled_scores_kernel`` with a learner's attempt put in: each (old, new) edit of its source must apply."""
    from . import kernel

    source = inspect.getsource(kernel.make_tiled_scores_kernel)
    for old, new in edits:
        assert old in source, f"make_tiled_scores_kernel no longer holds {old!r}: update this wrong answer"
        source = source.replace(old, new)
    namespace = dict(vars(kernel))
    exec(source, namespace)
    return namespace["make_tiled_scores_kernel"]


_LOADS_K = "            if j0 + ty < Lk and d0 + tx < D:\n"
_FIRST_BARRIER = "            cuda.syncthreads()  # the tiles are complete before anyone reads them\n"
_SECOND_BARRIER = "            cuda.syncthreads()  # everyone is done with the tiles before the next step overwrites them\n"

# The wrong answers below whose failure is a race (a barrier missing): the simulator shows every one of them, a GPU
# may by chance not, even with the strict grading above. Tests that run the grader on a GPU skip these labels there.
RACES = frozenset({
    "as shipped: no barrier between loading the tiles and reading them",
    "the barrier after loading q_tile only (k_tile still read half-written)",
    "the barrier moved instead of added (none after the multiply)",
    "no barrier at all",
})

PUZZLE = Puzzle(
    check=check_scores_puzzle,
    solution="make_scores_kernel",
    wrong={  # each builds the kernel factory a learner might end with
        "as shipped: no barrier between loading the tiles and reading them": lambda: _scores_kernel_with(
            (_FIRST_BARRIER, "")),
        "the barrier after loading q_tile only (k_tile still read half-written)": lambda: _scores_kernel_with(
            (_FIRST_BARRIER, ""), (_LOADS_K, _FIRST_BARRIER + _LOADS_K)),
        "the barrier moved instead of added (none after the multiply)": lambda: _scores_kernel_with(
            (_SECOND_BARRIER, "")),
        "no barrier at all": lambda: _scores_kernel_with((_FIRST_BARRIER, ""), (_SECOND_BARRIER, "")),
    },
)
