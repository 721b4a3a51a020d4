"""Figures from a benchmark results file (the dashboard lesson, and ``python -m wb_kernels.bench --figures``).

Every function takes the results dict (:func:`wb_kernels.bench.load_results`) and a *view*: which
dtype, head dim and masking to show, ``{"dtype": "float16", "D": 128, "causal": False}``. The
x axis is the sequence length; each contender is one line, in the colors of
:data:`wb_kernels.plots.STAGE_COLORS`. Nothing here measures anything: a figure only shows what
the file holds, so a laptop draws the GPU's figures.

A decode results file (``--preset decode``) has one figure of its own, :func:`decode_figure`: GB/s against the
cache's length Lk, one line per contender, for the bar's shapes.
"""

from __future__ import annotations

from pathlib import Path

from ..plots import STAGE_COLORS, new_figure, save

__all__ = ["views", "default_view", "series", "draw_latency", "draw_throughput", "draw_memory", "draw_speedup",
           "draw_roofline", "latency_figure", "throughput_figure", "memory_figure", "speedup_figure",
           "roofline_figure", "dashboard_figure", "roofline_point", "roofline_points_figure", "ROOFLINE_VIEW",
           "save_all", "FIGURE_NAMES", "decode_families",
           "draw_decode_bandwidth", "decode_figure", "save_decode_figures", "DECODE_FIGURE_NAME"]

FIGURE_NAMES = ("bench_latency", "bench_throughput", "bench_memory", "bench_speedup", "bench_roofline",
                "bench_dashboard")
_DTYPE_ORDER = {"float16": 0, "bfloat16": 1, "float32": 2, "float64": 3}
_BASELINE_STYLE = {"sdpa": "-", "sdpa-flash": "--", "sdpa-efficient": "-.", "sdpa-cudnn": ":", "sdpa-math": "--",
                   "torch-eager": ":", "flex": "-.", "flash_attn": "-", "vllm": "-.", "flashinfer-fa2": "--",
                   "flashinfer-fa3": "-", "flashinfer": "--", "flashinfer-tc": "-"}
_BASELINE_COLORS = {"sdpa": STAGE_COLORS.get("sdpa", "#9467bd"), "sdpa-flash": "#8c564b", "sdpa-efficient": "#e377c2",
                    "sdpa-cudnn": "#17becf", "sdpa-math": "#c49c94", "torch-eager": STAGE_COLORS.get("torch", "#bcbd22"),
                    "flex": "#e7ba52", "flash_attn": "#000000", "vllm": "#aec7e8",
                    # FlashInfer (vLLM's and SGLang's attention): one green, two line styles for its two kernels
                    "flashinfer-fa2": "#31a354", "flashinfer-fa3": "#31a354", "flashinfer": "#31a354",
                    "flashinfer-tc": "#31a354"}


def _color(name: str) -> str:
    return _BASELINE_COLORS.get(name) or STAGE_COLORS.get(name, "#333333")


def _linestyle(record_kind: str, name: str) -> str:
    return "-" if record_kind == "stage" else _BASELINE_STYLE.get(name, "--")


def _ok(results):
    return [r for r in results["records"] if r.get("status") == "ok"]


def views(results) -> list:
    """Every (dtype, D, causal) the file has timings for, as view dicts, most contenders first."""
    groups = {}
    for r in _ok(results):
        groups.setdefault((r["dtype"], r["D"], r["causal"]), set()).add(r["contender"])
    ordered = sorted(groups, key=lambda g: (-len(groups[g]), _DTYPE_ORDER.get(g[0], 9), -g[1], g[2]))
    return [{"dtype": d, "D": D, "causal": c} for d, D, c in ordered]


def default_view(results) -> dict:
    found = views(results)
    if not found:
        raise ValueError("the results file holds no timed measurement to draw")
    return found[0]


