"""The variants benchmark (lesson 11_triton): the ``triton`` stage with the attention variants real models use, against
FlexAttention given the same modifications, in a file of its own.

    python -m wb_kernels.bench.variants --json results/triton/variants_h100.json --time-budget 480   # the bar
    python -m wb_kernels.bench.variants --preset full --preset window-sweep --time-budget 480     # everything
    python -m wb_kernels.bench.variants --preset smoke     # a CPU: Triton's interpreter, tiny sizes, no FlexAttention
    python -m wb_kernels.bench.variants --table results/triton/variants_h100.json              # the README's tables

What is measured (:data:`VARIANT_PRESETS`): fp16 and bf16, D 64 and 128, H 16, B * L = 16k tokens (B = 16k / L), each
variant of :data:`VARIANTS` (:class:`VariantSpec`: plain, causal, ALiBi, a (1, H, L, L) bias, a sliding window of 1024
keys causal and not, softcap 50, sinks, 4 packed documents per sequence, gpt-oss = window 128 + sinks, Gemma 2 = window
4096 + softcap 50), in two modes: ``forward`` and ``fwd+bwd`` (the forward, then the gradients of q, k, v and of the
bias and the sinks where the variant has them, for a random ``dout``). Presets: ``bar`` (the issue's problems: L 4096,
D 128, fp16, every variant), ``full`` (L 1k-16k), ``window-sweep`` (forward time against the window at L = 16k, and
against L at a window of 1024, beside causal: a sliding window's cost grows with the window, not with L), ``memory``
(L = 16k: the peak memory of each contender) and ``smoke`` (B1 H2 L64 D16 on a CPU, for the tests).

Contenders (:func:`variant_contenders`), each checked, then timed with the one method every preset uses
(:data:`wb_kernels.timing.DEVICE_TIME`, recorded in the file):

- ``triton``: ``wb.attention(q, k, v, stage="triton", causal=..., softcap=..., bias=..., ...)``, what users call
  (validation, the registered op, autograd in ``fwd+bwd``);
- ``triton-kernel``: the stage's registered forward and backward called directly
  (``get_stage("triton").forward(..., variants=...)``, ``get_backward("triton").gradients``): no validation, no
  autograd;
- ``flex``: FlexAttention (``torch.nn.attention.flex_attention``) compiled once per workload, with the SAME
  modifications: softcap, ALiBi and the bias as one ``score_mod`` (:func:`flex_modifications`), causal, window and
  documents as one ``mask_mod`` given as a block mask from ``create_block_mask`` (built once per workload, outside the
  timing). FlexAttention has no sink argument; a sink is exact math on its returned LSE (natural log, without the
  sink): with a sink the row's normaliser is exp(lse) + exp(sink) instead of exp(lse), so each probability, and the
  output, is scaled by exp(lse) / (exp(lse) + exp(sink)) = sigmoid(lse - sink)::

      out_with_sink = out * sigmoid(lse - sink),     lse_with_sink = logaddexp(lse, sink)

  (:func:`with_sinks`; a row that sees no key has out = 0 and lse = -inf, so it stays 0 as the reference's). The
  correction runs inside the compiled function (fused by Inductor), and autograd carries the gradients through it
  into FlexAttention's LSE and into the sinks: exact, not an approximation;
- for ``plain`` and ``causal`` only: SDPA forced to FLASH and to cuDNN, and the ``mma`` and ``hopper`` stages through
  ``wb.attention``. Each of these rows on a machine that cannot run it (no GPU, no backward, another GPU) is a row
  with status "skipped" and the reason.

The check, before any timing: the forward's output rows of batch 0, head 0 go through :func:`wb_kernels.check.check`
with the variants (the package's rule: twice PyTorch's own error with the same variants in PyTorch ops in the same
precision, plus its floors), on a slice of :data:`CHECK_ROWS` query rows against every key: the last rows under a
causal mask (``causal="bottom_right"`` on the slice puts them on the full problem's diagonal, which windows and ALiBi
follow), the first rows otherwise. The gradients of head 0 of every batch entry (dq, dk, dv, and dbias and dsinks,
which sum over the batch) against float64 autograd through the same formula on the device
(:func:`wb_kernels.check.torch_ops_attention` in float64), within twice the same formula's error in the inputs'
dtype plus the rounding of storing the reference in that dtype (the backward benchmark's rule). A stage that fails
is not timed (``--time-failed-checks`` times it, flagged); a baseline that fails is timed and flagged.

FLOPs count the visible (query, key) pairs only (:func:`visible_pairs`: causal about half, a window about L * w, the
documents the sum of their squares' halves): forward ``4 B H pairs D``, ``fwd+bwd`` 3.5 times that (the backward's
five products against the forward's two), the same number for every contender, so TFLOP/s ratios are time ratios.
Memory: every row's peak bytes allocated during its checked call beyond what existed before
(``torch.cuda.max_memory_allocated``); :func:`memory_table` shows them at L = 16k.

Results go to their own file (``"kind": "variants"``, under ``results/triton/``), written after every measurement;
the same command resumes a run cut short (``--time-budget``). :func:`variants_table` prints the README's table and
the issue's bars (:data:`BARS`): plain forward at least 1.0x SDPA FLASH's speed, every variant at least 0.9x
FlexAttention's forward and 0.8x its fwd+bwd.

Three modules: :mod:`.variant_workloads` (what is measured: the variants, workloads, FLOPs and presets),
this one (the contenders, the checks and the run) and :mod:`.variant_tables` (the results read back: tables, bars,
the README's block); the names of the other two are importable from here as well.
"""

