"""Rung hopper, the backward (issue 47): FlashAttention-3's backward on Hopper's machinery, before its H100 run.

On the CPU (CI):
- the compile check with nvcc alone, for sm_90a (``build.nvcc_compile_report(part="backward")``): the preprocessing,
  the main kernel and the dQ conversion compile for fp16/bf16 and D 64/128 with the watchdog, without spills, with
  no wgmma serialized; the main kernel's SASS holds the products the design names (S^T, dP^T by SS ``HGMMA``; dV, dK
  by RS ``HGMMA`` with B transposed; dQ by SS ``HGMMA`` with both operands transposed), ``UTMALDG`` (Q, dO, K, V by
  TMA), ``UBLKCP`` (LSE and D by bulk copy), setmaxnreg, the float32 atomics and the semaphore's release;
- the NumPy model of the backward (``backward_model``: the kernel's tile schedule, masks, skipped tiles, GQA sums,
  16-bit roundings) against the float64 reference gradients with wb.check's rule, and its dQ schedules: the
  deterministic one bit-identical under any order in which the key blocks get there, the atomic one not;
- the source decides tiles and masks as the model does.

On a Hopper GPU (next session), each in a subprocess under a time limit: ``gpu_checks dq_product backward_quick
backward deterministic``.
"""

from __future__ import annotations

import numpy as np
import pytest

import wb_kernels as wb
from wb_kernels import cuda_build
from wb_kernels.stages.hopper import backward_model as bm
from wb_kernels.stages.hopper import build as hb
from stage_cases import tool_or_skip

DTYPES = ("float16", "bfloat16")
MANGLED = {"float16": "6__half", "bfloat16": "13__nv_bfloat16"}


# ---------------------------------------------------------------------------------------------
# The compile check for sm_90a (nvcc alone)

@pytest.fixture(scope="module")
def backward_report():
    tool_or_skip(cuda_build.find_nvcc, "the hopper backward's compile check")
    return hb.nvcc_compile_report(part="backward")  # raises when ptxas serialized a wgmma


def test_every_backward_kernel_compiles_for_sm_90a_without_spills(backward_report):
    found = {(r.function, r.dtype) for r in backward_report if r.function.startswith("backward")}
    expected = {(f"backward D={D}", dtype) for D in (64, 128) for dtype in DTYPES}
    expected |= {(f"backward_{edge}", dtype) for edge in ("preprocess", "convert_dq") for dtype in DTYPES}
    expected |= {(f"backward_dq_product D={D}", dtype) for D in (64, 128) for dtype in DTYPES}
    assert found == expected
    for kernel in backward_report:
        assert kernel.spill_stores == kernel.spill_loads == kernel.stack_bytes == 0, kernel
        assert kernel.registers <= 168, kernel  # the launch's count; the consumers take 240 by setmaxnreg


