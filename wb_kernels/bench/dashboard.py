"""The dashboard lesson's widget: pick head dim, dtype, masking and sequence length; the figures follow.

Plain functions over a results file (:mod:`wb_kernels.bench.results`), tested by pytest; the notebook
only calls :func:`dashboard_widget`, which wires them to ipywidgets. Lesson 03 reads its speed-ups
from :func:`committed_results_path` too. The figures are :mod:`wb_kernels.bench.figures`; the
honesty demonstrations' lines and figure are :mod:`wb_kernels.bench.pitfalls`.
"""

from __future__ import annotations

from pathlib import Path

from .figures import dashboard_figure, roofline_point, series, views
from .results import REPO_ROOT, committed_decode_results, committed_results, load_results, same_timing, timing_method

__all__ = ["committed_results_path", "load", "choices", "lengths", "summary_rows", "draw", "dashboard_widget",
           "MMA_RESULTS", "RUNG_RESULTS", "overview_sources", "overview_lines"]

# The mma preset's own run (lesson 06's file): where the mma rung's prefill numbers are until a full run holds them.
MMA_RESULTS = REPO_ROOT / "results" / "mma" / "bench_h100.json"
# The rungs' own runs, read for the overview when the newest full run did not time the rung: the mma preset's, and the
# hopper-bar preset's (sweeps.RUNG_PRESETS), each on the H100.
RUNG_RESULTS = {"mma": MMA_RESULTS, "hopper": REPO_ROOT / "results" / "hopper" / "bench_h100.json"}


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
# Every stage in one table: the prefill rungs and decode, from files that must agree on how they timed
# ----------------------------------------------------------------------------------------------

def overview_sources() -> dict:
    """{path relative to the repository: results} for the ladder overview: the newest committed GPU benchmark file,
    a rung's own file (RUNG_RESULTS) when that one holds no timing of the rung, and the newest decode benchmark
    file."""
    files = {}
    path = committed_results("gpu")
    if path is not None:
        files[path] = load_results(path)
    for rung, own in RUNG_RESULTS.items():
        if not any(r.get("contender") == rung and r.get("status") == "ok" for f in files.values()
                   for r in f["records"]) and own.exists():
            files[own] = load_results(own)
    decode = committed_decode_results()
    if decode is not None:
        files[decode] = load_results(decode)
    return {str(path.relative_to(REPO_ROOT)): results for path, results in files.items()}


def _prefill_row(name, results, source):
    """A prefill stage's best point of a file: its highest TFLOP/s over every configuration it timed."""
    timed = [r for r in results["records"] if r.get("contender") == name and r.get("status") == "ok"
             and r.get("tflops") is not None]
    if not timed:
        return None
    r = max(timed, key=lambda r: r["tflops"])
    view = {"dtype": r["dtype"], "D": r["D"], "causal": r["causal"]}
    point = roofline_point(results, name, view)
    kv_heads = f" Hk{r['Hk']}" if r.get("Hk", r["H"]) != r["H"] else ""
    where = f"{r['dtype']} B{r['B']} H{r['H']}{kv_heads} L{r['Lq']} D{r['D']}{' causal' if r['causal'] else ''}"
    roof = f"{r['tflops'] / min(point['peak'], point['bandwidth'] * 1e9 * r['intensity'] / 1e12):.0%} of roof" \
        if point else "no ceilings"
    return {"stage": name, "source": source, "problem": where, "value": f"{r['tflops']:.0f} TFLOP/s", "roof": roof}


def _decode_rows(results, source):
    from .sweeps import DECODE_BAR

    rows = []
    for B, H, Hk, Lk, D, dtype in DECODE_BAR:
        r = next((r for r in results["records"] if r.get("contender") == "wb.decode" and r.get("layout") ==
                  "contiguous" and r.get("status") == "ok" and (r["B"], r["H"], r["Hk"], r["Lk"], r["D"], r["dtype"])
                  == (B, H, Hk, Lk, D, dtype)), None)
        if r is not None:
            rows.append({"stage": "decode", "source": source, "problem": f"{dtype} B{B} H{H} Hk{Hk} Lk{Lk} D{D}",
                         "value": f"{r['gbps']:.0f} GB/s",
                         "roof": f"{r['fraction_of_copy']:.0%} of copy" if r.get("fraction_of_copy") else "–"})
    return rows


def overview_lines(files: dict, label: bool = False) -> list:
    """One line per rung of the ladder (naive ... hopper: its best TFLOP/s and the fraction of its roof; decode: its
    GB/s at the bar's shapes and the fraction of the copy ceiling), each from the first of `files` ({name: results},
    :func:`overview_sources`) that timed it, with the file it came from.

    The files must have been timed the same way (:func:`wb_kernels.bench.results.same_timing`): otherwise this
    raises :class:`~wb_kernels.bench.results.MixedTiming`, unless ``label=True``, where every line names how its
    file was timed instead, and the table is headed as not one comparison."""
    if not label:
        method = same_timing(files)
        head = [f"every rung, timed one way: {method.label()}"]
    else:
        head = ["NOT one comparison: each line is timed as its file was (the last column)"]
    rows = []
    stages = [name for name in ("naive", "tiled", "flash", "wmma", "mma", "hopper")]
    for name in stages:
        row = next((row for source, results in files.items() if results.get("kind") != "decode"
                    for row in [_prefill_row(name, results, source)] if row), None)
        if row:
            rows.append(row)
    for source, results in files.items():
        if results.get("kind") == "decode":
            rows += _decode_rows(results, source)
            break
    lines = head + [f"{'rung':7s} {'best problem in its file':40s} {'rate':>14s} {'':>13s}  file"]
    for row in rows:
        method = timing_method(files[row["source"]])
        lines.append(f"{row['stage']:7s} {row['problem']:40s} {row['value']:>14s} {row['roof']:>13s}  {row['source']}"
                     + (f"  [{method.label() if method else 'no GPU'}]" if label else ""))
    return lines
