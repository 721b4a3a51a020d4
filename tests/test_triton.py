"""The ``triton`` stage (wb_kernels/stages/triton; lesson 11_triton) against the float64 reference, on Triton's CPU
interpreter without a GPU (compiled on a GPU) at small sizes (blocks of 16, so that a few dozen positions make
several blocks and ragged edges).

Tolerances: float32 within about 1e-5 of the largest reference value (the kernels multiply in IEEE float32, no
TF32); float16 and bfloat16 within twice the error of the same computation in PyTorch ops in that precision
(:func:`torch_errors`: scores, variants, softmax and autograd in the dtype), plus the rounding of storing the
reference in it. Each variant alone and in the combinations models use; its gradients (dq, dk, dv, dbias, dsinks);
``score_mod`` / ``mask_mod`` against the named variant they rewrite; block skipping counted tile by tile.
"""

from __future__ import annotations

import os

import wb_kernels  # noqa: F401  (first: without a GPU it asks for Triton's interpreter before triton loads)

import subprocess  # noqa: E402
import sys  # noqa: E402
import textwrap  # noqa: E402
from pathlib import Path  # noqa: E402

import numpy as np  # noqa: E402
import pytest  # noqa: E402

triton = pytest.importorskip("triton", reason="the triton stage needs triton (pip install triton)")
torch = pytest.importorskip("torch")
tl = triton.language

from wb_kernels.check import torch_ops_attention as torch_attention  # noqa: E402  (PyTorch's own error)
from wb_kernels.reference import reference, reference_gradients  # noqa: E402
from wb_kernels.stages.triton import STAGE, launcher  # noqa: E402
from wb_kernels.variants import canonical_variants, document_ids_from_cu_seqlens  # noqa: E402

from triton_mods import (alibi_mod, causal_mask, integer_score_mod, numeric_mask, row_mask,  # noqa: E402
                        summed_score_mod, unit_derivative)

kernels = launcher.load_kernels()
DEVICE = "cpu" if launcher.interpreting() else "cuda"  # the interpreter takes CPU tensors, the compiler CUDA ones


@pytest.fixture(autouse=True)
def _tensors_on_the_stages_device():
    with torch.device(DEVICE):  # (random draws come from a CPU generator, then move: the same numbers everywhere)
        yield
ROOT = Path(__file__).resolve().parent.parent
BLOCK = dict(block_m=16, block_n=16)
GRADIENT_NAMES = ("q", "k", "v", "bias", "sinks")


# ---------------------------------------------------------------------------------------------- problems

def make_problem(B=1, H=2, Lq=37, Lk=None, D=16, *, Hk=None, dtype=torch.float32, seed=0):
    generator = torch.Generator().manual_seed(seed)
    Lk = Lq if Lk is None else Lk
    Hk = H if Hk is None else Hk

    def draw(*shape):
        return torch.randn(*shape, generator=generator, device="cpu").to(dtype).to(DEVICE)

    return draw(B, H, Lq, D), draw(B, Hk, Lk, D), draw(B, Hk, Lk, D), draw(B, H, Lq, D)


def run_triton(q, k, v, dout, *, causal=None, key_padding_mask=None, scale=None, score_mod=None,
               score_mod_derivative=None, mask_mod=None, block=BLOCK, **variants):
    """Forward then backward of the triton stage: ``(out, lse, grads)``."""
    canonical = canonical_variants(q, k, **variants)
    options = dict(causal=causal, key_padding_mask=key_padding_mask, scale=scale, variants=canonical,
                   score_mod=score_mod, mask_mod=mask_mod, **block)
    out, lse = launcher.forward(q, k, v, **options)
    grads = launcher.gradients(q, k, v, out, lse, dout, score_mod_derivative=score_mod_derivative, **options)
    return out, lse, grads


def run_reference(q, k, v, dout, *, causal=None, key_padding_mask=None, scale=None, **variants):
    out, lse = reference(q, k, v, causal=causal, key_padding_mask=key_padding_mask, scale=scale, **variants)
    grads = reference_gradients(q, k, v, dout, causal=causal, key_padding_mask=key_padding_mask, scale=scale,
                                **variants)
    return out, lse, grads


