"""The mma stage's gradients on tensor cores (``wb_kernels/stages/backward/flash_backward.cu``, lesson 08_backward).

Without a GPU (nvcc alone; CI runs it): every kernel of both versions compiles for sm_80 and sm_90a without
spilling, the forward's helpers are shared and not copied, and a compiler error names the line of the file it is on.

On a GPU (skipped on the simulator): dq, dk, dv of v1 and v2 against the float64 reference (``reference_backward``)
with the rule "at most 2x the error of torch autograd through SDPA in the same dtype, plus twice the rounding of
storing the reference in that dtype", for fp16 and bf16, D 64 and 128, odd lengths, Lq != Lk, no mask, causal at
both alignments, key padding, GQA and MQA, rows that see no key (zero gradients, no NaN), a scale of any sign,
B H > 65,535 (gridDim.x); v1 bitwise deterministic; v2 (deterministic=False: dQ by fp32 atomics) compared with the
reference only, its dk and dv (no atomics) bitwise repeatable.
"""

from __future__ import annotations

import re

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

# sm_90a: the Hopper target the series' later kernels use (wgmma); plain sm_90 gives the same registers for
# mma.sync code and is left out to keep CI short.
ARCHES = ["sm_80", "sm_90a"]


@pytest.fixture(scope="module")
def reports():
    tool_or_skip(cuda_build.find_nvcc, "the backward's compile check")
    return {arch: backward_build.nvcc_compile_report(arch) for arch in ARCHES}


