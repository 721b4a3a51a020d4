"""Slider logic for lesson 04 (FlashAttention on CUDA cores): memory against L, and a step-through
of the tiles a thread block consumes with its running max and sum.

Plain functions (inputs -> numbers or a matplotlib Figure); pytest calls them, the lesson wires them
to sliders with :func:`wb_kernels.widgets.sequence_length_slider` / :func:`link_slider`.
"""

from __future__ import annotations

import math

import numpy as np

from .online_softmax import online_softmax_step
from ...plots import STAGE_COLORS, new_figure
from .. import get_stage

__all__ = ["owners", "draw_register_blocking", "memory_bytes", "draw_memory", "tile_schedule", "causal_work", "step_count", "draw_tile_step",
           "SLIDER_LENGTHS", "GPU_MEMORY_BYTES"]

SLIDER_LENGTHS = (1024, 2048, 4096, 8192, 16384, 32768, 65536, 131072)
GPU_MEMORY_BYTES = 80 * 10**9  # an H100's 80 GB


def memory_bytes(stage: str, L: int, *, B: int = 1, H: int = 16, D: int = 64) -> int:
    """Extra device bytes beyond Q, K, V that `stage` needs at Lq = Lk = L (its own Stage says how many)."""
    return int(get_stage(stage).workspace_bytes(B, H, L, L, D))


def draw_memory(L: int, *, B: int = 1, H: int = 16, D: int = 64, lengths=SLIDER_LENGTHS):
    """Extra memory of the naive stage (S and P) and the flash stage (O and LSE) against L, marked at L."""
    fig, ax = new_figure()
    xs = np.array(sorted(set(lengths) | {L}))
    for stage in ("naive", "flash"):
        ys = [memory_bytes(stage, int(x), B=B, H=H, D=D) / 2**30 for x in xs]
        ax.plot(xs, ys, "o-", color=STAGE_COLORS[stage], label=stage, markersize=3)
        here = memory_bytes(stage, L, B=B, H=H, D=D) / 2**30
        ax.annotate(f"{here:.3g} GiB", (L, here), textcoords="offset points", xytext=(5, -12 if stage == "flash" else 5),
                    color=STAGE_COLORS[stage], fontsize=9)
    ax.axhline(GPU_MEMORY_BYTES / 2**30, color="black", lw=0.8, ls="--")
    ax.text(xs[0], GPU_MEMORY_BYTES / 2**30 * 1.3, "an H100's 80 GB", fontsize=8)
    ax.axvline(L, color="black", lw=0.6, alpha=0.5)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("sequence length L")
    ax.set_ylabel("extra device memory (GiB)")
    ax.set_title(f"naive keeps S and P, flash only O and LSE (B={B}, H={H}, D={D}, fp32)")
    ax.legend(loc="upper left")
    return fig


def tile_schedule(Lq: int, Lk: int, block_m: int, block_n: int, causal: bool = False) -> list:
    """Every (query tile, key tile) pair in the order a block visits them; causal marks the skipped ones.

    A key tile is skipped when its first key comes after the tile's last query row (top-left causal).
    """
    steps = []
    for qt in range(math.ceil(Lq / block_m)):
        last_row = min((qt + 1) * block_m, Lq) - 1
        for kt in range(math.ceil(Lk / block_n)):
            steps.append({"q_tile": qt, "k_tile": kt, "skipped": bool(causal and kt * block_n > last_row)})
    return steps


def causal_work(Lq: int, Lk: int, block_m: int, block_n: int) -> dict:
    """How many tiles a causal kernel computes out of all of them."""
    steps = tile_schedule(Lq, Lk, block_m, block_n, causal=True)
    computed = sum(not s["skipped"] for s in steps)
    return {"computed": computed, "total": len(steps), "saved_fraction": 1 - computed / len(steps)}


def step_count(Lq: int, Lk: int, block_m: int, block_n: int, causal: bool = False) -> int:
    """Number of steps of the step-through: the tiles that are computed."""
    return sum(not s["skipped"] for s in tile_schedule(Lq, Lk, block_m, block_n, causal))


