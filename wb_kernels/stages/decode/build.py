"""The CUDA C++ decode kernels' build: ``decode_host.cu`` and the headers it includes, described to the shared
:mod:`wb_kernels.cuda_build`.

The files (``stages/decode/``): ``decode_params.cuh`` (the parameters, NaN tests, 16-byte loads), ``decode_merge.cuh``
(the merges of a sequence's splits), ``decode_split_kernel.cuh`` (the split kernel), ``decode_mma_kernel.cuh`` (the
tensor-core kernel for MQA and large groups): device code another kernel can include; ``decode_host.cu``: the
extension's translation unit (launches, torch entry points). :data:`SOURCE` is all of them: what nvcc compiles is
``decode_host.cu`` with its headers put in (:class:`~wb_kernels.cuda_build.EditableSource`).

- :func:`extension` (needs a CUDA GPU and a CUDA build of torch): the extension with ``flash_decode_forward``, built
  once per process from the package's source (the first build takes a minute or more, and says so) and cached on
  disk; later calls return the loaded module without reading or hashing the source again (per-call overhead).
- :func:`enable_region_cells`: lets lesson 07's C++ cells (``# region: NAME (wb_kernels/stages/decode/<file>)``, any
  of the files above) run; each records the learner's version of that region, which :func:`nvcc_compile_report`
  then compiles.
- :func:`nvcc_compile_report` (needs only nvcc): registers, spills and shared memory of every kernel the launcher can
  choose, for a CPU-only machine and CI.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

from ...cuda_build import CudaBuildError, EditableSource, Extension, compile_cubin, enable_region_cells, ptxas_entries

__all__ = ["SOURCE", "SOURCE_NAME", "extension", "build", "nvcc_compile_report", "KernelResources",
           "package_source", "KEYS_PER_STEP", "enable_region_cells", "current_source", "VERSIONS", "version_flags",
           "build_version"]

SOURCE = EditableSource(Path(__file__).resolve().parent / "decode_host.cu")  # and the headers it includes
SOURCE_NAME = SOURCE.name  # "wb_kernels/stages/decode/decode_host.cu"
LINE_NAME = SOURCE.file_name
_FUNCTIONS = ["flash_decode_forward", "flash_decode_blocks_per_sm", "flash_decode_mma_forward",
              "flash_decode_mma_blocks_per_sm"]
_CPP_DECLARATION = (
    "std::vector<torch::Tensor> flash_decode_forward(torch::Tensor q, torch::Tensor k_pages, torch::Tensor v_pages, "
    "std::optional<torch::Tensor> block_table, torch::Tensor seq_lens, torch::Tensor status, int64_t keys_per_split, "
    "int64_t num_splits, double scale);"
    "int64_t flash_decode_blocks_per_sm(bool bf16, int64_t head_dim, int64_t group, bool paged);"
    "std::vector<torch::Tensor> flash_decode_mma_forward(torch::Tensor q, torch::Tensor k_pages, "
    "torch::Tensor v_pages, std::optional<torch::Tensor> block_table, torch::Tensor seq_lens, torch::Tensor status, "
    "int64_t keys_per_split, int64_t num_splits, double scale);"
    "int64_t flash_decode_mma_blocks_per_sm(bool bf16, int64_t head_dim, int64_t group, bool paged);"
)
# keys a block of the split kernel reads per trip round its loop at D = 64 (8 warps x 4 keys x 2 steps in flight;
# at D = 128 a trip is half of it); splits are rounded up to a multiple of it so that no block ends with idle lanes
KEYS_PER_STEP = 8 * 4 * 2

package_source = SOURCE.package_source
current_source = SOURCE.current_source  # with the regions a learner edited in the lesson (enable_region_cells)
# build(source=None, *, flags=None, verbose=False): the extension from `source` (default: the package's);
# extension(): the package's, looked up once per process: what every wb.decode call uses
EXTENSION = Extension(SOURCE, _CPP_DECLARATION, _FUNCTIONS, default="package")
build = EXTENSION.build
extension = EXTENSION.extension


# The kept versions of the CUDA C++ kernels that still exist in the source, by name: each is the package's source
# built with ``-D`` flags that undo what later versions added (NOTES.md, "Versions", says what each version is and
# what it measured; versions 1-4 are the numba kernels, kernel.py; 8, 9, 11-14 and 18-19 changed code or the launcher
# and exist only in history). What a flag cannot undo is today's in every one of them (the graph-safe, strided and
# paged loads of versions 12 and 16's loop structure, the mma kernel, one split's block writing the answer), so
# "v5" is version 5's launch configuration and softmax on today's kernel, not the kernel of that commit.
# build_version(name) builds one (a GPU); its module has the package's entry points, flash_decode_forward included,
# so a cell can time version N against N + 1 on the same inputs (tune.py's timing of the bare call).
_V5 = {"WB_DECODE_WARPS": 4, "WB_KEYS_IN_FLIGHT": 4, "WB_DECODE_PREFETCH": 0, "WB_DECODE_CHUNKED_SOFTMAX": 0,
       "WB_DECODE_FUSED_MERGE": 0, "WB_PAGED_FOUR_ROW_BLOCKS": 0, "WB_PAGED_TABLE_AHEAD": 0, "WB_DECODE_KV_NC": 0,
       "WB_DECODE_MERGE_VECTOR": 0}
VERSIONS = {
    "v5": _V5,  # 4 warps, 4 key steps in flight, the online softmax per key, a second kernel merges
    "v6": {**_V5, "WB_DECODE_WARPS": 8, "WB_KEYS_IN_FLIGHT": 2, "WB_DECODE_PREFETCH": 1},  # next trip's loads first
    "v7": {**_V5, "WB_DECODE_WARPS": 8, "WB_KEYS_IN_FLIGHT": 2, "WB_DECODE_PREFETCH": 1,
           "WB_DECODE_CHUNKED_SOFTMAX": 1},  # one rescale per trip of keys
    "v10": {**_V5, "WB_DECODE_WARPS": 8, "WB_KEYS_IN_FLIGHT": 2, "WB_DECODE_PREFETCH": 1,
            "WB_DECODE_CHUNKED_SOFTMAX": 1, "WB_DECODE_FUSED_MERGE": 1},  # the last block of a group merges
    "v15": {**_V5, "WB_DECODE_WARPS": 8, "WB_KEYS_IN_FLIGHT": 2, "WB_DECODE_PREFETCH": 1,  # 2 paged 4-row blocks an SM
            "WB_DECODE_CHUNKED_SOFTMAX": 1, "WB_DECODE_FUSED_MERGE": 1, "WB_PAGED_FOUR_ROW_BLOCKS": 2},
    "v16": {**_V5, "WB_DECODE_WARPS": 8, "WB_KEYS_IN_FLIGHT": 2, "WB_DECODE_PREFETCH": 1,
            "WB_DECODE_CHUNKED_SOFTMAX": 1, "WB_DECODE_FUSED_MERGE": 1, "WB_PAGED_FOUR_ROW_BLOCKS": 2,
            "WB_PAGED_TABLE_AHEAD": 1, "WB_DECODE_KV_NC": 1},  # page-table entries a trip ahead, K/V past L1
    "v19": {},  # the package's build: v17's merge by four columns (WB_DECODE_MERGE_VECTOR) and one split's write
}


def version_flags(name: str) -> list:
    """The ``-D`` flags of version `name` of :data:`VERSIONS`; a ValueError naming the versions there are."""
    if name not in VERSIONS:
        raise ValueError(f"the decode rung has no version {name!r}; it has {', '.join(VERSIONS)}")
    return [f"-D{macro}={value}" for macro, value in VERSIONS[name].items()]


def build_version(name: str, *, verbose: bool = False):
    """The extension of version `name` (the package's source with :func:`version_flags`), built or loaded from the
    disk cache; needs a CUDA GPU. ``build_version("v19")`` is :func:`extension`'s build."""
    from ...cuda_build import build_flags

    return build(package_source(), flags=build_flags() + version_flags(name), verbose=verbose)


@dataclass(frozen=True)
class KernelResources:
    arch: str
    kernel: str  # "split", "mma" (the tensor-core kernel for large groups) or "merge"
    dtype: str
    head_dim: int
    rows: int  # query rows per block (split kernel; the mma kernel's row tiles x 16); 0 for the merge kernel
    registers: int
    spill_stores: int
    spill_loads: int
    paged: bool | None = None  # the mma kernel's variants (paged or contiguous cache); None: not told apart


_SPLIT = re.compile(r"decode_split_kernelI(6__half|13__nv_bfloat16)Li(\d+)ELi(\d+)E")
_MERGE = re.compile(r"decode_merge_kernelI(6__half|13__nv_bfloat16)Li(\d+)E")
_MMA = re.compile(r"decode_mma_kernelI(6__half|13__nv_bfloat16)Li(\d+)ELi(\d+)ELb([01])E")


def nvcc_compile_report(arch: str = "sm_90") -> list:
    """Compile every kernel of the launcher for `arch` with nvcc; one :class:`KernelResources` each."""
    _, log = compile_cubin(arch, current_source(), LINE_NAME, SOURCE_NAME)
    found = []
    for entry in ptxas_entries(log):
        split, merge, mma = (pattern.search(entry.function) for pattern in (_SPLIT, _MERGE, _MMA))
        match = split or merge or mma
        if match is None:
            continue
        dtype = "float16" if match.group(1) == "6__half" else "bfloat16"
        kind, rows = ("split", int(split.group(3))) if split else ("mma", 16 * int(mma.group(3))) if mma else ("merge", 0)
        found.append(KernelResources(entry.arch, kind, dtype, int(match.group(2)), rows, entry.registers,
                                     entry.spill_stores, entry.spill_loads, mma.group(4) == "1" if mma else None))
    if not found:
        raise CudaBuildError(f"nvcc for {arch} reported no kernel; its output was:\n{log[-2000:]}")
    return sorted(found, key=lambda r: (r.kernel, r.dtype, r.head_dim, r.rows, bool(r.paged)))
