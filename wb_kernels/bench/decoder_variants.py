"""The compiled decode step's variants (lesson 07; ``python -m wb_kernels.bench.decoder_tokens --variants``): the
decoder at batch 1 and 1,024 keys with ``wb.decode`` under each of :data:`wb_kernels.models.decoder_graphs.
COMPILE_VARIANTS`, against its roofline (the bar: :data:`ROOFLINE_BAR`), each with its greedy check, and the README's
line for the newest run (:func:`update_variants_readme`).
"""

from __future__ import annotations

import functools
import json
import signal
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import torch

from ..models import llama_decoder as dec
from ..models.decoder_graphs import (COMPILE_VARIANTS, DEFAULT_VARIANTS, CompiledDecoder, EagerRunner, cudagraph_skips,
                                     profile_compiled, time_compiled, variant_names)
from ..models.decoder_greedy import compare_runners, greedy_note
from ..results_files import (REPO_ROOT, environment, fill_block, gpu_short_name, round_significant, save_results,
                             shown_path)
from ..timing import free_device_memory
from .failures import error_line
from .results import SCHEMA_VERSION
from .decoder_shared import (CONFIGS, MAX_STEPS, NOTES, graph_attend, json_roundtrip, log_line, measure_run_ceilings,
                             roofline_fields, warm_up_kernels)

__all__ = ["VARIANTS_KIND", "ROOFLINE_BAR", "VariantSettings", "GPU_VARIANT_SETTINGS", "SMOKE_VARIANT_SETTINGS",
           "check_variant_settings", "variant_plan", "estimate_variant_seconds", "run_variant", "run_variants",
           "variants_summary", "best_variant", "variants_readme_line", "update_variants_readme", "variants_main"]

VARIANTS_KIND = "decoder_variants"  # the results file's "kind"


# The bar: the compiled step with wb.decode at batch 1 and 1,024 keys at this fraction of its roofline or more
ROOFLINE_BAR = 0.60


@dataclass(frozen=True)
class VariantSettings:
    """What the variants' run measures: each variant of :data:`~.decoder_graphs.COMPILE_VARIANTS` compiled once per
    context (batch 1, contiguous cache), its greedy tokens checked against the eager decoder with SDPA, then timed."""

    variants: tuple  # names in COMPILE_VARIANTS, the baseline first
    config: str = "llama_1b"
    dtype: str = "float16"
    device: str = "cuda"
    attend: str = "wb"  # the attention of the compiled step: "wb" (the bar's) or "sdpa"
    contexts: tuple = (1024,)  # keys in the cache when the timed steps start; each context compiles every variant
    steps: int = 32  # timed steps per repeat (time_static's 32 and 3, as the committed rows)
    warmup: int = 3
    repeats: int = 5  # timed runs of `steps`, each from `context` keys: the median is the row's ms/step
    greedy_tokens: int = 32  # new tokens of the greedy check, from a prompt of `context` random tokens
    seed: int = 0
    backend: str = "inductor"  # "eager": traced only (the CPU smoke), the variants' options then do not apply
    num_splits: int | None = None  # wb.decode's split count (None: its choice from the cache's capacity)
    page_size: int = 16  # (the kernels' warm-up runs the paged layout too)
    profile_steps: int = 0  # > 0: that many steps profiled after the timing (decoder_graphs.profile_compiled)


GPU_VARIANT_SETTINGS = VariantSettings(variants=DEFAULT_VARIANTS)


SMOKE_VARIANT_SETTINGS = VariantSettings(variants=DEFAULT_VARIANTS, config="tiny", dtype="float32", device="cpu",
                                         contexts=(16,), steps=3, warmup=1, repeats=2, greedy_tokens=4,
                                         backend="eager", page_size=4)


