"""The GEMV kernels (wb_kernels/stages/gemv, issue 48's first step).

On the CPU (CI):
- the compile check with nvcc alone, for sm_90: every kernel the launcher can choose compiles without spills or stack;
  the batch-1 kernels issue all of a trip's weight loads before their first multiply-add (the SASS, via cuobjdump);
  the header's table of shapes is work_split's;
- the NumPy model (work_split): every weight read exactly once by the launch's blocks, warps and lanes, a warp's load
  512 contiguous bytes; the emulated kernels within the float64 bound; the split-K choice and the bytes in flight at
  the model's shapes; the roofline's arithmetic; the products' shapes are the decoder's;
- the launcher's refusals: every bad input refused with a ValueError or TypeError before any launch.

On a CUDA GPU: ``gpu_checks`` (every kernel against float64, bit for bit against the NumPy model for the plain and
residual products) in a subprocess under a time limit each.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

import wb_kernels as wb
from wb_kernels import cuda_build
from wb_kernels.stages.gemv import build, launcher
from wb_kernels.stages.gemv import work_split as ws
from stage_cases import tool_or_skip

REPO = Path(__file__).resolve().parents[1]
HEADER = REPO / "wb_kernels" / "stages" / "gemv" / "gemv.cuh"


# ---------------------------------------------------------------------------------------------- the compile check


@pytest.fixture(scope="module")
def report():
    tool_or_skip(cuda_build.find_nvcc, "the GEMV kernels' compile check")
    return build.nvcc_compile_report()


def test_every_kernel_compiles_for_sm_90_without_spills(report):
    found = {(r.kernel, r.dtype, r.batch_width, r.form) for r in report}
    dtypes = ("float16", "bfloat16")
    assert found == ({("v1", dt, 1, "plain") for dt in dtypes}
                     | {("gemv", dt, width, form) for dt in dtypes for width in ws.SHAPES for form in ws.FORMS})
    for r in report:
        assert r.arch == "sm_90" and r.spill_stores == r.spill_loads == r.stack_bytes == 0, r
        rows, unroll, min_blocks = ws.SHAPES[r.batch_width] if r.kernel == "gemv" else (1, ws.V1_UNROLL, 1)
        # __launch_bounds__(128, MIN_BLOCKS): what the compiler may use so that MIN_BLOCKS blocks fit an SM
        assert r.registers <= min(255, 65536 // (128 * min_blocks)), r
        # the model's register counts (work_split.REGISTERS, its default occupancy) stay near the compiler's
        assert abs(r.registers - ws.REGISTERS[(r.kernel, r.batch_width)]) <= 40, r


def test_the_header_holds_work_splits_table():
    text = HEADER.read_text()
    table = {int(b): tuple(int(v) for v in values) for b, *values in re.findall(
        r"struct GemvShape<(\d+)> \{ static constexpr int ROWS = (\d+), UNROLL = (\d+), MIN_BLOCKS = (\d+); \};", text)}
    table[1] = tuple(int(re.search(rf"#define WB_GEMV_B1_{name} (\d+)", text).group(1))
                     for name in ("ROWS", "UNROLL", "MIN_BLOCKS"))  # batch 1's defaults, which -D flags may change
    assert table == ws.SHAPES and build.VARIANTS["default"] == (*ws.SHAPES[1], 0)
    assert "#define WB_GEMV_PREFETCH 0" in text
    assert all(rows % 2 == 0 for rows, *_ in build.VARIANTS.values())  # the gate/up form pairs a warp's rows
    assert build.variant_flags("rows2_unroll8") == ["-DWB_GEMV_B1_ROWS=2", "-DWB_GEMV_B1_UNROLL=8",
                                                     "-DWB_GEMV_B1_MIN_BLOCKS=2", "-DWB_GEMV_PREFETCH=0"]
    assert f"constexpr int kWarps = {ws.WARPS};" in text and f"constexpr int kV1Unroll = {ws.V1_UNROLL};" in text
    host = (HEADER.parent / "gemv_host.cu").read_text()
    assert "enum Form { kPlain = 0, kNormProduct = 1, kResidualProduct = 2, kNormGateUp = 3 };" in host
    assert list(build.FORM_NAMES.values()) == list(ws.FORMS)


SASS_KERNELS = {"gemv_v1_kernelI6__half": ws.V1_UNROLL, "gemv_v1_kernelI13__nv_bfloat16": ws.V1_UNROLL,
                "gemv_kernelI6__halfLi1ELi0ELi0E": 2 * 4, "gemv_kernelI6__halfLi1ELi0ELi1E": 2 * 4,
                "gemv_kernelI13__nv_bfloat16Li1ELi0ELi0E": 2 * 4}  # kernel -> weight loads in one trip


@pytest.fixture(scope="module")
def sass(report):
    """{kernel: its SASS lines} for SASS_KERNELS, from one run of cuobjdump over the cubin (each function's listing
    starts with its .headerflags line)."""
    tool_or_skip(cuda_build.find_cuobjdump, "the GEMV kernels' machine-code check")
    cubin, _ = cuda_build.compile_cubin(build.ARCH, build.package_source(), build.SOURCE.file_name, build.SOURCE_NAME)
    order = []

    def wanted(name):
        found = [kernel for kernel in SASS_KERNELS if kernel in name]
        order.extend(found)
        return bool(found)

    lines = cuda_build.sass_lines(cubin, wanted, pattern="")
    starts = [i for i, line in enumerate(lines) if line.startswith(".headerflags")]
    assert len(starts) == len(order) == len(SASS_KERNELS), (starts, order)
    return {kernel: lines[start:end] for kernel, start, end in zip(order, starts, starts[1:] + [len(lines)])}


@pytest.mark.parametrize("kernel", SASS_KERNELS)
def test_batch_one_kernels_issue_a_trips_loads_before_using_one(sass, kernel):
    """Without __launch_bounds__' minimum of blocks, ptxas kept the registers low by issuing one or two loads and then
    using them: 1 KB per warp in flight instead of 4 (NOTES.md). The weights' loads (LDG.E.NA.128: read-only, no L1
    allocation) of the first trip must all come before its first FFMA, and nothing spills to local memory."""
    lines = sass[kernel]
    first_ffma = next(i for i, line in enumerate(lines) if line.startswith("FFMA"))
    assert sum(line.startswith("LDG.E.NA.128") for line in lines[:first_ffma]) == SASS_KERNELS[kernel]
    assert not [line for line in lines if line.startswith(("LDL", "STL"))]


def test_the_source_splits_the_work_as_the_model_does():
    """The expressions work_split's warp_rows, lane_columns and emulate copy, as the kernel writes them."""
    source = build.package_source()
    for expression in (
            "const int row0 = tile * ROWS_PER_BLOCK + warp * OUT_ROWS;",
            "const int row = min(row0 + i % OUT_ROWS, p.N_out - 1) + (i / OUT_ROWS) * p.N_out;",
            "const int k_begin = split * p.k_per_split, k_end = min(p.K, k_begin + p.k_per_split);",
            "const int k = k0 + u * kWarpStep + lane * kChunk;",  # a lane's chunks in order of k, in both kernels
            "for (int e = 0; e < 8; ++e) acc[i][b] = fmaf(wf[i][e], xf[e], acc[i][b]);",
            "for (int s = 1; s < p.splits; ++s) total += __ldcg(part + static_cast<size_t>(s) * p.batch * N_w);",
            "for (int offset = 16; offset > 0; offset /= 2) value += __shfl_xor_sync(0xffffffffu, value, offset);",
            "return rsqrtf(sum_of_squares * p.inv_K + p.eps);",
            "const int row = blockIdx.x * kWarps + threadIdx.x / 32;"):
        assert expression in source, expression


