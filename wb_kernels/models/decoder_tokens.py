"""Tokens per second of lesson 07's LLaMA-shaped decoder, with its attention by SDPA, by ``wb.decode`` and by
FlashInfer's paged decode where it is installed (lesson 07_decode reads the committed file).

    python -m wb_kernels.models.decoder_tokens          # on a GPU: results/decode/decoder_<gpu>.json (h100, h200, ...)
    python -m wb_kernels.models.decoder_tokens --json results/decode/decoder_h100.json --configs llama_1b
    python -m wb_kernels.models.decoder_tokens --smoke  # TINY on the CPU in float32: seconds, for the tests

On a GPU, by default: ``LLAMA_1B`` and ``LLAMA_1B_D128`` in float16, batch 1 and 16, prompts (the context) of 1024
and 8192 tokens. Each combination is timed by :func:`~.llama_decoder.time_decode` (64 greedy decode steps after 3
untimed ones, CUDA events) five times: attention by ``sdpa_attend`` and by ``wb_attend``, each on a contiguous
cache and on a paged one (pages of 16 keys, shuffled), and by ``FlashInferAttend`` on the paged one (where
flashinfer is installed; elsewhere the row says why it is missing). A row records tokens/s, ms per step, the attention's ms per
step and its share of the step; wb's tokens/s over SDPA's on the same cache layout (and, for the paged cache, over
SDPA's on the contiguous one); and the step's roofline (:func:`~.llama_decoder.decode_step_roofline`) at the copy
bandwidth and fp16 matmul peak measured in the same run (:func:`wb_kernels.bench.measure_ceilings`, the decode
benchmark's ceilings), with the fraction of it the step reached.

Then a greedy check per model: the same random prompts generate tokens with SDPA (contiguous cache) and with
``wb_attend`` (contiguous, then paged), then FlashInfer (paged), each pair of runs in lockstep (:func:`compare_greedy`). The file says whether the
tokens are identical, how far the two runs' logits differed while their contexts were the same (and whether that
is within rounding), and, if the tokens differ, the first step where they do, SDPA's margin between its top two
logits there and the logit difference there. The weights are random, so near ties between the two largest logits
are common, and 16-bit rounding may flip one: the record says whether rounding can account for the flip.

About a minute on an H100 once wb.decode's CUDA extension is built (the first call builds it when it is not
cached: a minute or two more). Every setting is bounded (see :func:`check_settings`), and a row whose cache and
prefill would not fit in the GPU's free memory is recorded as skipped. The file is rewritten after every row.
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import torch

from . import llama_decoder as dec

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


GPU_SETTINGS = Settings(configs=("llama_1b", "llama_1b_d128"), dtype="float16", device="cuda", batches=(1, 16),
                        contexts=(1024, 8192), steps=64, warmup=3, page_size=16, greedy_batch=8, greedy_prompt=1024,
                        greedy_tokens=32)
# TINY on the CPU; wb_attend runs on the CUDA simulator there (about a tenth of a second per call), so few steps.
SMOKE_SETTINGS = Settings(configs=("tiny",), dtype="float32", device="cpu", batches=(2,), contexts=(16,), steps=3,
                          warmup=1, page_size=4, greedy_batch=2, greedy_prompt=8, greedy_tokens=4)

NOTES = {
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
               "serving engines do; where flashinfer is not installed its rows say so",
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
    for name in s.configs:
        longest = CONFIGS[name].max_seq_len
        if max(s.contexts) + max(s.steps, s.warmup) > longest:
            raise ValueError(f"contexts: {max(s.contexts)} + {max(s.steps, s.warmup)} steps exceeds {name}'s "
                             f"max_seq_len={longest}")
        if s.greedy_prompt + s.greedy_tokens > longest:
            raise ValueError(f"greedy_prompt {s.greedy_prompt} + greedy_tokens {s.greedy_tokens} exceeds {name}'s "
                             f"max_seq_len={longest}")


def _plan(settings: Settings) -> list:
    """[(config name, batch, context, layout, attend)]: per model, from the smallest cache up, SDPA before wb on each
    layout (so a row's SDPA baseline is there when its ratio is computed)."""
    return [(name, batch, context, layout, attend)
            for name in settings.configs
            for batch, context in sorted(((b, c) for b in settings.batches for c in settings.contexts),
                                         key=lambda bc: (bc[0] * bc[1], bc))
            for layout in LAYOUTS for attend in ATTENDS if layout in ATTEND_LAYOUTS.get(attend, LAYOUTS)]


def estimate_seconds(settings: Settings) -> float:
    """About how long a run takes on an H100: each row's prefill at a guessed 300 TFLOP/s, its steps at the larger of
    a guessed 5 ms of launches and the roofline's bytes at 1.5 TB/s (half the copy rate, as SDPA on a paged cache
    copies it first), a second of bookkeeping; the ceilings, the greedy checks. A plan, not a measurement."""
    total = 10.0
    for name, batch, context, _, _ in _plan(settings):
        config = CONFIGS[name]
        prefill = 2 * config.params() * batch * context / 300e12
        step = dec.decode_step_roofline(config, batch=batch, context_len=context, dtype_bytes=2,
                                        bandwidth_bytes_per_s=1.5e12)["step_time_s"]
        total += 1.0 + prefill + (settings.steps + settings.warmup) * max(5e-3, step)
    greedy = len(settings.configs) * 2 * (settings.greedy_tokens * 2 * 5e-3 + 1.0)
    return total + greedy


def default_output(smoke: bool) -> Path:
    """results/decode/decoder_<gpu>.json (decoder_h100.json, ...), or results/decode/decoder_smoke.json."""
    from ..bench.decode import gpu_short_name
    from ..bench.results import REPO_ROOT

    return REPO_ROOT / "results" / "decode" / f"decoder_{'smoke' if smoke else gpu_short_name()}.json"


# ----------------------------------------------------------------------------------------------
# The greedy check
# ----------------------------------------------------------------------------------------------

# The logits of two correct attentions differ by their rounding, carried through every layer; an attention that is
# wrong moves them by a sizeable fraction of their range. The line between: 16 units of the dtype's rounding
# (torch.finfo(dtype).eps) times the largest |logit|. A guess with room, not a derived bound; the file keeps the
# numbers it is applied to.
ROUNDING_ULPS = 16


@torch.inference_mode()
def compare_greedy(model: dec.Decoder, prompt: torch.Tensor, new_tokens: int, reference, other, *,
                   reference_paged: bool = False, other_paged: bool = False, page_size: int = 16) -> dict:
    """Greedy generation of `new_tokens` per prompt (B, L) with the attention `reference` and with `other`, in
    lockstep: each run is fed its own tokens, and the two runs' logits are compared at every step.

    Step 0 is the prefill's prediction, step s the s-th decode step. A sequence's two runs see the same context at
    step s while none of its earlier tokens differed; the logits are compared only there (past it they differ
    because their inputs do). Returns:

    - ``identical`` (every token equal) and ``sequences_identical``;
    - ``max_logit_diff``, ``logit_absmax`` (the reference's largest |logit|), their ratio ``relative_logit_diff``,
      ``rounding_tolerance`` (:data:`ROUNDING_ULPS` x the dtype's eps) and ``agree_to_rounding`` (the ratio within
      it), and ``min_reference_margin`` (the reference's smallest gap between its top two logits);
    - ``first_divergence``: None, or the first differing step and sequence, both tokens, the reference's top-2
      margin and the largest |logit difference| of that sequence there, and ``near_tie``: the attentions agree to
      rounding and the margin is at most twice that difference, so their rounding can account for the flip.
    """
    if isinstance(new_tokens, bool) or not isinstance(new_tokens, int) or new_tokens < 1:
        raise ValueError(f"new_tokens={new_tokens!r}: expected an int >= 1")
    batch, length = prompt.shape
    caches = [model.new_cache(batch, length + new_tokens - 1, paged=paged, page_size=page_size)
              for paged in (reference_paged, other_paged)]
    logits = [model.prefill(prompt, cache) for cache in caches]
    tokens, margins, diffs, absmax = [], [], [], []
    for step in range(new_tokens):
        if step:
            logits = [model.decode_step(token, cache, attend)
                      for token, cache, attend in zip(tokens[-1], caches, (reference, other))]
        ref_logits, other_logits = (x.float() for x in logits)  # exact for 16-bit logits
        top2 = ref_logits.topk(2, dim=-1).values
        margins.append(top2[:, 0] - top2[:, 1])
        diffs.append((ref_logits - other_logits).abs().amax(dim=-1))
        absmax.append(ref_logits.abs().amax(dim=-1))
        tokens.append((logits[0].argmax(-1), logits[1].argmax(-1)))
    ref_tokens = torch.stack([t[0] for t in tokens], dim=1).cpu()  # (B, new_tokens)
    other_tokens = torch.stack([t[1] for t in tokens], dim=1).cpu()
    margins, diffs, absmax = (torch.stack(x, dim=1).cpu() for x in (margins, diffs, absmax))
    differ = ref_tokens != other_tokens
    agreed_so_far = torch.cat([torch.ones(batch, 1, dtype=torch.long), (~differ[:, :-1]).long()], dim=1)
    same_context = agreed_so_far.cumprod(dim=1).bool()  # (B, new_tokens)
    max_diff, logit_absmax = float(diffs[same_context].max()), float(absmax[same_context].max())
    relative = max_diff / logit_absmax if logit_absmax > 0 else math.inf
    tolerance = ROUNDING_ULPS * torch.finfo(model.dtype).eps
    record = {"identical": not bool(differ.any()), "sequences_identical": int((~differ).all(dim=1).sum()),
              "max_logit_diff": _round(max_diff), "logit_absmax": _round(logit_absmax),
              "relative_logit_diff": _round(relative, 3), "rounding_tolerance": _round(tolerance, 3),
              "agree_to_rounding": relative <= tolerance,
              "min_reference_margin": _round(float(margins[same_context].min())), "first_divergence": None}
    if differ.any():
        steps = torch.where(differ.any(dim=1), differ.float().argmax(dim=1), new_tokens)  # first differing step
        step = int(steps.min())
        sequence = int((steps == step).nonzero()[0])
        margin, diff = float(margins[sequence, step]), float(diffs[sequence, step])
        record["first_divergence"] = {
            "step": step, "sequence": sequence, "reference_token": int(ref_tokens[sequence, step]),
            "other_token": int(other_tokens[sequence, step]), "reference_top2_margin": _round(margin),
            "logit_max_abs_diff": _round(diff), "near_tie": record["agree_to_rounding"] and margin <= 2 * diff,
            "sequences_diverged": int((steps < new_tokens).sum())}
    return record


def _greedy_note(record: dict) -> str:
    """One sentence on a compare_greedy record, for the file and the log: what happened, and what it means."""
    agreement = (f"while the two runs saw the same context their logits differed by at most "
                 f"{record['max_logit_diff']:.3g} (relative to the largest |logit|: "
                 f"{record['relative_logit_diff']:.3g}, " + ("within" if record["agree_to_rounding"] else "beyond")
                 + f" the rounding tolerance {record['rounding_tolerance']:.3g})")
    first = record["first_divergence"]
    if first is None:
        return (f"identical tokens; {agreement}; the reference's smallest top-2 margin was "
                f"{record['min_reference_margin']:.3g}")
    text = (f"the tokens differ from step {first['step']} on (sequence {first['sequence']}; "
            f"{first['sequences_diverged']} of {record['sequences_identical'] + first['sequences_diverged']} "
            f"sequences diverge): there the reference's top two logits were {first['reference_top2_margin']:.3g} "
            f"apart and the two runs' logits differed by up to {first['logit_max_abs_diff']:.3g}; {agreement}. ")
    if first["near_tie"]:
        return text + ("A near tie, which the two attentions' rounding can flip; the weights are random, which makes "
                       "near ties common. Not by itself a wrong kernel")
    return text + "Not a near tie that rounding explains: the attention is suspect"


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


def _fits(config, settings: Settings, batch: int, context: int, paged: bool) -> str | None:
    """Why a row would not fit in the GPU's free memory (None: it fits, or not on a GPU): its KV cache, plus the
    prefill's largest activations (the MLP's gate and up projections, float32 copies in the norms and RoPE), plus
    SDPA's gathered copy of a paged layer."""
    if settings.device != "cuda":
        return None
    itemsize = torch.empty((), dtype=getattr(torch, settings.dtype)).element_size()
    capacity = context + max(settings.steps, settings.warmup)
    cache = batch * capacity * config.kv_bytes_per_token(itemsize)
    prefill = batch * context * (3 * config.ffn_dim * itemsize + 8 * config.dim * 4)
    gathered = 2 * batch * capacity * config.n_kv_heads * config.head_dim * itemsize if paged else 0
    need = cache + prefill + gathered + 2**30  # and a GiB for the allocator's rounding and the workspaces
    free = torch.cuda.mem_get_info()[0]
    if need <= free:
        return None
    return (f"does not fit: the cache ({cache / 2**30:.1f} GiB) and the prefill need about {need / 2**30:.1f} GiB, "
            f"{free / 2**30:.1f} GiB are free")


def _warm_up_kernels(model: dec.Decoder, settings: Settings, progress: bool) -> None:
    """Run wb_attend once on each layout before anything is timed: its first call on a GPU loads (or builds) the
    CUDA extension, which must not land in a row's time; time_decode's own warm-up steps then warm the rest. Off a
    GPU there is nothing to load (the simulator runs the kernels as Python)."""
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


def _row(config_name, settings, model, batch, context, layout, attend_name, ceilings) -> dict:
    config = CONFIGS[config_name]
    row = {"key": f"{config_name}|{settings.dtype}|B{batch}|L{context}|{layout}|{attend_name}", "kind": "decoder",
           "config": config_name, "dtype": settings.dtype, "batch": batch, "context": context, "layout": layout,
           "page_size": settings.page_size if layout == "paged" else None, "attend": attend_name,
           "steps": settings.steps, "warmup": settings.warmup}
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
    itemsize = torch.empty((), dtype=getattr(torch, settings.dtype)).element_size()
    mean_context = round(context + (settings.steps + 1) / 2)
    peak = ceilings.get(f"{settings.dtype}_matmul_tflops")
    roofline = dec.decode_step_roofline(config, batch=batch, context_len=mean_context, dtype_bytes=itemsize,
                                        bandwidth_bytes_per_s=ceilings["copy_gbps"] * 1e9,
                                        peak_flops_per_s=peak * 1e12 if peak else None)
    row.update(status="ok", **{name: _round(timing[name], 4) for name in
                               ("tokens_per_s", "ms_per_step", "attention_ms_per_step", "attention_share")},
               roofline={"context": mean_context, "step_ms": _round(roofline["step_time_s"] * 1e3, 4),
                         "tokens_per_s": _round(roofline["tokens_per_s"], 4),
                         "bytes_per_step": roofline["bytes_per_step"], "kv_share": _round(roofline["kv_share"], 3),
                         "bandwidth_gbps": ceilings["copy_gbps"], "peak_tflops": peak},
               fraction_of_roofline=_round(roofline["step_time_s"] * 1e3 / timing["ms_per_step"], 3))
    return row


def add_ratios(results: dict) -> dict:
    """Each timed row's tokens/s over SDPA's on the same model, batch, context and layout (``vs_sdpa``), and over
    SDPA's on the contiguous cache (``vs_sdpa_contiguous``); wb's paged rows also over FlashInfer's (``vs_flashinfer``,
    both reading the same paged cache)."""
    ok = {r["key"]: r for r in results["records"] if r.get("status") == "ok"}
    for r in ok.values():
        base = f"{r['config']}|{r['dtype']}|B{r['batch']}|L{r['context']}"
        wanted = ((("vs_sdpa", r["layout"]),) if r["attend"] != "sdpa" else ()) + \
            ((("vs_sdpa_contiguous", "contiguous"),) if r["layout"] != "contiguous" else ())
        for field, layout in wanted:
            sdpa = ok.get(f"{base}|{layout}|sdpa")
            if sdpa is not None:
                r[field] = _round(r["tokens_per_s"] / sdpa["tokens_per_s"], 3)
        flashinfer = ok.get(f"{base}|paged|flashinfer")
        if r["attend"] == "wb" and r["layout"] == "paged" and flashinfer is not None:
            r["vs_flashinfer"] = _round(r["tokens_per_s"] / flashinfer["tokens_per_s"], 3)
    return results


# The greedy check's attentions against SDPA on the contiguous cache: wb on both layouts, FlashInfer on the paged one
GREEDY_OTHERS = (("wb", "contiguous"), ("wb", "paged"), ("flashinfer", "paged"))


def _greedy(config_name, settings, model) -> list:
    """The greedy check of one model: each of :data:`GREEDY_OTHERS` against SDPA on the contiguous cache."""
    generator = torch.Generator().manual_seed(settings.seed + 1)
    prompt = torch.randint(0, CONFIGS[config_name].vocab_size, (settings.greedy_batch, settings.greedy_prompt),
                           generator=generator).to(model.device)
    records = []
    for attend_name, layout in GREEDY_OTHERS:
        record = {"config": config_name, "dtype": settings.dtype, "batch": settings.greedy_batch,
                  "prompt_len": settings.greedy_prompt, "new_tokens": settings.greedy_tokens,
                  "reference": "sdpa, contiguous", "other": f"{attend_name}, {layout}",
                  "page_size": settings.page_size if layout == "paged" else None}
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


def run_tokens(settings: Settings, out_path, *, smoke: bool = False, command: str | None = None,
               progress: bool = True) -> dict:
    """Measure `settings` into the JSON file `out_path` (written after every row); return the results."""
    from ..bench.results import SCHEMA_VERSION, environment, save_results

    check_settings(settings)
    started = time.monotonic()
    out_path = Path(out_path)
    results = {"schema": SCHEMA_VERSION, "kind": KIND, "mode": "smoke" if smoke else "gpu",
               "environment": environment(), "command": command, "settings": asdict(settings), "notes": NOTES,
               "configs": {name: {"params": CONFIGS[name].params(), "n_layers": CONFIGS[name].n_layers,
                                  "dim": CONFIGS[name].dim, "n_heads": CONFIGS[name].n_heads,
                                  "n_kv_heads": CONFIGS[name].n_kv_heads, "head_dim": CONFIGS[name].head_dim}
                           for name in settings.configs},
               "ceilings": None, "records": [], "greedy": [], "complete": False}
    plan = _plan(settings)
    _log(progress, f"{len(plan)} rows and {2 * len(settings.configs)} greedy checks on "
                   f"{results['environment']['device']}, into {out_path}"
         + (f" (about {estimate_seconds(settings) / 60:.1f} min on an H100)" if settings.device == "cuda" else ""))
    _log(progress, "measuring the ceilings (copy bandwidth" + (", matmul peaks)" if settings.device == "cuda" else ")"))
    results["ceilings"] = ceilings = _ceilings(settings)
    save_results(results, out_path)
    dtype = getattr(torch, settings.dtype)
    for config_name in settings.configs:
        _log(progress, f"{config_name}: {CONFIGS[config_name].params() / 1e9:.2f} billion parameters, random weights "
                       f"in {settings.dtype} on {settings.device}")
        model = dec.Decoder(CONFIGS[config_name], dtype=dtype, device=settings.device, seed=settings.seed)
        _warm_up_kernels(model, settings, progress)
        for _, batch, context, layout, attend_name in (row for row in plan if row[0] == config_name):
            row = _row(config_name, settings, model, batch, context, layout, attend_name, ceilings)
            results["records"].append(row)
            add_ratios(results)
            save_results(results, out_path)
            # a line per row rather than a bar: the GPU check keeps stderr in a log file, where a bar is noise
            _log(progress, f"  [{len(results['records'])}/{len(plan)}] {config_name} B={batch} context={context} "
                           f"{layout} {attend_name}: " + (
                f"{row['tokens_per_s']:.0f} tokens/s, {row['ms_per_step']:.3g} ms/step, attention "
                f"{100 * row['attention_share']:.0f} percent" if row["status"] == "ok"
                else f"{row['status']}: {row['reason']}"))
        _log(progress, f"{config_name}: greedy check, {settings.greedy_batch} prompts of {settings.greedy_prompt} "
                       f"tokens, {settings.greedy_tokens} new tokens each")
        for record in _greedy(config_name, settings, model):
            results["greedy"].append(record)
            save_results(results, out_path)
            _log(progress, f"  {record['other']} vs {record['reference']}: "
                 + (record["note"] if record["status"] == "ok" else f"failed: {record['reason']}"))
        del model
        _free_memory()
    results.update(complete=True, elapsed_s=round(time.monotonic() - started, 1))
    save_results(results, out_path)
    return results


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
    parser.add_argument("--no-progress", action="store_true", help="no progress lines on stderr")
    return parser


def main(argv=None) -> int:
    from ..timing import on_gpu

    parser = _parser()
    args = parser.parse_args(argv)
    if not args.smoke and not on_gpu():
        print("error: the decoder benchmark times LLAMA_1B in 16-bit through wb.decode's CUDA kernel and needs a "
              "CUDA GPU; this machine has none. --smoke runs the TINY model on the CPU instead.", file=sys.stderr)
        return 2
    base = SMOKE_SETTINGS if args.smoke else GPU_SETTINGS
    chosen = {name: getattr(args, name) for name in ("configs", "dtype", "batches", "contexts", "steps", "warmup",
                                                     "page_size", "greedy_batch", "greedy_prompt", "greedy_tokens",
                                                     "seed") if getattr(args, name) is not None}
    settings = replace(base, **chosen)
    if args.smoke and settings.configs != ("tiny",):
        parser.error("--smoke runs on the CPU: only --configs tiny (the 1B models need a GPU)")
    try:
        check_settings(settings)
    except ValueError as error:
        parser.error(str(error))
    out = args.json if args.json is not None else default_output(args.smoke)
    command = "python -m wb_kernels.models.decoder_tokens " + " ".join(argv if argv is not None else sys.argv[1:])
    if args.smoke:
        torch.set_num_threads(1)  # TINY's matrices are tiny: threads cost more than they save
    results = run_tokens(settings, out, smoke=args.smoke, command=command.strip(), progress=not args.no_progress)
    from ..stages.decode.slider import decoder_table

    print(decoder_table(results))
    print(f"wrote {out}")
    failed = [r for r in results["records"] + results["greedy"] if r.get("status") == "failed"]
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
