"""Rung hopper, v0 (the primitives lab) and the mbarrier ring model.

On the CPU (CI):
- the TMA's 128-byte swizzle in NumPy (``tma_swizzle``): the address-bit formula is the mma rung's chunk XOR;
- the compile check with nvcc alone, for sm_90a: every kernel of ``hopper_host.cu`` (with the headers it includes)
  compiles without spills and with the watchdog; its SASS holds ``HGMMA`` (wgmma), ``UTMALDG`` (the TMA load) and the mbarrier's ``SYNCS``; a wgmma
  that ptxas serializes (a printf in the kernel) fails the build; the CUDA 13.0 toolkit's nvcc too, when present;
- the ring model (``barrier_ring``): correct schedules finish under many interleavings, and each classic mistake
  (wrong parity, wrong byte count, a missing release, a wrong arrival count) raises instead of hanging.

On a Hopper GPU: ``gpu_checks`` (the TMA tile bit for bit, every GEMM variant against float64, v1 attention against
the float64 reference with wb.check's rule, the watchdog) in a subprocess under a time limit each, since a wrong
barrier hangs the kernel rather than failing it. v1 is not a registered stage yet, so the shared test matrix does not
cover it; the ``attention`` check runs a matrix of its own (dtypes, head dims, masks, GQA, rows without keys).
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import wb_kernels as wb
from wb_kernels import cuda_build
from wb_kernels.cuda_toolchain import toolkit_tool
from wb_kernels.stages.hopper import barrier_ring as br
from wb_kernels.stages.hopper import build as hb
from wb_kernels.stages.hopper import tma_swizzle as ts
from wb_kernels.stages.hopper import v1_model
from wb_kernels.stages.hopper import wgmma_fragments as wf
from wb_kernels.stages.mma import swizzle as mma_swizzle
from wb_kernels.lesson_sync import module_regions
from stage_cases import tool_or_skip

REPO = Path(__file__).resolve().parents[1]
GPU_CHECK_SECONDS = {"tma": 60, "gemm": 60, "registers": 60, "named_barriers": 60, "attention": 150, "v2": 200,
                     "v3": 200, "v4": 200, "watchdog": 60}  # a hang is cut off here


def _is_hopper() -> bool:
    if wb.BACKEND.is_simulator:
        return False
    try:
        import torch

        return torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)
    except ImportError:
        return False


needs_hopper = pytest.mark.skipif(not _is_hopper(), reason="the hopper rung's kernels need a Hopper GPU (sm_90) "
                                                           "and a CUDA build of torch")
rng = np.random.default_rng(0)


# ---------------------------------------------------------------------------------------------
# The 128-byte swizzle

def test_the_tma_swizzle_is_the_mma_rungs_xor_for_128_byte_rows():
    """Bits 4-6 of a byte address XOR bits 7-9: for rows of 64 16-bit elements, chunk c of row r moves to c ^ (r % 8)."""
    row, chunk = np.meshgrid(np.arange(64), np.arange(8), indexing="ij")
    plain = row * ts.ROW_BYTES + chunk * 16
    assert np.array_equal(ts.swizzle_128b(plain), mma_swizzle.offset_bytes("swizzled", row, chunk, 64))
    # within a chunk the bytes keep their order, and each 1024-byte group of 8 rows is permuted within itself
    offsets = np.arange(64 * ts.ROW_BYTES)
    stored = ts.swizzle_128b(offsets)
    assert np.array_equal(stored % 16, offsets % 16) and np.array_equal(stored // 1024, offsets // 1024)
    assert sorted(stored) == list(offsets)


@pytest.mark.parametrize("row0, column0", [(0, 0), (8, 64), (80, 160), (99, 192)])
def test_both_swizzle_models_give_one_image_and_ragged_boxes_are_zero_filled(row0, column0):
    x = rng.integers(1, 1000, size=(100, 200)).astype(np.int16)
    box = ts.tma_box(x, row0, column0)
    assert box.shape == (64, 64)
    valid_rows, valid_columns = min(64, 100 - row0), min(64, 200 - column0)
    assert np.array_equal(box[:valid_rows, :valid_columns], x[row0:row0 + valid_rows, column0:column0 + valid_columns])
    assert not box[valid_rows:].any() and not box[:, valid_columns:].any()
    image = ts.swizzled_image(box)
    assert np.array_equal(image, ts.swizzled_image_by_bits(box))
    assert np.array_equal(image[:8], box[0, :8]) and np.array_equal(image[64 + 8:64 + 16], box[1, :8])  # row 1: 0 -> 1


# ---------------------------------------------------------------------------------------------
# The register layouts the kernels assume, against the mma rung's fragment model

@pytest.mark.parametrize("n", [64, 128])
def test_every_accumulator_element_is_held_once_and_matches_mma_c_fragments(n):
    held = [rc for thread in range(wf.WARPGROUP) for rc in wf.accumulator_coords(thread, n)]
    assert sorted(held) == [(r, c) for r in range(64) for c in range(n)]
    for thread in range(wf.WARPGROUP):
        warp, lane = divmod(thread, 32)
        for j in range(n // 8):  # each 8-column slice is mma.m16n8's C fragment on warp w's rows
            expected = [(16 * warp + r, 8 * j + c) for r, c in wf.mma_fragments.c_coords(lane)]
            assert wf.accumulator_coords(thread, n)[4 * j:4 * j + 4] == expected


@pytest.mark.parametrize("step", range(4))
def test_the_rs_operand_the_lab_loads_is_the_mma_a_fragment(step):
    for thread in range(wf.WARPGROUP):
        assert wf.a_register_coords(thread, step) == wf.mma_a_coords(thread, step)


@pytest.mark.parametrize("step", range(4))
def test_v1_packs_p_from_s_without_moving_data_between_threads(step):
    """The kernel's p[t][i] = pack(s[8t + 2i], s[8t + 2i + 1]) holds, in each thread, exactly the A operand the RS
    wgmma of k-step t expects: columns 16 t .. 16 t + 15 of P, in the A fragment's order."""
    for thread in range(wf.WARPGROUP):
        s_coords = wf.accumulator_coords(thread, 64)
        assert [s_coords[index] for index in wf.p_from_s(step)] == wf.a_register_coords(thread, step)


