"""Lesson 02's exercises and its coding puzzle: what each answer must equal, the grader of the puzzle, and the
plausible wrong answers each must reject.

The worked answers (and a solution to the puzzle) are in ``solutions.py`` next to this file: open it when you
want them.
"""

from __future__ import annotations

import inspect
import math
from types import SimpleNamespace

import numpy as np

from ...check import check as check_against_reference
from ...inputs import random_padding_mask, random_qkv
from ... import device
from ...backend import BACKEND
from ...exercises import Exercise, Puzzle, check_answers, check_puzzle, hands_copies
from .kernel import global_memory_traffic, grid_shapes, naive_forward, scores_kernel, weighted_sum_kernel, workspace_bytes

__all__ = ["EXERCISES", "PUZZLE", "check", "check_scaled_softmax_puzzle", "puzzle_problems"]


def _threads_launched(block: int = 16) -> int:
    grid, block_shape = grid_shapes(B=2, H=8, Lq=1000, Lk=1000, D=64, block=block)["scores_kernel"]
    return math.prod(grid) * math.prod(block_shape)


def _softmax_read_mib(passes: int = 3) -> float:
    one_pass = global_memory_traffic(2, 8, 1000, 1000, 64)["row_softmax_kernel"]["read_requested"] / 3
    return passes * one_pass / 2**20


def _s_alone_gib(itemsize: int = 4) -> float:
    return workspace_bytes(2, 12, 12288, 12288, 64) / 2 / 4 * itemsize / 2**30


