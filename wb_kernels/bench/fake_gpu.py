"""A pretend GPU for the dashboard lesson's timing puzzle: a few lines of Python that behave like the real thing where a timing
loop can go wrong, so that a loop is graded on a laptop (CI has no GPU) against a known truth.

What it models, each the cause of one of the lies the dashboard lesson measures on a real GPU (:mod:`.pitfalls`):

- calls are asynchronous: ``fn()`` spends host time (a Python wrapper, the launch) and returns while its kernel is
  only *queued*; the device runs the queue in order, after whatever is ahead of it;
- the first call compiles (host time, once);
- the L2 cache: a kernel that follows itself finds its inputs there (faster); after a flush by *reading* a big
  buffer it starts clean (the truth); after a flush by *zeroing* one it must first write back the dirty lines;
- a few runs are slow (an interrupt, a clock change): every ``outlier_every``-th run takes ``outlier_factor``
  times as long;
- events are stamped when the *device* reaches them: an event recorded while the device is idle is stamped at the
  host's time, so whatever the host does before the next kernel is in the window; ``sleep(us)`` queues a sleeping
  kernel (:func:`wb_kernels.timing.hold_device`) that keeps the device busy while the host queues what follows.

Its methods mirror torch's: ``synchronize()``, ``Event()`` with ``record()``, ``synchronize()`` and
``elapsed_time(end)`` (ms), plus ``flush_l2(mode)`` (``"read"`` or ``"write"``), ``sleep(us)`` and a host clock,
``perf_counter()`` (seconds). Time is virtual (microseconds), so every run gives the same numbers.
"""

from __future__ import annotations

__all__ = ["FakeDevice", "FakeEvent"]


class FakeEvent:
    """A CUDA event on the fake device: stamped (device time, µs) when the device reaches it in its queue."""

    def __init__(self, device: "FakeDevice", enable_timing: bool = True):
        self.device = device
        self.stamp = None

    def record(self) -> None:
        device = self.device
        device.host_us += device.event_us
        self.stamp = max(device.host_us, device.free_at)  # an idle device stamps it at once, at the host's time
        device.free_at = self.stamp

    def synchronize(self) -> None:
        if self.stamp is None:
            raise RuntimeError("synchronize() on an event that was never recorded")
        self.device.host_us = max(self.device.host_us, self.stamp)

    def elapsed_time(self, end: "FakeEvent") -> float:
        """Milliseconds from this event to `end`, as torch.cuda.Event.elapsed_time."""
        if self.stamp is None or end.stamp is None:
            raise RuntimeError("elapsed_time() needs both events recorded")
        if self.device.host_us < end.stamp:
            raise RuntimeError("elapsed_time() before the end event completed: synchronize on it first")
        return (end.stamp - self.stamp) / 1e3


class FakeDevice:
    """One asynchronous device running one kernel, ``device.kernel`` (the ``fn`` a timing loop is given). Its truth,
    :attr:`truth_ms`, is what the kernel takes on the device from a clean L2, with no host time and no outlier."""

    def __init__(self, kernel_us: float = 40.0, wrapper_us: float = 80.0, compile_us: float = 200_000.0,
                 launch_us: float = 4.0, event_us: float = 1.0, flush_us: float = 30.0, writeback_us: float = 12.0,
                 warm_factor: float = 0.6, outlier_every: int = 10, outlier_factor: float = 5.0):
        self.kernel_us, self.wrapper_us, self.compile_us = kernel_us, wrapper_us, compile_us
        self.launch_us, self.event_us, self.flush_us, self.writeback_us = launch_us, event_us, flush_us, writeback_us
        self.warm_factor, self.outlier_every, self.outlier_factor = warm_factor, outlier_every, outlier_factor
        self.host_us = 0.0  # the host's clock
        self.free_at = 0.0  # when the device will have finished everything queued so far
        self.l2 = "clean"  # "clean", "dirty" (after a zeroing flush) or "warm" (the kernel's inputs are in it)
        self.compiled = False
        self.runs = 0

    @property
    def truth_ms(self) -> float:
        return self.kernel_us / 1e3

    def _queue(self, duration_us: float) -> None:
        self.host_us += self.launch_us
        self.free_at = max(self.host_us, self.free_at) + duration_us

    # ---- what a timing loop may call --------------------------------------------------------------------------

    def kernel(self):
        """The call being timed: host work (compilation the first time, a wrapper), then its kernel is queued."""
        if not self.compiled:
            self.host_us += self.compile_us
            self.compiled = True
        self.host_us += self.wrapper_us
        duration = {"warm": self.kernel_us * self.warm_factor, "clean": self.kernel_us,
                    "dirty": self.kernel_us + self.writeback_us}[self.l2]
        self.runs += 1
        if self.outlier_every and self.runs % self.outlier_every == 0:
            duration *= self.outlier_factor
        self._queue(duration)
        self.l2 = "warm"

    def flush_l2(self, mode: str = "read") -> None:
        """Queue an L2 flush: "read" sums a buffer twice the L2's size (a clean cache), "write" zeroes it (dirty)."""
        if mode not in ("read", "write"):
            raise ValueError(f"flush mode {mode!r}: 'read' or 'write'")
        self._queue(self.flush_us)
        self.l2 = "clean" if mode == "read" else "dirty"

    def sleep(self, microseconds: float) -> None:
        """Queue a sleeping kernel of that many µs (it touches no memory)."""
        self._queue(float(microseconds))

    def synchronize(self) -> None:
        """Wait on the host until the device has finished everything queued."""
        self.host_us = max(self.host_us, self.free_at)

    def Event(self, enable_timing: bool = True) -> FakeEvent:  # noqa: N802 - torch.cuda.Event's name
        return FakeEvent(self, enable_timing)

    def perf_counter(self) -> float:
        """The host's clock, in seconds (as time.perf_counter)."""
        return self.host_us / 1e6
