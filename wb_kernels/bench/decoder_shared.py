"""What the decoder's two benchmark runs share (lesson 07; :mod:`.decoder_tokens` and :mod:`.decoder_variants`):
the models and attentions by name, a run's settings, its notes, the ceilings its rooflines use, the roofline fields
of a row, the kernels' warm-up and the attention a CUDA graph captures.
"""

from __future__ import annotations

import functools
import json
import sys
import time
from dataclasses import dataclass

import torch

from ..models import llama_decoder as dec
from ..results_files import round_significant

__all__ = ["CONFIGS", "ATTENDS", "MAX_STEPS", "NOTES", "Settings", "measure_run_ceilings", "roofline_fields",
           "warm_up_kernels", "graph_attend", "json_roundtrip", "log_line"]

CONFIGS = {"tiny": dec.TINY, "llama_1b": dec.LLAMA_1B, "llama_1b_d128": dec.LLAMA_1B_D128}


ATTENDS = {"sdpa": dec.sdpa_attend, "wb": dec.wb_attend, "flashinfer": dec.FlashInferAttend()}


MAX_STEPS = 1024


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
               "CUDA C++ kernels of stages/decode/), with the host's longest length as max_seqlen; flashinfer: "
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


def log_line(progress: bool, text: str) -> None:
    if progress:
        print(text, file=sys.stderr, flush=True)


def warm_up_kernels(model: dec.Decoder, settings: Settings, progress: bool) -> None:
    """Run wb_attend once on each layout before anything is timed: its first call on a GPU loads (or builds) the
    CUDA extension, which must not land in a row's time; time_decode's own warm-up steps then warm the rest. Off a
    GPU there is nothing to load (the simulator runs the kernels as Python). Either way wb.decode's operator is
    defined here, which a compiler cannot do while it traces (``python -m`` imports wb_kernels before torch, and on
    the CPU no eager call of wb.decode need come before the first compiled one)."""
    from ..torch_ops import register

    register()
    if settings.device != "cuda":
        return
    log_line(progress, "loading wb.decode's kernels (on a GPU the CUDA extension is built on first use when it is not "
                   "cached: a minute or two)")
    started = time.perf_counter()
    prompt = torch.zeros((1, 8), dtype=torch.long)
    for paged in (False, True):
        model.generate(prompt, 2, dec.wb_attend, paged=paged, page_size=settings.page_size)
    log_line(progress, f"wb.decode ready after {time.perf_counter() - started:.1f} s")


def measure_run_ceilings(settings: Settings) -> dict:
    """The copy bandwidth (and, on a GPU, the matmul peaks) the rooflines use, measured now. On a GPU the decode
    benchmark's own ceilings; on the CPU a host copy, so that a smoke run's file has the same fields."""
    if settings.device == "cuda":
        from .measure import measure_ceilings

        return measure_ceilings()
    from ..timing import time_call

    copy_bytes = 2**26
    source = torch.ones(copy_bytes // 4)
    target = torch.empty_like(source)
    timing = time_call(target.copy_, source, warmup=2, repeats=5, device="cpu")
    return {"copy_gbps": round_significant(2.0 * copy_bytes / (timing.median_ms / 1e3) / 1e9), "copy_bytes": copy_bytes,
            "note": "a host memory copy (a smoke run on the CPU): the rooflines' fractions mean nothing here"}


def roofline_fields(config, settings, batch, mean_context, ms_per_step, ceilings) -> dict:
    """The step's roofline at `mean_context` keys and the fraction of it reached: every row's last fields."""
    itemsize = torch.empty((), dtype=getattr(torch, settings.dtype)).element_size()
    peak = ceilings.get(f"{settings.dtype}_matmul_tflops")
    roofline = dec.decode_step_roofline(config, batch=batch, context_len=round(mean_context), dtype_bytes=itemsize,
                                        bandwidth_bytes_per_s=ceilings["copy_gbps"] * 1e9,
                                        peak_flops_per_s=peak * 1e12 if peak else None)
    return {"bytes_per_step": roofline["bytes_per_step"],
            "roofline": {"context": round(mean_context), "step_ms": round_significant(roofline["step_time_s"] * 1e3, 4),
                         "tokens_per_s": round_significant(roofline["tokens_per_s"], 4),
                         "bytes_per_step": roofline["bytes_per_step"], "weight_bytes": roofline["weight_bytes"],
                         "kv_cache_bytes": roofline["kv_cache_bytes"], "kv_share": round_significant(roofline["kv_share"], 3),
                         "bandwidth_gbps": ceilings["copy_gbps"], "peak_tflops": peak},
            "fraction_of_roofline": round_significant(roofline["step_time_s"] * 1e3 / ms_per_step, 3)}


def graph_attend(attend_name: str, settings: Settings):
    """The attention a graph or a compiled step calls: SDPA as it is; wb.decode with the settings' split count;
    FlashInfer's graph form (a new one per runner: it holds that runner's wrappers and their plans)."""
    if attend_name == "flashinfer":
        return dec.FlashInferGraphAttend()
    if attend_name == "wb" and settings.num_splits is not None:
        return functools.partial(dec.wb_attend, num_splits=settings.num_splits)
    return ATTENDS[attend_name]


def json_roundtrip(value):
    """`value` as it reads back from JSON (tuples become lists): what a resumed run compares its settings with."""

    return json.loads(json.dumps(value))
