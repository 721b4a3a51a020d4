"""The scaling benchmark of issue #32: exact attention over W GPUs of one host against one GPU, in the same run.

Start it with torchrun (rank code must live in a module)::

    python -m torch.distributed.run --standalone --nproc_per_node=2 -m wb_kernels.stages.distributed.scaling \\
        --out results/distributed [--dtypes float16,bfloat16] [--time-budget 300]
    python -m torch.distributed.run --standalone --nproc_per_node=2 -m wb_kernels.stages.distributed.scaling \\
        --out DIR --backend gloo --device cpu        # the smoke preset: tiny sizes on the CPU (the test runs it)

For every problem (dtype, B, H, Hk, L, D, causal) it times, with CUDA events, the median of several repeats after a
warm-up, every rank waiting at a barrier before each repeat, each repeat's time being the slowest rank's:

- the one-GPU baselines, the whole problem on one GPU with the local kernel of the methods compared with it:
  ``wb.attention(stage="mma")`` for ours, SDPA for PyTorch's (every rank runs it at once; the slowest counts);
- ``ring`` (contiguous shards, and once more without overlap where the preset says so), ``zigzag`` (causal
  only: without a mask its work is the ring's), ``ulysses``, each rank's local attention the mma stage;
- ``context_parallel``: PyTorch's (``torch.distributed.tensor.experimental``), its SDPA, head-tail load balance
  when causal and none otherwise (it needs ``enable_load_balance = False`` without a mask). CUDA only.

Scaling efficiency = one-GPU time / (W x W-GPU time). Each method's output is checked once per problem: its
distance to the one-GPU result over every row, and ``wb.check``'s rule (2x SDPA's error in the same precision,
against float64) on a slice, the last 32 query rows of the query heads of KV head 0 over every key (the float64
reference of the whole problem would be L x L per head).

Results go to ``DIR/scaling_<gpu>x<W>.json`` (``schema`` 1: ``environment``, ``command``, ``timing``, ``records``,
``unavailable``, ``complete``), written after every record. The same command resumes: records already there are
kept, and a record that a previous run started but never finished (a crash, or a hang past ``--timeout``) is
recorded as failed instead of being tried again.

What the lesson uses, on any machine (no GPU, no torch.distributed): :func:`find_scaling_results`,
:func:`load_scaling`, :func:`scaling_table`, :func:`efficiency_figure` and :func:`bar_results`. Tests:
``tests/test_distributed.py``.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import signal
import statistics
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

SCHEMA = 1
METHODS = ("ring", "zigzag", "ulysses", "context_parallel")
BARS = {False: 0.90, True: 0.85}  # issue #32's first bar at L = 128k on 2 GPUs: non-causal, causal (zigzag)
CHECK_ROWS = 32  # query rows graded against float64 per problem (the last ones: under a mask they see every key;
# the float64 reference is NumPy on one core: 32 rows x 4 heads x 256k keys take about 10 s)

__all__ = ["SCHEMA", "METHODS", "BARS", "Problem", "Method", "problems", "methods_for", "find_scaling_results",
           "load_scaling", "scaling_table", "readme_table", "update_readme", "efficiency_figure", "bar_results",
           "resumed_records", "main"]
README_START, README_END = "<!-- perf-table-distributed:start -->", "<!-- perf-table-distributed:end -->"


# ---- what is measured ---------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Problem:
    dtype: str
    B: int
    H: int
    Hk: int
    L: int
    D: int
    causal: bool

    def key(self) -> str:
        return (f"{self.dtype} B{self.B} H{self.H}/{self.Hk} L{self.L} D{self.D} "
                f"{'causal' if self.causal else 'non-causal'}")


@dataclass(frozen=True)
class Method:
    name: str  # one of METHODS
    local: str  # the kernel each rank runs: a wb stage name, or "sdpa"
    overlap: bool = True  # ring and zigzag: the next block's transfer overlaps this block's attention

    def key(self, problem: Problem) -> str:
        return f"{self.name}{_overlap_note({'method': self.name, 'overlap': self.overlap})} | {problem.key()}"


def problems(preset: str, dtypes=("float16",)) -> list:
    """The problems of `preset` in the order they run (the most wanted first, so that a run cut short by its time
    budget has them): ``"gpu"``: D 128, H 16 and GQA 32/8, L 32k-128k, causal and not, for the first dtype; then
    L 256k (H 16); then the other dtypes at H 16; then GQA at 256k. ``"smoke"``: tiny float32 problems for the CPU."""
    if preset == "smoke":
        return [Problem("float32", 1, 4, Hk, L, 8, causal)
                for L in (64, 90) for Hk in (4, 2) for causal in (False, True)]
    if preset != "gpu":
        raise ValueError(f"preset: expected 'gpu' or 'smoke', got {preset!r}")
    first, *others = dtypes
    k = 1024
    order = [Problem(first, 1, H, Hk, L, 128, causal)
             for L in (32 * k, 64 * k, 128 * k) for H, Hk in ((16, 16), (32, 8)) for causal in (False, True)]
    order += [Problem(first, 1, 16, 16, 256 * k, 128, causal) for causal in (False, True)]
    order += [Problem(dtype, 1, 16, 16, L, 128, causal)
              for dtype in others for L in (32 * k, 64 * k, 128 * k) for causal in (False, True)]
    order += [Problem(first, 1, 32, 8, 256 * k, 128, causal) for causal in (False, True)]
    return order


def methods_for(problem: Problem, local_stage: str, *, no_overlap_ring: bool = True) -> list:
    """The methods timed on `problem`: zigzag only under a causal mask; the ring once more without overlap (for
    H = Hk, `no_overlap_ring`), context_parallel with SDPA."""
    chosen = [Method("ring", local_stage)]
    if no_overlap_ring and problem.H == problem.Hk:
        chosen.append(Method("ring", local_stage, overlap=False))
    if problem.causal:
        chosen.append(Method("zigzag", local_stage))
    chosen += [Method("ulysses", local_stage, overlap=False), Method("context_parallel", "sdpa", overlap=False)]
    return chosen


# ---- reading results (the lesson; no GPU needed) -------------------------------------------------------------------

def load_scaling(path) -> dict:
    """A results file written by this module: the dict, its ``schema`` checked."""
    results = json.loads(Path(path).read_text())
    if results.get("schema") != SCHEMA:
        raise ValueError(f"{path}: scaling results schema {results.get('schema')!r}, this code reads {SCHEMA}")
    return results


def find_scaling_results(root=None):
    """The newest committed ``results/distributed/scaling_*.json`` under the repository `root` (default: this
    checkout), by the date its environment records; None when there is none. Files git does not track (a run's
    fresh output) are left out where `root` is a git checkout."""
    import subprocess

    root = Path(root) if root is not None else Path(__file__).resolve().parents[3]
    found = sorted((root / "results" / "distributed").glob("scaling_*.json"))
    try:
        listed = subprocess.run(["git", "ls-files", "results/distributed"], cwd=root, capture_output=True,
                                text=True, timeout=20)
        if listed.returncode == 0:
            tracked = {root / line for line in listed.stdout.split()}
            found = [path for path in found if path in tracked]
    except (OSError, subprocess.SubprocessError):  # no git: every file counts
        pass
    # a committed file that cannot be read is an error to fix, not a reason to show an older one
    dated = [(load_scaling(path)["environment"].get("date") or "", path.name, path) for path in found]
    return max(dated)[2] if dated else None


def _heads(record) -> str:
    return f"H{record['H']}/{record['Hk']}"


def _length(L: int) -> str:
    return f"{L // 1024}k" if L >= 1024 and L % 1024 == 0 else str(L)


def _overlap_note(record) -> str:
    """The label's suffix ' (no overlap)' for a ring timed without overlap; empty for everything else."""
    return " (no overlap)" if record["method"] in ("ring", "zigzag") and not record.get("overlap") else ""


