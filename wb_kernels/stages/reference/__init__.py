"""Rung 01, ``reference``: the float64 NumPy reference as a stage, so the ladder starts where lesson 01 does.

The reference itself (:mod:`wb_kernels.reference`) is shared: every check compares against it. This folder
holds what is lesson 01's own: the stage registration (here), the slider and figure logic (``slider.py``)
and the notes (``NOTES.md``). Lesson: ``notebooks/01_reference.ipynb``; tests: ``tests/test_reference.py``.
"""

from ...inputs import DTYPES
from ...reference import reference
from ...variants import NO_VARIANTS, VARIANT_NAMES, fields_of
from .. import Stage


def _forward(q, k, v, *, causal=None, key_padding_mask=None, scale=None, variants=NO_VARIANTS):
    """The reference as a stage: every variant (:mod:`wb_kernels.variants`), in float64."""
    return reference(q, k, v, causal=causal, key_padding_mask=key_padding_mask, scale=scale, **fields_of(variants))


STAGE = Stage(
    name="reference",
    lesson="01_reference",
    summary="float64 NumPy on the CPU, materializes S and P (O(L^2) memory)",
    forward=_forward,
    dtypes=tuple(DTYPES),  # every dtype the package knows
    # S and P in float64, plus the einsum's temporaries
    workspace_bytes=lambda B, H, Lq, Lk, D: 3 * 8 * B * H * Lq * Lk,
    order=1,
    variants=VARIANT_NAMES,
)
