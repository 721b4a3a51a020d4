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

from ...check import check as check_against_reference
from ...inputs import random_qkv
from ...reference import attention_mask, reference
from ...check import CheckResult
from ...exercises import Exercise, Puzzle, check_answers, check_puzzle, hands_copies, merged_lse_allowance
from .slider import attention_cost, cache_memory, split_weights
from .splitkv import choose_num_splits, partial_attention, split_bounds

__all__ = ["EXERCISES", "PUZZLE", "check", "check_merge_puzzle", "puzzle_inputs", "PUZZLE_SPLITS", "PUZZLE_SCALE"]

A100_SMS = 108  # exercise 1 asks for a GPU the lesson does not print: the A100's SM count (NVIDIA A100 whitepaper)

EXERCISES = (
    Exercise("exercise 1", lambda: choose_num_splits(2, 8, 8192, A100_SMS),
             "Without splitting the grid has B x Hk = 16 blocks; a wave is 2 x 108 blocks, and choose_num_splits costs "
             "each count of splits as whole waves x (keys per split + 64).",
             wrong={"the H100's answer (132 SMs), not the A100's": lambda: choose_num_splits(2, 8, 8192, 132),
                    "ceil(2 x 108 / 16): two blocks per SM, ignoring that 14 splits spill into a second wave":
                        -(-2 * A100_SMS // 16),
                    "as many splits as the 256-key minimum allows": 8192 // 256,
                    "no split: B x Hk blocks": 1}),
    Exercise("exercise 2", lambda: float(split_weights([1.0, 3.0])[0]),
             "The weight of split s is exp(lse_s - lse), with lse = log(exp(1) + exp(3)).",
             wrong={"the second split's weight": lambda: float(split_weights([1.0, 3.0])[1]),
                    "exp(lse_1 - max lse), not divided by the sum": math.exp(1.0 - 3.0),
                    "the LSEs' own ratio, 1 / (1 + 3)": 0.25,
                    "a plain average of the splits": 0.5}),
    Exercise("exercise 3", lambda: cache_memory([1000], 1000, 64)["paged"] - 1000,
             "The sequence gets ceil(1000 / 64) pages of 64 slots; only its last page is partly empty.",
             wrong={"the slots used in the last page, 1000 % 64": 1000 % 64,
                    "the pages, ceil(1000 / 64)": -(-1000 // 64),
                    "the slots reserved, not the empty ones": lambda: cache_memory([1000], 1000, 64)["paged"]}),
    Exercise("exercise 4", lambda: attention_cost(1, 32, 1, 1, 256, 128, 2)["intensity"],
             "FLOPs: 4 H Lk D. Bytes: K and V, 2 Hk Lk D x 2 bytes, plus q and the output, 2 H D x 2 bytes: here q "
             "and the output are an eighth of the cache.",
             wrong={"q and the output left out": lambda: (lambda c: c["flops"] / c["kv_bytes"])(
                        attention_cost(1, 32, 1, 1, 256, 128, 2)),
                    "q counted, the output left out": lambda: (lambda c: c["flops"] / (c["kv_bytes"] + c["q_out_bytes"]
                                                                                          / 2))(
                        attention_cost(1, 32, 1, 1, 256, 128, 2)),
                    "one byte per number": lambda: (lambda c: 2 * c["intensity"])(attention_cost(1, 32, 1, 1, 256, 128,
                                                                                                2)),
                    "MHA's one FLOP per byte": 1.0}),
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
    q, k, v = random_qkv(1, 1, 37, 16, dtype="float64", seed=7)
    keep = np.ones(37, dtype=bool)
    keep[0] = False
    keep[10:15] = False
    return q, k, v, keep


@hands_copies
def check_merge_puzzle(merge) -> None:
    """Split the puzzle's keys into ``PUZZLE_SPLITS`` splits, compute each split's ``(out_s, lse_s)`` with
    :func:`partial_attention`, merge them with the learner's `merge` (outs (S, rows, D), lses (S, rows) ->
    (out (rows, D), lse (rows,))) and check output and LSE against the float64 reference. Prints one line."""
    q, k, v, keep = puzzle_inputs()
    Lq, Lk = q.shape[2], k.shape[2]
    allowed = attention_mask(Lq, Lk, causal=True, key_padding_mask=keep[None])[0, 0]  # (Lq, Lk)

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
        ref = reference(q, k, v, causal=True, key_padding_mask=keep[None], scale=PUZZLE_SCALE)
        result = check_against_reference("your merge", out[None, None], q, k, v, lse=lse[None, None], causal=True,
                          key_padding_mask=keep[None], scale=PUZZLE_SCALE, ref=ref, verbose=False,
                          raise_on_failure=False)
        # the hint's formula, exp(lse_s - lse) with the merged lse, carries that lse's rounding (near a thousand:
        # ~1e-13) into every split's weight: a right merge, which the 2x rule alone would reject
        allowance = merged_lse_allowance(ref[1], v, merges=1)
        return CheckResult(result.name, result.max_err, result.tol + allowance, result.lse_err, result.lse_tol)

    check_puzzle("puzzle", run, hint="Weigh split s by exp(lse_s - lse) with lse = log(sum_s exp(lse_s)), computed "
                                     "after subtracting the largest lse_s; a split with lse_s = -inf weighs 0, and "
                                     "a row where every split is empty gives 0 and -inf, not NaN.")


# ---------------------------------------------------------------- the plausible wrong merges, as data

def _stub(outs, lses):  # the lesson's cell as shipped: only the first split is kept
    return outs[0], lses[0]


def _without_the_max(outs, lses):  # exact on paper; exp(lse) overflows at the puzzle's scores
    with np.errstate(over="ignore", invalid="ignore", divide="ignore"):
        weights = np.exp(lses)
        total = weights.sum(axis=0)
        return (weights[..., None] * outs).sum(axis=0) / total[:, None], np.log(total)


def _without_the_guard(outs, lses):  # right for every row that sees a key; NaN for the row that sees none
    with np.errstate(invalid="ignore"):
        top = lses.max(axis=0)
        weights = np.exp(lses - top)
        total = weights.sum(axis=0)
        return (weights[..., None] * outs).sum(axis=0) / total[:, None], top + np.log(total)


def _guarded(outs, lses):
    """The max and the guard in place: (top, weights exp(lse_s - top) with 0 for empty splits, their sum, seen)."""
    top = lses.max(axis=0)
    seen = np.isfinite(top)
    weights = np.exp(lses - np.where(seen, top, 0.0))
    return top, weights, weights.sum(axis=0), seen


def _weights_not_normalised(outs, lses):  # sum_s exp(lse_s - top) out_s: the division by the sum forgotten
    top, weights, total, seen = _guarded(outs, lses)
    safe = np.where(seen, total, 1.0)
    return (weights[..., None] * outs).sum(axis=0), np.where(seen, top + np.log(safe), -np.inf)


def _lse_not_updated(outs, lses):  # the output merged right, the first split's LSE passed on
    top, weights, total, seen = _guarded(outs, lses)
    safe = np.where(seen, total, 1.0)
    return np.where(seen[:, None], (weights[..., None] * outs).sum(axis=0) / safe[:, None], 0.0), lses[0]


def _max_lse_as_lse(outs, lses):  # the output merged right, the largest split's LSE taken for the row's
    top, weights, total, seen = _guarded(outs, lses)
    safe = np.where(seen, total, 1.0)
    return np.where(seen[:, None], (weights[..., None] * outs).sum(axis=0) / safe[:, None], 0.0), top


def _plain_average(outs, lses):  # every split weighs the same, empty ones included
    top, _, total, seen = _guarded(outs, lses)
    return outs.mean(axis=0), np.where(seen, top + np.log(np.where(seen, total, 1.0)), -np.inf)


def _weights_from_lse_itself(outs, lses):  # weights lse_s / sum lse_s: the log taken for the mass
    finite = np.where(np.isfinite(lses), lses, 0.0)
    total = finite.sum(axis=0)
    with np.errstate(invalid="ignore", divide="ignore"):
        out = (finite[..., None] * outs).sum(axis=0) / total[:, None]
    top, _, mass, seen = _guarded(outs, lses)
    return out, np.where(seen, top + np.log(np.where(seen, mass, 1.0)), -np.inf)


PUZZLE = Puzzle(
    check=check_merge_puzzle,
    solution="merge_partials",
    wrong={"the stub as shipped": lambda: _stub,
           "without the max: exp(lse) overflows": lambda: _without_the_max,
           "without the guard: NaN for the row that sees no key": lambda: _without_the_guard,
           "weights not normalised": lambda: _weights_not_normalised,
           "the LSE not updated (the first split's)": lambda: _lse_not_updated,
           "the largest lse_s used as the row's LSE": lambda: _max_lse_as_lse,
           "a plain average of the outputs": lambda: _plain_average,
           "weights proportional to lse_s, not exp(lse_s)": lambda: _weights_from_lse_itself},
)
