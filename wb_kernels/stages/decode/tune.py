#!/usr/bin/env python3
"""Build, check and time the CUDA C++ decode kernel's launch variants and numbers of splits on one GPU, in one run.

A variant is a build of ``decode_host.cu`` (and the headers it includes) with other values of its three knobs (``-D`` flags):

- ``WB_DECODE_WARPS``: warps per block of the split kernel (each warp walks its own keys);
- ``WB_KEYS_IN_FLIGHT``: key steps whose K and V loads a lane issues before it uses the first;
- ``WB_DECODE_PREFETCH``: 1 issues the next trip's loads before this trip's arithmetic (twice the registers).

For each variant, each decode workload (fp16, H = 32, the bar shapes of lesson 07 and a few around them) and each
number of splits, the bare extension call (``flash_decode_forward``: split kernel + merge kernel + its buffers) is
checked against PyTorch in float32 and timed with CUDA events as the decode benchmark times a call (device time,
the L2 cache flushed clean before every call). In the same
run: SDPA (default backend, and FLASH forced) and a copy of K and V, the ceiling the decode benchmark uses. The
table printed and the JSON written say, per workload, the fastest (variant, splits) and what
``choose_num_splits`` would pick at 2, 4 and 8 blocks per SM, and what the launcher picks (at the default build's
occupancy, which the CUDA runtime computes), measured as it is, so that the launcher's defaults come from measurements
(this folder's NOTES.md quotes them).

A second, small measurement: SDPA in a decode loop, where the cache grows by one key per step. Each new length is a
new shape; the time per call is measured with the host clock (what a decoder waits for), with PyTorch picking the
backend and with FLASH forced.

    python -m wb_kernels.stages.decode.tune --json results/decode/tune_h100.json
    python -m wb_kernels.stages.decode.tune --quick      # two variants, the two bar shapes
    python -m wb_kernels.stages.decode.tune --mma-threshold --json results/decode/mma_threshold_h100.json

``--mma-threshold`` times instead the two kernels of the default build on the same problems, H = 32 query heads on
Hk = 32 / group KV heads (groups 1 to 32), each at the launcher's split count for that kernel: the split kernel
(``flash_decode_forward``) and the tensor-core one for large groups (``flash_decode_mma_forward``), and says from
which group on the second is faster at every shape (:func:`smallest_winning_group`): the value for
``launcher.MMA_MIN_GROUP``. (Its file is not named ``tune_*.json``: lesson 07 reads the newest of those as the
split kernel's tuning run.)

    python -m wb_kernels.stages.decode.tune --mma-sweep --json results/decode/mma_sweep_h100.json

    python -m wb_kernels.stages.decode.tune --mma-trace --json results/decode/mma_trace_h100.json

``--mma-trace`` builds the tensor-core kernel with ``WB_DECODE_MMA_TRACE`` (thread 0 of every block stamps
``%globaltimer`` and ``clock64`` at points of its life into the status tensor: entry, first loads issued, q in
shared memory, first tile landed, loop done, partial result written, and in a block that runs the fused merge, that
merge done) and calls it once per shape (:data:`TRACE_SHAPES`)
after a clean L2: where a block's time goes, which neither the benchmark (one number per call) nor ncu (counters
averaged over the kernel) shows. Cycles are each block's own (``clock64`` from its entry); times are from the first
block's entry, at the timer's resolution (about 0.26 us on the H100).

``--split-trace`` does the same for the split kernel (``WB_DECODE_SPLIT_TRACE``: entry, first loads issued, loop
done, partial result written, merge done) at the GQA-8 bar shapes (:data:`SPLIT_TRACE_SHAPES`), on a contiguous and
a paged cache: how the blocks of one wave end, and how long the last block's merge takes.

    python -m wb_kernels.stages.decode.tune --split-trace --json results/decode/split_trace_h100.json

``--mma-sweep`` A/B's the tensor-core kernel's builds (:data:`MMA_VARIANTS`: the default and its number of warps
per block, ``WB_DECODE_MMA_WARPS``, each with the package's own nvcc flags) at :data:`MMA_SWEEP_SHAPES` (the MQA
bar shapes, a long MQA sequence, a group of 8 and MQA at batch 64), each at several numbers of splits around the
launcher's, every result checked against float32 PyTorch (output and LSE; a mismatch is printed as MISMATCH and the
exit status is 1), with SDPA's backends and the K/V copy timed in the same run.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import wb_kernels  # noqa: F401  (first: chooses the backend)
from wb_kernels import timing
from wb_kernels.cuda_build import build_flags
from wb_kernels.timing import DEVICE_TIME as DECODE_TIMING  # the decode benchmark's timing, the same object
from wb_kernels.stages.decode import build
from wb_kernels.stages.decode.launcher import (cuda_launch_plan, cuda_blocks_per_sm, cuda_row_chunks, cuda_split_plan,
                                               decode_bytes)
from wb_kernels.stages.decode.splitkv import choose_num_splits


@dataclass(frozen=True)
class Variant:
    warps: int
    keys_in_flight: int
    prefetch: int
    chunked: int  # 1: one online-softmax rescale per trip of keys_in_flight keys; 0: per key
    fused: int = 1  # 1: the split kernel's last block per group merges the splits; 0: a second kernel does

    @property
    def name(self) -> str:
        return (f"w{self.warps}_k{self.keys_in_flight}" + ("_pf" if self.prefetch else "")
                + ("_ch" if self.chunked else "") + ("_fm" if self.fused else ""))

    @property
    def flags(self) -> list:
        """The package's nvcc flags (optimisation, fast math, this GPU's architecture) and the knobs. (Until
        2026-11-27 only the knobs: flags given to the build replace the package's, so the default mode's builds had
        neither -O3 nor fast math, and the tuning files before then time those builds.)"""
        return build_flags() + [f"-DWB_DECODE_WARPS={self.warps}", f"-DWB_KEYS_IN_FLIGHT={self.keys_in_flight}",
                f"-DWB_DECODE_PREFETCH={self.prefetch}", f"-DWB_DECODE_CHUNKED_SOFTMAX={self.chunked}",
                f"-DWB_DECODE_FUSED_MERGE={self.fused}"]


DEFAULT = Variant(8, 2, 1, 1)  # what decode_host.cu builds without flags
# the previous default (a second kernel merges), the first version (4 warps, 4 steps in flight, per-key softmax,
# separate merge), and fused ones around the default. (Names before 2026-11-24 had no _fm: all merged separately.)
VARIANTS = (DEFAULT, Variant(8, 2, 1, 1, 0), Variant(4, 4, 0, 0, 0), Variant(8, 4, 1, 1), Variant(8, 4, 0, 1),
            Variant(4, 2, 1, 1))
# (B, H, Hk, Lk, D): the two bar shapes first; B64 Lk1024, the README table's row furthest behind SDPA (one split: two
# waves of blocks), since 2026-11-27
WORKLOADS = ((8, 32, 8, 8192, 128), (1, 32, 8, 32768, 128), (1, 32, 32, 32768, 128), (1, 32, 1, 32768, 128),
             (64, 32, 8, 4096, 128), (8, 32, 8, 8192, 64), (1, 32, 8, 4096, 128), (16, 32, 8, 1024, 64),
             (64, 32, 8, 1024, 128))
SPLITS = (1, 2, 4, 8, 16, 32, 64, 128)


def _build_in_subprocess(variant: Variant) -> subprocess.Popen:
    code = ("import wb_kernels; from wb_kernels.stages.decode import build; "
            f"build.build(build.package_source(), flags={variant.flags!r})")
    return subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def build_all(variants) -> dict:
    """Every variant's extension, compiled side by side (one nvcc per variant), then loaded here from the cache."""
    started = time.time()
    jobs = {v: _build_in_subprocess(v) for v in variants}
    failed = {}
    for variant, job in jobs.items():
        output, _ = job.communicate()
        if job.returncode != 0:
            failed[variant.name] = output[-2000:]
    print(f"built {len(variants) - len(failed)} of {len(variants)} variants in {time.time() - started:.0f} s",
          file=sys.stderr)
    return {v: build.build(build.package_source(), flags=v.flags) for v in variants if v.name not in failed}, failed


