"""Honest benchmarking, shown by getting it wrong on purpose (the dashboard lesson's middle part).

:func:`honesty_demos` measures each mistake next to the right way on a GPU: no warm-up, a CPU timer
without synchronizing, the mean instead of the median, a warm L2 cache, clocks after idle, zeros
instead of random inputs. ``--preset honesty`` stores its numbers in the results file, and
:func:`honesty_lines` and :func:`samples_figure` print and draw them from there, so the lesson reads
the same on a laptop as on the GPU that measured them.
"""

from __future__ import annotations

import statistics
import time

from ..results_files import newest_matching, nvidia_smi, round_significant
from ..timing import free_device_memory
from .failures import error_line

__all__ = ["mistake_sizes", "honesty_demos", "HONESTY_TOPICS", "NO_DEMOS", "honesty_lines", "samples_figure",
           "TIMING_MODES", "MODE_NAMES", "timing_modes", "timing_modes_lines", "timing_modes_figure", "demos_path"]


# ----------------------------------------------------------------------------------------------
# Measuring them (GPU only)
# ----------------------------------------------------------------------------------------------

def _event_ms(fn, repeats: int, flush=None, prime: bool = False) -> list:
    """CUDA-event times of `fn`. `flush` (evict L2) or `prime` (one untimed call of fn: a warm L2) run
    just before each start event, so the GPU is busy when the timed call is queued and the CPU's launch
    gap is not timed with it."""
    import torch

    samples = []
    for _ in range(repeats):
        if flush is not None:
            flush()
        if prime:
            fn()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        samples.append(start.elapsed_time(end))
    return samples


def _stats(samples) -> dict:
    ordered = sorted(samples)
    quartiles = statistics.quantiles(ordered, n=20) if len(ordered) >= 4 else [ordered[0]] * 19
    return {"n": len(ordered), "median_ms": round_significant(statistics.median(ordered)), "mean_ms": round_significant(statistics.fmean(ordered)),
            "min_ms": round_significant(ordered[0]), "max_ms": round_significant(ordered[-1]), "p5_ms": round_significant(quartiles[0]),
            "p25_ms": round_significant(quartiles[4]), "p75_ms": round_significant(quartiles[14]), "p95_ms": round_significant(quartiles[18])}


