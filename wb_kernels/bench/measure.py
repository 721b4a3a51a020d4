"""How the benchmark measures (the dashboard lesson): the contenders, one measurement, and the resumable sweep.

What one measurement is (the rules the dashboard lesson teaches, and :func:`wb_kernels.bench.pitfalls.honesty_demos`
demonstrates):

- fresh random inputs (never zeros: zeros make some GPUs run faster), drawn once per shape and
  shared by every contender, so all of them see exactly the same numbers;
- correctness first: each contender's output for the first (batch, head) is checked against the
  float64 reference with :func:`wb_kernels.check.check` before it is timed; a stage that fails is
  not timed, a baseline that fails is timed and flagged;
- warm-up calls (compilation, cuDNN plans, the allocator), then CUDA-event timing of the device's work
  (a sleeping kernel queued before every repeat) with the L2 cache flushed clean by reading before every repeat
  (:func:`wb_kernels.timing.time_call` with :data:`wb_kernels.timing.DEVICE_TIME`, the one method every preset
  uses, recorded in the file as ``"timing"``), repeated until about
  ``--seconds`` of samples exist (at least 3, or 2 for calls slower than a second); median and
  spread, never the mean;
- peak memory: the bytes allocated beyond the inputs during the checked call (output included),
  next to the stage's analytic workspace (``Stage.workspace_bytes``);
- the ceilings the roofline is drawn against (large fp16/bf16/fp32 matmuls, a device-to-device
  copy) are measured in the same run.

Results are written after every measurement; running the same command again skips what is done,
so a sweep cut short (``--time-budget``, a lost machine) continues where it stopped.
"""

from __future__ import annotations

import importlib
import math
import statistics
import time
import warnings
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Callable, Optional

from ..attention_costs import ITEMSIZE, attention_flops, minimum_bytes
from ..results_files import environment, load_results, round_significant, save_results
from ..stages import available_stages
from ..timing import DEVICE_TIME, TimingMethod, free_device_memory
from ..tuning import sdpa_call
from . import flashinfer
from .failures import SizeRefused, error_line, is_out_of_memory, is_refusal
from .results import add_speedups, new_results
from .sweeps import BASELINES, Config, Refused, record_key

__all__ = ["Contender", "contenders", "TimingPolicy", "DEVICE_TIME", "measure", "measure_ceilings", "plan", "run",
           "stamp_timing"]


# ----------------------------------------------------------------------------------------------
# Contenders: the package's stages and PyTorch's (and others') attention
# ----------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Contender:
    """Something that computes attention. ``prepare(q, k, v, causal)`` does the untimed setup and
    returns ``(call, as_bhld)``: the timed zero-argument call, and a function turning its result
    into the output (B, H, L, D) for the check."""

    name: str
    kind: str  # "stage" or "baseline"
    prepare: Callable
    dtypes: Optional[tuple] = None  # None: any
    head_dims: Optional[tuple] = None
    needs_gpu: bool = False
    unavailable: Optional[str] = None  # why it cannot run here at all (not installed, ...)
    workspace_bytes: Optional[Callable] = None


def _gqa_options(q, k) -> dict:
    """``enable_gqa=True`` for SDPA and FlexAttention when k and v have fewer heads than q (grouped-query attention);
    nothing otherwise, so that multi-head problems call them exactly as before."""
    return {"enable_gqa": True} if k.shape[1] != q.shape[1] else {}


def _sdpa_prepare(backend_name: Optional[str]):
    def prepare(q, k, v, causal):
        return sdpa_call(q, k, v, backend_name, is_causal=causal, **_gqa_options(q, k)), None

    return prepare


def _eager_prepare(q, k, v, causal):
    """softmax(q k^T * scale) v as three PyTorch ops, the way attention is written by hand.
    The softmax runs in float32 (as real models do), so half precision stays accurate. Grouped-query K and V are
    repeated to q's heads in the call, as hand-written model code does."""
    import torch

    from ..reference import repeat_kv_heads

    scale = q.shape[-1] ** -0.5
    L, Lk = q.shape[-2], k.shape[-2]
    mask = torch.ones(L, Lk, dtype=torch.bool, device=q.device).tril() if causal else None

    def call():
        keys, values = repeat_kv_heads(k, q.shape[1]), repeat_kv_heads(v, q.shape[1])
        scores = (q @ keys.transpose(-1, -2)) * scale
        if mask is not None:
            scores = scores.masked_fill(~mask, float("-inf"))
        return torch.softmax(scores.float(), dim=-1).to(q.dtype) @ values

    return call, None


