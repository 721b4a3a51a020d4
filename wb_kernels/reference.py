"""The float64 NumPy reference that every stage is checked against (lesson 01; used by 02-09).

Conventions shared by every stage of the package:

- shapes: q (B, H, Lq, D), k and v (B, Hk, Lk, D) with Hk dividing H; the output is (B, H, Lq, D) and
  the log-sum-exp (LSE) of each row of scaled scores is (B, H, Lq);
- grouped-query attention (GQA; MQA when Hk = 1): query head h uses key/value head h // (H // Hk), as
  SDPA's ``enable_gqa=True`` (:func:`repeat_kv_heads`);
- ``scale`` defaults to 1/sqrt(D);
- ``causal`` lets query i see keys j <= i + offset (:func:`causal_offset`): ``True`` or ``"top_left"``
  (offset 0, as ``torch.nn.functional.scaled_dot_product_attention(is_causal=True)`` when Lq != Lk), or
  ``"bottom_right"`` (offset Lk - Lq, flash-attn's alignment, for decoding with a KV cache);
- ``key_padding_mask`` is a bool array (B, Lk), True where the key takes part (SDPA's boolean
  ``attn_mask`` convention);
- a query row that sees no key at all gets output 0 and LSE -inf, never NaN;
- NaN and Inf in the inputs propagate as in SDPA's math: a NaN (or an Inf that makes a score NaN
  or +inf) reaches every row that attends the key or query holding it (details and the rule every
  stage follows: :func:`wb_kernels.api.attention`).
"""

from __future__ import annotations

import numpy as np

from .arguments import CAUSAL_ALIGNMENTS, validate_inputs

__all__ = ["reference", "reference_backward", "sum_kv_groups", "attention_mask", "causal_offset", "positive_scale",
           "repeat_kv_heads", "CAUSAL_ALIGNMENTS", "safe_softmax", "naive_softmax"]

def as_float64(x) -> np.ndarray:
    if hasattr(x, "detach"):  # a torch tensor, on any device
        x = x.detach().cpu().double().numpy()
    return np.asarray(x, dtype=np.float64)


def causal_offset(causal, Lq: int, Lk: int):
    """The causal mask as one integer: query i sees keys j <= i + offset; None when `causal` is off.

    ``True`` or ``"top_left"``: offset 0 (SDPA's ``is_causal``). ``"bottom_right"``: offset Lk - Lq, so that
    the last query sees the last key, as a new query does when it is appended after Lk - Lq cached keys
    (flash-attn's alignment). The offset is negative when Lq > Lk: then the first Lq - Lk rows see no key.
    Every stage masks with this number, so the two alignments are one code path.
    """
    if isinstance(causal, str):
        if causal not in CAUSAL_ALIGNMENTS:
            raise ValueError(f"causal: expected True, False or one of {', '.join(map(repr, CAUSAL_ALIGNMENTS))} "
                             f"(True = 'top_left'), got {causal!r}")
        return Lk - Lq if causal == "bottom_right" else 0
    return 0 if causal else None


def positive_scale(q, scale):
    """``(q', scale')`` with ``scale' > 0`` and ``scale' * (q' . k) = scale * (q . k)`` for every key, for kernels that
    need a positive scale (the tensor-core rungs ``mma`` and ``hopper``); `scale` None is 1/sqrt(D).

    Such a kernel tracks each row's maximum of the raw scores q . k and scales afterwards, which gives the maximum of
    the scaled scores only for a positive scale. A negative one: scale * (q . k) = |scale| * (-q . k), and negating
    a 16-bit number is exact. Zero: a masked score is -inf before it is scaled, and -inf * 0 is NaN, so
    0 * (q . k) = 1 * (q * 0 . k) instead; q * 0 rather than zeros, so that a NaN or an Inf in q stays a NaN there
    (0 * Inf = NaN) and the row becomes NaN, as 0 * (q . k) is NaN in the reference. NumPy arrays and torch tensors.
    """
    scale = float(q.shape[-1]) ** -0.5 if scale is None else float(scale)
    if scale < 0:
        return -q, -scale
    if scale == 0:
        return q * 0, 1.0
    return q, scale


def repeat_kv_heads(x, H: int):
    """K or V (B, Hk, L, D) as (B, H, L, D): head h is head h // (H // Hk) of `x` (GQA as a copy).

    What the reference and the checks do; the kernels read key/value head h // (H // Hk) in place instead.
    NumPy arrays and torch tensors; `x` itself when Hk = H.
    """
    group = H // x.shape[1]
    if group == 1:
        return x
    if hasattr(x, "repeat_interleave"):  # a torch tensor
        return x.repeat_interleave(group, dim=1)
    return np.repeat(x, group, axis=1)


def attention_mask(Lq: int, Lk: int, causal=False, key_padding_mask=None, batch: int = 1):
    """Boolean mask (B, 1, Lq, Lk): True where query i may attend key j (causal: j <= i + :func:`causal_offset`)."""
    allowed = np.ones((batch, 1, Lq, Lk), dtype=bool)
    offset = causal_offset(causal, Lq, Lk)
    if offset is not None:
        allowed &= np.tri(Lq, Lk, k=offset, dtype=bool)
    if key_padding_mask is not None:
        keep = np.asarray(key_padding_mask.cpu() if hasattr(key_padding_mask, "cpu") else key_padding_mask, dtype=bool)
        allowed = allowed & keep[:, None, None, :]
    return allowed


def naive_softmax(scores: np.ndarray, axis: int = -1) -> np.ndarray:
    """exp(s) / sum(exp(s)): overflows to inf/inf = NaN once a logit passes ~709 (float64)."""
    e = np.exp(scores)
    return e / e.sum(axis=axis, keepdims=True)


