"""Split-KV decode across ranks: lesson 07's flash-decoding, with the splits on different processes.

Each rank holds part of the KV cache (a shard under :mod:`.sharding`'s layouts) and every rank the same queries
(a decode step's one query per head, or a few: speculative or chunked). Each computes its partial (out, LSE) over
its keys with ``wb.attention(..., return_lse=True)``; one all-gather of (out, LSE) packed into one tensor gives
every rank all W partials, and the merge of :mod:`.merge` gives every rank the whole result. (The alternative,
an all-reduce of the row maxima, then one of the rescaled sums and outputs, is two collectives for the same bytes.)
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from ...reference import causal_offset
from .agreement import agree
from .merge import merge_stack, pack, unpack
from .ring import SAME, accumulate_blocks, new_accumulator
from .sharding import shard_pieces

__all__ = ["split_kv_decode"]


def split_kv_decode(q, k, v, *, Lk: int, layout: str = "contiguous", causal=False, key_padding_mask=None,
                    scale=None, stage: str = "reference", group=None):
    """Attention of the whole q (B, H, Lq, D), the same on every rank, over a KV cache of Lk positions sharded
    over the ranks (k, v: this rank's (B, Hk, n, D)). Returns (out (B, H, Lq, D) in q's dtype, lse (B, H, Lq) in
    the accumulation dtype), identical on every rank. `causal` and `key_padding_mask` (whole (B, Lk)) as in
    ``wb.attention``: ``"bottom_right"`` is decoding's alignment (the queries are the last Lq positions)."""
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    Lq = q.shape[2]
    # one small all-gather before the first collective: the same q (its shape and a digest of its bits) on every
    # rank, and the same Lk, mask, causal, scale and dtypes; every rank raises the same error otherwise (a merged
    # answer from different queries would be right for none of them)
    agree("split_kv_decode", q=q, k=k, v=v, key_padding_mask=key_padding_mask, Lq=Lq, Lk=Lk, causal=causal,
          scale=scale, layout=layout, group=group, same=SAME + ("q", "q_bits"), q_sharded=False, q_digest=True)
    acc = new_accumulator(q)
    accumulate_blocks(acc, q, [(0, Lq)], k, v, shard_pieces(Lk, world, rank, layout), causal_offset(causal, Lq, Lk),
                      key_padding_mask=key_padding_mask, scale=scale, stage=stage)
    mine = pack(*acc)
    gathered = [torch.empty_like(mine) for _ in range(world)]
    dist.all_gather(gathered, mine, group=group)
    outs, lses = unpack(torch.stack(gathered), acc[0].dtype)
    out, lse = merge_stack(outs, lses)
    return out.to(q.dtype), lse