def check_variant_settings(s: VariantSettings) -> None:
    """Raise ValueError, saying which setting and why, for settings the variants' run does not take."""
    unknown = [name for name in s.variants if name not in COMPILE_VARIANTS]
    if not s.variants or unknown:
        raise ValueError(f"variants: expected names among {', '.join(COMPILE_VARIANTS)}, got "
                         f"{', '.join(unknown) or 'none'}")
    if s.config not in CONFIGS:
        raise ValueError(f"config={s.config!r}: expected one of {', '.join(CONFIGS)}")
    if s.dtype not in ("float16", "bfloat16", "float32"):
        raise ValueError(f"dtype={s.dtype!r}: expected float16, bfloat16 or float32")
    if s.attend not in ("wb", "sdpa"):
        raise ValueError(f"attend={s.attend!r}: expected wb or sdpa")
    if s.backend not in ("inductor", "eager", "aot_eager"):
        raise ValueError(f"backend={s.backend!r}: expected inductor, eager or aot_eager")
    if not s.contexts or any(isinstance(c, bool) or not isinstance(c, int) or c < 1 for c in s.contexts):
        raise ValueError(f"contexts={list(s.contexts)}: expected one or more positive ints")
    for name, value, low, top in (("steps", s.steps, 1, MAX_STEPS), ("warmup", s.warmup, 0, MAX_STEPS),
                                  ("repeats", s.repeats, 1, 50), ("greedy_tokens", s.greedy_tokens, 1,
                                                                  s.warmup + s.steps + 1),
                                  ("profile_steps", s.profile_steps, 0, max(s.warmup + s.steps - 1, 0))):
        if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= top:
            raise ValueError(f"{name}={value!r}: expected an int from {low} to {top}"
                             + (" (the greedy check runs in the timed step's cache: at most warmup + steps + 1 new "
                                "tokens)" if name == "greedy_tokens" else "")
                            + (" (the profile runs in the timed step's cache, after one untimed step: at most "
                               "warmup + steps - 1)" if name == "profile_steps" else ""))
    longest = CONFIGS[s.config].max_seq_len
    if max(s.contexts) + s.warmup + s.steps > longest:
        raise ValueError(f"contexts: {max(s.contexts)} + {s.warmup + s.steps} steps exceeds {s.config}'s "
                         f"max_seq_len={longest}")


def variant_plan(s: VariantSettings) -> list:
    """[(variant name, context)] in the order they run: every variant at the first context, then at the next; a
    variant whose compilation is the slowest (max-autotune) after all the others, so that a budget cuts it first."""
    slow = max(COMPILE_VARIANTS[name].compile_guess_s for name in s.variants)
    pairs = [(name, context) for context in s.contexts for name in s.variants]
    last = [pair for pair in pairs if COMPILE_VARIANTS[pair[0]].compile_guess_s == slow and pair[0] != s.variants[0]]
    return [pair for pair in pairs if pair not in last] + last


def estimate_variant_seconds(s: VariantSettings) -> float:
    """About how long the variants' run takes on an H100 after wb.decode's extension is built: 15 s for the model and
    the ceilings, each variant's guessed compilation, its greedy check (an eager prefill and 32 eager steps: 2 s)
    and its timed steps. A plan, not a measurement."""
    return 15.0 + sum(COMPILE_VARIANTS[name].compile_guess_s + 2.0 for name, _ in variant_plan(s))


class _OutOfTime(BaseException):
    """A variant ran past what was left of the time budget (a BaseException, so no `except Exception` keeps it)."""


def _raise_out_of_time(signum, frame):
    raise _OutOfTime()


def _deadline(seconds: float | None):
    """A context manager that raises _OutOfTime after `seconds` of wall time (None, or off the main thread: none)."""
    import contextlib
    import threading

    if seconds is None or threading.current_thread() is not threading.main_thread():
        return contextlib.nullcontext()

    @contextlib.contextmanager
    def armed():
        previous = signal.signal(signal.SIGALRM, _raise_out_of_time)
        signal.setitimer(signal.ITIMER_REAL, max(seconds, 0.001))
        try:
            yield
        finally:
            signal.setitimer(signal.ITIMER_REAL, 0)
            signal.signal(signal.SIGALRM, previous)

    return armed()


def _cuda_usable() -> bool:
    """Whether the CUDA context still runs a kernel (after a variant failed: a failed capture may break it)."""
    try:
        torch.ones(1, device="cuda").add_(1)
        torch.cuda.synchronize()
        return True
    except Exception:  # noqa: BLE001 - the answer to the question asked
        return False


