"""Figures, committed numbers and slider logic for lesson 09 (rung ``hopper``): plain functions, which pytest calls
without a browser (tests/test_hopper_lesson.py).

- why ``mma.sync`` stops short on an H100, from committed files: :func:`tflops_at` (a benchmark results file),
  :func:`profile_contrast` (the mma rung's Nsight Compute file: the mma kernel next to cuDNN's wgmma kernel);
- the 128-byte swizzle as a picture: :func:`swizzle_positions`, :func:`draw_swizzle`;
- one thread's registers in a warpgroup (the slider): :func:`thread_elements`, :func:`draw_thread`;
- ping-pong (v3) as a picture: :func:`pingpong_schedule`, :func:`draw_pingpong` (a schematic timeline of two consumer
  warpgroups, in units of one warpgroup's products of one tile: no GPU time in it);
- the rung's own measurements: :func:`load_bench` (``None`` while ``results/hopper/bench_h100.json`` is not
  committed), :func:`hopper_rows` and :func:`version_table` (NOTES.md's predictions next to what the file measured).
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np

from . import tma_swizzle, wgmma_fragments

__all__ = ["REPOSITORY", "BENCH_FILE", "MEASURE_COMMAND", "HEADLINE", "THREAD_CHOICES", "tflops_at",
           "profile_contrast", "swizzle_positions", "draw_swizzle", "thread_elements", "draw_thread", "pingpong_schedule",
           "draw_pingpong", "load_bench",
           "hopper_rows", "notes_versions", "version_table", "notes_text", "load_json"]

REPOSITORY = Path(__file__).resolve().parents[3]
BENCH_FILE = REPOSITORY / "results" / "hopper" / "bench_h100.json"
# what writes BENCH_FILE on an H100: the rung's preset (the stage against the mma rung, SDPA FLASH and cuDNN and
# FlashInfer's FlashAttention-3 kernel at issue 31's shapes), into results/hopper/bench_<gpu>.json
MEASURE_COMMAND = "python -m wb_kernels.bench --preset hopper-bar"
# the first bar is stated at this problem: fp16, B = 4, H = 16, L = 4096, D = 128, not causal
HEADLINE = {"B": 4, "H": 16, "L": 4096, "D": 128, "dtype": "float16", "causal": False}
THREAD_CHOICES = list(range(wgmma_fragments.WARPGROUP))


# --- why mma.sync stops short: committed files -----------------------------------------------------------------

def tflops_at(results: dict, *, B: int, H: int, L: int, D: int, dtype: str, causal: bool) -> dict:
    """{contender: TFLOP/s} of the records of a benchmark results file at one problem (Lq = Lk = L; runs that
    failed are left out)."""
    return {r["contender"]: r["tflops"] for r in results["records"] if r.get("status") == "ok" and
            (r["B"], r["H"], r["Lq"], r["Lk"], r["D"], r["dtype"], bool(r["causal"])) == (B, H, L, L, D, dtype, causal)}


def profile_contrast(profile: dict, shape=(4, 16, 4096, 128)) -> dict:
    """From the mma rung's Nsight Compute file (results/mma/ncu_<gpu>.json): per contender at `shape` (B, H, L, D),
    what tells a wgmma kernel from an mma.sync one: shared-memory bytes through the load/store path per FLOP, the
    tensor pipe's share of cycles, threads per block, registers per thread, and whether its name says wgmma."""
    from ..mma.slider import profile_rows

    rows = profile_rows(profile)[tuple(shape)]
    return {name: {"tflops": s["tflops"], "tensor_pipe_pct": s["tensor_pipe_pct"],
                   "shared_bytes_per_flop": s["shared_bytes_per_flop"], "threads_per_block": int(s["threads_per_block"]),
                   "registers_per_thread": int(s["registers_per_thread"]), "wgmma_in_name": "wgmma" in s["kernel"]}
            for name, s in rows.items()}


