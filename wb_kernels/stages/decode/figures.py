"""Lesson 07's figures (matplotlib): a decode step on the roofline, one row's split weights, the splits chosen per
workload, the slider's grid against the SMs (:func:`draw_split_choice`), a paged cache against contiguous ones and
its page pool, and the CUDA kernel's fused merge (:func:`draw_fused_merge`). The numbers they draw are
:mod:`.costs`'; ``tests/test_decode.py`` draws each without a browser.
"""

from __future__ import annotations

import math

import numpy as np

from ...plots import new_figure, style
from .costs import (WORKLOAD_BATCHES, WORKLOAD_KV_HEADS, WORKLOAD_LENGTHS, attention_cost, cache_memory, row_chunks,
                    sm_wave, split_weights, splits_table)
from .splitkv import MIN_KEYS_PER_SPLIT, choose_num_splits, split_bounds

__all__ = ["draw_roofline", "draw_split_weights", "draw_splits_heatmap", "draw_split_choice", "draw_cache_memory",
           "draw_page_pool", "draw_fused_merge"]


def draw_roofline(points, *, peak_tflops: float, bandwidth_gbps: float, gpu: str):
    """The roofline (``min(peak, bandwidth x intensity)``) with `points` [(label, FLOPs per byte), ...] on it: the
    speed each could reach at best."""
    fig, ax = new_figure(width=7.0, height=3.8)
    intensities = [x for _, x in points]
    x = np.geomspace(min(min(intensities) / 4, 0.25), max(max(intensities) * 4, 4 * peak_tflops * 1e3 / bandwidth_gbps),
                     300)
    roof = np.minimum(peak_tflops, bandwidth_gbps * x / 1e3)
    ax.plot(x, roof, color="black", lw=1.5)
    ridge = peak_tflops * 1e3 / bandwidth_gbps
    ax.axvline(ridge, color="black", lw=0.6, ls=":")
    ax.annotate(f"ridge: {ridge:.0f} FLOP/byte", (ridge, peak_tflops / 30), xytext=(4, 0), textcoords="offset points",
                fontsize=8)
    ax.annotate(f"fp16 matmul {peak_tflops:.0f} TFLOP/s", (x[-1], peak_tflops), ha="right", va="bottom", fontsize=8)
    ax.annotate(f"memory {bandwidth_gbps:.0f} GB/s", (x[0], roof[0]), ha="left", va="bottom", fontsize=8)
    for n, (label, intensity) in enumerate(points):
        reach = min(peak_tflops, bandwidth_gbps * intensity / 1e3)
        ax.plot([intensity], [reach], "o", markersize=6, color=f"C{n}", label=f"{label}: {intensity:.3g} FLOP/byte")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("arithmetic intensity (FLOPs per byte moved)")
    ax.set_ylabel("attainable TFLOP/s")
    ax.set_title(f"Attention on the roofline of an {gpu}")
    ax.legend(loc="lower right", fontsize=8)
    return fig


def draw_split_weights(scores, num_splits: int, lses):
    """One row's scores along its keys, the split boundaries, and each split's weight in the merge."""
    scores = np.asarray(scores)
    bounds = split_bounds(len(scores), num_splits)
    weights = split_weights(lses)
    fig, (ax_s, ax_w) = new_figure(ncols=2, width=11.0, height=3.4)
    ax_s.plot(np.arange(len(scores)), scores, ".", color="C0")
    for start, stop in bounds[1:]:
        if start < len(scores):
            ax_s.axvline(start - 0.5, color="black", lw=0.6, ls="--")
    ax_s.set(xlabel="key", ylabel="score (scaled q·k)", title=f"one query's scores, {num_splits} splits")
    ax_w.bar([f"{s}\n[{a},{b})" for s, (a, b) in enumerate(bounds)], weights, color="C1")
    ax_w.set(ylabel="exp(lse_s − lse)", title="each split's weight in the merge (they sum to 1)")
    ax_w.tick_params(axis="x", labelsize=7)
    return fig


def _length_label(L: int) -> str:
    return f"{L // 1024}k" if L >= 1024 else str(L)


