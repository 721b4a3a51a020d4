"""FlashInfer, the attention library the vLLM and SGLang serving engines run, as a contender (lessons 06-11).

FlashInfer (Ye et al., 2025, "FlashInfer: Efficient and Customizable Attention Engine for LLM Inference Serving",
arXiv:2501.01005) is what a serving engine's attention is; measuring against it is the series' "vs vLLM"
comparison, stated as what it is: the same attention kernels vLLM can serve with, not vLLM itself (whose scheduler,
CUDA graphs and batching are not attention).

It is optional: ``pip install .[contenders]`` on a machine with a CUDA GPU. Where it is not importable (CPU CI, a
laptop), :func:`problem` says why, and the benchmark records that reason instead of its rows.

Used the way its documentation shows, with everything but the attention call outside the timing: one wrapper per
problem, its ``plan`` (the work split, the kernels built on first use: 10-20 s each) made once, then ``run``.

- prefill (:func:`prefill_prepare`): ``BatchPrefillWithRaggedKVCacheWrapper`` (the batch's sequences packed one
  after another, (B*L, H, D), with offsets), ``backend="fa2"`` (FlashAttention-2's algorithm) or ``"fa3"``
  (FlashAttention-3's, Hopper's warp-specialised TMA/wgmma kernels);
- decode (:func:`decode_prepare`, :class:`PagedDecode`): ``BatchDecodeWithPagedKVCacheWrapper`` on the paged cache
  (num_pages, Hk, page_size, D), FlashInfer's "HND" layout, the same pools ``wb.decode`` reads, with CUDA-core decode
  kernels or, ``use_tensor_cores=True``, its tensor-core (prefill) kernels; :class:`GraphPagedDecode`, the same
  in a CUDA graph, as vLLM's and SGLang's FlashInfer backends run it.
"""

from __future__ import annotations

import functools
from typing import Optional

__all__ = ["problem", "fa3_problem", "WORKSPACE_BYTES", "prefill_prepare", "decode_prepare", "PagedDecode",
           "GraphPagedDecode", "page_lists"]

WORKSPACE_BYTES = 128 * 2**20  # the size FlashInfer's documentation recommends for a wrapper's workspace


@functools.lru_cache(maxsize=None)
def problem() -> Optional[str]:
    """Why FlashInfer cannot run here, or None. Asked once per process."""
    import importlib.util

    if importlib.util.find_spec("flashinfer") is None:
        return "flashinfer is not installed here (`pip install .[contenders]` brings it, on a machine with a CUDA GPU)"
    try:
        import torch

        if not torch.cuda.is_available():
            return "flashinfer needs a CUDA GPU; this machine has none"
        import flashinfer  # noqa: F401
    except Exception as error:  # noqa: BLE001 - any import failure means "not usable here"
        first = (str(error).splitlines() or [""])[0][:120]
        return f"flashinfer is not importable here ({type(error).__name__}: {first})"
    return None


def fa3_problem() -> Optional[str]:
    """Why FlashInfer's FA3 backend cannot run here (its kernels are Hopper's: sm_90), or None."""
    if problem() is not None:
        return problem()
    import torch

    major, minor = torch.cuda.get_device_capability()
    if major != 9:
        return f"flashinfer's fa3 backend runs on Hopper (sm_90); this GPU is sm_{major}{minor}"
    return None


_WORKSPACES: dict = {}


def _workspace(device):
    """One zeroed workspace per device, shared by the wrappers (FlashInfer asks for zeros before the first use)."""
    import torch

    key = str(device)
    if key not in _WORKSPACES:
        _WORKSPACES[key] = torch.zeros(WORKSPACE_BYTES, dtype=torch.uint8, device=device)
    return _WORKSPACES[key]


