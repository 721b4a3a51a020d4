"""Time the GEMV kernels on a GPU against cuBLAS and the copy ceiling, at LLaMA 3.2 1B's products, into
``results/gemv/bench_<gpu>.json``.

    python -m wb_kernels.stages.gemv.bench                       # batches 1, 4, 8, 16; float16
    python -m wb_kernels.stages.gemv.bench --batches 1 --quick   # fewer repeats, the split sweep left out
    python -m wb_kernels.stages.gemv.bench --dtype bfloat16 --json results/gemv/bench_h100_bf16.json
    python -m wb_kernels.stages.gemv.bench --batches 1 --variants all --json results/gemv/variants_h100.json

For each product of work_split.MODEL_PRODUCTS (QKV, o, gate/up, down, LM head) and each batch, on the same inputs:

- ``v1`` (batch 1): the warp-per-row kernel on the product's whole matrix (gate/up's 2F rows), no fusion;
- ``gemv splits=S``: the plain product W x (v2 with S > 1, v3 for B > 1) at S = 1, 2, 4, 8 and ``auto`` (the
  launcher's choice, work_split.choose_splits for this GPU's SMs), with one workspace kept across calls (as a CUDA
  graph would keep it: the counters need no memset);
- ``fused``: the product's fused form (RMSNorm -> QKV or LM head, o or down + residual, RMSNorm -> gate/up -> SiLU *
  up) at the launcher's split choice;
- ``cublas``: ``torch.nn.functional.linear`` (cuBLAS) on the same W and x, and ``torch unfused``: the fused form's
  eager PyTorch sequence (F.rms_norm, F.linear, the add or F.silu * up): what the fusion saves;
- ``variant <name>`` (with ``--variants``, batch 1): the plain product, one split, from a build whose batch-1 kernel
  has another shape (build.VARIANTS: rows per warp, loads in flight per row, minimum blocks per SM) or loads each
  trip's weights a trip ahead (prefetch);
- ``copy``: a device-to-device copy of W's bytes (it reads and writes them: half its time is the ceiling of a
  product that only reads them), and once per run a 1 GiB copy, the rate the decoder's roofline uses.

Every timed contender is first checked against float64 (work_split.error_bound); a failure is recorded and the
contender not timed. Timing: wb_kernels.timing.DEVICE_TIME (CUDA events around the call behind a sleeping kernel,
the L2 flushed clean by a read before each repeat), median of the repeats. Each row records the time, the fraction
of the copy ceiling (the weight's own copy and the large copy), cuBLAS's time on the same shape, and the model's
prediction (work_split.predicted_time_us).
"""

from __future__ import annotations

import argparse
import sys

from ...results_files import REPO_ROOT, environment, gpu_results_path, recorded_arguments, round_significant, \
    save_results
from ...timing import DEVICE_TIME, time_call
from . import launcher
from . import work_split as ws
from .gpu_checks import random_case

__all__ = ["main", "measure_product", "large_copy_gbps"]

SPLITS = (1, 2, 4, 8)


def large_copy_gbps(repeats: int) -> float:
    """A 1 GiB device-to-device copy's rate: bytes read + written per second."""
    import torch

    source = torch.empty(2 ** 30, dtype=torch.uint8, device="cuda")
    target = torch.empty_like(source)
    ms = time_call(lambda: target.copy_(source), warmup=3, repeats=repeats, **DEVICE_TIME).median_ms
    return 2 * source.numel() / (ms * 1e-3) / 1e9


def _torch_unfused(product: ws.Product, case: dict):
    import torch.nn.functional as F

    w, x = case["w"], case["x"]

    def normed():
        return F.rms_norm(x.float(), (x.shape[-1],), eps=1e-5).to(x.dtype) * case["norm_weight"]

    if product.form == "plain":
        return lambda: F.linear(x, w)
    if product.form == "norm":
        return lambda: F.linear(normed(), w)
    if product.form == "residual":
        return lambda: case["residual"] + F.linear(x, w)

    def gate_up():
        gate, up = F.linear(normed(), w).chunk(2, dim=-1)
        return F.silu(gate) * up

    return gate_up


def _fused_call(product: ws.Product, case: dict, workspace):
    w, x = case["w"], case["x"]
    if product.form == "norm":
        return lambda: launcher.rmsnorm_gemv(w, x, case["norm_weight"], workspace=workspace)
    if product.form == "residual":
        return lambda: launcher.gemv_residual(w, x, case["residual"], workspace=workspace)
    if product.form == "norm_gate_up":
        return lambda: launcher.rmsnorm_gate_up_silu(w, x, case["norm_weight"], workspace=workspace)
    return lambda: launcher.gemv(w, x, workspace=workspace)


