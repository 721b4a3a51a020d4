"""The decoder's steps on the roofline: bytes each step must read against the time it took, beside the copy ceiling
(lesson 07_decode, the README's figure; the rows come from ``decoder_tokens``' results file).

A decode step reads every weight once and the KV cache of every sequence; at the copy bandwidth measured in the same
run that takes ``bytes / bandwidth``: the line every marker sits on or above. A marker's height over the line is
how far the step is from its roofline (its ``fraction_of_roofline`` is line / marker), its place along the line what
it must read (batch and context). Plain functions of a results dict: :func:`roofline_points` (the numbers) and
:func:`roofline_chart` (a matplotlib Figure), tested on the CPU with results made up in the test.
"""

from __future__ import annotations

__all__ = ["roofline_points", "roofline_chart", "contender_label", "roofline_summary"]

# one color per contender (mode, layout, attend), one marker per batch
_MODE_WORDS = {"eager": "eager", "graph": "CUDA graph", "compile": "torch.compile"}
_BATCH_MARKERS = ("o", "s", "^", "D", "v", "P", "X", "*")


def contender_label(row: dict) -> str:
    """``"CUDA graph, wb, paged"``: how the chart and the summary name a row's contender."""
    return f"{_MODE_WORDS.get(row.get('mode', 'eager'), row.get('mode'))}, {row['attend']}, {row['layout']}"


def roofline_points(results: dict, *, config: str | None = None) -> list:
    """The timed rows of a decoder results file as points: dicts with ``label`` (the contender), ``batch``,
    ``context``, ``bytes_per_step``, ``ms_per_step``, ``roofline_ms`` and ``fraction`` (roofline over measured).
    Rows of other configs than `config` (default: every config), and rows not timed, are left out. Files written
    before the sweep (no ``mode``, the bytes under ``roofline``) read as eager rows."""
    points = []
    for row in results.get("records", []):
        if row.get("status") != "ok" or (config is not None and row.get("config") != config):
            continue
        roofline = row.get("roofline") or {}
        bytes_per_step = row.get("bytes_per_step", roofline.get("bytes_per_step"))
        if bytes_per_step is None:
            continue
        points.append({"label": contender_label(row), "config": row.get("config"), "batch": row["batch"],
                       "context": row["context"], "bytes_per_step": bytes_per_step, "ms_per_step": row["ms_per_step"],
                       "roofline_ms": roofline.get("step_ms"), "fraction": row.get("fraction_of_roofline")})
    return points


def roofline_summary(results: dict, *, config: str | None = None) -> list:
    """One line per contender: its best and worst fraction of the roofline, at which (batch, context)."""
    by_label = {}
    for point in roofline_points(results, config=config):
        if point["fraction"] is not None:
            by_label.setdefault(point["label"], []).append(point)
    lines = []
    for label, points in by_label.items():
        best = max(points, key=lambda p: p["fraction"])
        worst = min(points, key=lambda p: p["fraction"])
        lines.append(f"{label}: {100 * best['fraction']:.0f} % of the roofline at best (B={best['batch']}, "
                     f"context {best['context']}), {100 * worst['fraction']:.0f} % at worst (B={worst['batch']}, "
                     f"context {worst['context']}), {len(points)} rows")
    return lines


def roofline_chart(results: dict, *, config: str | None = "llama_1b", title: str | None = None):
    """Bytes per step against milliseconds per step, log-log: the copy ceiling's line (bytes / the run's copy
    bandwidth), one marker per row (color: contender; shape: batch). Returns the Figure."""
    import matplotlib

    from ..plots import new_figure

    points = roofline_points(results, config=config)
    if not points and config is not None:
        points = roofline_points(results)  # a file of other models (the smoke run's TINY): draw what there is
    copy_gbps = (results.get("ceilings") or {}).get("copy_gbps")
    if not copy_gbps or copy_gbps <= 0:
        raise ValueError("roofline_chart: the results hold no copy bandwidth (ceilings.copy_gbps)")
    fig, ax = new_figure(width=8.0, height=5.0)
    if points:
        low = min(p["bytes_per_step"] for p in points) / 1.5
        high = max(p["bytes_per_step"] for p in points) * 1.5
    else:
        low, high = 1e6, 1e11
    ax.plot([low / 1e9, high / 1e9], [low / copy_gbps / 1e6, high / copy_gbps / 1e6], "k-", lw=1.2,
            label=f"copy ceiling, {copy_gbps:.0f} GB/s")
    labels = list(dict.fromkeys(p["label"] for p in points))
    batches = sorted({p["batch"] for p in points})
    # one color per contender: a sweep with FlashInfer and torch.compile has 13 of them, past the default cycle's 10
    palette = matplotlib.colormaps["tab20"]
    for index, label in enumerate(labels):
        color = palette(index % palette.N)
        for batch_index, batch in enumerate(batches):
            mine = [p for p in points if p["label"] == label and p["batch"] == batch]
            if mine:
                ax.plot([p["bytes_per_step"] / 1e9 for p in mine], [p["ms_per_step"] for p in mine],
                        _BATCH_MARKERS[batch_index % len(_BATCH_MARKERS)], color=color, markersize=6, alpha=0.85,
                        linestyle="none")
        ax.plot([], [], "o", color=color, label=label)
    for batch_index, batch in enumerate(batches):
        ax.plot([], [], _BATCH_MARKERS[batch_index % len(_BATCH_MARKERS)], color="black", markerfacecolor="none",
                label=f"batch {batch}")
    env = results.get("environment") or {}
    where = env.get("gpu") or env.get("device") or "an unnamed device"
    ax.set(xscale="log", yscale="log", xlabel="bytes per step (GB): weights + KV cache read",
           ylabel="time per step (ms)",
           title=title or f"Decode steps against the roofline ({config or 'every model'}, {where})")
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0), borderaxespad=0.0)  # beside the markers
    return fig
