"""``wb.attention`` as a PyTorch operator with a gradient: ``torch.ops.wb.attention`` and
``torch.ops.wb.attention_backward`` (lesson 08_backward; every lesson that trains or compiles through ``wb.attention``).

Registered with ``torch.library.Library`` (``define`` + ``impl``), ``register_fake`` and ``register_autograd``:

- the real implementation (CPU and CUDA) validates and runs a stage's forward as ``wb.attention``'s direct path does
  (:func:`wb_kernels.api.run_forward`), the NaN/Inf pass included. It is opaque to the compiler, so
  ``torch.compile(fullgraph=True)`` and ``torch.export`` never trace into NumPy or numba code;
- the fake implementation only says what comes out (shapes and dtypes), so meta and fake tensors work;
- the autograd formula saves q, k, v, out and the LSE (never P: the backward recomputes it) and calls the backward
  op, whose real implementation is the stage's registered :class:`~wb_kernels.stages.Backward`.

An eager call that needs a gradient runs :class:`EagerAttention` instead, the same arithmetic as a plain
``autograd.Function``: the op's Python wrappers cost more than a small call's whole device work (its docstring).

A ``Library`` op costs about half what ``@torch.library.custom_op`` costs per call (FACTS: 14 against 31 µs on the
H100 host), which matters for a call that takes tens of microseconds. This module imports torch, so the package
imports it only when torch tensors reach ``wb.attention`` (``import wb_kernels`` works without torch).
"""

from __future__ import annotations

import torch

from . import api
from .stages import get_backward
from .validation import validate_inputs

__all__ = ["register", "registered", "EagerAttention"]

_LIBRARY = None  # the torch.library.Library, once registered: one registration per process


def register() -> None:
    """Define ``wb::attention`` and ``wb::attention_backward`` (once per process; later calls return at once)."""
    global _LIBRARY
    if _LIBRARY is not None:
        return
    library = torch.library.Library("wb", "DEF")
    # causal travels as a string ("" = no mask): the schema has no type for "False or a name"
    library.define("attention(Tensor q, Tensor k, Tensor v, Tensor? key_padding_mask, str stage, str causal, "
                   "float? scale, bool check_finite) -> (Tensor, Tensor)")
    library.define("attention_backward(Tensor dout, Tensor q, Tensor k, Tensor v, Tensor out, Tensor lse, "
                   "Tensor? key_padding_mask, str stage, str causal, float? scale) -> (Tensor, Tensor, Tensor)")
    for device in ("CPU", "CUDA"):
        library.impl("attention", _forward, device)
        library.impl("attention_backward", _backward, device)
    torch.library.register_fake("wb::attention", _forward_fake, lib=library)
    torch.library.register_fake("wb::attention_backward", _backward_fake, lib=library)
    torch.library.register_autograd("wb::attention", _gradient, setup_context=_save_for_backward, lib=library)
    _LIBRARY = library


def registered() -> bool:
    """Whether :func:`register` has run in this process."""
    return _LIBRARY is not None


def _options(causal: str, scale):
    return dict(causal=causal or False, scale=scale)


def _forward(q, k, v, key_padding_mask, stage, causal, scale, check_finite):
    options = _options(causal, scale)
    spec = api.validated(q, k, v, stage=stage, key_padding_mask=key_padding_mask, **options)
    return api.run_forward(spec, q, k, v, key_padding_mask=key_padding_mask, check_finite=check_finite, **options)


def _forward_fake(q, k, v, key_padding_mask, stage, causal, scale, check_finite):
    # the checks that read shapes, dtypes and devices only: a fake tensor has no values
    inputs = validate_inputs(q, k, v, key_padding_mask=key_padding_mask, **_options(causal, scale))
    lse_dtype = torch.float64 if q.dtype == torch.float64 else torch.float32
    return q.new_empty(q.shape), q.new_empty((inputs.B, inputs.H, inputs.Lq), dtype=lse_dtype)


def _backward(dout, q, k, v, out, lse, key_padding_mask, stage, causal, scale):
    return api.run_backward(get_backward(stage), q, k, v, out, lse, dout, key_padding_mask=key_padding_mask,
                            **_options(causal, scale))


def _backward_fake(dout, q, k, v, out, lse, key_padding_mask, stage, causal, scale):
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)


def _keep_for_backward(ctx, q, k, v, key_padding_mask, out, lse, stage, causal, scale):
    """What both autograd paths save: the inputs, out and the LSE (never P: the backward recomputes it)."""
    ctx.save_for_backward(q, k, v, out, lse, key_padding_mask)
    ctx.stage, ctx.causal, ctx.scale = stage, causal, scale
    ctx.mark_non_differentiable(lse)  # Backward.gradients takes dL/d(out) only
    # and no tensor of zeros for the LSE's unused gradient on every backward call (measured on the H100: a zeros
    # kernel and its allocation in each training step of a small problem)
    ctx.set_materialize_grads(False)


def _gradients(ctx, dout, backward):
    """The 8 gradients of the forward's arguments from `backward` (the op, or its real implementation)."""
    if dout is None:  # (grads are not materialized: the loss did not depend on out)
        return None, None, None, None, None, None, None, None
    q, k, v, out, lse, key_padding_mask = ctx.saved_tensors
    dq, dk, dv = backward(dout, q, k, v, out, lse, key_padding_mask, ctx.stage, ctx.causal, ctx.scale)
    return dq, dk, dv, None, None, None, None, None


def _save_for_backward(ctx, inputs, output):
    q, k, v, key_padding_mask, stage, causal, scale, _ = inputs
    get_backward(stage)  # a stage without one is refused while tracing too, not first in the backward pass
    _keep_for_backward(ctx, q, k, v, key_padding_mask, *output, stage, causal, scale)


def _gradient(ctx, dout, _dlse):
    return _gradients(ctx, dout, torch.ops.wb.attention_backward)


class EagerAttention(torch.autograd.Function):
    """The same forward and backward as the registered op, as a plain ``autograd.Function``: what an eager call that
    needs a gradient runs (a compiler's tracing, ``torch.export`` and fake tensors take the op).

    Why both: the op's autograd formula (``register_autograd``) runs through ``torch.library``'s Python wrappers on
    every call, which cost about 165 µs per training step on a 2-core CPU against this class's few (a step of a tiny
    problem: 241 µs through the op, 77 µs through this class, 113 µs for SDPA), and a small call is nothing else.
    The arithmetic is one: both call :func:`wb_kernels.api.run_forward` and :func:`wb_kernels.api.run_backward`,
    and ``tests/test_autograd.py`` checks that their gradients agree bit for bit.
    """

    @staticmethod
    def forward(ctx, q, k, v, key_padding_mask, spec, causal, scale, check_finite):
        out, lse = api.run_forward(spec, q, k, v, causal=causal, key_padding_mask=key_padding_mask, scale=scale,
                                   check_finite=check_finite)
        _keep_for_backward(ctx, q, k, v, key_padding_mask, out, lse, spec.name, causal or "", scale)
        return out, lse

    @staticmethod
    def backward(ctx, dout, _dlse):
        return _gradients(ctx, dout, _backward)
