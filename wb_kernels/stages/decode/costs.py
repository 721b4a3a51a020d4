"""What a decode step costs and how its grid fills the GPU (lesson 07): FLOPs and bytes of a step, each split's weight
in the merge, the blocks a workload launches and the splits chosen for it, the SMs the first wave keeps busy, a paged
cache against contiguous ones, and the bytes each CUDA kernel would move. Plain functions of numbers (NumPy), which
``tests/test_decode.py`` calls; the figures drawn from them are :mod:`.figures`.
"""

from __future__ import annotations

import math

import numpy as np

from .splitkv import choose_num_splits

__all__ = ["WORKLOAD_BATCHES", "WORKLOAD_KV_HEADS", "WORKLOAD_LENGTHS", "attention_cost", "split_weights",
           "CUDA_ROWS_PER_BLOCK", "row_chunks", "splits_table", "sm_wave", "random_sequence_lengths", "cache_memory",
           "kernel_bytes_rows"]


# the decode workloads the rung is measured on: batch 1, 8, 64; MHA, GQA and MQA of 32 query heads; 1k to 128k keys
WORKLOAD_BATCHES = (1, 8, 64)


WORKLOAD_KV_HEADS = (32, 8, 1)


WORKLOAD_LENGTHS = (1024, 2048, 4096, 8192, 16384, 32768, 65536, 131072)


def attention_cost(B: int, H: int, Hk: int, Lq: int, Lk: int, D: int, dtype_bytes: int = 2) -> dict:
    """FLOPs of attention (``4 B H Lq Lk D``: QK^T and PV, no mask) and the bytes it must move at least: q and the
    output once, and the cache's K and V once (``2 B Hk Lk D``: the query heads of a group share their KV head).
    Decode is ``Lq = 1``; a prefill of L tokens is ``Lq = Lk = L``."""
    if min(B, H, Hk, Lq, Lk, D, dtype_bytes) < 1 or H % Hk:
        raise ValueError(f"attention_cost: sizes must be >= 1 and Hk={Hk} must divide H={H}")
    flops = 4 * B * H * Lq * Lk * D
    q_and_out = 2 * B * H * Lq * D * dtype_bytes
    kv = 2 * B * Hk * Lk * D * dtype_bytes
    return {"flops": flops, "kv_bytes": kv, "q_out_bytes": q_and_out, "bytes": kv + q_and_out,
            "intensity": flops / (kv + q_and_out)}


def split_weights(lses) -> np.ndarray:
    """Each split's share of the row's softmax mass, ``exp(lse_s - lse)``: they sum to 1 (0 for an empty split)."""
    lses = np.asarray(lses, dtype=np.float64)
    top = lses.max()
    if not np.isfinite(top):
        return np.zeros_like(lses)
    weights = np.exp(lses - top)
    return weights / weights.sum()


CUDA_ROWS_PER_BLOCK = 4  # the CUDA split kernel's blocks hold up to 4 query heads: what a GPU runs for 16-bit caches