def max_error(x, ref) -> float:
    """max |x - ref| over the entries where the reference is finite (a row that sees no key: LSE -inf, both)."""
    x = x.detach().cpu().double().numpy() if hasattr(x, "detach") else np.asarray(x, dtype=np.float64)
    finite = np.isfinite(ref)
    assert np.array_equal(np.isfinite(x), finite), "non-finite entries differ from the reference's"
    return float(np.abs(x[finite] - ref[finite]).max(initial=0.0))


def scale_of(ref) -> float:
    finite = np.abs(ref[np.isfinite(ref)])
    return float(finite.max(initial=0.0))


def assert_float32_close(ours, refs, rel=1e-5):
    """Every result within rel of its largest reference entry (plus a hair for results near 0)."""
    out, lse, grads = ours
    out_ref, lse_ref, grads_ref = refs
    pairs = [("out", out, out_ref), ("lse", lse, lse_ref)]
    pairs += [(name, grads[name], grads_ref[name]) for name in GRADIENT_NAMES if name in grads_ref]
    assert set(grads) == set(grads_ref), f"gradients {sorted(grads)} vs the reference's {sorted(grads_ref)}"
    for name, x, ref in pairs:
        assert tuple(x.shape) == ref.shape, f"{name}: shape {tuple(x.shape)} vs {ref.shape}"
        err, bound = max_error(x, ref), rel * max(scale_of(ref), 1e-2)
        assert err <= bound, f"{name}: max |err| {err:.3g} > {bound:.3g}"


# ---------------------------------------------------------------------------------------------- PyTorch's own error

def torch_errors(q, k, v, dout, refs, *, causal=None, key_padding_mask=None, **variants) -> dict:
    """PyTorch's error in q's dtype against the reference, for out, lse and every gradient the call has."""
    leaves = {name: x.detach().clone().requires_grad_(True) for name, x in (("q", q), ("k", k), ("v", v))}
    for name in ("bias", "sinks"):
        if variants.get(name) is not None:
            variants[name] = leaves[name] = variants[name].detach().to(q.dtype).clone().requires_grad_(True)
    canonical = canonical_variants(q, k, **variants)
    out, lse = torch_attention(leaves["q"], leaves["k"], leaves["v"], causal=causal,
                               key_padding_mask=key_padding_mask, variants=canonical)
    out.backward(dout)
    out_ref, lse_ref, grads_ref = refs
    errors = {"out": max_error(out, out_ref), "lse": max_error(lse, lse_ref)}
    for name, leaf in leaves.items():
        errors[name] = max_error(leaf.grad, grads_ref[name])
    return errors


def storage_error(ref, dtype) -> float:
    """What merely storing the reference in `dtype` costs (flash-attn's (ref + 0.3 - 0.3) - ref): the floor under a
    bar that PyTorch, by luck, may have made tiny."""
    finite = np.where(np.isfinite(ref), ref, 0.0)
    return max_error(torch.from_numpy(finite).to(dtype), finite)


def assert_within_pytorch(ours, refs, errors, dtype):
    """Each result within twice PyTorch's error plus twice the storage floor (wb.check's rule)."""
    out, lse, grads = ours
    out_ref, lse_ref, grads_ref = refs
    found = {"out": (out, out_ref), "lse": (lse, lse_ref)}
    found.update({name: (grads[name], grads_ref[name]) for name in grads_ref})
    for name, (x, ref) in found.items():
        assert x.dtype == (torch.float32 if name == "lse" else dtype), f"{name}: dtype {x.dtype}"
        err = max_error(x, ref)
        bound = 2 * errors[name] + 2 * storage_error(ref, x.dtype)
        assert err <= bound, f"{name}: max |err| {err:.3g} > 2 x PyTorch's {errors[name]:.3g} + storage floor"


# ---------------------------------------------------------------------------------------------- plain attention

@pytest.mark.parametrize("causal", [None, "top_left", "bottom_right"])
@pytest.mark.parametrize("Lq,Lk", [(37, 37), (20, 37), (45, 21)])
def test_plain_and_causal_float32(causal, Lq, Lk):
    """Lengths that are not block multiples, Lq != Lk both ways (bottom_right with Lq > Lk: rows that see no key)."""
    q, k, v, dout = make_problem(B=2, H=2, Lq=Lq, Lk=Lk, seed=Lq + Lk)
    assert_float32_close(run_triton(q, k, v, dout, causal=causal), run_reference(q, k, v, dout, causal=causal))


