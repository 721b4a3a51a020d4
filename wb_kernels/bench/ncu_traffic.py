"""Shared-memory traffic of the CUDA C++ attention stages, measured with Nsight Compute (needs a GPU); the mma
rung's lesson sets the wmma and mma kernels side by side with it.

    python -m wb_kernels.bench.ncu_traffic --stages wmma mma --json results/mma/smem_traffic.json
    python -m wb_kernels.bench.ncu_traffic --stages wmma --L 2048 --D 64 --dtype bfloat16 --causal
    python -m wb_kernels.bench.ncu_traffic --stages wmma mma --from-csv ncu.csv --device-name "NVIDIA H100 80GB HBM3"

The command runs itself under ncu (``--child``). The child draws one problem (by default B=4 H=16 L=4096 D=128
fp16, not causal), calls ``wb.attention(q, k, v, stage=...)`` ``--warmup`` times per stage (the extension's
build and load, the first launch), then once more per stage. ncu looks only at kernels named
``flash_<stage>_kernel``, skips the warm-up launches and profiles the last launch of each stage, so the numbers
are those of one attention call. The metrics (:data:`METRICS`) count what moves between the registers and
shared memory (bytes, wavefronts, bank conflicts, and the instructions that move it: LDS, STS, LDSM, LDGSTS),
plus the kernel's duration under ncu. The JSON holds them per stage with the shared-memory bytes and wavefronts
per FLOP, the GPU, the versions, the date and the command.
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

from ..attention_costs import attention_flops
from ..nsight import (ENVIRONMENT_TAG, SHARED_MEMORY_METRICS, UNIT_SCALE, environment_from, ncu_csv_rows,
                      ncu_version, recorded_command, unit_scale)
from ..results_files import recorded_arguments, shown_path

__all__ = ["METRICS", "KERNEL_NAME", "ENVIRONMENT_TAG", "UNIT_SCALE", "kernel_regex", "ncu_command", "unit_scale",
           "ncu_csv_rows", "recorded_command", "shown_path", "recorded_arguments", "parse_ncu_csv", "missing_metrics_message", "environment_from", "ncu_version",
           "build_result", "main"]

# One list, so that the command, the parser and the result agree. Every name is checked against the CSV: a
# metric this ncu does not know stops the run with its name (`ncu --query-metrics` lists the known ones).
METRICS = SHARED_MEMORY_METRICS + (
    "gpu__time_duration.sum",  # the kernel's duration under ncu (clocks as they run, caches flushed per pass)
)
KERNEL_NAME = "flash_{stage}_kernel"  # the __global__ function of every CUDA C++ rung (flash_wmma_kernel<...>)
DEFAULT_PROBLEM = {"B": 4, "H": 16, "L": 4096, "D": 128, "dtype": "float16", "causal": False}


def kernel_regex(stages) -> str:
    """The pattern ncu's ``--kernel-name regex:`` gets: the attention kernel of each stage and nothing else
    (not the input checks or copies that wb.attention launches around it)."""
    return "|".join(KERNEL_NAME.format(stage=re.escape(stage)) for stage in stages)


def _stage_of(kernel_name: str, stages):
    for stage in stages:
        if re.search(r"\b" + KERNEL_NAME.format(stage=re.escape(stage)) + r"\b", kernel_name):
            return stage
    return None


def ncu_command(ncu: str, stages, problem: dict, warmup: int) -> list:
    """The ncu command line that profiles the last launch of each stage's kernel in a ``--child`` run."""
    child = [sys.executable, "-m", "wb_kernels.bench.ncu_traffic", "--child", "--stages", *stages,
             "--warmup", str(warmup), "--B", str(problem["B"]), "--H", str(problem["H"]), "--L", str(problem["L"]),
             "--D", str(problem["D"]), "--dtype", problem["dtype"]] + (["--causal"] if problem["causal"] else [])
    # --launch-skip counts only the launches that match --kernel-name: the child's warm-up calls, all stages'
    # first, then one launch per stage. --clock-control none: the GPU at the clocks the benchmark sees.
    return [ncu, "--csv", "--print-units", "base", "--clock-control", "none", "--metrics", ",".join(METRICS),
            "--kernel-name", "regex:" + kernel_regex(stages), "--launch-skip", str(warmup * len(stages)),
            "--launch-count", str(len(stages)), *child]


