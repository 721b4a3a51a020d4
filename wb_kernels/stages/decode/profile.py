"""Nsight Compute's view of the decode rung's tensor-core kernel (lesson 07, "Bytes from the profiler"; needs a GPU
and ``ncu``).

    python -m wb_kernels.stages.decode.profile --json results/decode/ncu_mma_h100.json

For each point of :data:`POINTS` (B, H, Hk, Lk, splits; 0 splits: the launcher's) one child process runs under ncu
(``--child``): it draws float16 q, K and V on the GPU, calls ``flash_decode_mma_forward`` three times unprofiled (the
extension's load, the shared-memory opt-in), then once between ``cudaProfilerStart`` and ``cudaProfilerStop``. ncu
runs with ``--profile-from-start off --set full`` and its default clock and cache control (clocks locked, caches
flushed before each kernel), so it profiles exactly that call's kernels: the mma kernel and, where the splits are not
merged in its launch, the merge kernel. ``ncu -i <report> --page details`` is read by :func:`parse_details`: each
kernel's duration, DRAM throughput, L2 hit rate, issue rate, registers and occupancy, and the bytes it moved to and
from DRAM (throughput times duration: three significant digits). A point that fails or passes ``--timeout`` is
recorded with its reason and the others go on.
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

__all__ = ["POINTS", "parse_details", "ncu_command", "run_child", "main"]

# (B, H, Hk, Lk, splits): MQA at the bar shapes (B8 Lk8192 at the launcher's splits and at 16), and GQA 8
POINTS = ((8, 32, 1, 8192, 0), (8, 32, 1, 8192, 16), (1, 32, 1, 2048, 0), (8, 32, 4, 8192, 0))
_UNITS = {"Tbyte/s": 1e12, "Gbyte/s": 1e9, "Mbyte/s": 1e6, "Kbyte/s": 1e3, "byte/s": 1.0}
_HEADER = re.compile(r"^\s*(?:void )?(?:wb::)?(decode_\w+)<[^\n]*?\((\d+), (\d+), (\d+)\)x\((\d+), (\d+), (\d+)\)",
                     re.M)


def _metric(block: str, name: str, unit: str | None = None):
    """The value of the details page's line ``name  unit  value`` in `block` (the first with `unit`), or None."""
    for match in re.finditer(rf"^\s*{re.escape(name)}\s+(\S+)?\s+([\d,.]+)\s*$", block, re.M):
        if unit is None or match.group(1) == unit:
            return float(match.group(2).replace(",", ""))
    return None


def parse_details(text: str) -> list:
    """Every decode kernel of an ``ncu --page details`` text: one dict each, in the order ncu lists them."""
    headers = list(_HEADER.finditer(text))
    kernels = []
    for index, header in enumerate(headers):
        block = text[header.end():headers[index + 1].start() if index + 1 < len(headers) else len(text)]
        name = header.group(1)
        duration = _metric(block, "Duration", "us")
        throughput = next((_metric(block, "Memory Throughput", unit) * scale for unit, scale in _UNITS.items()
                           if _metric(block, "Memory Throughput", unit) is not None), None)
        kernels.append(dict(
            kernel="mma" if name == "decode_mma_kernel" else "merge" if "merge" in name else name,
            grid=[int(header.group(i)) for i in (2, 3, 4)], threads=int(header.group(5)), duration_us=duration,
            dram_throughput_pct=_metric(block, "DRAM Throughput", "%"), dram_bytes_per_s=throughput,
            dram_bytes=round(throughput * duration * 1e-6) if throughput and duration else None,
            l2_hit_rate_pct=_metric(block, "L2 Hit Rate", "%"),
            issued_warps_per_scheduler=_metric(block, "Issued Warp Per Scheduler"),
            warp_cycles_per_issue=_metric(block, "Warp Cycles Per Issued Instruction", "cycle"),
            registers=_metric(block, "Registers Per Thread", "register/thread"),
            achieved_occupancy_pct=_metric(block, "Achieved Occupancy", "%"),
            sm_frequency_ghz=_metric(block, "SM Frequency", "Ghz") or _metric(block, "SM Frequency", "GHz")))
    return kernels


