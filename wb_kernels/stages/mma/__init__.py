"""Rung 06, ``mma``: FlashAttention-2 by hand on tensor cores with PTX ``mma.sync``, built with ``load_inline``.

- ``fragments.py``: which lane of a warp holds which element of the A, B and C/D operands of
  ``mma.sync.aligned.m16n8k16`` (fp16/bf16 in, fp32 accumulate), as the PTX ISA documents them, what ``ldmatrix.x4``
  delivers, and why the accumulator of S = Q Kᵀ can be reused in registers as the A operand of P V;
- ``swizzle.py``: where a tile's 16-byte chunks land in shared memory (plain, padded, XOR-swizzled) and what each
  layout costs an ``ldmatrix`` phase;
- ``warp_model.py``: the kernel's arithmetic register by register in NumPy, checked against the reference;
- ``slider.py``, ``exercises.py``, ``solutions.py``: the lesson's figures and slider, its exercises and puzzle, and
  the worked answers;
- ``flash_mma.cu``: the kernel and its torch launcher (the lesson shows it region by region);
- ``build.py``: the kernel described to the shared :mod:`wb_kernels.cuda_build`: its build, the learner's edits,
  the compile report of every launch variant and the instruction counts of its key loop, without a GPU;
- ``launcher.py``: the Python side (``forward``, the tuned launch variants) and the stage registration (``STAGE``);
- ``tune.py``: launch variants built, checked and timed on a GPU (``python -m wb_kernels.stages.mma.tune``);
- ``NOTES.md``: versions, predictions and measurements.

Lesson: ``notebooks/06_mma.ipynb``; tests: ``tests/test_mma.py``.
"""

from .launcher import STAGE
from .versions import VERSIONS  # noqa: F401  (its kept versions by name: versions.py, NOTES.md)

__all__ = ["STAGE"]