def series(results, view) -> dict:
    """{contender: [record, ...] sorted by L} for the view. Where one L was measured at several
    batch sizes, the one with the most tokens (B*L) is kept."""
    chosen = {}
    for r in _ok(results):
        if (r["dtype"], r["D"], r["causal"]) != (view["dtype"], view["D"], view["causal"]):
            continue
        key = (r["contender"], r["Lq"])
        if key not in chosen or r["B"] * r["Lq"] * r["H"] > chosen[key]["B"] * chosen[key]["Lq"] * chosen[key]["H"]:
            chosen[key] = r
    out = {}
    for (name, _), r in sorted(chosen.items(), key=lambda item: item[0][1]):
        out.setdefault(name, []).append(r)
    order = [r["contender"] for r in results["records"]]
    return dict(sorted(out.items(), key=lambda item: (item[1][0]["kind"] != "stage", order.index(item[0]))))


def _title(view, what) -> str:
    return f"{what} - {view['dtype']}, D={view['D']}{', causal' if view['causal'] else ''}"


def _log2_lengths(ax, data):
    lengths = sorted({r["Lq"] for rs in data.values() for r in rs})
    ax.set_xscale("log", base=2)
    if lengths:
        ax.set_xticks(lengths, [str(L) if L < 1024 else f"{L // 1024}k" for L in lengths])
    ax.set_xlabel("sequence length L")


def _highlight(ax, highlight_L):
    if highlight_L is not None:
        ax.axvline(highlight_L, color="#999999", linewidth=0.8, zorder=0)


def _draw_lines(ax, data, value, highlight_L=None):
    for name, rs in data.items():
        points = [(r["Lq"], value(r)) for r in rs if value(r) is not None]
        if points:
            xs, ys = zip(*points)
            ax.plot(xs, ys, marker="o", markersize=3, color=_color(name), linestyle=_linestyle(rs[0]["kind"], name),
                    label=name)
            flagged = [(r["Lq"], value(r)) for r in rs if r.get("check_failed") and value(r) is not None]
            if flagged:  # timed although outside the check tolerance (--time-failed-checks): crossed out
                fx, fy = zip(*flagged)
                ax.plot(fx, fy, marker="x", markersize=8, linestyle="none", color=_color(name))
    _log2_lengths(ax, data)
    _highlight(ax, highlight_L)


def draw_latency(ax, results, view, highlight_L=None):
    data = series(results, view)
    _draw_lines(ax, data, lambda r: r["median_ms"], highlight_L)
    for name, rs in data.items():  # the spread: interquartile range around the median
        ax.fill_between([r["Lq"] for r in rs], [max(r["median_ms"] - r["iqr_ms"] / 2, 1e-6) for r in rs],
                        [r["median_ms"] + r["iqr_ms"] / 2 for r in rs], color=_color(name), alpha=0.15, linewidth=0)
    ax.set_yscale("log")
    ax.set_ylabel("median latency (ms)")
    ax.set_title(_title(view, "latency"))


def draw_throughput(ax, results, view, highlight_L=None):
    _draw_lines(ax, series(results, view), lambda r: r["tflops"], highlight_L)
    ax.set_yscale("log")
    ax.set_ylabel("TFLOP/s")
    ax.set_title(_title(view, "throughput"))


def draw_memory(ax, results, view, highlight_L=None):
    data = series(results, view)
    _draw_lines(ax, data, lambda r: r["peak_bytes"] / 2**20 if r.get("peak_bytes") else None, highlight_L)
    for name, rs in data.items():  # what the stage's own formula predicts, dotted
        analytic = [(r["Lq"], r["workspace_bytes"] / 2**20) for r in rs if r.get("workspace_bytes")]
        if analytic:
            xs, ys = zip(*analytic)
            ax.plot(xs, ys, color=_color(name), linestyle=":", linewidth=1)
    ax.set_yscale("log")
    ax.set_ylabel("peak memory beyond inputs (MiB)")
    ax.set_title(_title(view, "memory (dotted: analytic workspace)"))


def draw_speedup(ax, results, view, baseline="sdpa", highlight_L=None):
    data = {name: rs for name, rs in series(results, view).items() if name != baseline}
    _draw_lines(ax, data, lambda r: r.get("speedup_vs", {}).get(baseline), highlight_L)
    ax.axhline(1.0, color=_color(baseline), linewidth=1)
    ax.set_yscale("log")
    ax.set_ylabel(f"speed-up vs {baseline} (>1: faster)")
    ax.set_title(_title(view, f"speed-up over {baseline}"))


