"""Tokens per second of lesson 07's LLaMA-shaped decoder against its step's roofline: eager, in a CUDA graph per
batch and under ``torch.compile``, with its attention by SDPA, by ``wb.decode`` and by FlashInfer's paged decode where
it is installed (lesson 07_decode reads the committed file; the README shows its roofline chart).

    python -m wb_kernels.bench.decoder_tokens --time-budget 300   # on a GPU: results/decode/decoder_<gpu>.json and
                                                                   # figures/07_decoder_roofline_<gpu>.png
    python -m wb_kernels.bench.decoder_tokens --sweep-configs none --configs llama_1b    # the eager rows only
    python -m wb_kernels.bench.decoder_tokens --smoke  # TINY on the CPU in float32: seconds, for the tests

On a GPU, by default, in float16:

1. **Eager** (the decoder as it is, every step launched from Python): ``LLAMA_1B`` and ``LLAMA_1B_D128``, batch 1 and
   16, prompts (the context) of 1024 and 8192 tokens, each timed by :func:`~wb_kernels.models.llama_decoder.time_decode` (a real
   prefill, 32 greedy decode steps after 3 untimed ones, CUDA events) five times: ``sdpa_attend`` and ``wb_attend``
   on a contiguous cache and on a paged one (pages of 16 keys, shuffled), and ``FlashInferAttend`` on the paged one
   (where flashinfer is installed; elsewhere the row says why it is missing). These rows also give the attention's
   ms and share of the step. Then the greedy check of each model (:func:`compare_greedy`).
2. **The roofline sweep** (``LLAMA_1B``, batch 1, 8 and 64, contexts 1k, 8k and 32k): the step without its host
   overhead (:mod:`wb_kernels.models.decoder_graphs`), on a static cache filled with random keys and values: one CUDA graph per batch
   with SDPA and with ``wb.decode`` (while ``wb.decode`` is not graph-safe, its rows say so and why), on both
   layouts, and with FlashInfer on the paged one (``FlashInferGraphAttend``: its run captured, planned on the host
   before every replay, as vLLM's and SGLang's FlashInfer backends do); then ``torch.compile(mode="reduce-overhead")``
   with SDPA at batch 1 and 1k keys (each cell compiles the step: the slowest rows, so they come last). The greedy
   check of each mode against the eager decoder with SDPA, and of each graph against the same step uncaptured (which
   must give the very same tokens).

Every row records tokens/s, ms per step, the bytes a step must read (every weight once, and the KV cache at the mean
context of its timed steps) and the fraction of the step's roofline reached (:func:`~wb_kernels.models.llama_decoder.
decode_step_roofline` at the copy bandwidth and fp16 matmul peak measured in the same run by
:func:`wb_kernels.bench.measure_ceilings`), and its speed over SDPA's in the same mode and layout.

The greedy checks: the same random prompts generate tokens with the eager SDPA decoder (contiguous cache) and with
the other, in lockstep (:func:`compare_runners`). The file says whether the tokens are identical, how far the two
runs' logits differed while their contexts were the same (and whether that is within rounding), and, if the tokens
differ, the first step where they do, SDPA's margin between its top two logits there and the logit difference there.
The weights are random, so near ties between the two largest logits are common, and 16-bit rounding may flip one
(another SDPA kernel in a graph, which reads the whole capacity under a mask; another split count; Inductor's
fusions): the record says whether rounding can account for the flip (the near-tie rule).

About five minutes on an H100 once wb.decode's CUDA extension is built (a minute of it the two compilations, the
timed cell's and the greedy check's; the plan: :func:`estimate_seconds`, ``--plan`` prints it). ``--time-budget`` stops starting rows after that many seconds, and the same command
resumes the unfinished file. Every setting is bounded (see :func:`check_settings`), a row whose cache would not fit
in the GPU's free memory is recorded as skipped, and the file is rewritten after every row."""

from __future__ import annotations

import argparse
import functools
import signal
import sys
import time
from dataclasses import asdict, replace
from pathlib import Path

import torch

from ..models import llama_decoder as dec
from ..models.decoder_graphs import (COMPILE_VARIANTS, DEFAULT_VARIANTS, CompiledDecoder, EagerRunner, GraphedDecoder,
                                     time_static, wb_decode_graph_support)
from ..models.decoder_greedy import ROUNDING_ULPS, compare_greedy, compare_runners, greedy_note
from ..results_files import REPO_ROOT, environment, gpu_short_name, load_results, round_significant, save_results
from ..timing import free_device_memory
from .failures import error_line
from .results import SCHEMA_VERSION
from .decoder_shared import (ATTENDS, CONFIGS, MAX_STEPS, NOTES, Settings, graph_attend, json_roundtrip, log_line,
                             measure_run_ceilings, roofline_fields, warm_up_kernels)

# the compiled step's variants are run by this command too (``--variants``): their names, as lesson 07 reads them
from .decoder_variants import (GPU_VARIANT_SETTINGS, README_VARIANTS_END, README_VARIANTS_START,
                               SMOKE_VARIANT_SETTINGS, VariantSettings, best_variant, check_variant_settings,
                               estimate_variant_seconds, run_variants, update_variants_readme, variant_plan,
                               variants_readme_line, variants_main, variants_summary)

__all__ = ["CONFIGS", "Settings", "GPU_SETTINGS", "SMOKE_SETTINGS", "ATTENDS", "check_settings", "compare_greedy",
           "compare_runners", "ROUNDING_ULPS", "run_tokens", "default_output", "main",
           # from decoder_variants
           "GPU_VARIANT_SETTINGS", "SMOKE_VARIANT_SETTINGS", "VariantSettings", "README_VARIANTS_START",
           "README_VARIANTS_END", "best_variant", "check_variant_settings", "estimate_variant_seconds", "run_variants",
           "update_variants_readme", "variant_plan", "variants_readme_line", "variants_summary"]

LAYOUTS = ("contiguous", "paged")


# FlashInfer's batch decode reads a paged cache only: it runs on that layout, beside SDPA and wb on both
ATTEND_LAYOUTS = {"flashinfer": ("paged",)}


