"""Rung 01, reference: the float64 reference against torch's scaled_dot_product_attention, with and without
masks, and the lesson's slider logic without a browser."""

import numpy as np
import pytest
import torch
import torch.nn.functional as F

import wb_kernels as wb
from wb_kernels.stages.reference.slider import (attention_probabilities, cpu_times, mask_heatmaps,
                                               materialized_bytes, memory_time_figure)


def sdpa64(q, k, v, allowed=None, scale=None, is_causal=False):
    t = [torch.from_numpy(np.asarray(x, dtype=np.float64)) for x in (q, k, v)]
    mask = None if allowed is None else torch.from_numpy(allowed)
    return F.scaled_dot_product_attention(*t, attn_mask=mask, is_causal=is_causal, scale=scale).numpy()


@pytest.mark.parametrize("B,H,Lq,Lk,D", [(1, 1, 1, 1, 8), (2, 3, 17, 17, 16), (1, 2, 5, 33, 64), (2, 1, 40, 9, 32)])
@pytest.mark.parametrize("causal", [False, True])
def test_matches_sdpa(B, H, Lq, Lk, D, causal):
    q, k, v = wb.random_qkv(B, H, Lq, D, Lk=Lk, dtype="float64", seed=B * 100 + Lq)
    out, lse = wb.reference(q, k, v, causal=causal)
    expected = sdpa64(q, k, v, is_causal=causal)
    np.testing.assert_allclose(out, expected, rtol=1e-10, atol=1e-12)
    scores = np.einsum("bhqd,bhkd->bhqk", q, k) / np.sqrt(D)
    scores = np.where(np.tril(np.ones((Lq, Lk), bool)) | (not causal), scores, -np.inf)
    np.testing.assert_allclose(lse, torch.logsumexp(torch.from_numpy(scores), -1).numpy(), rtol=1e-12)


def test_padding_mask_and_scale_match_sdpa():
    q, k, v = wb.random_qkv(3, 2, 12, 16, Lk=20, dtype="float64", seed=7)
    pad = wb.random_padding_mask(3, 20, seed=7)
    out, _ = wb.reference(q, k, v, key_padding_mask=pad, causal=True, scale=0.3)
    allowed = np.tril(np.ones((12, 20), bool))[None, None] & pad[:, None, None, :]
    np.testing.assert_allclose(out, sdpa64(q, k, v, allowed=allowed, scale=0.3), rtol=1e-10, atol=1e-12)


def test_fully_masked_rows_are_zero_not_nan():
    q, k, v = wb.random_qkv(2, 1, 4, 8, Lk=6, dtype="float64")
    pad = np.array([[False] * 6, [True] * 6])
    out, lse = wb.reference(q, k, v, key_padding_mask=pad)
    assert np.all(out[0] == 0) and np.all(np.isneginf(lse[0]))
    assert np.all(np.isfinite(out[1])) and np.all(np.isfinite(lse[1]))


def test_large_logits_do_not_overflow():
    q, k, v = wb.random_qkv(1, 1, 8, 16, dtype="float64", std=100.0)  # logits ~ 1e4
    out, lse = wb.reference(q, k, v)
    assert np.all(np.isfinite(out)) and np.all(np.isfinite(lse))
    np.testing.assert_allclose(out, sdpa64(q, k, v), rtol=1e-9, atol=1e-9)


def test_accepts_torch_tensors_of_any_dtype():
    q, k, v = wb.random_qkv(1, 2, 9, 16, framework="torch", dtype="bfloat16")
    out, lse = wb.reference(q, k, v)
    assert out.dtype == np.float64 and out.shape == (1, 2, 9, 16) and lse.shape == (1, 2, 9)


def test_inputs_are_seeded_and_framework_independent():
    a = wb.random_qkv(1, 2, 5, 4, seed=3)
    b = wb.random_qkv(1, 2, 5, 4, seed=3, framework="torch")
    c = wb.random_qkv(1, 2, 5, 4, seed=4)
    for x, y in zip(a, b):
        np.testing.assert_array_equal(x, y.numpy())
    assert not np.array_equal(a[0], c[0])
    assert np.std(a[0]) > 0.5  # random data, never zeros


# --- the lesson's slider logic ----------------------------------------------------------------------

def test_materialized_bytes_is_two_l_squared_matrices():
    assert materialized_bytes(4096, B=1, H=16, itemsize=4) == 2 * 16 * 4096**2 * 4
    assert materialized_bytes(2048) * 4 == materialized_bytes(4096)