def _ceilings_for(results, dtype):
    ceilings = results.get("ceilings") or {}
    peak = ceilings.get(f"{dtype}_matmul_tflops")
    bandwidth = ceilings.get("copy_gbps")
    return peak, bandwidth


def draw_roofline(ax, results, view, highlight_L=None):
    """Achieved TFLOP/s against arithmetic intensity (FLOPs per byte of q, k, v and output), under
    the matmul peak and copy bandwidth measured in the same run."""
    import numpy as np

    data = series(results, view)
    xs_all = [r["intensity"] for rs in data.values() for r in rs]
    for name, rs in data.items():
        ax.plot([r["intensity"] for r in rs], [r["tflops"] for r in rs], marker="o", markersize=3,
                linestyle="none" if len(rs) == 1 else _linestyle(rs[0]["kind"], name), color=_color(name), label=name)
        if highlight_L is not None:
            hit = [r for r in rs if r["Lq"] == highlight_L]
            if hit:
                ax.plot([hit[0]["intensity"]], [hit[0]["tflops"]], marker="o", markersize=7, markerfacecolor="none",
                        color=_color(name))
    peak, bandwidth = _ceilings_for(results, view["dtype"])
    if peak and bandwidth and xs_all:
        x = np.geomspace(min(min(xs_all) / 4, 1.0), max(xs_all) * 4, 200)
        roof = np.minimum(peak, bandwidth * 1e9 * x / 1e12)
        ax.plot(x, roof, color="#444444", linewidth=1.2)
        ax.annotate(f"{view['dtype']} matmul {peak:.0f} TFLOP/s", (x[-1], peak), ha="right", va="bottom", fontsize=8)
        ax.annotate(f"copy {bandwidth:.0f} GB/s", (x[0], roof[0]), ha="left", va="bottom", fontsize=8, rotation=0)
    else:
        ax.text(0.02, 0.98, "no ceilings measured in this run (GPU runs measure them)", transform=ax.transAxes,
                va="top", fontsize=8)
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("arithmetic intensity (FLOP per byte of q, k, v, out)")
    ax.set_ylabel("TFLOP/s")
    ax.set_title(_title(view, "roofline"))


ROOFLINE_VIEW = {"dtype": "float16", "D": 128, "causal": False}  # the tensor-core stages' main view


def roofline_point(results, name, view=None) -> dict | None:
    """`name`'s point on the roofline at the longest L of `view` (default :data:`ROOFLINE_VIEW`): its arithmetic
    intensity, achieved TFLOP/s, the roof there (min(peak, bandwidth x intensity), both measured in the same run),
    the fraction of the roof reached and where the roof bends; None when the file did not time `name` there or
    measured no ceilings."""
    view = view or ROOFLINE_VIEW
    rs = series(results, view).get(name)
    peak, bandwidth = _ceilings_for(results, view["dtype"])
    if not rs or not peak or not bandwidth:
        return None
    r = max(rs, key=lambda r: r["Lq"])
    roof = min(peak, bandwidth * 1e9 * r["intensity"] / 1e12)
    return {"name": name, "B": r["B"], "H": r["H"], "L": r["Lq"], "D": r["D"], "dtype": r["dtype"],
            "causal": r["causal"], "intensity": r["intensity"], "tflops": r["tflops"], "median_ms": r["median_ms"],
            "peak": peak, "bandwidth": bandwidth, "bend": peak * 1e12 / (bandwidth * 1e9), "roof": roof,
            "fraction": r["tflops"] / roof}