KIND = "decoder_tokens"  # the results file's "kind": not a decode-kernel benchmark (those are "decode")


# Upper bounds of the settings: with them no single row can run for long, whatever the command line says.
MAX_BATCH = 256


MAX_GREEDY_TOKENS = 256


GPU_SETTINGS = Settings(configs=("llama_1b", "llama_1b_d128"), dtype="float16", device="cuda", batches=(1, 16),
                        contexts=(1024, 8192), steps=32, warmup=3, page_size=16, greedy_batch=8, greedy_prompt=1024,
                        greedy_tokens=32, sweep_configs=("llama_1b",), sweep_batches=(1, 8, 64),
                        sweep_contexts=(1024, 8192, 32768), compile_cells=((1, 1024),))


# TINY on the CPU; wb_attend runs on the CUDA simulator there (about a tenth of a second per call), so few steps.
SMOKE_SETTINGS = Settings(configs=("tiny",), dtype="float32", device="cpu", batches=(2,), contexts=(16,), steps=3,
                          warmup=1, page_size=4, greedy_batch=2, greedy_prompt=8, greedy_tokens=4,
                          sweep_configs=("tiny",), sweep_batches=(2,), sweep_contexts=(16,), compile_cells=((2, 16),),
                          compile_backend="eager")


# The contenders of the sweep, (mode, layout, attend): hand-captured graphs with SDPA and wb.decode on both layouts,
# and torch.compile(mode="reduce-overhead") with SDPA and wb.decode (where compile_cells say): Inductor fuses the
# step's elementwise operators (norms, RoPE, SiLU) into a few kernels, which a hand-captured graph replays one by one
SWEEP_CONTENDERS = (("graph", "contiguous", "sdpa"), ("graph", "paged", "sdpa"), ("graph", "contiguous", "wb"),
                    ("graph", "paged", "wb"), ("graph", "paged", "flashinfer"), ("compile", "contiguous", "sdpa"),
                    ("compile", "contiguous", "wb"), ("compile", "paged", "wb"))


def check_settings(settings: Settings) -> None:
    """Raise ValueError, saying which setting and why, for settings this benchmark does not run."""
    s = settings
    unknown = [name for name in s.configs if name not in CONFIGS]
    if not s.configs or unknown:
        raise ValueError(f"configs: expected names among {', '.join(CONFIGS)}, got {', '.join(s.configs) or 'none'}")
    if s.dtype not in ("float16", "bfloat16", "float32"):
        raise ValueError(f"dtype={s.dtype!r}: expected float16, bfloat16 or float32")
    for name, values, top in (("batches", s.batches, MAX_BATCH), ("contexts", s.contexts, None)):
        if not values or any(isinstance(v, bool) or not isinstance(v, int) or v < 1 for v in values):
            raise ValueError(f"{name}={list(values)}: expected one or more positive ints")
        if top is not None and max(values) > top:
            raise ValueError(f"{name}={list(values)}: at most {top}, to keep every row short")
    for name, value, low, top in (("steps", s.steps, 1, MAX_STEPS), ("warmup", s.warmup, 0, MAX_STEPS),
                                  ("page_size", s.page_size, 1, 4096), ("greedy_batch", s.greedy_batch, 1, MAX_BATCH),
                                  ("greedy_prompt", s.greedy_prompt, 1, None),
                                  ("greedy_tokens", s.greedy_tokens, 0, MAX_GREEDY_TOKENS)):
        if isinstance(value, bool) or not isinstance(value, int) or value < low or (top is not None and value > top):
            raise ValueError(f"{name}={value!r}: expected an int from {low}" + (f" to {top}" if top else " up"))
    unknown = [name for name in s.sweep_configs if name not in CONFIGS]
    if unknown:
        raise ValueError(f"sweep_configs: expected names among {', '.join(CONFIGS)}, got {', '.join(unknown)}")
    for name, values, top in (("sweep_batches", s.sweep_batches, MAX_BATCH), ("sweep_contexts", s.sweep_contexts,
                                                                               None)):
        if any(isinstance(v, bool) or not isinstance(v, int) or v < 1 for v in values) or \
                (top is not None and values and max(values) > top):
            raise ValueError(f"{name}={list(values)}: expected positive ints" + (f", at most {top}" if top else ""))
    if bool(s.sweep_configs) != bool(s.sweep_batches and s.sweep_contexts):
        raise ValueError("the sweep needs sweep_configs, sweep_batches and sweep_contexts together (or none of them)")
    cells = {(b, c) for b in s.sweep_batches for c in s.sweep_contexts}
    if any(tuple(cell) not in cells for cell in s.compile_cells):
        raise ValueError(f"compile_cells={[list(c) for c in s.compile_cells]}: each (batch, context) must be a cell "
                         "of the sweep")
    if s.compile_backend not in ("inductor", "eager", "aot_eager"):
        raise ValueError(f"compile_backend={s.compile_backend!r}: expected inductor, eager or aot_eager")
    if s.num_splits is not None and (isinstance(s.num_splits, bool) or not isinstance(s.num_splits, int)
                                     or not 1 <= s.num_splits <= 64):
        raise ValueError(f"num_splits={s.num_splits!r}: expected None or an int from 1 to 64")
    for name in set(s.configs) | set(s.sweep_configs):
        longest = CONFIGS[name].max_seq_len
        contexts = (s.contexts if name in s.configs else ()) + (s.sweep_contexts if name in s.sweep_configs else ())
        if max(contexts) + s.steps + s.warmup > longest:
            raise ValueError(f"contexts: {max(contexts)} + {s.steps + s.warmup} steps exceeds {name}'s "
                             f"max_seq_len={longest}")
        if s.greedy_prompt + s.greedy_tokens > longest:
            raise ValueError(f"greedy_prompt {s.greedy_prompt} + greedy_tokens {s.greedy_tokens} exceeds {name}'s "
                             f"max_seq_len={longest}")