def test_the_source_indexes_registers_as_the_python_transcription_says():
    """The expressions wgmma_fragments.py transcribes, as they stand in the kernels: if the kernel changes them,
    this fails until the transcription (and the layout tests above) follow."""
    source = hb.package_source()
    for expression in (
            "const int row = 16 * warp + lane / 4 + 8 * (i % 2), column = 16 * step + 2 * (lane % 4) + 8 * (i / 2);",
            "const int row = 16 * warp + lane / 4 + 8 * h, column = 8 * j + 2 * (lane % 4);",
            "make_float2(d[4 * j + 2 * h], d[4 * j + 2 * h + 1])",
            "p[t][i] = pack_pair<T>(s[8 * t + 2 * i], s[8 * t + 2 * i + 1]);",
            "n0 + 8 * j + 2 * (lane % 4) + e < params.Lk",  # the key of s[4 j + 2 r + e] (key padding's read)
            "bound[r] = keys_end - n0 - 2 * (lane % 4);",  # the same key, as a bound on column 8 j + e
            "pack_pair<T>(o[4 * j + 2 * r] * inverse, o[4 * j + 2 * r + 1] * inverse)"):
        assert expression in source, expression


# ---------------------------------------------------------------------------------------------
# v1's control flow and arithmetic in NumPy (v1_model), against the float64 reference

V1_CASES = [(1, 2, 1, 1, 2, 64), (2, 3, 100, 77, 3, 64), (1, 2, 200, 70, 2, 128), (2, 4, 130, 300, 2, 64),
            (1, 4, 77, 513, 1, 128)]


def _v1_inputs(B, H, Lq, Lk, Hk, D):
    q, k, v = wb.random_qkv(B, H, Lq, D, Lk=Lk, dtype="float16", seed=Lq + Lk)
    return q, k[:, :Hk].copy(), v[:, :Hk].copy()


@pytest.mark.parametrize("case", V1_CASES, ids=lambda c: "B{}H{}Lq{}Lk{}Hk{}D{}".format(*c))
@pytest.mark.parametrize("causal", [False, "top_left", "bottom_right"])
@pytest.mark.parametrize("padded", [False, True])
def test_v1_model_meets_the_tolerance_rule(case, causal, padded):
    q, k, v = _v1_inputs(*case)
    mask = wb.random_padding_mask(case[0], case[3], seed=case[3]) if padded else None
    out, lse = v1_model.forward(q, k, v, causal=causal, key_padding_mask=mask)
    wb.check(f"v1 model {case} causal={causal} padded={padded}", out, q, k, v, lse=lse, causal=causal,
             key_padding_mask=mask, verbose=False)


def test_v1_model_rows_without_keys_give_zero_and_minus_inf():
    q, k, v = wb.random_qkv(1, 2, 70, 64, dtype="float16", seed=3)
    mask = np.ones((1, 70), bool)
    mask[0, :5] = False
    out, lse = v1_model.forward(q, k, v, causal=True, key_padding_mask=mask)
    assert not out[:, :, :5].any() and np.all(lse[:, :, :5] == -np.inf) and np.isfinite(lse[:, :, 5:]).all()


