"""Lesson 04's first kernel: FlashAttention's loop with one query row per thread (numba.cuda).

The step between the NumPy loop of ``online_softmax.py`` and the register-blocked kernel of ``kernel.py``: each
thread owns one query row and keeps its running max ``m``, sum ``l`` and output accumulator in registers (local
arrays); the threads of a block load each tile of ``block_n`` keys and values into shared memory together, then
each folds the tile into its own row. Correct for every mask, and simple; slow, because every multiply-add needs
one shared-memory load (the row's ``q`` is in registers, the key is not), which is what register blocking in
``kernel.py`` fixes. NOTES.md has its speed on a GPU (version 0).
"""

from __future__ import annotations

import math

import numpy as np
from numba import cuda, float32

from ... import device
from ...resources import register_kernel
from ..naive.kernel import check_grid, key_keep_mask

__all__ = ["make_one_row_kernel", "one_row_forward", "SIGNATURE"]

_F32_3D = "float32[:, :, ::1]"
SIGNATURE = f"void({_F32_3D}, {_F32_3D}, {_F32_3D}, uint8[:, ::1], int64, float32, boolean, {_F32_3D}, float32[:, ::1])"


# region: one_row_setup
def make_one_row_kernel(D, block_n):
    """A kernel for head dim D (the size of each thread's local arrays must be a compile-time constant)."""

    @cuda.jit
    def one_row_kernel(q,          # (B*H, Lq, D) float32 queries
                       k,          # (B*H, Lk, D) float32 keys
                       v,          # (B*H, Lk, D) float32 values
                       key_keep,   # (B, Lk) uint8: 1 where the key takes part
                       num_heads,  # H, to find a (batch*head) index's batch element
                       scale,      # float32 softmax scale
                       causal,     # bool: query i sees only keys j <= i
                       out,        # (B*H, Lq, D) float32 output O
                       lse):       # (B*H, Lq) float32 output: log-sum-exp of each row
        k_tile = cuda.shared.array((block_n, D), float32)
        v_tile = cuda.shared.array((block_n, D), float32)
        q_row = cuda.local.array(D, float32)   # this thread's query row, in registers
        acc = cuda.local.array(D, float32)     # its unnormalised output
        s = cuda.local.array(block_n, float32)  # its scores for the current tile
        bh = cuda.blockIdx.x  # (batch, head) pair: x, the grid dimension that may exceed 65,535 blocks
        i = cuda.blockIdx.y * cuda.blockDim.x + cuda.threadIdx.x  # this thread's query row
        Lq, Lk = q.shape[1], k.shape[1]
        active = i < Lq  # threads past the last row still help load the tiles
        for d in range(D):
            q_row[d] = q[bh, i, d] if active else 0.0
            acc[d] = 0.0
        m = float32(-math.inf)  # running max of the scores seen so far
        l = float32(0.0)        # running sum of exp(score - m)
# endregion

        # region: one_row_tile_loop
        for j0 in range(0, Lk, block_n):
            # the block loads the tile together: thread t copies elements t, t + threads, ...
            for e in range(cuda.threadIdx.x, block_n * D, cuda.blockDim.x):
                jj, d = e // D, e % D
                inside = j0 + jj < Lk
                k_tile[jj, d] = k[bh, j0 + jj, d] if inside else 0.0
                v_tile[jj, d] = v[bh, j0 + jj, d] if inside else 0.0
            cuda.syncthreads()  # the tiles are complete before anyone reads them
            if active:
                tile_max = float32(-math.inf)
                for jj in range(block_n):
                    j = j0 + jj
                    if j >= Lk or (causal and j > i) or key_keep[bh // num_heads, j] == 0:
                        s[jj] = -math.inf
                    else:
                        dot = float32(0.0)
                        for d in range(D):
                            dot += q_row[d] * k_tile[jj, d]
                        s[jj] = scale * dot
                    tile_max = max(tile_max, s[jj])
                new_m = max(m, tile_max)
                if new_m > -math.inf:  # this row has seen a key: fold the tile in
                    alpha = math.exp(m - new_m)  # rescale what was accumulated against the old max
                    l *= alpha
                    for d in range(D):
                        acc[d] *= alpha
                    for jj in range(block_n):
                        p = math.exp(s[jj] - new_m)  # 0 for a masked key
                        l += p
                        for d in range(D):
                            acc[d] += p * v_tile[jj, d]
                    m = new_m
            cuda.syncthreads()  # everyone is done with the tiles before the next ones overwrite them
        if active:
            inv = float32(1.0) / l if l > 0 else float32(0.0)  # a row that saw no key: zeros, LSE -inf
            for d in range(D):
                out[bh, i, d] = acc[d] * inv
            lse[bh, i] = m + math.log(l) if l > 0 else -math.inf

    return one_row_kernel
# endregion


_KERNELS: dict = {}


def _kernel(D: int, block_n: int):
    key = (D, block_n)
    if key not in _KERNELS:
        _KERNELS[key] = make_one_row_kernel(D, block_n)
        register_kernel(f"flash.one_row_kernel[D={D},block_n={block_n}]", _KERNELS[key], SIGNATURE,
                        (__name__, "_kernel", key))
    return _KERNELS[key]


for _D in (16, 32, 64, 128):  # the head dims the lesson checks; CI compiles each for sm_80 and sm_90
    _kernel(_D, 32)


def one_row_forward(q, k, v, *, causal=False, key_padding_mask=None, scale=None, threads=64, block_n=32,
                    kernel=None):
    """Attention with one query row per thread; returns (out (B, H, Lq, D), lse (B, H, Lq)).

    `kernel`: one made by :func:`make_one_row_kernel` (for example from the lesson's edited cell)."""
    B, H, Lq, D = q.shape
    Lk = k.shape[2]
    kernel = kernel or _kernel(D, block_n)
    scale = np.float32(1.0 / math.sqrt(D) if scale is None else scale)
    q3 = device.to_work(q).reshape(B * H, Lq, D)
    k3 = device.to_work(k).reshape(B * H, Lk, D)
    v3 = device.to_work(v).reshape(B * H, Lk, D)
    out = device.empty((B * H, Lq, D))
    lse = device.empty((B * H, Lq))
    view = device.kernel_view
    grid = (B * H, math.ceil(Lq / threads))  # one thread per query row
    check_grid("flash (one_row_forward)", grid, ("B*H", f"Lq / {threads}"))
    kernel[grid, threads](view(q3), view(k3), view(v3), view(key_keep_mask(key_padding_mask, B, Lk)), H, scale,
                          bool(causal), view(out), view(lse))
    return out.reshape(B, H, Lq, D), lse.reshape(B, H, Lq)
