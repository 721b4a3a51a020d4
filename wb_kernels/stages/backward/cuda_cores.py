"""The ``flash`` stage's gradients on CUDA cores in numba.cuda (lesson 08_backward; runs on the simulator in CI).

FlashAttention-2's backward pass (Dao 2023, "FlashAttention-2: Faster Attention with Better Parallelism and Work
Partitioning", Algorithm 2), split into three kernels so that no gradient is summed with atomics and the result is
the same bits on every run:

1. :func:`preprocess_kernel`, one thread per query row: ``D_i = sum_d dO_id * O_id`` (the softmax Jacobian's one
   number per row), and the forward's LSE in log2 units, with a row that saw no key (LSE = -inf) turned into +BIG so
   that every ``exp2(score - lse)`` of that row is exactly 0 (no -inf ever reaches a fastmath kernel, no NaN); a
   finite LSE, however negative (-1e31), is a row with keys;
2. the KV-stationary kernel (``dkdv_kernel``): a block owns ``block_n`` keys of one key/value head, keeps their dK and
   dV in registers and streams the query tiles of every query head of the GQA group past them: it recomputes
   ``P = exp(scale q k - lse)``, then ``dV += Pᵀ dO``, ``dP = dO Vᵀ``, ``dS = P * (dP - D)``,
   ``dK += scale dSᵀ Q``.
   The group's heads are summed inside the block, in a fixed order;
3. the Q-stationary kernel (``dq_kernel``): a block owns ``block_m`` query rows, streams the key tiles past them
   (the forward's loop order) and accumulates ``dQ += scale dS K``.

P and dS are recomputed twice (once per gradient kernel): the price of determinism without atomics. Neither kernel
stores anything of size Lq x Lk: the extra memory is D (B, H, Lq) and the log2 LSE (B, H, Lq).

Register blocking as in the forward (``wb_kernels/stages/flash/kernel.py``): the ``threads_per_row`` threads of a
group share ``per_thread`` rows of the block's stationary side (keys in dkdv, query rows in dq); for the score tile
each thread computes those rows against every ``threads_per_row``-th column of the streamed tile, for the
accumulators against every ``threads_per_row``-th head dimension. Tiles are stored transposed (D x rows, stride
rows + 1), so one copy of Q, dO, K or V serves both "row . row" products (scores) and "column" reads (accumulation).
No warp shuffles, so the same code runs on numba's CUDA simulator.

Layout of the dynamic shared memory (float32 words), see :func:`backward_shared_layout`:
``Kᵀ | Vᵀ (D x block_n+1 each) | Qᵀ | dOᵀ (D x block_m+1 each) | Pᵀ | dSᵀ (block_n x block_m+pad each) |``
``lse2 | D (block_m each)``.
The dq kernel uses the same layout: its dS (block_m x block_n+pad) goes into the dSᵀ words; it leaves Pᵀ unused.

Launch: (batch, head, tile) flattened into gridDim.x (limit 2^31 - 1), so a large batch of short sequences fits
(gridDim.y and z stop at 65,535).

:func:`flash_gradients` is the launcher, the :class:`~wb_kernels.stages.Backward` contract for the ``flash`` stage.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
from numba import cuda, float32, uint64  # after ..backend (imported by the package first): the simulator switch

from ...backend import BACKEND
from ...device import empty, is_torch, kernel_view, to_work
from ...reference import causal_offset
from ...resources import register_kernel
from ..flash.kernel import LOG2E, allow_shared_bytes, jit_options

__all__ = ["BackwardConfig", "SIMULATOR_CONFIG", "GPU_CONFIGS", "config_for", "backward_shared_layout",
           "make_backward_kernels", "get_kernels", "preprocess_kernel", "flash_gradients", "simulator_seconds",
           "HEAD_DIMS", "DKDV_SIGNATURE", "DQ_SIGNATURE", "PREPROCESS_SIGNATURE", "BIG", "MAX_GRID_X", "LSE_LIMIT",
           "check_lse_range"]

# A row that saw no key gets lse2 = +BIG: exp2(score - BIG) underflows to exactly 0, without an infinity that the
# fastmath kernels may assume away (the forward stores such a row's LSE as -inf).
BIG = 1.0e30
# The kernels recompute P = exp2(score * scale * log2(e) - lse2) in float32. At |LSE| = 2^24 the rounding of lse2 alone
# is about 1 in that exponent, and beyond it grows with |LSE|: P is then off by factors of e and more, and at
# |LSE| ~ 1e31 it is 0 or inf. No float32 LSE can carry log(l) there (its ulp is 1e24): such rows are refused.
LSE_LIMIT = 2.0**24
MAX_GRID_X = 2**31 - 1
HEAD_DIMS = (16, 32, 64, 128)  # what the flash forward takes


@dataclass(frozen=True)
class BackwardConfig:
    """Tile shape of both gradient kernels; every field is a compile-time constant."""

    block_m: int = 64  # query rows per tile (streamed in dkdv, stationary in dq)
    block_n: int = 64  # keys per tile (stationary in dkdv, streamed in dq)
    per_thread: int = 4  # stationary rows each thread owns: keys in dkdv, query rows in dq
    threads_per_row: int = 8  # threads sharing them (split the streamed tile's columns and the head dims)
    min_blocks: int = 1  # launch bound: ptxas keeps registers low enough for this many blocks per SM

    @property
    def dkdv_threads(self) -> int:
        return (self.block_n // self.per_thread) * self.threads_per_row

    @property
    def dq_threads(self) -> int:
        return (self.block_m // self.per_thread) * self.threads_per_row

    def validate(self, D: int) -> None:
        c, problems = self, []
        for name in ("block_m", "block_n"):
            if getattr(c, name) % c.per_thread or getattr(c, name) % c.threads_per_row:
                problems.append(f"{name}={getattr(c, name)} is not a multiple of per_thread={c.per_thread} "
                                f"and threads_per_row={c.threads_per_row}")
        if D < 1 or D & (D - 1) or D % c.threads_per_row:
            problems.append(f"D={D} is not a power of two that threads_per_row={c.threads_per_row} divides")
        for threads in (c.dkdv_threads, c.dq_threads):
            if not 1 <= threads <= 1024:
                problems.append(f"{threads} threads per block (must be 1..1024)")
        if problems:
            raise ValueError(f"BackwardConfig {c}: " + "; ".join(problems))


# The simulator runs one Python thread per CUDA thread and a barrier costs milliseconds: 16 threads per block.
SIMULATOR_CONFIG = BackwardConfig(block_m=16, block_n=16, per_thread=4, threads_per_row=4)
# Not tuned (no GPU run yet): chosen so that neither kernel spills at sm_80/sm_90 (tests/test_ptx_compile.py shows
# the registers) and the shared memory fits an A100's 163 KiB; NOTES.md has the arithmetic.
GPU_CONFIGS = {
    16: BackwardConfig(32, 32, 4, 8, 2),
    32: BackwardConfig(64, 64, 4, 16, 2),
    64: BackwardConfig(64, 64, 4, 16, 1),
    128: BackwardConfig(32, 64, 4, 16, 1),
}


def config_for(D: int) -> BackwardConfig:
    """The tile shape used when the caller gives none: small on the simulator, per head dim on a GPU."""
    if BACKEND.is_simulator:
        return SIMULATOR_CONFIG
    return GPU_CONFIGS.get(D, BackwardConfig())


def backward_shared_layout(D: int, config: BackwardConfig) -> dict:
    """Offsets and strides (float32 words) of both kernels' shared memory, and its size in bytes.

    The transposed tiles get one extra column (their transposing stores then walk the banks with an odd stride); the
    Pᵀ and dSᵀ rows get ``threads_per_row`` extra words, as the forward's P does. The dq kernel's dS tile
    (block_m x block_n+pad) goes into the dSᵀ words, sized for the larger of the two shapes.
    """
    c = config
    pad = c.threads_per_row if c.threads_per_row < 32 else 0
    k_stride, q_stride = c.block_n + 1, c.block_m + 1
    pt_stride, ds_stride = c.block_m + pad, c.block_n + pad
    p_words = max(c.block_n * pt_stride, c.block_m * ds_stride)
    k_off = 0
    v_off = k_off + D * k_stride
    q_off = v_off + D * k_stride
    do_off = q_off + D * q_stride
    p_off = do_off + D * q_stride
    ds_off = p_off + p_words
    lse_off = ds_off + p_words
    delta_off = lse_off + c.block_m
    words = delta_off + c.block_m
    return dict(k_stride=k_stride, q_stride=q_stride, pt_stride=pt_stride, ds_stride=ds_stride, k_off=k_off,
                v_off=v_off, q_off=q_off, do_off=do_off, p_off=p_off, ds_off=ds_off, lse_off=lse_off,
                delta_off=delta_off, words=words, bytes=4 * words)


# region: backward_preprocess
@cuda.jit  # no fastmath: this kernel compares the forward's LSE with -inf, which fastmath may assume away
def preprocess_kernel(out,  # (B, H, Lq, D) float32, the forward's output
                      dout,  # (B, H, Lq, D) float32, dL/d(out)
                      lse,  # (B, H, Lq) float32, the forward's LSE (natural log; -inf for a row that saw no key)
                      delta,  # (B, H, Lq) float32 result: D_i = sum_d dO_id * O_id
                      lse2):  # (B, H, Lq) float32 result: LSE * log2(e), or +BIG for a row that saw no key
    row = cuda.grid(1)  # one thread per query row of the flattened (B, H, Lq)
    B, H, Lq, D = out.shape
    if row >= B * H * Lq:
        return
    b = row // (H * Lq)
    h = (row // Lq) % H
    i = row % Lq
    total = float32(0.0)
    for d in range(D):
        total += dout[b, h, i, d] * out[b, h, i, d]
    delta[b, h, i] = total
    value = lse[b, h, i]
    lse2[b, h, i] = value * float32(LOG2E) if value > float32(-math.inf) else float32(BIG)  # -1e31 is a row with keys
# endregion


_F32_3D, _F32_4D = "float32[:, :, ::1]", "float32[:, :, :, ::1]"
PREPROCESS_SIGNATURE = f"void({_F32_4D}, {_F32_4D}, {_F32_3D}, {_F32_3D}, {_F32_3D})"
# importing this module registers the kernel again in a fresh process: the "rebuild" is a function that does nothing
register_kernel("backward.preprocess_kernel", preprocess_kernel, PREPROCESS_SIGNATURE, (__name__, "_imported", ()))


def _imported():
    return preprocess_kernel


# region: backward_constants
def make_backward_kernels(D, config):
    """The two gradient kernels (dkdv, dq), compile-time specialised for head dim D and one tile shape."""
    BM, BN = config.block_m, config.block_n
    TS, TPR = config.per_thread, config.threads_per_row
    KEY_GROUPS, ROW_GROUPS = BN // TS, BM // TS  # thread t owns stationary rows g, g + GROUPS, ... (g = t // TPR)
    DKDV_THREADS, DQ_THREADS = KEY_GROUPS * TPR, ROW_GROUPS * TPR
    TD = D // TPR  # head dims per thread in the accumulators
    TMR, TN = BM // TPR, BN // TPR  # streamed columns per thread: query rows in dkdv, keys in dq
    LOG2_D = D.bit_length() - 1
    lay = backward_shared_layout(D, config)
    KS, QS, PTS, DSS = lay["k_stride"], lay["q_stride"], lay["pt_stride"], lay["ds_stride"]
    K0, V0, Q0, DO0, P0, DS0 = lay["k_off"], lay["v_off"], lay["q_off"], lay["do_off"], lay["p_off"], lay["ds_off"]
    LSE0, DELTA0 = lay["lse_off"], lay["delta_off"]
    LOG2_E = float32(LOG2E)
    U = uint64  # an unsigned index: numba then skips the negative-index (wraparound) fix-up
    fast = dict(fastmath=True, inline="always")  # inlined by numba: constants propagate, no device query
    # endregion

    # region: backward_tile_helpers
    @cuda.jit(device=True, **fast)
    def load_transposed(smem, base, stride, src, first, rows, t, threads):
        """Rows first .. first+rows-1 of src (L, D) into smem[base + d * stride + r]; zeros past the end."""
        for e in range(t, rows * D, threads):
            r = e >> LOG2_D
            d = e & (D - 1)  # consecutive threads read consecutive floats of a row: coalesced
            value = float32(0.0)
            if first + r < src.shape[0]:
                value = src[U(first + r), U(d)]
            smem[U(base + d * stride + r)] = value

    @cuda.jit(device=True, **fast)
    def load_row_stats(smem, lse2_bh, delta_bh, row0, t, threads):
        """lse2 and D of query rows row0 .. row0+BM-1; a row past Lq gets lse2 = BIG, so its P is 0."""
        for r in range(t, BM, threads):
            in_range = row0 + r < lse2_bh.shape[0]
            smem[U(LSE0 + r)] = lse2_bh[U(row0 + r)] if in_range else float32(BIG)
            smem[U(DELTA0 + r)] = delta_bh[U(row0 + r)] if in_range else float32(0.0)

    @cuda.jit(device=True, **fast)
    def probability(dot, row, key, Lk, causal, offset, key_keep, b, use_mask, exp_scale, row_lse2):
        """P = exp(scale q.k - lse) = exp2(q.k * scale*log2(e) - lse2); exactly 0 where the key is masked."""
        if key >= Lk or (causal and key > row + offset):
            return float32(0.0)
        if use_mask and key_keep[b, U(key)] == 0:
            return float32(0.0)
        return math.exp2(dot * exp_scale - row_lse2)  # row_lse2 = BIG for a row that sees no key: exp2 -> 0
    # endregion

    # region: backward_two_products
    def make_two_products(GROUPS, COLS):
        """Both kernels' score step: x = A Bᵀ and y = A2 B2ᵀ for one thread, TS x COLS each, in registers.

        A and A2 are the stationary tiles (K and V in dkdv, Q and dO in dq), B and B2 the streamed ones, all stored
        transposed (D x rows); the thread takes rows g + GROUPS * i of A and columns c + TPR * j of B.
        """
        @cuda.jit(device=True, **fast)
        def two_products(smem, x, y, a, a2, a_stride, b, b2, b_stride, g, c):
            a_reg = cuda.local.array(TS, float32)
            a2_reg = cuda.local.array(TS, float32)
            b_reg = cuda.local.array(COLS, float32)
            b2_reg = cuda.local.array(COLS, float32)
            for i in range(TS):
                for j in range(COLS):
                    x[i, j] = 0.0
                    y[i, j] = 0.0
            for d in range(D):
                for i in range(TS):
                    a_reg[i] = smem[U(a + d * a_stride + g + GROUPS * i)]
                    a2_reg[i] = smem[U(a2 + d * a_stride + g + GROUPS * i)]
                for j in range(COLS):
                    b_reg[j] = smem[U(b + d * b_stride + c + TPR * j)]
                    b2_reg[j] = smem[U(b2 + d * b_stride + c + TPR * j)]
                for i in range(TS):
                    for j in range(COLS):
                        x[i, j] += a_reg[i] * b_reg[j]
                        y[i, j] += a2_reg[i] * b2_reg[j]
        return two_products

    key_products = make_two_products(KEY_GROUPS, TMR)  # dkdv: Sᵀ = K Qᵀ, dPᵀ = V dOᵀ
    row_products = make_two_products(ROW_GROUPS, TN)  # dq: S = Q Kᵀ, dP = dO Vᵀ
    # endregion

    # region: backward_dkdv_setup
    @cuda.jit(**jit_options(DKDV_THREADS, config.min_blocks))
    def dkdv_kernel(q,  # (B, H, Lq, D) float32 queries
                    k,  # (B, Hk, Lk, D) float32 keys; Hk divides H
                    v,  # (B, Hk, Lk, D) float32 values
                    dout,  # (B, H, Lq, D) float32 dL/d(out)
                    lse2,  # (B, H, Lq) float32 LSE * log2(e), BIG for a row that sees no key (preprocess_kernel)
                    delta,  # (B, H, Lq) float32 D_i (preprocess_kernel)
                    dk,  # (B, Hk, Lk, D) float32 result, summed over the GQA group
                    dv,  # (B, Hk, Lk, D) float32 result, summed over the GQA group
                    key_keep,  # (B, Lk) uint8, 1 = key takes part; read only when use_mask
                    use_mask,  # 0/1
                    causal,  # 0/1: query i sees keys j <= i + causal_offset
                    causal_offset,  # 0 (top-left), or Lk - Lq (bottom-right)
                    scale):  # the softmax scale (any sign: no running maximum here)
        smem = cuda.shared.array(0, float32)
        H, Hk, Lq, Lk = q.shape[1], k.shape[1], q.shape[2], k.shape[2]
        group = H // Hk  # query heads kv, ..., read this key/value head
        key_tiles = (Lk + BN - 1) // BN
        bk = cuda.blockIdx.x // key_tiles  # (batch, kv head, key tile) flattened into gridDim.x
        b, kvh = bk // Hk, bk % Hk
        k0 = (cuda.blockIdx.x % key_tiles) * BN
        t = cuda.threadIdx.x
        g, c = t // TPR, t % TPR  # key group; position inside it
        exp_scale = float32(scale * LOG2_E)
        load_transposed(smem, K0, KS, k[b, kvh], k0, BN, t, DKDV_THREADS)  # K and V stay for the whole block
        load_transposed(smem, V0, KS, v[b, kvh], k0, BN, t, DKDV_THREADS)

        acc_dk = cuda.local.array((TS, TD), float32)  # this thread's TS keys x TD head dims of dK / scale
        acc_dv = cuda.local.array((TS, TD), float32)
        s = cuda.local.array((TS, TMR), float32)  # Sᵀ, then Pᵀ: TS keys x TMR query rows
        dp = cuda.local.array((TS, TMR), float32)  # dPᵀ = V dOᵀ, then dSᵀ
        for i in range(TS):
            for dd in range(TD):
                acc_dk[i, dd] = 0.0
                acc_dv[i, dd] = 0.0
        # causal: query rows before k0 - offset see none of these keys; their tiles are never loaded
        first_tile = max(0, k0 - causal_offset) // BM if causal else 0
        query_tiles = (Lq + BM - 1) // BM
        # endregion

        # region: backward_dkdv_scores
        for hh in range(group * (query_tiles - first_tile)):  # the group's heads one after another, in order
            h = kvh * group + hh // (query_tiles - first_tile)
            row0 = (first_tile + hh % (query_tiles - first_tile)) * BM
            load_transposed(smem, Q0, QS, q[b, h], row0, BM, t, DKDV_THREADS)
            load_transposed(smem, DO0, QS, dout[b, h], row0, BM, t, DKDV_THREADS)
            load_row_stats(smem, lse2[b, h], delta[b, h], row0, t, DKDV_THREADS)
            cuda.syncthreads()
            key_products(smem, s, dp, K0, V0, KS, Q0, DO0, QS, g, c)  # Sᵀ = K Qᵀ, dPᵀ = V dOᵀ: TS x TMR
            # Pᵀ and dSᵀ = Pᵀ * (dPᵀ - D), shared with the block: each thread needs every query row of its keys
            for i in range(TS):
                key = k0 + g + KEY_GROUPS * i
                for j in range(TMR):
                    r = c + TPR * j
                    p = probability(s[i, j], row0 + r, key, Lk, causal, causal_offset, key_keep, b, use_mask,
                                    exp_scale, smem[U(LSE0 + r)])
                    smem[U(P0 + (g + KEY_GROUPS * i) * PTS + r)] = p
                    smem[U(DS0 + (g + KEY_GROUPS * i) * PTS + r)] = p * (dp[i, j] - smem[U(DELTA0 + r)])
            cuda.syncthreads()
            # endregion

            # region: backward_dkdv_accumulate
            # dV += Pᵀ dO and dK += dSᵀ Q for TS keys x TD head dims (dO and Q read from their transposed tiles)
            p_reg, ds_reg = cuda.local.array(TS, float32), cuda.local.array(TS, float32)
            do_reg, q_reg = cuda.local.array(TD, float32), cuda.local.array(TD, float32)
            for r in range(BM):
                for i in range(TS):
                    p_reg[i] = smem[U(P0 + (g + KEY_GROUPS * i) * PTS + r)]
                    ds_reg[i] = smem[U(DS0 + (g + KEY_GROUPS * i) * PTS + r)]
                for dd in range(TD):
                    do_reg[dd] = smem[U(DO0 + (c + TPR * dd) * QS + r)]
                    q_reg[dd] = smem[U(Q0 + (c + TPR * dd) * QS + r)]
                for i in range(TS):
                    for dd in range(TD):
                        acc_dv[i, dd] += p_reg[i] * do_reg[dd]
                        acc_dk[i, dd] += ds_reg[i] * q_reg[dd]
            cuda.syncthreads()  # the next query tile overwrites Q, dO, Pᵀ and dSᵀ

        dk_bh, dv_bh = dk[b, kvh], dv[b, kvh]
        for i in range(TS):
            key = k0 + g + KEY_GROUPS * i
            if key < Lk:  # every key gets written: a key no row sees keeps its zeros
                for dd in range(TD):
                    dk_bh[U(key), U(c + TPR * dd)] = acc_dk[i, dd] * scale
                    dv_bh[U(key), U(c + TPR * dd)] = acc_dv[i, dd]
    # endregion

    # region: backward_dq_setup
    @cuda.jit(**jit_options(DQ_THREADS, config.min_blocks))
    def dq_kernel(q, k, v, dout, lse2, delta,  # as dkdv_kernel's
                  dq,  # (B, H, Lq, D) float32 result
                  key_keep, use_mask, causal, causal_offset, scale):  # as dkdv_kernel's
        smem = cuda.shared.array(0, float32)
        H, Hk, Lq, Lk = q.shape[1], k.shape[1], q.shape[2], k.shape[2]
        query_tiles = (Lq + BM - 1) // BM
        bh = cuda.blockIdx.x // query_tiles  # (batch, head, query tile) flattened into gridDim.x
        b, h = bh // H, bh % H
        kvh = h // (H // Hk)
        # heaviest tiles first: under a causal mask the last query tiles see the most keys
        row0 = (query_tiles - 1 - cuda.blockIdx.x % query_tiles) * BM
        t = cuda.threadIdx.x
        g, c = t // TPR, t % TPR  # row group; position inside it
        exp_scale = float32(scale * LOG2_E)
        load_transposed(smem, Q0, QS, q[b, h], row0, BM, t, DQ_THREADS)  # Q, dO, lse2, D stay for the whole block
        load_transposed(smem, DO0, QS, dout[b, h], row0, BM, t, DQ_THREADS)
        load_row_stats(smem, lse2[b, h], delta[b, h], row0, t, DQ_THREADS)

        acc = cuda.local.array((TS, TD), float32)  # this thread's TS rows x TD head dims of dQ / scale
        s = cuda.local.array((TS, TN), float32)  # S, then P: TS rows x TN keys
        dp = cuda.local.array((TS, TN), float32)  # dP = dO Vᵀ
        ds_reg = cuda.local.array(TS, float32)
        k_reg = cuda.local.array(TD, float32)
        for i in range(TS):
            for dd in range(TD):
                acc[i, dd] = 0.0
        key_tiles = (Lk + BN - 1) // BN
        if causal:  # tiles entirely above the diagonal are never loaded
            last_key = min(row0 + BM, Lq) - 1 + causal_offset  # the last key the block's last row sees
            key_tiles = max(0, min(key_tiles, last_key // BN + 1))
        # endregion

        # region: backward_dq_loop
        for tile in range(key_tiles):
            k0 = tile * BN
            load_transposed(smem, K0, KS, k[b, kvh], k0, BN, t, DQ_THREADS)
            load_transposed(smem, V0, KS, v[b, kvh], k0, BN, t, DQ_THREADS)
            cuda.syncthreads()
            row_products(smem, s, dp, Q0, DO0, QS, K0, V0, KS, g, c)  # S = Q Kᵀ, dP = dO Vᵀ: TS rows x TN keys
            for i in range(TS):  # dS = P * (dP - D), shared: each thread needs every key of its rows
                r = g + ROW_GROUPS * i
                for j in range(TN):
                    p = probability(s[i, j], row0 + r, k0 + c + TPR * j, Lk, causal, causal_offset, key_keep, b,
                                    use_mask, exp_scale, smem[U(LSE0 + r)])
                    smem[U(DS0 + r * DSS + c + TPR * j)] = p * (dp[i, j] - smem[U(DELTA0 + r)])
            cuda.syncthreads()
            for j in range(BN):  # dQ += dS K for TS rows x TD head dims (K read from its transposed tile)
                for i in range(TS):
                    ds_reg[i] = smem[U(DS0 + (g + ROW_GROUPS * i) * DSS + j)]
                for dd in range(TD):
                    k_reg[dd] = smem[U(K0 + (c + TPR * dd) * KS + j)]
                for i in range(TS):
                    for dd in range(TD):
                        acc[i, dd] += ds_reg[i] * k_reg[dd]
            cuda.syncthreads()  # the next key tile overwrites K, V and dS

        dq_bh = dq[b, h]
        for i in range(TS):
            row = row0 + g + ROW_GROUPS * i
            if row < Lq:  # a row that sees no key has P = 0 everywhere: its dQ is written as zeros
                for dd in range(TD):
                    dq_bh[U(row), U(c + TPR * dd)] = acc[i, dd] * scale

    return dkdv_kernel, dq_kernel
# endregion


# the argument types the launcher passes (compile_ptx, the resource tables, CI)
_TAIL = "uint8[:, ::1], int64, int64, int64, float32"
DKDV_SIGNATURE = (f"void({_F32_4D}, {_F32_4D}, {_F32_4D}, {_F32_4D}, {_F32_3D}, {_F32_3D}, {_F32_4D}, {_F32_4D}, "
                  f"{_TAIL})")
DQ_SIGNATURE = f"void({_F32_4D}, {_F32_4D}, {_F32_4D}, {_F32_4D}, {_F32_3D}, {_F32_3D}, {_F32_4D}, {_TAIL})"
_KERNELS: dict = {}


def _label(D: int, config: BackwardConfig) -> str:
    c = config
    return f"D={D},{c.block_m}x{c.block_n},ts={c.per_thread},tpr={c.threads_per_row},mb={c.min_blocks}"


def get_kernels(D: int, config: BackwardConfig):
    """(dkdv_kernel, dq_kernel) for (D, config), built once per process and registered so that CI compiles them."""
    key = (D, config)
    if key not in _KERNELS:
        config.validate(D)
        _KERNELS[key] = make_backward_kernels(D, config)
        rebuild = (__name__, "_rebuild", (D, config.block_m, config.block_n, config.per_thread,
                                          config.threads_per_row, config.min_blocks))
        register_kernel(f"backward.dkdv_kernel[{_label(D, config)}]", _KERNELS[key][0], DKDV_SIGNATURE, rebuild)
        register_kernel(f"backward.dq_kernel[{_label(D, config)}]", _KERNELS[key][1], DQ_SIGNATURE, rebuild)
    return _KERNELS[key]


def _rebuild(D, *fields):
    return get_kernels(D, BackwardConfig(*fields))


def check_lse_range(lse) -> None:
    """Refuse, with a ValueError, an LSE whose finite part reaches :data:`LSE_LIMIT` in magnitude: the float32
    kernels cannot recompute the softmax from it (one number read back from the device)."""
    if is_torch(lse):
        import torch

        largest = float(torch.where(torch.isfinite(lse), lse.abs(), torch.zeros_like(lse)).amax()) if lse.numel() else 0.0
    else:
        finite = np.abs(np.asarray(lse, dtype=np.float64))
        largest = float(finite[np.isfinite(finite)].max(initial=0.0))
    if largest >= LSE_LIMIT:
        raise ValueError(f"the flash backward: a row's log-sum-exp is {largest:.3g} in magnitude (scores that large, "
                         f"e.g. -1e31); its float32 kernels recompute P = exp(scale q.k - LSE) and past |LSE| = 2^24 "
                         f"float32 rounding alone exceeds 1 in that exponent, so the gradients would be wrong. Scale "
                         f"the scores down, or take these gradients with stage='reference' (float64)")


# region: backward_launch
def flash_gradients(q, k, v, out, lse, dout, *, causal=False, key_padding_mask=None, scale=None, config=None):
    """Gradients (dq, dk, dv) of the flash stage, float32 where the kernels run, from its forward's ``(out, lse)``.

    dk and dv have k's shape (B, Hk, Lk, D): summed over the query heads that share a key/value head (GQA). A row
    that sees no key (LSE -inf) gets zero gradients and gives none. `config` picks the tile shape (default
    :func:`config_for`).
    """
    B, H, Lq, D = q.shape
    Hk, Lk = k.shape[1], k.shape[2]
    if D not in HEAD_DIMS:
        raise ValueError(f"the flash backward takes head dims {HEAD_DIMS}, got D={D}")
    config = config or config_for(D)
    dkdv_kernel, dq_kernel = get_kernels(D, config)
    scale = 1.0 / math.sqrt(D) if scale is None else float(scale)
    offset = causal_offset(causal, Lq, Lk)  # query i sees keys j <= i + offset; None: not causal
    key_tiles, query_tiles = -(-Lk // config.block_n), -(-Lq // config.block_m)
    if max(B * Hk * key_tiles, B * H * query_tiles) > MAX_GRID_X:
        raise ValueError(f"B={B}, H={H}, Lq={Lq}, Lk={Lk} needs more than 2^31 - 1 thread blocks")
    check_lse_range(lse)  # before any launch: float32 cannot recompute P from an LSE of -1e31
    qw, kw, vw, ow, dow = (to_work(x) for x in (q, k, v, out, dout))
    lse_w = to_work(lse)
    delta, lse2 = empty((B, H, Lq)), empty((B, H, Lq))
    rows, threads = B * H * Lq, 128
    preprocess_kernel[-(-rows // threads), threads](kernel_view(ow), kernel_view(dow), kernel_view(lse_w),
                                                     kernel_view(delta), kernel_view(lse2))
    keep = (to_work(key_padding_mask, dtype=np.uint8) if key_padding_mask is not None
            else empty((1, 1), dtype=np.uint8))  # never read
    dq, dk, dv = empty((B, H, Lq, D)), empty((B, Hk, Lk, D)), empty((B, Hk, Lk, D))
    inputs = tuple(kernel_view(x) for x in (qw, kw, vw, dow, lse2, delta))
    tail = (kernel_view(keep), int(key_padding_mask is not None), int(offset is not None), offset or 0,
            np.float32(scale))
    nbytes = backward_shared_layout(D, config)["bytes"]
    dkdv_args = inputs + (kernel_view(dk), kernel_view(dv)) + tail
    allow_shared_bytes(dkdv_kernel, dkdv_args, nbytes)
    dkdv_kernel[B * Hk * key_tiles, config.dkdv_threads, 0, nbytes](*dkdv_args)
    dq_args = inputs + (kernel_view(dq),) + tail
    allow_shared_bytes(dq_kernel, dq_args, nbytes)
    dq_kernel[B * H * query_tiles, config.dq_threads, 0, nbytes](*dq_args)
    return dq, dk, dv
# endregion


def simulator_seconds(B, H, Lq, Lk, D):
    """Rough seconds of :func:`flash_gradients` on the simulator with SIMULATOR_CONFIG, without a causal mask (which
    skips about half the tiles): both kernels visit every (16-row, 16-key) tile pair once. Measured on a 2-core
    machine: 0.14 / 0.18 / 0.41 / 0.75 s per tile pair at D = 16 / 32 / 64 / 128, about 3x the forward's time."""
    tiles = B * H * math.ceil(Lq / 16) * math.ceil(Lk / 16)
    return 0.1 + tiles * (0.02 + 0.006 * D)


