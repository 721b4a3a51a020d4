"""Stage 02: naive attention on the GPU in numba.cuda, three kernels, one thread per output element.

Taught in lesson 02 (``notebooks/02_naive.ipynb``), which shows every region below in full; lesson 03
compares its tiled kernels with these. The kernels work on (B*H, L, D) views of the (B, H, L, D) inputs,
so one grid dimension walks the (batch, head) pairs: x, the only one CUDA lets grow past 65,535 blocks
(to 2**31 - 1), so a large batch of short sequences runs. K and V may have fewer heads Hk (grouped-query
attention), viewed as (B*Hk, Lk, D): pair bh then reads K/V pair bh // (H // Hk).

    scores_kernel        S = scale * Q K^T, masked entries -inf      one thread per element of S
    row_softmax_kernel   P = softmax(S) by rows, and LSE per row     one thread per row
    weighted_sum_kernel  O = P V                                     one thread per element of O

S and P are float32 buffers of B*H*Lq*Lk numbers each: the O(L^2) memory lesson 04 removes.
"""

from __future__ import annotations

import math

import numpy as np
from numba import cuda, float32

from ... import device
from ...reference import causal_offset
from ...resources import register_kernel
from .. import Stage

__all__ = ["scores_kernel", "row_softmax_kernel", "weighted_sum_kernel", "naive_forward", "grid_shapes", "check_grid", "GRID_LIMITS",
           "global_memory_traffic", "workspace_bytes", "STAGE", "SCORES_SIGNATURE", "SOFTMAX_SIGNATURE",
           "WEIGHTED_SUM_SIGNATURE"]


