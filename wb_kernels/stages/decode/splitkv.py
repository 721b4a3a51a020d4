"""Split-KV (flash-decoding) in NumPy: the model the decode kernels are derived from (lesson 07).

In decode, each sequence brings one new query per head and reads its whole KV cache. A kernel that gives each
(sequence, head) one thread block, as the prefill stages do, starts B * H blocks: at B = 1, H = 32 that is 32 blocks
for a GPU with 132 SMs, and most of the memory bandwidth, which is what decode is bound by, stays unused.
Flash-decoding (Dao, Haziza, Massa, Sizov, 2023) splits each sequence's keys into ``num_splits`` chunks and gives
every chunk its own block. Each block computes the attention of its queries over its chunk only: a *partial*
output, normalised over the chunk, and the chunk's log-sum-exp (LSE). A second, small step merges them exactly:

    lse   = log(sum_s exp(lse_s))                      (the LSE of the whole row)
    out   = sum_s exp(lse_s - lse) * out_s             (each chunk weighted by its share of the row's mass)

because exp(lse_s) is the sum of exp(scores) over chunk s, and out_s is that chunk's softmax-weighted values.
A chunk whose keys are all masked (or that holds no keys) has lse_s = -inf and weight exp(-inf) = 0: it drops out.
A row where every chunk is empty keeps the package's convention: output 0, LSE -inf.

Every function here works on float64 NumPy arrays and is checked against :func:`wb_kernels.reference`.
"""

from __future__ import annotations

import math

import numpy as np

__all__ = ["partial_attention", "merge_partials", "split_kv_attention", "split_bounds", "choose_num_splits", "split_cost",
           "MIN_KEYS_PER_SPLIT"]

# A split shorter than this spends more time starting up and merging than reading keys: at 128 keys of D = 128 in
# fp16, a block reads 64 KiB of K and V, about 20 ns of an H100's bandwidth, less than a block's launch.
MIN_KEYS_PER_SPLIT = 256


# region: partial_attention
def partial_attention(q, k, v, scale, allowed=None):
    """One split's share: ``(out_s, lse_s)`` for queries q (R, D) over keys k, v (n, D).

    `allowed` (R, n) bool marks the keys each row may see (None: all). out_s is normalised over this split only.
    A row that sees none of the split's keys gets out_s = 0 and lse_s = -inf.
    """
    scores = scale * (q @ k.T)  # (R, n)
    if allowed is not None:
        scores = np.where(allowed, scores, -np.inf)
    row_max = scores.max(axis=1, initial=-np.inf)
    seen = np.isfinite(row_max)
    shifted = np.exp(scores - np.where(seen, row_max, 0.0)[:, None])  # exp(-inf) = 0 for masked keys
    total = shifted.sum(axis=1)
    out = np.divide(shifted @ v, total[:, None], out=np.zeros((q.shape[0], v.shape[1])), where=seen[:, None])
    with np.errstate(divide="ignore"):
        lse = np.where(seen, row_max + np.log(np.where(seen, total, 1.0)), -np.inf)
    return out, lse
# endregion


# region: merge_partials
def merge_partials(outs, lses):
    """Merge splits exactly: outs (S, ..., D), lses (S, ...) -> (out (..., D), lse (...)).

    Weights are exp(lse_s - max_s lse_s), so the largest is 1 and nothing overflows; splits with lse_s = -inf
    weigh 0. Rows where every split is empty give out 0 and lse -inf.
    """
    outs, lses = np.asarray(outs, dtype=np.float64), np.asarray(lses, dtype=np.float64)
    top = lses.max(axis=0)
    seen = np.isfinite(top)
    weights = np.exp(lses - np.where(seen, top, 0.0))  # (S, ...), 0 for empty splits
    total = weights.sum(axis=0)
    safe_total = np.where(seen, total, 1.0)
    out = np.where(seen[..., None], (weights[..., None] * outs).sum(axis=0) / safe_total[..., None], 0.0)
    lse = np.where(seen, top + np.log(safe_total), -np.inf)
    return out, lse
# endregion


def split_bounds(length: int, num_splits: int):
    """[(start, stop), ...]: `length` keys in `num_splits` chunks of equal size (the last may be shorter or empty)."""
    per_split = max(1, math.ceil(length / num_splits))
    return [(min(s * per_split, length), min((s + 1) * per_split, length)) for s in range(num_splits)]


