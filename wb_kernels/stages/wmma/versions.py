"""The wmma rung's kept versions, runnable by name (lesson 05; NOTES.md, "Versions: prediction and measurement").

The kernel in ``flash_wmma.cu`` is version 3: every launch variant of ``build.VARIANTS`` (warps per block, 16 or 32
query rows per warp, Q in registers or in shared memory), each with version 2's explicit ``.shared`` loads. Version
3 is the 32-row variants; a 16-row variant is version 1's and 2's shape. So the table has one entry per variant,
named ``w<warps>_r<rows per warp>_q<reg|smem>``: ``VERSIONS["w4_r16_qreg"]`` is version 1's launch,
``VERSIONS["w4_r32_qreg"]`` what ``stage="wmma"`` runs at D = 64, ``VERSIONS["w4_r16_qsmem"]`` at D = 128.
Each is ``(q, k, v, *, causal=False, key_padding_mask=None, scale=None) -> (out, lse)`` on CUDA torch tensors
(float16 or bfloat16, D 64 or 128), without ``wb.attention``'s validation. Version 1's bf16 path
(``wmma::load_matrix_sync``, 0.37-0.42x FLASH) is history only (:data:`HISTORY_ONLY`).
"""

from __future__ import annotations

import functools

from .build import VARIANTS
from .launcher import DEFAULT_VARIANT, forward

__all__ = ["VERSIONS", "DEFAULT_VERSION", "HISTORY_ONLY", "version_name"]


def version_name(variant) -> str:
    """The table's name of a launch variant ``(num_warps, q_in_registers, row_frags)``."""
    num_warps, q_in_registers, row_frags = variant
    return f"w{num_warps}_r{16 * row_frags}_q{'reg' if q_in_registers else 'smem'}"


VERSIONS = {version_name(variant): functools.partial(forward, variant=variant) for variant in VARIANTS}
DEFAULT_VERSION = {D: version_name(variant) for D, variant in DEFAULT_VARIANT.items()}  # what stage="wmma" runs
HISTORY_ONLY = ("v1 bf16 loads (wmma::load_matrix_sync)",)