def _expected_kernels(dtype):
    """(kernel, version, dtype, head dim, tile, warps) of every kernel the launcher can choose."""
    wanted = {("convert", "", dtype, 0, 0, 0)}
    for variant in backward_build.VARIANTS:
        D = variant.head_dim
        wanted.add(("preprocess", "", dtype, D, 0, 0))
        wanted.add(("dkdv", variant.version, dtype, D, variant.block_m, variant.dkdv_keys // 16))
        if variant.version == "v1":
            wanted.add(("dq", "v1", dtype, D, variant.block_n, 0))
    return wanted


@pytest.mark.parametrize("arch", ARCHES)
def test_every_kernel_compiles_without_spilling(reports, arch):
    found = {(r.kernel, r.version, r.dtype, r.head_dim, r.tile, r.warps) for r in reports[arch]}
    assert found == _expected_kernels("float16") | _expected_kernels("bfloat16")
    assert {r.arch for r in reports[arch]} == {arch}
    for kernel in reports[arch]:
        assert 0 < kernel.registers <= 255 and kernel.shared_bytes <= 227 * 1024, kernel
        assert kernel.spill_stores == 0 and kernel.spill_loads == 0, kernel


def test_the_forwards_helpers_are_shared_not_copied():
    shipped = backward_build.SOURCE.package_source()
    assert "struct Mma<__half>" not in shipped and "// wb:shared-regions" in shipped
    composed = backward_build.package_source()
    assert composed.count("template <> struct Mma<__half>") == 1 and "ldmatrix_x4_trans" in composed
    assert "load_tile_async" in composed and "// wb:shared-regions" not in composed


def test_variants_match_the_source():
    source = backward_build.SOURCE.package_source()
    listed = re.search(r"#define WB_FOR_EACH_BACKWARD_VARIANT\(X\)(.*?)\n\n", source, re.S).group(1)
    found = [backward_build.Variant(f"v{x[0]}", *map(int, x[1:]))
             for x in re.findall(r"X\((\d+), (\d+), (\d+), (\d+)\)", listed)]
    assert found == list(backward_build.VARIANTS)
    assert set(launcher.DEFAULT_VARIANT.values()) <= set(backward_build.VARIANTS)
    assert {v for v, _ in launcher.DEFAULT_VARIANT} == set(launcher.VERSIONS) and launcher.DEFAULT_VERSION == "v1"


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
    with pytest.raises(ValueError, match="v1.*v2"):
        launcher.mma_gradients(torch.zeros(1, 1, 1, 64), None, None, None, None, None, variant="v9", module=object())
    with pytest.raises(ValueError, match="head dims"):
        launcher.mma_gradients(torch.zeros(1, 1, 1, 96), None, None, None, None, None, module=object())
    with pytest.raises(ValueError, match="not compiled"):
        launcher.mma_gradients(torch.zeros(1, 1, 1, 64), None, None, None, None, None, module=object(),
                               variant=backward_build.Variant("v2", 64, 32, 128))


# ---------------------------------------------------------------------------------------------
# GPU: the kernels against the float64 reference


def _inputs(dtype, B, H, Hk, Lq, Lk, D, seed):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    dt = getattr(torch, dtype)
    q, dout = (torch.randn(B, H, Lq, D, device="cuda", dtype=dt, generator=gen) for _ in range(2))
    k, v = (torch.randn(B, Hk, Lk, D, device="cuda", dtype=dt, generator=gen) for _ in range(2))
    return q, k, v, dout


def _assert_within_rule(errors, label):
    """`errors`: what launcher.gradient_errors returns, one entry per version or variant."""
    for variant, by_name in errors.items():
        for name, (mine, theirs, floor) in by_name.items():
            assert mine <= 2 * theirs + floor + 1e-6, \
                f"{variant} {label} {name}: {mine:.3e} > 2 x SDPA {theirs:.3e} + {floor:.1e}"


# (B, H, Hk, Lq, Lk): L = 1, ragged tiles, Lq != Lk both ways, GQA, MQA, several tiles. Every one runs with every
# dtype, head dim and mask (168 cases, both versions in each); the larger LARGE (its float64 reference takes
# seconds on a CPU) with fewer.
SHAPES = [
    (1, 1, 1, 1, 1), (2, 3, 3, 1, 300), (1, 2, 2, 65, 65), (2, 4, 2, 128, 128), (1, 4, 1, 200, 77),
    (2, 2, 2, 77, 200), (1, 8, 2, 300, 129),
]
LARGE = (1, 6, 3, 513, 1000)


def _check_case(dtype, D, causal, padded, shape, variants=launcher.VERSIONS):
    B, H, Hk, Lq, Lk = shape
    q, k, v, dout = _inputs(dtype, B, H, Hk, Lq, Lk, D, seed=Lq + 3 * Lk)
    mask = wb.random_padding_mask(B, Lk, seed=Lk, framework="torch", device="cuda") if padded else None
    errors = launcher.gradient_errors(q, k, v, dout, causal=causal, key_padding_mask=mask, variants=variants)
    _assert_within_rule(errors, f"{dtype} D={D} {shape} causal={causal} padded={padded}")


@needs_gpu
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("D", [64, 128])
@pytest.mark.parametrize("causal", [False, "top_left", "bottom_right"])
@pytest.mark.parametrize("padded", [False, True])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_gradients_meet_the_rule(dtype, D, causal, padded, shape):
    _check_case(dtype, D, causal, padded, shape)


@needs_gpu
@pytest.mark.parametrize("dtype, D", [("float16", 128), ("bfloat16", 64)])
@pytest.mark.parametrize("causal", [False, "top_left", "bottom_right"])
def test_several_tiles_each_way(dtype, D, causal):
    """Lq = 513, Lk = 1000: many query and key tiles, ragged ends, GQA 2, key padding."""
    _check_case(dtype, D, causal, True, LARGE)


@needs_gpu
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_every_compiled_variant(dtype):
    """The configurations that are not a version's default (python -m ...launcher times them too)."""
    for D in (64, 128):
        variants = [x for x in backward_build.VARIANTS if x.head_dim == D]
        _check_case(dtype, D, "bottom_right", True, (2, 4, 2, 190, 260), variants=variants)


@needs_gpu
@pytest.mark.parametrize("version", launcher.VERSIONS)
@pytest.mark.parametrize("D", [64, 128])
def test_rows_that_see_no_key_get_zero_gradients(D, version):
    """Bottom-right with Lq = 200 > Lk = 70 and keys 0-4 padded out: rows 0-134 see no key (LSE = -inf). Their dq
    is exactly 0, nothing is NaN, and the keys only they would see (the padded ones) get dk = dv = 0."""
    q, k, v, dout = _inputs("float16", 1, 4, 2, 200, 70, D, seed=4)
    mask = torch.ones(1, 70, dtype=torch.bool, device="cuda")
    mask[0, :5] = False
    from wb_kernels.stages.mma.launcher import forward

    out, lse = forward(q, k, v, causal="bottom_right", key_padding_mask=mask)
    assert torch.all(lse[:, :, :135] == float("-inf"))
    dq, dk, dv = launcher.mma_gradients(q, k, v, out, lse, dout, causal="bottom_right", key_padding_mask=mask,
                                        variant=version)
    assert all(torch.isfinite(x).all() for x in (dq, dk, dv))
    assert torch.all(dq[:, :, :135] == 0) and torch.all(dk[:, :, :5] == 0) and torch.all(dv[:, :, :5] == 0)
    _assert_within_rule(launcher.gradient_errors(q, k, v, dout, causal="bottom_right", key_padding_mask=mask,
                                                 variants=(version,)), "rows without keys")


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


def _run_twice_more(version):
    q, k, v, dout = _inputs("bfloat16", 2, 8, 2, 300, 300, 128, seed=2)
    from wb_kernels.stages.mma.launcher import forward

    out, lse = forward(q, k, v, causal=True)
    first = launcher.mma_gradients(q, k, v, out, lse, dout, causal=True, variant=version)
    return first, [launcher.mma_gradients(q, k, v, out, lse, dout, causal=True, variant=version) for _ in range(3)]


@needs_gpu
def test_v1_is_deterministic():
    first, again = _run_twice_more("v1")
    assert all(torch.equal(a, b) for run in again for a, b in zip(first, run))


@needs_gpu
def test_v2_dk_dv_are_repeatable_and_dq_close():
    """v2 is deterministic=False: dq's atomic additions come in any order, so only dk and dv (written once each,
    no atomics) must be bitwise equal; dq may differ in its last bits."""
    first, again = _run_twice_more("v2")
    for run in again:
        assert torch.equal(first[1], run[1]) and torch.equal(first[2], run[2])
        torch.testing.assert_close(run[0], first[0], rtol=2e-2, atol=1e-2)
