"""The tensor-core backward's build: ``flash_backward.cu`` described to the shared :mod:`wb_kernels.cuda_build`
(lesson 08_backward).

``flash_backward.cu`` uses the forward's tensor-core product, ldmatrix, swizzle and cp.async helpers without a copy
of them: its line ``// wb:shared-regions NAME ...`` stands for those regions of ``wb_kernels/stages/mma/flash_mma.cu``,
and :func:`package_source` puts them there (with ``#line`` directives, so that compiler messages still name the
right file and line).

- :func:`build` / :func:`extension` (need a CUDA GPU and a CUDA build of torch): the extension with
  ``flash_backward``, built once and cached on disk.
- :func:`nvcc_compile_report` (needs only nvcc): registers, spills and shared memory of every kernel the launcher
  can choose, for sm_80, sm_90 or sm_90a, on a machine without a GPU (CI).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

from ...cuda_build import CudaBuildError, EditableSource, Extension, compile_cubin, ptxas_entries
from ...lesson_sync import module_regions
from ..mma import build as mma_build

__all__ = ["SOURCE", "SOURCE_NAME", "VARIANTS", "Variant", "KernelResources", "package_source", "current_source",
           "build", "extension", "shared_memory_bytes", "nvcc_compile_report"]

SOURCE = EditableSource(Path(__file__).resolve().parent / "flash_backward.cu")
SOURCE_NAME = SOURCE.name  # "wb_kernels/stages/backward/flash_backward.cu"
LINE_NAME = SOURCE.file_name
_FUNCTIONS = ["flash_backward"]
_CPP_DECLARATION = (
    "std::vector<torch::Tensor> flash_backward(torch::Tensor q, torch::Tensor k, torch::Tensor v, torch::Tensor out, "
    "torch::Tensor lse, torch::Tensor dout, torch::Tensor key_keep, bool causal, int64_t causal_offset, double scale, "
    "int64_t version, int64_t block_m, int64_t block_n);"
)
_SHARED = re.compile(r"^// wb:shared-regions (.+)$", re.M)


@dataclass(frozen=True)
class Variant:
    """One launch configuration. ``version`` "v1": ``block_m`` query rows per step of the KV-stationary dK/dV kernel
    (64 keys, 4 warps), ``block_n`` keys per step of the Q-stationary dQ kernel (64 query rows, 4 warps). "v2":
    ``block_m`` query rows per step of the single kernel, ``block_n`` keys per block (one warp per 16)."""

    version: str
    head_dim: int
    block_m: int
    block_n: int

    @property
    def dkdv_keys(self) -> int:
        """Keys per block of the dK/dV kernel (v2's single kernel)."""
        return 64 if self.version == "v1" else self.block_n

    @property
    def label(self) -> str:
        if self.version == "v1":
            return (f"v1 D={self.head_dim} dK/dV: 64 keys x {self.block_m} queries, "
                    f"dQ: 64 queries x {self.block_n} keys")
        return f"v2 D={self.head_dim} {self.block_n} keys x {self.block_m} queries, dQ by atomics"


# As WB_FOR_EACH_BACKWARD_VARIANT in flash_backward.cu lists them (there the version is a number).
VARIANTS = tuple(Variant(f"v{v[0]}", *v[1:]) for v in (
    (1, 64, 64, 64), (1, 128, 32, 64), (2, 64, 64, 128), (2, 128, 32, 128), (2, 64, 64, 64), (2, 128, 32, 64)))


def _with_forward_regions(source: str) -> str:
    """`source` with its ``// wb:shared-regions`` line replaced by those regions of the forward's file."""
    match = _SHARED.search(source)
    if match is None:
        return source
    forward_path = mma_build.SOURCE.path
    forward_lines = forward_path.read_text().splitlines()
    regions = module_regions(forward_path)
    pieces = []
    for name in match.group(1).split():
        if name not in regions:
            raise KeyError(f"{mma_build.SOURCE_NAME} has no region {name!r}")
        first_line = forward_lines.index(f"// region: {name}") + 2  # 1-based number of the region's first line
        pieces.append(f'#line {first_line} "{mma_build.LINE_NAME}"\n{regions[name]}')
    resume = source[:match.end()].count("\n") + 2  # the line after the marker, 1-based
    return (source[:match.start()] + "\n".join(pieces) + f'\n#line {resume} "{LINE_NAME}"' + source[match.end():])


# The text nvcc compiles is the file with the forward's shared regions put in: package_source() as shipped,
# current_source() with the learner's edits (the lesson's region cells); build(source=None, *, flags=None,
# verbose=False) compiles current_source() by default, as the mma stage's does; extension() is the package's, once
# per process: what wb.attention runs
EXTENSION = Extension(SOURCE, _CPP_DECLARATION, _FUNCTIONS, compose=_with_forward_regions)
package_source = EXTENSION.package_source
current_source = EXTENSION.current_source
build = EXTENSION.build
extension = EXTENSION.extension


def shared_memory_bytes(variant: Variant, kernel: str) -> int:
    """Dynamic shared memory per block, as ``backward_smem_bytes`` in flash_backward.cu: four 16-bit tiles, v2's
    16-bit dS tile (query rows x keys) and two fp32 rows of per-query statistics (LSE, Delta)."""
    if kernel in ("preprocess", "convert"):
        return 0
    q_rows = variant.block_m if kernel == "dkdv" else 64
    kv_rows = variant.dkdv_keys if kernel == "dkdv" else variant.block_n
    ds_tile = q_rows * kv_rows * 2 if variant.version == "v2" and kernel == "dkdv" else 0
    return 2 * (kv_rows + q_rows) * variant.head_dim * 2 + ds_tile + 2 * q_rows * 4


@dataclass(frozen=True)
class KernelResources:
    """What ptxas reports for one kernel (per thread, except shared memory)."""

    arch: str
    kernel: str  # "preprocess", "dkdv", "dq" or "convert"
    version: str  # "v1" or "v2" for dkdv (v2: the single kernel), "v1" for dq, "" for preprocess and convert
    dtype: str
    head_dim: int  # 0 for convert
    tile: int  # block_m (dkdv), block_n (dq), 0 (preprocess, convert)
    warps: int  # dkdv: one per 16 keys; else 0
    registers: int
    spill_stores: int
    spill_loads: int
    shared_bytes: int


# preprocess_kernel<T, D>, dkdv_kernel<T, D, BLOCK_M, NUM_WARPS, ATOMIC_DQ>, dq_kernel<T, D, BLOCK_N>,
# convert_dq_kernel<T> as the compiler mangles them
_MANGLED = re.compile(r"(preprocess|dkdv|dq|convert_dq)_kernelI(6__half|13__nv_bfloat16)(?:Li(\d+)E)?(?:Li(\d+)E)?"
                      r"(?:Li(\d+)ELb([01])E)?")


def nvcc_compile_report(arch: str = "sm_90", source: str | None = None) -> list:
    """Compile every kernel with nvcc for `arch` ("sm_80", "sm_90" or "sm_90a"); returns one
    :class:`KernelResources` per kernel."""
    source = package_source() if source is None else source
    _, log = compile_cubin(arch, source, LINE_NAME, SOURCE_NAME)
    found = []
    for entry in ptxas_entries(log):
        match = _MANGLED.search(entry.function)
        if match is None:
            continue
        kernel, dtype = match.group(1).replace("convert_dq", "convert"), match.group(2)
        dtype = "float16" if dtype == "6__half" else "bfloat16"
        head_dim, tile = int(match.group(3) or 0), int(match.group(4) or 0)
        warps = int(match.group(5) or 0)
        version = {"dkdv": "v2" if match.group(6) == "1" else "v1", "dq": "v1"}.get(kernel, "")
        shared = 0
        if kernel in ("dkdv", "dq"):
            keys = 16 * warps if kernel == "dkdv" else tile
            variant = Variant(version, head_dim, tile if kernel == "dkdv" else 64, keys)
            shared = shared_memory_bytes(variant, kernel)
        found.append(KernelResources(entry.arch, kernel, version, dtype, head_dim, tile, warps, entry.registers,
                                     entry.spill_stores, entry.spill_loads, shared))
    if not found:
        raise CudaBuildError(f"nvcc for {arch} reported no kernel; its output was:\n{log[-2000:]}")
    return found