def _flash_attn_prepare(q, k, v, causal):
    from flash_attn import flash_attn_func

    # flash_attn wants (B, L, H, D); the transposed copies are made here, outside the timing.
    qt, kt, vt = (x.transpose(1, 2).contiguous() for x in (q, k, v))
    return (lambda: flash_attn_func(qt, kt, vt, causal=causal)), (lambda out: out.transpose(1, 2))


def _vllm_prepare(q, k, v, causal):
    import torch
    from vllm.vllm_flash_attn import flash_attn_varlen_func

    B, H, L, D = q.shape
    qt, kt, vt = (x.transpose(1, 2).reshape(B * L, x.shape[1], D).contiguous() for x in (q, k, v))
    cu = torch.arange(0, (B + 1) * L, L, dtype=torch.int32, device=q.device)

    def call():
        return flash_attn_varlen_func(qt, kt, vt, max_seqlen_q=L, cu_seqlens_q=cu, max_seqlen_k=L,
                                      cu_seqlens_k=cu, causal=causal)

    return call, (lambda out: out.reshape(B, L, H, D).transpose(1, 2))


def causal_mask_mod(batch, head, q_index, kv_index):
    """FlexAttention's mask_mod for top-left causal attention: query i sees keys j <= i."""
    return q_index >= kv_index


def _flex_prepare(q, k, v, causal):
    """FlexAttention as a PyTorch user runs it: compiled (its Triton kernel), the causal block mask built once.

    Both the compilation and the block mask are paid here, before the checked call and the timing. Each
    configuration compiles its own kernel, specialised to its shapes (``dynamic=False``, as PyTorch's examples
    compile it); dynamo is reset first, because past its recompile limit it falls back to running flex_attention
    unfused, with a warning that the benchmark does not show, and that is not the kernel a user gets.
    ``fullgraph=True``: a graph break is an error, not a slower hybrid timed as FlexAttention.
    """
    import torch
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    torch._dynamo.reset()
    compiled = torch.compile(flex_attention, dynamic=False, fullgraph=True)
    block_mask = (create_block_mask(causal_mask_mod, None, None, q.shape[-2], k.shape[-2], device=q.device)
                  if causal else None)

    gqa = _gqa_options(q, k)

    def call():
        return compiled(q, k, v, block_mask=block_mask, **gqa)

    call()  # the compilation happens on this first call
    return call, None


def flex_problem() -> Optional[str]:
    """Why FlexAttention cannot run here (its module is missing in torch before 2.5, and torch.compile
    generates its kernel with triton), or None."""
    return _import_problem("torch.nn.attention.flex_attention") or _import_problem("triton")


def _import_problem(module: str) -> Optional[str]:
    try:
        importlib.import_module(module)
    except Exception as error:  # noqa: BLE001 - any import failure means "not usable here"
        return f"{module} is not importable here ({type(error).__name__}: {str(error).splitlines()[0][:120]})"
    return None


def _baselines() -> dict:
    return {
        "sdpa": Contender("sdpa", "baseline", _sdpa_prepare(None)),
        # PyTorch's FLASH and cuDNN backends have kernels for 16-bit inputs only: planned for those alone, not
        # tried on float32 and recorded as "No available kernel"
        "sdpa-flash": Contender("sdpa-flash", "baseline", _sdpa_prepare("FLASH_ATTENTION"), dtypes=("float16", "bfloat16")),
        "sdpa-efficient": Contender("sdpa-efficient", "baseline", _sdpa_prepare("EFFICIENT_ATTENTION")),
        "sdpa-cudnn": Contender("sdpa-cudnn", "baseline", _sdpa_prepare("CUDNN_ATTENTION"), dtypes=("float16", "bfloat16")),
        "sdpa-math": Contender("sdpa-math", "baseline", _sdpa_prepare("MATH")),
        "torch-eager": Contender("torch-eager", "baseline", _eager_prepare),
        # 16-bit only, as the kernels it is compared with: in float32 its Triton matmuls may round through TF32
        "flex": Contender("flex", "baseline", _flex_prepare, dtypes=("float16", "bfloat16"), needs_gpu=True),
        "flash_attn": Contender("flash_attn", "baseline", _flash_attn_prepare, dtypes=("float16", "bfloat16"),
                                needs_gpu=True),
        "vllm": Contender("vllm", "baseline", _vllm_prepare, dtypes=("float16", "bfloat16"), needs_gpu=True),
        # FlashInfer's batched prefill (what vLLM and SGLang serve with), its FA2 and FA3 kernels: fp16 and bf16, the
        # head dims its prebuilt choices cover (each dtype, head dim and mask is a kernel built on first use)
        "flashinfer-fa2": Contender("flashinfer-fa2", "baseline", flashinfer.prefill_prepare("fa2"),
                                    dtypes=("float16", "bfloat16"), head_dims=(64, 128, 256), needs_gpu=True),
        "flashinfer-fa3": Contender("flashinfer-fa3", "baseline", flashinfer.prefill_prepare("fa3"),
                                    dtypes=("float16", "bfloat16"), head_dims=(64, 128, 256), needs_gpu=True),
    }