def test_gqa_key_padding_and_scale():
    """Four query heads reading two key/value heads, D = 32, keys padded, a scale of its own."""
    q, k, v, dout = make_problem(B=2, H=4, Hk=2, Lq=29, Lk=40, D=32, seed=3)
    padding = torch.ones(2, 40, dtype=torch.bool)
    padding[0, 25:] = False
    padding[1, :7] = False
    options = dict(causal="bottom_right", key_padding_mask=padding, scale=0.3)
    assert_float32_close(run_triton(q, k, v, dout, **options), run_reference(q, k, v, dout, **options))


def test_row_that_sees_no_key():
    """A batch entry whose keys are all padded: output 0, LSE -inf, zero gradients; with sinks its LSE is the sink."""
    q, k, v, dout = make_problem(B=2, H=2, Lq=20, Lk=24, seed=4)
    padding = torch.ones(2, 24, dtype=torch.bool)
    padding[1] = False
    out, lse, grads = run_triton(q, k, v, dout, key_padding_mask=padding)
    assert torch.all(out[1] == 0) and torch.all(lse[1] == float("-inf"))
    assert torch.all(grads["q"][1] == 0) and torch.all(grads["k"][1] == 0) and torch.all(grads["v"][1] == 0)
    assert_float32_close((out, lse, grads), run_reference(q, k, v, dout, key_padding_mask=padding))
    sinks = torch.tensor([0.5, -1.25])
    ours = run_triton(q, k, v, dout, key_padding_mask=padding, sinks=sinks)
    assert torch.all(ours[0][1] == 0)
    assert torch.allclose(ours[1][1], sinks[:, None].expand(2, 20), rtol=0, atol=1e-6)
    assert_float32_close(ours, run_reference(q, k, v, dout, key_padding_mask=padding, sinks=sinks))


def test_float64_is_refused():
    q, k, v, _ = make_problem(dtype=torch.float64)
    with pytest.raises(TypeError, match="float64"):
        launcher.forward(q, k, v)


# ---------------------------------------------------------------------------------------------- the variants

def alibi_slopes(H):
    return torch.tensor([2.0 ** (-8.0 * (h + 1) / H) for h in range(H)])


def variant_cases(B, H, Lq, Lk, generator):
    """{name: (call options, variants)}: each variant alone, then the combinations models use."""
    def draw(*shape, std=1.0):
        return std * torch.randn(*shape, generator=generator, device="cpu").to(DEVICE)

    ids = document_ids_from_cu_seqlens(torch.tensor([0, 9, 12, 30]), Lq)  # three documents, then padding (-1)
    return {
        "softcap": ({}, dict(softcap=2.0)),  # small, so that the cap bends the scores
        "alibi (H,)": ({"causal": "top_left"}, dict(alibi_slopes=alibi_slopes(H))),
        "alibi (B, H) bottom_right": ({"causal": "bottom_right"}, dict(alibi_slopes=draw(B, H).abs())),
        "bias (1, H, Lq, Lk)": ({}, dict(bias=draw(1, H, Lq, Lk))),
        "bias (B, 1, 1, Lk)": ({}, dict(bias=draw(B, 1, 1, Lk))),
        "bias (B, H, Lq, Lk)": ({"causal": "top_left"}, dict(bias=draw(B, H, Lq, Lk))),
        "bias (B, H, 1, Lk)": ({}, dict(bias=draw(B, H, 1, Lk))),
        "window (5, 3)": ({}, dict(window=(5, 3))),  # without causal
        "window (None, 2)": ({}, dict(window=(None, 2))),
        "documents": ({}, dict(document_ids=(ids[None].expand(B, Lq), ids[None].expand(B, Lk)))),
        "sinks": ({}, dict(sinks=draw(H))),
        "gpt-oss: window + sinks": ({"causal": "top_left"}, dict(window=(6, 0), sinks=draw(H))),
        "gemma 2: window + softcap": ({"causal": "top_left"}, dict(window=(7, 0), softcap=1.5)),
        "documents + causal + bias": ({"causal": "top_left"},
                                      dict(document_ids=(ids[None].expand(B, Lq), ids[None].expand(B, Lk)),
                                           bias=draw(B, H, Lq, Lk))),
        "everything": ({"causal": "bottom_right"},
                       dict(softcap=3.0, alibi_slopes=alibi_slopes(H), bias=draw(1, 1, Lq, Lk), window=(9, 2),
                            sinks=draw(H))),
    }


