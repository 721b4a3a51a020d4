"""Lesson 08_backward's exercises and its coding puzzle: what each answer must equal (computed from the package when
graded), the puzzle's grader, and the plausible wrong answers each must reject (as data: ``tests/test_exercises.py``
feeds them to the graders).

The worked answers (and a solution to the puzzle) are in ``solutions.py`` next to this file: open it when you want
them.

The puzzle asks for one step of the blockwise backward (:func:`~.blockwise.backward_tile_step`): the gradients'
shares of one (query tile, key tile) pair. Its problem (:func:`puzzle_problem`) is built so that each mistake the
lesson warns about shows: two query heads share each key/value head (GQA, so dK and dV must be summed over the
group), the scale is not 1/sqrt(D) (a scale forgotten or assumed shows), rows have keys in several key tiles (so a D
taken from one tile's P and dP is wrong), the bottom-right causal mask and padded first keys leave rows 0 to 4 with
no key at all inside a tile whose other rows see keys (LSE = -inf there: a step that computes exp(-inf - -inf) gives
NaN), and scores of a few units (so exp(S) without the LSE, or a softmax over one tile, is far from P).
"""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np

from ...check import check_gradients
from ...inputs import random_qkv
from ...reference import reference
from ...exercises import Exercise, Puzzle, check_answers, check_puzzle, hands_copies
from .blockwise import blockwise_backward, recompute_probs
from .launcher import DEFAULT_VARIANT
from .slider import flop_ratio, mma_per_tile, saved_bytes

__all__ = ["EXERCISES", "PUZZLE", "check", "check_tile_step_puzzle", "puzzle_problem", "PUZZLE_BLOCK"]


def _v1_tile():
    variant = DEFAULT_VARIANT[("v1", 128)]
    return mma_per_tile("dkdv", block_m=variant.block_m, block_n=variant.block_n, D=128)


EXERCISES = (
    # B = 2, H = 32, L = 16384, D = 128 in bf16: a shape the lesson does not print (it prints B = 1, H = 16, D = 64)
    Exercise("exercise 1", lambda: saved_bytes("O+LSE", 16384, B=2, H=32, D=128, dtype_bytes=2) / 2**20,
             "O is B*H*L*D numbers in the inputs' dtype (2 bytes), the LSE B*H*L float32s; MiB = bytes / 2**20.",
             wrong={"P kept instead": saved_bytes("P", 16384, B=2, H=32, D=128) / 2**20,
                    "O without the LSE": 2 * 32 * 16384 * 128 * 2 / 2**20,
                    "the LSE in bf16 too": 2 * 32 * 16384 * 129 * 2 / 2**20,
                    "O in float32": 2 * 32 * 16384 * (128 * 4 + 4) / 2**20,
                    "in GiB": saved_bytes("O+LSE", 16384, B=2, H=32, D=128) / 2**30}),
    Exercise("exercise 2", lambda: flop_ratio("backward (two kernels, deterministic)"),
             "Count the matrix products of the forward and of both v1 kernels; S and dP are recomputed in each.",
             wrong={"the one-kernel backward (atomic dQ)": flop_ratio("backward (one kernel, atomic dQ)"),
                    "twice the forward (the usual rule of thumb)": 2.0,
                    "S recomputed once, dP twice": 3.0,
                    "the backward's products, not over the forward's": 7.0}),
    Exercise("exercise 3", lambda: sum(_v1_tile().values()),
             "Four products per pair (Sᵀ, dPᵀ, dV, dK), each (M/16)(N/8)(K/16) instructions of m16n8k16.",
             wrong={"one product only": lambda: next(iter(_v1_tile().values())),
                    "dV and dK only": lambda: 2 * next(iter(_v1_tile().values())),
                    "dQ too (five products)": lambda: 5 * next(iter(_v1_tile().values())),
                    "m16n8k8 (twice as many)": lambda: 2 * sum(_v1_tile().values())}),
)


def check(answer_1, answer_2, answer_3) -> None:
    """Grade lesson 08_backward's exercises (``...`` means not answered yet)."""
    check_answers(EXERCISES, answer_1, answer_2, answer_3)


# --- the puzzle: one (query tile, key tile) step of the blockwise backward, in NumPy ------------------------------

PUZZLE_BLOCK = 8
PUZZLE_SCALE = 0.3  # not 1/sqrt(D) = 0.25: a step that assumes the default scale fails


def puzzle_problem():
    """(q, k, v, dout, keep), float64: B = 1, H = 4 query heads on Hk = 2 key/value heads, Lq = 29, Lk = 27, D = 16;
    keys 0 to 2 padded. With the bottom-right causal mask row i sees keys 3 .. i - 2: rows 0 to 4 see none (inside
    the first query tile, whose rows 5 to 7 do see keys), and most rows see keys of several tiles of 8."""
    q, k, v = random_qkv(1, 4, 29, 16, Lk=27, dtype="float64", seed=8, std=1.5)
    k, v = k[:, :2].copy(), v[:, :2].copy()
    dout = np.random.default_rng(9).standard_normal(q.shape)
    keep = np.ones((1, 27), dtype=bool)
    keep[0, :3] = False
    return q, k, v, dout, keep