def time_call(call, reps: int, flush_mode: str = DECODE_TIMING["flush_mode"]) -> float:
    """Median milliseconds of `call`: the package's CUDA-event timer as the decode benchmark runs it (device time, the
    L2 cache flushed before each call, by reading unless `flush_mode` says "write")."""
    return timing.time_call(call, warmup=1, repeats=reps, flush_l2=True, device="cuda", flush_mode=flush_mode,
                            hold_us=DECODE_TIMING["hold_us"]).median_ms


def measure(variants, workloads, reps: int) -> list:
    import torch
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    extensions, failed = build_all(variants)
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    rows = []
    for B, H, Hk, L, D in workloads:
        gen = torch.Generator(device="cuda").manual_seed(B + Hk + L + D)
        q = torch.randn(B, H, D, device="cuda", dtype=torch.float16, generator=gen)
        k = torch.randn(B, Hk, L, D, device="cuda", dtype=torch.float16, generator=gen)
        v = torch.randn(B, Hk, L, D, device="cuda", dtype=torch.float16, generator=gen)
        lens = torch.full((B,), L, dtype=torch.int32, device="cuda")
        table = None  # a contiguous cache: the kernel needs no block table
        status = torch.zeros(1, dtype=torch.int32, device="cuda")  # the kernel's flags (none expected here)
        scale = D ** -0.5
        expected = F.scaled_dot_product_attention(q[:, :, None].float(), k.float(), v.float(), enable_gqa=True)[:, :, 0]
        kv_bytes = 2 * k.numel() * k.element_size()
        shape = dict(B=B, H=H, Hk=Hk, Lk=L, D=D, kv_bytes=kv_bytes)
        group = H // Hk
        heuristic = {bps: choose_num_splits(B, Hk, L, sms, row_chunks=cuda_row_chunks(group), blocks_per_sm=bps,
                                            keys_step=build.KEYS_PER_STEP) for bps in (2, 4, 8)}
        # what the launcher runs (its plan, at the default build's occupancy: the CUDA runtime's blocks per SM)
        device = torch.cuda.current_device()
        occupancy = cuda_blocks_per_sm(device, False, D, group)
        launcher_splits = cuda_launch_plan(device, B, H, Hk, L, None, D, False)[1]

        target = torch.empty_like(k)

        def copy():
            target.copy_(k)
            target.copy_(v)

        baselines = {"copy": time_call(copy, reps)}
        qs = q[:, :, None]
        baselines["sdpa"] = time_call(lambda: F.scaled_dot_product_attention(qs, k, v, enable_gqa=True), reps)
        with sdpa_kernel([SDPBackend.FLASH_ATTENTION]):
            baselines["sdpa-flash"] = time_call(lambda: F.scaled_dot_product_attention(qs, k, v, enable_gqa=True),
                                                reps)
        # the same three with the L2 left dirty by the flush (zeroed, not read), as tuning runs before 2026-11-24 timed
        baselines_write = {"copy": time_call(copy, reps, "write"),
                           "sdpa": time_call(lambda: F.scaled_dot_product_attention(qs, k, v, enable_gqa=True), reps,
                                             "write")}
        copy_gbps = 2 * kv_bytes / (baselines["copy"] / 1e3) / 1e9
        print(f"B{B} H{H} Hk{Hk} Lk{L} D{D}: copy {copy_gbps:.0f} GB/s, sdpa {baselines['sdpa']:.4f} ms, "
              f"sdpa-flash {baselines['sdpa-flash']:.4f} ms; choose_num_splits at 2/4/8 blocks per SM: "
              f"{heuristic[2]}/{heuristic[4]}/{heuristic[8]}; the launcher's ({occupancy} per SM): {launcher_splits}",
              file=sys.stderr)
        for variant, ext in extensions.items():
            for splits in sorted(set(SPLITS) | {launcher_splits}):  # the launcher's pick measured as it is
                keys, used = cuda_split_plan(L, splits)
                if used != splits and splits != 1:
                    continue  # rounding to whole steps gave fewer splits: measured under their own count

                def call():
                    return ext.flash_decode_forward(q, k, v, table, lens, status, keys, used, scale)

                out = call()[0]
                err = float((out.float() - expected).abs().max())
                ms = time_call(call, reps)
                dirty = {}
                if variant == DEFAULT and used == launcher_splits:
                    ms_write = time_call(call, reps, "write")
                    dirty = dict(median_ms_write_flush=round(ms_write, 5),
                                 fraction_of_copy_write_flush=round(baselines_write["copy"] / (2 * ms_write), 4),
                                 baselines_ms_write_flush={n: round(t, 5) for n, t in baselines_write.items()})
                rows.append(dict(shape, variant=variant.name, **asdict(variant), splits=used, keys_per_split=keys,
                                 median_ms=round(ms, 5), gbps=round(kv_bytes / (ms / 1e3) / 1e9, 1),
                                 fraction_of_copy=round(baselines["copy"] / (2 * ms), 4), **dirty,
                                 max_err_vs_fp32=err, ok=err < 2e-2,
                                 baselines_ms={n: round(t, 5) for n, t in baselines.items()},
                                 heuristic_splits=heuristic, launcher_splits=launcher_splits,
                                 launcher_blocks_per_sm=occupancy))
        best = min((r for r in rows if r["Lk"] == L and r["B"] == B and r["Hk"] == Hk and r["D"] == D),
                   key=lambda r: r["median_ms"])
        print(f"   best: {best['variant']} splits {best['splits']}: {best['median_ms']:.4f} ms, "
              f"{best['fraction_of_copy']:.0%} of copy; vs sdpa {baselines['sdpa'] / best['median_ms']:.2f}x",
              file=sys.stderr)
    return rows, failed