from __future__ import annotations

import argparse
import sys
import time
import warnings
import zlib
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Callable, Optional

from ..results_files import REPO_ROOT, gpu_results_path, load_results, recorded_arguments, round_significant
from ..timing import free_device_memory
from ..tuning import sdpa_call
from .failures import error_line, is_refusal
from .measure import (TimingPolicy, finish_results, flex_problem, measure_jobs, open_results, stamp_timing,
                      tensor_device, time_checked)
from .results import add_speedups, new_results
from .sweeps import Refused
from .variant_tables import (BARS, README_VARIANTS_END, README_VARIANTS_START, bar_verdicts, memory_table,
                             update_variants_readme, variants_table, window_sweep_table)
from .variant_workloads import (BASE_VARIANTS, MODES, PRESET_GROUPS, VARIANT_PRESETS, VARIANTS, VariantPreset,
                                VariantSpec, VariantWorkload, alibi_slopes, document_ids, document_lengths, pass_flops,
                                variant_record_key, visible_pairs, window_sides)

__all__ = ["VariantSpec", "VARIANTS", "VariantWorkload", "VariantPreset", "VARIANT_PRESETS", "PRESET_GROUPS", "MODES",
           "BARS", "CHECK_ROWS", "VariantContender", "variant_contenders", "window_sides", "document_ids",
           "document_lengths", "alibi_slopes", "visible_pairs", "pass_flops", "with_sinks", "lse_with_sinks",
           "flex_modifications", "flex_block_mask", "flex_attention_with", "Problem", "make_problem", "plan_variants",
           "variant_record_key", "skip_reason", "measure_one", "run_variants", "default_variants_output",
           "variants_table", "bar_verdicts", "window_sweep_table", "memory_table", "update_variants_readme", "main",
           "README_VARIANTS_START", "README_VARIANTS_END", "VARIANT_NOTES"]

CHECK_ROWS = 256  # query rows of batch 0, head 0 that the forward's check compares (every key)


VARIANT_NOTES = {
    "modes": "forward: out = f(q, k, v); fwd+bwd: the forward, then torch.autograd.grad of q, k, v (and the bias and "
             "the sinks where the variant has them) for a random dout, timed together. triton-kernel: the stage's "
             "registered forward and backward called directly",
    "flops": "over the visible (query, key) pairs only: forward 4*B*H*pairs*D, fwd+bwd 3.5 x",
    "flex": "FlexAttention compiled once per workload; softcap, ALiBi and bias as one score_mod, causal, window and "
            "documents as a block mask from create_block_mask; sinks as out * sigmoid(lse - sink) on its LSE "
            "(exact: the normaliser with a sink is exp(lse) + exp(sink))",
    "check": f"forward: wb.check with the variants on {CHECK_ROWS} query rows of batch 0, head 0 against every key "
             "(the last rows when causal); gradients: head 0 of every batch entry (dq, dk, dv, dbias, dsinks) "
             "against float64 autograd on the device, within 2 x the same formula's error in the inputs' dtype + "
             "the storage floor",
    "memory": "peak_bytes (GPU only): allocated during the checked call beyond what existed before it (inputs, the "
              "variants' tensors), outputs and gradients included",
}


# ----------------------------------------------------------------------------------------------
# FlexAttention with the same modifications
# ----------------------------------------------------------------------------------------------

def with_sinks(out, lse, sinks):
    """Attention with sinks from attention without them: ``out * sigmoid(lse - sink_h)``, in float32 (or wider),
    returned in out's dtype. `out` (B, H, L, D) and `lse` (B, H, L) (natural log) of the same scores without the
    sinks, `sinks` (H,). Exact: the sink adds exp(sink) to each row's normaliser exp(lse), so every probability, and
    their weighted sum of the values, is multiplied by exp(lse) / (exp(lse) + exp(sink)) = 1 / (1 + exp(sink - lse))."""
    import torch

    wide = torch.promote_types(lse.dtype, torch.float32)  # float32 at least (float64 stays float64)
    weight = torch.sigmoid(lse.to(wide) - sinks.to(wide)[None, :, None])
    return (out.to(wide) * weight[..., None]).to(out.dtype)


def lse_with_sinks(lse, sinks):
    """The LSE with the sinks in it, as the package reports it: log(exp(lse) + exp(sink_h))."""
    import torch

    wide = torch.promote_types(lse.dtype, torch.float32)
    return torch.logaddexp(lse.to(wide), sinks.to(wide)[None, :, None])


