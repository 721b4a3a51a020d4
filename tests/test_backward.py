"""The ``flash`` stage's gradients on CUDA cores (wb_kernels/stages/backward/cuda_cores.py; lesson 08_backward).

On the simulator the kernels run with 16 x 16 tiles at small sizes (under a minute in all); each case runs the flash
forward, then :func:`flash_gradients` on its ``(out, lse)``, and compares dq, dk and dv with the float64
:func:`wb_kernels.reference.reference_backward`.

The tolerance is a rounding-error bound, entry by entry (Higham, "Accuracy and Stability of Numerical Algorithms",
2nd ed., section 3.1: a float32 sum of n products is off by at most about n * u * sum |products|, u = 2^-24). Each
gradient entry is such a sum, over at most n = D + group * Lq + Lk terms along its longest chain (a score's dot
product, then a sum over keys or over the group's query rows), of terms whose magnitudes the same formulas give when
every factor is replaced by its absolute value (:func:`rounding_bound`). P itself carries the relative error of
its exponent, which the float32 score and the forward's float32 LSE put there; the bound adds that too. A kernel that
drops or repeats one term of a sum, or masks one key wrongly, is off by the size of that term, far above n * u times
the sum of all of them (:func:`test_the_bound_catches_a_missing_term`).
"""

from __future__ import annotations

import math

import numpy as np
import pytest

import wb_kernels as wb
from wb_kernels.reference import attention_mask, repeat_kv_heads, reference_backward, sum_kv_groups
from wb_kernels.stages import get_stage
from wb_kernels.stages.backward import cuda_cores as cc

U32 = 2.0**-24  # float32's unit roundoff
gpu_only = pytest.mark.skipif(not wb.BACKEND.is_gpu, reason="needs a CUDA GPU (runs on the numba simulator here)")


def make_problem(B, H, Lq, Lk, D, *, Hk=None, seed=0, std=1.0):
    """Random float32 q, k, v (Hk key/value heads) and dout; torch CUDA tensors on a GPU, NumPy here."""
    q, k, v = wb.random_qkv(B, H, Lq, D, Lk=Lk, seed=seed, std=std)
    if Hk is not None:  # grouped-query attention: the first Hk heads serve as key/value heads
        k, v = np.ascontiguousarray(k[:, :Hk]), np.ascontiguousarray(v[:, :Hk])
    dout = np.random.default_rng(seed + 1).standard_normal(q.shape).astype(np.float32)
    if wb.BACKEND.is_gpu:
        import torch

        q, k, v, dout = (torch.from_numpy(x).cuda() for x in (q, k, v, dout))
    return q, k, v, dout


def as_numpy(x):
    return np.asarray(x.detach().cpu().numpy() if hasattr(x, "detach") else x, dtype=np.float64)