def greedy_verdict(record: dict) -> str:
    """"identical", "near tie" (the first flip is one that rounding accounts for: compare_greedy's rule) or
    "suspect" (anything else: the compiled step is not the decoder's)."""
    if record["identical"]:
        return "identical"
    first = record["first_divergence"]
    return "near tie" if first is not None and first["near_tie"] else "suspect"


def _variant_head(s: VariantSettings, name: str, context: int) -> dict:
    return {"key": f"{s.config}|{s.dtype}|B1|L{context}|compile|contiguous|{s.attend}|{name}",
            "kind": "decoder_variant", "variant": name, "context": context}


def run_variant(model: dec.Decoder, s: VariantSettings, name: str, context: int, ceilings: dict) -> dict:
    """One variant at one context: compile the step (batch 1, a contiguous cache of context + warmup + steps keys),
    check its greedy tokens against the eager decoder with SDPA (a prompt of `context` random tokens, the same
    rule as the tokens run's compiled checks), then time it on the same cache (:func:`~.decoder_graphs.
    time_compiled`). Returns the record (status "ok" or "failed"; _OutOfTime passes through)."""

    variant = COMPILE_VARIANTS[name]
    capacity = context + s.warmup + s.steps
    record = {**_variant_head(s, name, context), "description": variant.description,
              "mode": variant.mode, "options": dict(variant.options), "split_gate_up": variant.split_gate_up,
              "backend": s.backend, "config": s.config, "dtype": s.dtype, "attend": s.attend, "layout": "contiguous",
              "batch": 1, "capacity": capacity, "steps": s.steps, "warmup": s.warmup,
              "repeats": s.repeats}
    started = time.perf_counter()
    skips_before = cudagraph_skips()
    runner = None
    try:
        cache = model.new_cache(1, capacity)
        attend = graph_attend(s.attend, s)
        runner = CompiledDecoder.for_variant(model, attend, cache=cache, variant=variant, backend=s.backend)
        prompt = torch.randint(0, model.config.vocab_size, (1, context),
                               generator=torch.Generator().manual_seed(s.seed + 1)).to(model.device)
        reference = EagerRunner(model, dec.sdpa_attend, capacity=capacity)
        greedy = compare_runners(reference, runner, prompt, s.greedy_tokens, model.dtype)
        del reference
        greedy["note"] = greedy_note(greedy)
        compile_s = runner.first_step_s
        timing = time_compiled(runner, context=context, steps=s.steps, warmup=s.warmup, repeats=s.repeats,
                               seed=s.seed)
        profiled = None
        if s.profile_steps:
            try:
                profiled = profile_compiled(runner, context=context, steps=s.profile_steps, seed=s.seed)
                if profiled["kernels_per_step"]:  # the step's time not covered by the summed device events
                    profiled["step_us_minus_kernel_us"] = round(1e3 * timing["ms_per_step"]
                                                                - profiled["kernel_us_per_step"], 2)
            except Exception as error:  # noqa: BLE001 - the timing stands without its profile

                profiled = {"status": "failed", "reason": error_line(error)}
    except Exception as error:  # noqa: BLE001 - recorded, the next variant runs

        return {**record, "status": "failed", "reason": error_line(error),
                "wall_s": round_significant(time.perf_counter() - started, 3)}
    finally:
        del runner
        torch._dynamo.reset()  # its graphs hold this cache's addresses; the next variant compiles anew
        free_device_memory()
    record.update(status="ok", compile_s=round_significant(compile_s, 3), wall_s=round_significant(time.perf_counter() - started, 3),
                  captured=s.device == "cuda" and s.backend == "inductor" and cudagraph_skips() == skips_before,
                  ms_per_step=round_significant(timing["ms_per_step"], 4), ms_per_step_min=round_significant(timing["ms_per_step_min"], 4),
                  ms_per_step_repeats=[round_significant(t, 4) for t in timing["ms_per_step_repeats"]],
                  tokens_per_s=round_significant(timing["tokens_per_s"], 4), greedy_verdict=greedy_verdict(greedy),
                  greedy={"reference": "sdpa, contiguous, eager", "prompt_len": context,
                          "new_tokens": s.greedy_tokens, **greedy})
    record.update(roofline_fields(CONFIGS[s.config], s, 1, timing["mean_context"], timing["ms_per_step"], ceilings))
    if profiled is not None:
        record["profile"] = profiled
    return record


