#!/usr/bin/env python3
"""Build, check and time the mma.sync kernel's launch variants against SDPA on one GPU, in one run.

The variants (``build.VARIANTS``): warps per block, 16 or 32 query rows per warp, 64 or 128 keys per tile, Q's
fragments in registers or re-read from shared memory. The shared tuner, :mod:`wb_kernels.tuning`, checks each
against the float64 reference, times it next to SDPA's FLASH and default backends, prints a table and writes JSON
(the numbers this folder's NOTES.md and lesson 06 quote; the fastest variant per head dim becomes
``launcher.DEFAULT_VARIANT``).

    python -m wb_kernels.stages.mma.tune --json results/mma/tune_h100.json   # the full grid
    python -m wb_kernels.stages.mma.tune --quick                             # L = 2048, 8192 only
"""

from __future__ import annotations

import wb_kernels  # noqa: F401  (first: chooses the backend)
from wb_kernels import tuning
from wb_kernels.stages.mma import build as mma_build
from wb_kernels.stages.mma import launcher as mma_stage


def variant_name(variant: mma_build.Variant) -> str:
    return (f"mma_w{variant.num_warps}_r{16 * variant.row_tiles}_n{variant.block_n}_"
            f"{'qreg' if variant.q_in_registers else 'qsmem'}")


def short_name(variant: mma_build.Variant) -> str:
    """block rows x keys per tile, R: Q in registers, S: Q in shared memory; 8 warps marked w8"""
    return (f"{variant.block_m}x{variant.block_n}{'R' if variant.q_in_registers else 'S'}"
            + ("w8" if variant.num_warps == 8 else ""))


TUNABLE = tuning.Tunable(rung="mma", build=mma_build.build, package_source=mma_build.package_source,
                         forward=mma_stage.forward,
                         variants=lambda head_dim: [v for v in mma_build.VARIANTS if v.head_dim == head_dim],
                         name=variant_name, short=short_name)

if __name__ == "__main__":
    tuning.main(TUNABLE)
