"""The front door's second floor: validated calls run (all lessons, through ``wb.attention``,
``wb.attention_backward`` and ``wb.decode``; the registered torch operators run the same functions).

- :func:`run_forward` and :func:`run_backward`: an :class:`~wb_kernels.validation.AttentionCall`'s stage forward and
  its Backward, inputs made contiguous once, results in the caller's kind and dtype;
- :func:`propagate_non_finite`: NaN/Inf in q and k reach the output as in SDPA, even from kernels compiled with fast
  math, which may assume that no value is ever NaN or Inf (``tests/test_edge_cases.py``);
- :func:`attention_eager` and :func:`decode_eager`: a call validated, then run (what an eager call and the operators'
  real implementations do); :func:`run_decode` and :func:`reference_decode`.

Nothing here validates what :mod:`wb_kernels.validation` has not, and nothing imports the operators or the API.
"""

from __future__ import annotations

import contextlib
import math
import warnings

import numpy as np

from . import stages as _stages
from .arguments import dtype_name
from .backend import BACKEND
from .device import is_torch, like_input
from .reference import reference, visible_keys
from .variants import NO_VARIANTS
from .validation import (AttentionCall, DecodeCall, as_hnd, check_decode_options, check_decode_simulator_time,
                         host_array, validate_call, validate_decode_call)

__all__ = ["run_forward", "run_backward", "propagate_non_finite", "attention_eager", "decode_eager", "run_decode",
           "reference_decode"]


def _contiguous(x):
    """`x` as a C-contiguous array of the same kind, copied only if it is not one already.

    Kernels index raw memory, and ``torch.from_numpy`` refuses negative strides. Torch tensors are detached: the
    stages' kernels know nothing of autograd. This is reached only where no gradient is asked for, or inside the
    registered op (:mod:`wb_kernels.torch_ops`), whose autograd formula gives the inputs their gradients.
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


def propagate_non_finite(out, lse, q, k, *, causal=False, key_padding_mask=None, scale=None, variants=NO_VARIANTS):
    """Make NaN/Inf in q and k reach `out` and `lse` as they do in SDPA (see :func:`wb_kernels.attention`).

    A row gets NaN (all of its output and its LSE) when it sees at least one key and either its query
    holds a NaN/Inf, or its score with some key it attends is NaN or +Inf (a NaN in that key, or an
    Inf that meets a query value of the same sign or a zero). Scores that come out -Inf leave the key
    out of the row, as in SDPA; the kernels handle those themselves. Values (v) need nothing here:
    ``P @ V`` carries their NaN/Inf in every kernel. Returns ``(out, lse)``, changed in place where
    possible. Costs O(B*H*Lq*D) plus O(Lq*D) per key that holds a NaN/Inf. With `variants`, their masks (a window,
    documents) say which keys a row sees; a row that sees none keeps its output 0 and its LSE (its sink's, or -inf).
    """
    qn, kn = _numpy64(q), _numpy64(k)
    B, H, Lq, D = qn.shape
    Hk, Lk = kn.shape[1], kn.shape[2]
    group = H // Hk  # query heads per key head (GQA)
    scale = 1.0 / math.sqrt(D) if scale is None else float(scale)
    allowed = visible_keys(Lq, Lk, causal, key_padding_mask, B, variants)[:, 0]  # (B, Lq, Lk)
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


def _in_dtype(x, dtype: str):
    """`x` (NumPy or torch) in dtype `dtype`, the same object when it is already."""
    if dtype_name(x) == dtype:
        return x
    if is_torch(x):
        import torch

        return x.to(getattr(torch, dtype))
    return x.astype(dtype)


def _in_callers_dtypes(out, lse, q):
    """out in q's dtype, the LSE in float32 (float64 for float64 q: the reference's). Cheap when they already are
    (every kernel of a GPU call): dtype objects compared, no names built."""
    if out.dtype != q.dtype:
        out = _in_dtype(out, dtype_name(q))
    # (float64 is the only 8-byte dtype a stage takes; NumPy and torch dtypes both tell their itemsize)
    wanted = 8 if q.dtype.itemsize == 8 else 4  # the kernels keep the LSE in float32
    if lse.dtype.itemsize != wanted:
        lse = _in_dtype(lse, "float64" if wanted == 8 else "float32")
    return out, lse


def run_forward(call: AttentionCall, q, k, v, key_padding_mask=None, *, check_finite=True):
    """A validated call's forward: ``(out, lse)`` in the caller's kind, out in q's dtype.

    What ``wb.attention``'s direct path, :class:`~wb_kernels.torch_ops.EagerAttention` and the registered op's real
    implementation run: inputs made contiguous, the stage's forward with the call's options as they are (``causal``
    "top_left", "bottom_right" or no mask: the comment at the call), the NaN/Inf pass (:func:`propagate_non_finite`),
    results moved back to the caller.
    """
    spec, causal, scale = call.stage, call.causal, call.scale
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
        if call.variants:  # (only a stage that computes them is given them: validation refused the others)
            out, lse = spec.forward(q, k, v, causal=causal, key_padding_mask=key_padding_mask, scale=scale,
                                    variants=call.variants)
        else:
            out, lse = spec.forward(q, k, v, causal=causal, key_padding_mask=key_padding_mask, scale=scale)
    out, lse = _in_callers_dtypes(like_input(out, caller_q), like_input(lse, caller_q), caller_q)
    if non_finite:
        out, lse = propagate_non_finite(out, lse, q, k, causal=causal, key_padding_mask=key_padding_mask,
                                        scale=scale, variants=call.variants)
    return out, lse


def run_backward(call: AttentionCall, q, k, v, out, lse, dout, key_padding_mask=None):
    """A validated call's gradients from its stage's :class:`~wb_kernels.stages.Backward`: ``(dq, dk, dv)`` in the
    caller's kind, each in its input's dtype. What ``wb.attention_backward`` and both autograd paths run; `out` and
    `lse` are the forward's. A call with variants gets ``(dq, dk, dv, dbias, dsinks)``: the gradients of its bias
    and sinks (each None where the call has none), which the stage's Backward returns in a dict."""
    backward, causal, scale = _stages.get_backward(call.stage.name), call.causal, call.scale
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
        if call.variants:
            found = backward.gradients(q, k, v, out, lse, dout, causal=causal, key_padding_mask=key_padding_mask,
                                       scale=scale, variants=call.variants)
            extras = [(found.get(name), getattr(call.variants, name)) for name in ("bias", "sinks")]
            grads = (found["q"], found["k"], found["v"])
        else:
            grads = backward.gradients(q, k, v, out, lse, dout, causal=causal, key_padding_mask=key_padding_mask,
                                       scale=scale)
    grads = tuple(_in_dtype(like_input(g, x), dtype_name(x)) for g, x in zip(grads, caller))
    if call.variants:
        grads += tuple(None if x is None else _in_dtype(like_input(g, x), dtype_name(x)) for g, x in extras)
    return grads