def test_memory_time_figure_marks_the_chosen_length():
    times = {"L": [64, 128, 256], "numpy_ms": [1.0, 3.0, 9.0], "torch_ms": [0.1, 0.2, 0.5]}
    fig_small = memory_time_figure(64, times=times)
    fig_large = memory_time_figure(256, times=times)
    marker = lambda fig: [l for l in fig.axes[0].lines if l.get_marker() == "o"][0].get_xdata()[0]
    assert marker(fig_small) == 64 and marker(fig_large) == 256
    assert len(fig_large.axes[1].lines[0].get_xdata()) == 3 and len(fig_small.axes[1].lines[0].get_xdata()) == 1


def test_cpu_times_measures_both_implementations():
    times = cpu_times([32, 64], H=1, D=16, repeats=1)
    assert times["L"] == [32, 64] and all(t > 0 for t in times["numpy_ms"] + times["torch_ms"])


def test_heatmap_probabilities_respect_masks():
    q, k, _ = wb.random_qkv(1, 1, 6, 4, Lk=8)
    pad = np.array([[True] * 5 + [False] * 3])
    p = attention_probabilities(q, k, causal=True, key_padding_mask=pad)[0, 0]
    np.testing.assert_allclose(p.sum(-1), 1.0)
    assert np.all(np.triu(p, 1) == 0) and np.all(p[:, 5:] == 0)
    assert len(mask_heatmaps(q, k, pad).axes) == 5  # four panels and a colorbar


def test_link_slider_redraws_and_shows_what_it_is_computing():
    from wb_kernels.widgets import link_slider, sequence_length_slider

    seen = []
    slider = sequence_length_slider([64, 128, 256], value=128)
    box = link_slider(slider, lambda L: seen.append(L) or f"L={L}")
    (row, output) = box.children
    assert row.children[0] is slider and row.children[1].value == ""  # status cleared after drawing
    slider.value = 256
    assert seen == [128, 256]


def test_link_sliders_redraws_on_each_slider():
    import ipywidgets as widgets

    from wb_kernels.widgets import link_sliders

    seen = []
    a = widgets.SelectionSlider(options=[1, 2, 4], value=1, description="B")
    b = widgets.SelectionSlider(options=[8, 16], value=8, description="Hk")
    box = link_sliders([a, b], lambda x, y: seen.append((x, y)) or f"{x} {y}")
    (row, output) = box.children
    assert row.children[:2] == (a, b) and row.children[2].value == ""
    a.value = 4
    b.value = 16
    assert seen == [(1, 8), (4, 8), (4, 16)]


def test_link_slider_clears_its_status_when_the_callback_raises():
    import pytest

    from wb_kernels.widgets import link_slider, sequence_length_slider

    def broken(L):
        if L == 256:
            raise RuntimeError("broken on purpose")
        return L

    slider = sequence_length_slider([64, 128, 256], value=128)
    box = link_slider(slider, broken)
    with pytest.raises(RuntimeError, match="on purpose"):
        slider.value = 256
    assert box.children[0].children[1].value == ""


# --- grouped-query attention and the bottom-right causal alignment ----------------------------------------

def attention_by_rows(q, k, v, *, last_key=None, keep=None, scale=None):
    """Exact attention one query row at a time, in float64: query head h reads K/V head h // (H // Hk), and row i
    sees the keys j <= last_key(i, Lq, Lk) that `keep` (B, Lk) lets through. Shares no code with the package."""
    B, H, Lq, D = q.shape
    Hk, Lk = k.shape[1], k.shape[2]
    scale = 1.0 / np.sqrt(D) if scale is None else scale
    out, lse = np.zeros((B, H, Lq, D)), np.full((B, H, Lq), -np.inf)
    for b in range(B):
        for h in range(H):
            kv = h * Hk // H  # = h // (H // Hk)
            for i in range(Lq):
                keys = [j for j in range(Lk) if (last_key is None or j <= last_key(i, Lq, Lk))
                        and (keep is None or keep[b, j])]
                if not keys:
                    continue  # a row that sees no key: zeros, LSE -inf
                scores = np.array([scale * float(np.dot(q[b, h, i], k[b, kv, j])) for j in keys])
                weights = np.exp(scores - scores.max())
                out[b, h, i] = (weights / weights.sum()) @ v[b, kv, keys]
                lse[b, h, i] = scores.max() + np.log(weights.sum())
    return out, lse


ALIGNMENTS = {"top_left": lambda i, Lq, Lk: i, "bottom_right": lambda i, Lq, Lk: i + Lk - Lq}