def rounding_bound(q, k, v, dout, *, causal=False, key_padding_mask=None, scale=None):
    """Per-entry bounds (dq, dk, dv) on a float32 computation's error: n * u * (the magnitudes of its terms)."""
    q, k, v, dout = (as_numpy(x) for x in (q, k, v, dout))
    B, H, Lq, D = q.shape
    Hk, Lk = k.shape[1], k.shape[2]
    scale = 1 / math.sqrt(D) if scale is None else scale
    k, v = repeat_kv_heads(k, H), repeat_kv_heads(v, H)
    allowed = attention_mask(Lq, Lk, causal, key_padding_mask, batch=B)
    scores = np.where(allowed, scale * q @ np.swapaxes(k, -1, -2), -np.inf)
    with np.errstate(invalid="ignore", divide="ignore"):
        row_max = np.where(allowed.any(-1, keepdims=True), scores.max(-1, keepdims=True), 0.0)
        p = np.exp(scores - row_max)
        p = np.divide(p, p.sum(-1, keepdims=True), out=np.zeros_like(p), where=p.sum(-1, keepdims=True) > 0)
        lse = np.where(allowed.any(-1), np.log(np.exp(scores - row_max).sum(-1)) + row_max[..., 0], 0.0)
    abs_scores = abs(scale) * np.abs(q) @ np.swapaxes(np.abs(k), -1, -2)  # what a dot product's rounding scales with
    # P = exp(score - lse): its relative error is the absolute error of the exponent (the score's dot product, the
    # forward's LSE, which is off by as much as the row's largest dot product, and the subtraction)
    p_err = p * (abs_scores + abs_scores.max(-1, keepdims=True) + np.abs(lse)[..., None] + 1)
    dp = dout @ np.swapaxes(v, -1, -2)
    row_dot = (dout * (p @ v)).sum(-1, keepdims=True)
    m_dp = np.abs(dout) @ np.swapaxes(np.abs(v), -1, -2)
    m_row_dot = (np.abs(dout) * (p @ np.abs(v))).sum(-1, keepdims=True)  # O's own rounding scales with P |V|
    m_ds = p * (m_dp + m_row_dot) + p_err * np.abs(dp - row_dot) + np.abs(p * (dp - row_dot))
    n = D + (H // Hk) * Lq + Lk + 8
    m_dq = abs(scale) * m_ds @ np.abs(k)
    m_dk = sum_kv_groups(abs(scale) * np.swapaxes(m_ds, -1, -2) @ np.abs(q), Hk)
    m_dv = sum_kv_groups(np.swapaxes(p + p_err, -1, -2) @ np.abs(dout), Hk)
    return tuple(n * U32 * m for m in (m_dq, m_dk, m_dv))


def run_backward(B, H, Lq, D, *, Lk=None, Hk=None, causal=False, mask=None, seed=0, std=1.0, scale=None,
                 config=None):
    """The flash forward's (out, lse), then the gradients; returns (gradients, reference, bound) as float64 NumPy."""
    Lk = Lq if Lk is None else Lk
    q, k, v, dout = make_problem(B, H, Lq, Lk, D, Hk=Hk, seed=seed, std=std)
    if mask is not None and wb.BACKEND.is_gpu:
        import torch

        mask = torch.from_numpy(mask).cuda()
    options = dict(causal=causal, key_padding_mask=mask, scale=scale)
    out, lse = get_stage("flash").forward(q, k, v, **options)
    grads = cc.flash_gradients(q, k, v, out, lse, dout, config=config, **options)
    reference = reference_backward(q, k, v, dout, **options)
    bound = rounding_bound(q, k, v, dout, **options)
    return tuple(map(as_numpy, grads)), reference, bound


def assert_within_bound(grads, reference, bound, label=""):
    for name, got, want, tol in zip(("dq", "dk", "dv"), grads, reference, bound):
        assert got.shape == want.shape, (name, got.shape, want.shape)
        assert np.isfinite(got).all(), f"{label} {name}: not finite"
        excess = np.abs(got - want) - tol
        worst = np.unravel_index(np.argmax(excess), excess.shape)
        assert excess[worst] <= 0, (f"{label} {name}{worst}: |error| {abs(got - want)[worst]:.3g} > bound "
                                    f"{tol[worst]:.3g} (reference {want[worst]:.3g})")


# --- shapes, masks, GQA ---------------------------------------------------------------------------------------------

CASES = [  # (B, H, Lq, Lk, D, Hk, causal)
    (1, 1, 16, 16, 16, None, False),  # one tile each way
    (1, 2, 19, 23, 32, None, False),  # odd lengths, Lq != Lk, two tiles of keys
    (1, 1, 1, 1, 16, None, False),  # L = 1
    (1, 1, 1, 7, 32, None, "bottom_right"),  # one new query against a cache
    (1, 2, 21, 13, 16, 1, "top_left"),  # MQA; Lq > Lk
    (1, 4, 18, 25, 16, 2, "bottom_right"),  # GQA; Lk > Lq
    (1, 2, 25, 18, 32, 1, "bottom_right"),  # Lq > Lk: the first 7 rows see no key (LSE -inf)
    (2, 2, 17, 17, 16, None, True),
    (1, 1, 9, 12, 64, None, "top_left"),  # a third and fourth head dim, short
    (1, 1, 5, 6, 128, None, False),
]


@pytest.mark.parametrize("B,H,Lq,Lk,D,Hk,causal", CASES)
def test_gradients_match_the_float64_reference(B, H, Lq, Lk, D, Hk, causal):
    grads, reference, bound = run_backward(B, H, Lq, D, Lk=Lk, Hk=Hk, causal=causal, seed=Lq * 31 + Lk)
    assert_within_bound(grads, reference, bound, f"B{B} H{H} Lq{Lq} Lk{Lk} D{D} Hk{Hk} {causal}")


@pytest.mark.parametrize("causal", [False, "top_left", "bottom_right"])
def test_key_padding_with_a_batch_that_sees_no_key(causal):
    """Batch 1 keeps no key at all: its rows have LSE -inf, and must give zero gradients, not NaN."""
    Lq, Lk = 15, 19
    mask = np.ones((2, Lk), dtype=bool)
    mask[0, [0, 3, 4, 17]] = False
    mask[1] = False
    grads, reference, bound = run_backward(2, 2, Lq, 16, Lk=Lk, Hk=1, causal=causal, mask=mask, seed=5)
    assert_within_bound(grads, reference, bound, f"mask {causal}")
    for g in grads:
        assert not g[1].any(), "a batch that sees no key must get exactly zero gradients"


def test_masked_keys_get_exactly_zero_dk_dv():
    """A padded key takes part in no row, and a key past every row's causal limit in none either."""
    Lq, Lk = 9, 14
    mask = np.ones((1, Lk), dtype=bool)
    mask[0, 2] = False
    (dq, dk, dv), reference, bound = run_backward(1, 2, Lq, 16, Lk=Lk, causal="top_left", mask=mask, seed=7)
    assert_within_bound((dq, dk, dv), reference, bound)
    assert not dk[0, :, 2].any() and not dv[0, :, 2].any()
    assert not dk[0, :, Lq:].any() and not dv[0, :, Lq:].any()  # top-left: keys >= Lq are seen by no row


def test_negative_scale_and_peaked_scores():
    """The backward keeps no running maximum, so any scale works; large logits test the exponent's range."""
    grads, reference, bound = run_backward(1, 1, 20, 16, Lk=20, std=3.0, scale=-0.4, causal=True, seed=3)
    assert_within_bound(grads, reference, bound, "scale -0.4, std 3")


def test_the_bound_catches_a_missing_term():
    """The tolerance has teeth: dropping one key's contribution, or one row's, fails it by far (NumPy only)."""
    q, k, v, dout = (as_numpy(x) for x in make_problem(1, 1, 20, 20, 32, seed=11))
    reference = reference_backward(q, k, v, dout)
    bound = rounding_bound(q, k, v, dout)
    assert all((b <= 1e-3 * np.abs(r).max()).all() for b, r in zip(bound, reference))
    dropped = reference_backward(q, k[:, :, :19], v[:, :, :19], dout)  # one key fewer
    with pytest.raises(AssertionError):
        assert_within_bound((dropped[0], reference[1], reference[2]), reference, bound)
    one_row_fewer = reference_backward(q[:, :, :19], k, v, dout[:, :, :19])[2]  # dV without the last query row
    with pytest.raises(AssertionError):
        assert_within_bound((reference[0], reference[1], one_row_fewer), reference, bound)


# --- the launcher's contract ----------------------------------------------------------------------------------------

@pytest.mark.parametrize("config,causal", [
    (cc.BackwardConfig(block_m=8, block_n=16, per_thread=2, threads_per_row=4), "top_left"),
    (cc.BackwardConfig(block_m=16, block_n=8, per_thread=2, threads_per_row=4), "bottom_right"),
])
def test_tiles_of_unequal_sides(config, causal):
    """block_m != block_n (as the GPU shape for D = 128): the causal tile skipping counts in the right unit."""
    grads, reference, bound = run_backward(1, 2, 29, 16, Lk=35, Hk=1, causal=causal, seed=9, config=config)
    assert_within_bound(grads, reference, bound, f"{config} {causal}")


def test_gradients_are_the_same_bits_on_every_run():
    """No atomics: the GQA group's heads are summed inside one block in a fixed order."""
    q, k, v, dout = make_problem(1, 4, 11, 13, 16, Hk=1, seed=2)
    out, lse = get_stage("flash").forward(q, k, v, causal="bottom_right", key_padding_mask=None, scale=None)
    first, second = (cc.flash_gradients(q, k, v, out, lse, dout, causal="bottom_right") for _ in range(2))
    for a, b in zip(first, second):
        assert np.array_equal(as_numpy(a), as_numpy(b))


@gpu_only
@pytest.mark.parametrize("D,causal", [(64, False), (64, "top_left"), (128, "bottom_right"), (32, True), (16, False)])
def test_gradients_at_gpu_sizes(D, causal):
    """Several tiles each way with the GPU tile shapes, lengths that are not tile multiples, GQA and padding."""
    mask = np.ones((2, 517), dtype=bool)
    mask[1, 400:] = False
    grads, reference, bound = run_backward(2, 4, 300, D, Lk=517, Hk=2, causal=causal, mask=mask, seed=D)
    assert_within_bound(grads, reference, bound, f"D{D} {causal}")


@gpu_only
def test_a_batch_larger_than_grid_y_allows():
    """(batch, head, tile) all go into gridDim.x: 70,000 short sequences need more blocks than y's 65,535."""
    grads, reference, bound = run_backward(70_000, 1, 3, 16, Lk=5, causal="bottom_right", seed=1)
    assert_within_bound(grads, reference, bound, "B = 70,000")


def test_more_blocks_than_grid_x_takes_are_refused():
    assert cc.MAX_GRID_X == 2**31 - 1
    with pytest.raises(ValueError, match="thread blocks"):
        q = np.lib.stride_tricks.as_strided(np.zeros(1, np.float32), (2**30, 1, 48, 16), (0, 0, 0, 0))
        cc.flash_gradients(q, q, q, q, q[..., 0], q)


def test_unsupported_head_dim_is_refused():
    q = np.zeros((1, 1, 4, 24), np.float32)
    with pytest.raises(ValueError, match="head dims"):
        cc.flash_gradients(q, q, q, q, q[..., 0], q)


def test_configs_are_valid_and_fit_shared_memory():
    for D, config in cc.GPU_CONFIGS.items():
        config.validate(D)
        assert cc.backward_shared_layout(D, config)["bytes"] <= 163 * 1024  # an A100's opt-in limit per block
    cc.SIMULATOR_CONFIG.validate(16)
    with pytest.raises(ValueError, match="power of two"):
        cc.SIMULATOR_CONFIG.validate(24)


def conflict_free(addresses):
    """One warp's shared-memory access hits each bank once (lanes reading the same word are a broadcast)."""
    words = set(addresses)
    return len({a % 32 for a in words}) == len(words)


@pytest.mark.parametrize("D", sorted(cc.GPU_CONFIGS))
def test_shared_memory_layout_has_no_bank_conflicts(D):
    """The addresses of every shared-memory access in both kernels, for the first warp, as the kernels compute them."""
    config = cc.GPU_CONFIGS[D]
    lay = cc.backward_shared_layout(D, config)
    tpr, ts = config.threads_per_row, config.per_thread
    lanes = range(32)
    g, c = [x // tpr for x in lanes], [x % tpr for x in lanes]
    for groups, a_stride, b_stride, stored_stride in (
            (config.block_n // ts, lay["k_stride"], lay["q_stride"], lay["pt_stride"]),  # dkdv
            (config.block_m // ts, lay["q_stride"], lay["k_stride"], lay["ds_stride"])):  # dq
        for i in range(ts):
            assert conflict_free([3 * a_stride + g[x] + groups * i for x in lanes])  # score step, stationary tile
            assert conflict_free([(g[x] + groups * i) * stored_stride + c[x] + tpr * 1 for x in lanes])  # P, dS stores
            assert conflict_free([(g[x] + groups * i) * stored_stride + 5 for x in lanes])  # P, dS reads
        assert conflict_free([3 * b_stride + c[x] + tpr * 1 for x in lanes])  # score step, streamed tile
        assert conflict_free([(c[x] + tpr * 1) * b_stride + 5 for x in lanes])  # accumulation: dO, Q (dkdv), K (dq)
        if D >= 32:  # with D = 16 a warp stores two rows of a tile: a 2-way conflict, in the loads only
            assert conflict_free([(x & (D - 1)) * a_stride + (x >> (D.bit_length() - 1)) for x in lanes])
    assert lay["bytes"] == 4 * lay["words"]


def test_kernels_are_registered_for_the_ptx_compile():
    from wb_kernels.stages import registered_kernels

    names = {entry.name for entry in registered_kernels()}
    assert "backward.preprocess_kernel" in names
    for D in cc.GPU_CONFIGS:
        assert any(name.startswith(f"backward.dkdv_kernel[D={D},") for name in names)
        assert any(name.startswith(f"backward.dq_kernel[D={D},") for name in names)

