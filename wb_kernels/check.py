"""Check a stage's result against the float64 reference (every lesson 01-09, the tests, the bench).

The tolerance rule is the one the flash-attn test suite uses: a kernel in some precision may be
wrong by at most ``multiplier`` (2) times the error that PyTorch's own attention (SDPA) makes in
that same precision, plus a floor: twice the rounding error of merely storing the reference in that
precision (flash-attn's ``(ref + 0.3 - 0.3) - ref``). So the bar moves with the precision and
the shape, and a kernel is held to "as good as PyTorch", not to a hand-picked number.

PyTorch's error is itself a measurement, and on a small problem it can be lucky. With one query row, say,
it is the largest of D numbers, and SDPA may round that row's few scores well by chance, while another
correct summation order (a GPU kernel accumulating with fused multiply-adds, one term after another) rounds
them differently. Twice "by luck" is no bar. So PyTorch's error counts as at least what rounding each score
once costs, to first order, at the probabilistic rounding bound of a D-term dot product accumulated in
float32 (Higham and Mary), ``eps_ij = u sqrt(D) |scale| sqrt(sum_d q_id^2 k_jd^2)``:

- for the log-sum-exp, ``eps_ij`` itself at the largest score a row attends to (:func:`dot_product_floor`);
- for the output, ``sqrt(sum_j (p_ij eps_ij (v_jd - o_id))^2)`` at its largest (:func:`output_floor`), the
  typical change of ``o_id`` when every score of its row moves by its ``eps_ij`` with a random sign.

What the output floor costs, measured on an H100 (``scripts/error_vs_pytorch.py``, saved in
``results/accuracy/``): on fp32 problems of real size (L 256-1024) it is 0.3-0.85x the error of PyTorch's own
chain-summing paths (SDPA's MATH backend, eager ``softmax(q k^T) v``), so the bar is never looser than the
flash-attn suite's rule, which compares with eager PyTorch. Against SDPA's default path it is 0.55-0.75x with
ordinary logits, where the bar stays SDPA's, and 1.1-1.9x at a peaked softmax, where SDPA's blocked sums beat
any chain by about 2x and the floor makes the bar "2x a chain-summing float32 attention" instead. On single
query rows it can exceed SDPA's error (1.2x on the H100, up to 24x with PyTorch on a CPU): there PyTorch was
lucky. The LSE floor is 1.3-2x PyTorch's LSE error.

``check`` prints one fixed-format line and raises ``CheckFailed`` (an AssertionError) when the
rule is broken, so a failing check fails a notebook under nbval as well as a pytest test.

``check_gradients`` grades a backward pass by the same rule: each of dq, dk and dv may be wrong by at most twice
PyTorch's own error (autograd through SDPA in the inputs' dtype, on their device) against the float64
``reference_backward``, plus the storage floor, and PyTorch's error counts as at least the probabilistic
rounding bound of the longest float32 sum a backward makes (:func:`gradient_floor`), and as at least what
recomputing P from the LSE costs (:func:`recomputation_floor`): a FlashAttention backward rounds each score
again, and its dS = P (dP - D) subtracts two float32 dot products that cancel exactly in a degenerate problem (one
key: dq is 0). SDPA's backward, which keeps its own P, can then be exact by luck: on the H100 the property tests
found the mma backward 1.4e-7 from a zero dq where SDPA's error gave a bar of 1.1e-7 (bf16, Lq = Lk = 1), and the
flash backward 3.1e-5 from dv = dout where the bar was 6.8e-6 (float32, scores near 200). On problems of ordinary
size (L 133-197) this floor is 0.1x PyTorch's error in fp16 and bf16, where the bar stays PyTorch's, and 2-3x it in
float32 on the CPU, where the bar becomes "2x a backward that recomputes P in float32".
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .inputs import DTYPES
from .reference import (reference, reference_gradients, repeat_kv_heads, safe_softmax, variant_probabilities,
                        visible_keys)
from .variants import NO_VARIANTS, Variants, canonical_variants, fields_of
from .arguments import dtype_name, require_array, validate_inputs

__all__ = ["CheckFailed", "CheckResult", "GradientCheckResult", "check", "check_gradients", "torch_error",
           "torch_gradient_error", "storage_floor", "dot_product_floor", "output_floor", "gradient_floor",
           "recomputation_floor"]


class CheckFailed(AssertionError):
    """A stage's output broke the tolerance rule (or held NaN/Inf where the reference has none)."""


