"""The primitives lab's Python side (rung ``hopper``, v0): each launcher runs one small kernel of ``hopper_lab.cu``.

Needs a Hopper GPU and a CUDA build of torch. A kernel that waits on an mbarrier hangs when the barrier is wrong:
the extension is built with the watchdog (``build.WATCHDOG_SECONDS``), and the tests run every launcher in a
subprocess under a time limit (:mod:`.gpu_checks`).

- :func:`tma_tile`: (a) one TMA box, 64 x 64 16-bit elements, returned as the raw shared-memory image;
- :func:`wgmma_gemm`: (b, c) C = A B in fp32 by one warpgroup, A (64, K <= 64) from shared memory (SS) or registers
  (RS), B K-major (given as its transpose, (N, K)) or MN-major ((K, N)), N = 64 or 128.
"""

from __future__ import annotations

from . import build as hopper_build

__all__ = ["tma_tile", "wgmma_gemm"]

TILE_BYTES = 64 * 128


def tma_tile(x, row0: int = 0, column0: int = 0, *, expect_bytes: int | None = None, module=None):
    """Shared memory after one TMA load of the 64 x 64 box at (row0, column0) of `x` (2-D CUDA, fp16/bf16, row
    length a multiple of 8), flat, in x's dtype. `expect_bytes` (default: the box's 8192) is what thread 0
    announces with arrive.expect_tx; another value never completes the barrier's phase (the watchdog traps)."""
    module = module or hopper_build.extension()
    return module.hopper_tma_tile(x.contiguous(), int(row0), int(column0),
                                  TILE_BYTES if expect_bytes is None else int(expect_bytes))


def wgmma_gemm(a, b, *, a_in_registers: bool = False, b_mn_major: bool = False, module=None):
    """C = A B (64 x N, float32). `a`: (64, K); `b`: (N, K) (K-major, B's transpose) or, with `b_mn_major`, (K, N)."""
    module = module or hopper_build.extension()
    return module.hopper_wgmma_gemm(a.contiguous(), b.contiguous(), bool(a_in_registers), bool(b_mn_major))