# region: scores_kernel
@cuda.jit
def scores_kernel(q,         # (B*H, Lq, D) float32 queries
                  k,         # (B*Hk, Lk, D) float32 keys; Hk divides H
                  key_keep,  # (B, Lk) uint8, 1 where the key takes part
                  num_heads,  # H, to find the batch element b = bh // H of the mask
                  scale,     # float32 multiplier of the dot products
                  causal,    # bool: query i sees only keys j <= i + causal_offset
                  causal_offset,  # int: 0 (top-left), or Lk - Lq (bottom-right)
                  scores):   # (B*H, Lq, Lk) float32 output S
    bh = cuda.blockIdx.x  # (batch, head) pair: x, the grid dimension that may exceed 65,535 blocks
    i = cuda.blockIdx.y * cuda.blockDim.y + cuda.threadIdx.y  # query
    j = cuda.blockIdx.z * cuda.blockDim.x + cuda.threadIdx.x  # key: neighbouring threads write neighbouring S
    kv = bh // (q.shape[0] // k.shape[0])  # = b*Hk + h // (H // Hk): the K/V head query head h shares (GQA)
    if i >= scores.shape[1] or j >= scores.shape[2]:
        return  # the grid is rounded up to whole blocks; these threads have no element
    if (causal and j > i + causal_offset) or key_keep[bh // num_heads, j] == 0:
        scores[bh, i, j] = -math.inf  # exp(-inf) = 0: the key gets no weight
        return
    # Every thread reads a whole row of Q and of K from global memory. The sum goes in blocks of 16:
    # each block's products are added up on their own and then into the total, so no rounding happens
    # on a running total that has grown large (half the error of one long chain at D = 128; SDPA sums
    # in blocks too, and the check compares with SDPA).
    total = float32(0.0)
    for d0 in range(0, q.shape[2], 16):
        block_sum = float32(0.0)
        for d in range(d0, min(d0 + 16, q.shape[2])):
            block_sum += q[bh, i, d] * k[kv, j, d]
        total += block_sum
    scores[bh, i, j] = scale * total
# endregion


# region: row_softmax_kernel
@cuda.jit
def row_softmax_kernel(scores,  # (B*H, Lq, Lk) float32 input S
                       probs,   # (B*H, Lq, Lk) float32 output P
                       lse):    # (B*H, Lq) float32 output: log-sum-exp of each row of S
    bh = cuda.blockIdx.x  # (batch, head) pair
    i = cuda.blockIdx.y * cuda.blockDim.x + cuda.threadIdx.x  # row (query)
    if i >= scores.shape[1]:
        return
    n = scores.shape[2]
    row_max = float32(-math.inf)  # pass 1: the maximum, so that exp never sees a positive argument
    for j in range(n):
        row_max = max(row_max, scores[bh, i, j])
    if row_max == -math.inf:  # the row sees no key: output 0, LSE -inf (never 0/0 = NaN)
        for j in range(n):
            probs[bh, i, j] = 0.0
        lse[bh, i] = -math.inf
        return
    # pass 2: the normaliser, summed in blocks of 16 like the dot products. One chain of a thousand
    # terms, each rounded onto the growing total, put a relative error of ~1e-6 on every probability of the
    # row: at L = 1024 this stage was 2.25x SDPA's error on an H100 because of it, 0.52x with blocks.
    total = float32(0.0)
    for j0 in range(0, n, 16):
        block_sum = float32(0.0)
        for j in range(j0, min(j0 + 16, n)):
            block_sum += math.exp(scores[bh, i, j] - row_max)
        total += block_sum
    for j in range(n):  # pass 3: the probabilities
        probs[bh, i, j] = math.exp(scores[bh, i, j] - row_max) / total
    lse[bh, i] = row_max + math.log(total)
# endregion


# region: weighted_sum_kernel
@cuda.jit
def weighted_sum_kernel(probs,  # (B*H, Lq, Lk) float32 P
                        v,      # (B*Hk, Lk, D) float32 values; Hk divides H
                        out):   # (B*H, Lq, D) float32 output O
    bh = cuda.blockIdx.x  # (batch, head) pair
    i = cuda.blockIdx.y * cuda.blockDim.y + cuda.threadIdx.y  # row of O (query)
    d = cuda.blockIdx.z * cuda.blockDim.x + cuda.threadIdx.x  # column of O: neighbours read neighbouring V
    kv = bh // (probs.shape[0] // v.shape[0])  # the K/V pair of scores_kernel (GQA)
    if i >= out.shape[1] or d >= out.shape[2]:
        return
    # A whole row of P and a whole column of V per thread, summed in blocks of 16 keys as the scores
    # are: one chain over thousands of keys rounds on a large running total at every step (in a float32
    # emulation at L = 1024, blocks cut this sum's error about 3x).
    total = float32(0.0)
    for j0 in range(0, v.shape[1], 16):
        block_sum = float32(0.0)
        for j in range(j0, min(j0 + 16, v.shape[1])):
            block_sum += probs[bh, i, j] * v[kv, j, d]
        total += block_sum
    out[bh, i, d] = total
# endregion


# The argument types the launcher below passes (C-contiguous float32 arrays, a uint8 mask, H as int64,
# scale as float32, causal as bool, its offset as int64); CI compiles each kernel with exactly these for sm_80
# and sm_90.
_F32_3D = "float32[:, :, ::1]"
SCORES_SIGNATURE = f"void({_F32_3D}, {_F32_3D}, uint8[:, ::1], int64, float32, boolean, int64, {_F32_3D})"
SOFTMAX_SIGNATURE = f"void({_F32_3D}, {_F32_3D}, float32[:, ::1])"
WEIGHTED_SUM_SIGNATURE = f"void({_F32_3D}, {_F32_3D}, {_F32_3D})"
register_kernel("naive.scores_kernel", scores_kernel, SCORES_SIGNATURE)
register_kernel("naive.row_softmax_kernel", row_softmax_kernel, SOFTMAX_SIGNATURE)
register_kernel("naive.weighted_sum_kernel", weighted_sum_kernel, WEIGHTED_SUM_SIGNATURE)


def grid_shapes(B, H, Lq, Lk, D, block=16, softmax_threads=128) -> dict:
    """{kernel: (blocks per grid, threads per block)} as the launcher below launches them."""
    return {
        "scores_kernel": ((B * H, math.ceil(Lq / block), math.ceil(Lk / block)), (block, block)),
        "row_softmax_kernel": ((B * H, math.ceil(Lq / softmax_threads)), (softmax_threads,)),
        "weighted_sum_kernel": ((B * H, math.ceil(Lq / block), math.ceil(D / block)), (block, block)),
    }


# CUDA's limits on a grid's blocks: x up to 2**31 - 1, y and z up to 65,535 each. Every launcher of the package
# puts the (batch, head) pairs in x, so B*H is never what fails; the lengths in y and z are limited instead
# (here Lq and Lk at most 65,535 blocks of `block`: 1,048,560 at block 16), which check_grid refuses by name.
GRID_LIMITS = (2**31 - 1, 65_535, 65_535)


def check_grid(stage, grid, what) -> None:
    """Refuse a launch CUDA would reject (the simulator would not), naming the size to blame, before any work.

    `grid`: the blocks along x, y, z; `what`: what each dimension counts, e.g. ("B*H", "Lq / 16", "Lk / 16")."""
    for axis, blocks, limit, counts in zip("xyz", grid, GRID_LIMITS, what):
        if blocks > limit:
            raise ValueError(f"stage={stage!r}: gridDim.{axis} would be {counts} = {blocks:,} blocks, over CUDA's "
                             f"limit of {limit:,}; use shorter sequences or another stage")


def key_keep_mask(key_padding_mask, B, Lk):
    """The (B, Lk) uint8 mask the kernels read: the caller's bool mask, or all ones."""
    if key_padding_mask is None:
        return device.to_work(np.ones((B, Lk), dtype=np.uint8), dtype=np.uint8)
    return device.to_work(key_padding_mask, dtype=np.uint8)


# region: naive_forward
def naive_forward(q, k, v, *, causal=False, key_padding_mask=None, scale=None, block=16,
                  softmax_threads=128, kernels=None):
    """Attention with the three naive kernels; returns (out (B, H, Lq, D), lse (B, H, Lq)).

    `kernels` = (scores, softmax, weighted_sum) kernels to launch instead of this module's, e.g. your
    own edited versions; `block` is the side of the square thread blocks of the two matrix kernels.
    """
    scores_k, softmax_k, weighted_sum_k = kernels or (scores_kernel, row_softmax_kernel, weighted_sum_kernel)
    B, H, Lq, D = q.shape
    Hk, Lk = k.shape[1], k.shape[2]
    scale = np.float32(1.0 / math.sqrt(D) if scale is None else scale)  # float32: no float64 math on the GPU
    offset = causal_offset(causal, Lq, Lk)  # query i sees keys j <= i + offset; None: not causal
    # (B, H, L, D) -> (B*H, L, D): gridDim.x walks the (batch, head) pairs (x allows 2**31 - 1 blocks, y and z
    # 65,535); K and V: (B*Hk, Lk, D)
    q3 = device.to_work(q).reshape(B * H, Lq, D)
    k3 = device.to_work(k).reshape(B * Hk, Lk, D)
    v3 = device.to_work(v).reshape(B * Hk, Lk, D)
    key_keep = key_keep_mask(key_padding_mask, B, Lk)
    scores = device.empty((B * H, Lq, Lk))  # S: the first L x L buffer
    probs = device.empty((B * H, Lq, Lk))   # P: the second
    out = device.empty((B * H, Lq, D))
    lse = device.empty((B * H, Lq))
    view = device.kernel_view

    grid = (B * H, math.ceil(Lq / block), math.ceil(Lk / block))  # one thread per element of S
    check_grid("naive", grid, ("B*H", f"Lq / {block}", f"Lk / {block}"))  # the other two grids are smaller
    scores_k[grid, (block, block)](view(q3), view(k3), view(key_keep), H, scale, offset is not None, offset or 0,
                                   view(scores))
    grid = (B * H, math.ceil(Lq / softmax_threads))  # one thread per row
    softmax_k[grid, softmax_threads](view(scores), view(probs), view(lse))
    grid = (B * H, math.ceil(Lq / block), math.ceil(D / block))  # one thread per element of O
    weighted_sum_k[grid, (block, block)](view(probs), view(v3), view(out))
    return out.reshape(B, H, Lq, D), lse.reshape(B, H, Lq)
# endregion


def workspace_bytes(B, H, Lq, Lk, D) -> int:
    """The L x L buffers: S and P in float32."""
    return 2 * 4 * B * H * Lq * Lk


def global_memory_traffic(B, H, Lq, Lk, D) -> dict:
    """Analytic global-memory bytes of each kernel (float32), as the code asks for them and as a minimum.

    ``requested``: every load the threads issue (each thread of scores_kernel reads 2*D numbers);
    ``compulsory``: each input byte read once and each output byte written once, what a perfect cache
    would leave for DRAM. Measured DRAM traffic lies between the two; lesson 02 compares.
    """
    f = 4
    bh = B * H
    return {
        "scores_kernel": {
            "read_requested": bh * Lq * Lk * 2 * D * f + B * Lk,
            "read_compulsory": bh * (Lq + Lk) * D * f + B * Lk,
            "write": bh * Lq * Lk * f,
        },
        "row_softmax_kernel": {
            "read_requested": 3 * bh * Lq * Lk * f,  # three passes over each row
            "read_compulsory": bh * Lq * Lk * f,
            "write": bh * Lq * Lk * f + bh * Lq * f,
        },
        "weighted_sum_kernel": {
            "read_requested": bh * Lq * D * 2 * Lk * f,
            "read_compulsory": bh * (Lq * Lk + Lk * D) * f,
            "write": bh * Lq * D * f,
        },
    }


def simulator_seconds(B, H, Lq, Lk, D) -> float:
    """Rough seconds on numba's CUDA simulator: it starts one Python thread per CUDA thread (~0.1 ms
    each) and every array access in a thread is a Python call (~1.5 us). Calibrated on 2 CPU cores."""
    block = 16
    threads = B * H * (math.ceil(Lq / block) * block * (math.ceil(Lk / block) * block + math.ceil(D / block) * block)
                       + math.ceil(Lq / 128) * 128)
    accesses = B * H * (2 * Lq * Lk * D + 4 * Lq * Lk + 2 * Lq * D * Lk)
    return 1.2e-4 * threads + 1.5e-6 * accesses


STAGE = Stage(
    name="naive",
    lesson="02_naive",
    summary="numba.cuda, three kernels (S, softmax, PV), one thread per element; S and P in global memory",
    forward=naive_forward,
    dtypes=("float32",),
    head_dims=(16, 32, 64, 128),
    workspace_bytes=workspace_bytes,
    simulator_seconds=simulator_seconds,
    order=2,
)
