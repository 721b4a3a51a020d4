"""The backward pass of attention in NumPy, tile by tile: the teaching model of lesson 08_backward.

What the two GPU backwards (``cuda_cores.py`` for the ``flash`` stage, ``flash_backward.cu`` for ``mma``) compute,
written so that a laptop runs it and a reader sees every step:

1. the *preprocess*: ``D_i = sum_d dO_id O_id``, one number per query row (:func:`row_dot`), the softmax Jacobian's
   only use of the whole row, computed from O and dO (L x D), never from P (L x L);
2. for each tile of keys of one key/value head (the KV-stationary order of FlashAttention-2's Algorithm 2), the
   tiles of query rows of every query head of its GQA group stream past, and each (query tile, key tile) pair runs
   :func:`backward_tile_step`: P recomputed from the forward's LSE, then dV, dP, dS, dK and dQ for that pair.

Nothing of size Lq x Lk is ever held: a tile of P at a time. The forward saved only O and the LSE (B, H, Lq).
Every function works in float64, so the result equals :func:`wb_kernels.reference.reference_backward` to rounding.
The lesson's puzzle (``exercises.py``) asks for :func:`backward_tile_step`.
"""

from __future__ import annotations

import numpy as np

from ...reference import as_float64, attention_mask

__all__ = ["row_dot", "recompute_probs", "softmax_backward", "backward_tile_step", "blockwise_backward",
           "tile_pairs"]


def row_dot(dout, out):
    """D_i = sum_d dO_id * O_id for every query row: equal to sum_j P_ij dP_ij, at L x D cost instead of L x L."""
    return (dout * out).sum(-1)


def softmax_backward(probs, dprobs):
    """dS from dP through P = softmax(S), row by row: the softmax's Jacobian, diag(p) - p pᵀ, applied to dP."""
    return probs * (dprobs - (probs * dprobs).sum(-1, keepdims=True))


def recompute_probs(scores, lse, allowed):
    """P = exp(S - LSE) where the mask allows, 0 elsewhere: the forward's softmax, recomputed exactly from its LSE.

    A row that saw no key has LSE = -inf and every entry masked: it gets zeros, never exp(-inf - -inf) = NaN."""
    with np.errstate(over="ignore", invalid="ignore"):  # masked entries and rows without keys: chosen away below
        return np.where(allowed, np.exp(scores - lse[..., None]), 0.0)


# region: backward_tile_step
def backward_tile_step(q, k, v, dout, lse, delta, allowed, scale):
    """The gradients' shares of one (query tile, key tile) pair, for the G query heads that read one K/V head.

    q, dout: (G, bm, D) the tile's query rows of each head of the group; k, v: (bn, D) the key tile;
    lse, delta: (G, bm) the forward's LSE and D_i = rowsum(dO * O); allowed: (bm, bn), True where row i sees key j.
    Returns dq (G, bm, D) and dk, dv (bn, D), each summed over the group's heads (GQA): what to add to dQ, dK, dV.
    """
    scores = scale * np.einsum("gmd,nd->gmn", q, k)  # S, recomputed: the forward kept only O and the LSE
    probs = recompute_probs(scores, lse, allowed)  # P = exp(S - LSE), 0 where masked (and in rows without keys)
    dv = np.einsum("gmn,gmd->nd", probs, dout)  # dV += Pᵀ dO, summed over the group's heads
    dprobs = np.einsum("gmd,nd->gmn", dout, v)  # dP = dO Vᵀ
    dscores = probs * (dprobs - delta[..., None])  # dS = P ∘ (dP - D): the softmax's Jacobian, D from the preprocess
    dq = scale * np.einsum("gmn,nd->gmd", dscores, k)  # dQ += scale dS K
    dk = scale * np.einsum("gmn,gmd->nd", dscores, q)  # dK += scale dSᵀ Q, summed over the group's heads
    return dq, dk, dv
# endregion


def tile_pairs(Lq: int, Lk: int, block_m: int, block_n: int, allowed=None):
    """The (query tile start, key tile start) pairs the KV-stationary loop visits, key tile by key tile.

    With `allowed` (Lq, Lk) given, a pair whose whole tile is masked is left out (above a causal diagonal, or keys
    all padded): the kernels skip it too."""
    pairs = []
    for j0 in range(0, Lk, block_n):
        for i0 in range(0, Lq, block_m):
            if allowed is None or allowed[i0:i0 + block_m, j0:j0 + block_n].any():
                pairs.append((i0, j0))
    return pairs


def blockwise_backward(q, k, v, out, lse, dout, *, causal=False, key_padding_mask=None, scale=None, block_m=16,
                       block_n=16, step=backward_tile_step):
    """(dq, dk, dv) in float64, tile by tile, from the forward's `out` and `lse` and the loss gradient `dout`.

    q, dout, out: (B, H, Lq, D); k, v: (B, Hk, Lk, D) with H a multiple of Hk (GQA); lse: (B, H, Lq). `causal` is
    False, "top_left" (or True) or "bottom_right"; `key_padding_mask` (B, Lk) is True for keys to keep. `step` is
    the per-tile function (:func:`backward_tile_step`; the lesson's puzzle passes the learner's). The loop is the
    KV-stationary one: a key tile's dK and dV are complete once its query tiles have passed; dQ gathers shares
    from every key tile (the GPU's v1 does that in a second, Q-stationary pass; v2 with atomic adds).
    """
    q, k, v, out, dout = (as_float64(x) for x in (q, k, v, out, dout))
    lse = as_float64(lse)
    B, H, Lq, D = q.shape
    Hk, Lk = k.shape[1], k.shape[2]
    if H % Hk:
        raise ValueError(f"k, v: {Hk} key/value heads do not divide the {H} query heads")
    group = H // Hk
    scale = 1.0 / np.sqrt(D) if scale is None else float(scale)
    delta = row_dot(dout, out)  # the preprocess: (B, H, Lq)
    allowed = attention_mask(Lq, Lk, causal, key_padding_mask, batch=B)[:, 0]  # (B, Lq, Lk)
    dq, dk, dv = np.zeros_like(q), np.zeros_like(k), np.zeros_like(v)
    for b in range(B):
        for kv_head in range(Hk):
            heads = slice(kv_head * group, (kv_head + 1) * group)  # the query heads that read this K/V head
            for i0, j0 in tile_pairs(Lq, Lk, block_m, block_n, allowed[b]):
                rows, keys = slice(i0, i0 + block_m), slice(j0, j0 + block_n)
                dq_t, dk_t, dv_t = step(q[b, heads, rows], k[b, kv_head, keys], v[b, kv_head, keys],
                                        dout[b, heads, rows], lse[b, heads, rows], delta[b, heads, rows],
                                        allowed[b, rows, keys], scale)
                dq[b, heads, rows] += dq_t
                dk[b, kv_head, keys] += dk_t
                dv[b, kv_head, keys] += dv_t
    return dq, dk, dv
