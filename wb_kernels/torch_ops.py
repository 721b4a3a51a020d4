"""The front door's third floor: the package's PyTorch operators, all defined here by one function, :func:`register`
(lesson 08_backward; every lesson that trains, compiles or captures through ``wb.attention`` or ``wb.decode``).

- ``torch.ops.wb.attention``: directly above its fake implementation and its autograd formula. The real
  implementation validates and runs a stage's forward as ``wb.attention``'s direct path does
  (:func:`wb_kernels.execution.attention_eager`), the NaN/Inf pass included. It is opaque to the compiler, so
  ``torch.compile(fullgraph=True)`` and ``torch.export`` never trace into NumPy or numba code; the fake only says what
  comes out (shapes and dtypes), so meta and fake tensors work. The autograd formula saves q, k, v, out and the LSE
  (never P: the backward recomputes it) and calls the backward op;
- ``torch.ops.wb.attention_backward``: the stage's registered :class:`~wb_kernels.stages.Backward`
  (:func:`wb_kernels.execution.run_backward`). Its own gradient refuses, with :data:`DOUBLE_BACKWARD`: a gradient
  penalty (``create_graph=True``) gets an error when it is differentiated, never a silently missing term;
- :class:`EagerAttention`: the same arithmetic as a plain ``autograd.Function``, what an eager call that needs a
  gradient runs (the op's Python wrappers cost more than a small call's whole device work: its docstring);
- ``torch.ops.wb.decode``: :func:`wb_kernels.execution.decode_eager` and its fake; decode has no gradient.

``causal`` travels in its canonical form (None, "top_left" or "bottom_right": the schema's ``str? causal``) from
validation to the kernel and back. A ``Library`` op costs about half what ``@torch.library.custom_op`` costs per call
(FACTS: 14 against 31 µs on the H100 host), which matters for a call that takes tens of microseconds.

A compiler cannot trace the operators' definition, so they must exist before ``torch.compile`` meets
``wb.attention`` or ``wb.decode``: :func:`register` runs when ``wb_kernels`` is imported after torch, or else at the
first eager call with torch tensors (:mod:`wb_kernels.api`). It also discovers the stage registry, so that nothing a
compiler traces walks the rungs' folders. This module imports torch: the package imports it only once torch is.
"""

from __future__ import annotations

import torch

from . import stages as _stages
from .execution import attention_eager, decode_eager, run_backward, run_forward
from .arguments import validate_inputs
from .validation import AttentionCall, validate_decode_shapes
from .variants import canonical_softcap, canonical_variants, canonical_window

__all__ = ["register", "registered", "EagerAttention", "MISSING", "DOUBLE_BACKWARD"]

MISSING = ("is defined when wb_kernels is imported after torch, or by the first eager call; this process imported "
           "wb_kernels before torch and compiles its first call, and a compiler cannot define it while it traces. "
           "Import torch before wb_kernels, or call wb_kernels.torch_ops.register() before compiling")
DOUBLE_BACKWARD = ("wb.attention has no double backward: its gradients come from the stage's Backward, which is not "
                   "itself differentiable, so a loss built from them (create_graph=True, a gradient penalty) cannot "
                   "be differentiated again. Compute that term with torch.nn.functional.scaled_dot_product_attention")

_LIBRARY = None  # the torch.library.Library, once registered: one registration per process

# The attention variants (wb_kernels.variants) in the operators' schemas: each one a value or an optional tensor, all
# defaulting to None so that a call without them reads as before. window (left, right) is two optional ints (both None:
# no window), document_ids the pair of q's and k's ids.
VARIANT_SCHEMA = ("float? softcap=None, Tensor? alibi_slopes=None, Tensor? bias=None, int? window_left=None, "
                  "int? window_right=None, Tensor? q_document_ids=None, Tensor? k_document_ids=None, "
                  "Tensor? sinks=None")
VARIANT_ARGS = 8  # how many arguments VARIANT_SCHEMA adds