def _checked(fn, case: dict, form: str, dtype: str, splits: int) -> float:
    """Run `fn` once and return its worst |error| / bound against float64 (> 1: wrong)."""
    args = {name: case[name] for name in ("norm_weight", "residual") if name in case}  # each form uses its own
    y = fn()
    ref = ws.reference64(case["w"], case["x"], form=form, **args)
    bound = ws.error_bound(case["w"], case["x"], dtype=dtype, form=form, splits=splits, **args)
    return float(((y.double().reshape(ref.shape) - ref).abs() / bound).max())


def measure_product(product: ws.Product, dtype: str, repeats: int, splits_sweep, large_gbps: float,
                    seed: int = 0, variants: dict | None = None) -> list:
    """Every contender on one product and batch: a list of rows for the results file."""
    import torch

    case = random_case(product.form, product.n_out, product.k, product.batch, dtype, seed)
    device = case["w"].device.index
    gpu = ws.Gpu("this GPU", launcher.sm_count(device), large_gbps)
    plain = ws.Product(product.name, product.weight_rows, product.k, "plain", product.batch)
    workspace = launcher.Workspace(product.weight_rows, product.batch, max(SPLITS) * 2, case["w"].device)
    target = torch.empty_like(case["w"])
    # what the launcher runs with splits=None (its model at the H100's copy rate, this GPU's SMs)
    auto = launcher.auto_splits(ws.Product("call", plain.n_out, plain.k, "plain", plain.batch), device)
    fused_splits = launcher.auto_splits(ws.Product("call", product.n_out, product.k, product.form, product.batch),
                                        device)
    contenders = [("copy", None, "plain", lambda: target.copy_(case["w"]))]
    if product.batch == 1:
        contenders.append(("v1", 1, "plain", lambda: launcher.gemv_v1(case["w"], case["x"])))
    for splits in splits_sweep:
        if ws.split_plan(product.k, splits)[1] == splits:
            contenders.append((f"gemv splits={splits}", splits, "plain",
                               lambda s=splits: launcher.gemv(case["w"], case["x"], splits=s, workspace=workspace)))
    contenders.append(("gemv auto", auto, "plain",
                       lambda: launcher.gemv(case["w"], case["x"], workspace=workspace)))
    for variant, module in (variants or {}).items():
        if product.batch == 1:
            call = launcher.validate(case["w"], case["x"], splits=1)
            contenders.append((f"variant {variant}", 1, "plain",
                               lambda c=call, m=module: launcher.run(case["w"], case["x"], c, module=m)))
    contenders.append(("cublas", None, "plain", _torch_unfused(plain, case)))
    if product.form != "plain":
        contenders.append(("fused", fused_splits, product.form, _fused_call(product, case, workspace)))
        contenders.append(("torch unfused", None, product.form, _torch_unfused(product, case)))
    rows, cublas_us = [], None
    copy_us = None
    for name, splits, form, fn in contenders:
        row = {"product": product.name, "batch": product.batch, "form": form, "n_out": plain.n_out if form == "plain"
               else product.n_out, "k": product.k, "weight_bytes": product.weight_bytes, "contender": name,
               "splits": splits}
        if name != "copy":
            ratio = _checked(fn, case, form, dtype, splits or 1)
            row["error_over_bound"] = round_significant(ratio, 3) if ratio == ratio and ratio != float("inf") \
                else str(ratio)  # NaN or inf: a string, which JSON can hold
            if not ratio <= 1.0 and name not in ("cublas", "torch unfused"):
                row["status"] = "wrong result: not timed"
                rows.append(row)
                print(f"{product.name} B{product.batch} {name}: WRONG (|error| / bound {ratio:.3g})", file=sys.stderr)
                continue
        timing = time_call(fn, warmup=5, repeats=repeats, **DEVICE_TIME)
        us = timing.median_ms * 1e3
        row.update(us=round_significant(us), iqr_us=round_significant(timing.iqr_ms * 1e3, 3))
        if name == "copy":
            copy_us = us
            row["copy_gbps"] = round_significant(2 * product.weight_bytes / (us * 1e-6) / 1e9)
            row["read_ceiling_us"] = round_significant(us / 2)  # W's bytes at this copy's rate, read once
        else:
            ceiling_us = copy_us / 2  # reading W once: half of a copy, which reads and writes it
            row["of_weight_copy"] = round_significant(ceiling_us / us, 3)
            row["of_large_copy"] = round_significant(ws.copy_time_us(product.weight_bytes, large_gbps) / us, 3)
            if name == "cublas":
                cublas_us = us
            if name.startswith(("gemv", "v1", "fused")):
                plan = ws.launch(product if name == "fused" else plain, "v1" if name == "v1" else "gemv",
                                 splits or 1)
                row["predicted_us"] = round_significant(ws.predicted_time_us(product if name == "fused" else plain,
                                                                             plan, gpu), 3)
        rows.append(row)
    for row in rows:
        if cublas_us and row.get("us") and row["contender"] not in ("copy", "cublas"):
            row["x_cublas"] = round_significant(cublas_us / row["us"], 3)
    return rows


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batches", default="1,4,8,16", help="comma-separated batches, each 1 to 16")
    parser.add_argument("--products", default=",".join(p.name for p in ws.MODEL_PRODUCTS))
    parser.add_argument("--dtype", default="float16", choices=("float16", "bfloat16"))
    parser.add_argument("--repeats", type=int, default=50)
    parser.add_argument("--quick", action="store_true", help="10 repeats, no split sweep (auto only)")
    parser.add_argument("--json", default=None, help="where to write (default results/gemv/bench_<gpu>.json)")
    parser.add_argument("--variants", default="", help="build variants to time at batch 1 (names from "
                        "build.VARIANTS, comma-separated, or 'all'): each a build of its own (minutes when cold)")
    args = parser.parse_args(argv)
    import torch

    if not torch.cuda.is_available():
        print("the GEMV benchmark needs a CUDA GPU (CPU machines: the compile report and work_split's model)",
              file=sys.stderr)
        return 2
    batches = [int(b) for b in args.batches.split(",")]
    names = args.products.split(",")
    unknown = [n for n in names if n not in {p.name for p in ws.MODEL_PRODUCTS}]
    if unknown or not all(1 <= b <= 16 for b in batches):
        parser.error(f"products from {[p.name for p in ws.MODEL_PRODUCTS]} and batches 1 to 16 (got {unknown}, "
                     f"{batches})")
    from .build import VARIANT_FIELDS, VARIANTS, build_variant

    wanted = [v for v in VARIANTS if v != "default"] if args.variants == "all" else \
        [v for v in args.variants.split(",") if v]
    if [v for v in wanted if v not in VARIANTS]:
        parser.error(f"--variants: names from {list(VARIANTS)} or 'all'")
    variants = {name: build_variant(name) for name in wanted}
    repeats = 10 if args.quick else args.repeats
    sweep = () if args.quick else SPLITS
    large = large_copy_gbps(repeats)
    print(f"1 GiB copy: {large:.0f} GB/s", file=sys.stderr)
    path = args.json or gpu_results_path("gemv", "bench", on_cuda=True, smoke_name="bench_smoke.json")
    results = {"kind": "gemv", "environment": environment(), "timing": dict(DEVICE_TIME),
               "timing_words": DEVICE_TIME.words(), "dtype": args.dtype, "large_copy_gbps": round_significant(large),
               "variants": {name: dict(zip(VARIANT_FIELDS, VARIANTS[name])) for name in
                            ["default", *wanted]},
               "command": "python -m wb_kernels.stages.gemv.bench " + recorded_arguments(
                   argv if argv is not None else sys.argv[1:], REPO_ROOT),
               "complete": False, "rows": []}
    for batch in batches:
        for product in ws.model_products(batch):
            if product.name in names:
                measured = measure_product(product, args.dtype, repeats, sweep, large, variants=variants)
                results["rows"] += measured
                save_results(results, path)  # after each product: a kernel that faults later leaves these
                for row in measured:
                    print(f"{row['product']:8s} B{row['batch']:<2d} {row['contender']:15s} "
                          f"{row.get('us', float('nan')):9.2f} us  of copy {row.get('of_weight_copy', ''):>6} "
                          f"x cuBLAS {row.get('x_cublas', ''):>6}  {row.get('status', '')}", file=sys.stderr)
    results["complete"] = True
    save_results(results, path)
    print(f"wrote {path}", file=sys.stderr)
    wrong = [row for row in results["rows"] if row.get("status")]
    return 1 if wrong else 0


if __name__ == "__main__":
    sys.exit(main())
