"""Stage 04: FlashAttention-2 on CUDA cores in numba.cuda (lesson 04; benchmarked in the dashboard lesson).

One thread block owns a tile of ``block_m`` query rows. It streams K and V through shared memory
in tiles of ``block_n`` keys and keeps, per query row, the running maximum ``m``, the running sum
``l`` and the output accumulator on chip (registers), rescaling them whenever the maximum grows.
O and the per-row log-sum-exp are written once at the end: no Lq x Lk buffer exists anywhere, so
the extra device memory is exactly O + LSE.

Register blocking: the ``threads_per_row`` threads of a *row group* share ``rows_per_thread``
query rows. For S = Q K^T each thread computes a (rows_per_thread x block_n/threads_per_row)
piece; for O += P V a (rows_per_thread x D/threads_per_row) piece. The row maximum is agreed
through shared memory (no warp shuffles, so the same code runs on numba's CUDA simulator).

Exponentials use ``exp2`` with the softmax scale and log2(e) folded into one constant c:
exp(scale * (x - m)) = exp2((x - m) * c), one FADD, one FMUL and one MUFU.EX2 instruction per score
(``math.exp`` would add a multiply and a range reduction). The running maximum m is kept in the scores' own
units and every exponent subtracts it before it is scaled, so the row's largest score gives exp2(0) = 1 exactly
at any magnitude (x * c - m * c, fused into an FFMA, keeps the rounding of m * c in the exponent: harmless at
ordinary scores, up to 2^77 at a score of -1e31). The LSE is m * scale + log(l), computed once per row in float64.

Layout of the dynamic shared memory (float32 words), see :func:`shared_layout`:
``Q^T (D x block_m+1) | K^T (D x block_n+1), later V (block_n x D) | P (block_m x block_n+pad) | partial maxima``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
from numba import cuda, float32, float64, uint64  # after ..backend (imported by the package first): the simulator switch

from ...backend import BACKEND
from ...device import empty, kernel_view, to_work
from ...reference import causal_offset
from ...resources import register_kernel
from .. import Stage
from ..naive.kernel import check_grid

__all__ = ["FlashConfig", "make_flash_kernel", "flash_forward", "shared_layout", "config_for", "get_kernel",
           "jit_options", "allow_shared_bytes", "kernel_name", "kernel_signature", "SIGNATURE",
           "SIMULATOR_CONFIG", "GPU_CONFIGS", "NEG_BIG", "LOG2E", "LN2", "STAGE"]

# A finite "minus infinity": the kernel is compiled with fastmath, which lets the compiler assume that no value is
# ever infinite, so masked scores get NEG_BIG, the lowest float32, below every score the kernel can compute: a
# score of -1e35 is a score (only a score equal to NEG_BIG, the end of float32's range, counts as masked). Whether a
# row has seen a key is its running sum l > 0 (its largest score contributes exp2(0) = 1), never a value's size.
NEG_BIG = float(np.finfo(np.float32).min)  # -3.4028235e38
LOG2E = 1.4426950408889634
LN2 = 0.6931471805599453
STATIC_SHARED_LIMIT = 48 * 1024  # beyond this a kernel must opt in to more dynamic shared memory


@dataclass(frozen=True)
class FlashConfig:
    """Tile shape of the kernel; every field is a compile-time constant."""

    block_m: int = 64  # query rows per thread block
    block_n: int = 64  # keys per K/V tile
    rows_per_thread: int = 4  # query rows each thread owns (register blocking, TM)
    threads_per_row: int = 8  # threads sharing those rows (TPR): split keys in S, head dims in O
    min_blocks: int = 2  # launch bound: ptxas keeps registers low enough for this many blocks per SM

    @property
    def threads(self) -> int:
        return (self.block_m // self.rows_per_thread) * self.threads_per_row

    def validate(self, D: int) -> None:
        c = self
        problems = []
        if c.block_m % c.rows_per_thread:
            problems.append(f"block_m={c.block_m} is not a multiple of rows_per_thread={c.rows_per_thread}")
        if c.block_n % c.threads_per_row:
            problems.append(f"block_n={c.block_n} is not a multiple of threads_per_row={c.threads_per_row}")
        if D & (D - 1):
            problems.append(f"D={D} is not a power of two")
        if D % c.threads_per_row:
            problems.append(f"D={D} is not a multiple of threads_per_row={c.threads_per_row}")
        if not 1 <= c.threads <= 1024:
            problems.append(f"{c.threads} threads per block (must be 1..1024)")
        if problems:
            raise ValueError(f"FlashConfig {c}: " + "; ".join(problems))

    def label(self) -> str:
        return (f"{self.block_m}x{self.block_n} tm{self.rows_per_thread} tpr{self.threads_per_row} "
                f"mb{self.min_blocks}")


# Small blocks for the simulator: it runs one Python thread per CUDA thread, and a barrier across
# 16 threads costs a few milliseconds, across 256 threads ten times more.
SIMULATOR_CONFIG = FlashConfig(block_m=16, block_n=16, rows_per_thread=4, threads_per_row=4)
# Chosen on the GPU by tune.py in this folder (NOTES.md has the numbers; the committed
# results/flash/tune_*.json names the device of the run).
GPU_CONFIGS = {
    16: FlashConfig(64, 64, 4, 4, 2),  # not tuned: checked by the tests only
    32: FlashConfig(64, 64, 4, 8, 2),  # not tuned: checked by the tests only
    64: FlashConfig(128, 64, 8, 8, 1),  # 8 x 8 per thread; 256 x 64 was 3 % faster but slower causal
    128: FlashConfig(128, 32, 8, 8, 1),  # 8 rows x 4 keys (S), 8 rows x 16 columns (O) per thread
}


def config_for(D: int) -> FlashConfig:
    """The tile shape used when the caller gives none: small on the simulator, tuned on a GPU."""
    if BACKEND.is_simulator:
        return SIMULATOR_CONFIG
    return GPU_CONFIGS.get(D, FlashConfig())


def shared_layout(D: int, config: FlashConfig) -> dict:
    """Offsets and strides (float32 words) of the kernel's shared memory, and its size in bytes.

    Strides are padded so that no warp's shared-memory access hits one bank twice: the transposed
    Q and K tiles get one extra column (the transposing stores then walk the banks with an odd
    stride), and P's rows get ``threads_per_row`` extra words (row groups then land on different
    banks when they read P in O += P V).
    """
    c = config
    q_stride = c.block_m + 1
    k_stride = c.block_n + 1
    p_stride = c.block_n + (c.threads_per_row if c.threads_per_row < 32 else 0)
    q_off = 0
    kv_off = q_off + D * q_stride
    kv_words = max(D * k_stride, c.block_n * D)  # K^T first, then V, in the same words
    p_off = kv_off + kv_words
    red_off = p_off + c.block_m * p_stride
    words = red_off + c.block_m * c.threads_per_row
    return dict(q_stride=q_stride, k_stride=k_stride, p_stride=p_stride, q_off=q_off, kv_off=kv_off,
                p_off=p_off, red_off=red_off, words=words, bytes=4 * words)


def jit_options(threads: int, min_blocks: int) -> dict:
    """cuda.jit options: fast math everywhere, launch bounds where the compiler uses them.

    The launch bounds (threads per block, blocks wanted per SM) cap the registers ptxas may use; the
    simulator's ``cuda.jit`` does not take that option, and has no registers to cap.
    """
    if BACKEND.is_simulator:
        return dict(fastmath=True)
    return dict(fastmath=True, launch_bounds=(threads, min_blocks))


# region: flash_constants
def make_flash_kernel(D, config):
    """Compile-time specialised FlashAttention-2 forward kernel for head dim D and one tile shape."""
    BM, BN = config.block_m, config.block_n
    TM, TPR = config.rows_per_thread, config.threads_per_row
    ROW_GROUPS = BM // TM  # thread t serves rows g, g + ROW_GROUPS, ... (g = t // TPR)
    THREADS = ROW_GROUPS * TPR
    TN = BN // TPR  # keys per thread in S = Q K^T
    TD = D // TPR  # output columns per thread in O += P V
    LOG2_D = D.bit_length() - 1  # D is a power of two: e >> LOG2_D, e & (D - 1) split a flat index
    lay = shared_layout(D, config)
    QS, KS, PS = lay["q_stride"], lay["k_stride"], lay["p_stride"]
    Q0, KV0, P0, RED0 = lay["q_off"], lay["kv_off"], lay["p_off"], lay["red_off"]
    NEG = float32(NEG_BIG)
    LOG2_E = float32(LOG2E)
    U = uint64  # an unsigned index: numba then skips the negative-index (wraparound) fix-up
# endregion

    # region: flash_signature
    @cuda.jit(**jit_options(THREADS, config.min_blocks))
    def flash_kernel(q,  # (B, H, Lq, D) float32 queries
                     k,  # (B, Hk, Lk, D) float32 keys; Hk divides H
                     v,  # (B, Hk, Lk, D) float32 values
                     out,  # (B, H, Lq, D) float32 output
                     lse,  # (B, H, Lq) float32 log-sum-exp per row (-inf for a row that sees no key)
                     key_keep,  # (B, Lk) uint8, 1 = key takes part; read only when use_mask
                     use_mask,  # 0/1
                     causal,  # 0/1: query i sees keys j <= i + causal_offset
                     causal_offset,  # 0 (top-left), or Lk - Lq (bottom-right)
                     q_scale,  # multiplies Q as it is loaded: 1, or the softmax scale when that is <= 0
                     score_scale):  # turns the kernel's scores into scaled scores: the softmax scale, or 1
        smem = cuda.shared.array(0, float32)
        H, Lq, Lk = q.shape[1], q.shape[2], k.shape[2]
        b = cuda.blockIdx.x // H  # (batch, head) in x, the one grid dimension past 65,535 blocks: a large batch
        h = cuda.blockIdx.x % H   # of short sequences runs
        kv = h // (H // k.shape[1])  # the key/value head of query head h: H // Hk share one (GQA)
        q_bh, k_bh, v_bh, out_bh, lse_bh = q[b, h], k[b, kv], v[b, kv], out[b, h], lse[b, h]
        # Heaviest tiles first: under a causal mask the last query tiles see the most keys. Blocks start in x-fastest
        # order, so every (batch, head)'s heaviest tile starts before any head's second heaviest.
        row0 = (cuda.gridDim.y - 1 - cuda.blockIdx.y) * BM
        t = cuda.threadIdx.x
        g = t // TPR  # row group
        c = t % TPR  # position inside the row group
        exp_scale = float32(score_scale * LOG2_E)
        # endregion

        # region: flash_q_tile_and_registers
        # Q tile, transposed and pre-scaled, stays in shared memory for the whole loop.
        for e in range(t, BM * D, THREADS):
            r = e >> LOG2_D
            d = e & (D - 1)
            value = float32(0.0)
            if row0 + r < Lq:
                value = q_bh[U(row0 + r), U(d)] * q_scale
            smem[U(Q0 + d * QS + r)] = value

        acc = cuda.local.array((TM, TD), float32)  # this thread's piece of O (unnormalised)
        m_run = cuda.local.array(TM, float32)  # running max of the row's (unscaled) scores; NEG: none yet
        # running sum over this thread's keys only; float64 because it adds up one term per tile, and a
        # float32 sum of hundreds of terms drifts by more than the LSE's tolerance (PyTorch's error x 2)
        l_run = cuda.local.array(TM, float64)
        s = cuda.local.array((TM, TN), float32)
        a_reg = cuda.local.array(TM, float32)
        b_reg = cuda.local.array(TD if TD > TN else TN, float32)
        for i in range(TM):
            m_run[i] = NEG
            l_run[i] = 0.0
            for j in range(TD):
                acc[i, j] = 0.0

        n_tiles = (Lk + BN - 1) // BN
        if causal:  # tiles entirely above the diagonal are never loaded
            last_key = min(row0 + BM, Lq) - 1 + causal_offset  # the last key the block's last row sees
            n_tiles = max(0, min(n_tiles, last_key // BN + 1))  # 0 when no row of the block sees a key
        # endregion

        # region: flash_scores
        for tile in range(n_tiles):
            k0 = tile * BN
            for e in range(t, BN * D, THREADS):  # K tile, transposed
                j = e >> LOG2_D
                d = e & (D - 1)
                value = float32(0.0)
                if k0 + j < Lk:
                    value = k_bh[U(k0 + j), U(d)]
                smem[U(KV0 + d * KS + j)] = value
            cuda.syncthreads()

            # S = Q K^T for TM rows x TN keys, in registers
            for i in range(TM):
                for j in range(TN):
                    s[i, j] = 0.0
            for d in range(D):
                for i in range(TM):
                    a_reg[i] = smem[U(Q0 + d * QS + g + ROW_GROUPS * i)]
                for j in range(TN):
                    b_reg[j] = smem[U(KV0 + d * KS + c + TPR * j)]
                for i in range(TM):
                    for j in range(TN):
                        s[i, j] += a_reg[i] * b_reg[j]
            # endregion

            # region: flash_masks
            # masks, and this thread's share of each row's maximum
            for i in range(TM):
                row = row0 + g + ROW_GROUPS * i
                tile_max = NEG
                for j in range(TN):
                    key = k0 + c + TPR * j
                    ok = key < Lk
                    if causal and key > row + causal_offset:
                        ok = False
                    if ok and use_mask:
                        if key_keep[b, U(key)] == 0:
                            ok = False
                    if ok:
                        tile_max = max(tile_max, s[i, j])
                    else:
                        s[i, j] = NEG
                smem[U(RED0 + (g + ROW_GROUPS * i) * TPR + c)] = tile_max
            cuda.syncthreads()
            # endregion

            # region: flash_online_softmax
            for e in range(t, BN * D, THREADS):  # V tile, into the words K used
                j = e >> LOG2_D
                d = e & (D - 1)
                value = float32(0.0)
                if k0 + j < Lk:
                    value = v_bh[U(k0 + j), U(d)]
                smem[U(KV0 + e)] = value

            # online softmax: new max, rescale what was accumulated, P = exp2(S - max)
            for i in range(TM):
                r = g + ROW_GROUPS * i
                tile_max = NEG
                for cc in range(TPR):
                    tile_max = max(tile_max, smem[U(RED0 + r * TPR + cc)])
                # exp(scale*(x - m)) = exp2((x - m)*c), c = scale*log2(e): the difference first, so the row's
                # largest score gives exp2(0) = 1 at any magnitude (an FFMA x*c - m*c would keep the rounding of
                # m*c, up to 2^77 at a score of -1e31). Masked scores (NEG) are skipped, never subtracted; a row
                # that has seen no key yet (m = NEG) has nothing to rescale.
                new_max = max(m_run[i], tile_max)
                alpha = float32(0.0)
                if m_run[i] > NEG:
                    alpha = math.exp2((m_run[i] - new_max) * exp_scale)
                m_run[i] = new_max
                row_sum = float32(0.0)
                for j in range(TN):
                    p = float32(0.0)
                    if s[i, j] > NEG:
                        p = math.exp2((s[i, j] - new_max) * exp_scale)
                    row_sum += p
                    smem[U(P0 + r * PS + c + TPR * j)] = p
                l_run[i] = l_run[i] * alpha + row_sum
                for j in range(TD):
                    acc[i, j] *= alpha
            cuda.syncthreads()
            # endregion

            # region: flash_pv
            # O += P V for TM rows x TD head dims
            for j in range(BN):
                for i in range(TM):
                    a_reg[i] = smem[U(P0 + (g + ROW_GROUPS * i) * PS + j)]
                for dd in range(TD):
                    b_reg[dd] = smem[U(KV0 + j * D + c + TPR * dd)]
                for i in range(TM):
                    for dd in range(TD):
                        acc[i, dd] += a_reg[i] * b_reg[dd]
            cuda.syncthreads()
            # endregion

        # region: flash_epilogue
        # each thread summed only its own keys: add up the row group's partial sums
        for i in range(TM):
            smem[U(RED0 + (g + ROW_GROUPS * i) * TPR + c)] = l_run[i]
        cuda.syncthreads()
        for i in range(TM):
            r = g + ROW_GROUPS * i
            if row0 + r < Lq:
                total = float64(0.0)
                for cc in range(TPR):
                    total += smem[U(RED0 + r * TPR + cc)]
                # a row that saw no key has acc = 0 and total = 0 (one that saw a key has total >= 1):
                # 0 * (1 / tiny) = 0 without a branch that fastmath could turn into 0 / 0
                inv = float32(1.0) / max(float32(total), float32(1e-30))
                for dd in range(TD):
                    out_bh[U(row0 + r), U(c + TPR * dd)] = acc[i, dd] * inv
                if c == 0:
                    if total > 0:  # once per row, in float64: fastmath's float32 log is off by ~1e-6 at L ~ 1000
                        lse_bh[U(row0 + r)] = float64(m_run[i]) * score_scale + math.log(total)
                    else:  # a stored constant, no arithmetic: nothing for fastmath to assume away
                        lse_bh[U(row0 + r)] = -math.inf

    return flash_kernel
# endregion


_F32_4D = "float32[:, :, :, ::1]"
# the argument types the stage launches its kernel with (compile_ptx, the resource tables, CI)
SIGNATURE = (f"void({_F32_4D}, {_F32_4D}, {_F32_4D}, {_F32_4D}, float32[:, :, ::1], uint8[:, ::1], "
             "int64, int64, int64, float32, float32)")
_KERNELS: dict = {}


def kernel_name(D: int, config: FlashConfig) -> str:
    c = config
    return (f"flash.flash_kernel[D={D},{c.block_m}x{c.block_n},tm={c.rows_per_thread},"
            f"tpr={c.threads_per_row},mb={c.min_blocks}]")


def get_kernel(D: int, config: FlashConfig):
    """The package's kernel for (D, config), built once per process and registered so that CI compiles it."""
    key = (D, config)
    if key not in _KERNELS:
        config.validate(D)
        _KERNELS[key] = make_flash_kernel(D, config)
        register_kernel(kernel_name(D, config), _KERNELS[key], SIGNATURE,
                        (__name__, "_rebuild", (D, config.block_m, config.block_n, config.rows_per_thread,
                                                config.threads_per_row, config.min_blocks)))
    return _KERNELS[key]


