"""Edge cases every stage must get right through wb.attention (issue: robustness): L = 1, Lq != Lk, lengths
that are not tile multiples, causal with Lq != Lk (top-left, as SDPA, and bottom-right), rows that see no key,
logits of +-1e4, NaN/Inf in the inputs (the result SDPA gives, see wb.attention's docstring), also with fewer
key/value heads than query heads (GQA), non-contiguous and read-only inputs, tensors that require grad, and the
output's dtype (the input's; the LSE float32, float64 for float64 inputs).

Stages join by existing; GPU-only ones are skipped on the simulator. Sizes stay small (L <= 20, B*H <= 2,
the smallest head dim a stage takes), so the whole file runs in about a minute on the simulator.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F

import wb_kernels as wb

from stage_cases import (LOOSE_TOLERANCE, STAGES, dtype_name, head_dim, like_inputs, make_inputs, numpy64, run_dtype,
                         stage_params)

ALL = stage_params()


def run(name, q, k, v, **kwargs):
    out, lse = wb.attention(q, k, v, stage=name, return_lse=True, **kwargs)
    assert type(out) is type(q) and tuple(out.shape) == tuple(q.shape)
    return out, lse


# --- lengths ------------------------------------------------------------------------------------------

# (Lq, Lk, causal): single rows and keys, lengths one past a 16-wide tile, Lq < Lk and Lq > Lk.
LENGTHS = [(1, 1, False), (1, 1, True), (17, 17, True), (5, 20, True), (20, 5, True), (1, 17, False), (17, 1, True)]


@pytest.mark.parametrize("Lq,Lk,causal", LENGTHS, ids=[f"Lq{a}-Lk{b}-{'causal' if c else 'full'}" for a, b, c in LENGTHS])
@pytest.mark.parametrize("name", ALL)
def test_lengths(name, Lq, Lk, causal):
    stage = STAGES[name]
    q, k, v = make_inputs(stage, 1, 1, Lq, head_dim(stage), Lk=Lk, seed=Lq * 31 + Lk)
    out, lse = run(name, q, k, v, causal=causal)
    wb.check(name, out, q, k, v, lse=lse, causal=causal, verbose=False)


def test_causal_alignment_is_top_left_as_sdpa():
    """The convention every stage is checked against, pinned to SDPA's is_causal for Lq < Lk and Lq > Lk."""
    for Lq, Lk in ((3, 7), (7, 3), (1, 5)):
        q, k, v = wb.random_qkv(1, 2, Lq, 8, Lk=Lk, dtype="float64", seed=Lq)
        out = wb.attention(q, k, v, causal=True)
        expected = F.scaled_dot_product_attention(*(torch.from_numpy(x) for x in (q, k, v)), is_causal=True).numpy()
        np.testing.assert_allclose(out, expected, rtol=1e-10, atol=1e-12)
    # Row 0 sees key 0 only: its output is v[0] exactly, whatever Lk is.
    q, k, v = wb.random_qkv(1, 1, 2, 8, Lk=6, dtype="float64")
    np.testing.assert_allclose(wb.attention(q, k, v, causal=True)[0, 0, 0], v[0, 0, 0], rtol=1e-12)


@pytest.mark.parametrize("name", ALL)
def test_causal_lq_differs_from_lk_per_row(name):
    """Row i of a causal stage equals the non-causal answer over keys 0..i only (Lq > Lk: rows past Lk see all)."""
    stage = STAGES[name]
    Lq, Lk = 6, 4
    q, k, v = make_inputs(stage, 1, 1, Lq, head_dim(stage), Lk=Lk, seed=5)
    out = numpy64(run(name, q, k, v, causal=True)[0])
    q64, k64, v64 = (numpy64(x) for x in (q, k, v))
    for i in range(Lq):
        seen = min(i + 1, Lk)
        row, _ = wb.reference(q64[:, :, i:i + 1], k64[:, :, :seen], v64[:, :, :seen])
        np.testing.assert_allclose(out[0, 0, i], row[0, 0, 0], atol=LOOSE_TOLERANCE[dtype_name(q)])


# --- masks: rows that see no key -------------------------------------------------------------------------