def flex_modifications(spec: VariantSpec, *, slopes=None, bias=None, ids=None) -> tuple:
    """``(score_mod, mask_mod)`` for FlexAttention computing `spec` (None where the variant needs none), in the
    package's order: softcap on the scaled score, then ALiBi (``- slope_h |i - j|``) and the bias, then the masks
    (causal, window, documents, all top-left as in the benchmark's calls). `slopes` (H,), `bias` (1, H, L, L) and
    `ids` (B, L) are the tensors the mods read (captured: a bias that requires grad gets FlexAttention's gradient)."""
    softcap = spec.softcap
    scored = softcap is not None or slopes is not None or bias is not None
    score_mod = None
    if scored:
        import torch

        def score_mod(score, b, h, q_idx, kv_idx):
            if softcap is not None:
                score = softcap * torch.tanh(score / softcap)
            if slopes is not None:
                score = score - slopes[h] * (q_idx - kv_idx).abs()
            if bias is not None:
                score = score + bias[0, h, q_idx, kv_idx]
            return score

    masks = []
    if spec.causal:
        masks.append(lambda b, h, q_idx, kv_idx: q_idx >= kv_idx)
    sides = window_sides(spec)
    if sides is not None:
        left, right = sides
        masks.append(lambda b, h, q_idx, kv_idx: (kv_idx - q_idx >= -left) & (kv_idx - q_idx <= right))
    if ids is not None:
        masks.append(lambda b, h, q_idx, kv_idx: ids[b, q_idx] == ids[b, kv_idx])
    if not masks:
        return score_mod, None
    if len(masks) == 1:
        return score_mod, masks[0]
    from torch.nn.attention.flex_attention import and_masks

    return score_mod, and_masks(*masks)


def flex_block_mask(workload: VariantWorkload, ids=None, device="cpu"):
    """FlexAttention's block mask of the workload's masks (``create_block_mask`` on :func:`flex_modifications`'
    mask_mod; per batch entry with documents, else shared), or None for a variant that hides no key."""
    from torch.nn.attention.flex_attention import create_block_mask

    w, spec = workload, workload.spec
    _, mask_mod = flex_modifications(spec, ids=ids)
    if mask_mod is None:
        return None
    return create_block_mask(mask_mod, w.B if spec.documents else None, None, w.L, w.L, device=device)


def flex_attention_with(spec: VariantSpec, flex=None, *, block_mask=None, slopes=None, bias=None, ids=None,
                        sinks=None) -> Callable:
    """``attend(q, k, v) -> out``: FlexAttention (`flex`, default ``flex_attention`` itself: pass the compiled one)
    with `spec`'s modifications (:func:`flex_modifications`), `block_mask` from their mask_mod, and the sinks applied
    to its LSE (:func:`with_sinks`). Compile the returned function (not only `flex`) and the correction is fused."""
    from torch.nn.attention import flex_attention as module

    flex = flex or module.flex_attention
    score_mod, _ = flex_modifications(spec, slopes=slopes, bias=bias, ids=ids)
    if sinks is None:
        return lambda q, k, v: flex(q, k, v, score_mod=score_mod, block_mask=block_mask)
    request = getattr(module, "AuxRequest", None)

    def attend(q, k, v):
        if request is not None:
            out, aux = flex(q, k, v, score_mod=score_mod, block_mask=block_mask, return_aux=request(lse=True))
            lse = aux.lse
        else:  # torch before AuxRequest
            out, lse = flex(q, k, v, score_mod=score_mod, block_mask=block_mask, return_lse=True)
        return with_sinks(out, lse, sinks)

    return attend


# ----------------------------------------------------------------------------------------------
# Inputs
# ----------------------------------------------------------------------------------------------

@dataclass
class Problem:
    """One workload's tensors on the device: q, k, v, dout (B, H, L, D), and the variant's: ``alibi_slopes`` (H,)
    float32, ``bias`` (1, H, L, L) in the inputs' dtype, ``sinks`` (H,) float32, ``document_ids`` (B, L) int64."""

    workload: VariantWorkload
    q: object
    k: object
    v: object
    dout: object
    tensors: dict = field(default_factory=dict)

    def variant_arguments(self, tensors: Optional[dict] = None) -> dict:
        """``wb.attention``'s keyword arguments for the variant (`tensors` replaces the problem's, e.g. leaves)."""
        spec = self.workload.spec
        given = dict(self.tensors, **(tensors or {}))
        found = {name: given[name] for name in ("alibi_slopes", "bias", "document_ids", "sinks") if name in given}
        if spec.softcap is not None:
            found["softcap"] = spec.softcap
        if spec.window is not None:
            found["window"] = window_sides(spec)
        return found

    def leaves(self) -> tuple:
        """``(leaves, arguments)``: q, k, v and the differentiable variant tensors as new leaves that require grad
        (sharing the problem's storage), in the gradients' order, and the variant arguments that use them."""
        spec = self.workload.spec
        leaves = [x.detach().requires_grad_(True) for x in (self.q, self.k, self.v)]
        own = {name: self.tensors[name].detach().requires_grad_(True) for name in spec.differentiable}
        return leaves + [own[name] for name in spec.differentiable], self.variant_arguments(own)


