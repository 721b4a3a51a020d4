"""Figure and slider logic for lesson 07 (decoding with a KV cache).

What a decode step costs (FLOPs, bytes, where that sits on a roofline), how many key splits fill the GPU, a paged
cache against contiguous ones sized to a maximum length, and the committed GPU numbers the lesson reads (the decode
benchmark's, and the decoder's tokens per second from ``wb_kernels/models/decoder_tokens.py``), read for the lesson's asserted claims, and the
picture of the CUDA kernel's fused merge (:func:`draw_fused_merge`). Plain
functions (inputs -> numbers or a matplotlib Figure): pytest calls them (``tests/test_decode.py``), and the lesson
wires :func:`draw_split_choice` to three sliders with :func:`wb_kernels.widgets.link_sliders`.
"""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np

from ...plots import new_figure, style
from .splitkv import MIN_KEYS_PER_SPLIT, choose_num_splits, split_bounds

__all__ = ["attention_cost", "committed_gpu", "draw_roofline", "split_weights", "draw_split_weights",
           "row_chunks", "splits_table", "draw_splits_heatmap", "sm_wave", "draw_split_choice", "random_sequence_lengths",
           "cache_memory", "draw_cache_memory", "draw_page_pool", "committed_tune_results",
           "describe_tune_run", "committed_decoder_results", "decoder_table", "describe_decoder_run",
           "NO_DECODER_RUN", "draw_fused_merge", "implied_block_overhead_keys", "decode_bench_rows", "copy_bandwidths",
           "committed_decode_bar_results", "OLDER_KERNEL", "BEFORE_PAGED_FIX", "PAGED_FIX", "kernel_bytes_rows", "decoder_speedups", "CUDA_ROWS_PER_BLOCK", "SLIDER_BATCHES", "SLIDER_KV_HEADS", "SLIDER_LENGTHS", "WORKLOAD_BATCHES",
           "WORKLOAD_KV_HEADS", "WORKLOAD_LENGTHS"]

SLIDER_BATCHES = (1, 2, 4, 8, 16, 32, 64, 128)
SLIDER_KV_HEADS = (1, 2, 4, 8, 16, 32)
SLIDER_LENGTHS = (1024, 2048, 4096, 8192, 16384, 32768, 65536, 131072)
# the decode workloads the rung is measured on: batch 1, 8, 64; MHA, GQA and MQA of 32 query heads; 1k to 128k keys
WORKLOAD_BATCHES = (1, 8, 64)
WORKLOAD_KV_HEADS = (32, 8, 1)
WORKLOAD_LENGTHS = SLIDER_LENGTHS


# ---------------------------------------------------------------- what a step costs


def attention_cost(B: int, H: int, Hk: int, Lq: int, Lk: int, D: int, dtype_bytes: int = 2) -> dict:
    """FLOPs of attention (``4 B H Lq Lk D``: QK^T and PV, no mask) and the bytes it must move at least: q and the
    output once, and the cache's K and V once (``2 B Hk Lk D``: the query heads of a group share their KV head).
    Decode is ``Lq = 1``; a prefill of L tokens is ``Lq = Lk = L``."""
    if min(B, H, Hk, Lq, Lk, D, dtype_bytes) < 1 or H % Hk:
        raise ValueError(f"attention_cost: sizes must be >= 1 and Hk={Hk} must divide H={H}")
    flops = 4 * B * H * Lq * Lk * D
    q_and_out = 2 * B * H * Lq * D * dtype_bytes
    kv = 2 * B * Hk * Lk * D * dtype_bytes
    return {"flops": flops, "kv_bytes": kv, "q_out_bytes": q_and_out, "bytes": kv + q_and_out,
            "intensity": flops / (kv + q_and_out)}


