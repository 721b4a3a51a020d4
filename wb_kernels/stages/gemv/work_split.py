"""The GEMV kernels' work split in NumPy (runs anywhere): who reads which bytes, how many bytes are in flight, the
split-K choice, the copy-rate roofline, and an emulation of the kernels' arithmetic.

The kernels (``gemv.cuh``) compute y = W x for W (N, K) row-major in float16 or bfloat16 with float32 sums:

- **who reads what** (:func:`launch`, :func:`warp_rows`, :func:`lane_columns`, :func:`read_counts`): a block of
  :data:`WARPS` warps covers a tile of rows, a warp ``rows`` weight rows, and along K a split's columns; lane ``l``
  of a warp reads 8 consecutive values (16 bytes) at columns ``k_begin + 256 c + 8 l`` for c = 0, 1, ...: a warp's
  load is 512 contiguous bytes of one row;
- **bytes in flight** (:func:`bytes_in_flight_per_sm`): each lane issues ``rows x unroll`` 16-byte weight loads
  before it uses the first; HBM needs about its bandwidth times its latency in flight (:func:`bytes_needed_per_sm`);
- **split-K** (:func:`choose_splits`): the split count a simple model (:func:`predicted_time_us`) finds fastest on a
  GPU (:data:`H100`: 132 SMs) for each of the model's products (:data:`MODEL_PRODUCTS`, LLaMA 3.2 1B's shapes);
- **roofline** (:func:`copy_time_us`): the time to read the weights at a copy rate, the ceiling of a product;
- **arithmetic** (:func:`emulate`): the kernels' float32 sums in their own order (each lane's columns in order,
  the warp's butterfly, the splits added in order 0, 1, ...), bit for bit where no approximate function enters
  (plain and residual products), held against :func:`reference64` (float64) with :func:`error_bound` in the tests.

Lesson: none yet (issue 48's decode-step lesson); tests: ``tests/test_gemv.py``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from ..wmma.fragment_model import round_to  # float32 -> float16 / bfloat16 (to nearest even) -> float32

__all__ = ["WARPS", "LANES", "CHUNK", "WARP_STEP", "V1_UNROLL", "SHAPES", "FORMS", "Gpu", "H100", "Product",
           "MODEL_PRODUCTS", "model_products", "batch_width", "Launch", "launch", "split_plan", "warp_rows",
           "lane_columns", "read_counts", "blocks_per_sm", "bytes_in_flight_per_warp", "bytes_in_flight_per_sm",
           "bytes_needed_per_sm", "waves", "instructions_per_weight", "issue_time_us", "predicted_time_us", "predictions", "choose_splits", "copy_time_us", "roofline_us",
           "round_to", "emulate", "reference64", "error_bound"]

WARPS = 4  # warps per block (gemv.cuh: kWarps)
LANES = 32
CHUNK = 8  # values per 16-byte load
WARP_STEP = LANES * CHUNK  # columns one warp-wide load covers: 256
V1_UNROLL = 8  # v1's loads in flight per lane (kV1Unroll)
# batch width -> (weight rows per warp, loads in flight per row and lane, min blocks per SM asked of the compiler):
# gemv.cuh's GemvShape, which tests/test_gemv.py compares with this table
SHAPES = {1: (2, 4, 4), 2: (2, 4, 4), 4: (4, 2, 3), 8: (4, 2, 3), 16: (4, 1, 2)}
# the fused forms, in the order of gemv_host.cu's Form enum: plain y = W x; norm y = W (rmsnorm(x) g);
# residual y = r + W x; norm_gate_up y = SiLU(W_gate x') * (W_up x') with x' = rmsnorm(x) g, W = [W_gate; W_up]
FORMS = ("plain", "norm", "residual", "norm_gate_up")


@dataclass(frozen=True)
class Gpu:
    """What the model needs of a GPU. Bandwidth: a large device-to-device copy's rate (bytes read + written per
    second); latency: a load's round trip to HBM under load (unloaded about 600 ns on an H100; more when busy)."""

    name: str
    sms: int
    copy_gbps: float
    hbm_latency_ns: float = 900.0
    l2_latency_ns: float = 300.0  # the split-K tail: an atomic, then the partial sums read from L2
    clock_ghz: float = 1.755  # the SMs' clock under a memory-bound load (the H100 SXM's boost is 1.98)
    registers_per_sm: int = 65536
    max_warps_per_sm: int = 64
    max_blocks_per_sm: int = 32