def _by_cache_size(batches, contexts) -> list:
    return sorted(((b, c) for b in batches for c in contexts), key=lambda bc: (bc[0] * bc[1], bc))


def _plan(settings: Settings) -> list:
    """[(config name, batch, context, mode, layout, attend)] in the order they run: the eager rows per model, from
    the smallest cache up, SDPA before wb on each layout (so a row's SDPA baseline is there when its ratio is
    computed); then the sweep's graph rows; then its torch.compile rows (each compiles the step: the slowest rows,
    last, so that a run stopped by its time budget has everything else)."""
    eager = [(name, batch, context, "eager", layout, attend)
             for name in settings.configs
             for batch, context in _by_cache_size(settings.batches, settings.contexts)
             for layout in LAYOUTS for attend in ATTENDS if layout in ATTEND_LAYOUTS.get(attend, LAYOUTS)]
    cells = _by_cache_size(settings.sweep_batches, settings.sweep_contexts)
    graph = [(name, batch, context, mode, layout, attend)
             for name in settings.sweep_configs for batch, context in cells
             for mode, layout, attend in SWEEP_CONTENDERS if mode == "graph"]
    compiled = [(name, batch, context, mode, layout, attend)
                for name in settings.sweep_configs for batch, context in cells
                if (batch, context) in {tuple(c) for c in settings.compile_cells}
                for mode, layout, attend in SWEEP_CONTENDERS if mode == "compile"]
    return eager + graph + compiled


# A guess at a cold compilation of the 1B step with Inductor, in seconds: a compiled row or check does not start when
# the time budget would end before it does (estimate_seconds' guess too)
COMPILE_GUESS_S = 60.0


def row_key(config, dtype, batch, context, mode, layout, attend) -> str:
    """A row's key in the results file (and what a resumed run skips)."""
    return f"{config}|{dtype}|B{batch}|L{context}|{mode}|{layout}|{attend}"


def _greedy_other(mode: str, layout: str, attend: str) -> str:
    """The ``other`` of a greedy record: "wb, paged" (eager, as the earlier files name it), "wb, paged, graph"."""
    return f"{attend}, {layout}" + ("" if mode == "eager" else f", {mode}")


def _stages(settings: Settings) -> list:
    """[(config name, "rows" or "greedy", the rows of :func:`_plan` or the (mode, layout, attend) checks)] in the order
    a run takes them: each model's eager rows and greedy check; then the sweep's graph rows and their check, its
    compiled rows and their check (the slowest, so that a run stopped by its time budget has everything else)."""
    plan = _plan(settings)
    stages = []
    for name in settings.configs:
        stages.append((name, "rows", [r for r in plan if r[0] == name and r[3] == "eager"]))
        stages.append((name, "greedy", [("eager", layout, attend) for attend, layout in GREEDY_OTHERS]))
    for mode in ("graph", "compile"):
        for name in settings.sweep_configs:
            stages.append((name, "rows", [r for r in plan if r[0] == name and r[3] == mode]))
            if mode == "graph" or settings.compile_cells:
                stages.append((name, "greedy", [check for check in GREEDY_MODES if check[0] == mode]))
    return stages


def estimate_seconds(settings: Settings) -> float:
    """About how long a run takes on an H100: each row's prefill at a guessed 300 TFLOP/s, its steps at the larger of
    a guessed 5 ms of launches and the roofline's bytes at 1.5 TB/s (half the copy rate, as SDPA on a paged cache
    copies it first), a second of bookkeeping; the ceilings, the greedy checks. A plan, not a measurement."""
    total = 10.0
    for name, batch, context, mode, _, _ in _plan(settings):
        config = CONFIGS[name]
        prefill = 2 * config.params() * batch * context / 300e12 if mode == "eager" else 0.0
        step = dec.decode_step_roofline(config, batch=batch, context_len=context, dtype_bytes=2,
                                        bandwidth_bytes_per_s=1.5e12)["step_time_s"]
        launches = 5e-3 if mode == "eager" else 0.0  # a graph's step is its bytes' time
        setup = {"eager": 1.0, "graph": 1.5, "compile": COMPILE_GUESS_S}[mode]
        total += setup + prefill + (settings.steps + settings.warmup) * max(launches, step)
    greedy = len(settings.configs) * 2 * (settings.greedy_tokens * 2 * 5e-3 + 1.0)
    # the compiled step's check: a second compilation, or (the same shapes as a timed cell) a guessed 20 s of tracing
    reused = settings.compile_cells and compile_check_shape(settings)[0] == settings.compile_cells[0][0]
    compile_check = (20.0 if reused else 60.0) if settings.compile_cells else 0.0
    greedy += len(settings.sweep_configs) * (3 * 3.0 + compile_check)
    return total + greedy


def default_output(smoke: bool) -> Path:
    """results/decode/decoder_<gpu>.json (decoder_h100.json, ...), or results/decode/decoder_smoke.json."""

    return REPO_ROOT / "results" / "decode" / f"decoder_{'smoke' if smoke else gpu_short_name()}.json"


def _fits(config, settings: Settings, batch: int, context: int, paged: bool, *, prefill: bool = True) -> str | None:
    """Why a row would not fit in the GPU's free memory (None: it fits, or not on a GPU): its KV cache, plus the
    prefill's largest activations (the MLP's gate and up projections, float32 copies in the norms and RoPE; none for
    the sweep's random cache), plus SDPA's gathered copy of a paged layer (`paged`)."""
    if settings.device != "cuda":
        return None
    itemsize = torch.empty((), dtype=getattr(torch, settings.dtype)).element_size()
    capacity = context + settings.steps + settings.warmup
    cache = batch * capacity * config.kv_bytes_per_token(itemsize)
    activations = batch * context * (3 * config.ffn_dim * itemsize + 8 * config.dim * 4) if prefill else 0
    # K and V gathered, each copied twice (the gather, then the reshape of its transposed view)
    gathered = 4 * batch * capacity * config.n_kv_heads * config.head_dim * itemsize if paged else 0
    need = cache + activations + gathered + 2**30  # and a GiB for the allocator's rounding and the workspaces
    free = torch.cuda.mem_get_info()[0]
    if need <= free:
        return None
    return (f"does not fit: the cache ({cache / 2**30:.1f} GiB)" + (" and the prefill" if prefill else "")
            + f" need about {need / 2**30:.1f} GiB, {free / 2**30:.1f} GiB are free")