def _stage_contender(stage, version=None) -> Contender:
    """The stage as the benchmark times it: its launcher alone (or, with `version`, that version of its kernel)."""
    from ..api import validate
    from ..device import like_input

    chosen = {} if version is None else {"version": version}

    def prepare(q, k, v, causal):
        try:
            validate(q, k, v, stage=stage.name, causal=causal)
        except (MemoryError, ValueError, TypeError) as refusal:  # the stage cannot take this size here
            raise SizeRefused(refusal) from refusal
        # Validated once above; the timed call is the stage's launcher alone, without the API's per-call
        # checks (its NaN/Inf scan reads q and k once more and waits for the answer on the host).
        # (like_input: the simulator's stages return NumPy; on a GPU it returns the CUDA tensor as it is)
        return (lambda: like_input(stage.forward(q, k, v, causal=causal, key_padding_mask=None, scale=None,
                                                 **chosen)[0], q)), None

    return Contender(stage.name if version is None else f"{stage.name}-{version}", "stage", prepare, dtypes=tuple(stage.dtypes), head_dims=stage.head_dims,
                     needs_gpu=stage.needs_gpu, workspace_bytes=stage.workspace_bytes)


def contenders() -> dict:
    """{name: Contender}: the package's stages (ladder order), then the baselines."""
    found = {}
    for name, stage in available_stages().items():
        found[name] = _stage_contender(stage)
        found.update({f"{name}-{version}": _stage_contender(stage, version) for version in stage.versions})
    problems = {"flex": flex_problem(), "flash_attn": _import_problem("flash_attn"),
                "vllm": _import_problem("vllm.vllm_flash_attn"), "flashinfer-fa2": flashinfer.problem(),
                "flashinfer-fa3": flashinfer.fa3_problem()}
    for name, contender in _baselines().items():
        found[name] = replace(contender, unavailable=problems.get(name))
    return found


# ----------------------------------------------------------------------------------------------
# Inputs, reference, check
# ----------------------------------------------------------------------------------------------

def tensor_device() -> str:
    from ..timing import on_gpu

    return "cuda" if on_gpu() else "cpu"


def reference_first_head(q, k, v, causal):
    """float64 reference (out, lse) for batch 0, head 0, as NumPy arrays (1, 1, L, D) and (1, 1, L).

    On the CPU this is :func:`wb_kernels.reference`. On a GPU the same formula runs in float64 on
    the GPU: at L = 16384 the NumPy version would need 6 GB of host memory and tens of seconds.
    """
    if q.device.type == "cpu":
        from ..reference import reference

        return reference(q[:1, :1], k[:1, :1], v[:1, :1], causal=causal)
    return torch_reference(q[:1, :1], k[:1, :1], v[:1, :1], causal)


def torch_reference(q, k, v, causal):
    """The float64 reference in PyTorch (same conventions as :func:`wb_kernels.reference`, no padding)."""
    import torch

    q, k, v = (x.detach().double() for x in (q, k, v))
    scores = (q @ k.transpose(-1, -2)) * q.shape[-1] ** -0.5
    if causal:
        allowed = torch.ones(q.shape[-2], k.shape[-2], dtype=torch.bool, device=q.device).tril()
        scores = scores.masked_fill(~allowed, float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)
    out = torch.exp(scores - lse[..., None]) @ v
    return out.cpu().numpy(), lse.cpu().numpy()


