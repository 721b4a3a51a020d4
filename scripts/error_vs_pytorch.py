#!/usr/bin/env python3
"""Each stage's error against the float64 reference next to the error of every PyTorch path, same inputs.

    python scripts/error_vs_pytorch.py            # a few fp32 problems, from ordinary to very peaked softmax

The tolerance rule (wb_kernels.check) compares a stage with SDPA's default path in the same precision. This
script shows where a stage stands against each of PyTorch's paths (default, each SDPA backend, eager
``softmax(q k^T) v``), which is what to look at when a check fails by a small factor: is the stage less
accurate than PyTorch, or only than the one path the rule uses? The last line of each problem is the check's
output floor (``wb_kernels.check.output_floor``), the least PyTorch's error counts as: on problems of real size
it should sit at or below SDPA's error, and only take over where SDPA was lucky (one query row).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import wb_kernels as wb  # noqa: E402  (before numba: picks the backend)
from wb_kernels.check import _max_abs_err, output_floor  # noqa: E402
from wb_kernels.reference import attention_mask  # noqa: E402

# (B, H, Lq, Lk, D, scale or None, input std, keep-probability of the key padding mask or None)
PROBLEMS = [
    (4, 4, 512, 512, 64, None, 1.0, None),
    (4, 4, 512, 512, 128, None, 1.0, None),
    (4, 1, 532, 120, 128, 1.4104247427746117, 1.0, 0.7),  # the hypothesis example that found the gap
    (2, 2, 256, 256, 128, 1.0, 1.0, None),
    (4, 4, 1024, 1024, 64, None, 2.0, None),
    (4, 4, 1024, 1024, 128, None, 3.0, 0.7),
    (4, 3, 1, 244, 128, 0.6318561187370902, 3.0, 0.7),  # a single query row, as in a gpu-profile failure
]


def pytorch_errors(q, k, v, mask, scale, out_ref, rows_valid) -> dict:
    import torch
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    errors = {}
    attn_mask = None if mask is None else torch.from_numpy(mask).to(q.device)
    backends = {"sdpa": None, "sdpa-efficient": SDPBackend.EFFICIENT_ATTENTION, "sdpa-math": SDPBackend.MATH}
    for name, backend in backends.items():
        try:
            if backend is None:
                out = F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, scale=scale)
            else:
                with sdpa_kernel(backend):
                    out = F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, scale=scale)
            errors[name] = _max_abs_err(out.double().cpu().numpy(), out_ref, rows_valid)
        except RuntimeError as error:  # a backend that does not take these inputs
            errors[name] = f"n/a ({str(error).splitlines()[0][:40]})"
    s = (q @ k.transpose(-1, -2)) * (scale if scale is not None else q.shape[-1] ** -0.5)
    if attn_mask is not None:
        s = s.masked_fill(~attn_mask, float("-inf"))
    eager = torch.softmax(s, dim=-1).nan_to_num() @ v
    errors["torch-eager"] = _max_abs_err(eager.double().cpu().numpy(), out_ref, rows_valid)
    return errors


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--stages", default="naive,tiled,flash", help="fp32 stages to compare")
    args = parser.parse_args()
    if not wb.BACKEND.is_gpu:
        print("needs a CUDA GPU: on the simulator these sizes would take hours", file=sys.stderr)
        return 2
    import torch

    for B, H, Lq, Lk, D, scale, std, keep_p in PROBLEMS:
        q, k, v = wb.random_qkv(B, H, Lq, D, Lk=Lk, dtype="float32", framework="torch", device="cuda", seed=1, std=std)
        keep = None if keep_p is None else np.random.default_rng(1).random((B, Lk)) < keep_p
        out_ref, lse_ref = wb.reference(q, k, v, key_padding_mask=keep, scale=scale)
        allowed = attention_mask(Lq, Lk, False, keep, batch=B)
        rows_valid = np.broadcast_to(allowed.any(-1), (B, H, Lq))
        mask = None if keep is None else np.broadcast_to(allowed, (B, 1, Lq, Lk)).copy()
        row = pytorch_errors(q, k, v, mask, scale, out_ref, rows_valid)
        for name in args.stages.split(","):
            out = wb.attention(q, k, v, stage=name, key_padding_mask=None if keep is None else torch.from_numpy(keep),
                               scale=scale)
            row[name] = _max_abs_err(out.double().cpu().numpy(), out_ref, rows_valid)
        row["output floor"] = output_floor(q, k, v, out_ref, lse_ref, dtype="float32", key_padding_mask=keep,
                                           scale=scale)
        base = row["sdpa"] if isinstance(row["sdpa"], float) and row["sdpa"] > 0 else None
        print(f"B{B} H{H} Lq{Lq} Lk{Lk} D{D} scale={scale if scale is not None else '1/sqrt(D)'} std={std}"
              f" mask={'none' if keep_p is None else keep_p}: max |err| (x SDPA default)")
        for name, err in row.items():
            ratio = f"  {err / base:5.2f}x" if base and isinstance(err, float) else ""
            print(f"  {name:16s} {err if isinstance(err, str) else f'{err:.2e}'}{ratio}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
