"""Rung hopper as a stage of ``wb.attention`` (``stages/hopper/launcher.py``): the registration, the errors, the scale
every version is given, the batch split under gridDim.y's limit; the rung's kernels themselves are tests/test_hopper.py's.

On the CPU: the registration; CPU inputs refused before any build, naming the GPU; a GPU that is not Hopper refused by
the build, naming the mma rung; :func:`wb_kernels.reference.positive_scale` (the one place where 0 and negative scales
become positive ones, for the mma and hopper launchers alike) against the float64 reference; what the launcher hands
a version's launcher (a stand-in for the kernel). The shared matrix (tests/test_edge_cases.py, tests/test_properties.py,
tests/test_api_errors.py) picks the stage up by itself.

On a Hopper GPU: the stage through ``wb.attention`` against the float64 reference with wb.check's rule (every CUDA
shape, GQA and causal alignment of the other CUDA C++ stages, both dtypes and head dims, key padding; rows without
keys; 0, negative and large scales; a batch past gridDim.y's 65,535 (batch, head) pairs; every version), each group in
a subprocess under a time limit, since a wrong barrier hangs the kernel rather than failing it.
"""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest
import torch

import wb_kernels as wb
from wb_kernels.reference import positive_scale
from wb_kernels.stages.hopper import launcher
from wb_kernels.stages.mma import launcher as mma_launcher
from stage_cases import (CUDA_GPU_SHAPES, CUDA_GQA_CASES, check_bottom_right_rows_without_keys, check_cuda_gqa_case,
                         check_cuda_stage, check_rows_without_keys)
from test_hopper import REPO, _environment, built_extension, needs_hopper  # noqa: F401 (a fixture)


# ---------------------------------------------------------------------------------------------
# The registration and the errors

def test_stage_is_registered_after_the_mma_rung():
    stage = wb.get_stage("hopper")
    assert (stage.lesson, stage.order, stage.needs_gpu, stage.linear_memory) == ("09_hopper", 9, True, True)
    assert stage.dtypes == ("float16", "bfloat16") and stage.head_dims == (64, 128)
    assert stage.forward is launcher.forward and not stage.non_finite_in_kernel  # wb.attention's NaN/Inf pass runs
    names = list(wb.available_stages())
    assert names.index("mma") < names.index("hopper")
    assert stage.workspace_bytes(2, 3, 100, 7, 128) == 2 * 3 * 100 * 128 * 2 + 2 * 3 * 100 * 4  # out + LSE


def test_the_version_table_is_lab_py():
    from wb_kernels.stages.hopper import lab

    assert "v1" in launcher.VERSIONS and launcher.DEFAULT_VERSION in launcher.VERSIONS
    assert all(run is getattr(lab, f"flash_{name}") for name, run in launcher.VERSIONS.items())
    assert launcher.launcher_of() is launcher.VERSIONS[launcher.DEFAULT_VERSION]
    # the stage's choice per head dim (the fastest on the H100 that passed the matrix: NOTES.md), any other -> default
    assert set(launcher.DEFAULT_VERSION_BY_HEAD_DIM) == set(launcher.STAGE.head_dims)
    assert all(name in launcher.VERSIONS for name in launcher.DEFAULT_VERSION_BY_HEAD_DIM.values())
    assert launcher.launcher_of(None, 64) is launcher.VERSIONS[launcher.DEFAULT_VERSION_BY_HEAD_DIM[64]]
    assert launcher.launcher_of(None, 128) is launcher.VERSIONS[launcher.DEFAULT_VERSION_BY_HEAD_DIM[128]]
    assert launcher.launcher_of(None, 96) is launcher.VERSIONS[launcher.DEFAULT_VERSION]
    assert launcher.launcher_of("v2", 64) is launcher.VERSIONS["v2"]  # an asked version wins
    with pytest.raises(ValueError, match=r"no version 'v9'.*v1"):
        launcher.launcher_of("v9")


@pytest.mark.parametrize("framework", ["numpy", "torch"])
def test_cpu_inputs_are_refused_naming_the_gpu(framework):
    q, k, v = wb.random_qkv(1, 2, 8, 64, dtype="float16", framework=framework)
    with pytest.raises(ValueError, match=r"stage 'hopper' runs only on a CUDA GPU.*got inputs on cpu"):
        wb.attention(q, k, v, stage="hopper")


