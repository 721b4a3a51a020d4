"""Tokens per second of lesson 07's LLaMA-shaped decoder against its step's roofline: eager, in a CUDA graph per
batch and under ``torch.compile``, with its attention by SDPA, by ``wb.decode`` and by FlashInfer's paged decode where
it is installed (lesson 07_decode reads the committed file; the README shows its roofline chart).

    python -m wb_kernels.models.decoder_tokens --time-budget 300   # on a GPU: results/decode/decoder_<gpu>.json and
                                                                   # figures/07_decoder_roofline_<gpu>.png
    python -m wb_kernels.models.decoder_tokens --sweep-configs none --configs llama_1b    # the eager rows only
    python -m wb_kernels.models.decoder_tokens --smoke  # TINY on the CPU in float32: seconds, for the tests

On a GPU, by default, in float16:

1. **Eager** (the decoder as it is, every step launched from Python): ``LLAMA_1B`` and ``LLAMA_1B_D128``, batch 1 and
   16, prompts (the context) of 1024 and 8192 tokens, each timed by :func:`~.llama_decoder.time_decode` (a real
   prefill, 32 greedy decode steps after 3 untimed ones, CUDA events) five times: ``sdpa_attend`` and ``wb_attend``
   on a contiguous cache and on a paged one (pages of 16 keys, shuffled), and ``FlashInferAttend`` on the paged one
   (where flashinfer is installed; elsewhere the row says why it is missing). These rows also give the attention's
   ms and share of the step. Then the greedy check of each model (:func:`compare_greedy`).
2. **The roofline sweep** (``LLAMA_1B``, batch 1, 8 and 64, contexts 1k, 8k and 32k): the step without its host
   overhead (:mod:`.decoder_graphs`), on a static cache filled with random keys and values: one CUDA graph per batch
   with SDPA and with ``wb.decode`` (while ``wb.decode`` is not graph-safe, its rows say so and why), on both
   layouts, and with FlashInfer on the paged one (``FlashInferGraphAttend``: its run captured, planned on the host
   before every replay, as vLLM's and SGLang's FlashInfer backends do); then ``torch.compile(mode="reduce-overhead")``
   with SDPA at batch 1 and 1k keys (each cell compiles the step: the slowest rows, so they come last). The greedy
   check of each mode against the eager decoder with SDPA, and of each graph against the same step uncaptured (which
   must give the very same tokens).

Every row records tokens/s, ms per step, the bytes a step must read (every weight once, and the KV cache at the mean
context of its timed steps) and the fraction of the step's roofline reached (:func:`~.llama_decoder.
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
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import torch

from . import llama_decoder as dec
from .decoder_graphs import (COMPILE_VARIANTS, DEFAULT_VARIANTS, CompiledDecoder, EagerRunner, GraphedDecoder,
                             time_static, variant_names, wb_decode_graph_support)
from .decoder_greedy import ROUNDING_ULPS, compare_greedy, compare_runners, greedy_note as _greedy_note  # noqa: F401

__all__ = ["CONFIGS", "Settings", "GPU_SETTINGS", "SMOKE_SETTINGS", "ATTENDS", "check_settings", "compare_greedy",
           "run_tokens", "default_output", "main"]

CONFIGS = {"tiny": dec.TINY, "llama_1b": dec.LLAMA_1B, "llama_1b_d128": dec.LLAMA_1B_D128}
ATTENDS = {"sdpa": dec.sdpa_attend, "wb": dec.wb_attend, "flashinfer": dec.FlashInferAttend()}
LAYOUTS = ("contiguous", "paged")
# FlashInfer's batch decode reads a paged cache only: it runs on that layout, beside SDPA and wb on both
ATTEND_LAYOUTS = {"flashinfer": ("paged",)}
KIND = "decoder_tokens"  # the results file's "kind": not a decode-kernel benchmark (those are "decode")

# Upper bounds of the settings: with them no single row can run for long, whatever the command line says.
MAX_BATCH = 256
MAX_STEPS = 1024
MAX_GREEDY_TOKENS = 256


@dataclass(frozen=True)
class Settings:
    """What one run measures."""

    configs: tuple  # names in CONFIGS
    dtype: str  # a torch dtype's name
    device: str
    batches: tuple
    contexts: tuple  # prompt lengths: the timed steps see context + 1 to context + steps keys
    steps: int  # timed decode steps per row
    warmup: int  # untimed decode steps before them
    page_size: int
    greedy_batch: int
    greedy_prompt: int
    greedy_tokens: int  # new tokens per sequence in the greedy check (the first comes from the prefill)
    seed: int = 0
    # The roofline sweep: the step without its host overhead (a CUDA graph per batch, torch.compile), on a static
    # cache filled with random keys and values to `context` (no prefill: a 64 x 32k prefill would not fit)
    sweep_configs: tuple = ()
    sweep_batches: tuple = ()
    sweep_contexts: tuple = ()
    compile_cells: tuple = ()  # ((batch, context), ...) of the sweep where torch.compile runs too (each compiles)
    compile_backend: str = "inductor"  # "inductor": mode="reduce-overhead"; "eager": traced only (the CPU smoke)
    num_splits: int | None = None  # wb.decode's split count in a graph (None: its choice from the capacity)


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

NOTES = {
    "modes": "eager: the decoder as it is, every step launched from Python (time_decode: a real prefill of the "
             "prompt, then the steps); graph: the step captured in one CUDA graph per batch (decoder_graphs."
             "GraphedDecoder: a static cache, the attention told the cache's capacity, the greedy token picked "
             "inside the graph); compile: torch.compile(mode='reduce-overhead', fullgraph=True) of the same step "
             "(decoder_graphs.CompiledDecoder, weights and cache marked static; compile_s: its first call). The "
             "graph and compile rows (the roofline sweep) start from a static cache filled with random keys and "
             "values up to `context` (no prefill: how fast a step runs does not depend on the cache's values); a "
             "graph row of wb.decode is skipped while wb.decode is not graph-safe (wb_graph_support). captured: "
             "whether the timed steps were CUDA-graph replays (false on the CPU; for compile, false when Inductor "
             "declined to capture, which its log says why)",
    "rows": "time_decode: `steps` greedy decode steps of `batch` random prompts of `context` tokens, after `warmup` "
            "untimed steps; on a GPU one pair of CUDA events around the steps and one around each attention call, "
            "read after the run. tokens_per_s = batch * steps / time; attention_share = the attention calls' time "
            "over the steps' time",
    "attends": "sdpa: llama_decoder.sdpa_attend (a paged cache is first gathered into a contiguous copy, then PyTorch's "
               "scaled_dot_product_attention with its FLASH, EFFICIENT and MATH backends: cuDNN's re-plans for every new key "
               "length, that is on every decode step, about 60 ms per call on an H100, see tune_*.json's "
               "sdpa_growing_cache); wb: llama_decoder.wb_attend, wb.decode (on a GPU in float16/bfloat16, the "
               "CUDA C++ kernel of flash_decode.cu), with the host's longest length as max_seqlen; flashinfer: "
               "llama_decoder.FlashInferAttend, FlashInfer's BatchDecodeWithPagedKVCacheWrapper (the attention vLLM and "
               "SGLang serve with) on the paged cache only, planned once per step and reused by every layer, as "
               "serving engines do (in a graph: llama_decoder.FlashInferGraphAttend, a wrapper made with "
               "use_cuda_graph=True whose run is captured, planned on the host before every replay with the length "
               "every sequence has then); where flashinfer is not installed its rows say so",
    "layouts": "contiguous: (B, Hk, capacity, D) per layer; paged: pools of page_size keys, the pages of the "
               "sequences handed out in a shuffled order",
    "vs_sdpa": "this row's tokens_per_s over SDPA's on the same model, batch, context and layout (>1: faster); "
               "vs_sdpa_contiguous: over SDPA's on the contiguous cache; vs_flashinfer (wb's paged rows): over "
               "FlashInfer's on the same paged cache",
    "roofline": "decode_step_roofline at the mean context of the timed steps (context + (steps + 1) / 2): every "
                "weight and the whole KV cache read once per step at the copy bandwidth of this run's ceilings, or "
                "the matmul FLOPs at its fp16 peak when that is longer; fraction_of_roofline = its step time over "
                "the measured one",
    "greedy": "the same random prompts, greedy, with the reference and the other attention in lockstep (each fed "
              "its own tokens). step 0 is the prefill's prediction (SDPA for every attention), step s >= 1 the "
              "s-th decode step. Logits are compared while a sequence's two runs have the same context: "
              "agree_to_rounding = their largest |difference| / the largest |logit| <= rounding_tolerance (16 x "
              "the dtype's eps: a guess with room, not a derived bound). At the first differing step: the "
              "reference's top-2 logit margin and that sequence's largest |logit difference|; near_tie = "
              "agree_to_rounding and margin <= 2 * that difference, so rounding can account for the flip (random "
              "weights make near ties common); otherwise the attention is suspect",
}


# ----------------------------------------------------------------------------------------------
# The settings
# ----------------------------------------------------------------------------------------------

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
    from ..bench.decode import gpu_short_name
    from ..bench.results import REPO_ROOT

    return REPO_ROOT / "results" / "decode" / f"decoder_{'smoke' if smoke else gpu_short_name()}.json"


# ----------------------------------------------------------------------------------------------
# The run
# ----------------------------------------------------------------------------------------------

def _round(x: float, digits: int = 5):
    from ..bench.results import _sig

    return _sig(x, digits)


def _log(progress: bool, text: str) -> None:
    if progress:
        print(text, file=sys.stderr, flush=True)


def _free_memory() -> None:
    from ..bench.measure import _free_device_memory

    _free_device_memory()


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


def _warm_up_kernels(model: dec.Decoder, settings: Settings, progress: bool) -> None:
    """Run wb_attend once on each layout before anything is timed: its first call on a GPU loads (or builds) the
    CUDA extension, which must not land in a row's time; time_decode's own warm-up steps then warm the rest. Off a
    GPU there is nothing to load (the simulator runs the kernels as Python). Either way wb.decode's operator is
    defined here, which a compiler cannot do while it traces (``python -m`` imports wb_kernels before torch, and on
    the CPU no eager call of wb.decode need come before the first compiled one)."""
    from ..ops import register

    register()
    if settings.device != "cuda":
        return
    _log(progress, "loading wb.decode's kernels (on a GPU the CUDA extension is built on first use when it is not "
                   "cached: a minute or two)")
    started = time.perf_counter()
    prompt = torch.zeros((1, 8), dtype=torch.long)
    for paged in (False, True):
        model.generate(prompt, 2, dec.wb_attend, paged=paged, page_size=settings.page_size)
    _log(progress, f"wb.decode ready after {time.perf_counter() - started:.1f} s")


def _ceilings(settings: Settings) -> dict:
    """The copy bandwidth (and, on a GPU, the matmul peaks) the rooflines use, measured now. On a GPU the decode
    benchmark's own ceilings; on the CPU a host copy, so that a smoke run's file has the same fields."""
    if settings.device == "cuda":
        from ..bench.measure import measure_ceilings

        return measure_ceilings()
    from ..bench.results import _sig
    from ..timing import time_call

    copy_bytes = 2**26
    source = torch.ones(copy_bytes // 4)
    target = torch.empty_like(source)
    timing = time_call(target.copy_, source, warmup=2, repeats=5, device="cpu")
    return {"copy_gbps": _sig(2.0 * copy_bytes / (timing.median_ms / 1e3) / 1e9), "copy_bytes": copy_bytes,
            "note": "a host memory copy (a smoke run on the CPU): the rooflines' fractions mean nothing here"}


def _attend_problem(attend_name: str, settings: Settings) -> str | None:
    """Why an attention cannot run in this run (FlashInfer: not installed, or the run is not on a CUDA GPU), or None."""
    if attend_name != "flashinfer":
        return None
    from ..bench.flashinfer import problem

    if settings.device != "cuda":
        return f"flashinfer runs on a CUDA GPU; this run is on the {settings.device}"
    return problem()


def _roofline_fields(config, settings, batch, mean_context, ms_per_step, ceilings) -> dict:
    """The step's roofline at `mean_context` keys and the fraction of it reached: every row's last fields."""
    itemsize = torch.empty((), dtype=getattr(torch, settings.dtype)).element_size()
    peak = ceilings.get(f"{settings.dtype}_matmul_tflops")
    roofline = dec.decode_step_roofline(config, batch=batch, context_len=round(mean_context), dtype_bytes=itemsize,
                                        bandwidth_bytes_per_s=ceilings["copy_gbps"] * 1e9,
                                        peak_flops_per_s=peak * 1e12 if peak else None)
    return {"bytes_per_step": roofline["bytes_per_step"],
            "roofline": {"context": round(mean_context), "step_ms": _round(roofline["step_time_s"] * 1e3, 4),
                         "tokens_per_s": _round(roofline["tokens_per_s"], 4),
                         "bytes_per_step": roofline["bytes_per_step"], "weight_bytes": roofline["weight_bytes"],
                         "kv_cache_bytes": roofline["kv_cache_bytes"], "kv_share": _round(roofline["kv_share"], 3),
                         "bandwidth_gbps": ceilings["copy_gbps"], "peak_tflops": peak},
            "fraction_of_roofline": _round(roofline["step_time_s"] * 1e3 / ms_per_step, 3)}


def _row_head(config_name, settings, batch, context, mode, layout, attend_name) -> dict:
    return {"key": row_key(config_name, settings.dtype, batch, context, mode, layout, attend_name), "kind": "decoder",
            "config": config_name, "dtype": settings.dtype, "batch": batch, "context": context, "mode": mode,
            "layout": layout, "page_size": settings.page_size if layout == "paged" else None, "attend": attend_name,
            "steps": settings.steps, "warmup": settings.warmup}


def _row(config_name, settings, model, batch, context, layout, attend_name, ceilings) -> dict:
    """An eager row: :func:`~.llama_decoder.time_decode` (a real prefill, then the steps as the decoder runs them)."""
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
        from ..bench.measure import _short

        return {**row, "status": "failed", "reason": _short(error)}
    finally:
        _free_memory()
    row.update(status="ok", **{name: _round(timing[name], 4) for name in
                               ("tokens_per_s", "ms_per_step", "attention_ms_per_step", "attention_share")})
    row.update(_roofline_fields(config, settings, batch, context + (settings.steps + 1) / 2, timing["ms_per_step"],
                                ceilings))
    return row


def graph_attend(attend_name: str, settings: Settings):
    """The attention a graph or a compiled step calls: SDPA as it is; wb.decode with the settings' split count;
    FlashInfer's graph form (a new one per runner: it holds that runner's wrappers and their plans)."""
    if attend_name == "flashinfer":
        return dec.FlashInferGraphAttend()
    if attend_name == "wb" and settings.num_splits is not None:
        return functools.partial(dec.wb_attend, num_splits=settings.num_splits)
    return ATTENDS[attend_name]


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
        from ..bench.measure import _short

        return {**row, "status": "failed", "reason": _short(error)}
    finally:
        if mode == "compile":
            torch._dynamo.reset()  # its graphs hold the cache's addresses: nothing later reuses them
        _free_memory()
    row.update(status="ok", tokens_per_s=_round(timing["tokens_per_s"], 4), ms_per_step=_round(timing["ms_per_step"], 4),
               attention_ms_per_step=None, attention_share=None, captured=timing["captured"],
               capacity=timing["capacity"], setup_s=_round(timing["setup_s"], 3),
               first_call_s=_round(timing["first_call_s"], 3))
    row.update(_roofline_fields(config, settings, batch, timing["mean_context"], timing["ms_per_step"], ceilings))
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
                r[field] = _round(r["tokens_per_s"] / other["tokens_per_s"], 3)
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
            record["note"] = _greedy_note(record)
        except Exception as error:  # noqa: BLE001 - recorded, the run goes on
            from ..bench.measure import _short

            record.update(status="failed", reason=_short(error))
        finally:
            _free_memory()
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
        record["note"] = _greedy_note(record)
        if "vs_uncaptured" in record:
            same = record["vs_uncaptured"]
            record["note"] += (". Against the same step uncaptured: " + (
                "identical tokens" if same["identical"] else
                f"the tokens differ (logits by up to {same['max_logit_diff']:.3g}): the graph does not replay its "
                "step, a bug"))
    except Exception as error:  # noqa: BLE001 - recorded, the run goes on
        from ..bench.measure import _short

        record.update(status="failed", reason=_short(error))
    finally:
        if mode == "compile":
            torch._dynamo.reset()
        _free_memory()
    return record


def _open(settings: Settings, out_path: Path, *, smoke: bool, command, resume: bool, log) -> dict:
    """The results to add to: `out_path` as it is when it holds a run of the same settings on this device that did
    not finish (a run stopped by its time budget), else a new one."""
    from ..bench.results import SCHEMA_VERSION, environment, load_results

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


def json_roundtrip(value):
    """`value` as it reads back from JSON (tuples become lists): what a resumed run compares its settings with."""
    import json

    return json.loads(json.dumps(value))


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
    from ..bench.results import save_results

    check_settings(settings)
    started = time.monotonic()
    out_path = Path(out_path)
    log = functools.partial(_log, progress)
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
        results["ceilings"] = _ceilings(settings)
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
            _free_memory()
            log(f"{config_name}: {CONFIGS[config_name].params() / 1e9:.2f} billion parameters, random weights "
                f"in {settings.dtype} on {settings.device}")
            model = dec.Decoder(CONFIGS[config_name], dtype=dtype, device=settings.device, seed=settings.seed)
            model_name = config_name
            _warm_up_kernels(model, settings, progress)
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
    _free_memory()
    elapsed = round(time.monotonic() - started, 1)
    results.update(complete=not stopped, elapsed_s=round(results.get("elapsed_s", 0) + elapsed, 1)
                   if results.get("resumed") else elapsed)
    save_results(results, out_path)
    if stopped:
        log(f"stopped after {time_budget:.0f} s (--time-budget), {len(results['records'])} of {len(plan)} rows done: "
            "run the same command again to continue")
    return results


# ----------------------------------------------------------------------------------------------
# The compiled step's variants: the bar of the decoder at its roofline (B1, 1,024 keys, wb.decode)
# ----------------------------------------------------------------------------------------------

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
    from .decoder_graphs import _cudagraph_skips, profile_compiled, time_compiled

    variant = COMPILE_VARIANTS[name]
    capacity = context + s.warmup + s.steps
    record = {**_variant_head(s, name, context), "description": variant.description,
              "mode": variant.mode, "options": dict(variant.options), "split_gate_up": variant.split_gate_up,
              "backend": s.backend, "config": s.config, "dtype": s.dtype, "attend": s.attend, "layout": "contiguous",
              "batch": 1, "capacity": capacity, "steps": s.steps, "warmup": s.warmup,
              "repeats": s.repeats}
    started = time.perf_counter()
    skips_before = _cudagraph_skips()
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
        greedy["note"] = _greedy_note(greedy)
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
                from ..bench.measure import _short

                profiled = {"status": "failed", "reason": _short(error)}
    except Exception as error:  # noqa: BLE001 - recorded, the next variant runs
        from ..bench.measure import _short

        return {**record, "status": "failed", "reason": _short(error),
                "wall_s": _round(time.perf_counter() - started, 3)}
    finally:
        del runner
        torch._dynamo.reset()  # its graphs hold this cache's addresses; the next variant compiles anew
        _free_memory()
    record.update(status="ok", compile_s=_round(compile_s, 3), wall_s=_round(time.perf_counter() - started, 3),
                  captured=s.device == "cuda" and s.backend == "inductor" and _cudagraph_skips() == skips_before,
                  ms_per_step=_round(timing["ms_per_step"], 4), ms_per_step_min=_round(timing["ms_per_step_min"], 4),
                  ms_per_step_repeats=[_round(t, 4) for t in timing["ms_per_step_repeats"]],
                  tokens_per_s=_round(timing["tokens_per_s"], 4), greedy_verdict=greedy_verdict(greedy),
                  greedy={"reference": "sdpa, contiguous, eager", "prompt_len": context,
                          "new_tokens": s.greedy_tokens, **greedy})
    record.update(_roofline_fields(CONFIGS[s.config], s, 1, timing["mean_context"], timing["ms_per_step"], ceilings))
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
    from ..bench.results import SCHEMA_VERSION, environment, save_results

    check_variant_settings(s)
    log = functools.partial(_log, progress)
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
        _warm_up_kernels(model, s, progress)
    started = time.monotonic()  # the budget counts from here: the extension's build is not the variants'
    log("measuring the ceilings")
    results["ceilings"] = _ceilings(s)
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
                _free_memory()
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
                record["vs_baseline"] = _round(baselines[context]["ms_per_step"] / record["ms_per_step"], 4)
        results["records"].append(record)
        save_results(results, out_path)
        log(_variant_line(record, baselines.get(context)))
    model = None
    _free_memory()
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
    import json

    from ..bench.results import REPO_ROOT

    readme = Path(readme) if readme is not None else REPO_ROOT / "README.md"
    text = readme.read_text()
    if README_VARIANTS_START not in text or README_VARIANTS_END not in text:
        raise ValueError(f"{readme} has no {README_VARIANTS_START} ... {README_VARIANTS_END} block to fill")
    source = Path(results_path).resolve()
    source = source.relative_to(REPO_ROOT) if source.is_relative_to(REPO_ROOT) else source
    line = variants_readme_line(json.loads(Path(results_path).read_text()), source=str(source))
    head, rest = text.split(README_VARIANTS_START, 1)
    tail = rest.split(README_VARIANTS_END, 1)[1]
    readme.write_text(f"{head}{README_VARIANTS_START}\n{line}\n{README_VARIANTS_END}{tail}")
    return readme


def default_variants_output(smoke: bool) -> Path:
    """results/decode/decoder_variants_<gpu>.json, or results/decode/decoder_variants_smoke.json."""
    from ..bench.decode import gpu_short_name
    from ..bench.results import REPO_ROOT

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
    command = "python -m wb_kernels.models.decoder_tokens " + " ".join(args.argv)
    if args.smoke:
        torch.set_num_threads(1)
    results = run_variants(settings, out, command=command.strip(), progress=not args.no_progress,
                           time_budget=args.time_budget, smoke=args.smoke)
    print(variants_summary(results))
    print(f"wrote {out}")
    suspect = [r for r in results["records"] if r.get("greedy_verdict") == "suspect"]
    return 1 if suspect else 0


# ----------------------------------------------------------------------------------------------
# The command line
# ----------------------------------------------------------------------------------------------

def _ints(text: str) -> tuple:
    try:
        values = tuple(int(part) for part in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    return values


def _names(text: str) -> tuple:
    return tuple(part.strip().lower() for part in text.split(",") if part.strip())


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m wb_kernels.models.decoder_tokens",
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
    command = "python -m wb_kernels.models.decoder_tokens " + " ".join(argv if argv is not None else sys.argv[1:])
    if args.smoke:
        torch.set_num_threads(1)  # TINY's matrices are tiny: threads cost more than they save
    # what the end needs, imported before the run: a SIGTERM that lands inside an import leaves that module broken
    from ..bench.decode import gpu_short_name
    from ..bench.results import load_results
    from ..plots import figures_dir, style
    from ..stages.decode.slider import decoder_table
    from .decoder_roofline import roofline_chart, roofline_summary

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
