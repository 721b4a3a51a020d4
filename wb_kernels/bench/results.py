"""The benchmark's results file (the dashboard lesson, lesson 03's speed-ups, the README's performance table).

One JSON file per run under ``results/bench/``: the environment it ran in (:func:`environment`),
the roofline's ceilings, the honesty demonstrations and one record per measurement. Written
atomically after every measurement (:func:`save_results`), so a run cut short can be resumed.
Also the newest committed file (:func:`committed_results`) and the README table built from it. The decode
presets' files (``"kind": "decode"``, under ``results/decode/``) have a README table of their own
(:func:`decode_readme_table`). Reading and writing a file, the record of where it was measured and the newest
committed one are :mod:`wb_kernels.results_files`' (rungs' scripts use them too); this module re-exports them.
"""

from __future__ import annotations

import datetime as _dt
from pathlib import Path
from typing import Optional

from ..results_files import (REPO_ROOT, committed_decode_results, committed_results, environment, fill_block,
                             git_commit, load_results, round_significant, save_results, shown_path)
from ..stages import available_stages
from ..timing import EVENTS_AROUND_CALL, TimingMethod
from .sweeps import BASELINES, PUBLIC_CONFIGS, Config, Refused, record_key

__all__ = ["SCHEMA_VERSION", "REPO_ROOT", "RESULTS_DIR", "README_START", "README_END", "README_BASELINES",
           "environment", "git_commit", "load_results", "save_results", "add_speedups", "new_results", "default_output",
           "committed_results",
           "readme_table", "decode_readme_table", "decode_bar_lines", "rung_bar_table", "update_readme",
           "committed_decode_results",
           "README_DECODE_START", "README_DECODE_END", "README_DECODE_VIEW", "README_DECODE_BAR_START",
           "README_DECODE_BAR_END", "timing_method", "same_timing",
           "MixedTiming"]

SCHEMA_VERSION = 1
RESULTS_DIR = REPO_ROOT / "results" / "bench"  # one JSON per benchmark run; other results/ files are not ours
README_START = "<!-- perf-table:start -->"
README_END = "<!-- perf-table:end -->"
# The baselines the README's table sets beside the stages: PyTorch's default and its FlashAttention-2 backend,
# FlexAttention (what a PyTorch user compiles instead), and the flash-attn package itself.
README_BASELINES = ("sdpa", "sdpa-flash", "flex", "flash_attn", "flashinfer-fa2", "flashinfer-fa3")
README_DECODE_START = "<!-- perf-table-decode:start -->"
README_DECODE_END = "<!-- perf-table-decode:end -->"
# The decode table's rows: the bar's setting (GQA with 4 query heads per KV head, fp16, D = 128) at every B and Lk.
README_DECODE_VIEW = {"dtype": "float16", "D": 128, "H": 32, "Hk": 8}
# The same table from the newest decode-bar run (results/decode/history/): the kernels as they are now, at B = 1 and 8,
# beside the full decode preset's table above it, whose run is older and longer (B = 64 too)
README_DECODE_BAR_START = "<!-- perf-table-decode-bar:start -->"
README_DECODE_BAR_END = "<!-- perf-table-decode-bar:end -->"


def add_speedups(results: dict) -> dict:
    """For every timed record: ``speedup_vs[baseline]`` = baseline's median / this median (>1: faster)."""
    timed = {}
    for r in results["records"]:
        if r.get("status") == "ok":
            timed.setdefault(r["key"].split("|", 1)[1], {})[r["contender"]] = r
    for group in timed.values():
        baselines = {name: r for name, r in group.items() if r["kind"] == "baseline"}
        for r in group.values():
            r["speedup_vs"] = {name: round_significant(b["median_ms"] / r["median_ms"], 4)
                               for name, b in baselines.items() if name != r["contender"]}
    return results


def new_results(presets, command=None) -> dict:
    return {"schema": SCHEMA_VERSION, "environment": environment(), "presets": list(presets), "command": command,
            "ceilings": None, "honesty": None, "unavailable": {}, "records": []}


def default_output(kind: str) -> Path:
    if kind == "cuda":
        import torch

        slug = "".join(c if c.isalnum() else "-" for c in torch.cuda.get_device_name(0).lower()).strip("-")
        slug = "-".join(part for part in slug.split("-") if part and part != "nvidia")
        return RESULTS_DIR / f"{slug}_{_dt.date.today().isoformat()}.json"
    return RESULTS_DIR / "simulator_smoke.json"