def _attend_problem(attend_name: str, settings: Settings) -> str | None:
    """Why an attention cannot run in this run (FlashInfer: not installed, or the run is not on a CUDA GPU), or None."""
    if attend_name != "flashinfer":
        return None
    from .flashinfer import problem

    if settings.device != "cuda":
        return f"flashinfer runs on a CUDA GPU; this run is on the {settings.device}"
    return problem()


def _row_head(config_name, settings, batch, context, mode, layout, attend_name) -> dict:
    return {"key": row_key(config_name, settings.dtype, batch, context, mode, layout, attend_name), "kind": "decoder",
            "config": config_name, "dtype": settings.dtype, "batch": batch, "context": context, "mode": mode,
            "layout": layout, "page_size": settings.page_size if layout == "paged" else None, "attend": attend_name,
            "steps": settings.steps, "warmup": settings.warmup}


def _row(config_name, settings, model, batch, context, layout, attend_name, ceilings) -> dict:
    """An eager row: :func:`~wb_kernels.models.llama_decoder.time_decode` (a real prefill, then the steps as the decoder runs them)."""
    config = CONFIGS[config_name]
    row = _row_head(config_name, settings, batch, context, "eager", layout, attend_name)
    why = _fits(config, settings, batch, context, layout == "paged") or _attend_problem(attend_name, settings)
    if why is not None:
        return {**row, "status": "skipped", "reason": why}
    try:
        timing = dec.time_decode(model, batch=batch, prompt_len=context, new_tokens=settings.steps,
                                 attend=ATTENDS[attend_name], paged=layout == "paged", warmup=settings.warmup,
                                 page_size=settings.page_size, seed=settings.seed)
    except Exception as error:  # noqa: BLE001 - recorded, the run goes on

        return {**row, "status": "failed", "reason": error_line(error)}
    finally:
        free_device_memory()
    row.update(status="ok", **{name: round_significant(timing[name], 4) for name in
                               ("tokens_per_s", "ms_per_step", "attention_ms_per_step", "attention_share")})
    row.update(roofline_fields(config, settings, batch, context + (settings.steps + 1) / 2, timing["ms_per_step"],
                                ceilings))
    return row


def _compile_options(settings: Settings) -> dict:
    return {} if settings.compile_backend == "inductor" else {"backend": settings.compile_backend}


def _graph_problem(mode, attend_name, settings) -> str | None:
    """Why this contender cannot be captured here (wb.decode while it is not graph-safe), or None."""
    if mode == "graph" and attend_name == "wb" and settings.device == "cuda":
        support = wb_decode_graph_support(settings.dtype, settings.num_splits)
        if not support["graph_safe"]:
            return f"not graph-safe yet: {support['reason']}"
    return None


def _sweep_row(config_name, settings, model, batch, context, mode, layout, attend_name, ceilings) -> dict:
    """A row of the roofline sweep: :func:`~.decoder_graphs.time_static` on a random static cache."""
    config = CONFIGS[config_name]
    row = _row_head(config_name, settings, batch, context, mode, layout, attend_name)
    why = (_attend_problem(attend_name, settings)
           or _fits(config, settings, batch, context, layout == "paged" and attend_name == "sdpa", prefill=False)
           or _graph_problem(mode, attend_name, settings))
    if why is not None:
        return {**row, "status": "skipped", "reason": why}
    try:
        timing = time_static(model, mode, graph_attend(attend_name, settings), batch=batch, context=context,
                             steps=settings.steps, warmup=settings.warmup, paged=layout == "paged",
                             page_size=settings.page_size, seed=settings.seed,
                             compile_options=_compile_options(settings) if mode == "compile" else None)
    except Exception as error:  # noqa: BLE001 - recorded, the run goes on

        return {**row, "status": "failed", "reason": error_line(error)}
    finally:
        if mode == "compile":
            torch._dynamo.reset()  # its graphs hold the cache's addresses: nothing later reuses them
        free_device_memory()
    row.update(status="ok", tokens_per_s=round_significant(timing["tokens_per_s"], 4), ms_per_step=round_significant(timing["ms_per_step"], 4),
               attention_ms_per_step=None, attention_share=None, captured=timing["captured"],
               capacity=timing["capacity"], setup_s=round_significant(timing["setup_s"], 3),
               first_call_s=round_significant(timing["first_call_s"], 3))
    row.update(roofline_fields(config, settings, batch, timing["mean_context"], timing["ms_per_step"], ceilings))
    return row


def add_ratios(results: dict) -> dict:
    """Each timed row's tokens/s over SDPA's in the same mode on the same model, batch, context and layout
    (``vs_sdpa``), and over SDPA's in that mode on the contiguous cache (``vs_sdpa_contiguous``); wb's eager paged rows
    also over FlashInfer's (``vs_flashinfer``, both reading the same paged cache); a compiled row over the graph of
    SDPA (``vs_graph_sdpa``); a graph or compiled row over the eager row of its attention and layout, where the eager
    rows have that cell (``vs_eager``)."""
    ok = {r["key"]: r for r in results["records"] if r.get("status") == "ok"}
    for r in ok.values():
        mode = r.get("mode", "eager")
        base = f"{r['config']}|{r['dtype']}|B{r['batch']}|L{r['context']}"
        wanted = ((("vs_sdpa", mode, r["layout"], "sdpa"),) if r["attend"] != "sdpa" else ()) + \
            ((("vs_sdpa_contiguous", mode, "contiguous", "sdpa"),) if r["layout"] != "contiguous" else ())
        if mode == "compile":
            wanted += (("vs_graph_sdpa", "graph", r["layout"], "sdpa"),)
        if mode != "eager":
            wanted += (("vs_eager", "eager", r["layout"], r["attend"]),)
        if mode in ("eager", "graph") and r["attend"] == "wb" and r["layout"] == "paged":
            wanted += (("vs_flashinfer", mode, "paged", "flashinfer"),)
        for field, other_mode, layout, attend in wanted:
            other = ok.get(f"{base}|{other_mode}|{layout}|{attend}")
            if other is not None:
                r[field] = round_significant(r["tokens_per_s"] / other["tokens_per_s"], 3)
    return results