def honesty_demos() -> dict:
    """Measured examples of each benchmarking mistake (the dashboard lesson). GPU only; about 15 s.

    Each entry holds the numbers of the wrong and the right way, measured one after the other.
    """
    import torch
    import torch.nn.functional as F

    from ..timing import L2Flusher

    demos = {}
    flush = L2Flusher()
    big = dict(B=4, H=16, L=4096, D=128, dtype="float16")  # the host's baseline configuration
    small = dict(B=1, H=16, L=1024, D=64, dtype="float16")  # 6 MiB of inputs: fits in the 50 MiB L2

    def qkv(B, H, L, D, dtype, zeros=False):
        make = torch.zeros if zeros else torch.randn
        gen = {} if zeros else {"generator": torch.Generator(device="cuda").manual_seed(0)}
        return tuple(make(B, H, L, D, device="cuda", dtype=getattr(torch, dtype), **gen) for _ in range(3))

    # 1. Warm-up: the first call of a numba kernel includes its compilation.
    try:
        from numba import cuda

        @cuda.jit
        def scale_in_place(x, factor):  # a fresh kernel, never compiled before in this process
            i = cuda.grid(1)
            if i < x.size:
                x[i] *= factor

        x = torch.ones(1 << 20, device="cuda")
        view = cuda.as_cuda_array(x)
        blocks = (x.numel() + 255) // 256
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        scale_in_place[blocks, 256](view, 1.0)
        torch.cuda.synchronize()
        first_ms = (time.perf_counter() - t0) * 1e3
        steady = [(lambda: (time.perf_counter(), scale_in_place[blocks, 256](view, 1.0), torch.cuda.synchronize(),
                            time.perf_counter()))() for _ in range(20)]
        steady_ms = [(s[3] - s[0]) * 1e3 for s in steady]
        q, k, v = qkv(1, 16, 1536, 128, "float16")  # a shape no other measurement uses: a cold plan
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        F.scaled_dot_product_attention(q, k, v)
        torch.cuda.synchronize()
        sdpa_first = (time.perf_counter() - t0) * 1e3
        sdpa_steady = [(lambda: (time.perf_counter(), F.scaled_dot_product_attention(q, k, v), torch.cuda.synchronize(),
                                 time.perf_counter()))() for _ in range(20)]
        demos["warmup"] = {
            "what": "wall-clock time of the first call vs the median of the next 20 (synchronized)",
            "numba_kernel_first_ms": round_significant(first_ms), "numba_kernel_steady_median_ms": round_significant(statistics.median(steady_ms)),
            "sdpa_first_ms": round_significant(sdpa_first),
            "sdpa_steady_median_ms": round_significant(statistics.median([(s[3] - s[0]) * 1e3 for s in sdpa_steady])),
            "sdpa_shape": "B1 H16 L1536 D128 fp16"}
    except Exception as error:  # noqa: BLE001
        demos["warmup"] = {"error": error_line(error)}

    # 2. Asynchrony: a CPU timer without synchronization measures only the launch.
    q, k, v = qkv(**big)
    call = lambda: F.scaled_dot_product_attention(q, k, v)  # noqa: E731
    for _ in range(3):
        call()
    torch.cuda.synchronize()
    no_sync, with_sync = [], []
    for _ in range(20):
        t0 = time.perf_counter()
        call()
        no_sync.append((time.perf_counter() - t0) * 1e3)
        torch.cuda.synchronize()
    for _ in range(20):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        call()
        torch.cuda.synchronize()
        with_sync.append((time.perf_counter() - t0) * 1e3)
    events = _event_ms(call, 20)
    demos["async"] = {"what": "SDPA B4 H16 L4096 D128 fp16 timed three ways, medians of 20",
                      "cpu_timer_no_sync_ms": round_significant(statistics.median(no_sync)),
                      "cpu_timer_with_sync_ms": round_significant(statistics.median(with_sync)),
                      "cuda_events_ms": round_significant(statistics.median(events))}

    # 3. Medians: 300 repeats of a short call; the mean is pulled by a few slow samples.
    qs, ks, vs = qkv(**small)
    short_call = lambda: F.scaled_dot_product_attention(qs, ks, vs)  # noqa: E731
    for _ in range(5):
        short_call()
    samples = _event_ms(short_call, 300)
    demos["medians"] = {"what": "SDPA B1 H16 L1024 D64 fp16, 300 CUDA-event samples, no flush",
                        **_stats(samples), "samples_ms": [round_significant(s, 4) for s in samples]}

    # 4. L2: a small problem timed right after the same call finds its inputs in the L2 cache.
    hot = _event_ms(short_call, 50, prime=True)
    cold = _event_ms(short_call, 50, flush=flush)
    buffer = torch.empty(4 << 20, dtype=torch.float32, device="cuda")  # 16 MiB
    other = torch.empty_like(buffer)
    copy_hot = _event_ms(lambda: other.copy_(buffer), 50, prime=True)
    copy_cold = _event_ms(lambda: other.copy_(buffer), 50, flush=flush)
    copy_gbps = lambda ms: round_significant(2 * buffer.numel() * 4 / (ms / 1e3) / 1e9)  # noqa: E731
    demos["l2"] = {"what": "the same call right after itself (warm L2) vs right after an L2 flush",
                   "sdpa_shape": "B1 H16 L1024 D64 fp16 (6 MiB of inputs)",
                   "sdpa_warm_ms": round_significant(statistics.median(hot)), "sdpa_flushed_ms": round_significant(statistics.median(cold)),
                   "copy_mib": 16, "copy_warm_gbps": copy_gbps(statistics.median(copy_hot)),
                   "copy_flushed_gbps": copy_gbps(statistics.median(copy_cold)),
                   "l2_bytes": int(getattr(torch.cuda.get_device_properties(0), "L2_cache_size", 0))}
    del buffer, other

    # 5. Clocks: they move with idle time, load, power and temperature; watch one matmul call by call.
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.float16)
    b = torch.randn(8192, 8192, device="cuda", dtype=torch.float16)
    torch.cuda.synchronize()
    clock_idle = nvidia_smi("clocks.sm")
    time.sleep(2.0)
    after_idle = _event_ms(lambda: torch.matmul(a, b), 120)
    clock_busy = nvidia_smi("clocks.sm")
    demos["clocks"] = {"what": "fp16 matmul 8192^3 timed call by call right after 2 s of idle",
                       "first_ms": round_significant(after_idle[0]), "first5_median_ms": round_significant(statistics.median(after_idle[:5])),
                       "last20_median_ms": round_significant(statistics.median(after_idle[-20:])),
                       "min_ms": round_significant(min(after_idle)), "max_ms": round_significant(max(after_idle)),
                       "samples_ms": [round_significant(s, 4) for s in after_idle],
                       "sm_clock_mhz_idle": clock_idle, "sm_clock_mhz_busy": clock_busy,
                       "sm_clock_mhz_max": nvidia_smi("clocks.max.sm")}

    # 6. Zeros vs random data: the same matmul on zeros draws less power and may run faster.
    za = torch.zeros_like(a)
    zb = torch.zeros_like(b)
    random_ms, zeros_ms = [], []
    for _ in range(2):  # interleaved blocks, so a clock drift does not favour one side
        random_ms += _event_ms(lambda: torch.matmul(a, b), 25)
        zeros_ms += _event_ms(lambda: torch.matmul(za, zb), 25)
    zq, zk, zv = qkv(**big, zeros=True)
    sdpa_random = _event_ms(call, 30, flush=flush)
    sdpa_zeros = _event_ms(lambda: F.scaled_dot_product_attention(zq, zk, zv), 30, flush=flush)
    flop = 2.0 * 8192 ** 3
    demos["zeros"] = {"what": "the same work on random inputs and on zeros, CUDA-event medians",
                      "matmul_random_ms": round_significant(statistics.median(random_ms)),
                      "matmul_zeros_ms": round_significant(statistics.median(zeros_ms)),
                      "matmul_random_tflops": round_significant(flop / statistics.median(random_ms) / 1e9),
                      "matmul_zeros_tflops": round_significant(flop / statistics.median(zeros_ms) / 1e9),
                      "sdpa_random_ms": round_significant(statistics.median(sdpa_random)),
                      "sdpa_zeros_ms": round_significant(statistics.median(sdpa_zeros))}
    del a, b, za, zb
    free_device_memory()
    return demos