def _headline(results) -> str:
    env = results["environment"]
    return (f"{env.get('world_size')}x {env.get('gpu') or 'CPU processes (' + str(env.get('backend')) + ')'}, "
            f"{str(env.get('date'))[:10]} "
            f"(torch {env.get('torch')}, NCCL {env.get('nccl')}, commit {env.get('git_commit')})")


def scaling_table(results) -> str:
    """The records as a Markdown table, its first line naming the GPUs and the date; efficiency = one-GPU time /
    (W x W-GPU time)."""
    lines = [f"Scaling on {_headline(results)}; efficiency = one-GPU time / (W x W-GPU time)", ""]
    link = results.get("link")
    if link:
        lines += [f"Link: {link['gb_per_s']:.0f} GB/s per direction ({link['megabytes']} MiB in "
                  f"{link['median_ms']:.2f} ms, {link['what']})", ""]
    lines += ["| dtype | heads | L | mask | method | local | overlap | W-GPU ms | one-GPU ms | efficiency | check |",
              "|---|---|---|---|---|---|---|---|---|---|---|"]
    order = {name: i for i, name in enumerate(METHODS)}
    records = sorted(results["records"], key=lambda r: (r["dtype"], r["H"], r["causal"], r["L"],
                                                        order.get(r["method"], 9), not r.get("overlap")))
    for r in records:
        if r["status"] == "ok":
            check = r.get("check") or {}
            verdict = (f"{check['error']:.1e} ≤ {check['tolerance']:.1e}" if check.get("error") is not None
                       else "-")
            timing = f"{r['median_ms']:.2f} | {r['one_gpu_ms']:.2f} | {r['efficiency']:.1%} | {verdict}"
        else:
            timing = f"- | - | - | {r['status']}: {r.get('reason', '')}"
        lines.append(f"| {r['dtype']} | {_heads(r)} | {_length(r['L'])} | {'causal' if r['causal'] else 'none'} | "
                     f"{r['method']} | {r['local']} | {'yes' if r.get('overlap') else 'no'} | {timing} |")
    for name, reason in results.get("unavailable", {}).items():
        lines.append(f"\n{name}: unavailable ({reason})")
    return "\n".join(lines)


