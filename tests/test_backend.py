"""Backend selection: the GPU when the driver reports one, the simulator otherwise, and a clear error
when numba was imported first in the other mode."""

import os
import subprocess
import sys

import pytest

import wb_kernels
from wb_kernels.backend import select_backend


def test_no_gpu_selects_simulator_and_sets_variable(monkeypatch):
    # numba is already imported in this process (on a GPU machine in GPU mode); pretend it is not
    monkeypatch.setattr("wb_kernels.backend._numba_already_simulating", lambda: None)
    env = {}
    backend = select_backend(env, gpu_count=lambda: 0)
    assert backend.is_simulator and backend.reason == "no CUDA GPU found"
    assert env["NUMBA_ENABLE_CUDASIM"] == "1"
    assert env["TRITON_INTERPRET"] == "1"  # the triton rung runs on Triton's interpreter (set before triton loads)
    env = {"TRITON_INTERPRET": "0"}
    select_backend(env, gpu_count=lambda: 0)
    assert env["TRITON_INTERPRET"] == "0"  # a caller's own choice stays (the triton stage then says what is wrong)


def test_gpu_present_selects_gpu(monkeypatch):
    # numba is already imported in this process (in simulator mode on a CPU machine); pretend it is not
    monkeypatch.setattr("wb_kernels.backend._numba_already_simulating", lambda: None)
    env = {}
    backend = select_backend(env, gpu_count=lambda: 2)
    assert backend.is_gpu and "2 CUDA device" in backend.reason
    assert env["NUMBA_ENABLE_CUDASIM"] == "0"
    assert "TRITON_INTERPRET" not in env  # Triton compiles for the GPU


def test_explicit_requests(monkeypatch):
    monkeypatch.setattr("wb_kernels.backend._numba_already_simulating", lambda: None)
    assert select_backend({"WB_BACKEND": "simulator"}, gpu_count=lambda: 1).is_simulator
    assert select_backend({"NUMBA_ENABLE_CUDASIM": "1"}, gpu_count=lambda: 1).is_simulator
    with pytest.raises(RuntimeError, match="reports no GPU"):
        select_backend({"WB_BACKEND": "gpu"}, gpu_count=lambda: 0)
    with pytest.raises(ValueError, match="WB_BACKEND='tpu'"):
        select_backend({"WB_BACKEND": "tpu"}, gpu_count=lambda: 0)


def test_numba_imported_first_in_wrong_mode(monkeypatch):
    monkeypatch.setattr("wb_kernels.backend._numba_already_simulating", lambda: False)
    with pytest.raises(ImportError, match="Restart the kernel"):
        select_backend({}, gpu_count=lambda: 0)


def test_this_process_uses_the_detected_backend():
    from numba import config

    assert bool(config.ENABLE_CUDASIM) == wb_kernels.BACKEND.is_simulator
    assert wb_kernels.banner().startswith("wb_kernels backend: ")


@pytest.mark.skipif(wb_kernels.BACKEND.is_gpu, reason="checks the simulator path on a machine without a GPU")
def test_fresh_interpreter_gets_simulator_before_numba_loads():
    # In a new process, importing wb_kernels first must leave numba.cuda in simulator mode.
    code = ("import wb_kernels, numba.cuda as c; from numba import config; "
            "print(wb_kernels.BACKEND.name, config.ENABLE_CUDASIM, wb_kernels.banner()[:40])")
    env = {k: v for k, v in os.environ.items() if k not in ("NUMBA_ENABLE_CUDASIM", "WB_BACKEND")}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, check=True).stdout
    assert out.startswith("simulator 1 wb_kernels backend: numba CUDA simulator")
