"""v1's control flow and arithmetic in NumPy, block by block and tile by tile (rung ``hopper``; tests/test_hopper.py).

``flash_v1_kernel`` in ``hopper_lab.cu`` with whole 64 x 64 matrices where the kernel has registers (the register
layouts are checked apart, in ``wgmma_fragments``): which key tiles a block of 64 query rows loads (``kv_end``,
all keys or up to the last row's causal diagonal), which tiles need the mask (ragged keys, key padding, the causal
diagonal), the online softmax in base 2 with masks by select and 0 as the base of a row that has seen no key, P
rounded to the input's 16-bit type before P V, O / l at the end, LSE = ln 2 (m + log2 l), and zeros with an LSE of
-inf for a row without keys. :func:`forward` runs it over (B, H, Lq, D) with K/V heads shared by groups of query
heads (GQA) and returns ``(out, lse)`` for ``wb.check``.
"""

from __future__ import annotations

import numpy as np

from ...reference import causal_offset

__all__ = ["BLOCK_M", "BLOCK_N", "key_tiles", "forward"]

BLOCK_M = BLOCK_N = 64
LOG2E = 1.4426950408889634


def key_tiles(m0: int, Lq: int, Lk: int, offset) -> int:
    """How many key tiles the block of rows m0 .. m0 + 63 loads: the kernel's ``n_tiles``."""
    kv_end = Lk if offset is None else max(0, min(Lk, min(m0 + BLOCK_M, Lq) + offset))
    return -(-kv_end // BLOCK_N)


def _block(q, k, v, keep, m0, Lq, Lk, offset, scale_log2, dtype):
    """One thread block: 64 query rows (zero rows past Lq, as the TMA fills them) of one head."""
    D = q.shape[-1]
    q_tile = np.zeros((BLOCK_M, D)); q_tile[:min(BLOCK_M, Lq - m0)] = q[m0:m0 + BLOCK_M]
    rows = m0 + np.arange(BLOCK_M)
    o, row_max, row_sum = np.zeros((BLOCK_M, D), np.float32), np.full(BLOCK_M, -np.inf, np.float32), np.zeros(BLOCK_M, np.float32)
    for tile in range(key_tiles(m0, Lq, Lk, offset)):
        n0 = tile * BLOCK_N
        k_tile, v_tile = np.zeros((BLOCK_N, D)), np.zeros((BLOCK_N, D))
        k_tile[:min(BLOCK_N, Lk - n0)] = k[n0:n0 + BLOCK_N]
        v_tile[:min(BLOCK_N, Lk - n0)] = v[n0:n0 + BLOCK_N]
        s = (q_tile @ k_tile.T).astype(np.float32) * np.float32(scale_log2)  # fp32 accumulators, then scaled
        needs_mask = n0 + BLOCK_N > Lk or keep is not None or (offset is not None and n0 + BLOCK_N - 1 > m0 + offset)
        if needs_mask:
            keys = n0 + np.arange(BLOCK_N)
            visible = (keys < Lk)[None, :] & np.ones((BLOCK_M, 1), bool)
            if keep is not None:
                visible &= np.concatenate([keep, np.zeros(BLOCK_N, bool)])[keys][None, :]
            if offset is not None:
                visible &= keys[None, :] <= rows[:, None] + offset
            s = np.where(visible, s, -np.inf).astype(np.float32)
        new_max = np.maximum(row_max, s.max(axis=1))
        base = np.where(new_max == -np.inf, np.float32(0), new_max)
        alpha = np.exp2(row_max - base)
        row_max = new_max
        p = np.exp2(s - base[:, None]).astype(np.float32)
        row_sum = row_sum * alpha + p.sum(axis=1, dtype=np.float32)
        o = o * alpha[:, None] + (p.astype(dtype).astype(np.float64) @ v_tile).astype(np.float32)
    inverse = np.where(row_sum > 0, 1 / np.where(row_sum > 0, row_sum, 1), 0).astype(np.float32)
    out = (o * inverse[:, None]).astype(dtype)
    with np.errstate(divide="ignore"):
        lse = np.where(row_sum > 0, (row_max + np.log2(np.where(row_sum > 0, row_sum, 1))) * np.log(2), -np.inf)
    valid = min(BLOCK_M, Lq - m0)
    return out[:valid], lse[:valid].astype(np.float32)


def forward(q, k, v, *, causal=False, key_padding_mask=None, scale=None):
    """(out, lse) as the v1 kernel computes them; q (B, H, Lq, D), k and v (B, Hk, Lk, D), 16-bit NumPy arrays
    (float16; bfloat16 has no NumPy type, so the model runs in float16)."""
    q, k, v = (np.asarray(x) for x in (q, k, v))
    B, H, Lq, D = q.shape
    Hk, Lk = k.shape[1], k.shape[2]
    scale = D ** -0.5 if scale is None else float(scale)
    offset = causal_offset(causal, Lq, Lk)
    keep = None if key_padding_mask is None else np.asarray(key_padding_mask, bool)
    out, lse = np.zeros_like(q), np.full((B, H, Lq), -np.inf, np.float32)
    if Lk == 0:
        return np.zeros_like(q), lse
    for b in range(B):
        for h in range(H):
            kv = h // (H // Hk)
            for m0 in range(0, Lq, BLOCK_M):
                o_block, lse_block = _block(q[b, h].astype(np.float64), k[b, kv].astype(np.float64),
                                            v[b, kv].astype(np.float64), None if keep is None else keep[b], m0, Lq,
                                            Lk, offset, scale * LOG2E, q.dtype)
                out[b, h, m0:m0 + BLOCK_M], lse[b, h, m0:m0 + BLOCK_M] = o_block, lse_block
    return out, lse
