"""The LLaMA-shaped decoder without its host overhead: a static KV cache, one CUDA graph per batch bucket, and
``torch.compile(mode="reduce-overhead")`` (lesson 07_decode; the tokens-per-second run of ``decoder_tokens``).

The eager decoder (:mod:`.llama_decoder`) launches several hundred small kernels per step from Python, and on an
H100 the host, not the GPU, sets its speed (a step of the 1B model takes 12-33 ms whatever the batch). Serving
engines take the host out the same way, and so does this module:

- **A static cache.** Every tensor a step reads or writes is allocated before the first step, at the capacity the
  sequences will need (:meth:`Decoder.new_cache`); positions and lengths live on the GPU
  (``cache.cache_seqlens``), and a step advances them there.
- **One graph per batch bucket** (:class:`GraphedDecoder`), hand-captured with ``torch.cuda.CUDAGraph`` as
  nano-vllm captures one per batch size: a batch of B sequences runs in the smallest bucket that holds it
  (:func:`bucket_for`), its spare rows padded. The attention is told the cache's capacity (``max_seqlen``), the
  same on every replay: SDPA reads every slot and masks those past each sequence's length, ``wb.decode`` picks its
  split count from the capacity (or the `num_splits` given) and reads each length on the GPU. A step's greedy token
  is picked inside the graph and fed to the next replay, so a generation is replays only.
- **torch.compile(mode="reduce-overhead")** (:class:`CompiledDecoder`): the same step compiled by Inductor and
  replayed by its CUDA-graph trees, with the weights and the cache marked static (as gpt-fast's module buffers are),
  so that nothing is copied in before a replay.

``wb.decode`` is captured only when it is graph-safe: :func:`wb_decode_graph_support` captures it on a small
problem in a separate process and replays it at lengths changed on the GPU; while that fails, the rows of
``wb.decode`` in a graph say "not graph-safe yet" and why.

What is exact: a captured graph runs the kernels of its uncaptured step, so its tokens are those of the same step
run eagerly. Against the eager decoder (which reads exactly the keys there are, with other SDPA kernels, or other
split counts) and under ``torch.compile`` (which fuses and reorders), the logits differ by rounding, and a greedy
token may flip where the two largest logits nearly tie: ``decoder_tokens.compare_greedy``'s near-tie rule decides
whether rounding accounts for a flip.

On the CPU (the smoke run, the tests) nothing is captured: :class:`GraphedDecoder` runs the same static step
eagerly (``capture=False``), which checks everything but the capture itself.
"""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass

import torch

from . import llama_decoder as dec

__all__ = ["BATCH_BUCKETS", "bucket_for", "buckets_up_to", "pad_tokens", "graph_capacity", "GraphedDecoder",
           "CompiledDecoder", "CompileVariant", "COMPILE_VARIANTS", "DEFAULT_VARIANTS", "variant_names",
           "EagerRunner", "fill_for_timing", "time_static", "time_compiled", "wb_decode_graph_support",
           "probe_wb_decode_capture"]

# nano-vllm's buckets: 1, 2, 4, 8, then every 16 up to its largest batch; powers of two here, enough for the
# batches this series times (a bucket costs a graph's capture and its share of the pool)
BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)
GRAPH_WARMUP_STEPS = 2  # eager steps on the capture stream before a capture (lazy initialisation, cuBLAS plans)


def bucket_for(batch: int, buckets=BATCH_BUCKETS) -> int:
    """The smallest bucket that holds `batch` sequences."""
    if isinstance(batch, bool) or not isinstance(batch, int) or batch < 1:
        raise ValueError(f"batch={batch!r}: expected a positive int")
    fitting = [b for b in sorted(buckets) if b >= batch]
    if not fitting:
        raise ValueError(f"batch={batch} exceeds the largest bucket ({max(buckets)}); capture a larger one")
    return fitting[0]


def buckets_up_to(max_batch: int, buckets=BATCH_BUCKETS) -> tuple:
    """The buckets a runner for up to `max_batch` sequences captures: every one up to the bucket of `max_batch`."""
    buckets = tuple(sorted(set(buckets)))
    if not buckets or any(isinstance(b, bool) or not isinstance(b, int) or b < 1 for b in buckets):
        raise ValueError(f"buckets={list(buckets)}: expected positive ints")
    top = bucket_for(max_batch, buckets)
    return tuple(b for b in buckets if b <= top)


def pad_tokens(tokens: torch.Tensor, bucket: int) -> torch.Tensor:
    """Tokens (B,) padded with token 0 to the bucket's size: the spare rows run, and their outputs are dropped."""
    if tokens.ndim != 1 or not 1 <= tokens.shape[0] <= bucket:
        raise ValueError(f"tokens: expected 1 to {bucket} token ids (B,), got shape {tuple(tokens.shape)}")
    return torch.cat([tokens, tokens.new_zeros(bucket - tokens.shape[0])])


