"""The naive rung's kept versions, runnable by name (lesson 02; NOTES.md, "Versions").

``VERSIONS[name](q, k, v, *, causal=False, key_padding_mask=None, scale=None)`` returns ``(out, lse)`` in the
caller's kind (NumPy for NumPy input, torch on the input's device for torch input), so that a learner can time one
version against the next in one cell::

    from wb_kernels.stages.naive import VERSIONS
    out, lse = VERSIONS["v3"](q, k, v, causal=True)

The entries call the kernels directly: no validation and no check of the inputs, which ``wb.attention`` does (float32
inputs of shape (B, H, L, D), K and V with H or fewer heads). Versions 1 and 2 (the dot products, then the
normaliser, summed in one chain) are history only: their code is not in the package (:data:`HISTORY_ONLY`).

:func:`in_callers_kind` is what every numba rung's table wraps its launchers in.
"""

from __future__ import annotations

from ... import device
from .kernel import naive_forward

__all__ = ["VERSIONS", "DEFAULT_VERSION", "HISTORY_ONLY", "in_callers_kind"]


def in_callers_kind(forward, **fixed):
    """`forward` (a launcher returning ``(out, lse)`` where the kernels run) with `fixed` keyword arguments, its
    results returned in the kind of the caller's ``q``."""
    def run(q, k, v, *, causal=False, key_padding_mask=None, scale=None):
        out, lse = forward(q, k, v, causal=causal, key_padding_mask=key_padding_mask, scale=scale, **fixed)
        return device.like_input(out, q), device.like_input(lse, q)

    settings = ", ".join(f"{key}={value!r}" for key, value in fixed.items())
    run.__name__ = forward.__name__
    run.__doc__ = f"{forward.__module__}.{forward.__name__}({settings}); (out, lse) in the caller's kind."
    return run


VERSIONS = {
    "v3": in_callers_kind(naive_forward),  # the lesson's kernels: sums of 16 products, the normaliser in blocks too
}
DEFAULT_VERSION = "v3"  # what stage="naive" runs
HISTORY_ONLY = ("v1", "v2")
