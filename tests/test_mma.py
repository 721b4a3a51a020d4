"""Rung mma (lesson 06). On the CPU: the NumPy models the lesson derives the kernel from.

- ``fragments``: mma.sync's register layouts and ldmatrix, against plain matrix products;
- ``swizzle``: the shared-memory banks an ldmatrix phase hits in each layout, and the swizzle's address arithmetic;
- ``warp_model``: the kernel's arithmetic register by register, held to the float64 reference with ``wb.check``
  (shapes, lengths that are not tile multiples, Lq != Lk, L = 1, masks, rows without keys, fp16 and bf16);
- the lesson's figures and slider (its exercises and puzzle: tests/test_exercises.py).

The kernel itself (``flash_mma.cu``): GPU tests (skipped on the simulator) hold it to the float64 reference with
wb.check's rule over shapes, dtypes, head dims, masks and every launch variant; the compile check needs only nvcc
(every variant for sm_80 and sm_90, and the key loop's machine code: tensor-core products and ldmatrix, no plain
shared-memory load or store, against lesson 05's WMMA kernel). In CI a missing nvcc or cuobjdump fails those tests.
"""

from __future__ import annotations

import json

import numpy as np
import pytest

import wb_kernels as wb
from wb_kernels import cuda_build
from wb_kernels.stages.mma import build as mma_build
from wb_kernels.stages.mma import fragments as fr
from wb_kernels.stages.mma import slider
from wb_kernels.stages.mma import swizzle as sw
from wb_kernels.stages.mma import warp_model as wm
from wb_kernels.stages.mma.launcher import DEFAULT_VARIANT
from wb_kernels.stages.wmma import build as wmma_build
from wb_kernels.stages.wmma.fragment_model import fragment_model, ulp
from wb_kernels.lesson_sync import module_regions
from stage_cases import (CUDA_GPU_SHAPES, check_bottom_right_rows_without_keys, check_cuda_gqa_case, check_cuda_stage,
                         check_rows_without_keys, cuda_gqa_parameters, tool_or_skip)

torch = pytest.importorskip("torch")

needs_gpu = pytest.mark.skipif(
    wb.BACKEND.is_simulator,
    reason="the mma.sync kernel needs a CUDA GPU (sm_80+) and a CUDA build of torch; this machine runs the simulator")

rng = np.random.default_rng(0)


@pytest.mark.parametrize("coords, shape", [(fr.a_coords, (16, 16)), (fr.b_coords, (16, 8)), (fr.c_coords, (16, 8))])
def test_every_element_is_held_by_exactly_one_register(coords, shape):
    held = [rc for lane in range(32) for rc in coords(lane)]
    assert sorted(held) == [(r, c) for r in range(shape[0]) for c in range(shape[1])]


def test_the_model_multiplies_like_numpy():
    a, b, c = rng.standard_normal((16, 16)), rng.standard_normal((16, 8)), rng.standard_normal((16, 8))
    d = fr.mma_m16n8k16(fr.distribute(a, fr.a_coords), fr.distribute(b, fr.b_coords), fr.distribute(c, fr.c_coords))
    np.testing.assert_allclose(fr.gather(d, fr.c_coords, (16, 8)), a @ b + c, rtol=1e-12)