def make_problem(workload: VariantWorkload, seed: int, device: str) -> Problem:
    """Standard normal q, k, v, dout and the variant's tensors, drawn per workload (a resumed run sees the same)."""
    import torch

    w, spec = workload, workload.spec
    generator = torch.Generator(device=device).manual_seed((zlib.crc32(w.key.encode()) + seed) % 2 ** 31)
    dtype = getattr(torch, w.dtype)

    def draw(*shape, kind=dtype):
        return torch.randn(shape, generator=generator, device=device, dtype=kind)

    q, k, v, dout = (draw(w.B, w.H, w.L, w.D) for _ in range(4))
    tensors = {}
    if spec.alibi:
        tensors["alibi_slopes"] = torch.from_numpy(alibi_slopes(w.H)).to(device)
    if spec.bias:
        tensors["bias"] = draw(1, w.H, w.L, w.L)
    if spec.sinks:
        tensors["sinks"] = draw(w.H, kind=torch.float32)
    if spec.documents:
        ids = torch.from_numpy(document_ids(w.L, spec.documents)).to(device)
        tensors["document_ids"] = ids[None].expand(w.B, w.L).contiguous()
    return Problem(w, q, k, v, dout, tensors)


def _named(grads, names) -> dict:
    return dict(zip(names, grads))


def _gradient_names(spec: VariantSpec) -> tuple:
    return ("q", "k", "v") + spec.differentiable


# ----------------------------------------------------------------------------------------------
# Contenders
# ----------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class VariantContender:
    """Something that computes attention with variants. ``prepare(problem, mode)`` does the untimed setup (and any
    compilation) and returns the timed zero-argument call: it returns the output (forward) or the gradients as a dict
    ``{"q", "k", "v", "bias"?, "sinks"?}`` (fwd+bwd). ``variants``: the variants it is planned for (None: all);
    ``refusal(workload, mode, on_cuda)`` says why it cannot run a row here (recorded as skipped), or None."""

    name: str
    kind: str  # "stage" (through wb.attention), "kernel" (the registered forward and backward) or "baseline"
    what: str
    prepare: Callable
    variants: Optional[tuple] = None
    dtypes: Optional[tuple] = None
    refusal: Callable = lambda workload, mode, on_cuda: None


def _causal(spec: VariantSpec):
    return "top_left" if spec.causal else None


def _meta_inputs(workload: VariantWorkload, on_cuda: bool):
    """q, k, v of the workload's shape and dtype on the run's device, as strided views of one element (what
    validation reads: shapes, dtypes, devices)."""
    import torch

    w = workload
    device = "cuda" if on_cuda else "cpu"
    one = torch.zeros(1, dtype=getattr(torch, w.dtype), device=device)
    return tuple(one.expand(w.B, w.H, w.L, w.D) for _ in range(3))


def _stage_refusal(name: str) -> Callable:
    def refusal(workload: VariantWorkload, mode: str, on_cuda: bool) -> Optional[str]:
        from ..api import validate
        from ..stages import available_stages, get_backward

        stage = available_stages().get(name)
        if stage is None:
            return f"{name!r} is not a stage of this package"
        if stage.needs_gpu and not on_cuda:
            return "needs a CUDA GPU; this run is on the CPU"
        if mode == "fwd+bwd":
            try:
                get_backward(name)
            except ValueError as error:
                return str(error)
        missing = [v for v in _used_variants(workload.spec) if v not in stage.variants]
        if missing:
            return f"stage {name!r} does not compute {', '.join(missing)}"
        try:  # the sizes it refuses here (memory, the interpreter's time) are skipped, not crashed
            validate(*_meta_inputs(workload, on_cuda), stage=name, causal=workload.spec.causal)
        except (MemoryError, ValueError, TypeError) as error:
            return error_line(error)
        return None

    return refusal


def _used_variants(spec: VariantSpec) -> tuple:
    used = {"softcap": spec.softcap is not None, "alibi_slopes": spec.alibi, "bias": spec.bias,
            "window": spec.window is not None, "document_ids": spec.documents > 0, "sinks": spec.sinks}
    return tuple(name for name, on in used.items() if on)


def _attention_prepare(stage: str) -> Callable:
    """wb.attention(stage=...) as users call it: with no grad in the forward, through autograd in fwd+bwd."""
    def prepare(problem: Problem, mode: str) -> Callable:
        import torch

        from ..api import attention

        causal = problem.workload.spec.causal
        if mode == "forward":
            arguments = problem.variant_arguments()
            return lambda: attention(problem.q, problem.k, problem.v, stage=stage, causal=causal, **arguments)
        leaves, arguments = problem.leaves()
        names = _gradient_names(problem.workload.spec)

        def call():
            out = attention(*leaves[:3], stage=stage, causal=causal, **arguments)
            return _named(torch.autograd.grad(out, leaves, problem.dout), names)

        return call

    return prepare


