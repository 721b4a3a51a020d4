"""Rung 05, ``wmma``: FlashAttention-2 on tensor cores, CUDA C++ with nvcuda::wmma, built with ``load_inline``.

- ``wmma_tile.cu`` and ``tile.py``: the lesson's first step, one 16 x 16 x 16 product by one warp;
- ``wmma_host.cuh``: a model of the WMMA API that runs on the CPU, against which the lesson's tile puzzle is graded
  on a laptop (``tile.host_product``);
- ``flash_wmma.cu``: the kernel and its torch launcher (the lesson shows it region by region, the kernel in
  consecutive pieces);
- ``build.py``: the kernel described to the shared :mod:`wb_kernels.cuda_build`: its build, the learner's edits,
  the compile report of every launch variant without a GPU;
- ``launcher.py``: the Python side (``forward``, the tuned launch variants) and the stage registration (``STAGE``);
- ``fragment_model.py``: the kernel's numerics in NumPy, rounding where the kernel rounds;
- ``slider.py``: the logic behind the lesson's figures and slider (rounding points, shared memory, tuning results);
- ``tune.py``: launch variants built, checked and timed on a GPU (``python -m wb_kernels.stages.wmma.tune``);
- ``NOTES.md``: versions, predictions and measurements.

The build machinery every CUDA C++ rung shares is :mod:`wb_kernels.cuda_build`.
Lesson: ``notebooks/05_wmma.ipynb``; tests: ``tests/test_wmma.py``.
"""

from .launcher import STAGE
from .versions import VERSIONS  # noqa: F401  (its kept versions by name: versions.py, NOTES.md)

__all__ = ["STAGE"]
