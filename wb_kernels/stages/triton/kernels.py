"""FlashAttention-2 in Triton: the forward, the three backward kernels and the block-mask kernel (lesson 11_triton).

Importing this module imports triton and decorates the kernels, so :mod:`.launcher` imports it lazily, after it
has decided between Triton's compiler and its CPU interpreter (``TRITON_INTERPRET``, read when a kernel is
decorated). Nothing else in the package imports it.

What one program computes (a "block" is BLOCK_M query rows or BLOCK_N keys):

=========================  ===================================  ==================================================
kernel                     one program per                      loops over
=========================  ===================================  ==================================================
``attention_forward``      query block, (batch, head)           the key blocks the query block can see
``backward_preprocess``    query block, (batch, head)           nothing: delta_i = sum_d dout * out, the sinks' part
``backward_dk_dv``         key block, (batch, kv head)          the query heads of its group, then their query blocks
``backward_dq``            query block, (batch, head)           the key blocks the query block can see
``block_mask_tiles``       (query block, key block, b * h)      nothing: is any / every element of the tile visible
=========================  ===================================  ==================================================

Scores follow :mod:`wb_kernels.variants`' order: scale, softcap, ALiBi and bias, ``score_mod``, then the masks
(causal, key padding, window, documents, ``mask_mod``) to -inf. The online softmax runs in base 2 (``exp2`` is one
instruction on a GPU, ``exp`` is ``exp2`` after a multiply): a plain call folds ``scale * log2(e)`` into one
multiply of the raw dot product; a call with a score variant applies the variants in natural units, where they are
defined, and multiplies by ``log2(e)`` once at the end. The saved LSE is in natural units.

Every variant is a ``tl.constexpr`` flag, so a plain call compiles none of their code, and a call's unused
pointers are None.
"""

from __future__ import annotations

import os

import triton
import triton.language as tl

__all__ = ["attention_forward", "backward_preprocess", "backward_dk_dv", "backward_dq", "block_mask_tiles",
           "INTERPRETING", "LOG2E"]

# decided by the launcher before this module was imported, and fixed for the process: the decorators read it
INTERPRETING = os.environ.get("TRITON_INTERPRET", "0").strip().lower() in ("1", "true", "yes", "on")

LOG2E = tl.constexpr(1.4426950408889634)  # exp(x) = exp2(x * log2(e))
LN2 = tl.constexpr(0.6931471805599453)  # log(x) = log2(x) * ln(2)
# Arguments that change with the sequence length and that the kernels gain nothing from knowing more of: left
# unspecialized, so a new length does not compile a new kernel (Triton otherwise compiles one per class of each int
# argument: equal to 1, divisible by 16, other). Lk and the bias's strides stay specialized: with Lk divisible by 16
# a bias tile's rows start aligned and its mask is constant over 16 keys, so its loads are 16-byte copies; without,
# they are scalar loads (NOTES.md). The compile key is therefore the head dim, the dtype, the flags, the launch
# settings and whether Lk is a multiple of 16 (with a dense bias, whether its strides Lq·Lk and Lk are), never L
# itself (tests/test_triton_lesson.py checks it on the launches a GPU call makes).
LENGTH_ARGUMENTS = ["Lq", "offset", "num_q_blocks", "num_k_blocks"]


# ------------------------------------------------------------------------------------------- elementwise helpers

if INTERPRETING:
    @triton.jit
    def tanh(x):
        """tanh from exp and log alone: Triton's interpreter has no libdevice. The textbook 1 - 2 / (exp(2x) + 1)
        loses every digit near 0, where softcap·tanh(s / softcap) ≈ s is used most; Kahan's expm1 trick
        (expm1(y) = (u - 1) · y / log(u), u = exp(y)) keeps a few ulps of relative error there."""
        a = tl.abs(x)
        a = tl.where(a > 9.0, 9.0, a)  # tanh(9) rounds to 1 in float32; further out exp(-2a) would go subnormal
        y = -2.0 * a
        u = tl.exp(y)
        exact_one = u == 1.0
        log_u = tl.where(exact_one, -1.0, tl.log(u))
        expm1 = tl.where(exact_one, y, (u - 1.0) * y / log_u)
        magnitude = -expm1 / (2.0 + expm1)  # tanh(a) = (1 - e^-2a) / (1 + e^-2a)
        return tl.where(x < 0, -magnitude, magnitude)

    @triton.jit
    def cast(x, dtype: tl.constexpr):
        """x.to(dtype), rounded to nearest even. The interpreter's float32 -> bfloat16 conversion drops the low 16
        bits (rounds toward zero), a bias a GPU does not have that doubled the bfloat16 gradients' error; rounding
        the bits first makes that conversion exact."""
        if dtype == tl.bfloat16:
            bits = x.to(tl.float32).to(tl.uint32, bitcast=True)
            bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
            x = tl.where(x == x, bits.to(tl.float32, bitcast=True), x)  # (a NaN stays NaN, whatever its payload)
        return x.to(dtype)

    @triton.jit
    def as_tile(x):
        """x as the compiler has it. The interpreter runs jit code as Python, where a constexpr times a tensor (a mod's
        ``CAP * tanh(score / CAP)``) stays a constexpr wrapping the tensor; the compiler gives the tensor."""
        return x.value if isinstance(x, tl.constexpr) else x
