"""The dashboard lesson's exercises and its timing puzzle: what each answer must equal (computed when graded), and the
plausible wrong answers as data.

The worked answers are in ``solutions.py`` next to this file: open it when you want them.

The puzzle: write ``time_it(fn, device)``, a timing loop, and :func:`check_timing_puzzle` runs it on pretend GPUs
(:class:`wb_kernels.bench.fake_gpu.FakeDevice`: asynchronous calls, a first call that compiles, an L2 cache, a few
slow runs) whose truth is known, and says which of the known lies the loop told when it is off. :data:`PUZZLE`
lists those lies as loops a learner would plausibly write.
"""

from __future__ import annotations

import json
import math
import statistics

from ..exercises import Exercise, Puzzle, check_answers
from .fake_gpu import FakeDevice
from .results import REPO_ROOT
from .sweeps import attention_flops, minimum_bytes

__all__ = ["EXERCISES", "check", "PUZZLE", "check_timing_puzzle", "PUZZLE_DEVICES", "TIMING_MODES"]

# The committed run that timed wb.decode and a copy with both flushes, with and without the sleeping kernel.
TIMING_MODES = REPO_ROOT / "results" / "decode" / "history" / "timing_modes_h100_42df32c.json"


def _mode_ms(B, Hk, Lk, call, flush_mode, hold_us) -> float:
    records = json.loads(TIMING_MODES.read_text())["records"]
    return next(r["median_ms"] for r in records if (r["B"], r["Hk"], r["Lk"], r["call"], r["flush_mode"], r["hold_us"])
                == (B, Hk, Lk, call, flush_mode, hold_us))


def _causal_tflops(seconds, causal=True, scale=1e12):
    return attention_flops(4, 16, 4096, 4096, 128, causal=causal) / seconds / scale


def _intensity(itemsize=2, tensors=4):
    # L = 6144, D = 64: a shape no lesson prints (lesson 06 prints L = 4096, the dashboard lesson L = 16384)
    return attention_flops(1, 1, 6144, 6144, 64, causal=False) / (
        minimum_bytes(1, 1, 6144, 6144, 64, itemsize=itemsize) * tensors / 4)


def _zeroing_extra_us(hold_us=0.0):
    """wb.decode at B1 H32 Hk32 Lk32768: zeroing flush (with or without the hold) over device time, clean L2."""
    return (_mode_ms(1, 32, 32768, "wb.decode", "write", hold_us)
            - _mode_ms(1, 32, 32768, "wb.decode", "read", 300.0)) * 1e3


EXERCISES = (
    Exercise("exercise 1", lambda: _causal_tflops(0.5e-3),
             "4*B*H*L*L*D FLOPs, halved for causal, divided by the seconds; then / 1e12.",
             wrong={"not halved for causal": lambda: _causal_tflops(0.5e-3, causal=False),
                    "0.5 taken as seconds": lambda: _causal_tflops(0.5),
                    "one matmul counted (2*B*H*L*L*D)": lambda: _causal_tflops(0.5e-3) / 2,
                    "in GFLOP/s": lambda: _causal_tflops(0.5e-3, scale=1e9)}),
    Exercise("exercise 2", _intensity,
             "4*L*L*D FLOPs over 2 bytes x (q, k, v, out) = 2 * 4*L*D bytes.",
             wrong={"4 bytes per number (fp32)": lambda: _intensity(itemsize=4),
                    "the output not counted": lambda: _intensity(tensors=3),
                    "halved as if causal": lambda: _intensity() / 2}),
    Exercise("exercise 3", lambda: 312e12 / 1555e9, "Peak FLOP/s divided by bytes/s.",
             wrong={"bytes per FLOP (inverted)": lambda: 1555e9 / 312e12,
                    "TFLOP/s over GB/s without the units": lambda: 312 / 1555,
                    "the copy's bandwidth halved (reads only)": lambda: 312e12 / (1555e9 / 2)}),
    Exercise("exercise 4", lambda: "l2",
             "8 MiB fits in a 50 MiB L2 cache: where did the 100th call find its input?",
             wrong={"asynchrony": "async", "warm-up": "warmup", "zeros": "zeros", "host time": "host"}),
    Exercise("exercise 5", _zeroing_extra_us,
             "Subtract the device-time row (reading flush, 300 µs hold) from the zeroing flush without the hold, "
             "and give microseconds.",
             wrong={"the write-back alone (zeroing flush, with the hold)": lambda: _zeroing_extra_us(300.0),
                    "in milliseconds": lambda: _zeroing_extra_us() / 1e3,
                    "the ratio of the two times": lambda: _mode_ms(1, 32, 32768, "wb.decode", "write", 0.0)
                    / _mode_ms(1, 32, 32768, "wb.decode", "read", 300.0)}),
)


def check(answer_1, answer_2, answer_3, answer_4, answer_5) -> None:
    """Grade the dashboard lesson's exercises (``...`` means not answered yet)."""
    check_answers(EXERCISES, answer_1, answer_2, answer_3, answer_4, answer_5)