def test_the_lesson_regions_are_there():
    regions = build.SOURCE.regions()
    assert {"warp_sum", "load_weights", "gemv_v1", "gemv_shapes", "gemv_epilogue", "split_k_reduction", "gemv_trip",
            "gemv_kernel", "gemv_launch", "gemv_forward"} <= set(regions)
    assert "vector_loads" in regions  # decode_params.cuh's, included rather than copied


# ---------------------------------------------------------------------------------------------- the NumPy model


PRODUCTS = [ws.Product("a", 7, 264), ws.Product("b", 33, 2056, batch=3), ws.Product("c", 20, 520, "norm_gate_up"),
            ws.Product("d", 9, 8, "residual", batch=16), ws.Product("e", 70, 1032, "norm", batch=5)]


@pytest.mark.parametrize("product, version, splits", [
    pytest.param(product, version, splits, id=f"{product.name}-{version}-{splits}") for product in PRODUCTS
    for version, splits in (("gemv", 1), ("gemv", 2), ("gemv", 3), ("v1", 1))
    if version == "gemv" or (product.batch == 1 and product.form == "plain")])
def test_every_weight_is_read_exactly_once(product, version, splits):
    plan = ws.launch(product, version, splits)
    assert (ws.read_counts(product, plan) == 1).all()


