"""The benchmark's results file (lesson 08, lesson 03's speed-ups, the README's performance table).

One JSON file per run under ``results/bench/``: the environment it ran in (:func:`environment`),
the roofline's ceilings, the honesty demonstrations and one record per measurement. Written
atomically after every measurement (:func:`save_results`), so a run cut short can be resumed.
Also the newest committed file (:func:`committed_results`) and the README table built from it.
"""

from __future__ import annotations

import datetime as _dt
import importlib.metadata
import json
import math
import os
import platform
import subprocess
from pathlib import Path
from typing import Optional

from ..backend import BACKEND
from ..stages import available_stages
from .sweeps import BASELINES, PUBLIC_CONFIGS, Config, Refused, record_key

__all__ = ["SCHEMA_VERSION", "REPO_ROOT", "RESULTS_DIR", "README_START", "README_END", "README_BASELINES",
           "environment", "load_results", "save_results", "add_speedups", "default_output", "committed_results",
           "readme_table", "update_readme"]

SCHEMA_VERSION = 1
REPO_ROOT = Path(__file__).resolve().parents[2]  # wb_kernels/bench/results.py -> the repository
RESULTS_DIR = REPO_ROOT / "results" / "bench"  # one JSON per benchmark run; other results/ files are not ours
README_START = "<!-- perf-table:start -->"
README_END = "<!-- perf-table:end -->"
# The baselines the README's table sets beside the stages: PyTorch's default and its FlashAttention-2 backend,
# FlexAttention (what a PyTorch user compiles instead), and the flash-attn package itself.
README_BASELINES = ("sdpa", "sdpa-flash", "flex", "flash_attn")


# Numbers are stored with 5 significant digits (3 or 4 for samples and ratios): the timings are not
# more precise than that, and the committed files stay readable in a diff.
def _sig(x: float, digits: int = 5):
    if x is None or not math.isfinite(x) or x == 0:
        return x
    return round(x, -int(math.floor(math.log10(abs(x)))) + digits - 1)


# The driver version here, the SM clocks in the pitfalls' clock demonstration.
def _nvidia_smi(query: str) -> Optional[str]:
    try:
        text = subprocess.run(["nvidia-smi", f"--query-gpu={query}", "--format=csv,noheader,nounits", "-i", "0"],
                              capture_output=True, text=True, timeout=20).stdout.strip()
    except Exception:  # noqa: BLE001 - no nvidia-smi: the field stays empty
        return None
    return text or None


def _version(package: str) -> Optional[str]:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return None


def environment() -> dict:
    """Where and with what the numbers were measured."""
    import numpy
    import torch

    from .. import __version__
    from ..backend import device_name
    from ..timing import on_gpu

    env = {
        "date": _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "backend": BACKEND.name, "device": device_name(), "python": platform.python_version(),
        "torch": torch.__version__, "numpy": numpy.__version__, "numba": _version("numba"),
        "numba_cuda": _version("numba-cuda"), "wb_kernels": __version__,
    }
    if on_gpu():
        props = torch.cuda.get_device_properties(0)
        env.update(gpu=torch.cuda.get_device_name(0), compute_capability=f"{props.major}.{props.minor}",
                   sm_count=props.multi_processor_count, gpu_memory_gib=round(props.total_memory / 2**30, 1),
                   cuda=torch.version.cuda, cudnn=torch.backends.cudnn.version(),
                   driver=_nvidia_smi("driver_version"), triton=_version("triton"), flash_attn=_version("flash-attn"),
                   vllm=_version("vllm"))
    else:
        env.update(gpu=None, cuda=torch.version.cuda, driver=None)
    try:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO_ROOT, capture_output=True,
                                text=True, timeout=10).stdout.strip()
        env["git_commit"] = commit or None
    except Exception:  # noqa: BLE001
        env["git_commit"] = None
    return env


def load_results(path) -> dict:
    return json.loads(Path(path).read_text())


def save_results(results: dict, path) -> None:
    """Write atomically: a sweep killed mid-write leaves the previous complete file."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    temporary = path.with_suffix(path.suffix + ".tmp")
    temporary.write_text(json.dumps(results, indent=1, allow_nan=False) + "\n")
    os.replace(temporary, path)


def add_speedups(results: dict) -> dict:
    """For every timed record: ``speedup_vs[baseline]`` = baseline's median / this median (>1: faster)."""
    timed = {}
    for r in results["records"]:
        if r.get("status") == "ok":
            timed.setdefault(r["key"].split("|", 1)[1], {})[r["contender"]] = r
    for group in timed.values():
        baselines = {name: r for name, r in group.items() if r["kind"] == "baseline"}
        for r in group.values():
            r["speedup_vs"] = {name: _sig(b["median_ms"] / r["median_ms"], 4)
                               for name, b in baselines.items() if name != r["contender"]}
    return results


def _new_results(presets, command=None) -> dict:
    return {"schema": SCHEMA_VERSION, "environment": environment(), "presets": list(presets), "command": command,
            "ceilings": None, "honesty": None, "unavailable": {}, "records": []}