def test_the_cuda_13_0_toolkit_compiles_the_backward_too():
    """The GPU host builds with its toolkit's nvcc (13.0), not the wheel's: no spills, nothing serialized there."""
    from wb_kernels.cuda_toolchain import toolkit_tool

    nvcc = toolkit_tool("nvcc")
    if nvcc is None:
        pytest.skip("no CUDA toolkit nvcc on this machine (the wheel's nvcc is checked above)")
    report = [r for r in hb.nvcc_compile_report(nvcc=nvcc, part="backward") if r.function.startswith("backward")]
    assert len(report) == 12
    assert all(r.spill_stores == r.spill_loads == r.stack_bytes == 0 for r in report), report


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("D", [64, 128])
def test_the_backward_is_wgmma_on_tma_tiles(backward_report, dtype, D):
    """Per (query tile, key block) and consumer: S^T = K Q^T and dP^T = V dO^T, D / 16 SS k-steps each (64 x 64);
    dV += P^T dO and dK += dS^T Q, 4 RS k-steps each (64 x D, A from registers, B transposed); dQ = dS K, 8 SS
    k-steps (64 x D / 2) with A and B transposed (dS^T from shared memory)."""
    tool_or_skip(cuda_build.find_cuobjdump, "the hopper backward's machine-code check")
    lines = hb.sass(f"flash_backward_kernelI{MANGLED[dtype]}Li{D}E", part="backward")
    hgmma = [line for line in lines if line.startswith("HGMMA.")]

    def shaped(n):  # HGMMA.64xNx16.F32 (fp16) or HGMMA.64xNx16.F32.BF16
        return [line for line in hgmma if line.split()[0] in (f"HGMMA.64x{n}x16.F32", f"HGMMA.64x{n}x16.F32.BF16")]

    scores = [line for line in shaped(64) if "tnsp" not in line]
    key_side = [line for line in shaped(D) if ".tnspB" in line and "tnspA" not in line]
    dq = [line for line in shaped(D // 2) if ".tnspA.tnspB" in line]
    assert (len(scores), len(key_side), len(dq), len(hgmma)) == (D // 8, 8, 8, D // 8 + 16), hgmma
    assert all(line.split()[2].startswith("R") for line in key_side)  # P^T and dS^T from registers
    assert not any(line.split()[2].startswith("R") for line in scores + dq)
    assert sum(line.startswith("UTMALDG.3D") for line in lines) == 4 * D // 64  # K, V, Q, dO per column block
    assert sum(line.startswith("UBLKCP") for line in lines) == 2  # LSE and D rows
    assert [line.split()[0] for line in lines if "SETMAXREG" in line] == ["USETMAXREG.TRY_ALLOC.CTAPOOL",
                                                                          "USETMAXREG.DEALLOC.CTAPOOL"]
    assert any(line.startswith("ATOMG.E.ADD.F32x2") or line.startswith("REDG.E.ADD.F32x2") for line in lines)
    assert any("REDG.E.ADD.S32.STRONG.GPU" in line for line in lines)  # the semaphore's release
    assert any(line.startswith("FENCE.VIEW.ASYNC.S") for line in lines)  # dS^T's stores before the dQ wgmma
    assert any(line.startswith("BPT.TRAP") for line in lines)  # the watchdog
    assert not [line for line in lines if line.startswith(("LDL", "STL"))]


@pytest.mark.parametrize("D", [64, 128])
def test_the_dq_product_runs_alone_as_the_backward_issues_it(backward_report, D):
    """dq_product_kernel calls issue_dq itself: 8 SS k-steps with A and B transposed, N = D / 2, A and B by TMA."""
    tool_or_skip(cuda_build.find_cuobjdump, "the hopper backward's machine-code check")
    lines = hb.sass(f"dq_product_kernelI6__halfLi{D}E", part="backward")
    hgmma = [line for line in lines if line.startswith("HGMMA.")]
    assert len(hgmma) == 8 and all(line.startswith(f"HGMMA.64x{D // 2}x16.F32 ") and ".tnspA.tnspB" in line
                                   for line in hgmma), hgmma
    assert sum(line.startswith("UTMALDG.2D") for line in lines) >= 2
    assert "issue_dq<T, HEAD_DIM>(d, smem_address(a_t_tile), smem_address(b_tile), consumer);" in hb.package_source()


def test_a_trap_inline_on_the_consumers_path_would_spill():
    """Why the backward's waits trap through a call (watchdog_trap): inlined, the trap made ptxas allocate the
    consumers for the launch's 168 registers (spills at D = 64 and 128, serialized wgmma at D = 128)."""
    tool_or_skip(cuda_build.find_nvcc, "the hopper backward's compile check")
    source = hb.package_source()
    inline = source.replace("__device__ __noinline__ void watchdog_trap()", "__device__ __forceinline__ void watchdog_trap()")
    assert inline != source
    try:
        report = hb.nvcc_compile_report(inline, part="backward")
    except cuda_build.CudaBuildError as error:  # serialized: the worse outcome, also a failure of the build
        assert "serialized" in str(error)
        return
    spilled = [r for r in report if r.function.startswith("backward D=") and r.spill_stores > 0]
    assert spilled, report


def test_the_backward_regions_exist():
    from wb_kernels.lesson_sync import module_regions

    regions = {name for path in hb.SOURCE.files().values() for name in module_regions(path)}
    assert {"backward_params", "backward_preprocess", "backward_convert_dq", "backward_primitives",
            "backward_wgmma_transposed_a", "backward_main_layout", "backward_main_producer", "backward_main_softmax",
            "backward_main_dq", "backward_main_epilogue", "backward_main_kernel", "backward_main_consumer",
            "backward_entry_point", "backward_torch_entry", "backward_dq_product_kernel",
            "backward_dq_product_entry"} <= regions


def test_the_build_declares_the_backward_entry_point():
    assert "hopper_flash_backward" in hb._FUNCTIONS
    assert "std::vector<torch::Tensor> hopper_flash_backward(" in hb._CPP_DECLARATION
    assert "std::vector<torch::Tensor> hopper_flash_backward(" in hb.package_source()
    assert "hopper_backward_dq_product" in hb._FUNCTIONS
    assert "torch::Tensor hopper_backward_dq_product(torch::Tensor a_t, torch::Tensor b, int64_t consumer)" in \
        hb.package_source()


def test_the_launcher_does_not_register_the_backward_yet():
    """An untested kernel must not run behind wb.attention: the stage's Backward waits for the H100 run."""
    from wb_kernels.stages import available_backwards
    from wb_kernels.stages.hopper import launcher

    assert callable(launcher.backward_gradients)
    assert "hopper" not in available_backwards()
    assert not hasattr(launcher, "BACKWARDS")


# ---------------------------------------------------------------------------------------------
# The model against the float64 reference

def _problem(B, H, Lq, Lk, Hk, D, causal, padded, seed=0):
    q, k, v = wb.random_qkv(B, H, Lq, D, Lk=Lk, dtype="float16", seed=Lq + 3 * Lk + D + seed)
    k, v = k[:, :Hk].copy(), v[:, :Hk].copy()
    mask = wb.random_padding_mask(B, Lk, seed=Lk) if padded else None
    out, lse = wb.reference(q, k, v, causal=causal, key_padding_mask=mask)
    dout = np.random.default_rng(Lq + Lk).standard_normal(q.shape).astype(np.float16)
    return q, k, v, out.astype(np.float16), lse.astype(np.float32), dout, mask


MODEL_CASES = [  # (B, H, Lq, Lk, Hk, D, causal, padded)
    (1, 2, 70, 200, 1, 64, False, True),            # GQA 2:1, ragged, two key blocks, padding
    (1, 2, 70, 200, 1, 64, "top_left", False),
    (2, 2, 130, 77, 2, 64, "bottom_right", True),   # Lq > Lk: early rows see no key
    (1, 4, 100, 300, 2, 128, "bottom_right", False),  # GQA, Lk > Lq: key blocks before every diagonal
    (1, 4, 100, 300, 2, 128, "top_left", True),     # top-left with Lk > Lq: whole key blocks visit no tile
    (1, 2, 1, 1, 2, 64, "top_left", False),         # L = 1
]


@pytest.mark.parametrize("case", MODEL_CASES, ids=lambda c: "B{}H{}Lq{}Lk{}Hk{}D{}-{}-pad{}".format(*c))
@pytest.mark.parametrize("mode", ["atomic", "deterministic"])
def test_the_backward_model_meets_the_tolerance_rule(case, mode):
    *shape, causal, padded = case
    q, k, v, out, lse, dout, mask = _problem(*shape, causal, padded)
    grads = bm.backward(q, k, v, out, lse, dout, causal=causal, key_padding_mask=mask, mode=mode, seed=1)
    wb.check_gradients(f"hopper backward model {case} {mode}", grads, q, k, v, dout, causal=causal,
                       key_padding_mask=mask, verbose=False)


def test_rows_and_keys_nobody_sees_get_zero_gradients():
    """Keys 0-4 padded out under top-left causal: queries 0-4 see no key (LSE -inf from the forward), so dq is 0
    there; the padded keys' dk and dv are 0."""
    q, k, v = wb.random_qkv(1, 2, 70, 64, dtype="float16", seed=3)
    mask = np.ones((1, 70), bool)
    mask[0, :5] = False
    out, lse = wb.reference(q, k, v, causal=True, key_padding_mask=mask)
    assert np.all(lse[:, :, :5] == -np.inf)
    dout = np.random.default_rng(0).standard_normal(q.shape).astype(np.float16)
    dq, dk, dv = bm.backward(q, k, v, out.astype(np.float16), lse.astype(np.float32), dout, causal=True,
                             key_padding_mask=mask)
    assert not dq[:, :, :5].any() and not dk[:, :, :5].any() and not dv[:, :, :5].any()
    assert np.isfinite(dq).all() and np.isfinite(dk).all() and np.isfinite(dv).all()
    wb.check_gradients("hopper backward model, rows without keys", (dq, dk, dv), q, k, v, dout, causal=True,
                       key_padding_mask=mask, verbose=False)


def test_the_model_fails_when_the_first_tile_ignores_the_offset(monkeypatch):
    """Teeth: a first query tile computed without the bottom-right offset skips tiles whose queries see the block's
    keys (Lk > Lq: the diagonal starts Lk - Lq keys on)."""
    monkeypatch.setattr(bm, "first_query_tile", lambda n0, offset, Lq_pad:
                        0 if offset is None else min(n0, Lq_pad) // bm.BLOCK_M)
    q, k, v, out, lse, dout, mask = _problem(1, 2, 100, 300, 1, 64, "bottom_right", False)
    grads = bm.backward(q, k, v, out, lse, dout, causal="bottom_right")
    with pytest.raises(wb.CheckFailed):
        wb.check_gradients("model without the offset", grads, q, k, v, dout, causal="bottom_right", verbose=False)


def test_fully_masked_tiles_are_never_visited():
    """Top-left causal, Lq = Lk = 300: key block 1 (keys 128-255) starts at query tile 2, key block 2 at tile 4."""
    assert [bm.first_query_tile(n0, 0, 320) for n0 in (0, 128, 256)] == [0, 2, 4]
    assert [bm.first_query_tile(n0, 200, 128) for n0 in (0, 128, 256)] == [0, 0, 0]  # bottom-right, Lk - Lq = 200
    assert bm.first_query_tile(384, -100, 320) == 5  # past every query: no tile (5 = Lq_pad / 64)


# ---------------------------------------------------------------------------------------------
# dQ's order: atomics against the semaphores

@pytest.mark.parametrize("causal", [False, "top_left"])
def test_the_deterministic_order_is_bit_identical_and_the_atomic_one_is_not(causal):
    """Four key blocks add to each query tile's dQ: under the semaphores the float32 accumulator is the same bits for
    every draw of which CTA moves when; in any order (atomics) it differs between draws, while both stay within
    the tolerance rule."""
    q, k, v, out, lse, dout, _ = _problem(1, 1, 512, 512, 1, 64, causal, False)
    runs = {mode: [bm.backward(q, k, v, out, lse, dout, causal=causal, mode=mode, seed=seed,
                               return_accumulator=True)[3] for seed in range(4)] for mode in ("atomic", "deterministic")}
    first = runs["deterministic"][0]
    assert all(np.array_equal(first.view(np.uint32), run.view(np.uint32)) for run in runs["deterministic"][1:])
    assert any(not np.array_equal(runs["atomic"][0].view(np.uint32), run.view(np.uint32)) for run in runs["atomic"][1:])


def test_the_semaphores_never_deadlock_and_order_the_adds_by_key_block():
    """Every key block that visits a query tile finds the blocks before it have visited it too (the causal diagonal
    only moves right), so "wait until the count reads my index" always finishes, in every draw; a rule that made a
    block wait for one more (or for blocks that never come) would deadlock, and the model says so."""
    q, k, v, out, lse, dout, _ = _problem(1, 2, 200, 400, 1, 64, "bottom_right", False)
    for seed in range(4):
        bm.backward(q, k, v, out, lse, dout, causal="bottom_right", mode="deterministic", seed=seed)
    blocks = {(0, 0, j): [((0, 0), np.zeros((64, 8), np.float32))] for j in (1, 2)}  # block 0 never comes
    with pytest.raises(bm.Deadlock):
        bm.accumulate_dq(blocks, (1, 64, 8), "deterministic")


def test_bfloat16_rounding_is_to_nearest_even():
    x = np.array([1.0, 1.0 + 2 ** -8, 1.0 + 3 * 2 ** -8, -2.5, np.inf], np.float32)
    assert bm.round_to(x, "bfloat16").tolist() == [1.0, 1.0, 1.0 + 2 ** -6, -2.5, np.inf]


# ---------------------------------------------------------------------------------------------
# The source decides as the model does

def test_the_source_decides_tiles_masks_and_order_as_the_model_does():
    source = hb.package_source()
    for expression in (
            "const int first_query = max(0, n0 - params.causal_offset);",
            "return min(first_query, params.Lq_pad) / BWD_BLOCK_M;",
            "first_query[r] = !kept ? NO_QUERY : params.causal ? key - params.causal_offset : EVERY_QUERY;",
            "const bool seen = m0 + column + e >= first_query[r];",
            "const float p = seen ? exp2f(fmaf(s[i], scale_log2, -(e ? lse.y : lse.x))) : 0.0f;",
            "dp[i] = p * (dp[i] - (e ? dot.y : dot.x));",
            "lse_log2[row] = l == -INFINITY ? INFINITY : l * LOG2_E;",
            "if (semaphore != nullptr && semaphore_thread) semaphore_wait(semaphore, n_block);",
            "constexpr int BWD_BLOCK_M = 64;", "constexpr int BWD_BLOCK_N = 128;",
            "pack_pair<T>(dk[4 * j + 2 * r] * params.scale, dk[4 * j + 2 * r + 1] * params.scale)",
            "pack_pair<T>(x.x * scale, x.y * scale)"):
        assert expression in source, expression


# ---------------------------------------------------------------------------------------------
# The GPU check's own logic, on the CPU: the model stands in for the kernels

def _model_stand_ins(monkeypatch, broken=False):
    import torch

    from wb_kernels.stages.hopper import gpu_checks, launcher

    def forward(q, k, v, *, causal=False, key_padding_mask=None, scale=None):
        mask = None if key_padding_mask is None else key_padding_mask.numpy()
        out, lse = wb.reference(q.numpy(), k.numpy(), v.numpy(), causal=causal, key_padding_mask=mask, scale=scale)
        return torch.from_numpy(out.astype(np.float16)), torch.from_numpy(lse.astype(np.float32))

    def backward_gradients(q, k, v, out, lse, dout, *, causal=False, key_padding_mask=None, scale=None,
                           deterministic=None):
        mask = None if key_padding_mask is None else key_padding_mask.numpy()
        grads = bm.backward(*(x.numpy() for x in (q, k, v, out, lse, dout)), causal=causal, key_padding_mask=mask,
                            scale=scale, mode="deterministic" if deterministic else "atomic")
        if broken:  # a dQ that misses one key block's share, as a wrong semaphore count or descriptor would
            grads = (grads[0] * np.float16(0.5), *grads[1:])
        return tuple(torch.from_numpy(np.ascontiguousarray(g)) for g in grads)

    monkeypatch.setattr(gpu_checks, "BACKWARD_DEVICE", "cpu")
    monkeypatch.setattr(gpu_checks, "BACKWARD_QUICK_SHAPES", [(1, 2, 70, 200, 1)])  # GQA, two key blocks
    monkeypatch.setattr(launcher, "forward", forward)
    monkeypatch.setattr(launcher, "backward_gradients", backward_gradients)
    return gpu_checks


def test_the_gpu_checks_backward_logic_passes_the_model_and_fails_a_wrong_dq(monkeypatch):
    gpu_checks = _model_stand_ins(monkeypatch)
    assert "6 cases within" in gpu_checks.check_backward(quick=True)
    gpu_checks = _model_stand_ins(monkeypatch, broken=True)
    with pytest.raises(AssertionError, match="dq max"):
        gpu_checks.check_backward(quick=True)


# ---------------------------------------------------------------------------------------------
# On a Hopper GPU: the gpu_checks entries, one subprocess each under a time limit (a wrong barrier hangs or traps)

from test_hopper import REPO, _environment, built_extension, needs_hopper  # noqa: E402,F401 (the fixture)

BACKWARD_GPU_SECONDS = {"dq_product": 60, "backward_quick": 120, "backward": 420, "deterministic": 180}


@needs_hopper
@pytest.mark.parametrize("name", list(BACKWARD_GPU_SECONDS))
def test_the_backward_on_the_gpu(name, built_extension):
    import subprocess
    import sys

    limit = BACKWARD_GPU_SECONDS[name]
    try:
        done = subprocess.run([sys.executable, "-m", "wb_kernels.stages.hopper.gpu_checks", name], cwd=REPO,
                              env=_environment(), capture_output=True, text=True, timeout=limit)
    except subprocess.TimeoutExpired as hung:
        pytest.fail(f"gpu check {name!r} did not finish in {limit} s: {hung.stdout!r} {hung.stderr!r}")
    assert done.returncode == 0 and f"CHECK {name} ok" in done.stdout, done.stdout + done.stderr[-3000:]
    print(done.stdout)


STATIC_SHARED_LIMIT = 48 * 1024  # a block's static shared memory; more must be dynamic, with the kernel's opt-in


def test_no_kernel_declares_more_static_shared_memory_than_a_block_may():
    """Every kernel of the forward and the backward keeps its static shared memory within 48 KB: ptxas for sm_90a
    accepts more without a word (for sm_80 and sm_90 it refuses), and such a launch is not one a GPU promises to run.
    The dQ product's tiles at D = 128 are 48 KB themselves, so they are dynamic shared memory (ptxas said 49,168
    bytes of static before)."""
    import re

    from wb_kernels.cuda_build import compile_cubin

    for part in hb.PARTS:
        _, log = compile_cubin(hb.ARCH, hb.package_source(), hb.LINE_NAME, hb.SOURCE_NAME,
                               extra_flags=tuple(hb.build_options(hb.WATCHDOG_SECONDS)) + hb.PARTS[part])
        kernels = re.findall(r"Compiling entry function '(\w+)'.*?(\d+) bytes smem", log, flags=re.S)
        assert kernels, log[-1000:]
        over = [(name, int(smem)) for name, smem in kernels if int(smem) > STATIC_SHARED_LIMIT]
        assert not over, over
