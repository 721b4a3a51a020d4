"""Stages 02 (naive) and 03 (tiled): results against the float64 reference, input errors, memory, speed.

On the simulator the sizes stay small (every CUDA thread is a Python thread); the tests marked
``gpu`` run the same checks at real sizes on a GPU and measure peak memory and speed.
"""

from __future__ import annotations

import math

import numpy as np
import pytest

import wb_kernels as wb
from wb_kernels.stages import naive, tiled

STAGES = ("naive", "tiled")
needs_gpu = pytest.mark.skipif(wb.BACKEND.is_simulator, reason="needs a CUDA GPU (runs on numba's simulator here)")
simulator_only = pytest.mark.skipif(wb.BACKEND.is_gpu, reason="simulator-specific sizes and behaviour")

# (B, H, Lq, Lk, D, causal, padding): every supported D, odd lengths that are not tile multiples, L = 1,
# Lq != Lk both ways, each mask alone and together. Sizes keep each case to a few seconds on the simulator.
SHAPES = [
    (1, 1, 1, 1, 16, False, False),
    (1, 2, 19, 13, 16, True, True),
    (2, 1, 13, 21, 32, True, False),
    (1, 1, 9, 17, 64, False, True),
    (1, 1, 7, 5, 128, True, True),
    (1, 1, 1, 11, 128, False, False),
]


def _case_id(case):
    B, H, Lq, Lk, D, causal, padding = case
    return f"B{B}H{H}-Lq{Lq}-Lk{Lk}-D{D}" + ("-causal" if causal else "") + ("-padding" if padding else "")


def _run_and_check(stage, B, H, Lq, Lk, D, causal, padding, seed=0, framework="numpy", device=None):
    q, k, v = wb.random_qkv(B, H, Lq, D, Lk=Lk, seed=seed, framework=framework, device=device)
    mask = wb.random_padding_mask(B, Lk, seed=seed + 1, framework=framework, device=device) if padding else None
    out, lse = wb.attention(q, k, v, stage=stage, causal=causal, key_padding_mask=mask, return_lse=True)
    assert tuple(out.shape) == (B, H, Lq, D) and tuple(lse.shape) == (B, H, Lq)
    assert type(out) is type(q)
    return wb.check(stage, out, q, k, v, lse=lse, causal=causal, key_padding_mask=mask, verbose=False)


@pytest.mark.parametrize("stage", STAGES)
@pytest.mark.parametrize("case", SHAPES, ids=_case_id)
def test_matches_reference(stage, case):
    assert _run_and_check(stage, *case, seed=sum(case[:5])).passed


@pytest.mark.parametrize("stage", STAGES)
def test_torch_cpu_tensors(stage):
    if wb.BACKEND.is_gpu:
        pytest.skip("CPU tensors are for the simulator; the GPU tests pass CUDA tensors")
    pytest.importorskip("torch")
    assert _run_and_check(stage, 1, 2, 10, 12, 32, True, True, framework="torch").passed


@pytest.mark.parametrize("tile", tiled.TILE_SIZES[:2])
def test_tiled_other_tile_and_softmax_sizes(tile):
    """The tile size and the softmax block size are parameters; any of them gives the same result."""
    q, k, v = wb.random_qkv(1, 1, 11, 16, Lk=18, seed=tile)
    mask = wb.random_padding_mask(1, 18, seed=3)
    out, lse = tiled.tiled_forward(q, k, v, causal=True, key_padding_mask=mask, tile=tile, softmax_threads=32)
    assert wb.check(f"tiled tile={tile}", out, q, k, v, lse=lse, causal=True, key_padding_mask=mask,
                    verbose=False).passed


@pytest.mark.parametrize("stage", STAGES)
def test_rows_that_see_no_key_are_zero(stage):
    q, k, v = wb.random_qkv(2, 1, 5, 16, Lk=6, seed=4)
    mask = np.ones((2, 6), dtype=bool)
    mask[1] = False  # batch element 1 has no key at all
    out, lse = wb.attention(q, k, v, stage=stage, key_padding_mask=mask, return_lse=True)
    assert np.all(out[1] == 0) and np.all(np.isneginf(lse[1]))
    assert np.all(np.isfinite(out[0])) and np.all(np.isfinite(lse[0]))


