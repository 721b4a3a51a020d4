"""The attention variants (wb_kernels.variants) in the float64 reference, against an independent computation: the
same formula written in PyTorch ops in float64, differentiated by autograd (forward, LSE and every gradient, the
bias's and the sinks' included), and each argument's errors."""

import numpy as np
import pytest
import torch

from wb_kernels.reference import reference, reference_gradients
from wb_kernels.variants import canonical_variants, document_ids_from_cu_seqlens

B, H, HK, D = 2, 4, 2, 8


def _problem(Lq, Lk, seed=0):
    rng = np.random.default_rng(seed)

    def leaf(*shape):
        return torch.tensor(rng.standard_normal(shape), dtype=torch.float64, requires_grad=True)

    return leaf(B, H, Lq, D), leaf(B, HK, Lk, D), leaf(B, HK, Lk, D), rng


def _torch_ops(q, k, v, *, causal, softcap=None, alibi_slopes=None, bias=None, window=None, document_ids=None,
               sinks=None):
    """The variants' order written out in float64 PyTorch ops, independently of the reference's code."""
    Lq, Lk = q.shape[2], k.shape[2]
    kk, vv = k.repeat_interleave(H // HK, 1), v.repeat_interleave(H // HK, 1)
    s = q @ kk.transpose(-1, -2) * D ** -0.5
    if softcap is not None:
        s = softcap * torch.tanh(s / softcap)
    offset = Lk - Lq if causal == "bottom_right" else 0
    distance = torch.arange(Lk)[None] - (torch.arange(Lq)[:, None] + offset)
    if alibi_slopes is not None:
        s = s - alibi_slopes[None, :, None, None] * distance.abs()
    if bias is not None:
        s = s + bias
    visible = torch.ones(Lq, Lk, dtype=torch.bool)
    if causal:
        visible &= distance <= 0
    if window is not None:
        visible &= (distance >= -window[0]) & (distance <= window[1])
    visible = visible[None, None].expand(B, 1, Lq, Lk)
    if document_ids is not None:
        visible = visible & (document_ids[:, None, :, None] == document_ids[:, None, None, :])
    s = s.masked_fill(~visible, float("-inf"))
    if sinks is not None:
        s = torch.cat([s, sinks[None, :, None, None].expand(B, H, Lq, 1)], -1)
    lse = torch.logsumexp(s, -1)
    p = torch.where(torch.isfinite(lse)[..., None], torch.softmax(s, -1), torch.zeros_like(s))[..., :Lk]
    return p @ vv, lse


VARIANTS = {
    "softcap": lambda rng, L: dict(softcap=2.0),
    "alibi": lambda rng, L: dict(alibi_slopes=torch.tensor(rng.uniform(0.1, 1.0, H))),
    "bias": lambda rng, L: dict(bias=torch.tensor(rng.standard_normal((1, H, L, L)), requires_grad=True)),
    "bias_b11": lambda rng, L: dict(bias=torch.tensor(rng.standard_normal((B, 1, 1, L)), requires_grad=True)),
    "window": lambda rng, L: dict(window=(3, 1)),
    "documents": lambda rng, L: dict(document_ids=document_ids_from_cu_seqlens(torch.tensor([0, 4, 9]), L)[None]
                                     .expand(B, L)),
    "sinks": lambda rng, L: dict(sinks=torch.tensor(rng.standard_normal(H), requires_grad=True)),
    "window+sinks (gpt-oss)": lambda rng, L: dict(window=(4, 0), sinks=torch.tensor(rng.standard_normal(H),
                                                                                   requires_grad=True)),
    "window+softcap (Gemma 2)": lambda rng, L: dict(window=(4, 0), softcap=1.5),
    "everything": lambda rng, L: dict(softcap=3.0, alibi_slopes=torch.tensor(rng.uniform(0, 1, H)),
                                      bias=torch.tensor(rng.standard_normal((1, H, L, L)), requires_grad=True),
                                      window=(3, 1), document_ids=document_ids_from_cu_seqlens(
                                          torch.tensor([0, 4, 9]), L)[None].expand(B, L),
                                      sinks=torch.tensor(rng.standard_normal(H), requires_grad=True)),
}


@pytest.mark.parametrize("causal", [None, "top_left"])
@pytest.mark.parametrize("name", list(VARIANTS))
def test_reference_variants_match_an_independent_float64_computation(name, causal):
    L = 11
    q, k, v, rng = _problem(L, L)
    variants = VARIANTS[name](rng, L)
    out, lse = _torch_ops(q, k, v, causal=causal, **variants)
    ref_out, ref_lse = reference(q, k, v, causal=causal, **variants)
    np.testing.assert_allclose(ref_out, out.detach().numpy(), atol=1e-12)
    np.testing.assert_allclose(ref_lse, lse.detach().numpy(), atol=1e-12)
    dout = torch.randn_like(out)
    names = ["q", "k", "v"] + [n for n in ("bias", "sinks") if n in variants]
    leaves = [q, k, v] + [variants[n] for n in names[3:]]
    expected = torch.autograd.grad(out, leaves, dout)
    got = reference_gradients(q, k, v, dout, causal=causal, **variants)
    assert sorted(got) == sorted(names)
    for n, e in zip(names, expected):
        np.testing.assert_allclose(got[n], e.numpy(), atol=1e-11, err_msg=n)


def test_bottom_right_alignment_moves_window_and_alibi_with_the_diagonal():
    q, k, v, rng = _problem(5, 9)
    variants = dict(window=(2, 0), alibi_slopes=torch.tensor(rng.uniform(0.1, 1.0, H)))
    out, lse = _torch_ops(q, k, v, causal="bottom_right", **variants)
    ref_out, ref_lse = reference(q, k, v, causal="bottom_right", **variants)
    np.testing.assert_allclose(ref_out, out.detach().numpy(), atol=1e-12)
    np.testing.assert_allclose(ref_lse, lse.detach().numpy(), atol=1e-12)


def test_softcap_comes_before_the_bias():
    """Gemma 2's order: the scaled score is capped, then the bias is added (a bias inside the tanh is squashed)."""
    q, k, v, _ = _problem(6, 6)
    bias = torch.full((1, 1, 6, 6), 10.0)
    _, lse = reference(q, k, v, softcap=1.0, bias=bias)
    # every capped score lies in (-1, 1), so with the bias added after the cap the LSE lies in 10 + (-1, 1) + log 6
    assert np.all(np.abs(lse - 10.0 - np.log(6)) < 1.0)


def test_a_row_that_sees_no_key_gives_zeros_and_its_sink_as_lse():
    q, k, v, _ = _problem(4, 4)
    sinks = torch.tensor([0.5, -1.0, 2.0, 0.0], dtype=torch.float64)
    ids_q, ids_k = torch.zeros(B, 4, dtype=torch.int64), torch.ones(B, 4, dtype=torch.int64)  # no shared document
    out, lse = reference(q, k, v, document_ids=(ids_q, ids_k), sinks=sinks)
    assert np.all(out == 0)
    np.testing.assert_array_equal(lse, np.broadcast_to(sinks.numpy()[None, :, None], lse.shape))
    out, lse = reference(q, k, v, document_ids=(ids_q, ids_k))
    assert np.all(out == 0) and np.all(lse == -np.inf)


def test_a_nan_in_the_bias_reaches_its_row_only_where_the_key_is_visible():
    q, k, v, _ = _problem(5, 5)
    bias = torch.zeros(1, 1, 5, 5, dtype=torch.float64)
    bias[0, 0, 1, 3] = float("nan")  # row 1, key 3: masked by causal
    bias[0, 0, 3, 2] = float("nan")  # row 3, key 2: visible
    out, _ = reference(q, k, v, causal=True, bias=bias)
    rows_nan = np.isnan(out).any(-1)[0, 0]
    assert rows_nan.tolist() == [False, False, False, True, False]


def test_cu_seqlens_become_document_ids_with_padding_minus_one():
    assert document_ids_from_cu_seqlens(np.array([0, 2, 5]), 7).tolist() == [0, 0, 1, 1, 1, -1, -1]
    assert document_ids_from_cu_seqlens(torch.tensor([0, 3]), 3).tolist() == [0, 0, 0]


@pytest.mark.parametrize("kwargs, error, words", [
    (dict(window=-1), ValueError, "negative"),
    (dict(window=(2, -3)), ValueError, "negative"),
    (dict(window=2.5), TypeError, "window"),
    (dict(window=(1, 2, 3)), TypeError, "pair"),
    (dict(softcap=0.0), ValueError, "softcap"),
    (dict(softcap=float("inf")), ValueError, "softcap"),
    (dict(softcap="50"), TypeError, "softcap"),
    (dict(bias=torch.zeros(B, H, 6)), ValueError, "broadcasts"),
    (dict(bias=torch.zeros(B, H, 6, 3)), ValueError, "broadcasts"),
    (dict(bias=torch.zeros(B, H, 6, 6, dtype=torch.int32)), TypeError, "floating"),
    (dict(bias=np.zeros((B, H, 6, 6))), TypeError, "torch tensor"),
    (dict(sinks=torch.zeros(H + 1)), ValueError, "one logit per query head"),
    (dict(alibi_slopes=torch.zeros(H, 2)), ValueError, "alibi_slopes"),
    (dict(document_ids=torch.zeros(B, 6)), TypeError, "integer"),
    (dict(document_ids=torch.zeros(B, 5, dtype=torch.int64)), ValueError, "(B, L)"),
])
def test_bad_variants_get_errors_that_name_the_argument(kwargs, error, words):
    q, k, _, _ = _problem(6, 6)
    with pytest.raises(error, match=None) as raised:
        canonical_variants(q, k, **kwargs)
    assert words in str(raised.value), str(raised.value)


# ------------------------------------------------------------------------------ through the front door

import wb_kernels as wb  # noqa: E402


def _front_door_problem():
    q, k, v, rng = _problem(7, 7, seed=3)
    variants = dict(softcap=2.0, bias=torch.tensor(rng.standard_normal((1, H, 7, 7)), requires_grad=True),
                    sinks=torch.tensor(rng.standard_normal(H), requires_grad=True), window=(2, 0),
                    alibi_slopes=torch.tensor(rng.uniform(0, 1, H)))
    return q, k, v, variants


def test_wb_attention_carries_the_variants_and_their_gradients_through_autograd():
    q, k, v, variants = _front_door_problem()
    out, lse = wb.attention(q, k, v, causal=True, return_lse=True, **variants)
    ref_out, ref_lse = reference(q, k, v, causal=True, **variants)
    np.testing.assert_array_equal(out.detach().numpy(), ref_out)
    np.testing.assert_array_equal(lse.numpy(), ref_lse)
    dout = torch.randn_like(out)
    out.backward(dout)
    expected = reference_gradients(q, k, v, dout, causal=True, **variants)
    for name, leaf in (("q", q), ("k", k), ("v", v), ("bias", variants["bias"]), ("sinks", variants["sinks"])):
        np.testing.assert_allclose(leaf.grad.numpy(), expected[name], atol=1e-13, err_msg=name)
    by_hand = wb.attention_backward(q.detach(), k.detach(), v.detach(), dout, causal=True, **variants)
    assert len(by_hand) == 5
    np.testing.assert_allclose(by_hand[3].numpy(), expected["bias"], atol=1e-13)
    np.testing.assert_allclose(by_hand[4].numpy(), expected["sinks"], atol=1e-13)


def test_a_compiled_call_with_variants_matches_the_eager_one_with_gradients():
    q, k, v, variants = _front_door_problem()
    bias, sinks = variants["bias"], variants["sinks"]

    def step(q, k, v, bias, sinks):
        return wb.attention(q, k, v, causal=True, softcap=2.0, bias=bias, sinks=sinks, window=(2, 0))

    eager = step(q, k, v, bias, sinks)
    eager.sum().backward()
    expected = [x.grad.clone() for x in (q, k, v, bias, sinks)]
    for x in (q, k, v, bias, sinks):
        x.grad = None
    compiled = torch.compile(step, fullgraph=True)(q, k, v, bias, sinks)
    compiled.sum().backward()
    torch.testing.assert_close(compiled, eager, rtol=0, atol=0)
    for x, e in zip((q, k, v, bias, sinks), expected):
        torch.testing.assert_close(x.grad, e, rtol=0, atol=0)


def test_a_stage_without_a_variant_is_refused_naming_those_that_have_it():
    q, k, v, _ = _problem(6, 6)
    with pytest.raises(ValueError, match="stage 'flash' does not compute softcap, sinks; the stages that compute "
                                         "softcap, sinks are reference"):
        wb.attention(q.float(), k.float(), v.float(), stage="flash", softcap=1.0, sinks=torch.zeros(H))


def test_check_fails_a_result_that_drops_a_variant():
    q, k, v, variants = _front_door_problem()
    variants = {n: (x.detach().float() if torch.is_tensor(x) else x) for n, x in variants.items()}
    q, k, v = (x.detach().float() for x in (q, k, v))
    good, lse = reference(q, k, v, causal=True, **variants)
    wb.check("reference in float32", torch.from_numpy(good).float(), q, k, v, lse=torch.from_numpy(lse).float(),
             causal=True, **variants)
    for dropped in ("softcap", "bias", "sinks", "window", "alibi_slopes"):
        wrong, _ = reference(q, k, v, causal=True, **{**variants, dropped: None})
        result = wb.check(f"without {dropped}", torch.from_numpy(wrong).float(), q, k, v, causal=True,
                          raise_on_failure=False, verbose=False, **variants)
        assert not result.passed, dropped
