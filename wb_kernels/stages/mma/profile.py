"""Why the mma kernel runs at about half cuDNN's speed on an H100: Nsight Compute's evidence, next to SDPA's FLASH
and cuDNN kernels on the same problems (lesson 06, section "Where the time goes"; needs a GPU and ``ncu``).

    python -m wb_kernels.stages.mma.profile --json results/mma/ncu_h100.json
    python -m wb_kernels.stages.mma.profile --contenders mma --shapes 4,16,4096,64 --json /tmp/ncu.json

For every (contender, shape) the command runs one child process under ncu (``--child``): it draws the problem,
calls the contender ``--warmup`` times unprofiled (the extension's build and load, cuDNN's plan), then once between
``cudaProfilerStart`` and ``cudaProfilerStop``; ncu runs with ``--profile-from-start off`` and so profiles exactly
the kernels of that one call, whatever they are named (the mma kernel's launches are also filtered by name,
``flash_mma_kernel``). The contenders are called as the benchmark times them: the mma stage's launcher
(``launcher.forward``), and ``scaled_dot_product_attention`` forced to one backend (``wb_kernels.tuning.sdpa_call``).

ncu runs with ``--clock-control none`` (the GPU at the clocks the benchmark sees) and its default cache control
(caches flushed before each replay pass). The metrics (:data:`METRICS`, each with what it says) are checked against
``ncu --query-metrics`` first: one this ncu does not know is recorded under ``metrics_missing`` and left out of the
run instead of stopping it, and if ncu still refuses one, the run is repeated without it. A run that fails or
passes ``--timeout`` is recorded with its reason, and the others go on. The JSON names the GPU, the versions, the
date, the commit and the exact ncu command of each run; :func:`summary` reads the numbers the lesson shows from it.
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

from ...backend import BACKEND
from ...inputs import random_qkv
from ... import nsight
from ...attention_costs import attention_flops
from ...results_files import shown_path

__all__ = ["METRICS", "STALL_REASONS", "CONTENDERS", "DEFAULT_SHAPES", "metric_base", "known_metric_bases",
           "unknown_metrics", "refused_metrics", "parse_ncu_csv", "main_kernel", "summary", "ncu_command", "build_result", "main"]

# Why the metric is there -> names. Rollups (.sum, .avg.pct_of_peak_sustained_active, .ratio) are part of the name.
STALL_REASONS = ("barrier", "branch_resolving", "dispatch_stall", "drain", "imc_miss", "lg_throttle",
                 "long_scoreboard", "math_pipe_throttle", "membar", "mio_throttle", "misc", "no_instruction",
                 "not_selected", "selected", "short_scoreboard", "sleeping", "tex_throttle", "wait")
_SHARED = nsight.SHARED_MEMORY_METRICS  # the benchmark's traffic run measures the same set
METRICS = (
    "gpu__time_duration.sum",  # the kernel's duration under ncu (one replay pass; not the benchmark's timing)
    "sm__cycles_elapsed.avg.per_second",  # the SM clock the kernel ran at
    # tensor pipes, in % of the cycles the SMs were active: any tensor op; mma.sync/HMMA (this kernel, FLASH);
    # Hopper's wgmma (GMMA), which cuDNN's kernels use
    "sm__pipe_tensor_cycles_active.avg.pct_of_peak_sustained_active",
    "sm__pipe_tensor_op_hmma_cycles_active.avg.pct_of_peak_sustained_active",
    "sm__pipe_tensor_op_gmma_cycles_active.avg.pct_of_peak_sustained_active",
    "sm__inst_executed_pipe_tensor_op_hmma.sum",
    "sm__inst_executed_pipe_tensor_op_gmma.sum",
    "sm__throughput.avg.pct_of_peak_sustained_elapsed",
    "smsp__issue_active.avg.pct_of_peak_sustained_active",  # cycles in which a scheduler issued an instruction
    "smsp__inst_executed.sum",
    # occupancy: achieved (warps resident, % of the SM's 64) and what limits the theoretical one
    "sm__warps_active.avg.pct_of_peak_sustained_active",
    "sm__maximum_warps_per_active_cycle_pct",
    "launch__occupancy_limit_registers",
    "launch__occupancy_limit_shared_mem",
    "launch__occupancy_limit_warps",
    "launch__occupancy_limit_blocks",
    "launch__registers_per_thread",
    "launch__block_size",
    "launch__grid_size",
    "launch__shared_mem_per_block_dynamic",
    "launch__shared_mem_per_block_static",
    "launch__waves_per_multiprocessor",
    # shared memory (the same counters as results/mma/smem_traffic.json) and spills to local memory
    *_SHARED,
    "smsp__sass_inst_executed_op_local_ld.sum",
    "smsp__sass_inst_executed_op_local_st.sum",
    # DRAM
    "dram__bytes_read.sum",
    "dram__bytes_write.sum",
    "gpu__dram_throughput.avg.pct_of_peak_sustained_elapsed",
    # why warps did not issue: the average cycles a warp spent in each state over its life (Warp State Statistics) ...
    *(f"smsp__average_warp_latency_issue_stalled_{reason}.ratio" for reason in STALL_REASONS),
    "smsp__average_warps_active_per_issue_active.ratio",  # cycles between two instructions of one warp
    # ... and the same from PC sampling (samples per state; ncu's Source view)
    *(f"smsp__pcsamp_warps_issue_stalled_{reason}" for reason in STALL_REASONS),
    "smsp__pcsamp_sample_count",
)

# name -> (what the lesson calls it, the benchmark's contender name)
CONTENDERS = {"mma": ("mma (this lesson)", "mma"), "sdpa-flash": ("SDPA FLASH (FlashAttention-2)", "sdpa-flash"),
              "sdpa-cudnn": ("SDPA cuDNN", "sdpa-cudnn")}
_SDPA_BACKENDS = {"sdpa-flash": "FLASH_ATTENTION", "sdpa-cudnn": "CUDNN_ATTENTION"}
MMA_KERNEL = "flash_mma_kernel"
# (B, H, L, D), fp16, not causal: the shape of the benchmark's headline and of results/mma/smem_traffic.json, and D=64
DEFAULT_SHAPES = ((4, 16, 4096, 128), (4, 16, 4096, 64))
DEFAULT_DTYPE = "float16"
_CHILD_TAG = "wb_profile_child "  # the child's line that says what it ran


# --- ncu's output ------------------------------------------------------------------------------------------------

def metric_base(metric: str) -> str:
    """The name ``ncu --query-metrics`` lists: without the rollup (``dram__bytes_read.sum`` -> ``dram__bytes_read``).
    PC-sampling and launch metrics have no rollup."""
    return metric.split(".", 1)[0]


def known_metric_bases(query_output: str) -> set:
    """The metric names in ``ncu --query-metrics`` output (first word of each table line)."""
    names = set()
    for line in query_output.splitlines():
        word = line.strip().split(" ", 1)[0] if line.strip() else ""
        if re.fullmatch(r"[a-z0-9]+__[A-Za-z0-9_]+", word):
            names.add(word)
    return names


def unknown_metrics(metrics, known) -> list:
    """The metrics of `metrics` that ncu's list `known` (:func:`known_metric_bases`) does not hold. A family the list
    does not show at all (say ``launch__``) is not judged by it: ncu may list some families apart."""
    if not known:
        return []
    families = {name.split("__", 1)[0] for name in known}
    return [m for m in metrics if m.split("__", 1)[0] in families and metric_base(m) not in known]


def refused_metrics(ncu_output: str, requested) -> list:
    """The metrics of `requested` that ncu's error lines name (``==ERROR== Failed to find metric ...``)."""
    errors = [line for line in ncu_output.splitlines() if "==ERROR==" in line and "metric" in line.lower()]
    return [m for m in requested if any(re.search(r"\b" + re.escape(metric_base(m)) + r"\b", line) for line in errors)]