# ----------------------------------------------------------------------------------------------
# How a file was timed, and which files may be compared
# ----------------------------------------------------------------------------------------------

class MixedTiming(Refused):
    """Files (or the records of one file) timed in different ways were about to be set side by side."""


def timing_method(results: dict) -> Optional[TimingMethod]:
    """How a results file's GPU records were timed: its ``"timing"`` entry (files written since every preset times with
    :data:`wb_kernels.timing.DEVICE_TIME`), else what its records say (``l2_flush_mode``, ``hold_us``; records
    that name neither were timed with events around the call after a zeroing flush, the method before 2026-11-24).
    None for a file with no GPU timing (the simulator's host clock). Raises :class:`MixedTiming` when its records
    disagree."""
    if (results.get("environment") or {}).get("backend") != "gpu":
        return None
    if results.get("timing"):
        return TimingMethod.from_record(results["timing"])
    found = set()
    for r in results.get("records", []):
        if r.get("status") != "ok" or r.get("device", "cuda") != "cuda" or r.get("median_ms") is None:
            continue
        if "l2_flush_mode" in r or "hold_us" in r:
            found.add(TimingMethod(flush_l2=r.get("l2_flush_mode") is not None,
                                   flush_mode=r.get("l2_flush_mode") or "write", hold_us=float(r.get("hold_us") or 0)))
        else:
            found.add(EVENTS_AROUND_CALL if r.get("l2_flushed", True) else
                      TimingMethod(flush_l2=False, flush_mode="write", hold_us=0.0))
    if len(found) > 1:
        raise MixedTiming("the file's records were timed in " + " and ".join(sorted(m.label() for m in found)))
    return found.pop() if found else None


def same_timing(files: dict) -> TimingMethod:
    """The one timing method `files` ({name: results}) share, so that their numbers may go into one comparison;
    raises :class:`MixedTiming`, saying how each was timed, when they were timed differently, on different GPUs, or
    (more than one file) with the host's launch time in the timed window: that part depends on what the host was
    doing in that run, so it is comparable within one file only."""
    methods = {name: timing_method(results) for name, results in files.items()}
    gpus = {name: (results.get("environment") or {}).get("gpu") for name, results in files.items()}
    problems = []
    if any(method is None for method in methods.values()):
        problems.append("no GPU timing in " + ", ".join(n for n, m in methods.items() if m is None))
    elif len(set(methods.values())) > 1:
        problems.append("timed differently: " + "; ".join(f"{n}: {m.label()}" for n, m in methods.items()))
    elif len(files) > 1 and not next(iter(methods.values())).device_time:
        problems.append("host time in the timed window (no sleeping kernel first) is comparable within one run only: "
                        + ", ".join(methods))
    if len(set(gpus.values())) > 1:
        problems.append("different GPUs: " + "; ".join(f"{n}: {g}" for n, g in gpus.items()))
    if problems:
        raise MixedTiming("; ".join(problems))
    return next(iter(methods.values()))


def _timing_words(results: dict) -> str:
    method = timing_method(results)
    return "the median of " + (method.words() if method else "host-clock timings (no GPU)")


# ----------------------------------------------------------------------------------------------
# README table
# ----------------------------------------------------------------------------------------------

def _timed_stages(records) -> list:
    """The stages a results file timed, in ladder order: the registered ones first, then any the file holds that
    this checkout does not register (a file from a branch with a newer rung still shows it)."""
    registered = [name for name in available_stages() if name != "reference"]
    seen = [r["contender"] for r in records if r.get("kind") == "stage" and r["contender"] != "reference"]
    return registered + [name for name in dict.fromkeys(seen) if name not in registered]


