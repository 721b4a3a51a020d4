"""Build, check and time a CUDA C++ rung's launch variants against SDPA on one GPU, in one run (``tune.py``).

For every workload (dtype, head dim, sequence length L with B*L = 16k tokens, H = 16, causal or not) it times
PyTorch's SDPA with the FLASH backend (FlashAttention-2) and with its default choice (cuDNN on an H100), and each
launch variant of the rung's kernel. Every variant is first checked against the float64 reference with the
tolerance rule; a variant that fails is reported and not timed. Prints a table and writes JSON (the numbers the
rung's NOTES.md and lesson quote). A rung's ``tune.py`` describes its variants and calls :func:`main`.

FLOPs: 4*B*H*L^2*D for non-causal attention and half of that for causal (the masked half is skipped).
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional

__all__ = ["Tunable", "main", "sdpa_call", "TOKENS", "HEADS"]

TOKENS = 16 * 1024
HEADS = 16


@dataclass(frozen=True)
class Tunable:
    """What the tuner needs of a rung."""

    rung: str  # "wmma", "mma": the stage and module name
    build: Callable  # build(source) -> extension module
    package_source: Callable  # () -> the .cu text
    forward: Callable  # forward(q, k, v, causal=, module=, variant=) -> (out, lse)
    variants: Callable  # variants(head_dim) -> the variants to try at that head dim
    name: Callable  # name(variant) -> a key for the JSON, e.g. "wmma_w4_r16_qreg"
    short: Callable  # short(variant) -> a column header


def _flops(B, H, L, D, causal):
    return 4 * B * H * L * L * D / (2 if causal else 1)


def sdpa_call(q, k, v, backend_name: Optional[str], **options) -> Callable:
    """``scaled_dot_product_attention(q, k, v, **options)`` as a zero-argument call, with PyTorch's choice of backend
    (`backend_name` None) or forced to one (an ``SDPBackend`` name, e.g. "FLASH_ATTENTION"): the baseline every
    rung's tuning script, the mma profile and the benchmark time."""
    import torch.nn.functional as F

    if backend_name is None:
        return lambda: F.scaled_dot_product_attention(q, k, v, **options)
    from torch.nn.attention import SDPBackend, sdpa_kernel

    backend = getattr(SDPBackend, backend_name)

    def call():
        with sdpa_kernel(backend):
            return F.scaled_dot_product_attention(q, k, v, **options)

    return call


def _sdpa(backend):
    def run(q, k, v, causal):
        return sdpa_call(q, k, v, backend, is_causal=causal)()

    return run


