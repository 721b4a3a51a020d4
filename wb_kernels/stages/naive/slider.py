"""Slider and figures for lesson 02 (naive GPU attention): how the grid covers S, memory and time against L.

Plain functions, so pytest checks them without a browser; the lesson wires them to a slider.
On the simulator the timed sizes are capped (every CUDA thread is a Python thread there).
"""

from __future__ import annotations

import math

import numpy as np

from ...backend import BACKEND
from ...plots import STAGE_COLORS, new_figure

__all__ = ["SLIDER_LENGTHS", "SIMULATOR_MAX_L", "grid_figure", "traffic_rows", "memory_rows", "measure",
           "memory_time_figure"]

# The slider's lengths; the simulator times at most SIMULATOR_MAX_L (the memory panel is analytic at any L).
SLIDER_LENGTHS = (512, 1024, 2048, 4096, 8192, 16384) if BACKEND.is_gpu else (8, 16, 32, 64)
SIMULATOR_MAX_L = 64


def grid_figure(Lq: int = 40, Lk: int = 56, block: int = 16):
    """S (Lq x Lk) with the blocks of scores_kernel's grid drawn over it, and one thread's element marked."""
    fig, ax = new_figure(width=6.4, height=4.4)
    gx, gy = math.ceil(Lk / block), math.ceil(Lq / block)
    ax.add_patch(_rect(0, 0, gx * block, gy * block, face="#f2f2f2", edge="none"))
    ax.add_patch(_rect(0, 0, Lk, Lq, face="#fde0dd", edge="k"))
    for bx in range(gx):
        for by in range(gy):
            ax.add_patch(_rect(bx * block, by * block, block, block, face="none", edge="#d62728", lw=1.5))
            ax.text(bx * block + block / 2, by * block + block / 2, f"block\n(bh,{by},{bx})", ha="center",
                    va="center", fontsize=8, color="#d62728")
    i, j = block + 3, block + 5  # the thread (threadIdx.x=5, threadIdx.y=3) of block (bh, 1, 1)
    ax.add_patch(_rect(j, i, 1, 1, face="k", edge="k"))
    ax.annotate(f"S[{i}, {j}]: block (bh,1,1), thread (5,3)", (j + 1, i + 0.5), (gx * block * 0.45, -4),
                arrowprops={"arrowstyle": "->"}, fontsize=9)
    ax.set(xlim=(0, gx * block), ylim=(gy * block, -8), xlabel="key j  (blockIdx.z*16 + threadIdx.x)",
           ylabel="query i  (blockIdx.y*16 + threadIdx.y)", aspect="equal",
           title=f"grid (B·H, {gy}, {gx}) of {block}×{block} blocks over S ({Lq}×{Lk}); grey: idle threads")
    ax.grid(False)
    return fig


def _rect(x, y, w, h, face, edge, lw=1.0):
    from matplotlib.patches import Rectangle

    return Rectangle((x, y), w, h, facecolor=face, edgecolor=edge, linewidth=lw)


def traffic_rows(B: int, H: int, L: int, D: int) -> list:
    """[(kernel, MiB read as requested, MiB read at least, MiB written)] for the three naive kernels."""
    from .kernel import global_memory_traffic

    mib = 2**20
    return [(kernel, t["read_requested"] / mib, t["read_compulsory"] / mib, t["write"] / mib)
            for kernel, t in global_memory_traffic(B, H, L, L, D).items()]


def memory_rows(lengths, B: int = 1, H: int = 16, D: int = 64) -> list:
    """[(L, GiB of S and P, GiB of q, k, v and out)] in float32: the L^2 term against the linear ones."""
    from .kernel import workspace_bytes

    return [(L, workspace_bytes(B, H, L, L, D) / 2**30, 4 * 4 * B * H * L * D / 2**30) for L in lengths]


def measure(L: int, stages=("naive",), B: int = 1, H: int = 4, D: int = 64, repeats: int = 5) -> dict:
    """{stage: (median ms, peak MiB)} for one call at length L (capped at SIMULATOR_MAX_L, B=H=1, D=16
    on the simulator, where the numbers are Python's, not a GPU's)."""
    import wb_kernels as wb

    if BACKEND.is_simulator:
        L, B, H, D, repeats = min(L, SIMULATOR_MAX_L), 1, 1, 16, 1
        framework, device = "numpy", None
    else:
        framework, device = "torch", "cuda"
    q, k, v = wb.random_qkv(B, H, L, D, framework=framework, device=device)
    results = {}
    for stage in stages:
        timing = wb.time_call(wb.attention, q, k, v, stage=stage, warmup=1, repeats=repeats)
        _, memory = wb.peak_memory(wb.attention, q, k, v, stage=stage)
        results[stage] = (timing.median_ms, memory.peak_mib)
    return {"L": L, "B": B, "H": H, "D": D, "results": results}


def memory_time_figure(L: int, *, history: dict | None = None, stages=("naive",), B: int = 1, H: int = 4,
                       D: int = 64):
    """Left: analytic memory of S and P against L, the chosen L marked. Right: the times measured so far.

    `history` ({L: measure(...)}) collects the slider's measurements; the chosen L is measured when missing.
    """
    history = {} if history is None else history
    if L not in history:
        history[L] = measure(L, stages=stages, B=B, H=H, D=D)
    fig, (ax_mem, ax_time) = new_figure(ncols=2, width=10, height=3.6)
    grid = np.geomspace(min(SLIDER_LENGTHS), 65536, 60)
    from .kernel import workspace_bytes

    ax_mem.loglog(grid, [workspace_bytes(B, H, x, x, D) / 2**20 for x in grid], color=STAGE_COLORS["naive"],
                  label=f"S and P, float32, B={B} H={H}")
    ax_mem.loglog(grid, [4 * 4 * B * H * x * D / 2**20 for x in grid], color="k", ls="--",
                  label=f"q, k, v, out (D={D})")
    ax_mem.plot([L], [workspace_bytes(B, H, L, L, D) / 2**20], "o", color="k",
                label=f"L={L}: {workspace_bytes(B, H, L, L, D) / 2**20:,.1f} MiB")
    ax_mem.set(xlabel="sequence length L", ylabel="MiB", title="O(L²) buffers against O(L) tensors")
    ax_mem.legend(loc="upper left")

    where = "simulator (Python threads)" if BACKEND.is_simulator else "GPU"
    for stage in stages:
        points = sorted((m["L"], m["results"][stage][0]) for m in history.values() if stage in m["results"])
        ax_time.loglog([p[0] for p in points], [p[1] for p in points], "o-", color=STAGE_COLORS.get(stage),
                       label=stage)
    shown = history[L]
    ax_time.set(xlabel="sequence length L", ylabel="ms (median)",
                title=f"time on the {where}, B={shown['B']} H={shown['H']} D={shown['D']}")
    ax_time.legend(loc="upper left")
    return fig
