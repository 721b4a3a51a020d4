"""The ``mma`` kernel's arithmetic at register level, warp by warp, in NumPy (lesson 06; tests/test_mma.py).

Everything here is what one thread block of the kernel does, with each warp's registers as arrays whose axis -2
(or -3 for accumulators) is the warp's 32 lanes:

- the block's Q, K and V tiles lie in shared memory as the kernel stores them (rows of D 16-bit elements, XOR
  swizzled: :mod:`.swizzle`), K/V tiles of ``BLOCK_N`` keys, rows past the end zero-filled as ``cp.async`` does;
- each of the ``NUM_WARPS`` warps owns ``ROW_TILES`` x 16 query rows and loads its Q fragments once with
  ``ldmatrix.x4``; per key tile it loads K fragments with ``ldmatrix.x4`` and V fragments with ``ldmatrix.x4.trans``
  (:func:`q_addresses`, :func:`k_addresses`, :func:`v_addresses` give each lane's row address);
- S = Q Kᵀ accumulates in fp32 C fragments (``fragments.mma_m16n8k16``, rounded to fp32 after each instruction);
- the online softmax runs on those fragments (:func:`fragment_softmax_step`): lane l holds rows l // 4 and
  l // 4 + 8, so a row's max takes two shuffles within its group of four lanes (:func:`quad_allreduce`); scores are
  scaled by scale * log2(e) and exponentiated with exp2; masked scores become -inf by *selection*, so a NaN at a
  masked key cannot leak; a row that has seen no key keeps m = -inf and subtracts 0 instead;
- P is rounded to fp16/bf16 in registers, and the C fragments of two neighbouring 16 x 8 tiles of S are the A
  fragment of P's 16 x 16 tile (``fragments.accumulator_as_a_operand``); O accumulates in fp32, rescaled per row by
  alpha = 2^(m_old - m_new); the row sums l add fp32 p before its rounding, each lane its own part, and the four
  parts of a row are added with two shuffles once, after the last tile (as FlashAttention-2 does);
- at the end O / l is rounded to the input dtype, and LSE = ln 2 (m + log2 l); a row with no key gives 0 and -inf.

:func:`forward` runs it over (B, H, Lq, Lk, D) and returns ``(out, lse)`` for ``wb.check``. The warps of a block
run side by side as one NumPy batch; :func:`counting` tallies the instructions one warp issues
(:func:`instruction_counts`).

Sources: NVIDIA, *PTX ISA*, "Warp-level matrix multiply-accumulate instructions" (``mma``, ``ldmatrix``) and
``shfl.sync``; T. Dao, "FlashAttention-2", 2023, arXiv:2307.08691.
"""

from __future__ import annotations

from collections import Counter
from contextlib import contextmanager

import numpy as np

from . import fragments as fr
from .swizzle import store_tile, swizzled_offset
from ..wmma.fragment_model import LN2, LOG2E, round_to

__all__ = ["NUM_WARPS", "ROW_TILES", "BLOCK_M", "BLOCK_N", "shuffle_xor", "quad_allreduce", "rows_of_accumulators",
           "accumulators_of_rows", "q_addresses", "k_addresses", "v_addresses", "fragment_softmax_step",
           "block_forward", "forward", "counting", "instruction_counts", "registers_per_lane",
           "ldmatrix_per_key_tile"]

NUM_WARPS = 4                 # warps per thread block, all on one (batch, head)
ROW_TILES = 1                 # 16-row tiles of queries per warp
BLOCK_M = NUM_WARPS * ROW_TILES * 16
BLOCK_N = 64                  # keys per K/V tile
S_TILES = BLOCK_N // 8        # 16 x 8 accumulator tiles across one key tile

LANE = np.arange(fr.LANES)
GROUP, THREAD_IN_GROUP = LANE // 4, LANE % 4
ROW_OF_LANE = GROUP[:, None] + 8 * np.arange(2)                                 # (32, 2): rows l//4, l//4 + 8
KEY_OF_LANE = (8 * np.arange(S_TILES)[:, None] + 2 * THREAD_IN_GROUP[:, None, None]
               + np.arange(2)).reshape(fr.LANES, 2 * S_TILES)                    # (32, 16): key 8n + 2t + j

