"""Which lane holds which element: the register layouts of ``mma.sync.aligned.m16n8k16`` in NumPy (rung ``mma``).

One warp computes D (16 x 8, fp32) = A (16 x 16, fp16/bf16) B (16 x 8) + C. Unlike WMMA's fragments, whose layout
is opaque, PTX documents where every element lives (PTX ISA, "Matrix Fragments for mma.m16n8k16 with floating
point type"). With ``group = lane // 4`` and ``t = lane % 4``:

- A: lane holds a0..a7; row ``group`` for a0, a1, a4, a5 and ``group + 8`` for the others; column ``2t + (i & 1)``,
  plus 8 for a4..a7;
- B: lane holds b0..b3; row (k) ``2t + (i & 1)``, plus 8 for b2, b3; column (n) ``group``;
- C and D: lane holds c0..c3; row ``group`` for c0, c1 and ``group + 8`` for c2, c3; column ``2t + (i & 1)``.

Two facts the FlashAttention-2 kernel is built on follow, and the tests check them: each row of C is held by the
four lanes of one group (a row's max or sum takes two shuffles, ``xor 1`` and ``xor 2``); and the C fragments of
two neighbouring 16 x 8 tiles of S are, register for register, the A fragment of the 16 x 16 tile of P that the
next ``mma`` multiplies with V: P never leaves registers.
"""

from __future__ import annotations

import numpy as np

__all__ = ["a_coords", "b_coords", "c_coords", "distribute", "gather", "mma_m16n8k16", "ldmatrix_x4",
           "accumulator_as_a_operand"]

LANES = 32


def a_coords(lane: int) -> list:
    """(row, col) of a0..a7 in the 16 x 16 A tile."""
    group, t = lane // 4, lane % 4
    return [(group + (8 if i in (2, 3, 6, 7) else 0), 2 * t + (i & 1) + (8 if i >= 4 else 0)) for i in range(8)]


def b_coords(lane: int) -> list:
    """(k, n) of b0..b3 in the 16 x 8 B tile."""
    group, t = lane // 4, lane % 4
    return [(2 * t + (i & 1) + (8 if i >= 2 else 0), group) for i in range(4)]


def c_coords(lane: int) -> list:
    """(row, col) of c0..c3 in the 16 x 8 C/D tile."""
    group, t = lane // 4, lane % 4
    return [(group + (8 if i >= 2 else 0), 2 * t + (i & 1)) for i in range(4)]


def distribute(matrix, coords) -> np.ndarray:
    """(32, n) array: lane l's registers, element i at ``coords(l)[i]`` of `matrix`."""
    matrix = np.asarray(matrix)
    return np.array([[matrix[r, c] for r, c in coords(lane)] for lane in range(LANES)])


def gather(fragments, coords, shape) -> np.ndarray:
    """The matrix the warp's registers hold (the inverse of :func:`distribute`)."""
    out = np.full(shape, np.nan)
    for lane in range(LANES):
        for value, (r, c) in zip(fragments[lane], coords(lane)):
            out[r, c] = value
    return out


def mma_m16n8k16(a_frag, b_frag, c_frag) -> np.ndarray:
    """What one ``mma.sync.m16n8k16`` leaves in each lane's D registers: products of the 16-bit inputs are exact,
    sums in float64 here (the hardware's fp32 sums round; the layout, not the rounding, is the point)."""
    a = gather(a_frag, a_coords, (16, 16))
    b = gather(b_frag, b_coords, (16, 8))
    c = gather(c_frag, c_coords, (16, 8))
    return distribute(a @ b + c, c_coords)


def ldmatrix_x4(tile) -> np.ndarray:
    """What ``ldmatrix.sync.aligned.m8n8.x4.b16`` puts in each lane's four 32-bit registers (two 16-bit values
    each) when lanes 0-7, 8-15, 16-23, 24-31 give the row addresses of the four 8 x 8 quarters of a 16 x 16 tile in
    the order top-left, bottom-left, top-right, bottom-right: lane l receives, from each quarter, row l // 4 and
    columns 2 (l % 4) and 2 (l % 4) + 1. Returns (32, 8), the eight 16-bit values in register order."""
    tile = np.asarray(tile)
    quarters = [tile[:8, :8], tile[8:, :8], tile[:8, 8:], tile[8:, 8:]]
    return np.array([[q[lane // 4, 2 * (lane % 4) + j] for q in quarters for j in (0, 1)] for lane in range(LANES)])


def accumulator_as_a_operand(c_left, c_right) -> np.ndarray:
    """The A fragment of a 16 x 16 tile from the C fragments of its left and right 16 x 8 halves, per lane, with no
    data moving between lanes: (c0, c1, c2, c3) of the left half and of the right half are a0..a3 and a4..a7
    (in the kernel, each pair is converted to 16 bits and packed into one register)."""
    return np.concatenate([np.asarray(c_left), np.asarray(c_right)], axis=1)
