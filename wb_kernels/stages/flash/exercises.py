"""Lesson 04's exercises and its coding puzzle: what each answer must equal, the puzzle's grader, and the plausible
wrong answers each must reject (as data: ``tests/test_exercises.py`` feeds them to the graders).

The worked answers (and a solution to the puzzle) are in ``solutions.py`` next to this file: open it when you
want them.

The puzzle's problem is built so that each mistake the lesson warns about shows (:func:`puzzle_problem`): scores
beyond 710 in size, where ``exp`` overflows even in float64 (past about 709.8) unless the running max is subtracted; keys
whose scores grow along the row, so that a later block raises every row's max and whatever was accumulated must be
rescaled; and a first block of keys that is masked, so that under the causal mask rows 0 to 7 see no key at all and
every later row sees its first key only in the second block, where a third of the rows score far below 0 (a step
that carries its "no key yet" stand-in max of 0 into that block loses those rows).
"""

from __future__ import annotations

import math

import numpy as np

from ...check import check as check_against_reference
from ...inputs import random_qkv
from ...check import CheckResult
from ...exercises import Exercise, Puzzle, check_answers, check_puzzle, hands_copies
from .kernel import STAGE
from .online_softmax import blockwise_attention
from .slider import causal_work

__all__ = ["EXERCISES", "PUZZLE", "check", "check_online_softmax_puzzle", "puzzle_problem"]

EXERCISES = (
    Exercise("exercise 1", lambda: causal_work(1024, 1024, 64, 64)["computed"],
             "Query tile i (0-based) sees key tiles 0..i.",
             wrong={"every tile (no skipping)": 256, "only the tiles below the diagonal": 120,
                    "half of the tiles": 128}),
    Exercise("exercise 2", lambda: STAGE.workspace_bytes(2, 32, 32768, 32768, 128) / 2**20,
             "B*H*L rows, each with D output floats and one LSE float, 4 bytes each; MiB = bytes / 2**20.",
             wrong={"O without the LSE": 4 * 2 * 32 * 32768 * 128 / 2**20,
                    "float64 instead of float32": 8 * 2 * 32 * 32768 * 129 / 2**20,
                    "in GiB": 4 * 2 * 32 * 32768 * 129 / 2**30,
                    "B left out": 4 * 32 * 32768 * 129 / 2**20}),
    Exercise("exercise 3", lambda: math.exp(2.0 - 5.0), "The rescaling factor is exp(m_old - m_new).",
             wrong={"exp(m_new - m_old)": math.exp(3.0), "no rescaling": 1.0, "m_old / m_new": 0.4,
                    "2 ** (m_old - m_new), base 2 without log2(e)": 2.0 ** -3}),
)


def check(answer_1, answer_2, answer_3) -> None:
    """Grade lesson 04's exercises (``...`` means not answered yet)."""
    check_answers(EXERCISES, answer_1, answer_2, answer_3)


# --- the puzzle: one step of the online softmax, in NumPy ---------------------------------------------------

PUZZLE_ROWS, PUZZLE_KEYS, PUZZLE_BLOCK = 37, 37, 8


def puzzle_problem():
    """The puzzle's problem: (q, k, v, keep), float64, one head of 37 queries and 37 keys, D = 16.

    Dimension 0 of key j is 75 + 0.3 j, and of query i is 40 (-40 for every third row): with scale 1/4 it adds
    750 + 3 j to each score (or its negative), so every score lies between 710 and 900 in size, where ``exp``
    overflows (or underflows to 0) in float64, and in most rows every later block of 8 keys raises the row's max.
    Rows far apart also defeat one max shared by all rows. The other dimensions add random scores of a few units,
    so that each row's softmax spreads over several keys. The first block (keys 0 to 7) is masked: under the
    causal mask rows 0 to 7 see no key, and rows 8 on see their first key in the second block, every third of them
    with scores near -780, so a step that returns its stand-in max 0 for a row without keys (in place of -inf) and
    carries it into that block underflows those rows to a sum of 0."""
    q, k, v = random_qkv(1, 1, PUZZLE_ROWS, 16, Lk=PUZZLE_KEYS, dtype="float64", seed=15, std=1.5)
    q[..., 0] = np.where(np.arange(PUZZLE_ROWS) % 3 == 2, -40.0, 40.0)
    k[..., 0] = 75.0 + 0.3 * np.arange(PUZZLE_KEYS)
    keep = np.ones(PUZZLE_KEYS, dtype=bool)
    keep[:PUZZLE_BLOCK] = False
    return q, k, v, keep


