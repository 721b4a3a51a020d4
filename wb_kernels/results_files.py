"""Results files: where they live, how one is read and written, and the record of where its numbers were measured
(lessons 03-11, the benchmark, every rung's ``tune.py`` and profiling scripts).

A floor below both the rungs and the benchmark (``wb_kernels/bench``): a rung's script that times its own kernel
writes its file with the same :func:`environment` (GPU, versions, date, commit) and :func:`save_results` as the
benchmark, and a lesson reads the committed files with :func:`load_results` and :func:`committed_results`,
without importing the benchmark. Nothing here imports a rung or the benchmark.
"""

from __future__ import annotations

import datetime as _dt
import importlib.metadata
import json
import math
import os
import platform
import re
import subprocess
from pathlib import Path
from typing import Optional

from .backend import BACKEND

__all__ = ["REPO_ROOT", "round_significant", "nvidia_smi", "package_version", "environment", "git_commit",
           "load_results", "save_results", "newest_matching", "newest_results", "committed_results",
           "committed_decode_results", "gpu_short_name", "gpu_results_path", "shown_path", "recorded_arguments",
           "fill_block"]

REPO_ROOT = Path(__file__).resolve().parents[1]  # wb_kernels/results_files.py -> the repository


# Numbers are stored with 5 significant digits (3 or 4 for samples and ratios): the timings are not
# more precise than that, and the committed files stay readable in a diff.
def round_significant(x: float, digits: int = 5):
    """`x` rounded to `digits` significant digits (None, 0 and non-finite values as they are)."""
    if x is None or not math.isfinite(x) or x == 0:
        return x
    return round(x, -int(math.floor(math.log10(abs(x)))) + digits - 1)


def nvidia_smi(query: str) -> Optional[str]:
    """One ``nvidia-smi --query-gpu`` field of GPU 0 (the driver version here, the SM clocks in the benchmark's clock
    demonstration), or None where nvidia-smi does not answer."""
    try:
        text = subprocess.run(["nvidia-smi", f"--query-gpu={query}", "--format=csv,noheader,nounits", "-i", "0"],
                              capture_output=True, text=True, timeout=20).stdout.strip()
    except Exception:  # noqa: BLE001 - no nvidia-smi: the field stays empty
        return None
    return text or None


def package_version(package: str) -> Optional[str]:
    """The installed version of `package`, or None where it is not installed."""
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return None


def environment() -> dict:
    """Where and with what the numbers were measured."""
    import numpy
    import torch

    from . import __version__
    from .backend import device_name
    from .timing import on_gpu

    env = {
        "date": _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "backend": BACKEND.name, "device": device_name(), "python": platform.python_version(),
        "torch": torch.__version__, "numpy": numpy.__version__, "numba": package_version("numba"),
        "numba_cuda": package_version("numba-cuda"), "wb_kernels": __version__,
    }
    if on_gpu():
        props = torch.cuda.get_device_properties(0)
        env.update(gpu=torch.cuda.get_device_name(0), compute_capability=f"{props.major}.{props.minor}",
                   sm_count=props.multi_processor_count, gpu_memory_gib=round(props.total_memory / 2**30, 1),
                   cuda=torch.version.cuda, cudnn=torch.backends.cudnn.version(),
                   driver=nvidia_smi("driver_version"), triton=package_version("triton"),
                   flash_attn=package_version("flash-attn"), vllm=package_version("vllm"),
                   flashinfer=package_version("flashinfer-python"))
    else:
        env.update(gpu=None, cuda=torch.version.cuda, driver=None)
    env["git_commit"] = git_commit()
    return env


# What a run writes (results, figures, executed lessons, logs) is not a change to the code that ran.
_RUN_OUTPUTS = ("results", "figures", "notebooks", "logs", "gpu-out")


def git_commit(root=REPO_ROOT) -> Optional[str]:
    """The short commit of the tree at `root` that is running, with ``+dirty`` when files that git tracks (or
    new ones it does not ignore) differ from it outside the folders a run writes to; None when `root` is not the
    top of a git checkout (a copy without .git, or one inside some other repository).

    ``WB_GIT_COMMIT`` in the environment overrides it: a machine that gets a copy of the files, whose .git (if
    any) is not the one they were committed in, is told the commit by whoever copied them.
    """
    if os.environ.get("WB_GIT_COMMIT"):
        told = os.environ["WB_GIT_COMMIT"]
        return told[:7] if re.fullmatch(r"[0-9a-f]{40}", told) else told  # a full hash: its short form, as git's

    def git(*args):
        return subprocess.run(["git", *args], cwd=root, capture_output=True, text=True, timeout=20)

    try:
        top = git("rev-parse", "--show-toplevel")
        if top.returncode != 0 or Path(top.stdout.strip()).resolve() != Path(root).resolve():
            return None
        commit = git("rev-parse", "--short", "HEAD").stdout.strip()
        status = git("status", "--porcelain", "--", ".", *(f":(exclude){name}" for name in _RUN_OUTPUTS))
    except Exception:  # noqa: BLE001 - no git here: the field stays empty
        return None
    if not commit:
        return None
    return commit + ("+dirty" if status.returncode != 0 or status.stdout.strip() else "")


