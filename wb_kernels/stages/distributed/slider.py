"""Figure, model and slider logic for lesson 10 (exact attention across GPUs).

Plain functions (inputs -> numbers, records or a matplotlib Figure) that pytest calls without a browser
(``tests/test_distributed_lesson.py``) and the lesson wires to sliders:

- :func:`simulate_ring`: the ring in one process, every rank in a loop, each step's partial merged by a merge
  function the caller may replace (the lesson's puzzle replaces it); the teaching model of ``ring.py``.
- :func:`chunk_pair_map` and :func:`draw_ring_blocks`: which (query chunk, key chunk) blocks each rank computes at
  each ring step, contiguous against zigzag, and the work of each rank per step (``sharding.ring_work``).
- :func:`overlap_tokens`, :func:`step_times` and :func:`draw_overlap`: when a step's compute hides the transfer of
  the next K/V block: tokens per shard >= achieved FLOP/s / link bandwidth (MHA, 2-byte elements, no mask).
- :func:`communication_bytes` and :func:`hierarchical_plan`: what the ring and Ulysses send, and a plan past one
  machine (Ulysses inside a node, the ring across nodes).
- :func:`launch` and :func:`summarize_launch`: run ``wb_kernels.stages.distributed.run`` under torchrun from a cell,
  in its own process group under a time limit, and print what is the same on every machine.
- :func:`scaling_records` and :func:`scaling_bars`: issue #32's bars read from a scaling results file's records.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
from pathlib import Path

import numpy as np

from ...plots import new_figure
from .scaling import BARS as SCALING_BARS
from .sharding import chunk_bounds, pair_blocks, predicted_efficiency, ring_work, shard_pieces, visible_pairs

__all__ = ["LINKS", "ACHIEVED_TFLOPS", "simulate_ring", "chunk_pair_map", "draw_ring_blocks", "overlap_tokens",
           "step_times", "draw_overlap", "communication_bytes", "hierarchical_plan", "launch", "summarize_launch",
           "scaling_records", "scaling_bars", "BARS", "SLIDER_WORLDS", "SLIDER_TFLOPS"]

# Bandwidth of one direction of a link, bytes per second (a ring step sends one block and receives one at once).
LINKS = {
    "NVLink 4 (H100 SXM, 18 links)": 450e9,  # NVIDIA H100 datasheet: 900 GB/s both directions
    "PCIe Gen5 x16": 64e9,  # 32 GT/s x 16 lanes, 128b/130b: ~63 GB/s each way
    "InfiniBand NDR (400 Gb/s)": 50e9,  # one 400 Gb/s port, as in an 8-GPU node with one NIC per GPU
}
# A round figure for a tuned fp16 FlashAttention forward at D = 128 on an H100, assumed, not read from a results
# file: the figure behind issue #32's 1.3k / 9k / 12k tokens. The lesson's slider moves it.
ACHIEVED_TFLOPS = 600.0
SLIDER_WORLDS = (2, 3, 4, 6, 8)
SLIDER_TFLOPS = (100, 200, 300, 400, 600, 800, 1000)
# issue #32's first bar: scaling efficiency at L = 128k on 2 GPUs, non-causal (any ring) and causal (zigzag); the
# numbers are the benchmark's (scaling.BARS, keyed by causal), named here as the lesson prints them
BARS = {"non-causal": SCALING_BARS[False], "causal (zigzag)": SCALING_BARS[True]}
BAR_LENGTH, BAR_WORLD = 131072, 2


# ---------------------------------------------------------------- the ring in one process

def simulate_ring(q, k, v, world: int, *, layout: str = "contiguous", causal=False, key_padding_mask=None,
                  scale=None, merge=None):
    """The ring of ``ring.py`` run in one process: for each rank and each of `world` steps, the attention of the
    rank's queries over the K/V block it holds at that step (the block of rank (rank - step) mod world), split by
    :func:`.sharding.pair_blocks` under a causal mask, each partial merged into the rank's accumulator with
    ``merge(acc_out, acc_lse, out, lse) -> (out, lse)`` (default :func:`.merge.merge_pair`).

    q (B, H, Lq, D), k, v (B, Hk, Lk, D): float torch tensors, whole sequences. Returns (out, lse, schedule):
    out and lse in the accumulation dtype for every row (scattered back from the ranks), and schedule, a list of
    (step, rank, (q0, q1), (k0, k1), causal) for every attention call, in the order made.
    """
    import torch

    import wb_kernels as wb
    from ...reference import causal_offset
    from .merge import merge_pair
    from .ring import new_accumulator

    merge = merge or merge_pair
    Lq, Lk = q.shape[2], k.shape[2]
    offset = causal_offset(causal, Lq, Lk)
    out_all, lse_all = new_accumulator(q)
    schedule = []
    for rank in range(world):
        rows = np.concatenate([np.arange(a, b) for a, b in shard_pieces(Lq, world, rank, layout)]).astype(np.int64)
        acc_out, acc_lse = out_all[:, :, rows].clone(), lse_all[:, :, rows].clone()
        local = {int(g): i for i, g in enumerate(rows)}
        for step in range(world):
            for qp in shard_pieces(Lq, world, rank, layout):
                for kp in shard_pieces(Lk, world, (rank - step) % world, layout):
                    for (q0, q1), (k0, k1), kind in pair_blocks(qp, kp, offset):
                        mask = None if key_padding_mask is None else key_padding_mask[:, k0:k1]
                        out, lse = wb.attention(q[:, :, q0:q1], k[:, :, k0:k1], v[:, :, k0:k1], stage="reference",
                                                causal=kind, key_padding_mask=mask, scale=scale, return_lse=True)
                        sl = slice(local[q0], local[q0] + q1 - q0)
                        acc_out[:, :, sl], acc_lse[:, :, sl] = merge(acc_out[:, :, sl], acc_lse[:, :, sl],
                                                                     out.to(acc_out.dtype), lse.to(acc_lse.dtype))
                        schedule.append((step, rank, (q0, q1), (k0, k1), kind))
        index = torch.as_tensor(rows)
        out_all[:, :, index], lse_all[:, :, index] = acc_out, acc_lse
    return out_all, lse_all, schedule


# ---------------------------------------------------------------- which blocks each rank computes, and when

def _owner(L: int, world: int, layout: str):
    """owner[c]: the rank holding chunk c of the 2W chunks of a sequence of L positions."""
    chunks = chunk_bounds(L, 2 * world)
    owner = np.empty(2 * world, dtype=np.int64)
    for rank in range(world):
        for a, b in shard_pieces(L, world, rank, layout):
            for c, (ca, cb) in enumerate(chunks):
                if a <= ca and cb <= b and cb > ca:
                    owner[c] = rank
    return owner


def chunk_pair_map(L: int, world: int, layout: str = "contiguous", causal: bool = True) -> dict:
    """The sequence cut into 2W chunks (L divisible by 2W); for every (query chunk i, key chunk j): the rank that
    computes it (the owner of query chunk i), the ring step at which that rank holds key chunk j
    ((owner(i) - owner(j)) mod W), and the fraction of its (query, key) pairs the mask lets through (0: skipped,
    1: full, about 1/2: the diagonal). Top-left causal, Lq = Lk = L."""
    if L % (2 * world):
        raise ValueError(f"chunk_pair_map: L = {L} must be divisible by 2W = {2 * world}")
    chunks = chunk_bounds(L, 2 * world)
    owner = _owner(L, world, layout)
    n = 2 * world
    rank, step, visible = (np.zeros((n, n), dtype=np.int64), np.zeros((n, n), dtype=np.int64),
                           np.zeros((n, n), dtype=np.float64))
    for i, qr in enumerate(chunks):
        for j, kr in enumerate(chunks):
            rank[i, j] = owner[i]
            step[i, j] = (owner[i] - owner[j]) % world
            visible[i, j] = visible_pairs(qr, kr, 0 if causal else None) / ((qr[1] - qr[0]) * (kr[1] - kr[0]))
    return {"owner": owner, "rank": rank, "step": step, "visible": visible}


def draw_ring_blocks(world: int = 4, L: int | None = None):
    """Contiguous against zigzag under a causal mask, W ranks: top, the (query chunk, key chunk) grid, each block
    colored by the step at which it is computed and labelled with the rank that computes it (blank: skipped,
    lighter: the diagonal's half); bottom, each rank's work at each step, in full blocks of (L/W)^2 pairs, with the
    ring's predicted efficiency (every step waits for its busiest rank)."""
    from matplotlib import colormaps

    L = L or 2 * world * 64
    fig, axes = new_figure(ncols=2, nrows=2, width=10.5, height=8.2)
    colors = colormaps["viridis"].resampled(world)
    n = L // world
    for col, layout in enumerate(("contiguous", "zigzag")):
        m = chunk_pair_map(L, world, layout)
        ax = axes[0, col]
        image = np.ones((2 * world, 2 * world, 4))
        for i in range(2 * world):
            for j in range(2 * world):
                if m["visible"][i, j] > 0:
                    rgba = np.array(colors(int(m["step"][i, j])))
                    rgba[3] = 1.0 if m["visible"][i, j] == 1 else 0.45
                    image[i, j] = rgba
                    if world <= 4:
                        ax.text(j, i, f"r{m['rank'][i, j]}", ha="center", va="center", fontsize=7,
                                color="white" if m["visible"][i, j] == 1 else "black")
        ax.imshow(image, interpolation="nearest")
        ax.set_xticks(range(2 * world), [f"{j}" for j in range(2 * world)], fontsize=7)
        ax.set_yticks(range(2 * world), [f"{i} (r{m['owner'][i]})" for i in range(2 * world)], fontsize=7)
        ax.set_xlabel("key chunk")
        ax.set_ylabel("query chunk (its rank)")
        ax.grid(False)
        ax.set_title(f"{layout}: color = ring step, label = rank")
        if col == 0:
            from matplotlib.patches import Patch
            ax.legend(handles=[Patch(color=colors(s), label=f"step {s}") for s in range(world)], loc="upper right",
                      fontsize=8)
        work = ring_work(L, L, world, layout, 0) / n**2
        ax = axes[1, col]
        width = 0.8 / world
        for r in range(world):
            ax.bar(np.arange(world) + (r - (world - 1) / 2) * width, work[:, r], width, label=f"rank {r}")
        ax.set_xlabel("ring step")
        ax.set_ylabel("work (blocks of (L/W)² pairs)")
        ax.set_xticks(range(world))
        ax.set_ylim(0, 1.15)
        ax.set_title(f"predicted efficiency {predicted_efficiency(work):.2f}")
        if col == 1:
            ax.legend(loc="upper right", ncols=2)
    return fig


# ---------------------------------------------------------------- when the transfer hides behind the compute

def overlap_tokens(tflops: float, link_bytes_per_s: float, *, H: int = 1, Hk: int = 1, dtype_bytes: int = 2,
                   causal: bool = False) -> float:
    """Tokens per shard n from which one ring step's attention takes as long as passing the next K/V block on.

    A step computes n queries against n keys: 4 n^2 D H FLOPs (half of that on average under a balanced causal
    mask); it sends and receives one block of K and V, 2 n D Hk dtype_bytes bytes each way. Equal when
    n = (Hk dtype_bytes / (2 H c)) x FLOP/s / bytes/s, c = 1 (1/2 causal): for MHA in 2-byte elements, no mask,
    n = achieved FLOP/s / link bandwidth. D cancels."""
    share = 0.5 if causal else 1.0
    return (Hk * dtype_bytes) / (2 * H * share) * (tflops * 1e12) / link_bytes_per_s


def step_times(tokens, tflops: float, link_bytes_per_s: float, *, D: int = 128, H: int = 16, Hk: int = 16,
               dtype_bytes: int = 2, causal: bool = False):
    """(compute seconds, transfer seconds) of one ring step at `tokens` per shard (arrays like `tokens`)."""
    n = np.asarray(tokens, dtype=np.float64)
    compute = 4 * n**2 * D * H * (0.5 if causal else 1.0) / (tflops * 1e12)
    transfer = 2 * n * D * Hk * dtype_bytes / link_bytes_per_s
    return compute, transfer


def draw_overlap(tflops: float = ACHIEVED_TFLOPS, links=None, *, D: int = 128, H: int = 16):
    """One ring step's compute time against the transfer time of its K/V block over each link, against the tokens
    per shard (MHA, fp16, no mask); where the compute line crosses a link's line the transfer can hide."""
    links = links or LINKS
    fig, ax = new_figure(width=7.5, height=4.2)
    n = np.geomspace(64, 1 << 17, 300)
    compute, _ = step_times(n, tflops, 1.0, D=D, H=H, Hk=H)
    ax.loglog(n, compute * 1e3, color="black", lw=2, label=f"compute at {tflops:.0f} TFLOP/s")
    for index, ((name, bandwidth), color) in enumerate(zip(links.items(), ("#1f77b4", "#ff7f0e", "#d62728"))):
        _, transfer = step_times(n, tflops, bandwidth, D=D, H=H, Hk=H)
        ax.loglog(n, transfer * 1e3, color=color, lw=1.5, label=f"transfer, {name}")
        cross = overlap_tokens(tflops, bandwidth)
        ax.axvline(cross, color=color, lw=0.8, ls=":")
        ax.annotate(f"{cross / 1e3:.1f}k", (cross, compute.min() * 1e3 * 3 * 8**index), color=color, fontsize=8,
                    xytext=(3, 0), textcoords="offset points")
    ax.set_xlabel("tokens per shard (L / W)")
    ax.set_ylabel("time per ring step (ms)")
    ax.set_title(f"the transfer hides where compute > transfer (H = {H}, D = {D}, fp16)")
    ax.legend(loc="upper left")
    return fig


# ---------------------------------------------------------------- ring against Ulysses, and past one machine

def communication_bytes(method: str, L: int, world: int, *, H: int, Hk: int, D: int, dtype_bytes: int = 2) -> float:
    """Bytes one rank sends in one forward pass. Ring: W - 1 steps, each one block of K and V of L / W tokens.
    Ulysses: an all-to-all of q, k, v in and one of the output back, each keeping 1/W of its shard at home."""
    n = L / world
    if method == "ring":
        return (world - 1) * 2 * n * Hk * D * dtype_bytes
    if method == "ulysses":
        return (2 * H + 2 * Hk) * n * D * dtype_bytes * (world - 1) / world
    raise ValueError(f"communication_bytes: method must be 'ring' or 'ulysses', got {method!r}")


def hierarchical_plan(nodes: int, gpus_per_node: int, L: int, *, H: int, Hk: int, tflops: float = ACHIEVED_TFLOPS,
                      inter_node: float = LINKS["InfiniBand NDR (400 Gb/s)"], dtype_bytes: int = 2) -> dict:
    """Ulysses over the GPUs of a node (its all-to-all on NVLink: the node's heads split gpus_per_node ways), the
    ring across nodes (each GPU passes its heads' K/V block to the same GPU of the next node, over its own NIC).
    Returns the degrees, the tokens of a ring shard, the overlap threshold across nodes and whether it hides."""
    if H % gpus_per_node or Hk % gpus_per_node:
        raise ValueError(f"hierarchical_plan: Ulysses inside a node needs gpus_per_node = {gpus_per_node} to divide "
                         f"H = {H} and Hk = {Hk}")
    shard = L / nodes
    threshold = overlap_tokens(tflops, inter_node, H=H // gpus_per_node, Hk=Hk // gpus_per_node,
                               dtype_bytes=dtype_bytes)
    return {"ulysses_degree": gpus_per_node, "ring_degree": nodes, "gpus": nodes * gpus_per_node,
            "heads_per_gpu": H // gpus_per_node, "tokens_per_ring_shard": shard, "overlap_threshold": threshold,
            "hides": shard >= threshold, "shortest_hidden_L": threshold * nodes}


# ---------------------------------------------------------------- torchrun from a cell

def launch(command, *, timeout: float = 120.0, cwd=None):
    """Run `command` (a torchrun launch of ``wb_kernels.stages.distributed.run --json``) in its own process group,
    killed whole after `timeout` seconds (a hang is a failure, not a frozen lesson). Returns (return code, the
    JSON records the ranks printed, the last lines of stderr). The package the lesson imports is put first on the
    ranks' PYTHONPATH, so that they run the same code."""
    import wb_kernels

    env = dict(os.environ)
    root = str(Path(wb_kernels.__file__).resolve().parents[1])
    env["PYTHONPATH"] = os.pathsep.join([root] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p])
    env.setdefault("OMP_NUM_THREADS", "1")
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
                               cwd=cwd, start_new_session=True)
    try:
        stdout, stderr = process.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        stdout, stderr = process.communicate()
        raise TimeoutError(f"the launch ran past {timeout:.0f} s and was killed: {' '.join(map(str, command))}\n"
                           + "\n".join(stderr.splitlines()[-20:]))
    records = [json.loads(line) for line in stdout.splitlines() if line.startswith("{")]
    return process.returncode, records, "\n".join(stderr.splitlines()[-20:])


