#!/usr/bin/env python3
"""Build, check and time tile shapes of the numba FlashAttention kernel against SDPA fp32, in one run.

For each head dim it builds every variant in VARIANTS (wb_kernels/stages/flash/kernel.py's
``make_flash_kernel`` with one FlashConfig), checks it against the float64 reference with the
tolerance rule (odd length, causal, key padding, Lq != Lk), and times the survivors on
B*L = 16k tokens, H = 16 next to ``scaled_dot_product_attention`` with fp32 inputs (PyTorch picks its
EFFICIENT backend for fp32) measured in the same process. The stage's own tiles (GPU_CONFIGS) are then timed
over all lengths, causal too, next to the naive and tiled stages of lessons 02 and 03 where they fit,
and its peak memory is compared with O + LSE. Prints tables and writes JSON (the numbers
this folder's NOTES.md and lesson 04 quote).

    python -m wb_kernels.stages.flash.tune --out results/flash/   # writes results/flash/tune_h100.json on an H100
    python -m wb_kernels.stages.flash.tune --quick --json x.json  # fewer variants and lengths

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
from wb_kernels.stages.flash import kernel as fc  # noqa: E402
from wb_kernels.stages.flash.kernel import FlashConfig as C  # noqa: E402

TOKENS = 16 * 1024
HEADS = 16
FP32_MATMUL_CEILING = 51.0  # TFLOP/s, measured on the H100 (fp32 matmul 8192^3, no TF32)

# per head dim, tile shapes (block_m, block_n, rows_per_thread, threads_per_row, min_blocks); the stage's own first
VARIANTS = {
    64: [C(128, 64, 8, 8, 1), C(64, 64, 4, 8, 2), C(64, 32, 4, 8, 3), C(256, 64, 8, 8, 1), C(128, 32, 8, 8, 1),
         C(128, 128, 8, 16, 1), C(128, 64, 8, 16, 1)],
    128: [C(128, 32, 8, 8, 1), C(64, 64, 4, 16, 2), C(64, 64, 4, 16, 1), C(64, 64, 4, 8, 2), C(64, 32, 8, 8, 2),
          C(128, 64, 8, 16, 1), C(64, 32, 4, 16, 2), C(128, 64, 4, 16, 1), C(128, 32, 8, 16, 1), C(256, 32, 8, 8, 1)],
}
QUICK = {64: VARIANTS[64][:3], 128: VARIANTS[128][:3]}


def flops(B, H, Lq, Lk, D, causal):
    return 4 * B * H * Lq * Lk * D / (2 if causal else 1)


def sdpa(q, k, v, causal):
    import torch.nn.functional as F

    return F.scaled_dot_product_attention(q, k, v, is_causal=causal)


def check_variant(D, config, kernel):
    """True when the variant passes the tolerance rule on awkward shapes (odd L, masks, Lq != Lk)."""
    cases = [dict(B=1, H=2, Lq=333, Lk=333, causal=False, mask=False),
             dict(B=2, H=1, Lq=257, Lk=190, causal=True, mask=True),
             dict(B=1, H=1, Lq=1, Lk=77, causal=False, mask=True)]
    for i, case in enumerate(cases):
        q, k, v = wb.random_qkv(case["B"], case["H"], case["Lq"], D, Lk=case["Lk"], framework="torch",
                                device="cuda", seed=10 + i)
        mask = wb.random_padding_mask(case["B"], case["Lk"], seed=i, framework="torch", device="cuda") \
            if case["mask"] else None
        out, lse = fc.flash_forward(q, k, v, causal=case["causal"], key_padding_mask=mask, config=config,
                                    kernel=kernel)
        result = wb.check(f"  {config.label()} D={D} case {i}", out, q, k, v, lse=lse, causal=case["causal"],
                          key_padding_mask=mask, raise_on_failure=False)
        if not result.passed:
            return False
    return True


def time_ms(fn, *args, repeats, **kwargs):
    return wb.time_call(fn, *args, warmup=2, repeats=repeats, **kwargs).median_ms


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", type=Path, help="write the results here")
    parser.add_argument("--out", type=Path, help="folder: write tune_<gpu>.json there (e.g. tune_h100.json)")
    parser.add_argument("--quick", action="store_true", help="three variants, L = 4096 only")
    parser.add_argument("--head-dims", type=int, nargs="*", default=[64, 128])
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--tune-length", type=int, default=4096)
    parser.add_argument("--lengths", type=int, nargs="*", default=[1024, 2048, 4096, 8192, 16384])
    parser.add_argument("--long", type=int, default=65536, help="one run at this length (0: skip)")
    args = parser.parse_args(argv)
    if not wb.BACKEND.is_gpu:
        sys.exit("python -m wb_kernels.stages.flash.tune needs a CUDA GPU")
    import torch

    t_start = time.perf_counter()
    results = dict(device=torch.cuda.get_device_name(), torch=torch.__version__, python=platform.python_version(),
                   tokens=TOKENS, heads=HEADS, fp32_ceiling_tflops=FP32_MATMUL_CEILING, variants=[], best={},
                   lengths=[], memory=[], long=[])
    print(f"{results['device']}, torch {torch.__version__}")

    gpu = next((name for name in ("H100", "H200", "A100", "B200") if name in results["device"]), "gpu").lower()
    target = args.json or (args.out / f"tune_{gpu}.json" if args.out else None)

    def save():  # after every section, so that a run cut short still leaves its numbers
        if target:
            results["seconds"] = time.perf_counter() - t_start
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_text(json.dumps(results, indent=1, default=str))

    def throughput(ms, B, H, L, D, causal):
        return flops(B, H, L, L, D, causal) / (ms * 1e-3) / 1e12

    variants = QUICK if args.quick else VARIANTS
    for D in args.head_dims:
        L = args.tune_length
        B = max(1, TOKENS // L)
        q, k, v = wb.random_qkv(B, HEADS, L, D, framework="torch", device="cuda", seed=1)
        sdpa_ms = time_ms(sdpa, q, k, v, False, repeats=args.repeats)
        sdpa_tf = throughput(sdpa_ms, B, HEADS, L, D, False)
        print(f"\nD={D} B={B} H={HEADS} L={L}: sdpa fp32 {sdpa_ms:.3f} ms = {sdpa_tf:.1f} TFLOP/s")
        print(f"{'variant':<24}{'thr':>5}{'smem KiB':>10}{'regs':>6}{'ms':>10}{'TFLOP/s':>9}{'x sdpa':>8}")
        best = None
        for config in variants.get(D, []):
            row = dict(D=D, config=config.__dict__, label=config.label(), threads=config.threads,
                       smem_bytes=fc.shared_layout(D, config)["bytes"])
            try:
                kernel = fc.make_flash_kernel(D, config)
                row["passed"] = check_variant(D, config, kernel)
                if row["passed"]:
                    ms = time_ms(fc.flash_forward, q, k, v, config=config, kernel=kernel, repeats=args.repeats)
                    row.update(ms=ms, tflops=throughput(ms, B, HEADS, L, D, False), sdpa_ms=sdpa_ms)
                    row["x_sdpa"] = sdpa_ms / ms
                    compiled = next(iter(kernel.overloads.values()))
                    row.update(registers=compiled.regs_per_thread, local_bytes=compiled.local_mem_per_thread)
                    if best is None or ms < best[1]:
                        best = (config, ms)
            except Exception as error:  # a variant that does not build or launch is a result too
                row.update(passed=False, error=f"{type(error).__name__}: {error}"[:300])
            results["variants"].append(row)
            print(f"{row['label']:<24}{row['threads']:>5}{row['smem_bytes'] / 1024:>10.1f}"
                  f"{row.get('registers', '-')!s:>6}{row.get('ms', float('nan')):>10.3f}"
                  f"{row.get('tflops', float('nan')):>9.2f}{row.get('x_sdpa', float('nan')):>8.3f}"
                  + ("" if row["passed"] else f"  FAILED {row.get('error', 'check')}"), flush=True)
        del q, k, v
        save()
        if best is None:
            continue
        results["best"][D] = best[0].__dict__ | dict(label=best[0].label())
        config = fc.GPU_CONFIGS.get(D, best[0])  # the sweep times what the stage runs by default
        results.setdefault("stage", {})[D] = config.__dict__ | dict(label=config.label())
        kernel = fc.make_flash_kernel(D, config)
        print(f"\nfastest D={D}: {best[0].label()}; the stage's tiles: {config.label()}; all lengths, "
              f"B*L = {TOKENS}, H = {HEADS}")
        print(f"{'L':>6}{'causal':>7}{'flash ms':>10}{'TFLOP/s':>9}{'sdpa ms':>9}{'x sdpa':>8}{'% ceil':>8}"
              f"{'naive ms':>10}{'tiled ms':>10}")
        for L in ([args.tune_length] if args.quick else args.lengths):
            B = max(1, TOKENS // L)
            q, k, v = wb.random_qkv(B, HEADS, L, D, framework="torch", device="cuda", seed=2)
            for causal in (False, True):
                ms = time_ms(fc.flash_forward, q, k, v, causal=causal, config=config, kernel=kernel,
                             repeats=args.repeats)
                s_ms = time_ms(sdpa, q, k, v, causal, repeats=args.repeats)
                row = dict(D=D, L=L, B=B, H=HEADS, causal=causal, ms=ms, sdpa_ms=s_ms,
                           tflops=throughput(ms, B, HEADS, L, D, causal),
                           sdpa_tflops=throughput(s_ms, B, HEADS, L, D, causal), x_sdpa=s_ms / ms)
                row["fraction_of_ceiling"] = row["tflops"] / FP32_MATMUL_CEILING
                for stage in ("naive", "tiled"):  # lessons 02 and 03, non-causal, where they fit
                    if causal or L > 4096:
                        continue
                    try:
                        row[f"{stage}_ms"] = time_ms(wb.attention, q, k, v, stage=stage, repeats=3)
                        row[f"x_{stage}"] = row[f"{stage}_ms"] / ms
                    except Exception as error:
                        row[f"{stage}_error"] = f"{type(error).__name__}: {error}"[:200]
                    torch.cuda.empty_cache()
                results["lengths"].append(row)
                print(f"{L:>6}{causal!s:>7}{ms:>10.3f}{row['tflops']:>9.2f}{s_ms:>9.3f}{row['x_sdpa']:>8.3f}"
                      f"{100 * row['fraction_of_ceiling']:>7.1f}%{row.get('naive_ms', float('nan')):>10.2f}"
                      f"{row.get('tiled_ms', float('nan')):>10.2f}", flush=True)
            # memory: the peak beyond the inputs, against O + LSE
            (out, lse), use = wb.peak_memory(fc.flash_forward, q, k, v, config=config, kernel=kernel)
            expected = fc.STAGE.workspace_bytes(B, HEADS, L, L, D)
            results["memory"].append(dict(D=D, L=L, B=B, peak_bytes=use.peak_bytes, o_plus_lse_bytes=expected,
                                          ratio=use.peak_bytes / expected))
            print(f"{'':>6} memory: peak {use.peak_bytes / 2**20:.2f} MiB, O + LSE {expected / 2**20:.2f} MiB, "
                  f"ratio {use.peak_bytes / expected:.4f}")
            del q, k, v, out, lse
            torch.cuda.empty_cache()
            save()
        if args.long:
            L, B, H = args.long, 1, 8  # naive would need 2 * 4 * 8 * L^2 bytes: 275 GB at L = 65536
            q, k, v = wb.random_qkv(B, H, L, D, framework="torch", device="cuda", seed=3)
            row = dict(D=D, L=L, B=B, H=H)
            try:
                wb.validate(q, k, v, stage="naive")
                row["naive"] = "fits"
            except MemoryError as error:
                row["naive"] = f"MemoryError: {str(error)[:160]}"
            except Exception as error:
                row["naive"] = f"{type(error).__name__}: {str(error)[:160]}"
            (out, lse), use = wb.peak_memory(fc.flash_forward, q, k, v, config=config, kernel=kernel)
            ms = time_ms(fc.flash_forward, q, k, v, config=config, kernel=kernel, repeats=2)
            row.update(ms=ms, tflops=throughput(ms, B, H, L, D, False), peak_bytes=use.peak_bytes,
                       o_plus_lse_bytes=fc.STAGE.workspace_bytes(B, H, L, L, D),
                       finite=bool(torch.isfinite(out).all().item()))
            results["long"].append(row)
            print(f"L={L} B={B} H={H} D={D}: flash {ms:.1f} ms ({row['tflops']:.2f} TFLOP/s), peak "
                  f"{use.peak_bytes / 2**20:.1f} MiB, finite {row['finite']}; naive: {row['naive']}")
            del q, k, v, out, lse
            torch.cuda.empty_cache()

    save()
    if target:
        print(f"wrote {target}")
    print(f"done in {results['seconds']:.0f} s")


if __name__ == "__main__":
    main()