# ----------------------------------------------------------------------------------------------
# Printing and drawing them from the results file (what the dashboard lesson shows)
# ----------------------------------------------------------------------------------------------

HONESTY_TOPICS = ("warmup", "async", "medians", "l2", "clocks", "zeros")
NO_DEMOS = "this results file has no GPU demonstrations (they run with --preset honesty on a GPU)"


def honesty_lines(results, topic: str) -> list:
    """Printable lines for one demonstration ("warmup", "async", "medians", "l2", "clocks", "zeros")."""
    if topic not in HONESTY_TOPICS:
        raise ValueError(f"topic={topic!r}: one of {', '.join(HONESTY_TOPICS)}")
    demo = (results.get("honesty") or {}).get(topic)
    if demo is None:
        return [NO_DEMOS]
    if "error" in demo:
        return [f"the demonstration failed on that run: {demo['error']}"]
    if topic == "warmup":
        return [f"numba kernel, first call (compiles it): {demo['numba_kernel_first_ms']:10.3f} ms",
                f"numba kernel, then (median of 20):      {demo['numba_kernel_steady_median_ms']:10.3f} ms"
                f"   -> {demo['numba_kernel_first_ms'] / demo['numba_kernel_steady_median_ms']:,.0f}x",
                f"SDPA at a new shape, first call:        {demo['sdpa_first_ms']:10.3f} ms",
                f"SDPA, then (median of 20):              {demo['sdpa_steady_median_ms']:10.3f} ms"
                f"   -> {demo['sdpa_first_ms'] / demo['sdpa_steady_median_ms']:,.1f}x"]
    if topic == "async":
        return [f"CPU timer, no synchronize: {demo['cpu_timer_no_sync_ms']:8.3f} ms   (only the launch)",
                f"CPU timer + synchronize:   {demo['cpu_timer_with_sync_ms']:8.3f} ms",
                f"CUDA events:               {demo['cuda_events_ms']:8.3f} ms",
                f"the unsynchronized number is {demo['cuda_events_ms'] / demo['cpu_timer_no_sync_ms']:.0f}x too small"]
    if topic == "medians":
        return [f"{demo['n']} samples: median {demo['median_ms']:.4f} ms, mean {demo['mean_ms']:.4f} ms, "
                f"min {demo['min_ms']:.4f}, max {demo['max_ms']:.4f}",
                f"middle half (p25-p75): {demo['p25_ms']:.4f}-{demo['p75_ms']:.4f} ms; "
                f"p95 {demo['p95_ms']:.4f} ms; max/median {demo['max_ms'] / demo['median_ms']:.2f}x"]
    if topic == "l2":
        return [f"SDPA {demo['sdpa_shape']}: warm L2 {demo['sdpa_warm_ms']:.4f} ms, flushed "
                f"{demo['sdpa_flushed_ms']:.4f} ms ({demo['sdpa_flushed_ms'] / demo['sdpa_warm_ms']:.2f}x)",
                f"copy of {demo['copy_mib']} MiB: warm L2 {demo['copy_warm_gbps']:,.0f} GB/s, flushed "
                f"{demo['copy_flushed_gbps']:,.0f} GB/s ({demo['copy_warm_gbps'] / demo['copy_flushed_gbps']:.2f}x)",
                f"L2 cache of that GPU: {demo['l2_bytes'] / 2**20:.0f} MiB",
                "the SDPA call ran " + ("faster with the cache flushed than warm: at this size the cache is not what "
                                        "decides its time" if demo["sdpa_flushed_ms"] < demo["sdpa_warm_ms"] else
                                        "faster from the warm cache")]
    if topic == "clocks":
        return [f"first call after 2 s idle: {demo['first_ms']:.3f} ms; median of the first 5 "
                f"{demo['first5_median_ms']:.3f} ms; of the last 20 of {len(demo['samples_ms'])} "
                f"{demo['last20_median_ms']:.3f} ms (first 5 / last 20: "
                f"{demo['first5_median_ms'] / demo['last20_median_ms']:.2f}x)",
                f"SM clock (nvidia-smi): idle {demo['sm_clock_mhz_idle']} MHz, busy {demo['sm_clock_mhz_busy']} MHz, "
                f"max {demo['sm_clock_mhz_max']} MHz"]
    if topic == "zeros":
        return [f"fp16 matmul 8192^3: random {demo['matmul_random_ms']:.3f} ms ({demo['matmul_random_tflops']:.0f} "
                f"TFLOP/s), zeros {demo['matmul_zeros_ms']:.3f} ms ({demo['matmul_zeros_tflops']:.0f} TFLOP/s): "
                f"zeros take {demo['matmul_zeros_ms'] / demo['matmul_random_ms']:.2f}x the time",
                f"SDPA B4 H16 L4096 D128 fp16: random {demo['sdpa_random_ms']:.3f} ms, zeros "
                f"{demo['sdpa_zeros_ms']:.3f} ms: zeros take {demo['sdpa_zeros_ms'] / demo['sdpa_random_ms']:.2f}x the time"]
    raise AssertionError(topic)  # unreachable: every topic is handled above


