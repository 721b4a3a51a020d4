"""The decode benchmark (lesson 07_decode): one new token per sequence against a KV cache, ``wb.decode``'s problem.

    python -m wb_kernels.bench --preset decode --json results/decode/bench_h100.json --time-budget 480
    python -m wb_kernels.bench --preset decode-bar      # the bar shapes' sweeps and the per-call overhead only
    python -m wb_kernels.bench --preset decode-smoke    # tiny sizes: what the simulator runs

The problems are :class:`~wb_kernels.bench.sweeps.DecodeWorkload` (:data:`~wb_kernels.bench.sweeps.DECODE_PRESETS`).
On each, every contender below is checked, then timed, in the same run:

- ``wb.decode``: ``wb.decode(q, k, v, cache_seqlens, block_table=..., max_seqlen=Lk)``, what a user calls (its
  validation, the launcher, the kernels);
- ``decode_forward``: ``wb_kernels.stages.decode.launcher.decode_forward`` with the same arguments, the launcher and
  kernels without the validation (the kernel path alone);
  both of them twice: on the contiguous cache (B, Hk, Lk, D), and on a paged cache holding the same numbers, pools
  (num_pages, Hk, 16, D) with a shuffled block table;
- SDPA: ``scaled_dot_product_attention(q (B, H, 1, D), k, v (B, Hk, Lk, D), enable_gqa=True)`` with PyTorch's choice
  of backend and forced to FLASH_ATTENTION, EFFICIENT_ATTENTION, CUDNN_ATTENTION and MATH (MATH only where the cache
  it makes, K and V repeated to H heads, is at most 1 GiB); a backend that refuses is a row with its reason. SDPA
  has no paged cache: it reads the contiguous one, also for a paged workload;
- FlexAttention, compiled once per shape outside the timing, at the shapes the figure draws;
- FlashInfer (where installed: ``pip install .[contenders]``), the attention vLLM and SGLang serve with: its batch
  decode on the same paged pools as ``wb.decode``, with its CUDA-core kernel (``flashinfer``) and its tensor-core one
  (``flashinfer-tc``), planned once outside the timing (:mod:`wb_kernels.bench.flashinfer`);
- ``copy``: the ceiling (:func:`copy_prepare` says how it is counted).

The metric is GB/s of K and V read once, ``2 * B * Hk * Lk * D * itemsize`` bytes over the CUDA-event median (L2
flushed before each repeat), and its fraction of the copy's rate on the same bytes. Also measured: the per-call
wall time of back-to-back calls (:func:`measure_overhead`), where the bar is 2x SDPA's.

Results go to their own file (``results/decode/bench_<gpu>.json``, ``"kind": "decode"``), written after every
measurement; the same command resumes a run cut short (``--time-budget``). :func:`run_decode` runs a preset.
"""

from __future__ import annotations

import math
import statistics
import time
import warnings
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional

from ..inputs import paged_copy
from ..results_files import gpu_results_path, round_significant, save_results
from ..timing import DEVICE_TIME, free_device_memory
from ..tuning import sdpa_call
from . import flashinfer
from .failures import error_line, is_refusal
from .measure import (TimingPolicy, finish_results, flex_problem, measure_ceilings, open_results, stamp_timing,
                      store_record, tensor_device, time_into, torch_reference, was_slowed)
from .results import new_results
from .sweeps import DECODE_BAR, DECODE_PAGE_SIZE, DECODE_PRESETS, DecodeWorkload, decode_record_key

__all__ = ["DecodeContender", "DecodeInputs", "decode_contenders", "make_inputs", "add_pages",
           "check_slice_indices", "memory_refusal", "plan_decode", "estimate_seconds", "per_call_seconds",
           "measure_overhead", "add_decode_ratios", "run_decode", "default_decode_output", "DECODE_NOTES",
           "OVERHEAD_BAR", "NEEDS_GPU", "DECODE_TIMING"]

NEEDS_GPU = "needs a CUDA GPU; this machine runs the CUDA simulator"
MATH_MAX_BYTES = 2**30  # MATH's cache (K and V repeated to H heads) up to which it is timed
CHECK_ALL_HEADS = 2**24  # elements of K in the check's slice up to which every head is checked
CHECK_MAX = 2**26  # beyond this, the slice is one sequence
MEMORY_SLACK = 2 * 2**30  # the check's float64 slice, the workspaces, the allocator's rounding
OVERHEAD_BAR = 2.0  # the bar: per-call wall time at most twice SDPA's
# How the decode presets time a call (bench.measure.TimingPolicy's fields). A decode step takes tens of microseconds,
# as long as the host's work to launch it or the write-back of a dirty cache, so both are kept out of the timed window:
# - the L2 flushed by reading a buffer twice its size, which leaves it clean ("write" zeroes one and leaves 50 MB of
#   dirty lines, whose write-back the next call pays: results/decode/tune_h100.json has SDPA at B1 H32 Hk8 Lk32768
#   at 0.055 ms after a reading flush and 0.064 ms after a zeroing one, this rung's kernel at 0.055 and 0.060 ms);
# - a sleeping kernel of 300 us queued first, so that the flush, the events and the call's launches are all queued
#   before the GPU reaches them: the events time the device's work. What the host costs per call is measured on its
#   own, wall clock, back to back (the overhead rows).
# The benchmark's one timing method (timing.DEVICE_TIME), the same object the prefill presets and the decode rung's
# tuning script (which reads it from wb_kernels.timing) time with.
DECODE_TIMING = DEVICE_TIME