def bar_results(results, L: int = 128 * 1024) -> list:
    """Issue #32's first bar at sequence length `L` (on 2 GPUs): for every measured record at `L`, a dict with its
    method, dtype, heads, mask, efficiency, the bar that applies (90 % non-causal, 85 % causal) and whether it is
    met. The bar is meant for the ring without a mask and zigzag with one; the others are listed for comparison."""
    rows = []
    for r in results["records"]:
        if r["status"] == "ok" and r["L"] == L:
            bar = BARS[bool(r["causal"])]
            rows.append({"method": r["method"] + _overlap_note(r), "dtype": r["dtype"], "heads": _heads(r),
                         "causal": r["causal"], "efficiency": r["efficiency"], "bar": bar,
                         "met": r["efficiency"] >= bar})
    return rows


def readme_table(results, source: str | None = None) -> str:
    """The README's summary: one row per problem, each method's efficiency (ours with the mma rung on every rank,
    PyTorch's context_parallel with SDPA), and the two-GPU milliseconds of our fastest method and of
    context_parallel. The whole table is :func:`scaling_table`'s."""
    columns = (("ring", True), ("ring", False), ("zigzag", True), ("ulysses", False), ("context_parallel", False))
    names = ("ring", "ring, no overlap", "zigzag", "ulysses", "context_parallel")
    problems_seen = {}
    for r in results["records"]:
        if r["status"] == "ok":
            key = (r["dtype"], r["H"], r["Hk"], r["causal"], r["L"])
            problems_seen.setdefault(key, {})[(r["method"], bool(r.get("overlap")))] = r
    lines = [f"Measured on {_headline(results)}" + (f", from `{source}`" if source else "") + ". Efficiency = "
             "one-GPU time / (2 x two-GPU time), each method against one GPU running the same local kernel in the "
             "same run (ours: the mma rung; context_parallel: SDPA); a dash: not measured. ms: two-GPU time of our "
             "fastest method and of context_parallel (whose local SDPA is the faster kernel on one GPU).", "",
             "| dtype | H | Hk | mask | L | " + " | ".join(names) + " | ours ms | context_parallel ms |",
             "|:---|---:|---:|:---|---:|" + "---:|" * (len(names) + 2)]
    for (dtype, H, Hk, causal, L), found in sorted(problems_seen.items()):
        cells = [f"{found[c]['efficiency']:.1%}" if c in found else "-" for c in columns]
        ours = [r["median_ms"] for (method, _), r in found.items() if method != "context_parallel"]
        theirs = found.get(("context_parallel", False))
        lines.append(f"| {dtype} | {H} | {Hk} | {'causal' if causal else 'none'} | {_length(L)} | "
                     + " | ".join(cells) + f" | {min(ours):.4g} | " + (f"{theirs['median_ms']:.4g}" if theirs else "-")
                     + " |")
    if not results.get("complete"):
        lines += ["", "The run did not reach every problem of its preset (`complete: false`); "
                  "`scripts/gpu_check.sh distributed` resumes it."]
    return "\n".join(lines)


def update_readme(results_path, readme) -> Path:
    """Rewrite the README's block between :data:`README_START` and :data:`README_END` from a results file."""
    from ...results_files import fill_block, shown_path

    source = shown_path(results_path, Path(readme).resolve().parent)
    return fill_block(readme, README_START, README_END, lambda: readme_table(load_scaling(results_path), source))


