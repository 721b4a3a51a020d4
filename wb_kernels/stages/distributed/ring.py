"""Ring attention: the sequence sharded over W ranks, K/V blocks passed rank to rank (Liu, Zaharia, Abbeel 2023).

Each rank keeps its queries and, for W steps, computes their attention over the K/V block it holds, merging each
step's partial (out, LSE) into its accumulator (:mod:`.merge`, fp32; fp64 for fp64), while it passes the block on
to the next rank and receives the previous rank's with ``dist.batch_isend_irecv``. The exchange for step s + 1 is
issued before step s's attention, so that transfer and compute can overlap; the rank waits for it only after its
own work (on CPU with gloo the transfer runs on gloo's threads; with NCCL on its own stream).

Causal masks are handled by :func:`.sharding.pair_blocks`: every (query piece, key piece) pair is either fully
visible, cut at the diagonal (one bottom-right call, which for equal shards is the top-left diagonal block), or
skipped. ``layout="zigzag"`` balances causal work (:mod:`.sharding`). Local attention is
``wb.attention(..., stage=stage, return_lse=True)``: any rung (``reference`` in float64 in the tests).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from ...reference import causal_offset
from .merge import accumulation_dtype, merge_pair
from .sharding import pair_blocks, shard_length, shard_pieces

__all__ = ["accumulate_blocks", "ring_attention", "new_accumulator"]


def _local_runs(pieces):
    """[(global start, global stop, local start), ...] for pieces concatenated along the sequence axis."""
    runs, local = [], 0
    for start, stop in pieces:
        runs.append((start, stop, local))
        local += stop - start
    return runs


def new_accumulator(q):
    """(out, lse) of a row that has seen no key yet: zeros and -inf, in the accumulation dtype."""
    dtype = accumulation_dtype(q.dtype)
    B, H, L, D = q.shape
    return (torch.zeros((B, H, L, D), dtype=dtype, device=q.device),
            torch.full((B, H, L), float("-inf"), dtype=dtype, device=q.device))


def accumulate_blocks(acc, q, q_pieces, k, v, k_pieces, offset, *, key_padding_mask, scale, stage):
    """Merge into `acc` (out, lse) the attention of local queries `q` (global runs `q_pieces`) over local keys
    `k`, `v` (global runs `k_pieces`), under causal `offset` (None: no mask). `key_padding_mask` is the global
    (B, Lk) mask or None. Returns the pairs of positions computed (the work)."""
    import wb_kernels as wb

    acc_out, acc_lse = acc
    work = 0
    for qa, qb, q_local in _local_runs(q_pieces):
        for ka, kb, k_local in _local_runs(k_pieces):
            for (q0, q1), (k0, k1), causal in pair_blocks((qa, qb), (ka, kb), offset):
                rows = slice(q_local + q0 - qa, q_local + q1 - qa)
                keys = slice(k_local + k0 - ka, k_local + k1 - ka)
                mask = None if key_padding_mask is None else key_padding_mask[:, k0:k1]
                out, lse = wb.attention(q[:, :, rows], k[:, :, keys], v[:, :, keys], stage=stage, causal=causal,
                                        key_padding_mask=mask, scale=scale, return_lse=True)
                acc_out[:, :, rows], acc_lse[:, :, rows] = merge_pair(acc_out[:, :, rows], acc_lse[:, :, rows],
                                                                      out, lse)
                work += (q1 - q0) * (k1 - k0)
    return work


def ring_attention(q, k, v, *, Lq: int, Lk: int, layout: str = "contiguous", causal=False, key_padding_mask=None,
                   scale=None, stage: str = "reference", group=None):
    """This rank's share of exact attention over the whole sequence: ``(out, lse)`` for its local queries.

    q (B, H, nq, D), k and v (B, Hk, nk, D) are this rank's shards of sequences of Lq queries and Lk keys under
    `layout` (:func:`.sharding.shard_pieces`; ``local_indices`` shards a full tensor). `causal` as in
    ``wb.attention`` (False, True/"top_left", "bottom_right", on the global positions); `key_padding_mask` is
    the whole (B, Lk) bool mask (every rank holds it: B x Lk booleans). Returns out (B, H, nq, D) in q's dtype
    and the LSE (B, H, nq) in the accumulation dtype (float32; float64 for float64).
    """
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    q_pieces = shard_pieces(Lq, world, rank, layout)
    expected = (shard_length(Lq, world, rank, layout), shard_length(Lk, world, rank, layout))
    if (q.shape[2], k.shape[2]) != expected or v.shape[2] != k.shape[2]:
        raise ValueError(f"ring_attention: rank {rank} of {world} ({layout}) should hold {expected[0]} queries and "
                         f"{expected[1]} keys, got q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}")
    offset = causal_offset(causal, Lq, Lk)
    acc = new_accumulator(q)
    block = torch.stack([k, v]).contiguous()  # one message per step: K and V together
    to_rank, from_rank = (rank + 1) % world, (rank - 1) % world
    peer = (lambda r: dist.get_global_rank(group, r)) if group is not None else (lambda r: r)
    for step in range(world):
        source = (rank - step) % world  # whose keys this rank holds at this step
        pending, incoming = [], None
        if step < world - 1:  # issue the next exchange before this step's attention (overlap)
            size = shard_length(Lk, world, (rank - step - 1) % world, layout)
            incoming = block.new_empty(block.shape[:3] + (size,) + block.shape[4:])
            ops = []  # an empty shard (L < 2W) is neither sent nor received: both ends know its size
            if block.shape[3]:
                ops.append(dist.P2POp(dist.isend, block, peer(to_rank), group))
            if size:
                ops.append(dist.P2POp(dist.irecv, incoming, peer(from_rank), group))
            pending = dist.batch_isend_irecv(ops) if ops else []
        accumulate_blocks(acc, q, q_pieces, block[0], block[1], shard_pieces(Lk, world, source, layout), offset,
                          key_padding_mask=key_padding_mask, scale=scale, stage=stage)
        for request in pending:
            request.wait()
        if incoming is not None:
            block = incoming
    out, lse = acc
    return out.to(q.dtype), lse
