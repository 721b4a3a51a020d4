"""The tensor-core stage (lesson 05): the NumPy fragment model on the CPU, the WMMA kernel on a GPU.

CPU tests hold the fragment model to the float64 reference with the tolerance rule, and test the
pieces of the build machinery that need no GPU. GPU tests (skipped on the simulator) check the
kernel over shapes, dtypes, masks and launch variants against the reference with the same rule,
check that the model and the kernel agree to within rounding, and check the build cache and the
readable compile errors.

The compile check at the end needs no GPU either: nvcc compiles the kernel for sm_80 and sm_90, which is
how CI catches a broken ``flash_wmma.cu``. In CI (the environment variable CI is set) a missing nvcc or
cuobjdump FAILS those tests, so the check cannot silently disappear; elsewhere (a laptop without the CUDA
compiler) they are skipped with the reason.
"""

from __future__ import annotations

import numpy as np
import pytest

import wb_kernels as wb
from wb_kernels import cuda_build
from wb_kernels.stages.wmma import build as wmma_build
from wb_kernels.stages.wmma.fragment_model import fragment_model, round_to, ulp
from wb_kernels.stages.wmma.launcher import DEFAULT_VARIANT
from wb_kernels.lesson_sync import module_regions
from stage_cases import (CUDA_GPU_SHAPES, check_bottom_right_rows_without_keys, check_cuda_gqa_case, check_cuda_stage,
                         check_rows_without_keys, cuda_gqa_parameters, tool_or_skip)

torch = pytest.importorskip("torch")

needs_gpu = pytest.mark.skipif(
    wb.BACKEND.is_simulator,
    reason="the WMMA kernel needs a CUDA GPU (sm_80+) and a CUDA build of torch; this machine runs the simulator")


def as_torch(array, dtype):
    return torch.from_numpy(np.ascontiguousarray(array)).to(getattr(torch, dtype))


# ---------------------------------------------------------------------------------------------
# CPU: the fragment model and the build functions


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("D", [64, 128])
@pytest.mark.parametrize("Lq, Lk, causal, padded", [
    (1, 1, False, False), (1, 130, True, False), (65, 65, True, False), (100, 77, False, True),
    (77, 200, True, True), (128, 192, False, False),
])
def test_model_meets_the_tolerance_rule(dtype, D, Lq, Lk, causal, padded):
    q, k, v = wb.random_qkv(2, 1, Lq, D, Lk=Lk, dtype=dtype, framework="torch", seed=Lq * 7 + Lk)
    mask = wb.random_padding_mask(2, Lk, seed=Lk) if padded else None
    out, lse = fragment_model(q, k, v, dtype=dtype, causal=causal, key_padding_mask=mask)
    wb.check(f"model {dtype} D={D}", as_torch(out, dtype), q, k, v, lse=torch.from_numpy(lse),
             causal=causal, key_padding_mask=mask)


def test_model_rows_without_keys_give_zero_and_minus_inf():
    q, k, v = wb.random_qkv(1, 1, 70, 64, Lk=70, dtype="float16", seed=3)
    mask = np.ones((1, 70), dtype=bool)
    mask[0, :5] = False  # causal: query rows 0-4 see only keys 0-4, all padded out
    out, lse = fragment_model(q, k, v, dtype="float16", causal=True, key_padding_mask=mask)
    assert np.all(out[0, 0, :5] == 0) and np.all(lse[0, 0, :5] == -np.inf)
    assert np.isfinite(out).all() and np.isfinite(lse[0, 0, 5:]).all()
    ref_out, _ = wb.reference(q, k, v, causal=True, key_padding_mask=mask)
    assert np.abs(out[0, 0, 5:] - ref_out[0, 0, 5:]).max() < 5e-3


def test_bfloat16_rounding_matches_torch():
    rng = np.random.default_rng(0)
    x = np.concatenate([rng.standard_normal(10000).astype(np.float32) * 10.0 ** rng.integers(-8, 8, 10000),
                        # exact ties between two bf16 numbers: round to the even one
                        np.array([1 + 2 ** -8, 1 + 3 * 2 ** -8, -(1 + 2 ** -8), 0.0, -0.0], dtype=np.float32)])
    expected = torch.from_numpy(x).to(torch.bfloat16).float().numpy()
    np.testing.assert_array_equal(round_to(x, "bfloat16"), expected)
    with np.errstate(over="ignore"):  # values beyond float16's range become inf in both
        np.testing.assert_array_equal(round_to(x, "float16"), x.astype(np.float16).astype(np.float32))


