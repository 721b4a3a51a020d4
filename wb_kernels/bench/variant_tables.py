"""The variants benchmark's results read back (lesson 11_triton, the README): the table of TFLOP/s and ratios to
FlexAttention and SDPA for one problem, the issue's bars (:data:`BARS`) and their verdicts, the window sweep, the
peak memory at L = 16k, and the README's block rewritten from a results file. Reads a results dict; runs nothing.
"""

from __future__ import annotations

from pathlib import Path
from typing import Optional

from ..results_files import REPO_ROOT, fill_block, load_results, round_significant, shown_path
from .results import timing_method
from .sweeps import Refused
from .variant_workloads import MODES, VARIANTS

__all__ = ["BARS", "README_VARIANTS_START", "README_VARIANTS_END", "bar_verdicts", "variants_table",
           "window_sweep_table", "memory_table", "update_variants_readme"]

README_VARIANTS_START = "<!-- perf-table-variants:start -->"
README_VARIANTS_END = "<!-- perf-table-variants:end -->"
# the bars: (mode, contender compared with, least speed of `triton` relative to it)
BARS = (("forward", "sdpa-flash", 1.0), ("forward", "flex", 0.9), ("fwd+bwd", "flex", 0.8))


# ----------------------------------------------------------------------------------------------
# Tables
# ----------------------------------------------------------------------------------------------

def _usable(record: Optional[dict]) -> bool:
    return record is not None and record.get("status") == "ok" and not record.get("check_failed")


def _by_key(results: dict) -> dict:
    return {r["key"]: r for r in results["records"]}


def _choose_problem(results: dict, dtype: Optional[str], L: Optional[int], D: Optional[int]) -> tuple:
    """(dtype, L, D) of the table: those given, the rest from the bar problem (float16, 4096, 128) when the file has
    it, else from its first timed record."""
    records = [r for r in results["records"] if r.get("status") == "ok"]
    bar = ("float16", 4096, 128)
    chosen = tuple(given or default for given, default in zip((dtype, L, D), bar))
    if any((r["dtype"], r["Lq"], r["D"]) == chosen for r in records) or not records:
        return chosen
    first = records[0]
    return dtype or first["dtype"], L or first["Lq"], D or first["D"]


def _rows(results: dict, dtype: str, L: int, D: int) -> dict:
    """{(variant, mode): {contender: record}} of one problem size: the variants' own workloads (no window override),
    or a variant's only overridden one (the smoke preset's small windows); the window sweep's other rows are its own
    table's."""
    groups = {}
    for r in results["records"]:
        if (r["dtype"], r["Lq"], r["D"]) == (dtype, L, D):
            groups.setdefault((r["variant"], r["mode"]), {}).setdefault(r.get("window_override"), {})[
                r["contender"]] = r
    found = {}
    for key, by_override in groups.items():
        if None in by_override:
            found[key] = by_override[None]
        elif len(by_override) == 1:
            found[key] = next(iter(by_override.values()))
    return found


def _ratio(mine: Optional[dict], theirs: Optional[dict]) -> Optional[float]:
    """Their time over mine (> 1: mine is faster), or None when either is not a usable timing."""
    if not (_usable(mine) and _usable(theirs)):
        return None
    return theirs["median_ms"] / mine["median_ms"]


def bar_verdicts(results: dict, *, ours: str = "triton", dtype: Optional[str] = None, L: Optional[int] = None,
                 D: Optional[int] = None) -> list:
    """The issue's bars (:data:`BARS`) on one problem size (:func:`variants_table`'s): one dict per (bar, variant)
    with ``ratio`` (the other's time over ours, None when either row is missing or failed) and ``met``."""
    dtype, L, D = _choose_problem(results, dtype, L, D)
    rows = _rows(results, dtype, L, D)
    verdicts = []
    for mode, other, least in BARS:
        for variant in VARIANTS:
            if other == "sdpa-flash" and variant != "plain":
                continue
            found = rows.get((variant, mode))
            if found is None:
                continue
            ratio = _ratio(found.get(ours), found.get(other))
            verdicts.append({"mode": mode, "against": other, "least": least, "variant": variant,
                             "ratio": None if ratio is None else round_significant(ratio, 3),
                             "met": ratio is not None and ratio >= least})
    return verdicts