@pytest.mark.parametrize("H, Hk", [(4, 4), (4, 2), (4, 1), (6, 3)])
@pytest.mark.parametrize("causal", [False, "top_left", "bottom_right"])
def test_grouped_query_attention_matches_row_by_row(H, Hk, causal):
    q, k, v = wb.random_qkv(2, H, 7, 8, Lk=11, dtype="float64", seed=H * 10 + Hk)
    k, v = k[:, :Hk], v[:, :Hk]
    out, lse = wb.reference(q, k, v, causal=causal)
    expected, expected_lse = attention_by_rows(q, k, v, last_key=ALIGNMENTS.get(causal))
    np.testing.assert_allclose(out, expected, rtol=1e-12, atol=1e-13)
    np.testing.assert_allclose(lse, expected_lse, rtol=1e-12)


@pytest.mark.parametrize("Lq, Lk", [(3, 12), (9, 9), (12, 5), (1, 7), (7, 1)])
@pytest.mark.parametrize("padded", [False, True])
def test_bottom_right_matches_row_by_row(Lq, Lk, padded):
    """Lq < Lk (decoding with a cache), Lq = Lk (the same as top-left), Lq > Lk (the first Lq - Lk rows see no key)."""
    q, k, v = wb.random_qkv(2, 2, Lq, 8, Lk=Lk, dtype="float64", seed=Lq * 13 + Lk)
    keep = wb.random_padding_mask(2, Lk, seed=Lk) if padded else None
    out, lse = wb.reference(q, k, v, causal="bottom_right", key_padding_mask=keep)
    expected, expected_lse = attention_by_rows(q, k, v, last_key=ALIGNMENTS["bottom_right"], keep=keep)
    np.testing.assert_allclose(out, expected, rtol=1e-12, atol=1e-13)
    np.testing.assert_array_equal(np.isneginf(lse), np.isneginf(expected_lse))
    np.testing.assert_allclose(lse, expected_lse, rtol=1e-12)
    if Lq > Lk:
        assert np.all(out[:, :, :Lq - Lk] == 0) and np.all(np.isneginf(lse[:, :, :Lq - Lk]))
    if Lq == Lk:
        np.testing.assert_array_equal(out, wb.reference(q, k, v, causal=True, key_padding_mask=keep)[0])


def test_gqa_and_bottom_right_match_sdpa():
    """The same conventions as PyTorch: SDPA's enable_gqa, and flash-attn's bottom-right mask as SDPA's attn_mask."""
    q, k, v = wb.random_qkv(1, 6, 5, 16, Lk=9, dtype="float64", seed=3)
    k, v = np.ascontiguousarray(k[:, :2]), np.ascontiguousarray(v[:, :2])
    bottom_right = np.tri(5, 9, 9 - 5, dtype=bool)
    expected = F.scaled_dot_product_attention(*(torch.from_numpy(x) for x in (q, k, v)),
                                              attn_mask=torch.from_numpy(bottom_right), enable_gqa=True).numpy()
    np.testing.assert_allclose(wb.reference(q, k, v, causal="bottom_right")[0], expected, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("Lq, Lk", [(3, 8), (8, 3), (6, 6), (1, 20)])
def test_causal_alignment_figure(Lq, Lk):
    from wb_kernels.plots import causal_alignment_figure

    fig = causal_alignment_figure(Lq, Lk)
    top_left, bottom_right = fig.axes
    assert [ax.images[0].get_array().shape for ax in fig.axes] == [(Lq, Lk)] * 2
    np.testing.assert_array_equal(top_left.images[0].get_array(), np.tri(Lq, Lk, 0, dtype=bool))
    np.testing.assert_array_equal(bottom_right.images[0].get_array(), np.tri(Lq, Lk, Lk - Lq, dtype=bool))
    assert ("see no key" in bottom_right.get_title()) == (Lq > Lk) and "see no key" not in top_left.get_title()


def test_the_puzzles_problems_make_the_lessons_mistakes_show():
    """Lesson 01's puzzle: Lq != Lk (top-left and bottom-right differ), a batch element with no key, and a logit
    that a query sees above float64's exp overflow (so the textbook softmax fails in any precision)."""
    from wb_kernels.stages.reference.exercises import puzzle_problems

    for q, k, v, mask in puzzle_problems():
        Lq, Lk = q.shape[2], k.shape[2]
        assert Lq != Lk and not mask[1].any() and mask[0].any()
        allowed = wb.attention_mask(Lq, Lk, "bottom_right", mask, batch=q.shape[0])
        scores = np.einsum("bhqd,bhkd->bhqk", q.astype(np.float64), k) / np.sqrt(q.shape[-1])
        assert scores[np.broadcast_to(allowed, scores.shape)].max() > np.log(np.finfo(np.float64).max)
