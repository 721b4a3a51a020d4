"""Timing and peak-memory measurement (lessons 01-11 and the benchmark).

Timing follows the usual rules for asynchronous devices: warm-up calls first (compilation, caches,
allocator), synchronization around every measured call (CUDA events on a GPU), many repeats,
median and spread rather than the mean, and optionally the L2 cache flushed before each repeat
so that a small problem is not timed out of the cache. :data:`DEVICE_TIME` is the benchmark's one way of timing,
for every preset: a sleeping kernel queued before each repeat (the events time the device's work, not the host's
launches) and the L2 flushed clean by reading (not zeroing, which leaves dirty lines for the timed call to write
back); the dashboard lesson shows what each half changes.

Memory: on a GPU, the peak of PyTorch's caching allocator around the call (every stage allocates
its buffers through torch so that they are counted); on the CPU, the peak of Python's tracemalloc,
which NumPy reports its buffers to.
"""

from __future__ import annotations

import functools
import statistics
import time
import tracemalloc
from collections.abc import Mapping
from dataclasses import dataclass, field, fields

from .backend import BACKEND

__all__ = ["Timing", "MemoryUse", "TimingMethod", "DEVICE_TIME", "EVENTS_AROUND_CALL", "L2Flusher", "time_call",
           "peak_memory", "free_device_memory", "synchronize", "on_gpu"]


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


def free_device_memory() -> None:
    """Collect Python's garbage and, on a GPU, give PyTorch's cached blocks back: between measurements, so that one
    problem's buffers do not count against the next one's memory."""
    import gc

    gc.collect()
    if on_gpu():
        import torch

        torch.cuda.empty_cache()


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


FLUSH_MODES = ("read", "write")