# ----------------------------------------------------------------------------------------------
# The timing puzzle
# ----------------------------------------------------------------------------------------------

# The pretend GPUs the loop is graded on: a short call behind a long Python wrapper (host work outlasts the kernel,
# as for a decode step or a small prefill), and a long one. Each device's truth is its kernel_us.
PUZZLE_DEVICES = ({"kernel_us": 40.0, "wrapper_us": 80.0}, {"kernel_us": 900.0, "wrapper_us": 80.0})
PUZZLE_TOLERANCE = 0.02  # a loop within 2 % of the truth on every device solves it


def _right_loop(fn, device, repeats=30, *, warmup=True, flush="read", hold_us=300.0, flush_in_window=False,
                summary=statistics.median):
    """The timing loop with one knob per lie (the wrong answers below turn one each)."""
    if warmup:
        fn()
        device.synchronize()
    samples = []
    for _ in range(repeats):
        if hold_us:
            device.sleep(hold_us)
        start, end = device.Event(), device.Event()
        if flush_in_window:
            start.record()
        if flush:
            device.flush_l2(flush)
        if not flush_in_window:
            start.record()
        fn()
        end.record()
        end.synchronize()
        samples.append(start.elapsed_time(end))
    return summary(samples)


def _host_timer(fn, device, repeats=30, *, sync=False):
    fn()
    device.synchronize()
    samples = []
    for _ in range(repeats):
        device.flush_l2("read")
        device.synchronize()
        t0 = device.perf_counter()
        fn()
        if sync:
            device.synchronize()
        samples.append((device.perf_counter() - t0) * 1e3)
        device.synchronize()
    return statistics.median(samples)


def _loop(**knobs):
    return lambda: (lambda fn, device, repeats=30: _right_loop(fn, device, repeats, **knobs))


# label -> a function building the wrong loop a learner would plausibly write
WRONG_LOOPS = {
    "no synchronisation: a host timer around the call (times the launch only)":
        lambda: (lambda fn, device, repeats=30: _host_timer(fn, device, repeats)),
    "a host timer with synchronize (the host's wrapper and launch in the time)":
        lambda: (lambda fn, device, repeats=30: _host_timer(fn, device, repeats, sync=True)),
    "the first (compiling) call timed": _loop(warmup=False, summary=lambda samples: samples[0]),
    "no warm-up (the compiling call among the samples, averaged)": _loop(warmup=False, summary=statistics.fmean),
    "the mean instead of the median (a slow run pulls it)": _loop(summary=statistics.fmean),
    "the L2 left warm (no flush)": _loop(flush=None),
    "the L2 flushed by zeroing (the call writes back dirty lines)": _loop(flush="write"),
    "the flush inside the timed window": _loop(flush_in_window=True),
    "host time in the window (no sleeping kernel first)": _loop(hold_us=0.0),
    "a sleeping kernel shorter than the host's work per repeat": _loop(hold_us=50.0),
}


def _run_on(time_it, spec):
    device = FakeDevice(**spec)
    return device, time_it(device.kernel, device)


def _which_lie(reported, spec):
    """The label of a known lie that reports exactly this number on this device, or None."""
    for label, build in WRONG_LOOPS.items():
        _, value = _run_on(build(), spec)
        if math.isclose(value, reported, rel_tol=1e-9):
            return label
    return None


def check_timing_puzzle(time_it) -> None:
    """Run ``time_it(fn, device)`` on each pretend GPU of :data:`PUZZLE_DEVICES` and print whether it reports the
    device's work from a clean L2 (within :data:`PUZZLE_TOLERANCE`), and when not, by how much and which known lie
    gives that number."""
    name = "timing puzzle"
    reported = []
    for spec in PUZZLE_DEVICES:
        try:
            device, value = _run_on(time_it, spec)
        except Exception as error:  # noqa: BLE001 - the learner's loop: say what it raised
            print(f"{name}: not solved yet: time_it raised {type(error).__name__}: {error}")
            return
        if value is None or value is ... or not isinstance(value, (int, float)) or not math.isfinite(value):
            print(f"{name}: not solved yet: time_it returned {value!r}, not a time in ms")
            return
        if not math.isclose(value, device.truth_ms, rel_tol=PUZZLE_TOLERANCE):
            lie = _which_lie(value, spec)
            print(f"{name}: not solved yet: on a device whose kernel takes {device.truth_ms:.3f} ms (behind "
                  f"{spec['wrapper_us'] / 1e3:.3f} ms of host work per call) your loop reports {value:.4f} ms, "
                  f"{value / device.truth_ms:.2f}x the truth" + (f": the number that {lie!r} gives" if lie else "."))
            return
        reported.append(value)
    print(f"{name}: solved ✓ (" + " and ".join(f"{v:.3f} ms" for v in reported)
          + ": the device's work, from a clean L2, on both devices)")


PUZZLE = Puzzle(check=check_timing_puzzle, solution="time_it", wrong=WRONG_LOOPS)