def test_a_warps_load_is_512_contiguous_bytes():
    plan = ws.launch(ws.Product("x", 8, 2048), "gemv", 2)
    starts = [ws.lane_columns(plan, 2048, 1, lane) for lane in range(ws.LANES)]
    for step in range(len(starts[0])):
        columns = sorted(s[step] for s in starts)
        assert columns == list(range(columns[0], columns[0] + ws.WARP_STEP, ws.CHUNK))
    assert starts[0][0] == plan.k_per_split == 1024


def test_split_plan_rounds_to_whole_warp_steps():
    assert ws.split_plan(2048, 3) == (768, 3)
    assert ws.split_plan(512, 3) == (256, 2)  # 3 asked, 2 come out
    assert ws.split_plan(8, 4) == (256, 1)
    with pytest.raises(ValueError):
        ws.split_plan(2048, 0)


def _inputs(product: ws.Product, dtype: str, seed: int):
    rng = np.random.default_rng(seed)
    w = ws.round_to(rng.standard_normal((product.weight_rows, product.k)) / np.sqrt(product.k), dtype)
    x = ws.round_to(rng.standard_normal((product.batch, product.k)), dtype)
    g = ws.round_to(1 + 0.1 * rng.standard_normal(product.k), dtype)
    r = ws.round_to(rng.standard_normal((product.batch, product.n_out)), dtype)
    return w, x, {"norm_weight": g, "residual": r}


@pytest.mark.parametrize("form", ws.FORMS)
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("splits", [1, 3])
def test_the_emulated_kernels_are_within_the_float64_bound(form, dtype, splits):
    for seed, (n, k, batch) in enumerate([(9, 776, 1), (5, 2048, 16), (3, 8, 2)]):
        product = ws.Product("t", n, k, form, batch)
        w, x, extra = _inputs(product, dtype, seed)
        used = ws.split_plan(k, splits)[1]
        got = ws.emulate(w, x, dtype=dtype, form=form, splits=used, **extra)
        expected = ws.reference64(w, x, form=form, **extra)
        bound = ws.error_bound(w, x, dtype=dtype, form=form, splits=used, **extra)
        assert got.shape == expected.shape == (batch, n)
        assert (np.abs(got - expected) <= bound).all(), np.max(np.abs(got - expected) / bound)
        # the bound is not vacuous: at the median output, within two ulps of dtype
        assert np.median(bound / np.abs(expected)) < 2 * (2.0 ** -10 if dtype == "float16" else 2.0 ** -7)