def _cell(record: Optional[dict]) -> str:
    return f"{record['tflops']:.3g}" if _usable(record) else "-"


def _measured_on(results: dict, source: Optional[str]) -> str:
    env = results.get("environment", {})
    method = timing_method(results)
    return (f"Measured on {env.get('gpu') or env.get('device')} (CUDA {env.get('cuda')}, torch {env.get('torch')}) "
            f"on {str(env.get('date', ''))[:10]}" + (f", from `{source}`" if source else "") + ". Timed as: the "
            "median of " + (method.words() if method else "host-clock timings (no GPU: not a speed)") + ".")


def variants_table(results: dict, source: Optional[str] = None, *, dtype: Optional[str] = None,
                   L: Optional[int] = None, D: Optional[int] = None) -> str:
    """The README's table (Markdown): one row per variant and mode of one problem size (default: the bar's, L 4096
    D 128 fp16), TFLOP/s of triton (wb.attention), triton-kernel and FlexAttention, triton's speed relative to
    FlexAttention's and whether it meets its bar; then the bars in one line each (:func:`bar_verdicts`)."""
    if results.get("kind") != "variants":
        raise Refused("not a variants results file (its 'kind' is not 'variants')")
    dtype, L, D = _choose_problem(results, dtype, L, D)
    rows = _rows(results, dtype, L, D)
    least = {mode: value for mode, other, value in BARS if other == "flex"}
    first = next((r for found in rows.values() for r in found.values()), {})
    lines = [_measured_on(results, source) + f" {dtype}, B{first.get('B')} H{first.get('H')} L{L} D{D}; TFLOP/s over "
             "the visible (query, key) pairs only (fwd+bwd: 3.5x the forward's FLOPs). triton: wb.attention (what "
             "users call), triton-kernel: the stage's forward and backward called directly, flex: FlexAttention "
             "compiled with the same score_mod and block mask (sinks: out * sigmoid(lse - sink)). ×flex: flex's time "
             "over triton's (>1: triton is faster); bar: ×flex ≥ "
             + " / ".join(f"{least[m]:g} ({m})" for m in MODES if m in least) + ". A dash: not run, skipped or "
             "failed its check.", "",
             "| variant | mode | visible | triton | triton-kernel | flex | ×flex | bar |",
             "|:---|:---|---:|---:|---:|---:|---:|:---:|"]
    for variant in VARIANTS:
        for mode in MODES:
            found = rows.get((variant, mode))
            if not found:
                continue
            any_record = next(iter(found.values()))
            ratio = _ratio(found.get("triton"), found.get("flex"))
            verdict = "-" if ratio is None else ("✓" if ratio >= least[mode] else "✗")
            lines.append(f"| {variant} | {mode} | {any_record['visible_fraction']:.0%} | {_cell(found.get('triton'))} "
                         f"| {_cell(found.get('triton-kernel'))} | {_cell(found.get('flex'))} | "
                         + ("-" if ratio is None else f"{ratio:.2f}") + f" | {verdict} |")
    lines += ["", "The bars:"]
    verdicts = bar_verdicts(results, dtype=dtype, L=L, D=D)
    for mode, other, value in BARS:
        mine = [v for v in verdicts if v["mode"] == mode and v["against"] == other]
        measured = [v for v in mine if v["ratio"] is not None]
        if not measured:
            lines.append(f"- {mode} ≥ {value:g}x {other}: not measured")
            continue
        low = min(measured, key=lambda v: v["ratio"])
        ok = all(v["met"] for v in mine)
        lines.append(f"- {mode} ≥ {value:g}x {other}: {sum(v['met'] for v in mine)}/{len(mine)} "
                     f"{'✓' if ok else '✗'} (lowest: {low['variant']} {low['ratio']:.2f}"
                     + (f"; not measured: {', '.join(v['variant'] for v in mine if v['ratio'] is None)}"
                        if len(measured) < len(mine) else "") + ")")
    return "\n".join(lines)