def test_a_gpu_that_is_not_hopper_is_refused_naming_the_mma_rung(monkeypatch):
    """On an A100 (sm_80) the build refuses before compiling anything; the launcher passes that error on."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *args: (8, 0))
    q, k, v = wb.random_qkv(1, 2, 8, 64, dtype="float16", framework="torch")
    with pytest.raises(RuntimeError, match=r"needs a Hopper GPU.*sm_80.*use stage='mma'"):
        launcher.forward(q, k, v)


# ---------------------------------------------------------------------------------------------
# The scale: one helper for the mma and hopper launchers

@pytest.mark.parametrize("scale", [None, 0.7, -0.3, 0.0])
@pytest.mark.parametrize("causal", [False, "bottom_right"])
def test_positive_scale_gives_the_same_attention(scale, causal):
    q, k, v = wb.random_qkv(2, 4, 9, 16, Lk=12, dtype="float64", seed=3)
    k, v = k[:, :2], v[:, :2]
    mask = wb.random_padding_mask(2, 12, seed=1)
    q2, scale2 = positive_scale(q, scale)
    assert scale2 > 0
    expected = wb.reference(q, k, v, causal=causal, key_padding_mask=mask, scale=scale)
    got = wb.reference(q2, k, v, causal=causal, key_padding_mask=mask, scale=scale2)
    for a, b in zip(got, expected):
        np.testing.assert_allclose(a, b, rtol=1e-12, atol=1e-14)


def test_positive_scale_cases():
    q = torch.tensor([[[[1.0, -2.0, float("nan"), float("inf")]]]], dtype=torch.float16)
    same, scale = positive_scale(q, 0.25)
    assert same is q and scale == 0.25
    assert positive_scale(q, None)[1] == 0.5  # 1/sqrt(D), D = 4
    negated, scale = positive_scale(q, -0.25)
    assert scale == 0.25 and torch.equal(negated[..., :2], -q[..., :2]) and torch.isinf(negated[..., 3]).all()
    zeroed, scale = positive_scale(q, 0.0)
    # 0 * (q . k) is NaN where q holds a NaN or an Inf, as in the reference: q * 0 keeps that, zeros would not
    assert scale == 1.0 and zeroed[..., :2].eq(0).all() and zeroed[..., 2:].isnan().all()
    assert positive_scale(np.ones((1, 1, 1, 16)), -2.0)[0].min() == -1.0  # NumPy too


class _FakeVersion:
    """Stands in for a version's launcher (the kernel needs a Hopper GPU): records what it is given and returns
    (out, lse) computed from it, so that split launches can be seen to join up."""

    def __init__(self):
        self.calls = []

    def __call__(self, q, k, v, *, causal, key_padding_mask, scale, module):
        self.calls.append(dict(B=q.shape[0], q=q, scale=scale, causal=causal, mask=key_padding_mask, module=module))
        return q * scale, q.float().sum(-1)


@pytest.mark.parametrize("scale, expected_scale, sign", [(None, 1 / 8, 1), (0.5, 0.5, 1), (-0.5, 0.5, -1),
                                                         (0.0, 1.0, 0)])
def test_the_launcher_hands_every_version_a_positive_scale(monkeypatch, scale, expected_scale, sign):
    fake = _FakeVersion()
    monkeypatch.setitem(launcher.VERSIONS, "fake", fake)
    q, k, v = wb.random_qkv(1, 2, 8, 64, dtype="float16", framework="torch", seed=2)
    launcher.forward(q, k, v, causal="top_left", scale=scale, version="fake", module="the module")
    (call,) = fake.calls
    assert call["scale"] == expected_scale and call["causal"] == "top_left" and call["module"] == "the module"
    assert torch.equal(call["q"], q * sign)


def test_the_mma_launcher_uses_the_same_helper():
    """The mma launcher's kernel call, with a stand-in extension: it receives what positive_scale makes."""
    seen = {}

    class Extension:
        @staticmethod
        def flash_mma_forward(q, k, v, keep, causal, offset, scale, *variant):
            seen.update(q=q, scale=scale)
            return q, None

    q, k, v = wb.random_qkv(1, 2, 8, 64, dtype="float16", framework="torch", seed=2)
    for scale in (-0.5, 0.0):
        mma_launcher.forward(q, k, v, scale=scale, module=Extension)
        expected_q, expected_scale = positive_scale(q, scale)
        assert seen["scale"] == expected_scale and torch.equal(seen["q"], expected_q)


