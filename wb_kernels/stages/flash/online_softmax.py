"""Online softmax, derived in NumPy before any kernel is written (lesson 04; the tests check it).

Three steps, each exact:

1. ``two_pass_softmax``: one pass for the maximum, one for the sum (and the division).
2. ``online_max_sum``: one pass that keeps a running maximum ``m`` and a running sum ``l``; when the
   maximum grows, the sum so far is rescaled by ``exp(m_old - m_new)``.
3. ``online_softmax_step`` / ``blockwise_attention``: the same for a whole block of scores at a time,
   and for the weighted sum of values too: the partial output is rescaled by the same factor. This is
   the loop the FlashAttention kernel runs, with the statistics recorded for the lesson's plots.

All in float64. Masked scores are ``-inf``; a row that has seen no key yet has ``m = -inf`` and is
treated as having maximum 0, so ``exp(-inf - 0) = 0`` and no NaN appears.
"""

from __future__ import annotations

import numpy as np

__all__ = ["two_pass_softmax", "online_max_sum", "online_softmax_step", "blockwise_attention"]


def two_pass_softmax(x) -> np.ndarray:
    """Softmax along the last axis: pass 1 finds the max, pass 2 sums exp(x - max)."""
    x = np.asarray(x, dtype=np.float64)
    m = x.max(axis=-1, keepdims=True)
    e = np.exp(x - m)
    return e / e.sum(axis=-1, keepdims=True)


def online_max_sum(x):
    """One pass over a 1-D array: running max m and running sum l = sum(exp(x_j - m)).

    Returns ``(m, l, history)`` where history holds m and l after each element.
    """
    m, l = -np.inf, 0.0
    history = {"m": [], "l": []}
    for value in np.asarray(x, dtype=np.float64):
        new_m = max(m, value)
        l = l * np.exp(m - new_m) + np.exp(value - new_m)  # rescale the old sum to the new max
        m = new_m
        history["m"].append(m)
        history["l"].append(l)
    return m, l, history


# region: online_softmax_step
def online_softmax_step(m, l, acc, scores, values):
    """Fold one block of keys into the running statistics of each query row.

    m, l: (rows,) running max and running sum; acc: (rows, D) unnormalised output so far;
    scores: (rows, block) scaled scores of this block (-inf where masked); values: (block, D).
    """
    new_m = np.maximum(m, scores.max(axis=1))
    safe_m = np.where(np.isfinite(new_m), new_m, 0.0)  # a row that has seen no key yet
    alpha = np.exp(m - safe_m)  # how much the old max overstated the new one: rescale by it
    p = np.exp(scores - safe_m[:, None])  # (rows, block), each <= 1
    l = l * alpha + p.sum(axis=1)
    acc = acc * alpha[:, None] + p @ values
    return new_m, l, acc
# endregion


def blockwise_attention(q, k, v, *, block_n=16, causal=False, key_mask=None, scale=None, step=online_softmax_step):
    """FlashAttention's loop for one head in NumPy: q (Lq, D), k and v (Lk, D).

    `step` folds one block into the running statistics (lesson 04's puzzle passes the learner's version).

    key_mask: bool (Lk,), True = the key takes part. Returns ``(out, lse, history)``; history has one
    entry per key block: ``{"start", "stop", "m", "l"}`` (copies of the running statistics after it).
    """
    q, k, v = (np.asarray(x, dtype=np.float64) for x in (q, k, v))
    Lq, D = q.shape
    Lk = k.shape[0]
    scale = 1.0 / np.sqrt(D) if scale is None else scale
    m = np.full(Lq, -np.inf)
    l = np.zeros(Lq)
    acc = np.zeros((Lq, D))
    history = []
    rows = np.arange(Lq)[:, None]
    for start in range(0, Lk, block_n):
        stop = min(start + block_n, Lk)
        scores = scale * q @ k[start:stop].T
        keys = np.arange(start, stop)[None, :]
        allowed = np.ones_like(scores, dtype=bool)
        if causal:
            allowed &= keys <= rows
        if key_mask is not None:
            allowed &= np.asarray(key_mask, dtype=bool)[None, start:stop]
        scores = np.where(allowed, scores, -np.inf)
        m, l, acc = step(m, l, acc, scores, v[start:stop])
        history.append({"start": start, "stop": stop, "m": m.copy(), "l": l.copy()})
    out = np.divide(acc, l[:, None], out=np.zeros_like(acc), where=l[:, None] > 0)
    with np.errstate(divide="ignore"):
        lse = np.where(l > 0, np.where(np.isfinite(m), m, 0.0) + np.log(l), -np.inf)
    return out, lse, history
