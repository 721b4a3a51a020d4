"""What the mma rung's ncu profile (wb_kernels/stages/mma/profile.py) records: no machine paths."""

import sys
from pathlib import Path

from wb_kernels.nsight import recorded_command
from wb_kernels.results_files import REPO_ROOT, recorded_arguments
from wb_kernels.stages.mma import profile


def test_the_recorded_ncu_command_names_ncu_and_python_by_file_name_only():
    command = profile.ncu_command("/usr/local/cuda/bin/ncu", "mma", (4, 16, 4096, 128), "float16", 3, ["m"])
    assert command[0] == "/usr/local/cuda/bin/ncu" and sys.executable in command  # what runs: the full paths
    recorded = recorded_command(command)
    assert recorded[0] == "ncu" and Path(sys.executable).name in recorded and sys.executable not in recorded
    assert recorded[1:] == [Path(part).name if part == sys.executable else part for part in command[1:]]


def test_the_recorded_command_names_the_output_as_the_repository_does(tmp_path):
    inside = str(REPO_ROOT / "results" / "mma" / "ncu_h100.json")
    assert recorded_arguments(["--json", inside, "--warmup", "3"], REPO_ROOT) == \
        "--json results/mma/ncu_h100.json --warmup 3"
    assert recorded_arguments([f"--json={inside}"], REPO_ROOT) == "--json=results/mma/ncu_h100.json"
    assert recorded_arguments(["--json", str(tmp_path / "x.json")], REPO_ROOT) == "--json x.json"
    assert recorded_arguments(["--from-csv", inside], REPO_ROOT, ("--from-csv",)) == \
        "--from-csv results/mma/ncu_h100.json"
