"""Stage 03: tiled attention in numba.cuda: shared-memory tiles for QK^T and PV, a block-wide row softmax.

Taught in lesson 03 (``notebooks/03_tiled.ipynb``), which shows every region below in full.
Same three steps and the same O(L^2) buffers S and P as stage 02 (:mod:`wb_kernels.stages.naive.kernel`), but
each block first copies a tile of its inputs into shared memory (all its threads together, then
``syncthreads``) and every number of the tile is then used `tile` times from there instead of being read
from global memory again.

    tiled_scores_kernel        S = scale * Q K^T in tile x tile blocks, loop over D in steps of tile
    block_softmax_kernel       one block per row: max and sum reduced in shared memory
    tiled_weighted_sum_kernel  O = P V in tile x tile blocks, loop over the keys in steps of tile

The tile size is a compile-time constant (it sizes the shared arrays), so kernels are made per tile size
by :func:`make_tiled_scores_kernel` and :func:`make_tiled_weighted_sum_kernel` (both:
:func:`make_tiled_kernels`); the softmax's block size likewise by :func:`make_block_softmax_kernel`.
The reductions use shared memory only: numba's simulator has no warp shuffles, and one code path means
the kernel the tests run on the CPU is the kernel that runs on the GPU.
"""

from __future__ import annotations

import functools
import math

import numpy as np
from numba import cuda, float32

from ... import device
from ...backend import BACKEND
from ...reference import causal_offset
from ...resources import register_kernel
from .. import Stage
from ..naive.kernel import check_grid, key_keep_mask, workspace_bytes

__all__ = ["make_tiled_scores_kernel", "make_tiled_weighted_sum_kernel", "make_tiled_kernels", "make_block_softmax_kernel",
           "tiled_kernels", "tiled_forward", "TILE_SIZES", "reuse_factor", "shared_bytes_per_block", "STAGE"]

# Tile sides the package compiles and tests: 32 x 32 = 1024 threads is the most a block may have.
TILE_SIZES = (8, 16, 32)
# On the simulator every thread is a Python thread and every syncthreads a barrier across them, so
# smaller blocks there keep the lessons fast; the results are the same for every tile size.
DEFAULT_TILE = 8 if BACKEND.is_simulator else 16
DEFAULT_SOFTMAX_THREADS = 16 if BACKEND.is_simulator else 128


