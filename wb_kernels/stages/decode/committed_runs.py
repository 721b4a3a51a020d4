"""The committed GPU runs lesson 07 reads, and what it reads from them: the benchmark's GPU (SMs, copy bandwidth,
fp16 peak), the decode kernel's tuning run, the decode benchmark's rows and the decode-bar runs, the decoder's tokens
per second (``results/decode/decoder_<gpu>.json``, written by ``python -m wb_kernels.bench.decoder_tokens``) as a
table (:func:`decoder_table`, which the README's decoder section uses too), and each run's copy bandwidth.

Reading only: the files are read with :mod:`wb_kernels.results_files`, not through the benchmark that wrote them
(a rung does not import the benchmark). ``tests/test_decode.py`` calls these on the committed files.
"""

from __future__ import annotations

import math
from pathlib import Path

from ...results_files import (REPO_ROOT, committed_decode_results, committed_results, load_results,
                               newest_matching)
from .costs import row_chunks

__all__ = ["committed_gpu", "committed_tune_results", "describe_tune_run", "NO_DECODER_RUN",
           "committed_decoder_results", "decoder_table", "describe_decoder_run", "implied_block_overhead_keys",
           "decode_bench_rows", "OLDER_KERNEL", "BEFORE_PAGED_FIX", "PAGED_FIX", "committed_decode_bar_results",
           "copy_bandwidths", "decoder_speedups"]


def committed_gpu(path=None) -> dict | None:
    """The GPU of the committed benchmark run (``results/bench/``, or `path`): its name, date, SM count, copy
    bandwidth and fp16 matrix-multiply peak as that run measured them. None where no GPU run is committed."""
    path = path or committed_results("gpu")
    if path is None:
        return None
    results = load_results(path)
    env, ceilings = results["environment"], results.get("ceilings") or {}
    return {"gpu": env["gpu"], "date": env["date"][:10], "sm_count": env["sm_count"],
            "copy_gbps": ceilings.get("copy_gbps"), "float16_tflops": ceilings.get("float16_matmul_tflops"),
            "file": Path(path).name}


def committed_tune_results(folder=None):
    """The committed tuning run of the CUDA decode kernel (``results/decode/tune_<gpu>.json``), or None."""
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
                  "`python -m wb_kernels.bench.decoder_tokens`)")


def committed_decoder_results(folder=None):
    """The newest committed GPU run of the decoder's tokens per second (``results/decode/decoder_*.json``, written by
    ``python -m wb_kernels.bench.decoder_tokens``), by the date it records; None while there is none. Smoke runs and
    files that are not such runs (unreadable, another kind) are passed over."""
    import json

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
    """A results file of ``wb_kernels/bench/decoder_tokens.py`` as text: where and how it ran, one line per row (model, batch, context, cache
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
    folder = Path(folder) if folder is not None else REPO_ROOT / "results" / "decode" / "history"
    return newest_matching(folder, "bench_decode_bar_*.json",
                           lambda data: (data.get("environment") or {}).get("backend") == "gpu")


def copy_bandwidths() -> dict:
    """The copy bandwidth of every committed GPU run the lesson reads, {file: (GPU, date, GB/s)}: each run measures
    its own device-to-device copy, and each comparison uses its own run's."""
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
