"""The front door's first floor: every check of a call against its stage, before anything runs (all lessons, through
``wb.attention``, ``wb.attention_backward`` and ``wb.decode``).

- attention: :func:`validate` (a stage and its inputs: where it runs, its dtypes and head dims, the memory and
  simulator time the sizes need) and :func:`validate_call` (a whole call as one :class:`AttentionCall`, each value in
  its one canonical form);
- decode: :func:`validate_decode` and :func:`validate_decode_call` (a :class:`DecodeCall`),
  :func:`check_decode_options`, :func:`seqlen_bucket`.

The rules for each argument whatever the stage, and each value's canonical form, are :mod:`wb_kernels.arguments`'s,
the floor under the reference and the rungs; this module reads the rungs (through the registry), so it sits above
them. Each error names the argument, the value it got and what is accepted (``tests/test_api_errors.py``). The imports
run one way: arguments <- reference <- rungs <- validation <- execution <- torch_ops <- api. The stage registry is read
through its module (``stages.get_stage``), so that a test that swaps the registry swaps it here too.
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass
from typing import Optional

import numpy as np

from . import stages as _stages
from .arguments import canonical_causal, canonical_scale, dtype_name, require_array, validate_inputs
from .backend import BACKEND
from .device import ValidatedCalls, cuda_signature, is_torch
from .variants import NO_VARIANTS, Variants, canonical_variants

__all__ = ["validate", "validate_call", "AttentionCall", "SIMULATOR_MAX_SECONDS", "check_simulator_time",
           "validate_decode", "validate_decode_shapes", "validate_decode_call", "DecodeCall", "check_decode_options",
           "seqlen_bucket", "as_hnd", "host_array", "check_decode_simulator_time", "DECODE_STAGES", "KV_LAYOUTS",
           "MAX_NUM_SPLITS"]

# Sizes the simulator would need longer than this for are refused (override: WB_SIM_MAX_SECONDS).
SIMULATOR_MAX_SECONDS = float(os.environ.get("WB_SIM_MAX_SECONDS", "120"))


def _free_bytes(on_cuda: bool) -> int:
    if on_cuda:
        import torch

        return torch.cuda.mem_get_info()[0]
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


@functools.lru_cache(maxsize=None)
def _total_gpu_bytes(device_index: int) -> int:
    import torch

    return torch.cuda.get_device_properties(device_index).total_memory


def _may_not_fit(need: int, on_cuda: bool) -> bool:
    """Whether a buffer of `need` bytes is large enough to ask the device how much memory is free.

    Asking the GPU (``cudaMemGetInfo``) costs tens of microseconds, a noticeable part of a small call; a buffer under
    1/16 of the GPU's memory is left to PyTorch's allocator, whose own out-of-memory error is clear enough.
    """
    if not on_cuda:
        return True
    import torch

    return need > _total_gpu_bytes(torch.cuda.current_device()) // 16


def _gib(n: float) -> str:
    return f"{n / 2**30:.2f} GiB"


def validate(q, k, v, *, stage: str = "reference", causal=False, key_padding_mask=None, scale=None,
             variants: Variants = NO_VARIANTS):
    """Raise a clear ValueError/TypeError/MemoryError for anything `stage` cannot run. Returns the Stage.

    First the stage name, then the rules of every entry point (:func:`validate_inputs`), then the stage's
    own: where it runs (a GPU-only stage says so before anything else: the right dtype would not help on
    the CPU), its dtypes and head dims, and the memory and simulator time the sizes need.
    """
    return _validated(q, k, v, stage, causal, key_padding_mask, scale, lambda: variants)[0]


def _validated(q, k, v, stage, causal, key_padding_mask, scale, variants_of) -> tuple:
    """:func:`validate`'s checks, with the variants made by ``variants_of()`` once q, k and v passed theirs (a
    variant's shape is checked against theirs): ``(stage, variants)``."""
    if not isinstance(stage, str):
        raise TypeError(f"stage: expected a stage name (str), one of {', '.join(_stages.available_stages())}; "
                        f"got {stage!r} of type {type(stage).__name__}")
    spec = _stages.get_stage(stage)  # ValueError naming the stages there are
    inputs = validate_inputs(q, k, v, causal=causal, key_padding_mask=key_padding_mask, scale=scale)
    B, H, Lq, Lk, D, device = inputs.B, inputs.H, inputs.Lq, inputs.Lk, inputs.D, inputs.device
    variants = variants_of()

    missing = [name for name in variants.used() if name not in spec.variants]
    if missing:
        able = [name for name, st in _stages.available_stages().items() if set(variants.used()) <= set(st.variants)]
        raise ValueError(f"stage {stage!r} does not compute {', '.join(missing)}; the stages that compute "
                         f"{variants.describe()} are {', '.join(able) or 'none'}")
    if spec.needs_gpu and not device.startswith("cuda"):
        raise ValueError(
            f"stage {stage!r} runs only on a CUDA GPU and takes CUDA torch tensors; got inputs on {device}"
            + ("" if BACKEND.is_gpu else " (and this machine has no CUDA GPU)"))
    if inputs.dtype not in spec.dtypes:
        raise TypeError(f"q, k, v: stage {stage!r} does not take dtype {inputs.dtype}; it accepts {', '.join(spec.dtypes)}")
    if spec.head_dims is not None and D not in spec.head_dims:
        raise ValueError(f"stage {stage!r} does not support head dim D={D}; it supports D in {list(spec.head_dims)}")
    if device.startswith("cuda") and not BACKEND.is_gpu:
        raise ValueError(f"inputs are on {device}, but wb_kernels runs on the CUDA simulator; pass CPU data")

    if spec.workspace_bytes is not None:
        need = spec.workspace_bytes(B, H, Lq, Lk, D)
        on_cuda = BACKEND.is_gpu and spec.name != "reference"
        free = _free_bytes(on_cuda) if _may_not_fit(need, on_cuda) else need
        if need > free:
            flash = [name for name, st in _stages.available_stages().items() if st.linear_memory]
            raise MemoryError(
                f"stage {stage!r} needs {_gib(need)} of {'GPU' if on_cuda else 'host'} memory for the "
                f"Lq x Lk = {Lq} x {Lk} score and probability matrices (B*H = {B * H}), but only {_gib(free)} "
                f"is free. The flash stages keep memory O(L): try stage={'/'.join(flash) or 'flash'}.")
    if BACKEND.is_simulator and spec.simulator_seconds is not None:
        check_simulator_time(stage, spec.simulator_seconds(B, H, Lq, Lk, D), f"B={B} H={H} Lq={Lq} Lk={Lk} D={D}")
    return spec, variants