def schema_variant_args(*, softcap=None, alibi_slopes=None, bias=None, window=None, document_ids=None, sinks=None):
    """:func:`wb_kernels.attention`'s variant keywords as the schema's arguments, the numbers in canonical form and
    the tensors as given (what a compiler traces: the operator's implementations check the tensors)."""
    window = canonical_window(window) or (None, None)
    if document_ids is None:
        documents = (None, None)
    elif isinstance(document_ids, (tuple, list)):
        documents = tuple(document_ids)
    else:
        documents = (document_ids, document_ids)
    return (canonical_softcap(softcap), alibi_slopes, bias, *window, *documents, sinks)


def _variant_kwargs(*args):
    """The schema's variant arguments (those given; the rest None) as :func:`~wb_kernels.variants.canonical_variants`'
    keywords."""
    args = args + (None,) * (VARIANT_ARGS - len(args))
    softcap, alibi_slopes, bias, window_left, window_right, q_document_ids, k_document_ids, sinks = args
    window = None if window_left is None and window_right is None else (window_left, window_right)
    documents = None if q_document_ids is None else (q_document_ids, k_document_ids)
    return dict(softcap=softcap, alibi_slopes=alibi_slopes, bias=bias, window=window, document_ids=documents,
                sinks=sinks)


def registered() -> bool:
    """Whether :func:`register` has run in this process."""
    return _LIBRARY is not None


def register() -> None:
    """Define ``wb::attention``, ``wb::attention_backward`` and ``wb::decode`` (once per process; later calls return
    at once), after discovering the stage registry (a compiler tracing a first call cannot walk the folders)."""
    global _LIBRARY
    if _LIBRARY is not None:
        return
    _stages.available_stages()
    _stages.available_backwards()
    library = torch.library.Library("wb", "DEF")
    library.define(f"attention(Tensor q, Tensor k, Tensor v, Tensor? key_padding_mask, str stage, str? causal, "
                   f"float? scale, bool check_finite, {VARIANT_SCHEMA}) -> (Tensor, Tensor)")
    # (the bias's and the sinks' gradients are empty tensors when the call has none: a schema returns no optionals)
    library.define(f"attention_backward(Tensor dout, Tensor q, Tensor k, Tensor v, Tensor out, Tensor lse, "
                   f"Tensor? key_padding_mask, str stage, str? causal, float? scale, {VARIANT_SCHEMA}) "
                   f"-> (Tensor, Tensor, Tensor, Tensor, Tensor)")
    library.define("decode(Tensor q, Tensor k_cache, Tensor v_cache, Tensor cache_seqlens, Tensor? block_table, "
                   "str stage, float? scale, int? num_splits, int? max_seqlen, str kv_layout) -> (Tensor, Tensor)")
    for device in ("CPU", "CUDA"):
        library.impl("attention", _attention, device)
        library.impl("attention_backward", _attention_backward, device)
        library.impl("decode", _decode, device)
    torch.library.register_fake("wb::attention", _attention_fake, lib=library)
    torch.library.register_autograd("wb::attention", _attention_gradient, setup_context=_save_attention,
                                    lib=library)
    torch.library.register_fake("wb::attention_backward", _attention_backward_fake, lib=library)
    torch.library.register_autograd("wb::attention_backward", _refuse_double_backward, setup_context=_save_nothing,
                                    lib=library)
    torch.library.register_fake("wb::decode", _decode_fake, lib=library)
    _LIBRARY = library


# ----------------------------------------------------------------------------------------------- wb::attention

def _attention(q, k, v, key_padding_mask, stage, causal, scale, check_finite, *variants):
    return attention_eager(q, k, v, key_padding_mask, stage=stage, causal=causal, scale=scale,
                           check_finite=check_finite, **_variant_kwargs(*variants))


def _attention_fake(q, k, v, key_padding_mask, stage, causal, scale, check_finite, *variants):
    # the checks that read shapes, dtypes and devices only: a fake tensor has no values
    inputs = validate_inputs(q, k, v, causal=causal, key_padding_mask=key_padding_mask, scale=scale)
    canonical_variants(q, k, **_variant_kwargs(*variants))
    lse_dtype = torch.float64 if q.dtype == torch.float64 else torch.float32
    return q.new_empty(q.shape), q.new_empty((inputs.B, inputs.H, inputs.Lq), dtype=lse_dtype)


