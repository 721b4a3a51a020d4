"""The mma.sync kernel's build: ``flash_mma.cu`` described to the shared :mod:`wb_kernels.cuda_build` (lesson 06).

- :func:`build` (needs a CUDA GPU and a CUDA build of torch): the extension with ``flash_mma_forward``, from the
  package's source with the learner's edits (:func:`current_source`), built once and cached.
- :func:`nvcc_compile_report` and :func:`key_loop_counts` (need only nvcc): every launch variant's registers, spills
  and shared memory, and which instructions the key loop is made of (tensor-core ``HMMA``, ``LDSM`` = ldmatrix,
  plain shared-memory loads and stores ``LDS``/``STS``), for this kernel and lesson 05's side by side.
- The learner's edits: the lesson's C++ region cells (``# region: NAME (wb_kernels/stages/mma/flash_mma.cu)``)
  record them once :func:`enable_region_cells` has run; :func:`set_region`, :func:`reset_regions` and
  :func:`edited_regions` do the same from Python.
"""

from __future__ import annotations

import re
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

from ...cuda_build import (CudaBuildError, EditableSource, Extension, compile_cubin, enable_region_cells, ptxas_entries,
                           sass_lines)

__all__ = ["SOURCE", "SOURCE_NAME", "VARIANTS", "Variant", "KernelResources", "package_source", "current_source",
           "set_region", "reset_regions", "edited_regions", "enable_region_cells", "build", "extension", "shared_memory_bytes",
           "nvcc_compile_report", "sass", "key_loop_counts"]

SOURCE = EditableSource(Path(__file__).resolve().parent / "flash_mma.cu")
SOURCE_NAME = SOURCE.name  # "wb_kernels/stages/mma/flash_mma.cu", as lessons name it in their region cells
LINE_NAME = SOURCE.file_name  # what compiler messages call it
_FUNCTIONS = ["flash_mma_forward"]
_CPP_DECLARATION = (
    "std::vector<torch::Tensor> flash_mma_forward(torch::Tensor q, torch::Tensor k, torch::Tensor v, "
    "torch::Tensor key_keep, bool causal, int64_t causal_offset, double scale, int64_t num_warps, "
    "int64_t row_tiles, int64_t block_n, bool q_in_registers);"
)


@dataclass(frozen=True)
class Variant:
    """One launch configuration: a warp owns ``row_tiles`` x 16 query rows, a block ``num_warps`` warps; keys come
    in tiles of ``block_n``; Q's fragments stay in registers or are re-read from shared memory every key tile."""

    head_dim: int
    num_warps: int
    row_tiles: int
    block_n: int
    q_in_registers: bool

    @property
    def block_m(self) -> int:
        return self.num_warps * self.row_tiles * 16

    @property
    def label(self) -> str:
        return (f"D={self.head_dim} {self.block_m}x{self.block_n} tile, {self.num_warps} warps x "
                f"{16 * self.row_tiles} rows, Q in {'registers' if self.q_in_registers else 'smem'}")


# Every variant the launcher can choose, as WB_FOR_EACH_MMA_VARIANT in flash_mma.cu lists them.
VARIANTS = tuple(Variant(*v) for v in (
    (64, 4, 1, 64, True), (64, 4, 2, 64, True), (64, 4, 1, 128, True), (64, 4, 2, 128, False), (64, 8, 1, 128, True),
    (128, 4, 1, 64, True), (128, 4, 2, 64, False), (128, 8, 1, 64, True), (128, 4, 1, 128, True)))

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


def shared_memory_bytes(variant: Variant) -> int:
    """Dynamic shared memory per block; mirrors ``Layout`` in flash_mma.cu: the Q tile (which also stages the
    output at the end) and two stages of K and V tiles, 16-bit, unpadded (the swizzle needs no extra bytes)."""
    q_tile = variant.block_m * variant.head_dim * 2
    kv_tiles = 2 * 2 * variant.block_n * variant.head_dim * 2
    return q_tile + kv_tiles


