"""Inputs for tests that run every stage of the package (test_edge_cases.py, test_properties.py), and the
skip-or-fail rule for tests that need the CUDA compiler.

Stages join these tests by existing: the list comes from ``wb.available_stages()``. A stage that needs
a GPU is skipped on the simulator, with that reason; everything else runs everywhere, at the small
sizes the simulator can afford, and the same code feeds CUDA tensors to every stage on a GPU.
"""

from __future__ import annotations

import numpy as np
import pytest

import wb_kernels as wb

STAGES = wb.available_stages()
ON_GPU = wb.BACKEND.is_gpu

# How far a finite output of a stage may be from the float64 reference in the NaN/Inf tests, where the
# tolerance rule of wb.check cannot run (it compares whole arrays, NaN rows included): a few hundred
# ulps of each precision at the sizes used there (L <= 20, N(0, 1) inputs).
LOOSE_TOLERANCE = {"float64": 1e-10, "float32": 1e-4, "float16": 1e-2, "bfloat16": 5e-2}


def stage_params(names=None):
    """pytest params, one per stage; GPU-only stages carry a skip mark on the simulator."""
    params = []
    for name in names or STAGES:
        stage = STAGES[name]
        marks = []
        if stage.needs_gpu and not ON_GPU:
            marks.append(pytest.mark.skip(reason=f"stage {name!r} needs a CUDA GPU; this run uses the numba simulator"))
        params.append(pytest.param(name, marks=marks, id=name))
    return params


def run_dtype(stage) -> str:
    """float32 where the stage takes it (every numba stage), else its first dtype (fp16 for wmma)."""
    return "float32" if "float32" in stage.dtypes else stage.dtypes[0]


def head_dim(stage, wanted: int = 16) -> int:
    """The smallest head dim the stage supports that is >= `wanted` (or `wanted` if it takes any)."""
    if stage.head_dims is None:
        return wanted
    larger = [d for d in sorted(stage.head_dims) if d >= wanted]
    return larger[0] if larger else max(stage.head_dims)


def framework_for(dtype: str) -> tuple:
    """(framework, device) for random_qkv: CUDA tensors on a GPU; NumPy where it has the dtype."""
    if ON_GPU:
        return "torch", "cuda"
    return ("numpy", None) if dtype != "bfloat16" else ("torch", "cpu")


def make_inputs(stage, B, H, Lq, D, *, Lk=None, seed=0, std=1.0, dtype=None):
    """q, k, v for `stage`, in a dtype and place it accepts. Returns NumPy float64 copies too."""
    dtype = dtype or run_dtype(stage)
    framework, device = framework_for(dtype)
    q, k, v = wb.random_qkv(B, H, Lq, D, Lk=Lk, dtype=dtype, framework=framework, device=device, seed=seed, std=std)
    return q, k, v


def like_inputs(array: np.ndarray, template):
    """A NumPy array (a mask, or inputs edited in NumPy) in the kind and place of `template`."""
    if hasattr(template, "detach"):
        import torch

        t = torch.from_numpy(np.ascontiguousarray(array))
        if array.dtype != np.bool_:
            t = t.to(template.dtype)
        return t.to(template.device)
    if array.dtype == np.bool_:
        return array
    return np.ascontiguousarray(array.astype(template.dtype))


def numpy64(x) -> np.ndarray:
    if hasattr(x, "detach"):
        return x.detach().cpu().double().numpy()
    return np.asarray(x, dtype=np.float64)


def dtype_name(x) -> str:
    return str(x.dtype).replace("torch.", "")


def tool_or_skip(find, purpose: str = "compile the CUDA kernel"):
    """`find()` (nvcc, cuobjdump, ...) or, when it is missing, a skip with the reason; under CI (the variable CI
    set) a failure instead, so that a check that needs the tool cannot silently disappear."""
    import os

    try:
        return find()
    except FileNotFoundError as missing:
        if os.environ.get("CI"):
            pytest.fail(f"CI must {purpose}, but: {missing}")
        pytest.skip(f"not in CI and {missing}")


# ---------------------------------------------------------------------------------------------
# The GPU checks every CUDA C++ stage (wmma, mma) passes, shared by their test files

CUDA_GPU_SHAPES = [  # (B, H, Lq, Lk): L = 1, ragged tiles, Lq != Lk both ways, several blocks and key tiles
    (1, 1, 1, 1), (2, 3, 1, 300), (1, 2, 65, 65), (2, 2, 128, 128), (1, 2, 200, 77), (2, 1, 77, 200),
    (1, 2, 513, 1000), (1, 1, 300, 129),
]