def draw_splits_heatmap(num_sms: int, gpu: str, batches=WORKLOAD_BATCHES, kv_heads=WORKLOAD_KV_HEADS,
                        lengths=WORKLOAD_LENGTHS, *, H: int = 32):
    """Left: the splits chosen for each workload. Right: the grid's blocks without splitting and with the splits,
    coloured by blocks per SM."""
    from matplotlib.colors import LogNorm

    rows = splits_table(num_sms, batches, kv_heads, lengths, H=H)
    labels = [f"B={B}, Hk={Hk}" for B in batches for Hk in kv_heads]
    shape = (len(labels), len(lengths))
    splits = np.array([r["splits"] for r in rows], dtype=float).reshape(shape)
    unsplit = np.array([r["blocks_unsplit"] for r in rows]).reshape(shape)
    blocks = np.array([r["blocks"] for r in rows]).reshape(shape)
    fig, (ax_s, ax_b) = new_figure(ncols=2, width=12.0, height=5.0)
    for ax, data, norm, cmap, title in (
            (ax_s, splits, LogNorm(vmin=1, vmax=64), "Blues", "splits per sequence (choose_num_splits)"),
            (ax_b, blocks / num_sms, LogNorm(vmin=1 / 16, vmax=16), "RdYlGn",
             f"blocks: unsplit → split; colour: blocks per SM ({num_sms} SMs)")):
        image = ax.imshow(data, cmap=cmap, aspect="auto", norm=norm)
        ax.set_xticks(range(len(lengths)), [_length_label(L) for L in lengths])
        ax.set_yticks(range(len(labels)), labels)
        ax.set_xlabel("keys per sequence Lk")
        ax.set_title(title, fontsize=10)
        ax.grid(False)
        fig.colorbar(image, ax=ax, shrink=0.8)
    for i in range(shape[0]):
        for j in range(shape[1]):
            ax_s.text(j, i, f"{splits[i, j]:.0f}", ha="center", va="center", fontsize=8)
            ax_b.text(j, i, f"{unsplit[i, j]}\n→{blocks[i, j]}", ha="center", va="center", fontsize=7)
    fig.suptitle(f"Split-KV on an {gpu}, H = {H} query heads: the grid is splits × B·Hk × row chunks blocks",
                 fontsize=11)
    return fig


def _square(x, y, shade):
    from matplotlib.patches import Rectangle

    color = (1 - 0.8 * shade, 1 - 0.45 * shade, 1 - 0.2 * shade)
    return Rectangle((x, y - 1), 0.9, 0.9, facecolor=color, edgecolor="#999999", lw=0.4)


def draw_cache_memory(lengths, max_len: int, page_sizes=(16, 256), shown: int = 32):
    """Left: the first `shown` sequences, the slots each uses and what a contiguous cache reserves for it.
    Right: the totals of every layout, in cache slots."""
    lengths = np.asarray(lengths)
    fig, (ax_seq, ax_tot) = new_figure(ncols=2, width=12.0, height=3.8)
    first = lengths[:shown]
    ax_seq.bar(range(len(first)), [max_len] * len(first), color="#dddddd", label=f"reserved (max_len = {max_len})")
    ax_seq.bar(range(len(first)), first, color="C0", label="used")
    ax_seq.set(xlabel="sequence", ylabel="cache slots (tokens)", title=f"contiguous caches, first {len(first)} "
               f"of {len(lengths)} sequences")
    ax_seq.legend(fontsize=8, loc="upper right")
    names = ["used", f"contiguous\n(max_len {max_len})"] + [f"paged\n({p} per page)" for p in page_sizes]
    totals = [cache_memory(lengths, max_len, page_sizes[0])["used"], len(lengths) * max_len]
    totals += [cache_memory(lengths, max_len, p)["paged"] for p in page_sizes]
    bars = ax_tot.bar(names, totals, color=["C0", "#bbbbbb"] + ["C2"] * len(page_sizes))
    for bar, total in zip(bars, totals):
        ax_tot.annotate(f"{total / totals[0]:.2f}× used", (bar.get_x() + bar.get_width() / 2, total), ha="center",
                        va="bottom", fontsize=8)
    ax_tot.set(ylabel="cache slots reserved", title=f"{len(lengths)} sequences together")
    return fig


