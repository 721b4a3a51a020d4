"""The backward rung's kept versions, runnable by name (lesson 08; NOTES.md, "Versions").

``VERSIONS[name](q, k, v, out, lse, dout, *, causal=False, key_padding_mask=None, scale=None)`` returns
``(dq, dk, dv)`` from the forward's ``out`` and ``lse``, without ``wb.attention_backward``'s validation:

- ``"cuda-cores"``: the flash stage's backward in numba (``cuda_cores.py``; float32, NumPy or torch, the simulator
  too), deterministic;
- ``"v1"``: the mma stage's backward on tensor cores, three kernels, deterministic (what ``wb.attention`` runs);
- ``"v2"``: one kernel, dQ added up by fp32 atomics, 128 keys per block (not bitwise reproducible);
- ``"v2/64"``: the same with 64 keys per block (NOTES.md measures both).

The tensor-core entries take CUDA torch tensors in float16 or bfloat16 with D 64 or 128. No version is history only.
"""

from __future__ import annotations

from ... import device
from .build import Variant
from .cuda_cores import flash_gradients
from .launcher import mma_gradients

__all__ = ["VERSIONS", "DEFAULT_VERSION", "HISTORY_ONLY"]


def _cuda_cores(q, k, v, out, lse, dout, *, causal=False, key_padding_mask=None, scale=None):
    grads = flash_gradients(q, k, v, out, lse, dout, causal=causal, key_padding_mask=key_padding_mask, scale=scale)
    return tuple(device.like_input(g, q) for g in grads)


def _mma(version, block_n=None):
    def run(q, k, v, out, lse, dout, *, causal=False, key_padding_mask=None, scale=None):
        D = q.shape[-1]
        variant = version if block_n is None else Variant(version, D, 64 if D == 64 else 32, block_n)
        return mma_gradients(q, k, v, out, lse, dout, causal=causal, key_padding_mask=key_padding_mask,
                             scale=scale, variant=variant)

    run.__name__ = f"mma_gradients_{version}" + (f"_{block_n}" if block_n else "")
    run.__doc__ = f"mma_gradients with version {version}" + (f", {block_n} keys per block" if block_n else "") + "."
    return run


VERSIONS = {
    "cuda-cores": _cuda_cores,
    "v1": _mma("v1"),
    "v2": _mma("v2"),
    "v2/64": _mma("v2", block_n=64),
}
DEFAULT_VERSION = {"flash": "cuda-cores", "mma": "v1"}  # what wb.attention's gradients run for each stage
HISTORY_ONLY = ()