def readme_table(results: dict, source: str | None = None) -> str:
    """The README's performance table (Markdown) from a GPU results file: the public configurations,
    fp16, causal and not; median ms and TFLOP/s of each stage and of the main baselines. A column appears
    when the file timed that contender at one of them, a row when the file timed anything there."""
    env = results["environment"]
    columns = _timed_stages(results["records"]) + [name for name in BASELINES if name in README_BASELINES]
    by_key = {r["key"]: r for r in results["records"]}
    public = [Config(B, H, L, D, "float16", causal) for causal in (False, True) for (B, H, L, D) in PUBLIC_CONFIGS]
    present = [c for c in columns
               if any(by_key.get(record_key(c, config), {}).get("status") == "ok" for config in public)]
    public = [config for config in public
              if any(by_key.get(record_key(c, config), {}).get("status") == "ok" for c in present)]
    top = next((name for name in reversed(present) if name not in BASELINES), None)  # the highest rung shown
    lines = [_measured_on(env, source) + f". Timed as: {_timing_words(results)}. fp16, median ms (TFLOP/s); a "
             "dash: not run or does not support the configuration."
             + (f" ×best peer: the fastest baseline's time on the row (any the file timed: SDPA's backends, "
                f"FlexAttention, FlashInfer, ...) over {top}'s, and which it was (>1: {top} is faster)." if top else ""),
             "", "| B | H | L | D | causal | " + " | ".join(present) + (f" | {top} ×best peer" if top else "") + " |",
             "|---:|---:|---:|---:|:---:|" + "---:|" * (len(present) + (1 if top else 0))]
    for config in public:
        cells = []
        for name in present:
            r = by_key.get(record_key(name, config))
            cells.append(f"{r['median_ms']:.3g} ({r['tflops']:.0f}){' †' if r.get('check_failed') else ''}"
                         if r and r.get("status") == "ok" else "–")
        if top:
            cells.append(_best_peer_cell(by_key, config, top))
        lines.append(f"| {config.B} | {config.H} | {config.L} | {config.D} | {'yes' if config.causal else 'no'} | "
                     + " | ".join(cells) + " |")
    if any("†" in line for line in lines):
        lines += ["", "† outside the check tolerance (2x PyTorch's error in the same precision); timed anyway."]
    return "\n".join(lines)


def best_peer(by_key: dict, config: Config, name: str) -> Optional[tuple]:
    """(the fastest baseline on `config` whose output passed the check, its median over `name`'s), from `name`'s
    record's ``speedup_vs`` (:func:`add_speedups`); None when `name` or no such baseline was timed there."""
    ours = by_key.get(record_key(name, config))
    if not ours or ours.get("status") != "ok":
        return None
    ratios = {peer: ratio for peer, ratio in (ours.get("speedup_vs") or {}).items()
              if (by_key.get(record_key(peer, config)) or {}).get("kind") == "baseline"
              and not by_key[record_key(peer, config)].get("check_failed")}
    if not ratios:
        return None
    peer = min(ratios, key=ratios.get)
    return peer, ratios[peer]


def _best_peer_cell(by_key: dict, config: Config, name: str) -> str:
    found = best_peer(by_key, config, name)
    return "–" if found is None else f"{found[1]:.2f} ({found[0]})"


def _measured_on(env: dict, source: Optional[str]) -> str:
    return (f"Measured on {env.get('gpu') or env.get('device')} (CUDA {env.get('cuda')}, torch {env.get('torch')}, "
            f"driver {env.get('driver')}) on {env.get('date', '')[:10]}" + (f", from `{source}`" if source else ""))


def _gbps_cell(r: Optional[dict], with_backend: bool = False) -> str:
    """A decode record as "GB/s (fraction of the copy)", † when it was timed outside the check tolerance."""
    if not r or r.get("status") != "ok":
        return "–"
    fraction = r.get("fraction_of_copy")
    text = f"{r['gbps']:.0f}" + (f" ({fraction:.2f})" if fraction is not None else "")
    if with_backend:
        names = {"flashinfer": "CUDA cores", "flashinfer-tc": "tensor cores"}
        text += " " + names.get(r["contender"], r["contender"].replace("sdpa-", "").replace("sdpa", "default"))
    return text + (" †" if r.get("check_failed") else "")


def _peer_cell(*ours) -> str:
    """wb.decode's ×best peer (its faster layout): "ratio (peer)", or a dash."""
    timed = [r for r in ours if r and r.get("status") == "ok" and r.get("vs_best_peer")]
    if not timed:
        return "–"
    fastest = max(timed, key=lambda r: r["vs_best_peer"]["ratio"])
    return f"{fastest['vs_best_peer']['ratio']:.2f} ({fastest['vs_best_peer']['peer']})"


def _decode_timing_words(results: dict) -> str:
    """How a decode file's rows were timed, in the README's words (:func:`timing_method`)."""
    return _timing_words(results)