def efficiency_figure(results, dtype: str | None = None):
    """Scaling efficiency against L, one panel without and one with a causal mask, a line per method (dashed:
    GQA), with the bars of issue #32 (90 % non-causal, 85 % causal) and, causal, the contiguous ring's ceiling
    W / (2W - 1). `dtype`: the records of one dtype (default: the most common). A matplotlib Figure."""
    from ...plots import new_figure
    from .sharding import causal_ceiling

    ok = [r for r in results["records"] if r["status"] == "ok"]
    if dtype is None and ok:
        dtype = statistics.mode(r["dtype"] for r in ok)
    ok = [r for r in ok if r["dtype"] == dtype]
    world = results["environment"].get("world_size") or 2
    fig, axes = new_figure(ncols=2, width=10, height=3.8)
    colors = {"ring": "#1f77b4", "zigzag": "#2ca02c", "ulysses": "#ff7f0e", "context_parallel": "#9467bd"}
    for ax, causal in zip(axes, (False, True)):
        lines = {}
        for r in ok:
            if r["causal"] == causal:
                label = r["method"] + _overlap_note(r)
                line = lines.setdefault((label, _heads(r), r["method"], r["H"] != r["Hk"]), [])
                line.append((r["L"], r["efficiency"]))
        for (label, heads, method, gqa), points in sorted(lines.items()):
            points.sort()
            ax.plot([p[0] for p in points], [p[1] for p in points], marker="o", color=colors.get(method),
                    linestyle="--" if gqa else ("-" if "no overlap" not in label else ":"),
                    label=f"{label} {heads}")
        ax.axhline(BARS[causal], color="black", linewidth=0.8, linestyle="-.",
                   label=f"bar {BARS[causal]:.0%}")
        if causal:
            ax.axhline(causal_ceiling(world), color="grey", linewidth=0.8, linestyle=":",
                       label=f"contiguous ceiling W/(2W-1) = {causal_ceiling(world):.0%}")
        ax.set_xscale("log", base=2)
        lengths = sorted({r["L"] for r in ok})
        ax.set_xticks(lengths, [_length(L) for L in lengths])
        ax.minorticks_off()
        ax.set_xlabel("sequence length L")
        ax.set_ylabel("scaling efficiency")
        ax.set_title(f"{'causal' if causal else 'non-causal'}, {dtype}")
        ax.set_ylim(0, 1.1)
        ax.legend(fontsize=7)
    fig.suptitle(f"Scaling on {_headline(results)}", fontsize=9)
    return fig


# ---- measuring (torchrun) ------------------------------------------------------------------------------------------

def _finite(x):
    """A float for JSON (which has no NaN or Inf): None where `x` is not finite."""
    return float(x) if x is not None and math.isfinite(x) else None


class Ranks:
    """This process's place in the run: the group, its device, and the timing and agreement helpers that keep
    every rank in step (each collective bounded by the group's timeout)."""

    def __init__(self, device):
        import torch
        import torch.distributed as dist

        self.torch, self.dist, self.device = torch, dist, device
        self.world, self.rank = dist.get_world_size(), dist.get_rank()
        self.cuda = device.type == "cuda"

    def barrier(self):
        if self.cuda:
            self.dist.barrier(device_ids=[self.device.index])
            self.torch.cuda.synchronize(self.device)
        else:
            self.dist.barrier()

    def max_over_ranks(self, values):
        """The largest of every rank's `values` (floats), element by element: the same list on every rank."""
        tensor = self.torch.tensor(values, dtype=self.torch.float64, device=self.device)
        self.dist.all_reduce(tensor, op=self.dist.ReduceOp.MAX)
        return tensor.tolist()

    def time(self, function, *, warmup: int, repeats: int):
        """(median ms over `repeats`, the last result): each repeat starts after a barrier, and its time is the
        slowest rank's (CUDA events on GPUs, the wall clock on the CPU)."""
        result, times = None, []
        for repeat in range(warmup + repeats):
            result = None  # the previous result's memory is free for this repeat
            self.barrier()
            if self.cuda:
                start, end = (self.torch.cuda.Event(enable_timing=True) for _ in range(2))
                start.record()
                result = function()
                end.record()
                end.synchronize()
                elapsed = start.elapsed_time(end)
            else:
                began = time.perf_counter()
                result = function()
                elapsed = (time.perf_counter() - began) * 1e3
            if repeat >= warmup:
                times.append(elapsed)
        return statistics.median(self.max_over_ranks(times)), result


def _make_inputs(problem: Problem, device, seed: int):
    """q (B, H, L, D), k, v (B, Hk, L, D): the same on every rank (one generator per problem, on the device)."""
    import torch

    generator = torch.Generator(device=device).manual_seed(seed)
    dtype = getattr(torch, problem.dtype)
    q = torch.randn(problem.B, problem.H, problem.L, problem.D, generator=generator, device=device, dtype=dtype)
    k, v = (torch.randn(problem.B, problem.Hk, problem.L, problem.D, generator=generator, device=device,
                        dtype=dtype) for _ in range(2))
    return q, k, v


