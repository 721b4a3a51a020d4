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

``kv_layout="NHD"`` takes caches whose last two axes are (keys, heads, D) instead: (B, L, Hk, D) or
(num_pages, page_size, Hk, D) (flash-attn's and FlashInfer's NHD), read in place through their strides. The shapes
alone cannot tell the layouts apart when both readings divide H, so a paged NHD cache must be named.

On a GPU the call is safe to capture in a CUDA graph and to compile with ``torch.compile(fullgraph=True)`` (it is
the registered op ``torch.ops.wb.decode`` for compilers and fake tensors): the split count depends on the cache's
capacity or on `max_seqlen` (a bucket, see :func:`seqlen_bucket`), never on the lengths' values, which are read on the
device only; the buffers come from PyTorch's caching allocator. A length that the splits do not cover (a
`max_seqlen` below it) is still computed in full, by the last split, and reported by :func:`decode_problems`.

The new token sees every key of its own sequence (bottom-right causal alignment with one query) and nothing beyond
its length. Returns (B, H, D) (and the LSE (B, H) with ``return_lse=True``). A sequence of length 0 gets zeros and
LSE -inf.
"""

from __future__ import annotations

import sys
import warnings

import numpy as np

from . import ops
from . import stages as _stages
from .api import _check_scale, _dtype_name, _numpy64, require_array
from .backend import BACKEND
from .device import ValidatedCalls, cuda_signature, is_torch, like_input
from .validation import check_simulator_time

__all__ = ["decode", "validate_decode", "DECODE_STAGES", "KV_LAYOUTS", "MAX_NUM_SPLITS", "reference_decode",
           "seqlen_bucket", "decode_problems"]

DECODE_STAGES = ("reference", "decode")
KV_LAYOUTS = ("HND", "NHD")  # (..., Hk, keys, D) or (..., keys, Hk, D)
MAX_NUM_SPLITS = 4096  # splits per sequence at most (the CUDA merge keeps one float per split in shared memory)
_VALIDATED = ValidatedCalls()  # CUDA inputs' signatures that passed validate_decode (see decode)


def _host(x) -> np.ndarray:
    """Lengths or a block table as a NumPy array (read off the GPU: only where a synchronisation is acceptable)."""
    return np.asarray(x.cpu() if is_torch(x) else x)


def _on_host(x) -> bool:
    return not is_torch(x) or x.device.type == "cpu"


def as_hnd(cache, kv_layout: str):
    """`cache` with its heads before its keys, (…, Hk, keys, D): a view, never a copy (NHD caches are read through
    their strides)."""
    if kv_layout == "HND":
        return cache
    return cache.transpose(1, 2) if is_torch(cache) else np.swapaxes(cache, 1, 2)


def _check_count(name: str, value, low: int, high: int, why: str):
    """An int in [low, high] (NumPy ints too; never a bool, a float or a string), else a TypeError/ValueError that
    names the range and why it is what it is."""
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer)):
        raise TypeError(f"{name}: expected an int in [{low}, {high}] ({why}) or None, got {value!r} of type "
                        f"{type(value).__name__}")
    if not low <= value <= high:
        raise ValueError(f"{name}: expected an int in [{low}, {high}] ({why}) or None, got {value}")
    return int(value)


def validate_decode(q, k_cache, v_cache, cache_seqlens, *, block_table=None, stage="decode", scale=None,
                    kv_layout="HND"):
    """Raise a clear error for anything :func:`decode` can't run; returns (B, H, Hk, D, paged, capacity).

    Shapes, dtypes and devices first (all a fake tensor has, see :func:`_validate_shapes`); then, where they are on
    the host, the lengths' and the table's values (on a GPU reading them would cost a synchronisation per step: the
    kernel clamps them to the cache and reports what it clamped, :func:`decode_problems`).
    """
    B, H, Hk, D, paged, capacity = _validate_shapes(q, k_cache, v_cache, cache_seqlens, block_table=block_table,
                                                    stage=stage, scale=scale, kv_layout=kv_layout)
    if _on_host(cache_seqlens):
        lens = _host(cache_seqlens)
        if lens.min(initial=0) < 0 or lens.max(initial=0) > capacity:
            other = "NHD" if kv_layout == "HND" else "HND"
            hint = f"; if the pages are laid out {other}, pass kv_layout={other!r}" if paged else ""
            raise ValueError(f"cache_seqlens: every length must be in [0, {capacity}] (the cache's capacity per "
                             f"sequence), got {lens.tolist()}{hint}")
        if paged and _on_host(block_table):
            table = _host(block_table)
            page_size = as_hnd(k_cache, kv_layout).shape[2]
            num_pages = k_cache.shape[0]
            for b, length in enumerate(lens):
                used = table[b, :-(-int(length) // page_size)]
                if used.size and (used.min() < 0 or used.max() >= num_pages):
                    raise ValueError(f"block_table[{b}]: pages must be in [0, {num_pages}), got {used.tolist()}")
    return B, H, Hk, D, paged, capacity


def _validate_shapes(q, k_cache, v_cache, cache_seqlens, *, block_table, stage, scale, kv_layout):
    """The checks that read shapes, dtypes and devices only (what the registered op's fake implementation runs)."""
    if not isinstance(stage, str) or stage not in DECODE_STAGES:
        raise ValueError(f"stage={stage!r} has no decode entry; decode stages: {', '.join(DECODE_STAGES)}")
    if not isinstance(kv_layout, str) or kv_layout not in KV_LAYOUTS:
        raise ValueError(f"kv_layout: expected 'HND' (caches (B, Hk, L, D) or (num_pages, Hk, page_size, D)) or "
                         f"'NHD' ((B, L, Hk, D) or (num_pages, page_size, Hk, D)), got {kv_layout!r}")
    for name, x in (("q", q), ("k_cache", k_cache), ("v_cache", v_cache)):
        require_array(name, x)
    if q.ndim != 3:
        raise ValueError(f"q: expected rank 3 (B, H, D), one new query per sequence, got shape {tuple(q.shape)}")
    for name, x in (("k_cache", k_cache), ("v_cache", v_cache)):
        if x.ndim != 4:
            raise ValueError(f"{name}: expected rank 4 ((B, Hk, L, D), or (num_pages, Hk, page_size, D) with a "
                             f"block_table; kv_layout='NHD' for (B, L, Hk, D)), got shape {tuple(x.shape)}")
    if tuple(k_cache.shape) != tuple(v_cache.shape):
        raise ValueError(f"k_cache {tuple(k_cache.shape)} and v_cache {tuple(v_cache.shape)} must have one shape")
    B, H, D = q.shape
    kh = as_hnd(k_cache, kv_layout)
    Hk, slots = kh.shape[1], kh.shape[2]  # slots: keys per page (paged) or per sequence (contiguous)
    layout = ("(num_pages, Hk, page_size, D)" if kv_layout == "HND" else "(num_pages, page_size, Hk, D)") \
        if block_table is not None else ("(B, Hk, L, D)" if kv_layout == "HND" else "(B, L, Hk, D)")
    if min(B, H, D) == 0 or min(k_cache.shape) == 0:
        raise ValueError(f"empty input: q {tuple(q.shape)} (B, H, D), k_cache {tuple(k_cache.shape)} {layout}; every "
                         "dimension must be >= 1 (a sequence with no keys yet is a length of 0 in cache_seqlens, not "
                         "an empty cache)")
    if k_cache.shape[3] != D:
        raise ValueError(f"head dim differs: q has D={D}, the cache D={k_cache.shape[3]}")
    if H % Hk:
        other = "NHD" if kv_layout == "HND" else "HND"
        raise ValueError(f"q has H={H} heads and the cache, read as {kv_layout} {layout}, Hk={Hk}: Hk must divide H "
                         f"(GQA: H // Hk query heads share each KV head; MQA: Hk = 1). If the cache is laid out "
                         f"{other}, pass kv_layout={other!r}")
    if len({_dtype_name(x) for x in (q, k_cache, v_cache)}) != 1:
        raise TypeError(f"q, k_cache, v_cache have different dtypes ({_dtype_name(q)}, {_dtype_name(k_cache)}, "
                        f"{_dtype_name(v_cache)}); use one dtype")
    if len({is_torch(x) for x in (q, k_cache, v_cache)}) != 1 or \
            len({str(x.device) if is_torch(x) else "cpu" for x in (q, k_cache, v_cache)}) != 1:
        raise ValueError("q, k_cache, v_cache: expected all NumPy arrays or all torch tensors on one device")
    device = str(q.device) if is_torch(q) else "cpu"
    if device.startswith("cuda") and not BACKEND.is_gpu:
        raise ValueError(f"inputs are on {device}, but wb_kernels runs on the CUDA simulator; pass CPU data")
    _check_dtype(q, stage, D)
    require_array("cache_seqlens", cache_seqlens, ("int32",))
    if tuple(cache_seqlens.shape) != (B,):
        raise ValueError(f"cache_seqlens: expected shape (B,)=({B},), got {tuple(cache_seqlens.shape)}")
    _check_index_device("cache_seqlens", cache_seqlens, device)
    paged = block_table is not None
    if paged:
        require_array("block_table", block_table, ("int32",))
        if block_table.ndim != 2 or block_table.shape[0] != B or block_table.shape[1] == 0:
            raise ValueError(f"block_table: expected shape (B, pages per sequence) with B={B} and at least one page, "
                             f"got {tuple(block_table.shape)}")
        _check_index_device("block_table", block_table, device)
        capacity = block_table.shape[1] * slots
    else:
        if kh.shape[0] != B:
            raise ValueError(f"k_cache: a contiguous cache has shape {layout} with B={B} (q's batch), got "
                             f"{tuple(k_cache.shape)}; pass block_table= for a paged cache")
        capacity = slots
    _check_scale(scale)  # wb.attention's rule and message
    return B, H, Hk, D, paged, capacity


def _check_index_device(name, x, device):
    where = str(x.device) if is_torch(x) else "cpu"
    if where not in ("cpu", device):
        raise ValueError(f"{name}: is on {where} but q and the cache are on {device}; put it on their device (or on "
                         "the CPU, which costs a copy per call)")


def _check_dtype(q, stage: str, D: int) -> None:
    """The stage's dtypes and head dims, as wb.attention refuses them: the numba kernels take float32 and float16,
    the CUDA kernel float16 and bfloat16 at D 64 or 128, the reference every float dtype (float64 exactly)."""
    from .stages.decode.launcher import CUDA_KERNEL_DTYPES, CUDA_KERNEL_HEAD_DIMS, uses_cuda_kernel

    dtype = _dtype_name(q)
    spec = _stages.get_stage("reference" if stage == "reference" else "decode")
    if stage == "reference":
        if dtype not in spec.dtypes:
            raise TypeError(f"q, k_cache, v_cache: stage 'reference' does not take dtype {dtype}; it accepts "
                            f"{', '.join(spec.dtypes)}")
        return
    if dtype == "bfloat16":
        if not uses_cuda_kernel(q):
            raise TypeError("bfloat16 needs the CUDA kernel (a GPU, CUDA tensors, D 64 or 128); the numba kernel "
                            "takes float32 and float16")
        return
    if dtype not in spec.dtypes:
        hint = " (stage='reference' computes float64 exactly)" if dtype == "float64" else ""
        raise TypeError(f"q, k_cache, v_cache: stage 'decode' does not take dtype {dtype}; it accepts "
                        f"{', '.join(spec.dtypes)}, and bfloat16 with the CUDA kernel ({', '.join(CUDA_KERNEL_DTYPES)} "
                        f"on a GPU at D in {list(CUDA_KERNEL_HEAD_DIMS)}){hint}")
    if D not in spec.head_dims:
        raise ValueError(f"stage 'decode' does not support head dim D={D}; it supports D in {list(spec.head_dims)}")


def seqlen_bucket(length: int, capacity: int, *, smallest: int = 256) -> int:
    """The `max_seqlen` to pass for sequences of up to `length` keys so that a decoder's calls, and its captured
    graphs, see few distinct values: the next power of two from `smallest` on, at most the cache's `capacity`.

    The split count (and so a graph's launch) depends only on it; a sequence that grows past it is still computed
    in full (by the last split, more slowly) and reported by :func:`decode_problems`.
    """
    length, capacity = int(length), int(capacity)
    if length < 0 or capacity < 1:
        raise ValueError(f"seqlen_bucket: expected length >= 0 and capacity >= 1, got {length} and {capacity}")
    bucket = max(int(smallest), 1)
    while bucket < length:
        bucket *= 2
    return min(bucket, capacity)


def _check_options(num_splits, max_seqlen, capacity: int, cache_seqlens):
    """`num_splits` and `max_seqlen` (cheap; checked on every call). Returns max_seqlen clamped to the capacity."""
    if max_seqlen is not None:
        max_seqlen = _check_count("max_seqlen", max_seqlen, 0, 2**31 - 1, "an upper bound of cache_seqlens, in keys")
        if _on_host(cache_seqlens):
            longest = int(_host(cache_seqlens).max(initial=0))
            if longest > max_seqlen:
                raise ValueError(f"max_seqlen={max_seqlen} is below the longest sequence ({longest} keys); pass "
                                 f"max_seqlen >= {longest} (seqlen_bucket({longest}, {capacity}) = "
                                 f"{seqlen_bucket(longest, capacity)}), or None for the capacity")
        max_seqlen = min(max_seqlen, capacity)
    if num_splits is not None:
        high = min(max(64, capacity), MAX_NUM_SPLITS)
        _check_count("num_splits", num_splits, 1, high, f"at most max(64, the cache's {capacity} keys per sequence) "
                     f"and {MAX_NUM_SPLITS}; None lets the launcher choose")
        num_splits = int(num_splits)
    return num_splits, max_seqlen


def _check_simulator_time(B, H, Hk, D, max_len, num_splits):
    """wb.attention's simulator limit for the numba kernels' grid: every split is a block that pays at least one
    tile of keys, so the splits count as keys."""
    from .stages.decode.kernel import config_for

    spec = _stages.get_stage("decode")
    if spec.simulator_seconds is None:
        return
    keys = max(max_len, (num_splits or 1) * config_for().block_n)
    seconds = spec.simulator_seconds(B, H, 1, keys, D)
    check_simulator_time("decode", seconds, f"B={B} H={H} Hk={Hk} D={D}, {max_len} keys per sequence, "
                                            f"num_splits={num_splits}")


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
           num_splits: int | None = None, max_seqlen: int | None = None, return_lse: bool = False,
           kv_layout: str = "HND"):
    """Attention of one new query per sequence over its KV cache (see the module docstring for shapes).

    `stage`: "decode" (the split-KV kernels of lesson 07) or "reference" (float64 NumPy). `num_splits`: the
    number of key splits per sequence, an int in [1, max(64, capacity)] (at most ``MAX_NUM_SPLITS``; default: chosen
    from the problem and the GPU's SM count, see ``wb_kernels.stages.decode.splitkv.choose_num_splits``).
    `max_seqlen`: an upper bound of cache_seqlens that the caller knows on the host, or a bucket of it
    (:func:`seqlen_bucket`), so the splits cover the keys there are rather than the cache's whole capacity; default:
    the capacity. Lengths on the host above it are refused; lengths on the GPU above it are computed in full by the
    last split and reported by :func:`decode_problems` (no synchronisation here). `kv_layout`: "HND" or "NHD".
    """
    torch = sys.modules.get("torch")  # None: no torch tensor can have been given
    if torch is not None and isinstance(q, torch.Tensor) and (
            torch.compiler.is_compiling() or type(q) is not torch.Tensor or q.is_meta):
        # a compiler traces, or fake/meta tensors: the registered op (its fake implementation gives the shapes)
        if not ops.ensure(torch):
            raise RuntimeError(f"wb.decode's operator, torch.ops.wb.decode, {ops.MISSING}")
        out, lse = torch.ops.wb.decode(q, k_cache, v_cache, cache_seqlens, block_table, stage, scale,
                                       num_splits, max_seqlen, kv_layout)
        return (out, lse) if return_lse else out
    if torch is not None and isinstance(q, torch.Tensor):
        ops.ensure(torch)  # (lookups once they are): so that a later compile finds the op
    out, lse = decode_eager(q, k_cache, v_cache, cache_seqlens, block_table=block_table, stage=stage, scale=scale,
                            num_splits=num_splits, max_seqlen=max_seqlen, kv_layout=kv_layout)
    return (out, lse) if return_lse else out