@dataclass(frozen=True)
class CheckResult:
    name: str
    max_err: float
    tol: float
    lse_err: float | None = None
    lse_tol: float | None = None

    @property
    def passed(self) -> bool:
        ok = self.max_err <= self.tol
        if self.lse_err is not None:
            ok = ok and self.lse_err <= self.lse_tol
        return bool(ok)

    def line(self) -> str:
        def part(err, tol):
            return f"max |err| {err:.1e} {'≤' if err <= tol else '>'} tol {tol:.1e}"

        text = f"{self.name}: {part(self.max_err, self.tol)}"
        if self.lse_err is not None:
            text += f", lse {part(self.lse_err, self.lse_tol)}"
        return f"{text} {'✓' if self.passed else '✗'}"


def _to_numpy64(x) -> np.ndarray:
    if hasattr(x, "detach"):
        return x.detach().cpu().double().numpy()
    return np.asarray(x, dtype=np.float64)


def _max_abs_err(a: np.ndarray, ref: np.ndarray, rows_valid: np.ndarray | None = None) -> float:
    """max |a - ref| where NaN/Inf in `a` (and not in ref) count as infinite error."""
    with np.errstate(invalid="ignore"):  # inf - inf: handled just below
        diff = np.abs(a - ref)
    bad = ~np.isfinite(a) & np.isfinite(ref)
    diff = np.where(bad, np.inf, diff)
    both_inf = ~np.isfinite(a) & ~np.isfinite(ref) & (a == ref)  # e.g. LSE -inf for empty rows
    diff = np.where(both_inf, 0.0, diff)
    if rows_valid is not None:
        diff = diff[rows_valid]
    return float(np.max(diff)) if diff.size else 0.0


def storage_floor(ref: np.ndarray, dtype: str) -> float:
    """2x the rounding error of storing `ref` in `dtype` (flash-attn's ``ref + 0.3 - 0.3``)."""
    import torch

    r = torch.from_numpy(np.where(np.isfinite(ref), ref, 0.0))
    stored = (r.to(getattr(torch, dtype)) + 0.3 - 0.3).double()
    return 2.0 * float((stored - r).abs().max()) if r.numel() else 0.0


def _finite64(x, device):
    """float64 torch copy on `device` with NaN/Inf set to 0: a non-finite input must not open the bar."""
    import torch

    x = x.detach() if hasattr(x, "detach") else torch.from_numpy(np.asarray(x, dtype=np.float64))
    x = x.to(device=device, dtype=torch.float64)
    return torch.where(torch.isfinite(x), x, torch.zeros((), dtype=x.dtype, device=device))


def _floor_device(x) -> str:
    """Where the floors are computed: on the GPU for CUDA tensors (float64 matmuls of L x L, as the bench's
    reference does), on the CPU otherwise."""
    return str(x.device) if hasattr(x, "device") and getattr(x.device, "type", "cpu") == "cuda" else "cpu"