def test_ulp_is_the_spacing_of_the_format():
    assert ulp(1.0, "float16") == 2 ** -10 and ulp(1.0, "bfloat16") == 2 ** -7
    assert ulp(3.0, "float16") == 2 ** -9 and ulp(0.0, "float16") == 2 ** -24


def test_rounding_p_is_what_costs_accuracy():
    """The model's switches move the error the way the lesson says: keeping P in fp32 is closer to the
    reference than rounding it to bf16, and fp16 accumulation of O is worse than fp32."""
    q, k, v = wb.random_qkv(1, 2, 256, 64, dtype="float32", seed=11)
    ref, _ = wb.reference(q, k, v)

    def err(**switches):
        o, _ = fragment_model(q, k, v, dtype="bfloat16", **switches)
        return np.abs(o - ref).mean()

    assert err(round_p=False) < err(round_p=True) < err(accumulate="bfloat16")


def test_region_cells_record_edits_and_reset():
    regions = module_regions(wmma_build.SOURCE_PATH)
    assert {"async_tile_copy", "online_softmax_rows", "kernel_setup", "kernel_epilogue", "torch_forward"} <= set(regions)
    cell = [f"# region: online_softmax_rows ({wmma_build.SOURCE_NAME})\n"] + [
        line + "\n" for line in regions["online_softmax_rows"].splitlines()]
    code = "".join(cuda_build._region_cell_transform(cell))
    try:
        exec(compile(code, "<cell>", "exec"), {})
        assert wmma_build.edited_regions() == [] and wmma_build.current_source() == wmma_build.package_source()
        edited = regions["online_softmax_rows"].replace("tile_sum += p[t];", "tile_sum += 2.0f * p[t];")
        assert wmma_build.set_region("online_softmax_rows", edited, verbose=False)
        assert wmma_build.edited_regions() == ["online_softmax_rows"]
        assert "tile_sum += 2.0f * p[t];" in wmma_build.current_source()
        assert module_regions(wmma_build.SOURCE_PATH)["online_softmax_rows"] == regions["online_softmax_rows"]
    finally:
        wmma_build.reset_regions()
    assert wmma_build.current_source() == wmma_build.package_source()
    assert cuda_build._region_cell_transform(["x = 1\n"]) == ["x = 1\n"]


def test_extension_name_follows_source_and_flags():
    source = wmma_build.package_source()
    flags = cuda_build.build_flags(gencode=["-gencode", "arch=compute_90,code=sm_90"])
    name = cuda_build.extension_name(source, flags, "flash_wmma")
    assert name == cuda_build.extension_name(source, list(flags), "flash_wmma")
    assert name != cuda_build.extension_name(source + "\n// edited\n", flags, "flash_wmma")
    assert name != cuda_build.extension_name(source, flags[:-1] + ["arch=compute_80,code=sm_80"], "flash_wmma")


def test_compiler_output_is_trimmed_to_the_errors():
    log = "\n".join(
        ["[1/3] c++ -MMD -MF main.o.d ... (a long command line)"] * 30
        + ['flash_wmma.cu(120): error: identifier "tile_summ" is undefined',
           "              tile_summ += p[t];", "              ^", "",
           "1 error detected in the compilation of \"flash_wmma.cu\".",
           "ninja: build stopped: subcommand failed."])
    trimmed = cuda_build._trim_compiler_output(log)
    assert trimmed.splitlines()[0] == 'flash_wmma.cu(120): error: identifier "tile_summ" is undefined'
    assert "tile_summ += p[t];" in trimmed and "c++ -MMD" not in trimmed and len(trimmed.splitlines()) <= 5


@pytest.mark.parametrize("dtype, D, device, error, words", [
    ("float16", 64, "cpu", ValueError, "CUDA"),
    # on the CPU, the GPU is what to fix first: the right dtype or head dim would not help there
    ("float32", 64, "cpu", ValueError, "CUDA"),
    ("float16", 96, "cpu", ValueError, "CUDA"),
    pytest.param("float32", 64, "cuda", TypeError, "float16, bfloat16", marks=needs_gpu),
    pytest.param("float16", 96, "cuda", ValueError, "[64, 128]", marks=needs_gpu),
])
def test_clear_errors_for_what_the_kernel_cannot_take(dtype, D, device, error, words):
    q, k, v = wb.random_qkv(1, 1, 8, D, dtype=dtype, framework="torch", device=device)
    with pytest.raises(error, match=None) as raised:
        wb.attention(q, k, v, stage="wmma")
    assert words in str(raised.value)