@pytest.mark.parametrize("stage", STAGES)
def test_large_logits_do_not_overflow(stage):
    q, k, v = wb.random_qkv(1, 1, 8, 16, seed=5, std=30.0)  # logits in the hundreds: exp would overflow
    out = wb.attention(q, k, v, stage=stage)
    assert wb.check(stage, out, q, k, v, verbose=False).passed


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


BAD_INPUTS = [
    ("rank", lambda q, k, v: (q[0], k, v), ValueError, "rank 4"),
    ("lengths of k and v", lambda q, k, v: (q, k, v[:, :, :3]), ValueError, "same length"),
    ("head dims", lambda q, k, v: (q, k[..., :8], v), ValueError, "head dim"),
    ("batch", lambda q, k, v: (q, k[:1], v[:1]), ValueError, "batch/heads"),
    ("dtype", lambda q, k, v: (q.astype(np.float64), k.astype(np.float64), v.astype(np.float64)), TypeError,
     "dtype float64"),
    ("unsupported D", lambda q, k, v: (q[..., :24], k[..., :24], v[..., :24]), ValueError, "D=24"),
    ("type", lambda q, k, v: (q.tolist(), k, v), TypeError, "NumPy array or torch tensor"),
]


@pytest.mark.parametrize("stage", STAGES)
@pytest.mark.parametrize("what, corrupt, error, words", BAD_INPUTS, ids=[b[0] for b in BAD_INPUTS])
def test_bad_input_is_refused_before_launch(stage, what, corrupt, error, words, monkeypatch):
    def must_not_run(*args, **kwargs):
        raise AssertionError("a kernel was launched for bad input")

    monkeypatch.setattr(naive, "naive_forward", must_not_run)
    monkeypatch.setattr(tiled, "tiled_forward", must_not_run)
    q, k, v = wb.random_qkv(2, 2, 6, 32, seed=7)
    with pytest.raises(error, match=words):
        wb.attention(*corrupt(q, k, v), stage=stage)


@pytest.mark.parametrize("stage", STAGES)
def test_bad_mask_is_refused(stage):
    q, k, v = wb.random_qkv(2, 1, 6, 16, seed=8)
    with pytest.raises(ValueError, match="key_padding_mask"):
        wb.attention(q, k, v, stage=stage, key_padding_mask=np.ones((2, 5), dtype=bool))
    with pytest.raises(TypeError, match="bool"):
        wb.attention(q, k, v, stage=stage, key_padding_mask=np.ones((2, 6), dtype=np.int32))


@simulator_only
@pytest.mark.parametrize("stage", STAGES)
def test_simulator_refuses_sizes_that_would_take_minutes(stage):
    q, k, v = wb.random_qkv(1, 4, 512, 64, seed=9)
    with pytest.raises(ValueError, match="simulator"):
        wb.validate(q, k, v, stage=stage)


@simulator_only
def test_simulator_cost_models_are_not_optimistic_for_checked_sizes():
    """The sizes the lessons check must be accepted, and a long run must be predicted as long."""
    assert wb.get_stage("naive").simulator_seconds(1, 1, 64, 64, 32) < 10
    assert wb.get_stage("tiled").simulator_seconds(1, 1, 32, 32, 16) < 20
    assert wb.get_stage("naive").simulator_seconds(1, 16, 1024, 1024, 64) > 600
    assert wb.get_stage("tiled").simulator_seconds(1, 16, 1024, 1024, 64) > 600


def test_tiled_rejects_impossible_configurations():
    with pytest.raises(ValueError, match="1024 threads"):
        tiled.tiled_kernels(64, 128)
    with pytest.raises(ValueError, match="power of two"):
        tiled.tiled_kernels(16, 100)


