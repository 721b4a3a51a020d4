"""The committed accuracy table: each fp32 stage's error next to every PyTorch path's (lessons 01, 02, 04).

``scripts/error_vs_pytorch.py`` writes it on a GPU (``results/accuracy/error_vs_pytorch_<gpu>.txt``); the lessons
read it here, so the numbers their prose discusses are printed from the file, with the GPU it names.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path

__all__ = ["ACCURACY_TABLE", "AccuracyProblem", "AccuracyTable", "load_accuracy_table"]

ACCURACY_TABLE = Path(__file__).resolve().parent.parent / "results" / "accuracy" / "error_vs_pytorch_h100.txt"
_HEADER = re.compile(r"^# .*\((?P<device>[^,]+),")
_PROBLEM = re.compile(r"^(?P<label>B\d+ H\d+ Lq\d+ Lk\d+ D\d+ .*std=(?P<std>[\d.]+) mask=\S+): max")
_ROW = re.compile(r"^\s+(?P<name>\S.*?)\s+(?P<err>\d\S*e[-+]\d+)\s+(?P<ratio>[\d.]+)x$")


@dataclass
class AccuracyProblem:
    label: str  # "B4 H4 Lq1024 Lk1024 D64 scale=1/sqrt(D) std=2.0 mask=none"
    std: float  # standard deviation of the inputs: larger means a more peaked softmax
    errors: dict = field(default_factory=dict)  # path or stage -> max |err| against float64
    ratios: dict = field(default_factory=dict)  # path or stage -> max |err| / SDPA default's


@dataclass
class AccuracyTable:
    device: str
    command: str
    problems: list


def load_accuracy_table(path=ACCURACY_TABLE) -> AccuracyTable:
    """Parse a file written by ``scripts/error_vs_pytorch.py``."""
    lines = Path(path).read_text().splitlines()
    header = _HEADER.match(lines[0])
    if header is None:
        raise ValueError(f"{path}: the first line should name the command and the GPU, got {lines[0]!r}")
    problems = []
    for line in lines[1:]:
        if match := _PROBLEM.match(line):
            problems.append(AccuracyProblem(match["label"], float(match["std"])))
        elif (match := _ROW.match(line)) and problems:
            problems[-1].errors[match["name"]] = float(match["err"])
            problems[-1].ratios[match["name"]] = float(match["ratio"])
    return AccuracyTable(header["device"], lines[0].lstrip("# ").split("  (")[0], problems)
