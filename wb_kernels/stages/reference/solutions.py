"""Worked solutions to lesson 01's exercises and its puzzle. Try them first: the lesson's check cells tell you
when you are right."""

import math

import numpy as np

answer_1 = 2 * 8 * 32 * 8192**2 * 2 / 2**30  # two matrices x B x H x L^2 x 2 bytes, in GiB
answer_2 = math.log(65504.0 / 1000)          # 1000 * e^s <= 65504, float16's largest finite value
answer_3 = 1000 * 1001 // 2                  # row i sees i + 1 keys: 1 + 2 + ... + 1000


def my_attention(q, k, v, key_padding_mask):
    """Bottom-right causal attention with key padding: query i sees key j when j <= i + Lk - Lq and the key is
    not padding; the safe softmax; a row that sees no key gives zeros. q (B, H, Lq, D), k and v (B, H, Lk, D)."""
    Lq, Lk = q.shape[2], k.shape[2]
    scores = np.einsum("bhqd,bhkd->bhqk", q, k) / math.sqrt(q.shape[-1])  # (B, H, Lq, Lk)
    i, j = np.arange(Lq)[:, None], np.arange(Lk)[None, :]
    allowed = (j <= i + Lk - Lq) & key_padding_mask[:, None, None, :]   # (B, 1, Lq, Lk)
    scores = np.where(allowed, scores, -np.inf)
    row_max = scores.max(axis=-1, keepdims=True)
    row_max = np.where(row_max == -np.inf, 0.0, row_max)  # a row with no key: exp(-inf - 0) = 0, not NaN
    e = np.exp(scores - row_max)
    total = e.sum(axis=-1, keepdims=True)
    probs = np.divide(e, total, out=np.zeros_like(e), where=total > 0)
    return np.einsum("bhqk,bhkd->bhqd", probs, v)
