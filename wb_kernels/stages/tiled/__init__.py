"""Rung 03, ``tiled``: the naive rung's three steps with shared-memory tiles (numba.cuda), O(L²) memory.

- ``kernel.py``: the tiled kernels, their launcher ``tiled_forward`` and the stage registration (``STAGE``);
- ``slider.py``: the logic behind the lesson's figures and tile-size slider;
- ``tune.py``: every tile size checked, then timed against the naive stage on a GPU
  (``python -m wb_kernels.stages.tiled.tune``);
- ``NOTES.md``: versions, predictions and measurements.

Lesson: ``notebooks/03_tiled.ipynb``; tests: ``tests/test_tiled.py``.
"""

from .kernel import STAGE
from .versions import VERSIONS  # noqa: F401  (its kept versions by name: versions.py, NOTES.md)

__all__ = ["STAGE"]