def _puzzle_result(step):
    q, k, v, dout, keep = puzzle_problem()
    options = dict(causal="bottom_right", key_padding_mask=keep, scale=PUZZLE_SCALE)
    out, lse = reference(q, k, v, **options)
    try:
        with np.errstate(all="ignore"):  # a wrong step overflows or makes NaN: the verdict says so, not a warning
            grads = blockwise_backward(q, k, v, out, lse, dout, block_m=PUZZLE_BLOCK, block_n=PUZZLE_BLOCK,
                                       step=step, **options)
    except Exception as error:  # a step of the wrong shape: say what it raised, not a traceback
        return SimpleNamespace(passed=False, reason=f"your step raised {type(error).__name__}: {error}")
    for name, grad in zip(("dq", "dk", "dv"), grads):
        if not np.isfinite(grad).all():
            return SimpleNamespace(passed=False, reason=f"{name} holds NaN or Inf (rows 0 to 4 see no key: their "
                                                        "LSE is -inf, and exp(-inf - -inf) is NaN)")
    return check_gradients("your tile step", grads, q, k, v, dout, verbose=False, raise_on_failure=False,
                              **options)


@hands_copies
def check_tile_step_puzzle(step) -> None:
    """Run the blockwise backward (:func:`~.blockwise.blockwise_backward`, tiles of 8 x 8) with the learner's
    ``step`` in place of ``backward_tile_step`` on :func:`puzzle_problem` and hold dq, dk, dv to the float64
    reference's gradients."""
    check_puzzle("puzzle", lambda: _puzzle_result(step),
                 hint="Recompute P = exp(S - LSE) only where allowed (0 elsewhere); dS = P (dP - D) with the D "
                      "given; scale dQ and dK; sum dK and dV over the group's heads.")


# Plausible wrong steps. Each is right on some inputs (one key tile per row, no GQA, scale 1, every row with a key);
# the puzzle's problem is built so that none of them passes.

def _step(*, probs=None, delta=None, scale_dq=True, scale_dk=True, group_sum=True):
    """A tile step with one mistake put in (the defaults are the right step)."""
    def step(q, k, v, dout, lse, delta_given, allowed, scale):
        scores = scale * np.einsum("gmd,nd->gmn", q, k)
        p = probs(scores, lse, allowed) if probs else recompute_probs(scores, lse, allowed)
        dp = np.einsum("gmd,nd->gmn", dout, v)
        d = delta(p, dp, delta_given) if delta else delta_given[..., None]
        ds = p * (dp - d)
        dq = np.einsum("gmn,nd->gmd", ds, k) * (scale if scale_dq else 1.0)
        if group_sum:
            dk, dv = np.einsum("gmn,gmd->nd", ds, q), np.einsum("gmn,gmd->nd", p, dout)
        else:  # only the group's first head
            dk, dv = ds[0].T @ q[0], p[0].T @ dout[0]
        return dq, dk * (scale if scale_dk else 1.0), dv
    return step


def _nan_for_rows_without_keys(scores, lse, allowed):  # mask to -inf first: exp(-inf - -inf) = NaN
    return np.exp(np.where(allowed, scores, -np.inf) - lse[..., None])


def _softmax_of_the_tile(scores, lse, allowed):  # the tile's own softmax: right only if the row's keys fit one tile
    s = np.where(allowed, scores, -np.inf)
    m = s.max(-1, keepdims=True)
    e = np.exp(s - np.where(np.isfinite(m), m, 0.0))
    total = e.sum(-1, keepdims=True)
    return np.divide(e, total, out=np.zeros_like(e), where=total > 0)


def _overwrites_its_inputs():  # zeroes dO, then returns no share: were dO the grader's own array, every reference
    def step(q, k, v, dout, lse, delta, allowed, scale):  # gradient would be 0 too, and "match"
        dout[...] = 0.0
        return np.zeros_like(q), np.zeros_like(k), np.zeros_like(v)
    return step


def _the_stub():  # as the lesson ships it: no share of any gradient
    return lambda q, k, v, dout, lse, delta, allowed, scale: (np.zeros_like(q), np.zeros_like(k), np.zeros_like(v))


PUZZLE = Puzzle(
    check=check_tile_step_puzzle,
    solution="backward_tile_step",
    wrong={
        "the stub as shipped": _the_stub,
        "dO overwritten with zeros, no share returned (the inputs are the grader's?)": _overwrites_its_inputs,
        "D forgotten: dS = P * dP": lambda: _step(delta=lambda p, dp, d: 0.0),
        "D from the tile's own P and dP": lambda: _step(delta=lambda p, dp, d: (p * dp).sum(-1, keepdims=True)),
        "D along the keys instead of the rows": lambda: _step(delta=lambda p, dp, d: d[:, None, :]),
        "P not recomputed from the LSE: exp(S)": lambda: _step(
            probs=lambda s, lse, allowed: np.where(allowed, np.exp(s), 0.0)),
        "P as a softmax over the tile alone": lambda: _step(probs=_softmax_of_the_tile),
        "the mask left out of P": lambda: _step(probs=lambda s, lse, allowed: np.exp(s - lse[..., None])),
        "a row without keys gives NaN (masked to -inf, then exp(S - LSE))": lambda: _step(
            probs=_nan_for_rows_without_keys),
        "scale forgotten in dQ and dK": lambda: _step(scale_dq=False, scale_dk=False),
        "scale forgotten in dK": lambda: _step(scale_dk=False),
        "the GQA group not summed (first head only)": lambda: _step(group_sum=False),
    },
)
