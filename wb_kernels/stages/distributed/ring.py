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
from .agreement import agree
from .merge import accumulation_dtype, merge_into
from .sharding import pair_blocks, shard_length, shard_pieces

__all__ = ["accumulate_blocks", "block_calls", "ring_attention", "new_accumulator", "BlockExchange",
           "block_gradients", "ring_attention_backward"]


# what every rank's call must agree on (agreement.describe's fields), besides batch, heads and head dim
SAME = ("q_dtype", "k_dtype", "v_dtype", "Lq", "Lk", "causal", "layout", "scale", "mask", "mask_bits")


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


def block_calls(q_pieces, k_pieces, offset, key_padding_mask):
    """The attention calls that cover local queries (global runs `q_pieces`) against local keys (global runs
    `k_pieces`) under causal `offset` (None: no mask), as :func:`.sharding.pair_blocks` cuts them: yields
    ``(rows, keys, causal, mask)``, the local row and key slices, the call's alignment, and the call's columns of
    the global (B, Lk) `key_padding_mask` (or None). The forward and the backward walk the same calls."""
    for qa, qb, q_local in _local_runs(q_pieces):
        for ka, kb, k_local in _local_runs(k_pieces):
            for (q0, q1), (k0, k1), causal in pair_blocks((qa, qb), (ka, kb), offset):
                mask = None if key_padding_mask is None else key_padding_mask[:, k0:k1]
                yield (slice(q_local + q0 - qa, q_local + q1 - qa), slice(k_local + k0 - ka, k_local + k1 - ka),
                       causal, mask)


def accumulate_blocks(acc, q, q_pieces, k, v, k_pieces, offset, *, key_padding_mask, scale, stage,
                      check_finite=True):
    """Merge into `acc` (out, lse) the attention of local queries `q` (global runs `q_pieces`) over local keys
    `k`, `v` (global runs `k_pieces`), under causal `offset` (None: no mask). `key_padding_mask` is the global
    (B, Lk) mask or None; `check_finite` is ``wb.attention``'s (False skips its NaN/Inf pass, which waits for the
    GPU: the benchmark's choice). Returns the pairs of positions computed (the work)."""
    import wb_kernels as wb

    acc_out, acc_lse = acc
    work = 0
    for rows, keys, causal, mask in block_calls(q_pieces, k_pieces, offset, key_padding_mask):
        out, lse = wb.attention(q[:, :, rows], k[:, :, keys], v[:, :, keys], stage=stage, causal=causal,
                                key_padding_mask=mask, scale=scale, return_lse=True, check_finite=check_finite)
        merge_into(acc_out[:, :, rows], acc_lse[:, :, rows], out, lse)
        work += (rows.stop - rows.start) * (keys.stop - keys.start)
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
    # one small all-gather: every rank checks every rank's shapes, dtypes, lengths, mask, causal and scale, and all
    # raise the same error before the first transfer (a mismatch would otherwise abort inside gloo or NCCL)
    agree("ring_attention", q=q, k=k, v=v, key_padding_mask=key_padding_mask, Lq=Lq, Lk=Lk, causal=causal,
          scale=scale, layout=layout, group=group, same=SAME)
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


# ---- the backward: dK/dV partials travel with their block ------------------------------------------------------

def block_gradients(q, k, v, out, lse, dout, *, causal, key_padding_mask, scale, stage):
    """(dq, dk, dv): one block of keys' shares of the gradients, from the whole forward's `out` and `lse` of these
    query rows (P = exp(S - LSE) over the block is the block's part of the whole softmax, and D = rowsum(dO * O)
    is the whole row's). The GPU backwards (``mma``, ``flash``) take them through ``wb.attention_backward(...,
    out=, lse=)``. The ``reference`` stage's backward recomputes the softmax over the keys it is given, which is
    right for a whole row and wrong for a block; its float64 stand-in here is lesson 08's teaching model,
    ``blockwise_backward``, which uses the saved LSE as the kernels do."""
    import wb_kernels as wb

    if stage == "reference":
        from ..backward.blockwise import blockwise_backward

        grads = blockwise_backward(q, k, v, out, lse, dout, causal=causal, key_padding_mask=key_padding_mask,
                                   scale=scale, block_m=64, block_n=64)
        return tuple(torch.from_numpy(g).to(q.device) for g in grads)
    return wb.attention_backward(q, k, v, dout, stage=stage, causal=causal, key_padding_mask=key_padding_mask,
                                 scale=scale, out=out, lse=lse)


