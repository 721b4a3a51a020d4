"""Ring attention: the sequence sharded over W ranks, K/V blocks passed rank to rank (Liu, Zaharia, Abbeel 2023).

Each rank keeps its queries and, for W steps, computes their attention over the K/V block it holds, merging each
step's partial (out, LSE) into its accumulator (:mod:`.merge`, fp32; fp64 for fp64), while it passes the block on
to the next rank and receives the previous rank's with ``dist.batch_isend_irecv``. The exchange for step s + 1 is
issued before step s's attention, so that transfer and compute can overlap; the rank waits for it only after its
own work (:class:`BlockExchange`: on CPU with gloo the transfer runs on gloo's threads; on CUDA it is issued from
a stream of its own and the compute stream waits for an event, so the host never blocks). The partials are merged
in place (:func:`.merge.merge_into`), one pass over the accumulator per block.

Causal masks are handled by :func:`.sharding.pair_blocks`: every (query piece, key piece) pair is either fully
visible, cut at the diagonal (one bottom-right call, which for equal shards is the top-left diagonal block), or
skipped. ``layout="zigzag"`` balances causal work (:mod:`.sharding`). Local attention is
``wb.attention(..., stage=stage, return_lse=True)``: any rung (``reference`` in float64 in the tests).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from ...reference import causal_offset
from .merge import accumulation_dtype, merge_into
from .sharding import pair_blocks, shard_length, shard_pieces

__all__ = ["accumulate_blocks", "ring_attention", "new_accumulator", "BlockExchange"]


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


def accumulate_blocks(acc, q, q_pieces, k, v, k_pieces, offset, *, key_padding_mask, scale, stage,
                      check_finite=True):
    """Merge into `acc` (out, lse) the attention of local queries `q` (global runs `q_pieces`) over local keys
    `k`, `v` (global runs `k_pieces`), under causal `offset` (None: no mask). `key_padding_mask` is the global
    (B, Lk) mask or None; `check_finite` is ``wb.attention``'s (False skips its NaN/Inf pass, which waits for the
    GPU: the benchmark's choice). Returns the pairs of positions computed (the work)."""
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
                                        key_padding_mask=mask, scale=scale, return_lse=True,
                                        check_finite=check_finite)
                merge_into(acc_out[:, :, rows], acc_lse[:, :, rows], out, lse)
                work += (q1 - q0) * (k1 - k0)
    return work


class BlockExchange:
    """One ring step's transfer: this rank's K/V block sent to the next rank, the previous rank's received.

    Started before the step's attention, finished after it, so that the two can overlap. On CUDA (NCCL) the
    transfer is issued from `side_stream`, which first waits for the compute stream (the block must be complete
    before it leaves); NCCL runs it on its own stream, the side stream waits for that, and an event recorded there
    is what the compute stream waits for in :meth:`finish`, so the host never blocks. The caching allocator would
    hand out the memory of a tensor freed on the compute stream while the transfer still reads or writes it:
    ``record_stream`` on the side stream prevents that for both. On CPU (gloo, `side_stream` None) the transfer
    runs on gloo's threads and :meth:`finish` waits for it.
    """

    def __init__(self, block, incoming_length, *, send_to, receive_from, group, side_stream):
        self.incoming = block.new_empty(block.shape[:3] + (incoming_length,) + block.shape[4:])
        ops = []  # an empty shard (L < 2W) is neither sent nor received: both ends know its size
        if block.shape[3]:
            ops.append(dist.P2POp(dist.isend, block, send_to, group))
        if incoming_length:
            ops.append(dist.P2POp(dist.irecv, self.incoming, receive_from, group))
        self.side_stream, self.requests, self.done = side_stream, [], None
        if side_stream is None:
            self.requests = dist.batch_isend_irecv(ops) if ops else []
            return
        side_stream.wait_stream(torch.cuda.current_stream(block.device))
        with torch.cuda.stream(side_stream):
            for request in dist.batch_isend_irecv(ops) if ops else []:
                request.wait()  # NCCL: the side stream waits for NCCL's stream; the host goes on
        block.record_stream(side_stream)
        self.incoming.record_stream(side_stream)
        self.done = torch.cuda.Event()
        self.done.record(side_stream)

    def finish(self):
        """The received block, usable on the current stream (CUDA) or in memory (CPU)."""
        if self.done is not None:
            torch.cuda.current_stream(self.incoming.device).wait_event(self.done)
        for request in self.requests:
            request.wait()
        return self.incoming


def ring_attention(q, k, v, *, Lq: int, Lk: int, layout: str = "contiguous", causal=False, key_padding_mask=None,
                   scale=None, stage: str = "reference", group=None, overlap: bool = True, check_finite=True):
    """This rank's share of exact attention over the whole sequence: ``(out, lse)`` for its local queries.

    q (B, H, nq, D), k and v (B, Hk, nk, D) are this rank's shards of sequences of Lq queries and Lk keys under
    `layout` (:func:`.sharding.shard_pieces`; ``local_indices`` shards a full tensor). `causal` as in
    ``wb.attention`` (False, True/"top_left", "bottom_right", on the global positions); `key_padding_mask` is
    the whole (B, Lk) bool mask (every rank holds it: B x Lk booleans). `overlap`: issue the next block's transfer
    before this step's attention (on CUDA from a stream of its own, :class:`BlockExchange`) and wait for it after;
    False waits for it before the attention (the benchmark's comparison). `check_finite` as in ``wb.attention``.
    Returns out (B, H, nq, D) in q's dtype and the LSE (B, H, nq) in the accumulation dtype (float32; float64 for
    float64).
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
    peer = (lambda r: dist.get_global_rank(group, r)) if group is not None else (lambda r: r)
    side_stream = torch.cuda.Stream(q.device) if q.is_cuda else None
    for step in range(world):
        source = (rank - step) % world  # whose keys this rank holds at this step
        exchange = None
        if step < world - 1:
            exchange = BlockExchange(block, shard_length(Lk, world, (rank - step - 1) % world, layout),
                                     send_to=peer((rank + 1) % world), receive_from=peer((rank - 1) % world),
                                     group=group, side_stream=side_stream)
            if not overlap:
                incoming = exchange.finish()
        accumulate_blocks(acc, q, q_pieces, block[0], block[1], shard_pieces(Lk, world, source, layout), offset,
                          key_padding_mask=key_padding_mask, scale=scale, stage=stage, check_finite=check_finite)
        if exchange is not None:
            block = exchange.finish() if overlap else incoming
    out, lse = acc
    return out.to(q.dtype), lse