CASE_NAMES = list(variant_cases(2, 2, 30, 30, torch.Generator()))


@pytest.mark.parametrize("case", CASE_NAMES)
def test_variant_float32(case):
    """Each variant and combination, GQA included, forward and every gradient (dbias, dsinks too)."""
    q, k, v, dout = make_problem(B=2, H=4, Hk=2, Lq=30, Lk=30, seed=CASE_NAMES.index(case))
    options, variants = variant_cases(2, 4, 30, 30, torch.Generator().manual_seed(7))[case]
    ours = run_triton(q, k, v, dout, **options, **variants)
    assert_float32_close(ours, run_reference(q, k, v, dout, **options, **variants))


HALF_CASES = ["softcap", "alibi (H,)", "bias (B, 1, 1, Lk)", "gpt-oss: window + sinks", "gemma 2: window + softcap",
              "documents + causal + bias"]


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["float16", "bfloat16"])
@pytest.mark.parametrize("case", ["plain causal"] + HALF_CASES)
def test_half_precision_within_twice_pytorch(dtype, case):
    B, H, L = 2, 2, 40
    q, k, v, dout = make_problem(B=B, H=H, Lq=L, dtype=dtype, seed=11)
    generator = torch.Generator().manual_seed(5)
    options, variants = ({"causal": "top_left"}, {}) if case == "plain causal" else \
        variant_cases(B, H, L, L, generator)[case]
    variants = {name: (x.to(dtype) if name in ("bias", "sinks") else x) for name, x in variants.items()}
    refs = run_reference(q, k, v, dout, **options, **variants)
    errors = torch_errors(q, k, v, dout, refs, **options, **dict(variants))
    assert_within_pytorch(run_triton(q, k, v, dout, **options, **variants), refs, errors, dtype)


def test_nan_in_bias_reaches_only_its_row():
    """A NaN bias at a key a row sees makes that row NaN (as the reference); at a masked key it changes nothing."""
    q, k, v, _ = make_problem(B=1, H=2, Lq=20, Lk=20, seed=9)
    bias = torch.zeros(1, 2, 20, 20)
    bias[0, 0, 5, 3] = float("nan")  # row 5 sees key 3 (causal)
    bias[0, 1, 2, 10] = float("nan")  # row 2 does not see key 10
    variants = canonical_variants(q, k, bias=bias)
    out, lse = launcher.forward(q, k, v, causal="top_left", variants=variants, **BLOCK)
    assert torch.isnan(out[0, 0, 5]).all() and torch.isnan(lse[0, 0, 5])
    nan_rows = torch.isnan(out).any(-1)
    assert int(nan_rows.sum()) == 1
    out_ref, _ = reference(q, k, v, causal="top_left", bias=bias)
    assert np.array_equal(np.isnan(out_ref).any(-1), nan_rows.cpu().numpy())


# ---------------------------------------------------------------------------------------------- score_mod / mask_mod

SOFTCAP = tl.constexpr(2.0)
WINDOW = tl.constexpr(6)
DOCUMENT = tl.constexpr(11)


@triton.jit
def softcap_mod(score, b, h, q_idx, kv_idx):
    return SOFTCAP * kernels.tanh(score / SOFTCAP)


@triton.jit
def softcap_derivative(score, b, h, q_idx, kv_idx):
    capped = kernels.tanh(score / SOFTCAP)
    return 1.0 - capped * capped


@triton.jit
def relative_bias_mod(score, b, h, q_idx, kv_idx):
    return score + 0.05 * (h + 1).to(tl.float32) * (q_idx - kv_idx).to(tl.float32)


@triton.jit
def sliding_window_mask(b, h, q_idx, kv_idx):
    return (kv_idx <= q_idx) & (q_idx - kv_idx <= WINDOW)


@triton.jit
def document_mask(b, h, q_idx, kv_idx):
    return q_idx // DOCUMENT == kv_idx // DOCUMENT


@triton.jit
def causal_except_head_1(b, h, q_idx, kv_idx):
    return (kv_idx <= q_idx) | (h == 1)


def relative_bias(H, L):
    i, j = torch.arange(L)[:, None], torch.arange(L)[None, :]
    return torch.stack([0.05 * (h + 1) * (i - j) for h in range(H)])[None].float()


