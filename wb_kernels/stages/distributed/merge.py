"""The log-sum-exp merge of partial attention results, in torch, for ranks that each hold part of the keys.

Lesson 07 teaches the merge (:func:`wb_kernels.stages.decode.splitkv.merge_partials`, float64 NumPy, the source of
truth this file is tested against): partial results over disjoint key sets, each normalised over its own keys and
carrying its log-sum-exp, combine exactly as

    lse = log(sum_s exp(lse_s))        out = sum_s exp(lse_s - lse) * out_s

A split that saw no key (lse_s = -inf) weighs exp(-inf) = 0; a row where every split is empty stays out 0,
lse -inf. The same formula is written here for torch tensors because the distributed code merges on each rank's
device in the accumulation dtype (float32 for fp16/bf16/fp32 inputs, float64 for float64), where the NumPy version
would copy to the host and compute in float64. Used by ``ring.py``, ``decode.py`` and ``ulysses.py`` (the packing).
"""

from __future__ import annotations

import torch

__all__ = ["accumulation_dtype", "merge_stack", "merge_pair", "merge_into", "pack", "unpack"]


def accumulation_dtype(dtype):
    """float64 for float64 inputs, float32 for every narrower float: partials accumulate in at least fp32 (in bf16
    the ring's error grows with every step, ring-flash-attention's issue #42)."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def merge_stack(outs, lses):
    """outs (S, ..., D), lses (S, ...) -> (out (..., D), lse (...)), in the dtype of `outs`.

    Weights exp(lse_s - max_s lse_s): the largest is 1, nothing overflows. The shift uses 0 where the maximum is
    -inf (every split empty) so that no -inf - -inf = NaN appears; those rows give 0 and -inf. A NaN lse (NaN input)
    is not -inf, so it reaches the output, as in the single-process result.
    """
    top = lses.amax(dim=0)
    seen = top != float("-inf")
    weights = torch.exp(lses - torch.where(seen, top, torch.zeros_like(top)))
    total = weights.sum(dim=0)
    safe_total = torch.where(seen, total, torch.ones_like(total))
    out = (weights.unsqueeze(-1) * outs).sum(dim=0) / safe_total.unsqueeze(-1)
    out = torch.where(seen.unsqueeze(-1), out, torch.zeros_like(out))
    lse = torch.where(seen, top + torch.log(safe_total), torch.full_like(top, float("-inf")))
    return out, lse


def merge_pair(out_a, lse_a, out_b, lse_b):
    """(out_a, lse_a) + (out_b, lse_b) -> (out, lse) over the union of two disjoint key sets, in the dtype of
    `out_a` (the accumulator's: the caller converts `out_b`)."""
    dtype = out_a.dtype
    return merge_stack(torch.stack([out_a, out_b.to(dtype)]), torch.stack([lse_a.to(dtype), lse_b.to(dtype)]))


def merge_into(acc_out, acc_lse, out, lse):
    """Merge (out, lse) into the accumulator (acc_out, acc_lse) in place: :func:`merge_pair`'s result, written where
    the accumulator is (views such as ``acc[:, :, rows]`` included). The ring merges once per block and step; at
    L = 128k an fp32 accumulator is half a GB per rank, so :func:`merge_pair`'s stacked copies would cost several
    passes over it where this makes one: scale the accumulator, add the new part (``addcmul_`` converts `out`
    on the fly). Same guards: a row that neither side has seen stays 0 / -inf, never NaN."""
    lse = lse.to(acc_lse.dtype)
    top = torch.maximum(acc_lse, lse)
    seen = top != float("-inf")
    shift = torch.where(seen, top, torch.zeros_like(top))
    old_weight, new_weight = torch.exp(acc_lse - shift), torch.exp(lse - shift)
    total = old_weight + new_weight
    safe_total = torch.where(seen, total, torch.ones_like(total))
    acc_out.mul_((old_weight / safe_total).unsqueeze(-1))
    acc_out.addcmul_(out, (new_weight / safe_total).unsqueeze(-1))
    acc_lse.copy_(torch.where(seen, shift + torch.log(safe_total), top))


def pack(out, lse):
    """(out (..., D), lse (...)) as one tensor (..., D + 1) in the LSE's dtype (float32 or float64), so that one
    collective moves both; an fp16/bf16 output converts to float32 and back exactly."""
    return torch.cat([out.to(lse.dtype), lse.unsqueeze(-1)], dim=-1)


def unpack(packed, out_dtype):
    """The inverse of :func:`pack`: (out in `out_dtype`, lse)."""
    return packed[..., :-1].to(out_dtype), packed[..., -1]