def main(tunable: Tunable, argv=None):
    rung = tunable.rung
    parser = argparse.ArgumentParser(
        description=f"Build, check and time the {rung} kernel's launch variants against SDPA on one GPU.")
    parser.add_argument("--json", type=Path, help="write the results here")
    parser.add_argument("--quick", action="store_true", help="only L = 2048 and 8192")
    parser.add_argument("--lengths", type=int, nargs="*", default=None)
    parser.add_argument("--dtypes", nargs="*", default=["float16", "bfloat16"])
    parser.add_argument("--head-dims", type=int, nargs="*", default=[64, 128])
    parser.add_argument("--repeats", type=int, default=20)
    args = parser.parse_args(argv)
    import wb_kernels as wb

    if not wb.BACKEND.is_gpu:
        sys.exit(f"python -m wb_kernels.stages.{rung}.tune needs a CUDA GPU")
    import torch

    lengths = args.lengths or ([2048, 8192] if args.quick else [512, 1024, 2048, 4096, 8192, 16384])
    t0 = time.perf_counter()
    module = tunable.build(tunable.package_source())
    build_s = time.perf_counter() - t0
    print(f"built the {rung} extension in {build_s:.1f} s on {torch.cuda.get_device_name()}")

    passed = {}
    for D in args.head_dims:
        for dtype in args.dtypes:
            for variant in tunable.variants(D):
                q, k, v = wb.random_qkv(2, 2, 333, D, Lk=300, dtype=dtype, framework="torch", device="cuda", seed=1)
                ok = True
                for causal in (False, True):
                    out, lse = tunable.forward(q, k, v, causal=causal, module=module, variant=variant)
                    result = wb.check(f"{dtype} D={D} variant {tunable.name(variant)} causal={causal}", out, q, k, v,
                                      lse=lse, causal=causal, raise_on_failure=False, verbose=False)
                    if not result.passed:
                        print("FAILED, not timed:", result.line())
                    ok &= result.passed
                passed[(dtype, D, variant)] = ok
    print(f"all {len(passed)} (dtype, D, variant) combinations checked, {sum(passed.values())} passed")

    rows = []
    for dtype in args.dtypes:
        for D in args.head_dims:
            variants = list(tunable.variants(D))
            widths = {variant: max(7, len(tunable.short(variant))) for variant in variants}
            header = (f"{'dtype':9} {'D':>4} {'L':>6} {'B':>3} {'causal':>6} | {'FLASH':>7} {'default':>7} | "
                      + " ".join(f"{tunable.short(variant):>{widths[variant]}}" for variant in variants) + " | best/FLASH")
            print(header)
            print("-" * len(header))
            for L in lengths:
                B = max(1, TOKENS // L)
                for causal in (False, True):
                    # drawn on the GPU (the same numbers for every contender): NumPy would take seconds here
                    generator = torch.Generator(device="cuda").manual_seed(L * D)
                    q, k, v = (torch.randn(B, HEADS, L, D, device="cuda", generator=generator).to(getattr(torch, dtype))
                               for _ in range(3))
                    work = _flops(B, HEADS, L, D, causal)
                    row = {"dtype": dtype, "D": D, "L": L, "B": B, "H": HEADS, "causal": causal, "tflops": {},
                           "ms": {}}
                    candidates = [("sdpa_flash", _sdpa("FLASH_ATTENTION")), ("sdpa_default", _sdpa(None))]
                    for variant in variants:
                        if passed[(dtype, D, variant)]:
                            candidates.append((tunable.name(variant),
                                               lambda q, k, v, causal, variant=variant: tunable.forward(
                                                   q, k, v, causal=causal, module=module, variant=variant)))
                    for name, fn in candidates:
                        try:
                            timing = wb.time_call(fn, q, k, v, causal, warmup=3, repeats=args.repeats)
                        except RuntimeError as error:  # e.g. a backend that has no kernel for this case
                            print(f"  {name}: {str(error).splitlines()[0]}")
                            continue
                        row["ms"][name] = timing.median_ms
                        row["tflops"][name] = work / timing.median_ms / 1e9
                    own = {n: t for n, t in row["tflops"].items() if n.startswith(rung + "_")}
                    flash = row["tflops"].get("sdpa_flash", float("nan"))
                    row[f"best_{rung}_vs_flash"] = max(own.values(), default=0.0) / flash
                    row["best_variant"] = max(own, key=own.get, default=None)
                    rows.append(row)
                    cells = " ".join(f"{row['tflops'].get(tunable.name(variant), float('nan')):{widths[variant]}.1f}"
                                     for variant in variants)
                    print(f"{dtype:9} {D:>4} {L:>6} {B:>3} {str(causal):>6} | {flash:7.1f} "
                          f"{row['tflops'].get('sdpa_default', float('nan')):7.1f} | {cells} | "
                          f"{row[f'best_{rung}_vs_flash']:.2f}x", flush=True)
                    del q, k, v
                    torch.cuda.empty_cache()

    result = {
        "device": torch.cuda.get_device_name(), "torch": torch.__version__, "cuda": torch.version.cuda,
        "python": platform.python_version(), "date": time.strftime("%Y-%m-%d"), "build_seconds": build_s,
        "tokens": TOKENS, "heads": HEADS, "flops_rule": "4*B*H*L^2*D, halved when causal",
        "units": "TFLOP/s (median of CUDA-event timings)",
        "variants_passed": {f"{d} D={D} {tunable.name(v)}": ok for (d, D, v), ok in passed.items()},
        "rows": rows,
    }
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(result, indent=1) + "\n")
        print(f"wrote {args.json}")
    return result
