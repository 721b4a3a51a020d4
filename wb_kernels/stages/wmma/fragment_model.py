"""What the tensor-core kernel computes, in NumPy (lesson 05; tests/test_wmma.py holds it to the kernel).

The WMMA kernel (``flash_wmma.cu`` in this folder) rounds at fixed points; this model rounds at the
same points, in the same order, so a learner without a GPU can see the kernel's numerics:

- Q, K, V are stored in fp16 or bf16; tensor cores multiply them exactly and add in fp32, so
  S = Q K^T is an fp32 matrix product of the rounded inputs;
- key tiles of 64 are visited in order; the online softmax keeps the row max m and sum l in fp32
  (base 2: the scale is multiplied by log2(e) and exp2 is used);
- P = 2^(x - m) is computed in fp32, summed in fp32 into l, then **rounded to fp16/bf16** before
  O += P V (the tensor cores take 16-bit inputs), with O accumulated in fp32;
- at the end O / l is rounded to the input dtype; LSE = ln(2) (m + log2 l) stays fp32.

Switches let the lesson show what each choice costs: ``round_p=False`` keeps P in fp32 (what a
kernel with fp32 PV would do), ``accumulate="float16"`` rounds O after every tile (what fp16
accumulators would do), ``round_output=False`` skips the final rounding of O. NumPy has no bfloat16: :func:`round_to` rounds float32 to bf16 by bit
manipulation (round to nearest, ties to even), values stay float32.
"""

from __future__ import annotations

import numpy as np

__all__ = ["round_to", "ulp", "fragment_model", "BLOCK_N"]

BLOCK_N = 64  # keys per tile, as in flash_wmma.cu
LOG2E = np.float32(1.4426950408889634)
LN2 = np.float32(0.6931471805599453)


def round_to(x, dtype: str) -> np.ndarray:
    """`x` rounded to float16, bfloat16 or float32 (round to nearest even), returned as float32."""
    x = np.asarray(x, dtype=np.float32)
    if dtype == "float32":
        return x.copy()
    if dtype == "float16":
        with np.errstate(over="ignore"):
            return x.astype(np.float16).astype(np.float32)
    if dtype == "bfloat16":
        bits = x.view(np.uint32).astype(np.uint64)
        rounded = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
        out = rounded.astype(np.uint32).view(np.float32)
        return np.where(np.isfinite(x), out, x).astype(np.float32)
    raise ValueError(f"dtype={dtype!r}: use 'float16', 'bfloat16' or 'float32'")


def ulp(x, dtype: str) -> np.ndarray:
    """The spacing of `dtype` numbers at |x| (float16 subnormals included)."""
    mantissa_bits, min_exponent = {"float16": (10, -14), "bfloat16": (7, -126), "float32": (23, -126)}[dtype]
    x = np.abs(np.asarray(x, dtype=np.float64))
    exponent = np.floor(np.log2(np.maximum(x, 2.0 ** min_exponent)))
    return 2.0 ** (exponent - mantissa_bits)


def _as_float32(x) -> np.ndarray:
    if hasattr(x, "detach"):  # torch, any device and dtype (bf16 converts to float32 exactly)
        return x.detach().float().cpu().numpy()
    return np.asarray(x, dtype=np.float32)


def fragment_model(q, k, v, *, dtype: str = "float16", causal: bool = False, key_padding_mask=None,
                   scale: float | None = None, round_p: bool = True, accumulate: str = "float32",
                   round_output: bool = True):
    """The kernel's arithmetic in NumPy. Returns ``(out, lse)``, float32 arrays; `out` holds values
    of `dtype` (rounded), `lse` is (B, H, Lq).

    q (B, H, Lq, D), k and v (B, H, Lk, D): NumPy arrays or torch tensors; they are rounded to
    `dtype` first (a no-op when they already are `dtype`). ``round_output=False`` returns O before its
    final rounding to `dtype` (what the kernel holds in fp32 just before it stores O).
    """
    q, k, v = (round_to(_as_float32(x), dtype) for x in (q, k, v))
    B, H, Lq, D = q.shape
    Lk = k.shape[2]
    scale_log2 = np.float32((D ** -0.5 if scale is None else scale)) * LOG2E
    keep = np.ones((B, Lk), dtype=bool)
    if key_padding_mask is not None:
        mask = key_padding_mask.cpu().numpy() if hasattr(key_padding_mask, "cpu") else key_padding_mask
        keep = np.asarray(mask, dtype=bool)
    query_index = np.arange(Lq)[:, None]

    m = np.full((B, H, Lq, 1), -np.inf, dtype=np.float32)
    l = np.zeros((B, H, Lq, 1), dtype=np.float32)
    o = np.zeros((B, H, Lq, D), dtype=np.float32)
    for key0 in range(0, Lk, BLOCK_N):
        keys = slice(key0, min(key0 + BLOCK_N, Lk))
        s = np.matmul(q, np.swapaxes(k[:, :, keys], -1, -2))  # fp32 accumulation of exact products
        bias = np.where(keep[:, keys], np.float32(0), np.float32(-np.inf))[:, None, None, :]
        with np.errstate(invalid="ignore"):
            x = (s * scale_log2 + bias).astype(np.float32)
        if causal:
            x = np.where(key0 + np.arange(x.shape[-1])[None, :] > query_index, np.float32(-np.inf), x)
        m_new = np.maximum(m, x.max(axis=-1, keepdims=True))
        m_use = np.where(m_new == -np.inf, np.float32(0), m_new)  # no inf - inf for rows without keys yet
        alpha = np.exp2(m - m_use).astype(np.float32)
        p = np.exp2(x - m_use).astype(np.float32)
        l = (l * alpha + p.sum(axis=-1, keepdims=True, dtype=np.float32)).astype(np.float32)
        p_mma = round_to(p, dtype) if round_p else p
        o = (o * alpha + np.matmul(p_mma, v[:, :, keys])).astype(np.float32)
        if accumulate != "float32":
            o = round_to(o, accumulate)
        m = m_new
    has_keys = l > 0
    inv_l = np.divide(np.float32(1), l, out=np.zeros_like(l), where=has_keys)
    out = round_to(o * inv_l, dtype) if round_output else (o * inv_l).astype(np.float32)
    with np.errstate(divide="ignore"):
        lse = np.where(has_keys, (m + np.log2(np.where(has_keys, l, 1))) * LN2, -np.inf)[..., 0].astype(np.float32)
    return out, lse