def test_the_emulation_sums_in_the_kernels_order():
    """Sums of small integers are exact in float32 whatever the order, so the model gives them exactly. A sum whose
    order matters shows the kernels' order: 2^24 in lane 0's first column absorbs each 1 that lane 0 adds after it
    (2^24 + 1 rounds back to 2^24 in float32), while the other lanes' ones reach the total through the butterfly; with
    two splits the ones of the second split are summed apart, and none is lost."""
    w = np.tile(np.arange(-8, 8, dtype=np.float32), (2, 32))  # (2, 512)
    x = np.ones((1, 512), np.float32)
    assert ws.emulate(w, x, dtype="float16", splits=2).tolist() == [[float(w[0].sum()), float(w[1].sum())]]
    w = np.zeros((1, 512), np.float32)
    w[0, 0], w[0, 256:] = 2.0 ** 24, 1.0
    x = np.ones((1, 512), np.float32)
    one_split = ws._warp_sum(ws._lane_sums(w, x, 0, 512))[0, 0]
    first, second = (ws._warp_sum(ws._lane_sums(w, x, begin, end))[0, 0] for begin, end in ((0, 256), (256, 512)))
    assert (one_split, np.float32(first + second)) == (2.0 ** 24 + 248, 2.0 ** 24 + 256)


def test_rounding_to_bfloat16_is_to_nearest_even():
    values = np.array([1.0, 1.0 + 2 ** -8, 1.0 + 3 * 2 ** -8, 1.0 + 2 ** -9, -3.0e38, 1e-40, np.nan], np.float32)
    rounded = ws.round_to(values, "bfloat16")
    assert rounded[:4].tolist() == [1.0, 1.0, 1.0 + 2 ** -6, 1.0]  # ties to even; 1 + 2^-9 below the half
    assert rounded[:6].tolist() == torch.tensor(values[:6]).to(torch.bfloat16).float().tolist()
    assert np.isnan(rounded[6])


def test_the_products_are_the_decoders():
    from wb_kernels.models.llama_decoder import LLAMA_1B as c

    shapes = {p.name: (p.weight_rows, p.k) for p in ws.MODEL_PRODUCTS}
    assert shapes == {"qkv": ((c.n_heads + 2 * c.n_kv_heads) * c.head_dim, c.dim), "o": (c.dim, c.n_heads * c.head_dim),
                      "gate_up": (2 * c.ffn_dim, c.dim), "down": (c.dim, c.ffn_dim), "lm_head": (c.vocab_size, c.dim)}
    assert c.tie_embeddings  # the LM head reads the embedding: its bytes once per step
    weights = sum(p.weight_bytes for p in ws.MODEL_PRODUCTS[:4]) * c.n_layers + ws.MODEL_PRODUCTS[4].weight_bytes
    norms = (2 * c.n_layers + 1) * c.dim * 2
    assert weights + norms == 2 * c.params()  # every parameter of the step in exactly one product (or a norm)


def test_split_k_at_the_models_shapes_on_an_h100():
    """Batch 1: every product has rows enough for every SM (256 tiles at the least, each warp 4 KB in flight): no
    split. From B = 4 a tile holds 4x more rows and a warp fewer loads in flight: QKV's 192 tiles, o's and down's 128
    (fewer than the 132 SMs) split in two, down in three at B = 16. (NOTES.md's table is this one.)"""
    chosen = {batch: {p.name: ws.choose_splits(p) for p in ws.model_products(batch)} for batch in (1, 4, 8, 16)}
    split = dict(qkv=2, o=2, gate_up=1, down=2, lm_head=1)
    assert chosen == {1: dict(qkv=1, o=1, gate_up=1, down=1, lm_head=1), 4: split, 8: split, 16: {**split, "down": 3}}
    for product in ws.model_products(1):
        plan = ws.launch(product, "gemv", 1)
        registers = ws.REGISTERS[("gemv", 1)]
        assert ws.bytes_in_flight_per_sm(product, plan, registers) >= ws.bytes_needed_per_sm()
        assert ws.waves(plan, registers) <= (1.0 if product.name in ("qkv", "o", "down") else 300)


