"""``wb.attention_varlen``: packed sequences in flash-attn's varlen layout, against each sequence computed alone.

The independent computation is the plain one: every sequence sliced out and given to ``wb.attention`` as its own
batch of one, with no document ids at all; the packed call must equal the concatenation, outputs, LSE and gradients.
The reference runs in float64 everywhere; the triton stage on Triton's interpreter (CPU) or on a GPU.
"""

from __future__ import annotations

import numpy as np
import pytest

import wb_kernels as wb

torch = pytest.importorskip("torch")

SEQUENCE_LENGTHS_Q = [5, 17, 1, 9]
SEQUENCE_LENGTHS_K = [7, 3, 12, 9]  # non-causal calls may pair each query sequence with keys of another length


def _offsets(lengths):
    return torch.tensor(np.concatenate([[0], np.cumsum(lengths)]), dtype=torch.int32)


def _packed(lengths_q, lengths_k, H=4, Hk=2, D=16, dtype=torch.float64, seed=0, device="cpu"):
    generator = torch.Generator().manual_seed(seed)
    draw = lambda total, heads: torch.randn(total, heads, D, generator=generator, dtype=torch.float64).to(  # noqa: E731
        dtype).to(device)
    return draw(sum(lengths_q), H), draw(sum(lengths_k), Hk), draw(sum(lengths_k), Hk)


def _each_alone(q, k, v, lengths_q, lengths_k, **options):
    """Each sequence as its own batch of one: (out (total_q, H, D), lse (H, total_q))."""
    outs, lses = [], []
    cq, ck = _offsets(lengths_q).tolist(), _offsets(lengths_k).tolist()
    for i in range(len(lengths_q)):
        qs, ks, vs = (x[a:b].transpose(0, 1)[None] for x, a, b in ((q, cq[i], cq[i + 1]), (k, ck[i], ck[i + 1]),
                                                                   (v, ck[i], ck[i + 1])))
        out, lse = wb.attention(qs, ks, vs, return_lse=True, **options)
        outs.append(out[0].transpose(0, 1))
        lses.append(lse[0])
    return torch.cat(outs), torch.cat(lses, dim=1)


@pytest.mark.parametrize("case", ["causal", "different key lengths", "window + softcap"])
def test_reference_equals_each_sequence_alone(case):
    lengths_k = SEQUENCE_LENGTHS_K if case == "different key lengths" else SEQUENCE_LENGTHS_Q
    q, k, v = _packed(SEQUENCE_LENGTHS_Q, lengths_k, seed=1)
    options = {"causal": dict(causal=True), "different key lengths": {},
               "window + softcap": dict(causal=True, window=(3, 0), softcap=2.0)}[case]
    cu_k = None if lengths_k is SEQUENCE_LENGTHS_Q else _offsets(lengths_k)
    out, lse = wb.attention_varlen(q, k, v, _offsets(SEQUENCE_LENGTHS_Q), cu_k, return_lse=True, **options)
    expected_out, expected_lse = _each_alone(q, k, v, SEQUENCE_LENGTHS_Q, lengths_k, **options)
    assert out.shape == q.shape and lse.shape == (q.shape[1], q.shape[0])
    np.testing.assert_allclose(out.numpy(), expected_out.numpy(), rtol=0, atol=1e-12)
    np.testing.assert_allclose(lse.numpy(), expected_lse.numpy(), rtol=0, atol=1e-12)


def test_numpy_inputs_give_numpy_outputs():
    q, k, v = (x.numpy() for x in _packed(SEQUENCE_LENGTHS_Q, SEQUENCE_LENGTHS_Q, seed=2))
    out = wb.attention_varlen(q, k, v, np.array([0, 5, 22, 23, 32]), causal=True)
    assert isinstance(out, np.ndarray) and out.shape == q.shape
    expected, _ = _each_alone(*(torch.from_numpy(x) for x in (q, k, v)), SEQUENCE_LENGTHS_Q, SEQUENCE_LENGTHS_Q,
                              causal=True)
    np.testing.assert_allclose(out, expected.numpy(), rtol=0, atol=1e-12)


