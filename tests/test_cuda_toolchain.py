"""Lesson 05 compiles its kernel with the CUDA compiler from PyPI, with no CUDA toolkit (wb_kernels/cuda_toolchain.py).

The ``lab`` extra installs ``nvidia-cuda-nvcc``, ``nvidia-cuda-crt`` and ``nvidia-cuda-cccl``; ``find_nvcc`` prefers
that nvcc to any system one, so what runs in the lesson is what CI tests. The last test proves it end to end: it
runs lesson 05 under strict nbval in a subprocess that cannot reach any system nvcc:

- PATH without any folder that holds an ``nvcc`` other than the wheels', ``CUDA_HOME``/``CUDA_PATH`` unset;
- where a toolkit folder exists (``/usr/local/cuda``, ``/usr/local/cuda-*``, ``/opt/cuda``), it is hidden for that
  subprocess only: ``unshare -m`` (as root; otherwise ``unshare -r -m``, a user namespace) and an empty folder
  bind-mounted over it. The mount exists only in the subprocess's own mount namespace; the machine is unchanged.
- Before pytest starts, a guard in that namespace checks that no toolkit nvcc is reachable (the lookup
  ``cuda_toolchain.toolkit_tool``, the same places the old ``cuda_build.find_nvcc`` searched) and stops otherwise.

Skips and CI: where the wheels are missing, or a toolkit is present and cannot be hidden (no ``unshare``, no
user namespaces), the test skips with the reason, except in CI (the environment variable CI is set), where it
FAILS: the check may not disappear silently there (the same rule as tests/test_cuda_compile.py).

Cost: one more run of lesson 05 (~1 minute on a 2-core machine, almost all of it compiling sm_80 and sm_90).
"""

from __future__ import annotations

import glob
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from wb_kernels import cuda_build, cuda_toolchain

ROOT = Path(__file__).resolve().parent.parent
IN_CI = bool(os.environ.get("CI"))
TOOLKIT_DIRS = ("/usr/local/cuda", "/usr/local/cuda-*", "/opt/cuda")


def _skip_or_fail(reason: str):
    if IN_CI:
        pytest.fail(f"CI must run this check, but {reason}")
    pytest.skip(f"not in CI and {reason}")


def _wheel_nvcc() -> str:
    nvcc = cuda_toolchain.wheel_tool("nvcc")
    if nvcc is None:
        _skip_or_fail(f"the PyPI CUDA compiler is not installed (pip install {' '.join(cuda_toolchain.PIP_PACKAGES)})")
    return nvcc


def test_find_nvcc_returns_the_wheels_nvcc():
    nvcc = Path(_wheel_nvcc())
    found = Path(cuda_toolchain.find_nvcc())
    assert found == nvcc and cuda_build.find_nvcc() == str(found)
    assert "site-packages" in found.parts and found.parent.parent.parent.name == "nvidia"  # .../nvidia/cu13/bin/nvcc
    assert found != Path("/usr/local/bin/nvcc")
    assert not found.resolve().is_relative_to(Path("/usr/local/cuda").resolve())


def test_the_wheels_win_over_a_toolkit_on_path_and_in_cuda_home(tmp_path, monkeypatch):
    wheel = _wheel_nvcc()
    toolkit_bin = tmp_path / "cuda" / "bin"
    toolkit_bin.mkdir(parents=True)
    (toolkit_bin / "nvcc").write_text("#!/bin/sh\nexit 1\n")
    (toolkit_bin / "nvcc").chmod(0o755)
    monkeypatch.setenv("PATH", f"{toolkit_bin}{os.pathsep}{os.environ.get('PATH', '')}")
    monkeypatch.setenv("CUDA_HOME", str(tmp_path / "cuda"))
    assert cuda_toolchain.find_nvcc() == wheel
    assert cuda_toolchain.toolkit_tool("nvcc") == str(toolkit_bin / "nvcc")  # the fallback, where no wheel is