def _keep_for_backward(ctx, q, k, v, key_padding_mask, out, lse, variant_tensors=()):
    """What both autograd paths save: the inputs, out and the LSE (never P: the backward recomputes it), and the
    variants' tensors (ALiBi slopes, bias, document ids, sinks) where the call has them."""
    ctx.save_for_backward(q, k, v, out, lse, key_padding_mask, *variant_tensors)
    ctx.mark_non_differentiable(lse)  # Backward.gradients takes dL/d(out) only
    # and no tensor of zeros for the LSE's unused gradient on every backward call (measured on the H100: a zeros
    # kernel and its allocation in each training step of a small problem)
    ctx.set_materialize_grads(False)


# the positions of the tensors among VARIANT_SCHEMA's arguments (the rest are numbers)
_VARIANT_TENSORS = (1, 2, 5, 6, 7)


def _save_attention(ctx, inputs, output):
    q, k, v, key_padding_mask, stage, causal, scale, _ = inputs[:8]
    variants = tuple(inputs[8:]) + (None,) * (VARIANT_ARGS - len(inputs[8:]))
    _stages.get_backward(stage)  # a stage without one is refused while tracing too, not first in the backward pass
    _keep_for_backward(ctx, q, k, v, key_padding_mask, *output, [variants[i] for i in _VARIANT_TENSORS])
    ctx.options = (stage, causal, scale)  # as the forward was called: canonical already
    ctx.variant_numbers = variants  # (its tensors are read back from saved_tensors)


def _saved_variants(ctx) -> list:
    variants = list(ctx.variant_numbers)
    for position, tensor in zip(_VARIANT_TENSORS, ctx.saved_tensors[6:]):
        variants[position] = tensor
    return variants


def _attention_gradient(ctx, dout, _dlse):
    nothing = (None,) * (8 + VARIANT_ARGS)
    if dout is None:  # (grads are not materialized: the loss did not depend on out)
        return nothing
    q, k, v, out, lse, key_padding_mask = ctx.saved_tensors[:6]
    variants = _saved_variants(ctx)
    dq, dk, dv, dbias, dsinks = torch.ops.wb.attention_backward(dout, q, k, v, out, lse, key_padding_mask,
                                                                *ctx.options, *variants)
    grads = [dq, dk, dv, *nothing[3:]]
    grads[8 + 2] = dbias if variants[2] is not None else None
    grads[8 + 7] = dsinks if variants[7] is not None else None
    return tuple(grads)


# ------------------------------------------------------------------------------------------ wb::attention_backward

def _attention_backward(dout, q, k, v, out, lse, key_padding_mask, stage, causal, scale, *variants):
    kwargs = _variant_kwargs(*variants)
    canonical = canonical_variants(q, k, **kwargs) if any(x is not None for x in kwargs.values()) else None
    call = AttentionCall(_stages.get_stage(stage), causal, scale)  # the forward validated these options
    if canonical is None:
        dq, dk, dv = run_backward(call, q, k, v, out, lse, dout, key_padding_mask)
        return dq, dk, dv, q.new_empty(0), q.new_empty(0)
    call = AttentionCall(call.stage, causal, scale, canonical)
    dq, dk, dv, dbias, dsinks = run_backward(call, q, k, v, out, lse, dout, key_padding_mask)
    return (dq, dk, dv, q.new_empty(0) if dbias is None else dbias, q.new_empty(0) if dsinks is None else dsinks)


def _attention_backward_fake(dout, q, k, v, out, lse, key_padding_mask, stage, causal, scale, *variants):
    bias, sinks = _variant_kwargs(*variants)["bias"], _variant_kwargs(*variants)["sinks"]
    dbias = q.new_empty(0) if bias is None else bias.new_empty(bias.shape)
    dsinks = q.new_empty(0) if sinks is None else sinks.new_empty(sinks.shape)
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape), dbias, dsinks


def _save_nothing(ctx, inputs, output):
    pass


def _refuse_double_backward(ctx, *grads):
    raise RuntimeError(DOUBLE_BACKWARD)