def graph_capacity(context: int, steps: int, *, page_size: int | None = None) -> int:
    """Keys each sequence of a static cache needs for `context` keys and `steps` more (whole pages when paged)."""
    need = context + steps
    return need if page_size is None else -(-need // page_size) * page_size


def _on_cuda(model: dec.Decoder) -> bool:
    return model.device.type == "cuda"


class EagerRunner:
    """The eager decoder behind the interface the greedy check and the timing share: ``start`` (prefill) and
    ``step`` (one decode step), each returning the logits (B, vocab)."""

    name = "eager"

    def __init__(self, model: dec.Decoder, attend, *, capacity: int, paged: bool = False, page_size: int = 16):
        self.model, self.attend, self.capacity, self.paged, self.page_size = model, attend, capacity, paged, page_size
        self.cache = None

    def start(self, prompt_ids: torch.Tensor) -> torch.Tensor:
        self.cache = self.model.new_cache(prompt_ids.shape[0], self.capacity, paged=self.paged,
                                          page_size=self.page_size)
        return self.model.prefill(prompt_ids, self.cache)

    def step(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.model.decode_step(tokens, self.cache, self.attend)


class GraphedDecoder:
    """The decoder's step in one CUDA graph per batch bucket, over a static cache (see the module docstring).

        runner = GraphedDecoder(model, dec.sdpa_attend, max_batch=8, capacity=2048)   # captures 1, 2, 4, 8
        tokens = runner.generate(prompt_ids, 64)                 # (B, L + 64), B <= 8, like Decoder.generate

    `attend` has the decoder's signature; it is called with ``max_seqlen=capacity`` and ``equal_lengths=False``, the
    same on every replay. `capture=False` (the default off a GPU) runs the same static step eagerly instead of
    replaying a graph. `cache`: a cache to use (its batch is the largest bucket's); by default a new one.
    """

    name = "graph"

    def __init__(self, model: dec.Decoder, attend, *, max_batch: int, capacity: int, paged: bool = False,
                 page_size: int = 16, buckets=BATCH_BUCKETS, capture: bool | None = None, cache=None):
        self.model, self.attend = model, attend
        self.buckets = buckets_up_to(max_batch, buckets)
        top = self.buckets[-1]
        self.cache = cache if cache is not None else model.new_cache(top, capacity, paged=paged, page_size=page_size)
        if self.cache.cache_seqlens.shape[0] != top:
            raise ValueError(f"cache: holds {self.cache.cache_seqlens.shape[0]} sequences; the largest bucket is {top}")
        self.capacity = self.cache.capacity
        self.captured = _on_cuda(model) if capture is None else bool(capture)
        if self.captured and not _on_cuda(model):
            raise ValueError("capture=True needs the model on a CUDA GPU")
        self.tokens = torch.zeros(top, dtype=torch.long, device=model.device)  # the graphs' input and output
        self.logits, self.graphs = {}, {}
        self.batch = None  # the batch of the current generation
        self.host_len = 0  # its longest sequence, as the host knows it
        if self.captured:
            self._capture_all()

    # ---- capture ---------------------------------------------------------------------------------------

    def _static_step(self, bucket: int) -> torch.Tensor:
        view = self.cache.head(bucket)
        logits = self.model.forward_step(self.tokens[:bucket], view, self.attend, max_seqlen=self.capacity,
                                         equal_lengths=False)
        self.tokens[:bucket].copy_(logits.argmax(-1))
        return logits

    @torch.inference_mode()
    def _capture_all(self) -> None:
        """Largest bucket first, all in one memory pool (as vLLM does: a smaller graph reuses the larger's memory).
        The warm-up steps run on the capture stream, then the lengths they advanced are put back."""
        self.stream, self.pool = torch.cuda.Stream(self.model.device), torch.cuda.graph_pool_handle()
        saved = self.cache.cache_seqlens.clone()
        for bucket in sorted(self.buckets, reverse=True):
            self.stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(self.stream):
                for _ in range(GRAPH_WARMUP_STEPS):
                    self._static_step(bucket)
            torch.cuda.current_stream().wait_stream(self.stream)
            self.cache.cache_seqlens.copy_(saved)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self.pool, stream=self.stream):
                self.logits[bucket] = self._static_step(bucket)
            self.graphs[bucket] = graph
        self.cache.cache_seqlens.copy_(saved)
        torch.cuda.synchronize(self.model.device)

    # ---- generation ------------------------------------------------------------------------------------

    def _run(self, bucket: int) -> torch.Tensor:
        if self.captured:
            self.graphs[bucket].replay()
            return self.logits[bucket]
        with torch.inference_mode():
            return self._static_step(bucket)

    @torch.inference_mode()
    def start(self, prompt_ids: torch.Tensor) -> torch.Tensor:
        """Prefill `prompt_ids` (B, L) into the first B rows of the static cache (eagerly, as engines do: a prompt's
        shape changes with every request); the spare rows of B's bucket are emptied. Returns the logits (B, vocab)."""
        batch, length = prompt_ids.shape
        bucket = bucket_for(batch, self.buckets)
        if length + 1 > self.capacity:
            raise ValueError(f"prompt length {length}: the static cache holds {self.capacity} keys per sequence")
        self.cache.cache_seqlens.zero_()
        logits = self.model.prefill(prompt_ids, self.cache.head(batch))
        self.tokens[:bucket].copy_(pad_tokens(logits.argmax(-1), bucket))
        self.batch, self.host_len = batch, length
        return logits

    def resume(self, batch: int, length: int, tokens: torch.Tensor) -> None:
        """Go on from a cache whose first `batch` sequences the caller filled to `length` keys each (the timing's
        random cache, :func:`fill_for_timing`), feeding `tokens` (B,) to the first replay."""
        bucket = bucket_for(batch, self.buckets)
        self.tokens[:bucket].copy_(pad_tokens(tokens.to(self.tokens.device), bucket))
        self.batch, self.host_len = batch, length

    def step(self, tokens: torch.Tensor | None = None) -> torch.Tensor:
        """One replay for the current batch: feeds `tokens` (B,) (default: the greedy tokens of the last step, which
        the graph leaves in place) and returns the logits (B, vocab), a view the next replay overwrites."""
        if self.batch is None:
            raise ValueError("start() the generation first: the static cache holds no prompt")
        if self.host_len + 1 > self.capacity:
            raise ValueError(f"the static cache is full: {self.host_len} keys per sequence, capacity {self.capacity}")
        bucket = bucket_for(self.batch, self.buckets)
        if tokens is not None:
            self.tokens[:self.batch].copy_(tokens)
        self.host_len += 1
        before_replay = getattr(self.attend, "before_replay", None)
        if self.captured and before_replay is not None:
            # an attention planned on the host (FlashInfer's): told each sequence's length, as serving engines do
            # (a bucket's spare rows are planned as long as the batch's: their outputs are dropped)
            before_replay(bucket, self.host_len)
        return self._run(bucket)[:self.batch]

    @torch.inference_mode()
    def generate(self, prompt_ids: torch.Tensor, max_new_tokens: int) -> torch.Tensor:
        """Greedy generation, as :meth:`Decoder.generate`: the prompts (B, L) and `max_new_tokens` tokens each."""
        if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 1:
            raise ValueError(f"max_new_tokens={max_new_tokens!r}: expected an int >= 1")
        prompt_ids = prompt_ids.to(self.model.device)
        if prompt_ids.shape[1] + max_new_tokens - 1 > self.capacity:
            raise ValueError(f"prompt length {prompt_ids.shape[1]} + max_new_tokens {max_new_tokens} - 1 exceeds the "
                             f"static cache's capacity {self.capacity}")
        self.start(prompt_ids)
        batch = prompt_ids.shape[0]
        generated = [self.tokens[:batch].clone()]
        for _ in range(max_new_tokens - 1):
            self.step()
            generated.append(self.tokens[:batch].clone())
        return torch.cat([prompt_ids, torch.stack(generated, dim=1).to(prompt_ids.dtype)], dim=1)


def _model_and_cache_tensors(model: dec.Decoder, cache: dec.KVCache) -> list:
    tensors = [model.embedding, model.final_norm, model.lm_head, model.rope_cos, model.rope_sin]
    for layer in model.layers:
        tensors += [layer.attention_norm, layer.wqkv, layer.wo, layer.mlp_norm, layer.w_gate_up, layer.w_down]
    tensors += list(cache.keys) + list(cache.values) + [cache.cache_seqlens]
    return tensors + ([cache.block_table] if cache.block_table is not None else [])


class CompiledDecoder:
    """The static step under ``torch.compile(mode="reduce-overhead", fullgraph=True)`` (gpt-fast's recipe): Inductor
    fuses the step and its CUDA-graph trees replay it. The weights and the cache are marked static, so a replay
    copies none of them in. One batch (the cache's); `compile_kwargs` replace the mode (the CPU tests pass
    ``backend="eager"``, which checks that the step traces as one graph without compiling it; a
    :class:`CompileVariant` passes ``options``). `split_gate_up`: the step's MLP as two products (see
    :meth:`Decoder.forward_step`).

    As gpt-fast does, each step's output is cloned before the next call: a replay overwrites its outputs.
    ``first_step_s``: the wall time of the first step (compilation, and on a GPU its kernels' tuning), once it ran.
    """

    name = "compile"

    def __init__(self, model: dec.Decoder, attend, *, cache: dec.KVCache, split_gate_up: bool = False,
                 **compile_kwargs):
        self.model, self.attend, self.cache = model, attend, cache
        self.capacity = cache.capacity
        self.split_gate_up = bool(split_gate_up)
        for tensor in _model_and_cache_tensors(model, cache):
            torch._dynamo.mark_static_address(tensor)
        options = compile_kwargs or {"mode": "reduce-overhead"}
        self._compiled = torch.compile(self._step, fullgraph=True, **options)
        self.batch, self.host_len = None, 0
        self.first_step_s = None

    @classmethod
    def for_variant(cls, model: dec.Decoder, attend, *, cache: dec.KVCache, variant: "CompileVariant",
                    backend: str = "inductor") -> "CompiledDecoder":
        """The compiled step of `variant`. `backend` other than "inductor" (the CPU tests' "eager") traces the
        variant's step without Inductor, whose options then do not apply."""
        kwargs = variant.compile_kwargs() if backend == "inductor" else {"backend": backend}
        return cls(model, attend, cache=cache, split_gate_up=variant.split_gate_up, **kwargs)

    def _step(self, tokens: torch.Tensor) -> tuple:
        # the greedy token is picked inside the compiled graph too, as GraphedDecoder picks it inside its capture:
        # outside, PyTorch's eager argmax over a 128k vocabulary takes about 30 us of a 1.5 ms step on an H100
        logits = self.model.forward_step(tokens, self.cache, self.attend, max_seqlen=self.capacity,
                                         equal_lengths=False, split_gate_up=self.split_gate_up)
        return logits, logits.argmax(-1)

    @torch.inference_mode()
    def start(self, prompt_ids: torch.Tensor) -> torch.Tensor:
        self.cache.cache_seqlens.zero_()
        if prompt_ids.shape[0] != self.cache.cache_seqlens.shape[0]:
            raise ValueError(f"prompt_ids: batch {prompt_ids.shape[0]}, the compiled step's is "
                             f"{self.cache.cache_seqlens.shape[0]}")
        self.batch, self.host_len = prompt_ids.shape[0], prompt_ids.shape[1]
        return self.model.prefill(prompt_ids, self.cache)

    def resume(self, batch: int, length: int) -> None:
        """Go on from a cache the caller filled to `length` keys per sequence (see :meth:`GraphedDecoder.resume`)."""
        if batch != self.cache.cache_seqlens.shape[0]:
            raise ValueError(f"batch {batch}: the compiled step's is {self.cache.cache_seqlens.shape[0]}")
        self.batch, self.host_len = batch, length

    @torch.inference_mode()
    def step(self, tokens: torch.Tensor, *, greedy: bool = False) -> torch.Tensor:
        """Feed `tokens` (B,); returns the logits (B, vocab), or with `greedy` only the next tokens (B,) picked
        inside the compiled step (what a generation loop needs: no logits copied out)."""
        if self.host_len + 1 > self.capacity:
            raise ValueError(f"the static cache is full: {self.host_len} keys per sequence, capacity {self.capacity}")
        self.host_len += 1
        if _on_cuda(self.model):
            torch.compiler.cudagraph_mark_step_begin()
        started = time.perf_counter() if self.first_step_s is None else None
        logits, picked = self._compiled(tokens.to(self.model.device).clone())
        if started is not None:
            _synchronize(self.model)
            self.first_step_s = time.perf_counter() - started
        return picked.clone() if greedy else logits.clone()


@dataclass(frozen=True)
class CompileVariant:
    """One way of compiling the static step, for the bar of the decoder at its roofline (``decoder_tokens
    --variants``): a torch.compile `mode`, or Inductor `options` (``torch.compile(options=...)``, the configuration
    patches of that compilation alone: nothing global changes), and the step's own `split_gate_up`."""

    name: str
    description: str
    mode: str | None = None
    options: tuple = ()  # ((inductor config name, value), ...): a tuple, so that the variant stays hashable
    split_gate_up: bool = False
    compile_guess_s: float = 60.0  # a guess at its cold compilation on an H100 (the run's plan and time budget)

    def __post_init__(self):
        if (self.mode is None) == (not self.options):
            raise ValueError(f"variant {self.name}: give a mode or options (torch.compile takes one of them)")

    def compile_kwargs(self) -> dict:
        return {"mode": self.mode} if self.mode is not None else {"options": dict(self.options)}


# Inductor's reduce-overhead mode is these options; a variant adds to them, so that every variant replays CUDA graphs
_CUDAGRAPHS = (("triton.cudagraphs", True),)
# gpt-fast's settings. coordinate_descent_tuning is the one that changes the step: with it, Inductor decomposes a
# matrix product with one row (a decode step at batch 1) into a multiply and a sum, which it generates as a Triton
# reduction (fusing the RMSNorm before it and the residual add after it) and tunes by coordinate descent, where
# without it the product goes to cuBLAS (torch/_inductor/decomposition.py, mm: "Our matrix vector multiplies only
# achieve peak bandwidth with coordinate descent tuning"). The other two are torch's defaults since 2.6 or so
# (kernel names for a profile; the compiled-graph cache on disk, which a second compilation of the same graph
# reuses): set anyway, so that the variant is gpt-fast's whatever the torch.
_GPT_FAST = _CUDAGRAPHS + (("coordinate_descent_tuning", True), ("triton.unique_kernel_names", True),
                           ("fx_graph_cache", True))

COMPILE_VARIANTS = {v.name: v for v in (
    CompileVariant("reduce-overhead", "torch.compile(mode='reduce-overhead'): the committed compiled step (cuBLAS "
                   "matrix-vector products, Inductor's fused elementwise kernels, CUDA-graph trees)",
                   mode="reduce-overhead", compile_guess_s=25.0),
    CompileVariant("coordinate-descent", "reduce-overhead with gpt-fast's Inductor settings: the matrix-vector "
                   "products as Triton reductions tuned by coordinate descent, the norms and residual adds fused into "
                   "them", options=_GPT_FAST, compile_guess_s=45.0),
    CompileVariant("coordinate-descent-split-gate-up", "coordinate-descent, the MLP's gate and up as two products "
                   "over views of their matrix (one kernel for both and silu(gate) * up, if Inductor fuses them)",
                   options=_GPT_FAST, split_gate_up=True, compile_guess_s=30.0),
    CompileVariant("coordinate-descent-pdl", "coordinate-descent with programmatic dependent launch between "
                   "Inductor's kernels (triton.enable_pdl, Hopper: a kernel starts while its predecessor drains; an "
                   "unknown option in older torch, then the variant fails at once)",
                   options=_GPT_FAST + (("triton.enable_pdl", True),), compile_guess_s=45.0),
    CompileVariant("max-autotune", "torch.compile(mode='max-autotune'): coordinate descent, CUDA graphs and "
                   "Inductor's autotuning of its kernels' configurations (no matrix product is left at batch 1 to "
                   "choose cuBLAS or a Triton template for): slow to compile, so last",
                   mode="max-autotune", compile_guess_s=90.0),
    # by name only (not in DEFAULT_VARIANTS): the two above together, should both help
    CompileVariant("coordinate-descent-pdl-split-gate-up", "coordinate-descent-pdl with the split gate and up",
                   options=_GPT_FAST + (("triton.enable_pdl", True),), split_gate_up=True, compile_guess_s=30.0),
    # by name only: more compilation, less likely to move the step
    CompileVariant("coordinate-descent-combo", "coordinate-descent with combo kernels (independent small kernels, "
                   "such as a layer's RoPE and cache writes, launched as one)",
                   options=_GPT_FAST + (("combo_kernels", True),), compile_guess_s=60.0),
    CompileVariant("coordinate-descent-all-directions", "coordinate-descent searching every direction of every "
                   "tuning knob, not only the first that improves",
                   options=_GPT_FAST + (("coordinate_descent_check_all_directions", True),), compile_guess_s=90.0),
)}
# The run's order: the baseline first (the same card's number to compare with), the likeliest gain next, the slowest
# compilation last
DEFAULT_VARIANTS = ("reduce-overhead", "coordinate-descent", "coordinate-descent-pdl",
                    "coordinate-descent-split-gate-up", "max-autotune")


def variant_names(text: str) -> tuple:
    """Variant names from a comma-separated list; "default" is :data:`DEFAULT_VARIANTS`, "all" every variant. The
    baseline (reduce-overhead) is always first, so that each variant has the same card's baseline beside it."""
    names = []
    for part in (p.strip().lower() for p in text.split(",") if p.strip()):
        expanded = {"default": DEFAULT_VARIANTS, "all": tuple(COMPILE_VARIANTS)}.get(part, (part,))
        for name in expanded:
            if name not in COMPILE_VARIANTS:
                raise ValueError(f"variant {name!r}: expected default, all or names among "
                                 f"{', '.join(COMPILE_VARIANTS)}")
            if name not in names:
                names.append(name)
    if not names:
        raise ValueError("variants: expected at least one name")
    return ("reduce-overhead",) + tuple(n for n in names if n != "reduce-overhead")


# ---- timing ------------------------------------------------------------------------------------------------


def fill_for_timing(cache: dec.KVCache, context: int, seed: int = 0) -> None:
    """Every slot of the cache drawn from N(0, 1) and every sequence `context` keys long: a cache as a prefill would
    leave it, for timing (a step's time does not depend on the values; a 64 x 32k prefill would not fit)."""
    if not 1 <= context <= cache.capacity:
        raise ValueError(f"context={context}: expected 1 to the cache's capacity {cache.capacity}")
    generator = torch.Generator(device=cache.cache_seqlens.device).manual_seed(seed)
    for tensor in list(cache.keys) + list(cache.values):
        tensor.normal_(0.0, 1.0, generator=generator)
    cache.cache_seqlens.fill_(context)
    cache.host_max_len, cache.host_uniform = context, True


def cudagraph_skips() -> int:
    """How many times Inductor has declined to put a compiled graph in a CUDA graph, in this process."""
    from torch._dynamo.utils import counters

    return int(counters["inductor"].get("cudagraph_skips", 0))


def _synchronize(model: dec.Decoder) -> None:
    if _on_cuda(model):
        torch.cuda.synchronize(model.device)


def time_static(model: dec.Decoder, mode: str, attend, *, batch: int, context: int, steps: int, warmup: int,
                paged: bool = False, page_size: int = 16, seed: int = 0, compile_options=None) -> dict:
    """Time `steps` greedy steps of `batch` sequences from `context` keys, after `warmup` untimed ones, with the step
    run as `mode`: "graph" (:class:`GraphedDecoder`, one bucket of exactly `batch`), "compile"
    (:class:`CompiledDecoder`, at least 3 warm-up calls: CUDA-graph trees warm up, record, then replay) or "eager"
    (:meth:`Decoder.decode_step`). The cache is static, with room for every step, filled by :func:`fill_for_timing`.

    On a GPU one pair of CUDA events around the timed steps, read after them; on the CPU a host clock. Returns
    ``ms_per_step``, ``tokens_per_s``, ``capacity``, ``mean_context`` (the keys an average timed step reads),
    ``captured``, ``setup_s`` (capture or compilation and the warm-up) and ``first_call_s``."""
    if mode not in ("graph", "compile", "eager"):
        raise ValueError(f"mode={mode!r}: expected graph, compile or eager")
    if min(batch, context, steps) < 1 or warmup < 0:
        raise ValueError(f"batch={batch}, context={context}, steps={steps} must be >= 1 and warmup={warmup} >= 0")
    warmup = max(warmup, 3) if mode == "compile" else warmup
    cache = model.new_cache(batch, context + warmup + steps, paged=paged, page_size=page_size)
    fill_for_timing(cache, context, seed)
    tokens = torch.randint(0, model.config.vocab_size, (batch,), generator=torch.Generator().manual_seed(seed))
    tokens = tokens.to(model.device)
    started = time.perf_counter()
    captured = False
    if mode == "graph":
        runner = GraphedDecoder(model, attend, max_batch=batch, capacity=cache.capacity, buckets=(batch,),
                                cache=cache)
        runner.resume(batch, context, tokens)
        captured = runner.captured

        def step():
            runner.step()
    else:
        state = [tokens]
        if mode == "compile":
            skips_before = cudagraph_skips()
            runner = CompiledDecoder(model, attend, cache=cache, **(compile_options or {}))
            runner.resume(batch, context)
            captured = _on_cuda(model) and not compile_options  # reduce-overhead's CUDA-graph trees

            def step():
                state[0] = runner.step(state[0], greedy=True)
        else:
            def step():
                state[0] = model.decode_step(state[0], cache, attend).argmax(-1)
    first_call_s = None
    for index in range(warmup):
        step()
        if index == 0:
            _synchronize(model)
            first_call_s = time.perf_counter() - started
    _synchronize(model)
    setup_s = time.perf_counter() - started
    if mode == "compile" and captured and cudagraph_skips() > skips_before:
        captured = False  # Inductor ran the step without its CUDA graphs (its log says why)
    total_ms = dec.time_steps(step, steps, _on_cuda(model))
    return {"ms_per_step": total_ms / steps, "tokens_per_s": batch * steps / (total_ms / 1e3),
            "capacity": cache.capacity, "mean_context": context + warmup + (steps + 1) / 2, "captured": captured,
            "setup_s": setup_s, "first_call_s": first_call_s}


def _restart(runner: CompiledDecoder, context: int, seed: int) -> list:
    """The compiled step put back to `context` keys of its filled cache (the lengths on the GPU too); returns the
    one-element list its steps' tokens pass through, starting from random tokens (the same for a seed)."""
    batch = runner.cache.cache_seqlens.shape[0]
    runner.cache.cache_seqlens.fill_(context)
    runner.resume(batch, context)
    tokens = torch.randint(0, runner.model.config.vocab_size, (batch,), generator=torch.Generator().manual_seed(seed))
    return [tokens.to(runner.model.device)]


def time_compiled(runner: CompiledDecoder, *, context: int, steps: int, warmup: int, repeats: int = 1,
                  seed: int = 0) -> dict:
    """:func:`time_static`'s measurement of a compiled step that already exists (the variants' run compiles each
    once, checks its greedy tokens, then times it here on the same cache): the cache filled by
    :func:`fill_for_timing` to `context` keys, `warmup` untimed steps, `steps` timed ones between one pair of CUDA
    events (the wall clock on the CPU), and again `repeats` times from `context` keys (the lengths on the GPU put
    back), so each repeat reads the same keys. Returns ``ms_per_step`` (the median repeat), ``ms_per_step_min``,
    ``ms_per_step_repeats``, ``tokens_per_s`` and ``mean_context`` (the keys an average timed step reads)."""
    batch = runner.cache.cache_seqlens.shape[0]
    if min(context, steps, repeats) < 1 or warmup < 0:
        raise ValueError(f"context={context}, steps={steps}, repeats={repeats} must be >= 1, warmup={warmup} >= 0")
    if context + warmup + steps > runner.capacity:
        raise ValueError(f"context {context} + warmup {warmup} + steps {steps} exceeds the compiled step's cache "
                         f"capacity {runner.capacity}")
    model = runner.model
    fill_for_timing(runner.cache, context, seed)
    times = []
    for _ in range(repeats):
        state = _restart(runner, context, seed)

        def step():
            state[0] = runner.step(state[0], greedy=True)

        for _ in range(warmup):
            step()
        _synchronize(model)
        times.append(dec.time_steps(step, steps, _on_cuda(model)) / steps)
    median = statistics.median(times)
    return {"ms_per_step": median, "ms_per_step_min": min(times), "ms_per_step_repeats": times,
            "tokens_per_s": batch / (median / 1e3), "mean_context": context + warmup + (steps + 1) / 2}


# The kinds a profile sorts the step's device work into, by the kernel's name (lowercase), the first that matches:
# wb.decode's own kernels and other attention kernels; cuBLAS / CUTLASS matrix products; Inductor's generated Triton
# kernels (its fused elementwise work, and at batch 1 with coordinate descent its matrix-vector reductions too: the
# `top` list of a profile names them); copies and fills; anything else
KERNEL_KINDS = (("attention", ("decode_split_kernel", "decode_mma", "decode_merge", "flash", "attention", "fmha",
                                "batchdecode")),
                ("matrix products", ("gemv", "gemm", "cutlass", "xmma", "cublas", "sm90_", "sm80_")),
                ("Inductor (Triton)", ("triton_",)),
                ("copies and fills", ("memcpy", "memset", "fill", "copy")))


def kernel_kind(name: str) -> str:
    """:data:`KERNEL_KINDS`' kind of a kernel, from its name; "other" when none matches."""
    lowered = name.lower()
    return next((kind for kind, marks in KERNEL_KINDS if any(mark in lowered for mark in marks)), "other")


def profile_compiled(runner: CompiledDecoder, *, context: int, steps: int, seed: int = 0, top: int = 12) -> dict:
    """Where a compiled step's device time goes: `steps` steps from `context` keys (the cache as
    :func:`time_compiled` fills it, one untimed step first) under torch.profiler, and its device events (kernels,
    copies, fills) summed per step: ``kernels_per_step``, ``kernel_us_per_step``, ``by_kind`` (:func:`kernel_kind`)
    and the `top` kernels by time. On the CPU there are no device events: the counts are zero and ``device`` says so."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    if steps < 1 or context + 1 + steps > runner.capacity:
        raise ValueError(f"steps={steps} must be >= 1 and context {context} + 1 + steps fit the capacity "
                         f"{runner.capacity}")
    model = runner.model
    fill_for_timing(runner.cache, context, seed)
    state = _restart(runner, context, seed)
    state[0] = runner.step(state[0], greedy=True)  # untimed: the first replay after the cache was refilled
    _synchronize(model)
    on_cuda = _on_cuda(model)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if on_cuda else [])
    with profile(activities=activities) as prof:
        for _ in range(steps):
            state[0] = runner.step(state[0], greedy=True)
        _synchronize(model)
    events = [(event.name, event.time_range.elapsed_us()) for event in prof.events()
              if event.device_type == DeviceType.CUDA]
    return {"context": context, "device": "cuda" if on_cuda else "cpu (no device events)",
            **summarize_device_events(events, steps, top=top)}


def summarize_device_events(events, steps: int, *, top: int = 12) -> dict:
    """`events` ((name, microseconds) per device event of `steps` steps) summed per step: ``kernels_per_step``,
    ``kernel_us_per_step``, ``by_kind`` ({kind: kernels and microseconds per step}, the longest first) and ``top``
    (the `top` names by time, each with its kind, calls and microseconds per step)."""
    by_name = {}
    for name, us in events:
        calls, total = by_name.get(name, (0, 0.0))
        by_name[name] = (calls + 1, total + us)
    by_kind = {}
    for name, (calls, us) in by_name.items():
        kind = by_kind.setdefault(kernel_kind(name), {"kernels_per_step": 0.0, "us_per_step": 0.0})
        kind["kernels_per_step"] += calls / steps
        kind["us_per_step"] += us / steps
    ranked = sorted(by_name.items(), key=lambda item: -item[1][1])[:top]
    return {"steps": steps,
            "kernels_per_step": round(sum(calls for calls, _ in by_name.values()) / steps, 2),
            "kernel_us_per_step": round(sum(us for _, us in by_name.values()) / steps, 2),
            "by_kind": {kind: {key: round(value, 2) for key, value in totals.items()}
                        for kind, totals in sorted(by_kind.items(), key=lambda item: -item[1]["us_per_step"])},
            "top": [{"name": name[:160], "kind": kernel_kind(name), "calls_per_step": round(calls / steps, 2),
                     "us_per_step": round(us / steps, 2)} for name, (calls, us) in ranked]}


# ---- is wb.decode graph-safe? ------------------------------------------------------------------------------


@dataclass(frozen=True)
class _ProbeProblem:
    batch: int = 2
    heads: int = 8
    kv_heads: int = 2
    head_dim: int = 64
    capacity: int = 1024
    page_size: int = 16


def probe_wb_decode_capture(dtype: str = "float16", num_splits: int | None = None) -> dict:
    """Capture ``wb.decode`` in a CUDA graph on a small problem (contiguous and paged), replay it at two sets of
    lengths written on the GPU between replays, and compare each replay with an uncaptured call at the same
    lengths: ``{"graph_safe": bool, "reason": str}``. Run in its own process by :func:`wb_decode_graph_support`,
    since a capture that fails part-way may leave the CUDA context unusable."""
    import wb_kernels as wb

    p = _ProbeProblem()
    device = torch.device("cuda")
    torch_dtype = getattr(torch, dtype)
    gen = torch.Generator(device=device).manual_seed(0)
    q = torch.randn(p.batch, p.heads, p.head_dim, device=device, generator=gen).to(torch_dtype)
    k = torch.randn(p.batch, p.kv_heads, p.capacity, p.head_dim, device=device, generator=gen).to(torch_dtype)
    v = torch.randn_like(k)
    pages = p.capacity // p.page_size
    table = torch.randperm(p.batch * pages, device=device).view(p.batch, pages).int()
    k_pages = torch.empty(p.batch * pages, p.kv_heads, p.page_size, p.head_dim, device=device, dtype=torch_dtype)
    v_pages = torch.empty_like(k_pages)
    for b in range(p.batch):  # the same keys, through the table
        k_pages[table[b].long()] = k[b].unflatten(1, (pages, p.page_size)).transpose(0, 1)
        v_pages[table[b].long()] = v[b].unflatten(1, (pages, p.page_size)).transpose(0, 1)
    seqlens = torch.tensor([p.capacity // 3, p.capacity], dtype=torch.int32, device=device)
    layouts = {"contiguous": (k, v, None), "paged": (k_pages, v_pages, table)}
    for layout, (kc, vc, bt) in layouts.items():
        def call():
            return wb.decode(q, kc, vc, seqlens, block_table=bt, max_seqlen=p.capacity, num_splits=num_splits)

        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        try:
            with torch.cuda.stream(stream):
                call()
            torch.cuda.current_stream().wait_stream(stream)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, stream=stream):
                out = call()
        except Exception as error:  # noqa: BLE001 - the answer to the question asked
            return {"graph_safe": False, "reason": f"{layout}: the capture failed: {type(error).__name__}: "
                                                   f"{str(error).splitlines()[0][:300]}"}
        for lengths in ([p.capacity // 3, p.capacity], [1, p.capacity - 17]):
            seqlens.copy_(torch.tensor(lengths, dtype=torch.int32))
            graph.replay()
            expected = call()
            torch.cuda.synchronize()
            error = float((out.float() - expected.float()).abs().max())
            if not error <= 1e-3:
                return {"graph_safe": False, "reason": f"{layout}: a replay at lengths {lengths} differs from an "
                                                       f"uncaptured call by {error:.3g}"}
        del graph
    return {"graph_safe": True, "reason": "captured on a side stream, replayed at lengths changed on the GPU between "
                                          "replays, contiguous and paged: the same output as uncaptured calls"}


_GRAPH_SUPPORT: dict = {}


def wb_decode_graph_support(dtype: str = "float16", num_splits: int | None = None, *, timeout: float = 120) -> dict:
    """Whether ``wb.decode`` can be captured in a CUDA graph here, asked once per process and dtype by
    :func:`probe_wb_decode_capture` in a child process: ``{"graph_safe": bool, "reason": str}``."""
    key = (dtype, num_splits)
    if key not in _GRAPH_SUPPORT:
        if not torch.cuda.is_available():
            _GRAPH_SUPPORT[key] = {"graph_safe": False, "reason": "no CUDA GPU: nothing to capture"}
            return _GRAPH_SUPPORT[key]
        command = [sys.executable, "-m", __name__, "--probe-wb", dtype] + ([str(num_splits)] if num_splits else [])
        try:
            done = subprocess.run(command, capture_output=True, text=True, timeout=timeout)
            lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
            answer = json.loads(lines[-1]) if lines else {
                "graph_safe": False, "reason": f"the probe exited {done.returncode}: "
                                               f"{(done.stderr.strip().splitlines() or [''])[-1][:300]}"}
        except subprocess.TimeoutExpired:
            answer = {"graph_safe": False, "reason": f"the probe ran past {timeout:.0f} s"}
        _GRAPH_SUPPORT[key] = answer
    return _GRAPH_SUPPORT[key]


if __name__ == "__main__":
    if len(sys.argv) >= 3 and sys.argv[1] == "--probe-wb":
        splits = int(sys.argv[3]) if len(sys.argv) > 3 else None
        try:
            print(json.dumps(probe_wb_decode_capture(sys.argv[2], splits)), flush=True)
        except Exception as error:  # noqa: BLE001 - reported to the parent process
            print(json.dumps({"graph_safe": False, "reason": f"{type(error).__name__}: {error}"[:400]}), flush=True)
    else:
        print("usage: python -m wb_kernels.models.decoder_graphs --probe-wb float16 [num_splits]", file=sys.stderr)
        sys.exit(2)
