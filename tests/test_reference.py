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