def roofline_points_figure(results, names, view=None):
    """The roof of one run and the points of `names` (:func:`roofline_point`) on it, each labelled."""
    import numpy as np

    points = [p for p in (roofline_point(results, name, view) for name in names) if p is not None]
    fig, ax = new_figure()
    if not points:
        ax.text(0.02, 0.98, "none of these was timed in this file", transform=ax.transAxes, va="top")
        return fig
    peak, bandwidth = points[0]["peak"], points[0]["bandwidth"]
    x = np.geomspace(1.0, max(p["intensity"] for p in points) * 4, 200)
    ax.plot(x, np.minimum(peak, bandwidth * 1e9 * x / 1e12), color="#444444", linewidth=1.2)
    ax.axvline(points[0]["bend"], color="#999999", linestyle=":", linewidth=1)
    for p in points:
        ax.plot([p["intensity"]], [p["tflops"]], "o", color=_color(p["name"]),
                label=f"{p['name']}: {p['tflops']:.0f} TFLOP/s, {p['fraction']:.0%} of its roof")
    ax.set(xscale="log", yscale="log", xlabel="arithmetic intensity (FLOP per byte of q, k, v, out)",
           ylabel="TFLOP/s", title=f"B{points[0]['B']} H{points[0]['H']} L{points[0]['L']} D{points[0]['D']} "
                                   f"{points[0]['dtype']}: the roof bends at {points[0]['bend']:.0f} FLOP/byte")
    ax.legend(loc="lower right")
    return fig


def _single(draw, results, view, **kwargs):
    fig, ax = new_figure()
    draw(ax, results, view, **kwargs)
    if ax.get_legend_handles_labels()[0]:
        ax.legend(loc="best", ncols=2)
    return fig


def latency_figure(results, view=None, **kwargs):
    return _single(draw_latency, results, view or default_view(results), **kwargs)


def throughput_figure(results, view=None, **kwargs):
    return _single(draw_throughput, results, view or default_view(results), **kwargs)


def memory_figure(results, view=None, **kwargs):
    return _single(draw_memory, results, view or default_view(results), **kwargs)


def speedup_figure(results, view=None, **kwargs):
    return _single(draw_speedup, results, view or default_view(results), **kwargs)


def roofline_figure(results, view=None, **kwargs):
    return _single(draw_roofline, results, view or default_view(results), **kwargs)


def dashboard_figure(results, view=None, highlight_L=None):
    """Latency, throughput, memory, speed-up and roofline of one view on one figure (2 x 3)."""
    view = view or default_view(results)
    fig, axes = new_figure(ncols=3, nrows=2, width=15, height=7.5)
    draw_latency(axes[0, 0], results, view, highlight_L)
    draw_throughput(axes[0, 1], results, view, highlight_L)
    draw_roofline(axes[0, 2], results, view, highlight_L)
    draw_memory(axes[1, 0], results, view, highlight_L)
    draw_speedup(axes[1, 1], results, view, highlight_L=highlight_L)
    legend_ax = axes[1, 2]
    legend_ax.axis("off")
    handles, labels = axes[0, 0].get_legend_handles_labels()
    if handles:
        legend_ax.legend(handles, labels, loc="upper left", title="contenders (solid: this package's stages)")
    env = results.get("environment", {})
    legend_ax.text(0.0, 0.05, f"{env.get('gpu') or env.get('device')}\n{env.get('date', '')[:10]}, torch "
                              f"{env.get('torch')}, CUDA {env.get('cuda')}", transform=legend_ax.transAxes,
                   fontsize=9, va="bottom")
    return fig


def save_all(results, view=None, prefix: str = "bench", directory=None) -> list:
    """Write <prefix>_{latency,throughput,memory,speedup,roofline,dashboard}.png into figures/ (or
    `directory`); return the paths. A decode results file gets its own figure (:func:`save_decode_figures`)."""
    if results.get("kind") == "decode":
        return save_decode_figures(results, directory)
    view = view or default_view(results)
    figures = {"latency": latency_figure, "throughput": throughput_figure, "memory": memory_figure,
               "speedup": speedup_figure, "roofline": roofline_figure, "dashboard": dashboard_figure}
    return [_save(make(results, view), f"{prefix}_{name}", directory) for name, make in figures.items()]


def _save(fig, name: str, directory=None) -> Path:
    """figures/<name>.png (:func:`wb_kernels.plots.save`), or <directory>/<name>.png."""
    from ..plots import style

    if directory is None:
        return Path(save(fig, name))
    path = Path(directory) / f"{name}.png"
    path.parent.mkdir(parents=True, exist_ok=True)
    with style():
        fig.savefig(path, metadata={"Software": None})
    return path


# ----------------------------------------------------------------------------------------------
# Decode (a file of the decode presets)
# ----------------------------------------------------------------------------------------------

DECODE_FIGURE_NAME = "bench_decode_bandwidth"
_DECODE_COLORS = {"wb.decode": "#c51b7d", "decode_forward": "#e6550d", "copy": "#444444"}