@dataclass(frozen=True)
class KernelResources:
    """What ptxas reports for one instantiation of the kernel (per thread, except shared memory)."""

    arch: str
    dtype: str  # "float16" or "bfloat16"
    variant: Variant
    registers: int
    spill_stores: int  # bytes per thread written to local memory because registers ran out
    spill_loads: int
    stack_bytes: int
    shared_bytes: int  # dynamic shared memory per block (from the layout; ptxas sees only static)

    @property
    def label(self) -> str:
        return f"{self.dtype} {self.variant.label}"


# flash_mma_kernel<T, HEAD_DIM, NUM_WARPS, ROW_TILES, BLOCK_N, Q_IN_REGISTERS> as the compiler mangles it
_MANGLED = re.compile(r"flash_mma_kernelI(6__half|13__nv_bfloat16)Li(\d+)ELi(\d+)ELi(\d+)ELi(\d+)ELb([01])E")


def _decode(function: str):
    match = _MANGLED.search(function)
    if match is None:
        return None
    dtype = "float16" if match.group(1) == "6__half" else "bfloat16"
    head_dim, warps, row_tiles, block_n = (int(match.group(i)) for i in range(2, 6))
    return dtype, Variant(head_dim, warps, row_tiles, block_n, match.group(6) == "1")


def nvcc_compile_report(arch="sm_90", source: str | None = None) -> list:
    """Compile every kernel variant for `arch` with nvcc; returns one :class:`KernelResources` each."""
    source = current_source() if source is None else source
    _, log = compile_cubin(arch, source, LINE_NAME, SOURCE_NAME)
    found = []
    for entry in ptxas_entries(log):
        decoded = _decode(entry.function)
        if decoded is None:
            continue
        dtype, variant = decoded
        found.append(KernelResources(entry.arch, dtype, variant, entry.registers, entry.spill_stores,
                                     entry.spill_loads, entry.stack_bytes, shared_memory_bytes(variant)))
    if not found:
        raise CudaBuildError(f"nvcc for {arch} reported no kernel; its output was:\n{log[-2000:]}")
    rank = {variant: i for i, variant in enumerate(VARIANTS)}
    return sorted(found, key=lambda r: (r.dtype != "float16", rank[r.variant]))


def sass(variant: Variant, arch="sm_90", *, dtype="float16", source: str | None = None, pattern: str = "") -> list:
    """The machine instructions of one kernel variant that contain `pattern` (all of them by default)."""
    source = current_source() if source is None else source
    cubin, _ = compile_cubin(arch, source, LINE_NAME, SOURCE_NAME)
    return sass_lines(cubin, lambda name: _decode(name) == (dtype, variant), pattern)


# What the lesson counts: tensor-core products, ldmatrix, and plain shared-memory loads and stores. A predicate
# of "@!PT" never holds: nvcc pads cp.async sequences with such never-executed loads, which are not traffic.
_COUNTED = {"HMMA": re.compile(r"\bHMMA\."), "LDSM": re.compile(r"\bLDSM\."), "LDS": re.compile(r"\bLDS(\.|\b)"),
            "STS": re.compile(r"\bSTS(\.|\b)")}


def instruction_counts(lines) -> Counter:
    """How many of `lines` (SASS) are HMMA, LDSM, LDS and STS, never-executed ``@!PT`` ones left out."""
    counts = Counter({name: 0 for name in _COUNTED})
    for line in lines:
        if "@!PT" in line:
            continue
        for name, pattern in _COUNTED.items():
            if pattern.search(line):
                counts[name] += 1
    return counts


def key_loop_counts(lines) -> Counter:
    """:func:`instruction_counts` of the key loop's body, taken as every instruction from the first tensor-core
    product to the last: the prologue (Q's fragments) comes before the first, the epilogue (O's stores) after the
    last, and the shared-memory round trip of S and P, if a kernel has one, lies between."""
    lines = list(lines)
    hmma = [i for i, line in enumerate(lines) if "HMMA." in line]
    if not hmma:
        raise ValueError("no HMMA instruction: is this a tensor-core kernel?")
    return instruction_counts(lines[hmma[0]:hmma[-1] + 1])