def test_triton_stage_forward_and_gradients():
    """The triton stage (packed documents skipped tile by tile) against each sequence alone on the reference."""
    pytest.importorskip("triton")
    from wb_kernels.stages.triton import launcher

    device = "cpu" if launcher.interpreting() else "cuda"
    for lengths_k, causal in ((SEQUENCE_LENGTHS_Q, True), (SEQUENCE_LENGTHS_K, False)):
        q, k, v = _packed(SEQUENCE_LENGTHS_Q, lengths_k, dtype=torch.float32, seed=3, device=device)
        q64, k64, v64 = (x.detach().double().cpu().requires_grad_() for x in (q, k, v))
        q, k, v = (x.requires_grad_() for x in (q, k, v))
        cu_k = None if causal else _offsets(lengths_k).to(device)
        out, lse = wb.attention_varlen(q, k, v, _offsets(SEQUENCE_LENGTHS_Q).to(device), cu_k, stage="triton",
                                       causal=causal, return_lse=True)
        expected, expected_lse = _each_alone(q64, k64, v64, SEQUENCE_LENGTHS_Q, lengths_k, causal=causal)
        dout = torch.randn_like(expected)
        (out * dout.to(out)).sum().backward()
        (expected * dout).sum().backward()
        np.testing.assert_allclose(out.detach().cpu().numpy(), expected.detach().numpy(), rtol=0, atol=2e-5)
        np.testing.assert_allclose(lse.cpu().numpy(), expected_lse.detach().numpy(), rtol=0, atol=2e-5)
        for ours, theirs in ((q, q64), (k, k64), (v, v64)):
            np.testing.assert_allclose(ours.grad.cpu().numpy(), theirs.grad.numpy(), rtol=0, atol=1e-4)


@pytest.mark.parametrize("bad, message", [
    (dict(cu_seqlens_q=torch.tensor([1, 5, 32])), "start at 0"),
    (dict(cu_seqlens_q=torch.tensor([0, 20, 5, 32])), "never decrease"),
    (dict(cu_seqlens_q=torch.tensor([0, 5, 30])), "end at the packed length 32"),
    (dict(cu_seqlens_q=torch.tensor([0.0, 32.0])), "1-D integer array"),
    (dict(cu_seqlens_k=torch.tensor([0, 32])), "4 sequences, cu_seqlens_k 1"),
    (dict(cu_seqlens_k=torch.tensor([0, 7, 10, 22, 32]), causal=True), "causal=True needs cu_seqlens_k equal"),
])
def test_bad_offsets_are_refused(bad, message):
    q, k, v = _packed(SEQUENCE_LENGTHS_Q, SEQUENCE_LENGTHS_Q, seed=4)
    call = dict(cu_seqlens_q=_offsets(SEQUENCE_LENGTHS_Q), cu_seqlens_k=None, causal=False)
    call.update(bad)
    with pytest.raises(ValueError, match=message):
        wb.attention_varlen(q, k, v, call.pop("cu_seqlens_q"), call.pop("cu_seqlens_k"), **call)


def test_batched_inputs_are_refused_with_the_right_function_named():
    q = torch.zeros(1, 2, 8, 16, dtype=torch.float64)
    with pytest.raises(ValueError, match="use wb.attention"):
        wb.attention_varlen(q, q, q, torch.tensor([0, 8]))


def test_a_stage_without_document_ids_is_refused_naming_those_that_have_them():
    q, k, v = _packed(SEQUENCE_LENGTHS_Q, SEQUENCE_LENGTHS_Q, dtype=torch.float32, seed=5)
    with pytest.raises(ValueError, match="document_ids"):
        wb.attention_varlen(q, k, v, _offsets(SEQUENCE_LENGTHS_Q), stage="tiled")