def _value(row: dict, kernel: str) -> float:
    text = (row.get("Metric Value") or "").replace(",", "").strip()
    try:
        value = float(text)
    except ValueError:
        raise ValueError(f"ncu gave no number for {row.get('Metric Name')} of {kernel}: {text!r}") from None
    return value * unit_scale(row)


def parse_ncu_csv(text: str, stages) -> dict:
    """{stage: {"kernel": name, "metrics": {metric: value}}} from ``ncu --csv --print-units base`` output (other
    lines, the program's own output among them, are skipped). Bytes stay bytes, times become seconds.

    Raises ValueError when the table is missing, when a stage has no profiled launch or more than one, or when
    a metric of :data:`METRICS` is missing (with its name)."""
    launches: dict = {}  # (launch ID, kernel name) -> {metric: value}
    for row in ncu_csv_rows(text):
        kernel = row.get("Kernel Name") or ""
        if _stage_of(kernel, stages) is None or row.get("Metric Name") not in METRICS:
            continue
        launches.setdefault((row.get("ID"), kernel), {})[row["Metric Name"]] = _value(row, kernel)
    found = {}
    for stage in stages:
        mine = [(kernel, metrics) for (_, kernel), metrics in launches.items() if _stage_of(kernel, stages) == stage]
        name = KERNEL_NAME.format(stage=stage)
        if not mine:
            raise ValueError(f"ncu profiled no launch of {name} (stage {stage!r}): does the stage's kernel carry "
                             "that name, and did the child run on a GPU?")
        if len(mine) > 1:
            raise ValueError(f"ncu profiled {len(mine)} launches of {name}, expected one: does one wb.attention "
                             "call launch the kernel more than once? (--launch-skip counts one launch per call)")
        kernel, metrics = mine[0]
        missing = [metric for metric in METRICS if metric not in metrics]
        if missing:
            raise ValueError(f"ncu reported no value for {', '.join(missing)} of {name}: this ncu may not know "
                             "them (ncu --query-metrics lists those it does); edit METRICS in "
                             "wb_kernels/bench/ncu_traffic.py")
        found[stage] = {"kernel": kernel, "metrics": metrics}
    return found


def missing_metrics_message(ncu_output: str):
    """A clear message when ncu refused a metric name (``==ERROR== Failed to find metric ...``), else None."""
    refused = [line.strip() for line in ncu_output.splitlines() if "==ERROR==" in line and "metric" in line.lower()]
    if not refused:
        return None
    named = [metric for metric in METRICS if any(metric.split(".")[0] in line for line in refused)]
    return ("ncu does not know " + (", ".join(named) if named else "a metric of METRICS") + " on this GPU or in this "
            "version (ncu --query-metrics lists the names it knows); edit METRICS in wb_kernels/bench/ncu_traffic.py."
            "\nncu said:\n" + "\n".join(refused))


