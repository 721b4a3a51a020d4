"""The float64 reference against torch's scaled_dot_product_attention, with and without masks."""

import numpy as np
import pytest
import torch
import torch.nn.functional as F

import wb_kernels as wb


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
