#!/usr/bin/env python3
"""Measure the DRAM traffic of each naive kernel with Nsight Compute (needs a GPU); lesson 02 shows the result.

    python -m wb_kernels.stages.naive.traffic                      # L=4096 D=64 B*H=4: runs itself under ncu,
                                                                   # writes results/naive/traffic.json
    python -m wb_kernels.stages.naive.traffic --L 2048 --D 128     # another size
    python -m wb_kernels.stages.naive.traffic --from-csv ncu.csv   # parse a CSV that ncu wrote elsewhere

What ncu runs (``--child``) launches each of the three naive kernels exactly once, through the same
``naive_forward`` the package uses. The metrics are ``dram__bytes_read.sum`` and ``dram__bytes_write.sum``
with ``--clock-control none`` (the GPU at its normal clocks). The JSON holds, per kernel, the measured
bytes next to the analytic ones of ``wb_kernels.stages.naive.kernel.global_memory_traffic``.
"""

from __future__ import annotations

import argparse
import csv
import io
import json
import shutil
import subprocess
import sys
from pathlib import Path

from ... import timing
from ...backend import BACKEND, device_name
from ...inputs import random_qkv

ROOT = Path(__file__).resolve().parents[3]  # the repository
KERNELS = ("scores_kernel", "row_softmax_kernel", "weighted_sum_kernel")
METRICS = ("dram__bytes_read.sum", "dram__bytes_write.sum")
DEFAULT_OUTPUT = ROOT / "results" / "naive" / "traffic.json"


def run_child(B: int, H: int, L: int, D: int) -> None:
    from wb_kernels.stages.naive.kernel import naive_forward

    if not BACKEND.is_gpu:
        sys.exit("measure_traffic needs a CUDA GPU (the simulator has no DRAM to measure)")
    q, k, v = random_qkv(B, H, L, D, framework="torch", device="cuda")
    naive_forward(q, k, v)  # one launch of each kernel: the ones ncu profiles
    timing.synchronize()
    print(json.dumps({"device": device_name()}))


def parse_ncu_csv(text: str) -> dict:
    """{kernel: {metric: bytes}} from ``ncu --csv --print-units base`` output (other lines are skipped)."""
    lines = text.splitlines()
    start = next((n for n, line in enumerate(lines) if '"Kernel Name"' in line and '"Metric Name"' in line), None)
    if start is None:
        raise ValueError("no ncu CSV table (a header with \"Kernel Name\" and \"Metric Name\") in the output")
    found: dict = {}
    for row in csv.DictReader(io.StringIO("\n".join(lines[start:]))):
        kernel = next((name for name in KERNELS if name in (row.get("Kernel Name") or "")), None)
        if kernel is None or row.get("Metric Name") not in METRICS:
            continue
        value = float(row["Metric Value"].replace(",", ""))
        scale = {"byte": 1, "Kbyte": 1e3, "Mbyte": 1e6, "Gbyte": 1e9}.get(row.get("Metric Unit", "byte"), 1)
        found.setdefault(kernel, {})[row["Metric Name"]] = value * scale
    missing = [name for name in KERNELS if name not in found]
    if missing:
        raise ValueError(f"ncu reported no metrics for {missing}; was the child run on a GPU?")
    return found


def build_result(measured: dict, B: int, H: int, L: int, D: int, device: str) -> dict:
    from wb_kernels.stages.naive.kernel import global_memory_traffic

    analytic = global_memory_traffic(B, H, L, L, D)
    return {
        "what": "DRAM bytes of each naive kernel, one launch each, measured with Nsight Compute",
        "ncu_metrics": list(METRICS),
        "device": device,
        "B": B, "H": H, "L": L, "D": D,
        "kernels": {
            name: {"dram_read_bytes": measured[name]["dram__bytes_read.sum"],
                   "dram_write_bytes": measured[name]["dram__bytes_write.sum"],
                   **{f"analytic_{key}": value for key, value in analytic[name].items()}}
            for name in KERNELS
        },
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--B", type=int, default=1)
    parser.add_argument("--H", type=int, default=4)
    parser.add_argument("--L", type=int, default=4096)
    parser.add_argument("--D", type=int, default=64)
    parser.add_argument("--out", type=Path, default=DEFAULT_OUTPUT)
    parser.add_argument("--ncu", default=shutil.which("ncu") or "ncu", help="path of Nsight Compute's ncu")
    parser.add_argument("--from-csv", type=Path, help="parse this ncu CSV instead of running ncu")
    parser.add_argument("--device-name", default="", help="with --from-csv: the GPU the CSV came from")
    parser.add_argument("--timeout", type=float, default=600, help="give up on ncu after this many seconds")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()

    if args.child:
        run_child(args.B, args.H, args.L, args.D)
        return
    if args.from_csv:
        text, device = args.from_csv.read_text(), args.device_name or "unknown GPU"
    else:
        # --launch-count: the three kernels once each, then ncu lets the process run on unprofiled
        command = [args.ncu, "--csv", "--print-units", "base", "--clock-control", "none",
                   "--metrics", ",".join(METRICS), "-k", "regex:" + "|".join(KERNELS), "--launch-count", "3",
                   sys.executable, str(Path(__file__).resolve()), "--child",
                   "--B", str(args.B), "--H", str(args.H), "--L", str(args.L), "--D", str(args.D)]
        print("running:", " ".join(command), file=sys.stderr)
        try:
            done = subprocess.run(command, capture_output=True, text=True, timeout=args.timeout)
        except subprocess.TimeoutExpired as stuck:
            tail = lambda b: (b or b"").decode(errors="replace")[-3000:]  # noqa: E731
            sys.exit(f"ncu did not finish in {args.timeout:.0f} s:\n{tail(stuck.stdout)}\n{tail(stuck.stderr)}")
        if done.returncode != 0:
            sys.exit(f"ncu failed ({done.returncode}):\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}")
        text = done.stdout
        device = next((json.loads(line)["device"] for line in text.splitlines() if line.startswith('{"device"')),
                      "unknown GPU")
    result = build_result(parse_ncu_csv(text), args.B, args.H, args.L, args.D, device)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    for name, numbers in result["kernels"].items():
        print(f"{name:20s} DRAM read {numbers['dram_read_bytes'] / 2**20:10.1f} MiB "
              f"(analytic {numbers['analytic_read_compulsory'] / 2**20:.1f} to {numbers['analytic_read_requested'] / 2**20:.1f}), "
              f"written {numbers['dram_write_bytes'] / 2**20:10.1f} MiB (analytic {numbers['analytic_write'] / 2**20:.1f})")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