_counts: Counter | None = None


@contextmanager
def counting():
    """``with counting() as counts:`` tallies the modelled instructions (``counts[name] += issued``)."""
    global _counts
    previous, _counts = _counts, Counter()
    try:
        yield _counts
    finally:
        _counts = previous


def _count(name: str, issued: int) -> None:
    if _counts is not None:
        _counts[name] += int(issued)


# --- warp shuffles: the only way lanes see each other's registers -----------------------------------------------

def shuffle_xor(values, lane_mask: int) -> np.ndarray:
    """``__shfl_xor_sync(0xffffffff, v, lane_mask)`` for per-lane arrays (..., 32, n): lane l receives lane
    l ^ lane_mask's values."""
    values = np.asarray(values)
    _count("shfl.sync.bfly", values[..., 0, :].size)
    return values[..., LANE ^ lane_mask, :]


def quad_allreduce(values, combine) -> np.ndarray:
    """`combine` (np.maximum, np.add) over each group of four lanes, the result in all four: two butterfly
    shuffles, because a row of an accumulator lives in lanes 4g..4g+3."""
    values = combine(values, shuffle_xor(values, 1))
    return combine(values, shuffle_xor(values, 2))


# --- the layout of one row in a lane's accumulators -------------------------------------------------------------

def rows_of_accumulators(frags) -> np.ndarray:
    """(..., T, 32, 4) C fragments of T neighbouring 16 x 8 tiles -> (..., 32, 2, 2T): per lane, its values of row
    l // 4 (c0, c1 of each tile) and of row l // 4 + 8 (c2, c3), in key order (:data:`KEY_OF_LANE`)."""
    frags = np.asarray(frags)
    *batch, tiles, lanes, _ = frags.shape
    halves = frags.reshape(*batch, tiles, lanes, 2, 2)  # (tile, lane, row half, j)
    return np.moveaxis(halves, -4, -2).reshape(*batch, lanes, 2, 2 * tiles)


