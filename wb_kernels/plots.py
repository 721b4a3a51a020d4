"""One plot style for every lesson (01-08) and the benchmark, and saving into ``figures/``.

PNG files are written without timestamps or software versions in their metadata, so re-running a
lesson that draws the same figure leaves the committed file unchanged.
"""

from __future__ import annotations

import os
from contextlib import contextmanager
from pathlib import Path

import matplotlib

__all__ = ["STYLE", "STAGE_COLORS", "style", "new_figure", "save", "figures_dir"]

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
