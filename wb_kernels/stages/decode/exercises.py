"""Lesson 07's exercises and its coding puzzle: what each answer must equal, and the grader of the puzzle.

Every answer is computed from the package (the split choice, the merge's weights, the cache's pages, the bytes a
decode step moves), so none is typed twice. The puzzle, the merge of split-KV's partial results, is graded by
running the split-KV model of ``splitkv.py`` with the learner's merge and holding its output and LSE to the float64
reference with ``wb.check``: no GPU needed. The worked answers are in ``solutions.py`` next to this file: open it
when you want them.
"""

from __future__ import annotations

import math

import numpy as np

from ...check import CheckResult
from ...exercises import Exercise, check_answers, check_puzzle
from .slider import attention_cost, cache_memory, split_weights
from .splitkv import choose_num_splits, partial_attention, split_bounds

__all__ = ["EXERCISES", "check", "check_merge_puzzle", "puzzle_inputs", "PUZZLE_SPLITS", "PUZZLE_SCALE"]

EXERCISES = (
    Exercise("exercise 1", lambda: choose_num_splits(1, 8, 4096, 132),
             "Two blocks per SM would take ceil(2 x 132 / (1 x 8)) splits; no split may hold fewer than 256 keys."),
    Exercise("exercise 2", lambda: float(split_weights([1.0, 3.0])[0]),
             "The weight of split s is exp(lse_s - lse), with lse = log(exp(1) + exp(3)).", rel=1e-6),
    Exercise("exercise 3", lambda: cache_memory([1000], 1000, 16)["paged"] - 1000,
             "The sequence gets ceil(1000 / 16) pages of 16 slots; only its last page is partly empty."),
    Exercise("exercise 4", lambda: attention_cost(1, 32, 8, 1, 4096, 64, 2)["intensity"],
             "FLOPs: 4 H Lk D. Bytes: K and V, 2 Hk Lk D x 2 bytes, plus q and the output, 2 H D x 2 bytes.",
             rel=1e-2),
)


def check(answer_1, answer_2, answer_3, answer_4) -> None:
    """Grade lesson 07's exercises (``...`` means not answered yet)."""
    check_answers(EXERCISES, answer_1, answer_2, answer_3, answer_4)


PUZZLE_SPLITS = 8
PUZZLE_SCALE = 120.0  # scores up to about a thousand: exp(lse) overflows float64, as a merge must not


def puzzle_inputs():
    """The puzzle's problem (float64, one head, 37 queries and keys, D = 16, causal): key 0 is padding, so row 0
    sees no key at all; keys 10-14 are padding, so split 2 (keys 10-14 of 8 splits of 5) is empty for every row; the
    early rows see only the first splits; and a large scale puts some LSEs near a thousand."""
    import wb_kernels as wb

    q, k, v = wb.random_qkv(1, 1, 37, 16, dtype="float64", seed=7)
    keep = np.ones(37, dtype=bool)
    keep[0] = False
    keep[10:15] = False
    return q, k, v, keep


def check_merge_puzzle(merge) -> None:
    """Split the puzzle's keys into ``PUZZLE_SPLITS`` splits, compute each split's ``(out_s, lse_s)`` with
    :func:`partial_attention`, merge them with the learner's `merge` (outs (S, rows, D), lses (S, rows) ->
    (out (rows, D), lse (rows,))) and check output and LSE against the float64 reference. Prints one line."""
    import wb_kernels as wb

    q, k, v, keep = puzzle_inputs()
    Lq, Lk = q.shape[2], k.shape[2]
    allowed = wb.attention_mask(Lq, Lk, causal=True, key_padding_mask=keep[None])[0, 0]  # (Lq, Lk)

    def run():
        outs, lses = [], []
        for start, stop in split_bounds(Lk, PUZZLE_SPLITS):
            out_s, lse_s = partial_attention(q[0, 0], k[0, 0, start:stop], v[0, 0, start:stop], PUZZLE_SCALE,
                                             allowed[:, start:stop])
            outs.append(out_s)
            lses.append(lse_s)
        out, lse = merge(np.stack(outs), np.stack(lses))
        out, lse = np.asarray(out, dtype=np.float64), np.asarray(lse, dtype=np.float64)
        if out.shape != (Lq, q.shape[3]) or lse.shape != (Lq,) or np.isnan(out).any() or np.isnan(lse).any():
            return CheckResult("your merge", math.nan, 0.0)  # a NaN (or a wrong shape) is never right
        return wb.check("your merge", out[None, None], q, k, v, lse=lse[None, None], causal=True,
                        key_padding_mask=keep[None], scale=PUZZLE_SCALE, verbose=False, raise_on_failure=False)

    check_puzzle("puzzle", run, hint="Weigh split s by exp(lse_s - lse) with lse = log(sum_s exp(lse_s)), computed "
                                     "after subtracting the largest lse_s; a split with lse_s = -inf weighs 0, and "
                                     "a row where every split is empty gives 0 and -inf, not NaN.")
