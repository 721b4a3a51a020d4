"""Lesson 06's exercises and its coding puzzle: what each answer must equal, and the grader of the puzzle.

Every answer is computed from the package's models (the register budget, the instructions one warp issues, the
shared-memory banks), so none is typed twice. The puzzle, the online softmax on a warp's registers, is graded by
running the register-level model of the kernel with the learner's step and holding its output to the float64
reference with ``wb.check``: no GPU needed. The worked answers are in ``solutions.py`` next to this file: open it
when you want them.
"""

from __future__ import annotations

import numpy as np

from ...exercises import Exercise, check_answers, check_puzzle
from . import swizzle, warp_model

__all__ = ["EXERCISES", "check", "check_fragment_softmax_puzzle", "puzzle_inputs"]


def _mma_per_key_tile(head_dim: int) -> int:
    counts = warp_model.instruction_counts(head_dim)["per key tile"]
    return sum(issued for name, issued in counts.items() if name.startswith("mma.sync"))


EXERCISES = (
    Exercise("exercise 1", lambda: warp_model.registers_per_lane(128)["O accumulators (fp32)"],
             "O is 16 x D fp32 values per warp, spread evenly over its 32 lanes."),
    Exercise("exercise 2", lambda: _mma_per_key_tile(128),
             "S: (64 / 8) tiles of 16 x 8, each (D / 16) products of depth 16; P V: (D / 8) tiles, each (64 / 16)."),
    Exercise("exercise 3", lambda: swizzle.worst_wavefronts("plain", 128),
             "Rows of 256 bytes start every 2 x 128 bytes: where do the 8 rows of one 16-byte column land?"),
)


def check(answer_1, answer_2, answer_3) -> None:
    """Grade lesson 06's exercises (``...`` means not answered yet)."""
    check_answers(EXERCISES, answer_1, answer_2, answer_3)


def puzzle_inputs():
    """The puzzle's problem (torch fp16, 2 x 1 x 100 x 100, D = 64, causal): ragged key tiles; in batch 0 the
    first key is padding, so its row 0 sees no key at all; in batch 1 the first 70 keys are padding, so its rows
    see their first key only in the second tile; and a wide spread of scores (std 3), so each row's own max matters."""
    import torch

    import wb_kernels as wb

    q, k, v = wb.random_qkv(2, 1, 100, 64, dtype="float16", framework="torch", seed=6, std=3.0)
    keep = torch.ones(2, 100, dtype=torch.bool)
    keep[0, 0] = False
    keep[1, :70] = False
    return q, k, v, keep


def check_fragment_softmax_puzzle(step) -> None:
    """Run the register-level model of the kernel (``warp_model.forward``) with the learner's `step` in place of
    ``fragment_softmax_step`` and check its output and LSE against the float64 reference. Prints one line."""
    import torch

    import wb_kernels as wb

    q, k, v, keep = puzzle_inputs()

    def run():
        out, lse = warp_model.forward(q, k, v, causal=True, key_padding_mask=keep, dtype="float16",
                                      softmax_step=step)
        return wb.check("your fragment softmax", torch.from_numpy(np.asarray(out)).half(), q, k, v,
                        lse=np.asarray(lse), causal=True, key_padding_mask=keep, verbose=False,
                        raise_on_failure=False)

    check_puzzle("puzzle", run, hint="Each row's max must be the max over its four lanes (shuffle_xor with lane "
                                     "masks 1 and 2), and a row whose max is still -inf must subtract 0, not -inf.")