def accumulators_of_rows(rows) -> np.ndarray:
    """The inverse of :func:`rows_of_accumulators`."""
    rows = np.asarray(rows)
    *batch, lanes, _, width = rows.shape
    halves = rows.reshape(*batch, lanes, 2, width // 2, 2)
    return np.moveaxis(halves, -2, -4).reshape(*batch, width // 2, lanes, 4)


def _per_row(row_values) -> np.ndarray:
    """(..., 32, 2) per-row factors -> (..., 1, 32, 4), to scale accumulators (c0, c1: first row; c2, c3: second)."""
    return np.asarray(row_values)[..., [0, 0, 1, 1]][..., None, :, :]


# --- ldmatrix: which row each lane points at --------------------------------------------------------------------

def q_addresses(k_step, head_dim: int, first_row=0) -> np.ndarray:
    """(..., 32) element offsets for ``ldmatrix.x4`` of Q's A fragment at k-step `k_step` (16 columns): lane l gives
    row first_row + l % 16 at chunk 2 k_step + l // 16 (quarters top-left, bottom-left, top-right, bottom-right)."""
    row = np.asarray(first_row)[..., None] + LANE % 16
    chunk = 2 * np.asarray(k_step)[..., None] + LANE // 16
    return swizzled_offset(row, chunk, head_dim)


def k_addresses(key_pair, k_step, head_dim: int) -> np.ndarray:
    """(..., 32) offsets for ``ldmatrix.x4`` (not transposed) of the B fragments of S = Q Kᵀ for keys
    16 key_pair .. 16 key_pair + 15 at k-step `k_step`: matrix i = l // 8 is keys 16 key_pair + 8 (i // 2) + l % 8 at
    chunk 2 k_step + i % 2, so registers 0-1 are one 16 x 8 tile's B fragment and 2-3 the next one's."""
    matrix = LANE // 8
    key = 16 * np.asarray(key_pair)[..., None] + 8 * (matrix // 2) + LANE % 8
    chunk = 2 * np.asarray(k_step)[..., None] + matrix % 2
    return swizzled_offset(key, chunk, head_dim)


def v_addresses(key_step, dim_pair, head_dim: int) -> np.ndarray:
    """(..., 32) offsets for ``ldmatrix.x4.trans`` of the B fragments of O += P V for keys 16 key_step .. + 15 and
    head dims 16 dim_pair .. + 15: V is stored key by key, and the B operand wants key pairs in a register, hence
    the transposing load. Matrix i is keys 16 key_step + 8 (i % 2) + l % 8 at chunk 2 dim_pair + i // 2."""
    matrix = LANE // 8
    key = 16 * np.asarray(key_step)[..., None] + 8 * (matrix % 2) + LANE % 8
    chunk = 2 * np.asarray(dim_pair)[..., None] + matrix // 2
    return swizzled_offset(key, chunk, head_dim)


def _ldmatrix(shared, addresses, *, trans: bool, name: str) -> np.ndarray:
    _count(name, np.asarray(addresses).size // fr.LANES)
    return fr.ldmatrix(shared, addresses, trans=trans)


def _two_b_fragments(registers) -> np.ndarray:
    """(..., 32, 8) from one ldmatrix.x4 -> (..., 2, 32, 4): the B fragments of two neighbouring 16 x 8 tiles."""
    return np.stack([registers[..., :4], registers[..., 4:]], axis=-3)


def _mma(a, b, c, name: str) -> np.ndarray:
    d = fr.mma_m16n8k16(a, b, c).astype(np.float32)  # the accumulators are fp32 registers
    _count(name, d.size // (fr.LANES * 4))
    return d


# --- the online softmax on one warp's registers -----------------------------------------------------------------

# region: fragment_softmax_step
def fragment_softmax_step(scores, m_old, l_old):
    """One key tile of the online softmax, on a warp's registers.

    scores: (..., 32, 2, 16) float32, lane l's 16 scores of row l // 4 and of row l // 4 + 8, already multiplied by
    scale * log2(e), -inf where masked. m_old: (..., 32, 2), each row's running max (equal in the row's 4 lanes);
    l_old: this lane's part of each row's sum. Returns m_new, l_new, p = 2^(scores - m_new), alpha = 2^(m_old - m_new).
    """
    lane_max = scores.max(axis=-1)
    row_max = quad_allreduce(lane_max, np.maximum)  # the row's other 48 scores are in lanes l^1, l^2, l^3
    m_new = np.maximum(m_old, row_max)
    # a row that has seen no key yet keeps m = -inf; subtracting it would give -inf - -inf = NaN
    m_safe = np.where(m_new == -np.inf, np.float32(0), m_new)
    alpha = np.exp2(m_old - m_safe)
    p = np.exp2(scores - m_safe[..., None])
    l_new = l_old * alpha + p.sum(axis=-1)  # the lane's own part: the 4 parts are added once, after the last tile
    return m_new, l_new, p, alpha
# endregion


# --- one thread block -------------------------------------------------------------------------------------------

def _zero_filled(rows, first: int, count: int) -> np.ndarray:
    """rows[first:first + count] with rows past the end as zeros: what cp.async with src-size 0 leaves."""
    tile = np.zeros((count, rows.shape[1]), dtype=np.float32)
    part = rows[first:first + count]
    tile[:len(part)] = part
    return tile


def block_forward(q_rows, k, v, key_keep, *, first_row: int, causal: bool, scale_log2, dtype: str,
                  softmax_step=fragment_softmax_step, query_rows: int | None = None):
    """One thread block on one (batch, head): warps of 16 rows each over `q_rows` (16 W, D), keys `k`, `v` (Lk, D),
    `key_keep` (Lk,) bool. `first_row` is the block's first query index (for the causal mask), `query_rows` how many
    of its rows exist (default all). Returns (out (16 W, D) float32 before the final rounding, lse (16 W,))."""
    q_rows = np.asarray(q_rows, dtype=np.float32)
    rows, head_dim = q_rows.shape
    warps, key_count = rows // 16, k.shape[0]
    query_rows = rows if query_rows is None else query_rows
    q_shared = store_tile(q_rows)
    k_steps, key_pairs = np.arange(head_dim // 16), np.arange(BLOCK_N // 16)
    q_frags = _ldmatrix(q_shared, q_addresses(k_steps, head_dim, 16 * np.arange(warps)[:, None]), trans=False,
                        name="ldmatrix.x4 (Q, once)")  # (W, D/16, 32, 8): kept in registers for the whole loop
    m = np.full((warps, fr.LANES, 2), -np.inf, dtype=np.float32)
    l = np.zeros((warps, fr.LANES, 2), dtype=np.float32)
    o = np.zeros((warps, head_dim // 8, fr.LANES, 4), dtype=np.float32)
    row_index = first_row + 16 * np.arange(warps)[:, None, None] + ROW_OF_LANE  # (W, 32, 2)
    key_tiles = -(-key_count // BLOCK_N)
    if causal:  # tiles right of the block's last row hold no key any of its rows may see: the kernel stops earlier
        key_tiles = min(key_tiles, -(-(first_row + query_rows) // BLOCK_N))
    for key0 in range(0, key_tiles * BLOCK_N, BLOCK_N):
        k_shared = store_tile(_zero_filled(k, key0, BLOCK_N))
        v_shared = store_tile(_zero_filled(v, key0, BLOCK_N))
        s = np.zeros((warps, S_TILES, fr.LANES, 4), dtype=np.float32)
        for k_step in k_steps:
            k_frags = _ldmatrix(k_shared, k_addresses(key_pairs, k_step, head_dim), trans=False, name="ldmatrix.x4 (K)")
            k_frags = _two_b_fragments(k_frags).reshape(S_TILES, fr.LANES, 4)
            s = _mma(q_frags[:, k_step, None], k_frags, s, "mma.sync (S = Q K^T)")
        key = key0 + KEY_OF_LANE[:, None, :]  # (32, 1, 16)
        visible = (key < key_count) & np.append(key_keep, False)[np.minimum(key, key_count)]
        if causal:
            visible = visible & (key <= row_index[..., None])
        scores = rows_of_accumulators(s) * np.float32(scale_log2)
        scores = np.where(visible, scores, np.float32(-np.inf))  # select, not add: NaN at a masked key stays out
        m, l, p, alpha = softmax_step(scores, m, l)
        o = o * _per_row(alpha)
        p_frags = accumulators_of_rows(round_to(p, dtype))  # P in 16 bits, still in the lanes that computed S
        for key_step in key_pairs:
            a_frag = fr.accumulator_as_a_operand(p_frags[:, 2 * key_step], p_frags[:, 2 * key_step + 1])
            v_frags = _ldmatrix(v_shared, v_addresses(key_step, k_steps, head_dim), trans=True,
                                name="ldmatrix.x4.trans (V)")
            v_frags = _two_b_fragments(v_frags).reshape(head_dim // 8, fr.LANES, 4)
            o = _mma(a_frag[:, None], v_frags, o, "mma.sync (O += P V)")
    l = quad_allreduce(l, np.add)
    has_keys = l > 0
    inv_l = np.divide(np.float32(1), l, out=np.zeros_like(l), where=has_keys)
    o = o * _per_row(inv_l)
    out = fr.gather(o, fr.c_coords, (16, 8)).transpose(0, 2, 1, 3).reshape(rows, head_dim).astype(np.float32)
    with np.errstate(divide="ignore", invalid="ignore"):
        lse = np.where(has_keys, (m + np.log2(np.where(has_keys, l, 1))) * LN2, -np.inf).astype(np.float32)
    lse = lse[:, ::4, :].transpose(0, 2, 1).reshape(rows)  # lanes 4g hold rows g and g + 8
    return out, lse


def _as_float32(x) -> np.ndarray:
    if hasattr(x, "detach"):  # torch, any dtype (bf16 converts to float32 exactly)
        return x.detach().float().cpu().numpy()
    return np.asarray(x, dtype=np.float32)


def forward(q, k, v, *, causal: bool = False, key_padding_mask=None, scale: float | None = None,
            dtype: str = "float16", softmax_step=fragment_softmax_step):
    """The kernel's result in NumPy: q (B, H, Lq, D), k and v (B, H, Lk, D) (NumPy or torch; rounded to `dtype`
    first), D a multiple of 64. Returns (out, lse): float32 arrays, `out` (B, H, Lq, D) holding `dtype` values,
    `lse` (B, H, Lq). `softmax_step` replaces :func:`fragment_softmax_step` (the lesson's puzzle)."""
    q, k, v = (round_to(_as_float32(x), dtype) for x in (q, k, v))
    B, H, Lq, D = q.shape
    scale_log2 = np.float32(D ** -0.5 if scale is None else scale) * LOG2E
    keep = np.ones((B, k.shape[2]), dtype=bool)
    if key_padding_mask is not None:
        mask = key_padding_mask.cpu().numpy() if hasattr(key_padding_mask, "cpu") else key_padding_mask
        keep = np.asarray(mask, dtype=bool)
    out = np.zeros((B, H, Lq, D), dtype=np.float32)
    lse = np.full((B, H, Lq), -np.inf, dtype=np.float32)
    for b in range(B):
        for h in range(H):
            for first_row in range(0, Lq, BLOCK_M):
                rows = min(BLOCK_M, Lq - first_row)
                block_out, block_lse = block_forward(
                    _zero_filled(q[b, h], first_row, BLOCK_M), k[b, h], v[b, h], keep[b], first_row=first_row,
                    causal=causal, scale_log2=scale_log2, dtype=dtype, softmax_step=softmax_step, query_rows=rows)
                out[b, h, first_row:first_row + rows] = block_out[:rows]
                lse[b, h, first_row:first_row + rows] = block_lse[:rows]
    return round_to(out, dtype), lse


# --- what one warp issues, and holds ----------------------------------------------------------------------------

def instruction_counts(head_dim: int) -> dict:
    """The instructions one warp issues: {"per key tile": Counter, "once": Counter}, counted by running the model
    for one warp over one and over two key tiles (the difference is one tile's worth)."""
    def run(key_tiles: int) -> Counter:
        zeros = np.zeros((key_tiles * BLOCK_N, head_dim), dtype=np.float32)
        with counting() as counts:
            block_forward(np.zeros((16, head_dim), dtype=np.float32), zeros, zeros, np.ones(len(zeros), dtype=bool),
                          first_row=0, causal=False, scale_log2=1.0, dtype="float16")
        return counts

    one, two = run(1), run(2)
    per_tile = two - one
    return {"per key tile": per_tile, "once": one - per_tile}


def registers_per_lane(head_dim: int, *, row_tiles: int = ROW_TILES, block_n: int = BLOCK_N,
                       q_in_registers: bool = True) -> dict:
    """32-bit registers each lane holds for the warp's fragments: the register budget that decides whether Q may stay
    in registers and whether 32 rows per warp fit. The defaults are the model's warp (16 rows, 64-key tiles, Q in
    registers); ``row_tiles=2, q_in_registers=False`` (and ``block_n=128`` at D = 64) is the kernel's default launch
    variant, which keeps only the Q fragment of the current k-step per row tile (``Q_KEPT = 1`` in flash_mma.cu)."""
    s_tiles = block_n // 8
    return {
        "Q fragments (16-bit pairs)": row_tiles * ((head_dim // 16) if q_in_registers else 1) * 4,
        "S accumulators (fp32)": row_tiles * s_tiles * 4,
        "P fragments (16-bit pairs)": row_tiles * s_tiles * 2,
        "O accumulators (fp32)": row_tiles * (head_dim // 8) * 4,
        "m and l (fp32)": row_tiles * 4,
    }


def ldmatrix_per_key_tile(head_dim: int, *, row_tiles: int = ROW_TILES, block_n: int = BLOCK_N,
                          q_in_registers: bool = True) -> dict:
    """``ldmatrix.x4`` one warp issues per key tile, by operand, for any launch variant (flash_mma.cu's loops): K's
    B fragments once per 16 keys and k-step, V's once per 16 keys and 16 head dims (shared by the warp's row tiles),
    and, when Q is not kept in registers, Q's A fragment once per row tile and k-step. For the model's own warp the
    K and V counts equal what :func:`instruction_counts` tallies while running it."""
    k_steps = head_dim // 16
    return {"K": (block_n // 16) * k_steps, "V": (block_n // 16) * (head_dim // 16),
            "Q": 0 if q_in_registers else row_tiles * k_steps}