def draw_tile_step(step: int, *, q, k, v, block_m: int = 16, block_n: int = 16, causal: bool = False,
                   rows_shown: int = 3):
    """Left: the tile grid after `step` computed tiles (done, current, skipped). Right: the running
    max m and running sum l of a few rows of the current query tile, key block by key block.

    q: (Lq, D), k and v: (Lk, D) of one head (NumPy).
    """
    Lq, Lk = q.shape[0], k.shape[0]
    steps = tile_schedule(Lq, Lk, block_m, block_n, causal)
    computed = [s for s in steps if not s["skipped"]]
    step = int(np.clip(step, 0, len(computed) - 1))
    current = computed[step]
    n_q, n_k = math.ceil(Lq / block_m), math.ceil(Lk / block_n)

    grid = np.zeros((n_q, n_k))  # 0 pending, 1 done, 2 current, -1 skipped
    for s in steps:
        if s["skipped"]:
            grid[s["q_tile"], s["k_tile"]] = -1
    for s in computed[:step]:
        grid[s["q_tile"], s["k_tile"]] = 1
    grid[current["q_tile"], current["k_tile"]] = 2

    fig, (ax_grid, ax_m, ax_l) = new_figure(ncols=3, width=12, height=3.6)
    from matplotlib.colors import ListedColormap

    cmap = ListedColormap(["#dddddd", "white", "#98df8a", STAGE_COLORS["flash"]])
    ax_grid.imshow(grid, cmap=cmap, vmin=-1.5, vmax=2.5, aspect="auto")
    ax_grid.set_xticks(range(n_k))
    ax_grid.set_yticks(range(n_q))
    ax_grid.set_xlabel("key tile")
    ax_grid.set_ylabel("query tile (one thread block)")
    ax_grid.grid(False)
    ax_grid.set_title(f"step {step + 1}/{len(computed)}: grey = skipped ({len(steps) - len(computed)})")
    for s in steps:
        if s["skipped"]:
            ax_grid.text(s["k_tile"], s["q_tile"], "skip", ha="center", va="center", fontsize=7, color="#777777")

    row0 = current["q_tile"] * block_m
    rows = np.arange(row0, min(row0 + block_m, Lq))
    history = _history_for_rows(q, k, v, rows, block_n, causal)
    upto = history[: current["k_tile"] + 1]
    blocks = np.arange(len(upto))
    shown = rows[np.linspace(0, len(rows) - 1, min(rows_shown, len(rows))).astype(int)] - row0
    for r in shown:
        m = np.array([h["m"][r] for h in upto])
        l = np.array([h["l"][r] for h in upto])
        ax_m.plot(blocks, np.where(np.isfinite(m), m, np.nan), "o-", markersize=3, label=f"row {row0 + r}")
        ax_l.plot(blocks, l, "o-", markersize=3, label=f"row {row0 + r}")
    for ax, name in ((ax_m, "running max m"), (ax_l, "running sum l")):
        ax.set_xlim(-0.5, n_k - 0.5)
        ax.set_xticks(range(n_k))
        ax.set_xlabel("key block")
        ax.set_title(name)
        ax.legend(loc="best")
    return fig


def _history_for_rows(q, k, v, rows, block_n, causal):
    """Running statistics of the given query rows (global positions, for the causal mask), block by block."""

    D = q.shape[1]
    scale = 1.0 / np.sqrt(D)
    m = np.full(len(rows), -np.inf)
    l = np.zeros(len(rows))
    acc = np.zeros((len(rows), D))
    history = []
    for start in range(0, k.shape[0], block_n):
        stop = min(start + block_n, k.shape[0])
        scores = scale * np.asarray(q[rows], dtype=np.float64) @ np.asarray(k[start:stop], dtype=np.float64).T
        if causal:
            scores = np.where(np.arange(start, stop)[None, :] <= rows[:, None], scores, -np.inf)
        m, l, acc = online_softmax_step(m, l, acc, scores, np.asarray(v[start:stop], dtype=np.float64))
        history.append({"start": start, "stop": stop, "m": m.copy(), "l": l.copy()})
    return history


def owners(block_m: int, width: int, rows_per_thread: int, threads_per_row: int) -> np.ndarray:
    """(block_m, width) array: which thread of the block owns each element of an S tile (width = block_n) or of
    an O tile (width = D), as ``kernel.py`` assigns them. Thread t is in row group g = t // TPR at position
    c = t % TPR; it owns rows g, g + row_groups, ... (TM of them) and columns c, c + TPR, ..."""
    row_groups = block_m // rows_per_thread
    owner = np.empty((block_m, width), dtype=int)
    for row in range(block_m):
        for col in range(width):
            owner[row, col] = (row % row_groups) * threads_per_row + col % threads_per_row
    return owner


def draw_register_blocking(config, D: int, highlight: int = 0):
    """Two tiles, coloured by the thread that owns each element: S (block_m x block_n) and O (block_m x D).
    The highlighted thread's elements are outlined: its registers hold all of them, and every number it
    loads from shared memory (a row of Q or P, a column of K or V) is used for several of them."""
    from matplotlib.patches import Rectangle

    c = config
    fig, axes = new_figure(ncols=2, width=9, height=3.6)
    for ax, width, title in ((axes[0], c.block_n, "S = Q K^T tile"), (axes[1], D, "O tile")):
        owner = owners(c.block_m, width, c.rows_per_thread, c.threads_per_row)
        ax.imshow(owner, cmap="tab20", interpolation="nearest", aspect="equal")
        for row, col in zip(*np.nonzero(owner == highlight)):
            ax.add_patch(Rectangle((col - 0.5, row - 0.5), 1, 1, fill=False, edgecolor="black", linewidth=1.2))
        ax.set(title=f"{title}: {c.block_m} x {width}", xlabel="key" if width == c.block_n else "head dim",
               ylabel="query row", xticks=[], yticks=[])
    fig.suptitle(f"{c.threads} threads, {c.rows_per_thread} rows x {c.threads_per_row} threads per row group; "
                 f"thread {highlight} outlined", fontsize=9)
    return fig
