"""Launching the split-KV kernels, the paged-cache helpers and the stage's registration (lesson 07).

Two ways in:

- ``wb.decode(q, k_cache, v_cache, cache_seqlens, block_table=...)`` (:func:`wb_kernels.api.decode`): one new query per
  sequence against a cache, contiguous (B, Hk, L, D) or paged (num_pages, Hk, page_size, D) with a block table, as
  serving engines keep it;
- ``wb.attention(q, k, v, stage="decode")``: any (B, H, Lq, D) problem, so that the benchmark and the property tests
  treat the rung like every other. k and v are then a contiguous cache with every sequence full.

Both end in :func:`split_kv_forward`, which picks the number of splits (``splitkv.choose_num_splits``), launches the
partial kernel and the merge, and returns float32 ``(out, lse)`` where the kernels ran.
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass

import numpy as np

from ...backend import BACKEND
from ...device import empty, is_torch, kernel_view, to_work
from . import build
from .kernel import (CAUSAL_BOTTOM_RIGHT, CAUSAL_NONE, CAUSAL_TOP_LEFT, config_for, get_partial_kernel,
                     merge_kernel)
from ..naive.kernel import check_grid
from .splitkv import choose_num_splits, split_bounds

__all__ = ["split_kv_forward", "forward", "decode_forward", "cuda_decode_forward", "check_cache_layout", "cuda_blocks_per_sm", "cuda_row_chunks", "cuda_kernel_for", "MMA_MIN_GROUP", "MMA_MAX_GROUP", "decode_bytes", "DecodeBytes", "uses_cuda_kernel", "CUDA_KERNEL_DTYPES", "CUDA_KERNEL_HEAD_DIMS", "contiguous_as_paged", "gather_pages", "num_sms", "CAUSAL_MODES", "status_buffer", "read_status", "STATUS_MESSAGES"]

CAUSAL_MODES = {None: CAUSAL_NONE, False: CAUSAL_NONE, True: CAUSAL_TOP_LEFT, "top_left": CAUSAL_TOP_LEFT,
                "bottom_right": CAUSAL_BOTTOM_RIGHT}
_SIMULATOR_SMS = 4  # the simulator has no SMs; a small number keeps its grids (and its run time) small


@functools.lru_cache(maxsize=None)
def _sm_count(device_index: int) -> int:
    import torch

    return torch.cuda.get_device_properties(device_index).multi_processor_count


def num_sms() -> int:
    """Streaming multiprocessors of the GPU the kernels run on (a small stand-in on the simulator); asked once."""
    if BACKEND.is_simulator:
        return _SIMULATOR_SMS
    import torch

    return _sm_count(torch.cuda.current_device())


def contiguous_as_paged(batch: int, length: int):
    """The block table that makes a contiguous cache (B, Hk, L, D) a paged one: one page of L keys per sequence."""
    return np.arange(batch, dtype=np.int32)[:, None]


def gather_pages(pages, block_table, seq_len: int, b: int):
    """Sequence b's first `seq_len` keys from a paged pool (num_pages, Hk, page_size, D): (Hk, seq_len, D)."""
    page_size = pages.shape[2]
    used = [int(p) for p in block_table[b, :-(-seq_len // page_size)]]
    if is_torch(pages):
        import torch

        joined = torch.cat([pages[p] for p in used], dim=1) if used else pages[0, :, :0]
    else:
        joined = np.concatenate([pages[p] for p in used], axis=1) if used else pages[0, :, :0]
    return joined[:, :seq_len]


def _work(x):
    """A contiguous buffer where the kernels run, float16 kept (it halves what the cache costs to read)."""
    name = str(x.dtype).replace("torch.", "")
    return to_work(x, dtype=np.float16 if name == "float16" else np.float32)


def split_kv_forward(q, k_pages, v_pages, block_table, seq_lens, *, causal=False, key_padding_mask=None,
                     scale=None, num_splits=None, max_len=None, config=None, kernel=None, merge=None):
    """Split-KV attention of q (B, H, Lq, D) over a paged cache; returns float32 ``(out, lse)``.

    `block_table` (B, pages per sequence) and `seq_lens` (B,) are int32 (NumPy or torch); `causal` is False/True/
    "top_left"/"bottom_right"; `max_len` bounds the longest sequence (default: the block table's capacity), and
    with the GPU's SM count it sets the number of splits unless `num_splits` is given. `kernel` and `merge` let a
    lesson launch its own kernels (built by ``make_partial_kernel(D, config)``, and a ``merge_kernel``).
    """
    B, H, Lq, D = q.shape
    Hk, page_size = k_pages.shape[1], k_pages.shape[2]
    config = config or config_for()
    kernel = kernel or get_partial_kernel(D, config)
    merge = merge or merge_kernel
    scale = float(D) ** -0.5 if scale is None else float(scale)
    max_len = block_table.shape[1] * page_size if max_len is None else int(max_len)
    row_chunks = -(-(H // Hk) * Lq // config.rows)  # blocks per (sequence, KV head): the group's rows, in chunks
    if num_splits is None:
        num_splits = choose_num_splits(B, Hk, max_len, num_sms(), row_chunks=row_chunks)
    keys_per_split = max(1, split_bounds(max_len, num_splits)[0][1])  # the first split's size is every split's
    qw, kw, vw = _work(q), _work(k_pages), _work(v_pages)
    table = to_work(block_table, dtype=np.int32)
    lens = to_work(seq_lens, dtype=np.int32)
    keep = to_work(key_padding_mask, dtype=np.uint8) if key_padding_mask is not None else empty((1, 1), np.uint8)
    part_out = empty((num_splits, B, H, Lq, D))
    part_max = empty((num_splits, B, H, Lq))  # each split's largest score and its sum, apart (kernel.py says why)
    part_sum = empty((num_splits, B, H, Lq))
    # (sequence, KV head) in x, which allows 2**31 - 1 blocks; splits and row chunks in y and z, 65,535 each
    grid = (B * Hk, num_splits, row_chunks)
    check_grid("decode", grid, ("B*Hk", "num_splits", f"H/Hk * Lq / {config.rows}"))
    kernel[grid, config.threads](
        kernel_view(qw), kernel_view(kw), kernel_view(vw), kernel_view(table), kernel_view(lens), kernel_view(keep),
        int(key_padding_mask is not None), CAUSAL_MODES[causal],
        np.float32(scale), keys_per_split, kernel_view(part_out), kernel_view(part_max), kernel_view(part_sum))
    out = empty((B, H, Lq, D))
    lse = empty((B, H, Lq))
    merge[B * H * Lq, min(D, 128)](kernel_view(part_out), kernel_view(part_max), kernel_view(part_sum),
                                   kernel_view(out), kernel_view(lse))  # rows that saw no key: zeros and LSE -inf
    return out, lse


def forward(q, k, v, *, causal=False, key_padding_mask=None, scale=None, num_splits=None):
    """The stage's ``wb.attention`` entry: k, v (B, Hk, Lk, D) as a contiguous cache, every sequence full.

    One query per sequence without a mask (a decode step) runs the CUDA C++ kernel where :func:`uses_cuda_kernel`;
    everything else runs the numba kernels.
    """
    B, Lk = q.shape[0], k.shape[2]
    if q.shape[2] == 1 and not causal and key_padding_mask is None and uses_cuda_kernel(q):
        import torch

        lens = torch.full((B,), Lk, dtype=torch.int32, device=q.device)  # every sequence full
        out, lse = cuda_decode_forward(q[:, :, 0], k, v, lens, scale=scale, num_splits=num_splits, max_seqlen=Lk)
        return out[:, :, None], lse[:, :, None]
    table = contiguous_as_paged(B, Lk)
    lens = np.full(B, Lk, dtype=np.int32)
    return split_kv_forward(q, k, v, table, lens, causal=causal, key_padding_mask=key_padding_mask, scale=scale,
                            num_splits=num_splits, max_len=Lk)


CUDA_KERNEL_DTYPES = ("float16", "bfloat16")  # what the CUDA decode kernels are built for
CUDA_KERNEL_HEAD_DIMS = (64, 128)


def uses_cuda_kernel(q) -> bool:
    """Whether wb.decode runs the CUDA C++ kernels (decode_host.cu) for this q: a GPU, 16-bit data, D 64 or 128."""
    if not (BACKEND.is_gpu and is_torch(q) and q.is_cuda):
        return False
    return str(q.dtype).removeprefix("torch.") in CUDA_KERNEL_DTYPES and q.shape[-1] in CUDA_KERNEL_HEAD_DIMS


_STATUS: dict = {}  # CUDA device index -> its int32 flags (see read_status), made once and never freed

# The flags the CUDA kernel raises (bits of the status word), and what each tells the user to do
STATUS_MESSAGES = {
    1: "a length in cache_seqlens was outside [0, the cache's capacity]: the kernel clamped it to the cache; fix the "
       "lengths (or the cache's size) you pass",
    2: "a length in cache_seqlens was above max_seqlen (more keys than the splits cover): the last split read the "
       "rest, correct but slower; pass a larger max_seqlen (wb.seqlen_bucket) or None",
    4: "a page number in block_table was outside [0, the number of pages in the cache): the kernel read the nearest "
       "page instead, so that sequence's output is wrong; fix the block table",
}


def status_buffer(device_index: int):
    """The int32 word of flags that the CUDA kernel ORs into on GPU `device_index` (STATUS_MESSAGES), made at the
    first call and kept for the process, so that a captured graph's pointer to it stays valid."""
    flags = _STATUS.get(device_index)
    if flags is None:
        import torch

        flags = _STATUS[device_index] = torch.zeros(1, dtype=torch.int32, device=torch.device("cuda", device_index))
    return flags


def read_status(device=None, *, reset: bool = True) -> list:
    """The flags raised on `device` since the last reset, as STATUS_MESSAGES' sentences (synchronises with it)."""
    if not BACKEND.is_gpu:
        return []
    import torch

    index = torch.cuda.current_device() if device is None else torch.device(device).index
    index = torch.cuda.current_device() if index is None else index
    flags = _STATUS.get(index)
    if flags is None:
        return []
    word = int(flags.item())
    if reset and word:
        flags.zero_()
    return [message for bit, message in STATUS_MESSAGES.items() if word & bit]


def cuda_split_plan(max_len: int, num_splits: int) -> tuple:
    """``(keys_per_split, num_splits)`` the CUDA kernel runs for `num_splits` asked: each split a whole number of
    the kernel's trips round its loop (``build.KEYS_PER_STEP``), and as many splits as that takes to cover
    `max_len` keys (rounding up may leave fewer than asked)."""
    step = build.KEYS_PER_STEP
    keys_per_split = max(step, -(-max(1, -(-max_len // num_splits)) // step) * step)
    return keys_per_split, (max(1, -(-max_len // keys_per_split)) if max_len else 1)


# Which CUDA kernel runs a group of H / Hk query heads per KV head. The split kernel holds up to 4 of them per block
# (registers), so a larger group takes ceil(group / 4) blocks per (sequence, KV head, split), each reading the split's
# keys: from a group of 5 on, K and V are asked for twice or more (decode_bytes). The tensor-core kernel
# (decode_mma_kernel) holds up to 64 in one block, reading them once. MMA_MIN_GROUP: the smallest group it takes; 5 is
# the bytes' answer (the first group the split kernel reads twice), to be confirmed on a GPU (the
# WB_DECODE_MMA_MIN_GROUP environment variable or this attribute change it; the launch plans remember the kernel).
MMA_MIN_GROUP = int(os.environ.get("WB_DECODE_MMA_MIN_GROUP", "5"))
MMA_MAX_GROUP = 64  # 4 row tiles of 16: decode_mma_kernel.cuh's kMmaMaxGroup
# the mma kernel's splits: at least one 64-key tile. (Two tiles until 2026-11-26; the H100's sweep of the 8-warp
# kernel, results/decode/mma_sweep_h100.json: MQA B1 Lk2048 ran 32 splits of 64 keys faster than 16 of 128)
MMA_MIN_KEYS_PER_SPLIT = 64
# The split kernel's: one trip of its block round the loop (KEYS_PER_STEP keys), not the NumPy model's 256: a short
# cache (a decoder's B = 1 step at 1k keys, 8 KV heads) otherwise gets 4 splits, 32 blocks on 132 SMs, and its time
# is the latency of 4 trips in a row (8.5 us a layer in the H100's profile of the decoder's step); the cost model
# (splitkv.choose_num_splits) still weighs each block's fixed cost
SPLIT_MIN_KEYS_PER_SPLIT = build.KEYS_PER_STEP
MMA_MAX_SPLITS = 128


def cuda_kernel_for(H: int, Hk: int, *, min_group: int | None = None) -> str:
    """``"mma"`` (the tensor-core kernel: the whole group in one block) or ``"split"`` (up to 4 query heads per
    block): which CUDA kernel ``wb.decode`` launches for H query heads on Hk KV heads."""
    group = H // Hk
    low = MMA_MIN_GROUP if min_group is None else min_group
    return "mma" if low <= group <= MMA_MAX_GROUP else "split"


@functools.lru_cache(maxsize=None)
def cuda_blocks_per_sm(device_index: int, bf16: bool, D: int, group: int, paged: bool = False,
                       kernel: str = "split") -> int:
    """Blocks of the CUDA kernel `kernel` (:func:`cuda_kernel_for`) for (dtype, D, group size, paged or contiguous
    cache) that one SM of GPU `device_index` holds at once: the CUDA runtime's occupancy calculation from the kernel's
    registers, shared memory and threads. The split kernel (compile report): 2 for groups of 4 and more at 128
    registers a thread; 3 for groups of 2 and 4 without grouping on a contiguous cache, 2 and 4 paged. The mma kernel
    (8 warps): its registers bound it, 1 at D = 128 (about 160 a thread) and 2 at D = 64. Asked once."""
    import torch

    with torch.cuda.device(device_index):
        extension = build.extension()
        count = extension.flash_decode_mma_blocks_per_sm if kernel == "mma" else extension.flash_decode_blocks_per_sm
        return int(count(bf16, D, group, paged))


def cuda_row_chunks(group: int) -> int:
    """Blocks per (sequence, KV head, split) of the CUDA split kernel for a group of `group` query heads:
    decode_host.cu's launch_rows puts 1, 2 or (for larger groups) 4 query heads in a block. (The mma kernel: 1.)"""
    rows = 1 if group == 1 else 2 if group == 2 else 4
    return -(-group // rows)


@dataclass(frozen=True)
class DecodeBytes:
    """What one decode call's blocks ask memory for (:func:`decode_bytes`), in bytes."""

    kernel: str  # "split" or "mma"
    blocks: int  # blocks of the launch: B * Hk * splits * blocks per (sequence, KV head, split)
    reads_per_key: int  # blocks that read each key: the split kernel's row chunks, 1 for the mma kernel
    kv_per_block: float  # K and V of one full split, as one block reads it
    kv_requested: float  # K and V summed over every block (a key read by several blocks counts each time)
    kv_unique: float  # K and V once: 2 * B * Hk * L * D * itemsize, what a kernel cannot avoid
    other: float  # q read, the splits' float32 partial results written and read back, the output written


def decode_bytes(B: int, H: int, Hk: int, L: int, D: int, itemsize: int, num_splits: int,
                 kernel: str) -> DecodeBytes:
    """The bytes a decode call of `kernel` ("split" or "mma") asks of memory at B sequences of L keys, H query heads
    on Hk KV heads, head dim D, `itemsize`-byte K and V, `num_splits` splits: per block and per call. The split kernel
    reads each split's keys once per chunk of 4 query heads (MQA with 32 heads: 8 times); the mma kernel once. What
    comes from L2 rather than HBM is the profiler's to tell (ncu's dram__bytes_read against lts__t_bytes)."""
    if kernel not in ("split", "mma"):
        raise ValueError(f"decode_bytes: kernel must be 'split' or 'mma', got {kernel!r}")
    group = H // Hk
    reads = cuda_row_chunks(group) if kernel == "split" else 1
    per_key = 2 * D * itemsize
    keys_per_split = -(-L // num_splits)
    unique = float(B * Hk * L * per_key)
    partials = 2.0 * num_splits * B * H * (D + 1) * 4 if num_splits > 1 else 0.0  # written, read by the merge
    return DecodeBytes(kernel=kernel, blocks=B * Hk * num_splits * reads, reads_per_key=reads,
                       kv_per_block=float(keys_per_split * per_key), kv_requested=unique * reads, kv_unique=unique,
                       other=float(2 * B * H * D * itemsize) + partials)


@functools.lru_cache(maxsize=4096)
def cuda_launch_plan(device_index: int, B: int, H: int, Hk: int, max_len: int, num_splits, D: int,
                      bf16: bool, paged: bool = False, kernel: str = "split") -> tuple:
    """What the CUDA kernel `kernel` runs for a problem: ``(keys_per_split, num_splits, default scale)``. Worked out
    once per problem shape and remembered: a decoder asks the same question for every layer of every step."""
    if num_splits is None:
        group = H // Hk
        # the mma kernel: one block per (sequence, KV head, split) whatever the group, so MQA at B = 1 has B * Hk = 1
        # block per split; shorter splits (two of its 64-key tiles) and more of them keep the SMs busy, and past 4 x 64
        # (row, split) pairs its splits are merged by the second kernel's B x H blocks, not one (decode_host.cu)
        shorter = ({"min_keys_per_split": MMA_MIN_KEYS_PER_SPLIT, "max_splits": MMA_MAX_SPLITS} if kernel == "mma"
                   else {"min_keys_per_split": SPLIT_MIN_KEYS_PER_SPLIT})
        num_splits = choose_num_splits(B, Hk, max_len, num_sms(),
                                       row_chunks=cuda_row_chunks(group) if kernel == "split" else 1,
                                       blocks_per_sm=cuda_blocks_per_sm(device_index, bf16, D, group, paged, kernel),
                                       keys_step=build.KEYS_PER_STEP, **shorter)
    return (*cuda_split_plan(max_len, num_splits), float(D) ** -0.5)


def check_cache_layout(k_cache, v_cache) -> None:
    """What the CUDA kernel can read in place, refused here with what was found (the extension checks the same, with
    messages that carry no numbers: formatting one there crashed the process on the H100 host). The kernel reads 8
    values (16 bytes) at a time and one offset per key serves k and v."""
    for name, cache in (("k_cache", k_cache), ("v_cache", v_cache)):
        strides, misaligned = tuple(cache.stride()), cache.data_ptr() % 16
        if strides[3] != 1 or any(s % 8 or s < 0 for s in strides[:3]) or misaligned:
            raise ValueError(f"wb.decode: the CUDA kernel reads the cache 8 values (16 bytes) at a time, so its head "
                             f"dim must be contiguous (stride 1), its other strides multiples of 8 and its data "
                             f"16-byte aligned; {name} has strides {strides} and data {misaligned} bytes past a "
                             f"multiple of 16. Allocate the cache once in that form (a fresh tensor is), rather than "
                             f"copying it every step")
    if tuple(k_cache.stride()) != tuple(v_cache.stride()):
        raise ValueError(f"wb.decode: k and v caches must have the same strides (one offset per key serves both); "
                         f"got {tuple(k_cache.stride())} and {tuple(v_cache.stride())}. Allocate both caches alike")
    span = (k_cache.shape[1] - 1) * k_cache.stride(1) + (k_cache.shape[2] - 1) * k_cache.stride(2) + k_cache.shape[3]
    if span > 2**31 - 1 or k_cache.stride(0) > 2**31 - 1:
        raise ValueError(f"wb.decode: one page of the cache (a sequence of a contiguous one) must span fewer than 2^31 "
                         f"elements; got shape {tuple(k_cache.shape)}, strides {tuple(k_cache.stride())}. Use a paged "
                         f"cache for longer ones")


def cuda_decode_forward(q, k_cache, v_cache, cache_seqlens, *, block_table=None, scale=None, num_splits=None,
                        max_seqlen=None):
    """The CUDA C++ split-KV kernel: q (B, H, D) -> ``(out (B, H, D) in q's dtype, lse (B, H) float32)``.

    Kept short, as it runs once per layer and token: the plan comes from :func:`cuda_launch_plan`'s memory, and the
    extension makes q contiguous and the lengths int32 on q's device itself (where that costs next to nothing). The
    caches are read through their strides (no copy); a contiguous cache needs no block table. Nothing here reads a
    value from the GPU or depends on the lengths' values, so the call can be captured in a CUDA graph.
    """
    import torch  # (already imported: the inputs are torch tensors; a dictionary lookup)

    B, H, D = q.shape
    device_index = q.get_device()
    if device_index not in _STATUS and torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
        # a first call inside a capture would make the status word from the graph's private pool, with a zero-fill
        # that every replay repeats, and load the extension while capturing
        raise ValueError("wb.decode's first call on a GPU cannot be inside a CUDA graph's capture: call it once "
                         "before capturing (a warm-up step, as torch.cuda.graphs' examples do)")
    capacity = (block_table.shape[1] if block_table is not None else 1) * k_cache.shape[2]
    max_len = capacity if max_seqlen is None else min(capacity, int(max_seqlen))
    kernel = cuda_kernel_for(H, k_cache.shape[1])
    keys_per_split, num_splits, default_scale = cuda_launch_plan(device_index, B, H, k_cache.shape[1], max_len,
                                                                  num_splits, D, q.dtype == torch.bfloat16,
                                                                  block_table is not None, kernel)
    if not _on_gpu(cache_seqlens) or (block_table is not None and not _on_gpu(block_table)):
        if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
            raise ValueError("wb.decode in a CUDA graph's capture: cache_seqlens and block_table must be on the GPU "
                             "(a copy from the host cannot be replayed); keep them in static GPU tensors and update "
                             "them in place between replays")
        if not is_torch(cache_seqlens):
            cache_seqlens = _torch_from_host(cache_seqlens)
        if block_table is not None and not is_torch(block_table):
            block_table = _torch_from_host(block_table)
    check_cache_layout(k_cache, v_cache)
    extension = build.extension()
    launch = extension.flash_decode_mma_forward if kernel == "mma" else extension.flash_decode_forward
    return launch(q, k_cache, v_cache, block_table, cache_seqlens, status_buffer(device_index), keys_per_split,
                  num_splits, default_scale if scale is None else float(scale))


def _on_gpu(x) -> bool:
    return is_torch(x) and x.is_cuda


def _torch_from_host(x):
    import torch

    return torch.from_numpy(np.ascontiguousarray(x))


def decode_forward(q, k_cache, v_cache, cache_seqlens, *, block_table=None, scale=None, num_splits=None,
                   max_seqlen=None):
    """``wb.decode``'s kernel path (inputs validated there): q (B, H, D) -> ``(out (B, H, D), lse (B, H))``.

    On a GPU with 16-bit data the CUDA C++ kernel runs (out in q's dtype); otherwise the numba kernels (float32
    out). The one new token sees all of its sequence's keys, so no causal mask is needed beyond each length.
    """
    if uses_cuda_kernel(q):
        return cuda_decode_forward(q, k_cache, v_cache, cache_seqlens, block_table=block_table, scale=scale,
                                   num_splits=num_splits, max_seqlen=max_seqlen)
    B = q.shape[0]
    table = block_table if block_table is not None else contiguous_as_paged(B, k_cache.shape[2])
    capacity = table.shape[1] * k_cache.shape[2]
    # lengths on a GPU are not read (a synchronisation): the splits cover the whole capacity, so none is dropped
    on_device = is_torch(cache_seqlens) and cache_seqlens.device.type != "cpu"
    max_len = capacity if max_seqlen is None or on_device else min(capacity, max_seqlen)
    out, lse = split_kv_forward(q[:, :, None], k_cache, v_cache, table, cache_seqlens, scale=scale,
                                num_splits=num_splits, max_len=max_len)
    return out[:, :, 0], lse[:, :, 0]