class _InputCache:
    """Draws one float64 set of q, k, v per shape and casts it per dtype, so every contender and
    every dtype of a shape sees the same numbers (and the draw is paid once)."""

    def __init__(self, seed: int):
        self.seed = seed
        self.shape = None
        self.master = None
        self.by_dtype = {}

    def get(self, config: Config):
        import torch

        from ..inputs import random_qkv

        if config.shape_key != self.shape:
            self.clear()
            q, k, v = random_qkv(config.B, config.H, config.L, config.D, dtype="float64", framework="torch",
                                 device=tensor_device(), seed=self.seed)
            # grouped-query attention: k and v keep their first Hk heads
            self.master = (q, k[:, :config.kv_heads], v[:, :config.kv_heads])
            self.shape = config.shape_key
        if config.dtype not in self.by_dtype:
            self.by_dtype = {config.dtype: tuple(x.to(getattr(torch, config.dtype)).contiguous()
                                                 for x in self.master)}
        return self.by_dtype[config.dtype]

    def clear(self):
        self.shape, self.master, self.by_dtype = None, None, {}
        free_device_memory()


# ----------------------------------------------------------------------------------------------
# One measurement
# ----------------------------------------------------------------------------------------------

@dataclass
class TimingPolicy:
    """How many repeats, and how each is timed. ``method`` is :data:`wb_kernels.timing.DEVICE_TIME` for every preset
    (the object itself, not a copy of its fields): the device's work alone, from a clean L2. A results file records
    it (``"timing"``), and a run refuses to add records timed another way to a file."""

    seconds: float = 1.0  # stop repeating once about this much time of samples exists
    min_repeats: int = 3
    max_repeats: int = 100
    warmup: int = 2
    method: TimingMethod = DEVICE_TIME  # the L2 flush and the sleeping kernel before each repeat (timing.py)
    slow_call_ms: float = 1000.0  # calls slower than this get 2 repeats and no extra warm-up
    time_failed_checks: bool = False  # True: a stage that fails its check is timed too, and flagged

    # read-only views of the method, for code that asks the policy
    @property
    def flush_l2(self) -> bool:
        return self.method.flush_l2

    @property
    def flush_mode(self) -> str:
        return self.method.flush_mode

    @property
    def hold_us(self) -> float:
        return self.method.hold_us


# A burst: something outside the call (another process on the GPU, a clock or power event) slows a run of samples
# several-fold, e.g. an 18 us kernel timed at 1.4 ms for 20 repeats in a row. A sample over BURST_FACTOR x the lower
# quartile is counted as slowed; a GPU measurement with more than BURST_SHARE of its samples slowed is taken again, up
# to BURST_RETRIES times, and the attempt with the fewest slowed samples is kept (the file records the others). A
# spread that is the call's own (a bimodal small kernel, 1.2-1.9x) stays under the factor and is not retaken.
BURST_FACTOR = 2.0
BURST_SHARE = 0.05
BURST_RETRIES = 2


def slowed_samples(samples_ms) -> int:
    """How many of `samples_ms` are over BURST_FACTOR x their lower quartile (a burst's, not the call's own spread)."""
    if len(samples_ms) < 4:
        return 0
    lower_quartile = statistics.quantiles(samples_ms, n=4)[0]
    return sum(s > BURST_FACTOR * lower_quartile for s in samples_ms)


def _too_many_slowed(samples_ms) -> bool:
    return slowed_samples(samples_ms) > BURST_SHARE * len(samples_ms)


def _burst(timing) -> bool:
    return timing.device == "cuda" and _too_many_slowed(timing.samples_ms)


def was_slowed(record: dict) -> bool:
    """True for a GPU record of a results file whose samples a burst slowed (the rule :func:`timed` retakes by)."""
    return (record.get("status") == "ok" and record.get("device") == "cuda"
            and _too_many_slowed(record.get("samples_ms") or ()))


def timed(call, policy: TimingPolicy, attempts: Optional[list] = None):
    """The Timing of ``call()`` under `policy`: one call estimates its duration, then warm-up calls and enough
    repeats for about ``policy.seconds`` of samples (between min_repeats and max_repeats; 2 and no warm-up for
    calls slower than ``policy.slow_call_ms``), the L2 cache flushed before each when ``policy.flush_l2``. A GPU
    measurement that a burst slowed (:func:`slowed_samples`) is taken again; every attempt not kept is appended to
    `attempts` (when given) as ``{"median_ms", "slowed"}``."""
    from ..timing import time_call

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        how = dict(policy.method)
        estimate = time_call(call, warmup=0, repeats=1, **how).median_ms
        if estimate >= policy.slow_call_ms:
            repeats, warmup = 2, 0
        else:
            wanted = math.ceil(policy.seconds * 1e3 / max(estimate, 1e-3))
            repeats = max(policy.min_repeats, min(policy.max_repeats, wanted))
            warmup = policy.warmup if estimate < 100 else 0
        tries = [time_call(call, warmup=warmup, repeats=repeats, **how)]
        while _burst(tries[-1]) and len(tries) <= BURST_RETRIES:
            tries.append(time_call(call, warmup=warmup, repeats=repeats, **how))
    kept = min(reversed(tries), key=lambda t: slowed_samples(t.samples_ms))  # on a tie, the latest
    if attempts is not None:
        attempts.extend({"median_ms": round_significant(t.median_ms), "slowed": slowed_samples(t.samples_ms)}
                        for t in tries if t is not kept)
    return kept