@dataclass(frozen=True)
class AttentionCall:
    """A validated ``wb.attention`` call: all of it but the tensors, each value in its one canonical form, as the
    execution (:mod:`wb_kernels.execution`), the torch operators and their saved autograd context carry it to the
    kernel and back.

    The tensors (q, k, v, the key padding mask) travel beside it, as the registered op's schema has them. The
    attention variants (a bias, a window, a softcap, sinks, document ids) are one field, validated in
    :func:`validate_call` and read by the stages that compute them through :func:`wb_kernels.execution.run_forward`;
    their tensors (the bias, the sinks: differentiable) also travel beside it through the op and autograd.
    """

    stage: "_stages.Stage"  # the registered stage, whose forward (and Backward) run the call
    causal: Optional[str]  # None (no mask), "top_left" or "bottom_right" (canonical_causal)
    scale: Optional[float]  # a finite float, or None = 1/sqrt(D) (canonical_scale)
    variants: Variants = NO_VARIANTS  # softcap, ALiBi, bias, window, documents, sinks (wb_kernels.variants)


# CUDA inputs' signatures (and the call's options) that passed validate_call, with the call: a signature checked once is
# not checked again (the checks cost more than a small kernel's launch; see device.ValidatedCalls)
_VALIDATED_CALLS = ValidatedCalls()