# The greedy check's attentions against SDPA on the contiguous cache, eager: wb on both layouts, FlashInfer on the
# paged one; then the sweep's modes (mode, layout, attend), each against the same eager SDPA
GREEDY_OTHERS = (("wb", "contiguous"), ("wb", "paged"), ("flashinfer", "paged"))


GREEDY_MODES = (("graph", "contiguous", "sdpa"), ("graph", "contiguous", "wb"), ("graph", "paged", "wb"),
                ("graph", "paged", "flashinfer"), ("compile", "contiguous", "sdpa"), ("compile", "contiguous", "wb"))


def _greedy_prompt(config_name, settings, model) -> torch.Tensor:
    generator = torch.Generator().manual_seed(settings.seed + 1)
    return torch.randint(0, CONFIGS[config_name].vocab_size, (settings.greedy_batch, settings.greedy_prompt),
                         generator=generator).to(model.device)


def _greedy_record(config_name, settings, other: str, layout: str) -> dict:
    return {"config": config_name, "dtype": settings.dtype, "batch": settings.greedy_batch,
            "prompt_len": settings.greedy_prompt, "new_tokens": settings.greedy_tokens,
            "reference": "sdpa, contiguous", "other": other,
            "page_size": settings.page_size if layout == "paged" else None}


def _greedy(config_name, settings, model, done=frozenset()) -> list:
    """The eager greedy check of one model: each of :data:`GREEDY_OTHERS` against SDPA on the contiguous cache
    (those whose ``other`` is in `done` were measured by the run this one resumes)."""
    prompt = _greedy_prompt(config_name, settings, model)
    records = []
    for attend_name, layout in GREEDY_OTHERS:
        record = _greedy_record(config_name, settings, f"{attend_name}, {layout}", layout)
        if (config_name, record["other"]) in done:
            continue
        why = _attend_problem(attend_name, settings)
        if why is not None:
            record.update(status="skipped", reason=why)
            records.append(record)
            continue
        try:
            record.update(status="ok", **compare_greedy(model, prompt, settings.greedy_tokens, dec.sdpa_attend,
                                                        ATTENDS[attend_name], other_paged=layout == "paged",
                                                        page_size=settings.page_size))
            record["note"] = greedy_note(record)
        except Exception as error:  # noqa: BLE001 - recorded, the run goes on

            record.update(status="failed", reason=error_line(error))
        finally:
            free_device_memory()
        records.append(record)
    return records


def compile_check_shape(settings: Settings) -> tuple:
    """(batch, cache capacity) of the compiled step's greedy check: those of the first compiled cell (its batch of the
    greedy prompts, its timed capacity) when they hold the prompts and their new tokens, else the greedy check's own."""
    own = (settings.greedy_batch, settings.greedy_prompt + settings.greedy_tokens)
    if not settings.compile_cells:
        return own
    batch, context = settings.compile_cells[0]
    capacity = context + max(settings.warmup, 3) + settings.steps  # time_static's cache for that cell
    if batch <= settings.greedy_batch and capacity >= settings.greedy_prompt + settings.greedy_tokens - 1:
        return batch, capacity
    return own


def greedy_mode(config_name, settings, model, mode: str, layout: str, attend_name: str) -> dict:
    """The greedy check of one of the sweep's modes (:data:`GREEDY_MODES`) against the eager decoder with SDPA on the
    contiguous cache: the graph's buckets up to `greedy_batch` are all captured, so the check replays the bucket
    that holds it. The compiled step is checked with the batch and cache of the first compiled cell when the prompts
    fit it (:func:`compile_check_shape`): the same shapes, so Inductor's cache serves the compilation again."""
    record = _greedy_record(config_name, settings, f"{attend_name}, {layout}, {mode}", layout)
    why = _attend_problem(attend_name, settings) or _graph_problem(mode, attend_name, settings)
    if why is not None:
        return {**record, "status": "skipped", "reason": why}
    prompt = _greedy_prompt(config_name, settings, model)
    capacity = settings.greedy_prompt + settings.greedy_tokens
    if mode == "compile":
        batch, capacity = compile_check_shape(settings)
        prompt = prompt[:batch]
        record["batch"] = batch
    reference = EagerRunner(model, dec.sdpa_attend, capacity=capacity)
    try:
        attend = graph_attend(attend_name, settings)
        if mode == "graph":
            other = GraphedDecoder(model, attend, max_batch=settings.greedy_batch, capacity=capacity,
                                   paged=layout == "paged", page_size=settings.page_size)
            record["buckets"] = list(other.buckets)
            record["captured"] = other.captured
            if other.captured:
                # the graph against the same step run eagerly: the same kernels, so the very same tokens
                # (an attention of its own: FlashInfer's graph form holds one runner's wrappers and plans)
                same_step = GraphedDecoder(model, graph_attend(attend_name, settings),
                                           max_batch=settings.greedy_batch, capacity=capacity,
                                           paged=layout == "paged", page_size=settings.page_size, capture=False)
                uncaptured = compare_runners(same_step, other, prompt, settings.greedy_tokens, model.dtype)
                record["vs_uncaptured"] = {"identical": uncaptured["identical"],
                                           "max_logit_diff": uncaptured["max_logit_diff"]}
                del same_step
        else:
            cache = model.new_cache(prompt.shape[0], capacity, paged=layout == "paged", page_size=settings.page_size)
            other = CompiledDecoder(model, attend, cache=cache, **_compile_options(settings))
        record.update(status="ok", **compare_runners(reference, other, prompt, settings.greedy_tokens, model.dtype))
        record["note"] = greedy_note(record)
        if "vs_uncaptured" in record:
            same = record["vs_uncaptured"]
            record["note"] += (". Against the same step uncaptured: " + (
                "identical tokens" if same["identical"] else
                f"the tokens differ (logits by up to {same['max_logit_diff']:.3g}): the graph does not replay its "
                "step, a bug"))
    except Exception as error:  # noqa: BLE001 - recorded, the run goes on

        record.update(status="failed", reason=error_line(error))
    finally:
        if mode == "compile":
            torch._dynamo.reset()
        free_device_memory()
    return record