def split_kv_attention(q, k, v, num_splits: int, scale=None, allowed=None):
    """Attention of q (R, D) over k, v (n, D) computed split by split, then merged: ``(out, lse)``."""
    q, k, v = (np.asarray(x, dtype=np.float64) for x in (q, k, v))
    scale = 1.0 / math.sqrt(q.shape[1]) if scale is None else scale
    outs, lses = [], []
    for start, stop in split_bounds(k.shape[0], num_splits):
        mask = None if allowed is None else allowed[:, start:stop]
        out_s, lse_s = partial_attention(q, k[start:stop], v[start:stop], scale, mask)
        outs.append(out_s)
        lses.append(lse_s)
    return merge_partials(outs, lses)


# region: choose_num_splits
def split_cost(batch: int, kv_heads: int, max_keys: int, num_sms: int, asked: int, *, blocks_per_sm: int = 2,
               row_chunks: int = 1, keys_step: int = 1, block_overhead_keys: int = 64) -> dict:
    """The grid of `asked` splits, costed: whole waves x (keys per split + `block_overhead_keys`), in keys' time."""
    keys_per_split = -(-max(1, -(-max_keys // asked)) // keys_step) * keys_step  # rounded up to whole steps
    splits = max(1, -(-max_keys // keys_per_split))  # rounding up may leave fewer splits than asked
    waves = -(-batch * kv_heads * max(1, row_chunks) * splits // (num_sms * blocks_per_sm))
    return {"splits": splits, "keys_per_split": keys_per_split, "waves": waves,
            "cost": waves * (keys_per_split + block_overhead_keys)}


def choose_num_splits(batch: int, kv_heads: int, max_keys: int, num_sms: int, *, blocks_per_sm: int = 2,
                      min_keys_per_split: int = MIN_KEYS_PER_SPLIT, max_splits: int = 64, row_chunks: int = 1,
                      keys_step: int = 1, block_overhead_keys: int = 64) -> int:
    """How many splits per sequence: the count whose grid finishes soonest, counted in whole waves of blocks.

    Without splitting, the grid has ``batch * kv_heads * row_chunks`` blocks: one per sequence and KV head (the query
    heads of a group share their block, so the cache is read once), times the chunks a group too large for one
    block's registers is cut into (MQA's 32 query heads: several). The GPU runs ``num_sms * blocks_per_sm`` of them
    at a time, a wave; a grid of 1.2 waves takes as long as 2 (the second wave's few blocks run alone). So each count
    of splits is costed by :func:`split_cost` as waves x (keys per split + `block_overhead_keys`): the grid's time
    when every block streams its keys at the same rate and pays a fixed start and finish (loading q, merging its
    warps, writing its result) worth about 64 keys of streaming (tune_h100.json, B8 Hk8 Lk8192 D128: each
    count of 8 to 128 splits, timed against the one wave of 4 splits, implies 43 to 66 keys' time per block;
    lesson 07 computes it). The cheapest count wins; on a tie, the fewest splits (less for the merge to read). No
    split is shorter than `min_keys_per_split`, and each split's length is rounded up to `keys_step` keys, as the
    kernel rounds it.
    """
    if min(batch, kv_heads, num_sms, blocks_per_sm, keys_step) < 1 or max_keys < 0:
        raise ValueError(f"choose_num_splits: batch={batch}, kv_heads={kv_heads}, num_sms={num_sms}, "
                         f"blocks_per_sm={blocks_per_sm} and keys_step={keys_step} must be >= 1 "
                         f"and max_keys={max_keys} >= 0")
    best_cost, best_splits = None, 1
    for asked in range(1, max(1, min(max_splits, max_keys // min_keys_per_split)) + 1):
        option = split_cost(batch, kv_heads, max_keys, num_sms, asked, blocks_per_sm=blocks_per_sm,
                            row_chunks=row_chunks, keys_step=keys_step, block_overhead_keys=block_overhead_keys)
        if best_cost is None or option["cost"] < best_cost:
            best_cost, best_splits = option["cost"], option["splits"]
    return int(best_splits)
# endregion