DECODE_NOTES = {
    "metric": "gbps = K and V bytes read once, 2*B*Hk*Lk*D*itemsize, / the CUDA-event median; q and the output are "
              "under 0.1% of it",
    "timing": f"device time: before every repeat a {DECODE_TIMING['hold_us']:.0f} us sleeping kernel is queued (so "
              "that the host's launches are "
              "queued before the GPU reaches them and the events time the GPU's work, not the host's), then the L2 "
              "is flushed by reading a buffer twice its size (a clean cache; zeroing one would leave 50 MB of dirty "
              "lines for the timed call to write back). The host's cost per call: the overhead rows",
    "ceiling": "copy: dst.copy_(k); dst.copy_(v) on the same cache, its gbps counting what it reads and what it "
               "writes (2 * the K and V bytes / its median): the rate the device's memory sustains. "
               "fraction_of_copy = a contender's gbps / the copy's gbps on the same workload; a stream of reads "
               "alone may run a little above a copy, so a fraction slightly above 1 means at the memory's rate",
    "layouts": "contiguous: the cache (B, Hk, Lk, D). paged: the same numbers in pools (num_pages, Hk, 16, D) with a "
               "shuffled block table, given to wb.decode and decode_forward only; SDPA, FlexAttention and the copy "
               "read the contiguous cache (their rows are under layout contiguous and serve both)",
    "sequences": "every sequence holds Lk keys (cache_seqlens = Lk); wb.decode and decode_forward get max_seqlen=Lk",
    "check": "each output (the copy has none) is checked before it is timed, by wb.check's rule against the "
             "float64 reference, on a slice: sequences 0 and B-1, every head while that is at most 2^24 elements of "
             "K, else heads 0, 1, H/2, H-1, and sequence 0 alone beyond 2^26 elements (each record's check says "
             "which)",
    "vs_best_sdpa": "the fastest SDPA backend on the same workload (whose output passed the check): its median / "
                    "this one's (>1: faster)",
    "vs_best_peer": "the same against the fastest peer on the same workload, any layout (SDPA's backends, "
                    "FlexAttention, FlashInfer; outputs that passed the check): its median / this one's (>1: faster)",
    "flashinfer": "flashinfer.BatchDecodeWithPagedKVCacheWrapper on the paged pools (its 'HND' layout: the pools "
                  "wb.decode reads), planned once per workload outside the timing (plan builds its kernels on first "
                  "use); flashinfer: its CUDA-core decode kernel; flashinfer-tc: use_tensor_cores=True",
    "flex": "torch.compile(flex_attention, dynamic=False, fullgraph=True) with enable_gqa=True, compiled once per "
            "shape before the check and the timing; timed at the figure's shapes only (B=1 and 8, Hk=8, fp16, "
            "D=128), as each shape costs a compilation",
    "overhead": "per-call wall time of back-to-back calls (no synchronisation between them, one at the end of each "
                "batch), median of batches; the bar is at most 2x SDPA's on the same problem",
}


# ----------------------------------------------------------------------------------------------
# Inputs: a cache, the same cache paged, and the slice the check reads
# ----------------------------------------------------------------------------------------------

@dataclass
class DecodeInputs:
    """One workload's tensors, on the device the contenders run on."""

    q: object  # (B, H, D)
    k: object  # (B, Hk, Lk, D), the contiguous cache; None once only the paged contenders are left
    v: object
    seqlens: object  # (B,) int32, every sequence full
    k_pages: object = None  # (num_pages, Hk, page_size, D)
    v_pages: object = None
    block_table: object = None  # (B, Lk // page_size) int32: a shuffled permutation of the pages


def _seed(workload: DecodeWorkload, seed: int) -> int:
    # per workload, not per process (Python's hash() of a str changes between runs): a resumed run sees the same numbers
    return (zlib.crc32(workload.key.encode()) + seed) % 2**31


def make_inputs(workload: DecodeWorkload, seed: int, device: str) -> DecodeInputs:
    """Standard-normal q, k, v drawn on `device` in the workload's dtype (never zeros: zeros make some GPUs faster)."""
    import torch

    w = workload
    generator = torch.Generator(device=device).manual_seed(_seed(w, seed))
    dtype = getattr(torch, w.dtype)

    def draw(*shape):
        return torch.randn(shape, generator=generator, device=device, dtype=dtype)

    return DecodeInputs(q=draw(w.B, w.H, w.D), k=draw(w.B, w.Hk, w.Lk, w.D), v=draw(w.B, w.Hk, w.Lk, w.D),
                        seqlens=torch.full((w.B,), w.Lk, dtype=torch.int32, device=device))


def add_pages(inputs: DecodeInputs, workload: DecodeWorkload, seed: int, page_size: int = DECODE_PAGE_SIZE) -> None:
    """Give `inputs` the paged copy of its cache, with a shuffled block table, then drop the contiguous cache (only
    the paged contenders come after this; the peak is the contiguous cache and the pools, not more)."""
    import torch

    if workload.Lk % page_size:
        raise ValueError(f"Lk={workload.Lk} is not a multiple of the page size {page_size}")
    device = inputs.k.device
    generator = torch.Generator(device=device).manual_seed(_seed(workload, seed) + 1)
    pages = workload.Lk // page_size
    order = torch.randperm(workload.B * pages, generator=generator, device=device)
    inputs.block_table = order.view(workload.B, pages).to(torch.int32)
    inputs.k_pages = paged_copy(inputs.k, inputs.block_table, page_size)
    inputs.v_pages = paged_copy(inputs.v, inputs.block_table, page_size)
    inputs.k = inputs.v = None
    _release()