@pytest.mark.parametrize("name", ALL)
def test_rows_that_see_no_key_are_zero_not_nan(name):
    stage = STAGES[name]
    B, Lq, Lk = 2, 5, 7
    q, k, v = make_inputs(stage, B, 1, Lq, head_dim(stage), Lk=Lk, seed=11)
    keep = np.ones((B, Lk), dtype=bool)
    keep[0] = False  # batch 0: no key at all
    keep[1, 0] = False  # batch 1 with causal: row 0 would see key 0 only, which is masked
    mask = like_inputs(keep, q)
    for causal in (False, True):
        out, lse = run(name, q, k, v, causal=causal, key_padding_mask=mask)
        out, lse = numpy64(out), numpy64(lse)
        assert not np.isnan(out).any() and not np.isnan(lse).any()
        assert np.all(out[0] == 0) and np.all(np.isneginf(lse[0]))
        if causal:
            assert np.all(out[1, :, 0] == 0) and np.all(np.isneginf(lse[1, :, 0]))
        # the other rows: right to a few ulps (the tolerance rule itself is the subject of test_properties.py)
        ref, ref_lse = wb.reference(q, k, v, causal=causal, key_padding_mask=keep)
        np.testing.assert_allclose(out, ref, atol=LOOSE_TOLERANCE[dtype_name(q)])
        np.testing.assert_array_equal(np.isneginf(lse), np.isneginf(ref_lse))


@pytest.mark.parametrize("name", ALL)
def test_bottom_right_rows_that_see_no_key_are_zero_not_nan(name):
    """Bottom-right with Lq > Lk: query i sees keys j <= i - (Lq - Lk), so rows 0..Lq-Lk-1 see none; with key 0
    padded out in batch 1, row Lq - Lk (which sees key 0 alone) sees none there either. K/V are shared by two query
    heads (GQA)."""
    stage = STAGES[name]
    B, H, Lq, Lk = 2, 2, 7, 4
    q, k, v = make_inputs(stage, B, H, Lq, head_dim(stage), Lk=Lk, seed=12)
    k, v = k[:, :1], v[:, :1]
    keep = np.ones((B, Lk), dtype=bool)
    keep[1, 0] = False
    out, lse = run(name, q, k, v, causal="bottom_right", key_padding_mask=like_inputs(keep, q))
    out, lse = numpy64(out), numpy64(lse)
    blind = Lq - Lk
    assert not np.isnan(out).any() and not np.isnan(lse).any()
    assert np.all(out[:, :, :blind] == 0) and np.all(np.isneginf(lse[:, :, :blind]))
    assert np.all(out[1, :, blind] == 0) and np.all(np.isneginf(lse[1, :, blind]))
    assert np.isfinite(lse[0, :, blind:]).all() and np.isfinite(lse[1, :, blind + 1:]).all()
    ref, ref_lse = wb.reference(q, k, v, causal="bottom_right", key_padding_mask=keep)
    np.testing.assert_allclose(out, ref, atol=LOOSE_TOLERANCE[dtype_name(q)])
    np.testing.assert_array_equal(np.isneginf(lse), np.isneginf(ref_lse))


# --- numerical extremes ---------------------------------------------------------------------------------

@pytest.mark.parametrize("name", ALL)
def test_logits_of_ten_thousand_do_not_overflow(name):
    stage = STAGES[name]
    D = head_dim(stage)
    # std s gives logits ~ s^2 * sqrt(D) / sqrt(D) * N(0,1)-ish: s = 100 puts them at +-1e4
    dtype = run_dtype(stage)
    if dtype == "float16" and "bfloat16" in stage.dtypes:
        dtype = "bfloat16"  # float16 tops out at 65504: inputs of 100 * N(0, 1) would overflow in q . k
    q, k, v = make_inputs(stage, 1, 2, 9, D, Lk=12, seed=2, std=100.0, dtype=dtype)
    scores = numpy64(q) @ numpy64(k).swapaxes(-1, -2) / np.sqrt(D)
    assert np.abs(scores).max() > 1e4 and scores.min() < -1e4
    for causal in (False, True):
        out, lse = run(name, q, k, v, causal=causal)
        assert np.isfinite(numpy64(out)).all() and np.isfinite(numpy64(lse)).all()
        wb.check(name, out, q, k, v, lse=lse, causal=causal, verbose=False)