def _puzzle_result(step) -> CheckResult:
    q, k, v, keep = puzzle_problem()
    with np.errstate(all="ignore"):  # a wrong step overflows or makes NaN: the verdict says so, not a warning
        out, lse, history = blockwise_attention(q[0, 0], k[0, 0], v[0, 0], block_n=PUZZLE_BLOCK, causal=True,
                                                key_mask=keep, step=step)
    if any(np.isnan(h["l"]).any() or np.isnan(h["m"]).any() for h in history):
        # the final division hides a NaN sum in a row without keys; the kernel would not: it has to fail here
        return CheckResult("your online softmax", math.nan, 0.0)
    return check_against_reference("your online softmax", out[None, None], q, k, v, lse=lse[None, None], causal=True,
                    key_padding_mask=keep[None], verbose=False, raise_on_failure=False)


@hands_copies
def check_online_softmax_puzzle(step) -> None:
    """Run FlashAttention's loop in NumPy (:func:`blockwise_attention`) with the learner's ``step`` in place of
    ``online_softmax_step`` on :func:`puzzle_problem` (keys in blocks of 8, causal, the first block masked) and hold
    the output and the LSE to the float64 reference."""
    check_puzzle("puzzle", lambda: _puzzle_result(step),
                 hint="The new max is the larger of the old one and the block's; rescale l and acc by "
                      "exp(m_old - m_new); a row whose max is still -inf must not turn into NaN.")


# Plausible wrong steps. Each is right on some inputs (small scores, a max that never moves, rows that all see a
# key); the puzzle's problem is built so that none of them passes.

def _no_running_max():  # exact on paper; exp(scores) overflows at these scores
    def step(m, l, acc, scores, values):
        p = np.exp(scores)
        return m, l + p.sum(axis=1), acc + p @ values
    return step


def _max_but_no_rescale():  # a rescale forgotten: the terms summed against the old max stay too large
    def step(m, l, acc, scores, values):
        new_m = np.maximum(m, scores.max(axis=1))
        safe_m = np.where(np.isfinite(new_m), new_m, 0.0)
        p = np.exp(scores - safe_m[:, None])
        return new_m, l + p.sum(axis=1), acc + p @ values
    return step


def _rescale_l_not_acc():  # the LSE comes out right, the output does not
    def step(m, l, acc, scores, values):
        new_m = np.maximum(m, scores.max(axis=1))
        safe_m = np.where(np.isfinite(new_m), new_m, 0.0)
        alpha, p = np.exp(m - safe_m), np.exp(scores - safe_m[:, None])
        return new_m, l * alpha + p.sum(axis=1), acc + p @ values
    return step


def _without_the_guard():  # right for every row that has seen a key; NaN (-inf - -inf) for the row that sees none
    def step(m, l, acc, scores, values):
        new_m = np.maximum(m, scores.max(axis=1))
        alpha, p = np.exp(m - new_m), np.exp(scores - new_m[:, None])
        return new_m, l * alpha + p.sum(axis=1), acc * alpha[:, None] + p @ values
    return step


def _safe_max_returned():  # the guarded max (0 for a row without keys) returned as m: a later block of scores far
    def step(m, l, acc, scores, values):  # below 0 is then measured against 0 and underflows to l = 0
        new_m = np.maximum(m, scores.max(axis=1))
        new_m = np.where(np.isfinite(new_m), new_m, 0.0)
        alpha, p = np.exp(m - new_m), np.exp(scores - new_m[:, None])
        return new_m, l * alpha + p.sum(axis=1), acc * alpha[:, None] + p @ values
    return step