def summarize_launch(records, tolerance: float = 1e-12):
    """One line per method, the same on every machine (no errors' digits, which vary with the CPU's arithmetic
    libraries; no rank order, which varies from run to run): cases, ranks, and how many are within `tolerance` of
    the single-process result. Returns (lines, the worst error over what each record compared: out and LSE, or the
    gradients)."""
    lines, worst = [], 0.0
    for method in dict.fromkeys(r["method"] for r in records):
        mine = [r for r in records if r["method"] == method]
        ran = [r for r in mine if r["status"] != "skipped"]
        within = sum(max(r["errors"].values()) <= tolerance for r in ran)
        worst = max([worst] + [max(r["errors"].values()) for r in ran])
        cases = len({r["case"] for r in mine})
        world = mine[0]["world"]
        lines.append(f"{method:8s} {cases} cases x {world} ranks: {within} of {len(ran)} within {tolerance:.0e} of "
                     f"one process" + (f", {len(mine) - len(ran)} skipped" if len(ran) < len(mine) else ""))
    return lines, worst


# ---------------------------------------------------------------- issue #32's bars, read from a scaling file

def scaling_records(results: dict):
    """The list of measurement records of a scaling results file (see ``scaling.py``)."""
    for key in ("records", "rows", "results"):
        if isinstance(results.get(key), list):
            return results[key]
    raise KeyError(f"a scaling results file holds its records under 'records'; found keys {sorted(results)}")


def scaling_bars(records, length: int = BAR_LENGTH, world: int = BAR_WORLD) -> dict:
    """issue #32's first bar, from measured records: the best efficiency at `length` on `world` GPUs among this
    package's methods, non-causal (ring, zigzag or Ulysses) and causal (zigzag); and PyTorch's context_parallel's
    in the same file. {bar: (measured or None, PyTorch CP's or None, threshold)}."""
    ok = [r for r in records if r.get("status") == "ok" and r.get("L") == length and r.get("world_size") == world
          and r.get("efficiency") is not None]

    def best(methods, causal):
        values = [r["efficiency"] for r in ok if r["method"] in methods and bool(r["causal"]) == causal]
        return max(values) if values else None

    return {"non-causal": (best(("ring", "zigzag", "ulysses"), False), best(("context_parallel",), False),
                           BARS["non-causal"]),
            "causal (zigzag)": (best(("zigzag",), True), best(("context_parallel",), True), BARS["causal (zigzag)"])}