def load_results(path) -> dict:
    return json.loads(Path(path).read_text())


def save_results(results: dict, path) -> None:
    """Write atomically: a sweep killed mid-write leaves the previous complete file."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    temporary = path.with_suffix(path.suffix + ".tmp")
    temporary.write_text(json.dumps(results, indent=1, allow_nan=False) + "\n")
    os.replace(temporary, path)


def newest_matching(folder: Path, pattern: str, accept) -> Optional[Path]:
    """The newest file of `folder` matching `pattern` whose results `accept(data)`, by the date its environment
    records (then by name); None where there is none. Files that cannot be read are passed over."""
    found = []
    for path in sorted(Path(folder).glob(pattern)):
        try:
            data = load_results(path)
        except (OSError, ValueError):
            continue
        if isinstance(data, dict) and accept(data):
            found.append((str((data.get("environment") or {}).get("date", "")), path.name, path))
    return max(found)[2] if found else None


def newest_results(folder: str, backend: str, *, decode: bool) -> Optional[Path]:
    """The newest results file under results/<folder>/ from `backend` ("gpu" or "simulator"), of the decode presets
    (``"kind": "decode"``) or not, by the date its environment records; None where there is none. Files that are not
    benchmark results (no "records": tuning logs, ...) are passed over."""
    return newest_matching(REPO_ROOT / "results" / folder, "*.json",
                           lambda data: "records" in data and (data.get("kind") == "decode") == decode
                           and (data.get("environment") or {}).get("backend") == backend)


def committed_results(kind: str = "gpu") -> Optional[Path]:
    """The newest benchmark results file of that kind ("gpu" or "simulator") under results/bench/, or None: the
    full runs the README, the dashboard and the ladder's lessons read. A rung's own runs (e.g. the ``mma`` preset in
    results/mma/) are read by its lesson by name. Other JSON files (tuning logs, ...) lack "records" and are ignored."""
    return newest_results("bench", kind, decode=False)


def committed_decode_results() -> Optional[Path]:
    """The newest GPU results file of the decode presets under results/decode/, or None."""
    return newest_results("decode", "gpu", decode=True)


def gpu_short_name() -> str:
    """h100, h200, a100, b200 (or gpu): the GPU's name in results files' names, as the tuning files use it."""
    import torch

    name = torch.cuda.get_device_name(0)
    return next((g for g in ("H100", "H200", "A100", "B200") if g in name), "gpu").lower()


def gpu_results_path(folder: str, stem: str, *, on_cuda: bool, smoke_name: str) -> Path:
    """Where a benchmark writes by default: ``results/<folder>/<stem>_<gpu>.json`` on a GPU (h100, h200, ...:
    :func:`gpu_short_name`), ``results/<folder>/<smoke_name>`` on the simulator or a CPU."""
    folder_path = REPO_ROOT / "results" / folder
    return folder_path / (f"{stem}_{gpu_short_name()}.json" if on_cuda else smoke_name)


def fill_block(document, start: str, end: str, body, error=ValueError) -> Path:
    """Replace what lies between the markers `start` and `end` in the file `document` (the README's result blocks)
    with `body` (text, or a function that makes it, called once the markers are found), on lines of its own. A file
    without both markers raises `error` naming them, before anything is read: a table is never appended where
    nobody placed it."""
    document = Path(document)
    text = document.read_text() if document.exists() else ""
    if start not in text or end not in text:
        raise error(f"{document} has no {start} ... {end} block to fill; add the two markers where the table belongs")
    body = body() if callable(body) else body
    head, rest = text.split(start, 1)
    tail = rest.split(end, 1)[1]
    document.write_text(f"{head}{start}\n{body}\n{end}{tail}")
    return document


def shown_path(path, root: Path) -> str:
    """`path` relative to the repository `root` when it lies inside, else its file name alone (no machine paths in
    results)."""
    try:
        return Path(path).resolve().relative_to(root).as_posix()
    except ValueError:
        return Path(path).name


def recorded_arguments(argv, root: Path, path_options=("--json",)) -> str:
    """The command-line arguments as a results file records them: the value of each option of `path_options`
    (``--json PATH`` or ``--json=PATH``) as :func:`shown_path` shows it."""
    given = list(argv)
    for n, argument in enumerate(given):
        option, equals, value = argument.partition("=")
        if option not in path_options:
            continue
        if equals:
            given[n] = f"{option}={shown_path(value, root)}"
        elif n + 1 < len(given):
            given[n + 1] = shown_path(given[n + 1], root)
    return " ".join(given)