def row_chunks(H: int, Hk: int, rows_per_block: int = CUDA_ROWS_PER_BLOCK) -> int:
    """Blocks per (split, sequence, KV head): a block holds `rows_per_block` query rows, the group's H / Hk heads
    (one new token each); a larger group takes several blocks, and each reads the split's keys again."""
    return -(-(H // Hk) // rows_per_block)


def splits_table(num_sms: int, batches=WORKLOAD_BATCHES, kv_heads=WORKLOAD_KV_HEADS, lengths=WORKLOAD_LENGTHS, *,
                 H: int = 32):
    """For every (B, Hk, Lk): the splits ``choose_num_splits`` picks and the grid the kernel launches, without
    splitting and with the splits (``splits x B·Hk x row chunks`` blocks), and the latter per SM."""
    rows = []
    for B in batches:
        for Hk in kv_heads:
            for Lk in lengths:
                splits = choose_num_splits(B, Hk, Lk, num_sms, row_chunks=row_chunks(H, Hk))
                unsplit = B * Hk * row_chunks(H, Hk)
                rows.append({"B": B, "Hk": Hk, "Lk": Lk, "splits": splits, "blocks_unsplit": unsplit,
                             "blocks": unsplit * splits, "blocks_per_sm": unsplit * splits / num_sms})
    return rows


def sm_wave(blocks: int, num_sms: int, blocks_per_sm: int = 2) -> np.ndarray:
    """Blocks resident on each SM in the grid's first wave (blocks dealt out one per SM in turn, at most
    `blocks_per_sm` each): how much of the GPU the grid can keep busy at once."""
    first_wave = min(blocks, num_sms * blocks_per_sm)
    return np.array([first_wave // num_sms + (sm < first_wave % num_sms) for sm in range(num_sms)])


def random_sequence_lengths(count: int, max_len: int, seed: int = 0) -> np.ndarray:
    """Final lengths of `count` sequences: log-normal around an eighth of `max_len`, clipped to [1, max_len]. Most
    requests end far below the maximum a server must allow for (the observation behind PagedAttention)."""
    rng = np.random.default_rng(seed)
    lengths = rng.lognormal(mean=math.log(max_len / 8), sigma=0.9, size=count)
    return np.clip(np.round(lengths), 1, max_len).astype(int)


def cache_memory(lengths, max_len: int, page_size: int) -> dict:
    """Cache slots (tokens) reserved for sequences of `lengths`: contiguous caches sized to `max_len` each, or
    pages of `page_size` slots handed out as the sequence grows (only the last page is partly empty)."""
    lengths = np.asarray(lengths)
    if lengths.size and (lengths.min() < 0 or lengths.max() > max_len):
        raise ValueError(f"cache_memory: lengths must be in [0, {max_len}]")
    used = int(lengths.sum())
    paged = int((-(-lengths // page_size) * page_size).sum())
    contiguous = int(lengths.size * max_len)
    return {"used": used, "contiguous": contiguous, "paged": paged,
            "contiguous_waste": 1 - used / contiguous if contiguous else 0.0,
            "paged_waste": 1 - used / paged if paged else 0.0}


def kernel_bytes_rows(shapes, *, num_sms: int, blocks_per_sm=2, H: int = 32, Hk: int = 1, D: int = 128,
                      itemsize: int = 2) -> list:
    """What each CUDA kernel would ask of memory at the shapes (B, Lk): for the split kernel (up to 4 query heads a
    block) and the tensor-core kernel (the whole group a block), the splits the launcher's rule picks at
    `blocks_per_sm` (the GPU's occupancy of the kernel, which the launcher asks the CUDA runtime for; here given: one
    number for both kernels, or ``{"split": n, "mma": m}``) and :func:`launcher.decode_bytes` at those splits. One
    dict per (shape, kernel)."""
    from . import build, launcher

    rules = {"split": {"row_chunks": launcher.cuda_row_chunks(H // Hk),
                       "min_keys_per_split": launcher.SPLIT_MIN_KEYS_PER_SPLIT},
             "mma": {"row_chunks": 1, "min_keys_per_split": launcher.MMA_MIN_KEYS_PER_SPLIT,
                     "max_splits": launcher.MMA_MAX_SPLITS}}
    rows = []
    for B, Lk in shapes:
        for kernel, rule in rules.items():
            occupancy = blocks_per_sm[kernel] if isinstance(blocks_per_sm, dict) else blocks_per_sm
            asked = choose_num_splits(B, Hk, Lk, num_sms, blocks_per_sm=occupancy, keys_step=build.KEYS_PER_STEP,
                                      **rule)
            splits = launcher.cuda_split_plan(Lk, asked)[1]
            rows.append({"B": B, "Lk": Lk, "kernel": kernel, "splits": splits,
                         "bytes": launcher.decode_bytes(B, H, Hk, Lk, D, itemsize, splits, kernel)})
    return rows
