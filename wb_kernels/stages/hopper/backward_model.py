"""The Hopper backward's schedule and arithmetic in NumPy (rung ``hopper``, issue 47; tests/test_hopper_backward.py).

``hopper_backward.cuh`` with whole matrices where the kernel has registers: the preprocessing (D = rowsum(dO o O) in
float32, LSE in base 2 padded to whole 64-row query tiles, +inf where a row has no key so that its P is 0); one CTA
per (batch, key/value head, block of 128 keys) walking, for every query head of its group (GQA: dK and dV summed in
the CTA), the query tiles from the first one its causal diagonal reaches (:func:`first_query_tile`: fully masked
tiles are never visited); per tile S^T = K Q^T and dP^T = V dO^T in float32, P^T = exp2(S^T scale log2 e - LSE log2 e)
with each key's mask as one bound on the query (:func:`first_query`), dS^T = P^T (dP^T - D), both rounded to the
inputs' 16-bit type before dV += P^T dO, dK += dS^T Q and the tile's dQ partial dS K (float32); dK times the scale,
rounded at the end.

The dQ partials of one (batch, head, query tile) come from every key block that visits it, and are added to a float32
accumulator in global memory. :func:`accumulate_dq` replays those adds under a schedule: ``"atomic"`` (the default
kernel: whatever order the CTAs get there, drawn at random) or ``"deterministic"`` (the semaphore: key block j adds
only when the tile's count reads j, then counts on). It raises :class:`Deadlock` when no CTA can move: the semaphore's
design promises that never happens. float32 addition is not associative: the atomic order changes dQ's last bits
between runs, the deterministic one never does.
"""

from __future__ import annotations

import numpy as np

from ...reference import causal_offset

__all__ = ["BLOCK_M", "BLOCK_N", "CONSUMER_KEYS", "Deadlock", "first_query_tile", "first_query", "preprocess",
           "key_block", "accumulate_dq", "backward", "round_to"]

BLOCK_M = 64         # query rows per tile (BWD_BLOCK_M)
BLOCK_N = 128        # keys per CTA (BWD_BLOCK_N): two consumer warpgroups of CONSUMER_KEYS
CONSUMER_KEYS = 64
LOG2E = 1.4426950408889634
NO_QUERY = 2 ** 31 - 1    # a key no query sees (past Lk, padded out)
EVERY_QUERY = -2 ** 31    # a key every query sees (not causal)


class Deadlock(RuntimeError):
    """No CTA can add its next dQ partial: the semaphores wait on each other."""


def round_to(x, dtype: str) -> np.ndarray:
    """float32 values rounded to a 16-bit type (to nearest, ties to even) and back, as pack_pair does."""
    x = np.asarray(x, np.float32)
    if dtype == "float16":
        return x.astype(np.float16).astype(np.float32)
    if dtype != "bfloat16":
        raise ValueError(f"dtype must be float16 or bfloat16, got {dtype!r}")
    bits = x.view(np.uint32).astype(np.uint64)
    rounded = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
    return np.where(np.isnan(x), x, rounded.astype(np.uint32).view(np.float32))


def first_query_tile(n0: int, offset, Lq_pad: int) -> int:
    """The first query tile key block n0 .. n0 + 127 visits (``first_query_tile``): 0 without the causal mask;
    with it, the tile of the first query that sees key n0 (query i sees keys j <= i + offset)."""
    if offset is None:
        return 0
    return min(max(0, n0 - offset), Lq_pad) // BLOCK_M


def first_query(keys: np.ndarray, Lk: int, keep_row, offset) -> np.ndarray:
    """Per key: the first query that sees it (the kernel's ``first_query[r]``), NO_QUERY for keys past Lk or padded
    out, EVERY_QUERY without the causal mask."""
    keys = np.asarray(keys, np.int64)
    kept = keys < Lk
    if keep_row is not None:
        kept &= np.asarray(keep_row, bool)[np.minimum(keys, Lk - 1)]
    seen_from = keys - offset if offset is not None else np.full(keys.shape, EVERY_QUERY, np.int64)
    return np.where(kept, seen_from, NO_QUERY)