def time_checked(record: dict, contender, call, policy: TimingPolicy, tokens: int) -> dict:
    """The end of a checked measurement (the backward and variants presets): a contender whose check failed is a
    "failed" record, untimed (a baseline, or ``policy.time_failed_checks``, is timed and marked ``check_failed``);
    else ``call()`` is timed into `record` (:func:`time_into`) with its TFLOP/s (from ``record["flops"]``) and
    tokens per second (`tokens` per call). The device's memory is freed either way; returns `record`."""
    if not record["check"]["passed"]:
        if contender.kind != "baseline" and not policy.time_failed_checks:
            record.update(status="failed", reason=f"check: {record['check']['line']}")
            free_device_memory()
            return record
        record["check_failed"] = True
    timing = time_into(record, call, policy)
    if timing is not None:
        seconds = timing.median_ms / 1e3
        record.update(tflops=round_significant(record["flops"] / seconds / 1e12),
                      tokens_per_s=round_significant(tokens / seconds))
    free_device_memory()
    return record


def time_into(record: dict, call, policy: TimingPolicy):
    """Time ``call()`` (:func:`timed`) into `record`: status "ok", median and spread (ms), every sample, where it ran;
    returns the Timing. If timing fails, the record says why (status "skipped" when out of memory, else "failed")
    and None is returned."""
    retaken = []
    try:
        timing = timed(call, policy, retaken)
    except Exception as error:  # noqa: BLE001 - recorded, the sweep goes on
        record.update(status="skipped" if is_out_of_memory(error) else "failed", reason=error_line(error))
        free_device_memory()
        return None
    record.update(status="ok", device=timing.device, repeats=len(timing.samples_ms), median_ms=round_significant(timing.median_ms),
                  iqr_ms=round_significant(timing.iqr_ms), min_ms=round_significant(timing.min_ms), max_ms=round_significant(timing.max_ms),
                  samples_ms=[round_significant(s, 4) for s in timing.samples_ms],
                  l2_flushed=policy.flush_l2 and timing.device == "cuda")
    if retaken:  # a burst slowed an attempt (timed): what each attempt not kept measured
        record["retaken"] = {"attempts": retaken, "kept_slowed": slowed_samples(timing.samples_ms),
                             "rule": f"a sample over {BURST_FACTOR:g}x the lower quartile is slowed; over "
                                     f"{BURST_SHARE:.0%} slowed samples: taken again"}
    if timing.device == "cuda":  # every GPU record says how it was timed (results.timing_method reads it)
        record.update(l2_flush_mode=policy.flush_mode if policy.flush_l2 else None, hold_us=policy.hold_us)
    return timing


