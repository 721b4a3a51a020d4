"""Slider and figure logic for lesson 05 (FlashAttention on tensor cores, WMMA).

Plain functions (inputs -> numbers or a matplotlib Figure) that pytest calls without a browser:

- :func:`rounding_errors` / :func:`draw_rounding`: what each rounding point of the kernel costs, from
  the NumPy fragment model, against the float64 reference, at a chosen L (the lesson's slider);
- :func:`shared_memory_parts` / :func:`draw_shared_memory`: the kernel's shared-memory layout per
  launch variant against an H100's budget, and how many blocks fit on one SM;
- :func:`traffic_per_tile`: shared-memory bytes and tensor-core FLOPs per warp and key tile, the
  arithmetic behind "what limits WMMA";
- :func:`committed_comparison`: this kernel against SDPA's FLASH and default backends and lesson 04's fp32
  kernel, from the committed benchmark results file (one run, one GPU).
"""

from __future__ import annotations


import numpy as np

from .build import VARIANTS, shared_memory_bytes
from .fragment_model import fragment_model, round_to
from ...inputs import random_qkv
from ...plots import STAGE_COLORS, new_figure
from ...reference import reference

__all__ = ["draw_double_buffering", "SLIDER_LENGTHS", "ROUNDING_CHOICES", "STORAGE", "rounding_errors", "draw_rounding", "shared_memory_parts",
           "blocks_per_sm", "draw_shared_memory", "traffic_per_tile", "committed_comparison"]

SLIDER_LENGTHS = (64, 128, 256, 512, 1024)
# (label, fragment_model switches): the kernel's own choice first
ROUNDING_CHOICES = (
    ("kernel: P in 16 bits, O in fp32", {}),
    ("P kept in fp32", {"round_p": False}),
    ("O accumulated in 16 bits", {"accumulate": "same"}),
)
SMEM_PER_SM = 228 * 1024       # an H100 (and A100: 164 KB) SM's shared memory
SMEM_RESERVED_PER_BLOCK = 1024  # the driver keeps 1 KB per resident block


STORAGE = "storing the exact O in 16 bits"


def rounding_errors(L: int, *, D: int = 64, BH: int = 1, seed: int = 0) -> dict:
    """{dtype: {choice label: max |O - reference|}} for Lq = Lk = L, from the fragment model.

    O is taken in fp32, before the kernel's final rounding, so that each choice's own error shows;
    the STORAGE entry is the error of merely rounding the exact O to the dtype, for scale.
    """
    q32, k32, v32 = random_qkv(1, BH, L, D, dtype="float32", seed=seed)
    errors = {}
    for dtype in ("float16", "bfloat16"):
        # the inputs as the kernel receives them: already 16-bit numbers, so only its own roundings count
        q, k, v = (round_to(x, dtype) for x in (q32, k32, v32))
        ref, _ = reference(q, k, v)
        errors[dtype] = {}
        for label, switches in ROUNDING_CHOICES:
            switches = {key: (dtype if value == "same" else value) for key, value in switches.items()}
            out, _ = fragment_model(q, k, v, dtype=dtype, round_output=False, **switches)
            errors[dtype][label] = float(np.abs(out - ref).max())
        errors[dtype][STORAGE] = float(np.abs(round_to(ref, dtype) - ref).max())
    return errors


def draw_rounding(L: int, *, D: int = 64):
    """Bars: max error of each rounding choice, fp16 and bf16, at length L (log scale)."""
    errors = rounding_errors(L, D=D)
    fig, ax = new_figure(width=6.4, height=3.8)
    width = 0.2
    labels = [label for label, _ in ROUNDING_CHOICES] + [STORAGE]
    colors = (STAGE_COLORS["wmma"], STAGE_COLORS["flash"], STAGE_COLORS["naive"], STAGE_COLORS["reference"])
    for i, label in enumerate(labels):
        values = [errors[dtype][label] for dtype in ("float16", "bfloat16")]
        ax.bar(np.arange(2) + (i - 1.5) * width, values, width, label=label, color=colors[i])
    ax.set_xticks(range(2), ["float16", "bfloat16"])
    ax.set_yscale("log")
    ax.set(ylabel="max |O - reference|", title=f"Where the kernel rounds, and what it costs (L = {L}, D = {D})")
    ax.legend(loc="upper center", bbox_to_anchor=(0.5, -0.1), ncol=2, fontsize=8)
    return fig


def shared_memory_parts(head_dim: int, num_warps: int, q_in_registers: bool, row_frags: int = 1) -> dict:
    """Bytes of each part of the kernel's shared memory (mirrors Layout in flash_wmma.cu)."""
    block_n, pad = 64, 8
    block_m = num_warps * row_frags * 16
    parts = {
        "K, V tiles x 2 stages": 2 * 2 * block_n * (head_dim + pad) * 2,
        "S scratch (fp32)": block_m * (block_n + pad) * 4,
        "P scratch (16-bit)": block_m * (block_n + pad) * 2,
        "Q tile": 0 if q_in_registers else block_m * (head_dim + pad) * 2,
        "key bias, row factors": 2 * block_n * 4 + block_m * 4,
    }
    assert sum(parts.values()) == shared_memory_bytes(head_dim, num_warps, q_in_registers, row_frags)
    return parts


def blocks_per_sm(shared_bytes: int, *, smem_per_sm: int = SMEM_PER_SM) -> int:
    """Resident blocks per SM as far as shared memory allows (registers may allow fewer)."""
    return smem_per_sm // (shared_bytes + SMEM_RESERVED_PER_BLOCK)


