"""The tensor-core kernel compiles for sm_80 and sm_90 with nvcc, on any machine with nvcc (lesson 05).

No GPU is needed: this is how CI catches a broken wb_kernels/csrc/flash_wmma.cu. In CI (the
environment variable CI is set) a missing nvcc or cuobjdump FAILS the test, so the check cannot
silently disappear; elsewhere (a laptop without the CUDA toolkit) it is skipped with the reason.
"""

from __future__ import annotations

import os

import pytest

from wb_kernels import cuda_build
from wb_kernels.stages.flash_tensor_cores import DEFAULT_VARIANT

IN_CI = bool(os.environ.get("CI"))
ARCHES = ["sm_80", "sm_90"]


def _tool_or_skip(find):
    try:
        return find()
    except FileNotFoundError as missing:
        if IN_CI:
            pytest.fail(f"CI must compile the CUDA kernel, but: {missing}")
        pytest.skip(f"not in CI and {missing}")


@pytest.fixture(scope="module")
def reports():
    _tool_or_skip(cuda_build.find_nvcc)
    return {arch: cuda_build.nvcc_compile_report(arch, source=cuda_build.package_source()) for arch in ARCHES}


@pytest.mark.parametrize("arch", ARCHES)
def test_every_variant_compiles(reports, arch):
    report = reports[arch]
    expected = {(dtype, D, *variant) for dtype in ("float16", "bfloat16") for D in (64, 128)
                for variant in cuda_build.VARIANTS}
    assert {(k.dtype, k.head_dim, k.num_warps, k.q_in_registers, k.row_frags) for k in report} == expected
    for kernel in report:
        assert 0 < kernel.registers <= 255, kernel
        # an H100/A100 block may use at most 227 KB of dynamic shared memory
        assert kernel.shared_bytes <= 227 * 1024, kernel


@pytest.mark.parametrize("arch", ARCHES)
def test_default_variants_do_not_spill(reports, arch):
    for kernel in reports[arch]:
        if (kernel.num_warps, kernel.q_in_registers, kernel.row_frags) == DEFAULT_VARIANT[kernel.head_dim]:
            assert kernel.spill_stores == 0 and kernel.spill_loads == 0, kernel


@pytest.mark.parametrize("arch", ARCHES)
@pytest.mark.parametrize("dtype, mnemonic", [("float16", "HMMA.16816.F32"), ("bfloat16", "HMMA.16816.F32.BF16")])
def test_machine_code_uses_tensor_cores(reports, arch, dtype, mnemonic):
    _tool_or_skip(cuda_build.find_cuobjdump)
    for D in (64, 128):
        num_warps, q_in_registers, row_frags = DEFAULT_VARIANT[D]
        hmma = cuda_build.sass(arch, dtype=dtype, head_dim=D, num_warps=num_warps, q_in_registers=q_in_registers,
                               row_frags=row_frags, source=cuda_build.package_source())
        # per 64-key tile and 16 rows a warp does D/16 x 4 WMMAs for S and 4 x D/16 for PV; each is
        # 2 HMMA.16816 (the loops are unrolled, so each appears once in the machine code)
        assert len(hmma) == row_frags * 2 * 2 * (D // 16) * 4, (D, len(hmma))
        assert all(line.startswith(mnemonic) for line in hmma), hmma[:3]


def test_a_broken_source_fails_with_the_compilers_message():
    _tool_or_skip(cuda_build.find_nvcc)
    broken = cuda_build.package_source().replace("tile_sum += p[t];", "tile_summ += p[t];")
    with pytest.raises(cuda_build.CudaBuildError) as raised:
        cuda_build.nvcc_compile_report("sm_90", source=broken)
    message = str(raised.value)
    assert 'identifier "tile_summ" is undefined' in message and len(message.splitlines()) < 20