# --- NaN and Inf in the inputs ----------------------------------------------------------------------------

L_NAN, D_COL, KEY, ROW = 6, 1, 2, 2  # the poisoned element sits in row/key 2, column 1


def poisoned_inputs(stage, where, value):
    """Inputs with `value` at element (KEY or ROW, D_COL) of q, k or v; column D_COL of q gets signs that
    make an Inf in k meet both a positive and a negative query value."""
    D = head_dim(stage)
    q, k, v = (numpy64(x) for x in make_inputs(stage, 1, 1, L_NAN, D, seed=3))
    q[0, 0, :, D_COL] = [-1.0, -0.5, 0.5, 1.0, -2.0, 0.25]
    {"q": q, "k": k, "v": v}[where][0, 0, ROW if where == "q" else KEY, D_COL] = value
    template = make_inputs(stage, 1, 1, 1, D)[0]
    return tuple(like_inputs(x, template) for x in (q, k, v))


# (where, value, causal) -> which output rows must be NaN, and whether only column D_COL is (v) or whole rows.
# Derived by hand from SDPA's arithmetic (test_reference_follows_sdpa_math pins the reference to SDPA):
rows = np.arange(L_NAN)
NAN_CASES = {
    ("q", np.nan, False): rows == ROW,  # a NaN query: its own row only
    ("q", np.inf, False): rows == ROW,  # scores +-inf in one row: inf - inf = NaN there
    ("k", np.nan, False): rows >= 0,  # a NaN key: every row that attends it ...
    ("k", np.nan, True): rows >= KEY,  # ... which under causal is rows >= key
    ("k", np.inf, False): np.array([-1.0, -0.5, 0.5, 1.0, -2.0, 0.25]) > 0,  # +inf score -> NaN; -inf -> key dropped
    ("k", -np.inf, True): (np.array([-1.0, -0.5, 0.5, 1.0, -2.0, 0.25]) < 0) & (rows >= KEY),
    ("v", np.nan, False): rows >= 0,  # column D_COL of every row that attends the key
    ("v", np.inf, False): rows >= 0,
}


@pytest.mark.parametrize("where,value,causal", list(NAN_CASES), ids=[f"{w}={v}-{'causal' if c else 'full'}"
                                                                     for w, v, c in NAN_CASES])
@pytest.mark.parametrize("name", ALL)
def test_non_finite_inputs_propagate_as_in_sdpa(name, where, value, causal):
    stage = STAGES[name]
    q, k, v = poisoned_inputs(stage, where, value)
    out, lse = run(name, q, k, v, causal=causal)
    out, lse = numpy64(out), numpy64(lse)
    expected_rows = NAN_CASES[(where, value, causal)]
    bad = ~np.isfinite(out[0, 0])
    if where == "v":
        assert np.array_equal(bad[:, D_COL], expected_rows)
        assert not np.delete(bad, D_COL, axis=1).any()
        assert np.isfinite(lse).all()
    else:
        assert np.array_equal(bad.all(-1), expected_rows) and np.array_equal(bad.any(-1), expected_rows)
        assert np.array_equal(np.isnan(out[0, 0]).all(-1), expected_rows)  # NaN, not Inf, as SDPA
        assert np.array_equal(~np.isfinite(lse[0, 0]), expected_rows)
    # everything that is finite is right: compare with the float64 reference, which follows the same rule
    ref, ref_lse = wb.reference(q, k, v, causal=causal)
    assert np.array_equal(np.isfinite(ref), np.isfinite(out))
    finite = np.isfinite(out)
    np.testing.assert_allclose(out[finite], ref[finite], atol=LOOSE_TOLERANCE[dtype_name(q)])