def measure(contender: Contender, config: Config, inputs, ref, policy: TimingPolicy) -> dict:
    """Check, then time, one contender on one configuration. Never raises for the contender's
    own failures: they become ``status`` "skipped" (cannot run this size here) or "failed"."""
    from ..check import check
    from ..timing import peak_memory

    q, k, v = inputs
    record = {"key": record_key(contender.name, config), "contender": contender.name, "kind": contender.kind,
              "dtype": config.dtype, "B": config.B, "H": config.H, "Hk": config.kv_heads, "Lq": config.L,
              "Lk": config.L, "D": config.D, "causal": config.causal}
    flops = attention_flops(config.B, config.H, config.L, config.L, config.D, config.causal)
    nbytes = minimum_bytes(config.B, config.H, config.L, config.L, config.D, ITEMSIZE[config.dtype], config.kv_heads)
    record.update(flops=flops, bytes_min=nbytes, intensity=round_significant(flops / nbytes))
    if contender.workspace_bytes is not None:
        record["workspace_bytes"] = int(contender.workspace_bytes(config.B, config.H, config.L, config.L, config.D))

    try:
        with warnings.catch_warnings():
            # SDPA warns about each kernel it rejects before raising "no available kernel".
            warnings.simplefilter("ignore")
            call, as_bhld = contender.prepare(q, k, v, config.causal)
            result, memory = peak_memory(call)
    except Exception as error:  # noqa: BLE001 - recorded, the sweep goes on
        record.update(status="skipped" if is_refusal(error) else "failed", reason=error_line(error))
        free_device_memory()
        return record

    out = as_bhld(result) if as_bhld is not None else result
    record["peak_bytes"] = int(memory.peak_bytes)
    record["peak_device"] = memory.device
    record["output_bytes"] = int(out.numel() * out.element_size())
    verdict = check(contender.name, out[:1, :1], q[:1, :1], k[:1, :1], v[:1, :1], causal=config.causal,
                    ref=ref, verbose=False, raise_on_failure=False)
    record["check"] = {"max_err": round_significant(verdict.max_err, 3), "tol": round_significant(verdict.tol, 3), "passed": verdict.passed,
                       "line": verdict.line()}
    del result, out
    if not verdict.passed and contender.kind == "stage":
        if not policy.time_failed_checks:
            record.update(status="failed", reason=f"check: {verdict.line()}")
            free_device_memory()
            return record
        record["check_failed"] = True

    timing = time_into(record, call, policy)
    if timing is None:
        return record
    seconds = timing.median_ms / 1e3
    record.update(tflops=round_significant(flops / seconds / 1e12), tokens_per_s=round_significant(config.B * config.L / seconds))
    if not verdict.passed:
        record["check_failed"] = True
        record["note"] = (f"{contender.kind} outside the check tolerance; timed anyway"
                          + (" (--time-failed-checks)" if contender.kind == "stage" else ""))
    free_device_memory()
    return record


# ----------------------------------------------------------------------------------------------
# Ceilings for the roofline
# ----------------------------------------------------------------------------------------------

