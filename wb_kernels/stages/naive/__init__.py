"""Rung 02, ``naive``: attention as three numba.cuda kernels (S = QKᵀ, row softmax, P·V), O(L²) memory.

- ``kernel.py``: the kernels, their launcher ``naive_forward`` and the stage registration (``STAGE``);
- ``slider.py``: the logic behind the lesson's figures and slider (pytest calls it without a browser);
- ``traffic.py``: the kernels' DRAM traffic under Nsight Compute, on a GPU
  (``python -m wb_kernels.stages.naive.traffic``, writes ``results/naive/traffic.json``);
- ``NOTES.md``: versions, predictions and measurements.

Lesson: ``notebooks/02_naive.ipynb``; tests: ``tests/test_naive.py``.
"""

from .kernel import STAGE
from .versions import VERSIONS  # noqa: F401  (its kept versions by name: versions.py, NOTES.md)

__all__ = ["STAGE"]
