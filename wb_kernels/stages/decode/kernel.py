"""Split-KV decoding in numba.cuda, with GQA and a paged cache (lesson 07's teaching kernel; runs on the simulator).

Two kernels, as in flash-decoding (``splitkv.py`` has the NumPy model):

1. ``decode_partial``: one thread block per (split, sequence, KV head, chunk of query rows). The block's query rows
   are the ``G = H / Hk`` query heads that share its KV head (times the Lq new tokens, 1 when decoding): they read
   the block's keys and values once, from shared memory. Keys come through the block table of a paged cache:
   key t of sequence b lives in page ``block_table[b, t // page_size]`` at slot ``t % page_size``. A contiguous
   cache (B, Hk, L, D) is the special case of one page of L keys per sequence and the table [[0], [1], ...], so
   both layouts run the same code. The block writes its split's output, normalised over the split, and the split's
   log-sum-exp.
2. ``decode_merge``: one block per query row merges the splits exactly (weights l_s exp(m_s - m), m the largest
   m_s). Each split hands over its largest score m_s and its sum l_s apart, not their LSE m_s + log(l_s): at a score
   of -1e31 a float32 LSE cannot carry log(l_s) (its ulp is 1e24), and splits of equal scores but different sizes
   would weigh the same.

Masks: keys at or beyond the sequence's length never take part; ``causal_mode`` 1 is top-left (row i sees keys
j <= i), 2 is bottom-right (j <= i + len_b - Lq, what a new token appended to a cache needs); a key padding mask
(B, Lk) is optional. Like lesson 04, masked scores get the finite NEG_BIG, the lowest float32, below every score:
a score of -1e35 is a score. Whether a row or a split has seen a key is its running sum l > 0, never a value's size;
the merge writes -inf for a row that saw none.

No warp shuffles: the same code runs under numba's CUDA simulator (FACTS: the simulator has none) and on a GPU.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from numba import cuda, float32  # after ..backend (imported by the package first): the simulator switch

from ...backend import BACKEND
from ...resources import register_kernel

__all__ = ["DecodeConfig", "make_partial_kernel", "merge_kernel", "load_query_rows", "load_kv_tile", "score_tile",
           "online_softmax_tile", "write_partial", "get_partial_kernel", "config_for",
           "SIMULATOR_CONFIG", "GPU_CONFIG", "NEG_BIG", "CAUSAL_NONE", "CAUSAL_TOP_LEFT",
           "CAUSAL_BOTTOM_RIGHT", "PARTIAL_SIGNATURE", "MERGE_SIGNATURE"]

NEG_BIG = -3.4028234663852886e38  # a finite "minus infinity" for masked scores: the lowest float32, below every score
CAUSAL_NONE, CAUSAL_TOP_LEFT, CAUSAL_BOTTOM_RIGHT = 0, 1, 2


@dataclass(frozen=True)
class DecodeConfig:
    """Shape of one block of ``decode_partial``; compile-time constants."""

    threads: int = 128  # threads per block
    block_n: int = 32  # keys per K/V tile in shared memory
    rows: int = 8  # query rows per block (query heads of one KV group x new tokens)

    def owned(self, D: int) -> int:
        """Outputs (row, column) each thread accumulates: rows * D spread over the threads."""
        return max(1, math.ceil(self.rows * D / self.threads))


# The simulator runs one Python thread per CUDA thread and pays milliseconds per syncthreads: few threads, small
# tiles. On a GPU: 128 threads; K and V tiles of 32 keys x D=128 in float32 fill 32 KiB of shared memory.
SIMULATOR_CONFIG = DecodeConfig(threads=16, block_n=16, rows=4)
GPU_CONFIG = DecodeConfig(threads=128, block_n=32, rows=8)


def config_for() -> DecodeConfig:
    return SIMULATOR_CONFIG if BACKEND.is_simulator else GPU_CONFIG


# The kernel's steps are device functions, each a lesson cell of its own. inline="always" inlines them in numba's IR,
# so the kernel compiles for any architecture without a GPU present (CI's PTX check), as one function.
# region: load_query_rows
@cuda.jit(device=True, inline="always")
def load_query_rows(q_tile, q, b, kv_head, group, row0):
    """The block's query rows into shared memory q_tile (ROWS, D), zeros past the group's last row. Row r is query
    head kv_head * group + (row0 + r) // Lq, new token (row0 + r) % Lq."""
    ROWS, D = q_tile.shape
    Lq = q.shape[2]
    for e in range(cuda.threadIdx.x, ROWS * D, cuda.blockDim.x):
        r = e // D
        d = e % D
        value = float32(0.0)
        if row0 + r < group * Lq:
            value = float32(q[b, kv_head * group + (row0 + r) // Lq, (row0 + r) % Lq, d])
        q_tile[r, d] = value
# endregion


# region: load_kv_tile
@cuda.jit(device=True, inline="always")
def load_kv_tile(k_tile, v_tile, k_pages, v_pages, block_table, b, kv_head, tile0, stop):
    """Keys tile0 .. tile0 + BN - 1 of sequence b into k_tile, v_tile (BN, D), each gathered through the block table;
    zeros past the split's end. Consecutive threads load consecutive columns of a key: coalesced within a page."""
    BN, D = k_tile.shape
    page_size = k_pages.shape[2]
    for e in range(cuda.threadIdx.x, BN * D, cuda.blockDim.x):
        j = e // D
        d = e % D
        key = tile0 + j
        kval = float32(0.0)
        vval = float32(0.0)
        if key < stop:
            page = block_table[b, key // page_size]
            slot = key % page_size
            kval = float32(k_pages[page, kv_head, slot, d])
            vval = float32(v_pages[page, kv_head, slot, d])
        k_tile[j, d] = kval
        v_tile[j, d] = vval
# endregion


# region: score_tile
@cuda.jit(device=True, inline="always")
def score_tile(scores, q_tile, k_tile, b, row0, rows_used, Lq, tile0, stop, causal_mode, offset, key_keep, use_mask,
               scale):
    """scores (ROWS, BN) of the block's rows against the tile's keys; a masked one (past the split, past the group's
    rows, past the causal limit i + offset, or padded) gets NEG_BIG, as in lesson 04."""
    ROWS, BN = scores.shape
    D = q_tile.shape[1]
    for e in range(cuda.threadIdx.x, ROWS * BN, cuda.blockDim.x):
        r = e // BN
        j = e % BN
        key = tile0 + j
        i = (row0 + r) % Lq
        keep = key < stop and row0 + r < rows_used
        if causal_mode != 0 and key > i + offset:
            keep = False
        if use_mask != 0 and keep:
            keep = key_keep[b, key] != 0
        s = float32(NEG_BIG)
        if keep:
            dot = float32(0.0)
            for d in range(D):
                dot += q_tile[r, d] * k_tile[j, d]
            s = dot * scale
        scores[r, j] = s
# endregion


# region: online_softmax_tile
@cuda.jit(device=True, inline="always")
def online_softmax_tile(m_run, l_run, acc, scores, v_tile):
    """Lesson 04's online softmax, for the outputs this thread owns: e = t, t + THREADS, ... of the ROWS x D block.
    Each rescales by its row's new maximum, e^(m_old - m_new), and adds the tile's e^(s - m_new) and e^(s - m_new) v."""
    ROWS, BN = scores.shape
    D = v_tile.shape[1]
    for u in range(m_run.shape[0]):
        e = cuda.threadIdx.x + u * cuda.blockDim.x
        if e < ROWS * D:
            r = e // D
            d = e % D
            tile_max = float32(NEG_BIG)
            for j in range(BN):
                tile_max = max(tile_max, scores[r, j])
            new_max = max(m_run[u], tile_max)
            alpha = float32(0.0)
            if m_run[u] > float32(NEG_BIG):  # the row has seen a key before this tile
                alpha = math.exp(m_run[u] - new_max)
            total = l_run[u] * alpha
            out = acc[u] * alpha
            for j in range(BN):
                s = scores[r, j]
                if s > float32(NEG_BIG):  # not masked (a score of -1e35 is a score)
                    p = math.exp(s - new_max)
                    total += p
                    out += p * v_tile[j, d]
            m_run[u] = new_max
            l_run[u] = total
            acc[u] = out
# endregion


# region: write_partial
@cuda.jit(device=True, inline="always")
def write_partial(part_out, part_max, part_sum, m_run, l_run, acc, split, b, kv_head, group, row0, ROWS):
    """The split's output, normalised over the split, its largest score m and its sum l (kept apart: their LSE
    m + log(l) would lose log(l) in float32 at m = -1e31), for the outputs this thread owns (of the block's ROWS x D);
    a row that saw no key of the split gets 0, NEG_BIG and 0."""
    Lq, D = part_out.shape[3], part_out.shape[4]
    for u in range(m_run.shape[0]):
        e = cuda.threadIdx.x + u * cuda.blockDim.x
        r = e // D
        d = e % D
        if e < ROWS * D and row0 + r < group * Lq:
            h = kv_head * group + (row0 + r) // Lq
            i = (row0 + r) % Lq
            seen = l_run[u] > 0.0
            part_out[split, b, h, i, d] = acc[u] / l_run[u] if seen else float32(0.0)
            if d == 0:
                part_max[split, b, h, i] = m_run[u] if seen else float32(NEG_BIG)
                part_sum[split, b, h, i] = l_run[u]
# endregion


# region: decode_partial
def make_partial_kernel(D: int, config: DecodeConfig):
    """The split-KV kernel for head dim D: one block per (sequence x KV head, split, chunk of query rows)."""
    BN, ROWS = config.block_n, config.rows
    OWNED = config.owned(D)

    @cuda.jit
    def decode_partial(q,  # (B, H, Lq, D) queries, float32 or float16
                       k_pages,  # (num_pages, Hk, page_size, D) keys (a contiguous cache: one page per sequence)
                       v_pages,  # (num_pages, Hk, page_size, D) values
                       block_table,  # (B, pages per sequence) int32: the pages of sequence b, in order
                       seq_lens,  # (B,) int32: keys in sequence b
                       key_keep,  # (B, Lk) uint8, 1 = key takes part; read only when use_mask
                       use_mask,  # 0/1
                       causal_mode,  # 0 none, 1 top-left, 2 bottom-right
                       scale,  # softmax scale, any finite number
                       keys_per_split,  # keys per split (the last split of a sequence may get fewer, or none)
                       part_out,  # (S, B, H, Lq, D) float32: each split's output, normalised over the split
                       part_max,  # (S, B, H, Lq) float32: each split's largest score (NEG_BIG if it saw no key)
                       part_sum):  # (S, B, H, Lq) float32: each split's sum of exp(score - largest) (0: no key)
        q_tile = cuda.shared.array((ROWS, D), float32)
        k_tile = cuda.shared.array((BN, D), float32)
        v_tile = cuda.shared.array((BN, D), float32)
        scores = cuda.shared.array((ROWS, BN), float32)
        # each thread's online-softmax state for the OWNED (row, column) outputs it accumulates
        m_run = cuda.local.array(OWNED, float32)
        l_run = cuda.local.array(OWNED, float32)
        acc = cuda.local.array(OWNED, float32)

        Lq, Hk = q.shape[2], k_pages.shape[1]
        group = q.shape[1] // Hk  # query heads per KV head
        b = cuda.blockIdx.x // Hk  # (sequence, KV head) in x, the one grid dimension past 65,535 blocks: a large
        kv_head = cuda.blockIdx.x % Hk  # batch runs
        split = cuda.blockIdx.y
        row0 = cuda.blockIdx.z * ROWS  # this block's rows among the group's group * Lq rows
        length = seq_lens[b]
        start = split * keys_per_split
        stop = min(start + keys_per_split, length)
        offset = 0  # causal: row i sees keys j <= i + offset
        if causal_mode == 2:
            offset = length - Lq

        load_query_rows(q_tile, q, b, kv_head, group, row0)
        for u in range(OWNED):
            m_run[u] = float32(NEG_BIG)
            l_run[u] = 0.0
            acc[u] = 0.0
        for tile0 in range(start, stop, BN):
            load_kv_tile(k_tile, v_tile, k_pages, v_pages, block_table, b, kv_head, tile0, stop)
            cuda.syncthreads()
            score_tile(scores, q_tile, k_tile, b, row0, group * Lq, Lq, tile0, stop, causal_mode, offset, key_keep,
                       use_mask, scale)
            cuda.syncthreads()
            online_softmax_tile(m_run, l_run, acc, scores, v_tile)
            cuda.syncthreads()  # before the next tile overwrites K, V and the scores
        write_partial(part_out, part_max, part_sum, m_run, l_run, acc, split, b, kv_head, group, row0, ROWS)

    return decode_partial
# endregion


# region: decode_merge
@cuda.jit
def merge_kernel(part_out,  # (S, B, H, Lq, D) float32
                 part_max,  # (S, B, H, Lq) float32: each split's largest score, NEG_BIG for an empty split
                 part_sum,  # (S, B, H, Lq) float32: each split's sum of exp(score - largest), 0 for an empty split
                 out,  # (B, H, Lq, D) float32
                 lse):  # (B, H, Lq) float32, -inf for a row that saw no key
    """One block per query row, one thread per column: out = sum_s w_s out_s / sum_s w_s, w_s = l_s exp(m_s - m)
    (= exp(lse_s - m) with lse_s = m_s + log(l_s), without a float32 lse_s that cannot hold log(l_s) at -1e31)."""
    S, B, H, Lq = part_max.shape[0], part_max.shape[1], part_max.shape[2], part_max.shape[3]
    row = cuda.blockIdx.x
    b = row // (H * Lq)
    h = (row // Lq) % H
    i = row % Lq
    top = float32(NEG_BIG)
    for s in range(S):
        top = max(top, part_max[s, b, h, i])
    total = float32(0.0)
    for s in range(S):
        if part_sum[s, b, h, i] > 0.0:  # the split saw a key
            total += math.exp(part_max[s, b, h, i] - top) * part_sum[s, b, h, i]
    for d in range(cuda.threadIdx.x, part_out.shape[4], cuda.blockDim.x):
        value = float32(0.0)
        for s in range(S):
            if part_sum[s, b, h, i] > 0.0:
                value += math.exp(part_max[s, b, h, i] - top) * part_sum[s, b, h, i] * part_out[s, b, h, i, d]
        out[b, h, i, d] = value / total if total > 0.0 else float32(0.0)
    if cuda.threadIdx.x == 0:
        lse[b, h, i] = top + math.log(total) if total > 0.0 else float32(-math.inf)  # no fastmath here
# endregion


def _signature(element: str) -> str:
    arr4 = f"{element}[:, :, :, ::1]"
    return (f"void({arr4}, {arr4}, {arr4}, int32[:, ::1], int32[::1], uint8[:, ::1], int64, int64, float32, "
            "int64, float32[:, :, :, :, ::1], float32[:, :, :, ::1], float32[:, :, :, ::1])")


PARTIAL_SIGNATURE = _signature("float16")
MERGE_SIGNATURE = ("void(float32[:, :, :, :, ::1], float32[:, :, :, ::1], float32[:, :, :, ::1], float32[:, :, :, ::1], "
                   "float32[:, :, ::1])")
_KERNELS: dict = {}


def get_partial_kernel(D: int, config: DecodeConfig):
    """The package's split-KV kernel for (D, config), built once per process and registered for CI's compile."""
    key = (D, config)
    if key not in _KERNELS:
        _KERNELS[key] = make_partial_kernel(D, config)
        register_kernel(f"decode.decode_partial[D={D},{config.threads}t,{config.block_n}n,{config.rows}r]",
                        _KERNELS[key], PARTIAL_SIGNATURE,
                        (__name__, "_rebuild", (D, config.threads, config.block_n, config.rows)))
    return _KERNELS[key]


def _rebuild(D, *fields):
    return get_partial_kernel(D, DecodeConfig(*fields))


register_kernel("decode.decode_merge", merge_kernel, MERGE_SIGNATURE)



# the shapes the stage launches on a GPU, known to CI (tests/test_ptx_compile.py compiles every registered kernel)
for _D in (64, 128):
    get_partial_kernel(_D, GPU_CONFIG)
