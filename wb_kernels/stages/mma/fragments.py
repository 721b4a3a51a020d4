"""Which lane holds which element: the register layouts of ``mma.sync.aligned.m16n8k16`` in NumPy (lesson 06).

One warp computes D (16 x 8, fp32) = A (16 x 16, fp16/bf16) B (16 x 8) + C. Unlike WMMA's fragments, whose layout
is opaque, PTX documents where every element lives (PTX ISA, "Matrix Fragments for mma.m16n8k16 with floating
point type"). With ``group = lane // 4`` and ``t = lane % 4``:

- A: lane holds a0..a7; row ``group`` for a0, a1, a4, a5 and ``group + 8`` for the others; column ``2t + (i & 1)``,
  plus 8 for a4..a7;
- B: lane holds b0..b3; row (k) ``2t + (i & 1)``, plus 8 for b2, b3; column (n) ``group``;
- C and D: lane holds c0..c3; row ``group`` for c0, c1 and ``group + 8`` for c2, c3; column ``2t + (i & 1)``.

:func:`ldmatrix` models the instruction that fills these registers from shared memory: each lane gives the address
of one 16-byte row and receives pieces of other lanes' rows (``.trans`` transposes each 8 x 8 matrix on the way).
Leading axes of every array are a batch (of tiles, of warps), so one NumPy step moves a whole warp's fragments.

Two facts the FlashAttention-2 kernel is built on follow, and the tests check them: each row of C is held by the
four lanes of one group (a row's max or sum takes two shuffles, ``xor 1`` and ``xor 2``); and the C fragments of
two neighbouring 16 x 8 tiles of S are, register for register, the A fragment of the 16 x 16 tile of P that the
next ``mma`` multiplies with V: P never leaves registers.
"""

from __future__ import annotations

from functools import lru_cache

import numpy as np

__all__ = ["a_coords", "b_coords", "c_coords", "distribute", "gather", "mma_m16n8k16", "ldmatrix",
           "ldmatrix_x4", "accumulator_as_a_operand", "LANES"]

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


@lru_cache(maxsize=None)
def _index(coords) -> tuple:
    """(rows, cols), each (32, n): where every register of every lane sits in its matrix, as index arrays, so that
    a whole warp's fragments (and a batch of warps or tiles) move with one NumPy indexing step."""
    table = np.array([coords(lane) for lane in range(LANES)])  # (32, n, 2)
    return table[..., 0], table[..., 1]


def distribute(matrix, coords) -> np.ndarray:
    """(..., 32, n) array: lane l's registers, element i at ``coords(l)[i]`` of `matrix` (..., rows, cols)."""
    rows, cols = _index(coords)
    return np.asarray(matrix)[..., rows, cols]


def gather(fragments, coords, shape) -> np.ndarray:
    """The matrix (..., *shape) the warp's registers hold (the inverse of :func:`distribute`)."""
    fragments = np.asarray(fragments)
    rows, cols = _index(coords)
    out = np.full(fragments.shape[:-2] + tuple(shape), np.nan, dtype=np.result_type(fragments, np.float32))
    out[..., rows, cols] = fragments
    return out


def mma_m16n8k16(a_frag, b_frag, c_frag) -> np.ndarray:
    """What one ``mma.sync.m16n8k16`` leaves in each lane's D registers: products of the 16-bit inputs are exact,
    sums in float64 here (the hardware's fp32 sums round; the layout, not the rounding, is the point). Leading
    axes are a batch of independent instructions and broadcast like NumPy's matmul."""
    a = gather(a_frag, a_coords, (16, 16)).astype(np.float64)
    b = gather(b_frag, b_coords, (16, 8)).astype(np.float64)
    c = gather(c_frag, c_coords, (16, 8)).astype(np.float64)
    return distribute(a @ b + c, c_coords)


@lru_cache(maxsize=None)
def _ldmatrix_index(trans: bool) -> tuple:
    """For lane l and value v of its eight: which address-giving lane's row, and which element of that row."""
    lane, value = np.arange(LANES)[:, None], np.arange(8)[None, :]
    matrix, half = value // 2, value % 2  # register r_i holds matrix i; two 16-bit values per register
    if trans:  # lane l gets column l // 4 of the 8 x 8 matrix, rows 2 (l % 4) and 2 (l % 4) + 1
        return 8 * matrix + 2 * (lane % 4) + half, np.broadcast_to(lane // 4, (LANES, 8))
    return 8 * matrix + lane // 4, 2 * (lane % 4) + half  # row l // 4, columns 2 (l % 4) and 2 (l % 4) + 1


def ldmatrix(shared, row_offsets, *, trans: bool = False) -> np.ndarray:
    """What ``ldmatrix.sync.aligned.m8n8.x4[.trans].b16`` puts in each lane's four 32-bit registers (two 16-bit
    values each). `shared` is the flat shared memory (in 16-bit elements); lane l gives `row_offsets[..., l]`, the
    element offset of one 16-byte row: lanes 8i..8i+7 give the eight rows of matrix i. From each matrix, lane l
    receives row l // 4, columns 2 (l % 4) and 2 (l % 4) + 1, or with ``trans`` the transposed pair (rows
    2 (l % 4) and 2 (l % 4) + 1 of column l // 4). Returns (..., 32, 8), the values in register order."""
    rows = np.asarray(shared)[np.asarray(row_offsets)[..., None] + np.arange(8)]  # (..., 32 rows, 8 elements)
    source_lane, element = _ldmatrix_index(trans)
    return rows[..., source_lane, element]


def ldmatrix_x4(tile) -> np.ndarray:
    """What ``ldmatrix.x4`` delivers for a 16 x 16 tile stored row by row when lanes 0-7, 8-15, 16-23, 24-31 give
    the row addresses of its four 8 x 8 quarters in the order top-left, bottom-left, top-right, bottom-right: lane
    l receives, from each quarter, row l // 4 and columns 2 (l % 4) and 2 (l % 4) + 1, which is the A fragment.
    Returns (32, 8), the eight 16-bit values in register order."""
    lane = np.arange(LANES)
    row, column = lane % 16, 8 * (lane // 16)  # the quarter order above, as row addresses
    return ldmatrix(np.asarray(tile).reshape(-1), row * 16 + column)


def accumulator_as_a_operand(c_left, c_right) -> np.ndarray:
    """The A fragment of a 16 x 16 tile from the C fragments of its left and right 16 x 8 halves, per lane, with no
    data moving between lanes: (c0, c1, c2, c3) of the left half and of the right half are a0..a3 and a4..a7
    (in the kernel, each pair is converted to 16 bits and packed into one register)."""
    return np.concatenate([np.asarray(c_left), np.asarray(c_right)], axis=-1)
