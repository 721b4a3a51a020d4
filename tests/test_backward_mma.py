"""The mma stage's gradients on tensor cores (``wb_kernels/stages/backward/flash_backward.cu``, lesson 08_backward).

Without a GPU (nvcc alone; CI runs it): every kernel compiles for sm_80, sm_90 and sm_90a, the launch variants in
use do not spill, the forward's helpers are shared and not copied, and a compiler error names the line of the file
it is on.

On a GPU (skipped on the simulator): dq, dk, dv against the float64 reference (``reference_backward``) with the
rule "at most 2x the error of torch autograd through SDPA in the same dtype, plus twice the rounding of storing the
reference in that dtype", for fp16 and bf16, D 64 and 128, odd lengths, Lq != Lk, no mask, causal at both
alignments, key padding, GQA and MQA, rows that see no key (zero gradients, no NaN), a scale of any sign,
B H > 65,535 (gridDim.x), and bitwise determinism.
"""

from __future__ import annotations

import re
import subprocess

import pytest

import wb_kernels as wb
from wb_kernels import cuda_build
from wb_kernels.stages.backward import build as backward_build
from wb_kernels.stages.backward import launcher
from stage_cases import tool_or_skip

torch = pytest.importorskip("torch")

needs_gpu = pytest.mark.skipif(
    wb.BACKEND.is_simulator,
    reason="the mma backward needs a CUDA GPU (sm_80+) and a CUDA build of torch; this machine runs the simulator")


# ---------------------------------------------------------------------------------------------
# Without a GPU

ARCHES = ["sm_80", "sm_90"]


@pytest.fixture(scope="module")
def reports():
    tool_or_skip(cuda_build.find_nvcc, "the backward's compile check")
    return {arch: backward_build.nvcc_compile_report(arch) for arch in ARCHES}


@pytest.mark.parametrize("arch", ARCHES)
def test_every_kernel_compiles_and_the_defaults_do_not_spill(reports, arch):
    found = {(r.kernel, r.dtype, r.head_dim, r.tile) for r in reports[arch]}
    for dtype in ("float16", "bfloat16"):
        for variant in backward_build.VARIANTS:
            D = variant.head_dim
            wanted = {("preprocess", dtype, D, 0), ("dkdv", dtype, D, variant.block_m), ("dq", dtype, D, variant.block_n)}
            assert wanted <= found
    defaults = set(launcher.DEFAULT_VARIANT.values())
    for kernel in reports[arch]:
        assert 0 < kernel.registers <= 255 and kernel.shared_bytes <= 227 * 1024, kernel
        variant_tiles = {(v.head_dim, v.block_m if kernel.kernel == "dkdv" else v.block_n) for v in defaults}
        if kernel.kernel == "preprocess" or (kernel.head_dim, kernel.tile) in variant_tiles:
            assert kernel.spill_stores == 0 and kernel.spill_loads == 0, kernel


def test_compiles_for_sm_90a():
    """The Hopper target the series' later kernels use (wgmma, setmaxnreg need it); mma.sync compiles there too."""
    nvcc = tool_or_skip(cuda_build.find_nvcc, "the backward's compile check")
    import tempfile
    from pathlib import Path

    with tempfile.TemporaryDirectory() as folder:
        source = Path(folder) / backward_build.LINE_NAME
        source.write_text(backward_build.package_source())
        result = subprocess.run([nvcc, "-std=c++17", "-O3", "--use_fast_math", "-DWB_KERNEL_ONLY", "-cubin",
                                 "-gencode", "arch=compute_90a,code=sm_90a", "-Xptxas", "-v", "-o", "k.cubin",
                                 source.name], capture_output=True, text=True, cwd=folder)
    log = result.stdout + result.stderr
    assert result.returncode == 0, log[-2000:]
    kernels = re.findall(r"Compiling entry function '(\w+)' for 'sm_90a'", log)  # ptxas_entries reads sm_NN only
    assert len(set(kernels)) == 2 * (2 + 2 * len(backward_build.VARIANTS)), log[-2000:]


def test_the_forwards_helpers_are_shared_not_copied():
    shipped = backward_build.SOURCE.package_source()
    assert "struct Mma<__half>" not in shipped and "// wb:shared-regions" in shipped
    composed = backward_build.package_source()
    assert composed.count("template <> struct Mma<__half>") == 1 and "ldmatrix_x4_trans" in composed
    assert "load_tile_async" in composed and "// wb:shared-regions" not in composed


def test_variants_match_the_source():
    source = backward_build.SOURCE.package_source()
    listed = re.search(r"#define WB_FOR_EACH_BACKWARD_VARIANT\(X\)(.*)", source).group(1)
    found = [backward_build.Variant(*map(int, x)) for x in re.findall(r"X\((\d+), (\d+), (\d+)\)", listed)]
    assert found == list(backward_build.VARIANTS)
    assert set(launcher.DEFAULT_VARIANT.values()) <= set(backward_build.VARIANTS)


def test_a_compiler_error_names_its_line_in_flash_backward_cu():
    tool_or_skip(cuda_build.find_nvcc, "the backward's compile check")
    shipped = backward_build.SOURCE.package_source()
    broken = shipped.replace("dp[n][i] = prob * (dp[n][i] - delta[local_query]);",
                             "dp[n][i] = prob * (dp[n][i] - deltaa[local_query]);")
    line = broken[:broken.index("deltaa")].count("\n") + 1
    with pytest.raises(cuda_build.CudaBuildError) as raised:
        backward_build.nvcc_compile_report("sm_80", source=backward_build._with_forward_regions(broken))
    assert f"flash_backward.cu({line}): error" in str(raised.value) and '"deltaa" is undefined' in str(raised.value)


