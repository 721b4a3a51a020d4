"""Timing and peak-memory measurement (lessons 01-08 and the benchmark).

Timing follows the usual rules for asynchronous devices: warm-up calls first (compilation, caches,
allocator), synchronization around every measured call (CUDA events on a GPU), many repeats,
median and spread rather than the mean, and optionally the L2 cache flushed before each repeat
so that a small problem is not timed out of the cache.

Memory: on a GPU, the peak of PyTorch's caching allocator around the call (every stage allocates
its buffers through torch so that they are counted); on the CPU, the peak of Python's tracemalloc,
which NumPy reports its buffers to.
"""

from __future__ import annotations

import statistics
import time
import tracemalloc
from dataclasses import dataclass, field

from .backend import BACKEND

__all__ = ["Timing", "MemoryUse", "time_call", "peak_memory", "synchronize", "on_gpu"]


def on_gpu() -> bool:
    """True when kernels run on a real GPU and torch can see it."""
    if not BACKEND.is_gpu:
        return False
    import torch

    return torch.cuda.is_available()


def synchronize() -> None:
    """Wait for all queued device work (no-op on the CPU / simulator)."""
    if on_gpu():
        import torch

        torch.cuda.synchronize()


@dataclass(frozen=True)
class Timing:
    """Repeated measurements of one call, in milliseconds."""

    samples_ms: tuple = field(repr=False)
    device: str = "cpu"

    @property
    def median_ms(self) -> float:
        return statistics.median(self.samples_ms)

    @property
    def min_ms(self) -> float:
        return min(self.samples_ms)

    @property
    def max_ms(self) -> float:
        return max(self.samples_ms)

    @property
    def iqr_ms(self) -> float:
        """Interquartile range: the spread that ignores the odd outlier."""
        if len(self.samples_ms) < 4:
            return self.max_ms - self.min_ms
        q = statistics.quantiles(self.samples_ms, n=4)
        return q[2] - q[0]

    def __str__(self) -> str:
        return (f"median {self.median_ms:.3f} ms (IQR {self.iqr_ms:.3f} ms, min {self.min_ms:.3f}, "
                f"n={len(self.samples_ms)}, {self.device})")


class _L2Flusher:
    """Overwrites a buffer twice the size of the L2 cache, evicting whatever the last call left."""

    def __init__(self):
        import torch

        l2_bytes = getattr(torch.cuda.get_device_properties(0), "L2_cache_size", 50 * 2**20)
        self.buffer = torch.empty(2 * l2_bytes // 4, dtype=torch.int32, device="cuda")

    def __call__(self):
        self.buffer.zero_()


def time_call(fn, *args, warmup: int = 3, repeats: int = 20, flush_l2: bool = False, device: str = "auto",
              **kwargs) -> Timing:
    """Time ``fn(*args, **kwargs)``: `warmup` untimed calls, then `repeats` timed ones.

    `device`: "cuda" (CUDA events), "cpu" (a host clock), or "auto": cuda when kernels run on a GPU.
    """
    if repeats < 1 or warmup < 0:
        raise ValueError(f"repeats={repeats} must be >= 1 and warmup={warmup} >= 0")
    if device not in ("auto", "cuda", "cpu"):
        raise ValueError(f"device={device!r}: use 'auto', 'cuda' or 'cpu'")
    for _ in range(warmup):
        fn(*args, **kwargs)
    samples = []
    if device == "cuda" or (device == "auto" and on_gpu()):
        import torch

        flush = _L2Flusher() if flush_l2 else None
        torch.cuda.synchronize()
        for _ in range(repeats):
            if flush is not None:
                flush()
            start = torch.cuda.Event(enable_timing=True)
            end = torch.cuda.Event(enable_timing=True)
            start.record()
            fn(*args, **kwargs)
            end.record()
            end.synchronize()
            samples.append(start.elapsed_time(end))
        return Timing(tuple(samples), device="cuda")
    # CPU or simulator: nothing is asynchronous, and there is no device L2 to flush.
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn(*args, **kwargs)
        samples.append((time.perf_counter() - t0) * 1e3)
    return Timing(tuple(samples), device="cpu")


@dataclass(frozen=True)
class MemoryUse:
    """Peak memory allocated during a call, beyond what was allocated before it."""

    peak_bytes: int
    device: str

    @property
    def peak_mib(self) -> float:
        return self.peak_bytes / 2**20

    def __str__(self) -> str:
        return f"peak {self.peak_mib:.2f} MiB ({self.device})"


def peak_memory(fn, *args, device: str = "auto", **kwargs):
    """Run ``fn(*args, **kwargs)`` once; return ``(result, MemoryUse)``.

    `device`: "cuda" (torch's allocator), "host" (tracemalloc), or "auto": cuda when kernels run on a
    GPU. CPU code such as the NumPy reference needs "host" on a GPU machine too.
    The result stays alive until the peak is read, so its own allocation is counted.
    """
    if device not in ("auto", "cuda", "host"):
        raise ValueError(f"device={device!r}: use 'auto', 'cuda' or 'host'")
    if device == "cuda" or (device == "auto" and on_gpu()):
        import torch

        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        result = fn(*args, **kwargs)
        torch.cuda.synchronize()
        return result, MemoryUse(torch.cuda.max_memory_allocated() - before, "cuda")
    already_tracing = tracemalloc.is_tracing()
    if not already_tracing:
        tracemalloc.start()
    tracemalloc.reset_peak()
    before, _ = tracemalloc.get_traced_memory()
    try:
        result = fn(*args, **kwargs)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        if not already_tracing:
            tracemalloc.stop()
    return result, MemoryUse(peak - before, "host")
