"""Slider and figures for lesson 03 (tiled GPU attention): which tiles a block loads, reuse against tile size.

Plain functions, so pytest checks them without a browser; the lesson wires them to a slider.
"""

from __future__ import annotations

import math

from ...backend import BACKEND
from ...plots import STAGE_COLORS, new_figure
from ...shared_memory import BANKS, conflict_degree

__all__ = ["TILE_CHOICES", "warp_banks", "draw_bank_conflicts", "reuse_rows", "tile_picture", "tile_figure", "tile_speed", "speed_figure"]

TILE_CHOICES = (4, 8, 16, 32)


def reuse_rows(tiles=TILE_CHOICES, D: int = 64) -> list:
    """[(tile, threads per block, shared bytes of the scores block, global loads per multiply-add)].

    The naive kernel loads 2 numbers per multiply-add; a tiled block loads 2 * tile * tile numbers per
    step and does tile * tile * tile multiply-adds with them, so 2 / tile loads per multiply-add.
    """
    from .kernel import reuse_factor, shared_bytes_per_block

    return [(t, t * t, shared_bytes_per_block(t)["tiled_scores_kernel"], 2 / reuse_factor(t)) for t in tiles]


def _rect(x, y, w, h, face, edge="k", lw=0.8, alpha=1.0):
    from matplotlib.patches import Rectangle

    return Rectangle((x, y), w, h, facecolor=face, edgecolor=edge, linewidth=lw, alpha=alpha)


def tile_picture(ax_q, ax_k, ax_s, *, Lq: int, Lk: int, D: int, tile: int, block=(1, 2)):
    """Draw Q, K and S with what a block of tiled_scores_kernel loads, the one at key block bx and query block by
    (its blockIdx.z and blockIdx.y; blockIdx.x is its (batch, head) pair): a strip of Q rows and a strip of K rows,
    tile columns of D at a time, to make one tile x tile tile of S."""
    bx, by = block
    i0, j0 = by * tile, bx * tile
    colors = ["#ff7f0e", "#fdae6b", "#fdd0a2", "#feedde"]
    steps = math.ceil(D / tile)
    for ax, rows, name, r0 in ((ax_q, Lq, "Q", i0), (ax_k, Lk, "K", j0)):
        ax.add_patch(_rect(0, 0, D, rows, face="#f7f7f7"))
        for step in range(steps):
            width = min(tile, D - step * tile)
            height = min(tile, rows - r0)
            if height > 0:
                ax.add_patch(_rect(step * tile, r0, width, height, face=colors[step % len(colors)]))
                ax.text(step * tile + width / 2, r0 + height / 2, f"{step + 1}", ha="center", va="center",
                        fontsize=8)
        ax.set(xlim=(0, D), ylim=(rows, 0), aspect="equal", xlabel="d", title=f"{name} ({rows}×{D})")
        ax.grid(False)
    ax_q.set_ylabel("query i")
    ax_k.set_ylabel("key j")
    ax_s.add_patch(_rect(0, 0, Lk, Lq, face="#f7f7f7"))
    for x in range(0, Lk, tile):
        for y in range(0, Lq, tile):
            ax_s.add_patch(_rect(x, y, min(tile, Lk - x), min(tile, Lq - y), face="none", edge="#bbbbbb", lw=0.5))
    ax_s.add_patch(_rect(j0, i0, min(tile, Lk - j0), min(tile, Lq - i0), face=STAGE_COLORS["tiled"], edge="k"))
    ax_s.set(xlim=(0, Lk), ylim=(Lq, 0), aspect="equal", xlabel="key j",
             title=f"S: block (bh, {by}, {bx}) makes one {tile}×{tile} tile")
    ax_s.grid(False)