def _number(text: str):
    text = (text or "").replace(",", "").strip()
    try:
        return float(text)
    except ValueError:
        return text or None  # n/a, a name: kept as ncu wrote it


def parse_ncu_csv(text: str) -> list:
    """Every profiled kernel in ``ncu --csv --print-units base`` output (other lines, the program's among them, are
    skipped), in launch order: ``[{"id", "name", "metrics": {metric: value}}]``. Bytes stay bytes, times become
    seconds (``nsight.UNIT_SCALE``), percentages stay percentages; a value that is not a number is kept as
    text. Raises ValueError when there is no ncu table at all."""
    kernels: dict = {}
    for row in nsight.ncu_csv_rows(text):
        if not row.get("Metric Name"):
            continue
        key = row.get("ID") or str(len(kernels))
        kernel = kernels.setdefault(key, {"id": key, "name": row.get("Kernel Name") or "", "metrics": {}})
        value = _number(row.get("Metric Value"))
        if isinstance(value, float):
            value *= nsight.unit_scale(row)
        kernel["metrics"][row["Metric Name"]] = value
    return sorted(kernels.values(), key=lambda k: int(k["id"]) if str(k["id"]).isdigit() else 0)


def main_kernel(kernels: list):
    """The kernel of a call that took longest under ncu (an attention call may launch a small helper beside it)."""
    timed = [k for k in kernels if isinstance(k["metrics"].get("gpu__time_duration.sum"), float)]
    return max(timed, key=lambda k: k["metrics"]["gpu__time_duration.sum"]) if timed else (kernels[0] if kernels
                                                                                            else None)


