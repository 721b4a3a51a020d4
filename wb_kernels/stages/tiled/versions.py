"""The tiled rung's kept versions, runnable by name (lesson 03; NOTES.md, "Versions" and "Tuning").

The kernels are one version (shared-memory tiles, the scores summed in blocks of 16); what the rung measured against
each other are its tile sides, so the table has one entry per side of ``TILE_SIZES``: ``"tile8"``, ``"tile16"``
(what ``stage="tiled"`` runs on a GPU) and ``"tile32"``. Each is called as
``VERSIONS[name](q, k, v, *, causal=False, key_padding_mask=None, scale=None)`` and returns ``(out, lse)`` in the
caller's kind, without the validation of ``wb.attention`` (float32 inputs). On the simulator a 32 x 32 tile runs
1,024 Python threads per block: keep the sizes tiny there.
"""

from __future__ import annotations

from ..naive.versions import in_callers_kind
from .kernel import DEFAULT_TILE, TILE_SIZES, tiled_forward

__all__ = ["VERSIONS", "DEFAULT_VERSION", "HISTORY_ONLY"]

VERSIONS = {f"tile{tile}": in_callers_kind(tiled_forward, tile=tile) for tile in TILE_SIZES}
DEFAULT_VERSION = f"tile{DEFAULT_TILE}"  # what stage="tiled" runs here (16 on a GPU, 8 on the simulator)
HISTORY_ONLY = ("scores summed in one chain",)  # the first kernel's dot products, before blocks of 16