@pytest.mark.parametrize("name", ALL)
def test_a_nan_key_reaches_only_the_query_heads_that_read_it(name):
    """GQA: query heads 0-1 read K/V head 0, heads 2-3 head 1. A NaN in key 2 of head 1 makes every row of heads 2-3
    that attends key 2 NaN (bottom-right: rows i >= 2 + Lq - Lk), and leaves heads 0-1 alone; rows 0-1 see no key."""
    stage = STAGES[name]
    Lq, Lk = 6, 4
    q, k, v = (numpy64(x) for x in make_inputs(stage, 1, 4, Lq, head_dim(stage), Lk=Lk, seed=9))
    k, v = k[:, :2].copy(), v[:, :2].copy()
    k[0, 1, KEY, 0] = np.nan
    template = make_inputs(stage, 1, 1, 1, head_dim(stage))[0]
    q, k, v = (like_inputs(x, template) for x in (q, k, v))
    out, lse = (numpy64(x) for x in run(name, q, k, v, causal="bottom_right"))
    rows_that_attend = np.arange(Lq) >= KEY - (Lk - Lq)
    assert not np.isnan(out[0, :2]).any() and not np.isnan(lse[0, :2]).any()  # heads 0-1 read K/V head 0
    assert np.all(out[0, :, :Lq - Lk] == 0) and np.all(np.isneginf(lse[0, :, :Lq - Lk]))  # rows that see no key
    for h in (2, 3):
        assert np.array_equal(np.isnan(out[0, h]).all(-1), rows_that_attend)
        assert np.array_equal(np.isnan(lse[0, h]), rows_that_attend)
    ref = wb.reference(q, k, v, causal="bottom_right")[0]
    finite = np.isfinite(out)
    assert np.array_equal(np.isfinite(ref), finite)
    np.testing.assert_allclose(out[finite], ref[finite], atol=LOOSE_TOLERANCE[dtype_name(q)])


@pytest.mark.parametrize("where,value", [("q", np.nan), ("q", np.inf), ("k", np.nan), ("k", np.inf), ("v", np.nan),
                                         ("v", -np.inf)])