def samples_figure(results):
    """Left: the medians demonstration's samples as a histogram with median and mean marked.
    Right: the clocks demonstration's call-by-call times after idle. None without GPU demos."""
    demos = results.get("honesty") or {}
    if "medians" not in demos or "clocks" not in demos or "error" in demos["medians"]:
        return None
    from ..plots import new_figure

    fig, (left, right) = new_figure(ncols=2)
    medians = demos["medians"]
    left.hist(medians["samples_ms"], bins=40, color="#9467bd", alpha=0.7)
    left.axvline(medians["median_ms"], color="black", label=f"median {medians['median_ms']:.4f} ms")
    left.axvline(medians["mean_ms"], color="#d62728", linestyle="--", label=f"mean {medians['mean_ms']:.4f} ms")
    left.set_yscale("log")
    left.set(xlabel="ms", ylabel="samples", title=f"{medians['n']} repeats of one call")
    left.legend()
    clocks = demos["clocks"]
    right.plot(range(1, len(clocks["samples_ms"]) + 1), clocks["samples_ms"], "o-", markersize=3, color="#1f77b4")
    right.set(xlabel="call number after 2 s idle", ylabel="ms", title="fp16 matmul 8192³, call by call")
    return fig


def mistake_sizes(results) -> list:
    """How far each benchmarking mistake moved the number in this results file, one line each: the factor by
    which the wrong way's time differs from the right way's (above 1: the wrong way reports more time)."""
    demos = results.get("honesty") or {}
    if not demos or any("error" in demos.get(topic, {}) for topic in HONESTY_TOPICS if topic in demos):
        return [NO_DEMOS]
    w, a, m, l2, c, z = (demos[topic] for topic in HONESTY_TOPICS)
    rows = [("timing the first call (warm-up)", w["numba_kernel_first_ms"] / w["numba_kernel_steady_median_ms"],
             "numba kernel"),
            ("", w["sdpa_first_ms"] / w["sdpa_steady_median_ms"], "SDPA at a new shape"),
            ("a CPU timer without synchronize", a["cpu_timer_no_sync_ms"] / a["cuda_events_ms"], "SDPA"),
            ("the mean instead of the median", m["mean_ms"] / m["median_ms"], f"{m['n']} samples"),
            ("a warm L2 instead of a flushed one", l2["sdpa_warm_ms"] / l2["sdpa_flushed_ms"], "SDPA, short call"),
            ("", l2["copy_flushed_gbps"] / l2["copy_warm_gbps"], "a 16 MiB copy"),
            ("timing right after idle (clocks)", c["first5_median_ms"] / c["last20_median_ms"], "first 5 calls vs the last 20"),
            ("zeros instead of random inputs", z["matmul_zeros_ms"] / z["matmul_random_ms"], "fp16 matmul"),
            ("", z["sdpa_zeros_ms"] / z["sdpa_random_ms"], "SDPA")]
    return [f"{mistake:36s} {factor:>10,.2f}x   ({what})" for mistake, factor, what in rows]