def _score_rounding_chunks(q, k, *, dtype, causal, key_padding_mask, scale, rows_per_chunk=None,
                           variants: Variants = NO_VARIANTS):
    """Yield ``(rows, eps, allowed)`` over chunks of query rows (float64 torch tensors q, k): ``eps[b, h, i, j]``
    is the probabilistic rounding bound of the scaled score ``scale * q_i . k_j`` accumulated in float32
    (float64 for float64 inputs), ``u sqrt(D) |scale| sqrt(sum_d q_id^2 k_jd^2)`` (Higham and Mary), and
    `allowed` says which pairs the masks keep. Chunked so that a long sequence never needs several L x L
    float64 arrays at once."""
    import torch

    B, H, Lq, D = q.shape
    Lk = k.shape[2]
    k = repeat_kv_heads(k, H)  # GQA: the key each query head really meets
    scale = D ** -0.5 if scale is None else scale
    unit_roundoff = 2.0 ** -53 if dtype == "float64" else 2.0 ** -24  # the stages accumulate in float32
    allowed_all = torch.from_numpy(visible_keys(Lq, Lk, causal, key_padding_mask, B, variants)).to(q.device)
    k_squared_t = (k * k).transpose(-1, -2)
    rows_per_chunk = rows_per_chunk or max(1, 2 ** 22 // max(1, B * H * Lk))
    for start in range(0, Lq, rows_per_chunk):
        rows = slice(start, min(Lq, start + rows_per_chunk))
        squares = q[:, :, rows] ** 2 @ k_squared_t  # sum_d q_id^2 k_jd^2
        eps = unit_roundoff * np.sqrt(D) * abs(scale) * squares.sqrt()
        yield rows, eps, allowed_all[:, :, rows].expand_as(eps)


def dot_product_floor(q, k, *, dtype: str, causal=False, key_padding_mask=None, scale=None,
                      variants: Variants = NO_VARIANTS) -> float:
    """The rounding bound of one scaled score at the largest score magnitude a row attends to: the least
    PyTorch's LSE error counts as (module docstring)."""
    device = _floor_device(q)
    q64, k64 = _finite64(q, device), _finite64(k, device)
    if q64.shape[2] == 0 or k64.shape[2] == 0:
        return 0.0
    largest = 0.0
    for _, eps, allowed in _score_rounding_chunks(q64, k64, dtype=dtype, causal=causal,
                                                  key_padding_mask=key_padding_mask, scale=scale, variants=variants):
        largest = max(largest, float((eps * allowed).max()))
    return largest


def output_floor(q, k, v, out_ref, lse_ref, *, dtype: str, causal=False, key_padding_mask=None,
                 scale=None, rows_per_chunk=None, variants: Variants = NO_VARIANTS) -> float:
    """What rounding each score once costs the output, to first order: the least PyTorch's output error
    counts as (module docstring).

    A score error ``delta_ij`` moves output ``o_id`` by ``sum_j p_ij delta_ij (v_jd - o_id)``. With the
    ``delta_ij`` independent and of the size ``eps_ij`` of one float32 dot product's rounding, its typical
    size is ``sqrt(sum_j (p_ij eps_ij (v_jd - o_id))^2)``; the floor is the largest over rows and columns.
    P comes from the reference (``exp(s_ij - lse_i)``), so the floor needs no kernel's output. With `variants`, P is
    the reference's with them (a softcap only shrinks a score's rounding: eps_ij stays a bound)."""
    import torch

    device = _floor_device(q)
    q64, k64, v64 = (_finite64(x, device) for x in (q, k, v))
    out64 = _finite64(out_ref, device)
    lse64 = _finite64(lse_ref, device)
    seen = torch.from_numpy(np.isfinite(np.asarray(lse_ref))).to(device)  # a row that sees no key: P = 0
    B, H, Lq, D = q64.shape
    if Lq == 0 or k64.shape[2] == 0:
        return 0.0
    k64, v64 = repeat_kv_heads(k64, H), repeat_kv_heads(v64, H)
    scale_value = D ** -0.5 if scale is None else scale
    k_t, v_squared = k64.transpose(-1, -2), v64 * v64
    largest = 0.0
    variant_p = None
    if variants:
        variant_p = torch.from_numpy(variant_probabilities(q, k, causal=causal, key_padding_mask=key_padding_mask,
                                                           scale=scale, variants=variants)).to(device)
    for rows, eps, allowed in _score_rounding_chunks(q64, k64, dtype=dtype, causal=causal,
                                                     key_padding_mask=key_padding_mask, scale=scale,
                                                     rows_per_chunk=rows_per_chunk, variants=variants):
        if variant_p is None:
            scores = scale_value * (q64[:, :, rows] @ k_t)
            probs = torch.exp((scores - lse64[:, :, rows, None]).clamp(max=0.0))
        else:
            probs = torch.nan_to_num(variant_p[:, :, rows], nan=0.0)
        probs = probs * (allowed & seen[:, :, rows, None])
        weight = (probs * eps) ** 2
        o = out64[:, :, rows]
        # sum_j w_ij (v_jd - o_id)^2, expanded so that no (rows, Lk, D) array is formed
        variance = weight @ v_squared - 2.0 * o * (weight @ v64) + o * o * weight.sum(-1, keepdim=True)
        largest = max(largest, float(variance.clamp(min=0.0).sqrt().max()))
    return largest


def torch_ops_attention(q, k, v, *, causal=None, key_padding_mask=None, scale=None, variants=NO_VARIANTS):
    """Attention with `variants` (canonical) written in PyTorch ops, in q's dtype on q's device: ``(out, lse)``.

    What PyTorch's own error is measured with for a call that uses variants SDPA lacks (a softcap, sinks, a window
    beside a bias): scores ``q kᵀ`` in the inputs' dtype, then the variants in :mod:`wb_kernels.variants`' order in that
    dtype, masks, ``torch.softmax`` (and ``logsumexp`` in float32 for the LSE); differentiable (the gradient checks
    run autograd through it). Every tensor argument must be a torch tensor on q's device.
    """
    import torch

    B, H, Lq, D = q.shape
    Lk = k.shape[2]
    kk, vv = repeat_kv_heads(k, H), repeat_kv_heads(v, H)
    s = (q @ kk.transpose(-1, -2)) * (D ** -0.5 if scale is None else scale)
    if variants.softcap is not None:
        s = variants.softcap * torch.tanh(s / variants.softcap)
    offset = Lk - Lq if causal == "bottom_right" else 0
    distance = (torch.arange(Lk, device=q.device)[None] - torch.arange(Lq, device=q.device)[:, None] - offset)
    if variants.alibi_slopes is not None:
        s = s - variants.alibi_slopes.to(s.dtype)[:, :, None, None] * distance.abs().to(s.dtype)
    if variants.bias is not None:
        s = s + variants.bias.to(s.dtype)
    visible = torch.from_numpy(visible_keys(Lq, Lk, causal, key_padding_mask, B, variants)).to(q.device)
    s = s.masked_fill(~visible, float("-inf"))
    if variants.sinks is not None:
        s = torch.cat([s, variants.sinks.to(s.dtype)[None, :, None, None].expand(B, H, Lq, 1)], -1)
    lse = torch.logsumexp(s.float(), -1)
    seen = visible.any(-1, keepdim=True) if variants.sinks is None else torch.ones_like(visible[..., :1])
    # a row that sees no key: zeros (and no NaN from a softmax of -inf alone, in the values or the gradients)
    p = torch.softmax(s.masked_fill(~seen, 0.0), -1).masked_fill(~seen, 0.0)[..., :Lk]
    return p @ vv, lse


def _variants_as(variants: Variants, device: str, dtype: str, grad: bool = False) -> Variants:
    """`variants` with its float tensors in `dtype` on `device` (leaves that require grad where `grad`), ids on
    `device`: what :func:`torch_ops_attention` computes PyTorch's error with."""
    import torch

    def moved(x, float_dtype=True, leaf=False):
        if x is None:
            return None
        x = x.detach() if hasattr(x, "detach") else torch.from_numpy(np.ascontiguousarray(x))
        x = x.to(device=device, dtype=getattr(torch, dtype)) if float_dtype else x.to(device)
        return x.clone().requires_grad_(True) if leaf else x

    documents = variants.document_ids
    return Variants(softcap=variants.softcap, alibi_slopes=moved(variants.alibi_slopes),
                    bias=moved(variants.bias, leaf=grad), window=variants.window,
                    document_ids=None if documents is None else tuple(moved(x, False) for x in documents),
                    sinks=moved(variants.sinks, leaf=grad))


def torch_error(q, k, v, out_ref, lse_ref, *, dtype: str, device: str, causal=False,
                key_padding_mask=None, scale=None, variants: Variants = NO_VARIANTS):
    """PyTorch's own error against the reference when it computes in `dtype` on `device`.

    "PyTorch's implementation" is ``scaled_dot_product_attention`` with the backend PyTorch picks for
    these inputs, the attention users actually call. (flash-attn's tests use eager ``softmax(q k^T) v``
    in `dtype` instead; where that happens to be exact, e.g. with a single key, the bar drops to the
    floor alone.)
    Returns (max |SDPA - ref| over rows that see a key, max |logsumexp - lse_ref|).
    """
    import torch
    import torch.nn.functional as F

    def as_torch(x):
        if not hasattr(x, "detach"):
            x = torch.from_numpy(np.asarray(x, dtype=np.float64))
        return x.detach().to(device=device, dtype=getattr(torch, dtype))

    tq, tk, tv = as_torch(q), as_torch(k), as_torch(v)
    if variants:  # variants SDPA lacks: the same variants in PyTorch ops, in `dtype`
        rows_valid = np.isfinite(np.asarray(lse_ref)) & (np.asarray(variant_probabilities(
            q, k, causal=causal, key_padding_mask=key_padding_mask, scale=scale, variants=variants)).sum(-1) > 0)
        with torch.no_grad():
            out, lse = torch_ops_attention(tq, tk, tv, causal=causal, key_padding_mask=key_padding_mask, scale=scale,
                                           variants=_variants_as(variants, device, dtype))
        if dtype in ("float16", "bfloat16"):
            lse = lse.to(getattr(torch, dtype))
        return (_max_abs_err(_to_numpy64(out), out_ref, rows_valid), _max_abs_err(_to_numpy64(lse), lse_ref))
    B, H, Lq, D = tq.shape
    tk, tv = repeat_kv_heads(tk, H), repeat_kv_heads(tv, H)  # GQA as SDPA's enable_gqa: a copy, exact
    Lk = tk.shape[2]
    allowed = visible_keys(Lq, Lk, causal, key_padding_mask, B)
    rows_valid = np.broadcast_to(allowed.any(-1), (B, H, Lq))
    mask = torch.from_numpy(allowed).to(device)
    with torch.no_grad():
        out = F.scaled_dot_product_attention(tq, tk, tv, attn_mask=mask, scale=scale)
        s = (tq @ tk.transpose(-1, -2)) * (scale if scale is not None else D ** -0.5)
        s = s.masked_fill(~mask, float("-inf"))
        lse = torch.logsumexp(s.float() if dtype in ("float16", "bfloat16") else s, dim=-1)
        if dtype in ("float16", "bfloat16"):
            lse = lse.to(getattr(torch, dtype))  # the rounding a kernel storing LSE in dtype would see
    out_err = _max_abs_err(_to_numpy64(out), out_ref, rows_valid)
    lse_err = _max_abs_err(_to_numpy64(lse), lse_ref, rows_valid)
    return out_err, lse_err


def check(name: str, out, q, k, v, *, lse=None, causal=False, key_padding_mask=None,
          scale: float | None = None, ref=None, multiplier: float = 2.0, verbose: bool = True,
          raise_on_failure: bool = True, **variants) -> CheckResult:
    """Compare `out` (and optionally `lse`) with the float64 reference; print one line; raise on failure.

    `ref` may hold a precomputed ``(out, lse)`` from :func:`reference` for these inputs.
    PyTorch's error is measured in `out`'s dtype, on `out`'s device (CPU for NumPy arrays).

    Bad q, k, v or options raise the errors :func:`wb_kernels.attention` raises. An `out` or `lse` that is not
    a NumPy array or torch tensor of a dtype in ``wb_kernels.inputs.DTYPES`` raises a TypeError; one of the
    wrong shape fails the check (CheckFailed, whatever `raise_on_failure` says).

    `variants` are :func:`wb_kernels.attention`'s (``softcap``, ``alibi_slopes``, ``bias``, ``window``,
    ``document_ids``, ``sinks``): the reference computes them, and PyTorch's error is that of the same variants
    written in PyTorch ops in the same precision (:func:`torch_ops_attention`), as SDPA lacks most of them.
    """
    inputs = validate_inputs(q, k, v, causal=causal, key_padding_mask=key_padding_mask, scale=scale)
    variants = canonical_variants(q, k, **variants)
    require_array("out", out, DTYPES)
    if lse is not None:
        require_array("lse", lse, DTYPES)
    for what, given, expected in (("output", out, (inputs.B, inputs.H, inputs.Lq, inputs.D)),
                                  ("lse", lse, (inputs.B, inputs.H, inputs.Lq))):
        if given is not None and tuple(given.shape) != expected:
            raise CheckFailed(f"{name}: {what} shape {tuple(given.shape)} != reference shape {expected}")
    out_ref, lse_ref = ref if ref is not None else reference(
        q, k, v, causal=causal, key_padding_mask=key_padding_mask, scale=scale, **fields_of(variants))
    dtype = dtype_name(out)
    device = str(out.device) if hasattr(out, "device") and not isinstance(out, np.ndarray) else "cpu"
    pt_err, pt_lse_err = torch_error(q, k, v, out_ref, lse_ref, dtype=dtype, device=device,
                                     causal=causal, key_padding_mask=key_padding_mask, scale=scale, variants=variants)
    err = _max_abs_err(_to_numpy64(out), out_ref)
    pt_err = max(pt_err, output_floor(q, k, v, out_ref, lse_ref, dtype=dtype, causal=causal,
                                      key_padding_mask=key_padding_mask, scale=scale, variants=variants))
    tol = multiplier * pt_err + storage_floor(out_ref, dtype)
    lse_err = lse_tol = None
    if lse is not None:
        lse_dtype = dtype_name(lse)
        lse_err = _max_abs_err(_to_numpy64(lse), lse_ref)
        pt_lse_err = max(pt_lse_err, dot_product_floor(q, k, dtype=dtype, causal=causal,
                                                       key_padding_mask=key_padding_mask, scale=scale,
                                                       variants=variants))
        lse_tol = multiplier * pt_lse_err + storage_floor(lse_ref, lse_dtype)
    result = CheckResult(name, err, tol, lse_err, lse_tol)
    if verbose:
        print(result.line())
    if raise_on_failure and not result.passed:
        raise CheckFailed(result.line())
    return result


@dataclass(frozen=True)
class GradientCheckResult:
    """The errors of (dq, dk, dv) against the float64 reference's gradients, and their tolerances."""

    name: str
    errors: tuple  # max |err| of dq, dk, dv (and the bias's, the sinks' gradients where a call has them)
    tols: tuple
    names: tuple = ("dq", "dk", "dv")

    @property
    def passed(self) -> bool:
        return all(err <= tol for err, tol in zip(self.errors, self.tols))

    def line(self) -> str:
        parts = (f"{what} max |err| {err:.1e} {'≤' if err <= tol else '>'} tol {tol:.1e}"
                 for what, err, tol in zip(self.names, self.errors, self.tols))
        return f"{self.name} gradients: {', '.join(parts)} {'✓' if self.passed else '✗'}"


def torch_gradient_error(q, k, v, dout, refs, *, dtype: str, device: str, causal=False, key_padding_mask=None,
                         scale=None, variants: Variants = NO_VARIANTS) -> tuple:
    """PyTorch's own error in (dq, dk, dv) against `refs` (float64 NumPy) when autograd runs SDPA in `dtype` on
    `device`, with the masks as a boolean ``attn_mask`` and GQA as repeated K/V heads (their gradients summed back).

    A row that sees no key is given every key and a zero ``dout`` instead: SDPA's backends disagree on such rows
    (zeros or NaN), and so changed the row adds exactly nothing to any gradient and gets dq = 0, the reference's.
    """
    import torch
    import torch.nn.functional as F

    def leaf(x):
        x = x.detach() if hasattr(x, "detach") else torch.from_numpy(np.asarray(x, dtype=np.float64))
        return x.to(device=device, dtype=getattr(torch, dtype)).requires_grad_(True)

    tq, tk, tv = leaf(q), leaf(k), leaf(v)
    if variants:  # the same variants in PyTorch ops, in `dtype`: refs is reference_gradients' dict
        moved = _variants_as(variants, device, dtype, grad=True)
        leaves = [tq, tk, tv] + [getattr(moved, n) for n in ("bias", "sinks") if getattr(moved, n) is not None]
        names = ["q", "k", "v"] + [n for n in ("bias", "sinks") if getattr(moved, n) is not None]
        out, _ = torch_ops_attention(tq, tk, tv, causal=causal, key_padding_mask=key_padding_mask, scale=scale,
                                     variants=moved)
        grads = torch.autograd.grad(out, leaves, leaf(dout).detach())
        return tuple(_max_abs_err(_to_numpy64(g), refs[n]) for g, n in zip(grads, names))
    B, H, Lq, D = tq.shape
    Lk = tk.shape[2]
    allowed = visible_keys(Lq, Lk, causal, key_padding_mask, B)  # (B, 1, Lq, Lk)
    empty = ~allowed.any(-1)  # (B, 1, Lq): rows that see no key
    allowed = allowed | empty[..., None]
    tdout = leaf(dout).detach().masked_fill(torch.from_numpy(empty[..., None]).to(device), 0.0)
    out = F.scaled_dot_product_attention(tq, repeat_kv_heads(tk, H), repeat_kv_heads(tv, H),
                                         attn_mask=torch.from_numpy(allowed).to(device), scale=scale)
    grads = torch.autograd.grad(out, (tq, tk, tv), tdout)
    return tuple(_max_abs_err(_to_numpy64(g), ref) for g, ref in zip(grads, refs))


def gradient_floor(ref: np.ndarray, *, dtype: str, terms: int) -> float:
    """The least PyTorch's error in a gradient counts as: the probabilistic rounding bound of a sum of `terms`
    float32 terms (float64 for float64 inputs), ``u sqrt(terms)``, relative to the gradient's largest entry.

    A tiny problem can let PyTorch round its few sums exactly by luck; twice "by luck" is no bar (module docstring).
    """
    finite = np.abs(ref[np.isfinite(ref)])
    unit_roundoff = 2.0 ** -53 if dtype == "float64" else 2.0 ** -24
    return unit_roundoff * np.sqrt(terms) * float(finite.max()) if finite.size else 0.0


def recomputation_floor(q, k, v, dout, *, dtype: str, causal=False, key_padding_mask=None, scale=None,
                        variants: Variants = NO_VARIANTS) -> tuple:
    """What recomputing P from the LSE costs each gradient, to first order: the least PyTorch's gradient errors count
    as, ``(dq, dk, dv)`` floors (module docstring's argument, carried to the backward).

    A FlashAttention backward does not keep P: it recomputes ``p_ij = exp(s_ij - lse_i)`` from a score rounded again,
    so ``p_ij`` is off by about ``p_ij * 2 eps_ij`` (the score's rounding bound, :func:`_score_rounding_chunks`, once
    in the forward's LSE and once here) even where the exact gradient cancels; ``dP_ij = dout_i . v_j`` and
    ``D_i = dout_i . out_i`` are float32 dot products (their bounds ``u sqrt(D) sqrt(sum_d x_d^2 y_d^2)``), and
    ``out`` is stored in the inputs' dtype first. Each gradient entry is a sum of such terms with random signs:
    ``dv_jd ~ sqrt(sum_i (dp_ij dout_id)^2)``, ``dq_id ~ |scale| sqrt(sum_j (dds_ij k_jd)^2)``, ``dk_jd`` alike over
    the queries of its head group, with ``dds_ij = dp_ij |dP_ij - D_i| + p_ij (err dP_ij + err D_i)``. Float64 NumPy
    over the whole problem: for the sizes a check compares in full. With `variants`, P is the reference's with them,
    and a fourth floor is returned: the largest ``dds_ij``, for the bias's gradient (dZ itself).
    """
    q, k, v, dout = (_to_numpy64(x) for x in (q, k, v, dout))
    q, k, v, dout = (np.where(np.isfinite(x), x, 0.0) for x in (q, k, v, dout))
    B, H, Lq, D = q.shape
    Hk, Lk = k.shape[1], k.shape[2]
    if min(Lq, Lk) == 0:
        return (0.0,) * (4 if variants else 3)
    p_variant = variant_probabilities(q, k, causal=causal, key_padding_mask=key_padding_mask, scale=scale,
                                      variants=variants) if variants else None
    scale = D ** -0.5 if scale is None else float(scale)
    u32 = 2.0 ** -53 if dtype == "float64" else 2.0 ** -24  # the kernels' accumulators
    u_store = {"float64": 2.0 ** -53, "float32": 2.0 ** -24, "bfloat16": 2.0 ** -9}.get(dtype, 2.0 ** -12)
    kr, vr = repeat_kv_heads(k, H), repeat_kv_heads(v, H)
    allowed = visible_keys(Lq, Lk, causal, key_padding_mask, B)
    with np.errstate(invalid="ignore", over="ignore", divide="ignore"):
        if p_variant is None:
            p = safe_softmax(np.where(allowed, scale * np.einsum("bhqd,bhkd->bhqk", q, kr), -np.inf))
        else:
            p = np.nan_to_num(p_variant)
        out = np.einsum("bhqk,bhkd->bhqd", p, vr)
        eps = u32 * np.sqrt(D) * abs(scale) * np.sqrt(np.einsum("bhqd,bhkd->bhqk", q * q, kr * kr))
        dp_err = p * 2 * eps
        dprobs = np.einsum("bhqd,bhkd->bhqk", dout, vr)
        row_dot = (dout * out).sum(-1, keepdims=True)
        dprobs_err = u32 * np.sqrt(D) * np.sqrt(np.einsum("bhqd,bhkd->bhqk", dout * dout, vr * vr))
        row_dot_err = (u32 * np.sqrt(D) + u_store) * np.sqrt(((dout * out) ** 2).sum(-1, keepdims=True))
        dds = dp_err * np.abs(dprobs - row_dot) + p * (dprobs_err + row_dot_err)
        dq = abs(scale) * np.sqrt(np.einsum("bhqk,bhkd->bhqd", dds ** 2, kr ** 2))
        dk = abs(scale) * np.sqrt(np.einsum("bhqk,bhqd->bhkd", dds ** 2, q ** 2).reshape(B, Hk, H // Hk, Lk, D)
                                  .sum(2))
        dv = np.sqrt(np.einsum("bhqk,bhqd->bhkd", dp_err ** 2, dout ** 2).reshape(B, Hk, H // Hk, Lk, D).sum(2))
    floors = (dq, dk, dv, dds) if variants else (dq, dk, dv)
    return tuple(float(np.nanmax(f)) if f.size else 0.0 for f in floors)


def check_gradients(stage_or_name, grads, q, k, v, dout, *, causal=False, key_padding_mask=None,
                    scale: float | None = None, ref=None, multiplier: float = 2.0, verbose: bool = True,
                    raise_on_failure: bool = True, **variants) -> GradientCheckResult:
    """Compare `grads` = (dq, dk, dv) with the float64 reference's (:func:`reference_gradients`); print one line;
    raise :class:`CheckFailed` when one is wrong by more than `multiplier` x PyTorch's error in the same precision
    plus the storage floor (module docstring).

    `stage_or_name` names the line: a stage name, or a Stage or Backward. `ref` may hold precomputed reference
    gradients. PyTorch's error is measured in each gradient's dtype, on its device (the CPU for NumPy arrays).
    Bad q, k, v or options raise the errors :func:`wb_kernels.attention` raises; a gradient that is not an array
    of a dtype the package knows raises a TypeError; one of the wrong shape fails the check (CheckFailed).

    With `variants` (:func:`check`'s), `grads` is what ``wb.attention_backward`` returns for them,
    ``(dq, dk, dv, dbias, dsinks)`` (None where the call has no bias or no sinks), and PyTorch's error is that of the
    same variants in PyTorch ops under autograd (:func:`torch_ops_attention`).
    """
    name = stage_or_name if isinstance(stage_or_name, str) else getattr(stage_or_name, "name", None) or \
        getattr(stage_or_name, "stage", str(stage_or_name))
    inputs = validate_inputs(q, k, v, causal=causal, key_padding_mask=key_padding_mask, scale=scale)
    variants = canonical_variants(q, k, **variants)
    expected = 5 if variants else 3
    if not isinstance(grads, (tuple, list)) or len(grads) != expected:
        wanted = "(dq, dk, dv, dbias, dsinks) for a call with variants" if variants else "(dq, dk, dv)"
        raise TypeError(f"grads: expected {wanted}, got {type(grads).__name__}"
                        + (f" of length {len(grads)}" if isinstance(grads, (tuple, list)) else ""))
    names, likes = ["q", "k", "v"], [q, k, v]
    for n in ("bias", "sinks"):
        if getattr(variants, n) is not None:
            names.append(n)
            likes.append(getattr(variants, n))
    given_grads = list(grads[:3]) + [g for g, n in zip(grads[3:], ("bias", "sinks")) if n in names]
    require_array("dout", dout, DTYPES)
    for what, given, like in zip(names, given_grads, likes):
        require_array(f"d{what}", given, DTYPES)
        if tuple(given.shape) != tuple(like.shape):
            raise CheckFailed(f"{name}: d{what} shape {tuple(given.shape)} != its input's shape {tuple(like.shape)}")
    if ref is not None and not isinstance(ref, dict):
        ref = dict(zip(("q", "k", "v"), ref))
    refs = ref if ref is not None else reference_gradients(q, k, v, dout, causal=causal,
                                                           key_padding_mask=key_padding_mask, scale=scale,
                                                           **fields_of(variants))
    dtype = dtype_name(grads[0])
    device = _floor_device(grads[0])
    pt_errors = torch_gradient_error(q, k, v, dout, refs if variants else [refs[n] for n in names], dtype=dtype,
                                     device=device, causal=causal, key_padding_mask=key_padding_mask, scale=scale,
                                     variants=variants)
    # the longest sum a backward makes: over keys (dq), over the queries of a head group (dk, dv), over D; the
    # sinks' gradient sums over every row of a head
    terms = max(inputs.Lk, inputs.Lq * inputs.H // inputs.Hk, inputs.D, inputs.B * inputs.Lq)
    recomputed = recomputation_floor(q, k, v, dout, dtype=dtype, causal=causal, key_padding_mask=key_padding_mask,
                                     scale=scale, variants=variants)
    floors = list(recomputed[:3]) + [recomputed[3] if n == "bias" else 0.0 for n in names[3:]]
    errors, tols = [], []
    for n, given, pt_err, floor in zip(names, given_grads, pt_errors, floors):
        reference_grad = refs[n]
        pt_err = max(pt_err, floor, gradient_floor(reference_grad, dtype=dtype, terms=terms))
        errors.append(_max_abs_err(_to_numpy64(given), reference_grad))
        tols.append(multiplier * pt_err + storage_floor(reference_grad, dtype_name(given)))
    result = GradientCheckResult(name, tuple(errors), tuple(tols), tuple(f"d{n}" for n in names))
    if verbose:
        print(result.line())
    if raise_on_failure and not result.passed:
        raise CheckFailed(result.line())
    return result