# the H100 SXM of this project's runs: 132 SMs; 2,934 GB/s is the copy rate the decoder's profile measured (models/NOTES)
H100 = Gpu("H100", sms=132, copy_gbps=2934.0)


@dataclass(frozen=True)
class Product:
    """One matrix-vector product: W (weight_rows, k), x (batch, k) -> (batch, n_out), in a fused form."""

    name: str
    n_out: int
    k: int
    form: str = "plain"
    batch: int = 1
    dtype_bytes: int = 2

    def __post_init__(self):
        if self.form not in FORMS:
            raise ValueError(f"form {self.form!r}: one of {FORMS}")

    @property
    def weight_rows(self) -> int:
        return 2 * self.n_out if self.form == "norm_gate_up" else self.n_out

    @property
    def weight_bytes(self) -> int:
        return self.weight_rows * self.k * self.dtype_bytes


# LLaMA 3.2 1B's products in one decode step (wb_kernels/models/llama_decoder.py, LLAMA_1B: dim 2048, 32 query heads
# and 8 KV heads of 64, ffn 8192, vocabulary 128256, the LM head tied to the embedding), each in the form that fuses
# its neighbours: the attention norm into QKV, the residual add into the output projection, the MLP norm and
# SiLU(gate) * up into gate/up, the residual into down, the final norm into the LM head. (tests/test_gemv.py checks
# these against the decoder's config.)
MODEL_PRODUCTS = (
    Product("qkv", 3072, 2048, "norm"),
    Product("o", 2048, 2048, "residual"),
    Product("gate_up", 8192, 2048, "norm_gate_up"),
    Product("down", 2048, 8192, "residual"),
    Product("lm_head", 128256, 2048, "norm"),
)


def model_products(batch: int = 1) -> tuple:
    """:data:`MODEL_PRODUCTS` at another batch."""
    return tuple(Product(p.name, p.n_out, p.k, p.form, batch, p.dtype_bytes) for p in MODEL_PRODUCTS)


def batch_width(batch: int) -> int:
    """The kernel's BATCH for a call's batch: the next of 1, 2, 4, 8, 16 (gemv_host.cu: batch_width)."""
    if not 1 <= batch <= 16:
        raise ValueError(f"batch {batch}: the kernels take 1 to 16 rows of x")
    return next(width for width in SHAPES if width >= batch)


# ---------------------------------------------------------------------------------------------- who reads what


@dataclass(frozen=True)
class Launch:
    version: str  # "v1" (batch 1, a warp per row) or "gemv" (v2 split-K, v3 batches, the fused forms)
    tiles: int  # gridDim.x: row tiles
    splits: int  # gridDim.y
    k_per_split: int
    rows_per_warp: int  # weight rows
    out_rows_per_block: int
    unroll: int  # loads in flight per weight row and lane
    min_blocks: int  # __launch_bounds__' second argument

    @property
    def blocks(self) -> int:
        return self.tiles * self.splits

    @property
    def threads(self) -> int:
        return WARPS * LANES


