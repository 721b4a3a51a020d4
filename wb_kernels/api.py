"""The one public entry point, ``attention(q, k, v, stage=..., causal=...)`` (all lessons, tests, bench), and its
gradients: through torch autograd, or ``attention_backward`` for NumPy users (lesson 08_backward).

Everything is validated (:mod:`wb_kernels.validation`) before any kernel is launched or any buffer allocated, and
each error names the argument, the value it got and what is accepted (``tests/test_api_errors.py``).
Here, too, the package keeps its promises about edge cases for every stage at once: inputs are made
contiguous once, outputs come back in the caller's kind and dtype, and NaN/Inf in the inputs give the result SDPA
gives (``tests/test_edge_cases.py``), even from kernels compiled with fast math, which may assume that no value is
ever NaN or Inf. Torch calls that need a gradient, a compiler or fake tensors go through the registered op
``torch.ops.wb.attention`` (:mod:`wb_kernels.autograd`, ``tests/test_autograd.py``), which runs the same code.
"""

from __future__ import annotations

import contextlib
import math
import sys
import warnings

import numpy as np

from . import ops
from .backend import BACKEND
from .device import ValidatedCalls, cuda_signature, is_torch, like_input
from .reference import attention_mask
from .stages import available_stages, get_backward, get_stage  # noqa: F401  (names tests patch here)
# validation lives in its own module (imports run validation <- reference <- api); its names stay importable here
from .validation import (CAUSAL_ALIGNMENTS, SIMULATOR_MAX_SECONDS, Inputs, _as_flag, _check_causal,  # noqa: F401
                         _check_scale, _device_of, _dtype_name, _kind, require_array, validate, validate_gradient,
                         validate_inputs)

__all__ = ["attention", "attention_backward", "validate", "validate_inputs", "require_array", "Inputs",
           "propagate_non_finite", "SIMULATOR_MAX_SECONDS"]

# CUDA inputs' signatures that passed validate, and its Stage: a signature checked once is not checked again (the
# checks cost more than a small kernel's launch; see device.ValidatedCalls)
_VALIDATED = ValidatedCalls()


def _contiguous(x):
    """`x` as a C-contiguous array of the same kind, copied only if it is not one already.

    Kernels index raw memory, and ``torch.from_numpy`` refuses negative strides. Torch tensors are detached: the
    stages' kernels know nothing of autograd. This is reached only where no gradient is asked for, or inside the
    registered op (:mod:`wb_kernels.autograd`), whose autograd formula gives the inputs their gradients.
    """
    if is_torch(x):
        return x.detach().contiguous()
    return np.ascontiguousarray(x)


def _may_hold_non_finite(q, k) -> bool:
    """Whether q or k may hold a NaN or an Inf: one pass over each and one number back.

    A sum is NaN or Inf when any term is (+Inf + -Inf gives NaN); it can also overflow for huge finite
    inputs, which only sends those to the exact (slower) path of propagate_non_finite, where nothing
    is changed.
    """
    if is_torch(q):
        import torch

        acc = torch.float64 if q.dtype == torch.float64 else torch.float32
        sums = torch.stack([q.sum(dtype=acc), k.sum(dtype=acc)])
        return not bool(torch.isfinite(sums).all())
    with np.errstate(over="ignore", invalid="ignore"):
        return not (np.isfinite(q.sum(dtype=np.float64)) and np.isfinite(k.sum(dtype=np.float64)))


def _numpy64(x) -> np.ndarray:
    if is_torch(x):
        return x.detach().cpu().double().numpy()
    return np.asarray(x, dtype=np.float64)


