"""Lesson 05's first step: one 16 x 16 x 16 matrix product on the tensor cores by one warp (``wmma_tile.cu``).

Without a GPU, :func:`hmma_instructions` compiles the kernel with nvcc and lists the tensor-core instructions the
compiler made of it; on a GPU, :func:`product` builds it with ``load_inline`` and runs it. :func:`source_with` puts
a learner's version of the kernel (the lesson's puzzle) into the file, so both work on it too.
"""

from __future__ import annotations

from pathlib import Path

from ... import cuda_build
from ...sync import module_regions

__all__ = ["SOURCE", "package_source", "kernel_text", "source_with", "hmma_instructions", "build", "product"]

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


def build(source: str | None = None):
    """The extension with ``wmma_tile(a, b)`` (needs a CUDA GPU and a CUDA build of torch)."""
    return cuda_build.build_extension(source or package_source(), file_name=SOURCE.file_name,
                                      declarations="torch::Tensor wmma_tile(torch::Tensor a, torch::Tensor b);",
                                      functions=["wmma_tile"], display_name=SOURCE.name)


def product(a, b, source: str | None = None):
    """C = A @ B for 16 x 16 float16 CUDA tensors, on the tensor cores; C is float32."""
    return build(source).wmma_tile(a, b)
