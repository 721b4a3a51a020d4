"""The attention variants real models use, as one set of named values that every entry point carries (lesson 11_triton;
``wb.attention``, ``wb.reference``, ``wb.check``, ``wb.check_gradients`` and the registered op).

Every rung computes softmax(scale · q kᵀ) v with a causal or key-padding mask. The models learners meet change that
one formula in a few places; each change is one field of :class:`Variants`:

==================  ========================================================  =====================================
field               what it does to row i's scores s_ij (after scale)          used by
==================  ========================================================  =====================================
``softcap``         s ← softcap · tanh(s / softcap), before any bias           Gemma 2 (50.0), Grok
``alibi_slopes``    s ← s − slope_h · |i + offset − j|  (H,) or (B, H)         BLOOM, MPT (Press et al., 2022)
``bias``            s ← s + bias[b, h, i, j], broadcast over size-1 dims      T5 relative bias, learned biases
``window``          keys with −left ≤ j − (i + offset) ≤ right only           Mistral, Gemma 2/3, gpt-oss
``document_ids``    keys of the query's own document only                     packed training sequences
``sinks``           exp(sink_h) joins each row's denominator, no value        gpt-oss (learnable, one per head)
==================  ========================================================  =====================================

The order is fixed and the reference, the Triton kernels and the PyTorch-ops version in the tests all follow it:
scale, then softcap, then ALiBi and the bias tensor, then the masks (causal, key padding, window, documents) set
masked scores to −inf, then the softmax with the sinks in its denominator. Gemma 2 caps the scaled score and then adds
its mask, which is this order; a bias added before capping would be squashed by the tanh, a different model.

``offset`` is the diagonal of :func:`wb_kernels.reference.causal_offset`: 0 ("top_left", and without causal),
Lk − Lq with ``causal="bottom_right"``, so a sliding window and ALiBi follow the causal alignment a call names.

A sink is a logit with no value (gpt-oss; not StreamingLLM's sink *tokens*, which are a mask: the first keys always
visible, written with ``document_ids`` or a custom mask in lesson 11). A row's LSE includes its sink:
lse_i = log(exp(sink_h) + Σ_j exp(s_ij)), so a row that sees no key gets output 0 and LSE = sink_h (−inf without
sinks, as everywhere). Gradients: ``bias`` (summed over its broadcast dimensions) and ``sinks`` are differentiable
through ``wb.attention``; ``alibi_slopes``, ``window``, ``softcap`` and ``document_ids`` are not.

Packed documents: ``document_ids`` holds one integer per position, ``(B, L)`` for q and k alike when Lq = Lk, or a
pair ``(q_ids (B, Lq), k_ids (B, Lk))``; query i sees key j only when their ids are equal. flash-attn's varlen layout
(``cu_seqlens``: the offsets where each sequence starts, all packed into one) becomes ids with
:func:`document_ids_from_cu_seqlens`; ``wb.attention_varlen`` takes that layout itself.

This module is the floor beside :mod:`wb_kernels.arguments`: it imports nothing of the package but that and
:mod:`wb_kernels.device`. Each error names the argument, the value it got and what is accepted.
"""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass, fields
from typing import Optional

import numpy as np

from .arguments import dtype_name, device_of, kind_of
from .device import is_torch

__all__ = ["Variants", "VARIANT_NAMES", "canonical_variants", "canonical_window", "canonical_softcap",
           "document_ids_from_cu_seqlens", "NO_VARIANTS"]

VARIANT_NAMES = ("softcap", "alibi_slopes", "bias", "window", "document_ids", "sinks")
# the variants whose values a gradient flows into (wb.attention returns their gradients through autograd)
DIFFERENTIABLE = ("bias", "sinks")


