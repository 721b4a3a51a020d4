"""Running Nsight Compute (``ncu``) and reading what it prints (lesson 06's shared-memory traffic and profile).

What the benchmark's traffic run (``wb_kernels/bench/ncu_traffic.py``) and the mma rung's profile
(``wb_kernels/stages/mma/profile.py``) share: the shared-memory metrics, the ``--csv`` table's rows and units, the
command line as a results file records it, the environment line a profiled child prints, and ncu's version. A floor
below both the rungs and the benchmark: nothing here imports either.
"""

from __future__ import annotations

import csv
import io
import json
import subprocess
import sys
from pathlib import Path

__all__ = ["SHARED_MEMORY_METRICS", "ENVIRONMENT_TAG", "UNIT_SCALE", "unit_scale", "ncu_csv_rows", "recorded_command",
           "environment_from", "ncu_version"]

# What moves between the registers and shared memory, and the instructions that move it
SHARED_MEMORY_METRICS = (
    "sm__sass_data_bytes_mem_shared.sum",  # bytes between registers and shared memory, every shared instruction
    "l1tex__data_pipe_lsu_wavefronts_mem_shared.sum",  # passes of the shared-memory pipe: what its time is made of
    "l1tex__data_bank_conflicts_pipe_lsu_mem_shared.sum",  # the extra passes that bank conflicts cost
    "smsp__sass_inst_executed_op_shared_ld.sum",  # LDS: shared loads of one value per thread
    "smsp__sass_inst_executed_op_shared_st.sum",  # STS: shared stores
    "smsp__sass_inst_executed_op_ldsm.sum",  # LDSM (ldmatrix): a warp loads whole 8x8 tiles into mma fragments
    "smsp__sass_inst_executed_op_ldgsts.sum",  # LDGSTS (cp.async): global to shared without passing registers
)
ENVIRONMENT_TAG = "wb_ncu_environment "  # the child's line that carries where it ran, among ncu's output

# ncu --print-units base still names a unit per value; these scale it to bytes and seconds.
UNIT_SCALE = {"byte": 1.0, "Kbyte": 1e3, "Mbyte": 1e6, "Gbyte": 1e9, "nsecond": 1e-9, "usecond": 1e-6,
              "msecond": 1e-3, "second": 1.0, "ns": 1e-9, "us": 1e-6, "ms": 1e-3, "s": 1.0}


def unit_scale(row: dict) -> float:
    """What multiplies a row's value to bytes or seconds (1 for a unit :data:`UNIT_SCALE` does not name)."""
    return UNIT_SCALE.get((row.get("Metric Unit") or "").strip(), 1.0)


def ncu_csv_rows(text: str) -> list:
    """The rows (dicts by column name) of the table in ``ncu --csv`` output: from its header (the line naming
    "Kernel Name" and "Metric Name") on, the quoted lines only, so that the program's own output is skipped.
    Raises ValueError when there is no such table."""
    lines = text.splitlines()
    start = next((n for n, line in enumerate(lines) if '"Kernel Name"' in line and '"Metric Name"' in line), None)
    if start is None:
        raise ValueError('no ncu CSV table (a header with "Kernel Name" and "Metric Name") in the output')
    return list(csv.DictReader(io.StringIO("\n".join(line for line in lines[start:] if line.startswith('"')))))


def recorded_command(command_line: list) -> list:
    """`command_line` as a results file records it: ncu and this Python by their file names (``ncu``, ``python3``),
    not by where this machine keeps them (the command still runs them by their full paths)."""
    return [Path(part).name if n == 0 or part == sys.executable else part for n, part in enumerate(command_line)]


def environment_from(text: str):
    """The environment a ``--child`` run printed on its :data:`ENVIRONMENT_TAG` line among ncu's output, else None."""
    for line in text.splitlines():
        if line.startswith(ENVIRONMENT_TAG):
            return json.loads(line[len(ENVIRONMENT_TAG):])
    return None


def ncu_version(ncu: str):
    """The last line of ``ncu --version`` (None when ncu does not answer)."""
    try:
        text = subprocess.run([ncu, "--version"], capture_output=True, text=True, timeout=60).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    return next((line.strip() for line in reversed(text.splitlines()) if line.strip()), None)