def propagate_non_finite(out, lse, q, k, *, causal=False, key_padding_mask=None, scale=None):
    """Make NaN/Inf in q and k reach `out` and `lse` as they do in SDPA (see :func:`attention`).

    A row gets NaN (all of its output and its LSE) when it sees at least one key and either its query
    holds a NaN/Inf, or its score with some key it attends is NaN or +Inf (a NaN in that key, or an
    Inf that meets a query value of the same sign or a zero). Scores that come out -Inf leave the key
    out of the row, as in SDPA; the kernels handle those themselves. Values (v) need nothing here:
    ``P @ V`` carries their NaN/Inf in every kernel. Returns ``(out, lse)``, changed in place where
    possible. Costs O(B*H*Lq*D) plus O(Lq*D) per key that holds a NaN/Inf.
    """
    qn, kn = _numpy64(q), _numpy64(k)
    B, H, Lq, D = qn.shape
    Hk, Lk = kn.shape[1], kn.shape[2]
    group = H // Hk  # query heads per key head (GQA)
    scale = 1.0 / math.sqrt(D) if scale is None else float(scale)
    allowed = attention_mask(Lq, Lk, causal, key_padding_mask, batch=B)[:, 0]  # (B, Lq, Lk)
    poisoned = ~np.isfinite(qn).all(-1)  # (B, H, Lq)
    bad_keys = ~np.isfinite(kn).all(-1)  # (B, Hk, Lk)
    chunk = 256  # keys per step: bounds the (group, Lq, chunk) scores held at once
    with np.errstate(invalid="ignore", over="ignore"):
        for b, hk in zip(*np.nonzero(bad_keys.any(-1))):
            heads = slice(hk * group, (hk + 1) * group)  # the query heads that read key head hk
            keys = np.flatnonzero(bad_keys[b, hk])
            for first in range(0, len(keys), chunk):
                some = keys[first:first + chunk]
                scores = scale * (qn[b, heads] @ kn[b, hk, some].T)  # (group, Lq, len(some)), IEEE: inf*0 = NaN
                hot = (np.isnan(scores) | (scores == np.inf)) & allowed[b][:, some]
                poisoned[b, heads] |= hot.any(-1)
    poisoned &= allowed.any(-1)[:, None, :]  # a row that sees no key stays 0, LSE -inf
    if not poisoned.any():
        return out, lse
    if is_torch(out):
        import torch

        rows = torch.from_numpy(poisoned).to(out.device)
        return (out.masked_fill(rows[..., None], float("nan")),
                lse.masked_fill(rows, float("nan")) if lse is not None else None)
    out = np.array(out, copy=True)
    out[poisoned] = np.nan
    if lse is not None:
        lse = np.array(lse, copy=True)
        lse[poisoned] = np.nan
    return out, lse