def split_plan(k: int, splits: int) -> tuple:
    """(columns per split, splits used): `splits` slices of K rounded up to whole warp steps (256 columns), so that a
    few requested splits of a short K may come out fewer."""
    if splits < 1:
        raise ValueError(f"splits={splits}: at least 1")
    per_split = -(-(-(-k // splits)) // WARP_STEP) * WARP_STEP
    return per_split, -(-k // per_split)


def launch(product: Product, version: str = "gemv", splits: int = 1) -> Launch:
    """The launch configuration of `version` for `product` (gemv_host.cu's)."""
    if version == "v1":
        if product.batch != 1 or product.form != "plain" or splits != 1:
            raise ValueError("v1 is the plain product at batch 1, one split")
        return Launch("v1", -(-product.n_out // WARPS), 1, product.k, 1, WARPS, V1_UNROLL, 1)
    if version != "gemv":
        raise ValueError(f"version {version!r}: 'v1' or 'gemv'")
    rows, unroll, min_blocks = SHAPES[batch_width(product.batch)]
    out_rows = WARPS * rows // (2 if product.form == "norm_gate_up" else 1)
    per_split, used = split_plan(product.k, splits)
    return Launch("gemv", -(-product.n_out // out_rows), used, per_split, rows, out_rows, unroll, min_blocks)


def warp_rows(product: Product, plan: Launch, tile: int, warp: int) -> list:
    """The weight rows warp `warp` of row tile `tile` reads (rows past the matrix read its last output row's again,
    and are not stored: they are left out here)."""
    halves = 2 if plan.version == "gemv" and product.form == "norm_gate_up" else 1
    out_rows = plan.rows_per_warp // halves
    first = tile * plan.out_rows_per_block + warp * out_rows
    return [first + i % out_rows + (i // out_rows) * product.n_out for i in range(plan.rows_per_warp)
            if first + i % out_rows < product.n_out]


def lane_columns(plan: Launch, k: int, split: int, lane: int) -> list:
    """The first column of each 8-value load of `lane` in split `split`, in the order the lane adds them."""
    begin, end = split * plan.k_per_split, min(k, (split + 1) * plan.k_per_split)
    return list(range(begin + CHUNK * lane, end, WARP_STEP))


def read_counts(product: Product, plan: Launch) -> np.ndarray:
    """How many times each weight is read (weight_rows, k): all ones when the split covers the matrix once (for
    small products: it walks every lane of every warp of every block)."""
    counts = np.zeros((product.weight_rows, product.k), np.int64)
    for tile in range(plan.tiles):
        for warp in range(WARPS):
            rows = warp_rows(product, plan, tile, warp)
            for split in range(plan.splits):
                for lane in range(LANES):
                    for column in lane_columns(plan, product.k, split, lane):
                        counts[rows, column:column + CHUNK] += 1
    return counts


# ---------------------------------------------------------------------------------------------- bytes in flight


def blocks_per_sm(registers: int, min_blocks: int = 1, gpu: Gpu = H100) -> int:
    """Blocks of 128 threads one SM holds at `registers` per thread (allocated in multiples of 8 per thread)."""
    per_block = -(-registers // 8) * 8 * WARPS * LANES
    return max(1, min(gpu.registers_per_sm // per_block, gpu.max_warps_per_sm // WARPS, gpu.max_blocks_per_sm))


def bytes_in_flight_per_warp(plan: Launch) -> int:
    """Weight bytes a warp has requested before it uses the first of them: rows x unroll x 512."""
    return plan.rows_per_warp * plan.unroll * LANES * 16


def bytes_in_flight_per_sm(product: Product, plan: Launch, registers: int, gpu: Gpu = H100) -> float:
    """Weight bytes in flight on an SM while the launch runs: the warps it holds (by registers, or by the blocks
    there are, spread over the SMs) times each warp's loads."""
    resident = min(blocks_per_sm(registers, plan.min_blocks, gpu), plan.blocks / gpu.sms)
    return resident * WARPS * bytes_in_flight_per_warp(plan)


def bytes_needed_per_sm(gpu: Gpu = H100) -> float:
    """Little's law: bandwidth x latency, per SM (about 20 KB on an H100 at 900 ns)."""
    return gpu.copy_gbps * 1e9 * gpu.hbm_latency_ns * 1e-9 / gpu.sms


def waves(plan: Launch, registers: int, gpu: Gpu = H100) -> float:
    """Blocks over the blocks the GPU holds at once."""
    return plan.blocks / (gpu.sms * blocks_per_sm(registers, plan.min_blocks, gpu))


# Registers per thread of each batch width's kernel, the largest of its forms and dtypes in the compile report for
# sm_90 (nvcc 13.0 and 13.5 alike; tests/test_gemv.py keeps them in step): the model's occupancy when no report is at
# hand
REGISTERS = {("v1", 1): 80, ("gemv", 1): 102, ("gemv", 2): 128, ("gemv", 4): 153, ("gemv", 8): 168, ("gemv", 16): 248}


def instructions_per_weight(plan: Launch, product: Product) -> float:
    """Instructions a lane issues per weight value: an FFMA per row of x (the kernel's batch width), the weight's
    conversion to float32, and x's conversion, which a warp's rows share (plus the norm's two per value of x)."""
    width = 1 if plan.version == "v1" else batch_width(product.batch)
    per_x = (1 + 2 * (product.form in ("norm", "norm_gate_up"))) * width
    return width + 1 + per_x / plan.rows_per_warp


def issue_time_us(product: Product, plan: Launch, gpu: Gpu = H100) -> float:
    """The instructions' time at 4 warp instructions per clock per SM (128 lanes' worth), every SM busy."""
    values = product.weight_rows * product.k
    return values * instructions_per_weight(plan, product) / (gpu.sms * 128 * gpu.clock_ghz * 1e9) * 1e6


def predicted_time_us(product: Product, plan: Launch, gpu: Gpu = H100, registers: int | None = None) -> float:
    """A first-order model of one product's time on `gpu`, to rank split counts (not to promise a number):

    latency of the first loads + the longer of (the weights' bytes at the copy rate, stretched by too few bytes in
    flight: below Little's law's need) and (the instructions' issue time), each stretched by the busiest SM's share
    of the blocks (ceil(blocks / SMs) of them), + with split-K the tail: the last block's atomic and its read of every
    split's partial sums (from L2). At batch 16 the issue time comes close to the bytes' time (NOTES.md)."""
    registers = registers or REGISTERS[(plan.version, batch_width(product.batch))]
    read_us = copy_time_us(product.weight_bytes, gpu.copy_gbps)
    imbalance = math.ceil(plan.blocks / gpu.sms) * gpu.sms / plan.blocks
    in_flight = min(1.0, bytes_in_flight_per_sm(product, plan, registers, gpu) / bytes_needed_per_sm(gpu))
    time_us = gpu.hbm_latency_ns * 1e-3 + max(read_us / in_flight, issue_time_us(product, plan, gpu)) * imbalance
    if plan.splits > 1:
        partial_bytes = 4 * plan.splits * product.batch * product.weight_rows
        time_us += 2 * gpu.l2_latency_ns * 1e-3 + partial_bytes / (gpu.copy_gbps * 1e9) * 1e6
    return time_us


def choose_splits(product: Product, gpu: Gpu = H100, registers: int | None = None,
                  candidates=(1, 2, 3, 4, 6, 8, 12, 16)) -> int:
    """The split count :func:`predicted_time_us` finds fastest (fewer splits on a tie within 2 %: a split costs a
    workspace and a tail)."""
    best, best_time = 1, predicted_time_us(product, launch(product, "gemv", 1), gpu, registers)
    for splits in candidates[1:]:
        plan = launch(product, "gemv", splits)
        if plan.splits != splits:
            continue
        t = predicted_time_us(product, plan, gpu, registers)
        if t < 0.98 * best_time:
            best, best_time = splits, t
    return best


def predictions(batch: int = 1, gpu: Gpu = H100) -> list:
    """Each model product at `batch` in its fused form at :func:`choose_splits`' count: the model's numbers as
    NOTES.md tabulates them (tests/test_gemv.py compares the two)."""
    rows = []
    for product in model_products(batch):
        splits = choose_splits(product, gpu)
        plan = launch(product, "gemv", splits)
        registers = REGISTERS[("gemv", batch_width(batch))]
        ceiling, model = copy_time_us(product.weight_bytes, gpu.copy_gbps), predicted_time_us(product, plan, gpu)
        rows.append({"product": product.name, "weight_mb": product.weight_bytes / 1e6, "ceiling_us": ceiling,
                     "tiles": plan.tiles, "splits": splits,
                     "in_flight_kb": bytes_in_flight_per_sm(product, plan, registers, gpu) / 1024,
                     "issue_us": issue_time_us(product, plan, gpu), "model_us": model, "of_ceiling": ceiling / model})
    return rows


# ---------------------------------------------------------------------------------------------- the roofline


def copy_time_us(nbytes: float, copy_gbps: float) -> float:
    """Time to move `nbytes` at a copy's rate, the rate the decoder's roofline uses (wb_kernels/models/NOTES.md): a copy's
    rate counts the bytes it reads and writes, which share HBM's bandwidth, so a stream that only reads moves its
    bytes at that rate too. (A copy of W's own bytes, which reads and writes them, thus takes twice the ceiling of a
    product that reads W once.)"""
    return nbytes / (copy_gbps * 1e9) * 1e6


def roofline_us(product: Product, copy_gbps: float) -> float:
    """A product's ceiling: its weights (and x, and y) at the copy rate."""
    moved = product.weight_bytes + product.dtype_bytes * product.batch * (product.k + product.n_out)
    return copy_time_us(moved, copy_gbps)


# ---------------------------------------------------------------------------------------------- the arithmetic


def _fma32(a, b, c):
    """float32 a * b + c with one rounding (through float64: a product of two values of 24 bits or fewer is exact
    there; the sum then rounds once, but in a case of probability ~2^-29 per operation)."""
    return (np.asarray(a, np.float64) * b + c).astype(np.float32)


def _lane_sums(rows: np.ndarray, x: np.ndarray, begin: int, end: int):
    """Each lane's float32 sums over its columns of [begin, end): rows (R, K), x (B, K) float32 -> (R, B, 32)."""
    width = -(-(end - begin) // WARP_STEP) * WARP_STEP  # whole warp steps: the missing columns are zeros, as loaded

    def chunks(a):
        padded = np.zeros((a.shape[0], width), np.float32)
        padded[:, :end - begin] = a[:, begin:end]
        return padded.reshape(a.shape[0], -1, LANES, CHUNK)  # (rows, step, lane, value)

    w, xs = chunks(rows), chunks(x)
    acc = np.zeros((rows.shape[0], x.shape[0], LANES), np.float32)
    for step in range(w.shape[1]):
        for e in range(CHUNK):
            acc = _fma32(w[:, None, step, :, e], xs[None, :, step, :, e], acc)
    return acc


def _warp_sum(values: np.ndarray) -> np.ndarray:
    """The butterfly of warp_sum over the last axis (32 lanes): every lane ends with the same bits; lane 0's."""
    lanes = np.arange(LANES)
    for offset in (16, 8, 4, 2, 1):
        values = (values + values[..., lanes ^ offset]).astype(np.float32)
    return values[..., 0]


def emulate(w, x, *, dtype: str = "float16", form: str = "plain", splits: int = 1, norm_weight=None,
            residual=None, eps: float = 1e-5) -> np.ndarray:
    """What the kernels compute, in NumPy float32 and the kernels' order: W (weight rows, K) and x (B, K) given as
    values of `dtype` (any float array; rounded to `dtype` here), returns (B, n_out) float32 holding values of `dtype`.

    The sum of each row: each lane's 8-value chunks in order of k (an fma each), the warp's butterfly, and with
    `splits` > 1 the splits' sums added in the order 0, 1, .... v1 gives the same bits as one split of "plain".
    Bit for bit the kernels' for "plain" and "residual"; "norm" and "norm_gate_up" use rsqrt and exp, which the
    GPU computes approximately (fast math): within a few float32 ulps before the last rounding."""
    w, x = round_to(w, dtype), round_to(np.atleast_2d(x), dtype)
    k = w.shape[1]
    per_split, used = split_plan(k, splits)
    if form in ("norm", "norm_gate_up"):
        g = round_to(norm_weight, dtype)
        xg = (x * g).astype(np.float32)  # exact: two 16-bit values' product
    else:
        xg = x
    totals, squares = None, None
    for split in range(used):
        begin, end = split * per_split, min(k, (split + 1) * per_split)
        part = _warp_sum(_lane_sums(w, xg, begin, end))  # (rows, B)
        totals = part if totals is None else (totals + part).astype(np.float32)
        if form in ("norm", "norm_gate_up"):
            sq = _warp_sum(_lane_sums(x, x, begin, end)[np.arange(x.shape[0]), np.arange(x.shape[0])])  # (B,)
            squares = sq if squares is None else (squares + sq).astype(np.float32)
    sums = totals.T  # (B, rows)
    if form in ("norm", "norm_gate_up"):
        inv_k = np.float32(1.0 / k)
        scale = (np.float32(1) / np.sqrt(_fma32(squares, inv_k, np.float32(eps)))).astype(np.float32)
        sums = (sums * scale[:, None]).astype(np.float32)
    if form == "residual":
        sums = (sums + round_to(np.asarray(residual).reshape(sums.shape), dtype)).astype(np.float32)
    if form == "norm_gate_up":
        half = sums.shape[1] // 2
        gate, up = sums[:, :half], sums[:, half:]
        sums = (gate / (np.float32(1) + np.exp(-gate)) * up).astype(np.float32)
    return round_to(sums, dtype)


def _float64(a):
    """`a` in float64: a NumPy array, or a torch tensor where it lies (a GPU check's reference stays on the GPU)."""
    return a.double() if hasattr(a, "double") else np.asarray(a, np.float64)


def _exp(a):
    return a.exp() if hasattr(a, "exp") else np.exp(a)


def _row_products(w, x, form, norm_weight, eps):
    """float64 sums W x' (B, rows) and sums of |W x'|, with x' = x or rmsnorm(x) g (NumPy or torch alike)."""
    w64, x64 = _float64(w), _float64(x)
    x64 = x64.reshape(1, -1) if x64.ndim == 1 else x64
    if form in ("norm", "norm_gate_up"):
        scale = ((x64 ** 2).mean(1) + eps) ** -0.5
        x64 = x64 * _float64(norm_weight) * scale[:, None]
    return x64 @ w64.T, abs(x64) @ abs(w64).T


def reference64(w, x, *, form: str = "plain", norm_weight=None, residual=None, eps: float = 1e-5):
    """The product in float64 from the same (already rounded) inputs: (B, n_out). NumPy arrays or torch tensors (the
    result is of the same kind, on the same device)."""
    y, _ = _row_products(w, x, form, norm_weight, eps)
    if form == "residual":
        y = y + _float64(residual).reshape(y.shape)
    if form == "norm_gate_up":
        half = y.shape[1] // 2
        gate, up = y[:, :half], y[:, half:]
        y = gate / (1.0 + _exp(-gate)) * up
    return y


def error_bound(w, x, *, dtype: str = "float16", form: str = "plain", splits: int = 1, norm_weight=None,
                residual=None, eps: float = 1e-5):
    """A bound on |kernel - float64| per output (B, n_out): float32 sums of n terms err by at most about n u |terms|
    (u = 2^-24; n = a lane's K/256 chunks x 8 + the butterfly's 5 + the splits), the approximate rsqrt and exp a few
    float32 ulps of the value, and the last rounding half an ulp of `dtype` (2^-11 or 2^-8 relative, and float16's
    smallest subnormal step). NumPy arrays or torch tensors, as :func:`reference64`."""
    y, magnitude = _row_products(w, x, form, norm_weight, eps)
    depth = CHUNK * -(-w.shape[1] // WARP_STEP) + 5 + splits + 2  # + 2: the norm's scale
    sums_error = depth * 2.0 ** -24 * magnitude + 2.0 ** -20 * abs(y)
    if form == "residual":
        y = y + _float64(residual).reshape(y.shape)
    if form == "norm_gate_up":
        half = y.shape[1] // 2
        gate, up = y[:, :half], y[:, half:]
        silu = gate / (1.0 + _exp(-gate))
        y = silu * up
        sums_error = 1.1 * sums_error[:, :half] * abs(up) + abs(silu) * sums_error[:, half:] + 2.0 ** -20 * abs(y)
    unit = 2.0 ** -11 if dtype == "float16" else 2.0 ** -8
    return sums_error + unit * 1.01 * abs(y) + (2.0 ** -24 if dtype == "float16" else 0.0)
