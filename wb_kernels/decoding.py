"""The decode entry point: one new query per sequence against a KV cache, as serving engines call it (lesson 07).

    out = wb.decode(q, k_cache, v_cache, cache_seqlens)                        # contiguous cache
    out = wb.decode(q, k_pages, v_pages, cache_seqlens, block_table=table)     # paged cache

Shapes (GQA/MQA: the cache has Hk heads, Hk divides H; query head h reads KV head h // (H // Hk)):

- q: (B, H, D), the new token's queries (after RoPE);
- contiguous cache: k_cache, v_cache (B, Hk, L, D), sequence b's keys in [:cache_seqlens[b]];
- paged cache: k_pages, v_pages (num_pages, Hk, page_size, D) shared by all sequences, and block_table
  (B, pages per sequence) int32: key t of sequence b lives in page block_table[b, t // page_size] at slot
  t % page_size (vLLM's PagedAttention layout, Kwon et al. 2023);
- cache_seqlens: (B,) int32, the number of valid keys of each sequence, the new token's included.

The new token sees every key of its own sequence (bottom-right causal alignment with one query) and nothing beyond
its length. Returns (B, H, D) (and the LSE (B, H) with ``return_lse=True``). A sequence of length 0 gets zeros and
LSE -inf.
"""

from __future__ import annotations

import warnings

import numpy as np

from .api import _check_scale, _dtype_name, _numpy64, require_array
from .device import ValidatedCalls, cuda_signature, is_torch, like_input

__all__ = ["decode", "validate_decode", "DECODE_STAGES", "reference_decode"]

DECODE_STAGES = ("reference", "decode")
_VALIDATED = ValidatedCalls()  # CUDA inputs' signatures that passed validate_decode (see decode)


def _host(x) -> np.ndarray:
    """Lengths or a block table as a NumPy array (read off the GPU: only where a synchronisation is acceptable)."""
    return np.asarray(x.cpu() if is_torch(x) else x)


