#!/usr/bin/env python3
"""Build, check and time the WMMA kernel's launch variants against SDPA on one GPU, in one run.

The variants: warps per block, 16 or 32 query rows per warp, Q in registers or shared memory (``build.VARIANTS``).
The shared tuner, :mod:`wb_kernels.tuning`, checks each against the float64 reference, times it next to SDPA's
FLASH and default backends, prints a table and writes JSON (the numbers this folder's NOTES.md and lesson 05 quote).

    python -m wb_kernels.stages.wmma.tune --json results/wmma/tune_h100.json   # the full grid
    python -m wb_kernels.stages.wmma.tune --quick                              # L = 2048, 8192 only
"""

from __future__ import annotations

import wb_kernels  # noqa: F401  (first: chooses the backend)
from wb_kernels import tuning
from wb_kernels.stages.wmma import build as wmma_build
from wb_kernels.stages.wmma import launcher as wmma_stage


def variant_name(variant):
    num_warps, q_in_registers, row_frags = variant
    return f"wmma_w{num_warps}_r{16 * row_frags}_{'qreg' if q_in_registers else 'qsmem'}"


def short_name(variant):
    """warps x rows per warp, R: Q in registers, S: Q in shared memory"""
    num_warps, q_in_registers, row_frags = variant
    return f"{num_warps}x{16 * row_frags}{'R' if q_in_registers else 'S'}"


TUNABLE = tuning.Tunable(rung="wmma", build=wmma_build.build, package_source=wmma_build.package_source,
                         forward=wmma_stage.forward, variants=lambda head_dim: wmma_build.VARIANTS,
                         name=variant_name, short=short_name)

if __name__ == "__main__":
    tuning.main(TUNABLE)