def _get(metrics: dict, name: str):
    value = metrics.get(name)
    return value if isinstance(value, float) else None


def summary(run: dict) -> dict:
    """The numbers the lesson shows for one profiled run (None where ncu did not measure them): duration and
    TFLOP/s under ncu, tensor-pipe activity, issue activity, occupancy (achieved, theoretical, registers per thread,
    shared memory per block), shared-memory bytes and bank conflicts, DRAM bytes, and ``top_stalls``: the states a
    warp waited in, ranked, each as its share of the warp's cycles (ncu's Warp State Statistics give the average
    cycles a warp spent in each state over its life; "selected", the cycles it issued, counts in the total but is not
    a stall). Without those, PC sampling's share of samples in each state."""
    m = run.get("metrics") or {}
    seconds = _get(m, "gpu__time_duration.sum")
    flops = run["problem"]["flops"]
    tensor = [_get(m, f"sm__pipe_tensor{kind}_cycles_active.avg.pct_of_peak_sustained_active")
              for kind in ("", "_op_hmma", "_op_gmma")]
    cycles = {reason: _get(m, f"smsp__average_warp_latency_issue_stalled_{reason}.ratio") for reason in STALL_REASONS}
    source = "share of a warp's cycles (Warp State Statistics)"
    if not any(cycles.values()):
        cycles = {r: _get(m, f"smsp__pcsamp_warps_issue_stalled_{r}") for r in STALL_REASONS}
        source = "share of PC samples"
    total = sum(v for v in cycles.values() if v)
    shares = {r: v / total for r, v in cycles.items() if v and total}
    ranked = sorted(((r, v) for r, v in shares.items() if r != "selected"), key=lambda item: -item[1])
    dram = [_get(m, f"dram__bytes_{way}.sum") for way in ("read", "write")]
    dynamic, static = (_get(m, f"launch__shared_mem_per_block_{kind}") for kind in ("dynamic", "static"))
    return {
        "kernel": run.get("kernel"),
        "duration_ms": seconds * 1e3 if seconds else None,
        "tflops": flops / seconds / 1e12 if seconds else None,
        "sm_clock_ghz": (_get(m, "sm__cycles_elapsed.avg.per_second") or 0) / 1e9 or None,
        "tensor_pipe_pct": tensor[0] if tensor[0] is not None else max((t for t in tensor if t is not None),
                                                                       default=None),
        "tensor_pipe_hmma_pct": tensor[1],
        "tensor_pipe_gmma_pct": tensor[2],
        "issue_active_pct": _get(m, "smsp__issue_active.avg.pct_of_peak_sustained_active"),
        "achieved_occupancy_pct": _get(m, "sm__warps_active.avg.pct_of_peak_sustained_active"),
        "theoretical_occupancy_pct": _get(m, "sm__maximum_warps_per_active_cycle_pct"),
        "registers_per_thread": _get(m, "launch__registers_per_thread"),
        "threads_per_block": _get(m, "launch__block_size"),
        "shared_bytes_per_block": (dynamic or 0) + (static or 0) if dynamic is not None or static is not None
        else None,
        "shared_bytes": _get(m, "sm__sass_data_bytes_mem_shared.sum"),
        "shared_bytes_per_flop": (_get(m, "sm__sass_data_bytes_mem_shared.sum") or 0) / flops
        if _get(m, "sm__sass_data_bytes_mem_shared.sum") is not None else None,
        "shared_bank_conflicts": _get(m, "l1tex__data_bank_conflicts_pipe_lsu_mem_shared.sum"),
        "shared_wavefronts": _get(m, "l1tex__data_pipe_lsu_wavefronts_mem_shared.sum"),
        "local_loads": _get(m, "smsp__sass_inst_executed_op_local_ld.sum"),
        "dram_bytes": sum(dram) if None not in dram else None,
        # q, k, v read and o written once: 4 B H L D 16-bit values
        "compulsory_dram_bytes": 4 * 2 * run["problem"]["B"] * run["problem"]["H"] * run["problem"]["L"]
        * run["problem"]["D"],
        "dram_throughput_pct": _get(m, "gpu__dram_throughput.avg.pct_of_peak_sustained_elapsed"),
        "cycles_between_issues": _get(m, "smsp__average_warps_active_per_issue_active.ratio"),
        "issuing_share": shares.get("selected"),
        "stall_unit": source,
        "top_stalls": ranked[:5],
    }