def test_a_row_of_the_accumulator_lives_in_one_group_of_four_lanes():
    """So a row's max (or sum) is two shuffles: xor 1 and xor 2 within the group."""
    for row in range(16):
        lanes = {lane for lane in range(32) for r, _ in fr.c_coords(lane) if r == row}
        assert len(lanes) == 4 and len({lane // 4 for lane in lanes}) == 1
        assert {lane ^ 1 for lane in lanes} == lanes and {lane ^ 2 for lane in lanes} == lanes


def test_ldmatrix_x4_delivers_the_a_fragment():
    tile = rng.standard_normal((16, 16))
    np.testing.assert_array_equal(fr.ldmatrix_x4(tile), fr.distribute(tile, fr.a_coords))


def test_the_accumulator_of_s_is_the_a_operand_of_p_v():
    """S (16 x 16) is two 16 x 8 mma results; their C fragments, side by side in each lane, are exactly the A
    fragment of the 16 x 16 tile: P = f(S) elementwise can feed the next mma without leaving registers."""
    s = rng.standard_normal((16, 16))
    left, right = fr.distribute(s[:, :8], fr.c_coords), fr.distribute(s[:, 8:], fr.c_coords)
    np.testing.assert_array_equal(fr.accumulator_as_a_operand(left, right), fr.distribute(s, fr.a_coords))
    # and the product with V, from those registers, is P V
    p = np.exp(s - s.max(axis=1, keepdims=True))
    v = rng.standard_normal((16, 8))
    pv = fr.mma_m16n8k16(fr.distribute(p, fr.a_coords), fr.distribute(v, fr.b_coords), np.zeros((32, 4)))
    np.testing.assert_allclose(fr.gather(pv, fr.c_coords, (16, 8)), p @ v, rtol=1e-12)


def test_fragments_take_a_batch_of_warps_and_tiles():
    """The warp model moves whole batches of fragments at once: a batch must equal one instruction at a time."""
    a, b, c = rng.standard_normal((3, 1, 16, 16)), rng.standard_normal((5, 16, 8)), rng.standard_normal((3, 5, 16, 8))
    d = fr.mma_m16n8k16(fr.distribute(a, fr.a_coords), fr.distribute(b, fr.b_coords), fr.distribute(c, fr.c_coords))
    assert d.shape == (3, 5, 32, 4)
    np.testing.assert_allclose(fr.gather(d, fr.c_coords, (16, 8)), a @ b + c, rtol=1e-12)


@pytest.mark.parametrize("trans", [False, True])
def test_ldmatrix_gives_each_lane_pieces_of_other_lanes_rows(trans):
    """Each lane points at one 16-byte row; lane l receives row l // 4 (or, transposed, column l // 4) of each
    8 x 8 matrix: the PTX ISA's ldmatrix fragment layout."""
    shared = rng.standard_normal(32 * 8)
    offsets = rng.permutation(32) * 8  # any row addresses, lane by lane
    received = fr.ldmatrix(shared, offsets, trans=trans)
    for lane in range(32):
        for i in range(4):
            matrix = np.stack([shared[offsets[8 * i + r]:offsets[8 * i + r] + 8] for r in range(8)])
            if trans:
                matrix = matrix.T
            np.testing.assert_array_equal(received[lane, 2 * i:2 * i + 2], matrix[lane // 4, 2 * (lane % 4):][:2])


# ---------------------------------------------------------------------------------------------
# the shared-memory layouts

@pytest.mark.parametrize("head_dim", [64, 128])
def test_plain_rows_conflict_8_ways_and_padding_and_swizzle_do_not(head_dim):
    summary = {row["layout"]: row for row in sw.layout_summary(head_dim)}
    assert {name: row["wavefronts"] for name, row in summary.items()} == {"plain": 8, "padded": 1, "swizzled": 1}
    # the swizzle costs nothing; the padding costs one chunk per row and the 128-byte alignment of rows
    assert summary["swizzled"]["tile_bytes"] == summary["plain"]["tile_bytes"] == 64 * head_dim * 2
    assert summary["padded"]["tile_bytes"] == 64 * (head_dim + 8) * 2
    assert [summary[name]["rows_128_byte_aligned"] for name in sw.LAYOUTS] == [True, False, True]


@pytest.mark.parametrize("head_dim", [64, 128])
def test_swizzle_permutes_chunks_within_each_row(head_dim):
    chunks = head_dim // 8
    for row in range(64):
        offsets = [sw.swizzled_offset(row, chunk, head_dim) for chunk in range(chunks)]
        assert sorted(offsets) == [row * head_dim + 8 * c for c in range(chunks)]
    tile = rng.standard_normal((64, head_dim))
    shared = sw.store_tile(tile)
    assert sorted(shared) == sorted(tile.ravel())  # dense: nothing added, nothing lost
    np.testing.assert_array_equal(shared[sw.swizzled_offset(13, 5, head_dim) + np.arange(8)], tile[13, 40:48])


def test_bank_groups_of_one_phase():
    """The figure's numbers: a chunk column of 8 rows in one bank group (plain) or in all 8 (padded, swizzled)."""
    for layout, expected in (("plain", 1), ("padded", 8), ("swizzled", 8)):
        groups = sw.bank_groups(layout, 128)
        assert all(len(set(groups[:, c])) == expected for c in range(16)), layout
    assert sw.draw_banks(64).axes and sw.draw_banks(128).axes


def test_swizzle_refuses_rows_too_short_to_swizzle():
    with pytest.raises(ValueError, match="multiple of 64"):
        sw.store_tile(np.zeros((8, 32)))
    with pytest.raises(ValueError, match="layout"):
        sw.row_stride_bytes("diagonal", 64)


# ---------------------------------------------------------------------------------------------
# the warp model: the kernel's arithmetic, register by register

def as_torch(array, dtype):
    return torch.from_numpy(np.ascontiguousarray(array)).to(getattr(torch, dtype))


@pytest.mark.parametrize("head_dim", [64, 128])
def test_ldmatrix_addresses_deliver_the_operands(head_dim):
    """Q's A fragments, K's B fragments (S = Q Kᵀ) and V's B fragments (.trans, O = P V) from the swizzled tiles."""
    q, k, v = rng.standard_normal((16, head_dim)), rng.standard_normal((64, head_dim)), rng.standard_normal((64, head_dim))
    for k_step in range(head_dim // 16):
        cols = slice(16 * k_step, 16 * k_step + 16)
        np.testing.assert_array_equal(fr.ldmatrix(sw.store_tile(q), wm.q_addresses(k_step, head_dim)),
                                      fr.distribute(q[:, cols], fr.a_coords))
        for pair in range(4):
            got = fr.ldmatrix(sw.store_tile(k), wm.k_addresses(pair, k_step, head_dim))
            for half in range(2):
                keys = slice(16 * pair + 8 * half, 16 * pair + 8 * half + 8)
                np.testing.assert_array_equal(got[:, 4 * half:4 * half + 4], fr.distribute(k[keys, cols].T, fr.b_coords))
    for key_step in range(4):
        for dim_pair in range(head_dim // 16):
            got = fr.ldmatrix(sw.store_tile(v), wm.v_addresses(key_step, dim_pair, head_dim), trans=True)
            for half in range(2):
                dims = slice(16 * dim_pair + 8 * half, 16 * dim_pair + 8 * half + 8)
                np.testing.assert_array_equal(got[:, 4 * half:4 * half + 4],
                                              fr.distribute(v[16 * key_step:16 * key_step + 16, dims], fr.b_coords))


def test_rows_of_accumulators_in_key_order():
    frags = rng.standard_normal((3, 8, 32, 4))
    rows = wm.rows_of_accumulators(frags)
    np.testing.assert_array_equal(wm.accumulators_of_rows(rows), frags)
    s = np.concatenate([fr.gather(frags[1, n], fr.c_coords, (16, 8)) for n in range(8)], axis=1)
    np.testing.assert_array_equal(rows[1], s[wm.ROW_OF_LANE[:, :, None], wm.KEY_OF_LANE[:, None, :]])


def test_quad_shuffles_reduce_each_row():
    values = rng.standard_normal((2, 32, 2))
    with wm.counting() as counts:
        total = wm.quad_allreduce(values, np.add)
    expected = values.reshape(2, 8, 4, 2).sum(axis=2)
    np.testing.assert_allclose(total, np.repeat(expected, 4, axis=1), rtol=1e-12)
    assert counts["shfl.sync.bfly"] == 2 * 2 * 2  # two rows per lane, two shuffles each, two warps
    np.testing.assert_array_equal(wm.shuffle_xor(np.arange(32)[:, None], 3)[:, 0], np.arange(32) ^ 3)


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("B, H, Lq, Lk, D, causal, padded", [
    (1, 1, 1, 1, 64, False, False), (2, 1, 100, 77, 64, True, True), (1, 2, 130, 200, 128, False, True),
    (1, 1, 65, 64, 128, True, False), (2, 2, 64, 129, 64, False, False), (1, 1, 200, 70, 64, True, True),
])
def test_warp_model_meets_the_tolerance_rule(dtype, B, H, Lq, Lk, D, causal, padded):
    q, k, v = wb.random_qkv(B, H, Lq, D, Lk=Lk, dtype=dtype, framework="torch", seed=Lq * 7 + Lk)
    mask = wb.random_padding_mask(B, Lk, seed=Lk) if padded else None
    out, lse = wm.forward(q, k, v, dtype=dtype, causal=causal, key_padding_mask=mask)
    wb.check(f"warp model {dtype}", as_torch(out, dtype), q, k, v, lse=torch.from_numpy(lse), causal=causal,
             key_padding_mask=mask)


def test_rows_without_keys_give_zero_and_minus_inf_and_late_first_keys_are_exact():
    q, k, v = wb.random_qkv(2, 1, 100, 64, dtype="float16", framework="torch", seed=4)
    keep = torch.ones(2, 100, dtype=torch.bool)
    keep[0, :5] = False    # causal: rows 0-4 of batch 0 see no key at all
    keep[1, :70] = False   # batch 1 sees its first key in the second tile: m = -inf through the first
    out, lse = wm.forward(q, k, v, causal=True, key_padding_mask=keep)
    assert np.all(out[0, 0, :5] == 0) and np.all(lse[0, 0, :5] == -np.inf)
    assert np.all(out[1, 0, :70] == 0) and np.isfinite(lse[1, 0, 70:]).all()
    wb.check("empty rows", as_torch(out, "float16"), q, k, v, lse=torch.from_numpy(lse), causal=True,
             key_padding_mask=keep)


def test_a_nan_at_a_masked_key_does_not_leak():
    """Masked scores are replaced (selected), not offset by -inf: NaN + -inf would be NaN."""
    q, k, v = wb.random_qkv(1, 1, 40, 64, Lk=90, dtype="float16", framework="torch", seed=8)
    keep = torch.ones(1, 90, dtype=torch.bool)
    keep[0, 80:] = False
    k_poisoned = k.clone()
    k_poisoned[0, 0, 85] = float("nan")
    clean = wm.forward(q, k, v, key_padding_mask=keep)
    poisoned = wm.forward(q, k_poisoned, v, key_padding_mask=keep)
    np.testing.assert_array_equal(poisoned[0], clean[0])
    np.testing.assert_array_equal(poisoned[1], clean[1])


def test_warp_model_agrees_with_lesson_05s_model_to_rounding():
    """Same rounding points as the WMMA kernel's model: outputs within one ulp of each other, most identical."""
    q, k, v = wb.random_qkv(1, 2, 150, 128, Lk=170, dtype="bfloat16", framework="torch", seed=2)
    ours, ours_lse = wm.forward(q, k, v, dtype="bfloat16", causal=True)
    theirs, theirs_lse = fragment_model(q, k, v, dtype="bfloat16", causal=True)
    assert np.all(np.abs(ours - theirs) <= ulp(np.maximum(np.abs(theirs), 1e-3), "bfloat16"))
    assert np.mean(ours == theirs) > 0.9
    np.testing.assert_allclose(ours_lse, theirs_lse, rtol=1e-5)


def test_the_model_refuses_head_dims_the_swizzle_cannot_take():
    q, k, v = wb.random_qkv(1, 1, 8, 32, seed=0)
    with pytest.raises(ValueError, match="multiple of 64"):
        wm.forward(q, k, v)


@pytest.mark.parametrize("head_dim", [64, 128])
def test_instructions_per_warp_and_key_tile(head_dim):
    counts = wm.instruction_counts(head_dim)
    per_tile, once = counts["per key tile"], counts["once"]
    assert per_tile["mma.sync (S = Q K^T)"] == (64 // 8) * (head_dim // 16)
    assert per_tile["mma.sync (O += P V)"] == (head_dim // 8) * (64 // 16)
    assert per_tile["ldmatrix.x4 (K)"] == per_tile["ldmatrix.x4.trans (V)"] == 64 * head_dim // 256
    assert per_tile["shfl.sync.bfly"] == 4 and once["shfl.sync.bfly"] == 4  # row max per tile; row sum once
    assert once["ldmatrix.x4 (Q, once)"] == head_dim // 16
    registers = wm.registers_per_lane(head_dim)
    assert registers["O accumulators (fp32)"] * 32 == 16 * head_dim


# ---------------------------------------------------------------------------------------------
# the lesson's figures, slider and exercises

@pytest.mark.parametrize("lane", [0, 5, 31])
def test_a_lane_holds_its_share_of_every_matrix(lane):
    held = {name: h for name, (h, _) in slider.lane_holdings(lane, 64).items()}
    sizes = {"Q": 16 * 64, "K": 64 * 64, "S": 16 * 64, "P": 16 * 64, "V": 64 * 64, "O": 16 * 64}
    assert {name: int(h.sum()) for name, h in held.items()} == {name: n // 32 for name, n in sizes.items()}
    np.testing.assert_array_equal(held["S"], held["P"])  # P stays where S was computed
    rows = {lane // 4, lane // 4 + 8}
    for name in ("Q", "S", "P", "O"):
        assert set(np.nonzero(held[name])[0]) == rows
    assert slider.draw_lane(lane).axes


def test_the_lanes_together_hold_every_element_once():
    holdings = [slider.lane_holdings(lane, 128) for lane in range(32)]
    for name in ("Q", "K", "S", "V", "O"):
        assert np.all(sum(h[name][0].astype(int) for h in holdings) == 1), name


def test_accumulator_reuse_figure_and_traffic():
    assert slider.draw_accumulator_reuse()._suptitle.get_text().endswith("True")
    for head_dim in (64, 128):
        one, two = slider.traffic_per_tile(head_dim), slider.traffic_per_tile(head_dim, row_tiles=2)
        assert one["shared bytes"] == 2 * 64 * head_dim * 2  # K and V once each, nothing else per tile
        assert two["FLOPs per shared byte"] == 2 * one["FLOPs per shared byte"]
    assert slider.balance_points()["H100 (sm_90)"] == 2 * slider.balance_points()["A100 (sm_80)"]


# ---------------------------------------------------------------------------------------------
# CPU: registration, errors, regions


def test_stage_is_registered():
    stage = wb.get_stage("mma")
    assert (stage.order, stage.lesson, stage.needs_gpu, stage.linear_memory) == (6, "06_mma", True, True)
    assert stage.dtypes == ("float16", "bfloat16") and stage.head_dims == (64, 128)


@pytest.mark.parametrize("dtype, D, device, error, words", [
    ("float16", 64, "cpu", ValueError, "CUDA"),
    ("float32", 64, "cpu", ValueError, "CUDA"),
    pytest.param("float32", 64, "cuda", TypeError, "float16, bfloat16", marks=needs_gpu),
    pytest.param("float16", 96, "cuda", ValueError, "[64, 128]", marks=needs_gpu),
])
def test_clear_errors_for_what_the_kernel_cannot_take(dtype, D, device, error, words):
    q, k, v = wb.random_qkv(1, 1, 8, D, dtype=dtype, framework="torch", device=device)
    with pytest.raises(error) as raised:
        wb.attention(q, k, v, stage="mma")
    assert words in str(raised.value)


def test_the_lesson_regions_exist():
    regions = module_regions(mma_build.SOURCE.path)
    assert {"flash_params", "mma_and_ldmatrix", "swizzle", "async_tile_copy", "online_softmax_fragments", "layout",
            "non_finite_queries", "kernel_setup", "kernel_prologue", "kernel_loop_scores", "kernel_loop_softmax",
            "kernel_loop_pv", "kernel_epilogue", "variants", "torch_launch_variant", "torch_entry_point"} == set(regions)
    # the kernel's pieces, in file order, are the whole kernel: every line from its template line to its closing
    # brace lies in one of them
    source = mma_build.package_source()
    start = source.index("// region: kernel_setup")
    body = source[start:source.index("\n}\n", start) + 2].splitlines()
    outside = [line for line in body if line.strip() and "// region:" not in line and "// endregion" not in line]
    pieces = "\n".join(regions[name] for name in ("kernel_setup", "kernel_prologue", "kernel_loop_scores",
                                                  "kernel_loop_softmax", "kernel_loop_pv", "kernel_epilogue"))
    assert outside == [line for line in pieces.splitlines() if line.strip()] and outside[-1] == "}"


def test_variants_match_the_source():
    """build.VARIANTS and WB_FOR_EACH_MMA_VARIANT in flash_mma.cu list the same launch variants."""
    import re

    source = mma_build.package_source()
    listed = re.search(r"#define WB_FOR_EACH_MMA_VARIANT\(X\)(.*?)\n\n", source, re.S).group(1)
    found = [mma_build.Variant(int(d), int(w), int(rt), int(bn), qr == "true")
             for d, w, rt, bn, qr in re.findall(r"X\((\d+), (\d+), (\d+), (\d+), (true|false)\)", listed)]
    assert found == list(mma_build.VARIANTS)
    assert set(DEFAULT_VARIANT.values()) <= set(mma_build.VARIANTS)


def test_shared_memory_has_no_padding():
    v = mma_build.Variant(128, 4, 1, 64, True)
    assert mma_build.shared_memory_bytes(v) == 64 * 128 * 2 + 2 * 2 * 64 * 128 * 2
    for variant in mma_build.VARIANTS:
        assert mma_build.shared_memory_bytes(variant) <= 227 * 1024


def test_instruction_counts_leave_out_never_executed_loads():
    lines = ["HMMA.16816.F32 R0, R4, R8, R0 ;", "@!PT LDS RZ, [RZ] ;", "LDS.128 R4, [R2] ;", "STS [R1], R2 ;",
             "LDSM.16.M88.4 R4, [R3] ;", "LDSM.16.MT88.4 R8, [R3] ;", "HMMA.16816.F32 R0, R4, R8, R0 ;",
             "STS.64 [R3], R4 ;"]
    assert mma_build.key_loop_counts(lines) == {"HMMA": 2, "LDSM": 2, "LDS": 1, "STS": 1}
    assert mma_build.instruction_counts(lines)["STS"] == 2


# ---------------------------------------------------------------------------------------------
# GPU: the kernel


@needs_gpu
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("D", [64, 128])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("padded", [False, True])
@pytest.mark.parametrize("shape", CUDA_GPU_SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_kernel_meets_the_tolerance_rule(dtype, D, causal, padded, shape):
    check_cuda_stage("mma", dtype, D, causal, padded, shape)


@needs_gpu
@pytest.mark.parametrize("variant", mma_build.VARIANTS, ids=lambda v: v.label.replace(" ", "_"))
def test_every_launch_variant(variant):
    from wb_kernels.stages.mma import launcher as stage

    D = variant.head_dim
    for dtype in ("float16", "bfloat16"):
        q, k, v = wb.random_qkv(2, 2, 300, D, Lk=333, dtype=dtype, framework="torch", device="cuda", seed=5)
        mask = wb.random_padding_mask(2, 333, seed=1, framework="torch", device="cuda")
        for causal in (False, True):
            for key_padding_mask in (None, mask):
                out, lse = stage.forward(q, k, v, causal=causal, key_padding_mask=key_padding_mask, variant=variant)
                wb.check(f"mma {variant.label} {dtype}", out, q, k, v, lse=lse, causal=causal,
                         key_padding_mask=key_padding_mask)


@needs_gpu
@cuda_gqa_parameters
def test_kernel_gqa_and_causal_alignments(dtype, D, causal, padded, case):
    """K/V heads read in place by H // Hk query heads (kv_group), and the causal mask at either corner
    (causal_offset): tile skipping, inactive warps, which tiles need masks and the per-score test all move with it."""
    check_cuda_gqa_case("mma", dtype, D, causal, padded, case)


@needs_gpu
@pytest.mark.parametrize("variant", mma_build.VARIANTS, ids=lambda v: v.label.replace(" ", "_"))
def test_every_launch_variant_gqa_bottom_right(variant):
    """Each variant's block, warp and key-tile sizes place the bottom-right diagonal differently: Lq < Lk and
    Lq > Lk, with and without padding."""
    from wb_kernels.stages.mma import launcher as stage

    D = variant.head_dim
    for Lq, Lk in ((300, 333), (333, 150)):
        q, k, v = wb.random_qkv(2, 4, Lq, D, Lk=Lk, dtype="float16", framework="torch", device="cuda", seed=Lq)
        k, v = k[:, :2].contiguous(), v[:, :2].contiguous()
        mask = wb.random_padding_mask(2, Lk, seed=1, framework="torch", device="cuda")
        for key_padding_mask in (None, mask):
            out, lse = stage.forward(q, k, v, causal="bottom_right", key_padding_mask=key_padding_mask,
                                     variant=variant)
            wb.check(f"mma {variant.label} Lq={Lq} Lk={Lk} GQA bottom-right", out, q, k, v, lse=lse,
                     causal="bottom_right", key_padding_mask=key_padding_mask)


@needs_gpu
def test_kernel_rows_without_keys_give_zero_and_minus_inf():
    check_rows_without_keys("mma")


@needs_gpu
def test_kernel_bottom_right_rows_without_keys_give_zero_and_minus_inf():
    check_bottom_right_rows_without_keys("mma")


@needs_gpu
@pytest.mark.parametrize("scale", [-0.3, 0.0, 2.5])
def test_any_finite_scale(scale):
    """The kernel tracks row maxima of raw scores; the launcher makes a negative scale a positive one."""
    q, k, v = wb.random_qkv(2, 2, 100, 64, Lk=150, dtype="float16", framework="torch", device="cuda", seed=9)
    for causal in (False, True):
        out, lse = wb.attention(q, k, v, stage="mma", causal=causal, scale=scale, return_lse=True)
        wb.check(f"mma scale={scale}", out, q, k, v, lse=lse, causal=causal, scale=scale)


@needs_gpu
def test_large_problem_against_sdpa():
    """A benchmark-sized problem: several key tiles per block, many blocks, both masks' fast paths."""
    q, k, v = wb.random_qkv(2, 8, 2048, 128, dtype="float16", framework="torch", device="cuda", seed=4)
    for causal in (False, True):
        out = wb.attention(q, k, v, stage="mma", causal=causal)
        wb.check("mma 2x8x2048x128", out, q, k, v, causal=causal)


@needs_gpu
def test_build_is_cached_and_compile_errors_are_readable():
    first = mma_build.build(mma_build.package_source())
    assert mma_build.build(mma_build.package_source()) is first
    broken = mma_build.package_source().replace("sum += p;", "summ += p;")
    with pytest.raises(cuda_build.CudaBuildError) as raised:
        mma_build.build(broken)
    message = str(raised.value)
    assert "summ" in message and "error" in message and len(message.splitlines()) < 40
    assert "flash_mma.cu(" in message


# ---------------------------------------------------------------------------------------------
# The compile check without a GPU (nvcc alone; CI runs it)

ARCHES = ["sm_80", "sm_90"]


@pytest.fixture(scope="module")
def reports():
    tool_or_skip(cuda_build.find_nvcc, "the mma kernel's compile check")
    return {arch: mma_build.nvcc_compile_report(arch, source=mma_build.package_source()) for arch in ARCHES}


@pytest.mark.parametrize("arch", ARCHES)
def test_every_variant_compiles(reports, arch):
    report = reports[arch]
    assert {(r.dtype, r.variant) for r in report} == {(dtype, v) for dtype in ("float16", "bfloat16")
                                                      for v in mma_build.VARIANTS}
    for kernel in report:
        assert 0 < kernel.registers <= 255 and kernel.shared_bytes <= 227 * 1024, kernel


@pytest.mark.parametrize("arch", ARCHES)
def test_default_variants_spill_at_most_a_few_bytes(reports, arch):
    """The defaults hold 32 rows of O and S per warp in 255 registers. nvcc 13 for sm_90 spilled 8 bytes per thread
    at D = 64 (none since the causal offset came in) and that variant is still the fastest measured (NOTES.md); more
    than 16 would be a regression."""
    for kernel in reports[arch]:
        if kernel.variant == DEFAULT_VARIANT[kernel.variant.head_dim]:
            assert kernel.spill_stores <= 16 and kernel.spill_loads <= 16, kernel


@pytest.mark.parametrize("arch", ARCHES)
@pytest.mark.parametrize("dtype, mnemonic", [("float16", "HMMA.16816.F32"), ("bfloat16", "HMMA.16816.F32.BF16")])
def test_key_loop_keeps_s_and_p_in_registers(reports, arch, dtype, mnemonic):
    """The lesson's claim, in the machine code: per key tile, tensor-core products and ldmatrix, and not one plain
    shared-memory load or store between the first product and the last; lesson 05's loop has both."""
    tool_or_skip(cuda_build.find_cuobjdump, "the mma kernel's machine-code check")
    for D in (64, 128):
        variant = DEFAULT_VARIANT[D]
        lines = mma_build.sass(variant, arch, dtype=dtype, source=mma_build.package_source())
        hmma = [line for line in lines if "HMMA." in line]
        # per key tile and 16 rows: S is (BLOCK_N / 8) x (D / 16) m16n8k16 products, P V (D / 8) x (BLOCK_N / 16)
        assert len(hmma) == variant.row_tiles * 2 * (variant.block_n // 8) * (D // 16), (D, len(hmma))
        assert all(line.split()[0] == mnemonic for line in hmma), hmma[:3]
        counts = mma_build.key_loop_counts(lines)
        assert counts["LDSM"] > 0 and counts["LDS"] == 0 and counts["STS"] == 0, counts
    num_warps, q_in_registers, row_frags = (4, False, 1)
    wmma_lines = wmma_build.sass(arch, dtype=dtype, head_dim=128, num_warps=num_warps, q_in_registers=q_in_registers,
                                 row_frags=row_frags, source=wmma_build.package_source(), pattern="")
    wmma_counts = mma_build.key_loop_counts(wmma_lines)
    assert wmma_counts["STS"] > 0 and wmma_counts["LDS"] > 0, wmma_counts


def test_a_broken_source_fails_with_the_compilers_message():
    tool_or_skip(cuda_build.find_nvcc, "the mma kernel's compile check")
    broken = mma_build.package_source().replace("sum += p;", "summ += p;")
    with pytest.raises(cuda_build.CudaBuildError) as raised:
        mma_build.nvcc_compile_report("sm_90", source=broken)
    message = str(raised.value)
    assert 'identifier "summ" is undefined' in message and len(message.splitlines()) < 20


# --- the profile (python -m wb_kernels.stages.mma.profile): ncu's output parsed on the CPU --------------------------

_NCU_HEADER = ('"ID","Process ID","Process Name","Host Name","Kernel Name","Context","Stream","Block Size",'
               '"Grid Size","Device","CC","Section Name","Metric Name","Metric Unit","Metric Value"')


def _ncu_row(launch, kernel, metric, unit, value):
    return (f'"{launch}","4242","python3","127.0.0.1","{kernel}","1","7","(128, 1, 1)","(32, 64, 1)","0","9.0",'
            f'"Command line profiler metrics","{metric}","{unit}","{value}"')


def _fake_ncu_output(kernel="void wb::flash_mma_kernel<__half, 128, 4, 2, 64, false>(wb::FlashParams)"):
    """What ``ncu --csv --print-units base`` prints for one call that launched a small helper and the attention
    kernel: the program's own lines first, then the table (values as ncu writes them: with thousands separators,
    units to scale, and an n/a)."""
    rows = [_ncu_row(0, "void at::native::fill_kernel<float>()", "gpu__time_duration.sum", "nsecond", "2,016")]
    for metric, unit, value in [
            ("gpu__time_duration.sum", "nsecond", "1,670,752"),
            ("launch__registers_per_thread", "register/thread", "255"),
            ("sm__warps_active.avg.pct_of_peak_sustained_active", "%", "12.41"),
            ("sm__pipe_tensor_op_hmma_cycles_active.avg.pct_of_peak_sustained_active", "%", "52.3"),
            ("sm__pipe_tensor_op_gmma_cycles_active.avg.pct_of_peak_sustained_active", "%", "0"),
            ("sm__sass_data_bytes_mem_shared.sum", "byte", "25,898,929,056"),
            ("l1tex__data_bank_conflicts_pipe_lsu_mem_shared.sum", "", "227,004"),
            ("dram__bytes_read.sum", "Mbyte", "512.5"),
            ("dram__bytes_write.sum", "byte", "67,108,864"),
            ("smsp__average_warp_latency_issue_stalled_math_pipe_throttle.ratio", "", "3.1"),
            ("smsp__average_warp_latency_issue_stalled_short_scoreboard.ratio", "", "1.7"),
            ("smsp__average_warp_latency_issue_stalled_barrier.ratio", "", "2.4"),
            ("smsp__average_warp_latency_issue_stalled_selected.ratio", "", "1.0"),
            ("launch__occupancy_limit_registers", "block", "n/a")]:
        rows.append(_ncu_row(1, kernel, metric, unit, value))
    return "\n".join(["==PROF== Connected to process 4242", "wb_ncu_environment " + json.dumps(
        {"gpu": "NVIDIA H100 80GB HBM3", "date": "2026-11-25T12:00:00Z", "git_commit": "abc1234"}),
                      "==PROF== Disconnected from process 4242", _NCU_HEADER, *rows]) + "\n"


def test_profile_parses_ncu_csv_picks_the_attention_kernel_and_ranks_the_stalls():
    from wb_kernels.stages.mma import profile

    kernels = profile.parse_ncu_csv(_fake_ncu_output())
    assert [k["id"] for k in kernels] == ["0", "1"]
    main = profile.main_kernel(kernels)
    assert "flash_mma_kernel" in main["name"]
    m = main["metrics"]
    assert m["gpu__time_duration.sum"] == pytest.approx(1.670752e-3)  # nanoseconds -> seconds
    assert m["dram__bytes_read.sum"] == pytest.approx(512.5e6)  # Mbyte -> bytes
    assert m["sm__sass_data_bytes_mem_shared.sum"] == 25898929056.0
    assert m["launch__occupancy_limit_registers"] == "n/a"  # kept as text, not a crash
    run = {"problem": {"flops": 549755813888.0, "B": 4, "H": 16, "L": 4096, "D": 128}, "kernel": main["name"],
           "metrics": {name: m.get(name) for name in profile.METRICS}}
    s = profile.summary(run)
    assert s["tflops"] == pytest.approx(549755813888.0 / 1.670752e-3 / 1e12)
    assert s["registers_per_thread"] == 255 and s["achieved_occupancy_pct"] == 12.41
    assert s["tensor_pipe_pct"] == 52.3  # the generic tensor metric is missing: the busiest named pipe
    assert s["dram_bytes"] == pytest.approx(512.5e6 + 67108864)
    assert [reason for reason, _ in s["top_stalls"]] == ["math_pipe_throttle", "barrier", "short_scoreboard"]
    assert s["top_stalls"][0][1] == pytest.approx(3.1 / (3.1 + 1.7 + 2.4 + 1.0))  # a share of the warp's cycles
    assert s["issuing_share"] == pytest.approx(1.0 / 8.2)
    assert s["theoretical_occupancy_pct"] is None  # not measured: None, not a crash
    with pytest.raises(ValueError, match="no ncu CSV table"):
        profile.parse_ncu_csv("==ERROR== the application returned an error code (1)")


def test_profile_names_metrics_ncu_does_not_know_instead_of_failing():
    from wb_kernels.stages.mma import profile

    query = "\n".join(["Device NVIDIA H100 80GB HBM3 (GH100)", "-" * 20, "Metric Name   Metric Type  Metric Unit",
                       "dram__bytes_read              Counter      byte   # of bytes read from DRAM",
                       "dram__bytes_write             Counter      byte   # of bytes written to DRAM",
                       "sm__pipe_tensor_op_hmma_cycles_active  Counter  cycle  # of cycles where HMMA was active"])
    known = profile.known_metric_bases(query)
    assert known == {"dram__bytes_read", "dram__bytes_write", "sm__pipe_tensor_op_hmma_cycles_active"}
    unknown = profile.unknown_metrics(profile.METRICS, known)
    assert "sm__pipe_tensor_op_gmma_cycles_active.avg.pct_of_peak_sustained_active" in unknown
    assert "dram__bytes_read.sum" not in unknown
    assert "launch__registers_per_thread" not in unknown  # a family the list does not show is not judged by it
    assert profile.unknown_metrics(profile.METRICS, None) == []
    error = "==ERROR== Failed to find metric smsp__pcsamp_sample_count\n==ERROR== something else"
    assert profile.refused_metrics(error, profile.METRICS) == ["smsp__pcsamp_sample_count"]


def test_profile_run_survives_a_refused_metric_and_a_hung_ncu(tmp_path):
    """profile_one against a stand-in for ncu: it refuses one metric on the first run (the run is repeated without
    it), then prints a table; a stand-in that hangs is given up after the time limit and recorded as failed."""
    import sys

    from wb_kernels.stages.mma import profile

    canned = tmp_path / "ncu.out"
    canned.write_text(_fake_ncu_output())
    fake = tmp_path / "ncu"
    fake.write_text(f"#!{sys.executable}\n" + (
        "import sys, time\n"
        "args = ' '.join(sys.argv)\n"
        "if 'HANG' in args: time.sleep(30)\n"
        "if 'smsp__pcsamp_sample_count' in args:\n"
        "    print('==ERROR== Failed to find metric smsp__pcsamp_sample_count'); sys.exit(1)\n"
        f"print(open({str(canned)!r}).read())\n"))
    fake.chmod(0o755)
    run = profile.profile_one(str(fake), "mma", (4, 16, 4096, 128), "float16", 3, profile.METRICS, timeout=20)
    assert run["status"] == "ok", run
    assert run["refused"] == ["smsp__pcsamp_sample_count"]
    assert "smsp__pcsamp_sample_count" not in ",".join(run["ncu_command"])
    assert {"--clock-control", "none"} <= set(run["ncu_command"]) and "--profile-from-start" in run["ncu_command"]
    assert "regex:flash_mma_kernel" in run["ncu_command"]
    assert run["summary"]["registers_per_thread"] == 255
    assert "smsp__pcsamp_sample_count" in run["missing"]
    result = profile.build_result([run], command="python -m wb_kernels.stages.mma.profile", ncu_version="test",
                                  metrics_missing=set(run["refused"]))
    assert result["gpu"] == "NVIDIA H100 80GB HBM3" and result["git_commit"] == "abc1234"
    assert result["metrics_missing"] == ["smsp__pcsamp_sample_count"]
    assert profile._shown(tmp_path / "x.json", mma_build.SOURCE.path.parents[3]) == "x.json"  # no machine path
    assert profile._shown(mma_build.SOURCE.path, mma_build.SOURCE.path.parents[3]) == mma_build.SOURCE_NAME
    hung = profile.profile_one(str(fake), "sdpa-cudnn", (1, 1, 64, 64), "float16", 3, ["HANG"], timeout=1)
    assert hung["status"] == "failed" and "did not finish" in hung["reason"]


def test_the_models_count_of_shared_memory_traffic_is_what_ncu_counted():
    """results/mma/smem_traffic.json (an H100 run): ncu's ldmatrix and cp.async instruction counts equal what the
    kernel's loops issue for the default variant, and the predicted FLOPs per shared byte are within 1 % of the
    measured ones (the epilogue's staging of O, left out, is the rest)."""
    import json as _json

    from wb_kernels.stages.mma.launcher import variant_for

    traffic = _json.loads((mma_build.SOURCE.path.parents[3] / "results" / "mma" / "smem_traffic.json").read_text())
    problem, measured = traffic["problem"], traffic["stages"]["mma"]
    predicted = slider.loop_smem_prediction(variant_for(problem["D"]), problem["B"], problem["H"], problem["L"])
    assert predicted["ldmatrix"] == measured["metrics"]["smsp__sass_inst_executed_op_ldsm.sum"]
    assert predicted["cp_async"] == measured["metrics"]["smsp__sass_inst_executed_op_ldgsts.sum"]
    assert predicted["FLOPs per byte, ldmatrix and cp.async"] == pytest.approx(1 / measured["shared_bytes_per_flop"],
                                                                               rel=0.01)
    assert predicted["FLOPs per byte, K and V ldmatrix"] == slider.traffic_per_tile(128, row_tiles=2)[
        "FLOPs per shared byte"]


def test_register_budget_of_the_default_variants_and_their_occupancy():
    from wb_kernels.stages.mma.launcher import variant_for

    assert sum(wm.registers_per_lane(128).values()) == 148  # the model's warp
    for D in (64, 128):
        v = variant_for(D)
        budget = wm.registers_per_lane(D, row_tiles=v.row_tiles, block_n=v.block_n, q_in_registers=v.q_in_registers)
        assert budget["O accumulators (fp32)"] == 2 * D // 8 * 4
        occupancy = slider.predicted_occupancy(255, 32 * v.num_warps, mma_build.shared_memory_bytes(v))
        assert occupancy["blocks_per_sm"] == 2 and occupancy["occupancy_pct"] == 12.5
    assert slider.predicted_occupancy(32, 128, 64 * 1024)["limiter"] == "shared memory"
    assert slider.predicted_occupancy(16, 1024, 0)["limiter"] == "warps"


def test_roofline_point_of_the_committed_benchmark():
    import json as _json

    results = _json.loads((mma_build.SOURCE.path.parents[3] / "results" / "mma" / "bench_h100.json").read_text())
    point = slider.roofline_points(results)
    assert point["intensity"] == 2 * 4096 / 4  # 4 B H L^2 D FLOPs over 4 B H L D x 2 bytes
    assert point["intensity"] > point["ridge"] and point["roof_tflops"] == point["matmul_tflops"]
    assert 0 < point["reached"]["mma"] < point["reached"]["sdpa"] < 1


def test_the_puzzle_problem_sinks_a_carried_stand_in_max():
    """Batch 1's rows see their first key only in the second key tile, and every one of their scores is so far
    below 0 (in the kernel's log2 units) that 2^(s - 0) underflows in fp32: a step that carries the guarded max 0
    of a row without keys into that tile loses the row."""
    from wb_kernels.stages.mma import exercises

    q, k, v, keep = exercises.puzzle_inputs()
    scores = (q[1, 0].double() @ k[1, 0].double().T).numpy() / 8 * np.log2(np.e)
    visible = (np.arange(100)[None, :] <= np.arange(100)[:, None]) & keep[1].numpy()[None, :]
    assert not visible[:, :wm.BLOCK_N].any() and visible[70:].any(axis=1).all()
    assert scores[visible].max() < np.log2(np.finfo(np.float32).smallest_subnormal)
