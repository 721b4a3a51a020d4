#!/usr/bin/env python3
"""Build, check and time the WMMA kernel's launch variants against SDPA on one GPU, in one run.

For every workload (dtype, head dim, sequence length L with B*L = 16k tokens, H = 16, causal or not)
it times PyTorch's SDPA with the FLASH backend (FlashAttention-2) and with its default choice (cuDNN
on an H100), and each kernel variant (warps per block, 16 or 32 query rows per warp, Q in registers or
shared memory) of
wb_kernels/stages/wmma/flash_wmma.cu. Every variant is first checked against the float64 reference with the
tolerance rule; a variant that fails is reported and not timed. Prints a table and writes JSON
(the numbers this folder's NOTES.md and lesson 05 quote).

    python -m wb_kernels.stages.wmma.tune --json results/wmma/tune_h100.json   # the full grid
    python -m wb_kernels.stages.wmma.tune --quick                              # L = 2048, 8192 only

FLOPs: 4*B*H*L^2*D for non-causal attention and half of that for causal (the masked half is skipped).
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from pathlib import Path

import wb_kernels as wb  # noqa: E402  (first: chooses the backend)
from wb_kernels import cuda_build  # noqa: E402
from wb_kernels.stages.wmma import build as wmma_build  # noqa: E402
from wb_kernels.stages.wmma import launcher as wmma_stage  # noqa: E402

TOKENS = 16 * 1024
HEADS = 16


def flops(B, H, L, D, causal):
    return 4 * B * H * L * L * D / (2 if causal else 1)


def variant_name(variant):
    num_warps, q_in_registers, row_frags = variant
    return f"wmma_w{num_warps}_r{16 * row_frags}_{'qreg' if q_in_registers else 'qsmem'}"


def sdpa(backend):
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    def run(q, k, v, causal):
        if backend is None:
            return F.scaled_dot_product_attention(q, k, v, is_causal=causal)
        with sdpa_kernel(getattr(SDPBackend, backend)):
            return F.scaled_dot_product_attention(q, k, v, is_causal=causal)

    return run


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[1])
    parser.add_argument("--json", type=Path, help="write the results here")
    parser.add_argument("--quick", action="store_true", help="only L = 2048 and 8192")
    parser.add_argument("--lengths", type=int, nargs="*", default=None)
    parser.add_argument("--dtypes", nargs="*", default=["float16", "bfloat16"])
    parser.add_argument("--head-dims", type=int, nargs="*", default=[64, 128])
    parser.add_argument("--repeats", type=int, default=20)
    args = parser.parse_args(argv)
    if not wb.BACKEND.is_gpu:
        sys.exit("python -m wb_kernels.stages.wmma.tune needs a CUDA GPU")
    import torch

    lengths = args.lengths or ([2048, 8192] if args.quick else [512, 1024, 2048, 4096, 8192, 16384])
    t0 = time.perf_counter()
    module = wmma_build.build(wmma_build.package_source())
    build_s = time.perf_counter() - t0
    print(f"built {cuda_build.extension_name(wmma_build.package_source(), cuda_build.build_flags(), 'flash_wmma')} "
          f"in {build_s:.1f} s on {torch.cuda.get_device_name()}")

    variants = list(wmma_build.VARIANTS)
    passed = {}
    for D in args.head_dims:
        for dtype in args.dtypes:
            for variant in variants:
                q, k, v = wb.random_qkv(2, 2, 333, D, Lk=300, dtype=dtype, framework="torch", device="cuda", seed=1)
                ok = True
                for causal in (False, True):
                    out, lse = wmma_stage.forward(q, k, v, causal=causal, module=module, variant=variant)
                    result = wb.check(f"{dtype} D={D} variant {variant} causal={causal}", out, q, k, v, lse=lse,
                                      causal=causal, raise_on_failure=False, verbose=False)
                    if not result.passed:
                        print("FAILED, not timed:", result.line())
                    ok &= result.passed
                passed[(dtype, D, variant)] = ok

    rows = []
    # warps x rows per warp, R: Q in registers, S: Q in shared memory
    short = {(w, r, f): f"{w}x{16 * f}{'R' if r else 'S'}" for w, r, f in variants}
    print(f"all {len(passed)} (dtype, D, variant) combinations checked, {sum(passed.values())} passed")
    header = f"{'dtype':9} {'D':>4} {'L':>6} {'B':>3} {'causal':>6} | {'FLASH':>7} {'default':>7} | " + " ".join(
        f"{short[variant]:>7}" for variant in variants) + " | best/FLASH"
    print(header)
    print("-" * len(header))
    for dtype in args.dtypes:
        for D in args.head_dims:
            for L in lengths:
                B = max(1, TOKENS // L)
                for causal in (False, True):
                    # drawn on the GPU (the same numbers for every contender): NumPy would take seconds here
                    generator = torch.Generator(device="cuda").manual_seed(L * D)
                    q, k, v = (torch.randn(B, HEADS, L, D, device="cuda", generator=generator).to(getattr(torch, dtype))
                               for _ in range(3))
                    work = flops(B, HEADS, L, D, causal)
                    row = {"dtype": dtype, "D": D, "L": L, "B": B, "H": HEADS, "causal": causal, "tflops": {},
                           "ms": {}}
                    candidates = [("sdpa_flash", sdpa("FLASH_ATTENTION")), ("sdpa_default", sdpa(None))]
                    for variant in variants:
                        if passed[(dtype, D, variant)]:
                            candidates.append((variant_name(variant),
                                               lambda q, k, v, causal, variant=variant: wmma_stage.forward(
                                                   q, k, v, causal=causal, module=module, variant=variant)))
                    for name, fn in candidates:
                        try:
                            timing = wb.time_call(fn, q, k, v, causal, warmup=3, repeats=args.repeats)
                        except RuntimeError as error:  # e.g. a backend that has no kernel for this case
                            print(f"  {name}: {str(error).splitlines()[0]}")
                            continue
                        row["ms"][name] = timing.median_ms
                        row["tflops"][name] = work / timing.median_ms / 1e9
                    wmma_best = max((t for n, t in row["tflops"].items() if n.startswith("wmma")), default=0.0)
                    flash = row["tflops"].get("sdpa_flash", float("nan"))
                    row["best_wmma_vs_flash"] = wmma_best / flash
                    row["best_variant"] = max((n for n in row["tflops"] if n.startswith("wmma")),
                                              key=row["tflops"].get, default=None)
                    rows.append(row)
                    cells = " ".join(f"{row['tflops'].get(variant_name(variant), float('nan')):7.1f}"
                                     for variant in variants)
                    print(f"{dtype:9} {D:>4} {L:>6} {B:>3} {str(causal):>6} | {flash:7.1f} "
                          f"{row['tflops'].get('sdpa_default', float('nan')):7.1f} | {cells} | "
                          f"{row['best_wmma_vs_flash']:.2f}x", flush=True)
                    del q, k, v
                    torch.cuda.empty_cache()

    result = {
        "device": torch.cuda.get_device_name(), "torch": torch.__version__, "cuda": torch.version.cuda,
        "python": platform.python_version(), "build_seconds": build_s, "tokens": TOKENS, "heads": HEADS,
        "flops_rule": "4*B*H*L^2*D, halved when causal", "units": "TFLOP/s (median of CUDA-event timings)",
        "variants_passed": {f"{d} D={D} {v}": ok for (d, D, v), ok in passed.items()},
        "rows": rows,
    }
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(result, indent=1) + "\n")
        print(f"wrote {args.json}")
    return result


if __name__ == "__main__":
    main()