def preprocess(out, dout, lse, Lq_pad: int):
    """``backward_preprocess_kernel``: (lse_log2, dot), both (B, H, Lq_pad) float32."""
    B, H, Lq, _ = out.shape
    dot = np.zeros((B, H, Lq_pad), np.float32)
    dot[:, :, :Lq] = (np.asarray(out, np.float32) * np.asarray(dout, np.float32)).sum(-1, dtype=np.float32)
    lse_log2 = np.full((B, H, Lq_pad), np.inf, np.float32)
    lse = np.asarray(lse, np.float32)
    lse_log2[:, :, :Lq] = np.where(lse == -np.inf, np.inf, lse * np.float32(LOG2E))
    return lse_log2, dot


def _rows(x, start: int, count: int) -> np.ndarray:
    """Rows start .. start + count - 1 of x (L, D) as float32, zeros past L (the TMA's zero fill)."""
    tile = np.zeros((count, x.shape[-1]), np.float32)
    part = np.asarray(x[start:start + count], np.float32)
    tile[:len(part)] = part
    return tile


def key_block(q, k, v, dout, lse_log2, dot, *, b: int, kv_head: int, n_block: int, offset, keep, scale: float,
              dtype: str):
    """One CTA of ``flash_backward_kernel``: returns (dk, dv) of its 128 keys (float32, before the scale and the
    rounding) and its dQ partials as a list of ((bh, m), (64, D) float32) in the order the CTA visits the tiles."""
    B, H, Lq, D = q.shape
    Hk, Lk = k.shape[1], k.shape[2]
    group, Lq_pad = H // Hk, lse_log2.shape[-1]
    n0 = n_block * BLOCK_N
    keys = n0 + np.arange(BLOCK_N)
    seen_from = first_query(keys, Lk, None if keep is None else keep[b], offset)[:, None]  # (128, 1)
    k_tile, v_tile = _rows(k[b, kv_head], n0, BLOCK_N), _rows(v[b, kv_head], n0, BLOCK_N)
    dk = np.zeros((BLOCK_N, D), np.float32)
    dv = np.zeros((BLOCK_N, D), np.float32)
    partials = []
    scale_log2 = np.float32(scale * LOG2E)
    for g in range(group):
        h = kv_head * group + g
        for m in range(first_query_tile(n0, offset, Lq_pad), Lq_pad // BLOCK_M):
            m0 = m * BLOCK_M
            q_tile, do_tile = _rows(q[b, h], m0, BLOCK_M), _rows(dout[b, h], m0, BLOCK_M)
            lse_row, dot_row = lse_log2[b, h, m0:m0 + BLOCK_M], dot[b, h, m0:m0 + BLOCK_M]
            s = k_tile @ q_tile.T                       # S^T (keys x queries)
            dp = v_tile @ do_tile.T                     # dP^T
            seen = (m0 + np.arange(BLOCK_M))[None, :] >= seen_from
            with np.errstate(over="ignore"):
                p = np.where(seen, np.exp2(s * scale_log2 - lse_row[None, :]), np.float32(0)).astype(np.float32)
            ds = (p * (dp - dot_row[None, :])).astype(np.float32)
            p16, ds16 = round_to(p, dtype), round_to(ds, dtype)
            dv += p16 @ do_tile
            dk += ds16 @ q_tile
            partials.append(((b * H + h, m), (ds16.T @ k_tile).astype(np.float32)))  # dQ = dS K, both halves
    return dk, dv, partials


def accumulate_dq(blocks: dict, shape: tuple, mode: str = "atomic", seed: int = 0) -> np.ndarray:
    """Replay the dQ adds of every CTA into a zeroed float32 (B H, Lq_pad, D) accumulator.

    `blocks`: {(b, kv_head, n_block): [((bh, m), partial), ...]} in each CTA's own order. At every step one CTA,
    drawn at random among those that may move, adds its next partial: ``"atomic"``, any CTA; ``"deterministic"``, a
    CTA whose next tile's semaphore reads its n_block (then the semaphore counts on)."""
    if mode not in ("atomic", "deterministic"):
        raise ValueError(f"mode must be 'atomic' or 'deterministic', got {mode!r}")
    rng = np.random.default_rng(seed)
    accumulator = np.zeros(shape, np.float32)
    semaphore: dict = {}
    position = {cta: 0 for cta in blocks}
    while True:
        waiting = [cta for cta in blocks if position[cta] < len(blocks[cta])]
        if not waiting:
            return accumulator
        movable = [cta for cta in waiting
                   if mode == "atomic" or semaphore.get(blocks[cta][position[cta]][0], 0) == cta[2]]
        if not movable:
            raise Deadlock(f"{len(waiting)} CTAs wait and none may add: "
                           + ", ".join(f"{cta} at tile {blocks[cta][position[cta]][0]}" for cta in waiting[:4]))
        cta = movable[rng.integers(len(movable))]
        (bh, m), partial = blocks[cta][position[cta]]
        rows = slice(m * BLOCK_M, (m + 1) * BLOCK_M)
        accumulator[bh, rows] = accumulator[bh, rows] + partial  # float32: one rounding per add
        semaphore[(bh, m)] = semaphore.get((bh, m), 0) + 1
        position[cta] += 1


def backward(q, k, v, out, lse, dout, *, causal=False, key_padding_mask=None, scale=None, mode: str = "atomic",
             seed: int = 0, dtype: str | None = None, return_accumulator: bool = False):
    """The three kernels over (B, H, Lq, D) inputs (K/V with Hk heads); returns (dq, dk, dv) as float16 arrays
    (`dtype` "bfloat16": float32 arrays holding bfloat16 values). `out`, `lse`: the forward's. `mode`, `seed`: the
    dQ schedule (:func:`accumulate_dq`). `return_accumulator`: also the float32 dQ accumulator."""
    q, k, v, dout = (np.asarray(x) for x in (q, k, v, dout))
    dtype = dtype or ("float16" if q.dtype == np.float16 else "bfloat16")
    B, H, Lq, D = q.shape
    Hk, Lk = k.shape[1], k.shape[2]
    scale = float(D) ** -0.5 if scale is None else float(scale)
    offset = causal_offset(causal, Lq, Lk)
    keep = None if key_padding_mask is None else np.asarray(key_padding_mask, bool)
    Lq_pad = -(-Lq // BLOCK_M) * BLOCK_M
    lse_log2, dot = preprocess(out, dout, lse, Lq_pad)
    dk = np.zeros((B, Hk, Lk, D), np.float32)
    dv = np.zeros((B, Hk, Lk, D), np.float32)
    blocks = {}
    for b in range(B):
        for kv_head in range(Hk):
            for n_block in range(-(-Lk // BLOCK_N)):
                block_dk, block_dv, partials = key_block(q, k, v, dout, lse_log2, dot, b=b, kv_head=kv_head,
                                                         n_block=n_block, offset=offset, keep=keep, scale=scale,
                                                         dtype=dtype)
                n0 = n_block * BLOCK_N
                dk[b, kv_head, n0:n0 + BLOCK_N] = block_dk[:Lk - n0] * np.float32(scale)
                dv[b, kv_head, n0:n0 + BLOCK_N] = block_dv[:Lk - n0]
                blocks[(b, kv_head, n_block)] = partials
    accumulator = accumulate_dq(blocks, (B * H, Lq_pad, D), mode, seed)
    dq = accumulator.reshape(B, H, Lq_pad, D)[:, :, :Lq] * np.float32(scale)
    cast = (lambda x: round_to(x, dtype).astype(np.float16)) if dtype == "float16" else (lambda x: round_to(x, dtype))
    grads = cast(dq), cast(dk), cast(dv)
    return (*grads, accumulator) if return_accumulator else grads