def draw_page_pool(block_table, seq_lens, num_pages: int, page_size: int):
    """The pool of pages: each page a column of `page_size` slots, coloured by the sequence that owns it (filled:
    holds a key; pale: reserved, not yet written; grey: free). Its number on top; the block table beside it."""
    from matplotlib.patches import Rectangle

    table = np.asarray(block_table)
    lens = np.asarray(seq_lens)
    owner = {}
    for b in range(table.shape[0]):
        pages_used = -(-int(lens[b]) // page_size)
        for index, page in enumerate(table[b, :pages_used]):
            owner[int(page)] = (b, index)
    fig, ax = new_figure(width=11.0, height=3.2)
    ax.remove()
    with style():
        ax_table, ax_pool = fig.subplots(1, 2, width_ratios=[1, 2.2])
    ax_table.axis("off")
    text = [f"seq {b} ({int(lens[b])} keys): " + "  ".join(
        str(int(p)) if i < -(-int(lens[b]) // page_size) else "·" for i, p in enumerate(table[b]))
        for b in range(table.shape[0])]
    ax_table.text(0, 0.9, "block_table\n\n" + "\n".join(text), va="top", family="monospace", fontsize=9,
                  transform=ax_table.transAxes)
    for page in range(num_pages):
        for slot in range(page_size):
            if page in owner:
                b, index = owner[page]
                filled = index * page_size + slot < lens[b]
                color = f"C{b}"
                alpha = 1.0 if filled else 0.2
            else:
                color, alpha = "#cccccc", 1.0
            ax_pool.add_patch(Rectangle((page, -slot - 1), 0.9, 0.9, facecolor=color, alpha=alpha, lw=0))
        ax_pool.text(page + 0.45, 0.3, str(page), ha="center", fontsize=8)
    ax_pool.set_xlim(-0.2, num_pages)
    ax_pool.set_ylim(-page_size - 0.2, 1.2)
    ax_pool.axis("off")
    ax_pool.set_title(f"the pool: {num_pages} pages of {page_size} slots", fontsize=10)
    return fig


def draw_fused_merge(num_splits: int = 4, finish_order=(2, 0, 3, 1)):
    """The CUDA split kernel's merge in its own launch, for one (sequence, KV head): each split block writes
    its partial output and LSE, then adds one to the group's counter with a release at GPU scope (its results are
    visible before its count); the block whose add returns ``num_splits - 1`` is the last, acquires, and merges every
    split's partial result (read from L2). The counters are the call's own, zeroed by a memset before the launch. `finish_order` is the order in which the blocks
    finish (any order: the GPU schedules blocks as it likes)."""
    from matplotlib.patches import FancyArrowPatch, Rectangle

    order = list(finish_order)
    if sorted(order) != list(range(num_splits)):
        raise ValueError(f"draw_fused_merge: finish_order must order the splits 0 .. {num_splits - 1}, got {order}")
    fig, ax = new_figure(width=11.0, height=3.6)
    for s in range(num_splits):
        rank = order.index(s)
        x = 0.4 + rank * 2.2  # left to right: the order in which the blocks finish
        last = rank == num_splits - 1
        ax.add_patch(Rectangle((x, 3.0), 1.8, 0.8, facecolor="C1" if last else "C0", alpha=0.8, lw=0))
        ax.text(x + 0.9, 3.4, f"split block {s}\n(keys of split {s})", ha="center", va="center", fontsize=8,
                color="white")
        ax.add_patch(Rectangle((x, 1.6), 1.8, 0.6, facecolor="#dddddd", lw=0))
        ax.text(x + 0.9, 1.9, f"part_out[{s}], part_lse[{s}]", ha="center", va="center", fontsize=8)
        ax.add_patch(FancyArrowPatch((x + 0.9, 3.0), (x + 0.9, 2.2), arrowstyle="-|>", mutation_scale=10))
        ax.text(x + 0.95, 2.6, "1. write", fontsize=7)
        ax.plot([x + 0.9, x + 0.9], [0.45, 0.25], color="#888888", lw=0.8)  # to the counter: the bus below
        ax.text(x + 0.9, 0.95, f"2. __syncthreads\n3. add (release) -> {rank}" + ("\n= num_splits - 1: last" if last else
                                                                                   "\n< num_splits - 1: exit"),
                ha="center", va="top", fontsize=7.5, color="C1" if last else "black")
    ax.plot([1.3, 10.4], [0.25, 0.25], color="#888888", lw=0.8)
    ax.add_patch(FancyArrowPatch((10.4, 0.25), (10.4, 1.5), arrowstyle="-|>", mutation_scale=10, color="#888888"))
    ax.text(10.45, 0.7, "add", fontsize=7, color="#555555")
    ax.add_patch(Rectangle((9.6, 1.5), 1.6, 0.8, facecolor="white", edgecolor="black", lw=0.8))
    ax.text(10.4, 1.9, "counter of\n(sequence, KV head)", ha="center", va="center", fontsize=7.5)
    x_last = 0.4 + (num_splits - 1) * 2.2
    ax.add_patch(FancyArrowPatch((x_last + 1.8, 3.4), (10.4, 3.4), arrowstyle="-|>", mutation_scale=10, color="C1"))
    ax.text(10.4, 3.55, f"4. the last block acquires, merges all {num_splits}\n(merge_splits, reads from L2)",
            ha="center", va="bottom", fontsize=7.5, color="C1")
    ax.set_xlim(0, 11.6)
    ax.set_ylim(0.0, 4.6)
    ax.axis("off")
    ax.set_title(f"The fused merge: {num_splits} split blocks of one group, left to right in the order they finish",
                 fontsize=10)
    return fig


def draw_split_choice(B: int, Hk: int, Lk: int, *, num_sms: int, gpu: str, H: int = 32, D: int = 64,
                      dtype_bytes: int = 2, blocks_per_sm: int = 2):
    """The slider's figure for one workload: the grid's size against the number of splits, and the SMs its first
    wave keeps busy without splitting and with the chosen splits; the title gives the bytes."""
    H = max(H, Hk)
    chosen = choose_num_splits(B, Hk, Lk, num_sms, blocks_per_sm=blocks_per_sm, row_chunks=row_chunks(H, Hk))
    cost = attention_cost(B, H, Hk, 1, Lk, D, dtype_bytes)
    fig, (ax_grid, ax_sms) = new_figure(ncols=2, width=12.0, height=3.8)
    counts = np.arange(1, 65)
    unsplit = B * Hk * row_chunks(H, Hk)
    ax_grid.plot(counts, unsplit * counts, color="C0", label="blocks = splits × B·Hk × row chunks")
    if Lk // MIN_KEYS_PER_SPLIT < counts[-1]:
        ax_grid.axvspan(max(1, Lk // MIN_KEYS_PER_SPLIT), counts[-1], color="#eeeeee",
                        label=f"splits under {MIN_KEYS_PER_SPLIT} keys")
    ax_grid.axhline(num_sms, color="black", lw=0.8, ls="--", label=f"{num_sms} SMs")
    ax_grid.axhline(num_sms * blocks_per_sm, color="black", lw=0.8, ls=":", label=f"{blocks_per_sm} blocks per SM")
    ax_grid.plot([chosen], [unsplit * chosen], "o", color="C3", markersize=8, label=f"chosen: {chosen} splits")
    ax_grid.set_yscale("log")
    ax_grid.set(xlabel="splits per sequence", ylabel="blocks in the grid", title=f"B={B}, Hk={Hk}, Lk={Lk}")
    ax_grid.legend(fontsize=8, loc="lower right")
    side = math.ceil(math.sqrt(num_sms))
    for row, (label, blocks) in enumerate((("unsplit", unsplit), (f"{chosen} splits", unsplit * chosen))):
        wave = sm_wave(blocks, num_sms, blocks_per_sm)
        for sm, resident in enumerate(wave):
            x, y = sm % side + row * (side + 2), -(sm // side)
            ax_sms.add_patch(_square(x, y, resident / blocks_per_sm))
        busy = int((wave > 0).sum())
        ax_sms.text(row * (side + 2) + side / 2, 1.2, f"{label}: {blocks} blocks\n{busy} of {num_sms} SMs busy",
                    ha="center", fontsize=8)
    ax_sms.set_xlim(-1, 2 * side + 3)
    ax_sms.set_ylim(-side - 0.5, 3)
    ax_sms.set_aspect("equal")
    ax_sms.axis("off")
    ax_sms.set_title(f"the first wave on an {gpu}", fontsize=9)
    keys = split_bounds(Lk, chosen)[0][1]
    fig.suptitle(f"{chosen} splits of {keys} keys; one layer's step reads {cost['kv_bytes'] / 2**20:.1f} MiB of "
                 f"K and V ({2 * Hk * D * dtype_bytes} bytes per cached token, H = {H}, D = {D}, "
                 f"{8 * dtype_bytes}-bit)", fontsize=10)
    return fig
