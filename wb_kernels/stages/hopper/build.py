"""The Hopper rung's build: ``hopper_host.cu`` and the headers it includes, described to the shared
:mod:`wb_kernels.cuda_build` (rung ``hopper``).

The files (``stages/hopper/``): ``hopper_primitives_lab.cuh`` (v0, the primitives lab: the mbarrier, TMA, wgmma,
setmaxnreg and named-barrier wrappers and their unit kernels), ``hopper_attention.cuh`` (the attention versions
v1-v4, built on the lab), ``hopper_host.cu`` (the extension's translation unit: tensor maps and the torch entry
points of both). :data:`SOURCE` is all of them (:class:`~wb_kernels.cuda_build.EditableSource`).

- :func:`build` (needs a Hopper GPU and a CUDA build of torch): the extension with ``hopper_tma_tile`` and
  ``hopper_wgmma_gemm``, built for ``-gencode arch=compute_90a,code=sm_90a`` (wgmma exists only on that target), by
  default with the barrier watchdog (``WATCHDOG_SECONDS``): a wait that never completes traps instead of hanging.
  Before building it compiles the kernels alone and refuses a source whose wgmma ptxas serialized.
- :func:`nvcc_compile_report`, :func:`sass` (need only nvcc): registers, spills and shared memory of every kernel,
  and its machine code: ``HGMMA`` (wgmma), ``UTMALDG`` (the TMA load), ``SYNCS`` (mbarrier operations).
  ptxas' "wgmma ... serialized" note (C7510, C7520) raises :class:`~wb_kernels.cuda_build.CudaBuildError`.
  ``part="backward"`` compiles the backward's kernels instead (``hopper_backward.cuh``, issue 47: the preprocessing,
  the main kernel and the dQ conversion, fp16/bf16, D 64/128; ``-DWB_BACKWARD_ONLY``), so that neither report
  waits for the other's kernels.
"""

from __future__ import annotations

import functools
import os
import re
from dataclasses import dataclass
from pathlib import Path

from ...cuda_build import (CudaBuildError, EditableSource, Extension, build_flags, compile_cubin, gencode,
                           ptxas_entries, sass_lines, serialized_wgmma)

__all__ = ["SOURCE", "SOURCE_NAME", "ARCH", "WATCHDOG_SECONDS", "GEMM_VARIANTS", "GemmVariant", "KernelResources",
           "package_source", "build_options", "build", "extension", "nvcc_compile_report", "sass", "check_wgmma_not_serialized",
           "PARTS"]

SOURCE = EditableSource(Path(__file__).resolve().parent / "hopper_host.cu")  # and the headers it includes
SOURCE_NAME = SOURCE.name
LINE_NAME = SOURCE.file_name
ARCH = "sm_90a"  # wgmma and setmaxnreg: Hopper's architecture-specific target
# a barrier wait longer than this traps (the kernels here finish in milliseconds); WB_WATCHDOG_SECONDS sets another
# limit for a run whose kernels are slowed (compute-sanitizer: its memcheck made the deterministic backward's waits
# long enough to trap, a false failure), 0 none
WATCHDOG_SECONDS = float(os.environ.get("WB_WATCHDOG_SECONDS", "2.0"))
_FUNCTIONS = ["hopper_tma_tile", "hopper_wgmma_gemm", "hopper_register_split", "hopper_named_barrier_turns",
              "hopper_flash_forward", "hopper_flash_backward", "hopper_backward_dq_product"]
_CPP_DECLARATION = (
    "torch::Tensor hopper_tma_tile(torch::Tensor x, int64_t row0, int64_t column0, int64_t expect_bytes);\n"
    "torch::Tensor hopper_wgmma_gemm(torch::Tensor a, torch::Tensor b, bool a_in_registers, bool b_mn_major);\n"
    "torch::Tensor hopper_register_split(torch::Tensor x);\n"
    "torch::Tensor hopper_named_barrier_turns(int64_t rounds, torch::Tensor device_like);\n"
    "std::vector<torch::Tensor> hopper_flash_forward(torch::Tensor q, torch::Tensor k, torch::Tensor v, "
    "torch::Tensor key_keep, bool causal, int64_t causal_offset, double scale, int64_t version);\n"
    "std::vector<torch::Tensor> hopper_flash_backward(torch::Tensor q, torch::Tensor k, torch::Tensor v, "
    "torch::Tensor out, torch::Tensor lse, torch::Tensor dout, torch::Tensor key_keep, bool causal, "
    "int64_t causal_offset, double scale, bool deterministic);\n"
    "torch::Tensor hopper_backward_dq_product(torch::Tensor a_t, torch::Tensor b, int64_t consumer);"
)
PARTS = {"forward": (), "backward": ("-DWB_BACKWARD_ONLY",)}  # which kernels a compile without torch instantiates

