"""Rung 02, naive: the tests every O(L²) numba rung passes, and what is the naive rung's own.

On the simulator the sizes stay small (every CUDA thread is a Python thread); the tests marked
``gpu`` run the same checks at real sizes on a GPU.
"""

from __future__ import annotations

import pytest

import wb_kernels as wb
from numba_stage_tests import *  # noqa: F401,F403  (the tests every O(L²) numba rung passes, run for this one)
from numba_stage_tests import simulator_only
from wb_kernels.stages.naive import kernel as naive
from wb_kernels.stages.naive import slider, traffic


@pytest.fixture
def stage():
    return "naive"


def test_learner_kernels_are_launched():
    """forward(..., kernels=...) launches the kernels it is given (what the lessons' edit cells rely on)."""
    launched = []

    class Recorder:
        def __init__(self, kernel):
            self.kernel = kernel

        def __getitem__(self, config):
            launched.append(self.kernel)
            return self.kernel[config]

    q, k, v = wb.random_qkv(1, 1, 4, 16, seed=6)
    kernels = (naive.scores_kernel, naive.row_softmax_kernel, naive.weighted_sum_kernel)
    naive.naive_forward(q, k, v, kernels=tuple(Recorder(x) for x in kernels))
    assert launched == list(kernels)


@simulator_only
def test_simulator_cost_model_is_not_optimistic_for_checked_sizes():
    """The sizes the lessons check must be accepted, and a long run must be predicted as long."""
    assert wb.get_stage("naive").simulator_seconds(1, 1, 64, 64, 32) < 10
    assert wb.get_stage("naive").simulator_seconds(1, 16, 1024, 1024, 64) > 600


def test_workspace_and_traffic_formulas():
    stage = wb.get_stage("naive")
    assert stage.workspace_bytes(2, 3, 5, 7, 64) == 2 * 4 * 2 * 3 * 5 * 7  # S and P, float32
    traffic = naive.global_memory_traffic(1, 1, 4096, 4096, 64)
    for kernel, numbers in traffic.items():
        assert numbers["read_compulsory"] <= numbers["read_requested"], kernel
    # S is written by one kernel and read by the next: the L x L terms dominate at large L
    assert traffic["scores_kernel"]["write"] == 4 * 4096**2
    assert traffic["row_softmax_kernel"]["read_requested"] == 3 * 4 * 4096**2


def test_grid_shapes_cover_every_element():
    for (B, H, Lq, Lk, D) in [(1, 1, 1, 1, 16), (2, 3, 100, 37, 64)]:
        grids = naive.grid_shapes(B, H, Lq, Lk, D)
        (gx, gy, gz), (bx, by) = grids["scores_kernel"]  # (batch, head) in x; queries in y, keys in z
        assert gx == B * H and gy * by >= Lq > (gy - 1) * by and gz * bx >= Lk > (gz - 1) * bx


# --- the lesson's slider logic ----------------------------------------------------------------------

def test_slider_logic():
    assert slider.grid_figure(40, 56).axes
    rows = slider.traffic_rows(1, 1, 4096, 64)
    assert [r[0] for r in rows] == ["scores_kernel", "row_softmax_kernel", "weighted_sum_kernel"]
    assert all(requested >= least > 0 for _, requested, least, _ in rows)
    (L1, sp1, lin1), (L2, sp2, lin2) = slider.memory_rows([1024, 2048])
    assert sp2 == pytest.approx(4 * sp1) and lin2 == pytest.approx(2 * lin1)  # L^2 against L
    history = {}
    small = min(slider.SLIDER_LENGTHS)
    fig = slider.memory_time_figure(small, history=history, B=1, H=1, D=16)
    assert small in history and history[small]["results"]["naive"][0] > 0 and len(fig.axes) == 2


def test_traffic_script_parses_ncu_csv():
    """traffic.py reads ncu's CSV (units in bytes, thousands separators) per kernel."""
    script = traffic
    header = '"ID","Process ID","Process Name","Host Name","Kernel Name","Context","Stream","Block Size","Grid Size","Device","CC","Section Name","Metric Name","Metric Unit","Metric Value"'
    rows = [header, '==PROF== Disconnected']
    for n, kernel in enumerate(script.KERNELS):
        for metric, value in zip(script.METRICS, ("1,048,576", "2,097,152")):
            rows.insert(-1, f'"{n}","1","python","h","cudapy::wb_kernels::stages::naive::kernel::{kernel}[abi:v1](Array<float, 3>)",'
                            f'"1","7","(16, 16, 1)","(4, 4, 1)","0","9.0","Command line profiler metrics","{metric}","byte","{value}"')
    measured = script.parse_ncu_csv("==PROF== Connected\n" + "\n".join(rows))
    assert measured["row_softmax_kernel"]["dram__bytes_write.sum"] == 2097152
    result = script.build_result(measured, 1, 4, 4096, 64, "test GPU")
    assert result["kernels"]["scores_kernel"]["analytic_write"] == 4 * 4 * 4096**2
    with pytest.raises(ValueError, match="no ncu CSV"):
        script.parse_ncu_csv("nothing here")


def test_the_puzzles_problems_make_the_lessons_mistakes_show():
    """Lesson 02's puzzle: every key is seen by some row, a seen scaled score overflows exp even in float64, a batch
    element sees no key, and the second problem's probabilities spread over the keys."""
    import numpy as np

    from wb_kernels.stages.naive.exercises import puzzle_problems

    (q, k, v, causal, mask, scale), ordinary = puzzle_problems()
    allowed = wb.attention_mask(q.shape[2], k.shape[2], causal, mask, batch=q.shape[0])
    assert allowed[0].any(axis=-2).all() and not allowed[1].any()
    scores = scale * np.einsum("bhqd,bhkd->bhqk", q.astype(np.float64), k)
    assert scores[np.broadcast_to(allowed, scores.shape)].max() > np.log(np.finfo(np.float64).max)
    q, k, v, causal, mask, scale = ordinary
    allowed = wb.attention_mask(q.shape[2], k.shape[2], causal, mask, batch=q.shape[0])
    probs = wb.safe_softmax(np.where(allowed, scale * np.einsum("bhqd,bhkd->bhqk", q.astype(np.float64), k), -np.inf))
    weight = probs.max(axis=-2)  # (B, H, Lk): the most weight any row gives each key
    assert (weight > 1e-3)[np.broadcast_to(mask[:, None, :], weight.shape)].all()  # every kept key counts


@simulator_only  # NumPy buffers stand in for the GPU's
def test_the_puzzles_guard_rows_catch_a_write_past_the_last_row():
    """A GPU checks no bounds: a softmax kernel whose threads past the last row write anyway lands in the guard rows
    after the last (batch, head), and the grader says so. Faked here by kernels that write into the guard directly."""
    import numpy as np

    from wb_kernels.stages.naive.exercises import _LaunchedWithScale

    class Fake:
        def __init__(self, overrun):
            self.overrun = overrun

        def __getitem__(self, config):
            def launch(scores, scale, probs, lse):
                probs[...] = 0.5
                lse[...] = 1.0
                if self.overrun:
                    np.asarray(probs).base[-1] = 0.5  # the buffer behind the view: its last guard row
            return launch

    scores, probs, lse = np.zeros((2, 3, 4), np.float32), np.empty((2, 3, 4), np.float32), np.empty((2, 3), np.float32)
    for overrun in (False, True):
        launched = _LaunchedWithScale(Fake(overrun), 1.0)
        launched[(1, 2), 128](scores, probs, lse)
        assert launched.overran == overrun and (probs == 0.5).all() and (lse == 1.0).all()