def _rebuild(D, *fields):
    return get_kernel(D, FlashConfig(*fields))


def kernel_signature(D: int = 64):
    """SIGNATURE as numba types, for ``numba.cuda.compile_ptx``."""
    from numba import float32, int64, uint8

    arr4 = float32[:, :, :, ::1]
    return (arr4, arr4, arr4, arr4, float32[:, :, ::1], uint8[:, ::1], int64, int64, int64, float32, float32)


_OPTED_IN: set = set()


def allow_shared_bytes(kernel, args, nbytes: int) -> None:
    """Let a GPU kernel use more than 48 KiB of dynamic shared memory (CUDA needs an explicit opt-in)."""
    if BACKEND.is_simulator or nbytes <= STATIC_SHARED_LIMIT:
        return
    argtypes = tuple(kernel.typeof_pyval(a) for a in args)
    key = (id(kernel), argtypes, nbytes)
    if key in _OPTED_IN:
        return
    from numba.cuda.cudadrv.driver import binding, driver

    cufunc = kernel.compile(argtypes)._codelibrary.get_cufunc()
    attribute = binding.CUfunction_attribute.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES
    driver.cuKernelSetAttribute(attribute, nbytes, cufunc.handle, cufunc.device.id)
    _OPTED_IN.add(key)