def validate_call(q, k, v, *, stage: str = "reference", causal=False, key_padding_mask=None,
                  scale=None, **variants) -> AttentionCall:
    """:func:`validate`, then the call as one :class:`AttentionCall`; from a cache when CUDA inputs of this signature
    and these options passed before (their checks read shapes, dtypes and devices only). `variants` are the keyword
    arguments of :func:`wb_kernels.variants.canonical_variants` (a call that uses one is never cached)."""
    used = any(value is not None for value in variants.values())
    key = None if used else cuda_signature(q, k, v, key_padding_mask)
    if key is not None and isinstance(stage, str) and isinstance(scale, (float, int, type(None))) \
            and isinstance(causal, (bool, str, type(None))):
        key = (key, stage, causal, scale)
    else:
        key = None
    call = _VALIDATED_CALLS.get(key)
    if call is None:
        spec, canonical = _validated(q, k, v, stage, causal, key_padding_mask, scale,
                                     lambda: canonical_variants(q, k, **variants) if used else NO_VARIANTS)
        call = _VALIDATED_CALLS.remember(key, AttentionCall(spec, canonical_causal(causal), canonical_scale(scale),
                                                            canonical))
    return call


def check_simulator_time(stage: str, seconds: float, sizes: str) -> None:
    """Refuse a problem the CUDA simulator would need more than ``SIMULATOR_MAX_SECONDS`` for (wb.attention and
    wb.decode alike); `sizes` names the sizes in the message."""
    if seconds > SIMULATOR_MAX_SECONDS:
        raise ValueError(
            f"stage {stage!r} at {sizes} would take about {seconds:.0f} s on the "
            f"CUDA simulator (limit {SIMULATOR_MAX_SECONDS:.0f} s, set WB_SIM_MAX_SECONDS to change it); "
            "use smaller sizes here, or run on a GPU.")




# ---------------------------------------------------------------------------------------------------------- decode

DECODE_STAGES = ("reference", "decode")
KV_LAYOUTS = ("HND", "NHD")  # (..., Hk, keys, D) or (..., keys, Hk, D)
MAX_NUM_SPLITS = 4096  # splits per sequence at most (the CUDA merge keeps one float per split in shared memory)


