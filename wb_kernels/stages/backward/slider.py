"""Figures and counts for lesson 08_backward: what the backward keeps in memory, the matrix products it does, and
which thread block owns which tiles in the two gradient kernels.

Plain functions (inputs -> numbers or a matplotlib Figure); ``tests/test_backward_lesson.py`` calls them without a
browser, and the lesson wires them to sliders with :func:`wb_kernels.widgets.link_slider`.
"""

from __future__ import annotations

import math

import numpy as np

from ...plots import new_figure
from ...reference import attention_mask
from .blockwise import tile_pairs

__all__ = ["saved_bytes", "draw_memory", "MATMULS", "matmul_flops", "flop_ratio", "mma_count", "mma_per_tile",
           "owner_map", "draw_schedule", "SLIDER_LENGTHS", "GPU_MEMORY_BYTES"]

SLIDER_LENGTHS = (1024, 2048, 4096, 8192, 16384, 32768, 65536, 131072)
GPU_MEMORY_BYTES = 80 * 10**9  # an H100's 80 GB
LSE_BYTES = 4  # the LSE is kept in float32 whatever the inputs' dtype: it is a log of a sum of exponentials

# The matrix products of each pass, each an (L x L x D) product of 2 L^2 D FLOPs per (batch, head).
MATMULS = {
    "forward": ("S = Q Kᵀ", "O = P V"),
    # FlashAttention-2's single kernel (v2): S recomputed once, dQ added up across key tiles with atomics
    "backward (one kernel, atomic dQ)": ("S = Q Kᵀ", "dV += Pᵀ dO", "dP = dO Vᵀ", "dQ += dS K", "dK += dSᵀ Q"),
    # v1, deterministic: the KV-stationary kernel (dK, dV) and the Q-stationary one (dQ) each recompute S and dP
    "backward (two kernels, deterministic)": ("S = Q Kᵀ", "dV += Pᵀ dO", "dP = dO Vᵀ", "dK += dSᵀ Q",
                                              "S = Q Kᵀ", "dP = dO Vᵀ", "dQ += dS K"),
}


def saved_bytes(keep: str, L: int, *, B: int = 1, H: int = 16, D: int = 64, dtype_bytes: int = 2) -> int:
    """Bytes the forward keeps for the backward beyond Q, K, V (which the caller keeps anyway), at Lq = Lk = L.

    ``keep="P"``: the probabilities, B H L^2 numbers in the inputs' dtype (what autograd through a plain
    softmax-attention keeps). ``keep="O+LSE"``: the output, B H L D numbers in the inputs' dtype, and the float32
    LSE, B H L numbers: what FlashAttention keeps, and all that the backward needs to recompute P exactly."""
    if keep == "P":
        return B * H * L * L * dtype_bytes
    if keep == "O+LSE":
        return B * H * L * (D * dtype_bytes + LSE_BYTES)
    raise ValueError(f"keep: 'P' or 'O+LSE', got {keep!r}")


def draw_memory(L: int, *, B: int = 1, H: int = 16, D: int = 64, dtype_bytes: int = 2, lengths=SLIDER_LENGTHS):
    """Bytes kept for the backward against L: P (quadratic) against O and the LSE (linear), marked at L."""
    fig, ax = new_figure()
    xs = np.array(sorted(set(lengths) | {L}))
    for keep, color in (("P", "tab:red"), ("O+LSE", "tab:blue")):
        ys = [saved_bytes(keep, int(x), B=B, H=H, D=D, dtype_bytes=dtype_bytes) / 2**30 for x in xs]
        ax.plot(xs, ys, "o-", color=color, label=f"save {keep}", markersize=3)
        here = saved_bytes(keep, L, B=B, H=H, D=D, dtype_bytes=dtype_bytes) / 2**30
        ax.annotate(f"{here:.3g} GiB", (L, here), textcoords="offset points",
                    xytext=(5, -12 if keep == "O+LSE" else 5), color=color, fontsize=9)
    # shade what does not fit on one GPU, so the length where P stops fitting reads off the red line
    ax.axhspan(GPU_MEMORY_BYTES / 2**30, ax.get_ylim()[1] * 10, color="0.9", zorder=0, label="more than an H100's 80 GB")
    ax.axvline(L, color="black", lw=0.6, alpha=0.5)
    ax.set(xscale="log", yscale="log", xlabel="sequence length L", ylabel="kept for the backward (GiB)",
           title=f"what the forward keeps for the backward (B={B}, H={H}, D={D}, {8 * dtype_bytes}-bit)")
    ax.set_xscale("log", base=2)
    ax.legend(loc="upper left")
    return fig


def matmul_flops(which: str, *, B: int = 1, H: int = 1, Lq: int = 1, Lk: int = 1, D: int = 1) -> int:
    """FLOPs of one pass in :data:`MATMULS` (non-causal): 2 Lq Lk D per product, per (batch, head)."""
    return len(MATMULS[which]) * 2 * B * H * Lq * Lk * D


