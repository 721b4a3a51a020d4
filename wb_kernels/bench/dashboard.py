"""Lesson 06's dashboard: pick head dim, dtype, masking and sequence length; the figures follow.

Plain functions over a results file (:mod:`wb_kernels.bench.results`), tested by pytest; the notebook
only calls :func:`dashboard_widget`, which wires them to ipywidgets. Lesson 03 reads its speed-ups
from :func:`committed_results_path` too. The figures are :mod:`wb_kernels.bench.figures`.
"""

from __future__ import annotations

from pathlib import Path

from .figures import dashboard_figure, series, views
from .results import committed_results, load_results

__all__ = ["committed_results_path", "load", "choices", "lengths", "summary_rows", "draw", "dashboard_widget"]


def committed_results_path() -> Path | None:
    """The newest committed GPU results file; the simulator's smoke results when there is none yet."""
    return committed_results("gpu") or committed_results("simulator")


def load(path=None) -> dict:
    path = path or committed_results_path()
    if path is None:
        raise FileNotFoundError("no results file under results/: run `python -m wb_kernels.bench` first")
    return load_results(path)


def choices(results) -> dict:
    """What the controls offer: {"dtype": [...], "D": [...], "causal": [...]} from the timed records."""
    found = views(results)
    return {"dtype": sorted({v["dtype"] for v in found}, key=lambda d: ("float16", "bfloat16", "float32").index(d)
                             if d in ("float16", "bfloat16", "float32") else 9),
            "D": sorted({v["D"] for v in found}, reverse=True),
            "causal": sorted({v["causal"] for v in found})}


def lengths(results, dtype, D, causal) -> list:
    """Sequence lengths timed for that view (any contender)."""
    view = {"dtype": dtype, "D": D, "causal": causal}
    return sorted({r["Lq"] for rs in series(results, view).values() for r in rs})


def summary_rows(results, dtype, D, causal, L, baseline="sdpa") -> list:
    """One line per contender at length L: median, TFLOP/s, peak memory, speed-up vs `baseline`."""
    view = {"dtype": dtype, "D": D, "causal": causal}
    rows = []
    for name, rs in series(results, view).items():
        hit = [r for r in rs if r["Lq"] == L]
        if not hit:
            continue
        r = hit[0]
        speedup = r.get("speedup_vs", {}).get(baseline)
        rows.append(f"{name:>15s}: {r['median_ms']:9.3f} ms  {r['tflops']:8.2f} TFLOP/s  "
                    f"{(r.get('peak_bytes') or 0) / 2**20:9.1f} MiB"
                    + (f"  {speedup:6.2f}x {baseline}" if speedup is not None else ""))
    skipped = [r for r in results["records"] if r.get("status") != "ok" and (r["dtype"], r["D"], r["causal"], r["Lq"])
               == (dtype, D, causal, L)]
    rows += [f"{r['contender']:>15s}: {r['status']} ({r['reason'][:90]})" for r in skipped]
    return rows


def draw(results, dtype, D, causal, L=None):
    """The dashboard figure for one view, with length L marked."""
    available = [v for v in views(results) if (v["dtype"], v["D"], v["causal"]) == (dtype, D, causal)]
    if not available:
        raise ValueError(f"the results file has no timings for {dtype}, D={D}, causal={causal}; "
                         f"it has {[tuple(v.values()) for v in views(results)]}")
    return dashboard_figure(results, available[0], highlight_L=L)


def dashboard_widget(results):
    """Dropdowns for dtype, head dim and masking, a slider over L, the figure and a table below."""
    import ipywidgets as widgets
    from IPython.display import display

    options = choices(results)
    default = views(results)[0]
    dtype = widgets.Dropdown(options=options["dtype"], value=default["dtype"], description="dtype")
    head_dim = widgets.Dropdown(options=options["D"], value=default["D"], description="D")
    causal = widgets.ToggleButtons(options=[("full", False), ("causal", True)], value=default["causal"],
                                   description="mask")
    length = widgets.SelectionSlider(options=lengths(results, default["dtype"], default["D"], default["causal"]),
                                     description="L", continuous_update=False)
    output = widgets.Output()

    def redraw(change=None):
        available = lengths(results, dtype.value, head_dim.value, causal.value)
        with output:
            output.clear_output(wait=True)
            if not available:
                print(f"no timings for {dtype.value}, D={head_dim.value}, "
                      f"{'causal' if causal.value else 'full'} in this file")
                return
            if list(length.options) != available:
                length.options = available  # may fire redraw itself; drawing again below is harmless
            display(draw(results, dtype.value, head_dim.value, causal.value, length.value))
            print("\n".join(summary_rows(results, dtype.value, head_dim.value, causal.value, length.value)))

    for control in (dtype, head_dim, causal, length):
        control.observe(redraw, names="value")
    redraw()
    return widgets.VBox([widgets.HBox([dtype, head_dim, causal]), length, output])


# ----------------------------------------------------------------------------------------------
# The honest-benchmarking demonstrations, as lesson 06 prints and draws them from the file
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
                f"L2 cache of that GPU: {demo['l2_bytes'] / 2**20:.0f} MiB"]
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