def host_array(x) -> np.ndarray:
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
    """Raise a clear error for anything :func:`wb_kernels.decode` can't run; returns (B, H, Hk, D, paged, capacity).

    Shapes, dtypes and devices first (all a fake tensor has, see :func:`validate_decode_shapes`); then, where they are
    on the host, the lengths' and the table's values (on a GPU reading them would cost a synchronisation per step: the
    kernel clamps them to the cache and reports what it clamped, :func:`wb_kernels.api.decode_problems`).
    """
    B, H, Hk, D, paged, capacity = validate_decode_shapes(q, k_cache, v_cache, cache_seqlens, block_table=block_table,
                                                    stage=stage, scale=scale, kv_layout=kv_layout)
    if _on_host(cache_seqlens):
        lens = host_array(cache_seqlens)
        if lens.min(initial=0) < 0 or lens.max(initial=0) > capacity:
            other = "NHD" if kv_layout == "HND" else "HND"
            hint = f"; if the pages are laid out {other}, pass kv_layout={other!r}" if paged else ""
            raise ValueError(f"cache_seqlens: every length must be in [0, {capacity}] (the cache's capacity per "
                             f"sequence), got {lens.tolist()}{hint}")
        if paged and _on_host(block_table):
            table = host_array(block_table)
            page_size = as_hnd(k_cache, kv_layout).shape[2]
            num_pages = k_cache.shape[0]
            for b, length in enumerate(lens):
                used = table[b, :-(-int(length) // page_size)]
                if used.size and (used.min() < 0 or used.max() >= num_pages):
                    raise ValueError(f"block_table[{b}]: pages must be in [0, {num_pages}), got {used.tolist()}")
    return B, H, Hk, D, paged, capacity


def validate_decode_shapes(q, k_cache, v_cache, cache_seqlens, *, block_table, stage, scale, kv_layout):
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
    if len({dtype_name(x) for x in (q, k_cache, v_cache)}) != 1:
        raise TypeError(f"q, k_cache, v_cache have different dtypes ({dtype_name(q)}, {dtype_name(k_cache)}, "
                        f"{dtype_name(v_cache)}); use one dtype")
    if len({is_torch(x) for x in (q, k_cache, v_cache)}) != 1 or \
            len({str(x.device) if is_torch(x) else "cpu" for x in (q, k_cache, v_cache)}) != 1:
        raise ValueError("q, k_cache, v_cache: expected all NumPy arrays or all torch tensors on one device")
    device = str(q.device) if is_torch(q) else "cpu"
    if device.startswith("cuda") and not BACKEND.is_gpu:
        raise ValueError(f"inputs are on {device}, but wb_kernels runs on the CUDA simulator; pass CPU data")
    _check_decode_dtype(q, stage, D)
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
    canonical_scale(scale)  # wb.attention's rule and message
    return B, H, Hk, D, paged, capacity


def _check_index_device(name, x, device):
    where = str(x.device) if is_torch(x) else "cpu"
    if where not in ("cpu", device):
        raise ValueError(f"{name}: is on {where} but q and the cache are on {device}; put it on their device (or on "
                         "the CPU, which costs a copy per call)")


def _check_decode_dtype(q, stage: str, D: int) -> None:
    """The stage's dtypes and head dims, as wb.attention refuses them: the numba kernels take float32 and float16,
    the CUDA kernel float16 and bfloat16 at D 64 or 128, the reference every float dtype (float64 exactly)."""
    from .stages.decode.launcher import CUDA_KERNEL_DTYPES, CUDA_KERNEL_HEAD_DIMS, uses_cuda_kernel

    dtype = dtype_name(q)
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


def check_decode_options(num_splits, max_seqlen, capacity: int, cache_seqlens):
    """`num_splits` and `max_seqlen` (cheap; checked on every call). Returns max_seqlen clamped to the capacity."""
    if max_seqlen is not None:
        max_seqlen = _check_count("max_seqlen", max_seqlen, 0, 2**31 - 1, "an upper bound of cache_seqlens, in keys")
        if _on_host(cache_seqlens):
            longest = int(host_array(cache_seqlens).max(initial=0))
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


def check_decode_simulator_time(B, H, Hk, D, max_len, num_splits):
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


@dataclass(frozen=True)
class DecodeCall:
    """A validated ``wb.decode`` call: what its checks found and its options in canonical form, the tensors beside it
    (``num_splits`` and ``max_seqlen`` are checked on every call: :func:`check_decode_options`)."""

    stage: str  # "reference" or "decode"
    B: int
    H: int  # query heads
    Hk: int  # key/value heads of the cache
    D: int
    paged: bool  # a block table was given
    capacity: int  # keys per sequence the cache holds
    scale: Optional[float]  # canonical_scale
    kv_layout: str  # "HND" or "NHD"


_VALIDATED_DECODES = ValidatedCalls()  # CUDA inputs' signatures that passed validate_decode, with the DecodeCall


def validate_decode_call(q, k_cache, v_cache, cache_seqlens, *, block_table=None, stage="decode", scale=None,
                         kv_layout="HND") -> DecodeCall:
    """:func:`validate_decode`, then the call as one :class:`DecodeCall`; from a cache when CUDA inputs of this
    signature and these options passed before (a decoder calls with the same ones for every layer of every step)."""
    key = cuda_signature(q, k_cache, v_cache, cache_seqlens, block_table)
    if key is not None and isinstance(scale, (float, int, type(None))) and isinstance(stage, str) \
            and isinstance(kv_layout, str):
        key = (key, stage, scale, kv_layout)
    else:
        key = None
    call = _VALIDATED_DECODES.get(key)
    if call is None:
        checked = validate_decode(q, k_cache, v_cache, cache_seqlens, block_table=block_table, stage=stage,
                                  scale=scale, kv_layout=kv_layout)
        call = _VALIDATED_DECODES.remember(key, DecodeCall(stage, *checked, canonical_scale(scale), kv_layout))
    return call