package_source = SOURCE.package_source
_EXTENSION = Extension(SOURCE, _CPP_DECLARATION, _FUNCTIONS, default="package")  # build() below adds Hopper's checks


@dataclass(frozen=True)
class GemmVariant:
    """One instantiation of ``wgmma_gemm_kernel``: C (64 x n) from K <= 16 k_steps, A in shared memory or registers,
    B K-major or MN-major."""

    n: int
    k_steps: int
    a_in_registers: bool
    b_mn_major: bool

    @property
    def label(self) -> str:
        return (f"64x{self.n}x{16 * self.k_steps} {'RS' if self.a_in_registers else 'SS'}, "
                f"B {'MN' if self.b_mn_major else 'K'}-major")


# As WB_FOR_EACH_GEMM_VARIANT in hopper_host.cu lists them
GEMM_VARIANTS = tuple(GemmVariant(*v) for v in (
    (64, 1, False, False), (64, 4, False, False), (128, 4, False, False), (64, 1, True, False), (64, 4, True, False),
    (128, 4, True, False), (64, 4, False, True), (128, 4, False, True), (64, 4, True, True), (128, 4, True, True)))


def build_options(watchdog_seconds: float | None = WATCHDOG_SECONDS) -> list:
    """The ``-D`` flags of a build: the watchdog's limit in nanoseconds, or none (wait for ever)."""
    if not watchdog_seconds:
        return []
    return [f"-DWB_WATCHDOG_NS={int(watchdog_seconds * 1e9)}ull"]


def check_wgmma_not_serialized(source: str, options: list) -> None:
    """Compile the kernels alone for sm_90a (the forward's, then the backward's) and raise :class:`CudaBuildError`
    when ptxas serialized a wgmma."""
    found = []
    for flags in PARTS.values():
        _, log = compile_cubin(ARCH, source, LINE_NAME, SOURCE_NAME, extra_flags=tuple(options) + flags)
        found += serialized_wgmma(log)
    if found:
        lines = "\n".join(f"  ({code}) {function}: serialized due to {reason}" for code, reason, function in found)
        raise CudaBuildError(f"ptxas serialized the wgmma of {len(found)} kernel(s) of {SOURCE_NAME} (a printf, "
                             f"accumulators touched while a wgmma is in flight, or a wgmma on a divergent path):\n{lines}")


def build(source: str | None = None, *, watchdog_seconds: float | None = WATCHDOG_SECONDS, verbose: bool = False):
    """Compile (or load from the cache) the primitives lab's extension for sm_90a; returns the Python module.
    Needs a Hopper GPU (sm_90) and a CUDA build of torch."""
    import torch

    source = package_source() if source is None else source
    if torch.cuda.is_available() and torch.cuda.get_device_capability() != (9, 0):
        major, minor = torch.cuda.get_device_capability()
        raise RuntimeError(f"the hopper rung needs a Hopper GPU (sm_90: H100, H200; wgmma and the TMA); this one is "
                           f"sm_{major}{minor}: use stage='mma', FlashAttention-2 with mma.sync, which runs on sm_80+")
    options = build_options(watchdog_seconds)
    check_wgmma_not_serialized(source, options)
    return _EXTENSION.build(source, flags=build_flags(gencode(ARCH)) + options, verbose=verbose)


@functools.cache
def extension():
    """The package's lab, with the watchdog, built or loaded once per process."""
    return build(package_source())


@dataclass(frozen=True)
class KernelResources:
    """What ptxas reports for one kernel (per thread; shared memory is static here, per block)."""

    function: str  # "tma_tile", "register_split", "named_barrier", a GemmVariant's label, "flash_v1 D=64" (v2-v4),
    # "backward D=64" (128), "backward_preprocess", "backward_convert_dq", "backward_dq_product D=64" (128)
    dtype: str | None
    variant: GemmVariant | None
    registers: int
    spill_stores: int
    spill_loads: int
    stack_bytes: int


