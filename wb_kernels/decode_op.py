"""``wb.decode`` as a PyTorch operator: ``torch.ops.wb.decode`` (lesson 07; a decoder that compiles or captures
its step).

Registered with ``torch.library.Library`` (a fragment of the ``wb`` namespace that :mod:`wb_kernels.autograd`
defines), ``impl`` for CPU and CUDA, and ``register_fake``, as ``wb.attention``'s op is; decode has no gradient.

- the real implementation is :func:`wb_kernels.decoding.decode_eager`, validation included; its out comes back in
  q's dtype and its LSE in float32 (float64 for float64 inputs, stage "reference"), whatever kernel ran;
- the fake implementation runs the checks that read shapes, dtypes and devices only, and says what comes out, so
  ``torch.compile(fullgraph=True)`` traces a decode step without entering NumPy, numba or the extension, and
  meta/fake tensors work.

``wb.decode`` takes this path while a compiler traces and for fake or meta tensors; an eager call runs
``decode_eager`` directly (the op's Python wrappers cost more than a decode step's launch). Both are safe to capture
in a CUDA graph on a GPU (:mod:`wb_kernels.stages.decode.launcher`). This module imports torch.
"""

from __future__ import annotations

import torch

from . import decoding

__all__ = ["register", "registered"]

_LIBRARY = None  # the torch.library.Library fragment, once registered


def registered() -> bool:
    return _LIBRARY is not None


def register() -> None:
    """Define ``wb::decode`` (once per process; later calls return at once)."""
    global _LIBRARY
    if _LIBRARY is not None:
        return
    library = torch.library.Library("wb", "FRAGMENT")
    library.define("decode(Tensor q, Tensor k_cache, Tensor v_cache, Tensor cache_seqlens, Tensor? block_table, "
                   "str stage, float? scale, int? num_splits, int? max_seqlen, str kv_layout) -> (Tensor, Tensor)")
    for device in ("CPU", "CUDA"):
        library.impl("decode", _decode, device)
    torch.library.register_fake("wb::decode", _decode_fake, lib=library)
    _LIBRARY = library


def _lse_dtype(q):
    return torch.float64 if q.dtype == torch.float64 else torch.float32


def _decode(q, k_cache, v_cache, cache_seqlens, block_table, stage, scale, num_splits, max_seqlen, kv_layout):
    out, lse = decoding.decode_eager(q, k_cache, v_cache, cache_seqlens, block_table=block_table, stage=stage,
                                     scale=scale, num_splits=num_splits, max_seqlen=max_seqlen, kv_layout=kv_layout)
    # one dtype rule whatever kernel ran (the numba kernels compute float32): what the fake implementation promises
    return out.to(q.dtype), lse.to(_lse_dtype(q))


def _decode_fake(q, k_cache, v_cache, cache_seqlens, block_table, stage, scale, num_splits, max_seqlen, kv_layout):
    # the checks that read shapes, dtypes and devices only: a fake tensor has no values
    decoding._validate_shapes(q, k_cache, v_cache, cache_seqlens, block_table=block_table, stage=stage, scale=scale,
                              kv_layout=kv_layout)
    B, H, D = q.shape
    return q.new_empty((B, H, D)), q.new_empty((B, H), dtype=_lse_dtype(q))