@dataclass(frozen=True)
class Variants:
    """The variants of one call in canonical form (None = not used). Build it with :func:`canonical_variants`."""

    softcap: Optional[float] = None
    alibi_slopes: object = None  # tensor/array (B, H), float
    bias: object = None  # tensor/array broadcastable to (B, H, Lq, Lk): each dim its size or 1
    window: Optional[tuple] = None  # (left, right): ints >= 0, or None for an unbounded side
    document_ids: Optional[tuple] = None  # (q_ids (B, Lq), k_ids (B, Lk)), integer
    sinks: object = None  # tensor/array (H,), float

    def used(self) -> tuple:
        """The names of the variants this call uses, in :data:`VARIANT_NAMES` order."""
        return tuple(name for name in VARIANT_NAMES if getattr(self, name) is not None)

    def __bool__(self) -> bool:
        return bool(self.used())

    def describe(self) -> str:
        return ", ".join(self.used()) or "none"


NO_VARIANTS = Variants()


def _float_array(name: str, x, shape_text: str):
    if not (is_torch(x) or isinstance(x, np.ndarray)):
        raise TypeError(f"{name}: expected a float NumPy array or torch tensor of shape {shape_text}, "
                        f"got {type(x).__name__}")
    if not dtype_name(x).startswith(("float", "bfloat")):
        raise TypeError(f"{name}: expected a floating-point dtype, got {dtype_name(x)}")


def _same_kind_and_device(name: str, x, q) -> None:
    if kind_of(x) != kind_of(q):
        raise TypeError(f"{name}: expected a {kind_of(q)} as q is, got a {kind_of(x)}")
    if device_of(x) != device_of(q):
        raise ValueError(f"{name}: is on {device_of(x)} but q, k, v are on {device_of(q)}; put it on their device")


def canonical_window(window) -> Optional[tuple]:
    if window is None:
        return None
    expected = ("an int w >= 0 (w keys on each side of the diagonal) or a pair (left, right) of ints >= 0 or None "
                "(None = unbounded on that side)")
    sides = (window, window) if isinstance(window, numbers.Integral) and not isinstance(window, bool) else window
    if not isinstance(sides, (tuple, list)) or len(sides) != 2:
        raise TypeError(f"window: expected {expected}, got {window!r}")
    canonical = []
    for side in sides:
        if side is None:
            canonical.append(None)
            continue
        if isinstance(side, bool) or not isinstance(side, numbers.Integral):
            raise TypeError(f"window: expected {expected}, got {window!r}")
        if side < 0:
            raise ValueError(f"window: expected {expected}, got {window!r} (a negative side sees no key at all: "
                             f"use a mask for that)")
        canonical.append(int(side))
    if canonical == [None, None]:
        return None  # no window at all
    return tuple(canonical)


def canonical_softcap(softcap) -> Optional[float]:
    if softcap is None:
        return None
    if isinstance(softcap, bool) or not isinstance(softcap, numbers.Real):
        raise TypeError(f"softcap: expected a finite number > 0 or None, got {softcap!r} of type "
                        f"{type(softcap).__name__}")
    if not (math.isfinite(float(softcap)) and softcap > 0):
        raise ValueError(f"softcap: expected a finite number > 0 or None (scores become softcap * tanh(s / softcap)), "
                         f"got {softcap!r}")
    return float(softcap)


def _document_ids(document_ids, q, B: int, Lq: int, Lk: int) -> Optional[tuple]:
    if document_ids is None:
        return None
    if isinstance(document_ids, (tuple, list)):
        if len(document_ids) != 2:
            raise TypeError(f"document_ids: expected one integer array (B, L) (when Lq = Lk) or a pair "
                            f"(q_ids (B, Lq), k_ids (B, Lk)), got a sequence of {len(document_ids)}")
        q_ids, k_ids = document_ids
    else:
        if Lq != Lk:
            raise ValueError(f"document_ids: one array serves q and k only when Lq = Lk, here Lq={Lq}, Lk={Lk}; "
                             f"pass a pair (q_ids (B, Lq), k_ids (B, Lk))")
        q_ids = k_ids = document_ids
    for name, ids, L in (("q_ids", q_ids, Lq), ("k_ids", k_ids, Lk)):
        if not (is_torch(ids) or isinstance(ids, np.ndarray)):
            raise TypeError(f"document_ids ({name}): expected an integer array of shape (B, L)=({B}, {L}), got "
                            f"{type(ids).__name__}")
        if tuple(ids.shape) != (B, L):
            raise ValueError(f"document_ids ({name}): expected shape (B, L)=({B}, {L}), got {tuple(ids.shape)}")
        if not dtype_name(ids).startswith(("int", "uint")):
            raise TypeError(f"document_ids ({name}): expected an integer dtype, got {dtype_name(ids)}")
        _same_kind_and_device(f"document_ids ({name})", ids, q)
    return q_ids, k_ids