def _decode_rows_elsewhere(results: dict, view: dict) -> str:
    """"; other Hk, bf16 and D = 64 are in the file": what the file timed outside the table's view (lessons 07 and
    11 show the full preset's table with this phrase in its caption)."""
    records = [r for r in results["records"] if "Hk" in r]
    short = {"bfloat16": "bf16", "float32": "fp32", "float16": "fp16"}
    found = (["other Hk"] if any(r["Hk"] != view["Hk"] for r in records) else []) + [
        short.get(d, d) for d in sorted({r["dtype"] for r in records} - {view["dtype"]})] + [
        f"D = {d}" for d in sorted({r["D"] for r in records} - {view["D"]})]
    if not found:
        return ""
    return "; " + (", ".join(found[:-1]) + " and " if len(found) > 1 else "") + found[-1] + " are in the file"


def decode_readme_table(results: dict, source: str | None = None) -> str:
    """The README's decode table (Markdown) from a decode results file: at :data:`README_DECODE_VIEW`, one row per
    (B, Lk) the file timed, GB/s and fraction of the copy ceiling of wb.decode (contiguous and paged), of its kernel
    path alone, of the fastest SDPA backend and of FlexAttention, and wb.decode's speed over that SDPA backend; then
    the per-call overhead rows."""
    from .sweeps import DECODE_BAR

    view = README_DECODE_VIEW
    records = [r for r in results["records"] if all(r.get(name) == value for name, value in view.items())]
    by = {(r["contender"], r["layout"], r["B"], r["Lk"]): r for r in records}
    shapes = sorted({(r["B"], r["Lk"]) for r in records if r.get("status") == "ok"})
    bar = {(B, Lk) for B, H, Hk, Lk, D, dtype in DECODE_BAR
           if (H, Hk, D, dtype) == (view["H"], view["Hk"], view["D"], view["dtype"])}
    lines = [_measured_on(results["environment"], source) + f", commit {results['environment'].get('git_commit')}. "
             f"Decode: one new query per sequence, H = {view['H']} query heads on Hk = {view['Hk']} KV heads, "
             f"D = {view['D']}, {view['dtype']}, every sequence Lk keys. GB/s: K and V read once "
             f"(2·B·Hk·Lk·D·2 bytes) over {_decode_timing_words(results)}; in "
             "parentheses the fraction of the copy ceiling, a device-to-device copy of the same bytes in the same run counting what it reads and "
             "writes. wb.decode: the user's call (what it runs on the device; its host work is in the per-call rows below); decode_forward: its launcher and kernels "
             "alone; paged: pages of 16 keys with a shuffled block table (SDPA and FlexAttention read the same "
             "numbers contiguous). ×SDPA: the fastest SDPA backend's time over wb.decode's (>1: wb.decode is "
             "faster). FlashInfer, paged: the faster of FlashInfer's two decode kernels (CUDA cores, tensor cores: "
             "flashinfer, flashinfer-tc) on the same paged cache as wb.decode, paged. ×best peer: the fastest peer's "
             "time (SDPA's backends, FlexAttention, FlashInfer, any layout) over wb.decode's (the faster of its two "
             "layouts), and which peer. Bold: the bar's shapes. A dash: not run or refused (the file says why)"
             + _decode_rows_elsewhere(results, view) + ".",
             "", "| B | Lk | copy GB/s | wb.decode | decode_forward | wb.decode, paged | best SDPA | ×SDPA | "
                 "×SDPA, paged | flex | FlashInfer, paged | ×best peer |",
             "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for B, Lk in shapes:
        def get(name, layout="contiguous"):
            return by.get((name, layout, B, Lk))

        def ratio(r):
            vs = (r or {}).get("vs_best_sdpa") if (r or {}).get("status") == "ok" else None
            return f"{vs['ratio']:.2f}" if vs else "–"

        ours, paged = get("wb.decode"), get("wb.decode", "paged")
        best = next((r["vs_best_sdpa"]["backend"] for r in records
                     if (r["B"], r["Lk"]) == (B, Lk) and r.get("vs_best_sdpa")), None)
        copy = get("copy")
        timed = [r for r in (get("flashinfer", "paged"), get("flashinfer-tc", "paged"))
                 if r and r.get("status") == "ok"]
        flashinfer = max(timed, key=lambda r: r["gbps"]) if timed else None
        cells = [f"{copy['gbps']:.0f}" if copy and copy.get("status") == "ok" else "–", _gbps_cell(ours),
                 _gbps_cell(get("decode_forward")), _gbps_cell(paged),
                 _gbps_cell(get(best), with_backend=True) if best else "–", ratio(ours), ratio(paged),
                 _gbps_cell(get("flex")), _gbps_cell(flashinfer, with_backend=True) if flashinfer else "–",
                 _peer_cell(ours, paged)]
        shape = [f"**{B}**", f"**{Lk}**"] if (B, Lk) in bar else [str(B), str(Lk)]
        lines.append("| " + " | ".join(shape + cells) + " |")
    if any("†" in line for line in lines[2:]):
        lines += ["", "† outside the check tolerance (2x PyTorch's error in the same precision); timed anyway."]
    rows = ((results.get("overhead") or {}).get("rows")) or []
    if rows:
        lines += ["", "Per-call wall time of back-to-back calls (median of batches; the bar: at most 2x SDPA's on the "
                      "same problem):", "", "| call | problem | µs per call | SDPA µs | ×SDPA |",
                  "|:---|:---|---:|---:|---:|"]
        for row in rows:
            if row["name"] == "sdpa":
                continue
            if row.get("status") != "ok":
                lines.append(f"| {row['name']} | {row['problem']} | {row['status']} | – | – |")
                continue
            verdict = "" if row.get("meets_bar") is None else (" ✓" if row["meets_bar"] else " ✗")
            lines.append(f"| {row['name']} | {row['problem']} | {row['per_call_us']:.1f} | "
                         + (f"{row['sdpa_per_call_us']:.1f} | {row['ratio_to_sdpa']:.2f}{verdict} |"
                            if row.get("sdpa_per_call_us") else "– | – |"))
    return "\n".join(lines)


def decode_bar_lines(results: dict) -> list:
    """Lines on lesson 07's bar from a decode benchmark file: at each bar shape (sweeps.DECODE_BAR) and layout,
    wb.decode's fraction of the copy ceiling against the bar (DECODE_BAR_FRACTION) and the goal
    (DECODE_GOAL_FRACTION), and its speed over the fastest SDPA backend of the same run."""
    from .sweeps import DECODE_BAR, DECODE_BAR_FRACTION, DECODE_GOAL_FRACTION

    lines = [f"{results['environment'].get('gpu')}, {str(results['environment'].get('date', ''))[:10]}: wb.decode "
             f"as called; the bar {DECODE_BAR_FRACTION:.0%} of the copy ceiling, the goal {DECODE_GOAL_FRACTION:.0%} "
             "and faster than every SDPA backend"]
    for B, H, Hk, Lk, D, dtype in DECODE_BAR:
        for layout in ("contiguous", "paged"):
            r = next((r for r in results["records"] if r.get("contender") == "wb.decode" and r.get("layout") == layout
                      and (r["B"], r["H"], r["Hk"], r["Lk"], r["D"], r["dtype"]) == (B, H, Hk, Lk, D, dtype)), None)
            shape = f"B{B} H{H} Hk{Hk} Lk{Lk} D{D} {dtype}, {layout}:"
            if r is None or r.get("status") != "ok" or r.get("fraction_of_copy") is None:
                lines.append(f"{shape:45s} not measured" + (f" ({r.get('reason')})" if r and r.get("reason") else ""))
                continue
            fraction, sdpa = r["fraction_of_copy"], (r.get("vs_best_sdpa") or {})
            faster = bool(sdpa) and sdpa["ratio"] >= 1  # the goal asks for both: its fraction and every SDPA beaten
            verdict = ("goal met" if fraction >= DECODE_GOAL_FRACTION and faster
                       else "bar met, the goal's fraction too" if fraction >= DECODE_GOAL_FRACTION
                       else "bar met" if fraction >= DECODE_BAR_FRACTION
                       else f"bar missed by {DECODE_BAR_FRACTION - fraction:.1%}")
            vs = f"{sdpa['ratio']:.2f}x the fastest SDPA ({sdpa['backend']})" if sdpa else "no SDPA in the run"
            lines.append(f"{shape:45s} {fraction:6.1%} of copy: {verdict}; {vs}")
    return lines


def rung_bar_table(results: dict, sweep, *, reference: str = "sdpa-cudnn",
                   peers: tuple = ("sdpa-cudnn", "flashinfer-fa3")) -> str:
    """A rung preset's run (``hopper-bar``: sweeps.RUNG_PRESETS) as Markdown, one row per problem of `sweep`: every
    contender's TFLOP/s, and the rung's (the sweep's first contender) speed over `reference`'s and over the faster
    of `peers`, all from the same run (>1: the rung is faster). A row appears when anything was timed there."""
    ours = sweep.contenders[0]
    by_key = {r["key"]: r for r in results["records"]}
    lines = [_measured_on(results["environment"], None) + f". Timed as: {_timing_words(results)}. TFLOP/s "
             f"(4 B H L² D, halved for causal); a dash: not run, skipped or failed its check; †: outside the check "
             f"tolerance, timed anyway. ×{reference}: {reference}'s median over {ours}'s; ×best: the fastest of "
             f"{', '.join(peers)} over {ours}'s, and which it was (>1: {ours} is faster).", "",
             "| dtype | D | causal | B | H | Hk | L | " + " | ".join(sweep.contenders)
             + f" | {ours} ×{reference} | {ours} ×best |",
             "|---|---:|:---:|---:|---:|---:|---:|" + "---:|" * (len(sweep.contenders) + 2)]
    for config in sweep.configs:
        timed = {name: by_key.get(record_key(name, config)) for name in sweep.contenders}
        timed = {name: r for name, r in timed.items() if r and r.get("status") == "ok"}
        if not timed:
            continue
        cells = [f"{timed[name]['tflops']:.0f}{' †' if timed[name].get('check_failed') else ''}" if name in timed
                 else "–" for name in sweep.contenders]
        ratios = (timed[ours].get("speedup_vs") or {}) if ours in timed else {}
        against = {peer: ratios[peer] for peer in peers
                   if peer in ratios and not by_key[record_key(peer, config)].get("check_failed")}
        best = min(against, key=against.get) if against else None
        cells += [f"{ratios[reference]:.2f}" if reference in ratios else "–",
                  f"{against[best]:.2f} ({best})" if best else "–"]
        lines.append(f"| {config.dtype} | {config.D} | {'yes' if config.causal else 'no'} | {config.B} | {config.H} | "
                     f"{config.kv_heads} | {config.L} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


README_MMA_START = "<!-- perf-table-mma:start -->"
README_MMA_END = "<!-- perf-table-mma:end -->"
README_HOPPER_START = "<!-- perf-table-hopper:start -->"
README_HOPPER_END = "<!-- perf-table-hopper:end -->"


def hopper_readme_table(results: dict, source: str | None = None) -> str:
    """The README's table of the hopper rung's bar (the ``hopper-bar`` preset's own file): :func:`rung_bar_table`
    of its one sweep, under the name of the file it came from."""
    from .sweeps import PRESETS

    (sweep,) = PRESETS["hopper-bar"]
    table = rung_bar_table(results, sweep)
    return table if source is None else f"From `{source}`. " + table


def _readme_blocks(results: dict) -> list:
    """The README's blocks a results file fills, as (start marker, end marker, render): the decode table (a file of
    the decode presets), or its twin for the decode-bar preset's runs; the hopper rung's table (a file of its hopper-bar preset); else the ladder's table, and the mma table too when the file holds the ``mma`` preset (a
    file of that preset alone fills only the mma table). One file filling both: both tables timed the same way."""
    presets = results.get("presets") or []
    if results.get("kind") == "decode" and presets == ["decode-bar"]:
        return [(README_DECODE_BAR_START, README_DECODE_BAR_END, decode_readme_table)]
    if results.get("kind") == "decode":
        return [(README_DECODE_START, README_DECODE_END, decode_readme_table)]
    if presets == ["mma"]:
        return [(README_MMA_START, README_MMA_END, readme_table)]
    if presets == ["hopper-bar"]:
        return [(README_HOPPER_START, README_HOPPER_END, hopper_readme_table)]
    blocks = [(README_START, README_END, readme_table)]
    if "mma" in presets:
        blocks.append((README_MMA_START, README_MMA_END, readme_table))
    return blocks


def update_readme(results_path, readme=REPO_ROOT / "README.md") -> Path:
    """Rewrite the README blocks that `results_path` fills (:func:`_readme_blocks`). Each table's caption says how
    its file was timed (:func:`timing_method`), so tables timed differently are labelled so."""
    results = load_results(results_path)
    source = shown_path(results_path, REPO_ROOT)
    for start, end, render in _readme_blocks(results):
        fill_block(readme, start, end, render(results, source=source), error=Refused)
    return Path(readme)
