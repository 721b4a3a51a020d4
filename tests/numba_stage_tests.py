"""Tests every numba stage with O(L²) buffers passes (rungs 02 naive and 03 tiled): results against the
float64 reference, input errors, memory.

Not collected by itself: ``test_naive.py`` and ``test_tiled.py`` import these tests next to a ``stage``
fixture naming their rung, so each rung's tests live in its own file without a second copy of these.
On the simulator the sizes stay small (every CUDA thread is a Python thread); the tests marked
``gpu`` run the same checks at real sizes on a GPU and measure peak memory.
"""

from __future__ import annotations

import importlib
import math

import numpy as np
import pytest

import wb_kernels as wb
from dataclasses import replace

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


def _run_and_check(stage, B, H, Lq, Lk, D, causal, padding, seed=0, framework="numpy", device=None, Hk=None):
    q, k, v = wb.random_qkv(B, H, Lq, D, Lk=Lk, seed=seed, framework=framework, device=device)
    if Hk is not None:  # grouped-query attention: the first Hk heads of k and v (a view; wb.attention copies it)
        k, v = k[:, :Hk], v[:, :Hk]
    mask = wb.random_padding_mask(B, Lk, seed=seed + 1, framework=framework, device=device) if padding else None
    out, lse = wb.attention(q, k, v, stage=stage, causal=causal, key_padding_mask=mask, return_lse=True)
    assert tuple(out.shape) == (B, H, Lq, D) and tuple(lse.shape) == (B, H, Lq)
    assert type(out) is type(q)
    return wb.check(stage, out, q, k, v, lse=lse, causal=causal, key_padding_mask=mask, verbose=False)


@pytest.mark.parametrize("case", SHAPES, ids=_case_id)
def test_matches_reference(stage, case):
    assert _run_and_check(stage, *case, seed=sum(case[:5])).passed


# (B, H, Hk, Lq, Lk, D, causal, padding): K/V heads shared by 2 or all query heads (GQA, MQA), the bottom-right
# causal alignment with Lq < Lk, Lq = Lk and Lq > Lk (whose first Lq - Lk rows see no key), and top-left with GQA.
GQA_SHAPES = [
    (1, 4, 2, 9, 21, 16, "bottom_right", True),
    (1, 2, 1, 13, 13, 16, "bottom_right", False),
    (1, 2, 1, 21, 9, 32, "bottom_right", True),
    (1, 2, 1, 11, 7, 16, "top_left", False),
]


def _gqa_case_id(case):
    B, H, Hk, Lq, Lk, D, causal, padding = case
    return f"B{B}H{H}Hk{Hk}-Lq{Lq}-Lk{Lk}-D{D}-{causal or 'full'}" + ("-padding" if padding else "")


@pytest.mark.parametrize("case", GQA_SHAPES, ids=_gqa_case_id)
def test_gqa_and_bottom_right_match_reference(stage, case):
    B, H, Hk, Lq, Lk, D, causal, padding = case
    assert _run_and_check(stage, B, H, Lq, Lk, D, causal, padding, seed=Lq + Lk, Hk=Hk).passed


def test_torch_cpu_tensors(stage):
    if wb.BACKEND.is_gpu:
        pytest.skip("CPU tensors are for the simulator; the GPU tests pass CUDA tensors")
    pytest.importorskip("torch")
    assert _run_and_check(stage, 1, 2, 10, 12, 32, True, True, framework="torch").passed


def test_rows_that_see_no_key_are_zero(stage):
    q, k, v = wb.random_qkv(2, 1, 5, 16, Lk=6, seed=4)
    mask = np.ones((2, 6), dtype=bool)
    mask[1] = False  # batch element 1 has no key at all
    out, lse = wb.attention(q, k, v, stage=stage, key_padding_mask=mask, return_lse=True)
    assert np.all(out[1] == 0) and np.all(np.isneginf(lse[1]))
    assert np.all(np.isfinite(out[0])) and np.all(np.isfinite(lse[0]))


def test_large_logits_do_not_overflow(stage):
    q, k, v = wb.random_qkv(1, 1, 8, 16, seed=5, std=30.0)  # logits in the hundreds: exp would overflow
    out = wb.attention(q, k, v, stage=stage)
    assert wb.check(stage, out, q, k, v, verbose=False).passed


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