# --- running ncu ---------------------------------------------------------------------------------------------------

def ncu_command(ncu: str, contender: str, shape, dtype: str, warmup: int, metrics) -> list:
    """The ncu command line that profiles one call of `contender` on `shape` (B, H, L, D) in a ``--child`` run."""
    B, H, L, D = shape
    child = [sys.executable, "-m", "wb_kernels.stages.mma.profile", "--child", "--contenders", contender,
             "--shapes", f"{B},{H},{L},{D}", "--dtype", dtype, "--warmup", str(warmup)]
    name_filter = ["--kernel-name", f"regex:{MMA_KERNEL}"] if contender == "mma" else []
    return [ncu, "--csv", "--print-units", "base", "--clock-control", "none", "--profile-from-start", "off",
            *name_filter, "--metrics", ",".join(metrics), *child]


def _call(contender: str, q, k, v):
    if contender == "mma":
        from .launcher import forward

        return lambda: forward(q, k, v)
    from ...tuning import sdpa_call

    return sdpa_call(q, k, v, _SDPA_BACKENDS[contender])


def run_child(contender: str, shape, dtype: str, warmup: int) -> None:
    import torch

    if not BACKEND.is_gpu:
        sys.exit("profile needs a CUDA GPU")
    B, H, L, D = shape
    q, k, v = random_qkv(B, H, L, D, dtype=dtype, framework="torch", device="cuda")
    call = _call(contender, q, k, v)
    for _ in range(warmup):
        call()
    torch.cuda.synchronize()
    torch.cuda.profiler.start()  # cudaProfilerStart: with --profile-from-start off, ncu profiles from here ...
    call()
    torch.cuda.synchronize()
    torch.cuda.profiler.stop()  # ... to here: the kernels of this one call
    from ...results_files import environment

    print(nsight.ENVIRONMENT_TAG + json.dumps(environment()), flush=True)
    print(_CHILD_TAG + json.dumps({"contender": contender, "shape": list(shape), "dtype": dtype}), flush=True)