else:
    from triton.language.extra import libdevice

    @triton.jit
    def tanh(x):
        return libdevice.tanh(x)

    @triton.jit
    def cast(x, dtype: tl.constexpr):
        return x.to(dtype)  # rounds to nearest even on a GPU

    @triton.jit
    def as_tile(x):
        return x


@triton.jit
def dot(a, b, FLOAT32_DOT: tl.constexpr):
    """a @ b with float32 accumulation. FLOAT32_DOT: operands taken as float32, multiplied in full (IEEE) precision:
    float32 inputs are then exact to float32 (tensor cores' default would round them to TF32's 10-bit mantissa), and
    bfloat16 ones exact as well (a product of two bfloat16 fits in float32), which is how the launcher runs bfloat16
    on the interpreter, whose own bfloat16 dot multiplies the raw bits. Otherwise the tensor-core dot of the
    operands' type."""
    if FLOAT32_DOT:
        product = tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
    else:
        product = tl.dot(a, b)
    return product


# ------------------------------------------------------------------------------------ which blocks can be visible

# region: key_block_range
@triton.jit
def key_block_range(start_m, Lq, Lk, offset, window_left, window_right,
                    IS_CAUSAL: tl.constexpr, HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr,
                    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """The key blocks [lo, hi) that rows start_m .. start_m + BLOCK_M - 1 may see: key j is visible to row i only
    when j <= i + offset (causal), j <= i + offset + right and j >= i + offset - left (window), so the first row
    bounds the keys from below and the last row from above. A sliding window's loop is (window + BLOCK_M) / BLOCK_N
    blocks long whatever Lk is; the keys outside are never loaded."""
    last_row = tl.minimum(start_m + BLOCK_M, Lq) - 1
    lo = start_m * 0  # first visible key (a runtime int, like hi)
    hi = Lk + lo  # one past the last visible key
    if IS_CAUSAL:
        hi = tl.minimum(hi, last_row + offset + 1)
    if HAS_RIGHT:
        hi = tl.minimum(hi, last_row + offset + window_right + 1)
    if HAS_LEFT:
        lo = tl.maximum(lo, start_m + offset - window_left)
    lo_block = lo // BLOCK_N
    hi_block = tl.where(hi > lo, (hi + BLOCK_N - 1) // BLOCK_N, lo_block)  # (hi > lo >= 0: no negative division)
    return lo_block, hi_block
# endregion


@triton.jit
def query_block_range(start_n, Lq, Lk, offset, window_left, window_right,
                      IS_CAUSAL: tl.constexpr, HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr,
                      BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """The query blocks [lo, hi) that may see keys start_n .. start_n + BLOCK_N - 1 (the backward's dK/dV loop):
    the same inequalities as :func:`key_block_range`, solved for i: i >= j - offset (causal),
    i >= j - offset - right and i <= j - offset + left (window)."""
    last_key = tl.minimum(start_n + BLOCK_N, Lk) - 1
    lo = start_n * 0
    hi = Lq + lo
    if IS_CAUSAL:
        lo = tl.maximum(lo, start_n - offset)
    if HAS_RIGHT:
        lo = tl.maximum(lo, start_n - offset - window_right)
    if HAS_LEFT:
        hi = tl.minimum(hi, last_key - offset + window_left + 1)
    lo_block = lo // BLOCK_M
    hi_block = tl.where(hi > lo, (hi + BLOCK_M - 1) // BLOCK_M, lo_block)
    return lo_block, hi_block


# region: document_block_range
@triton.jit
def document_block_range(lo, hi, DocBlocks, b, block, num_blocks, HAS_DOCS: tl.constexpr):
    """[lo, hi) narrowed to the blocks on the other side that can share a document with this program's block:
    DocBlocks (B, blocks, 2) int32, from the launcher (O(blocks²) host work on the blocks' smallest and largest id).
    For packed sequences, whose ids are sorted, the blocks that meet a document are contiguous, so the loop visits
    about (document length / BLOCK_N + 1) key blocks per query block; unsorted ids get the span from the first
    such block to the last (fewer skipped, never a wrong answer: the elementwise mask still applies). A range, not
    a test inside the loop: a branch around a tile's loads keeps Triton from pipelining them (no cp.async)."""
    if HAS_DOCS:
        at = (b.to(tl.int64) * num_blocks + block) * 2
        lo = tl.maximum(lo, tl.load(DocBlocks + at))
        hi = tl.minimum(hi, tl.load(DocBlocks + at + 1))
    return lo, hi
# endregion


# region: loop_range
@triton.jit
def first_listed_at_least(Indices, start, count, value):
    """The first position t in [0, count) of the ascending list at Indices + start whose block is >= value (count
    if there is none): a binary search, about log2(count) loads."""
    first = count * 0
    last = count
    while first < last:
        middle = (first + last) // 2
        below = tl.load(Indices + start + middle) < value
        first = tl.where(below, middle + 1, first)
        last = tl.where(below, last, middle)
    return first


@triton.jit
def loop_range(lo, hi, Count, Indices, list_row, list_length, MASK_MOD: tl.constexpr):
    """The positions [t_lo, t_hi) a program's loop runs over. Without a block mask they are the blocks [lo, hi)
    themselves. With one, the positions in this program's list (ascending blocks with a visible element) of the
    blocks inside [lo, hi), found by two binary searches: a test inside the loop instead would keep Triton from
    pipelining the loop's loads (no cp.async), as the compile check showed."""
    t_lo = lo
    t_hi = hi
    if MASK_MOD is not None:
        start = list_row.to(tl.int64) * list_length
        count = tl.load(Count + list_row)
        t_lo = first_listed_at_least(Indices, start, count, lo)
        t_hi = first_listed_at_least(Indices, start, count, hi)
    return t_lo, t_hi


@triton.jit
def block_to_visit(t, list_row, Indices, Full, list_length, MASK_MOD: tl.constexpr):
    """The block at position t of the loop and whether its tile needs mask_mod elementwise: t itself without a
    block mask; with one, the t-th entry of this program's list and its "full" mark."""
    block = t
    check_mask_mod = False
    if MASK_MOD is not None:
        at = list_row.to(tl.int64) * list_length + t
        block = tl.load(Indices + at)
        check_mask_mod = tl.load(Full + at) == 0
    return block, check_mask_mod
# endregion


# region: checked_mods
@triton.jit
def checked_score(result, tile):
    """A score_mod's result, refused when the kernel is compiled unless it holds one floating value per (q_idx,
    kv_idx) of the tile: a 2-D block whose sides are the tile's or 1. A reduced or 1-D result would otherwise
    broadcast into a wrong answer without a word. (Its derivative may be a constant, 1.0 for an added term: not
    checked.)"""
    result = as_tile(result)
    tl.static_assert(len(result.shape) == 2, "score_mod must return one score per (q_idx, kv_idx): a 2-D tile like "
                                             "its score argument, not a reduction or a 1-D result")
    tl.static_assert(((result.shape[0] == tile.shape[0]) | (result.shape[0] == 1))
                     & ((result.shape[1] == tile.shape[1]) | (result.shape[1] == 1)),
                     "score_mod must return one score per (q_idx, kv_idx): a tile shaped like its score argument")
    tl.static_assert(result.dtype.is_floating(), "score_mod must return floating-point scores")
    return result


@triton.jit
def checked_mask(result, tile):
    """A mask_mod's result, refused when the kernel is compiled unless it holds one boolean per (q_idx, kv_idx) of
    the tile (a 2-D block whose sides are the tile's or 1)."""
    result = as_tile(result)
    tl.static_assert(len(result.shape) == 2, "mask_mod must return one boolean per (q_idx, kv_idx): a 2-D tile, not "
                                             "a reduction or a 1-D result")
    tl.static_assert(((result.shape[0] == tile.shape[0]) | (result.shape[0] == 1))
                     & ((result.shape[1] == tile.shape[1]) | (result.shape[1] == 1)),
                     "mask_mod must return one boolean per (q_idx, kv_idx): a tile shaped like q_idx x kv_idx")
    tl.static_assert(result.dtype == tl.int1, "mask_mod must return booleans (a comparison such as kv_idx <= q_idx), "
                                              "not numbers")
    return result
# endregion


# ------------------------------------------------------------------------------------------- one tile's scores

# region: tile_scores
@triton.jit
def tile_scores(qk, b, h, offs_m, offs_n, Lq, Lk, offset, scale, softcap, slope,
                bias_base, stride_bias_m, stride_bias_n, window_left, window_right,
                KeyKeep, QIds, KIds, check_mask_mod,
                IS_CAUSAL: tl.constexpr, HAS_KEY_PADDING: tl.constexpr, HAS_SOFTCAP: tl.constexpr,
                HAS_ALIBI: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr,
                HAS_DOCS: tl.constexpr, SCORE_MOD: tl.constexpr, SCORE_MOD_DERIVATIVE: tl.constexpr,
                MASK_MOD: tl.constexpr, WANT_CHAIN: tl.constexpr):
    """Scores of one (BLOCK_M, BLOCK_N) tile in base 2 (natural score · log2 e), -inf where the key is not visible,
    from qk = q kᵀ (float32). With WANT_CHAIN (the backward) also dZ/dS, the factor the chain rule multiplies dZ
    by to reach the scaled raw score S: softcap' = 1 - tanh²(S / softcap), times score_mod's derivative."""
    q_idx = offs_m[:, None]  # (BLOCK_M, 1)
    kv_idx = offs_n[None, :]  # (1, BLOCK_N)
    inside = (q_idx < Lq) & (kv_idx < Lk)
    chain = 1.0
    if HAS_SOFTCAP or HAS_ALIBI or HAS_BIAS or (SCORE_MOD is not None):
        z = qk * scale  # natural units: each variant is defined there
        if HAS_SOFTCAP:
            capped = tanh(z / softcap)
            z = softcap * capped
            if WANT_CHAIN:
                chain = 1.0 - capped * capped
        if HAS_ALIBI:
            z = z - slope * tl.abs(kv_idx - (q_idx + offset)).to(tl.float32)
        if HAS_BIAS:
            bias = tl.load(bias_base + q_idx * stride_bias_m + kv_idx * stride_bias_n, mask=inside, other=0.0)
            z = z + bias.to(tl.float32)
        if SCORE_MOD is not None:
            if WANT_CHAIN:
                chain = chain * SCORE_MOD_DERIVATIVE(z, b, h, q_idx, kv_idx)
            z = checked_score(SCORE_MOD(z, b, h, q_idx, kv_idx), z)
        scores = z * LOG2E
    else:
        scores = qk * (scale * LOG2E)  # one multiply: the plain path
    visible = inside
    if IS_CAUSAL:
        visible = visible & (kv_idx <= q_idx + offset)
    if HAS_KEY_PADDING:
        keep = tl.load(KeyKeep + b.to(tl.int64) * Lk + offs_n, mask=offs_n < Lk, other=0)
        visible = visible & (keep[None, :] != 0)
    if HAS_LEFT:
        visible = visible & (kv_idx - (q_idx + offset) >= -window_left)
    if HAS_RIGHT:
        visible = visible & (kv_idx - (q_idx + offset) <= window_right)
    if HAS_DOCS:
        q_ids = tl.load(QIds + b.to(tl.int64) * Lq + offs_m, mask=offs_m < Lq, other=-1)
        k_ids = tl.load(KIds + b.to(tl.int64) * Lk + offs_n, mask=offs_n < Lk, other=-2)
        visible = visible & (q_ids[:, None] == k_ids[None, :])
    if MASK_MOD is not None:
        if check_mask_mod:  # a tile the block mask found full skips the elementwise mask
            visible = visible & checked_mask(MASK_MOD(b, h, q_idx, kv_idx), visible)
    scores = tl.where(visible, scores, float("-inf"))
    return scores, chain
# endregion


# ------------------------------------------------------------------------------------------------ the forward

# region: forward_tile
@triton.jit
def forward_tile(acc, m_i, l_i, q, K_head, V_head, start_n, offs_m, offs_d, b, h, Lq, Lk, D, offset, scale,
                 softcap, slope, bias_base, stride_bias_m, stride_bias_n, window_left, window_right,
                 KeyKeep, QIds, KIds, check_mask_mod,
                 IS_CAUSAL: tl.constexpr, HAS_KEY_PADDING: tl.constexpr, HAS_SOFTCAP: tl.constexpr,
                 HAS_ALIBI: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr,
                 HAS_DOCS: tl.constexpr, SCORE_MOD: tl.constexpr, MASK_MOD: tl.constexpr,
                 BLOCK_N: tl.constexpr, FLOAT32_DOT: tl.constexpr):
    """One step of the online softmax: the key block at start_n joins the running max m_i, sum l_i and output
    acc (all float32, base 2)."""
    offs_n = start_n + tl.arange(0, BLOCK_N)
    key_ok = (offs_n[:, None] < Lk) & (offs_d[None, :] < D)
    k = tl.load(K_head + offs_n[:, None] * D + offs_d[None, :], mask=key_ok, other=0.0)
    qk = dot(q, tl.trans(k), FLOAT32_DOT)  # (BLOCK_M, BLOCK_N), float32
    scores, _ = tile_scores(qk, b, h, offs_m, offs_n, Lq, Lk, offset, scale, softcap, slope,
                            bias_base, stride_bias_m, stride_bias_n, window_left, window_right,
                            KeyKeep, QIds, KIds, check_mask_mod,
                            IS_CAUSAL, HAS_KEY_PADDING, HAS_SOFTCAP, HAS_ALIBI, HAS_BIAS, HAS_LEFT, HAS_RIGHT,
                            HAS_DOCS, SCORE_MOD, None, MASK_MOD, False)
    m_new = tl.maximum(m_i, tl.max(scores, 1))
    # a row that has seen no key yet keeps m = -inf; subtracting 0 instead keeps exp2(-inf - -inf) = NaN away
    m_shift = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp2(m_i - m_shift)  # rescales what was summed under the old max
    p = tl.exp2(scores - m_shift[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    v = tl.load(V_head + offs_n[:, None] * D + offs_d[None, :], mask=key_ok, other=0.0)
    acc = acc * alpha[:, None] + dot(cast(p, v.dtype), v, FLOAT32_DOT)
    return acc, m_new, l_i
# endregion


# region: attention_forward
@triton.jit(do_not_specialize=LENGTH_ARGUMENTS)
def attention_forward(
    Q, K, V, Out, Lse,  # (B, H, Lq, D), (B, Hk, Lk, D) twice, (B, H, Lq, D), (B, H, Lq) float32; contiguous
    H, Hk, Lq, Lk, D,  # sizes
    scale, offset,  # the score scale; the causal diagonal's offset (0, or Lk - Lq for bottom_right)
    KeyKeep,  # (B, Lk) uint8, 1 = the key takes part (key padding)
    softcap, Slopes,  # the softcap; ALiBi slopes (B, H) float32
    Bias, stride_bias_b, stride_bias_h, stride_bias_m, stride_bias_n,  # bias; stride 0 on a broadcast dimension
    window_left, window_right,  # sliding window, each side used only with its HAS_ flag
    QIds, KIds, DocKeyBlocks, DocQueryBlocks,  # document ids (B, Lq), (B, Lk); block ranges (document_block_range)
    Sinks,  # (H,) float32: a logit per head in every row's denominator
    KvCount, KvIndices, KvFull, mask_stride_b, mask_stride_h,  # block mask: per query block, the key blocks to visit
    Visits,  # (B * H, number of query blocks) int32: key blocks visited, when COUNT_VISITS
    num_q_blocks, num_k_blocks,
    IS_CAUSAL: tl.constexpr, HAS_KEY_PADDING: tl.constexpr, HAS_SOFTCAP: tl.constexpr, HAS_ALIBI: tl.constexpr,
    HAS_BIAS: tl.constexpr, HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr, HAS_DOCS: tl.constexpr,
    HAS_SINKS: tl.constexpr, SCORE_MOD: tl.constexpr, MASK_MOD: tl.constexpr, COUNT_VISITS: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, FLOAT32_DOT: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_bh = tl.program_id(1)
    b = pid_bh // H
    h = pid_bh % H
    kv_head = b * Hk + h // (H // Hk)  # GQA: a group of H // Hk query heads reads one key/value head
    start_m = pid_m * BLOCK_M
    offs_m = start_m + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    Q_head = Q + pid_bh.to(tl.int64) * Lq * D  # (int64: B * H * L * D outgrows int32 at real sizes)
    K_head = K + kv_head.to(tl.int64) * Lk * D
    V_head = V + kv_head.to(tl.int64) * Lk * D
    row_ok = (offs_m[:, None] < Lq) & (offs_d[None, :] < D)
    q = tl.load(Q_head + offs_m[:, None] * D + offs_d[None, :], mask=row_ok, other=0.0)

    # the sink is one more logit in the denominator with no value: start the running max at it, its term at 1
    if HAS_SINKS:
        m_i = tl.zeros([BLOCK_M], dtype=tl.float32) + tl.load(Sinks + h).to(tl.float32) * LOG2E
        l_i = tl.zeros([BLOCK_M], dtype=tl.float32) + 1.0
    else:
        m_i = tl.zeros([BLOCK_M], dtype=tl.float32) + float("-inf")
        l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)

    slope = 0.0
    if HAS_ALIBI:
        slope = tl.load(Slopes + pid_bh).to(tl.float32)
    bias_base = Bias
    if HAS_BIAS:
        bias_base = Bias + b.to(tl.int64) * stride_bias_b + h.to(tl.int64) * stride_bias_h

    lo, hi = key_block_range(start_m, Lq, Lk, offset, window_left, window_right, IS_CAUSAL, HAS_LEFT, HAS_RIGHT,
                             BLOCK_M, BLOCK_N)
    lo, hi = document_block_range(lo, hi, DocKeyBlocks, b, pid_m, num_q_blocks, HAS_DOCS)
    list_row = (b * mask_stride_b + h * mask_stride_h) * num_q_blocks + pid_m  # its block mask list, if any
    t_lo, t_hi = loop_range(lo, hi, KvCount, KvIndices, list_row, num_k_blocks, MASK_MOD)
    visits = pid_m * 0  # (a runtime int: a loop may add to it)
    for t in range(t_lo, t_hi):
        n_block, check_mask_mod = block_to_visit(t, list_row, KvIndices, KvFull, num_k_blocks, MASK_MOD)
        acc, m_i, l_i = forward_tile(
            acc, m_i, l_i, q, K_head, V_head, n_block * BLOCK_N, offs_m, offs_d, b, h, Lq, Lk, D, offset,
            scale, softcap, slope, bias_base, stride_bias_m, stride_bias_n, window_left, window_right,
            KeyKeep, QIds, KIds, check_mask_mod,
            IS_CAUSAL, HAS_KEY_PADDING, HAS_SOFTCAP, HAS_ALIBI, HAS_BIAS, HAS_LEFT, HAS_RIGHT, HAS_DOCS,
            SCORE_MOD, MASK_MOD, BLOCK_N, FLOAT32_DOT)
        if COUNT_VISITS:
            visits += 1

    # a row that saw no key (and no sink) has l = 0: output 0 and LSE -inf, never 0 / 0 (a NaN l, from a NaN score
    # the row sees, stays NaN in both)
    empty = l_i == 0.0
    out = acc / tl.where(empty, 1.0, l_i)[:, None]
    lse = tl.where(empty, float("-inf"), (m_i + tl.log2(tl.where(empty, 1.0, l_i))) * LN2)
    out_at = pid_bh.to(tl.int64) * Lq * D + offs_m[:, None] * D + offs_d[None, :]
    tl.store(Out + out_at, cast(out, Out.dtype.element_ty), mask=row_ok)
    tl.store(Lse + pid_bh.to(tl.int64) * Lq + offs_m, lse, mask=offs_m < Lq)
    if COUNT_VISITS:
        tl.store(Visits + pid_bh * num_q_blocks + pid_m, visits)
# endregion


# ------------------------------------------------------------------------------------------------ the backward

@triton.jit(do_not_specialize=LENGTH_ARGUMENTS)
def backward_preprocess(
    Out, DOut, Lse, Delta,  # (B, H, Lq, D) twice, (B, H, Lq) float32 twice
    Sinks, SinkPartials,  # (H,) float32; (B * H, number of query blocks) float32
    H, Lq, D, num_q_blocks,
    HAS_SINKS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr,
):
    """delta_i = sum_d dout_id · out_id (= sum_j P_ij dP_ij, the softmax Jacobian's one number per row), and the
    sinks' gradient: the sink's column has no value, so its dP is 0 and dsink_h = -sum_{b,i} P_i,sink · delta_i,
    P_i,sink = exp(sink_h - lse_i). Each program writes its block's part of that sum; the launcher adds the
    B · Lq / BLOCK_M parts of each head, in a fixed order (deterministic, unlike atomics)."""
    pid_m = tl.program_id(0)
    pid_bh = tl.program_id(1)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    ok = (offs_m[:, None] < Lq) & (offs_d[None, :] < D)
    at = pid_bh.to(tl.int64) * Lq * D + offs_m[:, None] * D + offs_d[None, :]
    out = tl.load(Out + at, mask=ok, other=0.0).to(tl.float32)
    dout = tl.load(DOut + at, mask=ok, other=0.0).to(tl.float32)
    delta = tl.sum(out * dout, 1)
    tl.store(Delta + pid_bh.to(tl.int64) * Lq + offs_m, delta, mask=offs_m < Lq)
    if HAS_SINKS:
        lse = tl.load(Lse + pid_bh.to(tl.int64) * Lq + offs_m, mask=offs_m < Lq, other=float("-inf"))
        sink = tl.load(Sinks + pid_bh % H).to(tl.float32)
        p_sink = tl.where(lse == float("-inf"), 0.0, tl.exp2((sink - lse) * LOG2E))
        tl.store(SinkPartials + pid_bh * num_q_blocks + pid_m, -tl.sum(p_sink * delta, 0))


# region: backward_tile
@triton.jit
def backward_tile(q, k, v, dout, lse, delta, offs_m, offs_n, b, h, Lq, Lk, offset, scale, softcap, slope,
                  bias_base, stride_bias_m, stride_bias_n, window_left, window_right,
                  KeyKeep, QIds, KIds, check_mask_mod,
                  IS_CAUSAL: tl.constexpr, HAS_KEY_PADDING: tl.constexpr, HAS_SOFTCAP: tl.constexpr,
                  HAS_ALIBI: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr,
                  HAS_DOCS: tl.constexpr, SCORE_MOD: tl.constexpr, SCORE_MOD_DERIVATIVE: tl.constexpr,
                  MASK_MOD: tl.constexpr, FLOAT32_DOT: tl.constexpr):
    """P of one tile recomputed from the saved LSE, and dZ = P (dP - delta) (the gradient of the modified score,
    which is the bias's) and dS = dZ · chain (the raw scaled score's). A row that saw no key has LSE -inf and
    -inf scores: subtracting 0 gives P = 0, not NaN."""
    qk = dot(q, tl.trans(k), FLOAT32_DOT)
    scores, chain = tile_scores(qk, b, h, offs_m, offs_n, Lq, Lk, offset, scale, softcap, slope,
                                bias_base, stride_bias_m, stride_bias_n, window_left, window_right,
                                KeyKeep, QIds, KIds, check_mask_mod,
                                IS_CAUSAL, HAS_KEY_PADDING, HAS_SOFTCAP, HAS_ALIBI, HAS_BIAS, HAS_LEFT, HAS_RIGHT,
                                HAS_DOCS, SCORE_MOD, SCORE_MOD_DERIVATIVE, MASK_MOD, True)
    lse2 = tl.where(lse == float("-inf"), 0.0, lse * LOG2E)
    p = tl.exp2(scores - lse2[:, None])
    dp = dot(dout, tl.trans(v), FLOAT32_DOT)
    dz = p * (dp - delta[:, None])
    ds = dz * chain
    return p, dz, ds
# endregion


# region: backward_dk_dv
@triton.jit(do_not_specialize=LENGTH_ARGUMENTS)
def backward_dk_dv(
    Q, K, V, DOut, Lse, Delta, DK, DV,  # (B, H, Lq, D), (B, Hk, Lk, D) twice, (B, H, Lq, D), (B, H, Lq) twice, like K
    H, Hk, Lq, Lk, D, scale, offset,
    KeyKeep, softcap, Slopes,
    Bias, stride_bias_b, stride_bias_h, stride_bias_m, stride_bias_n,
    DBias, stride_dbias_b, stride_dbias_h, stride_dbias_m, stride_dbias_n,  # float32 gradient, the bias's shape
    window_left, window_right,
    QIds, KIds, DocKeyBlocks, DocQueryBlocks,
    QCount, QIndices, QFull, mask_stride_b, mask_stride_h,  # block mask: per key block, the query blocks to visit
    num_q_blocks, num_k_blocks,
    IS_CAUSAL: tl.constexpr, HAS_KEY_PADDING: tl.constexpr, HAS_SOFTCAP: tl.constexpr, HAS_ALIBI: tl.constexpr,
    HAS_BIAS: tl.constexpr, BIAS_SUM_ROWS: tl.constexpr, BIAS_ATOMIC: tl.constexpr,
    HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr, HAS_DOCS: tl.constexpr,
    SCORE_MOD: tl.constexpr, SCORE_MOD_DERIVATIVE: tl.constexpr, MASK_MOD: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, FLOAT32_DOT: tl.constexpr,
):
    """dK and dV of one key block of one key/value head: it stays in registers while the program walks the query
    heads of its group and, for each, the query blocks that can see the block, so dk and dv are summed over the
    group without atomics. The bias's gradient dZ is written here too: a tile store where this program owns the
    element, a row sum kept in registers where the bias broadcasts over Lq (BIAS_SUM_ROWS: every query block of
    the head passes through this program), atomics where it broadcasts over B or H (BIAS_ATOMIC: other programs
    add to the same element)."""
    pid_n = tl.program_id(0)
    pid_bhk = tl.program_id(1)
    b = pid_bhk // Hk
    kv_head = pid_bhk % Hk
    group = H // Hk
    start_n = pid_n * BLOCK_N
    offs_n = start_n + tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    key_ok = (offs_n[:, None] < Lk) & (offs_d[None, :] < D)
    kv_at = pid_bhk.to(tl.int64) * Lk * D + offs_n[:, None] * D + offs_d[None, :]
    k = tl.load(K + kv_at, mask=key_ok, other=0.0)
    v = tl.load(V + kv_at, mask=key_ok, other=0.0)
    dk = tl.zeros([BLOCK_N, BLOCK_D], dtype=tl.float32)
    dv = tl.zeros([BLOCK_N, BLOCK_D], dtype=tl.float32)
    lo, hi = query_block_range(start_n, Lq, Lk, offset, window_left, window_right, IS_CAUSAL, HAS_LEFT, HAS_RIGHT,
                               BLOCK_M, BLOCK_N)
    lo, hi = document_block_range(lo, hi, DocQueryBlocks, b, pid_n, num_k_blocks, HAS_DOCS)

    for g in range(0, group):
        h = kv_head * group + g
        bh = b * H + h
        slope = 0.0
        if HAS_ALIBI:
            slope = tl.load(Slopes + bh).to(tl.float32)
        bias_base = Bias
        dbias_base = DBias
        if HAS_BIAS:
            bias_base = Bias + b.to(tl.int64) * stride_bias_b + h.to(tl.int64) * stride_bias_h
            dbias_base = DBias + b.to(tl.int64) * stride_dbias_b + h.to(tl.int64) * stride_dbias_h
        dbias_row = tl.zeros([BLOCK_N], dtype=tl.float32)
        Q_head = Q + bh.to(tl.int64) * Lq * D
        DOut_head = DOut + bh.to(tl.int64) * Lq * D
        list_row = (b * mask_stride_b + h * mask_stride_h) * num_k_blocks + pid_n
        t_lo, t_hi = loop_range(lo, hi, QCount, QIndices, list_row, num_q_blocks, MASK_MOD)
        for t in range(t_lo, t_hi):
            m_block, check_mask_mod = block_to_visit(t, list_row, QIndices, QFull, num_q_blocks, MASK_MOD)
            offs_m = m_block * BLOCK_M + tl.arange(0, BLOCK_M)
            row_ok = (offs_m[:, None] < Lq) & (offs_d[None, :] < D)
            q = tl.load(Q_head + offs_m[:, None] * D + offs_d[None, :], mask=row_ok, other=0.0)
            dout = tl.load(DOut_head + offs_m[:, None] * D + offs_d[None, :], mask=row_ok, other=0.0)
            lse = tl.load(Lse + bh.to(tl.int64) * Lq + offs_m, mask=offs_m < Lq, other=float("-inf"))
            delta = tl.load(Delta + bh.to(tl.int64) * Lq + offs_m, mask=offs_m < Lq, other=0.0)
            p, dz, ds = backward_tile(
                q, k, v, dout, lse, delta, offs_m, offs_n, b, h, Lq, Lk, offset, scale, softcap, slope,
                bias_base, stride_bias_m, stride_bias_n, window_left, window_right,
                KeyKeep, QIds, KIds, check_mask_mod,
                IS_CAUSAL, HAS_KEY_PADDING, HAS_SOFTCAP, HAS_ALIBI, HAS_BIAS, HAS_LEFT, HAS_RIGHT, HAS_DOCS,
                SCORE_MOD, SCORE_MOD_DERIVATIVE, MASK_MOD, FLOAT32_DOT)
            dv += dot(tl.trans(cast(p, dout.dtype)), dout, FLOAT32_DOT)
            dk += dot(tl.trans(cast(ds, q.dtype)), q, FLOAT32_DOT)
            if HAS_BIAS:
                if BIAS_SUM_ROWS:
                    dbias_row += tl.sum(dz, 0)
                else:
                    tile_ok = (offs_m[:, None] < Lq) & (offs_n[None, :] < Lk)
                    at = dbias_base + offs_m[:, None] * stride_dbias_m + offs_n[None, :] * stride_dbias_n
                    if BIAS_ATOMIC:
                        tl.atomic_add(at, dz, mask=tile_ok)
                    else:
                        tl.store(at, dz, mask=tile_ok)
        if HAS_BIAS:
            if BIAS_SUM_ROWS:
                at = dbias_base + offs_n * stride_dbias_n
                if BIAS_ATOMIC:
                    tl.atomic_add(at, dbias_row, mask=offs_n < Lk)
                else:
                    tl.store(at, dbias_row, mask=offs_n < Lk)

    tl.store(DK + kv_at, cast(dk * scale, DK.dtype.element_ty), mask=key_ok)
    tl.store(DV + kv_at, cast(dv, DV.dtype.element_ty), mask=key_ok)
# endregion


# region: backward_dq
@triton.jit(do_not_specialize=LENGTH_ARGUMENTS)
def backward_dq(
    Q, K, V, DOut, Lse, Delta, DQ,
    H, Hk, Lq, Lk, D, scale, offset,
    KeyKeep, softcap, Slopes,
    Bias, stride_bias_b, stride_bias_h, stride_bias_m, stride_bias_n,
    window_left, window_right,
    QIds, KIds, DocKeyBlocks, DocQueryBlocks,
    KvCount, KvIndices, KvFull, mask_stride_b, mask_stride_h,
    num_q_blocks, num_k_blocks,
    IS_CAUSAL: tl.constexpr, HAS_KEY_PADDING: tl.constexpr, HAS_SOFTCAP: tl.constexpr, HAS_ALIBI: tl.constexpr,
    HAS_BIAS: tl.constexpr, HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr, HAS_DOCS: tl.constexpr,
    SCORE_MOD: tl.constexpr, SCORE_MOD_DERIVATIVE: tl.constexpr, MASK_MOD: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, FLOAT32_DOT: tl.constexpr,
):
    """dQ of one query block: the forward's loop again, with P recomputed and dS k summed in registers. A kernel of
    its own rather than atomic adds from the dK/dV kernel into a float32 dq: it recomputes P once more, but it is
    deterministic, needs no float32 buffer of q's size and no conversion pass, which is what a teaching kernel
    (and FlashAttention-2's paper) picks."""
    pid_m = tl.program_id(0)
    pid_bh = tl.program_id(1)
    b = pid_bh // H
    h = pid_bh % H
    kv_head = b * Hk + h // (H // Hk)
    start_m = pid_m * BLOCK_M
    offs_m = start_m + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    row_ok = (offs_m[:, None] < Lq) & (offs_d[None, :] < D)
    q_at = pid_bh.to(tl.int64) * Lq * D + offs_m[:, None] * D + offs_d[None, :]
    q = tl.load(Q + q_at, mask=row_ok, other=0.0)
    dout = tl.load(DOut + q_at, mask=row_ok, other=0.0)
    lse = tl.load(Lse + pid_bh.to(tl.int64) * Lq + offs_m, mask=offs_m < Lq, other=float("-inf"))
    delta = tl.load(Delta + pid_bh.to(tl.int64) * Lq + offs_m, mask=offs_m < Lq, other=0.0)
    K_head = K + kv_head.to(tl.int64) * Lk * D
    V_head = V + kv_head.to(tl.int64) * Lk * D
    dq = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    slope = 0.0
    if HAS_ALIBI:
        slope = tl.load(Slopes + pid_bh).to(tl.float32)
    bias_base = Bias
    if HAS_BIAS:
        bias_base = Bias + b.to(tl.int64) * stride_bias_b + h.to(tl.int64) * stride_bias_h
    lo, hi = key_block_range(start_m, Lq, Lk, offset, window_left, window_right, IS_CAUSAL, HAS_LEFT, HAS_RIGHT,
                             BLOCK_M, BLOCK_N)
    lo, hi = document_block_range(lo, hi, DocKeyBlocks, b, pid_m, num_q_blocks, HAS_DOCS)
    list_row = (b * mask_stride_b + h * mask_stride_h) * num_q_blocks + pid_m
    t_lo, t_hi = loop_range(lo, hi, KvCount, KvIndices, list_row, num_k_blocks, MASK_MOD)
    for t in range(t_lo, t_hi):
        n_block, check_mask_mod = block_to_visit(t, list_row, KvIndices, KvFull, num_k_blocks, MASK_MOD)
        offs_n = n_block * BLOCK_N + tl.arange(0, BLOCK_N)
        key_ok = (offs_n[:, None] < Lk) & (offs_d[None, :] < D)
        k = tl.load(K_head + offs_n[:, None] * D + offs_d[None, :], mask=key_ok, other=0.0)
        v = tl.load(V_head + offs_n[:, None] * D + offs_d[None, :], mask=key_ok, other=0.0)
        p, dz, ds = backward_tile(
            q, k, v, dout, lse, delta, offs_m, offs_n, b, h, Lq, Lk, offset, scale, softcap, slope,
            bias_base, stride_bias_m, stride_bias_n, window_left, window_right,
            KeyKeep, QIds, KIds, check_mask_mod,
            IS_CAUSAL, HAS_KEY_PADDING, HAS_SOFTCAP, HAS_ALIBI, HAS_BIAS, HAS_LEFT, HAS_RIGHT, HAS_DOCS,
            SCORE_MOD, SCORE_MOD_DERIVATIVE, MASK_MOD, FLOAT32_DOT)
        dq += dot(cast(ds, k.dtype), k, FLOAT32_DOT)
    tl.store(DQ + q_at, cast(dq * scale, DQ.dtype.element_ty), mask=row_ok)
# endregion


# ------------------------------------------------------------------------------------------------ the block mask

# region: block_mask_tiles
@triton.jit
def block_mask_tiles(
    State,  # (B', H', number of query blocks, number of key blocks) int8: 0 empty, 1 partial, 2 full
    H, Lq, Lk, num_q_blocks, num_k_blocks,
    MASK_MOD: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):
    """mask_mod evaluated on every element of one (query block, key block) tile, once per mask: a tile where no
    element is visible is never visited, one where every element (inside the matrix) is visible is visited without
    the elementwise mask, the rest with it."""
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    pid_bh = tl.program_id(2)
    b = pid_bh // H
    h = pid_bh % H
    q_idx = (pid_m * BLOCK_M + tl.arange(0, BLOCK_M))[:, None]
    kv_idx = (pid_n * BLOCK_N + tl.arange(0, BLOCK_N))[None, :]
    inside = (q_idx < Lq) & (kv_idx < Lk)
    visible = checked_mask(MASK_MOD(b, h, q_idx, kv_idx), inside) & inside
    n_visible = tl.sum(tl.sum(visible.to(tl.int32), 1), 0)
    n_inside = tl.sum(tl.sum(inside.to(tl.int32), 1), 0)
    state = tl.where(n_visible == 0, 0, tl.where(n_visible == n_inside, 2, 1))
    tl.store(State + (pid_bh.to(tl.int64) * num_q_blocks + pid_m) * num_k_blocks + pid_n, state.to(tl.int8))
# endregion