def test_the_notes_tabulate_the_models_predictions():
    notes = (HEADER.parent / "NOTES.md").read_text()
    names = {"qkv": "QKV", "o": "o", "gate_up": "gate/up", "down": "down", "lm_head": "LM head"}
    for row in ws.predictions(1):
        line = (f"| {names[row['product']]} | {row['weight_mb']:.1f} | {row['ceiling_us']:.2f} | {row['tiles']} | "
                f"{row['in_flight_kb']:.0f} | {row['model_us']:.2f} | {100 * row['of_ceiling']:.0f} % |")
        assert line in notes, line
    for batch in (1, 4, 8, 16):
        rows = ws.predictions(batch)
        line = f"| {batch} | " + " | ".join(f"{100 * row['of_ceiling']:.0f} %" for row in rows) + " |"
        assert line in notes, line
    for batches, splits in (("1", "1 | 1 | 1 | 1 | 1"), ("4, 8", "2 | 2 | 1 | 2 | 1"), ("16", "2 | 2 | 1 | 3 | 1")):
        assert f"| {batches} | {splits} |" in notes
        assert all(" | ".join(str(row["splits"]) for row in ws.predictions(int(b))) == splits for b in batches.split(", "))


def test_the_roofline_arithmetic():
    assert ws.copy_time_us(3e9, 3000) == pytest.approx(1000.0)  # 3 GB at a 3,000 GB/s copy's rate
    lm_head = ws.MODEL_PRODUCTS[4]
    assert ws.roofline_us(lm_head, 2934) == pytest.approx(2 * (128256 * 2048 + 2048 + 128256) / 2934e3, rel=1e-9)
    # the decoder's roofline at batch 1 counts the same weights at the same rate: 2.47 GB, 0.842 ms at 2,934 GB/s
    step = sum(ws.copy_time_us(p.weight_bytes, 2934) for p in ws.MODEL_PRODUCTS[:4]) * 16 \
        + ws.copy_time_us(lm_head.weight_bytes, 2934)
    assert step == pytest.approx(842, abs=1)
    assert ws.bytes_needed_per_sm() == pytest.approx(2934e9 * 900e-9 / 132)


# ---------------------------------------------------------------------------------------------- the launcher


def _cpu(*shape, dtype=torch.float16):
    return torch.zeros(*shape, dtype=dtype)


def _misaligned(n, k):
    return torch.zeros(n * k + 1, dtype=torch.float16)[1:].view(n, k)


REFUSALS = {
    "float32 W": (lambda: launcher.gemv(_cpu(8, 256, dtype=torch.float32), _cpu(256)), TypeError, "float16 or bfloat16"),
    "mixed dtypes": (lambda: launcher.gemv(_cpu(8, 256), _cpu(256, dtype=torch.bfloat16)), TypeError, "W's dtype"),
    "numpy x": (lambda: launcher.gemv(_cpu(8, 256), np.zeros(256, np.float16)), TypeError, "torch tensor"),
    "1-D W": (lambda: launcher.gemv(_cpu(256), _cpu(256)), ValueError, "2-D"),
    "K mismatch": (lambda: launcher.gemv(_cpu(8, 256), _cpu(2, 248)), ValueError, "K = 256"),
    "3-D x": (lambda: launcher.gemv(_cpu(8, 256), _cpu(1, 2, 256)), ValueError, "(B, K)"),
    "batch 17": (lambda: launcher.gemv(_cpu(8, 256), _cpu(17, 256)), ValueError, "1 to 16"),
    "batch 0": (lambda: launcher.gemv(_cpu(8, 256), _cpu(0, 256)), ValueError, "1 to 16"),
    "ragged K": (lambda: launcher.gemv(_cpu(8, 260), _cpu(260)), ValueError, "multiple of 8"),
    "transposed W": (lambda: launcher.gemv(_cpu(256, 8).t(), _cpu(256)), ValueError, "contiguous"),
    "misaligned W": (lambda: launcher.gemv(_misaligned(8, 256), _cpu(256)), ValueError, "16-byte aligned"),
    "odd gate/up": (lambda: launcher.rmsnorm_gate_up_silu(_cpu(7, 256), _cpu(256), _cpu(256)), ValueError, "even"),
    "no norm weight": (lambda: launcher.rmsnorm_gemv(_cpu(8, 256), _cpu(256), None), ValueError, "RMSNorm weight"),
    "norm weight shape": (lambda: launcher.rmsnorm_gemv(_cpu(8, 256), _cpu(256), _cpu(8)), ValueError, "(256,)"),
    "eps": (lambda: launcher.rmsnorm_gemv(_cpu(8, 256), _cpu(256), _cpu(256), eps=0.0), ValueError, "eps"),
    "residual shape": (lambda: launcher.gemv_residual(_cpu(8, 256), _cpu(2, 256), _cpu(8)), ValueError, "(2, 8)"),
    "residual dtype": (lambda: launcher.gemv_residual(_cpu(8, 256), _cpu(256), _cpu(8, dtype=torch.bfloat16)),
                       TypeError, "W's dtype"),
    "out shape": (lambda: launcher.gemv_residual(_cpu(8, 256), _cpu(256), _cpu(8), out=_cpu(9)), ValueError, "out"),
    "out is x": (lambda: (lambda x: launcher.gemv_residual(_cpu(256, 256), x, _cpu(256), out=x))(_cpu(256)),
                 ValueError, "shares memory"),
    "splits 0": (lambda: launcher.gemv(_cpu(8, 256), _cpu(256), splits=0), ValueError, "positive int"),
    "splits True": (lambda: launcher.gemv(_cpu(8, 256), _cpu(256), splits=True), ValueError, "positive int"),
    "splits that round": (lambda: launcher.gemv(_cpu(8, 512), _cpu(512), splits=3), ValueError, "ask for 2"),
    "v1 batch 2": (lambda: launcher.gemv_v1(_cpu(8, 256), _cpu(2, 256)), ValueError, "batch 1 only"),
    "unknown form": (lambda: launcher.validate(_cpu(8, 256), _cpu(256), form="gelu"), ValueError, "not one of"),
    "residual for plain": (lambda: launcher.validate(_cpu(8, 256), _cpu(256), residual=_cpu(8)), ValueError,
                           "takes no residual"),
}