# region: make_tiled_scores_kernel
def make_tiled_scores_kernel(tile):
    """tiled_scores_kernel for blocks of tile x tile threads."""
    padded = tile + 1  # a shared array's shape must be compile-time constants: computed here, not inside

    @cuda.jit
    def tiled_scores_kernel(q,         # (B*H, Lq, D) float32 queries
                            k,         # (B*Hk, Lk, D) float32 keys; Hk divides H
                            key_keep,  # (B, Lk) uint8, 1 where the key takes part
                            num_heads,  # H, to find the batch element b = bh // H of the mask
                            scale,     # float32 multiplier of the dot products
                            causal,    # bool: query i sees only keys j <= i + causal_offset
                            causal_offset,  # int: 0 (top-left), or Lk - Lq (bottom-right)
                            scores):   # (B*H, Lq, Lk) float32 output S
        q_tile = cuda.shared.array((tile, tile), float32)      # Q[i0 + row, d0 + col]
        k_tile = cuda.shared.array((tile, padded), float32)   # K[j0 + row, d0 + col]; +1 column: see below
        tx, ty = cuda.threadIdx.x, cuda.threadIdx.y
        bh, i0, j0 = cuda.blockIdx.x, cuda.blockIdx.y * tile, cuda.blockIdx.z * tile  # pair in x: see the launcher
        kv = bh // (q.shape[0] // k.shape[0])  # = b*Hk + h // (H // Hk): the K/V head query head h shares (GQA)
        i, j = i0 + ty, j0 + tx  # this thread's element of S
        Lq, Lk, D = scores.shape[1], scores.shape[2], q.shape[2]
        if causal and j0 > i0 + tile - 1 + causal_offset:
            # the whole tile lies above the diagonal: nothing to load (the same for every thread of the
            # block, so no thread skips a syncthreads that the others wait at)
            if i < Lq and j < Lk:
                scores[bh, i, j] = -math.inf
            return
        total = float32(0.0)
        for d0 in range(0, D, tile):
            # every thread copies one number of each tile: tile*tile threads fill both tiles at once
            if i < Lq and d0 + tx < D:
                q_tile[ty, tx] = q[bh, i, d0 + tx]
            else:
                q_tile[ty, tx] = 0.0
            if j0 + ty < Lk and d0 + tx < D:
                k_tile[ty, tx] = k[kv, j0 + ty, d0 + tx]
            else:
                k_tile[ty, tx] = 0.0
            cuda.syncthreads()  # the tiles are complete before anyone reads them
            tile_sum = float32(0.0)  # this tile's products on their own, then into the total: less rounding
            for dd in range(tile):
                # k_tile[tx, dd]: the threads of a warp read one column, tile + 1 floats apart, which
                # falls in different shared-memory banks thanks to the padding column
                tile_sum += q_tile[ty, dd] * k_tile[tx, dd]
            total += tile_sum
            cuda.syncthreads()  # everyone is done with the tiles before the next step overwrites them
        if i < Lq and j < Lk:
            if (causal and j > i + causal_offset) or key_keep[bh // num_heads, j] == 0:
                scores[bh, i, j] = -math.inf
            else:
                scores[bh, i, j] = scale * total

    return tiled_scores_kernel
# endregion


# region: make_tiled_weighted_sum_kernel
def make_tiled_weighted_sum_kernel(tile):
    """tiled_weighted_sum_kernel for blocks of tile x tile threads."""

    @cuda.jit
    def tiled_weighted_sum_kernel(probs,   # (B*H, Lq, Lk) float32 P
                                  v,       # (B*Hk, Lk, D) float32 values; Hk divides H
                                  causal,  # bool: P is 0 right of the diagonal, those tiles are skipped
                                  causal_offset,  # int: the diagonal is j = i + causal_offset
                                  out):    # (B*H, Lq, D) float32 output O
        p_tile = cuda.shared.array((tile, tile), float32)  # P[i0 + row, j0 + col]
        v_tile = cuda.shared.array((tile, tile), float32)  # V[j0 + row, d0 + col]
        tx, ty = cuda.threadIdx.x, cuda.threadIdx.y
        bh, i0, d0 = cuda.blockIdx.x, cuda.blockIdx.y * tile, cuda.blockIdx.z * tile
        kv = bh // (probs.shape[0] // v.shape[0])  # = b*Hk + h // (H // Hk), as in the scores kernel (GQA)
        i, d = i0 + ty, d0 + tx  # this thread's element of O
        Lq, Lk, D = out.shape[1], v.shape[1], out.shape[2]
        # the last key any row of this tile may see, + 1 (<= 0 when none sees a key: the loop is skipped)
        key_end = min(Lk, i0 + tile + causal_offset) if causal else Lk
        total = float32(0.0)
        for j0 in range(0, key_end, tile):
            if i < Lq and j0 + tx < Lk:
                p_tile[ty, tx] = probs[bh, i, j0 + tx]
            else:
                p_tile[ty, tx] = 0.0
            if j0 + ty < Lk and d < D:
                v_tile[ty, tx] = v[kv, j0 + ty, d]
            else:
                v_tile[ty, tx] = 0.0
            cuda.syncthreads()
            for jj in range(tile):
                total += p_tile[ty, jj] * v_tile[jj, tx]
            cuda.syncthreads()
        if i < Lq and d < D:
            out[bh, i, d] = total

    return tiled_weighted_sum_kernel
# endregion


def make_tiled_kernels(tile):
    """(tiled_scores_kernel, tiled_weighted_sum_kernel) for blocks of tile x tile threads."""
    return make_tiled_scores_kernel(tile), make_tiled_weighted_sum_kernel(tile)


# region: make_block_softmax_kernel
def make_block_softmax_kernel(threads):
    """Row softmax with one block of `threads` threads (a power of two) per row."""

    @cuda.jit
    def block_softmax_kernel(scores,  # (B*H, Lq, Lk) float32 input S
                             probs,   # (B*H, Lq, Lk) float32 output P
                             lse):    # (B*H, Lq) float32 output: log-sum-exp of each row
        partial = cuda.shared.array(threads, float32)  # one partial result per thread
        t = cuda.threadIdx.x
        # one block per row of all B*H*Lq rows, numbered along x (up to 2**31 - 1 blocks): row i of pair bh
        bh, i = cuda.blockIdx.x // scores.shape[1], cuda.blockIdx.x % scores.shape[1]
        n = scores.shape[2]

        # 1. the row maximum: each thread scans every `threads`-th entry (neighbouring threads read
        #    neighbouring entries), then the partial maxima are halved in shared memory, log2(threads) steps
        local = float32(-math.inf)
        for j in range(t, n, threads):
            local = max(local, scores[bh, i, j])
        partial[t] = local
        cuda.syncthreads()
        stride = threads // 2
        while stride > 0:
            if t < stride:
                partial[t] = max(partial[t], partial[t + stride])
            cuda.syncthreads()
            stride //= 2
        row_max = partial[0]
        cuda.syncthreads()  # everyone has read partial[0] before step 2 overwrites it

        if row_max == -math.inf:  # the row sees no key (the same for the whole block): output 0, LSE -inf
            for j in range(t, n, threads):
                probs[bh, i, j] = 0.0
            if t == 0:
                lse[bh, i] = -math.inf
            return

        # 2. the normaliser, reduced the same way
        local = float32(0.0)
        for j in range(t, n, threads):
            local += math.exp(scores[bh, i, j] - row_max)
        partial[t] = local
        cuda.syncthreads()
        stride = threads // 2
        while stride > 0:
            if t < stride:
                partial[t] += partial[t + stride]
            cuda.syncthreads()
            stride //= 2
        total = partial[0]

        # 3. the probabilities
        for j in range(t, n, threads):
            probs[bh, i, j] = math.exp(scores[bh, i, j] - row_max) / total
        if t == 0:
            lse[bh, i] = row_max + math.log(total)

    return block_softmax_kernel
# endregion


_F32_3D = "float32[:, :, ::1]"
SCORES_SIGNATURE = f"void({_F32_3D}, {_F32_3D}, uint8[:, ::1], int64, float32, boolean, int64, {_F32_3D})"
WEIGHTED_SUM_SIGNATURE = f"void({_F32_3D}, {_F32_3D}, boolean, int64, {_F32_3D})"
SOFTMAX_SIGNATURE = f"void({_F32_3D}, {_F32_3D}, float32[:, ::1])"


@functools.lru_cache(maxsize=None)
def tiled_kernels(tile=DEFAULT_TILE, softmax_threads=DEFAULT_SOFTMAX_THREADS):
    """The package's (scores, softmax, weighted_sum) kernels for one configuration, made once and
    registered so that CI compiles them."""
    if tile < 1 or tile * tile > 1024:
        raise ValueError(f"tile={tile}: a block of tile x tile threads must have 1..1024 threads, so 1 <= tile <= 32")
    if softmax_threads < 1 or softmax_threads > 1024 or softmax_threads & (softmax_threads - 1):
        raise ValueError(f"softmax_threads={softmax_threads}: must be a power of two between 1 and 1024")
    scores_k, weighted_sum_k = _tile_kernels(tile)
    softmax_k = _softmax_kernel(softmax_threads)
    return scores_k, softmax_k, weighted_sum_k


@functools.lru_cache(maxsize=None)
def _tile_kernels(tile):
    scores_k, weighted_sum_k = make_tiled_kernels(tile)
    rebuild = (__name__, "_tile_kernels", (tile,))
    register_kernel(f"tiled.tiled_scores_kernel[tile={tile}]", scores_k, SCORES_SIGNATURE, rebuild)
    register_kernel(f"tiled.tiled_weighted_sum_kernel[tile={tile}]", weighted_sum_k, WEIGHTED_SUM_SIGNATURE, rebuild)
    return scores_k, weighted_sum_k


@functools.lru_cache(maxsize=None)
def _softmax_kernel(threads):
    kernel = make_block_softmax_kernel(threads)
    register_kernel(f"tiled.block_softmax_kernel[threads={threads}]", kernel, SOFTMAX_SIGNATURE,
                    (__name__, "_softmax_kernel", (threads,)))
    return kernel


for _tile in TILE_SIZES:  # the configurations the lessons and the benchmark use, known to CI
    _tile_kernels(_tile)
for _threads in (16, 128):
    _softmax_kernel(_threads)


# region: tiled_forward
def tiled_forward(q, k, v, *, causal=False, key_padding_mask=None, scale=None, tile=DEFAULT_TILE,
                  softmax_threads=DEFAULT_SOFTMAX_THREADS, kernels=None):
    """Attention with the tiled kernels; returns (out (B, H, Lq, D), lse (B, H, Lq)).

    `kernels` = (scores, softmax, weighted_sum) to launch instead of the package's, e.g. your own
    ``(make_tiled_scores_kernel(tile), make_block_softmax_kernel(128), make_tiled_weighted_sum_kernel(tile))``;
    they must have been made for the same `tile` and `softmax_threads`.
    """
    scores_k, softmax_k, weighted_sum_k = kernels or tiled_kernels(tile, softmax_threads)
    B, H, Lq, D = q.shape
    Hk, Lk = k.shape[1], k.shape[2]
    scale = np.float32(1.0 / math.sqrt(D) if scale is None else scale)
    offset = causal_offset(causal, Lq, Lk)  # query i sees keys j <= i + offset; None: not causal
    q3 = device.to_work(q).reshape(B * H, Lq, D)
    k3 = device.to_work(k).reshape(B * Hk, Lk, D)
    v3 = device.to_work(v).reshape(B * Hk, Lk, D)
    key_keep = key_keep_mask(key_padding_mask, B, Lk)
    scores = device.empty((B * H, Lq, Lk))
    probs = device.empty((B * H, Lq, Lk))
    out = device.empty((B * H, Lq, D))
    lse = device.empty((B * H, Lq))
    view = device.kernel_view

    # (batch, head) in x, which allows 2**31 - 1 blocks; y and z allow 65,535: Lq, Lk <= 65,535 * tile
    grid = (B * H, math.ceil(Lq / tile), math.ceil(Lk / tile))  # one block per tile of S
    check_grid("tiled", grid, ("B*H", f"Lq / {tile}", f"Lk / {tile}"))  # the other two grids are smaller
    scores_k[grid, (tile, tile)](view(q3), view(k3), view(key_keep), H, scale, offset is not None, offset or 0,
                                 view(scores))
    softmax_k[B * H * Lq, softmax_threads](view(scores), view(probs), view(lse))  # one block per row
    grid = (B * H, math.ceil(Lq / tile), math.ceil(D / tile))  # one block per tile of O
    weighted_sum_k[grid, (tile, tile)](view(probs), view(v3), offset is not None, offset or 0, view(out))
    return out.reshape(B, H, Lq, D), lse.reshape(B, H, Lq)
# endregion


def reuse_factor(tile: int) -> float:
    """How many times each number a block copies into shared memory is used: `tile` (a global load per
    multiply-add in the naive kernel, one per `tile` of them here)."""
    return float(tile)


def shared_bytes_per_block(tile: int) -> dict:
    """Static shared memory of each tiled kernel's block, in bytes (float32)."""
    return {"tiled_scores_kernel": 4 * (tile * tile + tile * (tile + 1)),
            "tiled_weighted_sum_kernel": 4 * 2 * tile * tile}


def simulator_seconds(B, H, Lq, Lk, D, tile=DEFAULT_TILE, softmax_threads=DEFAULT_SOFTMAX_THREADS) -> float:
    """Rough seconds on numba's CUDA simulator (2 CPU cores): ~0.1 ms to start each Python thread, a few
    ms per syncthreads of a block (more for bigger blocks), ~1.5 us per array access in a thread."""
    threads_per_tile = tile * tile

    def sync_seconds(threads):  # measured: ~6 ms per barrier of 64 threads, ~60 ms of 256
        return 1.2e-5 * threads ** 1.5

    tiles_s = math.ceil(Lq / tile) * math.ceil(Lk / tile)
    tiles_o = math.ceil(Lq / tile) * math.ceil(D / tile)
    syncs = tiles_s * 2 * math.ceil(D / tile) + tiles_o * 2 * math.ceil(Lk / tile)
    softmax_syncs = Lq * (3 + 2 * int(math.log2(softmax_threads)))
    threads = (tiles_s + tiles_o) * threads_per_tile + Lq * softmax_threads
    accesses = 4 * Lq * Lk * D + 6 * Lq * Lk
    seconds = (syncs * sync_seconds(threads_per_tile) + softmax_syncs * sync_seconds(softmax_threads) + threads * 1.2e-4
               + accesses * 1.5e-6)
    return B * H * seconds


STAGE = Stage(
    name="tiled",
    lesson="03_tiled",
    summary="numba.cuda, shared-memory tiles for QK^T and PV, block-wide row softmax; S and P in global memory",
    forward=tiled_forward,
    dtypes=("float32",),
    head_dims=(16, 32, 64, 128),
    workspace_bytes=workspace_bytes,
    simulator_seconds=simulator_seconds,
    order=3,
)