def _kernel_prepare(stage_name: str) -> Callable:
    """The stage's registered forward (and backward) with the canonical variants: no validation, no autograd."""
    def prepare(problem: Problem, mode: str) -> Callable:
        import torch

        from ..stages import get_backward, get_stage
        from ..variants import canonical_variants

        q, k, v, dout = problem.q, problem.k, problem.v, problem.dout
        options = dict(causal=_causal(problem.workload.spec), key_padding_mask=None, scale=None,
                       variants=canonical_variants(q, k, **problem.variant_arguments()))
        forward = get_stage(stage_name).forward
        if mode == "forward":
            return lambda: forward(q, k, v, **options)[0]
        gradients = get_backward(stage_name).gradients

        def call():
            with torch.no_grad():
                out, lse = forward(q, k, v, **options)
                found = gradients(q, k, v, out, lse, dout, **options)
            return found if isinstance(found, dict) else _named(found, ("q", "k", "v"))

        return call

    return prepare


def _sdpa_prepare(backend: str) -> Callable:
    def prepare(problem: Problem, mode: str) -> Callable:
        import torch

        causal = problem.workload.spec.causal
        if mode == "forward":
            return sdpa_call(problem.q, problem.k, problem.v, backend, is_causal=causal)
        leaves, _ = problem.leaves()
        forward = sdpa_call(*leaves, backend, is_causal=causal)
        return lambda: _named(torch.autograd.grad(forward(), leaves, problem.dout), ("q", "k", "v"))

    return prepare


_FLEX = {}  # {"workload": the workload, "block_mask": its block mask}: built once per workload


def _flex_prepare(problem: Problem, mode: str) -> Callable:
    """FlexAttention compiled with the workload's modifications (:func:`flex_attention_with`): the block mask and
    dynamo's reset once per workload, one compilation per mode (with and without grad), both before the check."""
    import torch

    w, spec = problem.workload, problem.workload.spec
    if _FLEX.get("workload") != w:
        _FLEX.clear()
        torch._dynamo.reset()  # as measure's FlexAttention: past the recompile limit it would run unfused
        _FLEX.update(workload=w, block_mask=flex_block_mask(w, problem.tensors.get("document_ids"), problem.q.device))
    if mode == "forward":
        tensors, leaves = problem.tensors, None
    else:
        leaves, _ = problem.leaves()
        tensors = dict(problem.tensors, **dict(zip(spec.differentiable, leaves[3:])))
    attend = torch.compile(flex_attention_with(spec, block_mask=_FLEX["block_mask"],
                                               slopes=tensors.get("alibi_slopes"), bias=tensors.get("bias"),
                                               sinks=tensors.get("sinks")), dynamic=False, fullgraph=True)
    if mode == "forward":
        call = lambda: attend(problem.q, problem.k, problem.v)  # noqa: E731
    else:
        names = _gradient_names(spec)

        def call():
            return _named(torch.autograd.grad(attend(*leaves[:3]), leaves, problem.dout), names)

    call()  # the compilation (and, in fwd+bwd, the backward's) happens here
    return call


def variant_contenders() -> dict:
    """{name: VariantContender}: the triton stage through wb.attention and bare, FlexAttention, and for plain and
    causal SDPA's FLASH and cuDNN and the mma and hopper stages."""
    sixteen = ("float16", "bfloat16")

    def gpu_only(why_not_here: Callable) -> Callable:
        def refusal(workload, mode, on_cuda):
            return why_not_here() if on_cuda else "needs a CUDA GPU; this run is on the CPU"
        return refusal

    found = {
        "triton": VariantContender("triton", "stage", "wb.attention(stage='triton', <variants>) (+ autograd)",
                                   _attention_prepare("triton"), refusal=_stage_refusal("triton")),
        "triton-kernel": VariantContender("triton-kernel", "kernel",
                                          "get_stage('triton').forward and get_backward('triton').gradients, bare",
                                          _kernel_prepare("triton"), refusal=_stage_refusal("triton")),
        # on a CPU FlexAttention would be Inductor's C++ kernel, not the GPU baseline the bars name
        "flex": VariantContender("flex", "baseline", "FlexAttention compiled: score_mod + block mask (+ autograd); "
                                 "sinks as out * sigmoid(lse - sink)", _flex_prepare, dtypes=sixteen,
                                 refusal=gpu_only(flex_problem)),
    }
    for name, backend in (("sdpa-flash", "FLASH_ATTENTION"), ("sdpa-cudnn", "CUDNN_ATTENTION")):
        found[name] = VariantContender(name, "baseline", f"SDPA forced to {backend} (+ autograd)",
                                       _sdpa_prepare(backend), BASE_VARIANTS, sixteen,
                                       gpu_only(lambda: None))
    for name in ("mma", "hopper"):
        found[name] = VariantContender(name, "stage", f"wb.attention(stage={name!r}) (+ autograd)",
                                       _attention_prepare(name), BASE_VARIANTS, refusal=_stage_refusal(name))
    return found


def skip_reason(contender: VariantContender, workload: VariantWorkload, mode: str,
                on_cuda: Optional[bool] = None) -> Optional[str]:
    """Why `contender` cannot run this row on this machine (`on_cuda`: None = ask), or None."""
    return contender.refusal(workload, mode, tensor_device() == "cuda" if on_cuda is None else on_cuda)