def _open(settings: Settings, out_path: Path, *, smoke: bool, command, resume: bool, log) -> dict:
    """The results to add to: `out_path` as it is when it holds a run of the same settings on this device that did
    not finish (a run stopped by its time budget), else a new one."""

    env = environment()
    if resume and out_path.exists():
        try:
            old = load_results(out_path)
        except (OSError, ValueError):
            old = None
        same = (old is not None and old.get("kind") == KIND and old.get("settings") == json_roundtrip(asdict(settings))
                and (old.get("environment") or {}).get("device") == env["device"])
        if same and not old.get("complete"):
            old.setdefault("resumed", []).append(env.get("date"))
            log(f"resuming {out_path}: {len(old['records'])} rows and {len(old['greedy'])} greedy checks done")
            return old
        if old is not None:
            log(f"{out_path} holds " + ("a finished run of these settings" if same else "another run")
                + ": starting a new one (it is overwritten as rows come)")
    return {"schema": SCHEMA_VERSION, "kind": KIND, "mode": "smoke" if smoke else "gpu", "environment": env,
            "command": command, "settings": json_roundtrip(asdict(settings)), "notes": NOTES,
            "configs": {name: {"params": CONFIGS[name].params(), "n_layers": CONFIGS[name].n_layers,
                               "dim": CONFIGS[name].dim, "n_heads": CONFIGS[name].n_heads,
                               "n_kv_heads": CONFIGS[name].n_kv_heads, "head_dim": CONFIGS[name].head_dim}
                        for name in dict.fromkeys(settings.configs + settings.sweep_configs)},
            "ceilings": None, "wb_graph_support": None, "records": [], "greedy": [], "complete": False}


def _row_line(row: dict, done: int, total: int) -> str:
    head = (f"  [{done}/{total}] {row['config']} B={row['batch']} context={row['context']} {row['mode']} "
            f"{row['layout']} {row['attend']}: ")
    if row["status"] != "ok":
        return head + f"{row['status']}: {row['reason']}"
    share = row.get("attention_share")
    return head + (f"{row['tokens_per_s']:.0f} tokens/s, {row['ms_per_step']:.3g} ms/step, "
                   f"{100 * row['fraction_of_roofline']:.0f} percent of the roofline"
                   + (f", attention {100 * share:.0f} percent" if share is not None else ""))


def run_tokens(settings: Settings, out_path, *, smoke: bool = False, command: str | None = None,
               progress: bool = True, time_budget: float | None = None, resume: bool = True) -> dict:
    """Measure `settings` into the JSON file `out_path` (written after every row); return the results.

    `time_budget` (seconds): no row or check starts after it; the file then says ``complete: false``, and the same
    call (the same command) resumes it, skipping what it holds."""

    check_settings(settings)
    started = time.monotonic()
    out_path = Path(out_path)
    log = functools.partial(log_line, progress)
    results = _open(settings, out_path, smoke=smoke, command=command, resume=resume, log=log)
    plan = _plan(settings)
    # a resumed run tries again what failed (an earlier row's memory, a killed process): once per command
    results["records"] = [r for r in results["records"] if r.get("status") != "failed"]
    results["greedy"] = [g for g in results["greedy"] if g.get("status") != "failed"]
    done_rows = {r["key"] for r in results["records"]}
    done_greedy = {(g["config"], g["other"]) for g in results["greedy"]}
    checks = sum(len(work) for _, phase, work in _stages(settings) if phase == "greedy")
    log(f"{len(plan)} rows and {checks} greedy checks on {results['environment']['device']}, into {out_path}"
        + (f" (about {estimate_seconds(settings) / 60:.1f} min on an H100)" if settings.device == "cuda" else "")
        + (f"; {len(done_rows)} rows already there" if done_rows else ""))
    if results["ceilings"] is None:
        log("measuring the ceilings (copy bandwidth" + (", matmul peaks)" if settings.device == "cuda" else ")"))
        results["ceilings"] = measure_run_ceilings(settings)
        save_results(results, out_path)
    ceilings = results["ceilings"]

    def out_of_time(expected_s: float = 0.0) -> bool:
        """Past the budget, or would be after `expected_s` more (a compilation: do not start what cannot end), or
        asked to stop (SIGTERM, see main)."""
        return _STOP["requested"] or (time_budget is not None
                                      and time.monotonic() - started + expected_s > time_budget)

    def store(row) -> None:
        results["records"].append(row)
        add_ratios(results)
        save_results(results, out_path)
        log(_row_line(row, len(results["records"]), len(plan)))

    def store_greedy(record) -> None:
        results["greedy"].append(record)
        save_results(results, out_path)
        log(f"  {record['other']} vs {record['reference']}: "
            + (record["note"] if record["status"] == "ok" else f"{record['status']}: {record['reason']}"))

    dtype = getattr(torch, settings.dtype)
    stopped = False
    model, model_name = None, None
    for config_name, phase, work in _stages(settings):
        if phase == "rows":
            work = [row for row in work if row_key(config_name, settings.dtype, *row[1:]) not in done_rows]
        else:
            work = [check for check in work if (config_name, _greedy_other(*check)) not in done_greedy]
        if not work:
            continue
        compiling = (work[0][3] if phase == "rows" else work[0][0]) == "compile"
        if out_of_time(COMPILE_GUESS_S if compiling else 0.0):
            stopped = True
            break
        if model_name != config_name:
            model = None
            free_device_memory()
            log(f"{config_name}: {CONFIGS[config_name].params() / 1e9:.2f} billion parameters, random weights "
                f"in {settings.dtype} on {settings.device}")
            model = dec.Decoder(CONFIGS[config_name], dtype=dtype, device=settings.device, seed=settings.seed)
            model_name = config_name
            warm_up_kernels(model, settings, progress)
        if phase == "rows" and work[0][3] != "eager" and results["wb_graph_support"] is None:
            if settings.device == "cuda":
                log("asking whether wb.decode can be captured in a CUDA graph (a probe in its own process)")
                results["wb_graph_support"] = wb_decode_graph_support(settings.dtype, settings.num_splits)
            else:
                results["wb_graph_support"] = {"graph_safe": None, "reason": "on the CPU nothing is captured: the "
                                                                            "graph rows run the static step eagerly"}
            log(f"wb.decode in a CUDA graph: {results['wb_graph_support']}")
            save_results(results, out_path)
        if phase == "greedy":
            log(f"{config_name}: greedy check ({work[0][0]}), {settings.greedy_batch} prompts of "
                f"{settings.greedy_prompt} tokens, {settings.greedy_tokens} new tokens each")
            if work[0][0] == "eager":
                for record in _greedy(config_name, settings, model, done_greedy):
                    store_greedy(record)
                continue
        for item in work:
            if out_of_time(COMPILE_GUESS_S if compiling else 0.0):
                stopped = True
                break
            if phase == "greedy":
                store_greedy(greedy_mode(config_name, settings, model, *item))
            elif item[3] == "eager":
                store(_row(config_name, settings, model, *item[1:3], *item[4:], ceilings))
            else:
                store(_sweep_row(config_name, settings, model, *item[1:], ceilings))
        if stopped:
            break
    model = None
    free_device_memory()
    elapsed = round(time.monotonic() - started, 1)
    results.update(complete=not stopped, elapsed_s=round(results.get("elapsed_s", 0) + elapsed, 1)
                   if results.get("resumed") else elapsed)
    save_results(results, out_path)
    if stopped and not _STOP["requested"]:  # (a SIGTERM whose exception some code swallowed: main says so)
        log(f"stopped after {time_budget:.0f} s (--time-budget), {len(results['records'])} of {len(plan)} rows done: "
            "run the same command again to continue")
    return results