def _sdpa(q, k, v, causal):
    import torch.nn.functional as F

    gqa = {"enable_gqa": True} if q.shape[1] != k.shape[1] else {}  # only where needed: CP's SDPA may not take it
    return F.scaled_dot_product_attention(q, k, v, is_causal=causal, **gqa)


class ContextParallel:
    """PyTorch's context_parallel, imported defensively: ``reason`` says why it cannot run (None when it can)."""

    def __init__(self, ranks: Ranks):
        self.reason, self.mesh = None, None
        if not ranks.cuda:
            self.reason = "runs only on CUDA (the CPU SDPA ops have no sharding rule)"
            return
        try:
            from torch.distributed.device_mesh import init_device_mesh
            from torch.distributed.tensor.experimental import context_parallel

            try:
                from torch.distributed.tensor.experimental._attention import _cp_options
            except ImportError:
                from torch.distributed.tensor.experimental._context_parallel._attention import _cp_options
            try:
                from torch.distributed.tensor.experimental._attention import context_parallel_unshard
            except ImportError:
                context_parallel_unshard = None
            self.context_parallel, self.options, self.unshard = context_parallel, _cp_options, context_parallel_unshard
            self.mesh = init_device_mesh("cuda", (ranks.world,))
        except Exception as error:  # noqa: BLE001 - any failure to import or build the mesh is recorded
            self.reason = f"{type(error).__name__}: {error}"

    def rotate_method(self) -> str | None:
        return None if self.reason else str(getattr(self.options, "rotate_method", None))


def _run_method(method: Method, problem: Problem, q, k, v, ranks: Ranks, cp: ContextParallel, *, warmup, repeats):
    """Time `method` on `problem`; (median ms, this rank's output rows, their LSE or None, their global positions).
    The local shards are cut before the clock starts."""
    import torch

    from .ring import ring_attention
    from .sharding import local_indices
    from .ulysses import ulysses_attention

    L, world, rank = problem.L, ranks.world, ranks.rank
    if method.name == "context_parallel":
        return _run_context_parallel(problem, q, k, v, ranks, cp, warmup=warmup, repeats=repeats)
    layout = "zigzag" if method.name == "zigzag" else "contiguous"
    rows = torch.as_tensor(local_indices(L, world, rank, layout), device=q.device)
    q_local, k_local, v_local = (x[:, :, rows].contiguous() for x in (q, k, v))
    common = dict(Lq=L, Lk=L, causal=problem.causal, stage=method.local, check_finite=False)
    if method.name == "ulysses":
        def step():
            return ulysses_attention(q_local, k_local, v_local, **common)
    else:
        def step():
            return ring_attention(q_local, k_local, v_local, layout=layout, overlap=method.overlap, **common)
    median, (out, lse) = ranks.time(step, warmup=warmup, repeats=repeats)
    return median, out, lse, rows


def _run_context_parallel(problem: Problem, q, k, v, ranks: Ranks, cp: ContextParallel, *, warmup, repeats):
    """context_parallel's SDPA on copies of q, k, v (it shards its buffers in place). Its output rows are put back
    in order by ``context_parallel_unshard`` and each rank keeps its contiguous share of them (graded like the
    other methods' rows); without that function, by the layout its load balancer uses (head-tail = zigzag when
    causal, contiguous otherwise)."""
    import torch

    from .sharding import local_indices

    if cp.reason:
        raise RuntimeError(f"context_parallel unavailable: {cp.reason}")
    before = cp.options.enable_load_balance
    cp.options.enable_load_balance = problem.causal  # without a mask it must be off (its head-tail needs one)
    buffers = [x.clone() for x in (q, k, v)]
    try:
        with cp.context_parallel(cp.mesh, buffers=buffers, buffer_seq_dims=[2, 2, 2],
                                 no_restore_buffers=set(buffers)):
            median, out = ranks.time(lambda: _sdpa(*buffers, problem.causal), warmup=warmup, repeats=repeats)
            if cp.unshard is not None:
                (whole,) = cp.unshard(cp.mesh, [out], [2])
                rows = torch.as_tensor(local_indices(problem.L, ranks.world, ranks.rank), device=q.device)
                return median, whole[:, :, rows].contiguous(), None, rows
    finally:
        cp.options.enable_load_balance = before
    layout = "zigzag" if problem.causal else "contiguous"
    return median, out, None, torch.as_tensor(local_indices(problem.L, ranks.world, ranks.rank, layout),
                                              device=q.device)


