"""What one attention call costs, counted: its FLOPs and the bytes no exact kernel can avoid moving (lessons 03-11,
the benchmark's TFLOP/s and roofline, the rungs' tuning and profiling scripts and lesson figures).

A floor below both the rungs and the benchmark: nothing here imports either.
"""

from __future__ import annotations

from typing import Optional

__all__ = ["attention_flops", "minimum_bytes", "ITEMSIZE"]

ITEMSIZE = {"float16": 2, "bfloat16": 2, "float32": 4, "float64": 8}  # bytes of one element of each dtype name


def attention_flops(B: int, H: int, Lq: int, Lk: int, D: int, causal: bool) -> float:
    """Multiply-adds of QK^T and PV, 2 FLOPs each: 4*B*H*Lq*Lk*D, halved for causal (the usual count)."""
    flops = 4.0 * B * H * Lq * Lk * D
    return flops / 2 if causal else flops


def minimum_bytes(B: int, H: int, Lq: int, Lk: int, D: int, itemsize: int, Hk: Optional[int] = None) -> float:
    """The traffic no exact kernel can avoid: read q, k, v once and write the output once (k and v have Hk heads;
    None: H)."""
    return float(itemsize) * B * D * (2 * H * Lq + 2 * (H if Hk is None else Hk) * Lk)