def test_workspace_and_traffic_formulas():
    stage = wb.get_stage("naive")
    assert stage.workspace_bytes(2, 3, 5, 7, 64) == 2 * 4 * 2 * 3 * 5 * 7  # S and P, float32
    assert wb.get_stage("tiled").workspace_bytes(1, 1, 4096, 4096, 64) == 2 * 4 * 4096**2
    traffic = naive.global_memory_traffic(1, 1, 4096, 4096, 64)
    for kernel, numbers in traffic.items():
        assert numbers["read_compulsory"] <= numbers["read_requested"], kernel
    # S is written by one kernel and read by the next: the L x L terms dominate at large L
    assert traffic["scores_kernel"]["write"] == 4 * 4096**2
    assert traffic["row_softmax_kernel"]["read_requested"] == 3 * 4 * 4096**2
    assert tiled.shared_bytes_per_block(16)["tiled_scores_kernel"] == 4 * (16 * 16 + 16 * 17)
    assert tiled.reuse_factor(32) == 32


def test_grid_shapes_cover_every_element():
    for (B, H, Lq, Lk, D) in [(1, 1, 1, 1, 16), (2, 3, 100, 37, 64)]:
        grids = naive.grid_shapes(B, H, Lq, Lk, D)
        (gx, gy, gz), (bx, by) = grids["scores_kernel"]
        assert gx * bx >= Lk > (gx - 1) * bx and gy * by >= Lq > (gy - 1) * by and gz == B * H


# --- on a GPU --------------------------------------------------------------------------------------

GPU_SHAPES = [
    (2, 4, 1024, 1024, 64, False, False),
    (1, 4, 2047, 1023, 128, True, True),
    (1, 2, 1, 777, 16, False, True),
    (1, 2, 555, 1, 32, True, False),
]


@needs_gpu
@pytest.mark.parametrize("stage", STAGES)
@pytest.mark.parametrize("case", GPU_SHAPES, ids=_case_id)
def test_gpu_matches_reference_with_cuda_tensors(stage, case):
    assert _run_and_check(stage, *case, framework="torch", device="cuda").passed


@needs_gpu
@pytest.mark.parametrize("stage", STAGES)
def test_gpu_numpy_inputs(stage):
    assert _run_and_check(stage, 1, 2, 300, 257, 64, True, True).passed


@needs_gpu
@pytest.mark.parametrize("tile", tiled.TILE_SIZES)
def test_gpu_every_tile_size(tile):
    q, k, v = wb.random_qkv(1, 2, 333, 128, Lk=200, seed=tile, framework="torch", device="cuda")
    out, lse = tiled.tiled_forward(q, k, v, causal=True, tile=tile, softmax_threads=128)
    assert wb.check(f"tiled tile={tile}", out, q, k, v, lse=lse, causal=True, verbose=False).passed


@needs_gpu
@pytest.mark.parametrize("stage", STAGES)
@pytest.mark.parametrize("L, D", [(1024, 64), (4096, 128)])
def test_gpu_peak_memory_matches_analytic(stage, L, D):
    """Measured peak = S and P (the O(L^2) workspace) + output + LSE + mask, within 5%."""
    B, H = 1, 4
    q, k, v = wb.random_qkv(B, H, L, D, framework="torch", device="cuda")
    wb.attention(q, k, v, stage=stage)  # compile first: numba's own allocations are not the kernel's
    _, used = wb.peak_memory(wb.attention, q, k, v, stage=stage)
    analytic = wb.get_stage(stage).workspace_bytes(B, H, L, L, D) + 4 * B * H * L * (D + 1) + B * L
    assert abs(used.peak_bytes - analytic) <= 0.05 * analytic, (used.peak_bytes, analytic)


@needs_gpu
@pytest.mark.parametrize("L", [1024, 4096])
def test_gpu_tiled_is_faster_than_naive(L):
    q, k, v = wb.random_qkv(1, 8, L, 64, framework="torch", device="cuda")
    naive_ms = wb.time_call(wb.attention, q, k, v, stage="naive", repeats=5).median_ms
    tiled_ms = wb.time_call(wb.attention, q, k, v, stage="tiled", repeats=5).median_ms
    assert tiled_ms < naive_ms, (tiled_ms, naive_ms)