def _variant_line(r: dict, baseline: dict | None) -> str:
    head = f"  {r['variant']:<36} L={r['context']:<6} "
    if r["status"] != "ok":
        return head + f"{r['status']}: {r['reason']}"
    versus = (f", {r['vs_baseline']:.3f}x {baseline['variant']}" if "vs_baseline" in r and baseline else "")
    return head + (f"{r['ms_per_step']:.4g} ms/step (min {r['ms_per_step_min']:.4g}), "
                   f"{100 * r['fraction_of_roofline']:.1f} % of the roofline{versus}; first step (compilation) "
                   f"{r['compile_s']:.1f} s; greedy: {r['greedy_verdict']}"
                   + ("" if r["captured"] or r["backend"] != "inductor" else "; NOT in a CUDA graph"))


def run_variants(s: VariantSettings, out_path, *, command: str | None = None, progress: bool = True,
                 time_budget: float | None = None, smoke: bool = False) -> dict:
    """Every variant of `s` at every context (:func:`variant_plan`), one record each, into the JSON file `out_path`
    (rewritten after every variant); returns the results. `time_budget` (seconds, counted after the model is built
    and wb.decode's kernels are loaded): a variant starts only while 10 s of it are left, and stops where it is
    when the rest is spent (its record says so; the variants after it are recorded as not started)."""

    check_variant_settings(s)
    log = functools.partial(log_line, progress)
    out_path = Path(out_path)
    results = {"schema": SCHEMA_VERSION, "kind": VARIANTS_KIND, "mode": "smoke" if smoke else "gpu",
               "environment": environment(), "command": command, "settings": json_roundtrip(asdict(s)),
               "roofline_bar": ROOFLINE_BAR, "notes": {
                   "what": "the compiled decode step (batch 1, contiguous cache, the bar's attention) compiled each "
                           "way of decoder_graphs.COMPILE_VARIANTS: each compiled once per context, its greedy "
                           "tokens checked against the eager decoder with SDPA (compare_greedy's near-tie rule), "
                           "then timed on the same cache as time_static times (CUDA events around `steps` steps "
                           "after `warmup`, the cache filled with random keys to `context`), `repeats` times: "
                           "ms_per_step is the median",
                   "roofline": NOTES["roofline"], "vs_baseline": "the baseline's ms/step over this variant's, "
                                                                 "same context (>1: faster)"},
               "ceilings": None, "records": [], "complete": False}
    plan = variant_plan(s)
    log(f"{len(plan)} compiled variants of {s.config} with {s.attend} at batch 1, into {out_path}"
        + (f" (about {estimate_variant_seconds(s):.0f} s on an H100)" if s.device == "cuda" else ""))
    model = dec.Decoder(CONFIGS[s.config], dtype=getattr(torch, s.dtype), device=s.device, seed=s.seed)
    if s.attend == "wb":
        warm_up_kernels(model, s, progress)
    started = time.monotonic()  # the budget counts from here: the extension's build is not the variants'
    log("measuring the ceilings")
    results["ceilings"] = measure_run_ceilings(s)
    save_results(results, out_path)
    baselines = {}
    out_of_time = False
    for name, context in plan:
        left = None if time_budget is None else time_budget - (time.monotonic() - started)
        if out_of_time or (left is not None and left < 10.0):
            why = "the time budget of {:.0f} s was spent".format(time_budget) if left is not None and left < 10.0 \
                else "an earlier variant stopped the run"
            out_of_time = True
            record = {**_variant_head(s, name, context), "status": "skipped", "reason": f"not started: {why}"}
        else:
            log(f"{name} at {context} keys: {COMPILE_VARIANTS[name].description}"
                + (f" ({left:.0f} s of the budget left)" if left is not None else ""))
            variant_started = time.perf_counter()
            try:
                with _deadline(left):
                    record = run_variant(model, s, name, context, results["ceilings"])
            except _OutOfTime:
                out_of_time = True
                torch._dynamo.reset()
                free_device_memory()
                record = {**_variant_head(s, name, context), "status": "skipped",
                          "reason": f"stopped after {time.perf_counter() - variant_started:.0f} s: the time budget "
                                    f"of {time_budget:.0f} s was spent (compiling or checking; nothing timed)"}
        if record["status"] == "failed" and s.device == "cuda" and not _cuda_usable():
            # a failed capture can leave the CUDA context unusable: what follows would fail for that reason alone
            out_of_time = True
            record["reason"] += "; the CUDA context is unusable after it: the variants after it are not run"
        if record["status"] == "ok":
            if name == s.variants[0]:
                baselines[context] = record
            elif context in baselines:
                record["vs_baseline"] = round_significant(baselines[context]["ms_per_step"] / record["ms_per_step"], 4)
        results["records"].append(record)
        save_results(results, out_path)
        log(_variant_line(record, baselines.get(context)))
    model = None
    free_device_memory()
    results.update(complete=not out_of_time, elapsed_s=round(time.monotonic() - started, 1))
    save_results(results, out_path)
    return results


