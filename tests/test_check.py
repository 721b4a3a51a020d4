"""The tolerance rule: passes PyTorch-grade results, fails wrong ones (and says so in one line)."""

import numpy as np
import pytest
import torch
import torch.nn.functional as F

import wb_kernels as wb
from wb_kernels.check import dot_product_floor, output_floor, storage_floor, torch_error


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


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_gqa_and_bottom_right_are_checked_as_pytorch_computes_them(dtype):
    """SDPA with enable_gqa and the bottom-right mask passes; the same with K/V heads tiled instead of grouped, or
    with the top-left mask, fails."""
    q, k, v = wb.random_qkv(2, 4, 6, 16, Lk=13, seed=5)
    k, v = k[:, :2], v[:, :2]
    bottom_right = torch.from_numpy(np.tri(6, 13, 13 - 6, dtype=bool))

    def sdpa(k_used, v_used, mask):
        t = [torch.from_numpy(np.ascontiguousarray(x)).to(dtype) for x in (q, k_used, v_used)]
        return F.scaled_dot_product_attention(*t, attn_mask=mask, enable_gqa=t[1].shape[1] != 4)

    assert wb.check("sdpa gqa", sdpa(k, v, bottom_right), q, k, v, causal="bottom_right", verbose=False).passed
    tiled_heads = sdpa(np.tile(k, (1, 2, 1, 1)), np.tile(v, (1, 2, 1, 1)), bottom_right)  # head h reads h % Hk
    top_left = sdpa(k, v, torch.from_numpy(np.tri(6, 13, 0, dtype=bool)))
    for name, wrong in (("tiled heads", tiled_heads), ("top-left mask", top_left)):
        assert not wb.check(name, wrong, q, k, v, causal="bottom_right", verbose=False, raise_on_failure=False).passed


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


def _sequential_fma_dot(a, b):
    """float32 a . b the way a GPU thread accumulates: one fused multiply-add per term, in order."""
    acc = np.float32(0)
    for x, y in zip(a.astype(np.float64), b.astype(np.float64)):
        acc = np.float32(np.float64(acc) + x * y)  # the float64 product of two float32 is exact: one rounding
    return acc


def test_a_single_key_lse_summed_in_another_order_passes():
    """With one key the LSE is one dot product. cuBLAS/MKL may round it far better than a sequential FMA sum
    by luck; the dot-product floor keeps such a correct kernel from failing (seed 36 did, before it)."""
    q, k, v = wb.random_qkv(1, 1, 1, 32, Lk=1, dtype="float32", seed=36)
    out, lse_ref = wb.reference(q, k, v)
    score = np.float32(np.float32(32 ** -0.5) * _sequential_fma_dot(q[0, 0, 0], k[0, 0, 0]))
    check = wb.check("fma order", out.astype(np.float32), q, k, v, lse=np.full((1, 1, 1), score), verbose=False)
    assert check.passed and check.lse_err > 0
    floor = dot_product_floor(q, k, dtype="float32")
    assert check.lse_err <= floor and check.lse_tol >= 2 * floor
    # ... but the floor is rounding-sized: an LSE off by 100 floors still fails
    with pytest.raises(wb.CheckFailed):
        wb.check("off", out.astype(np.float32), q, k, v, lse=np.full((1, 1, 1), score + np.float32(100 * floor)),
                 verbose=False)


def test_dot_product_floor_ignores_non_finite_inputs_and_masked_keys():
    q, k, _ = wb.random_qkv(1, 1, 2, 16, Lk=3, dtype="float64", seed=1)
    base = dot_product_floor(q, k, dtype="float32")
    assert 0 < base < 1e-5
    k_big = k.copy()
    k_big[0, 0, 2] *= 1e6
    keep = np.array([[True, True, False]])
    masked = dot_product_floor(q, k_big, dtype="float32", key_padding_mask=keep)
    assert masked == dot_product_floor(q, k[:, :, :2], dtype="float32")  # the huge masked key is ignored
    k_bad = k.copy()
    k_bad[0, 0, 1, 0] = np.inf
    assert np.isfinite(dot_product_floor(q, k_bad, dtype="float32"))
    assert dot_product_floor(q, k, dtype="float64") < base * 1e-8


def _sequential_fma_attention(q, k, v, keep):
    """float32 attention for one query row per (b, h, i), scores summed one FMA at a time as a GPU thread
    does; softmax and P V in float32 as well."""
    scale = np.float32(q.shape[-1] ** -0.5)
    out = np.zeros(q.shape, np.float32)
    for b, h, i in np.ndindex(q.shape[:3]):
        s = np.array([scale * _sequential_fma_dot(q[b, h, i], k[b, h, j]) for j in range(k.shape[2])], np.float32)
        s = np.where(keep[b], s, -np.inf).astype(np.float32)
        p = np.exp(s - s.max()).astype(np.float32)
        out[b, h, i] = ((p / p.sum()).astype(np.float32)[:, None] * v[b, h]).sum(0)
    return out