@needs_gpu
def test_gpu_launch_signatures_are_the_registered_ones():
    """CI compiles the registered signatures; they must be the types the launchers really pass."""
    from numba.core import sigutils

    from wb_kernels.resources import registered_kernels

    q, k, v = wb.random_qkv(1, 1, 64, 64, framework="torch", device="cuda")
    mask = wb.random_padding_mask(1, 64, framework="torch", device="cuda")
    for stage in STAGES:
        wb.attention(q, k, v, stage=stage, causal=True, key_padding_mask=mask)
    launched = {e.name: e for e in registered_kernels() if e.name.startswith(("naive.", "tiled."))
                and e.kernel.overloads}
    assert any(name.startswith("naive.") for name in launched) and any(name.startswith("tiled.") for name in launched)
    for name, entry in launched.items():
        registered = {tuple(sigutils.normalize_signature(s)[0]) for s in entry.signatures}
        for types in entry.kernel.overloads:
            assert tuple(types) in registered, (name, types, registered)


def test_lse_dtype_and_scale():
    q, k, v = wb.random_qkv(1, 1, 6, 16, seed=10)
    for stage in STAGES:
        out, lse = wb.attention(q, k, v, stage=stage, scale=0.5, return_lse=True)
        assert lse.dtype == np.float32 and out.dtype == np.float32
        assert wb.check(stage, out, q, k, v, lse=lse, scale=0.5, verbose=False).passed
        assert math.isfinite(float(lse.max()))


# --- the lessons' slider logic ----------------------------------------------------------------------

def test_lesson02_widgets():
    from wb_kernels.widgets import naive_gpu

    assert naive_gpu.grid_figure(40, 56).axes
    rows = naive_gpu.traffic_rows(1, 1, 4096, 64)
    assert [r[0] for r in rows] == ["scores_kernel", "row_softmax_kernel", "weighted_sum_kernel"]
    assert all(requested >= least > 0 for _, requested, least, _ in rows)
    (L1, sp1, lin1), (L2, sp2, lin2) = naive_gpu.memory_rows([1024, 2048])
    assert sp2 == pytest.approx(4 * sp1) and lin2 == pytest.approx(2 * lin1)  # L^2 against L
    history = {}
    small = min(naive_gpu.SLIDER_LENGTHS)
    fig = naive_gpu.memory_time_figure(small, history=history, B=1, H=1, D=16)
    assert small in history and history[small]["results"]["naive"][0] > 0 and len(fig.axes) == 2


def test_lesson03_widgets():
    from wb_kernels.widgets import tiled as tiled_widgets

    rows = tiled_widgets.reuse_rows((4, 8, 16, 32))
    assert [r[3] for r in rows] == [0.5, 0.25, 0.125, 0.0625]  # loads per multiply-add fall as 2 / tile
    assert rows[-1][1] == 1024
    for tile in tiled_widgets.TILE_CHOICES:
        assert len(tiled_widgets.tile_figure(tile, Lq=40, Lk=50, D=64).axes) == 4
    if wb.BACKEND.is_simulator:
        with pytest.raises(RuntimeError, match="GPU"):
            tiled_widgets.tile_speed()


def test_traffic_script_parses_ncu_csv():
    """scripts/measure_traffic.py reads ncu's CSV (units in bytes, thousands separators) per kernel."""
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parent.parent / "scripts" / "measure_traffic.py"
    spec = importlib.util.spec_from_file_location("measure_traffic", path)
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    header = '"ID","Process ID","Process Name","Host Name","Kernel Name","Context","Stream","Block Size","Grid Size","Device","CC","Section Name","Metric Name","Metric Unit","Metric Value"'
    rows = [header, '==PROF== Disconnected']
    for n, kernel in enumerate(script.KERNELS):
        for metric, value in zip(script.METRICS, ("1,048,576", "2,097,152")):
            rows.insert(-1, f'"{n}","1","python","h","cudapy::wb_kernels::stages::naive::{kernel}[abi:v1](Array<float, 3>)",'
                            f'"1","7","(16, 16, 1)","(4, 4, 1)","0","9.0","Command line profiler metrics","{metric}","byte","{value}"')
    measured = script.parse_ncu_csv("==PROF== Connected\n" + "\n".join(rows))
    assert measured["row_softmax_kernel"]["dram__bytes_write.sum"] == 2097152
    result = script.build_result(measured, 1, 4, 4096, 64, "test GPU")
    assert result["kernels"]["scores_kernel"]["analytic_write"] == 4 * 4 * 4096**2
    with pytest.raises(ValueError, match="no ncu CSV"):
        script.parse_ncu_csv("nothing here")
