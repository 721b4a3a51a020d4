"""Slider logic for lesson 01 (CPU reference): memory of S and P, and CPU time, against L.

Plain functions, so pytest checks them without a browser; the lesson wires them to a slider.
"""

from __future__ import annotations

import numpy as np

from ...inputs import random_qkv
from ...plots import STAGE_COLORS, new_figure
from ...reference import reference
from ...timing import time_call
from ...widgets import progress as show_progress

__all__ = ["materialized_bytes", "cpu_times", "memory_time_figure", "SLIDER_LENGTHS"]

# Lengths the slider offers: the reference at L = 2048 already takes about a second per call.
SLIDER_LENGTHS = (64, 128, 256, 512, 1024, 2048)


def materialized_bytes(L, B: int = 1, H: int = 16, itemsize: int = 4):
    """Bytes of the two L x L matrices (scores S and probabilities P) that plain attention keeps."""
    L = np.asarray(L, dtype=np.float64)
    return 2.0 * B * H * L * L * itemsize


def cpu_times(lengths, B: int = 1, H: int = 4, D: int = 64, repeats: int = 3, progress: bool = True) -> dict:
    """Median milliseconds of the NumPy float64 reference and of torch's SDPA (float32, CPU) per L.

    `progress`: a progress bar over the lengths (the lesson's timing cell); the slider passes False."""
    import torch
    import torch.nn.functional as F

    numpy_ms, torch_ms = [], []
    for L in show_progress(lengths, description="timing NumPy and torch", unit="lengths",
                           disable=not progress or len(lengths) < 3):
        q, k, v = random_qkv(B, H, L, D, seed=L)
        numpy_ms.append(time_call(reference, q, k, v, warmup=1, repeats=repeats, device="cpu").median_ms)
        tq, tk, tv = (torch.from_numpy(x) for x in (q, k, v))
        torch_ms.append(time_call(F.scaled_dot_product_attention, tq, tk, tv, warmup=1, repeats=repeats,
                                  device="cpu").median_ms)
    return {"L": list(lengths), "numpy_ms": numpy_ms, "torch_ms": torch_ms}


def memory_time_figure(L: int, *, H: int = 16, times: dict | None = None):
    """Left: memory of S and P against L, with the chosen L marked. Right: CPU time up to L.

    `times` may hold precomputed :func:`cpu_times` results (tests pass them to stay fast).
    """
    lengths = [x for x in SLIDER_LENGTHS if x <= L] or [L]
    fig, (ax_mem, ax_time) = new_figure(ncols=2, width=10, height=3.6)
    grid = np.geomspace(64, 65536, 60)
    ax_mem.loglog(grid, materialized_bytes(grid, H=H) / 2**30, color=STAGE_COLORS["reference"],
                  label=f"S and P, float32, H={H}")
    ax_mem.axhline(80, color="k", ls=":", lw=1, label="80 GiB (one H100)")
    ax_mem.plot([L], [materialized_bytes(L, H=H) / 2**30], "o", color="C3",
                label=f"L={L}: {materialized_bytes(L, H=H) / 2**20:,.0f} MiB")
    ax_mem.set(xlabel="sequence length L", ylabel="GiB", title="Memory of the L×L matrices")
    ax_mem.legend(loc="upper left")

    # No bar inside the slider: its status label already says what is being computed, and in one headless
    # run on a GPU machine the slider cell with a progress widget in its output area stalled for 300 s.
    times = times if times is not None else cpu_times(lengths, progress=False)
    keep = [i for i, x in enumerate(times["L"]) if x <= L]
    Ls = [times["L"][i] for i in keep]
    ax_time.loglog(Ls, [times["numpy_ms"][i] for i in keep], "o-", color=STAGE_COLORS["numpy"],
                   label="NumPy float64 reference")
    ax_time.loglog(Ls, [times["torch_ms"][i] for i in keep], "s-", color=STAGE_COLORS["torch"],
                   label="torch SDPA float32 (CPU)")
    ax_time.set(xlabel="sequence length L", ylabel="ms (median)", title="CPU time, B=1 H=4 D=64")
    ax_time.legend(loc="upper left")
    return fig


def attention_probabilities(q, k, *, causal=False, key_padding_mask=None, scale=None) -> np.ndarray:
    """P = softmax(masked scale * q k^T) in float64, (B, H, Lq, Lk): the matrix the heatmaps show."""
    from ...reference import attention_mask, safe_softmax

    q, k = np.asarray(q, dtype=np.float64), np.asarray(k, dtype=np.float64)
    B, _, Lq, D = q.shape
    scale = 1.0 / np.sqrt(D) if scale is None else scale
    scores = scale * np.einsum("bhqd,bhkd->bhqk", q, k)
    allowed = attention_mask(Lq, k.shape[2], causal, key_padding_mask, batch=B)
    return safe_softmax(np.where(allowed, scores, -np.inf))


def mask_heatmaps(q, k, key_padding_mask):
    """Four heatmaps of P (batch 0, head 0): no mask, causal, key padding, both."""
    variants = [("no mask", False, None), ("causal", True, None),
                ("key padding", False, key_padding_mask), ("causal + padding", True, key_padding_mask)]
    fig, axes = new_figure(ncols=4, width=12, height=3.2)
    for ax, (title, causal, padding) in zip(axes, variants):
        probs = attention_probabilities(q, k, causal=causal, key_padding_mask=padding)[0, 0]
        image = ax.imshow(probs, vmin=0, vmax=1, cmap="viridis")
        ax.set(title=title, xlabel="key j", ylabel="query i")
        ax.grid(False)
    fig.colorbar(image, ax=axes, shrink=0.8, label="P[i, j]")
    return fig