@pytest.mark.parametrize("seed", [2, 19])
def test_a_single_row_summed_in_another_order_passes(seed):
    """One query row, peaked softmax: PyTorch's error is the largest of 32 numbers and may be small by luck.
    A correct kernel that sums each score with sequential FMAs failed 6 of 40 such problems (seeds 0-39)
    against 2x PyTorch's error alone, like the tiled stage on the GPU; the output floor lets it pass."""
    q, k, v = wb.random_qkv(1, 1, 1, 32, Lk=39, std=3.0, seed=seed)
    keep = wb.random_padding_mask(1, 39, seed=seed)
    out = _sequential_fma_attention(q, k, v, keep)
    ref = wb.reference(q, k, v, key_padding_mask=keep)
    pytorch_err, _ = torch_error(q, k, v, *ref, dtype="float32", device="cpu", key_padding_mask=keep)
    check = wb.check("fma order", out, q, k, v, key_padding_mask=keep, ref=ref, verbose=False)
    assert check.passed and check.max_err > 2 * pytorch_err + storage_floor(ref[0], "float32")
    floor = output_floor(q, k, v, *ref, dtype="float32", key_padding_mask=keep)
    assert check.max_err <= floor  # the kernel's error is of the floor's size: the floor is not slack
    with pytest.raises(wb.CheckFailed):  # and an output off by a few floors still fails
        wb.check("off", out + np.float32(3 * floor), q, k, v, key_padding_mask=keep, ref=ref, verbose=False)


def test_output_floor_is_the_typical_effect_of_rounding_every_score():
    """Monte Carlo: move every score by eps_ij times a standard normal; the largest standard deviation of an
    output entry is what output_floor predicts."""
    rng = np.random.default_rng(0)
    q, k, v = wb.random_qkv(1, 2, 3, 32, Lk=20, dtype="float64", std=2.0, seed=4)
    out, lse = wb.reference(q, k, v)
    scale = 32 ** -0.5
    scores = scale * np.einsum("bhqd,bhkd->bhqk", q, k)
    eps = 2.0 ** -24 * np.sqrt(32) * scale * np.sqrt(np.einsum("bhqd,bhkd->bhqk", q * q, k * k))
    samples = []
    for _ in range(4000):
        s = scores + eps * rng.standard_normal(scores.shape)
        p = np.exp(s - s.max(-1, keepdims=True))
        samples.append(np.einsum("bhqk,bhkd->bhqd", p / p.sum(-1, keepdims=True), v) - out)
    measured = float(np.std(samples, axis=0).max())
    assert 0.9 < output_floor(q, k, v, out, lse, dtype="float32") / measured < 1.1
    assert output_floor(q, k, v, out, lse, dtype="float64") < measured * 1e-8  # float64 rounding is 2^-29 smaller


def test_output_floor_is_below_pytorch_error_at_real_sizes():
    """On a problem of real size with ordinary logits the floor is under PyTorch's own error, so the bar
    stays where PyTorch puts it (wb_kernels/check.py has the H100 numbers, peaked softmax included)."""
    q, k, v = wb.random_qkv(2, 2, 256, 64, std=2.0, seed=3)
    ref = wb.reference(q, k, v)
    pytorch_err, _ = torch_error(q, k, v, *ref, dtype="float32", device="cpu")
    assert output_floor(q, k, v, *ref, dtype="float32") < pytorch_err


def test_output_floor_ignores_masked_keys_and_empty_rows():
    q, k, v = wb.random_qkv(2, 1, 4, 16, Lk=5, dtype="float64", seed=2)
    keep = np.array([[True, True, True, True, False], [False] * 5])  # batch 1 sees no key at all
    v_big = v.copy()
    v_big[0, 0, 4] *= 1e6  # a masked key's value must not count
    ref = wb.reference(q, k, v_big, key_padding_mask=keep)
    floor = output_floor(q, k, v_big, *ref, dtype="float32", key_padding_mask=keep)
    ref_first = wb.reference(q[:1], k[:1, :, :4], v[:1, :, :4])
    assert np.isclose(floor, output_floor(q[:1], k[:1, :, :4], v[:1, :, :4], *ref_first, dtype="float32"))
    assert 0 < floor < 1e-5


def test_output_floor_in_chunks_equals_whole():
    q, k, v = wb.random_qkv(1, 2, 37, 16, Lk=29, dtype="float64", seed=5)
    ref = wb.reference(q, k, v, causal=True)
    whole = output_floor(q, k, v, *ref, dtype="float32", causal=True)
    assert np.isclose(whole, output_floor(q, k, v, *ref, dtype="float32", causal=True, rows_per_chunk=5))