def _query_known(ncu: str, timeout: float):
    try:
        done = subprocess.run([ncu, "--query-metrics"], capture_output=True, text=True, timeout=timeout)
    except (OSError, subprocess.SubprocessError):
        return None
    known = known_metric_bases(done.stdout)
    return known if len(known) > 50 else None  # too few: not the table we expect, so do not filter by it


def _tail(text) -> str:
    if isinstance(text, bytes):
        text = text.decode(errors="replace")
    return (text or "")[-3000:]


def profile_one(ncu: str, contender: str, shape, dtype: str, warmup: int, metrics, timeout: float) -> dict:
    """One ncu run (repeated without any metric ncu refuses); returns the run's record, never raises for ncu."""
    B, H, L, D = shape
    problem = {"B": B, "H": H, "L": L, "D": D, "dtype": dtype, "causal": False,
               "flops": attention_flops(B, H, L, L, D, False)}
    record = {"contender": contender, "label": CONTENDERS[contender][0], "problem": problem, "refused": []}
    metrics = list(metrics)
    for _ in range(4):
        command = ncu_command(ncu, contender, shape, dtype, warmup, metrics)
        record["ncu_command"] = nsight.recorded_command(command)  # no machine paths in the results
        print("running:", " ".join(command[:12]), "...", contender, shape, file=sys.stderr, flush=True)
        start = time.monotonic()
        try:
            done = subprocess.run(command, capture_output=True, text=True, timeout=timeout)
        except subprocess.TimeoutExpired as stuck:
            return {**record, "status": "failed", "reason": f"ncu did not finish in {timeout:.0f} s",
                    "output_tail": _tail(stuck.stdout) + _tail(stuck.stderr)}
        record["seconds"] = round(time.monotonic() - start, 1)
        output = done.stdout + "\n" + done.stderr
        refused = refused_metrics(output, metrics)
        if refused:
            record["refused"] += refused
            metrics = [m for m in metrics if m not in refused]
            continue
        break
    else:
        return {**record, "status": "failed", "reason": "ncu kept refusing metrics", "output_tail": _tail(output)}
    try:
        kernels = parse_ncu_csv(done.stdout)
    except ValueError as error:
        return {**record, "status": "failed", "reason": f"{error} (ncu exit code {done.returncode})",
                "output_tail": _tail(output)}
    main = main_kernel(kernels)
    measured = dict(main["metrics"]) if main else {}
    record.update(status="ok", kernel=main["name"] if main else None,
                  kernels=[{"name": k["name"], "duration_ms": (_get(k["metrics"], "gpu__time_duration.sum") or 0) * 1e3}
                           for k in kernels],
                  metrics={m: measured.get(m) for m in METRICS},
                  missing=[m for m in METRICS if not isinstance(measured.get(m), float)],
                  environment=nsight.environment_from(done.stdout))
    record["summary"] = summary(record)
    return record


def build_result(runs: list, *, command: str, ncu_version, metrics_missing, environment=None) -> dict:
    environment = environment or next((r["environment"] for r in runs if r.get("environment")), {}) or {}
    for run in runs:
        run.pop("environment", None)
    return {
        "what": "Nsight Compute profile of one attention call per contender and shape: the mma kernel of lesson 06 "
                "next to SDPA's FLASH and cuDNN kernels",
        "gpu": environment.get("gpu"),
        "date": environment.get("date"),
        "git_commit": environment.get("git_commit"),
        "environment": environment,
        "ncu_version": ncu_version,
        "command": command,
        "metrics": list(METRICS),
        "metrics_missing": sorted(metrics_missing),
        "note": "durations are under ncu (one replay pass, caches flushed, clocks not locked): compare them with one "
                "another, not with the benchmark's timings",
        "runs": runs,
    }