def prefill_prepare(backend: str):
    """A benchmark ``prepare(q, k, v, causal)`` for FlashInfer's batched ragged prefill with `backend` ("fa2", "fa3").

    q (B, H, Lq, D), k and v (B, Hk, Lk, D) are packed once, outside the timing, into FlashInfer's (B*L, heads, D)
    with offsets every L rows; the timed call is ``wrapper.run(q, k, v)``. Causal is FlashInfer's, aligned at the
    bottom right, the same as the benchmark's top-left one where Lq == Lk (its only case)."""

    def prepare(q, k, v, causal):
        import flashinfer
        import torch

        B, H, Lq, D = q.shape
        Hk, Lk = k.shape[1], k.shape[2]
        if causal and Lq != Lk:
            raise ValueError("flashinfer's causal mask is aligned at the bottom right; the benchmark's is top-left, "
                             "the same only where Lq == Lk")

        def packed(x):
            return x.transpose(1, 2).reshape(-1, x.shape[1], D).contiguous()

        qt, kt, vt = packed(q), packed(k), packed(v)
        qo_indptr = torch.arange(0, (B + 1) * Lq, Lq, dtype=torch.int32, device=q.device)
        kv_indptr = torch.arange(0, (B + 1) * Lk, Lk, dtype=torch.int32, device=q.device)
        wrapper = flashinfer.BatchPrefillWithRaggedKVCacheWrapper(_workspace(q.device), "NHD", backend=backend)
        wrapper.plan(qo_indptr, kv_indptr, H, Hk, D, causal=causal, q_data_type=q.dtype, kv_data_type=k.dtype)

        def call():
            return wrapper.run(qt, kt, vt)

        return call, (lambda out: out.reshape(B, Lq, H, D).transpose(1, 2))

    return prepare


class PagedDecode:
    """FlashInfer's batch decode over a paged cache (num_pages, Hk, page_size, D) and a block table (B, pages), the
    layout of ``wb.decode`` and of lesson 07's decoder.

    ``plan(block_table, lengths, ...)`` once per decode step (a serving engine plans once per step and reuses the plan
    in every layer); ``run(q, k_pages, v_pages)`` per layer. `lengths` are the host's (Python ints): FlashInfer plans
    on the host, as serving engines know each sequence's length there.
    """

    def __init__(self, device, *, use_tensor_cores: bool = False):
        import flashinfer

        self.use_tensor_cores = use_tensor_cores
        self.wrapper = flashinfer.BatchDecodeWithPagedKVCacheWrapper(_workspace(device), "HND",
                                                                     use_tensor_cores=use_tensor_cores)
        self.planned = None

    def plan(self, block_table, lengths, *, num_heads: int, kv_heads: int, head_dim: int, page_size: int, dtype):
        """Plan for sequences of `lengths` keys (host ints) whose pages are the rows of `block_table`."""
        import torch

        # the table itself, not its address: holding it keeps its memory from being reused by another table
        key = (block_table, tuple(lengths), num_heads, kv_heads, head_dim, page_size, dtype)
        if self.planned is not None and key[0] is self.planned[0] and key[1:] == self.planned[1:]:
            return
        indptr, indices, last = page_lists(block_table, lengths, page_size)
        device = block_table.device
        self.wrapper.plan(indptr.to(device), indices, last.to(device), num_heads, kv_heads, head_dim, page_size,
                          q_data_type=dtype, kv_data_type=dtype)
        self.planned = key

    def run(self, q, k_pages, v_pages):
        """q (B, H, D) -> (B, H, D) in q's dtype."""
        return self.wrapper.run(q, (k_pages, v_pages))