# --- the 128-byte swizzle -----------------------------------------------------------------------------------------

def swizzle_positions(rows: int = 8) -> np.ndarray:
    """(rows, 8): the 16-byte chunk position in shared memory that chunk c of box row r is written to, by the
    TMA's address-bit formula (``tma_swizzle.swizzle_128b``)."""
    row, chunk = np.meshgrid(np.arange(rows), np.arange(8), indexing="ij")
    stored = tma_swizzle.swizzle_128b(row * tma_swizzle.ROW_BYTES + chunk * 16)
    return (stored % tma_swizzle.ROW_BYTES) // 16


def draw_swizzle(rows: int = 8):
    """Left: a box's first `rows` rows as the tensor holds them, chunk by chunk. Right: the same rows in shared
    memory after the TMA's 128-byte swizzle; each cell names the chunk of the box it holds."""
    from ...plots import new_figure

    positions = swizzle_positions(rows)
    held = np.zeros_like(positions)  # held[r, p]: which chunk of row r sits at position p
    for r in range(rows):
        held[r, positions[r]] = np.arange(8)
    fig, axes = new_figure(ncols=2, width=10, height=0.45 * rows + 1.6)
    for ax, grid, title in ((axes[0], np.tile(np.arange(8), (rows, 1)), "the box in global memory"),
                            (axes[1], held, "shared memory after the 128-byte swizzle")):
        ax.imshow(grid, cmap="tab10", vmin=0, vmax=9, aspect="auto")
        for r in range(rows):
            for p in range(8):
                ax.text(p, r, str(grid[r, p]), ha="center", va="center", fontsize=9)
        ax.set_xticks(range(8), [f"{16 * p}" for p in range(8)])
        ax.set_yticks(range(rows))
        ax.set_xlabel("byte offset in the 128-byte row")
        ax.set_ylabel("row")
        ax.set_title(title)
    fig.suptitle("chunk c of row r lands at position c XOR (r mod 8): each column of 8 rows hits 8 different bank groups",
                 fontsize=10)
    return fig


# --- one thread of a warpgroup (the slider) ---------------------------------------------------------------------