THRESHOLD_GROUPS = (1, 2, 4, 5, 8, 16, 32)  # H = 32 on Hk = 32 / group (5: H = 40 on 8)
THRESHOLD_SHAPES = ((8, 8192, 128), (1, 32768, 128), (8, 8192, 64))  # (B, Lk, D)


def measure_mma_threshold(reps: int) -> list:
    """Both kernels of the default build on each (shape, group), float16, contiguous cache, at the launcher's splits
    for each kernel, checked against float32 SDPA; one row per (shape, group, kernel)."""
    import torch
    import torch.nn.functional as F

    ext = build.extension()
    device = torch.cuda.current_device()
    status = torch.zeros(1, dtype=torch.int32, device="cuda")
    rows = []
    for B, L, D in THRESHOLD_SHAPES:
        for group in THRESHOLD_GROUPS:
            H, Hk = (40, 8) if group == 5 else (32, 32 // group)
            gen = torch.Generator(device="cuda").manual_seed(B + group + L + D)
            q = torch.randn(B, H, D, device="cuda", dtype=torch.float16, generator=gen)
            k, v = (torch.randn(B, Hk, L, D, device="cuda", dtype=torch.float16, generator=gen) for _ in range(2))
            lens = torch.full((B,), L, dtype=torch.int32, device="cuda")
            expected = F.scaled_dot_product_attention(q[:, :, None].float(), k.float(), v.float(),
                                                      enable_gqa=True)[:, :, 0]
            kv_bytes = 2 * k.numel() * k.element_size()
            for kernel, entry in (("split", ext.flash_decode_forward), ("mma", ext.flash_decode_mma_forward)):
                keys, splits, scale = cuda_launch_plan(device, B, H, Hk, L, None, D, False, False, kernel)

                def call():
                    return entry(q, k, v, None, lens, status, keys, splits, scale)

                err = float((call()[0].float() - expected).abs().max())
                ms = time_call(call, reps)
                asked = decode_bytes(B, H, Hk, L, D, 2, splits, kernel)
                rows.append(dict(B=B, H=H, Hk=Hk, group=group, Lk=L, D=D, kernel=kernel, splits=splits,
                                 median_ms=round(ms, 5), gbps=round(kv_bytes / (ms / 1e3) / 1e9, 1),
                                 kv_requested=asked.kv_requested, max_err_vs_fp32=err, ok=err < 2e-2))
            split_ms, mma_ms = rows[-2]["median_ms"], rows[-1]["median_ms"]
            print(f"B{B} Lk{L} D{D} group {group}: split kernel {split_ms:.4f} ms, mma kernel {mma_ms:.4f} ms "
                  f"({split_ms / mma_ms:.2f}x)", file=sys.stderr)
    return rows


def smallest_winning_group(rows: list):
    """The smallest group from which on the mma kernel is faster than the split kernel at every shape and every
    larger group measured (None: at no group); only rows whose outputs passed the check count."""
    by_point = {}
    for row in rows:
        by_point.setdefault((row["B"], row["Lk"], row["D"], row["group"]), {})[row["kernel"]] = row
    groups = sorted({group for _, _, _, group in by_point})
    wins = {group: all(p["mma"]["median_ms"] < p["split"]["median_ms"] and p["mma"]["ok"] and p["split"]["ok"]
                       for key, p in by_point.items() if key[3] == group and {"mma", "split"} <= set(p))
            for group in groups}
    answer = None
    for group in reversed(groups):
        if not wins[group]:
            break
        answer = group
    return answer


@dataclass(frozen=True)
class MmaVariant:
    """A build of decode_host.cu with `defines` (``WB_DECODE_MMA_*`` knobs) on top of the package's nvcc flags."""

    name: str
    defines: tuple = ()  # ((macro, value), ...)

    def flags(self, base: list) -> list:
        return list(base) + [f"-D{macro}={value}" for macro, value in self.defines]


MMA_VARIANTS = (
    MmaVariant("base"),  # the default build, as wb.decode runs it: 8 warps a block
    MmaVariant("warps4", (("WB_DECODE_MMA_WARPS", 4),)),  # the kernel before 2026-11-26: 4 warps, 64-key tiles
    # more tiles in flight: 192 KB of stages (MQA's 64-key tiles: 6 of them; one row tile: 3 of 128 keys)
    MmaVariant("smem192", (("WB_DECODE_MMA_SMEM_KB", 192),)),
    # the last block merges up to 1024 (query head, split) pairs instead of 256 (MQA's 32 heads: 32 splits, not 8)
    MmaVariant("fused1024", (("WB_DECODE_MMA_FUSED_ROW_SPLITS", 1024),)),
)
# (B, H, Hk, Lk, D), float16: the MQA bar shapes, a long MQA sequence, GQA 8 (the mma kernel from group 5 on), and
# MQA at batch 64 (the decode benchmark's rows furthest behind SDPA, 0.76-0.93x; the launcher plans 2 splits there)
MMA_SWEEP_SHAPES = ((8, 32, 1, 8192, 128), (1, 32, 1, 2048, 128), (1, 32, 1, 32768, 128), (8, 32, 4, 8192, 128),
                    (64, 32, 1, 1024, 128), (64, 32, 1, 8192, 128))
MMA_MAX_SWEEP_SPLITS = 256


def mma_sweep_splits(L: int, launcher_splits: int) -> list:
    """The numbers of splits timed at a shape: the launcher's, then powers of two from an eighth of it to twice it,
    or to 8 where twice is less (at most MMA_MAX_SWEEP_SPLITS), each as the kernel runs it (``cuda_split_plan``: whole
    64-key steps), so that a count rounded onto another is timed once."""
    most = max(2 * launcher_splits, 8)
    asked = {launcher_splits} | {1 << e for e in range(9) if launcher_splits / 8 <= 1 << e <= most}
    plans = {}
    for splits in sorted(asked):
        if splits > MMA_MAX_SWEEP_SPLITS:
            continue
        keys, used = cuda_split_plan(L, splits)
        plans.setdefault(used, keys)
    return sorted(plans.items(), key=lambda plan: plan[0])  # [(splits, keys_per_split), ...]


def _mma_sdpa_baselines(q, k, v, reps: int) -> dict:
    """SDPA's backends (each one alone; a backend that refuses the problem is left out) and the default dispatch."""
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    qs, times = q[:, :, None], {}
    times["sdpa"] = time_call(lambda: F.scaled_dot_product_attention(qs, k, v, enable_gqa=True), reps)
    for name, backend in (("sdpa-flash", SDPBackend.FLASH_ATTENTION), ("sdpa-efficient", SDPBackend.EFFICIENT_ATTENTION),
                          ("sdpa-cudnn", SDPBackend.CUDNN_ATTENTION)):
        try:
            with sdpa_kernel([backend]):
                times[name] = time_call(lambda: F.scaled_dot_product_attention(qs, k, v, enable_gqa=True), reps)
        except RuntimeError as error:  # not available for this problem or build
            print(f"   {name}: {str(error).splitlines()[0][:100]}", file=sys.stderr)
    return times


def measure_mma_sweep(variants, reps: int) -> tuple:
    """Every variant's mma kernel at every shape and sweep count of splits: one row each (see the module doc).

    The builds compile side by side; each is then timed in a child process of its own (``--mma-sweep-child``), with
    the baselines timed again there, so that no build shares a process with another. (Until 2026-11-26 every knob
    build's launches failed with "invalid argument": the child asked the package's build for its occupancy first, and
    the kernel's shared-memory opt-in flag was one object for the whole process, so the knob build skipped its own
    opt-in. The flag is each build's own now: NOTES.md.)"""
    import tempfile

    started = time.time()
    base_flags = build_flags()
    jobs = {v: _build_flags_in_subprocess(v.flags(base_flags)) for v in variants}
    built, failed = [], {}
    for variant, job in jobs.items():
        output, _ = job.communicate()
        if job.returncode != 0:
            failed[variant.name] = output[-3000:]
            print(f"BUILD FAILED {variant.name}:\n{output[-3000:]}", file=sys.stderr)
        else:
            built.append(variant)
    print(f"built {len(built)} of {len(variants)} mma variants in {time.time() - started:.0f} s", file=sys.stderr)
    rows, shapes = [], []
    for variant in built:
        with tempfile.TemporaryDirectory() as folder:
            out = Path(folder) / "child.json"
            child = subprocess.run([sys.executable, "-m", "wb_kernels.stages.decode.tune", "--mma-sweep-child",
                                    variant.name, "--reps", str(reps), "--json", str(out)], text=True,
                                   stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
            print(child.stdout[-4000:], file=sys.stderr)
            if child.returncode != 0 or not out.exists():
                failed[variant.name] = f"timing child exited {child.returncode}: {child.stdout[-2000:]}"
                continue
            part = json.loads(out.read_text())
        rows += part["records"]
        shapes = shapes or part["shapes"]  # the first child's baselines (each child's rows use its own)
    return rows, shapes, failed


def measure_mma_variant(variant, reps: int) -> tuple:
    """One variant's rows and the shapes' baselines, in this process (the build comes from the cache)."""
    import torch

    extensions = {variant: build.build(build.package_source(), flags=variant.flags(build_flags()))}
    device = torch.cuda.current_device()
    status = torch.zeros(1, dtype=torch.int32, device="cuda")
    rows, shapes = [], []
    for B, H, Hk, L, D in MMA_SWEEP_SHAPES:
        gen = torch.Generator(device="cuda").manual_seed(B * 7 + Hk + L + D)
        q = torch.randn(B, H, D, device="cuda", dtype=torch.float16, generator=gen)
        k, v = (torch.randn(B, Hk, L, D, device="cuda", dtype=torch.float16, generator=gen) for _ in range(2))
        lens = torch.full((B,), L, dtype=torch.int32, device="cuda")
        scale = D ** -0.5
        expected = torch.nn.functional.scaled_dot_product_attention(q[:, :, None].float(), k.float(), v.float(),
                                                                     enable_gqa=True)[:, :, 0]
        scores = torch.einsum("bhgd,bhld->bhgl", q.float().view(B, Hk, H // Hk, D), k.float()) * scale
        expected_lse = torch.logsumexp(scores, dim=-1).reshape(B, H)
        del scores
        kv_bytes = 2 * k.numel() * k.element_size()
        target = torch.empty_like(k)

        def copy():
            target.copy_(k)
            target.copy_(v)

        baselines = {"copy": time_call(copy, reps), **_mma_sdpa_baselines(q, k, v, reps)}
        fastest = min((n for n in baselines if n.startswith("sdpa")), key=baselines.get)
        launcher_splits = cuda_launch_plan(device, B, H, Hk, L, None, D, False, False, "mma")[1]
        shape = dict(B=B, H=H, Hk=Hk, Lk=L, D=D, kv_bytes=kv_bytes)
        shapes.append(dict(shape, baselines_ms={n: round(t, 5) for n, t in baselines.items()}, sdpa_fastest=fastest,
                           launcher_splits=launcher_splits,
                           blocks_per_sm=cuda_blocks_per_sm(device, False, D, H // Hk, False, "mma")))
        print(f"B{B} H{H} Hk{Hk} Lk{L} D{D}: copy {baselines['copy'] * 1e3:.1f} us, fastest SDPA {fastest} "
              f"{baselines[fastest] * 1e3:.1f} us; the launcher's splits {launcher_splits}", file=sys.stderr)
        for variant, ext in extensions.items():
            for splits, keys in mma_sweep_splits(L, launcher_splits):
                last = {}

                def call():
                    last["result"] = ext.flash_decode_mma_forward(q, k, v, None, lens, status, keys, splits, scale)
                    return last["result"]

                try:
                    out, lse = call()[:2]
                    torch.cuda.synchronize()
                except RuntimeError as error:  # a launch the build refuses (e.g. invalid argument): say so, go on
                    print(f"ERROR {variant.name} B{B} Hk{Hk} Lk{L} splits {splits} keys {keys}: "
                          f"{str(error).splitlines()[0]}", file=sys.stderr)
                    rows.append(dict(shape, variant=variant.name, splits=splits, keys_per_split=keys, ok=False,
                                     launcher_pick=splits == launcher_splits, error=str(error).splitlines()[0]))
                    continue
                err = float((out.float() - expected).abs().max())
                lse_err = float((lse - expected_lse).abs().max())
                ok = err < 2e-2 and lse_err < 1e-2 and int(status.item()) == 0
                ms = time_call(call, reps)
                row = dict(shape, variant=variant.name, splits=splits, keys_per_split=keys, median_ms=round(ms, 5),
                           gbps=round(kv_bytes / (ms / 1e3) / 1e9, 1),
                           fraction_of_copy=round(baselines["copy"] / (2 * ms), 4),
                           vs_sdpa_fastest=round(baselines[fastest] / ms, 3), launcher_pick=splits == launcher_splits,
                           max_err_vs_fp32=err, lse_err_vs_fp32=lse_err, ok=ok)
                if not ok:
                    print(f"MISMATCH {variant.name} B{B} Hk{Hk} Lk{L} splits {splits}: max |out - fp32| {err:.3g}, "
                          f"|lse - fp32| {lse_err:.3g}, status {int(status.item())}", file=sys.stderr)
                    status.zero_()
                rows.append(row)
    return rows, shapes


def mma_sweep_table(rows: list, shapes: list) -> str:
    """The sweep as text: a line per (shape, variant, splits), then per shape the base build at the launcher's
    splits, the fastest point, and SDPA's fastest backend and the copy."""
    lines = [f"{'shape':<22} {'variant':<16} {'splits':>6} {'keys':>6} {'us':>8} {'GB/s':>7} {'%copy':>6} "
             f"{'xSDPA':>6}  ok"]
    for info in shapes:
        name = f"B{info['B']} H{info['H']} Hk{info['Hk']} Lk{info['Lk']}"
        mine = [r for r in rows if (r["B"], r["Hk"], r["Lk"], r["D"]) == (info["B"], info["Hk"], info["Lk"], info["D"])]
        for r in mine:
            if "error" in r:
                lines.append(f"{name:<22} {r['variant']:<16} {r['splits']:>6} {r['keys_per_split']:>6}  ERROR "
                             f"{r['error']}")
                continue
            lines.append(f"{name:<22} {r['variant']:<16} {r['splits']:>5}{'*' if r['launcher_pick'] else ' '} "
                         f"{r['keys_per_split']:>6} {r['median_ms'] * 1e3:>8.1f} {r['gbps']:>7.0f} "
                         f"{100 * r['fraction_of_copy']:>5.0f}% {r['vs_sdpa_fastest']:>6.2f}  "
                         f"{'ok' if r['ok'] else 'MISMATCH'}")
        good = [r for r in mine if r["ok"]]
        base = [r for r in good if r["variant"] == "base" and r["launcher_pick"]]
        b = info["baselines_ms"]
        lines.append(f"  -> {name}: copy {b['copy'] * 1e3:.1f} us, {info['sdpa_fastest']} {b[info['sdpa_fastest']] * 1e3:.1f}"
                     f" us" + (f"; base at the launcher's {base[0]['splits']} splits {base[0]['median_ms'] * 1e3:.1f} us "
                               f"({100 * base[0]['fraction_of_copy']:.0f}% copy, {base[0]['vs_sdpa_fastest']:.2f}x)"
                               if base else ""))
        if good:
            best = min(good, key=lambda r: r["median_ms"])
            lines.append(f"     best: {best['variant']} at {best['splits']} splits: {best['median_ms'] * 1e3:.1f} us, "
                         f"{100 * best['fraction_of_copy']:.0f}% of copy, {best['vs_sdpa_fastest']:.2f}x SDPA's fastest")
    return "\n".join(lines)


def _build_flags_in_subprocess(flags: list) -> subprocess.Popen:
    code = ("import wb_kernels; from wb_kernels.stages.decode import build; "
            f"build.build(build.package_source(), flags={flags!r})")
    return subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def sdpa_growing_cache(steps: int = 40) -> list:
    """SDPA with a cache that grows by one key per call, as in a decode loop: host-clock ms per call."""
    import torch
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    out = []
    for B, H, Hk, D, start in ((1, 32, 8, 64, 1024), (16, 32, 8, 64, 1024)):
        q = torch.randn(B, H, 1, D, device="cuda", dtype=torch.float16)
        k = torch.randn(B, Hk, start + 2 * steps, D, device="cuda", dtype=torch.float16)
        v = torch.randn_like(k)
        for name, backends in (("sdpa", None), ("sdpa-flash", [SDPBackend.FLASH_ATTENTION])):
            for growing in (False, True):
                times = []
                for step in range(steps):
                    length = start + (step if growing else 0)
                    torch.cuda.synchronize()
                    t0 = time.perf_counter()
                    if backends is None:
                        F.scaled_dot_product_attention(q, k[:, :, :length], v[:, :, :length], enable_gqa=True)
                    else:
                        with sdpa_kernel(backends):
                            F.scaled_dot_product_attention(q, k[:, :, :length], v[:, :, :length], enable_gqa=True)
                    torch.cuda.synchronize()
                    times.append((time.perf_counter() - t0) * 1e3)
                out.append(dict(B=B, H=H, Hk=Hk, D=D, start=start, backend=name, growing=growing, steps=steps,
                                median_ms=round(statistics.median(times[1:]), 4), max_ms=round(max(times[1:]), 4)))
                print(f"sdpa growing={growing} {name} B{B}: median {out[-1]['median_ms']} ms per call "
                      f"(max {out[-1]['max_ms']})", file=sys.stderr)
    return out


TRACE_PHASES = ("entry", "loads_issued", "q_ready", "first_tile", "loop_end", "written", "merged")
# the phases each kernel stamps (the split kernel has no shared-memory q or tile)
KERNEL_TRACE_PHASES = {"mma": TRACE_PHASES, "split": ("entry", "loads_issued", "loop_end", "written", "merged")}
# (B, H, Hk, Lk, D, splits or None for the launcher's), float16 contiguous: the MQA bar shapes, a long MQA sequence
TRACE_SHAPES = ((8, 32, 1, 8192, 128, None), (1, 32, 1, 2048, 128, None), (1, 32, 1, 32768, 128, None),
                (8, 32, 4, 8192, 128, None))
# the split kernel's: the GQA-8 bar shapes (B, H, Hk, Lk, D, splits), each on a contiguous and a paged cache
SPLIT_TRACE_SHAPES = ((1, 32, 8, 32768, 128, None), (8, 32, 8, 8192, 128, None))
TRACE_PAGE_SIZE = 16


def _spread(values) -> list:
    ordered = sorted(float(v) for v in values)
    return [round(ordered[0], 2), round(ordered[len(ordered) // 2], 2), round(ordered[-1], 2)]


def _trace_problems(kernel: str):
    """(B, H, Hk, Lk, D, splits asked, paged) of the trace for `kernel`."""
    if kernel == "mma":
        return [shape + (False,) for shape in TRACE_SHAPES]
    return [shape + (paged,) for shape in SPLIT_TRACE_SHAPES for paged in (False, True)]


def measure_trace(kernel: str = "mma", variant=None, reps: int = 5) -> list:
    """Each of the kernel's trace problems: the trace build's stamps of its last call, as min / median / max over the
    blocks (`variant`: an MMA_VARIANTS build's knobs on top of the trace's; the mma kernel only)."""
    import torch

    from wb_kernels.inputs import paged_copy

    define = {"mma": "-DWB_DECODE_MMA_TRACE", "split": "-DWB_DECODE_SPLIT_TRACE"}[kernel]
    flags = (variant or MMA_VARIANTS[0]).flags(build_flags()) + [define]
    ext = build.build(build.package_source(), flags=flags)
    entry = ext.flash_decode_mma_forward if kernel == "mma" else ext.flash_decode_forward
    phases = KERNEL_TRACE_PHASES[kernel]
    stamped = [TRACE_PHASES.index(name) for name in phases]  # their words in a block's 16
    flush = torch.empty(256 * 2**20, dtype=torch.uint8, device="cuda")
    rows = []
    for B, H, Hk, L, D, asked, paged in _trace_problems(kernel):
        gen = torch.Generator(device="cuda").manual_seed(B * 7 + Hk + L + D)
        q = torch.randn(B, H, D, device="cuda", dtype=torch.float16, generator=gen)
        k, v = (torch.randn(B, Hk, L, D, device="cuda", dtype=torch.float16, generator=gen) for _ in range(2))
        lens = torch.full((B,), L, dtype=torch.int32, device="cuda")
        table = None
        if paged:  # pages of TRACE_PAGE_SIZE keys in a shuffled pool, as the decode benchmark's paged rows
            table = torch.randperm(B * L // TRACE_PAGE_SIZE, device="cuda", generator=gen).view(B, -1).int()
            k, v = paged_copy(k, table, TRACE_PAGE_SIZE), paged_copy(v, table, TRACE_PAGE_SIZE)
        keys, splits = cuda_launch_plan(torch.cuda.current_device(), B, H, Hk, L, asked, D, False, paged,
                                         kernel)[:2]
        blocks = B * Hk * splits * (cuda_row_chunks(H // Hk) if kernel == "split" else 1)
        status = torch.zeros(4 + 32 * blocks, dtype=torch.int32, device="cuda")  # the flags, then 16 int64 a block
        for _ in range(reps):
            flush.sum()
            status.zero_()
            entry(q, k, v, table, lens, status, keys, splits, D ** -0.5)
            torch.cuda.synchronize()
        stamps = status[4:].view(torch.int64).view(blocks, 16).cpu().double()
        times, cycles = stamps[:, stamped], stamps[:, [8 + i for i in stamped]]
        from_first = (times - times[:, :1].min()) / 1e3
        own = cycles - cycles[:, :1]
        merging = stamps[:, 6] > 0  # "merged": only the blocks that ran the fused merge stamp it
        written = phases.index("written")
        ghz = float(((cycles[:, written] - cycles[:, 0]) / (times[:, written] - times[:, 0]).clamp(min=1)).median())
        shown = [(i, name) for i, name in enumerate(phases) if name != "merged" or merging.any()]
        row = dict(B=B, H=H, Hk=Hk, Lk=L, D=D, kernel=kernel, layout="paged" if paged else "contiguous",
                   splits=splits, keys_per_split=keys, blocks=blocks, sm_ghz=round(ghz, 3),
                   sms_used=len(set(stamps[:, 7].long().tolist())), status=int(status[0]),
                   merging_blocks=int(merging.sum()),
                   span_us=round(float(from_first[:, shown[-1][0]].max()), 2),
                   us_from_first_entry={name: _spread(from_first[merging if name == "merged" else slice(None), i])
                                        for i, name in shown},
                   cycles_from_own_entry={name: _spread(own[merging if name == "merged" else slice(None), i])
                                          for i, name in shown})
        rows.append(row)
        print(f"{kernel} B{B} H{H} Hk{Hk} Lk{L} D{D} {row['layout']}, {splits} splits of {keys} keys: span "
              f"{row['span_us']} us at {row['sm_ghz']} GHz on {row['sms_used']} SMs", file=sys.stderr)
        for name in row["cycles_from_own_entry"]:
            print(f"   {name:13s} cycles from the block's entry (min/median/max) {row['cycles_from_own_entry'][name]}; "
                  f"us from the first block's entry {row['us_from_first_entry'][name]}", file=sys.stderr)
    return rows


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", type=Path, default=None, help="where to write the results (default: print only)")
    parser.add_argument("--quick", action="store_true", help="the default and one other variant, the bar shapes")
    parser.add_argument("--reps", type=int, default=50, help="timed calls per point (median)")
    parser.add_argument("--mma-threshold", action="store_true",
                        help="time the split and the mma kernel on groups 1-32 instead (launcher.MMA_MIN_GROUP)")
    parser.add_argument("--mma-sweep", action="store_true",
                        help="A/B the mma kernel's builds (MMA_VARIANTS) and split counts at MMA_SWEEP_SHAPES")
    parser.add_argument("--mma-sweep-child", metavar="VARIANT", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--mma-trace", action="store_true",
                        help="the mma kernel's per-block timeline (a WB_DECODE_MMA_TRACE build) at TRACE_SHAPES")
    parser.add_argument("--split-trace", action="store_true",
                        help="the split kernel's per-block timeline (a WB_DECODE_SPLIT_TRACE build) at the GQA-8 bar "
                             "shapes, contiguous and paged")
    parser.add_argument("--mma-variants", default=None,
                        help="with --mma-sweep: comma-separated names of MMA_VARIANTS (default: all); with "
                             "--mma-trace: the builds to trace (default: base)")
    args = parser.parse_args(argv)
    if args.mma_trace and args.split_trace:
        parser.error("--mma-trace and --split-trace: one trace per run (each writes its own --json file)")
    if args.mma_variants is not None:
        known = {v.name: v for v in MMA_VARIANTS}
        unknown = [n for n in args.mma_variants.split(",") if n not in known]
        if unknown:
            parser.error(f"--mma-variants: unknown {unknown}; known: {sorted(known)}")
    if not wb_kernels.BACKEND.is_gpu:
        print("tune.py times the CUDA C++ kernel: it needs a CUDA GPU", file=sys.stderr)
        return 2
    import torch

    from wb_kernels.results_files import environment

    if args.mma_sweep_child is not None:  # one variant, in a process of its own (measure_mma_sweep)
        variant = {v.name: v for v in MMA_VARIANTS}[args.mma_sweep_child]
        rows, shapes = measure_mma_variant(variant, args.reps)
        _write(dict(records=rows, shapes=shapes), args.json)
        return 0

    if args.mma_trace or args.split_trace:
        kernel = "mma" if args.mma_trace else "split"
        chosen = (args.mma_variants or "base").split(",") if kernel == "mma" else ["base"]
        rows = [dict(row, variant=name) for name in chosen
                for row in measure_trace(kernel, {v.name: v for v in MMA_VARIANTS}[name])]
        define = "WB_DECODE_MMA_TRACE" if kernel == "mma" else "WB_DECODE_SPLIT_TRACE"
        entry = "flash_decode_mma_forward" if kernel == "mma" else "flash_decode_forward"
        result = dict(kind=f"decode_{kernel}_trace", environment=environment(),
                      command=" ".join(["python -m wb_kernels.stages.decode.tune"] + (argv or sys.argv[1:])),
                      notes=dict(stamps="thread 0 of each block: %globaltimer (ns) and clock64 at " +
                                        ", ".join(KERNEL_TRACE_PHASES[kernel]) + f" (decode_host.cu, {define})",
                                 call=f"the 5th of 5 calls of {entry} at the launcher's splits, "
                                      "each after the L2 was flushed by reading 256 MB; a merge kernel that "
                                      "follows is not stamped",
                                 spread="[min, median, max] over the grid's blocks"),
                      records=rows)
        _write(result, args.json)
        return 0

    if args.mma_sweep:
        variants = (MMA_VARIANTS if args.mma_variants is None
                    else tuple(v for v in MMA_VARIANTS if v.name in args.mma_variants.split(",")))
        reps = min(args.reps, 30)  # ~12 ms a point: the whole sweep stays within a couple of minutes
        rows, shapes, failed = measure_mma_sweep(variants, reps)
        print(mma_sweep_table(rows, shapes), file=sys.stderr)
        result = dict(kind="decode_tune_mma_sweep", environment=environment(),
                      command=" ".join(["python -m wb_kernels.stages.decode.tune"] + (argv or sys.argv[1:])),
                      notes=dict(timing=f"bare flash_decode_mma_forward call, CUDA events, median of {reps}, a "
                                        f"{DECODE_TIMING['hold_us']:.0f} us hold then the L2 flushed by reading",
                                 check="output against float32 SDPA (max abs < 2e-2) and LSE against float32 "
                                       "logsumexp (< 1e-2), no status flag",
                                 fraction_of_copy="(K and V bytes / time) over the copy's (read + write bytes / time)",
                                 variants={v.name: dict(v.defines) for v in variants}),
                      failed_builds=failed, shapes=shapes, records=rows)
        _write(result, args.json)
        bad = [r for r in rows if not r["ok"]]
        if bad or failed:
            print(f"MISMATCH or failed build: {len(bad)} points, builds {sorted(failed)}", file=sys.stderr)
            return 1
        return 0

    if args.mma_threshold:
        rows = measure_mma_threshold(args.reps)
        threshold = smallest_winning_group(rows)
        print(f"the mma kernel is faster at every shape from group {threshold} on", file=sys.stderr)
        result = dict(kind="decode_tune_mma", environment=environment(),
                      command=" ".join(["python -m wb_kernels.stages.decode.tune"] + (argv or sys.argv[1:])),
                      notes=dict(timing=f"as the default mode: device time, median of {args.reps}, L2 flushed by "
                                        "reading", shapes="H = 32 on Hk = 32 / group (group 5: H = 40 on Hk = 8), "
                                        "float16, contiguous cache, each kernel at the launcher's splits for it"),
                      smallest_winning_group=threshold, records=rows)
        _write(result, args.json)
        return 0

    variants = VARIANTS[:2] if args.quick else VARIANTS
    workloads = WORKLOADS[:2] if args.quick else WORKLOADS
    rows, failed = measure(variants, workloads, args.reps)
    growing = sdpa_growing_cache()
    result = dict(kind="decode_tune", environment=environment(), command=" ".join(["python -m wb_kernels.stages.decode.tune"] + (argv or sys.argv[1:])),
                  sms=torch.cuda.get_device_properties(0).multi_processor_count,
                  notes=dict(timing="bare extension call (split + merge kernels, buffers), CUDA events, median of "
                                    f"{args.reps}, device time as the decode benchmark measures it: a "
                                    f"{DECODE_TIMING['hold_us']:.0f} us sleeping kernel, then the L2 flushed by "
                                    "reading, before each call",
                             write_flush="*_write_flush: the default variant at the launcher's number of splits and "
                                         "the baselines with the L2 flushed by zeroing (left dirty), as tuning runs "
                                         "before 2026-11-24 were timed",
                             fraction_of_copy="(K and V bytes / time) over the copy's (read + write bytes / time)"),
                  failed_builds=failed, records=rows, sdpa_growing_cache=growing)
    _write(result, args.json)
    return 0


def _write(result: dict, path) -> None:
    if path:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(result, indent=1) + "\n")
        print(f"wrote {path}", file=sys.stderr)


if __name__ == "__main__":
    sys.exit(main())
