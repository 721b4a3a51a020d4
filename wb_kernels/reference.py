"""The float64 NumPy reference that every stage is checked against (lesson 01; used by 02-08).

Conventions shared by every stage of the package:

- shapes: q (B, H, Lq, D), k and v (B, H, Lk, D); the output is (B, H, Lq, D) and the
  log-sum-exp (LSE) of each row of scaled scores is (B, H, Lq);
- ``scale`` defaults to 1/sqrt(D);
- ``causal=True`` lets query i see keys j <= i (top-left alignment, as
  ``torch.nn.functional.scaled_dot_product_attention(is_causal=True)`` does when Lq != Lk);
- ``key_padding_mask`` is a bool array (B, Lk), True where the key takes part (SDPA's boolean
  ``attn_mask`` convention);
- a query row that sees no key at all gets output 0 and LSE -inf, never NaN;
- NaN and Inf in the inputs propagate as in SDPA's math: a NaN (or an Inf that makes a score NaN
  or +inf) reaches every row that attends the key or query holding it (details and the rule every
  stage follows: :func:`wb_kernels.api.attention`).
"""

from __future__ import annotations

import numpy as np

__all__ = ["reference", "attention_mask", "safe_softmax", "naive_softmax"]


def _as_float64(x) -> np.ndarray:
    if hasattr(x, "detach"):  # a torch tensor, on any device
        x = x.detach().cpu().double().numpy()
    return np.asarray(x, dtype=np.float64)


def attention_mask(Lq: int, Lk: int, causal: bool = False, key_padding_mask=None, batch: int = 1):
    """Boolean mask (B, 1, Lq, Lk): True where query i may attend key j."""
    allowed = np.ones((batch, 1, Lq, Lk), dtype=bool)
    if causal:
        allowed &= np.tril(np.ones((Lq, Lk), dtype=bool))
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


def reference(q, k, v, *, causal: bool = False, key_padding_mask=None, scale: float | None = None):
    """Exact attention in float64. Returns ``(out, lse)`` as float64 NumPy arrays.

    Accepts NumPy arrays or torch tensors (any device and dtype, one for all three): converted to float64
    on the CPU first, so the reference never inherits the rounding of the stage it checks.
    Bad input gets the errors :func:`wb_kernels.attention` gives (:func:`wb_kernels.api.validate_inputs`).
    """
    from .api import validate_inputs  # here, not at the top: api imports this module

    validate_inputs(q, k, v, causal=causal, key_padding_mask=key_padding_mask, scale=scale)
    q, k, v = _as_float64(q), _as_float64(k), _as_float64(v)
    B, H, Lq, D = q.shape
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