def plan_variants(presets, table: dict) -> list:
    """[(contender, workload, mode, [preset names])] of the presets, in run order (by workload, then mode, then the
    preset's contender order); contenders not in `table`, variants and dtypes a contender is not planned for are left
    out. A row that cannot run here is planned: the run records it as skipped, with the reason."""
    jobs = {}
    for preset in presets:
        found = VARIANT_PRESETS[preset]
        for workload in found.workloads:
            for mode in found.modes:
                for name in found.contenders:
                    contender = table.get(name)
                    if contender is None or (contender.variants is not None
                                             and workload.variant not in contender.variants) \
                            or (contender.dtypes is not None and workload.dtype not in contender.dtypes):
                        continue
                    key = variant_record_key(name, mode, workload)
                    jobs.setdefault(key, (contender, workload, mode, []))[3].append(preset)
    return list(jobs.values())


# ----------------------------------------------------------------------------------------------
# The check
# ----------------------------------------------------------------------------------------------

def _device_storage_floor(ref, dtype) -> float:
    """:func:`wb_kernels.check.storage_floor` on the device: 2x the rounding of storing `ref` in `dtype`."""
    finite = ref.nan_to_num(0.0, 0.0, 0.0)
    return 2.0 * float(((finite.to(dtype) + 0.3 - 0.3).double() - finite).abs().max()) if ref.numel() else 0.0


def _number(x: float):
    """`x` as a results file keeps it: rounded, or its name ("inf", "nan") where it is not finite (the file is JSON
    without NaN or Infinity)."""
    import math

    return round_significant(x, 3) if math.isfinite(x) else str(x)


class _Judge:
    """The checks of one workload's rows, each reference built on first use (module docstring: the check)."""

    def __init__(self, problem: Problem):
        self.problem = problem
        self._forward = None  # (slice arguments, reference (out, lse))
        self._gradients = None  # ({name: float64 reference}, {name: tolerance})

    # -------------------------------------------------------------------- forward
    def _forward_slice(self) -> tuple:
        """The rows the forward's check compares, as wb.check's arguments: the last CHECK_ROWS rows with
        causal="bottom_right" when causal (on the full problem's diagonal), the first ones otherwise."""
        p = self.problem
        spec, L = p.workload.spec, p.workload.L
        n = min(CHECK_ROWS, L)
        rows = slice(L - n, L) if spec.causal else slice(0, n)
        causal = ("bottom_right" if n < L else True) if spec.causal else False
        tensors = {}
        for name, x in p.tensors.items():
            if name == "bias":
                tensors[name] = x[:1, :1, rows]
            elif name == "document_ids":
                tensors[name] = (x[:1, rows], x[:1])
            else:  # alibi_slopes, sinks (H,)
                tensors[name] = x[:1]
        arguments = dict(p.variant_arguments(tensors), causal=causal)
        return rows, arguments, p.q[:1, :1, rows], p.k[:1, :1], p.v[:1, :1]

    def forward(self, name: str, out) -> dict:
        from ..check import check
        from ..reference import reference

        if self._forward is None:
            rows, arguments, q, k, v = self._forward_slice()
            self._forward = (rows, arguments, (q, k, v), reference(q, k, v, **arguments))
        rows, arguments, (q, k, v), ref = self._forward
        verdict = check(name, out[:1, :1, rows], q, k, v, ref=ref, verbose=False, raise_on_failure=False,
                        **arguments)
        return {"max_err": _number(verdict.max_err), "tol": _number(verdict.tol),
                "passed": verdict.passed, "line": verdict.line()}

    # -------------------------------------------------------------------- gradients
    def _head_gradients(self, dtype) -> dict:
        """Autograd's gradients of head 0 (every batch entry) through the same formula in PyTorch ops
        (:func:`wb_kernels.check.torch_ops_attention`) computed in `dtype` (float64: the reference)."""
        import torch

        from ..check import torch_ops_attention
        from ..variants import canonical_variants

        p = self.problem
        spec = p.workload.spec
        leaves = [x[:, :1].detach().to(dtype).requires_grad_(True) for x in (p.q, p.k, p.v)]
        own = {}
        for name, x in p.tensors.items():
            if name == "document_ids":
                own[name] = x
            elif name == "bias":
                own[name] = x[:, :1].detach().to(dtype).requires_grad_(True)
            else:  # alibi_slopes, sinks: PyTorch's error computes them in the inputs' dtype, as wb.check does
                own[name] = x[:1].detach().to(dtype).requires_grad_(name == "sinks")
        arguments = p.variant_arguments(own)
        variants = canonical_variants(leaves[0], leaves[1], **arguments)
        out, _ = torch_ops_attention(*leaves, causal=_causal(spec) or False, variants=variants)
        wanted = leaves + [own[name] for name in spec.differentiable]
        grads = torch.autograd.grad(out, wanted, p.dout[:, :1].to(dtype))
        return {name: g.detach() for name, g in zip(_gradient_names(spec), grads)}

    def gradients(self, name: str, grads: dict) -> dict:
        import torch

        p = self.problem
        names = _gradient_names(p.workload.spec)
        if self._gradients is None:
            ref = self._head_gradients(torch.float64)
            theirs = self._head_gradients(p.q.dtype)
            given_dtypes = {"q": p.q.dtype, "k": p.k.dtype, "v": p.v.dtype, **{n: x.dtype for n, x in
                                                                                 p.tensors.items()}}
            tols = {n: 2.0 * float((theirs[n].double() - ref[n]).abs().max())
                    + _device_storage_floor(ref[n], given_dtypes[n]) for n in names}
            del theirs
            free_device_memory()
            self._gradients = (ref, tols)
        ref, tols = self._gradients
        errors = {}
        for n in names:
            mine = grads[n][:1] if n == "sinks" else grads[n][:, :1]
            errors[n] = float((mine.double() - ref[n]).abs().max().nan_to_num(float("inf")))
        passed = all(errors[n] <= tols[n] for n in names)
        line = f"{name} gradients: " + ", ".join(
            f"d{n} max |err| {errors[n]:.1e} {'≤' if errors[n] <= tols[n] else '>'} tol {tols[n]:.1e}"
            for n in names) + (" ✓" if passed else " ✗")
        return {"errors": [_number(errors[n]) for n in names], "tols": [_number(tols[n]) for n in names],
                "names": [f"d{n}" for n in names],
                "passed": passed, "line": line}