def _build_pages(inputs: DecodeInputs, workload: DecodeWorkload, seed: int) -> Optional[str]:
    """:func:`add_pages`, or why it could not (out of memory, most likely); then the contiguous cache is kept and
    nothing half-built is left for the paged contenders."""
    try:
        add_pages(inputs, workload, seed)
    except Exception as error:  # noqa: BLE001 - recorded in the paged rows
        inputs.k_pages = inputs.v_pages = inputs.block_table = None
        _release()
        return f"could not build the paged cache: {error_line(error)}"
    return None


def check_slice_indices(B: int, H: int, Lk: int, D: int) -> tuple:
    """(sequences, heads) whose outputs the check compares with the float64 reference: the first and the last
    sequence (a batch-stride mistake shows in the last), every head while the slice's K is at most 2^24 elements,
    else heads 0, 1, H/2, H-1 (a query head reading the wrong KV head shows in them for every Hk > 1); the first
    sequence alone beyond 2^26 elements (the reference and the check's floors hold several float64 copies)."""
    sequences = [0] if B == 1 else [0, B - 1]
    heads = list(range(H))
    if len(sequences) * H * Lk * D > CHECK_ALL_HEADS:
        heads = sorted({0, 1, H // 2, H - 1} & set(heads))
    if len(sequences) * len(heads) * Lk * D > CHECK_MAX:
        sequences = [0]
    return sequences, heads


@dataclass
class _CheckSlice:
    sequences: list
    heads: list
    q: object  # (S, n, 1, D): the slice as the attention problem wb.check takes, KV heads repeated
    k: object  # (S, n, Lk, D)
    v: object
    ref: tuple  # float64 (out, lse) of the slice

    def describe(self) -> str:
        return f"sequences {self.sequences}, heads {self.heads if len(self.heads) < 8 else 'all'}"


def _make_check_slice(inputs: DecodeInputs, workload: DecodeWorkload) -> _CheckSlice:
    import torch

    sequences, heads = check_slice_indices(workload.B, workload.H, workload.Lk, workload.D)
    device = inputs.q.device
    b = torch.tensor(sequences, device=device)[:, None]
    h = torch.tensor(heads, device=device)[None, :]
    kv = h // (workload.H // workload.Hk)  # query head h reads KV head h // (H / Hk)
    q, k, v = inputs.q[b, h][:, :, None], inputs.k[b, kv], inputs.v[b, kv]
    return _CheckSlice(sequences, heads, q, k, v, torch_reference(q, k, v, False))


def _check(name: str, out_bhd, piece: _CheckSlice):
    from ..check import check

    out = out_bhd[piece.sequences][:, piece.heads][:, :, None]
    return check(name, out, piece.q, piece.k, piece.v, ref=piece.ref, verbose=False, raise_on_failure=False)


# ----------------------------------------------------------------------------------------------
# Contenders
# ----------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class DecodeContender:
    """Something timed on a decode workload. ``prepare(inputs, layout, workload)`` does the untimed setup and returns
    ``(call, as_bhd)``: the timed zero-argument call, and a function turning its result into the output (B, H, D) for
    the check (None: nothing to check, the copy)."""

    name: str
    kind: str  # "stage" (this package), "baseline" (PyTorch), "ceiling" (the copy)
    what: str  # the timed call, in one line (stored in the results file)
    prepare: Callable
    layouts: tuple = ("contiguous",)
    needs_gpu: bool = False
    unavailable: Optional[str] = None  # why it cannot run here at all


def _cache_args(inputs: DecodeInputs, layout: str) -> tuple:
    if layout == "paged":
        return inputs.k_pages, inputs.v_pages, inputs.block_table
    return inputs.k, inputs.v, None


def _wb_decode_prepare(inputs, layout, workload):
    import wb_kernels as wb

    k, v, table = _cache_args(inputs, layout)
    return (lambda: wb.decode(inputs.q, k, v, inputs.seqlens, block_table=table, max_seqlen=workload.Lk)), None


def _decode_forward_prepare(inputs, layout, workload):
    from ..device import like_input
    from ..stages.decode import decode_forward  # the rung's export, not its launcher module

    k, v, table = _cache_args(inputs, layout)
    # like_input: on the simulator the kernels return NumPy; on a GPU the CUDA tensor comes back as it is
    return (lambda: like_input(decode_forward(inputs.q, k, v, inputs.seqlens, block_table=table,
                                              max_seqlen=workload.Lk)[0], inputs.q)), None


def _sdpa_prepare(backend_name: Optional[str]):
    def prepare(inputs, layout, workload):
        # q (B, H, 1, D): one query per sequence and head; the contiguous cache (B, Hk, Lk, D)
        call = sdpa_call(inputs.q[:, :, None], inputs.k, inputs.v, backend_name, enable_gqa=True)
        return call, (lambda out: out[:, :, 0])

    return prepare


def _flex_prepare(inputs, layout, workload):
    """FlexAttention as its decoding examples run it: compiled for this shape (dynamo reset first, as in the attention
    presets: past its recompile limit it would fall back to an unfused version), the compilation paid here."""
    import torch
    from torch.nn.attention.flex_attention import flex_attention

    torch._dynamo.reset()
    compiled = torch.compile(flex_attention, dynamic=False, fullgraph=True)
    q = inputs.q[:, :, None]
    k, v = inputs.k, inputs.v

    def call():
        return compiled(q, k, v, enable_gqa=True)

    call()
    return call, (lambda out: out[:, :, 0])


def copy_prepare(inputs, layout, workload):
    """The ceiling: K and V copied, one after the other, into one buffer of K's size (half the cache's memory, not
    all of it, as the largest workloads need the rest).

    Counted as (what it reads + what it writes) / time, 2 * the K and V bytes over its median. Why that, and not its
    reads alone: a device's memory moves bytes in either direction at one shared rate, so the copy keeps it as busy
    as a stream of reads would; counting only its reads would put the ceiling at half of what the memory delivers,
    and every decode kernel above it. Why a copy and not a read-only kernel (``k.sum()``): the copy is the simplest
    kernel there is, and what the other presets' roofline is drawn against (``measure_ceilings``' copy_gbps); how
    close a reduction comes to the memory's rate is a property of torch's reduction. Pure reads may run a few percent
    above a copy (no turnarounds between reading and writing): a fraction a little above 1 is "at the ceiling".
    Two launches, as the split-KV decode has two kernels: at the small sizes the launches are part of the ceiling.
    """
    import torch

    target = torch.empty_like(inputs.k)

    def call():
        target.copy_(inputs.k)
        target.copy_(inputs.v)
        return target

    return call, None


_SDPA_BACKENDS = (("sdpa", None), ("sdpa-flash", "FLASH_ATTENTION"), ("sdpa-efficient", "EFFICIENT_ATTENTION"),
                  ("sdpa-cudnn", "CUDNN_ATTENTION"), ("sdpa-math", "MATH"))


def decode_contenders() -> dict:
    """{name: DecodeContender}, in the order each workload runs them."""
    both = ("contiguous", "paged")
    table = {
        "wb.decode": DecodeContender("wb.decode", "stage", "wb.decode(q, k, v, cache_seqlens, block_table=..., "
                                     "max_seqlen=Lk): the user's call, validation included", _wb_decode_prepare, both),
        "decode_forward": DecodeContender("decode_forward", "stage", "wb_kernels.stages.decode.launcher.decode_forward"
                                          "(same arguments): launcher and kernels, no validation",
                                          _decode_forward_prepare, both),
    }
    for name, backend in _SDPA_BACKENDS:
        table[name] = DecodeContender(name, "baseline", "scaled_dot_product_attention(q (B, H, 1, D), k, v (B, Hk, Lk, "
                                      f"D), enable_gqa=True), {'forced to ' + backend if backend else 'PyTorch picks'}",
                                      _sdpa_prepare(backend))
    table["flex"] = DecodeContender("flex", "baseline", "flex_attention(q (B, H, 1, D), k, v, enable_gqa=True), "
                                    "compiled for the shape", _flex_prepare, needs_gpu=True,
                                    unavailable=flex_problem())
    # FlashInfer's batch decode on the same paged pools (HND layout) as wb.decode: its CUDA-core kernel, and its
    # tensor-core one (use_tensor_cores=True, which its documentation recommends for large GQA groups)
    for name, tensor_cores in (("flashinfer", False), ("flashinfer-tc", True)):
        table[name] = DecodeContender(name, "baseline", "flashinfer.BatchDecodeWithPagedKVCacheWrapper(workspace, "
                                      f"'HND', use_tensor_cores={tensor_cores}).run(q, (k_pages, v_pages)), planned "
                                      "once outside the timing: the paged cache that wb.decode reads",
                                      flashinfer.decode_prepare(tensor_cores), layouts=("paged",), needs_gpu=True,
                                      unavailable=flashinfer.problem())
    table["copy"] = DecodeContender("copy", "ceiling", "dst.copy_(k); dst.copy_(v): the ceiling, counted as read + "
                                    "write", copy_prepare)
    return table


def _stage_refusal(workload: DecodeWorkload, on_cuda: bool) -> Optional[str]:
    """Why the decode stage does not take this workload (dtype, head dim), or None. On a GPU wb.decode runs the CUDA
    kernel for its dtypes and head dims (bfloat16 too), whatever the numba stage's Stage.dtypes say."""
    from ..stages import get_stage
    from ..stages.decode import CUDA_KERNEL_DTYPES, CUDA_KERNEL_HEAD_DIMS

    if on_cuda and workload.dtype in CUDA_KERNEL_DTYPES and workload.D in CUDA_KERNEL_HEAD_DIMS:
        return None
    stage = get_stage("decode")
    if workload.dtype not in stage.dtypes:
        return (f"the decode stage takes {', '.join(stage.dtypes)} (its Stage.dtypes), not {workload.dtype}: "
                "not measured")
    if stage.head_dims is not None and workload.D not in stage.head_dims:
        return f"the decode stage takes D in {list(stage.head_dims)}, not {workload.D}"
    return None


def refusal(contender: DecodeContender, workload: DecodeWorkload, on_cuda: bool) -> Optional[str]:
    """Why `contender` is not run on `workload` here (recorded as a skipped row), or None."""
    if contender.unavailable:
        return contender.unavailable
    if contender.needs_gpu and not on_cuda:
        return f"{contender.name} {NEEDS_GPU}"
    if contender.kind == "stage":
        return _stage_refusal(workload, on_cuda)
    if contender.name.startswith("flashinfer") and (workload.dtype not in ("float16", "bfloat16")
                                                    or workload.D not in (64, 128, 256)):
        return (f"flashinfer's decode kernels take float16 and bfloat16 at D 64, 128 or 256, not {workload.dtype} "
                f"at D {workload.D}")
    if contender.name == "sdpa-math":
        math_cache = workload.kv_bytes * workload.H // workload.Hk
        if math_cache > MATH_MAX_BYTES:
            return (f"not run: MATH repeats K and V to the H={workload.H} query heads ({math_cache / 2**30:.1f} GiB) "
                    f"and is timed only up to {MATH_MAX_BYTES / 2**30:.0f} GiB, to keep the run short")
    return None


def memory_refusal(workload: DecodeWorkload, paged: bool, free_bytes: Optional[int]) -> Optional[str]:
    """Why the workload does not fit in `free_bytes` of device memory (None: it fits, or nothing to check).

    At its peak a workload holds the contiguous cache and the pools built from it (paged), or the cache and the
    copy's target of half its size (contiguous only), and the check's slice and the kernels' workspace."""
    if free_bytes is None:
        return None
    need = workload.kv_bytes * (2.0 if paged else 1.5) + MEMORY_SLACK
    if need <= free_bytes:
        return None
    return (f"does not fit: K and V take {workload.kv_bytes / 2**30:.1f} GiB, and with "
            f"{'the paged pools built from them' if paged else 'the copy ceiling target'} the run needs about "
            f"{need / 2**30:.0f} GiB; {free_bytes / 2**30:.1f} GiB of the GPU's memory are free")


def _release() -> None:
    """Give the device memory of dropped tensors back (a garbage collection, then torch's cache emptied): between
    measurements on a GPU, where the next workload may need all of it; nothing to give back off a GPU."""
    if tensor_device() == "cuda":
        free_device_memory()


def _free_bytes(on_cuda: bool) -> Optional[int]:
    if not on_cuda:
        return None  # tiny workloads only off a GPU (the decode and decode-bar presets are refused there)
    import torch

    _release()
    return int(torch.cuda.mem_get_info()[0])


# ----------------------------------------------------------------------------------------------
# The plan, and what it costs
# ----------------------------------------------------------------------------------------------

def _is_bar(workload: DecodeWorkload) -> bool:
    return (workload.B, workload.H, workload.Hk, workload.Lk, workload.D, workload.dtype) in DECODE_BAR


def plan_decode(workloads, table: dict) -> list:
    """[(workload, contender, layout)]: the bar shapes first, then the figure's shapes, then the rest from the smallest
    cache up (a run stopped by --time-budget has the most important rows, and the most rows); within a workload the
    contiguous cache's contenders, then the paged ones (the contiguous cache is dropped before them)."""
    ordered = sorted(dict.fromkeys(workloads), key=lambda w: (not _is_bar(w), not w.flex, w.kv_bytes))
    jobs = []
    for workload in ordered:
        for layout in ("contiguous", "paged"):
            for contender in table.values():
                if layout not in contender.layouts or (contender.name == "flex" and not workload.flex):
                    continue
                jobs.append((workload, contender, layout))
    return jobs


# Rough rates for the estimate of the run time on an H100 (3.35 TB/s peak, ~2.9 TB/s copies): fractions of the copy's
# rate, guessed on the slow side for kernels not measured yet (the numba split-KV kernel; MATH).
_GUESSED_FRACTION = {"copy": 1.0, "wb.decode": 0.3, "decode_forward": 0.3, "sdpa-math": 0.05, "sdpa-efficient": 0.4}


def estimate_seconds(jobs, policy: TimingPolicy, bandwidth: float = 2.9e12) -> float:
    """About how long `jobs` take on an H100: each measurement's calls (first call, estimate, warm-up, repeats)
    at a guessed rate, a fixed cost for the check and the bookkeeping, FlexAttention's compilation, the inputs, the
    numba kernels' first compilation, the ceilings and the per-call overhead. A plan, not a measurement."""
    total = 5.0 + 15.0  # the matmul and copy ceilings; the per-call overhead rows
    workloads = {}
    for workload, contender, layout in jobs:
        workloads.setdefault(workload, set()).add(layout)
        seconds = workload.kv_bytes / (bandwidth * _GUESSED_FRACTION.get(contender.name, 0.6)) + 30e-6
        if contender.name == "copy":
            seconds *= 2  # it writes what it reads
        repeats = max(policy.min_repeats, min(policy.max_repeats, math.ceil(policy.seconds / seconds)))
        total += 0.05 + seconds * (2 + policy.warmup + repeats) + repeats * 150e-6  # + L2 flush and events
        total += 10.0 if contender.name == "flex" else 0.0
    for workload, layouts in workloads.items():
        total += 3 * workload.kv_bytes / 1e12 * (2 if "paged" in layouts else 1)  # draw, and build the pools
        total += 0.5  # the reference of the check's slice; memory given back between workloads
    total += 5.0 * len({(w.D, w.dtype) for w in workloads})  # numba compiles the kernels per D and dtype
    return total


# ----------------------------------------------------------------------------------------------
# One measurement
# ----------------------------------------------------------------------------------------------

def _warning_lines(caught) -> list:
    """What PyTorch warned while refusing (SDPA says why each backend does not take the inputs)."""
    lines = []
    for item in caught:
        text = " ".join(str(item.message).split())
        if text and text not in lines:
            lines.append(text[:200])
    return lines[:4]


def _base_record(contender: DecodeContender, workload: DecodeWorkload, layout: str) -> dict:
    w = workload
    record = {"key": decode_record_key(contender.name, layout, w), "contender": contender.name,
              "kind": contender.kind, "layout": layout, "dtype": w.dtype, "B": w.B, "H": w.H, "Hk": w.Hk, "Lq": 1,
              "Lk": w.Lk, "D": w.D, "kv_bytes": w.kv_bytes}
    if layout == "paged":
        record["page_size"] = DECODE_PAGE_SIZE
    return record


def measure_one(contender: DecodeContender, workload: DecodeWorkload, layout: str, inputs: DecodeInputs,
                piece: _CheckSlice, policy: TimingPolicy) -> dict:
    """Check, then time, one contender on one workload and layout. Never raises for the contender's own failures:
    they become status "skipped" (refused, out of memory) or "failed", with the reason."""
    from ..timing import peak_memory

    record = _base_record(contender, workload, layout)
    caught = []
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            call, as_bhd = contender.prepare(inputs, layout, workload)
            result, memory = peak_memory(call)
    except Exception as error:  # noqa: BLE001 - recorded, the run goes on
        # (flashinfer's CUDA-core decode has kernels for GQA groups up to 8 query heads: MQA's 32 is refused)
        refused = is_refusal(error, "unsupported group_size")
        said = _warning_lines(caught)
        # (a library's message may name its cache under the home folder: shown as ~, as the build messages do)
        record.update(status="skipped" if refused else "failed",
                      reason=(error_line(error) + (f" [warnings: {' | '.join(said)}]" if said else "")).replace(
                          str(Path.home()) + "/", "~/"))
        _release()
        return record
    record.update(peak_bytes=int(memory.peak_bytes), peak_device=memory.device)
    if contender.kind != "ceiling":
        try:  # an output of the wrong shape or kind fails the check with an exception: the record says which
            verdict = _check(contender.name, as_bhd(result) if as_bhd is not None else result, piece)
        except Exception as error:  # noqa: BLE001 - recorded, the run goes on
            record.update(status="failed", reason=f"check: {error_line(error)}")
            _release()
            return record
        record["check"] = {"max_err": round_significant(verdict.max_err, 3), "tol": round_significant(verdict.tol, 3),
                           "passed": verdict.passed, "line": verdict.line(), "slice": piece.describe()}
        if not verdict.passed:
            if contender.kind == "stage" and not policy.time_failed_checks:
                record.update(status="failed", reason=f"check: {verdict.line()}")
                _release()
                return record
            record["check_failed"] = True
            record["note"] = f"{contender.kind} outside the check tolerance; timed anyway"
    del result
    timing = time_into(record, call, policy)
    if timing is None:
        return record
    moved = workload.kv_bytes * (2 if contender.kind == "ceiling" else 1)
    record["gbps"] = round_significant(moved / (timing.median_ms / 1e3) / 1e9)
    return record  # what it allocated goes back to torch's cache with `call`, for the next contender's use


def add_decode_ratios(results: dict) -> dict:
    """For every timed record: ``fraction_of_copy`` (its gbps over the copy's on the same workload) and
    ``vs_best_sdpa`` (the fastest SDPA backend whose output passed the check: its median / this one's); for the
    stages also ``vs_best_peer`` (the same against the fastest baseline of any kind and layout: SDPA, FlexAttention,
    FlashInfer)."""
    groups = {}
    for r in results["records"]:
        if r.get("status") == "ok":
            groups.setdefault(r["key"].split("|", 2)[2], []).append(r)
    for group in groups.values():
        copy = next((r for r in group if r["kind"] == "ceiling"), None)
        sdpa = [r for r in group if r["contender"].startswith("sdpa") and not r.get("check_failed")]
        best = min(sdpa, key=lambda r: r["median_ms"]) if sdpa else None
        peers = [r for r in group if r["kind"] == "baseline" and not r.get("check_failed")]
        best_peer = min(peers, key=lambda r: r["median_ms"]) if peers else None
        for r in group:
            if copy is not None:
                r["fraction_of_copy"] = round_significant(r["gbps"] / copy["gbps"], 3)
            if best is not None and r["kind"] != "ceiling":
                r["vs_best_sdpa"] = {"backend": best["contender"], "ratio": round_significant(best["median_ms"] / r["median_ms"], 3)}
            if best_peer is not None and r["kind"] == "stage":
                r["vs_best_peer"] = {"peer": best_peer["contender"], "layout": best_peer["layout"],
                                     "ratio": round_significant(best_peer["median_ms"] / r["median_ms"], 3)}
    return results


# ----------------------------------------------------------------------------------------------
# Per-call overhead: wall time of back-to-back calls
# ----------------------------------------------------------------------------------------------

OVERHEAD_ATTENTION = (1, 16, 512, 64, "float16")  # B, H, L, D, dtype: the small public problem
OVERHEAD_STAGES = ("mma", "wmma")  # the fast attention stages
OVERHEAD_DECODE = DecodeWorkload(1, 32, 8, 1024, 128, "float16")


def per_call_seconds(call, *, calls: int = 200, batches: int = 5, warmup: int = 20) -> list:
    """Seconds per call of `calls` back-to-back calls, one sample per batch: the host's clock around the batch and
    one synchronisation at its end. Where the host is slower than the device, this is what a call costs the host
    (validation, allocation, launches); where the device is slower, the device's time."""
    from ..timing import synchronize

    for _ in range(warmup):
        call()
    synchronize()
    samples = []
    for _ in range(batches):
        start = time.perf_counter()
        for _ in range(calls):
            call()
        synchronize()
        samples.append((time.perf_counter() - start) / calls)
    return samples


def _overhead_row(name: str, problem: str, call, check, sdpa_us: Optional[float] = None,
                  policy: Optional[TimingPolicy] = None, **timing) -> dict:
    """One row: the call checked (`check` turns its result into a CheckResult), then its per-call wall time
    (:func:`per_call_seconds` with `timing`); beside SDPA's when `sdpa_us` is given. Ours (a `policy` given) is timed
    after a failed check only with time_failed_checks, as in the bandwidth rows; SDPA is timed and flagged."""
    row = {"name": name, "problem": problem}
    try:
        verdict = check(call())
        row["check"] = {"passed": verdict.passed, "line": verdict.line()}
        if not verdict.passed:
            if policy is not None and not policy.time_failed_checks:
                row.update(status="failed", reason=f"check: {verdict.line()}")
                return row
            row["check_failed"] = True
        samples = per_call_seconds(call, **timing)
    except Exception as error:  # noqa: BLE001 - recorded, the run goes on
        row.update(status="failed", reason=error_line(error))
        return row
    row.update(status="ok", per_call_us=round_significant(statistics.median(samples) * 1e6, 4),
               samples_us=[round_significant(s * 1e6, 4) for s in samples])
    if sdpa_us:
        row.update(sdpa_per_call_us=sdpa_us, ratio_to_sdpa=round_significant(row["per_call_us"] / sdpa_us, 3), bar=OVERHEAD_BAR,
                   meets_bar=row["per_call_us"] <= OVERHEAD_BAR * sdpa_us)
    return row


def _overhead_plan(attention=OVERHEAD_ATTENTION, workload=OVERHEAD_DECODE) -> list:
    B, H, L, D, dtype = attention
    w = workload
    attention = f"B{B} H{H} L{L} D{D} {dtype}"
    decode = f"B{w.B} H{w.H} Hk{w.Hk} Lk{w.Lk} D{w.D} {w.dtype}, contiguous"
    return ([("sdpa", attention)] + [(f"wb.attention(stage={s!r})", attention) for s in OVERHEAD_STAGES]
            + [("sdpa", decode), ("wb.decode", decode), ("decode_forward", decode)])


def measure_overhead(seed: int = 0, policy: Optional[TimingPolicy] = None, *, device: Optional[str] = None,
                     attention=OVERHEAD_ATTENTION, workload: DecodeWorkload = OVERHEAD_DECODE, **timing) -> dict:
    """Per-call wall time of the fast attention stages through ``wb.attention`` and of ``wb.decode`` (and its kernel
    path alone), each beside SDPA's on the same problem (`attention`: B, H, L, D, dtype; `workload`). On the GPU by
    default, and off one the rows say why they were not measured; `device` runs them there anyway (the tests, on the
    CPU, with problems small enough for the simulator; `timing` goes to :func:`per_call_seconds`)."""
    import torch.nn.functional as F

    import wb_kernels as wb

    from ..check import check
    from ..inputs import random_qkv
    from ..stages import available_stages
    from .measure import reference_first_head

    plan = iter(_overhead_plan(attention, workload))
    if device is None:
        if tensor_device() != "cuda":
            return {"rows": [{"name": name, "problem": problem, "status": "skipped", "reason": "wall-clock overhead "
                              f"of GPU launches: {NEEDS_GPU}"} for name, problem in plan]}
        device = "cuda"
    rows = []
    B, H, L, D, dtype = attention
    q, k, v = random_qkv(B, H, L, D, dtype=dtype, framework="torch", device=device, seed=seed)
    ref = reference_first_head(q, k, v, False)

    def check_attention(name):
        return lambda out: check(name, out[:1, :1], q[:1, :1], k[:1, :1], v[:1, :1], ref=ref, verbose=False,
                                 raise_on_failure=False)

    name, problem = next(plan)
    rows.append(_overhead_row(name, problem, lambda: F.scaled_dot_product_attention(q, k, v), check_attention(name),
                              **timing))
    sdpa_us = rows[-1].get("per_call_us")
    for stage in OVERHEAD_STAGES:
        name, problem = next(plan)
        if stage not in available_stages():
            rows.append({"name": name, "problem": problem, "status": "skipped",
                         "reason": f"stage {stage!r} is not registered in this checkout"})
            continue
        rows.append(_overhead_row(name, problem, lambda stage=stage: wb.attention(q, k, v, stage=stage),
                                  check_attention(name), sdpa_us, policy or TimingPolicy(), **timing))

    inputs = make_inputs(workload, seed, device)
    piece = _make_check_slice(inputs, workload)
    table = decode_contenders()
    name, problem = next(plan)
    call, as_bhd = table["sdpa"].prepare(inputs, "contiguous", workload)
    rows.append(_overhead_row(name, problem, call, lambda out: _check(name, as_bhd(out), piece), **timing))
    sdpa_us = rows[-1].get("per_call_us")
    for contender in ("wb.decode", "decode_forward"):
        name, problem = next(plan)
        refused = _stage_refusal(workload, device == "cuda")
        if refused:
            rows.append({"name": name, "problem": problem, "status": "skipped", "reason": refused})
            continue
        call, _ = table[contender].prepare(inputs, "contiguous", workload)
        rows.append(_overhead_row(name, problem, call, lambda out, name=name: _check(name, out, piece), sdpa_us,
                                  policy or TimingPolicy(), **timing))
    inputs = piece = None
    _release()
    return {"rows": rows}


# ----------------------------------------------------------------------------------------------
# The run
# ----------------------------------------------------------------------------------------------

def default_decode_output(on_cuda: bool) -> Path:
    """results/decode/bench_<gpu>.json (h100, h200, ...: the name the tuning files use), or simulator_smoke.json."""
    return gpu_results_path("decode", "bench", on_cuda=on_cuda, smoke_name="simulator_smoke.json")


def run_decode(workloads, out_path, *, presets=("decode",), policy: Optional[TimingPolicy] = None,
               resume: bool = True, seed: int = 0, progress: bool = True, time_budget: Optional[float] = None,
               overhead: bool = True, ceilings: bool = True, table: Optional[dict] = None,
               command: Optional[str] = None, retake_slowed: bool = False, log=print) -> dict:
    """Run the decode `workloads` into the JSON file `out_path` (resumed unless resume=False); return the results.
    `retake_slowed`: drop the records of a resumed file whose samples a burst slowed (:func:`measure.slowed_samples`),
    so that they are measured again."""
    from ..widgets import progress as show_progress

    started = time.monotonic()
    policy = policy or TimingPolicy()
    table = table if table is not None else decode_contenders()
    on_cuda = tensor_device() == "cuda"
    device = "cuda" if on_cuda else "cpu"
    out_path = Path(out_path)
    results = open_results(out_path, list(presets), resume=resume, command=command, kind="decode", fresh=_new_decode)
    stamp_timing(results, policy, out_path)
    results["contenders"] = {name: c.what for name, c in table.items()}
    if retake_slowed:
        kept, slowed = [], []
        for record in results["records"]:
            (slowed if was_slowed(record) else kept).append(record)
        results["records"] = kept
        slowed = [r["key"] for r in slowed]
        log(f"{len(slowed)} records a burst slowed are measured again" + (f": {', '.join(slowed)}" if slowed else ""))
    jobs = plan_decode(workloads, table)
    done = {r["key"] for r in results["records"]}
    todo = [job for job in jobs if decode_record_key(job[1].name, job[2], job[0]) not in done]
    log(f"{len(jobs)} decode measurements planned, {len(jobs) - len(todo)} already in {out_path}, {len(todo)} to run "
        f"on {results['environment']['device']}"
        + (f" (about {estimate_seconds(todo, policy) / 60:.0f} min on an H100)" if on_cuda else ""))

    if on_cuda and ceilings and results.get("ceilings") is None:
        log("measuring the ceilings (fp16/bf16/fp32 matmul, copy)")
        results["ceilings"] = measure_ceilings()
        save_results(results, out_path)
    if overhead and results.get("overhead") is None:
        log("measuring the per-call overhead (wall time of back-to-back calls)")
        results["overhead"] = measure_overhead(seed, policy)
        save_results(results, out_path)

    by_workload = {}
    for workload, contender, layout in todo:
        by_workload.setdefault(workload, []).append((contender, layout))
    stopped = False
    for workload, group in show_progress(list(by_workload.items()), description="decode", unit="workloads",
                                         disable=not progress):
        if time_budget is not None and time.monotonic() - started > time_budget:
            stopped = True
            break
        stopped = _run_workload(workload, group, results, out_path, policy, seed, device, on_cuda, time_budget,
                                started, log)
        if stopped:
            break
    add_decode_ratios(results)
    return finish_results(results, out_path, stopped=stopped, time_budget=time_budget, log=log)


def _new_decode(presets, command) -> dict:
    return {**new_results(presets, command), "kind": "decode", "notes": DECODE_NOTES, "overhead": None}


def _run_workload(workload, group, results, out_path, policy, seed, device, on_cuda, time_budget, started,
                  log) -> bool:
    """Measure one workload's remaining (contender, layout) pairs; True when the time budget stopped it."""
    # the presets of this run that hold the workload (all of them for workloads passed in by hand)
    asked = results["presets"]
    presets = [name for name in asked if workload in DECODE_PRESETS.get(name, ())] or list(asked)

    def store(entry):
        store_record(results, dict(entry, presets=presets), out_path, log, add_decode_ratios)

    def record(contender, layout, **fields):
        store({**_base_record(contender, workload, layout), **fields})

    runnable = []
    for contender, layout in group:
        why = refusal(contender, workload, on_cuda)
        if why:
            record(contender, layout, status="skipped", reason=why)
        else:
            runnable.append((contender, layout))
    if not runnable:
        return False
    paged = any(layout == "paged" for _, layout in runnable)
    why = memory_refusal(workload, paged, _free_bytes(on_cuda))
    inputs = piece = None
    if why is None:
        try:
            inputs = make_inputs(workload, seed, device)
            piece = _make_check_slice(inputs, workload)
        except Exception as error:  # noqa: BLE001 - out of memory, most likely: recorded for each contender
            why = f"could not build the inputs: {error_line(error)}"
    if why is not None:
        for contender, layout in runnable:
            record(contender, layout, status="skipped", reason=why)
        inputs = piece = None
        _release()
        return False
    stopped = False
    for contender, layout in runnable:
        if time_budget is not None and time.monotonic() - started > time_budget:
            stopped = True
            break
        if layout == "paged" and inputs.k_pages is None:
            why = _build_pages(inputs, workload, seed)
            if why is not None:
                record(contender, layout, status="skipped", reason=why)
                continue
        store(measure_one(contender, workload, layout, inputs, piece, policy))
    inputs = piece = None
    _release()
    return stopped