# ----------------------------------------------------------------------------------------------
# The two flushes and the two clocks (a committed history file; the dashboard lesson)
# ----------------------------------------------------------------------------------------------

TIMING_MODES = ("write", 0.0), ("write", 300.0), ("read", 0.0), ("read", 300.0)  # (flush_mode, hold_us)
MODE_NAMES = {("write", 0.0): "zeroing flush, host time in the window",
              ("write", 300.0): "zeroing flush, device time",
              ("read", 0.0): "reading flush, host time in the window",
              ("read", 300.0): "reading flush, device time (the benchmark's)"}


def timing_modes(path) -> dict:
    """A timing-modes file (``results/decode/history/timing_modes_*.json``) as {"gpu", "date", "commit",
    "rows": {(call, B, H, Hk, Lk, D): {(flush_mode, hold_us): median_ms}}}."""
    import json
    from pathlib import Path

    data = json.loads(Path(path).read_text())
    rows = {}
    for r in data["records"]:
        rows.setdefault((r["call"], r["B"], r["H"], r["Hk"], r["Lk"], r["D"]), {})[(r["flush_mode"], r["hold_us"])] = \
            r["median_ms"]
    env = data["environment"]
    return {"gpu": env.get("gpu"), "date": env.get("date"), "commit": env.get("git_commit"), "rows": rows}


def timing_modes_lines(modes: dict, Hk: int) -> list:
    """One line per call and shape with Hk KV heads: its median under each of the four ways (µs)."""
    lines = [f"{modes['gpu']}, {modes['date']}, commit {modes['commit']}: median µs of one call, timed four ways",
             "(host: nothing queued before the call; device: a 300 µs sleeping kernel queued first)",
             f"{'call, shape':34s}" + "".join(f"{h:>17s}" for h in ("zeroing, host", "zeroing, device",
                                                                     "reading, host", "reading, device"))]
    for (call, B, H, Hk_, Lk, D), times in sorted(modes["rows"].items(), key=lambda kv: (kv[0][0] != "wb.decode", kv[0])):
        if Hk_ == Hk:
            lines.append(f"{call + f' B{B} H{H} Hk{Hk_} Lk{Lk} D{D}':34s}"
                         + "".join(f"{times[m] * 1e3:17.1f}" for m in TIMING_MODES))
    return lines


def timing_modes_figure(modes: dict, Hk: int):
    """Bars: each call and shape with Hk KV heads, its median under each of the four ways."""
    import numpy as np

    from ..plots import new_figure

    rows = [(key, times) for key, times in sorted(modes["rows"].items(), key=lambda kv: (kv[0][0] != "wb.decode", kv[0]))
            if key[3] == Hk]
    fig, ax = new_figure()
    width = 0.2
    colors = ("#d62728", "#ff9896", "#1f77b4", "#2ca02c")
    for i, mode in enumerate(TIMING_MODES):
        ax.bar(np.arange(len(rows)) + (i - 1.5) * width, [t[mode] * 1e3 for _, t in rows], width, color=colors[i],
               label=MODE_NAMES[mode])
    ax.set_xticks(np.arange(len(rows)), [f"{k[0]}\nB{k[1]} Lk{k[4]}" for k, _ in rows], fontsize=8)
    ax.set(ylabel="median µs", title=f"one call timed four ways ({modes['gpu']}, Hk={Hk})")
    ax.set_ylim(0, 1.5 * max(t[m] for _, t in rows for m in TIMING_MODES) * 1e3)  # room for the legend
    ax.legend(fontsize=7, loc="upper left", ncols=2)
    return fig


def demos_path():
    """The newest committed GPU results file that holds the honesty demonstrations (``--preset honesty``), or None:
    the dashboard lesson reads them from there, whichever run the rest of the lesson reads."""
    from .results import RESULTS_DIR

    return newest_matching(RESULTS_DIR, "*.json", lambda data: bool(data.get("honesty"))
                           and (data.get("environment") or {}).get("backend") == "gpu")