def test_a_batch_past_grid_y_runs_as_several_launches_of_whole_sequences(monkeypatch):
    fake = _FakeVersion()
    monkeypatch.setitem(launcher.VERSIONS, "fake", fake)
    monkeypatch.setattr(launcher, "GRID_Y_BLOCKS", 5)  # H = 2: two sequences per launch
    q, k, v = wb.random_qkv(7, 2, 8, 64, dtype="float16", framework="torch", seed=2)
    mask = wb.random_padding_mask(7, 8, seed=1, framework="torch")
    out, lse = launcher.forward(q, k, v, key_padding_mask=mask, scale=0.5, version="fake")
    assert [c["B"] for c in fake.calls] == [2, 2, 2, 1]
    assert torch.equal(torch.cat([c["mask"] for c in fake.calls]), mask)
    assert torch.equal(out, q * 0.5) and torch.equal(lse, q.float().sum(-1))
    fake.calls.clear()
    q, k, v = q[:2], k[:2], v[:2]
    launcher.forward(q, k, v, scale=0.5, version="fake")  # B * H within the limit: one launch, the tensors as they are
    assert len(fake.calls) == 1 and fake.calls[0]["q"] is q


# ---------------------------------------------------------------------------------------------
# On a Hopper GPU: each group in a subprocess under a time limit (a wrong barrier hangs rather than fails)

def _every_dtype_head_dim_and_mask(check, cases):
    for dtype in ("float16", "bfloat16"):
        for D in (64, 128):
            for causal in (False, "top_left", "bottom_right"):
                for padded in (False, True):
                    for case in cases:
                        check("hopper", dtype, D, causal, padded, case)


def gpu_shapes():
    _every_dtype_head_dim_and_mask(check_cuda_stage, CUDA_GPU_SHAPES)


def gpu_gqa():
    _every_dtype_head_dim_and_mask(check_cuda_gqa_case, CUDA_GQA_CASES)


def gpu_rows_and_scales():
    check_rows_without_keys("hopper")
    check_bottom_right_rows_without_keys("hopper")
    q, k, v = wb.random_qkv(2, 2, 100, 64, Lk=150, dtype="float16", framework="torch", device="cuda", seed=9)
    for scale in (-0.3, 0.0, 2.5):
        for causal in (False, True):
            out, lse = wb.attention(q, k, v, stage="hopper", causal=causal, scale=scale, return_lse=True)
            wb.check(f"hopper scale={scale}", out, q, k, v, lse=lse, causal=causal, scale=scale)


def gpu_large_and_every_version():
    q, k, v = wb.random_qkv(2, 8, 2048, 128, dtype="float16", framework="torch", device="cuda", seed=4)
    for causal in (False, True):
        wb.check("hopper 2x8x2048x128", wb.attention(q, k, v, stage="hopper", causal=causal), q, k, v, causal=causal)
    # B * H = 66,000 (batch, head) pairs: two launches of whole sequences
    q, k, v = wb.random_qkv(33_000, 2, 3, 64, dtype="bfloat16", framework="torch", device="cuda", seed=5)
    out, lse = wb.attention(q, k, v, stage="hopper", causal=True, return_lse=True)
    rows = torch.tensor([0, 1, 16_383, 16_384, 32_766, 32_767, 32_768, 32_999], device="cuda")
    wb.check("hopper B*H=66,000", out[rows], q[rows], k[rows], v[rows], lse=lse[rows], causal=True)
    q, k, v = wb.random_qkv(2, 4, 333, 128, Lk=300, dtype="bfloat16", framework="torch", device="cuda", seed=6)
    k, v = k[:, :2].contiguous(), v[:, :2].contiguous()
    mask = wb.random_padding_mask(2, 300, seed=1, framework="torch", device="cuda")
    for name in launcher.VERSIONS:
        for causal in (False, "bottom_right"):
            out, lse = launcher.forward(q, k, v, causal=causal, key_padding_mask=mask, version=name)
            wb.check(f"hopper {name}", out, q, k, v, lse=lse, causal=causal, key_padding_mask=mask)


GPU_GROUPS = {"gpu_shapes": 240, "gpu_gqa": 240, "gpu_rows_and_scales": 60, "gpu_large_and_every_version": 120}


@needs_hopper
@pytest.mark.parametrize("group", list(GPU_GROUPS))
def test_the_stage_on_the_gpu(group, built_extension):  # noqa: F811 (the fixture imported above)
    limit = GPU_GROUPS[group]
    command = f"import sys; sys.path.insert(0, 'tests'); import test_hopper_stage as t; t.{group}(); print('done')"
    try:
        done = subprocess.run([sys.executable, "-c", command], cwd=REPO, env=_environment(), capture_output=True,
                              text=True, timeout=limit)
    except subprocess.TimeoutExpired as hung:
        pytest.fail(f"{group} did not finish in {limit} s (a barrier that never completes?); its output: "
                    f"{hung.stdout!r} {hung.stderr!r}")
    assert done.returncode == 0 and "done" in done.stdout, done.stdout + done.stderr[-3000:]