def _grade(method: Method, problem: Problem, q, k, v, out, lse, rows, one_gpu_out, reference_slice, ranks: Ranks):
    """The method's check: its largest distance to the one-GPU result over every row it holds (every rank), and
    wb.check's rule on the last CHECK_ROWS query rows of KV head 0's query heads (gathered: rank 0 grades)."""
    import torch

    import wb_kernels as wb

    distance = 0.0
    for head in range(problem.H if rows.numel() else 0):  # one head at a time: no second copy of the output
        distance = max(distance, (out[:, head].float() - one_gpu_out[:, head, rows].float()).abs().max().item())
    n = min(CHECK_ROWS, problem.L)
    group = problem.H // problem.Hk
    first = problem.L - n
    piece = torch.zeros(problem.B, group, n, problem.D + 1, dtype=torch.float32, device=q.device)
    mine = rows >= first
    if mine.any():
        piece[:, :, rows[mine] - first, :-1] = out[:, :group][:, :, mine].float()
        if lse is not None:
            piece[:, :, rows[mine] - first, -1] = lse[:, :group][:, :, mine].float()
    ranks.dist.all_reduce(piece)  # each row is held by exactly one rank: the sum is a gather
    distance = ranks.max_over_ranks([distance])[0]
    if ranks.rank != 0:
        return None
    q_slice, k_slice, v_slice = q[:, :group, first:], k[:, :1], v[:, :1]
    graded = wb.check(f"{method.name} {problem.key()}", piece[..., :-1].to(q.dtype), q_slice, k_slice, v_slice,
                      lse=None if lse is None else piece[..., -1], causal="bottom_right" if problem.causal else False,
                      ref=reference_slice, verbose=False, raise_on_failure=False)
    return {"error": _finite(graded.max_err), "tolerance": _finite(graded.tol), "lse_error": _finite(graded.lse_err),
            "lse_tolerance": _finite(graded.lse_tol), "passed": graded.passed, "one_gpu_distance": _finite(distance),
            "rows": f"last {n} query rows, query heads 0-{group - 1} (KV head 0), every key, against float64"}


def measure_link(ranks: Ranks, *, megabytes: int, warmup: int, repeats: int) -> dict:
    """The ring's own exchange (:class:`.ring.BlockExchange`: send `megabytes` MiB to the next rank, receive as much
    from the previous one) timed like the methods: the bandwidth per direction that the overlap condition of the
    lesson needs (tokens per shard >= achieved FLOP/s / link bandwidth)."""
    import torch

    from .ring import BlockExchange

    block = torch.empty(megabytes * 2**20, dtype=torch.uint8, device=ranks.device).view(1, 1, 1, -1, 1)
    side_stream = torch.cuda.Stream(ranks.device) if ranks.cuda else None
    world, rank = ranks.world, ranks.rank

    def exchange():
        return BlockExchange(block, block.shape[3], send_to=(rank + 1) % world, receive_from=(rank - 1) % world,
                             group=None, side_stream=side_stream).finish()

    median, _ = ranks.time(exchange, warmup=warmup, repeats=repeats)
    return {"megabytes": megabytes, "median_ms": median, "gb_per_s": block.numel() / median / 1e6,
            "what": "one ring exchange (batch_isend_irecv: send to rank + 1, receive from rank - 1), per direction"}


def _environment(ranks: Ranks, stage: str) -> dict:
    import torch

    from ...results_files import environment

    env = environment()
    nccl = torch.cuda.nccl.version() if ranks.cuda else None  # a tuple (2, 27, 5); an int in old versions
    env.update(world_size=ranks.world, backend=ranks.dist.get_backend(), local_stage=stage,
               gpu_count=torch.cuda.device_count() if ranks.cuda else 0,
               nccl=".".join(map(str, nccl)) if isinstance(nccl, tuple) else nccl)
    return env


def _results_path(out_dir: Path, ranks: Ranks) -> Path:
    if ranks.cuda:
        from ...results_files import gpu_short_name

        return out_dir / f"scaling_{gpu_short_name()}x{ranks.world}.json"
    return out_dir / f"scaling_cpux{ranks.world}.json"


def _say(line: str) -> None:
    from .run import say_line  # (run imports torch at the top; this module is read on machines without it)

    say_line(line)


class Stopped(BaseException):
    """SIGTERM arrived (the run's time limit): not an Exception, so no method's failure handler records it."""


def _stop(signum, frame):
    raise Stopped()


def resumed_records(old) -> dict:
    """key -> record of a previous run's results (None: none), kept as they are; the record it was measuring when
    it stopped (``in_progress``: a crash, or a hang past the collective timeout) becomes a failed one, so that the
    same command does not walk into the same hang again."""
    if old is None:
        return {}
    done = {r["key"]: r for r in old["records"]}
    interrupted = old.get("in_progress")
    if interrupted and interrupted["key"] not in done:
        done[interrupted["key"]] = {**interrupted, "status": "failed",
                                    "reason": "a previous run stopped inside it (a crash, or a hang past the "
                                              "collective timeout); not tried again"}
    return done