def ring_attention_backward(q, k, v, out, lse, dout, *, Lq: int, Lk: int, layout: str = "contiguous", causal=False,
                            key_padding_mask=None, scale=None, stage: str = "reference", group=None,
                            overlap: bool = True):
    """This rank's shards of (dq, dk, dv) for the ring forward's result: q, k, v as :func:`ring_attention` took
    them, `out` and `lse` what it returned, `dout` the loss gradient of `out` (this rank's rows).

    The K/V blocks go round the ring as in the forward (the next one's transfer overlapping this step's work), and
    with each block travels the accumulator of its dK and dV (float32; float64 for float64 inputs): every rank adds
    its queries' shares (:func:`block_gradients`, the forward's block calls) and passes it on, so after W steps and
    W transfers each block's accumulator is back on the rank that owns the block, complete. dQ stays home and
    gathers every block's share. Returns dq, dk, dv in q's, k's and v's dtypes.
    """
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    q_pieces = shard_pieces(Lq, world, rank, layout)
    agree("ring_attention_backward", q=q, k=k, v=v, key_padding_mask=key_padding_mask, Lq=Lq, Lk=Lk, causal=causal,
          scale=scale, layout=layout, group=group, same=SAME)
    expected = (shard_length(Lq, world, rank, layout), shard_length(Lk, world, rank, layout))
    if (q.shape[2], k.shape[2]) != expected or out.shape != q.shape or dout.shape != q.shape:
        raise ValueError(f"ring_attention_backward: rank {rank} of {world} ({layout}) should hold {expected[0]} "
                         f"queries (q, out, dout) and {expected[1]} keys, got q {tuple(q.shape)}, k {tuple(k.shape)},"
                         f" out {tuple(out.shape)}, dout {tuple(dout.shape)}")
    offset = causal_offset(causal, Lq, Lk)
    dtype = accumulation_dtype(q.dtype)
    dq = torch.zeros(q.shape, dtype=dtype, device=q.device)
    block = torch.stack([k, v]).contiguous()
    block_grads = torch.zeros(block.shape, dtype=dtype, device=q.device)  # (dk, dv) of the block held, travelling
    peer = (lambda r: dist.get_global_rank(group, r)) if group is not None else (lambda r: r)
    ring = dict(send_to=peer((rank + 1) % world), receive_from=peer((rank - 1) % world), group=group,
                side_stream=torch.cuda.Stream(q.device) if q.is_cuda else None)
    for step in range(world):
        source = (rank - step) % world
        incoming_length = shard_length(Lk, world, (rank - step - 1) % world, layout)  # after W steps: our own
        blocks = BlockExchange(block, incoming_length, **ring) if step < world - 1 else None
        if blocks is not None and not overlap:
            blocks.finish()
        for rows, keys, block_causal, mask in block_calls(q_pieces, shard_pieces(Lk, world, source, layout), offset,
                                                          key_padding_mask):
            shares = block_gradients(q[:, :, rows], block[0][:, :, keys], block[1][:, :, keys], out[:, :, rows],
                                     lse[:, :, rows], dout[:, :, rows], causal=block_causal, key_padding_mask=mask,
                                     scale=scale, stage=stage)
            dq[:, :, rows] += shares[0]
            block_grads[0][:, :, keys] += shares[1]
            block_grads[1][:, :, keys] += shares[2]
        if world > 1:  # the shares just added leave with the accumulator (the last hop takes it home)
            block_grads = BlockExchange(block_grads, incoming_length, **ring).finish()
        if blocks is not None:
            block = blocks.finish()
    return dq.to(q.dtype), block_grads[0].to(k.dtype), block_grads[1].to(v.dtype)
