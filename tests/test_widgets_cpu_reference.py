"""Lesson 01's slider logic, without a browser."""

import numpy as np

import wb_kernels as wb
from wb_kernels.widgets.cpu_reference import (attention_probabilities, cpu_times, mask_heatmaps,
                                              materialized_bytes, memory_time_figure)


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
