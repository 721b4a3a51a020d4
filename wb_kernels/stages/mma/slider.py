"""Slider and figure logic for lesson 06 (FlashAttention-2 by hand with ``mma.sync``).

Plain functions (inputs -> numbers or a matplotlib Figure) that pytest calls without a browser:

- :func:`lane_holdings` / :func:`draw_lane`: which elements of Q, K, S, P, V and O one lane holds in its registers
  during a key tile, and which rows it points ``ldmatrix`` at (the lesson's slider: pick a lane);
- :func:`draw_accumulator_reuse`: the C fragments of two 16 x 8 tiles of S, lane by lane, next to the A fragment
  of the 16 x 16 tile of P: the same lanes hold the same elements, so P never leaves registers;
- :func:`traffic_per_tile` / :func:`balance_points`: shared-memory bytes and tensor-core FLOPs per warp and key tile
  (from the instructions the model issues), against what an SM's tensor cores need per shared-memory byte;
- the bank figure of the three shared-memory layouts is :func:`wb_kernels.stages.mma.swizzle.draw_banks`.

Everything is derived from the models (``fragments``, ``swizzle``, ``warp_model``): the pictures show what those
compute, with element indices in place of numbers.
"""

from __future__ import annotations

import numpy as np

from . import fragments as fr
from . import warp_model as wm
from .swizzle import store_tile
from ...plots import STAGE_COLORS, new_figure
from ...shared_memory import BANKS, WORD_BYTES

__all__ = ["LANE_CHOICES", "lane_holdings", "draw_lane", "draw_accumulator_reuse", "traffic_per_tile",
           "balance_points", "TENSOR_FLOPS_PER_CLOCK", "COMPARED", "committed_comparison", "ratio_range", "committed_tuning", "smem_traffic"]

LANE_CHOICES = tuple(range(fr.LANES))
LDMATRIX_X4_BYTES = 4 * 8 * 16   # four 8 x 8 matrices of 16-bit values
MMA_FLOPS = 2 * 16 * 8 * 16      # one m16n8k16: 16 x 8 outputs, 16 multiply-adds each
# Dense fp16/bf16 tensor-core FLOPs per clock and SM: 1024 multiply-adds on an A100 SM (NVIDIA A100 whitepaper),
# twice that on an H100 SM (NVIDIA H100 whitepaper, "clock-for-clock" against A100).
TENSOR_FLOPS_PER_CLOCK = {"A100 (sm_80)": 2 * 1024, "H100 (sm_90)": 2 * 2048}
SHARED_BYTES_PER_CLOCK = BANKS * WORD_BYTES  # one pass over the 32 banks per clock and SM