@pytest.fixture
def no_build(monkeypatch):
    """A refusal must come before the extension is even looked up."""
    from wb_kernels.stages.gemv import build as gemv_build

    def refuse():
        raise AssertionError("the extension was reached: the input was not refused first")

    monkeypatch.setattr(gemv_build, "extension", refuse)


@pytest.mark.parametrize("name", REFUSALS)
def test_bad_input_is_refused_before_any_launch(name, no_build):
    call, error, words = REFUSALS[name]
    with pytest.raises(error, match=re.escape(words)):
        call()


@pytest.mark.parametrize("call", [lambda: launcher.gemv(_cpu(8, 256), _cpu(3, 256), splits=1),
                                  lambda: launcher.gemv_v1(_cpu(8, 256), _cpu(256)),
                                  lambda: launcher.rmsnorm_gate_up_silu(_cpu(8, 256), _cpu(256), _cpu(256)),
                                  lambda: launcher.gemv_residual(_cpu(8, 256), _cpu(256), _cpu(8))])
def test_good_input_without_a_gpu_says_so(call, no_build):
    with pytest.raises(launcher.GemvNeedsGpu, match="CUDA GPU"):
        call()


def test_the_folder_is_not_an_attention_stage():
    import wb_kernels.stages.gemv as gemv

    assert not hasattr(gemv, "STAGE") and "gemv" not in wb.available_stages()


# ---------------------------------------------------------------------------------------------- on a GPU


def test_a_failed_gpu_check_names_its_last_launch(monkeypatch, capsys):
    from wb_kernels.stages.gemv import gpu_checks

    def trapped():
        gpu_checks._current["case"] = "gemv plain N=2048 K=8192 B=1 float16 splits=8"
        raise RuntimeError("CUDA error: an illegal memory access was encountered\nCUDA kernel errors might be "
                           "reported later")

    monkeypatch.setattr(gpu_checks, "CHECKS", {"fake": trapped, "fine": lambda: "all good"})
    assert gpu_checks.main(["fake", "fine"]) == 1
    assert gpu_checks.main(["nonsense"]) == 1
    lines = capsys.readouterr().out.splitlines()
    assert lines == ["CHECK fake FAILED (last launch: gemv plain N=2048 K=8192 B=1 float16 splits=8): RuntimeError: "
                     "CUDA error: an illegal memory access was encountered CUDA kernel errors might be reported later",
                     "CHECK fine ok (0 s): all good"]