def test_flops_and_bad_variants():
    assert launcher.backward_flops(4, 16, 4096, 4096, 128) == 2.5 * 4 * 4 * 16 * 4096 ** 2 * 128
    assert launcher.backward_flops(1, 1, 8, 8, 64, causal=True) == launcher.backward_flops(1, 1, 8, 8, 64) / 2
    with pytest.raises(ValueError, match="v1"):
        launcher.mma_gradients(torch.zeros(1, 1, 1, 64), None, None, None, None, None, variant="v9", module=object())
    with pytest.raises(ValueError, match="head dims"):
        launcher.mma_gradients(torch.zeros(1, 1, 1, 96), None, None, None, None, None, module=object())


# ---------------------------------------------------------------------------------------------
# GPU: the kernels against the float64 reference


def _inputs(dtype, B, H, Hk, Lq, Lk, D, seed):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    dt = getattr(torch, dtype)
    q, dout = (torch.randn(B, H, Lq, D, device="cuda", dtype=dt, generator=gen) for _ in range(2))
    k, v = (torch.randn(B, Hk, Lk, D, device="cuda", dtype=dt, generator=gen) for _ in range(2))
    return q, k, v, dout


def _assert_within_rule(errors, label):
    for name, (mine, theirs, floor) in errors.items():
        assert mine <= 2 * theirs + floor + 1e-6, f"{label} {name}: {mine:.3e} > 2 x SDPA {theirs:.3e} + {floor:.1e}"


SHAPES = [  # (B, H, Hk, Lq, Lk): L = 1, ragged tiles, Lq != Lk both ways, GQA, MQA, several tiles
    (1, 1, 1, 1, 1), (2, 3, 3, 1, 300), (1, 2, 2, 65, 65), (2, 4, 2, 128, 128), (1, 4, 1, 200, 77),
    (2, 2, 2, 77, 200), (1, 6, 3, 513, 1000), (1, 8, 2, 300, 129),
]


@needs_gpu
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("D", [64, 128])
@pytest.mark.parametrize("causal", [False, "top_left", "bottom_right"])
@pytest.mark.parametrize("padded", [False, True])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_gradients_meet_the_rule(dtype, D, causal, padded, shape):
    B, H, Hk, Lq, Lk = shape
    q, k, v, dout = _inputs(dtype, B, H, Hk, Lq, Lk, D, seed=Lq + 3 * Lk)
    mask = wb.random_padding_mask(B, Lk, seed=Lk, framework="torch", device="cuda") if padded else None
    errors = launcher.gradient_errors(q, k, v, dout, causal=causal, key_padding_mask=mask)
    _assert_within_rule(errors, f"{dtype} D={D} {shape} causal={causal} padded={padded}")


@needs_gpu
@pytest.mark.parametrize("D", [64, 128])
def test_rows_that_see_no_key_get_zero_gradients(D):
    """Bottom-right with Lq = 200 > Lk = 70 and keys 0-4 padded out: rows 0-134 see no key (LSE = -inf). Their dq
    is exactly 0, nothing is NaN, and the keys only they would see (the padded ones) get dk = dv = 0."""
    q, k, v, dout = _inputs("float16", 1, 4, 2, 200, 70, D, seed=4)
    mask = torch.ones(1, 70, dtype=torch.bool, device="cuda")
    mask[0, :5] = False
    from wb_kernels.stages.mma.launcher import forward

    out, lse = forward(q, k, v, causal="bottom_right", key_padding_mask=mask)
    assert torch.all(lse[:, :, :135] == float("-inf"))
    dq, dk, dv = launcher.mma_gradients(q, k, v, out, lse, dout, causal="bottom_right", key_padding_mask=mask)
    assert all(torch.isfinite(x).all() for x in (dq, dk, dv))
    assert torch.all(dq[:, :, :135] == 0) and torch.all(dk[:, :, :5] == 0) and torch.all(dv[:, :, :5] == 0)
    _assert_within_rule(launcher.gradient_errors(q, k, v, dout, causal="bottom_right", key_padding_mask=mask),
                        "rows without keys")


@needs_gpu
@pytest.mark.parametrize("scale", [-0.3, 0.0, 0.02])
def test_any_finite_scale(scale):
    q, k, v, dout = _inputs("float16", 2, 2, 2, 100, 150, 64, seed=9)
    _assert_within_rule(launcher.gradient_errors(q, k, v, dout, causal=True, scale=scale), f"scale={scale}")


@needs_gpu
def test_more_than_65535_batch_heads():
    """(batch, head) lives in gridDim.x: B H = 66,000 blocks of dq and dk/dv. The mma forward puts B H in gridDim.y,
    so out and LSE come from float32 torch here."""
    q, k, v, dout = _inputs("float16", 33, 2000, 2000, 5, 7, 64, seed=1)
    s = (q.float() @ k.float().transpose(-1, -2)) * 64 ** -0.5
    lse = torch.logsumexp(s, dim=-1)
    out = (torch.softmax(s, dim=-1) @ v.float()).half()
    _assert_within_rule(launcher.gradient_errors(q, k, v, dout, out_lse=(out, lse)), "B H = 66,000")


@needs_gpu
def test_v1_is_deterministic():
    q, k, v, dout = _inputs("bfloat16", 2, 8, 2, 300, 300, 128, seed=2)
    from wb_kernels.stages.mma.launcher import forward

    out, lse = forward(q, k, v, causal=True)
    first = launcher.mma_gradients(q, k, v, out, lse, dout, causal=True)
    for _ in range(3):
        again = launcher.mma_gradients(q, k, v, out, lse, dout, causal=True)
        assert all(torch.equal(a, b) for a, b in zip(first, again))
