"""Rung 06, ``mma`` (in progress): FlashAttention-2 by hand on tensor cores with PTX ``mma.sync``.

So far this folder holds the teaching model the lesson will start from:

- ``fragments.py``: which lane of a warp holds which element of the A, B and C/D operands of
  ``mma.sync.aligned.m16n8k16`` (fp16/bf16 in, fp32 accumulate), as the PTX ISA documents them, what ``ldmatrix.x4``
  delivers, and why the accumulator of S = Q Kᵀ can be reused in registers as the A operand of P V.

The kernel, its launcher and ``STAGE``, the lesson (``notebooks/06_mma.ipynb``, before the benchmark dashboard) and
the rest of the folder come next; until then the registry does not list this rung (there is no ``STAGE``).
"""
