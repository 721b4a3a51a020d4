"""One plot style for every lesson (01-10) and the benchmark, and saving into ``figures/``; and the picture of
the two causal alignments that ``wb.attention``'s docstring describes (:func:`causal_alignment_figure`).

PNG files are written without timestamps or software versions in their metadata, so re-running a
lesson that draws the same figure leaves the committed file unchanged.
"""

from __future__ import annotations

import os
from contextlib import contextmanager
from pathlib import Path

import matplotlib

__all__ = ["STYLE", "STAGE_COLORS", "style", "new_figure", "save", "figures_dir", "causal_alignment_figure"]

STYLE = {
    "figure.dpi": 100,
    "savefig.dpi": 110,
    "figure.figsize": (6.4, 3.6),
    "axes.grid": True,
    "grid.alpha": 0.3,
    "axes.spines.top": False,
    "axes.spines.right": False,
    "axes.titlesize": 11,
    "axes.labelsize": 10,
    "legend.fontsize": 9,
    "legend.frameon": False,
    "font.size": 10,
    "svg.hashsalt": "waveboost",
}

# One color per stage (and baseline) everywhere, so a reader learns them once.
STAGE_COLORS = {
    "reference": "#7f7f7f",
    "numpy": "#7f7f7f",
    "torch": "#bcbd22",
    "naive": "#d62728",
    "tiled": "#ff7f0e",
    "flash": "#2ca02c",
    "wmma": "#1f77b4",
    "mma": "#393b79",
    "hopper": "#843c39",
    "sdpa": "#9467bd",
}


@contextmanager
def style():
    """``with style(): ...`` draws in the project's style without changing global settings."""
    with matplotlib.rc_context(STYLE):
        yield


def new_figure(ncols: int = 1, nrows: int = 1, width: float | None = None, height: float | None = None):
    """A figure in the project's style: (fig, axes). Not attached to pyplot, so nothing leaks
    between slider updates; display it by returning it from a cell or with IPython.display."""
    from matplotlib.figure import Figure

    w, h = STYLE["figure.figsize"]
    with style():
        fig = Figure(figsize=(width or w * ncols, height or h * nrows), dpi=STYLE["figure.dpi"],
                     layout="constrained")
        axes = fig.subplots(nrows, ncols)
    return fig, axes


def figures_dir() -> Path:
    """Where figures go: $WB_FIGURES_DIR if set (the tests point it away from the committed
    figures), else the repository's figures/ folder (next to the package), else ./figures."""
    repo = Path(__file__).resolve().parent.parent
    if os.environ.get("WB_FIGURES_DIR"):
        target = Path(os.environ["WB_FIGURES_DIR"])
    else:
        target = repo / "figures" if (repo / "pyproject.toml").exists() else Path.cwd() / "figures"
    target.mkdir(parents=True, exist_ok=True)
    return target


def save(fig, name: str) -> Path:
    """Save `fig` as figures/<name>.png with reproducible metadata; returns the path."""
    path = figures_dir() / f"{name}.png"
    with style():
        fig.savefig(path, metadata={"Software": None})
    return path


def causal_alignment_figure(Lq: int, Lk: int):
    """Two panels of the (Lq, Lk) grid, the pairs (query i, key j) a causal mask allows: top-left alignment (SDPA's
    ``is_causal``, j <= i) beside bottom-right (flash-attn's, j <= i + Lk - Lq). Rows that see no key are marked."""
    from matplotlib.colors import ListedColormap
    from matplotlib.ticker import MaxNLocator

    from .reference import CAUSAL_ALIGNMENTS, attention_mask, causal_offset

    fig, axes = new_figure(ncols=2, width=2 * min(6.0, 2.0 + 0.25 * Lk), height=min(6.0, 2.2 + 0.25 * Lq))
    for ax, alignment in zip(axes, CAUSAL_ALIGNMENTS):
        allowed = attention_mask(Lq, Lk, alignment)[0, 0]
        ax.imshow(allowed, cmap=ListedColormap(["#f0f0f0", STAGE_COLORS["flash"]]), vmin=0, vmax=1, aspect="auto",
                  extent=(-0.5, Lk - 0.5, Lq - 0.5, -0.5))
        blind = [row for row in range(Lq) if not allowed[row].any()]  # rows that see no key: zeros, LSE -inf
        for row in blind:
            ax.axhspan(row - 0.5, row + 0.5, color=STAGE_COLORS["naive"], alpha=0.25, lw=0)
        offset = causal_offset(alignment, Lq, Lk)
        title = f"{alignment}: j <= i" + (f" {'+' if offset > 0 else '-'} {abs(offset)}" if offset else "")
        if blind:
            title += f"\n{len(blind)} row{'s' if len(blind) > 1 else ''} see no key (red)"
        ax.set(title=title, xlabel=f"key j (Lk = {Lk})", ylabel=f"query i (Lq = {Lq})")
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.yaxis.set_major_locator(MaxNLocator(integer=True))
        ax.grid(False)
    return fig