# ----------------------------------------------------------------------------------------------
# One measurement
# ----------------------------------------------------------------------------------------------

def _base_record(contender: VariantContender, workload: VariantWorkload, mode: str) -> dict:
    w, spec = workload, workload.spec
    pairs = visible_pairs(spec, w.L)
    return {"key": variant_record_key(contender.name, mode, w), "contender": contender.name, "kind": contender.kind,
            "mode": mode, "variant": w.variant, "dtype": w.dtype, "B": w.B, "H": w.H, "Lq": w.L, "Lk": w.L,
            "D": w.D, "causal": spec.causal, "window": window_sides(spec), "softcap": spec.softcap,
            "documents": spec.documents, "window_override": w.window, "visible_pairs": pairs,
            "visible_fraction": round_significant(pairs / w.L ** 2, 4), "flops": pass_flops(w, mode)}


def measure_one(contender: VariantContender, workload: VariantWorkload, mode: str, problem: Problem, judge: _Judge,
                policy: TimingPolicy, on_cuda: bool) -> dict:
    """Check, then time, one contender on one workload in one mode; never raises for the contender's own failures
    (they become status "skipped": cannot run this here, or "failed")."""
    from ..timing import peak_memory

    record = _base_record(contender, workload, mode)
    why = contender.refusal(workload, mode, on_cuda)
    if why:
        record.update(status="skipped", reason=why)
        return record
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # SDPA warns about each kernel it rejects; FlexAttention about its API
            call = contender.prepare(problem, mode)
            # on a CPU tracemalloc would see none of torch's buffers and slow the interpreter's Python 3-4x
            result, memory = peak_memory(call) if on_cuda else (call(), None)
    except Exception as error:  # noqa: BLE001 - recorded, the sweep goes on
        record.update(status="skipped" if is_refusal(error) else "failed", reason=error_line(error))
        free_device_memory()
        return record
    if memory is not None:
        record.update(peak_bytes=int(memory.peak_bytes), peak_device=memory.device)
    try:
        record["check"] = judge.forward(contender.name, result) if mode == "forward" else \
            judge.gradients(contender.name, result)
    except Exception as error:  # noqa: BLE001 - the reference could not be built (out of memory, most likely)
        record.update(status="skipped", reason=f"could not check: {error_line(error)}")
        free_device_memory()
        return record
    del result
    return time_checked(record, contender, call, policy, workload.B * workload.L)


# ----------------------------------------------------------------------------------------------
# The run
# ----------------------------------------------------------------------------------------------

def default_variants_output(on_cuda: bool) -> Path:
    """results/triton/variants_<gpu>.json (h100, h200, ...), or results/triton/variants_smoke.json."""
    return gpu_results_path("triton", "variants", on_cuda=on_cuda, smoke_name="variants_smoke.json")


def _new_variants(presets, command) -> dict:
    return {**new_results(presets, command), "kind": "variants", "notes": VARIANT_NOTES}


