"""Where the numba kernels run: a real CUDA GPU, or numba's CUDA simulator on the CPU.

Used by every lesson (01-09): `import wb_kernels` imports this module before anything else,
so a learner never has to think about it.

Why the import order matters: numba reads ``NUMBA_ENABLE_CUDASIM`` once, when numba itself is
first imported. So the choice is made here, by asking the CUDA driver directly through ctypes
(no numba, no torch), and the variable is set before the package imports numba anywhere.

Override with ``WB_BACKEND=gpu`` or ``WB_BACKEND=simulator`` (set before ``import wb_kernels``). On the simulator
``TRITON_INTERPRET=1`` is set too (unless set already), for the same reason: Triton reads it when it is imported.
"""

from __future__ import annotations

import ctypes
import os
import sys
from dataclasses import dataclass

__all__ = ["Backend", "BACKEND", "banner", "cuda_gpu_count", "select_backend"]

SIMULATOR = "simulator"
GPU = "gpu"
# numba's real CUDA compiler without a device: only for compiling kernels to PTX (wb_kernels.resources
# runs it in a subprocess, because the simulator cannot compile). Launching anything fails.
COMPILE_ONLY = "compile-only"


def cuda_gpu_count() -> int:
    """Number of CUDA devices the driver reports; 0 when there is no driver or no device."""
    for library in ("libcuda.so.1", "libcuda.so", "nvcuda.dll"):
        try:
            driver = ctypes.CDLL(library)
        except OSError:
            continue
        if driver.cuInit(0) != 0:
            return 0
        count = ctypes.c_int(0)
        if driver.cuDeviceGetCount(ctypes.byref(count)) != 0:
            return 0
        return count.value
    return 0


@dataclass(frozen=True)
class Backend:
    """The backend chosen for this process (it cannot change once numba is imported)."""

    name: str  # "gpu" or "simulator"
    reason: str  # why it was chosen, for the banner

    @property
    def is_simulator(self) -> bool:
        return self.name == SIMULATOR

    @property
    def is_gpu(self) -> bool:
        return self.name == GPU


def _numba_already_simulating() -> bool | None:
    """None if numba is not imported yet, else whether it was imported in simulator mode."""
    if "numba" not in sys.modules:
        return None
    from numba import config

    return bool(config.ENABLE_CUDASIM)


def select_backend(environ=os.environ, gpu_count=cuda_gpu_count) -> Backend:
    """Decide the backend and set NUMBA_ENABLE_CUDASIM in `environ` to match.

    `environ` and `gpu_count` are parameters so that tests can exercise every branch.
    """
    requested = environ.get("WB_BACKEND", "auto").strip().lower()
    if requested not in ("auto", GPU, SIMULATOR, COMPILE_ONLY):
        raise ValueError(f"WB_BACKEND={requested!r}: use 'auto', 'gpu' or 'simulator'")
    if requested == "auto" and environ.get("NUMBA_ENABLE_CUDASIM") == "1":
        requested = SIMULATOR

    if requested == COMPILE_ONLY:
        environ["NUMBA_ENABLE_CUDASIM"] = "0"
        return Backend(COMPILE_ONLY, "requested: compile kernels to PTX, no device")
    if requested == SIMULATOR:
        backend = Backend(SIMULATOR, "requested")
    else:
        n = gpu_count()
        if n > 0:
            backend = Backend(GPU, f"{n} CUDA device(s) found")
        elif requested == GPU:
            raise RuntimeError("WB_BACKEND=gpu, but the CUDA driver reports no GPU on this machine")
        else:
            backend = Backend(SIMULATOR, "no CUDA GPU found")

    already = _numba_already_simulating()
    if already is not None and already != backend.is_simulator:
        wanted = "the CUDA simulator" if backend.is_simulator else "the GPU"
        raise ImportError(
            f"numba was imported before wb_kernels and cannot switch to {wanted} any more. "
            "Restart the kernel and run `import wb_kernels` before importing numba."
        )
    environ["NUMBA_ENABLE_CUDASIM"] = "1" if backend.is_simulator else "0"
    if backend.is_simulator:
        # The triton rung (lesson 11) runs on Triton's interpreter without a GPU. Triton decorates its own library
        # functions (tl.max, tl.cdiv, ...) when it is first imported, in the mode TRITON_INTERPRET names then, as
        # numba reads its variable: so it is set here, before anything imports triton (torch.compile does).
        environ.setdefault("TRITON_INTERPRET", "1")
    # The lessons launch deliberately small grids to check kernels; numba would warn about low occupancy
    # on every such launch (on a GPU only), and that stderr would differ from the simulator's output.
    environ.setdefault("NUMBA_CUDA_LOW_OCCUPANCY_WARNINGS", "0")
    return backend


BACKEND = select_backend()

if BACKEND.is_simulator:
    # The simulator runs one Python thread per CUDA thread; every syncthreads() is a barrier across
    # them. A short switch interval makes those barriers 5-10x cheaper (measured, 2-core machine).
    sys.setswitchinterval(1e-4)


def device_name() -> str:
    """Human-readable name of the device the kernels run on."""
    if BACKEND.is_simulator:
        return "numba CUDA simulator (CPU)"
    from numba import cuda

    device = cuda.get_current_device()
    name = device.name.decode() if isinstance(device.name, bytes) else device.name
    return f"{name} (sm_{device.compute_capability[0]}{device.compute_capability[1]})"


def banner() -> str:
    """One line that says which backend runs and what that means for sizes and timings."""
    if BACKEND.is_simulator:
        return (
            f"wb_kernels backend: numba CUDA simulator ({BACKEND.reason}) - kernels run as Python "
            "threads on the CPU: small sizes only (L <= 128), timings are not GPU timings, "
            "the tensor-core stage needs a GPU."
        )
    return (
        f"wb_kernels backend: CUDA GPU {device_name()} through numba-cuda - full sizes, "
        "real GPU timings."
    )
