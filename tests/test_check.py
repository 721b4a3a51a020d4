"""The tolerance rule: passes PyTorch-grade results, fails wrong ones (and says so in one line)."""

import numpy as np
import pytest
import torch
import torch.nn.functional as F

import wb_kernels as wb


def torch_attention(q, k, v, dtype, causal=False):
    t = [torch.from_numpy(x).to(dtype) for x in (q, k, v)]
    return F.scaled_dot_product_attention(*t, is_causal=causal)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_pytorch_result_passes(dtype, capsys):
    q, k, v = wb.random_qkv(2, 2, 33, 32, Lk=47)
    out = torch_attention(q, k, v, dtype, causal=True)
    result = wb.check("sdpa", out, q, k, v, causal=True)
    assert result.passed
    line = capsys.readouterr().out.strip()
    assert line.startswith("sdpa: max |err| ") and line.endswith("✓") and "≤ tol" in line


@pytest.mark.parametrize("bug", ["perturbed", "no_scale", "nan", "wrong_mask"])
def test_wrong_results_fail(bug, capsys):
    q, k, v = wb.random_qkv(1, 2, 24, 16)
    good = torch_attention(q, k, v, torch.float32, causal=True).numpy()
    bad = {
        "perturbed": good + 1e-3,
        "no_scale": torch_attention(q * 4, k, v, torch.float32, causal=True).numpy(),
        "nan": np.where(np.arange(good.size).reshape(good.shape) == 5, np.nan, good).astype(np.float32),
        "wrong_mask": torch_attention(q, k, v, torch.float32, causal=False).numpy(),
    }[bug]
    with pytest.raises(wb.CheckFailed, match="✗"):
        wb.check(bug, bad, q, k, v, causal=True)
    assert capsys.readouterr().out.strip().endswith("✗")


def test_tolerance_scales_with_precision():
    q, k, v = wb.random_qkv(1, 2, 64, 64)
    tol32 = wb.check("f32", torch_attention(q, k, v, torch.float32), q, k, v, verbose=False).tol
    tol16 = wb.check("f16", torch_attention(q, k, v, torch.float16), q, k, v, verbose=False).tol
    assert tol16 > 100 * tol32


def test_lse_is_checked_too():
    q, k, v = wb.random_qkv(1, 1, 16, 16)
    out, lse = wb.reference(q, k, v)
    assert wb.check("lse ok", out.astype(np.float32), q, k, v, lse=lse.astype(np.float32), verbose=False).passed
    with pytest.raises(wb.CheckFailed):
        wb.check("lse off", out.astype(np.float32), q, k, v, lse=(lse + 1e-2).astype(np.float32), verbose=False)


def test_fully_masked_rows_must_be_zero():
    q, k, v = wb.random_qkv(2, 1, 8, 16, Lk=8)
    pad = np.array([[False] * 8, [True] * 8])
    ref_out, _ = wb.reference(q, k, v, key_padding_mask=pad)
    assert wb.check("zeros", ref_out.astype(np.float32), q, k, v, key_padding_mask=pad, verbose=False).passed
    nan_rows = ref_out.astype(np.float32)
    nan_rows[0] = np.nan  # what a careless kernel computes as 0/0
    with pytest.raises(wb.CheckFailed):
        wb.check("nan rows", nan_rows, q, k, v, key_padding_mask=pad, verbose=False)


def test_shape_mismatch_fails():
    q, k, v = wb.random_qkv(1, 1, 8, 16)
    with pytest.raises(wb.CheckFailed, match="shape"):
        wb.check("shape", np.zeros((1, 1, 8, 8), np.float32), q, k, v, verbose=False)