class _DoubleBackwardRefused(torch.autograd.Function):
    """The gradients of :class:`EagerAttention` under ``create_graph=True``: unchanged, tied to what they depend on
    (q, k, v and dL/d(out)), and refusing with :data:`DOUBLE_BACKWARD` when differentiated (what the backward op's
    registered gradient does on the op's path). ``once_differentiable`` would not do: it ties the gradients to
    dL/d(out) only, which for a loss like ``out.sum()`` needs no gradient, and the penalty would vanish again."""

    @staticmethod
    def forward(ctx, dq, dk, dv, *depends_on):
        return dq.view_as(dq), dk.view_as(dk), dv.view_as(dv)

    @staticmethod
    def backward(ctx, *grads):
        raise RuntimeError(DOUBLE_BACKWARD)


class EagerAttention(torch.autograd.Function):
    """The same forward and backward as the registered op, as a plain ``autograd.Function``: what an eager call that
    needs a gradient runs (a compiler's tracing, ``torch.export`` and fake tensors take the op).

    Why both: the op's autograd formula (``register_autograd``) runs through ``torch.library``'s Python wrappers on
    every call, which cost about 165 µs per training step on a 2-core CPU against this class's few (a step of a tiny
    problem: 241 µs through the op, 77 µs through this class, 113 µs for SDPA), and a small call is nothing else.
    The arithmetic is one: both call :func:`wb_kernels.execution.run_forward` and
    :func:`wb_kernels.execution.run_backward` with one :class:`~wb_kernels.validation.AttentionCall`, and
    ``tests/test_autograd.py`` checks that their gradients agree bit for bit. Differentiating its gradients again
    (double backward) raises :data:`DOUBLE_BACKWARD`, as the op's path does.
    """

    @staticmethod
    def forward(ctx, q, k, v, key_padding_mask, bias, sinks, call, check_finite):
        # (bias and sinks are call.variants' own tensors, passed again so that autograd gives them gradients)
        out, lse = run_forward(call, q, k, v, key_padding_mask, check_finite=check_finite)
        _keep_for_backward(ctx, q, k, v, key_padding_mask, out, lse)
        ctx.call = call
        return out, lse

    @staticmethod
    def backward(ctx, dout, _dlse):
        if dout is None:  # (grads are not materialized: the loss did not depend on out)
            return (None,) * 8
        q, k, v, out, lse, key_padding_mask = ctx.saved_tensors
        dbias = dsinks = None
        if ctx.call.variants:
            dq, dk, dv, dbias, dsinks = run_backward(ctx.call, q, k, v, out, lse, dout, key_padding_mask)
        else:
            dq, dk, dv = run_backward(ctx.call, q, k, v, out, lse, dout, key_padding_mask)
        if torch.is_grad_enabled():  # create_graph=True: a loss may be built from these gradients
            dq, dk, dv = _DoubleBackwardRefused.apply(dq, dk, dv, q, k, v, dout)
        return dq, dk, dv, None, dbias, dsinks, None, None


# --------------------------------------------------------------------------------------------------- wb::decode

def _lse_dtype(q):
    return torch.float64 if q.dtype == torch.float64 else torch.float32


def _decode(q, k_cache, v_cache, cache_seqlens, block_table, stage, scale, num_splits, max_seqlen, kv_layout):
    out, lse = decode_eager(q, k_cache, v_cache, cache_seqlens, block_table=block_table, stage=stage, scale=scale,
                            num_splits=num_splits, max_seqlen=max_seqlen, kv_layout=kv_layout)
    # one dtype rule whatever kernel ran (the numba kernels compute float32): what the fake implementation promises
    return out.to(q.dtype), lse.to(_lse_dtype(q))


def _decode_fake(q, k_cache, v_cache, cache_seqlens, block_table, stage, scale, num_splits, max_seqlen, kv_layout):
    # the checks that read shapes, dtypes and devices only: a fake tensor has no values
    validate_decode_shapes(q, k_cache, v_cache, cache_seqlens, block_table=block_table, stage=stage, scale=scale,
                           kv_layout=kv_layout)
    B, H, D = q.shape
    return q.new_empty((B, H, D)), q.new_empty((B, H), dtype=_lse_dtype(q))