class ModelExtension:
    """A stand-in for the built extension on the CPU: work_split's NumPy model behind the extension's two entry points
    (what the launcher passes them is checked as the host code checks it). `wrong`: ulps to move the first output by."""

    def __init__(self, wrong: int = 0):
        self.wrong, self.calls = wrong, []

    def _result(self, y, like, out=None):
        result = torch.from_numpy(np.ascontiguousarray(y)).to(like.dtype)
        if self.wrong:
            result.view(torch.int16).view(-1)[0] += self.wrong  # the next values up (or down, for a negative one)
        if out is None:
            return result
        out.copy_(result.reshape(out.shape))
        return out

    def gemv_forward(self, w, x, norm_weight, residual, form, eps, splits, k_per_split, partial, counters, out):
        self.calls.append(("gemv", ws.FORMS[form], x.shape[0], splits))
        assert ws.split_plan(w.shape[1], splits) == (k_per_split, splits)
        assert x.dim() == 2 and x.is_contiguous() and (splits == 1 or counters.dtype == torch.int32)
        dtype = str(w.dtype).replace("torch.", "")
        host = lambda t: None if t is None else t.float().numpy()  # noqa: E731
        y = ws.emulate(host(w), host(x), dtype=dtype, form=ws.FORMS[form], splits=splits,
                       norm_weight=host(norm_weight), residual=host(residual), eps=eps)
        return self._result(y, w, out)

    def gemv_v1(self, w, x):
        self.calls.append(("v1",))
        y = ws.emulate(w.float().numpy(), x.float().numpy(), dtype=str(w.dtype).replace("torch.", ""))
        return self._result(y, w)


@pytest.fixture
def on_the_model(monkeypatch):
    """The launcher, gpu_checks and bench run on CPU tensors with ModelExtension as the extension."""
    from wb_kernels.stages.gemv import build as gemv_build
    from wb_kernels.stages.gemv import gpu_checks

    extension = ModelExtension()
    monkeypatch.setattr(gemv_build, "extension", lambda: extension)
    monkeypatch.setattr(launcher, "_require_gpu", lambda w: None)
    monkeypatch.setattr(launcher, "sm_count", lambda index: 132)
    monkeypatch.setattr(gpu_checks, "DEVICE", "cpu")
    launcher.auto_splits.cache_clear()
    yield extension
    launcher.auto_splits.cache_clear()


def test_the_checks_pass_a_kernel_that_computes_the_models_sums(on_the_model):
    from wb_kernels.stages.gemv import gpu_checks

    line = gpu_checks.report_line("quick")
    assert line.startswith("CHECK quick ok") and "25 of 25 equal to the NumPy model" in line, line
    assert gpu_checks.report_line("in_place").startswith("CHECK in_place ok")
    assert ("gemv", "norm_gate_up", 16, 3) in on_the_model.calls and ("v1",) in on_the_model.calls
    result = gpu_checks.check_case("residual", 130, 2056, 3, "bfloat16", splits=None, squeeze=False)
    assert result == {"error_over_bound": result["error_over_bound"], "model": "equal"}
    # the launcher's split choice for a batch-16 down projection, as the check assumed it
    gpu_checks.check_case("plain", 2048, 8192, 16, "float16", bits="skip")
    assert on_the_model.calls[-1] == ("gemv", "plain", 16, 3)


def test_the_checks_fail_a_kernel_one_ulp_off(on_the_model):
    from wb_kernels.stages.gemv import gpu_checks

    on_the_model.wrong = 1  # one ulp: past the float64 bound, or (at the top of a binade) not the model's bits
    for seed in range(4):
        with pytest.raises(AssertionError, match=r"bound = |not the NumPy model's bits"):
            gpu_checks.check_case("plain", 33, 2056, 2, "float16", splits=2, seed=seed)
    on_the_model.wrong = 3  # past the bound: caught before the bits are compared, and where no model runs
    with pytest.raises(AssertionError, match="bound"):
        gpu_checks.check_case("norm", 64, 512, 1, "bfloat16", splits=1, bits="skip")