def committed_gpu(path=None) -> dict | None:
    """The GPU of the committed benchmark run (``results/bench/``, or `path`): its name, date, SM count, copy
    bandwidth and fp16 matrix-multiply peak as that run measured them. None where no GPU run is committed."""
    from ...bench import committed_results, load_results

    path = path or committed_results("gpu")
    if path is None:
        return None
    results = load_results(path)
    env, ceilings = results["environment"], results.get("ceilings") or {}
    return {"gpu": env["gpu"], "date": env["date"][:10], "sm_count": env["sm_count"],
            "copy_gbps": ceilings.get("copy_gbps"), "float16_tflops": ceilings.get("float16_matmul_tflops"),
            "file": Path(path).name}


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


# ---------------------------------------------------------------- split-KV


def split_weights(lses) -> np.ndarray:
    """Each split's share of the row's softmax mass, ``exp(lse_s - lse)``: they sum to 1 (0 for an empty split)."""
    lses = np.asarray(lses, dtype=np.float64)
    top = lses.max()
    if not np.isfinite(top):
        return np.zeros_like(lses)
    weights = np.exp(lses - top)
    return weights / weights.sum()


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


CUDA_ROWS_PER_BLOCK = 4  # flash_decode.cu's blocks hold up to 4 query heads: what a GPU runs for 16-bit caches