def thread_elements(thread: int, n: int = 64) -> dict:
    """Where thread `thread` holds S (64 x n fp32 accumulators, register index each) and, packed from the same
    registers, P as the A operand of the RS wgmma (k-step t covers keys 16 t .. 16 t + 15)."""
    s = {coord: index for index, coord in enumerate(wgmma_fragments.accumulator_coords(thread, n))}
    p = {}
    for step in range(n // 16):
        for slot, index in enumerate(wgmma_fragments.p_from_s(step)):
            p[wgmma_fragments.a_register_coords(thread, step)[slot]] = (step, slot // 2, index)
    return {"S": s, "P": p}


def draw_thread(thread: int):
    """Thread `thread`'s warp's 16 rows of the 64 x 64 tile of S: filled, the 32 accumulators the thread holds,
    numbered by register d[i] and coloured by the k-step of P V whose A operand (packed from the same registers)
    holds them. Nothing is filled outside the warp's rows, and every filled cell is the thread's own P."""
    from matplotlib.colors import ListedColormap

    from ...plots import new_figure

    held = thread_elements(thread)
    warp, lane = divmod(thread, 32)
    band = np.full((16, 64), np.nan)  # the warp's rows: k-step of P for the thread's cells, NaN elsewhere
    for (row, column), (step, _, index) in held["P"].items():
        assert held["S"][(row, column)] == index  # the register of P's operand is the accumulator of S
        band[row - 16 * warp, column] = step
    fig, ax = new_figure(width=11, height=3.4)
    ax.imshow(band, cmap=ListedColormap(["#4c72b0", "#dd8452", "#55a868", "#c44e52"]), vmin=-0.5, vmax=3.5,
              aspect="auto", interpolation="nearest")
    for (row, column), index in held["S"].items():
        ax.text(column, row - 16 * warp, str(index), ha="center", va="center", fontsize=6, color="white")
    ax.set_xticks(range(0, 64, 8))
    ax.set_yticks(range(16), [str(16 * warp + r) for r in range(16)], fontsize=6)
    ax.set_xlabel("key (column of S); colour: the k-step of P V (16 keys each) whose A operand holds the value")
    ax.set_ylabel(f"query row (warp {warp})")
    ax.grid(False)
    ax.set_title(f"thread {thread} (warp {warp}, lane {lane}): its 32 accumulators of S, by register number; "
                 f"rows {16 * warp + lane // 4} and {16 * warp + lane // 4 + 8}", fontsize=10)
    return fig


# --- ping-pong, schematically (v3) ---------------------------------------------------------------------------

def pingpong_schedule(version: int, tiles: int = 4, gemm: float = 1.0, softmax: float = 0.8) -> dict:
    """A schematic timeline of two consumer warpgroups, each doing, per key tile, its products (`gemm` time units
    when it has the tensor cores to itself) and then its softmax (`softmax` units, off the tensor cores).

    v2 (`version` 2): nothing orders the two; they start each tile together (the same tile lands for both), so their
    products share the tensor cores (both finish after 2 `gemm`) and their softmaxes run at the same time, with the
    tensor cores idle. v3: named barriers give the tensor cores to one warpgroup at a time, in turn; a warpgroup's
    products start when the other's are done and its own softmax is over. Returns the bars
    ``(warpgroup, start, end, "gemm" | "softmax", tile)`` and ``tensor_busy``, the share of the time from the first
    product to the last in which the tensor cores work."""
    if version not in (2, 3):
        raise ValueError(f"version must be 2 or 3, got {version}")
    bars, tensor_time = [], 0.0
    ready = [0.0, 0.0]  # when each warpgroup's softmax of its last tile is over
    tensor_free = 0.0
    for tile in range(tiles):
        if version == 2:
            start = max(ready)
            for c in range(2):
                bars.append((c, start, start + 2 * gemm, "gemm", tile))
                bars.append((c, start + 2 * gemm, start + 2 * gemm + softmax, "softmax", tile))
                ready[c] = start + 2 * gemm + softmax
            tensor_time += 2 * gemm
            continue
        for c in range(2):  # v3: c's turn, then the other's
            start = max(tensor_free, ready[c])
            tensor_free = start + gemm
            bars.append((c, start, tensor_free, "gemm", tile))
            bars.append((c, tensor_free, tensor_free + softmax, "softmax", tile))
            ready[c] = tensor_free + softmax
            tensor_time += gemm
    products = [bar for bar in bars if bar[3] == "gemm"]
    span = max(end for _, _, end, _, _ in products) - min(start for _, start, _, _, _ in products)
    return {"bars": bars, "tensor_busy": tensor_time / span, "end": max(end for _, _, end, _, _ in bars)}


def draw_pingpong(tiles: int = 4, gemm: float = 1.0, softmax: float = 0.8):
    """v2 above, v3 below: :func:`pingpong_schedule`'s bars, one row per consumer warpgroup (blue: its products of a
    tile, numbered; orange: its softmax), on one time axis."""
    from ...plots import new_figure

    fig, axes = new_figure(nrows=2, width=11, height=4.2)
    for ax, version in zip(axes, (2, 3)):
        schedule = pingpong_schedule(version, tiles, gemm, softmax)
        for c, start, end, kind, tile in schedule["bars"]:
            shared = version == 2 and kind == "gemm"
            ax.barh(c, end - start, left=start, height=0.6, color="#4c72b0" if kind == "gemm" else "#dd8452",
                    hatch="//" if shared else None, edgecolor="white")
            ax.text((start + end) / 2, c, f"{'S, PV' if kind == 'gemm' else 'softmax'} {tile}", ha="center",
                    va="center", fontsize=7, color="white")
        ax.set_yticks([0, 1], ["consumer 0", "consumer 1"])
        ax.invert_yaxis()
        ax.set_title(f"v{version}: " + ("both warpgroups' products share the tensor cores, then both softmaxes "
                                        "leave them idle" if version == 2 else
                                        "named barriers give the tensor cores to one warpgroup at a time")
                     + f" (tensor cores busy {schedule['tensor_busy']:.0%} of the time)", fontsize=9)
    axes[1].set_xlim(axes[0].get_xlim())  # one time axis: v3 ends earlier
    axes[1].set_xlabel("time, in units of one warpgroup's products of one tile (a schematic, not a measurement)")
    return fig


# --- the rung's measurements -------------------------------------------------------------------------------------

def load_bench(path=None):
    """The rung's committed benchmark file (default :data:`BENCH_FILE`), or None when it is not there (yet)."""
    path = Path(BENCH_FILE if path is None else path)
    return json.loads(path.read_text()) if path.exists() else None  # a results file: JSON (the rung does not import bench)


def hopper_rows(results: dict, baselines=("mma", "sdpa-cudnn", "flashinfer-fa3")) -> list:
    """One row per problem the file timed a ``hopper`` contender at (``hopper`` or ``hopper-vN``): the problem, each
    hopper contender's and each baseline's TFLOP/s, and the best hopper contender's ratio to each baseline."""
    problems = sorted({(r["dtype"], r["D"], bool(r["causal"]), r["B"], r["H"], r["Lq"]) for r in results["records"]
                       if r.get("status") == "ok" and r["contender"].startswith("hopper") and r["Lq"] == r["Lk"]})
    rows = []
    for dtype, D, causal, B, H, L in problems:
        found = tflops_at(results, B=B, H=H, L=L, D=D, dtype=dtype, causal=causal)
        hopper = {name: value for name, value in found.items() if name.startswith("hopper")}
        best = max(hopper.values())
        rows.append({"dtype": dtype, "D": D, "causal": causal, "B": B, "H": H, "L": L, "hopper": hopper,
                     "baselines": {name: found[name] for name in baselines if name in found},
                     "ratio": {name: best / found[name] for name in baselines if name in found}})
    return rows


_ROW = re.compile(r"^\|\s*(v\d+)\s*\|(.*)\|\s*$")


def notes_versions(notes_text: str) -> list:
    """The version table of the rung's NOTES.md ("## Versions"): [{version, what, prediction, notes}] in its order
    (notes: the table's own "measurement" column, which says what ran where)."""
    section = notes_text.split("## Versions", 1)[1].split("\n## ", 1)[0] if "## Versions" in notes_text else ""
    versions = []
    for line in section.splitlines():
        match = _ROW.match(line.strip())
        if match:
            cells = [cell.strip() for cell in match.group(2).split("|")]
            versions.append({"version": match.group(1), "what": cells[0], "prediction": cells[1] if len(cells) > 1 else "",
                             "notes": cells[2] if len(cells) > 2 else ""})
    return versions


def version_table(notes_text: str, results, problem=None) -> list:
    """NOTES.md's versions, each with its prediction and the TFLOP/s the results file measured for contender
    ``hopper-<version>`` at `problem` (default :data:`HEADLINE`), or None where the file has none (or no file)."""
    problem = dict(HEADLINE if problem is None else problem)
    found = {} if results is None else tflops_at(results, **problem)
    return [dict(entry, measured=found.get(f"hopper-{entry['version']}")) for entry in notes_versions(notes_text)]


def notes_text() -> str:
    """The rung's NOTES.md, as committed."""
    return (Path(__file__).resolve().parent / "NOTES.md").read_text()


def load_json(relative: str) -> dict:
    """A committed results file, by its path in the repository."""
    return json.loads((REPOSITORY / relative).read_text())