def build_result(measured: dict, problem: dict, environment: dict, *, command: str, ncu_command_line=None,
                 ncu_version=None) -> dict:
    """The JSON written: per stage its metrics and the shared-memory bytes and wavefronts per FLOP of the problem."""
    flops = attention_flops(problem["B"], problem["H"], problem["L"], problem["L"], problem["D"], problem["causal"])
    stages = {}
    for stage, found in measured.items():
        metrics = found["metrics"]
        wavefronts = metrics["l1tex__data_pipe_lsu_wavefronts_mem_shared.sum"]
        seconds = metrics["gpu__time_duration.sum"]
        stages[stage] = {
            "kernel": found["kernel"],
            "shared_bytes": metrics["sm__sass_data_bytes_mem_shared.sum"],
            "shared_bytes_per_flop": metrics["sm__sass_data_bytes_mem_shared.sum"] / flops,
            "shared_wavefronts": wavefronts,
            "shared_wavefronts_per_flop": wavefronts / flops,
            # the share of the shared-memory pipe's passes spent replaying bank conflicts
            "bank_conflicts_per_wavefront": metrics["l1tex__data_bank_conflicts_pipe_lsu_mem_shared.sum"] / wavefronts
            if wavefronts else None,
            "duration_ms_under_ncu": seconds * 1e3,
            "tflops_under_ncu": flops / seconds / 1e12 if seconds else None,
            "metrics": metrics,
        }
    return {
        "what": "shared-memory traffic of one attention launch per stage, measured with Nsight Compute",
        "gpu": environment.get("gpu") or environment.get("device"),
        "date": environment.get("date"),
        "environment": environment,
        "ncu_version": ncu_version,
        "command": command,
        "ncu_command": ncu_command_line,
        "problem": {**problem, "flops": flops},
        "ncu_metrics": list(METRICS),
        "stages": stages,
    }


def run_child(stages, problem: dict, warmup: int) -> None:
    import wb_kernels as wb

    from .results import environment

    if not wb.BACKEND.is_gpu:
        sys.exit("ncu_traffic needs a CUDA GPU (the simulator has no shared memory to count)")
    q, k, v = wb.random_qkv(problem["B"], problem["H"], problem["L"], problem["D"], dtype=problem["dtype"],
                            framework="torch", device="cuda")
    for stage in stages:
        for _ in range(warmup):
            wb.attention(q, k, v, stage=stage, causal=problem["causal"])
    for stage in stages:  # the launches ncu profiles
        wb.attention(q, k, v, stage=stage, causal=problem["causal"])
    wb.timing.synchronize()
    print(ENVIRONMENT_TAG + json.dumps(environment()), flush=True)


def _check_stages(parser, stages, problem: dict) -> None:
    """Refuse, before ncu starts, a stage that is not a CUDA C++ rung or cannot take the problem."""
    from ..stages import available_stages

    registered = available_stages()
    for stage in stages:
        if stage not in registered:
            parser.error(f"stage {stage!r} is not registered in this checkout (stages: {', '.join(registered)})")
        info = registered[stage]
        if not info.needs_gpu:
            parser.error(f"stage {stage!r} is not a CUDA C++ rung (its kernels are not named "
                         f"{KERNEL_NAME.format(stage=stage)}); ncu_traffic profiles those only")
        if problem["dtype"] not in info.dtypes:
            parser.error(f"stage {stage!r} takes {', '.join(info.dtypes)}, not {problem['dtype']}")
        if info.head_dims is not None and problem["D"] not in info.head_dims:
            parser.error(f"stage {stage!r} takes head dims {', '.join(map(str, info.head_dims))}, not {problem['D']}")


def _positive(text: str) -> int:
    value = int(text)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {value}")
    return value


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m wb_kernels.bench.ncu_traffic",
                                     description=__doc__.split("\n\n")[0].replace("\n", " "),
                                     formatter_class=argparse.RawDescriptionHelpFormatter,
                                     epilog=__doc__.split("\n\n", 1)[1])
    parser.add_argument("--stages", nargs="+", required=True, help="CUDA C++ stages to profile, e.g. wmma mma")
    parser.add_argument("--json", type=Path, help="where to write the result (default: "
                                                  "results/<last stage>/smem_traffic.json)")
    for name, what in (("B", "batch"), ("H", "heads"), ("L", "sequence length, Lq = Lk"), ("D", "head dim")):
        parser.add_argument(f"--{name}", type=_positive, default=DEFAULT_PROBLEM[name],
                            help=f"{what} (default {DEFAULT_PROBLEM[name]})")
    parser.add_argument("--dtype", choices=("float16", "bfloat16"), default=DEFAULT_PROBLEM["dtype"])
    parser.add_argument("--causal", action="store_true", help="causal attention (default: not)")
    parser.add_argument("--warmup", type=_positive, default=3, help="unprofiled calls per stage before the one "
                                                                     "ncu profiles (default 3)")
    parser.add_argument("--ncu", default=shutil.which("ncu") or "ncu", help="path of Nsight Compute's ncu")
    parser.add_argument("--from-csv", type=Path, help="parse this ncu CSV (ncu's whole output) instead of running ncu")
    parser.add_argument("--device-name", default="", help="with --from-csv: the GPU the CSV came from, when the "
                                                          "CSV does not say")
    parser.add_argument("--timeout", type=float, default=600, help="give up on ncu after this many seconds")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    return parser