def default_output(kind: str) -> Path:
    if kind == "cuda":
        import torch

        slug = "".join(c if c.isalnum() else "-" for c in torch.cuda.get_device_name(0).lower()).strip("-")
        slug = "-".join(part for part in slug.split("-") if part and part != "nvidia")
        return RESULTS_DIR / f"{slug}_{_dt.date.today().isoformat()}.json"
    return RESULTS_DIR / "simulator_smoke.json"


def committed_results(kind: str = "gpu") -> Optional[Path]:
    """The newest benchmark results file of that kind ("gpu" or "simulator") under results/bench/, or None: the
    full runs the README, the dashboard and the ladder's lessons read. A rung's own runs (e.g. the ``mma`` preset in
    results/mma/) are read by its lesson by name. Other JSON files (tuning logs, ...) lack "records" and are ignored."""
    found = []
    for path in sorted((REPO_ROOT / "results" / "bench").glob("*.json")):
        try:
            data = load_results(path)
        except (OSError, ValueError):
            continue
        if isinstance(data, dict) and "records" in data and data.get("environment", {}).get("backend") == kind:
            found.append((data["environment"].get("date", ""), path))
    return max(found)[1] if found else None


# ----------------------------------------------------------------------------------------------
# README table
# ----------------------------------------------------------------------------------------------

def _timed_stages(records) -> list:
    """The stages a results file timed, in ladder order: the registered ones first, then any the file holds that
    this checkout does not register (a file from a branch with a newer rung still shows it)."""
    registered = [name for name in available_stages() if name != "reference"]
    seen = [r["contender"] for r in records if r.get("kind") == "stage" and r["contender"] != "reference"]
    return registered + [name for name in dict.fromkeys(seen) if name not in registered]


def readme_table(results: dict, source: str | None = None) -> str:
    """The README's performance table (Markdown) from a GPU results file: the public configurations,
    fp16, causal and not; median ms and TFLOP/s of each stage and of the main baselines. A column appears
    when the file timed that contender at one of them, a row when the file timed anything there."""
    env = results["environment"]
    columns = _timed_stages(results["records"]) + [name for name in BASELINES if name in README_BASELINES]
    by_key = {r["key"]: r for r in results["records"]}
    public = [Config(B, H, L, D, "float16", causal) for causal in (False, True) for (B, H, L, D) in PUBLIC_CONFIGS]
    present = [c for c in columns
               if any(by_key.get(record_key(c, config), {}).get("status") == "ok" for config in public)]
    public = [config for config in public
              if any(by_key.get(record_key(c, config), {}).get("status") == "ok" for c in present)]
    lines = [f"Measured on {env.get('gpu') or env.get('device')} (CUDA {env.get('cuda')}, torch {env.get('torch')}, "
             f"driver {env.get('driver')}) on {env.get('date', '')[:10]}"
             + (f", from `{source}`" if source else "") + ". Median of CUDA-event timings with the L2 cache "
             "flushed, fp16, ms (TFLOP/s); a dash: not run or does not support the configuration.",
             "", "| B | H | L | D | causal | " + " | ".join(present) + " |",
             "|---:|---:|---:|---:|:---:|" + "---:|" * len(present)]
    for config in public:
        cells = []
        for name in present:
            r = by_key.get(record_key(name, config))
            cells.append(f"{r['median_ms']:.3g} ({r['tflops']:.0f}){' †' if r.get('check_failed') else ''}"
                         if r and r.get("status") == "ok" else "–")
        lines.append(f"| {config.B} | {config.H} | {config.L} | {config.D} | {'yes' if config.causal else 'no'} | "
                     + " | ".join(cells) + " |")
    if any("†" in line for line in lines):
        lines += ["", "† outside the check tolerance (2x PyTorch's error in the same precision); timed anyway."]
    return "\n".join(lines)


def _readme_block(results: dict) -> tuple:
    """The README's markers for a results file: the ladder's table, or the table of a rung's own preset run (a file
    of the ``mma`` preset alone fills ``<!-- perf-table-mma:start -->`` ... ``:end -->``)."""
    presets = results.get("presets") or []
    if len(presets) == 1 and presets[0] == "mma":
        return "<!-- perf-table-mma:start -->", "<!-- perf-table-mma:end -->"
    return README_START, README_END


def update_readme(results_path, readme=REPO_ROOT / "README.md") -> Path:
    readme = Path(readme)
    text = readme.read_text() if readme.exists() else ""
    results = load_results(results_path)
    start, end = _readme_block(results)
    if start not in text or end not in text:
        raise Refused(f"{readme} has no {start} ... {end} block to fill; add the two markers "
                      "where the table belongs")
    relative = Path(results_path).resolve()
    try:
        relative = relative.relative_to(REPO_ROOT)
    except ValueError:
        pass
    table = readme_table(results, source=str(relative))
    head, rest = text.split(start, 1)
    _, tail = rest.split(end, 1)
    readme.write_text(f"{head}{start}\n{table}\n{end}{tail}")
    return readme