def _ints(text: str) -> tuple:
    try:
        values = tuple(int(part) for part in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    return values


def _names(text: str) -> tuple:
    return tuple(part.strip().lower() for part in text.split(",") if part.strip())


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m wb_kernels.bench.decoder_tokens",
                                     formatter_class=argparse.RawDescriptionHelpFormatter,
                                     description=__doc__.split("\n\n")[0], epilog=__doc__.split("\n\n", 1)[1])
    parser.add_argument("--json", type=Path, default=None, metavar="PATH",
                        help="the results file (default: results/decode/decoder_<gpu>.json, or decoder_smoke.json)")
    parser.add_argument("--smoke", action="store_true",
                        help="TINY in float32 on the CPU, a few steps: checks the whole path in seconds")
    parser.add_argument("--configs", type=_names, help=f"models, comma-separated, among {', '.join(CONFIGS)}")
    parser.add_argument("--dtype", choices=("float16", "bfloat16", "float32"))
    parser.add_argument("--batches", type=_ints, help="batch sizes, comma-separated (GPU default: 1,16)")
    parser.add_argument("--contexts", type=_ints, help="prompt lengths, comma-separated (GPU default: 1024,8192)")
    parser.add_argument("--steps", type=int, help="timed decode steps per row (GPU default: 64)")
    parser.add_argument("--warmup", type=int, help="untimed decode steps before them (default: 3)")
    parser.add_argument("--page-size", type=int, help="keys per page of the paged cache (GPU default: 16)")
    parser.add_argument("--greedy-batch", type=int, help="prompts in the greedy check (GPU default: 8)")
    parser.add_argument("--greedy-prompt", type=int, help="their length (GPU default: 1024)")
    parser.add_argument("--greedy-tokens", type=int, help="new tokens each (GPU default: 32)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--sweep-configs", type=_names, help="models of the roofline sweep (GPU default: llama_1b; "
                                                             "'none': no sweep)")
    parser.add_argument("--sweep-batches", type=_ints, help="its batch sizes (GPU default: 1,8,64)")
    parser.add_argument("--sweep-contexts", type=_ints, help="its contexts (GPU default: 1024,8192,32768)")
    parser.add_argument("--compile-cells", type=_cells, help="BxL cells of the sweep where torch.compile runs, e.g. "
                                                             "1x1024,64x8192 (GPU default); 'none': nowhere")
    parser.add_argument("--num-splits", type=int, help="wb.decode's split count in a graph (default: its choice "
                                                       "from the cache's capacity)")
    parser.add_argument("--time-budget", type=float, metavar="SECONDS",
                        help="start no row after this many seconds; the same command resumes the file")
    parser.add_argument("--fresh", action="store_true", help="start a new file instead of resuming an unfinished one")
    parser.add_argument("--figure", type=Path, default=None, metavar="PNG",
                        help="the roofline chart (GPU default: figures/07_decoder_roofline_<gpu>.png)")
    parser.add_argument("--plan", action="store_true", help="print the rows this command would run and the plan's "
                                                            "time on an H100, run nothing (works without a GPU)")
    parser.add_argument("--no-progress", action="store_true", help="no progress lines on stderr")
    variants = parser.add_argument_group(
        "the compiled step's variants (--variants): the bar of the decoder at its roofline",
        "Each variant of decoder_graphs.COMPILE_VARIANTS compiled at batch 1 for each of --contexts (default 1024), "
        "its greedy tokens checked against the eager decoder, then timed --repeats times; into "
        "results/decode/decoder_variants_<gpu>.json (or --json). --steps, --warmup, --greedy-tokens, --dtype, "
        "--configs (one), --seed, --num-splits, --time-budget, --smoke and --plan apply; the other options do not.")
    variants.add_argument("--variants", metavar="NAMES",
                          help="comma-separated among " + ", ".join(COMPILE_VARIANTS) + "; 'default' ("
                               + ", ".join(DEFAULT_VARIANTS) + ") or 'all'; the baseline reduce-overhead always "
                               "runs first")
    variants.add_argument("--repeats", type=int, help="timed runs of --steps steps per variant (default: 5; the "
                                                      "median is its ms/step)")
    variants.add_argument("--attend", choices=("wb", "sdpa"), help="the compiled step's attention (default: wb)")
    variants.add_argument("--profile-steps", type=int, metavar="N",
                          help="after each variant's timing, N steps under torch.profiler: kernels per step, their "
                               "time by kind and the top kernels, in the record's 'profile' (default: 0, none)")
    return parser