def lane_holdings(lane: int, head_dim: int = 64) -> dict:
    """{matrix: (held, pointed)} for one lane over one key tile: `held` marks the elements the lane has in its
    registers (Q for the whole loop, K and V as ldmatrix delivers them, S and P and O as accumulator or operand
    fragments), `pointed` the elements of the 16-byte rows whose address the lane gives to ldmatrix (Q, K, V only).
    Matrices: Q (16, D), K (64, D), S (16, 64), P (16, 64), V (64, D), O (16, D)."""
    block_n, k_steps, key_steps = wm.BLOCK_N, np.arange(head_dim // 16), np.arange(wm.BLOCK_N // 16)
    shapes = {"Q": (16, head_dim), "K": (block_n, head_dim), "V": (block_n, head_dim)}
    ids = {name: np.arange(np.prod(shape), dtype=np.float64).reshape(shape) for name, shape in shapes.items()}
    loads = {  # the addresses every lane gives, as the model's ldmatrix calls use them
        "Q": (wm.q_addresses(k_steps, head_dim), False),
        "K": (wm.k_addresses(key_steps[:, None], k_steps, head_dim), False),
        "V": (wm.v_addresses(key_steps[:, None], k_steps, head_dim), True),
    }
    out = {}
    for name, (addresses, trans) in loads.items():
        shared_ids = store_tile(ids[name])  # the swizzled tile, element ids in place of values
        held = np.zeros(shapes[name], dtype=bool)
        held.flat[fr.ldmatrix(shared_ids, addresses, trans=trans)[..., lane, :].astype(int).ravel()] = True
        pointed = np.zeros(shapes[name], dtype=bool)
        # shared offset -> element id: the row an address points at, 8 consecutive elements
        for start in np.asarray(addresses)[..., lane].ravel():
            pointed.flat[shared_ids[start:start + 8].astype(int)] = True
        out[name] = (held, pointed)
    s_ids = np.arange(16 * block_n).reshape(16, block_n)
    s_frags = np.stack([fr.distribute(s_ids[:, 8 * n:8 * n + 8], fr.c_coords) for n in range(block_n // 8)])
    s_held = np.isin(s_ids, s_frags[:, lane])
    p_frags = [fr.accumulator_as_a_operand(s_frags[2 * kk], s_frags[2 * kk + 1]) for kk in key_steps]
    p_held = np.isin(s_ids, np.stack(p_frags)[:, lane])
    o_ids = np.arange(16 * head_dim).reshape(16, head_dim)
    o_held = np.isin(o_ids, [fr.distribute(o_ids[:, 8 * n:8 * n + 8], fr.c_coords)[lane] for n in range(head_dim // 8)])
    out.update({"S": (s_held, None), "P": (p_held, None), "O": (o_held, None)})
    return {name: out[name] for name in ("Q", "K", "S", "P", "V", "O")}


def draw_lane(lane: int, head_dim: int = 64):
    """Six panels, Q K S / P V O, for one key tile: filled, what `lane` holds in registers; framed, the 16-byte rows
    it points ldmatrix at (it gives one row address per matrix, and receives pieces of other lanes' rows)."""
    from matplotlib.colors import ListedColormap
    from matplotlib.patches import Rectangle

    holdings = lane_holdings(lane, head_dim)
    cmap = ListedColormap(["#f2f2f2", STAGE_COLORS["mma"]])
    fig, axes = new_figure(ncols=3, nrows=2, width=11, height=5.6)
    captions = {"Q": "Q (A operand, whole loop)", "K": "K (B operand of S)", "S": "S = Q Kᵀ (C fragments, fp32)",
                "P": "P (A operand of P V, 16-bit)", "V": "V (B operand, .trans)", "O": "O (C fragments, fp32)"}
    for ax, (name, (held, pointed)) in zip(axes.ravel(), holdings.items()):
        ax.imshow(held, cmap=cmap, vmin=0, vmax=1, aspect="auto", interpolation="nearest")
        if pointed is not None:
            for row, col in zip(*np.nonzero(pointed[:, ::8])):  # one frame per 16-byte row segment
                ax.add_patch(Rectangle((8 * col - 0.5, row - 0.5), 8, 1, fill=False, edgecolor="black", lw=0.8))
        ax.set_title(f"{captions[name]}: {int(held.sum())} held", fontsize=9)
        ax.set_xlabel("key" if name in ("S", "P") else "head dim", fontsize=8)
        ax.set_ylabel("key" if name in ("K", "V") else "query row", fontsize=8)
        ax.set_yticks(range(0, held.shape[0], 4 if held.shape[0] == 16 else 16))
        ax.grid(False)
    fig.suptitle(f"lane {lane} (group {lane // 4}, rows {lane // 4} and {lane // 4 + 8}): filled = in its registers; "
                 "framed = the rows it points ldmatrix at", fontsize=10)
    return fig


def draw_accumulator_reuse():
    """Left: S's two neighbouring 16 x 8 accumulator tiles, each cell coloured and labelled by the lane and register
    holding it. Right: the A fragment of the 16 x 16 tile of P, the same way. The lanes are the same; only the
    registers' names change (c0..c3 of the left tile are a0..a3, of the right tile a4..a7)."""
    s_tiles = np.arange(16 * 16).reshape(16, 16)
    c_left = fr.distribute(s_tiles[:, :8], fr.c_coords)
    c_right = fr.distribute(s_tiles[:, 8:], fr.c_coords)
    lane_of_c, lane_of_a = np.zeros((16, 16), dtype=int), np.zeros((16, 16), dtype=int)
    register_of_c, register_of_a = np.empty((16, 16), dtype=object), np.empty((16, 16), dtype=object)
    a_frag = fr.accumulator_as_a_operand(c_left, c_right)
    for lane in range(fr.LANES):
        for i, (left, right) in enumerate(zip(c_left[lane], c_right[lane])):
            lane_of_c.flat[[left, right]] = lane
            register_of_c.flat[[left, right]] = f"c{i}"
        for i, element in enumerate(a_frag[lane]):
            lane_of_a.flat[element] = lane
            register_of_a.flat[element] = f"a{i}"
    fig, axes = new_figure(ncols=2, width=11, height=5.4)
    for ax, lanes, registers, title in ((axes[0], lane_of_c, register_of_c, "S: C fragments of two 16 x 8 mma results"),
                                        (axes[1], lane_of_a, register_of_a, "P: A fragment of one 16 x 16 operand")):
        ax.imshow(lanes, cmap="hsv", vmin=0, vmax=fr.LANES, aspect="equal", interpolation="nearest", alpha=0.55)
        for (r, c), lane in np.ndenumerate(lanes):
            ax.text(c, r, f"{lane}\n{registers[r, c]}", ha="center", va="center", fontsize=5, linespacing=0.9)
        ax.axvline(7.5, color="black", lw=1.5)
        ax.set(title=title, xlabel="key (column)", ylabel="query row", xticks=range(0, 16, 2), yticks=range(0, 16, 2))
        ax.grid(False)
    same = bool(np.array_equal(lane_of_c, lane_of_a))
    fig.suptitle(f"lane and register holding each element; the same lane in both pictures: {same}", fontsize=10)
    return fig


def traffic_per_tile(head_dim: int, row_tiles: int = wm.ROW_TILES) -> dict:
    """Per warp and key tile of 64 keys: shared-memory bytes its ldmatrix loads move, and the tensor-core FLOPs of
    its mma instructions, from the instructions the model issues. A warp with `row_tiles` tiles of 16 rows reads
    each K and V fragment once and uses it `row_tiles` times."""
    counts = wm.instruction_counts(head_dim)["per key tile"]
    loads = sum(n for name, n in counts.items() if name.startswith("ldmatrix"))
    products = sum(n for name, n in counts.items() if name.startswith("mma"))
    shared_bytes = loads * LDMATRIX_X4_BYTES
    flops = row_tiles * products * MMA_FLOPS
    return {"ldmatrix.x4 per tile": loads, "mma.sync per tile": row_tiles * products, "shared bytes": shared_bytes,
            "tensor-core FLOPs": flops, "FLOPs per shared byte": flops / shared_bytes}


def balance_points() -> dict:
    """{GPU: tensor-core FLOPs an SM does in the time its shared memory moves one byte}: a kernel with fewer FLOPs
    per shared byte than this waits on shared memory, not on the tensor cores."""
    return {gpu: flops / SHARED_BYTES_PER_CLOCK for gpu, flops in TENSOR_FLOPS_PER_CLOCK.items()}


# What the lesson compares this kernel with, as the benchmark names them: lesson 05's kernel, SDPA's FLASH backend
# (FlashAttention-2), SDPA's default choice (cuDNN on an H100) and FlexAttention (torch.compile).
COMPARED = ("mma", "wmma", "sdpa-flash", "sdpa", "flex")


def committed_comparison(results: dict, head_dim: int = 128, tokens: int = 16384, heads: int = 16) -> list:
    """One row per (dtype, causal, L) of a benchmark results file (one run, one GPU) at B*L = `tokens`, H = `heads`:
    the TFLOP/s of every contender in :data:`COMPARED` that the run timed (None where it did not)."""
    timed = {}
    for r in results["records"]:
        if r.get("status") == "ok" and r["D"] == head_dim and r["B"] * r["Lq"] == tokens and r["H"] == heads:
            timed[r["contender"], r["dtype"], r["causal"], r["Lq"]] = r["tflops"]
    keys = sorted({key[1:] for key in timed if key[0] == "mma"})
    return [{"dtype": dtype, "causal": causal, "L": L, **{name: timed.get((name, dtype, causal, L)) for name in COMPARED}}
            for dtype, causal, L in keys]


def ratio_range(rows: list, numerator: str, denominator: str, min_length: int = 2048) -> tuple:
    """(lowest, highest) of numerator / denominator over the rows with L >= `min_length` that have both."""
    ratios = [r[numerator] / r[denominator] for r in rows
              if r["L"] >= min_length and r.get(numerator) and r.get(denominator)]
    return min(ratios), max(ratios)


def committed_tuning(tuning: dict, min_length: int = 2048) -> dict:
    """{head dim: [(variant name, geometric-mean TFLOP/s over L >= `min_length`, both dtypes and masks)], fastest
    first} from a tune.py results file."""
    from collections import defaultdict

    logs = defaultdict(lambda: defaultdict(list))
    for row in tuning["rows"]:
        if row["L"] >= min_length:
            for name, tflops in row["tflops"].items():
                if name.startswith("mma_"):
                    logs[row["D"]][name].append(np.log(tflops))
    return {D: sorted(((name, float(np.exp(np.mean(values)))) for name, values in by_name.items()),
                      key=lambda item: -item[1]) for D, by_name in sorted(logs.items())}


def smem_traffic(traffic: dict) -> dict:
    """{stage: (shared-memory bytes per FLOP, bank conflicts as a share of wavefronts)} from the committed ncu run."""
    return {stage: (m["shared_bytes_per_flop"], m["bank_conflicts_per_wavefront"]) for stage, m in traffic["stages"].items()}


# --- the model against the measurements (lesson 06, "The argument, measured" and "Where the time goes") ----------

def loop_smem_prediction(variant, B: int, H: int, L: int) -> dict:
    """What one call of `variant` (a ``build.Variant``) moves through shared memory on a (B, H, L, L) problem, not
    causal, counted from the kernel's loops as :func:`warp_model.ldmatrix_per_key_tile` describes them: the
    ``ldmatrix.x4`` of K, V and (unless Q stays in registers) Q every key tile, Q's once-per-warp loads otherwise, and
    the ``cp.async`` copies of the Q tile and of every K and V tile into shared memory (16 bytes a lane, 512 a warp
    instruction). The epilogue's staging of O (once per block) is left out. Counts are warp instructions, as Nsight
    Compute's ``smsp__sass_inst_executed_op_ldsm`` and ``..._ldgsts`` count them."""
    from ...attention_costs import attention_flops

    D, warps = variant.head_dim, variant.num_warps
    blocks = B * H * -(-L // variant.block_m)
    tiles = -(-L // variant.block_n)
    per_tile = wm.ldmatrix_per_key_tile(D, row_tiles=variant.row_tiles, block_n=variant.block_n,
                                        q_in_registers=variant.q_in_registers)
    q_once = variant.row_tiles * (D // 16) if variant.q_in_registers else 0
    ldsm = {name: blocks * warps * tiles * n for name, n in per_tile.items()}
    ldsm["Q"] += blocks * warps * q_once
    copy_bytes = blocks * (variant.block_m + tiles * 2 * variant.block_n) * D * 2
    ldgsts = copy_bytes // LDMATRIX_X4_BYTES  # 32 lanes x 16 bytes, the same 512 bytes as one ldmatrix.x4
    flops = attention_flops(B, H, L, L, D, False)
    kv_bytes = (ldsm["K"] + ldsm["V"]) * LDMATRIX_X4_BYTES
    ldsm_bytes = sum(ldsm.values()) * LDMATRIX_X4_BYTES
    return {"flops": flops, "ldmatrix": sum(ldsm.values()), "ldmatrix_by_operand": ldsm, "cp_async": ldgsts,
            "FLOPs per byte, K and V ldmatrix": flops / kv_bytes,
            "FLOPs per byte, all ldmatrix": flops / ldsm_bytes,
            "FLOPs per byte, ldmatrix and cp.async": flops / (ldsm_bytes + copy_bytes)}


# An H100 SM (CUDA C++ Programming Guide, "Compute Capabilities", 9.0): 64K 32-bit registers, allocated per warp in
# units of 256; 228 KB of shared memory, of which the runtime reserves 1 KB per block; 64 resident warps, 32 blocks.
SM_LIMITS = {"registers": 65536, "register_unit": 256, "shared_bytes": 228 * 1024, "reserved_per_block": 1024,
             "warps": 64, "blocks": 32}


def predicted_occupancy(registers_per_thread: int, threads_per_block: int, shared_bytes_per_block: int,
                        limits: dict = SM_LIMITS) -> dict:
    """Blocks per SM and the theoretical occupancy (resident warps in % of the SM's maximum) that registers, shared
    memory and the warp and block limits allow; ``limiter`` names the tightest."""
    warps = -(-threads_per_block // 32)
    unit = limits["register_unit"]
    per_warp = -(-registers_per_thread * 32 // unit) * unit
    by = {"registers": limits["registers"] // (per_warp * warps),
          "shared memory": limits["shared_bytes"] // (shared_bytes_per_block + limits["reserved_per_block"]),
          "warps": limits["warps"] // warps, "blocks": limits["blocks"]}
    blocks = min(by.values())
    return {"blocks_per_sm": blocks, "warps_per_sm": blocks * warps, "occupancy_pct": 100.0 * blocks * warps /
            limits["warps"], "limiter": min(by, key=by.get), "by": by}


def roofline_points(results: dict, *, B: int = 4, H: int = 16, L: int = 4096, D: int = 128, dtype: str = "float16",
                    causal: bool = False, contenders=("mma", "sdpa-flash", "sdpa")) -> dict:
    """Each contender's point on the roofline of the benchmark file's GPU at one shape: the problem's FLOPs per byte
    of its compulsory DRAM traffic (q, k, v read and o written once), the ridge point (the file's measured matmul
    ceiling over its copy bandwidth) and the share of the matmul ceiling each contender reached."""
    ceilings = results["ceilings"]
    peak = ceilings[f"{dtype}_matmul_tflops"] * 1e12
    bandwidth = ceilings["copy_gbps"] * 1e9
    found = {r["contender"]: r for r in results["records"] if r.get("status") == "ok" and
             (r["B"], r["H"], r["Lq"], r["D"], r["dtype"], r["causal"]) == (B, H, L, D, dtype, causal)}
    any_record = next(iter(found.values()))
    intensity = any_record["flops"] / any_record["bytes_min"]
    return {"intensity": intensity, "ridge": peak / bandwidth, "matmul_tflops": peak / 1e12,
            "copy_gbps": bandwidth / 1e9, "roof_tflops": min(peak, intensity * bandwidth) / 1e12,
            "reached": {name: found[name]["tflops"] * 1e12 / peak for name in contenders if name in found}}


def profile_rows(profile: dict) -> dict:
    """{(B, H, L, D): {contender: summary}} from a results/mma/ncu_<gpu>.json written by ``profile.py`` (runs that
    failed are left out; their reasons stay in the file). Each summary is computed afresh from the run's metrics
    (``profile.summary``), so that a file written by an older version of the script reads the same way."""
    from .profile import summary

    rows: dict = {}
    for run in profile["runs"]:
        if run.get("status") == "ok":
            p = run["problem"]
            rows.setdefault((p["B"], p["H"], p["L"], p["D"]), {})[run["contender"]] = summary(run)
    return rows