# the tile shapes used on a GPU, known to CI (tests/test_ptx_compile.py compiles every registered kernel)
for _D, _config in sorted(GPU_CONFIGS.items()):
    get_kernels(_D, _config)


def bench_main(argv=None) -> int:
    """``python -m wb_kernels.stages.backward.cuda_cores`` on a GPU: checks a small problem against the float64
    reference, then times :func:`flash_gradients` (after the flash forward) against SDPA's fp32 backward (autograd
    through ``scaled_dot_product_attention``, its default backend) at B4 H16 L4096, D 64 and 128, causal and not, with
    the benchmark's one timing method (:data:`wb_kernels.timing.DEVICE_TIME`). Prints one line per shape;
    ``--json PATH`` also writes them with the GPU's name."""
    import argparse
    import json

    import torch
    import torch.nn.functional as F

    from ...reference import reference_backward
    from ...timing import DEVICE_TIME, time_call
    from ..flash.kernel import flash_forward

    parser = argparse.ArgumentParser(description=bench_main.__doc__.split("\n\n")[0])
    parser.add_argument("--json", help="write the results here")
    parser.add_argument("--length", type=int, default=4096)
    args = parser.parse_args(argv)
    if not BACKEND.is_gpu:
        print("needs a CUDA GPU (on the simulator, tests/test_backward.py checks the kernels)")
        return 1
    gen = torch.Generator(device="cuda").manual_seed(0)

    def problem(B, H, L, D, causal):
        q, k, v, dout = (torch.randn(B, H, L, D, device="cuda", generator=gen) for _ in range(4))
        return (q, k, v) + flash_forward(q, k, v, causal=causal) + (dout,)

    for D in (64, 128):  # a check with the GPU tile shapes before anything is timed
        q, k, v, out, lse, dout = problem(1, 4, 333, D, "bottom_right")
        grads = flash_gradients(q, k, v, out, lse, dout, causal="bottom_right")
        ref = reference_backward(q, k, v, dout, causal="bottom_right")
        worst = max(float((g.double().cpu() - torch.from_numpy(r)).abs().max()) / abs(r).max()
                    for g, r in zip(grads, ref))
        print(f"check B1 H4 L333 D{D}: largest error / largest gradient {worst:.2e}")
    rows = []
    B, H, L = 4, 16, args.length
    for D in (64, 128):
        for causal in (False, True):
            q, k, v, out, lse, dout = problem(B, H, L, D, causal)
            ours = time_call(flash_gradients, q, k, v, out, lse, dout, causal=causal, **DEVICE_TIME).median_ms
            forward = time_call(flash_forward, q, k, v, causal=causal, **DEVICE_TIME).median_ms
            qg, kg, vg = (x.detach().requires_grad_() for x in (q, k, v))
            sdpa_out = F.scaled_dot_product_attention(qg, kg, vg, is_causal=causal)
            sdpa = time_call(lambda: torch.autograd.grad(sdpa_out, (qg, kg, vg), dout, retain_graph=True),
                             **DEVICE_TIME).median_ms
            flops = 2.5 * 4 * B * H * L * L * D / (2 if causal else 1)  # five products against the forward's two
            row = dict(B=B, H=H, L=L, D=D, causal=causal, ms=ours, forward_ms=forward, sdpa_fp32_ms=sdpa,
                       tflops=flops / ours / 1e9, x_sdpa=sdpa / ours)
            rows.append(row)
            print(f"B{B} H{H} L{L} D{D} causal={causal}: {ours:.2f} ms ({row['tflops']:.1f} TFLOP/s), "
                  f"{ours / forward:.1f}x the forward, SDPA fp32 backward {sdpa:.2f} ms ({row['x_sdpa']:.2f}x ours)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(gpu=torch.cuda.get_device_name(), torch=torch.__version__, timing=dict(DEVICE_TIME),
                           rows=rows), f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(bench_main())