# --- check_gradients: the same rule for dq, dk, dv ---------------------------------------------------------------

def _sdpa_gradients(q, k, v, dout, dtype, causal=False, keep=None):
    """PyTorch's own gradients in `dtype` (GQA as repeated heads, the masks as a boolean attn_mask)."""
    t = [torch.from_numpy(np.ascontiguousarray(x)).to(dtype).requires_grad_(True) for x in (q, k, v)]
    H = q.shape[1]
    allowed = torch.from_numpy(wb.attention_mask(q.shape[2], k.shape[2], causal, keep, batch=q.shape[0]))
    out = F.scaled_dot_product_attention(t[0], *(x.repeat_interleave(H // k.shape[1], 1) for x in t[1:]),
                                         attn_mask=allowed)
    return torch.autograd.grad(out, t, torch.from_numpy(dout).to(dtype))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_pytorch_gradients_pass(dtype, capsys):
    q, k, v = wb.random_qkv(2, 4, 9, 16, Lk=13, seed=7)
    k, v = k[:, :2].copy(), v[:, :2].copy()
    dout = wb.random_qkv(2, 4, 9, 16, seed=8)[0]
    keep = wb.random_padding_mask(2, 13, seed=3)
    grads = _sdpa_gradients(q, k, v, dout, dtype, "bottom_right", keep)
    result = wb.check_gradients("sdpa", grads, q, k, v, dout, causal="bottom_right", key_padding_mask=keep)
    assert result.passed
    line = capsys.readouterr().out.strip()
    assert line.startswith("sdpa gradients: dq max |err| ") and ", dk max |err| " in line and ", dv max |err| " in line
    assert line.endswith("✓")


@pytest.mark.parametrize("bug", ["dq perturbed", "dk not summed over the group", "dv of the wrong mask", "nan",
                                 "no scale in dq"])
def test_wrong_gradients_fail(bug, capsys):
    q, k, v = wb.random_qkv(1, 4, 12, 16, seed=9)
    k, v = k[:, :2].copy(), v[:, :2].copy()
    dout = wb.random_qkv(1, 4, 12, 16, seed=10)[0]
    dq, dk, dv = (g.numpy() for g in _sdpa_gradients(q, k, v, dout, torch.float32, causal=True))
    if bug == "dq perturbed":
        dq = dq + 1e-3
    elif bug == "dk not summed over the group":
        dk = dk / 2  # the average of the group's gradients, not the sum
    elif bug == "dv of the wrong mask":
        dv = _sdpa_gradients(q, k, v, dout, torch.float32, causal=False)[2].numpy()
    elif bug == "nan":
        dv = dv.copy()
        dv[0, 1, 3, 2] = np.nan
    else:
        dq = dq * np.sqrt(16)
    with pytest.raises(wb.CheckFailed, match="✗"):
        wb.check_gradients(bug, (dq, dk, dv), q, k, v, dout, causal=True)
    assert capsys.readouterr().out.strip().endswith("✗")


def test_gradient_shapes_and_kinds_are_checked():
    q, k, v = wb.random_qkv(1, 2, 5, 8, seed=11)
    dout = np.ones_like(q)
    dq, dk, dv = wb.attention_backward(q, k, v, dout)
    with pytest.raises(wb.CheckFailed, match=r"dk shape \(1, 2, 4, 8\) != its input's shape \(1, 2, 5, 8\)"):
        wb.check_gradients("reference", (dq, dk[:, :, :4], dv), q, k, v, dout)
    with pytest.raises(TypeError, match=r"grads: expected \(dq, dk, dv\), got tuple of length 2"):
        wb.check_gradients("reference", (dq, dk), q, k, v, dout)
    with pytest.raises(TypeError, match="dv: expected a NumPy array or torch tensor, got list"):
        wb.check_gradients("reference", (dq, dk, dv.tolist()), q, k, v, dout)
    stage = wb.get_backward("reference")  # a Backward (or a Stage) names the line as well as a string
    assert wb.check_gradients(stage, (dq, dk, dv), q, k, v, dout, verbose=False).name == "reference"


def test_rows_that_see_no_key_must_have_zero_gradients():
    q, k, v = wb.random_qkv(2, 1, 4, 8, seed=12)
    dout = np.ones_like(q)
    keep = np.ones((2, 4), dtype=bool)
    keep[1] = False
    dq, dk, dv = wb.attention_backward(q, k, v, dout, key_padding_mask=keep)
    assert wb.check_gradients("reference", (dq, dk, dv), q, k, v, dout, key_padding_mask=keep, verbose=False).passed
    dq = dq.copy()
    dq[1] = 1e-3
    assert not wb.check_gradients("stray", (dq, dk, dv), q, k, v, dout, key_padding_mask=keep, verbose=False,
                                  raise_on_failure=False).passed
