"""Lesson 05's first step: one 16 x 16 x 16 matrix product on the tensor cores by one warp (``wmma_tile.cu``).

Without a GPU, :func:`hmma_instructions` compiles the kernel with nvcc and lists the tensor-core instructions the
compiler made of it, and :func:`host_product` runs the kernel on the CPU against a model of the WMMA API
(``wmma_host.cuh``: which matrix, which layout, which leading dimension, a fragment that holds garbage until it is
filled), so that what the kernel computes is checked on a laptop too. On a GPU, :func:`product` builds it with
``load_inline`` and runs it on the tensor cores. :func:`source_with` puts a learner's version of the kernel (the
lesson's puzzle) into the file, so all three work on it too.
"""

from __future__ import annotations

import subprocess
import tempfile
from pathlib import Path

import numpy as np

from ... import cuda_build
from ...lesson_sync import module_regions

__all__ = ["SOURCE", "HOST_MODEL", "TileModelError", "package_source", "kernel_text", "source_with",
           "hmma_instructions", "host_product", "build", "product"]

HOST_MODEL = Path(__file__).resolve().parent / "wmma_host.cuh"

SOURCE = cuda_build.EditableSource(Path(__file__).resolve().parent / "wmma_tile.cu")
KERNEL_REGION = "wmma_tile_kernel"
package_source = SOURCE.package_source


def kernel_text() -> str:
    """The kernel as the package ships it (what the lesson prints)."""
    return module_regions(SOURCE.path)[KERNEL_REGION]


def source_with(kernel: str) -> str:
    """The file with `kernel` in place of the package's ``wmma_tile_kernel``."""
    return SOURCE.source_with(KERNEL_REGION, kernel)


def hmma_instructions(source: str | None = None, arch: str = "sm_90") -> list:
    """The tensor-core (HMMA) instructions nvcc makes of the kernel; needs nvcc, not a GPU."""
    cubin, _ = cuda_build.compile_cubin(arch, source or package_source(), SOURCE.file_name, SOURCE.name)
    return cuda_build.sass_lines(cubin, lambda name: "wmma_tile_kernel" in name)


class TileModelError(RuntimeError):
    """The kernel, run on the CPU against the WMMA model, did something the product cannot survive."""


# Runs the kernel once per lane of the warp (threadIdx.x = 0 ... 31), each time on a C filled with NaN: every lane
# must make the same calls (WMMA's calls are collective) and write all of C. Prints whether the lanes agree, then C.
_HOST_DRIVER = r"""
#include <cstring>
int main() {
    static __half a[256], b[256];
    static float c[256], first[256];
    for (int i = 0; i < 256; ++i) { float x; if (std::scanf("%f", &x) != 1) return 2; a[i] = x; }
    for (int i = 0; i < 256; ++i) { float x; if (std::scanf("%f", &x) != 1) return 2; b[i] = x; }
    wb_host::buffers[0] = {a, sizeof a, "a"};
    wb_host::buffers[1] = {b, sizeof b, "b"};
    wb_host::buffers[2] = {c, sizeof c, "c"};
    bool agree = true;
    for (unsigned lane = 0; lane < 32; ++lane) {
        threadIdx.x = lane;
        for (float& e : c) e = std::numeric_limits<float>::quiet_NaN();
        wmma_tile_kernel(a, b, c);
        if (lane == 0) std::memcpy(first, c, sizeof c);
        else agree = agree && std::memcmp(first, c, sizeof c) == 0;
    }
    std::printf("LANES_AGREE %d\n", agree ? 1 : 0);
    for (float e : first) std::printf("%.9g\n", e);
    return 0;
}
"""


def host_product(a, b, kernel: str | None = None) -> np.ndarray:
    """C as the kernel computes it on the WMMA model, on the CPU (needs nvcc's host compiler, not a GPU).

    `a`, `b`: 16 x 16 arrays of float16 values; `kernel`: the text of ``wmma_tile_kernel`` (default: the package's).
    Returns C (16, 16) float32 as lane 0 stored it. Raises :class:`TileModelError` when the kernel reads or writes
    outside A, B and C, or when the lanes of the warp store different C; ``CudaBuildError`` when it does not compile
    against the model."""
    kernel = kernel_text() if kernel is None else kernel
    numbers = np.concatenate([np.asarray(a, np.float32).ravel(), np.asarray(b, np.float32).ravel()])
    with tempfile.TemporaryDirectory(prefix="wb_wmma_host_") as folder:
        workdir = Path(folder)
        source = workdir / "wmma_tile_host.cpp"
        source.write_text(f'#include "{HOST_MODEL.as_posix()}"\n#line 1 "wmma_tile_kernel"\n{kernel}\n{_HOST_DRIVER}')
        result = subprocess.run([cuda_build.find_nvcc(), "-x", "c++", "-std=c++17", "-O1", "-o", "wmma_tile_host",
                                 source.name], capture_output=True, text=True, cwd=workdir)
        if result.returncode != 0:
            raise cuda_build.CudaBuildError("the host compiler rejects it against the WMMA model (wmma_host.cuh):\n"
                                            + cuda_build.trim_compiler_output(result.stdout + result.stderr))
        try:
            run = subprocess.run([str(workdir / "wmma_tile_host")], input="\n".join(f"{x:.9g}" for x in numbers),
                                 capture_output=True, text=True, cwd=workdir, timeout=60)
        except subprocess.TimeoutExpired:
            raise TileModelError("it ran for a minute on the CPU model without finishing (a loop that never ends?)")
    if "OUT_OF_BOUNDS" in run.stdout:
        raise TileModelError("it reads or writes outside the 16 x 16 matrices A, B and C (a leading dimension?)")
    if run.returncode != 0:
        raise TileModelError(f"it stopped on the CPU model with exit status {run.returncode}")
    lines = run.stdout.split()
    if lines[:2] != ["LANES_AGREE", "1"]:
        raise TileModelError("the 32 lanes of the warp do not all store the same C: every lane must make the same "
                             "WMMA calls (they are collective)")
    return np.array([float(x) for x in lines[2:]], dtype=np.float32).reshape(16, 16)


def build(source: str | None = None):
    """The extension with ``wmma_tile(a, b)`` (needs a CUDA GPU and a CUDA build of torch)."""
    return cuda_build.build_extension(source or package_source(), file_name=SOURCE.file_name,
                                      declarations="torch::Tensor wmma_tile(torch::Tensor a, torch::Tensor b);",
                                      functions=["wmma_tile"], display_name=SOURCE.name)


def product(a, b, source: str | None = None):
    """C = A @ B for 16 x 16 float16 CUDA tensors, on the tensor cores; C is float32."""
    return build(source).wmma_tile(a, b)