def run_benchmark(args, ranks: Ranks) -> dict:
    """Every (problem, method) of the preset not yet in the results file, within the time budget; the results."""
    import torch

    from ...results_files import save_results
    from .sharding import predicted_efficiency, ring_work

    import wb_kernels as wb

    started = time.monotonic()
    path = _results_path(Path(args.out), ranks)
    old = load_scaling(path) if path.exists() else None
    ranks.barrier()  # every rank has read the old file before rank 0 writes the new one
    command = (f"python -m torch.distributed.run --standalone --nproc_per_node={ranks.world} "
               f"-m wb_kernels.stages.distributed.scaling {' '.join(args.argv)}")
    results = {"schema": SCHEMA, "kind": "distributed_scaling", "environment": _environment(ranks, args.stage),
               "command": command,
               "timing": {"method": "CUDA events" if ranks.cuda else "wall clock",
                          "statistic": "median over repeats of the slowest rank's time, a barrier before each",
                          "warmup": args.warmup, "repeats": args.repeats},
               "records": [], "unavailable": {}, "complete": False}
    done = resumed_records(old)
    results["records"] = list(done.values())
    results["link"] = measure_link(ranks, megabytes=256 if ranks.cuda else 4, warmup=args.warmup + 1,
                                   repeats=args.repeats)
    cp = ContextParallel(ranks)
    if cp.reason:
        results["unavailable"]["context_parallel"] = cp.reason
    else:
        results["environment"]["context_parallel_rotate_method"] = cp.rotate_method()

    def save(in_progress=None):
        if ranks.rank == 0:
            results["in_progress"] = in_progress
            save_results(results, path)

    save()
    planned = [(p, m) for p in problems(args.preset, args.dtypes) for m in methods_for(p, args.stage)]
    out_of_time = False
    signal.signal(signal.SIGTERM, _stop)  # torchrun passes on the SIGTERM of a step's time limit
    try:
        for index, problem in enumerate(problems(args.preset, args.dtypes)):
            todo = [m for m in methods_for(problem, args.stage) if m.key(problem) not in done]
            if not todo:
                continue
            go = ranks.max_over_ranks([float(time.monotonic() - started < args.time_budget)])[0]  # rank-agnostic
            if not go:
                out_of_time = True
                break
            q, k, v = _make_inputs(problem, ranks.device, seed=1000 + index)
            baselines = {}  # local kernel -> (ms, output)

            def one_gpu(local):
                if local not in baselines:
                    if local == "sdpa":
                        call = lambda: _sdpa(q, k, v, problem.causal)  # noqa: E731
                    else:
                        call = lambda: wb.attention(q, k, v, stage=local, causal=problem.causal,  # noqa: E731
                                                    check_finite=False)
                    baselines[local] = ranks.time(call, warmup=args.warmup, repeats=args.repeats)
                return baselines[local]

            reference_slice = None
            if ranks.rank == 0:
                n, group = min(CHECK_ROWS, problem.L), problem.H // problem.Hk
                reference_slice = wb.reference(q[:, :group, problem.L - n:], k[:, :1], v[:, :1],
                                               causal="bottom_right" if problem.causal else False)
            for method in todo:
                key = method.key(problem)
                record = {"key": key, "method": method.name, "local": method.local, **asdict(problem),
                          "world_size": ranks.world, "overlap": method.overlap, "median_ms": None, "one_gpu_ms": None,
                          "efficiency": None, "check": None, "status": "failed", "reason": ""}
                if method.name in ("ring", "zigzag"):
                    layout = "zigzag" if method.name == "zigzag" else "contiguous"
                    record["predicted_efficiency"] = predicted_efficiency(
                        ring_work(problem.L, problem.L, ranks.world, layout, 0 if problem.causal else None))
                if method.name == "ulysses" and (problem.H % ranks.world or problem.Hk % ranks.world):
                    record.update(status="skipped", reason=f"W = {ranks.world} does not divide H and Hk")
                elif method.name == "context_parallel" and cp.reason:
                    record.update(status="skipped", reason=f"unavailable: {cp.reason}")
                else:
                    save(in_progress=record)
                    error = ""
                    try:
                        base_ms, base_out = one_gpu(method.local)
                        median, out, lse, rows = _run_method(method, problem, q, k, v, ranks, cp,
                                                             warmup=args.warmup, repeats=args.repeats)
                        check = _grade(method, problem, q, k, v, out, lse, rows, base_out, reference_slice, ranks)
                        del out, lse
                        record.update(median_ms=median, one_gpu_ms=base_ms,
                                      efficiency=base_ms / (ranks.world * median), check=check)
                    except Exception as failure:  # noqa: BLE001 - recorded; the ranks agree below
                        error = f"{type(failure).__name__}: {failure}"[:500]
                    failed_somewhere = ranks.max_over_ranks([float(bool(error))])[0]
                    if failed_somewhere:
                        record.update(status="failed", reason=error or "failed on another rank")
                    elif ranks.rank == 0 and not record["check"]["passed"]:
                        record.update(status="failed", reason="check failed")
                    else:
                        record.update(status="ok", reason="")
                    if ranks.cuda:
                        torch.cuda.empty_cache()
                done[key] = record
                results["records"] = list(done.values())
                save()
                if ranks.rank == 0:
                    _say(_progress_line(record, time.monotonic() - started))
            del q, k, v, baselines
            if ranks.cuda:
                torch.cuda.empty_cache()
    except Stopped:
        # stopped from outside (a time limit), not by a hang: the record under way is tried again next time
        save(in_progress=None)
        raise SystemExit(143) from None
    results["complete"] = not out_of_time and all(m.key(p) in done for p, m in planned)
    save()
    return results