def attention(q, k, v, *, stage: str = "reference", causal=False, key_padding_mask=None,
              scale: float | None = None, return_lse: bool = False, check_finite: bool = True):
    """Exact attention softmax(scale * q k^T [masked]) v with the chosen stage's kernel.

    Inputs
        q: (B, H, Lq, D); k, v: (B, Hk, Lk, D) where Hk = H, or Hk divides H: grouped-query attention
        (GQA; MQA when Hk = 1), as SDPA's ``enable_gqa=True``: query head h uses key/value head
        h // (H // Hk). The kernels read that head in place; nothing is copied. All NumPy arrays or all
        torch tensors (CPU, or CUDA on a GPU), of one dtype the stage accepts (``wb.get_stage(name).dtypes``)
        and a head dim D it supports. Non-contiguous inputs (slices, transposes) are copied once. Torch
        tensors are differentiable (``loss.backward()`` reaches q, k and v) with every stage that has a
        backward (``wb.stages.available_backwards()``); asking a gradient of another stage raises a
        ValueError naming those that have one. The call is the registered op ``torch.ops.wb.attention``
        when a gradient is needed, under ``torch.compile`` and for meta/fake tensors
        (:mod:`wb_kernels.autograd`); plain tensors that need no gradient take a direct, cheaper path.
    causal
        ``False`` (no mask), ``True`` or ``"top_left"``, or ``"bottom_right"``: query i attends keys
        j <= i + offset, where the offset is 0 at the top left and Lk - Lq at the bottom right
        (:func:`wb_kernels.reference.causal_offset`). The two differ only when Lq != Lk::

                    Lq=2, Lk=4                           Lq=4, Lk=2
                    top_left   bottom_right              top_left   bottom_right
            key     0 1 2 3    0 1 2 3           key     0 1        0 1
            query 0 x . . .    x x x .           query 0 x .        . .
            query 1 x x . .    x x x x           query 1 x x        . .
                                                 query 2 x x        x .
                                                 query 3 x x        x x

        *top-left* is SDPA's ``is_causal=True``: row i sees keys 0..i whatever Lk is. *bottom-right* is
        flash-attn's, what decoding with a KV cache and chunked prefill need: the Lq queries are the last
        Lq positions of a sequence whose first Lk - Lq keys are already cached, so the last query sees
        every key. With Lq > Lk its first Lq - Lk rows see no key (zeros, LSE -inf, as below).
        ``wb_kernels.plots.causal_alignment_figure(Lq, Lk)`` draws both. Accepts True/False, NumPy
        bools and 0/1 for the flag; another string is refused with the accepted values.
    key_padding_mask
        bool (B, Lk), True = the key takes part (SDPA's boolean ``attn_mask`` convention), on the CPU
        or the inputs' device.
    scale
        a finite number; defaults to 1/sqrt(D).

    Returns the output (B, H, Lq, D) in the caller's kind (NumPy, or torch on q's device) and dtype, and with
    ``return_lse=True`` also the per-row log-sum-exp (B, H, Lq) (float32; float64 for float64 input). The LSE
    carries no gradient (torch marks it non-differentiable): differentiate through the output.

    Edge cases, the same for every stage:
        - A row that sees no key (every key masked) gets zeros and LSE -inf, never NaN.
        - Large logits (|scale * q.k| up to 1e4 and beyond) do not overflow: the row maximum is
          subtracted before exp.
        - NaN/Inf in the inputs propagate as in PyTorch's SDPA (checked against its math backend):
          a NaN or Inf in query row i makes output row i NaN; a NaN in key row j makes every row that
          attends key j NaN; an Inf in key row j makes a row's score +Inf, -Inf or NaN depending on the
          query's signs: +Inf and NaN make the row NaN, -Inf leaves key j out of that row; a NaN/Inf
          in v[j, d] reaches column d of every row that attends key j. LSE is NaN (or +Inf) in rows
          that are NaN. Exceptions: a row that sees no key stays 0 even if its query is NaN; and
          whether a NaN/Inf in a *masked* key's k or v reaches a row is not specified (SDPA's math
          backend lets it through, as it adds the mask as a -Inf bias; the stages here never use a
          masked key's k, but may multiply its v by 0, and 0 * NaN = NaN).
          The kernels themselves may assume finite inputs (the flash kernels are compiled with fast
          math), so this function keeps the promise: it looks for NaN/Inf in q and k first (one pass
          over each) and, when there are any, marks the rows SDPA would make NaN
          (:func:`propagate_non_finite`). ``check_finite=False`` skips that pass; the result for
          non-finite inputs is then whatever the kernel makes of them. A stage whose kernel keeps the
          promise itself (``Stage.non_finite_in_kernel``: the mma rung) gets no pass: that pass reads a
          number back from the GPU, which stalls the host on every call.

    Raises, before launching anything: TypeError (wrong kind or dtype of an argument, unknown kind of
    stage name), ValueError (shapes that disagree, Hk not dividing H, an unknown causal alignment,
    unsupported head dim, an unknown stage, CPU inputs for a GPU-only stage, a size the simulator would
    take minutes for), MemoryError (a stage's Lq x Lk
    buffers would not fit: the message says how much they need and suggests the flash stages).
    """
    torch = sys.modules.get("torch")  # None: no torch tensor can have been given
    if torch is not None:
        ops.ensure(torch)  # defined eagerly, once (lookups after it): a compiler tracing a first call could not
    if torch is not None and (torch.compiler.is_compiling()
                              or (isinstance(q, torch.Tensor) and _needs_op(torch, q, k, v))):
        return _through_op(torch, q, k, v, stage=stage, causal=causal, key_padding_mask=key_padding_mask,
                           scale=scale, return_lse=return_lse, check_finite=check_finite)
    spec = validated(q, k, v, stage=stage, causal=causal, key_padding_mask=key_padding_mask, scale=scale)
    out, lse = run_forward(spec, q, k, v, causal=_check_causal(causal), key_padding_mask=key_padding_mask,
                           scale=_check_scale(scale), check_finite=check_finite)
    if return_lse:
        return out, lse
    return out


def validated(q, k, v, *, stage, causal, key_padding_mask, scale):
    """:func:`validate`'s Stage, from the cache when CUDA inputs of this signature and these options passed before."""
    key = cuda_signature(q, k, v, key_padding_mask)
    if key is not None and isinstance(scale, (float, int, type(None))) and isinstance(causal, (bool, str)):
        key = (key, stage, causal, scale)  # CUDA inputs: the checks read shapes, dtypes and devices only
    else:
        key = None
    spec = _VALIDATED.get(key)
    if spec is None:
        spec = _VALIDATED.remember(key, validate(q, k, v, stage=stage, causal=causal,
                                                 key_padding_mask=key_padding_mask, scale=scale))
    return spec


