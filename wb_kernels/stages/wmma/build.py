"""The tensor-core kernel's build: ``flash_wmma.cu`` described to the shared :mod:`wb_kernels.cuda_build` (lesson 05).

- :func:`build` (needs a CUDA GPU and a CUDA build of torch): the extension with ``flash_wmma_forward``, from the
  package's source with the learner's edits (:func:`current_source`), built once and cached.
- :func:`nvcc_compile_report` and :func:`sass` (need only nvcc): every launch variant's registers, spills and shared
  memory, and the tensor-core (HMMA) instructions of one variant's machine code.
- The learner's edits: the lesson's C++ region cells (``# region: NAME (wb_kernels/stages/wmma/flash_wmma.cu)``)
  record them once :func:`enable_region_cells` has run; :func:`set_region`, :func:`reset_regions` and
  :func:`edited_regions` do the same from Python.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

from ...cuda_build import (CudaBuildError, EditableSource, Extension, compile_cubin, enable_region_cells, ptxas_entries,
                           sass_lines)

__all__ = ["SOURCE", "SOURCE_PATH", "SOURCE_NAME", "LINE_NAME", "VARIANTS", "KernelResources", "package_source",
           "current_source", "set_region", "reset_regions", "edited_regions", "enable_region_cells", "build", "extension",
           "shared_memory_bytes", "nvcc_compile_report", "sass"]

SOURCE = EditableSource(Path(__file__).resolve().parent / "flash_wmma.cu")
SOURCE_PATH = SOURCE.path
SOURCE_NAME = SOURCE.name  # "wb_kernels/stages/wmma/flash_wmma.cu", as lessons name it in their region cells
LINE_NAME = SOURCE.file_name  # what compiler messages call it
_FUNCTIONS = ["flash_wmma_forward"]
_CPP_DECLARATION = (
    "std::vector<torch::Tensor> flash_wmma_forward(torch::Tensor q, torch::Tensor k, torch::Tensor v, "
    "torch::Tensor key_keep, bool causal, int64_t causal_offset, double scale, int64_t num_warps, "
    "bool q_in_registers, int64_t row_frags);"
)
# Every variant the launcher can choose: (num_warps, q_in_registers, row_frags), as WB_FOR_EACH_VARIANT
# in flash_wmma.cu lists them. A warp owns row_frags x 16 query rows. The compile report covers all.
VARIANTS = ((4, True, 1), (8, True, 1), (4, False, 1), (8, False, 1), (4, True, 2), (4, False, 2))

package_source = SOURCE.package_source
current_source = SOURCE.current_source
set_region = SOURCE.set_region
reset_regions = SOURCE.reset_regions
edited_regions = SOURCE.edited_regions
# build(source=None, *, flags=None, verbose=False): the extension, by default from current_source() (the learner's
# edits put in); extension(): the package's (edits left out), once per process: what wb.attention calls
EXTENSION = Extension(SOURCE, _CPP_DECLARATION, _FUNCTIONS)
build = EXTENSION.build
extension = EXTENSION.extension


@dataclass(frozen=True)
class KernelResources:
    """What ptxas reports for one instantiation of the kernel (per thread, except shared memory)."""

    arch: str
    dtype: str  # "float16" or "bfloat16"
    head_dim: int
    num_warps: int
    q_in_registers: bool
    row_frags: int  # a warp owns row_frags x 16 query rows
    registers: int
    spill_stores: int  # bytes per thread written to local memory because registers ran out
    spill_loads: int
    stack_bytes: int
    shared_bytes: int  # dynamic shared memory per block (from the layout; ptxas sees only static)

    @property
    def label(self) -> str:
        return (f"{self.dtype} D={self.head_dim} warps={self.num_warps} rows/warp={16 * self.row_frags} "
                f"Q in {'registers' if self.q_in_registers else 'smem'}")


# flash_wmma_kernel<T, HEAD_DIM, NUM_WARPS, Q_IN_REGISTERS, ROW_FRAGS> as the compiler mangles it
_MANGLED = re.compile(r"flash_wmma_kernelI(6__half|13__nv_bfloat16)Li(\d+)ELi(\d+)ELb([01])ELi(\d+)E")


def shared_memory_bytes(head_dim: int, num_warps: int, q_in_registers: bool, row_frags: int = 1) -> int:
    """Dynamic shared memory per block; mirrors ``Layout`` in flash_wmma.cu."""
    block_n, pad = 64, 8
    block_m = num_warps * row_frags * 16
    kv = 2 * 2 * block_n * (head_dim + pad) * 2  # 2 stages x (K, V), fp16/bf16
    s_scratch = block_m * (block_n + pad) * 4
    p_scratch = block_m * (block_n + pad) * 2
    bias = 2 * block_n * 4
    row = block_m * 4
    q = 0 if q_in_registers else block_m * (head_dim + pad) * 2
    return kv + s_scratch + p_scratch + bias + row + q


def nvcc_compile_report(arch="sm_90", source: str | None = None) -> list:
    """Compile every kernel variant for `arch` with nvcc; returns one :class:`KernelResources` each."""
    source = current_source() if source is None else source
    _, log = compile_cubin(arch, source, LINE_NAME, SOURCE_NAME)
    found = []
    for entry in ptxas_entries(log):
        variant = _MANGLED.search(entry.function)
        if variant is None:
            continue
        dtype = "float16" if variant.group(1) == "6__half" else "bfloat16"
        head_dim, warps, q_regs, row_frags = (int(variant.group(2)), int(variant.group(3)), variant.group(4) == "1",
                                              int(variant.group(5)))
        found.append(KernelResources(entry.arch, dtype, head_dim, warps, q_regs, row_frags, entry.registers,
                                     entry.spill_stores, entry.spill_loads, entry.stack_bytes,
                                     shared_memory_bytes(head_dim, warps, q_regs, row_frags)))
    if not found:
        raise CudaBuildError(f"nvcc for {arch} reported no kernel; its output was:\n{log[-2000:]}")
    order = {"float16": 0, "bfloat16": 1}
    rank = {variant: i for i, variant in enumerate(VARIANTS)}
    return sorted(found, key=lambda r: (order[r.dtype], r.head_dim,
                                        rank[(r.num_warps, r.q_in_registers, r.row_frags)]))


def sass(arch="sm_90", *, dtype="float16", head_dim=128, num_warps=4, q_in_registers=True, row_frags=1,
         source: str | None = None, pattern: str = "HMMA") -> list:
    """The machine instructions of one kernel variant that contain `pattern` (tensor-core HMMA by default)."""
    source = current_source() if source is None else source
    cubin, _ = compile_cubin(arch, source, LINE_NAME, SOURCE_NAME)
    want = ("6__half" if dtype == "float16" else "13__nv_bfloat16", str(head_dim), str(num_warps),
            "1" if q_in_registers else "0", str(row_frags))

    def is_variant(name):
        match = _MANGLED.search(name)
        return bool(match) and match.groups() == want

    return sass_lines(cubin, is_variant, pattern)
