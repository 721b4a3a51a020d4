"""Ulysses (DeepSpeed-Ulysses, Jacobs et al. 2023): two all-to-alls instead of a ring.

The sequence arrives sharded over W ranks (contiguous layout). One ``dist.all_to_all_single`` per tensor turns
"every head, my positions" into "my H / W heads, every position"; each rank then runs ordinary full attention on
its heads (any mask, any Lq and Lk: it sees whole sequences), and one more all-to-all turns the output back. Its
degree is bounded by the heads: W must divide H and the KV heads Hk (GQA: query head h uses KV head h // (H / Hk),
so the query heads of one rank use a contiguous run of H / W / (H / Hk) = Hk / W KV heads). The ring has no such
bound but W steps of exchange; Ulysses moves each tensor once (volume per rank ~ 4 x its shard, not W x).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from .agreement import agree
from .merge import pack, unpack
from .ring import SAME
from .sharding import chunk_bounds

__all__ = ["ulysses_attention", "ulysses_attention_backward", "seq_to_heads", "heads_to_seq"]


def seq_to_heads(x, length: int, group=None):
    """x (B, Hx, n_r, D), this rank's contiguous shard of `length` positions -> (B, Hx / W, length, D), this rank's
    heads over every position."""
    world = dist.get_world_size(group)
    B, Hx, n, D = x.shape
    heads = Hx // world
    send = x.reshape(B, world, heads, n, D).transpose(0, 1).contiguous().reshape(-1)  # rank w's heads, in order
    sizes = [b - a for a, b in chunk_bounds(length, world)]
    recv = x.new_empty(B * heads * length * D)
    dist.all_to_all_single(recv, send, output_split_sizes=[B * heads * s * D for s in sizes],
                           input_split_sizes=[B * heads * n * D] * world, group=group)
    parts = recv.split([B * heads * s * D for s in sizes])
    return torch.cat([p.reshape(B, heads, s, D) for p, s in zip(parts, sizes)], dim=2)


def heads_to_seq(y, length: int, group=None):
    """The inverse: y (B, h, length, D), this rank's heads -> (B, h x W, n_r, D), every head of its positions."""
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    B, heads, _, D = y.shape
    bounds = chunk_bounds(length, world)
    n = bounds[rank][1] - bounds[rank][0]
    send = torch.cat([y[:, :, a:b].reshape(-1) for a, b in bounds])  # positions of rank w, in order
    recv = y.new_empty(world * B * heads * n * D)
    dist.all_to_all_single(recv, send, output_split_sizes=[B * heads * n * D] * world,
                           input_split_sizes=[B * heads * (b - a) * D for a, b in bounds], group=group)
    return recv.reshape(world, B, heads, n, D).transpose(0, 1).reshape(B, world * heads, n, D)


def ulysses_attention(q, k, v, *, Lq: int, Lk: int, causal=False, key_padding_mask=None, scale=None,
                      stage: str = "reference", group=None, check_finite=True):
    """This rank's share of exact attention: q (B, H, nq, D), k and v (B, Hk, nk, D) contiguous shards (as
    ``sharding.shard_pieces(..., "contiguous")``) of Lq queries and Lk keys. `causal`, `key_padding_mask`
    (whole (B, Lk)) and `check_finite` as in ``wb.attention``. Returns (out (B, H, nq, D) in q's dtype, lse
    (B, H, nq))."""
    import wb_kernels as wb

    # one small all-gather: shard lengths (contiguous), heads W divides, and everything the ranks must agree on,
    # checked on every rank before the first all-to-all
    agree("ulysses_attention", q=q, k=k, v=v, key_padding_mask=key_padding_mask, Lq=Lq, Lk=Lk, causal=causal,
          scale=scale, group=group, same=SAME, heads_divide=True)
    qh, kh, vh = seq_to_heads(q, Lq, group), seq_to_heads(k, Lk, group), seq_to_heads(v, Lk, group)
    out, lse = wb.attention(qh, kh, vh, stage=stage, causal=causal, key_padding_mask=key_padding_mask, scale=scale,
                            return_lse=True, check_finite=check_finite)
    return unpack(heads_to_seq(pack(out, lse), Lq, group), q.dtype)


def ulysses_attention_backward(q, k, v, out, lse, dout, *, Lq: int, Lk: int, causal=False, key_padding_mask=None,
                               scale=None, stage: str = "reference", group=None):
    """This rank's shards of (dq, dk, dv) for :func:`ulysses_attention`'s result: the same all-to-alls around one
    whole-sequence backward per rank. q, k, v as the forward took them, `out` and `lse` what it returned, `dout`
    the loss gradient of this rank's rows. Each rank's heads see every key, so ``wb.attention_backward`` with the
    saved out and LSE (or, for the reference stage, recomputing them) is the whole answer for those heads: no
    partials to merge. Returns dq, dk, dv in q's, k's and v's dtypes, sequence-sharded like q, k, v."""
    import wb_kernels as wb

    agree("ulysses_attention_backward", q=q, k=k, v=v, key_padding_mask=key_padding_mask, Lq=Lq, Lk=Lk,
          causal=causal, scale=scale, group=group, same=SAME, heads_divide=True)
    heads = [seq_to_heads(x, length, group) for x, length in ((q, Lq), (k, Lk), (v, Lk), (out, Lq), (dout, Lq))]
    lse_heads = seq_to_heads(lse.unsqueeze(-1), Lq, group).squeeze(-1)
    qh, kh, vh, out_heads, dout_heads = heads
    dq, dk, dv = wb.attention_backward(qh, kh, vh, dout_heads, stage=stage, causal=causal,
                                       key_padding_mask=key_padding_mask, scale=scale, out=out_heads, lse=lse_heads)
    return heads_to_seq(dq, Lq, group), heads_to_seq(dk, Lk, group), heads_to_seq(dv, Lk, group)