def decode_families(results) -> list:
    """The (dtype, D, H, Hk, B) groups the decode figure draws, one panel each: the bar shapes' groups the file
    timed, else the two groups with the most timed lengths."""
    from .sweeps import DECODE_BAR

    lengths = {}
    for r in _ok(results):
        lengths.setdefault((r["dtype"], r["D"], r["H"], r["Hk"], r["B"]), set()).add(r["Lk"])
    bar = [(dtype, D, H, Hk, B) for B, H, Hk, _, D, dtype in DECODE_BAR if (dtype, D, H, Hk, B) in lengths]
    return bar or sorted(lengths, key=lambda group: -len(lengths[group]))[:2]


def draw_decode_bandwidth(ax, results, family):
    """GB/s of K and V read once against Lk for one (dtype, D, H, Hk, B): a line per contender and layout, the copy
    of the same bytes (the ceiling, counted as read + write) in gray."""
    dtype, D, H, Hk, B = family
    lines = {}
    for r in _ok(results):
        if (r["dtype"], r["D"], r["H"], r["Hk"], r["B"]) == family:
            lines.setdefault((r["contender"], r["layout"]), []).append(r)
    order = {"stage": 0, "baseline": 1, "ceiling": 2}
    first = {}  # the run's order: this package's contenders, contiguous then paged, then PyTorch's, then the copy
    for n, r in enumerate(results["records"]):
        first.setdefault((r["contender"], r.get("layout")), n)
    for (name, layout), rs in sorted(lines.items(), key=lambda item: (order[item[1][0]["kind"]], first[item[0]])):
        rs.sort(key=lambda r: r["Lk"])
        kind = rs[0]["kind"]
        style = {"color": _DECODE_COLORS.get(name) or _color(name), "marker": "o", "markersize": 3,
                 "linestyle": "-" if kind == "stage" else _BASELINE_STYLE.get(name, "--")}
        if layout == "paged":
            style.update(linestyle="--", marker="s")
        if kind == "ceiling":
            style.update(linestyle="-", linewidth=2.5, alpha=0.5)
        label = (name + (", paged" if layout == "paged" else "")
                 + (" (ceiling: read + write)" if kind == "ceiling" else ""))
        ax.plot([r["Lk"] for r in rs], [r["gbps"] for r in rs], label=label, **style)
        flagged = [r for r in rs if r.get("check_failed")]
        if flagged:  # timed although outside the check tolerance: crossed out
            ax.plot([r["Lk"] for r in flagged], [r["gbps"] for r in flagged], marker="x", markersize=8,
                    linestyle="none", color=style["color"])
    lengths = sorted({r["Lk"] for rs in lines.values() for r in rs})
    ax.set_xscale("log", base=2)
    if lengths:
        ax.set_xticks(lengths, [str(L) if L < 1024 else f"{L // 1024}k" for L in lengths])
    ax.set_ylim(bottom=0)
    ax.set_xlabel("cached keys per sequence Lk")
    ax.set_ylabel("GB/s of K and V read once")
    ax.set_title(f"decode B={B} H={H} Hk={Hk} D={D} {dtype}")


def decode_figure(results):
    """GB/s against Lk for the bar's shapes (:func:`decode_families`), one panel each, on one figure."""
    families = decode_families(results)
    if not families:
        raise ValueError("the results file holds no timed decode measurement to draw")
    fig, axes = new_figure(ncols=len(families), width=6.5 * len(families), height=4.5)
    axes = list(axes) if len(families) > 1 else [axes]
    for ax, family in zip(axes, families):
        draw_decode_bandwidth(ax, results, family)
    axes[-1].legend(loc="best", fontsize=8)
    env = results.get("environment", {})
    fig.suptitle(f"{env.get('gpu') or env.get('device')}, {env.get('date', '')[:10]}, torch {env.get('torch')}",
                 fontsize=9)
    return fig


def save_decode_figures(results, directory=None) -> list:
    """Write figures/bench_decode_bandwidth.png (or into `directory`); return the paths."""
    return [_save(decode_figure(results), DECODE_FIGURE_NAME, directory)]