def ncu_command(ncu: str, report: Path, point) -> list:
    """The ncu command that profiles one point's call (its child process) into `report`."""
    return [ncu, "--profile-from-start", "off", "--set", "full", "-f", "-o", str(report), sys.executable, "-m",
            "wb_kernels.stages.decode.profile", "--child", ",".join(str(x) for x in point)]


def run_child(point) -> None:
    """The profiled process: one call of the mma kernel at `point` between cudaProfilerStart and Stop."""
    import torch

    import wb_kernels  # noqa: F401  (chooses the backend)
    from wb_kernels.stages.decode import build, launcher

    B, H, Hk, L, splits = point
    D = 128
    generator = torch.Generator(device="cuda").manual_seed(0)
    q = torch.randn(B, H, D, device="cuda", dtype=torch.float16, generator=generator)
    k, v = (torch.randn(B, Hk, L, D, device="cuda", dtype=torch.float16, generator=generator) for _ in range(2))
    lengths = torch.full((B,), L, dtype=torch.int32, device="cuda")
    status = torch.zeros(1, dtype=torch.int32, device="cuda")
    if splits == 0:
        keys, splits, _ = launcher._cuda_launch_plan(torch.cuda.current_device(), B, H, Hk, L, None, D, False, False,
                                                    "mma")
    else:
        keys, splits = launcher.cuda_split_plan(L, splits)
    extension = build.extension()

    def call():
        return extension.flash_decode_mma_forward(q, k, v, None, lengths, status, keys, splits, D ** -0.5)

    for _ in range(3):
        call()
    torch.cuda.synchronize()
    torch.cuda.cudart().cudaProfilerStart()
    call()
    torch.cuda.synchronize()
    torch.cuda.cudart().cudaProfilerStop()
    print(json.dumps(dict(splits=splits, keys_per_split=keys, status=int(status.item()))))


def _profile_point(ncu: str, point, timeout: float) -> list:
    """One row per kernel of the point's call (the point's shape and splits in each), or one row with an error."""
    B, H, Hk, L, asked = point
    row = dict(B=B, H=H, Hk=Hk, Lk=L, D=128, asked_splits=asked)
    with tempfile.TemporaryDirectory() as folder:
        report = Path(folder) / "point"
        try:
            run = subprocess.run(ncu_command(ncu, report, point), capture_output=True, text=True, timeout=timeout)
            details = subprocess.run([ncu, "-i", f"{report}.ncu-rep", "--page", "details"], capture_output=True,
                                     text=True, timeout=timeout)
        except subprocess.TimeoutExpired:
            return [dict(row, error=f"ncu passed the {timeout:.0f} s timeout")]
    told = [json.loads(line) for line in run.stdout.splitlines() if line.startswith("{")]
    kernels = parse_details(details.stdout)
    if run.returncode != 0 or not told or not kernels:
        return [dict(row, error=f"ncu exited {run.returncode}: {(run.stdout + run.stderr)[-1500:]}")]
    return [dict(row, **told[-1], **kernel) for kernel in kernels]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", type=Path, default=None, help="where to write the results (default: print only)")
    parser.add_argument("--ncu", default=shutil.which("ncu") or "ncu", help="the ncu executable")
    parser.add_argument("--timeout", type=float, default=180.0, help="seconds per point")
    parser.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child is not None:
        run_child(tuple(int(x) for x in args.child.split(",")))
        return 0
    import wb_kernels

    if not wb_kernels.BACKEND.is_gpu:
        print("profile.py profiles the CUDA C++ kernel: it needs a CUDA GPU and ncu", file=sys.stderr)
        return 2
    from wb_kernels.bench.results import environment

    runs = [row for point in POINTS for row in _profile_point(args.ncu, point, args.timeout)]
    for run in runs:
        print(json.dumps(run)[:400], file=sys.stderr)
    result = dict(kind="decode_ncu_mma", environment=environment(),
                  command=" ".join(["python -m wb_kernels.stages.decode.profile"] + (argv or sys.argv[1:])),
                  notes=dict(clocks="ncu's default: clocks locked, caches flushed before each kernel; durations are "
                                    "ncu's, not the benchmark's",
                             dram_bytes="ncu's DRAM throughput (three significant digits) times its duration"),
                  records=runs)
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(result, indent=1) + "\n")
    return 1 if any("error" in run for run in runs) else 0


if __name__ == "__main__":
    sys.exit(main())
