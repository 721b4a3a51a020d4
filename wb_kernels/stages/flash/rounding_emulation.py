#!/usr/bin/env python3
"""Why stage 04 keeps its running max as the rounded m*c: a NumPy emulation of the kernel's float32 rounding.

The GPU fuses a multiply and a subtract into one FFMA, rounding once; numba's simulator rounds each product.
This script replays the kernel's online softmax for one head in float32, with one rounding per fused
multiply-add, for the two ways of writing the rescaling (this folder's NOTES.md, versions 5 and 6):

* "products": the max m is kept unscaled and the exponents are m_old*c - m_new*c and x*c - m_new*c, so the
  compiler fuses one product unrounded while the other was rounded: each rescale is off by up to an ulp;
* "stored":   the max is kept as fl(m*c) and every exponent subtracts that one stored number (the kernel until
  issue 45): the FFMA x*c - fl(m*c) keeps the rounding of m*c, up to 2^77 at a score of -1e31;
* "difference": the max m is kept unscaled and every exponent is fl(fl(x - m) * c) (the kernel now): the row's
  largest score gives exp2(0) = 1 at any magnitude.

It prints the largest LSE error against the float64 reference next to the tolerance rule of wb.check
(2 x PyTorch's float32 error + storage floor). ``--ex2-error`` perturbs every exp2 by up to that relative
error, as the GPU's approximate MUFU.EX2 does (about 2 ulp).

    python -m wb_kernels.stages.flash.rounding_emulation
"""

from __future__ import annotations

import argparse
import math

import numpy as np

import wb_kernels as wb  # noqa: E402
from wb_kernels.check import storage_floor, torch_error  # noqa: E402

F32 = np.float32
NEG_BIG = np.finfo(F32).min  # the kernel's stand-in for -inf: below every score


def emulated_lse(q, k, *, block_n, threads_per_row, causal, scheme, ex2_error=0.0, rng=None):
    """LSE of one head (q (Lq, D), k (Lk, D)) as the kernel computes it, in emulated float32."""
    Lq, D = q.shape
    Lk = k.shape[0]
    scale = 1 / math.sqrt(D)
    c = F32(scale * math.log2(math.e))
    scores = (q.astype(F32) @ k.astype(F32).T).astype(F32)
    m = np.full(Lq, NEG_BIG, F32)
    partial_sums = np.zeros((Lq, threads_per_row))  # float64, one per thread of a row group

    def fused(a, b, c_):  # a*b - c_ with one rounding, as an FFMA
        return (a.astype(np.float64) * b - c_).astype(F32)

    for k0 in range(0, Lk, block_n):  # (overflows of NEG_BIG - m are harmless here: exp2(-inf) = 0, no fastmath)
        s = scores[:, k0:k0 + block_n].copy()
        keys = np.arange(k0, min(k0 + block_n, Lk))
        allowed = np.ones_like(s, dtype=bool)
        if causal:
            allowed &= keys[None, :] <= np.arange(Lq)[:, None]
        s[~allowed] = NEG_BIG
        tile_max = s.max(axis=1)
        if scheme == "difference":
            new = np.maximum(m, tile_max)
            alpha = np.exp2(((m - new).astype(F32).astype(np.float64) * c).astype(F32))
            p = np.exp2(((s - new[:, None]).astype(F32).astype(np.float64) * c).astype(F32))
        elif scheme == "products":
            new = np.maximum(m, tile_max)
            new_scaled = (new.astype(np.float64) * c).astype(F32)
            alpha = np.exp2(fused(m, c, new_scaled))
            p = np.exp2(fused(s, c, new_scaled[:, None]))
        else:
            new = np.maximum(m, (tile_max.astype(np.float64) * c).astype(F32))
            alpha = np.exp2((m.astype(np.float64) - new).astype(F32))
            p = np.exp2(fused(s, c, new[:, None]))
        p = np.where(allowed, p, 0).astype(F32)
        if ex2_error:
            p = (p * (1 + rng.uniform(-ex2_error, ex2_error, p.shape))).astype(F32)
        m = new
        for t in range(threads_per_row):  # each thread's keys t, t + TPR, ...: a float32 row sum per tile
            partial_sums[:, t] = partial_sums[:, t] * alpha + p[:, t::threads_per_row].sum(axis=1, dtype=F32)
    total = partial_sums.astype(F32).astype(np.float64).sum(axis=1)
    with np.errstate(divide="ignore"):
        if scheme in ("products", "difference"):
            return (m.astype(np.float64) * scale + np.log(total)).astype(F32)
        return (m.astype(np.float64) * math.log(2) + np.log(total)).astype(F32)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ex2-error", type=float, default=2.4e-7)
    args = parser.parse_args(argv)
    rng = np.random.default_rng(0)
    schemes = ("products", "stored", "difference")
    print(f"{'D':>4}{'block_n':>8}{'causal':>8}{'tolerance':>11}" + "".join(f"{s:>11}" for s in schemes))
    for D, block_n in ((64, 64), (128, 32)):
        for causal in (False, True):
            q, k, v = wb.random_qkv(1, 1, 1000, D, Lk=1537, seed=D)
            ref_out, ref_lse = wb.reference(q, k, v, causal=causal)
            _, torch_lse_err = torch_error(q, k, v, ref_out, ref_lse, dtype="float32", device="cpu", causal=causal)
            tol = 2 * torch_lse_err + storage_floor(ref_lse, "float32")
            errors = [np.abs(emulated_lse(q[0, 0], k[0, 0], block_n=block_n, threads_per_row=8, causal=causal,
                                          scheme=scheme, ex2_error=args.ex2_error, rng=rng) - ref_lse[0, 0]).max()
                      for scheme in schemes]
            print(f"{D:>4}{block_n:>8}{causal!s:>8}{tol:>11.2e}" + "".join(f"{e:>11.2e}" for e in errors))


if __name__ == "__main__":
    main()
