"""The GEMV kernels' build: ``gemv_host.cu`` and the headers it includes (``gemv.cuh``, and from the decode rung
``decode_params.cuh`` for its 16-byte loads and its finished-block counter), described to the shared
:mod:`wb_kernels.cuda_build`.

- :func:`extension` (needs a CUDA GPU and a CUDA build of torch): the extension with ``gemv_v1`` and
  ``gemv_forward``, built once per process for the GPU's own architecture (sm_90 on an H100) and cached on disk.
- :func:`nvcc_compile_report` (needs only nvcc): registers, spills and stack of every kernel the launcher can
  choose, for a CPU-only machine and CI, one :class:`KernelResources` each.
- :data:`VARIANTS` and :func:`build_variant`: the batch-1 kernel's shape (weight rows per warp, loads in flight per
  row, minimum blocks per SM) and the next trip's loads issued early (prefetch) built with other values (``-D``
  flags), for ``bench.py --variants`` to time side by side.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

from ...cuda_build import CudaBuildError, EditableSource, Extension, compile_cubin, ptxas_entries

__all__ = ["SOURCE", "SOURCE_NAME", "ARCH", "FORM_NAMES", "extension", "build", "package_source",
           "nvcc_compile_report", "KernelResources", "VARIANTS", "VARIANT_FIELDS", "variant_flags", "build_variant"]

SOURCE = EditableSource(Path(__file__).resolve().parent / "gemv_host.cu")  # and the headers it includes
SOURCE_NAME = SOURCE.name  # "wb_kernels/stages/gemv/gemv_host.cu"
ARCH = "sm_90"  # the H100's; nothing here needs the arch-specific sm_90a (no wgmma, no setmaxnreg)
_FUNCTIONS = ["gemv_v1", "gemv_forward"]
_CPP_DECLARATION = (
    "torch::Tensor gemv_v1(torch::Tensor w, torch::Tensor x);"
    "torch::Tensor gemv_forward(torch::Tensor w, torch::Tensor x, std::optional<torch::Tensor> norm_weight, "
    "std::optional<torch::Tensor> residual, int64_t form, double eps, int64_t splits, int64_t k_per_split, "
    "torch::Tensor partial, torch::Tensor counters, std::optional<torch::Tensor> out);"
)
# (prologue, epilogue) of gemv_kernel's template as the host's Form enum orders them: launcher.FORMS' names
FORM_NAMES = {(0, 0): "plain", (1, 0): "norm", (0, 1): "residual", (1, 2): "norm_gate_up"}

package_source = SOURCE.package_source
EXTENSION = Extension(SOURCE, _CPP_DECLARATION, _FUNCTIONS, default="package")
build = EXTENSION.build
extension = EXTENSION.extension


# Each build bench.py can time side by side: the batch-1 shape (rows per warp, loads in flight per row and lane, min
# blocks per SM) and whether every kernel loads its next trip before computing this one (prefetch); "default" is the
# package's (work_split.SHAPES[1], no prefetch). Rows stay even: the gate/up form pairs them.
VARIANT_FIELDS = ("rows", "unroll", "min_blocks", "prefetch")
VARIANTS = {"default": (2, 4, 4, 0), "rows4_unroll2": (4, 2, 4, 0), "rows2_unroll8": (2, 8, 2, 0),
            "rows4_unroll4": (4, 4, 2, 0), "capped_registers": (2, 4, 8, 0), "prefetch": (2, 4, 4, 1)}


def variant_flags(name: str) -> list:
    """The ``-D`` flags of build variant `name` (:data:`VARIANTS`); a ValueError naming the variants there are."""
    if name not in VARIANTS:
        raise ValueError(f"the gemv rung has no build variant {name!r}; it has {', '.join(VARIANTS)}")
    rows, unroll, min_blocks, prefetch = VARIANTS[name]
    return [f"-DWB_GEMV_B1_ROWS={rows}", f"-DWB_GEMV_B1_UNROLL={unroll}", f"-DWB_GEMV_B1_MIN_BLOCKS={min_blocks}",
            f"-DWB_GEMV_PREFETCH={prefetch}"]


def build_variant(name: str, *, verbose: bool = False):
    """The extension built with variant `name`'s batch-1 shape (a GPU; cached on disk like the package's)."""
    from ...cuda_build import build_flags

    return build(package_source(), flags=build_flags() + variant_flags(name), verbose=verbose)


@dataclass(frozen=True)
class KernelResources:
    """What ptxas reports for one kernel (per thread)."""

    arch: str
    kernel: str  # "v1" or "gemv" (v2, v3 and the fused forms)
    dtype: str
    batch_width: int  # the kernel's BATCH (1 for v1)
    form: str  # FORM_NAMES' value ("plain" for v1)
    registers: int
    spill_stores: int
    spill_loads: int
    stack_bytes: int


_DTYPE = {"6__half": "float16", "13__nv_bfloat16": "bfloat16"}
_V1 = re.compile(r"gemv_v1_kernelI(6__half|13__nv_bfloat16)E")
_GEMV = re.compile(r"gemv_kernelI(6__half|13__nv_bfloat16)Li(\d+)ELi(\d)ELi(\d)E")


def nvcc_compile_report(arch: str = ARCH, source: str | None = None, nvcc: str | None = None,
                        variant: str = "default") -> list:
    """Every kernel of ``gemv_host.cu`` compiled for `arch` with nvcc alone (no GPU), as build `variant` shapes its
    batch-1 kernel: one :class:`KernelResources` each, sorted. Cached per source, arch and flags in this process
    (:func:`~wb_kernels.cuda_build.compile_cubin`)."""
    flags = tuple(variant_flags(variant)) if variant != "default" else ()
    _, log = compile_cubin(arch, package_source() if source is None else source, SOURCE.file_name, SOURCE_NAME,
                           nvcc=nvcc, extra_flags=flags)
    found = []
    for entry in ptxas_entries(log):
        v1, gemv = _V1.search(entry.function), _GEMV.search(entry.function)
        if v1:
            kernel, dtype, width, form = "v1", _DTYPE[v1.group(1)], 1, "plain"
        elif gemv:
            kernel, dtype, width = "gemv", _DTYPE[gemv.group(1)], int(gemv.group(2))
            form = FORM_NAMES[(int(gemv.group(3)), int(gemv.group(4)))]
        else:
            continue
        found.append(KernelResources(entry.arch, kernel, dtype, width, form, entry.registers, entry.spill_stores,
                                     entry.spill_loads, entry.stack_bytes))
    if not found:
        raise CudaBuildError(f"nvcc for {arch} reported no GEMV kernel; its output was:\n{log[-2000:]}")
    return sorted(found, key=lambda r: (r.kernel, r.dtype, r.batch_width, r.form))