class L2Flusher:
    """Streams a buffer twice the size of the L2 cache through it, evicting whatever the last call left.

    mode "write" zeroes it, as most harnesses do (Triton's do_bench, NVBench's cold measurements): the cache is then
    left full of dirty lines, and the timed call pays for writing them back to memory as it evicts them, up to the
    L2's size in extra traffic (on an H100, 50 MB: up to about 15 us at its copy bandwidth, which a decode step of
    60 us feels and a prefill of milliseconds does not). mode "read" sums the buffer instead: the cache is left holding
    clean lines, which the timed call evicts for free, so a call that only reads (a decode step) is charged for its
    own traffic alone. Neither is what a model's layer sees (the previous layer leaves a little dirty data, not 50 MB):
    the decode benchmark times with "read" and its tuning run records "write" beside it.
    """

    def __init__(self, mode: str = "write"):
        import torch

        if mode not in FLUSH_MODES:
            raise ValueError(f"flush mode {mode!r}: use one of {FLUSH_MODES}")
        l2_bytes = getattr(torch.cuda.get_device_properties(0), "L2_cache_size", 50 * 2**20)
        self.buffer = torch.zeros(2 * l2_bytes // 4, dtype=torch.int32, device="cuda")
        self.mode = mode

    def __call__(self):
        if self.mode == "read":
            self.buffer.sum()
        else:
            self.buffer.zero_()


@dataclass(frozen=True)
class TimingMethod(Mapping):
    """How each repeat of a call is timed on a GPU: the L2 flush before it (``flush_l2``, ``flush_mode`` "read" or
    "write") and the sleeping kernel queued first (``hold_us``, :func:`hold_device`; 0: none). One object of this
    kind, :data:`DEVICE_TIME`, is what every benchmark preset times with (prefill and decode alike); results files
    record it, and :func:`wb_kernels.bench.results.timing_method` reads it back, so that two files timed differently
    are not set side by side as if they were one measurement. It is also a mapping of :func:`time_call`'s keyword
    arguments: ``time_call(fn, **DEVICE_TIME)``; ``dict(DEVICE_TIME)`` is what a results file records."""

    flush_l2: bool = True
    flush_mode: str = "read"
    hold_us: float = 300.0

    # the Mapping protocol, over the fields: time_call's keyword arguments, and dict(method) is what results record
    def __getitem__(self, name):
        if name not in self.__dataclass_fields__:
            raise KeyError(name)
        return getattr(self, name)

    def __iter__(self):
        return (f.name for f in fields(self))

    def __len__(self):
        return len(fields(self))

    @property
    def device_time(self) -> bool:
        """True when the events time the device's work alone (a sleeping kernel holds the host's launches)."""
        return self.hold_us > 0

    def label(self) -> str:
        """A few words for a table's column or a figure's title."""
        clock = "device time" if self.device_time else "host time in the window"
        flush = {"read": "L2 flushed by reading", "write": "L2 flushed by zeroing"}[self.flush_mode] \
            if self.flush_l2 else "L2 not flushed"
        return f"{clock}, {flush}"

    def words(self) -> str:
        """A sentence's worth: what the timed window holds."""
        if self.device_time:
            clock = (f"CUDA-event timings of the device's work (a {self.hold_us:.0f} µs sleeping kernel queued before "
                     "each repeat, so that the host's launch work is not in the timed window)")
        else:
            clock = ("CUDA-event timings around the call, with no kernel queued before it (the host's launch work, "
                     "when it outlasts the flush, is in the timed window)")
        if not self.flush_l2:
            return clock + " with the L2 cache left as the last call left it"
        if self.flush_mode == "read":
            return clock + (" with the L2 cache flushed clean (a buffer twice its size read, not written: a read-only "
                            "call pays no write-back of the flush's dirty lines)")
        return clock + (" with the L2 cache flushed by zeroing a buffer twice its size (which leaves dirty lines that "
                        "the timed call writes back)")

    @classmethod
    def from_record(cls, record: dict) -> "TimingMethod":
        """The method a results file recorded as ``dict(method)`` (older files: the defaults of that time)."""
        return cls(flush_l2=bool(record.get("flush_l2", True)), flush_mode=record.get("flush_mode") or "write",
                   hold_us=float(record.get("hold_us") or 0.0))


# The benchmark's one way of timing (every preset: prefill, decode, their tuning scripts): the device's work alone,
# from an L2 left clean. Why each half, measured: the dashboard lesson ("Two flushes, two clocks").
DEVICE_TIME = TimingMethod(flush_l2=True, flush_mode="read", hold_us=300.0)
# How the benchmark timed before 2026-11-24 (results files that record no method): events around the call, the L2
# zeroed before it.
EVENTS_AROUND_CALL = TimingMethod(flush_l2=True, flush_mode="write", hold_us=0.0)


@functools.lru_cache(maxsize=None)
def _sleep_cycles_per_us(device_index: int) -> float:
    """GPU clock cycles per microsecond of ``torch.cuda._sleep``, measured once with CUDA events."""
    import torch

    cycles = 2_000_000
    torch.cuda._sleep(cycles // 10)  # warm-up
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    torch.cuda._sleep(cycles)
    end.record()
    end.synchronize()
    return cycles / (start.elapsed_time(end) * 1e3)


def hold_device(microseconds: float) -> None:
    """Keep the current GPU busy for about `microseconds` with a sleeping kernel, so that the host can queue what
    follows (an L2 flush, the events, a call's launches) before the GPU reaches it: the events then time the device's
    work, not the host's launch latency (NVBench holds its launches behind a blocking kernel for the same reason)."""
    import torch

    if microseconds > 0:
        torch.cuda._sleep(int(microseconds * _sleep_cycles_per_us(torch.cuda.current_device())))


def time_call(fn, *args, warmup: int = 3, repeats: int = 20, flush_l2: bool = False, device: str = "auto",
              flush_mode: str = "write", hold_us: float = 0.0, **kwargs) -> Timing:
    """Time ``fn(*args, **kwargs)``: `warmup` untimed calls, then `repeats` timed ones.

    `device`: "cuda" (CUDA events), "cpu" (a host clock), or "auto": cuda when kernels run on a GPU.
    On a GPU: `flush_l2` evicts the L2 cache before each timed call, by reading (`flush_mode` "read": a clean cache)
    or overwriting ("write": a dirty one, see :class:`L2Flusher`); `hold_us` > 0 first queues a sleeping kernel of
    that length (:func:`hold_device`), so that the events time what the GPU does for the call, without the host's
    time to launch it. Without it, a call whose host work outlasts the flush (a Python wrapper, several launches) is
    charged for the GPU's wait; the host's per-call cost is then for a wall-clock measurement of back-to-back calls.
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

        flush = L2Flusher(flush_mode) if flush_l2 else None
        torch.cuda.synchronize()
        for _ in range(repeats):
            hold_device(hold_us)
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
