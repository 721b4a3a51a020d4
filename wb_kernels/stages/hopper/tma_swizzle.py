"""The TMA's 128-byte swizzle in NumPy, and why it is the mma rung's XOR (rung ``hopper``, v0 (a)).

A tensor map with ``CU_TENSOR_MAP_SWIZZLE_128B`` makes the copy engine write each box into shared memory with the
bits of every byte address permuted: bits 4-6 (which 16-byte chunk of a 128-byte line) are XORed with bits 7-9
(which line of an aligned group of eight, that is row % 8 when rows are 128 bytes):

    stored = offset ^ (((offset >> 7) & 7) << 4)          (offset from a 1024-byte aligned start)

For a box whose rows are exactly 128 bytes (64 fp16/bf16 elements, what this rung uses everywhere) that is
"chunk c of row r goes to chunk c ^ (r % 8) of the same row": the XOR :func:`wb_kernels.stages.mma.swizzle.swizzled_offset`
computes for the mma rung's cp.async tiles at D = 64. :func:`swizzled_image` builds the shared-memory image both
ways and the tests hold them equal, and equal to what the GPU's TMA wrote (``lab.tma_tile``). The wgmma descriptor's
swizzle mode 1 reads the same layout back (``hopper_primitives_lab.cuh``, region ``wgmma_descriptor``).

Sources: NVIDIA, *CUDA C++ Programming Guide*, "Tensor Memory Access" (swizzle modes); CUDA Driver API,
``cuTensorMapEncodeTiled``; *PTX ISA*, "cp.async.bulk.tensor" and the wgmma "Matrix Descriptor Format".
"""

from __future__ import annotations

import numpy as np

from ..mma import swizzle as mma_swizzle

__all__ = ["BOX_ROWS", "BOX_COLUMNS", "ROW_BYTES", "swizzle_128b", "tma_box", "swizzled_image", "swizzled_image_by_bits"]

ROW_BYTES = 128  # the swizzle's span: a box row of 64 16-bit elements
BOX_COLUMNS = ROW_BYTES // 2
BOX_ROWS = 64  # the lab kernel's box: 64 x 64 elements, 8 KB


# region: swizzle_128b
def swizzle_128b(offset):
    """Where byte `offset` of a box (counted from a 1024-byte aligned start) is stored: bits 4-6 XOR bits 7-9."""
    offset = np.asarray(offset)
    return offset ^ (((offset >> 7) & 7) << 4)
# endregion


def tma_box(x, row0: int, column0: int, rows: int = BOX_ROWS, columns: int = BOX_COLUMNS) -> np.ndarray:
    """The box the copy engine reads: x[row0:row0 + rows, column0:column0 + columns], zeros where it leaves x."""
    x = np.asarray(x)
    box = np.zeros((rows, columns), dtype=x.dtype)
    r1, c1 = min(row0 + rows, x.shape[0]), min(column0 + columns, x.shape[1])
    if r1 > row0 and c1 > column0:
        box[:r1 - row0, :c1 - column0] = x[row0:r1, column0:c1]
    return box


def swizzled_image(box) -> np.ndarray:
    """Shared memory after the copy, flat in elements, through the mma rung's chunk XOR (rows of 64 elements)."""
    return mma_swizzle.store_tile(np.asarray(box), "swizzled")


def swizzled_image_by_bits(box) -> np.ndarray:
    """The same image through the address-bit formula :func:`swizzle_128b`, element by element."""
    box = np.asarray(box)
    rows, columns = box.shape
    if columns * 2 != ROW_BYTES:
        raise ValueError(f"rows of {columns} elements: this model takes 128-byte rows (64 16-bit elements)")
    row, column = np.meshgrid(np.arange(rows), np.arange(columns), indexing="ij")
    stored = swizzle_128b(row * ROW_BYTES + column * 2) // 2
    image = np.zeros(rows * columns, dtype=box.dtype)
    image[stored.ravel()] = box.ravel()
    return image
