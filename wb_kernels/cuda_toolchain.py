"""Where the CUDA compiler and its tools come from (lesson 05, through :mod:`wb_kernels.cuda_build`).

Lesson 05 compiles the tensor-core kernel on the CPU (``nvcc -cubin``, ``ptxas -v``) to show registers,
spills and shared memory, and disassembles it (``cuobjdump -sass``) to show the HMMA instructions. No
GPU and no CUDA toolkit are needed: the compiler is on PyPI. ``make lab`` installs it (the ``lab``
extra of pyproject.toml), or by hand::

    pip install nvidia-cuda-nvcc nvidia-cuda-crt nvidia-cuda-cccl nvidia-cuda-cuobjdump nvidia-cuda-nvdisasm

These wheels put ``nvcc``, ``ptxas``, ``cuobjdump`` and ``nvdisasm`` in ``site-packages/nvidia/cu13/bin``,
``cicc`` in ``nvidia/cu13/nvvm/bin`` and the headers (``mma.h``, ``cuda_fp16.h``, ``nv/target``) in
``nvidia/cu13/include``. That ``nvcc`` needs no flags and no environment of its own: the ``nvcc.profile``
next to it points it at ``ptxas``, ``cicc`` and the headers relative to itself. It does need a host C++
compiler (``gcc``/``g++`` on PATH); without one it stops with "Failed to preprocess host compiler properties".

The tools of these wheels are preferred over any system ones (PATH, ``$CUDA_HOME/bin``, ``$CUDA_PATH/bin``,
``/usr/local/cuda/bin``), so what a learner runs is what CI tests (tests/test_cuda_toolchain.py runs lesson 05
with every system nvcc hidden). A CUDA toolkit is the fallback where the wheels are not installed.
"""

from __future__ import annotations

import os
import re
import shutil
from pathlib import Path

__all__ = ["PIP_PACKAGES", "NvccNotFound", "TOOLKIT_BIN", "wheel_bin_dirs", "wheel_tool", "toolkit_tool", "find_nvcc",
           "find_cuobjdump"]

# What `pip install` needs to compile lesson 05's kernel (the lab extra of pyproject.toml).
PIP_PACKAGES = ("nvidia-cuda-nvcc", "nvidia-cuda-crt", "nvidia-cuda-cccl")
_INSTALL_HINT = f"`pip install {' '.join(PIP_PACKAGES)}` (or `make lab`, which installs them)"


class NvccNotFound(FileNotFoundError):
    """No nvcc: neither the PyPI wheels nor a CUDA toolkit (see :func:`toolkit_tool` for where one is looked for)."""


def wheel_bin_dirs() -> list:
    """The ``nvidia/cuXY/bin`` folders of NVIDIA's wheels in this Python environment, newest CUDA major first."""
    try:
        import nvidia  # the namespace package every NVIDIA wheel installs into
    except ImportError:
        return []
    found = []
    for base in getattr(nvidia, "__path__", []):
        for folder in Path(base).glob("cu*/bin"):
            major = re.fullmatch(r"cu(\d+)", folder.parent.name)
            if major and folder.is_dir():
                found.append((-int(major.group(1)), str(folder), folder))
    return [folder for _, _, folder in sorted(found)]


def wheel_tool(name: str) -> str | None:
    """`name` (nvcc, cuobjdump, ...) from NVIDIA's wheels in this Python environment, or None."""
    for folder in wheel_bin_dirs():
        tool = folder / name
        if tool.is_file() and os.access(tool, os.X_OK):
            return str(tool)
    return None


TOOLKIT_BIN = Path("/usr/local/cuda/bin")  # where a CUDA toolkit installs by default


def toolkit_tool(name: str) -> str | None:
    """`name` from a CUDA toolkit, not from the wheels: PATH, $CUDA_HOME/bin, $CUDA_PATH/bin, /usr/local/cuda/bin."""
    candidates = [shutil.which(name)]
    for variable in ("CUDA_HOME", "CUDA_PATH"):
        if os.environ.get(variable):
            candidates.append(str(Path(os.environ[variable]) / "bin" / name))
    candidates.append(str(TOOLKIT_BIN / name))
    wheels = {folder.resolve() for folder in wheel_bin_dirs()}
    for candidate in candidates:
        if candidate and Path(candidate).is_file() and Path(candidate).resolve().parent not in wheels:
            return candidate
    return None


def find_nvcc() -> str:
    """The nvcc of the ``nvidia-cuda-nvcc`` wheel, else a CUDA toolkit's; raises :class:`NvccNotFound`."""
    found = wheel_tool("nvcc") or toolkit_tool("nvcc")
    if found:
        return found
    raise NvccNotFound("nvcc (the CUDA compiler) was found neither in this Python environment nor in a CUDA "
                       "toolkit (PATH, $CUDA_HOME/bin, $CUDA_PATH/bin, /usr/local/cuda/bin); to compile the "
                       f"tensor-core kernel without a GPU: {_INSTALL_HINT}")


def find_cuobjdump() -> str:
    """cuobjdump of the ``nvidia-cuda-cuobjdump`` wheel, else a CUDA toolkit's; raises FileNotFoundError.

    ``cuobjdump -sass`` runs ``nvdisasm`` (the ``nvidia-cuda-nvdisasm`` wheel), which it looks for on PATH:
    put this file's folder first on PATH when running it."""
    found = wheel_tool("cuobjdump") or toolkit_tool("cuobjdump")
    if found:
        return found
    raise FileNotFoundError("cuobjdump was not found: `pip install nvidia-cuda-cuobjdump nvidia-cuda-nvdisasm` "
                            "(or `make lab`) provides it")
