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
from .variants import NO_VARIANTS, Variants, canonical_variants

__all__ = ["reference", "reference_backward", "reference_gradients", "visible_keys", "variant_probabilities", "sum_kv_groups", "attention_mask", "causal_offset", "positive_scale",
           "repeat_kv_heads", "CAUSAL_ALIGNMENTS", "safe_softmax", "naive_softmax"]

def as_numpy(x) -> np.ndarray:
    """A NumPy array of `x` (a torch tensor on any device, or an array), its dtype kept."""
    return x.detach().cpu().numpy() if hasattr(x, "detach") else np.asarray(x)


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


def visible_keys(Lq: int, Lk: int, causal=False, key_padding_mask=None, batch: int = 1,
                 variants: Variants = NO_VARIANTS):
    """:func:`attention_mask` with the masks of `variants` (a sliding window, documents) too: (B, 1, Lq, Lk), True
    where query i sees key j."""
    allowed = attention_mask(Lq, Lk, causal, key_padding_mask, batch=batch)
    return allowed & _variant_mask(Lq, Lk, causal, variants, batch) if variants else allowed


def _variant_mask(Lq: int, Lk: int, causal, variants: Variants, batch: int):
    """The masks a variant adds (window, documents) as a bool array (B, 1, Lq, Lk), True where the key is visible."""
    allowed = np.ones((batch, 1, Lq, Lk), dtype=bool)
    offset = causal_offset(causal, Lq, Lk) or 0
    if variants.window is not None:
        left, right = variants.window
        distance = np.arange(Lk)[None, :] - (np.arange(Lq)[:, None] + offset)  # j - (i + offset)
        if left is not None:
            allowed &= distance >= -left
        if right is not None:
            allowed &= distance <= right
    if variants.document_ids is not None:
        q_ids, k_ids = (as_numpy(ids).astype(np.int64) for ids in variants.document_ids)
        allowed &= (q_ids[:, None, :, None] == k_ids[:, None, None, :])
    return allowed


def _variant_scores(raw, causal, variants: Variants):
    """Scaled scores (B, H, Lq, Lk) with softcap, then ALiBi and the bias tensor applied (no mask yet)."""
    B, H, Lq, Lk = raw.shape
    scores = raw
    if variants.softcap is not None:
        scores = variants.softcap * np.tanh(raw / variants.softcap)
    if variants.alibi_slopes is not None:
        offset = causal_offset(causal, Lq, Lk) or 0
        distance = np.abs(np.arange(Lk)[None, :] - (np.arange(Lq)[:, None] + offset))
        scores = scores - as_float64(variants.alibi_slopes)[:, :, None, None] * distance
    if variants.bias is not None:
        scores = scores + as_float64(variants.bias)
    return scores


def _forward64(q, k, v, *, causal, key_padding_mask, scale, variants: Variants, keep_raw: bool = False):
    """Everything the forward and backward references share, in float64: masked scores, P, out, LSE, and the raw
    scaled scores where `keep_raw` (the softcap's gradient needs them; otherwise freed at once: lesson 01 measures
    the reference's peak memory in L x L arrays)."""
    q, k, v = as_float64(q), as_float64(k), as_float64(v)
    B, H, Lq, D = q.shape
    k, v = repeat_kv_heads(k, H), repeat_kv_heads(v, H)  # GQA: each group of query heads reads one K/V head
    Lk = k.shape[2]
    scale = 1.0 / np.sqrt(D) if scale is None else float(scale)
    with np.errstate(invalid="ignore", over="ignore"):  # NaN/Inf inputs propagate, silently
        raw = scale * np.einsum("bhqd,bhkd->bhqk", q, k)  # (B, H, Lq, Lk): the O(L^2) matrix S
        scores = _variant_scores(raw, causal, variants) if variants else raw
    allowed = visible_keys(Lq, Lk, causal, key_padding_mask, B, variants)
    scores = np.where(allowed, scores, -np.inf)
    if not keep_raw:
        raw = None
    sinks = None if variants.sinks is None else np.broadcast_to(as_float64(variants.sinks)[None, :, None, None],
                                                               (B, H, Lq, 1))
    with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
        logits = scores if sinks is None else np.concatenate([scores, sinks], axis=-1)
        probs = safe_softmax(logits)  # P, also O(L^2); a sink's column carries no value
        row_max = logits.max(axis=-1)
        finite_max = np.where(np.isfinite(row_max), row_max, 0.0)
        lse = finite_max + np.log(np.exp(logits - finite_max[..., None]).sum(axis=-1))
        out = np.einsum("bhqk,bhkd->bhqd", probs[..., :Lk], v)
    return dict(q=q, k=k, v=v, raw=raw, scale=scale, probs=probs, out=out, lse=lse, Lk=Lk)


def variant_probabilities(q, k, *, causal=False, key_padding_mask=None, scale=None,
                          variants: Variants = NO_VARIANTS) -> np.ndarray:
    """P (B, H, Lq, Lk) of a call with canonical `variants`, in float64 (without the sinks' column): what the
    checks' rounding floors weigh each score by (:mod:`wb_kernels.check`)."""
    zeros = np.zeros(k.shape)
    found = _forward64(q, k, zeros, causal=causal, key_padding_mask=key_padding_mask, scale=scale, variants=variants)
    return found["probs"][..., :found["Lk"]]