def test_without_wheel_or_toolkit_the_error_says_what_to_install(tmp_path, monkeypatch):
    monkeypatch.setattr(cuda_toolchain, "wheel_bin_dirs", lambda: [])
    monkeypatch.setattr(cuda_toolchain, "TOOLKIT_BIN", tmp_path)
    monkeypatch.setenv("PATH", str(tmp_path))
    monkeypatch.delenv("CUDA_HOME", raising=False)
    monkeypatch.delenv("CUDA_PATH", raising=False)
    with pytest.raises(cuda_build.NvccNotFound) as raised:
        cuda_build.find_nvcc()
    assert "pip install nvidia-cuda-nvcc nvidia-cuda-crt nvidia-cuda-cccl" in str(raised.value)
    assert "make lab" in str(raised.value)


def _environment_without_toolkit(figures: Path) -> dict:
    """os.environ with no CUDA_HOME/CUDA_PATH and a PATH without any folder holding a toolkit nvcc."""
    env = {k: v for k, v in os.environ.items() if k not in ("CUDA_HOME", "CUDA_PATH")}
    wheels = {folder.resolve() for folder in cuda_toolchain.wheel_bin_dirs()}
    kept = [folder for folder in env.get("PATH", "").split(os.pathsep)
            if folder and not (Path(folder, "nvcc").exists() and Path(folder).resolve() not in wheels)]
    env["PATH"] = os.pathsep.join(kept)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])])
    env["WB_FIGURES_DIR"] = str(figures)
    return env


def _toolkit_dirs() -> list:
    found = {Path(match).resolve() for pattern in TOOLKIT_DIRS for match in glob.glob(pattern)}
    return sorted(str(folder) for folder in found if folder.is_dir())


# What runs first in the subprocess (in its own mount namespace where a toolkit is hidden): bind-mount the empty
# folder over each toolkit folder, check that no nvcc but the wheels' is reachable, then exec the command.
_IN_NAMESPACE = """
import os, subprocess, sys
empty, *rest = sys.argv[1:]
split = rest.index("--")
for folder in rest[:split]:
    subprocess.run(["mount", "--bind", empty, folder], check=True)
from wb_kernels.cuda_toolchain import toolkit_tool
if toolkit_tool("nvcc"):
    sys.exit(f"a toolkit nvcc is still reachable: {toolkit_tool('nvcc')}")
os.execv(rest[split + 1], rest[split + 1:])
"""


def test_lesson_05_runs_under_nbval_with_no_system_nvcc(tmp_path):
    _wheel_nvcc()
    lessons = sorted(ROOT.glob("notebooks/05_*.ipynb"))
    assert len(lessons) == 1, f"expected one lesson 05 notebook, found {lessons}"
    empty = tmp_path / "empty"
    empty.mkdir()
    hide, namespace = _toolkit_dirs(), []
    if hide:
        unshare = shutil.which("unshare")
        if unshare is None:
            _skip_or_fail(f"a CUDA toolkit is installed ({', '.join(hide)}) and `unshare` is missing to hide it")
        namespace = [unshare, "-m"] if os.geteuid() == 0 else [unshare, "-r", "-m"]
        probe = subprocess.run([*namespace, "mount", "--bind", str(empty), hide[0]], capture_output=True, text=True)
        if probe.returncode != 0:
            _skip_or_fail(f"a CUDA toolkit is installed ({', '.join(hide)}) and cannot be hidden "
                          f"({' '.join(namespace)} mount --bind: {probe.stderr.strip()})")
    nbval = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(lessons[0].relative_to(ROOT)),
             "--nbval", "--nbval-current-env", "--nbval-sanitize-with", "tests/nbval_sanitize.cfg"]
    command = [*namespace, sys.executable, "-c", _IN_NAMESPACE, str(empty), *hide, "--", *nbval]
    result = subprocess.run(command, cwd=ROOT, env=_environment_without_toolkit(tmp_path / "figures"),
                            capture_output=True, text=True, timeout=900)
    output = re.sub(r"\x1b\[[0-9;]*m", "", result.stdout + result.stderr)[-6000:]  # without the colours
    assert "a toolkit nvcc is still reachable" not in output, output
    assert result.returncode == 0, f"lesson 05 failed under nbval with no system nvcc reachable:\n{output}"