def _progress_line(record, elapsed: float) -> str:
    what = f"[{elapsed:6.0f} s] {record['key']:70s}"
    if record["status"] != "ok":
        return f"{what} {record['status']}: {record['reason']}"
    check = record["check"] or {}
    return (f"{what} {record['median_ms']:9.2f} ms, one GPU {record['one_gpu_ms']:9.2f} ms, efficiency "
            f"{record['efficiency']:6.1%}, check {check.get('error') or 0:.1e} <= {check.get('tolerance') or 0:.1e}, "
            f"to one GPU {check.get('one_gpu_distance') or 0:.1e}")


def main(argv=None) -> int:
    from .run import init_ranks

    argv = sys.argv[1:] if argv is None else argv
    parser = argparse.ArgumentParser(
        prog="python -m torch.distributed.run ... -m wb_kernels.stages.distributed.scaling",
        description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True, help="folder of the results file scaling_<gpu>x<W>.json")
    parser.add_argument("--preset", default=None, choices=("gpu", "smoke"),
                        help="problems (default: gpu; smoke with --device cpu: tiny float32 ones)")
    parser.add_argument("--dtypes", default="float16,bfloat16",
                        help="comma-separated; the first gets every problem, the others L <= 128k at H = 16")
    parser.add_argument("--stage", default=None, help="local rung of ours (default: mma on GPUs, reference on CPU)")
    parser.add_argument("--backend", default="nccl", choices=("nccl", "gloo"))
    parser.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--time-budget", type=float, default=300.0,
                        help="seconds after which no new problem starts (the same command resumes)")
    parser.add_argument("--timeout", type=float, default=180.0, help="seconds a collective may wait before failing")
    parser.add_argument("--update-readme", metavar="RESULTS.json", default=None,
                        help="rewrite README.md's scaling table from a results file, then exit (no torchrun needed)")
    if "--update-readme" in argv:  # (the only option that needs no --out and no ranks)
        path = argv[argv.index("--update-readme") + 1]
        print(f"updated {update_readme(path, Path(__file__).resolve().parents[3] / 'README.md')}")
        return 0
    args = parser.parse_args(argv)
    args.argv = argv
    args.preset = args.preset or ("smoke" if args.device == "cpu" else "gpu")
    args.dtypes = tuple(d.strip() for d in args.dtypes.split(",") if d.strip())
    if args.preset == "smoke":
        args.dtypes = ("float32",)
    if (args.device == "cpu") != (args.backend == "gloo"):
        parser.error("--device cpu goes with --backend gloo, --device cuda with --backend nccl")
    args.stage = args.stage or ("mma" if args.device == "cuda" else "reference")
    if "RANK" not in os.environ:
        parser.error("start this module with torchrun (python -m torch.distributed.run --nproc_per_node=W -m ...)")
    device = init_ranks(args.backend, args.timeout)
    try:
        ranks = Ranks(device)
        results = run_benchmark(args, ranks)
        failed = [r["key"] for r in results["records"] if r["status"] == "failed"]
        if ranks.rank == 0:  # (only rank 0 knows the verdicts of the float64 checks: the exit status is its)
            _say(f"{len(results['records'])} records, {len(failed)} failed, complete: {results['complete']}; "
                 f"written to {_results_path(Path(args.out), ranks)}")
            _say(scaling_table(results))
        any_failed = ranks.max_over_ranks([float(bool(failed))])[0]
    finally:
        import torch.distributed as dist

        dist.destroy_process_group()
    return 1 if any_failed else 0


if __name__ == "__main__":
    sys.exit(main())