def _needs_op(torch, q, k, v) -> bool:
    """Whether an eager torch call must go through the registered op: a gradient is asked for, or the tensors are
    not plain ones (meta, fake or functional tensors: torch.export, shape inference). (A compiler's tracing is
    tested before, and without :func:`is_torch`, whose cache of types a compiler cannot guard on.) A CUDA call that
    needs none of this keeps the direct path: a few attribute reads here."""
    if not (isinstance(k, torch.Tensor) and isinstance(v, torch.Tensor)):
        return False  # mixed kinds: validation says what is wrong
    if (q.requires_grad or k.requires_grad or v.requires_grad) and torch.is_grad_enabled():
        return True
    return type(q) is not torch.Tensor or q.is_meta


def _through_op(torch, q, k, v, *, stage, causal, key_padding_mask, scale, return_lse, check_finite):
    """wb.attention with autograd. In eager mode everything is validated here, before anything runs, a stage
    without a backward is refused before its forward when a gradient is asked for, and the call runs
    :class:`~wb_kernels.autograd.EagerAttention` (the op's arithmetic without ``torch.library``'s per-call
    wrappers); while a compiler traces, and for fake or meta tensors, it is ``torch.ops.wb.attention``, checked by
    the op's fake implementation (shapes) and its real one (everything, at run time)."""
    traced = torch.compiler.is_compiling() or type(q) is not torch.Tensor or q.is_meta
    if not traced or not isinstance(stage, str):
        spec = validated(q, k, v, stage=stage, causal=causal, key_padding_mask=key_padding_mask, scale=scale)
    causal, scale = _check_causal(causal), _check_scale(scale)
    if torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad):
        get_backward(stage)  # ValueError naming the stages that have one, before the forward runs
    if not traced:  # eager: the same arithmetic as the op's, without torch.library's wrappers (EagerAttention)
        from .autograd import EagerAttention

        out, lse = EagerAttention.apply(q, k, v, key_padding_mask, spec, causal, scale, bool(check_finite))
        return (out, lse) if return_lse else out
    if not ops.registered():  # (traced: defining it here would be traced too, which the compiler refuses)
        raise RuntimeError(f"wb.attention's operator, torch.ops.wb.attention, {ops.MISSING}")
    out, lse = torch.ops.wb.attention(q, k, v, key_padding_mask, stage, causal or "", scale, bool(check_finite))
    return (out, lse) if return_lse else out


def _in_dtype(x, dtype: str):
    """`x` (NumPy or torch) in dtype `dtype`, the same object when it is already."""
    if _dtype_name(x) == dtype:
        return x
    if is_torch(x):
        import torch

        return x.to(getattr(torch, dtype))
    return x.astype(dtype)


def _in_callers_dtypes(out, lse, q):
    """out in q's dtype, the LSE in float32 (float64 for float64 q: the reference's). Cheap when they already are
    (every kernel of a GPU call): dtype objects compared, no names built."""
    if out.dtype != q.dtype:
        out = _in_dtype(out, _dtype_name(q))
    # (float64 is the only 8-byte dtype a stage takes; NumPy and torch dtypes both tell their itemsize)
    wanted = 8 if q.dtype.itemsize == 8 else 4  # the kernels keep the LSE in float32
    if lse.dtype.itemsize != wanted:
        lse = _in_dtype(lse, "float64" if wanted == 8 else "float32")
    return out, lse


def run_forward(spec, q, k, v, *, causal, key_padding_mask, scale, check_finite=True):
    """A validated call of `spec`'s forward: ``(out, lse)`` in the caller's kind, out in q's dtype.

    What both ``wb.attention``'s direct path and the registered op's real implementation run: inputs made
    contiguous, the NaN/Inf pass (:func:`propagate_non_finite`), results moved back to the caller. `causal` and
    `scale` are already checked (:func:`_check_causal`, :func:`_check_scale`).
    """
    caller_q = q
    q, k, v = (_contiguous(x) for x in (q, k, v))
    if key_padding_mask is not None:
        key_padding_mask = _contiguous(key_padding_mask)
    # a stage whose kernel handles NaN/Inf itself needs no pass here (that pass waits for the GPU: see Stage)
    non_finite = check_finite and not spec.non_finite_in_kernel and _may_hold_non_finite(q, k)
    quiet = non_finite or BACKEND.is_simulator
    # (no warnings filter on a GPU's ordinary call: saving and restoring the filters costs microseconds per call)
    with warnings.catch_warnings() if quiet else contextlib.nullcontext():
        if quiet:
            # NumPy arithmetic (the reference, and every kernel on the simulator) warns about NaN/Inf that
            # are the right answer here; a GPU computes the same silently
            warnings.simplefilter("ignore", RuntimeWarning)
        out, lse = spec.forward(q, k, v, causal=causal, key_padding_mask=key_padding_mask, scale=scale)
    out, lse = _in_callers_dtypes(like_input(out, caller_q), like_input(lse, caller_q), caller_q)
    if non_finite:
        out, lse = propagate_non_finite(out, lse, q, k, causal=causal, key_padding_mask=key_padding_mask,
                                        scale=scale)
    return out, lse