def variants_summary(results: dict) -> str:
    """The table the variants' run prints: one line per record, then the best variant per context and the bar."""
    s = results["settings"]
    lines = [f"compiled variants of {s['config']} ({s['dtype']}, attention {s['attend']}, batch 1) on "
             f"{results['environment'].get('gpu') or results['environment'].get('device')}; copy "
             f"{results['ceilings']['copy_gbps']} GB/s" + (" (a smoke run: the fractions mean nothing)"
                                                            if results["mode"] == "smoke" else "")]
    baselines = {r["context"]: r for r in results["records"]
                 if r.get("status") == "ok" and r["variant"] == s["variants"][0]}
    lines += [_variant_line(r, baselines.get(r["context"])) for r in results["records"]]
    for context in s["contexts"]:
        best = best_variant(results, context)
        if best is None:
            lines.append(f"L={context}: no variant timed with its tokens checked")
            continue
        bar = 100 * results["roofline_bar"]
        lines.append(f"L={context}: best {best['variant']}, {best['ms_per_step']:.4g} ms/step = "
                     f"{100 * best['fraction_of_roofline']:.1f} % of the roofline (roofline {best['roofline']['step_ms']}"
                     f" ms); the bar, {bar:.0f} %, is " + ("met" if best["fraction_of_roofline"] >= ROOFLINE_BAR
                                                             else "not met"))
    return "\n".join(lines)


def best_variant(results: dict, context: int) -> dict | None:
    """The fastest variant timed at `context` keys whose greedy tokens were checked and not suspect (a faster step
    that generates other tokens is not a faster decoder); None where no variant was."""
    ok = [r for r in results["records"] if r.get("status") == "ok" and r["context"] == context
          and r["greedy_verdict"] != "suspect"]
    return min(ok, key=lambda r: r["ms_per_step"]) if ok else None


def variants_readme_line(results: dict, *, source: str) -> str:
    """The README's sentence for a variants run (`source`: the file's path in the repository), rendered from the
    file alone: the GPU and commit, each variant's ms per step and fraction of the roofline per context (or why it
    did not run), the greedy verdicts, the best variant and whether it meets the file's ``roofline_bar``."""
    s, env = results["settings"], results["environment"]
    parts = []
    for context in s["contexts"]:
        records = [r for r in results["records"] if r["context"] == context]
        timed = [r for r in records if r.get("status") == "ok"]
        rows = ", ".join(f"{r['variant']} {r['ms_per_step']:.3f} ms ({100 * r['fraction_of_roofline']:.1f} %)"
                         if r.get("status") == "ok" else f"{r['variant']} {r['status']} ({r.get('reason')})"
                         for r in records)
        verdicts = sorted({r["greedy_verdict"] for r in timed})
        greedy = (f"greedy tokens {verdicts[0]} to the eager decoder's for every variant timed" if len(verdicts) == 1
                  else "greedy tokens against the eager decoder's: " + ", ".join(
                      f"{r['variant']} {r['greedy_verdict']}" for r in timed))
        best = best_variant(results, context)
        verdict = ("no variant timed with its tokens checked" if best is None else
                   f"best {best['variant']}" + (f", {best['vs_baseline']:.3f}x {s['variants'][0]}"
                                                if best.get("vs_baseline") else "")
                   + f": the bar of {100 * results['roofline_bar']:.0f} % of the roofline is "
                   + ("met" if best["fraction_of_roofline"] >= results["roofline_bar"] else "not met"))
        parts.append(f"{context:,} keys: {rows}; {greedy}; {verdict}")
    return (f"The compiled step's variants (`{s['config']}`, {s['dtype']}, batch 1, attention `{s['attend']}`; ms per "
            f"step and the fraction of the step's roofline), measured on {env.get('gpu') or env.get('device')} at "
            f"commit {env.get('git_commit')} (`{source}`): " + "; ".join(parts) + ".")