def test_v1_model_fails_when_the_causal_tile_count_ignores_the_offset(monkeypatch):
    """The check has teeth: a kv_end that forgets the bottom-right offset drops keys the last rows see."""
    monkeypatch.setattr(v1_model, "key_tiles", lambda m0, Lq, Lk, offset, block_m, block_n: -(-(
        Lk if offset is None else max(0, min(Lk, min(m0 + block_m, Lq)))) // block_n))
    q, k, v = _v1_inputs(1, 2, 77, 513, 1, 64)
    out, lse = v1_model.forward(q, k, v, causal="bottom_right")
    with pytest.raises(wb.CheckFailed):
        wb.check("v1 model, kv_end without the offset", out, q, k, v, lse=lse, causal="bottom_right", verbose=False)


WS_CASES = V1_CASES + [(1, 2, 300, 1100, 1, 64), (1, 2, 1030, 200, 2, 128), (1, 2, 260, 324, 2, 64)]


@pytest.mark.parametrize("case", WS_CASES, ids=lambda c: "B{}H{}Lq{}Lk{}Hk{}D{}".format(*c))
@pytest.mark.parametrize("causal", [False, "top_left", "bottom_right"])
@pytest.mark.parametrize("padded", [False, True])
def test_v2_v3_model_meets_the_tolerance_rule(case, causal, padded):
    """128-row blocks of two 64-row consumers, 128-key tiles: every consumer walks its block's tiles."""
    q, k, v = _v1_inputs(*case)
    mask = wb.random_padding_mask(case[0], case[3], seed=case[3]) if padded else None
    out, lse = v1_model.forward(q, k, v, causal=causal, key_padding_mask=mask, **v1_model.WS)
    wb.check(f"v2 model {case} causal={causal} padded={padded}", out, q, k, v, lse=lse, causal=causal,
             key_padding_mask=mask, verbose=False)


def test_v2_model_fails_when_the_tile_count_comes_from_64_rows(monkeypatch):
    """Teeth: a tile count from v1's 64 rows instead of the block's 128 drops keys that consumer 1's rows see (with
    the bottom-right diagonal 64 keys on, rows 64-127 reach into the second tile)."""
    tiles = v1_model.key_tiles
    monkeypatch.setattr(v1_model, "key_tiles", lambda m0, Lq, Lk, offset, block_m, block_n:
                        tiles(m0, Lq, Lk, offset, 64, block_n))
    q, k, v = _v1_inputs(1, 2, 260, 324, 2, 64)
    out, lse = v1_model.forward(q, k, v, causal="bottom_right", **v1_model.WS)
    with pytest.raises(wb.CheckFailed):
        wb.check("v2 model, tile count of 64 rows", out, q, k, v, lse=lse, causal="bottom_right", verbose=False)


def test_the_source_decides_tiles_and_masks_as_the_model_does():
    source = hb.package_source()
    for expression in (
            "if (params.causal) kv_end = max(0, min(params.Lk, min(m0 + BLOCK_M, params.Lq) + params.causal_offset));",
            "const bool needs_mask = n0 + BLOCK_N > params.Lk || keep != nullptr ||",
            "(params.causal && n0 + BLOCK_N - 1 > first_row + params.causal_offset);",
            "const int n_tiles = key_tile_count<V1_BLOCK_M, V1_BLOCK_N>(params, m0);",
            "const int n_tiles = key_tile_count<WS_BLOCK_M, WS_BLOCK_N>(params, m0);  // the producer's and the consumers'",
            "rows.first_row = m0 + 64 * consumer;",
            "rows.query0 = rows.first_row + 16 * warp + lane / 4;",
            "constexpr int WS_BLOCK_M = 128;", "constexpr int WS_BLOCK_N = 128;",
            "const float base = new_max == -INFINITY ? 0.0f : new_max;",
            "total > 0.0f ? (row_max[r] + log2f(total)) * 0.6931471805599453f : -INFINITY"):
        assert expression in source, expression


# ---------------------------------------------------------------------------------------------
# The compile check for sm_90a (nvcc alone; CI runs it)

@pytest.fixture(scope="module")
def report():
    tool_or_skip(cuda_build.find_nvcc, "the hopper rung's compile check")
    return hb.nvcc_compile_report()


def test_every_kernel_compiles_for_sm_90a_without_spills(report):
    found = {(r.function, r.dtype) for r in report}
    expected = {("tma_tile", None), ("register_split", None), ("named_barrier", None)}
    expected |= {(v.label, dtype) for v in hb.GEMM_VARIANTS for dtype in ("float16", "bfloat16")}
    expected |= {(f"flash_v{version} D={D}", dtype) for version in (1, 2, 3, 4) for D in (64, 128)
                 for dtype in ("float16", "bfloat16")}
    assert found == expected
    for kernel in report:
        assert kernel.spill_stores == kernel.spill_loads == kernel.stack_bytes == 0, kernel
        assert kernel.registers <= 168, kernel  # 64 x 128 fp32 accumulators are 64 registers per thread (v2/v3's
        # consumers reach past 168 only after setmaxnreg.inc: the report shows the launch's count)


def test_the_cuda_13_0_toolkit_compiles_it_too():
    """The GPU host builds with its toolkit's nvcc (13.0), not the wheel's: the same checks with that compiler."""
    nvcc = toolkit_tool("nvcc")
    if nvcc is None:
        pytest.skip("no CUDA toolkit nvcc on this machine (the wheel's nvcc is checked above)")
    report = hb.nvcc_compile_report(nvcc=nvcc)
    assert len(report) == 3 + 2 * len(hb.GEMM_VARIANTS) + 16  # v1 to v4, fp16/bf16, D 64/128
    assert all(r.spill_stores == r.spill_loads == r.stack_bytes == 0 for r in report)
    assert any("HGMMA" in line for line in hb.sass("wgmma_gemm_kernel", nvcc=nvcc, pattern="HGMMA"))


@pytest.mark.parametrize("variant", hb.GEMM_VARIANTS, ids=lambda v: v.label)
def test_the_gemm_is_wgmma_fed_by_the_tma(report, variant):
    tool_or_skip(cuda_build.find_cuobjdump, "the hopper rung's machine-code check")
    mangled = (f"wgmma_gemm_kernelI6__halfLi{variant.n}ELi{variant.k_steps}ELb{int(variant.a_in_registers)}"
               f"ELb{int(variant.b_mn_major)}E")
    lines = hb.sass(mangled)
    hgmma = [line for line in lines if line.startswith("HGMMA.")]
    assert len(hgmma) == variant.k_steps, hgmma  # one wgmma.mma_async per k16 step, none serialized away
    assert all(line.startswith(f"HGMMA.64x{variant.n}x16.F32 ") for line in hgmma), hgmma
    assert all(("tnspB" in line) == variant.b_mn_major for line in hgmma), hgmma
    # SS: A's descriptor first; RS: A's registers first (HGMMA.64xNx16.F32 R24, R88, gdesc[...])
    assert all((line.split()[2].startswith("R")) == variant.a_in_registers for line in hgmma), hgmma
    loads = [line for line in lines if line.startswith("UTMALDG.2D")]
    assert len(loads) == (1 + variant.n // 64 if variant.b_mn_major else 2), loads
    assert any(line.startswith("SYNCS.PHASECHK.TRANS64.TRYWAIT") for line in lines)  # mbarrier.try_wait
    assert any(line.startswith("WARPGROUP.ARRIVE") for line in lines)  # wgmma.fence
    assert not [line for line in lines if line.startswith(("LDL", "STL"))]  # no local memory


def test_the_tma_tile_kernel_and_the_watchdog(report):
    tool_or_skip(cuda_build.find_cuobjdump, "the hopper rung's machine-code check")
    watched = hb.sass("tma_tile_kernel")
    assert sum(line.startswith("UTMALDG.2D") for line in watched) == 1
    assert any(line.startswith("SYNCS.ARRIVE.TRANS64") for line in watched)  # mbarrier.arrive.expect_tx
    assert any(line.startswith("BPT.TRAP") for line in watched)  # the watchdog's __trap
    unwatched = hb.sass("tma_tile_kernel", watchdog_seconds=None)
    assert not any(line.startswith("BPT.TRAP") for line in unwatched)


@pytest.mark.parametrize("version", [2, 3, 4])
@pytest.mark.parametrize("dtype, D", [("6__half", 64), ("6__half", 128), ("13__nv_bfloat16", 64),
                                      ("13__nv_bfloat16", 128)])
def test_v2_v3_v4_split_registers_and_keep_wgmma_on_tma_tiles(report, version, dtype, D):
    """v2: D / 16 SS wgmma for S (64 x 128 keys) and 8 RS wgmma for P V per tile; v3 and v4 issue each twice in the
    source (their first and last turns stand outside the loop). 168 registers at launch, the producer gives back to 24
    and the consumers take 240; 3-D TMA loads; v3's and v4's turns are bar.sync / bar.arrive over 256 threads; only
    v4 waits for one of two groups (wgmma.wait_group 1: DEPBAR.LE gsb0, 0x1); the watchdog's trap."""
    tool_or_skip(cuda_build.find_cuobjdump, "the hopper rung's machine-code check")
    kernel = next(r for r in report if r.function == f"flash_v{version} D={D}"
                  and r.dtype == ("float16" if dtype == "6__half" else "bfloat16"))
    assert (kernel.registers, kernel.spill_stores, kernel.spill_loads, kernel.stack_bytes) == (168, 0, 0, 0), kernel
    lines = hb.sass(f"flash_ws_kernelI{dtype}Li{D}ELi{version}E", pattern="")
    hgmma = [line for line in lines if line.startswith("HGMMA.")]
    s_products = [line for line in hgmma if line.startswith("HGMMA.64x128x16.F32") and "tnspB" not in line]
    pv_products = [line for line in hgmma if line.startswith(f"HGMMA.64x{D}x16.F32") and "tnspB" in line]
    copies = 1 if version == 2 else 2
    assert (len(s_products), len(pv_products), len(hgmma)) == (copies * D // 16, copies * 8, copies * (D // 16 + 8))
    assert all(line.split()[2].startswith("R") for line in pv_products)  # P from registers
    assert [line for line in lines if "SETMAXREG" in line] == ["USETMAXREG.TRY_ALLOC.CTAPOOL UP0, 0xf0 ;",
                                                              "USETMAXREG.DEALLOC.CTAPOOL 0x18 ;"]
    assert any(line.startswith("UTMALDG.3D") for line in lines)
    assert any(line.startswith("SYNCS.ARRIVE") for line in lines)
    assert any(line.startswith("BPT.TRAP") for line in lines)
    turns = [line for line in lines if ("BAR.SYNC" in line or "BAR.ARV" in line) and line.endswith(", 0x100 ;")]
    assert bool(turns) == (version >= 3), turns
    overlapped = [line for line in lines if line.startswith("WARPGROUP.DEPBAR.LE gsb0, 0x1")]
    assert len(overlapped) == (1 if version == 4 else 0), overlapped  # the softmax between the two waits
    assert not [line for line in lines if line.startswith(("LDL", "STL"))]


@pytest.mark.parametrize("dtype, D", [("6__half", 64), ("6__half", 128), ("13__nv_bfloat16", 128)])
def test_v1_key_loop_is_wgmma_on_tma_tiles(report, dtype, D):
    """Per key tile: D / 16 SS wgmma for S = Q K^T (K-major), 4 RS wgmma for O += P V (V MN-major: tnspB), the K and V
    tiles by 3-D TMA loads, no local memory."""
    tool_or_skip(cuda_build.find_cuobjdump, "the hopper rung's machine-code check")
    lines = hb.sass(f"flash_v1_kernelI{dtype}Li{D}E")
    hgmma = [line for line in lines if line.startswith("HGMMA.")]
    s_products = [line for line in hgmma if line.startswith("HGMMA.64x64x16.F32") and "tnspB" not in line]
    pv_products = [line for line in hgmma if line.startswith(f"HGMMA.64x{D}x16.F32") and "tnspB" in line]
    assert (len(s_products), len(pv_products), len(hgmma)) == (D // 16, 4, D // 16 + 4), hgmma
    assert all(line.split()[2].startswith("R") for line in pv_products)  # P from registers
    assert any(line.startswith("UTMALDG.3D") for line in lines)
    assert not [line for line in lines if line.startswith(("LDL", "STL"))]


def _highest_register(lines) -> int:
    return max(int(r) for line in lines for r in re.findall(r"\bR(\d+)\b", line))


def test_setmaxnreg_moves_registers_from_the_producer_to_the_consumers(report):
    """The block launches with 168 registers a thread; warpgroup 0 gives back to 24, warpgroups 1-2 take 240 and keep
    200 values live without a spill, using registers past R168. The same kernel without setmaxnreg spills."""
    tool_or_skip(cuda_build.find_cuobjdump, "the hopper rung's machine-code check")
    split = next(r for r in report if r.function == "register_split")
    assert (split.registers, split.spill_stores, split.stack_bytes) == (168, 0, 0), split
    lines = hb.sass("register_split_kernel", pattern="")
    assert [line for line in lines if "SETMAXREG" in line] == ["USETMAXREG.TRY_ALLOC.CTAPOOL UP0, 0xf0 ;",
                                                              "USETMAXREG.DEALLOC.CTAPOOL 0x18 ;"]
    assert _highest_register(lines) >= 168  # registers the launch does not give: only the .inc provides them
    source = hb.package_source()
    without = source.replace("        setmaxnreg_inc<CONSUMER_REGISTERS>();\n", "").replace(
        "        setmaxnreg_dec<PRODUCER_REGISTERS>();\n", "")
    assert without.count("setmaxnreg_") == source.count("setmaxnreg_") - 2
    spilled = next(r for r in hb.nvcc_compile_report(without) if r.function == "register_split")
    assert spilled.spill_stores > 0, spilled


def test_named_barriers_are_bar_sync_and_bar_arrive_over_two_warpgroups(report):
    tool_or_skip(cuda_build.find_cuobjdump, "the hopper rung's machine-code check")
    lines = hb.sass("named_barrier_kernel", pattern="BAR.")
    syncs = [line for line in lines if "BAR.SYNC" in line and line.endswith(", 0x100 ;")]  # 256 threads
    arrives = [line for line in lines if "BAR.ARV" in line and line.endswith(", 0x100 ;")]
    assert syncs and arrives, lines
    assert all(" R" in line for line in syncs + arrives)  # the barrier's index from a register: 1 + warpgroup


def test_a_serialized_wgmma_fails_the_build():
    """A printf between the wgmma and its wait makes ptxas serialize every wgmma (a C75xx note, not a warning)."""
    tool_or_skip(cuda_build.find_nvcc, "the hopper rung's compile check")
    broken = hb.package_source().replace("    wgmma_commit_group();\n",
                                         '    printf("%f\\n", d[0]);\n    wgmma_commit_group();\n', 1)
    assert broken != hb.package_source()
    with pytest.raises(cuda_build.CudaBuildError, match=r"serialized.*wgmma_gemm_kernel"):
        hb.nvcc_compile_report(broken)


def test_the_lesson_regions_exist():
    regions = {name for path in hb.SOURCE.files().values() for name in module_regions(path)}
    assert {"mbarrier", "tma", "wgmma_descriptor", "wgmma", "tma_tile_kernel", "gemm_kernel", "tensor_map",
            "torch_entry_points", "tma_3d", "flash_params", "flash_tile_steps", "flash_v1_kernel", "flash_entry_point",
            "flash_ws_layout", "flash_ws_producer", "flash_v2_consumer", "flash_v3_consumer", "flash_v4_consumer",
            "flash_v4_turn", "flash_ws_kernel", "setmaxnreg",
            "named_barrier", "register_split_kernel", "named_barrier_kernel"} <= set(regions)


def test_the_build_names_the_mma_rung_on_a_gpu_that_is_not_hopper(monkeypatch):
    torch = pytest.importorskip("torch")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *args: (8, 0))
    with pytest.raises(RuntimeError, match=r"sm_80.*stage='mma'"):
        hb.build()


# ---------------------------------------------------------------------------------------------
# The mbarrier ring, modelled

@pytest.mark.parametrize("stages, consumers", [(1, 1), (2, 1), (3, 1), (2, 2), (4, 2)])
def test_a_correct_ring_finishes_under_every_interleaving(stages, consumers):
    result = br.simulate(stages=stages, tiles=11, consumers=consumers, seeds=range(30))
    assert sorted(result.reads) == sorted((f"consumer {c}", t) for c in range(consumers) for t in range(11))


@pytest.mark.parametrize("stages", [1, 2, 3])
def test_the_producer_runs_ahead_by_the_ring_depth_and_no_further(stages):
    """With copies slower than the loop around them, the producer fills every slot; the empty barriers stop it there."""
    aheads = [br.simulate(stages=stages, tiles=12, seeds=[seed], copy_delay=6).max_ahead for seed in range(10)]
    assert max(aheads) == stages


@pytest.mark.parametrize("options, error, words", [
    (dict(producer_options=dict(expect_bytes=16384 + 16)), br.Deadlock, "16 byte"),
    (dict(producer_options=dict(expect_bytes=16384 - 16)), br.Deadlock, "-16 byte"),
    (dict(producer_options=dict(empty_parity_flip=False)), br.Deadlock, "producer waits on empty[0] for parity 0"),
    (dict(consumer_options=dict(release=False)), br.Deadlock, "producer waits on empty[0]"),
    (dict(consumer_options=dict(flip_on_wrap=False)), br.Deadlock, "consumer 0 waits on full[0] for parity 0"),
    (dict(empty_count=2), br.Deadlock, "1 of 2 arrival"),
    (dict(consumer_options=dict(start_phase=1)), br.StaleRead, "holds nothing yet"),
], ids=["too-many-bytes", "too-few-bytes", "producer-parity", "no-release", "consumer-no-flip", "empty-count",
        "consumer-parity"])
def test_each_classic_mistake_raises_instead_of_hanging(options, error, words):
    with pytest.raises(error) as raised:
        br.simulate(**options)
    assert words in str(raised.value)


@pytest.mark.parametrize("version", [2, 3, 4])
@pytest.mark.parametrize("stages, tiles", [(2, 0), (2, 1), (2, 9), (3, 9), (4, 9), (3, 2)])
def test_v2_v3_v4_rings_finish_under_every_interleaving(version, stages, tiles):
    """The kernel's loops: the producer (Q, then the ring), 8 consumer warps each arriving on kv_empty; v3's warps
    also take turns through the two named barriers. No tiles at all (a block above the causal diagonal) too."""
    result = br.simulate_ws(version, stages, tiles, seeds=range(15))
    assert sorted(result.reads) == sorted((f"consumer {c} warp {w}", t) for c in range(2) for w in range(4)
                                          for t in range(tiles))


def test_v3_v4_need_two_slots_and_v2_does_not():
    """A v3 or v4 consumer holds a tile's slot until the next turn's P V: with one slot the producer can never refill
    it."""
    br.simulate_ws(2, 1, 5)
    for version in (3, 4):
        with pytest.raises(br.Deadlock, match="producer waits on empty"):
            br.simulate_ws(version, 1, 5)
    with pytest.raises(ValueError, match="v5"):
        br.simulate_ws(5, 3, 5)


@pytest.mark.parametrize("options, error, words", [
    (dict(version=3, consumer_options=dict(first_waits=True)), br.Deadlock, "consumer 0 warp 0 waits on turn[0]"),
    (dict(version=3, consumer_options=dict(last_arrives=True)), br.RingError, "generation open"),
    (dict(version=2, producer_tiles=6), br.Deadlock, "waits on full"),
    (dict(version=3, producer_tiles=8), br.RingError, "disagree on the tile count"),
    (dict(version=2, empty_count=2), br.RingError, ""),
    (dict(version=2, producer_options=dict(expect_bytes=65536 + 16)), br.Deadlock, "16 byte"),
], ids=["v3-both-wait-first", "v3-extra-arrival", "producer-fewer-tiles", "producer-more-tiles",
        "empty-counts-warpgroups", "too-many-bytes"])
def test_each_v2_v3_mistake_raises_instead_of_hanging(options, error, words):
    with pytest.raises(error) as raised:
        br.simulate_ws(stages=3, tiles=7, **options)
    assert words in str(raised.value)


def test_the_source_runs_the_modelled_ring():
    """The expressions of barrier_ring's loops and flash_ws_kernel's, side by side: changing one side fails this."""
    import inspect

    model, kernel = inspect.getsource(br), hb.package_source()
    for python, cuda in (
            ("yield Wait(ring.empty[stage], phase ^ 1 if empty_parity_flip else phase)",
             "mbarrier_wait(&kv_empty[stage], phase ^ 1);"),
            ("yield ArriveExpectTx(ring.full[stage], tile_bytes", "mbarrier_arrive_expect_tx(&kv_full[stage], 2 * KV_TILE_BYTES);"),
            ("yield Wait(ring.full[stage], phase)", "mbarrier_wait(&kv_full[stage], phase);"),
            ("if stage == ring.stages:", "if (++stage == STAGES) {"),
            ("yield Wait(ring.q_full, 0)", "mbarrier_wait(&q_full, 0);  // always, even without tiles"),
            ("yield ArriveExpectTx(ring.q_full, Q_BYTES)", "mbarrier_arrive_expect_tx(q_full, COLUMN_BLOCKS * Q_BLOCK_BYTES);"),
            ("ring = Ring(stages, consumers=8, empty_count=empty_count)", "constexpr int WS_EMPTY_ARRIVALS = 4 * WS_CONSUMERS;"),
            ("yield Arrive(ring.empty[stage])", "if (rows.lane == 0) mbarrier_arrive(&kv_empty[stage]);"),
            ("yield Arrive(ring.empty[held[0]])", "if (rows.lane == 0) mbarrier_arrive(&kv_empty[held]);"),
            ("if consumer_index == 1 or first_waits:", "if (consumer == 1) named_barrier_sync(my_turn, TURN_THREADS_V3);"),
            ("if consumer_index == 0 or last_arrives:", "if (consumer == 0) named_barrier_arrive(other_turn, TURN_THREADS_V3);"),
            ('self.turn = [NamedBarrier(f"turn[{c}]", 8) for c in range(2)]', "constexpr uint32_t TURN_THREADS_V3 = 2 * WARPGROUP;")):
        assert python in model, python
        assert cuda in kernel, cuda
    # v3 and v4: first turn (consumer 1), loop, last turn
    assert kernel.count("named_barrier_sync(my_turn, TURN_THREADS_V3);") == 6
    assert kernel.count("named_barrier_arrive(other_turn, TURN_THREADS_V3);") == 6


def test_a_producer_that_never_waits_is_caught():
    with pytest.raises(br.RingError):
        br.simulate(producer_options=dict(wait_empty=False))


def test_a_wait_on_the_previous_phase_returns_at_once():
    barrier = br.MBarrier("b", count=1)
    assert barrier.try_wait(1) and not barrier.try_wait(0)
    barrier.arrive(expect_bytes=100)
    assert not barrier.try_wait(0)  # one arrival in, 100 bytes missing
    barrier.complete_tx(100)
    assert barrier.try_wait(0) and not barrier.try_wait(1) and barrier.phase == 1


# ---------------------------------------------------------------------------------------------
# On a Hopper GPU, one subprocess per check, under a time limit

def test_a_failed_gpu_check_names_its_last_launch(monkeypatch, capsys):
    """A trap surfaces at the next synchronisation, maybe cases later: the report names the last case launched."""
    from wb_kernels.stages.hopper import gpu_checks

    def trapped():
        gpu_checks._running("gemm float16 64x64x16 SS, B K-major K=16")
        raise RuntimeError("CUDA error: unspecified launch failure\nCUDA kernel errors might be reported later")

    monkeypatch.setattr(gpu_checks, "CHECKS", {"fake": trapped, "fine": lambda: "all good"})
    assert gpu_checks.main(["fake", "fine"]) == 1
    lines = capsys.readouterr().out.splitlines()
    assert lines == ["CHECK fake FAILED (last launch: gemm float16 64x64x16 SS, B K-major K=16): RuntimeError: CUDA "
                     "error: unspecified launch failure CUDA kernel errors might be reported later",
                     "CHECK fine ok: all good"]


BUILD_SECONDS = 600  # a cold build: nvcc on torch's headers and every kernel, a minute or two


def _environment() -> dict:
    return dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])))


