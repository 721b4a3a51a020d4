"""Rung 04, ``flash``: FlashAttention-2's loop order and online softmax on CUDA cores (numba.cuda), O(L) memory.

- ``online_softmax.py``: the NumPy derivation the lesson starts from (two-pass, online, blockwise);
- ``one_row_per_thread.py``: the first kernel, one query row per thread (the lesson's step before register blocking);
- ``kernel.py``: the kernel factory, its launcher ``flash_forward`` and the stage registration (``STAGE``);
- ``region_cells.py``: lets the lesson show a kernel factory in consecutive regions, each cell editable, and rebuild
  the factory from them;
- ``slider.py``: the logic behind the lesson's figures and sliders (memory, tile schedule, one tile step);
- ``tune.py``: tile shapes built, checked and timed on a GPU (``python -m wb_kernels.stages.flash.tune``);
- ``rounding_emulation.py``: the kernel's float32 rounding replayed in NumPy (why the max is stored as m·c);
- ``NOTES.md``: versions, predictions and measurements.

Lesson: ``notebooks/04_flash.ipynb``; tests: ``tests/test_flash.py``.
"""

from . import one_row_per_thread  # noqa: F401  (registers its kernels, so CI compiles them)
from .kernel import STAGE
from .versions import VERSIONS  # noqa: F401  (its kept versions by name: versions.py, NOTES.md)

__all__ = ["STAGE"]