class GraphPagedDecode:
    """FlashInfer's batch decode for a CUDA graph, as serving engines capture it: one wrapper per batch size, made
    with ``use_cuda_graph=True`` and fixed index buffers (the batch size and the buffers' addresses are then fixed);
    the graph captures :meth:`run` only, and the host plans before every replay (:meth:`plan`, outside the capture).
    FlashInfer's documentation: in CUDA-graph mode the plan's launch configuration does not depend on the lengths
    (so one captured run serves every plan of the same batch), and ``plan`` cannot be captured.

    ``plan`` takes every sequence's length from the host; the offsets and last-page lengths go in as CPU tensors and
    the page list stays on the GPU, so planning never waits for the GPU. FlashInfer stages a plan's data in one
    pinned buffer, which the next plan overwrites: each plan therefore first waits until the GPU has taken the
    previous one (an event recorded after it), so the host runs at most one step ahead of the GPU.
    """

    def __init__(self, device, *, batch: int, max_pages: int, use_tensor_cores: bool = False):
        import flashinfer
        import torch

        self.batch, self.max_pages = batch, max_pages
        self.buffers = (torch.zeros(batch + 1, dtype=torch.int32, device=device),
                        torch.zeros(max_pages, dtype=torch.int32, device=device),
                        torch.zeros(batch, dtype=torch.int32, device=device))
        # a workspace of its own: a plan writes its schedule there, which a captured run reads at every replay
        workspace = torch.zeros(WORKSPACE_BYTES, dtype=torch.uint8, device=device)
        self.wrapper = flashinfer.BatchDecodeWithPagedKVCacheWrapper(
            workspace, "HND", use_cuda_graph=True, use_tensor_cores=use_tensor_cores,
            paged_kv_indptr_buffer=self.buffers[0], paged_kv_indices_buffer=self.buffers[1],
            paged_kv_last_page_len_buffer=self.buffers[2])
        self.out = None  # the output every run writes (a fixed address, which the graph's later kernels read)
        self._taken = None  # an event after the last plan: the GPU has copied its data once it has passed it

    def plan(self, block_table, lengths, *, num_heads: int, kv_heads: int, head_dim: int, page_size: int, dtype):
        """Plan for `lengths` (host ints, one per row of `block_table`: this wrapper's batch)."""
        import torch

        if len(lengths) != self.batch or block_table.shape[0] != self.batch:
            raise ValueError(f"GraphPagedDecode: planned for {self.batch} sequences, got {len(lengths)} lengths and a "
                             f"table of {block_table.shape[0]} rows")
        pages = [-(-n // page_size) for n in lengths]
        if sum(pages) > self.max_pages or max(pages) > block_table.shape[1]:
            raise ValueError(f"GraphPagedDecode: lengths {max(lengths)} need more pages than the table or the "
                             f"buffer ({self.max_pages}) hold")
        indptr, indices, last = page_lists(block_table, lengths, page_size)
        if self._taken is not None:
            self._taken.synchronize()
        # the buffers may be inference tensors (made by a capture under inference_mode): update them in that mode
        with torch.inference_mode():
            self.wrapper.plan(indptr, indices, last, num_heads, kv_heads, head_dim, page_size, q_data_type=dtype,
                              kv_data_type=dtype)
        self._taken = torch.cuda.Event()
        self._taken.record()

    def run(self, q, k_pages, v_pages):
        """q (B, H, D) -> (B, H, D) in q's dtype, into the same output tensor every time (capturable)."""
        import torch

        if self.out is None:
            self.out = torch.empty_like(q)
        return self.wrapper.run(q, (k_pages, v_pages), out=self.out)


def page_lists(block_table, lengths, page_size: int) -> tuple:
    """FlashInfer's description of a paged batch: ``(indptr, indices, last_page_len)``, int32. indptr (B + 1,) and the
    last pages' lengths (B,) on the host, from `lengths` (host ints); indices, each sequence's pages in order, packed,
    on the table's device (a slice of the table when every sequence has as many pages: no copy from the host)."""
    import torch

    pages = [-(-n // page_size) for n in lengths]
    indptr = torch.tensor([0] + list(_running_sum(pages)), dtype=torch.int32)
    last = torch.tensor([n - (p - 1) * page_size if p else 0 for n, p in zip(lengths, pages)], dtype=torch.int32)
    if len(set(pages)) == 1:
        indices = block_table[:, :pages[0]].reshape(-1).to(torch.int32).contiguous()
    else:
        device = block_table.device
        used = torch.arange(block_table.shape[1], device=device)[None, :] < torch.tensor(pages, device=device)[:, None]
        indices = block_table[used].to(torch.int32).contiguous()
    return indptr, indices, last


def _running_sum(values):
    total = 0
    for value in values:
        total += value
        yield total


def decode_prepare(use_tensor_cores: bool):
    """A decode-benchmark ``prepare(inputs, layout, workload)``: :class:`PagedDecode` on the workload's paged cache,
    planned once outside the timing; the timed call is one ``run``."""

    def prepare(inputs, layout, workload):
        if layout != "paged" or inputs.k_pages is None:
            raise ValueError("flashinfer's decode is timed on the paged cache only")
        from .sweeps import DECODE_PAGE_SIZE

        decode = PagedDecode(inputs.q.device, use_tensor_cores=use_tensor_cores)
        decode.plan(inputs.block_table, [workload.Lk] * workload.B, num_heads=workload.H, kv_heads=workload.Hk,
                    head_dim=workload.D, page_size=DECODE_PAGE_SIZE, dtype=inputs.q.dtype)
        return (lambda: decode.run(inputs.q, inputs.k_pages, inputs.v_pages)), None

    return prepare