@pytest.fixture(scope="module")
def built_extension():
    """Build (or find in the cache) the extension once, in a subprocess of its own, so that the checks' time limits
    measure the kernels, not nvcc."""
    command = "from wb_kernels.stages.hopper import build; build.extension()"
    try:
        done = subprocess.run([sys.executable, "-c", command], cwd=REPO, env=_environment(), capture_output=True,
                              text=True, timeout=BUILD_SECONDS)
    except subprocess.TimeoutExpired:
        pytest.fail(f"building the hopper extension took over {BUILD_SECONDS} s")
    assert done.returncode == 0, done.stderr[-3000:]


def _run_gpu_check(name: str) -> str:
    limit = GPU_CHECK_SECONDS[name]
    env = _environment()
    try:
        done = subprocess.run([sys.executable, "-m", "wb_kernels.stages.hopper.gpu_checks", name], cwd=REPO, env=env,
                              capture_output=True, text=True, timeout=limit)
    except subprocess.TimeoutExpired as hung:
        pytest.fail(f"gpu check {name!r} did not finish in {limit} s (a barrier that never completes?); "
                    f"its output: {hung.stdout!r} {hung.stderr!r}")
    output = done.stdout + done.stderr[-3000:]
    assert done.returncode == 0 and f"CHECK {name} ok" in done.stdout, output
    return done.stdout


@needs_hopper
@pytest.mark.parametrize("name", list(GPU_CHECK_SECONDS))
def test_on_the_gpu(name, built_extension):
    print(_run_gpu_check(name))


def test_a_producer_that_waits_on_the_full_barrier_overwrites_a_slot_still_being_read():
    """A slot is being read from a consumer's Read until its arrive on the slot's empty barrier: with consumers that
    compute on a tile for a few steps (read_ticks), a producer that waits for the previous lap's tile to land (the
    full barrier, as the consumers wait) instead of for its release lands the next tile on it; the ring's own
    producer never does, with the same consumers."""
    from wb_kernels.stages.hopper import exercises

    def agents(ring, make_producer):
        return {"producer": make_producer(ring, 7, 16384), "consumer 0": br.consumer(ring, 7)}

    with pytest.raises(br.Overwrite, match="had not yet released"):
        for seed in range(5):
            ring = br.Ring(1)
            br.run_agents(ring, agents(ring, exercises._waits_on_full), seed=seed, read_ticks=4)
    for seed in range(5):
        ring = br.Ring(2)
        result = br.run_agents(ring, agents(ring, br.producer), seed=seed, read_ticks=4)
        assert [tile for _, tile in result.reads] == list(range(7))
