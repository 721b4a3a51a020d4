"""The mma rung's kept versions, runnable by name (lesson 06; NOTES.md, "Versions").

``VERSIONS[name](q, k, v, *, causal=False, key_padding_mask=None, scale=None)`` returns ``(out, lse)`` on CUDA torch
tensors (float16 or bfloat16, D 64 or 128), without ``wb.attention``'s validation:

- ``"v1"``: 4 warps x 16 rows, Q in registers, 64-key tiles (the lesson's warp model);
- ``"v2"``: 4 warps x 32 rows, Q re-read from shared memory (128-key tiles at D = 64): what ``stage="mma"`` runs.

Both are launch variants of the one kernel in ``flash_mma.cu`` (``build.VARIANTS``; the others there are the tuning
run's alternatives, ``tune.py``), so no version of this rung is history only.
"""

from __future__ import annotations

from .build import Variant
from .launcher import DEFAULT_VARIANT, forward

__all__ = ["VERSIONS", "DEFAULT_VERSION", "HISTORY_ONLY", "VARIANT_OF"]

# each version's launch variant per head dim
VARIANT_OF = {"v1": {D: Variant(D, 4, 1, 64, True) for D in (64, 128)}, "v2": dict(DEFAULT_VARIANT)}


def _version(name):
    def run(q, k, v, *, causal=False, key_padding_mask=None, scale=None):
        D = q.shape[-1]
        if D not in VARIANT_OF[name]:
            raise ValueError(f"mma version {name} is compiled for head dims {sorted(VARIANT_OF[name])}, got {D}")
        return forward(q, k, v, causal=causal, key_padding_mask=key_padding_mask, scale=scale,
                       variant=VARIANT_OF[name][D])

    run.__name__ = f"mma_{name}"
    run.__doc__ = f"The mma kernel's version {name}: launcher.forward with VARIANT_OF[{name!r}][D]."
    return run


VERSIONS = {name: _version(name) for name in VARIANT_OF}
DEFAULT_VERSION = "v2"  # what stage="mma" runs
HISTORY_ONLY = ()