def attention_eager(q, k, v, key_padding_mask=None, *, stage="reference", causal=False, scale=None, check_finite=True,
                    **variants):
    """A call validated (:func:`~wb_kernels.validation.validate_call`), then run (:func:`run_forward`): what an eager
    ``wb.attention`` and the registered op's real implementation do. Returns ``(out, lse)``."""
    call = validate_call(q, k, v, stage=stage, causal=causal, key_padding_mask=key_padding_mask, scale=scale,
                         **variants)
    return run_forward(call, q, k, v, key_padding_mask, check_finite=check_finite)


def reference_decode(q, k_cache, v_cache, cache_seqlens, *, block_table=None, scale=None):
    """float64 NumPy decode through :func:`wb_kernels.reference`: ``(out (B, H, D), lse (B, H))``."""
    from .stages.decode.launcher import contiguous_as_paged, gather_pages

    qn, kn, vn = _numpy64(q), _numpy64(k_cache), _numpy64(v_cache)
    lens = host_array(cache_seqlens)
    B, H, D = qn.shape
    if block_table is None:
        table = contiguous_as_paged(B, kn.shape[2])
    else:
        table = host_array(block_table)
    group = H // kn.shape[1]
    out, lse = np.zeros((B, H, D)), np.full((B, H), -np.inf)
    for b in range(B):
        length = int(lens[b])
        if length == 0:
            continue
        keys = np.repeat(gather_pages(kn, table, length, b), group, axis=0)[None]  # (1, H, length, D)
        values = np.repeat(gather_pages(vn, table, length, b), group, axis=0)[None]
        o, l = reference(qn[b][None, :, None], keys, values, scale=scale)
        out[b], lse[b] = o[0, :, 0], l[0, :, 0]
    return out, lse