MOD_CASES = {
    # name: (score_mod, its derivative, mask_mod, the named call it equals)
    "softcap": (softcap_mod, softcap_derivative, None, dict(softcap=2.0)),
    "alibi": (alibi_mod, unit_derivative, None, dict(alibi_slopes=alibi_slopes(2))),
    "bias": (relative_bias_mod, unit_derivative, None, dict(bias=relative_bias(2, 40))),
    "causal": (None, None, causal_mask, dict(causal="top_left")),
    "sliding window": (None, None, sliding_window_mask, dict(window=(6, 0), causal="top_left")),
    "documents": (None, None, document_mask, dict(document_ids=torch.arange(40)[None].expand(2, 40) // 11)),
    "softcap + sliding window": (softcap_mod, softcap_derivative, sliding_window_mask,
                                 dict(softcap=2.0, window=(6, 0), causal="top_left")),
}


@pytest.mark.parametrize("case", list(MOD_CASES))
def test_mods_equal_the_named_variants(case):
    """A score_mod / mask_mod written to compute a named variant gives what the variant gives (and the reference),
    gradients included. (Sinks have no mod: a sink is a column with no key, not a change of a score.)"""
    score_mod, derivative, mask_mod, named = MOD_CASES[case]
    named = {name: x.to(DEVICE) if torch.is_tensor(x) else x for name, x in named.items()}  # (made at import)
    q, k, v, dout = make_problem(B=2, H=2, Lq=40, seed=21)
    causal = named.pop("causal", None)
    by_variant = run_triton(q, k, v, dout, causal=causal, **named)
    by_mods = run_triton(q, k, v, dout, score_mod=score_mod, score_mod_derivative=derivative, mask_mod=mask_mod)
    refs = run_reference(q, k, v, dout, causal=causal, **named)
    for name in ("out", "lse", "q", "k", "v"):
        pick = {"out": 0, "lse": 1}.get(name)
        x_variant = by_variant[pick] if pick is not None else by_variant[2][name]
        x_mods = by_mods[pick] if pick is not None else by_mods[2][name]
        ref = refs[pick] if pick is not None else refs[2][name]
        bound = 2e-5 * max(scale_of(ref), 1e-2)
        assert max_error(x_mods, ref) <= bound, f"{case}: mods' {name} off the reference"
        assert max_error(x_mods, x_variant.double().cpu().numpy()) <= bound, f"{case}: mods' {name} vs the variant's"


def test_score_mod_without_derivative_is_refused():
    q, k, v, dout = make_problem()
    out, lse = launcher.forward(q, k, v, score_mod=softcap_mod, **BLOCK)
    with pytest.raises(ValueError, match="score_mod_derivative"):
        launcher.gradients(q, k, v, out, lse, dout, score_mod=softcap_mod, **BLOCK)


@pytest.mark.parametrize("mods, message", [
    (dict(score_mod=summed_score_mod), "score_mod must return one score per"),
    (dict(score_mod=integer_score_mod), "score_mod must return floating-point scores"),
    (dict(mask_mod=numeric_mask), "mask_mod must return booleans"),
    (dict(mask_mod=row_mask), "mask_mod must return one boolean per"),
], ids=["1-D score", "integer score", "numeric mask", "1-D mask"])
def test_a_mod_of_the_wrong_shape_or_dtype_is_refused(mods, message):
    """A score_mod or mask_mod whose result would broadcast or convert into a wrong answer is refused when the
    kernel is compiled (or interpreted), with the kernels' own sentence as a ValueError."""
    q, k, v, _ = make_problem(B=1, H=2, Lq=20, seed=2)
    with pytest.raises(ValueError, match=message):
        launcher.forward(q, k, v, **mods, **BLOCK)


def test_mask_depending_on_the_head_and_a_mask_shared_by_batch():
    """A block mask built for H heads and B = 1 serves both batch entries; head 1 sees everything, head 0 is causal."""
    q, k, v, dout = make_problem(B=2, H=2, Lq=35, seed=2)
    mask = launcher.block_mask(causal_except_head_1, 1, 2, 35, 35, 16, 16)
    assert mask.tile_state[0, 1].eq(2).all() and mask.tile_state[0, 0].triu(1).eq(0).all()
    out, lse = launcher.forward(q, k, v, block_mask=mask)
    grads = launcher.gradients(q, k, v, out, lse, dout, block_mask=mask)
    for head, causal in ((0, "top_left"), (1, None)):
        part = [x[:, head:head + 1] for x in (q, k, v, dout)]
        refs = run_reference(*part, causal=causal)
        ours = (out[:, head:head + 1], lse[:, head:head + 1], {n: grads[n][:, head:head + 1] for n in "qkv"})
        assert_float32_close(ours, refs)


# ---------------------------------------------------------------------------------------------- block skipping

def test_block_mask_tiles_and_lists():
    """Tile states against the mask evaluated in NumPy, and the lists the kernels walk (visible blocks, ascending)."""
    L, block = 50, 16
    mask = launcher.block_mask(sliding_window_mask, 1, 1, L, L, block, block)
    i, j = np.arange(L)[:, None], np.arange(L)[None, :]
    dense = (j <= i) & (i - j <= 6)
    n = -(-L // block)
    for m in range(n):
        for b in range(n):
            tile = dense[m * block:(m + 1) * block, b * block:(b + 1) * block]
            expected = 0 if not tile.any() else 2 if tile.all() else 1
            assert int(mask.tile_state[0, 0, m, b]) == expected, (m, b)
        visible = [b for b in range(n) if dense[m * block:(m + 1) * block, b * block:(b + 1) * block].any()]
        count = int(mask.kv_count[0, 0, m])
        assert mask.kv_indices[0, 0, m, :count].tolist() == visible
        assert count == len(visible)
    for b in range(n):  # the transposed lists, for the dK/dV kernel
        visible = [m for m in range(n) if dense[m * block:(m + 1) * block, b * block:(b + 1) * block].any()]
        assert mask.q_indices[0, 0, b, :int(mask.q_count[0, 0, b])].tolist() == visible
    assert "BlockMask" in repr(mask)


@pytest.mark.parametrize("L", [64, 160])
def test_sliding_window_visits_do_not_grow_with_length(L):
    """A window of 6 keys with 16 x 16 blocks: at most 2 key blocks per query block at any length, through the
    arithmetic range and through the block mask alike; causal alone visits the lower triangle of blocks."""
    q, k, v, _ = make_problem(B=1, H=1, Lq=L, D=16, seed=L)
    window = canonical_variants(q, k, window=(6, 0))
    out, lse, visits = launcher.visited_key_blocks(q, k, v, causal="top_left", variants=window, **BLOCK)
    assert int(visits.max()) == 2 and int(visits.sum()) == 2 * (L // 16) - 1
    assert_float32_close((out, lse, {}), (*reference(q, k, v, causal="top_left", window=(6, 0)), {}))
    out_mod, _, visits_mod = launcher.visited_key_blocks(q, k, v, mask_mod=sliding_window_mask, **BLOCK)
    assert torch.equal(visits_mod, visits) and torch.allclose(out_mod, out, rtol=0, atol=1e-6)
    if L == 64:
        _, _, causal_visits = launcher.visited_key_blocks(q, k, v, causal="top_left", **BLOCK)
        n = L // 16
        assert causal_visits[0, 0].tolist() == list(range(1, n + 1))


def test_documents_skip_blocks_of_other_documents():
    """Sorted document ids: a query block visits only the key blocks its documents reach."""
    L = 64
    q, k, v, _ = make_problem(B=1, H=1, Lq=L, seed=8)
    ids = document_ids_from_cu_seqlens(torch.tensor([0, 16, 32, 48, 64]), L)[None]
    variants = canonical_variants(q, k, document_ids=ids)
    _, _, visits = launcher.visited_key_blocks(q, k, v, variants=variants, **BLOCK)
    assert visits[0, 0].tolist() == [1, 1, 1, 1]



def test_document_block_ranges_are_the_span_of_blocks_that_meet():
    """The launcher's per-block spans against a brute force over every pair of positions: sorted ids (exact spans),
    unsorted ids (the first to the last block that shares an id), different ids for q and k, a block that meets
    none (an empty span), and padding of a partial last block."""
    generator = torch.Generator().manual_seed(4)
    q_ids = torch.stack([torch.arange(37) // 9, torch.randint(0, 4, (37,), generator=generator)])
    k_ids = torch.stack([torch.arange(29) // 7 + 1, torch.randint(0, 4, (29,), generator=generator)])
    k_ids[1, :16] = 9  # no query has id 9: the first two key blocks of batch entry 1 meet no query block
    key_blocks, query_blocks = launcher.document_block_ranges(q_ids, k_ids, 16, 8)
    for b in range(2):
        meets = [[bool(np.isin(q_ids[b, m * 16:(m + 1) * 16], k_ids[b, n * 8:(n + 1) * 8]).any()) for n in range(4)]
                 for m in range(3)]
        for m in range(3):
            found = [n for n in range(4) if meets[m][n]]
            assert key_blocks[b, m].tolist() == ([found[0], found[-1] + 1] if found else [0, 0])
        for n in range(4):
            found = [m for m in range(3) if meets[m][n]]
            span = query_blocks[b, n].tolist()
            if not found:
                assert span[0] == span[1]
            else:  # the id ranges may overlap without a shared id: a superset, never a block missed
                assert span[0] <= found[0] and span[1] >= found[-1] + 1
    assert key_blocks[0].tolist() == [[0, 1], [0, 3], [1, 4]]  # sorted ids: exact, from the ranges alone
    assert query_blocks[1, 0].tolist() == [0, 0] and query_blocks[1, 1].tolist() == [0, 0]


def test_unsorted_document_ids_forward_and_gradients():
    """Ids that repeat out of order (a mask, not packing): the spans cover every block that shares an id, so the
    answer is the reference's, gradients included."""
    q, k, v, dout = make_problem(B=2, H=2, Lq=45, Lk=38, seed=12)
    generator = torch.Generator().manual_seed(3)
    ids = (torch.randint(0, 3, (2, 45), generator=generator), torch.randint(0, 3, (2, 38), generator=generator))
    ids = tuple(x.to(DEVICE) for x in ids)
    for causal in (None, "bottom_right"):
        ours = run_triton(q, k, v, dout, causal=causal, document_ids=ids)
        assert_float32_close(ours, run_reference(q, k, v, dout, causal=causal, document_ids=ids))


# ---------------------------------------------------------------------------------------------- interpreter helpers

@triton.jit
def _elementwise(X, Out, N: tl.constexpr, WHICH: tl.constexpr):
    at = tl.arange(0, N)
    x = tl.load(X + at)
    if WHICH == "tanh":
        tl.store(Out + at, kernels.tanh(x))
    else:
        tl.store(Out + at, kernels.cast(x, tl.bfloat16))


@pytest.mark.skipif(not launcher.interpreting(), reason="the interpreter's own tanh and cast (a GPU uses libdevice)")
def test_tanh_and_bfloat16_rounding_on_the_interpreter():
    """The interpreter's tanh (no libdevice there) within a few float32 ulps from 1e-30 to 100, exact at 0, ±inf and
    NaN; its float32 -> bfloat16 cast rounded to nearest even, as torch (and a GPU) round."""
    magnitudes = torch.logspace(-30, 2, 1022)  # (2 x 1022 + 4: a power of two, as tl.arange wants)
    x = torch.cat([magnitudes, -magnitudes, torch.tensor([0.0, float("inf"), -float("inf"), float("nan")])])
    out = torch.empty_like(x)
    _elementwise[(1,)](x, out, x.numel(), "tanh")
    want = torch.tanh(x.double())
    finite = torch.isfinite(want) & (want != 0)
    ulps = ((out.double() - want).abs() / want.abs())[finite].max() / 2.0**-24
    assert ulps <= 8, f"tanh off by {ulps:.1f} ulps"
    assert out[-4:-1].tolist() == [0.0, 1.0, -1.0] and torch.isnan(out[-1])
    x = torch.randn(1024, generator=torch.Generator().manual_seed(0))
    rounded = torch.empty(1024, dtype=torch.bfloat16)
    _elementwise[(1,)](x, rounded, 1024, "cast")
    assert torch.equal(rounded, x.to(torch.bfloat16))


# ---------------------------------------------------------------------------------------------- the stage

def test_stage_registration_and_numpy_inputs():
    assert STAGE.name == "triton" and STAGE.order == 11 and STAGE.linear_memory and not STAGE.needs_gpu
    assert set(STAGE.variants) == {"softcap", "alibi_slopes", "bias", "window", "document_ids", "sinks"}
    assert STAGE.simulator_seconds(1, 2, 64, 64, 16) < 5 < STAGE.simulator_seconds(8, 16, 4096, 4096, 128)
    q, k, v, dout = (x.cpu().numpy() for x in make_problem(B=1, H=2, Lq=33, seed=1))
    out, lse = STAGE.forward(q, k, v, causal="top_left", key_padding_mask=None, scale=None)
    assert isinstance(out, np.ndarray) and out.dtype == np.float32
    out_ref, _ = reference(q, k, v, causal="top_left")
    assert np.abs(out - out_ref).max() < 1e-5
    from wb_kernels.stages.triton import BACKWARDS

    dq, dk, dv = BACKWARDS[0].gradients(q, k, v, out, lse, dout, causal="top_left", key_padding_mask=None, scale=None)
    assert isinstance(dq, np.ndarray) and dq.shape == q.shape


def test_package_import_leaves_triton_alone_and_errors_are_clear():
    """In a fresh process: importing the rung imports no triton; without triton a launch says `pip install triton`;
    TRITON_INTERPRET=0 on a CPU-only run is an error that says so, and so is triton imported for its compiler before
    wb_kernels could ask for the interpreter (wb_kernels sets it on import: tests/test_backend.py)."""
    script = textwrap.dedent("""
        import os, sys
        os.environ.pop("TRITON_INTERPRET", None)
        import wb_kernels.stages.triton as rung
        from wb_kernels.stages.triton import launcher
        assert "triton" not in sys.modules, "importing the rung imported triton"
        import torch
        q = torch.zeros(1, 1, 16, 16)
        sys.modules["triton"] = None  # as if triton were not installed
        try:
            launcher.forward(q, q, q)
        except ImportError as error:
            assert "pip install triton" in str(error), error
        else:
            raise AssertionError("no ImportError without triton")
        del sys.modules["triton"]
        os.environ["TRITON_INTERPRET"] = "0"
        try:
            launcher.forward(q, q, q)
        except RuntimeError as error:
            assert "interpreter" in str(error) and "TRITON_INTERPRET=0" in str(error), error
        else:
            raise AssertionError("no error for TRITON_INTERPRET=0 without a GPU")
        del os.environ["TRITON_INTERPRET"]
        import triton  # for the compiler, before wb_kernels could set the interpreter: an error that says what to do
        try:
            launcher.forward(q, q, q)
        except RuntimeError as error:
            assert "import wb_kernels before anything imports triton" in str(error), error
        else:
            raise AssertionError("no error for triton imported for its compiler without a GPU")
        print("ok")
    """)
    environment = dict(os.environ, WB_BACKEND="simulator")
    environment.pop("TRITON_INTERPRET", None)
    found = subprocess.run([sys.executable, "-c", script], cwd=ROOT, env=environment, capture_output=True, text=True,
                           timeout=120)
    assert found.returncode == 0 and found.stdout.strip() == "ok", found.stderr[-3000:]


def test_the_compiled_code_summary_counts_instruction_families():
    from wb_kernels.stages.triton.compiled import summarize_ptx

    ptx = "\n".join(["\twgmma.mma_async.sync.aligned.m64n64k16.f32.f16.f16 {%f1}, %rd1, %rd2;",
                     "\twgmma.mma_async.sync.aligned.m64n64k16.f32.f16.f16 {%f2}, %rd3, %rd4;",
                     "\tcp.async.cg.shared.global [%r1], [%rd5], 16;", "\tex2.approx.f32 %f3, %f4;",
                     "\tmma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%f5}, {%r2}, {%r3}, {%f6};",
                     "\tbar.sync 0;", "\tld.global.b32 %r4, [%rd6];"])
    found = summarize_ptx(ptx)
    counts = found["instructions"]
    assert counts["wgmma (Hopper warpgroup tensor-core MMA, lesson 09)"] == 2
    assert counts["mma.sync (warp tensor-core MMA, lesson 06)"] == 1
    assert counts["cp.async (global -> shared without registers, pipelined)"] == 1
    assert counts["cp.async.bulk (TMA, lesson 09)"] == 0 and counts["bar.sync (block barriers)"] == 1
    assert found["mma_shapes"] == {"m64n64k16": 2, "m16n8k16": 1} and found["ptx_lines"] == 7
