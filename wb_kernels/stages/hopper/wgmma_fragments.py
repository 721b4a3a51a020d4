"""Which thread of a warpgroup holds which element of a wgmma operand, from the mma rung's fragment model
(rung ``hopper``; tests/test_hopper.py).

``wgmma.mma_async.m64nNk16`` spreads its register operands over the 4 warps of a warpgroup: warp w holds rows
16 w .. 16 w + 15, and within a warp the layout is that of ``mma.sync.m16n8k16`` (PTX ISA, "Register Fragments",
the wgmma figures for m64nNk16): the accumulator repeats the m16n8 C fragment once per 8 columns, and the A operand
of the RS form is the m16n8k16 A fragment (:mod:`wb_kernels.stages.mma.fragments`). So the mma rung's lesson
carries over: S's accumulators are, register pair by register pair, the A operand of the next product.

The functions here write down the index arithmetic of ``hopper_primitives_lab.cuh`` in Python, so that the tests can hold it to
that model:

- :func:`accumulator_coords`: ``d[4 j + 2 h + e]`` of thread ``t`` is D[16 w + lane / 4 + 8 h][8 j + 2 (lane % 4) + e];
- :func:`a_register_coords`: the RS form's ``a[i]`` (two 16-bit values) as the lab GEMM loads it from shared memory;
- :func:`p_from_s`: which accumulators of S the v1 kernel packs into ``p[t][i]``.
"""

from __future__ import annotations

from ..mma import fragments as mma_fragments

__all__ = ["WARPGROUP", "accumulator_coords", "a_register_coords", "mma_a_coords", "p_from_s"]

WARPGROUP = 128


def accumulator_coords(thread: int, n: int) -> list:
    """(row, column) in the 64 x n accumulator of each of the thread's n / 2 fp32 registers, as the kernels index
    them: ``d[4 j + 2 h + e]``."""
    warp, lane = divmod(thread, 32)
    coords = []
    for j in range(n // 8):
        for h in range(2):
            for e in range(2):
                coords.append((16 * warp + lane // 4 + 8 * h, 8 * j + 2 * (lane % 4) + e))
    return coords


def a_register_coords(thread: int, step: int) -> list:
    """(row, column) in the 64 x K matrix A of the 8 16-bit values in the thread's four RS registers for k-step
    `step`, low half first, as ``wgmma_gemm_kernel`` loads them: a[i] = A[16 w + lane / 4 + 8 (i % 2)]
    [16 step + 2 (lane % 4) + 8 (i / 2) + {0, 1}]."""
    warp, lane = divmod(thread, 32)
    coords = []
    for i in range(4):
        row, column = 16 * warp + lane // 4 + 8 * (i % 2), 16 * step + 2 * (lane % 4) + 8 * (i // 2)
        coords += [(row, column), (row, column + 1)]
    return coords


def mma_a_coords(thread: int, step: int) -> list:
    """The same registers according to the mma rung's m16n8k16 A fragment, moved to warp w's rows and k-step `step`."""
    warp, lane = divmod(thread, 32)
    return [(16 * warp + row, 16 * step + column) for row, column in mma_fragments.a_coords(lane)]


def p_from_s(step: int) -> list:
    """Indices into S's accumulators (64 x 64, 32 per thread) that the v1 kernel packs into p[step][0..3], low half
    first: ``p[t][i] = pack(s[8 t + 2 i], s[8 t + 2 i + 1])``."""
    return [8 * step + 2 * i + e for i in range(4) for e in range(2)]