def measure_ceilings(size: int = 8192, copy_bytes: int = 2**30) -> dict:
    """Peak rates measured now: matmuls of size^3 (fp16, bf16, fp32 without TF32) and a copy."""
    import torch

    from ..timing import time_call

    ceilings = {}
    for dtype in ("float16", "bfloat16", "float32"):
        a = torch.randn(size, size, device="cuda", dtype=getattr(torch, dtype))
        b = torch.randn(size, size, device="cuda", dtype=getattr(torch, dtype))
        previous = torch.backends.cuda.matmul.allow_tf32
        torch.backends.cuda.matmul.allow_tf32 = False  # the fp32 ceiling is for true fp32 FMA
        try:
            t = time_call(torch.matmul, a, b, warmup=3, repeats=10 if dtype == "float32" else 20)
        finally:
            torch.backends.cuda.matmul.allow_tf32 = previous
        ceilings[f"{dtype}_matmul_tflops"] = round_significant(2.0 * size ** 3 / (t.median_ms / 1e3) / 1e12)
        del a, b
    source = torch.empty(copy_bytes // 4, dtype=torch.float32, device="cuda").normal_()
    target = torch.empty_like(source)
    t = time_call(target.copy_, source, warmup=3, repeats=20)
    ceilings["copy_gbps"] = round_significant(2.0 * copy_bytes / (t.median_ms / 1e3) / 1e9)  # read + write
    ceilings["matmul_size"] = size
    ceilings["copy_bytes"] = copy_bytes
    del source, target
    free_device_memory()
    return ceilings


# ----------------------------------------------------------------------------------------------
# The sweep
# ----------------------------------------------------------------------------------------------

def plan(sweeps, table: dict, *, explicit: tuple = ()) -> tuple:
    """(jobs, notes): [(Contender, Config, [sweep names])] in input-sharing order, and why some
    requested contenders are not in it. Contenders named in `explicit` must be runnable here."""
    jobs, notes = {}, {}
    for sweep in sweeps:
        for name in sweep.contenders:
            contender = table.get(name)
            if contender is None:
                if name in explicit:
                    raise Refused(f"{name!r} is neither a stage of this package ({', '.join(available_stages())}) "
                                  f"nor a baseline ({', '.join(BASELINES)})")
                notes[name] = "not a stage of this package yet"
                continue
            if contender.needs_gpu and tensor_device() != "cuda":
                if name in explicit:
                    raise Refused(f"stage {name!r} runs only on a CUDA GPU, and this machine runs the CUDA "
                                  "simulator: run it on a GPU, or leave it out here" if contender.kind == "stage" else
                                  f"baseline {name!r} needs a CUDA GPU; this machine has none")
                notes[name] = "needs a CUDA GPU"
                continue
            if contender.unavailable:
                notes[name] = contender.unavailable
                continue
            if name == "reference" and tensor_device() == "cuda" and name not in explicit:
                continue  # the float64 CPU reference is the judge, not a contender, on a GPU
            for config in sweep.configs:
                if contender.dtypes is not None and config.dtype not in contender.dtypes:
                    continue
                if contender.head_dims is not None and config.D not in contender.head_dims:
                    continue
                key = record_key(name, config)
                if key in jobs:
                    jobs[key][2].append(sweep.name)
                else:
                    jobs[key] = (contender, config, [sweep.name])
    order = sorted(jobs.values(), key=lambda job: (job[1].shape_key, job[1].dtype, job[1].causal,
                                                   list(table).index(job[0].name)))
    return order, notes


def run(sweeps, out_path, *, policy: TimingPolicy | None = None, resume: bool = True, seed: int = 0,
        progress: bool = True, time_budget: float | None = None, ceilings: bool = True, honesty: bool = False,
        explicit: tuple = (), table: dict | None = None, command: str | None = None, log=print) -> dict:
    """Run `sweeps` into the JSON file `out_path` (resuming it unless resume=False); return the results."""
    from ..widgets import progress as show_progress

    started = time.monotonic()
    policy = policy or TimingPolicy()
    table = table if table is not None else contenders()
    jobs, notes = plan(sweeps, table, explicit=explicit)
    out_path = Path(out_path)
    results = open_results(out_path, [s.name for s in sweeps], resume=resume, command=command)
    stamp_timing(results, policy, out_path)
    results["unavailable"].update(notes)
    for name, why in notes.items():
        log(f"  {name}: absent ({why})")
    done = {r["key"] for r in results["records"]}
    todo = [job for job in jobs if record_key(job[0].name, job[1]) not in done]
    log(f"{len(jobs)} measurements planned, {len(jobs) - len(todo)} already in {out_path}, {len(todo)} to run "
        f"on {results['environment']['device']}")

    on_cuda = tensor_device() == "cuda"
    if on_cuda and ceilings and results.get("ceilings") is None:
        log("measuring the roofline ceilings (fp16/bf16/fp32 matmul, copy)")
        results["ceilings"] = measure_ceilings()
        save_results(results, out_path)
    if honesty:
        if not on_cuda:
            log("honesty demonstrations: need a GPU, skipped here")
        elif results.get("honesty") is None:
            from .pitfalls import honesty_demos  # pitfalls.py builds on this module: imported here, not above

            log("running the honest-benchmarking demonstrations")
            results["honesty"] = honesty_demos()
            save_results(results, out_path)

    cache = _InputCache(seed)
    ref_cache = {}
    stopped = False
    for contender, config, sweep_names in show_progress(todo, description="benchmark", unit="runs", disable=not progress):
        if time_budget is not None and time.monotonic() - started > time_budget:
            stopped = True
            break
        inputs = cache.get(config)
        ref_key = (config.shape_key, config.dtype, config.causal)
        if ref_key not in ref_cache:
            ref_cache.clear()
            ref_cache[ref_key] = reference_first_head(*inputs, config.causal)
        record = measure(contender, config, inputs, ref_cache[ref_key], policy)
        store_record(results, dict(record, presets=sweep_names), out_path, log, add_speedups)
    cache.clear()
    add_speedups(results)
    return finish_results(results, out_path, stopped=stopped, time_budget=time_budget, log=log)


def open_results(out_path: Path, presets: list, *, resume: bool, command: Optional[str], kind: Optional[str] = None,
                 fresh=new_results) -> dict:
    """The results file to add to: `out_path` as it is when resuming (it must come from this machine, and be of
    this `kind`: None for the attention presets, "decode"), else a new one; `presets` added to its list."""
    if resume and out_path.exists():
        results = load_results(out_path)
        if results.get("kind") != kind:
            raise Refused(f"{out_path} is not a {kind or 'attention'} results file (it is "
                          f"{results.get('kind') or 'attention'}); write to another file (--out) or start over "
                          "(--fresh)")
        if results["environment"].get("device") != environment()["device"]:
            raise Refused(f"{out_path} holds results from {results['environment'].get('device')}; this machine is "
                          f"{environment()['device']}. Write to another file (--out) or start over (--fresh).")
    else:
        results = fresh(presets, command)
    results["presets"] = sorted(set(results["presets"]) | set(presets))
    return results


def stamp_timing(results: dict, policy: TimingPolicy, out_path: Path) -> None:
    """Write how this run times (``policy.method``) into the results file, as ``"timing"``; refuse to add to a file
    whose records were timed another way (one file, one method: its rows are compared with each other)."""
    from .results import timing_method

    if results["environment"].get("backend") != "gpu":
        return  # the simulator's host clock: no flush, nothing queued (timing.time_call)
    before = timing_method(results) if results["records"] else None
    if before is not None and before != policy.method:
        raise Refused(f"{out_path} was timed as: {before.label()}; this run times as: {policy.method.label()}. "
                      "Write to another file (--out) or start over (--fresh).")
    results["timing"] = dict(policy.method)


def store_record(results: dict, record: dict, out_path: Path, log, derive=add_speedups) -> None:
    """Add `record` to the results, say why if it was not timed, update what is derived from the records (`derive`:
    speed-ups, or the decode ratios) and save the file: a run stopped after this keeps the record."""
    results["records"].append(record)
    if record["status"] != "ok":
        log(f"  {record['key']}: {record['status']}: {record['reason']}")
    derive(results)
    save_results(results, out_path)


def measure_jobs(results: dict, jobs: list, out_path: Path, *, key_of, prepare, measure_row, base_record,
                 wants_inputs, started: float, time_budget: Optional[float], retry_failed: bool, progress: bool,
                 what: str, log, release=lambda: None) -> bool:
    """The loop of a resumable benchmark whose rows share inputs per workload (the backward and variants presets):
    `jobs` (contender, workload, mode, preset names) not yet in `results` (``key_of(contender name, mode,
    workload)``; with `retry_failed` a failed row is measured again), grouped by workload. For each workload,
    ``prepare(workload)`` builds the shared state once, when the first row that ``wants_inputs(contender, workload,
    mode)`` comes (an error there skips the workload's rows, saying why: ``base_record(contender, workload, mode)``
    marked skipped), then ``measure_row(contender, workload, mode, state)`` (state None when no row wanted it) gives
    each record, stored as it comes; then
    ``release()`` and the device's memory are freed. Stops starting rows past `time_budget` seconds after `started`.
    Returns whether it stopped there."""
    from ..widgets import progress as show_progress

    if retry_failed:  # a fixed contender's failed rows are measured again, not kept as done
        results["records"] = [r for r in results["records"] if r["status"] != "failed"]
    done = {r["key"] for r in results["records"]}
    todo = [job for job in jobs if key_of(job[0].name, job[2], job[1]) not in done]
    log(f"{len(jobs)} {what} measurements planned, {len(jobs) - len(todo)} already in {out_path}, {len(todo)} to "
        f"run on {results['environment']['device']}")
    by_workload = {}
    for contender, workload, mode, names in todo:
        by_workload.setdefault(workload, []).append((contender, mode, names))
    for workload, group in show_progress(list(by_workload.items()), description=what, unit="workloads",
                                         disable=not progress):
        state = why = None
        for contender, mode, names in group:
            if time_budget is not None and time.monotonic() - started > time_budget:
                release()
                free_device_memory()
                return True
            if state is None and why is None and wants_inputs(contender, workload, mode):
                try:  # the inputs (and the reference they are checked against), once per workload
                    state = prepare(workload)
                except Exception as error:  # noqa: BLE001 - out of memory, most likely: recorded for each row
                    why, state = f"could not build the inputs: {error_line(error)}", None
                    free_device_memory()
            record = dict(base_record(contender, workload, mode), status="skipped", reason=why) if why is not None \
                else measure_row(contender, workload, mode, state)
            store_record(results, dict(record, presets=names), out_path, log, add_speedups)
        state = None
        release()
        free_device_memory()
    return False


def finish_results(results: dict, out_path: Path, *, stopped: bool, time_budget: Optional[float], log) -> dict:
    """Mark the run complete (or stopped by the time budget), save it, and say what the file holds."""
    results["complete"] = not stopped
    save_results(results, out_path)
    counts = {s: sum(r["status"] == s for r in results["records"]) for s in ("ok", "skipped", "failed")}
    log(f"{out_path}: {counts['ok']} timed, {counts['skipped']} skipped, {counts['failed']} failed"
        + (f"; stopped after {time_budget:.0f} s (--time-budget): run the same command again to continue"
           if stopped else ""))
    return results