def describe_plan(settings: Settings) -> str:
    """The rows and checks `settings` run, in the order they run, and the plan's time: what ``--plan`` prints."""
    lines = []
    for name, phase, work in _stages(settings):
        if phase == "rows":
            lines += [row_key(name, settings.dtype, *row[1:]) for row in work]
        else:
            lines += [f"greedy check {name}: {_greedy_other(*check)} against sdpa, contiguous (eager)"
                      for check in work]
    rows = sum(1 for line in lines if not line.startswith("greedy"))
    return "\n".join(lines + [f"{rows} rows, {len(lines) - rows} greedy checks; about "
                              f"{estimate_seconds(settings) / 60:.1f} min on an H100 (a plan, not a measurement)"])


def _cells(text: str) -> tuple:
    if text.strip().lower() == "none":
        return ()
    try:
        return tuple(tuple(int(x) for x in part.lower().split("x")) for part in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected cells like 1x1024,64x8192, got {text!r}") from None


def main(argv=None) -> int:
    from ..timing import on_gpu

    parser = _parser()
    args = parser.parse_args(argv)
    if not (args.smoke or args.plan) and not on_gpu():
        print("error: the decoder benchmark times LLAMA_1B in 16-bit through wb.decode's CUDA kernel and needs a "
              "CUDA GPU; this machine has none. --smoke runs the TINY model on the CPU instead.", file=sys.stderr)
        return 2
    if args.variants is not None:
        args.argv = list(argv if argv is not None else sys.argv[1:])
        return variants_main(args, parser)
    if args.repeats is not None or args.attend is not None:
        parser.error("--repeats and --attend belong to --variants")
    base = SMOKE_SETTINGS if args.smoke else GPU_SETTINGS
    chosen = {name: getattr(args, name) for name in ("configs", "dtype", "batches", "contexts", "steps", "warmup",
                                                     "page_size", "greedy_batch", "greedy_prompt", "greedy_tokens",
                                                     "seed", "sweep_configs", "sweep_batches", "sweep_contexts",
                                                     "compile_cells", "num_splits") if getattr(args, name) is not None}
    if chosen.get("sweep_configs") == ("none",):
        chosen.update(sweep_configs=(), sweep_batches=(), sweep_contexts=(), compile_cells=())
    settings = replace(base, **chosen)
    if args.smoke and (settings.configs != ("tiny",) or settings.sweep_configs not in ((), ("tiny",))):
        parser.error("--smoke runs on the CPU: only --configs tiny (the 1B models need a GPU)")
    try:
        check_settings(settings)
    except ValueError as error:
        parser.error(str(error))
    if args.plan:
        print(describe_plan(settings))
        return 0
    out = args.json if args.json is not None else default_output(args.smoke)
    command = "python -m wb_kernels.bench.decoder_tokens " + " ".join(argv if argv is not None else sys.argv[1:])
    if args.smoke:
        torch.set_num_threads(1)  # TINY's matrices are tiny: threads cost more than they save
    # what the end needs, imported before the run: a SIGTERM that lands inside an import leaves that module broken
    from ..plots import figures_dir, style
    from ..stages.decode import decoder_table
    from ..models.decoder_roofline import roofline_chart, roofline_summary

    _STOP["requested"] = False
    try:
        previous = signal.signal(signal.SIGTERM, _stop_on_sigterm)
    except ValueError:  # not the main thread: no handler, the run stops where SIGTERM finds it
        previous = None
    try:
        results = run_tokens(settings, out, smoke=args.smoke, command=command.strip(), progress=not args.no_progress,
                             time_budget=args.time_budget, resume=not args.fresh)
    except _Stopped:
        results = load_results(out)  # every row finished so far (the file is saved after each)
    finally:
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)
    if _STOP["requested"]:
        print("stopped by SIGTERM: the file holds the rows finished so far; run the same command again to resume",
              file=sys.stderr)

    print(decoder_table(results))
    chart_config = (settings.sweep_configs or settings.configs)[0]
    print(f"{chart_config} against its step's roofline (copy {results['ceilings']['copy_gbps']} GB/s):")
    for line in roofline_summary(results, config=chart_config):
        print("  " + line)
    print(f"wrote {out}" + ("" if results["complete"] else " (not finished: run the same command again to resume)"))
    figure = args.figure
    if figure is None and not args.smoke:
        figure = figures_dir() / f"07_decoder_roofline_{gpu_short_name()}.png"
    if figure is not None:
        figure = Path(figure)
        figure.parent.mkdir(parents=True, exist_ok=True)
        with style():
            roofline_chart(results, config=chart_config).savefig(
                figure, metadata={"Software": None})
        print(f"wrote {figure}")
    failed = [r for r in results["records"] + results["greedy"] if r.get("status") == "failed"
              or (r.get("vs_uncaptured") or {}).get("identical") is False]
    return 1 if failed else 0


class _Stopped(BaseException):
    """SIGTERM arrived: the run stops where it is (its file is saved after every row). A BaseException, as
    KeyboardInterrupt is, so that no row's ``except Exception`` records it as that row's failure."""


_STOP = {"requested": False}


def _stop_on_sigterm(signum, frame):
    """Stop now (the exception) and, should some code swallow it, at the next row (the flag out_of_time reads)."""
    _STOP["requested"] = True
    raise _Stopped()


if __name__ == "__main__":
    sys.exit(main())
