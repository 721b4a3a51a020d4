"""Rung 08, ``backward``: the gradients of attention, from the float64 derivation to tensor cores.

This rung has no forward stage of its own: it gives the ``reference``, ``flash`` and ``mma`` stages their backward
passes (``BACKWARDS``, found by :func:`wb_kernels.stages.available_backwards`), so that ``wb.attention`` is
differentiable with them.

Lesson: ``notebooks/08_backward.ipynb``; tests: ``tests/test_backward.py``.
"""

from ...reference import reference_backward, reference_gradients
from ...variants import fields_of
from .. import Backward
from .cuda_cores import flash_gradients
from .launcher import mma_gradients
from .versions import VERSIONS  # noqa: F401  (its kept versions by name: versions.py, NOTES.md)


def _reference_gradients(q, k, v, out, lse, dout, *, causal=False, key_padding_mask=None, scale=None, variants=None):
    if variants:  # a dict with the bias's and the sinks' gradients too (wb_kernels.execution.run_backward)
        return reference_gradients(q, k, v, dout, causal=causal, key_padding_mask=key_padding_mask, scale=scale,
                                   **fields_of(variants))
    return reference_backward(q, k, v, dout, causal=causal, key_padding_mask=key_padding_mask, scale=scale)


BACKWARDS = (
    Backward("reference", "float64 NumPy: P recomputed in full, O(L^2) memory", _reference_gradients),
    Backward("flash", "CUDA cores, numba: preprocess for D, KV-stationary dK/dV, Q-stationary dQ; deterministic",
             flash_gradients),
    Backward("mma", "tensor cores, mma.sync: preprocess for D, KV-stationary dK/dV, Q-stationary dQ; deterministic",
             mma_gradients),
)