def _broadcast_shape_ok(shape: tuple, full: tuple) -> bool:
    return len(shape) == 4 and all(s in (1, f) for s, f in zip(shape, full)) and shape[3] == full[3]


def canonical_variants(q, k, *, softcap=None, alibi_slopes=None, bias=None, window=None, document_ids=None,
                       sinks=None) -> Variants:
    """Check each variant against q (B, H, Lq, D) and k (B, Hk, Lk, D) and return them in canonical form.

    Raises a TypeError or ValueError that names the argument, the value it got and what is accepted. Arrays must be
    of q's kind (NumPy or torch) and on q's device. ``alibi_slopes`` of shape (H,) becomes (B, H) (a broadcast view);
    ``window`` w becomes (w, w); ``document_ids`` one array becomes the pair (ids, ids).
    """
    B, H, Lq, _ = q.shape
    Lk = k.shape[2]
    if alibi_slopes is not None:
        _float_array("alibi_slopes", alibi_slopes, f"(H,)=({H},) or (B, H)=({B}, {H})")
        _same_kind_and_device("alibi_slopes", alibi_slopes, q)
        shape = tuple(alibi_slopes.shape)
        if shape == (H,):
            alibi_slopes = alibi_slopes[None, :].expand(B, H) if is_torch(alibi_slopes) \
                else np.broadcast_to(alibi_slopes[None, :], (B, H))
        elif shape != (B, H):
            raise ValueError(f"alibi_slopes: expected shape (H,)=({H},) or (B, H)=({B}, {H}), got {shape}")
    if bias is not None:
        full = (B, H, Lq, Lk)
        _float_array("bias", bias, f"(B, H, Lq, Lk)={full} (size-1 B, H or Lq broadcast)")
        _same_kind_and_device("bias", bias, q)
        if not _broadcast_shape_ok(tuple(bias.shape), full):
            raise ValueError(f"bias: expected a shape that broadcasts to (B, H, Lq, Lk)={full}, each of B, H and Lq "
                             f"its size or 1 and Lk in full, got {tuple(bias.shape)}")
    if sinks is not None:
        _float_array("sinks", sinks, f"(H,)=({H},)")
        _same_kind_and_device("sinks", sinks, q)
        if tuple(sinks.shape) != (H,):
            raise ValueError(f"sinks: expected one logit per query head, shape (H,)=({H},), got {tuple(sinks.shape)}")
    return Variants(softcap=canonical_softcap(softcap), alibi_slopes=alibi_slopes, bias=bias, window=canonical_window(window),
                    document_ids=_document_ids(document_ids, q, B, Lq, Lk), sinks=sinks)


def document_ids_from_cu_seqlens(cu_seqlens, total: int):
    """Document ids (one per packed position, 0, 0, ..., 1, 1, ...) from flash-attn's ``cu_seqlens``: the offsets
    [0, L_0, L_0 + L_1, ..., total] where each packed sequence starts. Positions past the last offset get id −1 (padding,
    which then sees only padding). NumPy arrays and torch tensors; the result has cu_seqlens' kind and device."""
    offsets = cu_seqlens
    if is_torch(offsets):
        import torch

        positions = torch.arange(total, device=offsets.device)
        ids = torch.searchsorted(offsets.to(torch.int64), positions, right=True) - 1
        return torch.where(positions < offsets[-1], ids, torch.full_like(ids, -1))
    offsets = np.asarray(offsets, dtype=np.int64)
    positions = np.arange(total)
    ids = np.searchsorted(offsets, positions, side="right") - 1
    return np.where(positions < offsets[-1], ids, -1)


def fields_of(variants: Variants) -> dict:
    """The variants as keyword arguments (for passing a Variants on to a function that takes them by name)."""
    return {f.name: getattr(variants, f.name) for f in fields(variants)}