def row_chunks(H: int, Hk: int, rows_per_block: int = CUDA_ROWS_PER_BLOCK) -> int:
    """Blocks per (split, sequence, KV head): a block holds `rows_per_block` query rows, the group's H / Hk heads
    (one new token each); a larger group takes several blocks, and each reads the split's keys again."""
    return -(-(H // Hk) // rows_per_block)


def splits_table(num_sms: int, batches=WORKLOAD_BATCHES, kv_heads=WORKLOAD_KV_HEADS, lengths=WORKLOAD_LENGTHS, *,
                 H: int = 32):
    """For every (B, Hk, Lk): the splits ``choose_num_splits`` picks and the grid the kernel launches, without
    splitting and with the splits (``splits x B·Hk x row chunks`` blocks), and the latter per SM."""
    rows = []
    for B in batches:
        for Hk in kv_heads:
            for Lk in lengths:
                splits = choose_num_splits(B, Hk, Lk, num_sms, row_chunks=row_chunks(H, Hk))
                unsplit = B * Hk * row_chunks(H, Hk)
                rows.append({"B": B, "Hk": Hk, "Lk": Lk, "splits": splits, "blocks_unsplit": unsplit,
                             "blocks": unsplit * splits, "blocks_per_sm": unsplit * splits / num_sms})
    return rows


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


def sm_wave(blocks: int, num_sms: int, blocks_per_sm: int = 2) -> np.ndarray:
    """Blocks resident on each SM in the grid's first wave (blocks dealt out one per SM in turn, at most
    `blocks_per_sm` each): how much of the GPU the grid can keep busy at once."""
    first_wave = min(blocks, num_sms * blocks_per_sm)
    return np.array([first_wave // num_sms + (sm < first_wave % num_sms) for sm in range(num_sms)])


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


def _square(x, y, shade):
    from matplotlib.patches import Rectangle

    color = (1 - 0.8 * shade, 1 - 0.45 * shade, 1 - 0.2 * shade)
    return Rectangle((x, y - 1), 0.9, 0.9, facecolor=color, edgecolor="#999999", lw=0.4)


# ---------------------------------------------------------------- a paged cache


def random_sequence_lengths(count: int, max_len: int, seed: int = 0) -> np.ndarray:
    """Final lengths of `count` sequences: log-normal around an eighth of `max_len`, clipped to [1, max_len]. Most
    requests end far below the maximum a server must allow for (the observation behind PagedAttention)."""
    rng = np.random.default_rng(seed)
    lengths = rng.lognormal(mean=math.log(max_len / 8), sigma=0.9, size=count)
    return np.clip(np.round(lengths), 1, max_len).astype(int)


def cache_memory(lengths, max_len: int, page_size: int) -> dict:
    """Cache slots (tokens) reserved for sequences of `lengths`: contiguous caches sized to `max_len` each, or
    pages of `page_size` slots handed out as the sequence grows (only the last page is partly empty)."""
    lengths = np.asarray(lengths)
    if lengths.size and (lengths.min() < 0 or lengths.max() > max_len):
        raise ValueError(f"cache_memory: lengths must be in [0, {max_len}]")
    used = int(lengths.sum())
    paged = int((-(-lengths // page_size) * page_size).sum())
    contiguous = int(lengths.size * max_len)
    return {"used": used, "contiguous": contiguous, "paged": paged,
            "contiguous_waste": 1 - used / contiguous if contiguous else 0.0,
            "paged_waste": 1 - used / paged if paged else 0.0}


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


# ---------------------------------------------------------------- committed measurements


def committed_tune_results(folder=None):
    """The committed tuning run of the CUDA decode kernel (``results/decode/tune_<gpu>.json``), or None."""
    from ...bench import REPO_ROOT

    folder = Path(folder) if folder is not None else REPO_ROOT / "results" / "decode"
    found = sorted(folder.glob("tune_*.json"))
    return found[-1] if found else None


def describe_tune_run(results: dict, variant: str | None = None) -> list:
    """Lines from tune.py's file: per workload, `variant` (default: the first one the file names, the kernel's
    default build) at the number of splits the launcher picks (``choose_num_splits`` at the kernel's occupancy) and at
    its fastest number of splits, as a fraction of the copy ceiling and against SDPA measured in the same run."""
    records = results["records"]
    variant = variant or records[0]["variant"]
    env = results.get("environment") or {}
    lines = [f"{env.get('gpu', 'a GPU')}, {str(env.get('date', ''))[:10]}, commit {env.get('git_commit')}: "
             f"variant {variant}; the bare extension call (split + merge kernels), "
             + ("device time, L2 flushed clean before each call" if "device time" in results.get("notes", {}).get(
                 "timing", "") else "L2 flushed before each call"),
             f"{'workload':26s} {'splits':>6s} {'ms':>8s} {'of copy':>8s} {'vs SDPA':>8s}   fastest splits"]
    shapes = list(dict.fromkeys((r["B"], r["H"], r["Hk"], r["Lk"], r["D"]) for r in records))
    for shape in shapes:
        rows = [r for r in records if (r["B"], r["H"], r["Hk"], r["Lk"], r["D"]) == shape and r["variant"] == variant]
        if not rows:
            continue
        # the launcher's pick, measured as it is (files from before 2026-11-24 hold the old rule's pick at 2 blocks
        # per SM, and only powers of two: the nearest one measured stands for it)
        picked = rows[0].get("launcher_splits", rows[0]["heuristic_splits"]["2"])
        at_pick = min(rows, key=lambda r: (abs(math.log2(r["splits"]) - math.log2(picked)), r["median_ms"]))
        best = min(rows, key=lambda r: r["median_ms"])
        sdpa = rows[0]["baselines_ms"]["sdpa"]
        B, H, Hk, Lk, D = shape
        lines.append(f"B{B} H{H} Hk{Hk} Lk{Lk} D{D}".ljust(26)
                     + f" {at_pick['splits']:>6d} {at_pick['median_ms']:8.4f} {at_pick['fraction_of_copy']:8.0%} "
                       f"{sdpa / at_pick['median_ms']:7.2f}x   {best['splits']} splits: {best['fraction_of_copy']:.0%}"
                       f" of copy (choose_num_splits: {picked})")
    return lines


NO_DECODER_RUN = ("No decoder run is committed yet (results/decode/decoder_<gpu>.json, from "
                  "`python -m wb_kernels.models.decoder_tokens`)")


def committed_decoder_results(folder=None):
    """The newest committed GPU run of the decoder's tokens per second (``results/decode/decoder_*.json``, written by
    ``python -m wb_kernels.models.decoder_tokens``), by the date it records; None while there is none. Smoke runs and
    files that are not such runs (unreadable, another kind) are passed over."""
    import json

    from ...bench import REPO_ROOT

    folder = Path(folder) if folder is not None else REPO_ROOT / "results" / "decode"
    found = []
    for path in sorted(folder.glob("decoder_*.json")):
        try:
            data = json.loads(path.read_text())
        except (OSError, ValueError):
            continue
        if isinstance(data, dict) and data.get("kind") == "decoder_tokens" and data.get("mode") == "gpu":
            found.append((str((data.get("environment") or {}).get("date", "")), path.name, path))
    return max(found)[2] if found else None


def _cell(value, text: str) -> str:
    return "–" if value is None else text.format(value)


def decoder_table(results: dict) -> str:
    """A results file of ``wb_kernels/models/decoder_tokens.py`` as text: where and how it ran, one line per row (model, batch, context, cache
    layout, attention, tokens/s, ms per step, the attention's share of the step, tokens/s over SDPA's on the same
    layout, percent of the step's roofline), then the greedy check's verdicts."""
    env = results.get("environment") or {}
    settings = results.get("settings") or {}
    ceilings = results.get("ceilings") or {}
    where = env.get("gpu") or env.get("device") or "an unnamed device"
    lines = [f"{where}, {str(env.get('date', ''))[:10]}, commit {env.get('git_commit')}, torch {env.get('torch')}, "
             f"CUDA {env.get('cuda')}" + (" (a smoke run: not GPU numbers)" if results.get("mode") != "gpu" else ""),
             f"{settings.get('dtype')}, {settings.get('steps')} timed decode steps per row (after "
             f"{settings.get('warmup')} untimed); roofline at the copy bandwidth of the same run, "
             f"{ceilings.get('copy_gbps')} GB/s"
             + ("" if results.get("complete") else "; the run did not finish"),
             "",
             f"{'config':<14} {'batch':>5} {'context':>7}  {'mode':<8} {'layout':<10} {'attend':<10} {'tokens/s':>9} "
             f"{'ms/step':>8} {'attention':>9} {'vs SDPA':>8} {'vs FI':>7} {'roofline':>8}"]
    for r in results.get("records", []):
        head = (f"{r['config']:<14} {r['batch']:>5} {r['context']:>7}  {r.get('mode', 'eager'):<8} {r['layout']:<10} "
                f"{r['attend']:<10} ")
        if r.get("status") != "ok":
            lines.append(head + f"{r.get('status')}: {r.get('reason', '')}")
            continue
        share = r.get("attention_share")
        lines.append(head + f"{r['tokens_per_s']:>9.4g} {r['ms_per_step']:>8.3g} "
                     f"{_cell(None if share is None else 100 * share, '{:.0f}%'):>9} "
                     f"{_cell(r.get('vs_sdpa'), '{:.3g}x'):>8} "
                     f"{_cell(r.get('vs_flashinfer'), '{:.3g}x'):>7} "
                     f"{_cell(r.get('fraction_of_roofline'), '{:.0%}'):>8}")
    lines.append("(mode: eager, a CUDA graph per batch, or torch.compile; attention: its share of the step, eager only; "
                 "vs SDPA: tokens/s over SDPA's in the same mode on the same cache layout; vs FI: "
                 "wb's tokens/s over FlashInfer's on the same paged cache; roofline: the step's roofline time over the "
                 "measured one)")
    for g in results.get("greedy", []):
        head = (f"greedy, {g['config']}: {g['batch']} prompts of {g['prompt_len']} tokens, {g['new_tokens']} new "
                f"tokens each, {g['other']} against {g['reference']}: ")
        lines.append(head + (g.get("note", "") if g.get("status") == "ok"
                             else f"{g.get('status')}: {g.get('reason', '')}"))
    return "\n".join(lines)


def describe_decoder_run(folder=None) -> str:
    """What the lesson prints: the newest committed decoder run as :func:`decoder_table`, with its file's name, or
    :data:`NO_DECODER_RUN`."""
    import json

    path = committed_decoder_results(folder)
    if path is None:
        return NO_DECODER_RUN
    return f"{path.name}:\n" + decoder_table(json.loads(path.read_text()))


# ---------------------------------------------------------------- the CUDA kernel's fused merge


def draw_fused_merge(num_splits: int = 4, finish_order=(2, 0, 3, 1)):
    """flash_decode.cu's merge in the split kernel's own launch, for one (sequence, KV head): each split block writes
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


# ---------------------------------------------------------------- the committed runs, read for the lesson's claims


def _tune_rows(results: dict, shape, variant: str | None = None) -> dict:
    """{splits: record} of tune.py's file at shape (B, H, Hk, Lk, D), for `variant` (default: the file's first)."""
    variant = variant or results["records"][0]["variant"]
    return {r["splits"]: r for r in results["records"]
            if (r["B"], r["H"], r["Hk"], r["Lk"], r["D"]) == tuple(shape) and r["variant"] == variant}


def implied_block_overhead_keys(results: dict, shape=(8, 32, 8, 8192, 128), num_sms: int = 132,
                                blocks_per_sm: int = 2) -> dict:
    """What a tuning run says a block's fixed cost is, in keys' time, at `shape`: with T(S) the time at S splits and
    the cost model waves(S) x (keys per split(S) + o), each count S past the fewest splits that fill one wave gives
    one o from T(S) / T(S1) = waves(S) (k(S) + o) / (waves(S1) (k(S1) + o)). {S: o}."""
    from .splitkv import split_cost

    B, H, Hk, Lk, D = shape
    rows = _tune_rows(results, shape)
    plans = {S: split_cost(B, Hk, Lk, num_sms, S, blocks_per_sm=blocks_per_sm, row_chunks=row_chunks(H, Hk))
             for S in rows}
    one_wave = max(S for S in rows if plans[S]["waves"] == 1)
    base, t_base = plans[one_wave], rows[one_wave]["median_ms"]
    implied = {}
    for S in sorted(rows):
        if S <= one_wave:
            continue
        ratio = rows[S]["median_ms"] / t_base
        w, k = plans[S]["waves"], plans[S]["keys_per_split"]
        # ratio * (k1 + o) = w (k + o)  ->  o = (ratio k1 - w k) / (w - ratio)
        implied[S] = (ratio * base["keys_per_split"] - w * k) / (w - ratio)
    return implied


def decode_bench_rows(results: dict, *, D: int, dtype: str = "float16", layout: str = "contiguous", Hk=None) -> list:
    """wb.decode's measured rows of a decode benchmark file at head dim D, each with the prediction from the same
    file: K and V bytes over the file's copy ceiling, both in µs."""
    copy_gbps = results["ceilings"]["copy_gbps"]
    rows = []
    for r in results["records"]:
        if (r.get("contender"), r.get("layout"), r.get("dtype"), r.get("D"), r.get("status")) != (
                "wb.decode", layout, dtype, D, "ok") or (Hk is not None and r["Hk"] != Hk):
            continue
        predicted_us = r["kv_bytes"] / (copy_gbps * 1e3)
        rows.append({"B": r["B"], "H": r["H"], "Hk": r["Hk"], "Lk": r["Lk"], "kv_bytes": r["kv_bytes"],
                     "predicted_us": predicted_us, "measured_us": 1e3 * r["median_ms"],
                     "gbps": r["kv_bytes"] / (1e6 * r["median_ms"]), "fraction_of_copy": r["fraction_of_copy"],
                     "vs_best_sdpa": (r.get("vs_best_sdpa") or {}).get("ratio")})
    return sorted(rows, key=lambda r: (r["Hk"], r["B"], r["Lk"]))


# the full decode preset's run before issue #30's kernels (commit 7e365e7): lesson 07's "older kernel", kept under
# results/decode/history/ when the preset ran again at the kernels of 2026-11-27 (results/decode/bench_h100.json)
OLDER_KERNEL = "bench_decode_h100_7e365e7.json"
# the decode-bar run after the graph-safe rewrite and before the paged kernel's fix (lesson 07's paged regression)
BEFORE_PAGED_FIX = "bench_decode_bar_h100_444ad36.json"
PAGED_FIX = "bench_decode_bar_h100_45dad40.json"  # the run after the paged fix (lesson 07 compares the three)


def committed_decode_bar_results(folder=None):
    """The newest committed run of the decode-bar preset (``results/decode/history/bench_decode_bar_<gpu>_<commit>.json``,
    from ``python -m wb_kernels.bench --preset decode-bar --fresh --json ...``), by the date it records, or None.
    The full decode preset's file (``results/decode/bench_<gpu>.json``) is :func:`committed_decode_results`'."""
    from ...bench import REPO_ROOT, load_results

    folder = Path(folder) if folder is not None else REPO_ROOT / "results" / "decode" / "history"
    found = []
    for path in sorted(folder.glob("bench_decode_bar_*.json")):
        try:
            data = load_results(path)
        except (OSError, ValueError):
            continue
        if isinstance(data, dict) and (data.get("environment") or {}).get("backend") == "gpu":
            found.append((str(data["environment"].get("date", "")), path.name, path))
    return max(found)[2] if found else None


def kernel_bytes_rows(shapes, *, num_sms: int, blocks_per_sm=2, H: int = 32, Hk: int = 1, D: int = 128,
                      itemsize: int = 2) -> list:
    """What each CUDA kernel would ask of memory at the shapes (B, Lk): for the split kernel (up to 4 query heads a
    block) and the tensor-core kernel (the whole group a block), the splits the launcher's rule picks at
    `blocks_per_sm` (the GPU's occupancy of the kernel, which the launcher asks the CUDA runtime for; here given: one
    number for both kernels, or ``{"split": n, "mma": m}``) and :func:`launcher.decode_bytes` at those splits. One
    dict per (shape, kernel)."""
    from . import build, launcher

    rules = {"split": {"row_chunks": launcher.cuda_row_chunks(H // Hk),
                       "min_keys_per_split": launcher.SPLIT_MIN_KEYS_PER_SPLIT},
             "mma": {"row_chunks": 1, "min_keys_per_split": launcher.MMA_MIN_KEYS_PER_SPLIT,
                     "max_splits": launcher.MMA_MAX_SPLITS}}
    rows = []
    for B, Lk in shapes:
        for kernel, rule in rules.items():
            occupancy = blocks_per_sm[kernel] if isinstance(blocks_per_sm, dict) else blocks_per_sm
            asked = choose_num_splits(B, Hk, Lk, num_sms, blocks_per_sm=occupancy, keys_step=build.KEYS_PER_STEP,
                                      **rule)
            splits = launcher.cuda_split_plan(Lk, asked)[1]
            rows.append({"B": B, "Lk": Lk, "kernel": kernel, "splits": splits,
                         "bytes": launcher.decode_bytes(B, H, Hk, Lk, D, itemsize, splits, kernel)})
    return rows


def copy_bandwidths() -> dict:
    """The copy bandwidth of every committed GPU run the lesson reads, {file: (GPU, date, GB/s)}: each run measures
    its own device-to-device copy, and each comparison uses its own run's."""
    from ...bench import REPO_ROOT, load_results
    from ...bench.results import committed_decode_results

    found = {}
    gpu = committed_gpu()
    if gpu is not None:
        found[f"results/bench/{gpu['file']}"] = (gpu["gpu"], gpu["date"], gpu["copy_gbps"])
    older = REPO_ROOT / "results" / "decode" / "history" / OLDER_KERNEL
    for path in (committed_decode_results(), older if older.exists() else None, committed_decode_bar_results(),
                 committed_decoder_results()):
        if path is not None:
            data = load_results(path)
            found[path.relative_to(REPO_ROOT).as_posix()] = (data["environment"]["gpu"],
                                                             data["environment"]["date"][:10],
                                                             data["ceilings"]["copy_gbps"])
    return found


def decoder_speedups(results: dict, *, layout: str = "paged", attend: str = "wb", mode: str = "eager") -> list:
    """(config, batch, context, tokens/s over SDPA's on the same layout) of a decoder run's `attend` rows in `mode`
    (eager, graph or compile; a file written before the modes holds eager rows only)."""
    return [(r["config"], r["batch"], r["context"], r["vs_sdpa"]) for r in results.get("records", [])
            if r.get("status") == "ok" and r["layout"] == layout and r["attend"] == attend
            and r.get("mode", "eager") == mode and r.get("vs_sdpa") is not None]