_shown = shown_path  # the name tests/test_mma.py calls


def _shape(text: str):
    parts = tuple(int(x) for x in text.split(","))
    if len(parts) != 4 or min(parts) <= 0:
        raise argparse.ArgumentTypeError(f"a shape is B,H,L,D (four positive integers), got {text!r}")
    return parts


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m wb_kernels.stages.mma.profile",
                                     description=__doc__.split("\n\n")[0].replace("\n", " "),
                                     formatter_class=argparse.RawDescriptionHelpFormatter,
                                     epilog=__doc__.split("\n\n", 1)[1])
    parser.add_argument("--json", type=Path, help="where to write (default results/mma/ncu_<gpu>.json)")
    parser.add_argument("--contenders", nargs="+", choices=tuple(CONTENDERS), default=list(CONTENDERS))
    parser.add_argument("--shapes", nargs="+", type=_shape, default=list(DEFAULT_SHAPES),
                        help="B,H,L,D of each problem (default: 4,16,4096,128 and 4,16,4096,64; not causal)")
    parser.add_argument("--dtype", choices=("float16", "bfloat16"), default=DEFAULT_DTYPE)
    parser.add_argument("--warmup", type=int, default=3, help="unprofiled calls before the profiled one")
    parser.add_argument("--ncu", default=shutil.which("ncu") or "ncu", help="path of Nsight Compute's ncu")
    parser.add_argument("--timeout", type=float, default=300, help="seconds per ncu run before it is given up")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    return parser


def main(argv=None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    if args.child:
        run_child(args.contenders[0], args.shapes[0], args.dtype, args.warmup)
        return 0
    from ...backend import BACKEND
    from ...results_files import REPO_ROOT, recorded_arguments, save_results

    if not BACKEND.is_gpu:
        parser.error("profiling needs a CUDA GPU, and this machine runs the CUDA simulator")
    if shutil.which(args.ncu) is None:
        parser.error(f"ncu not found ({args.ncu}): install Nsight Compute or name it with --ncu PATH")
    missing = unknown_metrics(METRICS, _query_known(args.ncu, min(args.timeout, 120)))
    requested = [m for m in METRICS if m not in missing]
    runs = []
    out = args.json
    # the output as the repository names it, not as this machine does
    command = "python -m wb_kernels.stages.mma.profile " + recorded_arguments(
        argv if argv is not None else sys.argv[1:], REPO_ROOT)
    for shape in args.shapes:
        for contender in args.contenders:
            run = profile_one(args.ncu, contender, shape, args.dtype, args.warmup, requested, args.timeout)
            runs.append(run)
            s = run.get("summary") or {}
            print(f"{contender:11s} {shape}: {run['status']}" + (
                f", {s['duration_ms']:.3f} ms under ncu, tensor pipe {s['tensor_pipe_pct']}%, "
                f"occupancy {s['achieved_occupancy_pct']}%" if run["status"] == "ok" and s.get("duration_ms")
                else f" ({run.get('reason', '')})"), flush=True)
            result = build_result([dict(r) for r in runs], command=command,
                                  ncu_version=nsight.ncu_version(args.ncu),
                                  metrics_missing=set(missing).union(*(r.get("refused", []) for r in runs)))
            if out is None:
                gpu = (result.get("gpu") or "gpu").lower()
                short = "h100" if "h100" in gpu else re.sub(r"\W+", "_", gpu)
                out = REPO_ROOT / "results" / "mma" / f"ncu_{short}.json"
            save_results(result, out)  # after every run: a later failure keeps what was measured
    print(f"wrote {out}")
    return 0 if all(r["status"] == "ok" for r in runs) else 1


if __name__ == "__main__":
    sys.exit(main())