# (B, H, Hk, Lq, Lk): key/value heads shared by 4, 2 or all query heads (GQA, MQA) or none (Hk = H); with the
# bottom-right alignment a single query after a long cache, Lq < Lk, Lq = Lk, and Lq > Lk, whose first Lq - Lk rows
# (whole blocks of them at Lq - Lk >= 128) see no key.
CUDA_GQA_CASES = [
    (1, 8, 2, 1, 1000), (2, 4, 1, 77, 200), (1, 6, 3, 200, 200), (1, 4, 2, 200, 77), (1, 2, 1, 513, 129),
    (2, 4, 4, 300, 1000),
]


def cuda_gqa_parameters(test):
    """The parameters of every CUDA C++ stage's GQA and causal-alignment test: dtype, D, causal, padded, case (one
    of CUDA_GQA_CASES), for :func:`check_cuda_gqa_case`."""
    for name, values, ids in reversed([
            ("dtype", ["float16", "bfloat16"], None), ("D", [64, 128], None),
            ("causal", [False, "top_left", "bottom_right"], None), ("padded", [False, True], None),
            ("case", CUDA_GQA_CASES, lambda c: "x".join(map(str, c)))]):
        test = pytest.mark.parametrize(name, values, ids=ids)(test)
    return test


def check_cuda_gqa_case(stage: str, dtype: str, D: int, causal, padded: bool, case: tuple) -> None:
    """:func:`check_cuda_stage` for a (B, H, Hk, Lq, Lk) case of CUDA_GQA_CASES."""
    B, H, Hk, Lq, Lk = case
    check_cuda_stage(stage, dtype, D, causal, padded, (B, H, Lq, Lk), Hk=Hk)


def check_cuda_stage(stage: str, dtype: str, D: int, causal, padded: bool, shape: tuple, Hk: int | None = None) -> None:
    """`stage` through wb.attention on CUDA tensors of `shape`, against the reference with wb.check's rule; with
    `Hk`, k and v keep their first Hk heads (grouped-query attention)."""
    import torch

    B, H, Lq, Lk = shape
    q, k, v = wb.random_qkv(B, H, Lq, D, Lk=Lk, dtype=dtype, framework="torch", device="cuda", seed=Lq + 3 * Lk)
    if Hk is not None:
        k, v = k[:, :Hk].contiguous(), v[:, :Hk].contiguous()
    mask = wb.random_padding_mask(B, Lk, seed=Lk, framework="torch", device="cuda") if padded else None
    out, lse = wb.attention(q, k, v, stage=stage, causal=causal, key_padding_mask=mask, return_lse=True)
    assert out.dtype == q.dtype and out.device == q.device and lse.dtype == torch.float32
    wb.check(f"{stage} {dtype} D={D} {shape} Hk={Hk or H} causal={causal}", out, q, k, v, lse=lse, causal=causal,
             key_padding_mask=mask)


def check_rows_without_keys(stage: str) -> None:
    """Causal rows 0-4 see only keys 0-4, all padded out: zeros and an LSE of -inf there, finite elsewhere."""
    import torch

    q, k, v = wb.random_qkv(1, 2, 70, 64, dtype="float16", framework="torch", device="cuda", seed=3)
    mask = torch.ones(1, 70, dtype=torch.bool, device="cuda")
    mask[0, :5] = False
    out, lse = wb.attention(q, k, v, stage=stage, causal=True, key_padding_mask=mask, return_lse=True)
    assert torch.all(out[:, :, :5] == 0) and torch.all(lse[:, :, :5] == float("-inf"))
    assert torch.isfinite(out).all() and torch.isfinite(lse[:, :, 5:]).all()


def check_bottom_right_rows_without_keys(stage: str) -> None:
    """Bottom-right with Lq = 200 > Lk = 70: rows 0-129 see no key (two whole 64-row blocks, part of the third), and
    with keys 0-4 padded out rows 130-134 see none either: zeros and an LSE of -inf there, finite elsewhere. Four
    query heads share two K/V heads."""
    import torch

    q, k, v = wb.random_qkv(1, 4, 200, 64, Lk=70, dtype="float16", framework="torch", device="cuda", seed=4)
    k, v = k[:, :2].contiguous(), v[:, :2].contiguous()
    mask = torch.ones(1, 70, dtype=torch.bool, device="cuda")
    mask[0, :5] = False
    out, lse = wb.attention(q, k, v, stage=stage, causal="bottom_right", key_padding_mask=mask, return_lse=True)
    assert torch.all(out[:, :, :135] == 0) and torch.all(lse[:, :, :135] == float("-inf"))
    assert torch.isfinite(out).all() and torch.isfinite(lse[:, :, 135:]).all()
    wb.check(f"{stage} bottom-right rows without keys", out, q, k, v, lse=lse, causal="bottom_right",
             key_padding_mask=mask)
