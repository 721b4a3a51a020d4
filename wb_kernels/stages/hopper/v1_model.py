"""v1's control flow and arithmetic in NumPy, block by block and tile by tile (rung ``hopper``; tests/test_hopper.py);
with ``**WS`` (128-row blocks of two 64-row consumers, 128-key tiles), v2's and v3's.

``flash_v1_kernel`` in ``hopper_attention.cuh`` with whole 64 x 64 matrices where the kernel has registers (the register
layouts are checked apart, in ``wgmma_fragments``): which key tiles a block of 64 query rows loads (``kv_end``,
all keys or up to the last row's causal diagonal), which tiles need the mask (ragged keys, key padding, the causal
diagonal), the online softmax in base 2 with masks by select and 0 as the base of a row that has seen no key, P
rounded to the input's 16-bit type before P V, O / l at the end, LSE = ln 2 (m + log2 l), and zeros with an LSE of
-inf for a row without keys. :func:`forward` runs it over (B, H, Lq, D) with K/V heads shared by groups of query
heads (GQA) and returns ``(out, lse)`` for ``wb.check``.

v2, v3 and v4 (``flash_ws_kernel``) do the same arithmetic with other blocks: 128 query rows per block, of which each
consumer warpgroup owns 64 (``consumer_rows``), and 128 keys per tile. Both consumers walk every key tile of their
block (the producer loads them once for both: ``key_tiles`` with the block's m0 and 128 rows), and each decides the
mask from its own first row. v3 reorders the products (P V of a tile in the turn after its softmax), not the sums.
"""

from __future__ import annotations

import numpy as np

from ...reference import causal_offset

__all__ = ["BLOCK_M", "BLOCK_N", "WS", "key_tiles", "forward"]

BLOCK_M = BLOCK_N = 64
WS = dict(block_m=128, block_n=128, consumer_rows=64)  # v2, v3 and v4: forward(..., **WS)
LOG2E = 1.4426950408889634


def key_tiles(m0: int, Lq: int, Lk: int, offset, block_m: int = BLOCK_M, block_n: int = BLOCK_N) -> int:
    """How many key tiles the block of rows m0 .. m0 + block_m - 1 loads: the kernel's ``n_tiles``
    (``key_tile_count``)."""
    kv_end = Lk if offset is None else max(0, min(Lk, min(m0 + block_m, Lq) + offset))
    return -(-kv_end // block_n)


def _rows(q, k, v, keep, first_row, n_tiles, Lq, Lk, offset, scale_log2, dtype, rows_count, block_n):
    """One warpgroup's query rows first_row .. first_row + rows_count - 1 (zero rows past Lq, as the TMA fills them)
    of one head, over the n_tiles key tiles its block loads."""
    D = q.shape[-1]
    q_tile = np.zeros((rows_count, D)); q_tile[:max(0, min(rows_count, Lq - first_row))] = q[first_row:first_row + rows_count]
    rows = first_row + np.arange(rows_count)
    o, row_max, row_sum = np.zeros((rows_count, D), np.float32), np.full(rows_count, -np.inf, np.float32), np.zeros(rows_count, np.float32)
    for tile in range(n_tiles):
        n0 = tile * block_n
        k_tile, v_tile = np.zeros((block_n, D)), np.zeros((block_n, D))
        k_tile[:min(block_n, Lk - n0)] = k[n0:n0 + block_n]
        v_tile[:min(block_n, Lk - n0)] = v[n0:n0 + block_n]
        s = (q_tile @ k_tile.T).astype(np.float32) * np.float32(scale_log2)  # fp32 accumulators, then scaled
        needs_mask = n0 + block_n > Lk or keep is not None or (offset is not None and n0 + block_n - 1 > first_row + offset)
        if needs_mask:
            keys = n0 + np.arange(block_n)
            visible = (keys < Lk)[None, :] & np.ones((rows_count, 1), bool)
            if keep is not None:
                visible &= np.concatenate([keep, np.zeros(block_n, bool)])[keys][None, :]
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
    valid = max(0, min(rows_count, Lq - first_row))
    return out[:valid], lse[:valid].astype(np.float32)


def forward(q, k, v, *, causal=False, key_padding_mask=None, scale=None, block_m: int = BLOCK_M,
            block_n: int = BLOCK_N, consumer_rows: int | None = None):
    """(out, lse) as the v1 kernel computes them (``**WS``: v2, v3 and v4); q (B, H, Lq, D), k and v (B, Hk, Lk, D),
    16-bit NumPy arrays (float16; bfloat16 has no NumPy type, so the model runs in float16)."""
    consumer_rows = consumer_rows or block_m
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
            for m0 in range(0, Lq, block_m):
                n_tiles = key_tiles(m0, Lq, Lk, offset, block_m, block_n)  # one count for the whole block
                for first_row in range(m0, min(m0 + block_m, Lq), consumer_rows):
                    o_rows, lse_rows = _rows(q[b, h].astype(np.float64), k[b, kv].astype(np.float64),
                                             v[b, kv].astype(np.float64), None if keep is None else keep[b],
                                             first_row, n_tiles, Lq, Lk, offset, scale * LOG2E, q.dtype,
                                             consumer_rows, block_n)
                    last = first_row + consumer_rows
                    out[b, h, first_row:last], lse[b, h, first_row:last] = o_rows, lse_rows
    return out, lse