def decode_eager(q, k_cache, v_cache, cache_seqlens, *, block_table=None, stage="decode", scale=None,
                 num_splits=None, max_seqlen=None, kv_layout="HND"):
    """:func:`decode` without the op: validated, then run; ``(out, lse)`` (what the op's real implementation runs)."""
    # CUDA inputs throughout: the checks depend on shapes, dtypes and devices only, so a signature that passed once
    # passes again (a decoder calls with the same ones for every layer of every step); anything else is checked
    key = cuda_signature(q, k_cache, v_cache, cache_seqlens, block_table)
    if key is not None and isinstance(scale, (float, int, type(None))) and isinstance(stage, str) \
            and isinstance(kv_layout, str):
        key = (key, stage, scale, kv_layout)
    else:
        key = None
    checked = _VALIDATED.get(key)
    if checked is None:
        checked = _VALIDATED.remember(key, validate_decode(q, k_cache, v_cache, cache_seqlens,
                                                           block_table=block_table, stage=stage, scale=scale,
                                                           kv_layout=kv_layout))
    B, H, Hk, D, paged, capacity = checked
    num_splits, max_seqlen = _check_options(num_splits, max_seqlen, capacity, cache_seqlens)
    k_cache, v_cache = as_hnd(k_cache, kv_layout), as_hnd(v_cache, kv_layout)
    if stage == "reference":
        out, lse = reference_decode(q, k_cache, v_cache, cache_seqlens, block_table=block_table, scale=scale)
        return like_input(out, q), like_input(lse, q)
    from .stages.decode.launcher import decode_forward, uses_cuda_kernel

    if uses_cuda_kernel(q):
        # The decode step's path on a GPU, kept short (it runs once per layer and token): the CUDA kernel
        # handles NaN/Inf itself, warns about nothing, and returns tensors on q's device in q's dtype.
        return decode_forward(q, k_cache, v_cache, cache_seqlens, block_table=block_table, scale=scale,
                              num_splits=num_splits, max_seqlen=max_seqlen)
    if BACKEND.is_simulator:
        _check_simulator_time(B, H, Hk, D, capacity if max_seqlen is None else max_seqlen, num_splits)
    with warnings.catch_warnings():
        # the simulator computes in NumPy, which warns about NaN/Inf that are the right answer here (as in
        # wb.attention); a GPU computes the same silently
        warnings.simplefilter("ignore", RuntimeWarning)
        out, lse = decode_forward(q, k_cache, v_cache, cache_seqlens, block_table=block_table, scale=scale,
                                  num_splits=num_splits, max_seqlen=max_seqlen)
    out, lse = _propagate_non_finite(out, lse, q, k_cache, cache_seqlens, block_table, scale)
    return like_input(out, q), like_input(lse, q)


def decode_problems(device=None, *, reset: bool = True) -> list:
    """What the CUDA decode kernel found wrong with lengths that live on the GPU since the last look, as sentences
    saying what to do (empty: nothing). Reads a flag from the device, so it waits for the GPU: call it after a
    step, or a graph's replay, not inside one. `device`: a CUDA device (default: the current one)."""
    from .stages.decode.launcher import read_status

    return read_status(device, reset=reset)
