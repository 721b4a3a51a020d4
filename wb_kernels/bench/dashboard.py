"""Lesson 08's dashboard: pick head dim, dtype, masking and sequence length; the figures follow.

Plain functions over a results file (:mod:`wb_kernels.bench.results`), tested by pytest; the notebook
only calls :func:`dashboard_widget`, which wires them to ipywidgets. Lesson 03 reads its speed-ups
from :func:`committed_results_path` too. The figures are :mod:`wb_kernels.bench.figures`; the
honesty demonstrations' lines and figure are :mod:`wb_kernels.bench.pitfalls`.
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