def run_variants(presets, out_path, *, policy: Optional[TimingPolicy] = None, resume: bool = True,
                 retry_failed: bool = False, seed: int = 0, progress: bool = True,
                 time_budget: Optional[float] = None, table: Optional[dict] = None, command: Optional[str] = None,
                 log=print) -> dict:
    """Run the `presets` (names in :data:`VARIANT_PRESETS`) into `out_path`; return the results. The timing policy
    is `policy`, else the first preset's own, else the default. `retry_failed`: drop the records a resumed file holds
    as failed, so that they are measured again."""
    started = time.monotonic()
    presets = list(presets)
    cpu = [p for p in presets if VARIANT_PRESETS[p].cpu]
    if cpu and len(presets) > 1:
        raise Refused(f"the {', '.join(cpu)} preset runs on the CPU: run it alone, not with {', '.join(presets)}")
    policy = policy or next((VARIANT_PRESETS[p].policy for p in presets if VARIANT_PRESETS[p].policy), None) \
        or TimingPolicy()
    table = table if table is not None else variant_contenders()
    on_cuda = tensor_device() == "cuda" and not cpu
    out_path = Path(out_path)
    results = open_results(out_path, presets, resume=resume, command=command, kind="variants", fresh=_new_variants)
    stamp_timing(results, policy, out_path)
    results["contenders"] = {name: c.what for name, c in table.items()}
    device = "cuda" if on_cuda else "cpu"

    def prepare(workload):
        problem = make_problem(workload, seed, device)
        return problem, _Judge(problem)

    stopped = measure_jobs(
        results, plan_variants(presets, table), out_path, key_of=variant_record_key, prepare=prepare,
        measure_row=lambda contender, workload, mode, state: measure_one(
            contender, workload, mode, *(state or (None, None)), policy, on_cuda),
        base_record=_base_record,
        wants_inputs=lambda contender, workload, mode: contender.refusal(workload, mode, on_cuda) is None,
        started=started, time_budget=time_budget, retry_failed=retry_failed, progress=progress, what="variant",
        log=log, release=_FLEX.clear)
    add_speedups(results)
    return finish_results(results, out_path, stopped=stopped, time_budget=time_budget, log=log)


# ----------------------------------------------------------------------------------------------
# The command line
# ----------------------------------------------------------------------------------------------

def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m wb_kernels.bench.variants",
                                     description="The triton stage's variants against FlexAttention (lesson 11).")
    parser.add_argument("--preset", action="append", choices=sorted(VARIANT_PRESETS) + sorted(PRESET_GROUPS),
                        help="what to run (repeatable; default: bar on a GPU, smoke on a CPU)")
    parser.add_argument("--json", type=Path, help="the results file (default: results/triton/variants_<gpu>.json)")
    parser.add_argument("--time-budget", type=float, help="stop starting rows after this many seconds; the same "
                                                          "command resumes")
    parser.add_argument("--seconds", type=float, help="about this many seconds of samples per row (default 1)")
    parser.add_argument("--fresh", action="store_true", help="start a new file instead of resuming")
    parser.add_argument("--retry-failed", action="store_true", help="measure a resumed file's failed rows again")
    parser.add_argument("--time-failed-checks", action="store_true", help="time a triton row that fails its check")
    parser.add_argument("--no-progress", action="store_true")
    parser.add_argument("--plan", action="store_true", help="list the rows (and why any is skipped here); run nothing")
    parser.add_argument("--table", type=Path, help="print the tables of this results file; run nothing")
    return parser


def main(argv=None) -> int:
    import os

    from ..timing import on_gpu

    args = _parser().parse_args(argv)
    if args.table is not None:
        results = load_results(args.table)
        print("\n\n".join(part for part in (variants_table(results, args.table.name), window_sweep_table(results),
                                            memory_table(results)) if part))
        return 0
    gpu = on_gpu()
    presets = []
    for name in args.preset or (["bar"] if gpu else ["smoke"]):
        presets += [p for p in PRESET_GROUPS.get(name, (name,)) if p not in presets]
    on_cpu = [p for p in presets if VARIANT_PRESETS[p].cpu]
    if on_cpu and len(presets) > 1:
        print(f"error: the {', '.join(on_cpu)} preset runs on the CPU: run it alone", file=sys.stderr)
        return 2
    if on_cpu or not gpu:
        # the triton stage runs on Triton's interpreter: chosen before anything imports triton
        os.environ.setdefault("TRITON_INTERPRET", "1")
        gpu = False
    if not gpu and not args.plan and not on_cpu:
        print("error: the variants benchmark times FlexAttention and the triton stage on a CUDA GPU; this machine has "
              "none. --preset smoke runs the triton stage on Triton's interpreter instead.", file=sys.stderr)
        return 2
    table = variant_contenders()
    if args.plan:
        for contender, workload, mode, names in plan_variants(presets, table):
            why = skip_reason(contender, workload, mode, gpu)
            print(f"{variant_record_key(contender.name, mode, workload)}" + (f"  [skipped: {why}]" if why else ""))
        return 0
    policy = None
    if args.seconds is not None or args.time_failed_checks:
        base = VARIANT_PRESETS[presets[0]].policy or TimingPolicy()
        policy = replace(base, seconds=args.seconds if args.seconds is not None else base.seconds,
                         time_failed_checks=args.time_failed_checks)
    out = args.json if args.json is not None else default_variants_output(gpu)
    given = list(argv if argv is not None else sys.argv[1:])
    command = "python -m wb_kernels.bench.variants " + recorded_arguments(given, REPO_ROOT)
    results = run_variants(presets, out, policy=policy, resume=not args.fresh, retry_failed=args.retry_failed,
                           progress=not args.no_progress, time_budget=args.time_budget, table=table,
                           command=command.strip())
    print(variants_table(results, out.name))
    sweep = window_sweep_table(results)
    if sweep:
        print("\n" + sweep)
    return 0


if __name__ == "__main__":
    sys.exit(main())