def reference(q, k, v, *, causal=False, key_padding_mask=None, scale: float | None = None, softcap=None,
              alibi_slopes=None, bias=None, window=None, document_ids=None, sinks=None):
    """Exact attention in float64. Returns ``(out, lse)`` as float64 NumPy arrays.

    Accepts NumPy arrays or torch tensors (any device and dtype, one for all three): converted to float64
    on the CPU first, so the reference never inherits the rounding of the stage it checks.
    Bad input gets the errors :func:`wb_kernels.attention` gives (:func:`wb_kernels.arguments.validate_inputs`).
    The variants (``softcap``, ``alibi_slopes``, ``bias``, ``window``, ``document_ids``, ``sinks``) are
    :mod:`wb_kernels.variants`' (their order and meaning there); with sinks a row's LSE includes its sink.
    """
    validate_inputs(q, k, v, causal=causal, key_padding_mask=key_padding_mask, scale=scale)
    variants = canonical_variants(q, k, softcap=softcap, alibi_slopes=alibi_slopes, bias=bias, window=window,
                                  document_ids=document_ids, sinks=sinks)
    found = _forward64(q, k, v, causal=causal, key_padding_mask=key_padding_mask, scale=scale, variants=variants)
    return found["out"], found["lse"]


def sum_kv_groups(grad, Hk: int):
    """A gradient (B, H, L, D) with respect to repeated K or V heads, summed back to the Hk heads (B, Hk, L, D).

    The transpose of :func:`repeat_kv_heads`: key/value head j was read by query heads j*group .. (j+1)*group - 1,
    so its gradient is the sum of theirs (GQA). NumPy arrays and torch tensors; `grad` itself when Hk = H.
    """
    B, H, L, D = grad.shape
    if H == Hk:
        return grad
    return grad.reshape(B, Hk, H // Hk, L, D).sum(2)


def reference_gradients(q, k, v, dout, *, causal=False, key_padding_mask=None, scale: float | None = None,
                        softcap=None, alibi_slopes=None, bias=None, window=None, document_ids=None, sinks=None) -> dict:
    """The gradients of :func:`reference` in float64, as ``{"q": dq, "k": dk, "v": dv}`` plus ``"bias"`` (summed
    over the bias's broadcast dimensions) and ``"sinks"`` (H,) when the call has them; `dout` = dL/d(out).

    With S = scale * q kᵀ, C = softcap · tanh(S / softcap) (or S), Z = C + ALiBi + bias masked to -inf,
    P = softmax of [Z, sink] row by row and out = P[:, :Lk] v:

        dv = Pᵀ dout                    dP = dout vᵀ
        D_i = sum_d dout_id * out_id    (= sum_j P_ij dP_ij: the softmax's Jacobian, one number per row)
        dZ = P * (dP - D)               dbias = dZ summed to the bias's shape
        dsink_h = -sum_i P_i,sink D_i   (the sink's column has no value: its dP is 0)
        dS = dZ * (1 - tanh²(S / softcap))   (or dZ)
        dq = scale * dS k,   dk = scale * dSᵀ q

    and dk, dv summed over the query heads that share a key/value head (GQA). A row that sees no key has P = 0,
    so it gets zero gradients and gives none.
    """
    validate_inputs(q, k, v, causal=causal, key_padding_mask=key_padding_mask, scale=scale)
    if tuple(dout.shape) != tuple(q.shape):
        raise ValueError(f"dout: expected the output's shape {tuple(q.shape)}, got {tuple(dout.shape)}")
    variants = canonical_variants(q, k, softcap=softcap, alibi_slopes=alibi_slopes, bias=bias, window=window,
                                  document_ids=document_ids, sinks=sinks)
    Hk = k.shape[1]
    f = _forward64(q, k, v, causal=causal, key_padding_mask=key_padding_mask, scale=scale, variants=variants,
                   keep_raw=variants.softcap is not None)
    dout = as_float64(dout)
    Lk = f["Lk"]
    probs = f["probs"][..., :Lk]
    with np.errstate(invalid="ignore", over="ignore"):  # NaN/Inf inputs propagate, silently
        dv = np.einsum("bhqk,bhqd->bhkd", probs, dout)
        dprobs = np.einsum("bhqd,bhkd->bhqk", dout, f["v"])
        row_dot = (dout * f["out"]).sum(-1, keepdims=True)  # D_i
        dz = probs * (dprobs - row_dot)
        grads = {}
        if variants.bias is not None:
            grads["bias"] = _sum_to_shape(dz, tuple(variants.bias.shape))
        if variants.sinks is not None:
            grads["sinks"] = -(f["probs"][..., Lk] * row_dot[..., 0]).sum(axis=(0, 2))
        ds = dz if variants.softcap is None else dz * (1 - np.tanh(f["raw"] / variants.softcap) ** 2)
        dq = f["scale"] * np.einsum("bhqk,bhkd->bhqd", ds, f["k"])
        dk = f["scale"] * np.einsum("bhqk,bhqd->bhkd", ds, f["q"])
    return {"q": dq, "k": sum_kv_groups(dk, Hk), "v": sum_kv_groups(dv, Hk), **grads}


def _sum_to_shape(x: np.ndarray, shape: tuple) -> np.ndarray:
    """`x` summed over the dimensions where `shape` has 1 (the transpose of broadcasting to x's shape)."""
    axes = tuple(i for i, (n, m) in enumerate(zip(shape, x.shape)) if n == 1 and m != 1)
    return x.sum(axis=axes, keepdims=True) if axes else x


def reference_backward(q, k, v, dout, *, causal=False, key_padding_mask=None, scale: float | None = None,
                       **variants):
    """``(dq, dk, dv)`` of :func:`reference_gradients` (the gradients of q, k and v; a variant's own gradient is in
    that function's dict). Accepts what :func:`reference` accepts, and `dout` shaped like q."""
    grads = reference_gradients(q, k, v, dout, causal=causal, key_padding_mask=key_padding_mask, scale=scale,
                                **variants)
    return grads["q"], grads["k"], grads["v"]
