"""Which positions each rank holds, which block pairs a causal mask lets through, and the work each rank does.

Pure functions (no torch.distributed), shared by ``ring.py``, ``decode.py``, ``ulysses.py`` and ``run.py`` and
tested in-process.

Layouts of a sequence of L positions over W ranks:

- ``"contiguous"``: rank r holds one run of positions, the r-th of W runs whose lengths differ by at most one
  (the first L mod W runs are one longer), so lengths need not divide by W.
- ``"zigzag"``: the sequence is cut into 2W such chunks and rank r holds chunk r and chunk 2W - 1 - r. Under a
  causal mask the early chunks see few keys and the late ones many; pairing the r-th earliest with the r-th latest
  gives every rank the same amount of work (ring-flash-attention's zigzag; Brandon et al. 2023 "striped" is the
  same idea at the granularity of single tokens).

A rank's local tensor is its pieces concatenated in order along the sequence axis.
"""

from __future__ import annotations

import numpy as np

__all__ = ["LAYOUTS", "chunk_bounds", "shard_pieces", "shard_length", "local_indices", "pair_blocks",
           "visible_pairs", "ring_work", "predicted_efficiency", "causal_ceiling"]

LAYOUTS = ("contiguous", "zigzag")


def chunk_bounds(length: int, chunks: int):
    """[(start, stop), ...]: `length` positions in `chunks` runs whose lengths differ by at most one."""
    if chunks < 1 or length < 0:
        raise ValueError(f"chunk_bounds: need chunks >= 1 and length >= 0, got chunks={chunks}, length={length}")
    base, extra = divmod(length, chunks)
    bounds, start = [], 0
    for c in range(chunks):
        stop = start + base + (1 if c < extra else 0)
        bounds.append((start, stop))
        start = stop
    return bounds


def shard_pieces(length: int, world: int, rank: int, layout: str = "contiguous"):
    """The runs of positions rank `rank` of `world` holds: [(start, stop)] (contiguous) or two runs (zigzag)."""
    if layout not in LAYOUTS:
        raise ValueError(f"layout: expected one of {', '.join(map(repr, LAYOUTS))}, got {layout!r}")
    if not 0 <= rank < world:
        raise ValueError(f"rank {rank} is not in 0..{world - 1}")
    if layout == "contiguous":
        return [chunk_bounds(length, world)[rank]]
    chunks = chunk_bounds(length, 2 * world)
    return [chunks[rank], chunks[2 * world - 1 - rank]]


def shard_length(length: int, world: int, rank: int, layout: str = "contiguous") -> int:
    """How many positions rank `rank` holds (the size of the block it sends round the ring)."""
    return sum(stop - start for start, stop in shard_pieces(length, world, rank, layout))


def local_indices(length: int, world: int, rank: int, layout: str = "contiguous"):
    """The global positions of rank `rank`'s local rows, in local order (an int64 NumPy array): ``x[..., idx, :]``
    shards a full tensor, and scattering each rank's rows back to ``idx`` rebuilds it."""
    return np.concatenate([np.arange(a, b, dtype=np.int64) for a, b in shard_pieces(length, world, rank, layout)])


def pair_blocks(q_range, k_range, offset):
    """The attention calls that cover queries `q_range` against keys `k_range` (global [start, stop) runs).

    `offset` is :func:`wb_kernels.reference.causal_offset`'s: None (no causal mask) or the integer with which query i
    sees keys j <= i + offset. Returns [((q0, q1), (k0, k1), causal), ...] with causal False (every query of the
    sub-block sees every key) or ``"bottom_right"``; an empty list when no query sees any key (the pair is skipped).

    Any offset is covered by at most two calls: keys no query reaches and queries that reach no key are cut off;
    the queries that see every remaining key are one full block; the rest end exactly at the last key, which is
    bottom-right alignment (the diagonal block of equal shards, top-left within the pair, is its Lq = Lk case).
    """
    (qa, qb), (ka, kb) = q_range, k_range
    if qa >= qb or ka >= kb:
        return []
    if offset is None:
        return [((qa, qb), (ka, kb), False)]
    kb = min(kb, qb + offset)  # keys past the last query's reach
    qa = max(qa, ka - offset)  # queries that reach no key of this block: their partial would be empty
    if kb <= ka or qa >= qb:
        return []
    split = min(max(qa, kb - offset), qb)  # rows i >= kb - offset see every key up to kb - 1
    blocks = []
    if split > qa:
        blocks.append(((qa, split), (ka, kb), "bottom_right"))  # row split - 1 sees key kb - 1: bottom-right
    if qb > split:
        blocks.append(((split, qb), (ka, kb), False))
    return blocks


def visible_pairs(q_range, k_range, offset) -> int:
    """How many (query, key) pairs of the two runs the mask lets through: the work of the pair."""
    (qa, qb), (ka, kb) = q_range, k_range
    if qa >= qb or ka >= kb:
        return 0
    if offset is None:
        return (qb - qa) * (kb - ka)
    rows = np.arange(qa, qb, dtype=np.int64)
    return int(np.clip(rows + offset - ka + 1, 0, kb - ka).sum())


def ring_work(Lq: int, Lk: int, world: int, layout: str = "contiguous", causal_offset=0):
    """work[step][rank]: the (query, key) pairs rank `rank` computes at ring step `step` (the block of rank
    (rank - step) mod world), with `causal_offset` None for no mask. A NumPy int64 array (world, world)."""
    work = np.zeros((world, world), dtype=np.int64)
    for step in range(world):
        for rank in range(world):
            source = (rank - step) % world
            work[step, rank] = sum(visible_pairs(qp, kp, causal_offset)
                                   for qp in shard_pieces(Lq, world, rank, layout)
                                   for kp in shard_pieces(Lk, world, source, layout))
    return work


def predicted_efficiency(work) -> float:
    """Scaling efficiency of a ring whose steps end together (each waits for its slowest rank, as the exchange of
    the next block makes them): total work / (world x the sum over steps of the busiest rank's work)."""
    work = np.asarray(work)
    busiest = work.max(axis=1).sum()
    return float(work.sum() / (work.shape[1] * busiest)) if busiest else 1.0


def causal_ceiling(world: int) -> float:
    """The causal ring's efficiency with contiguous shards, in blocks: W / (2W - 1).

    Rank r's queries see r whole blocks and half of its own (the diagonal): r + 1/2 blocks, W^2 / 2 in all, so one
    rank's share would be W / 2; but the last rank does W - 1/2, and the ring waits for it. 67 % at W = 2, 53 % at
    W = 8. Zigzag gives every rank the same work at every step: 1 (up to the rounding of unequal chunks).
    """
    if world < 1:
        raise ValueError(f"causal_ceiling: world must be >= 1, got {world}")
    return world / (2 * world - 1)
