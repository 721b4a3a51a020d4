"""Rung 03, tiled: the tests every O(L²) numba rung passes, and what is the tiled rung's own.

On the simulator the sizes stay small (every CUDA thread is a Python thread); the tests marked
``gpu`` run the same checks at real sizes on a GPU and compare its speed with the naive rung's.
"""

from __future__ import annotations

import numpy as np
import pytest

import wb_kernels as wb
from numba_stage_tests import *  # noqa: F401,F403  (the tests every O(L²) numba rung passes, run for this one)
from numba_stage_tests import needs_gpu, simulator_only
from wb_kernels.stages.tiled import kernel as tiled
from wb_kernels.stages.tiled import slider


@pytest.fixture
def stage():
    return "tiled"


@pytest.mark.parametrize("tile", tiled.TILE_SIZES[:2])
def test_tiled_other_tile_and_softmax_sizes(tile):
    """The tile size and the softmax block size are parameters; any of them gives the same result."""
    q, k, v = wb.random_qkv(1, 1, 11, 16, Lk=18, seed=tile)
    mask = wb.random_padding_mask(1, 18, seed=3)
    out, lse = tiled.tiled_forward(q, k, v, causal=True, key_padding_mask=mask, tile=tile, softmax_threads=32)
    assert wb.check(f"tiled tile={tile}", out, q, k, v, lse=lse, causal=True, key_padding_mask=mask,
                    verbose=False).passed


@simulator_only
def test_simulator_cost_model_is_not_optimistic_for_checked_sizes():
    """The sizes the lessons check must be accepted, and a long run must be predicted as long."""
    assert wb.get_stage("tiled").simulator_seconds(1, 1, 32, 32, 16) < 20
    assert wb.get_stage("tiled").simulator_seconds(1, 16, 1024, 1024, 64) > 600


def test_tiled_rejects_impossible_configurations():
    with pytest.raises(ValueError, match="1024 threads"):
        tiled.tiled_kernels(64, 128)
    with pytest.raises(ValueError, match="power of two"):
        tiled.tiled_kernels(16, 100)


def test_workspace_and_reuse_formulas():
    assert wb.get_stage("tiled").workspace_bytes(1, 1, 4096, 4096, 64) == 2 * 4 * 4096**2
    assert tiled.shared_bytes_per_block(16)["tiled_scores_kernel"] == 4 * (16 * 16 + 16 * 17)
    assert tiled.reuse_factor(32) == 32


# --- on a GPU --------------------------------------------------------------------------------------

@needs_gpu
@pytest.mark.parametrize("tile", tiled.TILE_SIZES)
def test_gpu_every_tile_size(tile):
    q, k, v = wb.random_qkv(1, 2, 333, 128, Lk=200, seed=tile, framework="torch", device="cuda")
    out, lse = tiled.tiled_forward(q, k, v, causal=True, tile=tile, softmax_threads=128)
    assert wb.check(f"tiled tile={tile}", out, q, k, v, lse=lse, causal=True, verbose=False).passed


@needs_gpu
@pytest.mark.parametrize("L", [1024, 4096])
def test_gpu_tiled_is_faster_than_naive(L):
    q, k, v = wb.random_qkv(1, 8, L, 64, framework="torch", device="cuda")
    naive_ms = wb.time_call(wb.attention, q, k, v, stage="naive", repeats=5).median_ms
    tiled_ms = wb.time_call(wb.attention, q, k, v, stage="tiled", repeats=5).median_ms
    assert tiled_ms < naive_ms, (tiled_ms, naive_ms)


# --- the lesson's slider logic ----------------------------------------------------------------------

def test_slider_logic():
    rows = slider.reuse_rows((4, 8, 16, 32))
    assert [r[3] for r in rows] == [0.5, 0.25, 0.125, 0.0625]  # loads per multiply-add fall as 2 / tile
    assert rows[-1][1] == 1024
    for tile in slider.TILE_CHOICES:
        assert len(slider.tile_figure(tile, Lq=40, Lk=50, D=64).axes) == 4
    if wb.BACKEND.is_simulator:
        with pytest.raises(RuntimeError, match="GPU"):
            slider.tile_speed()


def test_bank_conflict_picture():
    # without the padding column a warp's column read conflicts, more with larger tiles; with it, never
    assert [slider.conflict_degree(slider.warp_banks(t, padded=False)) for t in (8, 16, 32)] == [2, 8, 32]
    assert [slider.conflict_degree(slider.warp_banks(t, padded=True)) for t in (8, 16, 32)] == [1, 1, 1]
    assert len(slider.draw_bank_conflicts(16).axes) == 2


@simulator_only
def test_simulator_gives_a_block_one_shared_array_per_call_site():
    """numba's simulator looked up and allocated a block's static shared array in two steps, so two of its threads
    could get different arrays (a rare wrong result of this stage); wb_kernels.simulator makes it one step."""
    import threading

    from numba.cuda.simulator import kernelapi

    assert getattr(kernelapi.FakeCUDAShared.array, "wb_thread_safe", False)
    shared, start, got = kernelapi.FakeCUDAShared(0), threading.Barrier(32), []

    def thread():
        start.wait()
        got.append(id(shared.array((4, 4), np.float32)))

    threads = [threading.Thread(target=thread) for _ in range(32)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(got) == 32 and len(set(got)) == 1


@simulator_only
def test_the_bug_hunt_gives_a_verdict_when_the_kernel_raises(capsys):
    """A kernel that reads past an array's end raises IndexError on the simulator: the bug hunt says "not solved
    yet" and what was raised, not a traceback. The same line whichever thread raised first."""
    from wb_kernels.exercises import puzzle_verdict
    from wb_kernels.stages.tiled import exercises

    unguarded = exercises._scores_kernel_with(
        ("            if j0 + ty < Lk and d0 + tx < D:\n", "            if True:\n"))
    line = puzzle_verdict(exercises.PUZZLE, unguarded)
    assert line.startswith("bug hunt: not solved yet: your kernel raised IndexError (index ") and "tid=" not in line


def test_the_bug_hunts_races_are_listed_wrong_answers():
    from wb_kernels.stages.tiled import exercises

    assert exercises.RACES and exercises.RACES <= set(exercises.PUZZLE.wrong)


@simulator_only
def test_the_bug_hunts_gpu_grading_runs_the_kernel_again_at_its_tile(monkeypatch, capsys):
    """The stricter grading a GPU gets (more launches, a larger tile), run here at simulator sizes: the solution
    still passes, each launch builds and runs the learner's kernel at that tile, and a wrong one fails."""
    from types import SimpleNamespace

    from wb_kernels.exercises import puzzle_verdict
    from wb_kernels.stages.tiled import exercises, solutions

    monkeypatch.setattr(exercises, "BACKEND", SimpleNamespace(is_gpu=True))
    monkeypatch.setattr(exercises, "_GPU_TILE", 4)
    monkeypatch.setattr(exercises, "_GPU_LAUNCHES", 2)
    monkeypatch.setattr(exercises, "_GPU_PROBLEM", (1, 1, 9, 10, 8))
    tiles = []

    def recorded(make):
        def factory(tile):
            tiles.append(tile)
            return make(tile)
        return factory

    assert "solved ✓" in puzzle_verdict(exercises.PUZZLE, recorded(solutions.make_scores_kernel))
    assert tiles == [8, 4, 4]
    wrong = exercises.PUZZLE.wrong["no barrier at all"]()
    assert "not solved yet" in puzzle_verdict(exercises.PUZZLE, wrong)