def validate_decode(q, k_cache, v_cache, cache_seqlens, *, block_table=None, stage="decode", scale=None):
    """Raise a clear error for anything :func:`decode` can't run; returns (B, H, Hk, D, paged)."""
    if stage not in DECODE_STAGES:
        raise ValueError(f"stage={stage!r} has no decode entry; decode stages: {', '.join(DECODE_STAGES)}")
    for name, x in (("q", q), ("k_cache", k_cache), ("v_cache", v_cache)):
        require_array(name, x)
    if q.ndim != 3:
        raise ValueError(f"q: expected rank 3 (B, H, D), one new query per sequence, got shape {tuple(q.shape)}")
    for name, x in (("k_cache", k_cache), ("v_cache", v_cache)):
        if x.ndim != 4:
            raise ValueError(f"{name}: expected rank 4 ((B, Hk, L, D), or (num_pages, Hk, page_size, D) with a "
                             f"block_table), got shape {tuple(x.shape)}")
    if tuple(k_cache.shape) != tuple(v_cache.shape):
        raise ValueError(f"k_cache {tuple(k_cache.shape)} and v_cache {tuple(v_cache.shape)} must have one shape")
    B, H, D = q.shape
    Hk = k_cache.shape[1]
    if k_cache.shape[3] != D:
        raise ValueError(f"head dim differs: q has D={D}, the cache D={k_cache.shape[3]}")
    if H % Hk:
        raise ValueError(f"q has H={H} heads and the cache Hk={Hk}: Hk must divide H (GQA: H // Hk query heads "
                         "share each KV head; MQA: Hk = 1)")
    if len({_dtype_name(x) for x in (q, k_cache, v_cache)}) != 1:
        raise TypeError(f"q, k_cache, v_cache have different dtypes ({_dtype_name(q)}, {_dtype_name(k_cache)}, "
                        f"{_dtype_name(v_cache)}); use one dtype")
    if len({is_torch(x) for x in (q, k_cache, v_cache)}) != 1 or \
            len({str(x.device) if is_torch(x) else "cpu" for x in (q, k_cache, v_cache)}) != 1:
        raise ValueError("q, k_cache, v_cache: expected all NumPy arrays or all torch tensors on one device")
    if _dtype_name(q) == "bfloat16" and stage == "decode":
        from .stages.decode.launcher import uses_cuda_kernel

        if not uses_cuda_kernel(q):
            raise TypeError("bfloat16 needs the CUDA kernel (a GPU, CUDA tensors, D 64 or 128); the numba kernel "
                            "takes float32 and float16")
    require_array("cache_seqlens", cache_seqlens, ("int32",))
    if tuple(cache_seqlens.shape) != (B,):
        raise ValueError(f"cache_seqlens: expected shape (B,)=({B},), got {tuple(cache_seqlens.shape)}")
    paged = block_table is not None
    if paged:
        require_array("block_table", block_table, ("int32",))
        if block_table.ndim != 2 or block_table.shape[0] != B:
            raise ValueError(f"block_table: expected shape (B, pages per sequence) with B={B}, got "
                             f"{tuple(block_table.shape)}")
        capacity = block_table.shape[1] * k_cache.shape[2]
    else:
        if k_cache.shape[0] != B:
            raise ValueError(f"k_cache: a contiguous cache has shape (B, Hk, L, D) with B={B} (q's batch), got "
                             f"{tuple(k_cache.shape)}; pass block_table= for a paged cache")
        capacity = k_cache.shape[2]
    # The values of the lengths and the table are checked only where they already are on the host: on a GPU that
    # would cost a synchronisation per decode step. The kernels clamp them to the cache instead.
    if not is_torch(cache_seqlens) or cache_seqlens.device.type == "cpu":
        lens = _host(cache_seqlens)
        if lens.min(initial=0) < 0 or lens.max(initial=0) > capacity:
            raise ValueError(f"cache_seqlens: every length must be in [0, {capacity}] (the cache's capacity per "
                             f"sequence), got {lens.tolist()}")
        if paged and (not is_torch(block_table) or block_table.device.type == "cpu"):
            table = _host(block_table)
            page_size = k_cache.shape[2]
            for b, length in enumerate(lens):
                used = table[b, :-(-int(length) // page_size)]
                if used.size and (used.min() < 0 or used.max() >= k_cache.shape[0]):
                    raise ValueError(f"block_table[{b}]: pages must be in [0, {k_cache.shape[0]}), got "
                                     f"{used.tolist()}")
    _check_scale(scale)  # wb.attention's rule and message
    return B, H, Hk, D, paged


def reference_decode(q, k_cache, v_cache, cache_seqlens, *, block_table=None, scale=None):
    """float64 NumPy decode through :func:`wb_kernels.reference`: ``(out (B, H, D), lse (B, H))``."""
    from .reference import reference
    from .stages.decode.launcher import contiguous_as_paged, gather_pages

    qn, kn, vn = _numpy64(q), _numpy64(k_cache), _numpy64(v_cache)
    lens = _host(cache_seqlens)
    B, H, D = qn.shape
    if block_table is None:
        table = contiguous_as_paged(B, kn.shape[2])
    else:
        table = _host(block_table)
    group = H // kn.shape[1]
    out, lse = np.zeros((B, H, D)), np.full((B, H), -np.inf)
    for b in range(B):
        length = int(lens[b])
        if length == 0:
            continue
        keys = np.repeat(gather_pages(kn, table, length, b), group, axis=0)[None]  # (1, H, length, D)
        values = np.repeat(gather_pages(vn, table, length, b), group, axis=0)[None]
        o, l = reference(qn[b][None, :, None], keys, values, scale=scale)
        out[b], lse[b] = o[0, :, 0], l[0, :, 0]
    return out, lse


def _propagate_non_finite(out, lse, q, k_cache, cache_seqlens, block_table, scale):
    """NaN/Inf in q or the keys reach the rows SDPA would make NaN (wb.attention's rule), for the numba kernels.

    One pass over q and the keys finds whether there is anything to do (on the host: this path is the simulator's
    and float32's); only then is each sequence's problem rebuilt as an attention one and handed to
    :func:`wb_kernels.api.propagate_non_finite`.
    """
    from .api import propagate_non_finite
    from .stages.decode.launcher import contiguous_as_paged, gather_pages

    qn, kn = _numpy64(q), _numpy64(k_cache)
    if np.isfinite(qn).all() and np.isfinite(kn).all():
        return out, lse
    lens = _host(cache_seqlens)
    table = contiguous_as_paged(qn.shape[0], kn.shape[2]) if block_table is None else \
        _host(block_table)
    group = qn.shape[1] // kn.shape[1]
    out_rows, lse_rows = [], []
    for b in range(qn.shape[0]):
        keys = np.repeat(gather_pages(kn, table, int(lens[b]), b), group, axis=0)[None]  # (1, H, len, D)
        if keys.shape[2] == 0:  # no key: the row stays 0, LSE -inf, whatever its query
            out_rows.append(out[b:b + 1, :, None])
            lse_rows.append(lse[b:b + 1, :, None])
            continue
        o, l = propagate_non_finite(out[b:b + 1, :, None], lse[b:b + 1, :, None], qn[b:b + 1, :, None], keys,
                                    scale=scale)
        out_rows.append(o)
        lse_rows.append(l)
    join = (lambda xs: __import__("torch").cat(xs)) if is_torch(out) else np.concatenate
    return join(out_rows)[:, :, 0], join(lse_rows)[:, :, 0]


def decode(q, k_cache, v_cache, cache_seqlens, *, block_table=None, stage: str = "decode", scale=None,
           num_splits: int | None = None, max_seqlen: int | None = None, return_lse: bool = False):
    """Attention of one new query per sequence over its KV cache (see the module docstring for shapes).

    `stage`: "decode" (the split-KV kernels of lesson 07) or "reference" (float64 NumPy). `num_splits`: the
    number of key splits per sequence (default: chosen from the problem and the GPU's SM count, see
    ``wb_kernels.stages.decode.splitkv.choose_num_splits``). `max_seqlen`: an upper bound of cache_seqlens that the
    caller knows on the host (a decoder does), so the splits cover the keys there are rather than the cache's whole
    capacity; default: the capacity (reading the lengths off the GPU would cost a synchronisation per step).
    """
    # CUDA inputs throughout: the checks depend on shapes, dtypes and devices only, so a signature that passed once
    # passes again (a decoder calls with the same ones for every layer of every step); anything else is checked
    key = cuda_signature(q, k_cache, v_cache, cache_seqlens, block_table)
    if key is not None and isinstance(scale, (float, int, type(None))):
        key = (key, stage, scale)
    else:
        key = None
    if _VALIDATED.get(key) is None:
        _VALIDATED.remember(key, validate_decode(q, k_cache, v_cache, cache_seqlens, block_table=block_table,
                                                 stage=stage, scale=scale))
    if max_seqlen is not None:
        if not isinstance(max_seqlen, (int, np.integer)) or max_seqlen < 0:
            raise ValueError(f"max_seqlen: expected a non-negative int, got {max_seqlen!r}")
        if not is_torch(cache_seqlens) or cache_seqlens.device.type == "cpu":
            longest = int(_host(cache_seqlens).max())
            if longest > max_seqlen:
                raise ValueError(f"max_seqlen={max_seqlen} is below the longest sequence ({longest} keys)")
    if stage == "reference":
        out, lse = reference_decode(q, k_cache, v_cache, cache_seqlens, block_table=block_table, scale=scale)
    else:
        from .stages.decode.launcher import decode_forward, uses_cuda_kernel

        if uses_cuda_kernel(q):
            # The decode step's path on a GPU, kept short (it runs once per layer and token): the CUDA kernel
            # handles NaN/Inf itself, warns about nothing, and returns tensors on q's device in q's dtype.
            out, lse = decode_forward(q, k_cache, v_cache, cache_seqlens, block_table=block_table, scale=scale,
                                      num_splits=num_splits, max_seqlen=max_seqlen)
            return (out, lse) if return_lse else out
        with warnings.catch_warnings():
            # the simulator computes in NumPy, which warns about NaN/Inf that are the right answer here (as in
            # wb.attention); a GPU computes the same silently
            warnings.simplefilter("ignore", RuntimeWarning)
            out, lse = decode_forward(q, k_cache, v_cache, cache_seqlens, block_table=block_table, scale=scale,
                                      num_splits=num_splits, max_seqlen=max_seqlen)
        out, lse = _propagate_non_finite(out, lse, q, k_cache, cache_seqlens, block_table, scale)
    out, lse = like_input(out, q), like_input(lse, q)
    return (out, lse) if return_lse else out