def run_backward(backward, q, k, v, out, lse, dout, *, causal, key_padding_mask, scale):
    """A validated call of a :class:`~wb_kernels.stages.Backward`: ``(dq, dk, dv)`` in the caller's kind, each in
    its input's dtype. What ``wb.attention_backward`` and the registered backward op run."""
    caller = (q, k, v)
    q, k, v, out, lse, dout = (_contiguous(x) for x in (q, k, v, out, lse, dout))
    if key_padding_mask is not None:
        key_padding_mask = _contiguous(key_padding_mask)
    # NumPy arithmetic (the reference, every kernel on the simulator) warns about NaN gradients that are the answer
    # for NaN/Inf inputs; a GPU computes them silently, and saving and restoring the filters costs microseconds
    quiet = BACKEND.is_simulator or not is_torch(q) or not q.is_cuda
    with warnings.catch_warnings() if quiet else contextlib.nullcontext():
        if quiet:
            warnings.simplefilter("ignore", RuntimeWarning)
        grads = backward.gradients(q, k, v, out, lse, dout, causal=causal, key_padding_mask=key_padding_mask,
                                   scale=scale)
    return tuple(_in_dtype(like_input(g, x), _dtype_name(x)) for g, x in zip(grads, caller))


def attention_backward(q, k, v, dout, *, stage: str = "reference", causal=False, key_padding_mask=None,
                       scale: float | None = None, out=None, lse=None):
    """The gradients of :func:`attention` with respect to q, k and v: ``(dq, dk, dv)`` for `dout` = dL/d(out).

    For NumPy users (the lesson runs it on a laptop) and anyone who wants gradients without autograd. Inputs and
    options are those of :func:`attention`, validated alike; `dout` is shaped like the output (B, H, Lq, D), of
    q's kind, dtype and device. `out` and `lse` are what ``attention(..., return_lse=True)`` returned for these
    inputs; when not given, the forward runs first (the backward needs them: the forward saves nothing else).
    dk and dv are summed over each group of query heads that share a key/value head (GQA). A row that sees no key
    gets zero gradients. Returns the gradients in the caller's kind and each input's dtype, without autograd
    history (no double backward).

    Raises the errors :func:`attention` raises, a ValueError naming the stages that have a backward when `stage`
    has none, and TypeError/ValueError for a `dout`, `out` or `lse` of the wrong kind, shape, dtype or device.
    """
    spec = validate(q, k, v, stage=stage, causal=causal, key_padding_mask=key_padding_mask, scale=scale)
    backward = get_backward(stage)
    inputs = validate_inputs(q, k, v, causal=causal, key_padding_mask=key_padding_mask, scale=scale)
    validate_gradient(dout, q, inputs)
    causal, scale = _check_causal(causal), _check_scale(scale)
    if (out is None) != (lse is None):
        raise ValueError("out, lse: pass both (what attention(..., return_lse=True) returned) or neither")
    if out is None:
        out, lse = run_forward(spec, q, k, v, causal=causal, key_padding_mask=key_padding_mask, scale=scale)
    else:
        for name, given, shape in (("out", out, (inputs.B, inputs.H, inputs.Lq, inputs.D)),
                                   ("lse", lse, (inputs.B, inputs.H, inputs.Lq))):
            require_array(name, given)
            if _kind(given) != _kind(q) or tuple(given.shape) != shape:
                raise ValueError(f"{name}: expected a {_kind(q)} of shape {shape} (from attention(..., "
                                 f"return_lse=True)), got a {_kind(given)} of shape {tuple(given.shape)}")
    return run_backward(backward, q, k, v, out, lse, dout, causal=causal, key_padding_mask=key_padding_mask,
                        scale=scale)