README_VARIANTS_START, README_VARIANTS_END = "<!-- decoder-variants:start -->", "<!-- decoder-variants:end -->"


def update_variants_readme(results_path, readme=None) -> Path:
    """Rewrite the README's block between :data:`README_VARIANTS_START` and :data:`README_VARIANTS_END` with
    :func:`variants_readme_line` of the variants file `results_path` (the README's test checks that it is current)."""


    return fill_block(readme if readme is not None else REPO_ROOT / "README.md", README_VARIANTS_START,
                      README_VARIANTS_END, lambda: variants_readme_line(json.loads(Path(results_path).read_text()),
                                                                        source=shown_path(results_path, REPO_ROOT)))


def default_variants_output(smoke: bool) -> Path:
    """results/decode/decoder_variants_<gpu>.json, or results/decode/decoder_variants_smoke.json."""

    return REPO_ROOT / "results" / "decode" / f"decoder_variants_{'smoke' if smoke else gpu_short_name()}.json"


def variants_main(args, parser) -> int:
    """``--variants``: the variants' run from the command line's arguments (see :func:`main`)."""
    base = SMOKE_VARIANT_SETTINGS if args.smoke else GPU_VARIANT_SETTINGS
    try:
        names = variant_names(args.variants)
    except ValueError as error:
        parser.error(str(error))
    chosen = {"variants": names}
    for name, value in (("contexts", args.contexts), ("steps", args.steps), ("warmup", args.warmup),
                        ("repeats", args.repeats), ("greedy_tokens", args.greedy_tokens), ("dtype", args.dtype),
                        ("attend", args.attend), ("seed", args.seed), ("num_splits", args.num_splits),
                        ("profile_steps", args.profile_steps)):
        if value is not None:
            chosen[name] = value
    if args.configs is not None:
        if len(args.configs) != 1:
            parser.error("--variants runs one model: give one name to --configs")
        chosen["config"] = args.configs[0]
    settings = replace(base, **chosen)
    if args.smoke and settings.config != "tiny":
        parser.error("--smoke runs on the CPU: only --configs tiny (the 1B models need a GPU)")
    try:
        check_variant_settings(settings)
    except ValueError as error:
        parser.error(str(error))
    if args.plan:
        for name, context in variant_plan(settings):
            print(f"{name} at {context} keys: {COMPILE_VARIANTS[name].description}")
        print(f"{len(variant_plan(settings))} variants; about {estimate_variant_seconds(settings):.0f} s on an H100 "
              "after wb.decode's extension is built (a plan, not a measurement)")
        return 0
    out = args.json if args.json is not None else default_variants_output(args.smoke)
    command = "python -m wb_kernels.bench.decoder_tokens " + " ".join(args.argv)
    if args.smoke:
        torch.set_num_threads(1)
    results = run_variants(settings, out, command=command.strip(), progress=not args.no_progress,
                           time_budget=args.time_budget, smoke=args.smoke)
    print(variants_summary(results))
    print(f"wrote {out}")
    suspect = [r for r in results["records"] if r.get("greedy_verdict") == "suspect"]
    return 1 if suspect else 0