EXERCISES = (
    Exercise("exercise 1", _threads_launched,
             "Round 1000/16 up in both directions, times 256 threads per block, times B*H.",
             wrong={"no idle threads (not rounded up)": 2 * 8 * 1000 * 1000,
                    "rounded down": 62 * 62 * 256 * 2 * 8,
                    "forgets B": lambda: _threads_launched() // 2}),
    Exercise("exercise 2", _s_alone_gib,
             "S alone: B * H * L * L float32 numbers; GiB = bytes / 2**30.",
             wrong={"S and P": lambda: 2 * _s_alone_gib(),
                    "float16": lambda: _s_alone_gib(itemsize=2),
                    "GB, not GiB": lambda: _s_alone_gib() * 2**30 / 1e9}),
    Exercise("exercise 3", _softmax_read_mib,
             "Each pass over a row reads all of its Lk numbers; count the passes in row_softmax_kernel; "
             "MiB = bytes / 2**20.",
             wrong={"one pass": lambda: _softmax_read_mib(1), "two passes": lambda: _softmax_read_mib(2),
                    "MB, not MiB": lambda: _softmax_read_mib() * 2**20 / 1e6}),
)


def check(answer_1, answer_2, answer_3) -> None:
    """Grade lesson 02's exercises (``...`` means not answered yet)."""
    check_answers(EXERCISES, answer_1, answer_2, answer_3)


# --- the puzzle: lesson 02's softmax with the scale folded in -------------------------------------------------

class _LaunchedWithScale:
    """A scaled softmax kernel in the softmax's place in ``naive_forward``, which launches its softmax with
    ``(scores, probs, lse)``: the scale goes in between.

    The kernel gets its arrays as the front of buffers with guard rows after the last row of the last (batch,
    head): a thread past the last row that reads and writes anyway (no ``if i >= scores.shape[1]: return``) raises
    IndexError on the simulator; a GPU checks no bounds, and its writes land in the guard rows, which ``overran``
    then reports."""

    def __init__(self, kernel, scale):
        self.kernel, self.scale = kernel, np.float32(scale)
        self.overran = False

    def __getitem__(self, config):
        launch = self.kernel[config]
        grid, block = config[0], config[1]
        # rows of one (batch, head) the grid's threads cover: the launcher's grid is (B*H, row blocks)
        rows_launched = grid[1] * (block if isinstance(block, int) else block[0])

        def launch_with_scale(scores, probs, lse):
            scores, probs, lse = (_as_buffer(x) for x in (scores, probs, lse))
            shape, guard = tuple(scores.shape), rows_launched * scores.shape[2]
            size = shape[0] * shape[1] * shape[2]
            padded = device.zeros((size + guard,))  # guard rows of scores: 0, a finite score
            padded[:size] = scores.reshape(-1)
            # NaN where the kernel writes nothing (not an earlier run's right answer), in the guard rows too
            padded_probs, padded_lse = device.empty((size + guard,)), device.empty((size // shape[2] + rows_launched,))
            padded_probs[...] = np.nan
            padded_lse[...] = np.nan
            front = (padded[:size].reshape(shape), padded_probs[:size].reshape(shape),
                     padded_lse[:size // shape[2]].reshape(shape[:2]))
            view = device.kernel_view
            launch(view(front[0]), self.scale, view(front[1]), view(front[2]))
            probs[...] = front[1]
            lse[...] = front[2]
            guards = (padded_probs[size:], padded_lse[size // shape[2]:])
            self.overran |= not all(bool((guard != guard).all()) for guard in guards)  # still all NaN?
        return launch_with_scale


def _as_buffer(view):
    """The buffer behind a kernel view: a torch CUDA tensor on a GPU (zero copy), the NumPy array itself on the
    simulator."""
    if BACKEND.is_gpu:
        import torch

        return torch.as_tensor(view, device="cuda")
    return view


def puzzle_problems():
    """The grader's problems, (q, k, v, causal, key_padding_mask, scale) each, small for the simulator:

    - Lq = 12 < Lk = 20 with the bottom-right causal mask, so the last row sees every key; inputs of std 20, so
      the scaled scores reach the thousands (exp overflows past ~88.7 in float32, ~709.8 in float64); batch
      element 1 has all its keys masked (its rows give zeros and LSE -inf);
    - Lq = 20 > Lk = 16, top-left causal, ordinary scores (std 1, scale 0.3) and a padding mask: every key
      carries weight in several rows, so a key left out or a sum divided too early shows."""
    q, k, v = random_qkv(2, 1, 12, 16, Lk=20, seed=11, std=20.0)
    mask = np.ones((2, 20), dtype=bool)
    mask[1] = False
    large = (q, k, v, "bottom_right", mask, 1 / math.sqrt(16))
    q, k, v = random_qkv(2, 1, 20, 16, Lk=16, seed=12)
    mask = random_padding_mask(2, 16, seed=12, keep_fraction=0.9)
    mask[0] = True
    ordinary = (q, k, v, True, mask, 0.3)
    return [large, ordinary]


@hands_copies
def check_scaled_softmax_puzzle(scaled_softmax_kernel) -> None:
    """Run the three-kernel attention with the learner's softmax kernel in the middle (``scores_kernel`` launched
    with scale 1, the learner's kernel given the scale) and hold the output and LSE to the float64 reference."""
    def run():
        for q, k, v, causal, mask, scale in puzzle_problems():
            softmax = _LaunchedWithScale(scaled_softmax_kernel, scale)
            kernels = (scores_kernel, softmax, weighted_sum_kernel)
            try:
                out, lse = naive_forward(q, k, v, causal=causal, key_padding_mask=mask, scale=1.0, kernels=kernels)
            except (ArithmeticError, ValueError):  # the simulator's math.exp/log raise where the GPU gives inf/NaN
                return SimpleNamespace(passed=False)
            except IndexError:  # the simulator checks bounds: a thread read or wrote past an array's end
                return _overran("on the simulator your kernel read or wrote past the end of an array (IndexError)")
            if softmax.overran:  # a GPU checks no bounds: the guard rows past the last row show it
                return _overran("your kernel wrote past the last row of its arrays")
            result = check_against_reference("your softmax", out, q, k, v, lse=lse, causal=causal, key_padding_mask=mask,
                              scale=scale, verbose=False, raise_on_failure=False)
            if not result.passed:
                return result
        return result

    check_puzzle("puzzle", run, hint=_PUZZLE_HINT)


def _overran(what: str):
    """The verdict of a kernel that went past its arrays: its output was never compared."""
    return SimpleNamespace(passed=False, reason=f"{what}: a thread whose row i is past the last one "
                                                "(i >= scores.shape[1]) must return before it reads or writes.")


_PUZZLE_HINT = ("Scale each score where you read it; three passes over the row: the maximum of the scaled row, the "
                "sum of exp(scale*s - max), then each probability; a row whose maximum is -inf gets zeros and "
                "lse = -inf.")


def _solution_with(*edits):
    """The puzzle's solution with a learner's mistake put in: each (old, new) edit of its source must apply."""
    from numba import cuda, float32

    from . import solutions

    source = inspect.getsource(solutions.scaled_row_softmax_kernel.py_func)
    for old, new in edits:
        assert old in source, f"the solution no longer holds {old!r}: update this wrong answer"
        source = source.replace(old, new)
    namespace = {"cuda": cuda, "float32": float32, "math": math}
    exec(source, namespace)
    return namespace["scaled_row_softmax_kernel"]


_GUARD = """    if row_max == -math.inf:  # the row sees no key: output 0, LSE -inf (never 0/0 = NaN)
        for j in range(n):
            probs[bh, i, j] = 0.0
        lse[bh, i] = -math.inf
        return
"""
_SUM_THEN_DIVIDE = """        total += math.exp(scale * scores[bh, i, j] - row_max)
    for j in range(n):  # pass 3: the probabilities
        probs[bh, i, j] = math.exp(scale * scores[bh, i, j] - row_max) / total"""
_DIVIDE_WHILE_SUMMING = """        total += math.exp(scale * scores[bh, i, j] - row_max)
        probs[bh, i, j] = math.exp(scale * scores[bh, i, j] - row_max) / total"""

PUZZLE = Puzzle(
    check=check_scaled_softmax_puzzle,
    solution="scaled_row_softmax_kernel",
    wrong={  # each builds the kernel a learner might write: the solution with one mistake
        "no max subtracted: exp overflows": lambda: _solution_with(
            (" - row_max)", ")"), ("row_max + math.log(total)", "math.log(total)")),
        "off by one: range(n - 1) misses the last key": lambda: _solution_with(("range(n)", "range(n - 1)")),
        "reads only keys 0..9": lambda: _solution_with(("range(n)", "range(min(n, 10))")),
        "no guard for a row that sees no key": lambda: _solution_with((_GUARD, "")),
        "divides before the sum is complete": lambda: _solution_with((_SUM_THEN_DIVIDE, _DIVIDE_WHILE_SUMMING)),
        "forgets the scale (lesson 02's kernel)": lambda: _solution_with(("scale * scores", "scores")),
        "the maximum of the unscaled row": lambda: _solution_with(
            ("max(row_max, scale * scores[bh, i, j])", "max(row_max, scores[bh, i, j])")),
        "no bounds check: threads past the last row read and write anyway": lambda: _solution_with(
            ("    if i >= scores.shape[1]:\n        return\n", "")),
        "the stub as shipped (writes nothing)": lambda: _solution_with(
            ("    n = scores.shape[2]\n", "    return\n    n = scores.shape[2]\n")),
    },
)