def tile_figure(tile: int, *, Lq: int = 64, Lk: int = 96, D: int = 64):
    """The slider's figure: the tiles one block loads (Q, K, S) and the reuse against tile size."""
    fig, axes = new_figure(ncols=4, width=14, height=3.8)
    block = (min(2, math.ceil(Lk / tile) - 1), min(1, math.ceil(Lq / tile) - 1))
    tile_picture(*axes[:3], Lq=Lq, Lk=Lk, D=D, tile=tile, block=block)
    rows = reuse_rows(TILE_CHOICES, D=D)
    ax = axes[3]
    ax.semilogy([r[0] for r in rows], [r[3] for r in rows], "o-", color=STAGE_COLORS["tiled"],
                label="tiled: 2 / tile")
    ax.axhline(2.0, color=STAGE_COLORS["naive"], ls="--", label="naive: 2")
    chosen = next(r for r in rows if r[0] == tile) if tile in TILE_CHOICES else reuse_rows((tile,), D)[0]
    ax.plot([tile], [chosen[3]], "o", color="k", ms=9,
            label=f"tile {tile}: {chosen[1]} threads, {chosen[2]} B shared")
    ax.set(xlabel="tile size", ylabel="global loads per multiply-add", title="reuse of every loaded number",
           xticks=list(TILE_CHOICES))
    ax.legend(loc="upper right")
    return fig


def tile_speed(L: int = 4096, D: int = 64, B: int = 1, H: int = 8, tiles=(8, 16, 32), repeats: int = 10) -> dict:
    """GPU only: {tile: median ms} of the tiled stage at one size, and the naive stage's for comparison."""
    if not BACKEND.is_gpu:
        raise RuntimeError("tile_speed times the GPU; on the simulator the numbers would be Python's")
    import wb_kernels as wb
    from .kernel import tiled_forward

    q, k, v = wb.random_qkv(B, H, L, D, framework="torch", device="cuda")
    times = {"naive": wb.time_call(wb.attention, q, k, v, stage="naive", repeats=repeats).median_ms}
    for tile in tiles:
        times[tile] = wb.time_call(tiled_forward, q, k, v, tile=tile, repeats=repeats).median_ms
    return times


def speed_figure(times: dict, *, L: int, D: int):
    """Bar chart of :func:`tile_speed`'s result."""
    fig, ax = new_figure(width=6, height=3.4)
    labels = [str(key) if key == "naive" else f"tile {key}" for key in times]
    values = list(times.values())
    colors = [STAGE_COLORS["naive"] if key == "naive" else STAGE_COLORS["tiled"] for key in times]
    ax.bar(labels, values, color=colors)
    ax.set(ylabel="ms (median)", title=f"tiled attention on the GPU, L={L} D={D}")
    return fig


def warp_banks(tile: int, padded: bool, dd: int = 0) -> list:
    """(thread, word, bank) for the 32 threads of the first warp of a tile x tile block when each reads
    ``k_tile[tx, dd]`` (the scores kernel's inner loop): rows of k_tile are `tile` words long, or tile + 1 with
    the padding column. Threads are numbered as CUDA numbers them, x fastest."""
    stride = tile + 1 if padded else tile
    rows = []
    for thread in range(min(32, tile * tile)):
        tx = thread % tile
        word = tx * stride + dd
        rows.append((thread, word, word % BANKS))
    return rows


def draw_bank_conflicts(tile: int = 16):
    """Which bank each thread of a warp reads when the scores kernel walks a column of k_tile, without and with the
    padding column: one dot per thread, its bank on the x axis. Dots stacked in one bank at different words are
    served one after the other."""
    fig, axes = new_figure(ncols=2, width=9, height=3.4)
    for ax, padded in zip(axes, (False, True)):
        rows = warp_banks(tile, padded)
        for thread, word, bank in rows:
            ax.scatter(bank, thread, s=22, color=STAGE_COLORS["tiled"] if padded else STAGE_COLORS["naive"])
        ax.set(xlim=(-1, BANKS), ylim=(len(rows), -1), xlabel="shared-memory bank", ylabel="thread of the warp",
               title=f"{'padded rows (tile + 1 words)' if padded else 'rows of tile words'}: "
                     f"{conflict_degree(rows)}-way conflict" if conflict_degree(rows) > 1 else
                     f"{'padded rows (tile + 1 words)' if padded else 'rows of tile words'}: no conflict")
    fig.suptitle(f"one warp reads k_tile[tx, dd] (tile = {tile}): the bank of each thread's word", fontsize=9)
    return fig
