"""The flash rung's kept versions, runnable by name (lesson 04; NOTES.md, "Versions: prediction and measurement").

``VERSIONS[name](q, k, v, *, causal=False, key_padding_mask=None, scale=None)`` returns ``(out, lse)`` in the
caller's kind (float32 inputs; no validation, which ``wb.attention`` does):

- ``"v0"``: one query row per thread (``one_row_per_thread.py``, the lesson's first kernel). It predates grouped-query
  attention and the bottom-right causal alignment, and refuses both.
- ``"v3-tiles"``: the register-blocked kernel with version 3's tile shapes (D = 64: 128 x 64 tiles, 8 rows x 8 keys
  per thread; D = 128: 64 x 64 tiles, 16 threads per row), run with the current kernel's arithmetic (versions 5 and
  7), so that it differs from ``"v7"`` in the tiles alone. On the simulator it runs the simulator's small tiles, as
  every entry does.
- ``"v7"``: what ``stage="flash"`` runs: version 4's tiles at D = 128, the float64 log of the row sum (5), and the
  exponent exp2((x - m) c) with masked scores marked by the lowest float32 (7, which replaced 6's stored m*c).

Versions 1, 2, 4, 5 and 6 are history only (:data:`HISTORY_ONLY`): 1 and 2 are the register blocking before the index
fixes that made it fast, whose code is gone; 4 is ``"v7"``'s tiles, 5's arithmetic is part of 7, and 6's stored m*c
was replaced by 7's exponent (it took very negative scores for masked ones).
"""

from __future__ import annotations

from ...reference import causal_offset
from ..naive.versions import in_callers_kind
from .kernel import BACKEND, FlashConfig, config_for, flash_forward
from .one_row_per_thread import one_row_forward

__all__ = ["VERSIONS", "DEFAULT_VERSION", "HISTORY_ONLY", "V3_CONFIGS"]

# version 3's tile shapes (NOTES.md): D = 64 is the stage's own; D = 128 had 64 x 64 tiles and 16 threads per row
V3_CONFIGS = {64: FlashConfig(128, 64, 8, 8, 1), 128: FlashConfig(64, 64, 4, 16, 2)}


def _one_row(q, k, v, *, causal=False, key_padding_mask=None, scale=None):
    if k.shape[1] != q.shape[1]:
        raise ValueError(f"flash version v0 predates grouped-query attention: k and v need q's {q.shape[1]} heads, "
                         f"got {k.shape[1]}")
    offset = causal_offset(causal, q.shape[2], k.shape[2])  # None: not causal; 0: top-left (or Lq = Lk)
    if offset not in (None, 0):
        raise ValueError("flash version v0 knows only the top-left causal alignment (causal=True or 'top_left'; "
                         "'bottom_right' only where Lq = Lk)")
    return one_row_forward(q, k, v, causal=offset is not None, key_padding_mask=key_padding_mask, scale=scale)


def _v3_tiles(q, k, v, *, causal=False, key_padding_mask=None, scale=None):
    D = q.shape[-1]
    config = config_for(D) if BACKEND.is_simulator else V3_CONFIGS.get(D, config_for(D))
    return flash_forward(q, k, v, causal=causal, key_padding_mask=key_padding_mask, scale=scale, config=config)


VERSIONS = {
    "v0": in_callers_kind(_one_row),
    "v3-tiles": in_callers_kind(_v3_tiles),
    "v7": in_callers_kind(flash_forward),
}
DEFAULT_VERSION = "v7"  # what stage="flash" runs
HISTORY_ONLY = ("v1", "v2", "v4", "v5", "v6")