def test_reference_follows_sdpa_math(where, value):
    """Without masks, the reference's NaN/Inf pattern is SDPA's (math backend, float64) exactly."""
    q, k, v = poisoned_inputs(STAGES["reference"], where, value)
    q, k, v = (numpy64(x) for x in (q, k, v))  # CUDA tensors on a GPU: the reference runs on the CPU
    out = wb.attention(q, k, v)
    with torch.nn.attention.sdpa_kernel(torch.nn.attention.SDPBackend.MATH):
        expected = F.scaled_dot_product_attention(*(torch.from_numpy(x) for x in (q, k, v))).numpy()
    assert np.array_equal(np.isnan(out), np.isnan(expected)) and np.array_equal(np.isinf(out), np.isinf(expected))
    finite = np.isfinite(expected)
    np.testing.assert_allclose(out[finite], expected[finite], rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("name", ALL)
def test_a_nan_query_in_a_row_that_sees_no_key_stays_zero(name):
    stage = STAGES[name]
    q, k, v = (numpy64(x) for x in make_inputs(stage, 2, 1, 3, head_dim(stage), Lk=4, seed=8))
    q[0, 0, 1, 0] = np.nan
    keep = np.array([[False] * 4, [True] * 4])
    template = make_inputs(stage, 1, 1, 1, head_dim(stage))[0]
    q, k, v = (like_inputs(x, template) for x in (q, k, v))
    out, lse = run(name, q, k, v, key_padding_mask=like_inputs(keep, template))
    out, lse = numpy64(out), numpy64(lse)
    assert np.all(out[0] == 0) and np.all(np.isneginf(lse[0])) and np.isfinite(out[1]).all()


# --- layouts --------------------------------------------------------------------------------------------

@pytest.mark.parametrize("name", ALL)
def test_non_contiguous_inputs(name):
    """Strided, transposed and reversed views give the same result as contiguous copies."""
    stage = STAGES[name]
    D = head_dim(stage)
    q, k, v = make_inputs(stage, 1, 2, 2 * 7, D, Lk=2 * 5, seed=4)
    if hasattr(q, "detach"):
        views = (q[:, :, ::2], k.transpose(1, 2).contiguous().transpose(1, 2)[:, :, ::2], v.flip(2)[:, :, ::2])
    else:
        views = (q[:, :, ::2], np.swapaxes(np.ascontiguousarray(np.swapaxes(k, 1, 2)), 1, 2)[:, :, ::2],
                 v[:, :, ::-1][:, :, ::2])
    copies = tuple(x.contiguous() if hasattr(x, "detach") else np.ascontiguousarray(x) for x in views)
    assert not any(x.is_contiguous() if hasattr(x, "detach") else x.flags.c_contiguous for x in views)
    keep = np.ones((1, 2 * 5), dtype=bool)
    keep[0, 1::4] = False
    mask_view = like_inputs(keep, q)[:, ::2]
    got = run(name, *views, causal=True, key_padding_mask=mask_view)[0]
    expected = run(name, *copies, causal=True, key_padding_mask=like_inputs(keep[:, ::2].copy(), q))[0]
    np.testing.assert_array_equal(numpy64(got), numpy64(expected))
    wb.check(name, got, *copies, causal=True, key_padding_mask=keep[:, ::2].copy(), verbose=False)


@pytest.mark.parametrize("name", ALL)
def test_torch_inputs_that_require_grad(name):
    """Nothing is detached silently: a stage with a backward gives an output that carries the gradient, a stage
    without one refuses (naming those with one) while grad mode is on, and runs forward-only under no_grad."""
    stage = STAGES[name]
    q, k, v = make_inputs(stage, 1, 1, 5, head_dim(stage), seed=6)
    if not hasattr(q, "detach"):
        q, k, v = (torch.from_numpy(x) for x in (q, k, v))
    q, k, v = (x.clone().requires_grad_(True) for x in (q, k, v))
    if name in wb.stages.available_backwards():
        out = wb.attention(q, k, v, stage=name)
        assert out.requires_grad and out.grad_fn is not None
    else:
        with pytest.raises(ValueError, match=f"stage '{name}' computes the forward pass only.*"
                                             f"{', '.join(wb.stages.available_backwards())}"):
            wb.attention(q, k, v, stage=name)
    with torch.no_grad():
        out = wb.attention(q, k, v, stage=name)
    assert isinstance(out, torch.Tensor) and not out.requires_grad
    wb.check(name, out, q.detach(), k.detach(), v.detach(), verbose=False)


# --- read-only inputs, dtypes -------------------------------------------------------------------------------

@pytest.mark.parametrize("name", ALL)
def test_read_only_numpy_inputs(name, tmp_path):
    """Inputs loaded with ``np.load(mmap_mode="r")`` or marked read-only work (the simulator copies kernel arguments
    back into the arrays they came from, which a read-only array refuses), and are left as they were."""
    stage = STAGES[name]
    if stage.needs_gpu or run_dtype(stage) == "bfloat16":
        pytest.skip(f"stage {name!r} takes CUDA torch tensors only")
    q, k, v = wb.random_qkv(1, 2, 7, head_dim(stage), Lk=9, dtype=run_dtype(stage), seed=8)  # NumPy, on a GPU too
    np.save(tmp_path / "q.npy", q)
    mapped = np.load(tmp_path / "q.npy", mmap_mode="r")
    k, v = k.copy(), v.copy()
    k.setflags(write=False)
    v.setflags(write=False)
    before = [x.copy() for x in (mapped, k, v)]
    keep = np.ones((1, 9), dtype=bool)
    keep[0, 2] = False
    keep.setflags(write=False)
    out = wb.attention(mapped, k, v, stage=name, causal=True, key_padding_mask=keep)
    wb.check(name, out, q, k, v, causal=True, key_padding_mask=keep, verbose=False)
    assert all(np.array_equal(a, b) for a, b in zip(before, (mapped, k, v)))


@pytest.mark.parametrize("name", ALL)
def test_output_dtype_is_the_inputs(name):
    """Every dtype a stage takes comes back as it went in; the LSE is float32 (float64 for float64 inputs)."""
    stage = STAGES[name]
    for dtype in stage.dtypes:
        q, k, v = make_inputs(stage, 1, 1, 3, head_dim(stage), seed=9, dtype=dtype)
        out, lse = wb.attention(q, k, v, stage=name, return_lse=True)
        assert dtype_name(out) == dtype, (name, dtype)
        assert dtype_name(lse) == ("float64" if dtype == "float64" else "float32"), (name, dtype)