# region: flash_launch
def flash_forward(q, k, v, *, causal=False, key_padding_mask=None, scale=None, config=None,
                  kernel=None):
    """Run the kernel; returns (out (B, H, Lq, D), lse (B, H, Lq)) as float32 where the kernel runs.

    `config` picks the tile shape (default: :func:`config_for`); `kernel` lets a lesson pass its own
    kernel built by ``make_flash_kernel(D, config)``.
    """
    B, H, Lq, D = q.shape
    Lk = k.shape[2]
    config = config or config_for(D)
    kernel = kernel or get_kernel(D, config)
    scale = 1.0 / math.sqrt(D) if scale is None else float(scale)
    offset = causal_offset(causal, Lq, Lk)  # query i sees keys j <= i + offset; None: not causal
    qw, kw, vw = (to_work(x) for x in (q, k, v))
    out = empty((B, H, Lq, D))  # the only buffers beyond the inputs: O and LSE
    lse = empty((B, H, Lq))
    if key_padding_mask is not None:
        keep = to_work(key_padding_mask, dtype=np.uint8)
    else:
        keep = empty((1, 1), dtype=np.uint8)  # never read
    args = (kernel_view(qw), kernel_view(kw), kernel_view(vw), kernel_view(out), kernel_view(lse),
            kernel_view(keep), int(key_padding_mask is not None), int(offset is not None), offset or 0,
            # the max of the scores is the max of the scaled scores only for a positive scale
            np.float32(1.0 if scale > 0 else scale), np.float32(scale if scale > 0 else 1.0))
    grid = (B * H, (Lq + config.block_m - 1) // config.block_m)  # y allows 65,535 blocks: Lq <= 65,535 * block_m
    check_grid("flash", grid, ("B*H", f"Lq / {config.block_m}"))
    nbytes = shared_layout(D, config)["bytes"]
    allow_shared_bytes(kernel, args, nbytes)
    kernel[grid, config.threads, 0, nbytes](*args)  # rows that saw no key: zeros and LSE -inf, from the kernel
    return out, lse
# endregion


def _simulator_seconds(B, H, Lq, Lk, D):
    # measured on a 2-core machine with SIMULATOR_CONFIG (16 x 16 tiles): 42 ms per tile at D = 32,
    # 80 ms at D = 64, 130 ms at D = 128
    tiles = B * H * math.ceil(Lq / 16) * math.ceil(Lk / 16)
    return 0.05 + tiles * (0.012 + 0.030 * D / 32)


STAGE = Stage(
    name="flash",
    lesson="04_flash",
    summary="FlashAttention-2 in numba.cuda on CUDA cores: online softmax, O(L) memory",
    forward=flash_forward,
    dtypes=("float32",),
    head_dims=(16, 32, 64, 128),
    workspace_bytes=lambda B, H, Lq, Lk, D: 4 * B * H * Lq * (D + 1),  # O + LSE, float32
    simulator_seconds=_simulator_seconds,
    order=4,
    linear_memory=True,
)

# the tile shapes the stage uses, known to CI (tests/test_ptx_compile.py compiles every registered kernel)
for _D, _config in sorted(GPU_CONFIGS.items()):
    get_kernel(_D, _config)