def main(argv=None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    stages = list(args.stages)
    if len(set(stages)) != len(stages):
        parser.error(f"--stages names a stage twice: {' '.join(stages)}")
    problem = {"B": args.B, "H": args.H, "L": args.L, "D": args.D, "dtype": args.dtype, "causal": args.causal}
    if args.child:
        run_child(stages, problem, args.warmup)
        return 0
    from .results import REPO_ROOT, save_results

    out = args.json or REPO_ROOT / "results" / stages[-1] / "smem_traffic.json"
    command = "python -m wb_kernels.bench.ncu_traffic " + recorded_arguments(
        argv if argv is not None else sys.argv[1:], REPO_ROOT, ("--json", "--from-csv"))
    if args.from_csv:
        if not args.from_csv.is_file():
            parser.error(f"--from-csv: no file {args.from_csv}")
        text = args.from_csv.read_text()
        environment = environment_from(text) or {"gpu": args.device_name or None}
        command_line, version = None, None
    else:
        _check_stages(parser, stages, problem)
        from ..backend import BACKEND

        if not BACKEND.is_gpu:
            parser.error("profiling needs a CUDA GPU, and this machine runs the CUDA simulator; --from-csv parses "
                         "ncu's output from a GPU machine")
        if shutil.which(args.ncu) is None:
            parser.error(f"ncu not found ({args.ncu}): install Nsight Compute or name it with --ncu PATH")
        command_line = ncu_command(args.ncu, stages, problem, args.warmup)
        version = ncu_version(args.ncu)
        print("running:", " ".join(command_line), file=sys.stderr)
        try:
            done = subprocess.run(command_line, capture_output=True, text=True, timeout=args.timeout)
        except subprocess.TimeoutExpired as stuck:
            tail = (stuck.stdout or b"")[-3000:]
            sys.exit(f"ncu did not finish in {args.timeout:.0f} s:\n"
                     f"{tail.decode(errors='replace') if isinstance(tail, bytes) else tail}")
        text = done.stdout + "\n" + done.stderr
        refused = missing_metrics_message(text)
        if refused:
            sys.exit(refused)
        if done.returncode != 0:
            sys.exit(f"ncu failed ({done.returncode}):\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}")
        environment = environment_from(done.stdout) or {}
    try:
        measured = parse_ncu_csv(text, stages)
    except ValueError as problem_in_csv:
        sys.exit(f"error: {problem_in_csv}")
    result = build_result(measured, problem, environment, command=command,
                          ncu_command_line=recorded_command(command_line) if command_line else None,
                          ncu_version=version)
    save_results(result, out)
    for stage, numbers in result["stages"].items():
        print(f"{stage:8s} shared memory {numbers['shared_bytes'] / 2**20:10.1f} MiB, "
              f"{numbers['shared_bytes_per_flop']:.4f} B/FLOP, {numbers['shared_wavefronts_per_flop'] * 1e3:.4f} "
              f"wavefronts per kFLOP, bank conflicts {numbers['bank_conflicts_per_wavefront'] or 0:.1%} of them; "
              f"{numbers['duration_ms_under_ncu']:.3f} ms under ncu")
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