@pytest.mark.parametrize("what, corrupt, error, words", BAD_INPUTS, ids=[b[0] for b in BAD_INPUTS])
def test_bad_input_is_refused_before_launch(stage, what, corrupt, error, words, monkeypatch):
    def must_not_run(*args, **kwargs):
        raise AssertionError("a kernel was launched for bad input")

    # the registry reads STAGE from the rung's package on every call: swap in one whose forward must not run
    rung = importlib.import_module(f"wb_kernels.stages.{stage}")
    monkeypatch.setattr(rung, "STAGE", replace(rung.STAGE, forward=must_not_run))
    q, k, v = wb.random_qkv(2, 2, 6, 32, seed=7)
    with pytest.raises(error, match=words):
        wb.attention(*corrupt(q, k, v), stage=stage)


def test_bad_mask_is_refused(stage):
    q, k, v = wb.random_qkv(2, 1, 6, 16, seed=8)
    with pytest.raises(ValueError, match="key_padding_mask"):
        wb.attention(q, k, v, stage=stage, key_padding_mask=np.ones((2, 5), dtype=bool))
    with pytest.raises(TypeError, match="bool"):
        wb.attention(q, k, v, stage=stage, key_padding_mask=np.ones((2, 6), dtype=np.int32))


@simulator_only
def test_simulator_refuses_sizes_that_would_take_minutes(stage):
    q, k, v = wb.random_qkv(1, 4, 512, 64, seed=9)
    with pytest.raises(ValueError, match="simulator"):
        wb.validate(q, k, v, stage=stage)


# --- on a GPU --------------------------------------------------------------------------------------

GPU_SHAPES = [
    (2, 4, 1024, 1024, 64, False, False),
    (1, 4, 2047, 1023, 128, True, True),
    (1, 2, 1, 777, 16, False, True),
    (1, 2, 555, 1, 32, True, False),
]


@needs_gpu
@pytest.mark.parametrize("case", GPU_SHAPES, ids=_case_id)
def test_gpu_matches_reference_with_cuda_tensors(stage, case):
    assert _run_and_check(stage, *case, framework="torch", device="cuda").passed


GPU_GQA_SHAPES = [
    (1, 8, 2, 300, 1000, 64, "bottom_right", True),
    (2, 4, 1, 1000, 300, 128, "bottom_right", False),
    (1, 4, 4, 1, 777, 32, "bottom_right", True),
    (2, 6, 3, 555, 555, 16, "top_left", True),
]


@needs_gpu
@pytest.mark.parametrize("case", GPU_GQA_SHAPES, ids=_gqa_case_id)
def test_gpu_gqa_and_bottom_right(stage, case):
    B, H, Hk, Lq, Lk, D, causal, padding = case
    assert _run_and_check(stage, B, H, Lq, Lk, D, causal, padding, framework="torch", device="cuda", Hk=Hk).passed


@needs_gpu
def test_gpu_numpy_inputs(stage):
    assert _run_and_check(stage, 1, 2, 300, 257, 64, True, True).passed


@needs_gpu
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
def test_gpu_launch_signatures_are_the_registered_ones(stage):
    """CI compiles the registered signatures; they must be the types the launchers really pass."""
    from numba.core import sigutils

    from wb_kernels.stages import registered_kernels

    q, k, v = wb.random_qkv(1, 1, 64, 64, framework="torch", device="cuda")
    mask = wb.random_padding_mask(1, 64, framework="torch", device="cuda")
    wb.attention(q, k, v, stage=stage, causal=True, key_padding_mask=mask)
    launched = {e.name: e for e in registered_kernels() if e.name.startswith(f"{stage}.") and e.kernel.overloads}
    assert launched
    for name, entry in launched.items():
        registered = {tuple(sigutils.normalize_signature(s)[0]) for s in entry.signatures}
        for types in entry.kernel.overloads:
            assert tuple(types) in registered, (name, types, registered)


def test_lse_dtype_and_scale(stage):
    q, k, v = wb.random_qkv(1, 1, 6, 16, seed=10)
    out, lse = wb.attention(q, k, v, stage=stage, scale=0.5, return_lse=True)
    assert lse.dtype == np.float32 and out.dtype == np.float32
    assert wb.check(stage, out, q, k, v, lse=lse, scale=0.5, verbose=False).passed
    assert math.isfinite(float(lse.max()))