def test_stage_is_registered():
    stage = wb.get_stage("wmma")
    assert (stage.order, stage.lesson, stage.needs_gpu, stage.linear_memory) == (5, "05_wmma", True, True)
    assert stage.dtypes == ("float16", "bfloat16") and stage.head_dims == (64, 128)


# ---------------------------------------------------------------------------------------------
# GPU: the kernel


@needs_gpu
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("D", [64, 128])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("padded", [False, True])
@pytest.mark.parametrize("shape", CUDA_GPU_SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_kernel_meets_the_tolerance_rule(dtype, D, causal, padded, shape):
    check_cuda_stage("wmma", dtype, D, causal, padded, shape)


@needs_gpu
@pytest.mark.parametrize("variant", wmma_build.VARIANTS, ids=lambda v: f"warps{v[0]}-qregs{int(v[1])}-rows{16 * v[2]}")
@pytest.mark.parametrize("D", [64, 128])
def test_every_launch_variant(variant, D):
    from wb_kernels.stages.wmma import launcher as stage

    for dtype in ("float16", "bfloat16"):
        q, k, v = wb.random_qkv(2, 2, 300, D, Lk=333, dtype=dtype, framework="torch", device="cuda", seed=5)
        for causal in (False, True):
            out, lse = stage.forward(q, k, v, causal=causal, variant=variant)
            wb.check(f"wmma {variant} {dtype} D={D}", out, q, k, v, lse=lse, causal=causal)


@needs_gpu
@cuda_gqa_parameters
def test_kernel_gqa_and_causal_alignments(dtype, D, causal, padded, case):
    """K/V heads read in place by H // Hk query heads (kv_group), and the causal mask at either corner
    (causal_offset): tile skipping, warp skipping and the per-score test all move with the offset."""
    check_cuda_gqa_case("wmma", dtype, D, causal, padded, case)


@needs_gpu
@pytest.mark.parametrize("variant", wmma_build.VARIANTS, ids=lambda v: f"warps{v[0]}-qregs{int(v[1])}-rows{16 * v[2]}")
@pytest.mark.parametrize("D", [64, 128])
def test_every_launch_variant_gqa_bottom_right(variant, D):
    """Each variant's block and warp sizes place the bottom-right diagonal differently: Lq < Lk and Lq > Lk."""
    from wb_kernels.stages.wmma import launcher as stage

    for Lq, Lk in ((300, 333), (333, 150)):
        q, k, v = wb.random_qkv(2, 4, Lq, D, Lk=Lk, dtype="float16", framework="torch", device="cuda", seed=Lq)
        k, v = k[:, :2].contiguous(), v[:, :2].contiguous()
        out, lse = stage.forward(q, k, v, causal="bottom_right", variant=variant)
        wb.check(f"wmma {variant} D={D} Lq={Lq} Lk={Lk} GQA bottom-right", out, q, k, v, lse=lse, causal="bottom_right")


@needs_gpu
def test_kernel_rows_without_keys_give_zero_and_minus_inf():
    check_rows_without_keys("wmma")


@needs_gpu
def test_kernel_bottom_right_rows_without_keys_give_zero_and_minus_inf():
    check_bottom_right_rows_without_keys("wmma")


@needs_gpu
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("D", [64, 128])
def test_model_and_kernel_agree(dtype, D):
    """The model is honest: it predicts the kernel's output bit for bit for almost every element, and
    elsewhere to within one unit in the last place (ulp) of the output dtype, counted at |out| but at
    least at 0.5 (a P element whose rounding flips moves an output by up to ulp(p) |v| / l, however
    small that output is). exp2 approximations and fp32 summation order are what flip roundings."""
    q, k, v = wb.random_qkv(2, 4, 300, D, Lk=500, dtype=dtype, framework="torch", device="cuda", seed=17)
    mask = wb.random_padding_mask(2, 500, seed=2, framework="torch", device="cuda")
    for causal in (False, True):
        out, lse = wb.attention(q, k, v, stage="wmma", causal=causal, key_padding_mask=mask, return_lse=True)
        model_out, model_lse = fragment_model(q, k, v, dtype=dtype, causal=causal, key_padding_mask=mask)
        reference_out, _ = wb.reference(q, k, v, causal=causal, key_padding_mask=mask)
        kernel_out = out.float().cpu().numpy()
        diff = np.abs(kernel_out - model_out)
        units = diff / ulp(np.maximum(np.abs(model_out), 0.5), dtype)
        identical = float(np.mean(diff == 0))
        print(f"{dtype} D={D} causal={causal}: kernel vs model max {diff.max():.1e} ({units.max():.2f} ulp), "
              f"{identical:.2%} identical; kernel vs reference max {np.abs(kernel_out - reference_out).max():.1e}; "
              f"lse max diff {np.abs(lse.cpu().numpy() - model_lse)[np.isfinite(model_lse)].max():.1e}")
        assert units.max() <= 1.0
        assert identical >= 0.95
        np.testing.assert_allclose(lse.cpu().numpy(), model_lse, rtol=0, atol=1e-4)


@needs_gpu
def test_build_is_cached_and_compile_errors_are_readable():
    import time

    t0 = time.perf_counter()
    first = wmma_build.build(wmma_build.package_source())
    assert wmma_build.build(wmma_build.package_source()) is first
    assert time.perf_counter() - t0 < 600
    broken = wmma_build.package_source().replace("tile_sum += p[t];", "tile_summ += p[t];")
    with pytest.raises(cuda_build.CudaBuildError) as raised:
        wmma_build.build(broken)
    message = str(raised.value)
    assert "tile_summ" in message and "error" in message and len(message.splitlines()) < 40
    assert "flash_wmma.cu(" in message  # points at the .cu's own line numbers


# ---------------------------------------------------------------------------------------------
# The lesson's figures and numbers (wb_kernels.stages.wmma.slider)


def test_rounding_errors_rank_the_choices():
    from wb_kernels.stages.wmma import slider as tc

    errors = tc.rounding_errors(128)
    for dtype, by_choice in errors.items():
        kernel, p32, o16 = (by_choice[label] for label, _ in tc.ROUNDING_CHOICES)
        assert p32 * 100 < kernel < o16, (dtype, by_choice)
        assert kernel < 1.5 * by_choice[tc.STORAGE]
    assert errors["bfloat16"][tc.STORAGE] > 4 * errors["float16"][tc.STORAGE]


def test_shared_memory_layout_adds_up_and_fits():
    from wb_kernels.stages.wmma import slider as tc

    for D in (64, 128):
        for variant in wmma_build.VARIANTS:
            parts = tc.shared_memory_parts(D, *variant)
            total = wmma_build.shared_memory_bytes(D, *variant)
            assert sum(parts.values()) == total <= 227 * 1024
            assert tc.blocks_per_sm(total) >= 1
    assert tc.blocks_per_sm(wmma_build.shared_memory_bytes(128, 4, False, 1)) == 2
    traffic = tc.traffic_per_tile(128)
    assert traffic["total bytes"] == 2 * 64 * 128 * 2 + 2 * 16 * 64 * 4 + 2 * 16 * 64 * 2
    assert traffic["tensor-core FLOPs"] == 4 * 16 * 64 * 128


def test_figures_draw():
    from matplotlib.figure import Figure

    from wb_kernels.stages.wmma import slider as tc

    for figure in (tc.draw_rounding(64), tc.draw_shared_memory(64), tc.draw_double_buffering()):
        assert isinstance(figure, Figure)


def test_committed_comparison_has_every_baseline():
    """The lesson's table: every WMMA row of the committed benchmark has FLASH and cuDNN from the same run."""
    from wb_kernels import bench
    from wb_kernels.stages.wmma import slider as tc

    rows = tc.committed_comparison(bench.load_results(bench.committed_results()))
    assert {r["dtype"] for r in rows} == {"float16", "bfloat16"} and {r["causal"] for r in rows} == {False, True}
    assert all(r["sdpa_flash"] and r["sdpa"] and r["wmma"] for r in rows)
    assert any(r["flash_fp32"] for r in rows)


# ---------------------------------------------------------------------------------------------
# The compile check without a GPU (nvcc alone; CI runs it)

ARCHES = ["sm_80", "sm_90"]


_tool_or_skip = tool_or_skip


@pytest.fixture(scope="module")
def reports():
    _tool_or_skip(cuda_build.find_nvcc)
    return {arch: wmma_build.nvcc_compile_report(arch, source=wmma_build.package_source()) for arch in ARCHES}


@pytest.mark.parametrize("arch", ARCHES)
def test_every_variant_compiles(reports, arch):
    report = reports[arch]
    expected = {(dtype, D, *variant) for dtype in ("float16", "bfloat16") for D in (64, 128)
                for variant in wmma_build.VARIANTS}
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
        hmma = wmma_build.sass(arch, dtype=dtype, head_dim=D, num_warps=num_warps, q_in_registers=q_in_registers,
                               row_frags=row_frags, source=wmma_build.package_source())
        # per 64-key tile and 16 rows a warp does D/16 x 4 WMMAs for S and 4 x D/16 for PV; each is
        # 2 HMMA.16816 (the loops are unrolled, so each appears once in the machine code)
        assert len(hmma) == row_frags * 2 * 2 * (D // 16) * 4, (D, len(hmma))
        assert all(line.startswith(mnemonic) for line in hmma), hmma[:3]


def test_a_broken_source_fails_with_the_compilers_message():
    _tool_or_skip(cuda_build.find_nvcc)
    broken = wmma_build.package_source().replace("tile_sum += p[t];", "tile_summ += p[t];")
    with pytest.raises(cuda_build.CudaBuildError) as raised:
        wmma_build.nvcc_compile_report("sm_90", source=broken)
    message = str(raised.value)
    assert 'identifier "tile_summ" is undefined' in message and len(message.splitlines()) < 20


# ---------------------------------------------------------------------------------------------
# The lesson's first step: one 16 x 16 x 16 product by one warp (wmma_tile.cu)

def test_tile_kernel_compiles_to_two_hmma():
    from wb_kernels.stages.wmma import tile

    _tool_or_skip(cuda_build.find_nvcc)
    _tool_or_skip(cuda_build.find_cuobjdump)
    hmma = tile.hmma_instructions()
    assert [line.split()[0] for line in hmma] == ["HMMA.16816.F32"] * 2, hmma


@needs_gpu
def test_tile_product_matches_numpy():
    from wb_kernels.stages.wmma import tile

    a, b = (torch.randn(16, 16, device="cuda").half() for _ in range(2))
    c = tile.product(a, b)
    assert c.dtype == torch.float32 and c.shape == (16, 16)
    torch.testing.assert_close(c.double(), a.double() @ b.double(), rtol=1e-5, atol=1e-4)


def test_double_buffering_picture():
    from wb_kernels.stages.wmma import slider

    fig = slider.draw_double_buffering(tiles=4, copy=1.0, compute=1.4)
    one, two = (ax.get_title() for ax in fig.axes)
    assert "100%" in one and "69%" in two  # (4 x 1.4 + 1.0) / (4 x 2.4): only the first load is not hidden


# ---------------------------------------------------------------------------------------------
# The WMMA model on the CPU (wmma_host.cuh): what the tile puzzle is graded with on a laptop


def test_host_model_computes_the_package_tile_product():
    from wb_kernels.stages.wmma import tile

    _tool_or_skip(cuda_build.find_nvcc)
    rng = np.random.default_rng(1)
    a, b = (rng.standard_normal((16, 16)).astype(np.float16) for _ in range(2))
    c = tile.host_product(a, b)
    np.testing.assert_allclose(c, a.astype(np.float64) @ b.astype(np.float64), rtol=1e-5, atol=1e-4)


def test_host_model_catches_what_only_a_gpu_run_would_show():
    from wb_kernels.stages.wmma import exercises, tile

    _tool_or_skip(cuda_build.find_nvcc)
    a, b = exercises._puzzle_inputs()
    unzeroed = tile.host_product(a, b, exercises.tile_kernel_variant(zero=False))
    assert np.isnan(unzeroed).all()  # a fragment holds garbage (NaN in the model) until it is filled
    with pytest.raises(tile.TileModelError, match="outside"):
        tile.host_product(a, b, exercises.tile_kernel_variant(ldm_b=32))
    with pytest.raises(tile.TileModelError, match="lanes"):
        tile.host_product(a, b, exercises.tile_kernel_variant(lane_zero_only=True))
    transposed = tile.host_product(a, b, exercises.tile_kernel_variant(store="mem_col_major"))
    np.testing.assert_allclose(transposed, (a.astype(np.float64) @ b.astype(np.float64).T).T, rtol=1e-5, atol=1e-4)


@needs_gpu
def test_tile_puzzle_solution_on_the_tensor_cores_agrees_with_the_host_model():
    from wb_kernels.stages.wmma import exercises, solutions, tile

    a, b = exercises._puzzle_inputs()
    on_gpu = tile.product(*(torch.from_numpy(x).cuda() for x in (a, b)),
                          source=tile.source_with(solutions.tile_kernel)).cpu().numpy()
    np.testing.assert_allclose(on_gpu, tile.host_product(a, b, solutions.tile_kernel), rtol=1e-5, atol=1e-4)