def flop_ratio(which: str) -> float:
    """A backward's FLOPs over the forward's: the same shape, so the count of products decides."""
    return len(MATMULS[which]) / len(MATMULS["forward"])


def mma_count(M: int, N: int, K: int) -> int:
    """``mma.sync.m16n8k16`` instructions for one (M x K) times (K x N) product (M, N, K multiples of the shape)."""
    if M % 16 or N % 8 or K % 16:
        raise ValueError(f"an m16n8k16 product needs M % 16 = N % 8 = K % 16 = 0, got M={M} N={N} K={K}")
    return (M // 16) * (N // 8) * (K // 16)


def mma_per_tile(kernel: str, *, block_m: int, block_n: int, D: int) -> dict:
    """The mma count of each product for one (query tile, key tile) pair, in the KV-stationary kernel ("dkdv",
    which computes Sᵀ = K Qᵀ so that Pᵀ and dSᵀ are its A operands) or the Q-stationary one ("dq")."""
    if kernel == "dkdv":
        return {"Sᵀ = K Qᵀ": mma_count(block_n, block_m, D), "dPᵀ = V dOᵀ": mma_count(block_n, block_m, D),
                "dV += Pᵀ dO": mma_count(block_n, D, block_m), "dK += dSᵀ Q": mma_count(block_n, D, block_m)}
    if kernel == "dq":
        return {"S = Q Kᵀ": mma_count(block_m, block_n, D), "dP = dO Vᵀ": mma_count(block_m, block_n, D),
                "dQ += dS K": mma_count(block_m, D, block_n)}
    raise ValueError(f"kernel: 'dkdv' or 'dq', got {kernel!r}")


def owner_map(kernel: str, Lq: int, Lk: int, block_m: int, block_n: int, causal=False):
    """(query tiles, key tiles) array: the thread block that computes each pair (blocks numbered per (batch, head)),
    -1 where the pair is skipped because the mask hides all of it.

    "dkdv": block j owns key tile j (its dK and dV stay in its registers) and visits every query tile;
    "dq": block i owns query tile i (its dQ) and visits every key tile. Each pair is computed once per kernel."""
    if kernel not in ("dkdv", "dq"):
        raise ValueError(f"kernel: 'dkdv' or 'dq', got {kernel!r}")
    allowed = attention_mask(Lq, Lk, causal)[0, 0]
    owners = np.full((math.ceil(Lq / block_m), math.ceil(Lk / block_n)), -1)
    for i0, j0 in tile_pairs(Lq, Lk, block_m, block_n, allowed):
        owners[i0 // block_m, j0 // block_n] = j0 // block_n if kernel == "dkdv" else i0 // block_m
    return owners


def draw_schedule(Lq: int, Lk: int, *, block_m: int = 16, block_n: int = 16, causal=False):
    """The two gradient kernels side by side: which block owns which (query tile, key tile) pairs (one colour per
    block, white where the mask skips the pair), and what each block accumulates."""
    fig, axes = new_figure(ncols=2, width=10, height=4.2)
    titles = {"dkdv": "KV-stationary: block j owns key tile j\n(dK, dV in registers; query tiles stream past)",
              "dq": "Q-stationary: block i owns query tile i\n(dQ in registers; key tiles stream past)"}
    for ax, kernel in zip(axes, ("dkdv", "dq")):
        owners = owner_map(kernel, Lq, Lk, block_m, block_n, causal)
        shown = np.ma.masked_less(owners, 0)
        ax.imshow(shown, cmap="tab20", vmin=0, vmax=19, aspect="auto", interpolation="nearest")
        rows, cols = owners.shape
        if rows * cols <= 256:  # numbers stay readable
            for i in range(rows):
                for j in range(cols):
                    if owners[i, j] >= 0:
                        ax.text(j, i, str(owners[i, j]), ha="center", va="center", fontsize=7)
        ax.set_xticks(range(cols))
        ax.set_yticks(range(rows))
        ax.set_xticklabels([str(j * block_n) for j in range(cols)], fontsize=7, rotation=90)
        ax.set_yticklabels([str(i * block_m) for i in range(rows)], fontsize=7)
        ax.set_xlabel("first key of the key tile")
        ax.set_ylabel("first query row of the query tile")
        ax.set_title(titles[kernel], fontsize=9)
        ax.grid(False)  # tiles, not a plot: the style's grid would cut through them
    skipped = int((owner_map("dq", Lq, Lk, block_m, block_n, causal) < 0).sum())
    fig.suptitle(f"Lq={Lq}, Lk={Lk}, tiles {block_m} x {block_n}, causal={causal}: {skipped} of "
                 f"{owners.size} tile pairs skipped in each kernel", fontsize=10)
    return fig