def test_the_benchmarks_rows_on_the_model(on_the_model):
    from wb_kernels.stages.gemv import bench

    product = ws.Product("o", 24, 512, "residual", batch=2)
    rows = bench.measure_product(product, "float16", repeats=2, splits_sweep=(1, 2), large_gbps=3000.0,
                                 variants={"rows4_unroll2": on_the_model})
    names = [row["contender"] for row in rows]
    assert names == ["copy", "gemv splits=1", "gemv splits=2", "gemv auto", "cublas", "fused", "torch unfused"]
    batch_one = bench.measure_product(ws.Product("o", 24, 512, "residual"), "float16", repeats=2, splits_sweep=(), large_gbps=3e3,
                                      variants={"rows4_unroll2": on_the_model})
    assert [row["contender"] for row in batch_one] == ["copy", "v1", "gemv auto", "variant rows4_unroll2", "cublas",
                                                       "fused", "torch unfused"]
    assert all(row["error_over_bound"] <= 1 for row in rows if row["contender"] in ("gemv auto", "fused"))
    assert all("us" in row and "of_weight_copy" in row for row in rows[1:])
    assert rows[5]["form"] == "residual" and rows[1]["form"] == "plain" and "predicted_us" in rows[5]


def test_the_benchmarks_file_on_the_model(on_the_model, monkeypatch, tmp_path):
    import json

    from wb_kernels.stages.gemv import bench

    monkeypatch.setattr(ws, "MODEL_PRODUCTS", (ws.Product("o", 16, 256, "residual"), ws.Product("up", 8, 512, "norm")))
    monkeypatch.setattr(bench, "large_copy_gbps", lambda repeats: 3000.0)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(bench, "environment", lambda: {"gpu": "stand-in"})
    path = tmp_path / "bench.json"
    assert bench.main(["--batches", "1,3", "--quick", "--json", str(path)]) == 0
    results = json.loads(path.read_text())
    assert results["complete"] and results["command"].endswith("--quick --json bench.json")
    assert {(row["product"], row["batch"]) for row in results["rows"]} == {("o", 1), ("o", 3), ("up", 1), ("up", 3)}
    assert all(row["error_over_bound"] <= 1 for row in results["rows"] if "error_over_bound" in row
               and not row["contender"].startswith(("cublas", "torch")))


def test_the_benchmark_refuses_to_run_without_a_gpu(capsys):
    from wb_kernels.stages.gemv import bench

    if torch.cuda.is_available():
        pytest.skip("a GPU is here: the benchmark would run")
    assert bench.main(["--batches", "1"]) == 2
    assert "needs a CUDA GPU" in capsys.readouterr().err


on_cuda = pytest.mark.skipif(not torch.cuda.is_available() or torch.version.cuda is None,
                             reason="the GEMV kernels run on a CUDA GPU with a CUDA build of torch")
GPU_CHECK_SECONDS = {"v1": 240, "v2": 300, "v3": 300, "fused": 400, "in_place": 120}


@on_cuda
@pytest.mark.parametrize("name", list(GPU_CHECK_SECONDS))
def test_on_the_gpu(name):
    """Each check in a process of its own under a time limit (the first builds the extension: a minute or two)."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])))
    try:
        done = subprocess.run([sys.executable, "-m", "wb_kernels.stages.gemv.gpu_checks", name], cwd=REPO, env=env,
                              capture_output=True, text=True, timeout=GPU_CHECK_SECONDS[name] + 300)
    except subprocess.TimeoutExpired as hung:
        pytest.fail(f"gpu check {name!r} ran past its limit; its output: {hung.stdout!r} {hung.stderr!r}")
    assert done.returncode == 0 and f"CHECK {name} ok" in done.stdout, done.stdout + done.stderr[-3000:]