# wgmma_gemm_kernel<T, N, K_STEPS, A_IN_REGISTERS, B_MN_MAJOR> as the compiler mangles it
_MANGLED = re.compile(r"wgmma_gemm_kernelI(6__half|13__nv_bfloat16)Li(\d+)ELi(\d+)ELb([01])ELb([01])E")


_V1 = re.compile(r"flash_v1_kernelI(6__half|13__nv_bfloat16)Li(\d+)E")
_WS = re.compile(r"flash_ws_kernelI(6__half|13__nv_bfloat16)Li(\d+)ELi([234])E")  # VERSION 2, 3 or 4
_BACKWARD = re.compile(r"flash_backward_kernelI(6__half|13__nv_bfloat16)Li(\d+)E")
_BACKWARD_EDGES = re.compile(r"backward_(preprocess|convert_dq)_kernelI(6__half|13__nv_bfloat16)E")
_DQ_PRODUCT = re.compile(r"dq_product_kernelI(6__half|13__nv_bfloat16)Li(\d+)E")


def _dtype(mangled: str) -> str:
    return "float16" if mangled == "6__half" else "bfloat16"


def _decode(function: str):
    for kernel in ("tma_tile", "register_split", "named_barrier"):
        if f"{kernel}_kernel" in function:
            return kernel, None, None
    match = _V1.search(function)
    if match is not None:
        return f"flash_v1 D={match.group(2)}", "float16" if match.group(1) == "6__half" else "bfloat16", None
    match = _WS.search(function)
    if match is not None:
        return (f"flash_v{match.group(3)} D={match.group(2)}",
                "float16" if match.group(1) == "6__half" else "bfloat16", None)
    match = _BACKWARD.search(function)
    if match is not None:
        return f"backward D={match.group(2)}", _dtype(match.group(1)), None
    match = _BACKWARD_EDGES.search(function)
    if match is not None:
        return f"backward_{match.group(1)}", _dtype(match.group(2)), None
    match = _DQ_PRODUCT.search(function)
    if match is not None:
        return f"backward_dq_product D={match.group(2)}", _dtype(match.group(1)), None
    match = _MANGLED.search(function)
    if match is None:
        return None
    dtype = "float16" if match.group(1) == "6__half" else "bfloat16"
    variant = GemmVariant(int(match.group(2)), int(match.group(3)), match.group(4) == "1", match.group(5) == "1")
    return variant.label, dtype, variant


def nvcc_compile_report(source: str | None = None, *, watchdog_seconds: float | None = WATCHDOG_SECONDS,
                        nvcc: str | None = None, part: str = "forward") -> list:
    """Compile every kernel of `part` (:data:`PARTS`: the lab and the forward, or the backward) for sm_90a with nvcc
    (no GPU); one :class:`KernelResources` each. Raises :class:`CudaBuildError` when ptxas serialized a wgmma."""
    source = package_source() if source is None else source
    options = tuple(build_options(watchdog_seconds)) + PARTS[part]
    _, log = compile_cubin(ARCH, source, LINE_NAME, SOURCE_NAME, extra_flags=options, nvcc=nvcc)
    found = serialized_wgmma(log)
    if found:
        raise CudaBuildError(f"ptxas serialized the wgmma of {SOURCE_NAME}: " +
                             "; ".join(f"({code}) {function}: due to {reason}" for code, reason, function in found))
    report = []
    for entry in ptxas_entries(log):
        decoded = _decode(entry.function)
        if decoded is not None:
            report.append(KernelResources(*decoded, entry.registers, entry.spill_stores, entry.spill_loads,
                                          entry.stack_bytes))
    if not report:
        raise CudaBuildError(f"nvcc for {ARCH} reported no kernel; its output was:\n{log[-2000:]}")
    return report


def sass(function: str = "", *, source: str | None = None, pattern: str = "",
         watchdog_seconds: float | None = WATCHDOG_SECONDS, nvcc: str | None = None, part: str = "forward") -> list:
    """Machine instructions containing `pattern` of the kernels of `part` whose mangled name contains `function`."""
    source = package_source() if source is None else source
    cubin, _ = compile_cubin(ARCH, source, LINE_NAME, SOURCE_NAME,
                             extra_flags=tuple(build_options(watchdog_seconds)) + PARTS[part], nvcc=nvcc)
    return sass_lines(cubin, lambda name: function in name, pattern)