def _keys_seen(record: dict) -> Optional[int]:
    sides = record.get("window")
    return None if not sides else sides[0] + sides[1] + 1


def window_sweep_table(results: dict) -> str:
    """The window sweep (Markdown), forward: triton's and flex's median ms (TFLOP/s) against the window at the
    longest L, then against L at a window of 1024 keys beside causal (B * L fixed: a window's time stays flat, causal's
    grows with L); empty when the file has no sweep rows."""
    sweep = [r for r in results["records"] if "window-sweep" in r.get("presets", ()) and r["mode"] == "forward"]
    if not sweep:
        return ""

    def cell(record):
        return f"{record['median_ms']:.3g} ({record['tflops']:.0f})" if _usable(record) else "-"

    longest = max(r["Lq"] for r in sweep)
    by_window = {}
    for r in sweep:
        if r["variant"] == "window" and r["Lq"] == longest:
            by_window.setdefault(_keys_seen(r), {})[r["contender"]] = r
    lines = [f"Window sweep, forward, median ms (TFLOP/s over the visible pairs). Against the window, L = {longest}:",
             "", "| window | visible | triton | flex | triton-kernel |", "|---:|---:|---:|---:|---:|"]
    for window in sorted(by_window):
        row = by_window[window]
        fraction = next(iter(row.values()))["visible_fraction"]
        lines.append(f"| {window} | {fraction:.1%} | {cell(row.get('triton'))} | {cell(row.get('flex'))} | "
                     f"{cell(row.get('triton-kernel'))} |")
    by_length = {}
    for r in sweep:
        if r.get("window_override") is None and r["variant"] in ("window", "causal"):
            by_length.setdefault(r["Lq"], {})[(r["variant"], r["contender"])] = r
    windows = sorted({_keys_seen(r) for r in sweep if r["variant"] == "window" and r.get("window_override") is None})
    size = f"{windows[0]} keys" if len(windows) == 1 else "its window"
    lines += ["", f"Against L (B * L = {TOKENS} tokens), window of {size} beside causal:", "",
              "| L | window: triton | window: flex | causal: triton | causal: flex |", "|---:|---:|---:|---:|---:|"]
    for L in sorted(by_length):
        row = by_length[L]
        lines.append(f"| {L} | " + " | ".join(cell(row.get((variant, name))) for variant in ("window", "causal")
                                               for name in ("triton", "flex")) + " |")
    return "\n".join(lines)


def memory_table(results: dict, L: int = 16384) -> str:
    """Peak memory (GiB allocated during the checked call) per variant, mode and contender at length `L`; empty when
    the file has no row of that length."""
    found = {}
    contenders = []
    for r in results["records"]:
        if r["Lq"] == L and r.get("peak_bytes") is not None and r.get("window_override") is None:
            found.setdefault((r["variant"], r["mode"], r["dtype"], r["D"]), {})[r["contender"]] = r
            if r["contender"] not in contenders:
                contenders.append(r["contender"])
    if not found:
        return ""
    lines = [f"Peak memory at L = {L} (GiB allocated during the checked call, beyond the inputs):", "",
             "| variant | mode | dtype | D | " + " | ".join(contenders) + " |",
             "|:---|:---|:---|---:|" + "---:|" * len(contenders)]
    for (variant, mode, dtype, D), row in found.items():
        cells = [f"{row[c]['peak_bytes'] / 2 ** 30:.2f}" if c in row else "-" for c in contenders]
        lines.append(f"| {variant} | {mode} | {dtype} | {D} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def update_variants_readme(results_path, readme=REPO_ROOT / "README.md") -> Path:
    """Rewrite the README's variants block (between :data:`README_VARIANTS_START` and ``_END``) from a results file."""
    def tables_of_the_file() -> str:
        results = load_results(results_path)
        return "\n\n".join(part for part in (variants_table(results, shown_path(results_path, REPO_ROOT)),
                                             window_sweep_table(results), memory_table(results)) if part)

    return fill_block(readme, README_VARIANTS_START, README_VARIANTS_END, tables_of_the_file, error=Refused)