def draw_shared_memory(head_dim: int):
    """Stacked bars of shared memory per block for every launch variant at `head_dim`."""
    fig, ax = new_figure(width=6.4, height=3.2)
    labels = [f"{w}x{16 * f} rows\nQ in {'regs' if r else 'smem'}" for w, r, f in VARIANTS]
    bottoms = np.zeros(len(VARIANTS))
    part_names = list(shared_memory_parts(head_dim, *VARIANTS[0]))
    for name in part_names:
        values = np.array([shared_memory_parts(head_dim, *variant)[name] for variant in VARIANTS]) / 1024
        ax.bar(labels, values, bottom=bottoms, label=name)
        bottoms += values
    for i, total in enumerate(bottoms):
        ax.text(i, total + 3, f"{blocks_per_sm(int(total * 1024))} block(s)/SM", ha="center", fontsize=8)
    ax.axhline(SMEM_PER_SM / 2048, color="gray", ls=":", lw=1)
    ax.set(ylabel="KiB per block", title=f"Shared memory per block, D = {head_dim} (dotted: half an H100 SM)",
           ylim=(0, SMEM_PER_SM / 1024))
    ax.legend(fontsize=7, loc="upper left")
    return fig


def traffic_per_tile(head_dim: int, *, rows: int = 16, keys: int = 64) -> dict:
    """Per warp and key tile: shared-memory bytes moved, and tensor-core FLOPs done.

    A warp owns `rows` query rows; for each tile of `keys` keys it reads all of K and V from shared
    memory (16-bit), and S goes out (fp32) and P comes back (16-bit) through its scratch.
    """
    k_and_v = 2 * keys * head_dim * 2
    s_round_trip = 2 * rows * keys * 4
    p_round_trip = 2 * rows * keys * 2
    flops = 2 * 2 * rows * keys * head_dim  # S = Q K^T and O += P V
    total = k_and_v + s_round_trip + p_round_trip
    return {"K and V fragments": k_and_v, "S round trip (fp32)": s_round_trip,
            "P round trip (16-bit)": p_round_trip, "total bytes": total, "tensor-core FLOPs": flops,
            "FLOPs per shared byte": flops / total}


def committed_comparison(results: dict, head_dim: int = 128) -> list:
    """The committed benchmark's numbers this lesson discusses, all from one run on one GPU: per dtype, causal
    and L (B*L = 16k tokens, H = 16), the TFLOP/s of this kernel, of SDPA's FLASH backend (FlashAttention-2), of
    SDPA's default (cuDNN on Hopper), and of lesson 04's fp32 kernel on CUDA cores where the run timed it."""
    timed = {}
    for r in results["records"]:
        if r.get("status") == "ok" and r["D"] == head_dim and r["B"] * r["Lq"] == 16384 and r["H"] == 16:
            timed[r["contender"], r["dtype"], r["Lq"], r["causal"]] = r["tflops"]
    rows = []
    for (name, dtype, L, causal), tflops in sorted(timed.items(), key=lambda item: (item[0][1], item[0][3], item[0][2])):
        if name != "wmma":
            continue
        row = {"dtype": dtype, "L": L, "causal": causal, "wmma": tflops,
               "sdpa_flash": timed.get(("sdpa-flash", dtype, L, causal)), "sdpa": timed.get(("sdpa", dtype, L, causal)),
               "flash_fp32": timed.get(("flash", "float32", L, causal))}
        rows.append(row)
    return rows


def draw_double_buffering(tiles: int = 4, copy: float = 1.0, compute: float = 1.4):
    """Time lines of the K/V tile loop, one buffer against two (a schematic: `copy` and `compute` are the relative
    durations of loading one tile and computing with it). With one buffer the copy of tile j + 1 must wait until
    tile j is used up; with two, ``cp.async`` fills one buffer while the tensor cores read the other, and the
    copies hide behind the work."""
    from matplotlib.patches import Rectangle

    colors = ("#9ecae1", "#fdae6b")  # buffer 0, buffer 1
    fig, axes = new_figure(nrows=2, width=9, height=3.6)
    for ax, buffers in zip(axes, (1, 2)):
        copy_end, compute_end = [], []
        for j in range(tiles):
            if buffers == 1:  # load, then compute, then the next load may overwrite the buffer
                start = compute_end[-1] if compute_end else 0.0
            else:  # the copy of tile j may start once tile j - 2 (same buffer) is used up, and after copy j - 1
                start = max(copy_end[-1] if copy_end else 0.0, compute_end[j - 2] if j >= 2 else 0.0)
            copy_end.append(start + copy)
            begin = max(copy_end[j], compute_end[-1] if compute_end else 0.0)
            compute_end.append(begin + compute)
            buffer = j % buffers
            ax.add_patch(Rectangle((start, 1.1), copy, 0.8, color=colors[buffer]))
            ax.text(start + copy / 2, 1.5, f"load {j}", ha="center", va="center", fontsize=8)
            ax.add_patch(Rectangle((begin, 0.1), compute, 0.8, color=colors[buffer], alpha=0.7))
            ax.text(begin + compute / 2, 0.5, f"compute {j}", ha="center", va="center", fontsize=8)
        ax.set(xlim=(0, tiles * (copy + compute) + 0.2), ylim=(0, 2), yticks=[0.5, 1.5],
               yticklabels=["tensor cores", "cp.async"], xticks=[],
               title=f"{buffers} buffer{'s' if buffers > 1 else ''}: {tiles} tiles in "
                     f"{compute_end[-1] / (tiles * (copy + compute)):.0%} of the serial time")
    axes[1].set_xlabel("time (schematic); colour = which shared-memory buffer holds the tile")
    return fig