def safe_softmax(scores: np.ndarray, axis: int = -1) -> np.ndarray:
    """Softmax with the row maximum subtracted first: exp never sees a positive argument.

    Rows that are all -inf (fully masked) give zeros instead of NaN. A NaN or +inf score still
    makes its row NaN, as in torch's softmax (non-finite inputs must not turn into plausible numbers).
    """
    with np.errstate(invalid="ignore", over="ignore"):  # NaN/Inf rows: their NaN is the answer
        row_max = scores.max(axis=axis, keepdims=True)
        row_max = np.where(np.isfinite(row_max), row_max, 0.0)
        e = np.exp(scores - row_max)
        total = e.sum(axis=axis, keepdims=True)
        # total is 0 only for an all -inf row; NaN != 0, so a NaN row divides and stays NaN
        return np.divide(e, total, out=np.zeros_like(e), where=total != 0)


def reference(q, k, v, *, causal=False, key_padding_mask=None, scale: float | None = None):
    """Exact attention in float64. Returns ``(out, lse)`` as float64 NumPy arrays.

    Accepts NumPy arrays or torch tensors (any device and dtype, one for all three): converted to float64
    on the CPU first, so the reference never inherits the rounding of the stage it checks.
    Bad input gets the errors :func:`wb_kernels.attention` gives (:func:`wb_kernels.arguments.validate_inputs`).
    """
    validate_inputs(q, k, v, causal=causal, key_padding_mask=key_padding_mask, scale=scale)
    q, k, v = as_float64(q), as_float64(k), as_float64(v)
    B, H, Lq, D = q.shape
    k, v = repeat_kv_heads(k, H), repeat_kv_heads(v, H)  # GQA: each group of query heads reads one K/V head
    Lk = k.shape[2]
    if scale is None:
        scale = 1.0 / np.sqrt(D)
    with np.errstate(invalid="ignore", over="ignore"):  # NaN/Inf inputs propagate, silently
        scores = scale * np.einsum("bhqd,bhkd->bhqk", q, k)  # (B, H, Lq, Lk): the O(L^2) matrix S
    allowed = attention_mask(Lq, Lk, causal, key_padding_mask, batch=B)
    scores = np.where(allowed, scores, -np.inf)
    probs = safe_softmax(scores)  # P, also O(L^2)
    with np.errstate(invalid="ignore", over="ignore"):
        out = np.einsum("bhqk,bhkd->bhqd", probs, v)
    with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
        row_max = scores.max(axis=-1)
        finite_max = np.where(np.isfinite(row_max), row_max, 0.0)
        lse = finite_max + np.log(np.exp(scores - finite_max[..., None]).sum(axis=-1))
    return out, lse


def sum_kv_groups(grad, Hk: int):
    """A gradient (B, H, L, D) with respect to repeated K or V heads, summed back to the Hk heads (B, Hk, L, D).

    The transpose of :func:`repeat_kv_heads`: key/value head j was read by query heads j*group .. (j+1)*group - 1,
    so its gradient is the sum of theirs (GQA). NumPy arrays and torch tensors; `grad` itself when Hk = H.
    """
    B, H, L, D = grad.shape
    if H == Hk:
        return grad
    return grad.reshape(B, Hk, H // Hk, L, D).sum(2)


def reference_backward(q, k, v, dout, *, causal=False, key_padding_mask=None, scale: float | None = None):
    """The gradients of :func:`reference` in float64: ``(dq, dk, dv)`` for the loss gradient `dout` = dL/d(out).

    With S = scale * q kᵀ (masked to -inf), P = softmax(S) row by row and out = P v:

        dv = Pᵀ dout                    dP = dout vᵀ
        D_i = sum_d dout_id * out_id    (= sum_j P_ij dP_ij: the softmax's Jacobian, one number per row)
        dS = P * (dP - D)               dq = scale * dS k,   dk = scale * dSᵀ q

    and dk, dv summed over the query heads that share a key/value head (GQA). A row that sees no key has P = 0,
    so it gets zero gradients and gives none. Accepts what :func:`reference` accepts, and `dout` shaped like q.
    """
    validate_inputs(q, k, v, causal=causal, key_padding_mask=key_padding_mask, scale=scale)
    if tuple(dout.shape) != tuple(q.shape):
        raise ValueError(f"dout: expected the output's shape {tuple(q.shape)}, got {tuple(dout.shape)}")
    q, k, v, dout = (as_float64(x) for x in (q, k, v, dout))
    B, H, Lq, D = q.shape
    Hk, Lk = k.shape[1], k.shape[2]
    k, v = repeat_kv_heads(k, H), repeat_kv_heads(v, H)
    scale = 1.0 / np.sqrt(D) if scale is None else float(scale)
    with np.errstate(invalid="ignore", over="ignore"):  # NaN/Inf inputs propagate, silently
        scores = scale * np.einsum("bhqd,bhkd->bhqk", q, k)
        scores = np.where(attention_mask(Lq, Lk, causal, key_padding_mask, batch=B), scores, -np.inf)
        probs = safe_softmax(scores)  # P (B, H, Lq, Lk), recomputed: the forward need not keep it
        out = np.einsum("bhqk,bhkd->bhqd", probs, v)
        dv = np.einsum("bhqk,bhqd->bhkd", probs, dout)
        dprobs = np.einsum("bhqd,bhkd->bhqk", dout, v)
        row_dot = (dout * out).sum(-1, keepdims=True)  # D_i
        dscores = probs * (dprobs - row_dot)
        dq = scale * np.einsum("bhqk,bhkd->bhqd", dscores, k)
        dk = scale * np.einsum("bhqk,bhqd->bhkd", dscores, q)
    return dq, sum_kv_groups(dk, Hk), sum_kv_groups(dv, Hk)