def _propagate_non_finite_decode(out, lse, q, k_cache, cache_seqlens, block_table, scale):
    """NaN/Inf in q or the keys reach the rows SDPA would make NaN (wb.attention's rule), for the numba kernels.

    One pass over q and the keys finds whether there is anything to do (on the host: this path is the simulator's
    and float32's); only then is each sequence's problem rebuilt as an attention one and handed to
    :func:`propagate_non_finite`.
    """
    from .stages.decode.launcher import contiguous_as_paged, gather_pages

    qn, kn = _numpy64(q), _numpy64(k_cache)
    if np.isfinite(qn).all() and np.isfinite(kn).all():
        return out, lse
    lens = host_array(cache_seqlens)
    table = contiguous_as_paged(qn.shape[0], kn.shape[2]) if block_table is None else \
        host_array(block_table)
    group = qn.shape[1] // kn.shape[1]
    out_rows, lse_rows = [], []
    for b in range(qn.shape[0]):
        keys = np.repeat(gather_pages(kn, table, int(lens[b]), b), group, axis=0)[None]  # (1, H, len, D)
        if keys.shape[2] == 0:  # no key: the row stays 0, LSE -inf, whatever its query
            out_rows.append(out[b:b + 1, :, None])
            lse_rows.append(lse[b:b + 1, :, None])
            continue
        o, l = propagate_non_finite(out[b:b + 1, :, None], lse[b:b + 1, :, None], qn[b:b + 1, :, None], keys,
                                    scale=scale)
        out_rows.append(o)
        lse_rows.append(l)
    join = (lambda xs: __import__("torch").cat(xs)) if is_torch(out) else np.concatenate
    return join(out_rows)[:, :, 0], join(lse_rows)[:, :, 0]


def decode_eager(q, k_cache, v_cache, cache_seqlens, *, block_table=None, stage="decode", scale=None,
                 num_splits=None, max_seqlen=None, kv_layout="HND"):
    """``wb.decode`` validated (:func:`~wb_kernels.validation.validate_decode_call`, once per CUDA signature), then run
    (:func:`run_decode`): ``(out, lse)``, what an eager call and the registered op's real implementation do."""
    call = validate_decode_call(q, k_cache, v_cache, cache_seqlens, block_table=block_table, stage=stage, scale=scale,
                                kv_layout=kv_layout)
    num_splits, max_seqlen = check_decode_options(num_splits, max_seqlen, call.capacity, cache_seqlens)
    return run_decode(call, q, k_cache, v_cache, cache_seqlens, block_table, num_splits=num_splits,
                      max_seqlen=max_seqlen)


def run_decode(call: DecodeCall, q, k_cache, v_cache, cache_seqlens, block_table=None, *, num_splits=None,
               max_seqlen=None):
    """A validated decode call (`num_splits` and `max_seqlen` checked by
    :func:`~wb_kernels.validation.check_decode_options`): ``(out, lse)`` in the caller's kind."""
    scale = call.scale
    k_cache, v_cache = as_hnd(k_cache, call.kv_layout), as_hnd(v_cache, call.kv_layout)
    if call.stage == "reference":
        out, lse = reference_decode(q, k_cache, v_cache, cache_seqlens, block_table=block_table, scale=scale)
        return like_input(out, q), like_input(lse, q)
    from .stages.decode.launcher import decode_forward, uses_cuda_kernel

    if uses_cuda_kernel(q):
        # The decode step's path on a GPU, kept short (it runs once per layer and token): the CUDA kernel
        # handles NaN/Inf itself, warns about nothing, and returns tensors on q's device in q's dtype.
        return decode_forward(q, k_cache, v_cache, cache_seqlens, block_table=block_table, scale=scale,
                              num_splits=num_splits, max_seqlen=max_seqlen)
    if BACKEND.is_simulator:
        check_decode_simulator_time(call.B, call.H, call.Hk, call.D,
                                    call.capacity if max_seqlen is None else max_seqlen, num_splits)
    with warnings.catch_warnings():
        # the simulator computes in NumPy, which warns about NaN/Inf that are the right answer here (as in
        # wb.attention); a GPU computes the same silently
        warnings.simplefilter("ignore", RuntimeWarning)
        out, lse = decode_forward(q, k_cache, v_cache, cache_seqlens, block_table=block_table, scale=scale,
                                  num_splits=num_splits, max_seqlen=max_seqlen)
    out, lse = _propagate_non_finite_decode(out, lse, q, k_cache, cache_seqlens, block_table, scale)
    return like_input(out, q), like_input(lse, q)