def _alpha_inverted():  # exp(m_new - m_old): grows the old terms instead of shrinking them
    def step(m, l, acc, scores, values):
        new_m = np.maximum(m, scores.max(axis=1))
        safe_m = np.where(np.isfinite(new_m), new_m, 0.0)
        alpha = np.where(np.isfinite(m), np.exp(safe_m - m), 0.0)
        p = np.exp(scores - safe_m[:, None])
        return new_m, l * alpha + p.sum(axis=1), acc * alpha[:, None] + p @ values
    return step


def _a_key_skipped():  # the block's last key left out (an off-by-one in a range)
    def step(m, l, acc, scores, values):
        scores, values = scores[:, :-1], values[:-1]
        new_m = np.maximum(m, scores.max(axis=1))
        safe_m = np.where(np.isfinite(new_m), new_m, 0.0)
        alpha, p = np.exp(m - safe_m), np.exp(scores - safe_m[:, None])
        return new_m, l * alpha + p.sum(axis=1), acc * alpha[:, None] + p @ values
    return step


def _block_max_only():  # the block's max in place of the running max: alpha = exp(m_old - m_block) overflows
    def step(m, l, acc, scores, values):
        new_m = scores.max(axis=1)
        safe_m = np.where(np.isfinite(new_m), new_m, 0.0)
        alpha = np.exp(np.where(np.isfinite(m), m, -np.inf) - safe_m)
        p = np.exp(scores - safe_m[:, None])
        return new_m, l * alpha + p.sum(axis=1), acc * alpha[:, None] + p @ values
    return step


def _one_max_for_all_rows():  # one max for the whole block: rows far below it underflow to 0
    def step(m, l, acc, scores, values):
        new_m = np.full_like(m, max(m.max(), scores.max()))
        safe_m = np.where(np.isfinite(new_m), new_m, 0.0)
        alpha, p = np.exp(m - safe_m), np.exp(scores - safe_m[:, None])
        alpha = np.where(np.isfinite(m), alpha, 0.0)
        return new_m, l * alpha + p.sum(axis=1), acc * alpha[:, None] + p @ values
    return step


def _normalised_too_early():  # divides acc by l after every block, then rescales it as if it were not divided
    def step(m, l, acc, scores, values):
        new_m = np.maximum(m, scores.max(axis=1))
        safe_m = np.where(np.isfinite(new_m), new_m, 0.0)
        alpha, p = np.exp(m - safe_m), np.exp(scores - safe_m[:, None])
        l = l * alpha + p.sum(axis=1)
        acc = acc * alpha[:, None] + p @ values
        return new_m, l, np.divide(acc, l[:, None], out=np.zeros_like(acc), where=l[:, None] > 0)
    return step


def _the_stub():  # as the lesson ships it: the block is ignored
    return lambda m, l, acc, scores, values: (m, l, acc)


PUZZLE = Puzzle(
    check=check_online_softmax_puzzle,
    solution="online_softmax_step",
    wrong={
        "the stub as shipped": _the_stub,
        "no running max at all (p = exp(scores))": _no_running_max,
        "max taken, l and acc never rescaled (a rescale forgotten)": _max_but_no_rescale,
        "l rescaled, acc not": _rescale_l_not_acc,
        "no guard for a row that has seen no key (NaN)": _without_the_guard,
        "the guarded max returned as m (a row without keys carries m = 0)": _safe_max_returned,
        "alpha = exp(m_new - m_old)": _alpha_inverted,
        "a key skipped (the block's last)": _a_key_skipped,
        "the block's max in place of the running max": _block_max_only,
        "one max for all rows of the block": _one_max_for_all_rows,
        "acc divided by l after every block": _normalised_too_early,
    },
)
