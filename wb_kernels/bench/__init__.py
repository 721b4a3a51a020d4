"""The benchmark: every stage against PyTorch's attention, into one resumable JSON file (lesson 06).

    python -m wb_kernels.bench --help
    python -m wb_kernels.bench --list                       # presets, stages, baselines
    python -m wb_kernels.bench --preset smoke               # tiny sweep (the simulator's preset)
    python -m wb_kernels.bench --preset all --time-budget 330   # on a GPU: results/bench/<gpu>_<date>.json
    python -m wb_kernels.bench --figures results/bench/FILE.json        # figures/bench_*.png from a results file
    python -m wb_kernels.bench --update-readme results/bench/FILE.json  # README's performance table

What one measurement is (the rules lesson 06 teaches, and :func:`honesty_demos` demonstrates):

- fresh random inputs (never zeros: zeros make some GPUs run faster), drawn once per shape and
  shared by every contender, so all of them see exactly the same numbers;
- correctness first: each contender's output for the first (batch, head) is checked against the
  float64 reference with :func:`wb_kernels.check.check` before it is timed; a stage that fails is
  not timed, a baseline that fails is timed and flagged;
- warm-up calls (compilation, cuDNN plans, the allocator), then CUDA-event timing with the L2 cache
  flushed before every repeat (:func:`wb_kernels.timing.time_call`), repeated until about
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

import argparse
import datetime as _dt
import importlib.metadata
import json
import math
import os
import platform
import statistics
import subprocess
import sys
import time
import warnings
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Callable, Optional

from ..backend import BACKEND
from ..stages import available_stages

__all__ = [
    "Config", "Sweep", "Contender", "PRESETS", "BASELINES", "PUBLIC_CONFIGS", "attention_flops",
    "minimum_bytes", "run", "main", "load_results", "save_results", "readme_table", "update_readme",
    "add_speedups", "honesty_demos", "measure_ceilings", "environment", "record_key", "SCHEMA_VERSION",
]

SCHEMA_VERSION = 1
REPO_ROOT = Path(__file__).resolve().parents[2]  # wb_kernels/bench/__init__.py -> the repository
RESULTS_DIR = REPO_ROOT / "results" / "bench"  # one JSON per benchmark run; other results/ files are not ours
README_START = "<!-- perf-table:start -->"
README_END = "<!-- perf-table:end -->"

# The configurations other public attention-kernel projects report (B, H, L, D), so that numbers
# here can be set beside theirs: B*L = 16k tokens, 16 heads of 128, plus the small B=1 L=512 D=64.
PUBLIC_CONFIGS = ((1, 16, 512, 64), (32, 16, 512, 128), (16, 16, 1024, 128), (8, 16, 2048, 128),
                  (4, 16, 4096, 128), (2, 16, 8192, 128), (1, 16, 16384, 128))
LADDER_LENGTHS = (512, 1024, 2048, 4096, 8192, 16384)
TOKENS = 16384  # B * L of the GPU sweeps


# ----------------------------------------------------------------------------------------------
# What is measured
# ----------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Config:
    """One problem: shapes, dtype and masking. Lq == Lk throughout the benchmark."""

    B: int
    H: int
    L: int
    D: int
    dtype: str
    causal: bool

    @property
    def shape_key(self):
        return (self.B, self.H, self.L, self.D)


@dataclass(frozen=True)
class Sweep:
    """Contenders x configurations; a preset is a list of sweeps."""

    name: str
    contenders: tuple  # stage names and baseline names; absent stages are dropped quietly
    configs: tuple  # of Config


def attention_flops(B: int, H: int, Lq: int, Lk: int, D: int, causal: bool) -> float:
    """Multiply-adds of QK^T and PV, 2 FLOPs each: 4*B*H*Lq*Lk*D, halved for causal (the usual count)."""
    flops = 4.0 * B * H * Lq * Lk * D
    return flops / 2 if causal else flops


def minimum_bytes(B: int, H: int, Lq: int, Lk: int, D: int, itemsize: int) -> float:
    """The traffic no exact kernel can avoid: read q, k, v once and write the output once."""
    return float(itemsize) * B * H * D * (2 * Lq + 2 * Lk)


_ITEMSIZE = {"float16": 2, "bfloat16": 2, "float32": 4, "float64": 8}


def _tokens_configs(lengths, D, dtypes, causals, H=16, tokens=TOKENS):
    return tuple(Config(max(1, tokens // L), H, L, D, dtype, causal)
                 for dtype in dtypes for causal in causals for L in lengths)


def _preset_sweeps() -> dict:
    ladder_configs = tuple(c for D in (64, 128) for c in _tokens_configs(LADDER_LENGTHS, D, ("float32",), (False,)))
    tensor_configs = _tokens_configs(LADDER_LENGTHS, 128, ("float16", "bfloat16"), (False, True))
    flash_configs = tuple(c for D in (64, 128)
                          for c in _tokens_configs(LADDER_LENGTHS[1:], D, ("float32",), (False,)))
    public_configs = tuple(Config(B, H, L, D, dtype, causal) for dtype in ("float16",)
                           for causal in (False, True) for (B, H, L, D) in PUBLIC_CONFIGS)
    every_baseline = ("sdpa", "sdpa-flash", "sdpa-efficient", "sdpa-cudnn", "sdpa-math", "torch-eager",
                      "flash_attn", "vllm")
    return {
        "smoke": [Sweep("smoke", ("reference", "naive", "tiled", "flash", "sdpa", "sdpa-math", "torch-eager"),
                        (Config(1, 1, 32, 16, "float32", False), Config(1, 1, 33, 16, "float32", True)))],
        "ladder": [Sweep("ladder", ("naive", "tiled", "sdpa", "sdpa-math"), ladder_configs)],
        "flash-fp32": [Sweep("flash-fp32", ("flash", "sdpa", "sdpa-efficient", "sdpa-math"), flash_configs)],
        "tensor-cores": [Sweep("tensor-cores", ("wmma", "sdpa", "sdpa-flash", "sdpa-cudnn", "flash_attn"),
                               tensor_configs)],
        "public": [Sweep("public", ("wmma", "flash", "tiled", "naive") + every_baseline, public_configs)],
    }


PRESETS = _preset_sweeps()
PRESET_HELP = {
    "smoke": "B=1 H=1 L=32/33 D=16 fp32: every stage that runs on the simulator (the CPU preset)",
    "ladder": "naive, tiled vs SDPA default/MATH: fp32, D=64/128, L=512..16384, B*L=16k, H=16",
    "flash-fp32": "flash vs SDPA (fp32 -> EFFICIENT) and MATH: fp32, D=64/128, L=1024..16384, B*L=16k",
    "tensor-cores": "wmma vs SDPA default/FLASH/cuDNN, flash_attn: fp16/bf16, D=128, L=512..16384, "
                    "causal and not",
    "public": "every stage and baseline at the configurations other projects report (fp16)",
    "honesty": "the honest-benchmarking demonstrations of lesson 06 (GPU only)",
    "all": "public + ladder + flash-fp32 + tensor-cores + honesty (the committed GPU run)",
}
GPU_PRESETS = ("ladder", "flash-fp32", "tensor-cores", "public", "honesty", "all")


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


def _sdpa_prepare(backend_name: Optional[str]):
    def prepare(q, k, v, causal):
        import torch.nn.functional as F

        if backend_name is None:
            return (lambda: F.scaled_dot_product_attention(q, k, v, is_causal=causal)), None
        from torch.nn.attention import SDPBackend, sdpa_kernel

        backend = getattr(SDPBackend, backend_name)

        def call():
            with sdpa_kernel(backend):
                return F.scaled_dot_product_attention(q, k, v, is_causal=causal)

        return call, None

    return prepare


def _eager_prepare(q, k, v, causal):
    """softmax(q k^T * scale) v as three PyTorch ops, the way attention is written by hand.
    The softmax runs in float32 (as real models do), so half precision stays accurate."""
    import torch

    scale = q.shape[-1] ** -0.5
    L, Lk = q.shape[-2], k.shape[-2]
    mask = torch.ones(L, Lk, dtype=torch.bool, device=q.device).tril() if causal else None

    def call():
        scores = (q @ k.transpose(-1, -2)) * scale
        if mask is not None:
            scores = scores.masked_fill(~mask, float("-inf"))
        return torch.softmax(scores.float(), dim=-1).to(q.dtype) @ v

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
    qt, kt, vt = (x.transpose(1, 2).reshape(B * L, H, D).contiguous() for x in (q, k, v))
    cu = torch.arange(0, (B + 1) * L, L, dtype=torch.int32, device=q.device)

    def call():
        return flash_attn_varlen_func(qt, kt, vt, max_seqlen_q=L, cu_seqlens_q=cu, max_seqlen_k=L,
                                      cu_seqlens_k=cu, causal=causal)

    return call, (lambda out: out.reshape(B, L, H, D).transpose(1, 2))


def _import_problem(module: str) -> Optional[str]:
    try:
        importlib.import_module(module)
    except Exception as error:  # noqa: BLE001 - any import failure means "not usable here"
        return f"{module} is not importable here ({type(error).__name__}: {str(error).splitlines()[0][:120]})"
    return None


def _baselines() -> dict:
    return {
        "sdpa": Contender("sdpa", "baseline", _sdpa_prepare(None)),
        "sdpa-flash": Contender("sdpa-flash", "baseline", _sdpa_prepare("FLASH_ATTENTION")),
        "sdpa-efficient": Contender("sdpa-efficient", "baseline", _sdpa_prepare("EFFICIENT_ATTENTION")),
        "sdpa-cudnn": Contender("sdpa-cudnn", "baseline", _sdpa_prepare("CUDNN_ATTENTION")),
        "sdpa-math": Contender("sdpa-math", "baseline", _sdpa_prepare("MATH")),
        "torch-eager": Contender("torch-eager", "baseline", _eager_prepare),
        "flash_attn": Contender("flash_attn", "baseline", _flash_attn_prepare, dtypes=("float16", "bfloat16"),
                                needs_gpu=True),
        "vllm": Contender("vllm", "baseline", _vllm_prepare, dtypes=("float16", "bfloat16"), needs_gpu=True),
    }


BASELINE_HELP = {
    "sdpa": "scaled_dot_product_attention, PyTorch's own choice of kernel",
    "sdpa-flash": "SDPA forced to FLASH_ATTENTION (FlashAttention-2 inside PyTorch)",
    "sdpa-efficient": "SDPA forced to EFFICIENT_ATTENTION (memory-efficient, xformers' kernel)",
    "sdpa-cudnn": "SDPA forced to CUDNN_ATTENTION",
    "sdpa-math": "SDPA forced to MATH (plain PyTorch ops, materializes L x L)",
    "torch-eager": "softmax(q k^T / sqrt(D)) v written as PyTorch ops, softmax in float32",
    "flash_attn": "flash_attn.flash_attn_func, when the flash-attn package is installed",
    "vllm": "vLLM's flash_attn_varlen_func, when vllm is installed",
}
BASELINES = tuple(BASELINE_HELP)


def _stage_contender(stage) -> Contender:
    from ..api import validate
    from ..device import like_input

    def prepare(q, k, v, causal):
        try:
            validate(q, k, v, stage=stage.name, causal=causal)
        except (MemoryError, ValueError, TypeError) as refusal:  # the stage cannot take this size here
            raise SizeRefused(refusal) from refusal
        # Validated once above; the timed call is the stage's launcher alone, without the API's per-call
        # checks (its NaN/Inf scan reads q and k once more and waits for the answer on the host).
        # (like_input: the simulator's stages return NumPy; on a GPU it returns the CUDA tensor as it is)
        return (lambda: like_input(stage.forward(q, k, v, causal=causal, key_padding_mask=None, scale=None)[0],
                                   q)), None

    return Contender(stage.name, "stage", prepare, dtypes=tuple(stage.dtypes), head_dims=stage.head_dims,
                     needs_gpu=stage.needs_gpu, workspace_bytes=stage.workspace_bytes)


def contenders() -> dict:
    """{name: Contender}: the package's stages (ladder order), then the baselines."""
    found = {name: _stage_contender(stage) for name, stage in available_stages().items()}
    problems = {"flash_attn": _import_problem("flash_attn"), "vllm": _import_problem("vllm.vllm_flash_attn")}
    for name, contender in _baselines().items():
        found[name] = replace(contender, unavailable=problems.get(name))
    return found


# ----------------------------------------------------------------------------------------------
# Inputs, reference, check
# ----------------------------------------------------------------------------------------------

def _device() -> str:
    from ..timing import on_gpu

    return "cuda" if on_gpu() else "cpu"


def _reference_first_head(q, k, v, causal):
    """float64 reference (out, lse) for batch 0, head 0, as NumPy arrays (1, 1, L, D) and (1, 1, L).

    On the CPU this is :func:`wb_kernels.reference`. On a GPU the same formula runs in float64 on
    the GPU: at L = 16384 the NumPy version would need 6 GB of host memory and tens of seconds.
    """
    if q.device.type == "cpu":
        from ..reference import reference

        return reference(q[:1, :1], k[:1, :1], v[:1, :1], causal=causal)
    return _torch_reference(q[:1, :1], k[:1, :1], v[:1, :1], causal)


def _torch_reference(q, k, v, causal):
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
            B, H, L, D = config.shape_key
            self.master = random_qkv(B, H, L, D, dtype="float64", framework="torch", device=_device(),
                                     seed=self.seed)
            self.shape = config.shape_key
        if config.dtype not in self.by_dtype:
            self.by_dtype = {config.dtype: tuple(x.to(getattr(torch, config.dtype)).contiguous()
                                                 for x in self.master)}
        return self.by_dtype[config.dtype]

    def clear(self):
        self.shape, self.master, self.by_dtype = None, None, {}
        _free_device_memory()


def _free_device_memory():
    import gc

    gc.collect()
    if _device() == "cuda":
        import torch

        torch.cuda.empty_cache()


# ----------------------------------------------------------------------------------------------
# One measurement
# ----------------------------------------------------------------------------------------------

@dataclass
class TimingPolicy:
    seconds: float = 1.0  # stop repeating once about this much time of samples exists
    min_repeats: int = 3
    max_repeats: int = 100
    warmup: int = 2
    flush_l2: bool = True
    slow_call_ms: float = 1000.0  # calls slower than this get 2 repeats and no extra warm-up
    time_failed_checks: bool = False  # True: a stage that fails its check is timed too, and flagged


def record_key(contender: str, config: Config) -> str:
    return (f"{contender}|{config.dtype}|B{config.B}|H{config.H}|L{config.L}|D{config.D}|"
            f"{'causal' if config.causal else 'full'}")


class SizeRefused(Exception):
    """A stage's validate() refused the configuration (memory, simulator time): recorded as skipped."""

    def __init__(self, original: BaseException):
        super().__init__(str(original))
        self.original = original


def _short(error: BaseException) -> str:
    if isinstance(error, SizeRefused):
        error = error.original
    text = str(error).strip().splitlines()
    return f"{type(error).__name__}: {text[0][:300] if text else ''}".rstrip(": ")


def _is_out_of_memory(error: BaseException) -> bool:
    text = str(error).lower()
    return isinstance(error, MemoryError) or "out of memory" in text or "out_of_memory" in text


def _sig(x: float, digits: int = 5):
    if x is None or not math.isfinite(x) or x == 0:
        return x
    return round(x, -int(math.floor(math.log10(abs(x)))) + digits - 1)


def measure(contender: Contender, config: Config, inputs, ref, policy: TimingPolicy) -> dict:
    """Check, then time, one contender on one configuration. Never raises for the contender's
    own failures: they become ``status`` "skipped" (cannot run this size here) or "failed"."""
    from ..check import check
    from ..timing import peak_memory, time_call

    q, k, v = inputs
    record = {"key": record_key(contender.name, config), "contender": contender.name, "kind": contender.kind,
              "dtype": config.dtype, "B": config.B, "H": config.H, "Lq": config.L, "Lk": config.L,
              "D": config.D, "causal": config.causal}
    flops = attention_flops(config.B, config.H, config.L, config.L, config.D, config.causal)
    nbytes = minimum_bytes(config.B, config.H, config.L, config.L, config.D, _ITEMSIZE[config.dtype])
    record.update(flops=flops, bytes_min=nbytes, intensity=_sig(flops / nbytes))
    if contender.workspace_bytes is not None:
        record["workspace_bytes"] = int(contender.workspace_bytes(config.B, config.H, config.L, config.L, config.D))

    try:
        with warnings.catch_warnings():
            # SDPA warns about each kernel it rejects before raising "no available kernel".
            warnings.simplefilter("ignore")
            call, as_bhld = contender.prepare(q, k, v, config.causal)
            result, memory = peak_memory(call)
    except Exception as error:  # noqa: BLE001 - recorded, the sweep goes on
        text = str(error).lower()
        if isinstance(error, SizeRefused) or _is_out_of_memory(error) or "no available kernel" in text \
                or "no viable backend" in text:
            record.update(status="skipped", reason=_short(error))
        else:
            record.update(status="failed", reason=_short(error))
        _free_device_memory()
        return record

    out = as_bhld(result) if as_bhld is not None else result
    record["peak_bytes"] = int(memory.peak_bytes)
    record["peak_device"] = memory.device
    record["output_bytes"] = int(out.numel() * out.element_size())
    verdict = check(contender.name, out[:1, :1], q[:1, :1], k[:1, :1], v[:1, :1], causal=config.causal,
                    ref=ref, verbose=False, raise_on_failure=False)
    record["check"] = {"max_err": _sig(verdict.max_err, 3), "tol": _sig(verdict.tol, 3), "passed": verdict.passed,
                       "line": verdict.line()}
    del result, out
    if not verdict.passed and contender.kind == "stage":
        if not policy.time_failed_checks:
            record.update(status="failed", reason=f"check: {verdict.line()}")
            _free_device_memory()
            return record
        record["check_failed"] = True

    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            estimate = time_call(call, warmup=0, repeats=1, flush_l2=policy.flush_l2).median_ms
            if estimate >= policy.slow_call_ms:
                repeats, warmup = 2, 0
            else:
                wanted = math.ceil(policy.seconds * 1e3 / max(estimate, 1e-3))
                repeats = max(policy.min_repeats, min(policy.max_repeats, wanted))
                warmup = policy.warmup if estimate < 100 else 0
            timing = time_call(call, warmup=warmup, repeats=repeats, flush_l2=policy.flush_l2)
    except Exception as error:  # noqa: BLE001
        record.update(status="skipped" if _is_out_of_memory(error) else "failed", reason=_short(error))
        _free_device_memory()
        return record

    seconds = timing.median_ms / 1e3
    record.update(
        status="ok", device=timing.device, repeats=len(timing.samples_ms), median_ms=_sig(timing.median_ms),
        iqr_ms=_sig(timing.iqr_ms), min_ms=_sig(timing.min_ms), max_ms=_sig(timing.max_ms),
        samples_ms=[_sig(s, 4) for s in timing.samples_ms],
        tflops=_sig(flops / seconds / 1e12), tokens_per_s=_sig(config.B * config.L / seconds),
        l2_flushed=policy.flush_l2 and timing.device == "cuda",
    )
    if not verdict.passed:
        record["check_failed"] = True
        record["note"] = (f"{contender.kind} outside the check tolerance; timed anyway"
                          + (" (--time-failed-checks)" if contender.kind == "stage" else ""))
    _free_device_memory()
    return record


# ----------------------------------------------------------------------------------------------
# Ceilings for the roofline, and the honest-benchmarking demonstrations
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
        ceilings[f"{dtype}_matmul_tflops"] = _sig(2.0 * size ** 3 / (t.median_ms / 1e3) / 1e12)
        del a, b
    source = torch.empty(copy_bytes // 4, dtype=torch.float32, device="cuda").normal_()
    target = torch.empty_like(source)
    t = time_call(target.copy_, source, warmup=3, repeats=20)
    ceilings["copy_gbps"] = _sig(2.0 * copy_bytes / (t.median_ms / 1e3) / 1e9)  # read + write
    ceilings["matmul_size"] = size
    ceilings["copy_bytes"] = copy_bytes
    del source, target
    _free_device_memory()
    return ceilings


def _nvidia_smi(query: str) -> Optional[str]:
    try:
        text = subprocess.run(["nvidia-smi", f"--query-gpu={query}", "--format=csv,noheader,nounits", "-i", "0"],
                              capture_output=True, text=True, timeout=20).stdout.strip()
    except Exception:  # noqa: BLE001 - no nvidia-smi: the field stays empty
        return None
    return text or None


def _event_ms(fn, repeats: int, flush=None, prime: bool = False) -> list:
    """CUDA-event times of `fn`. `flush` (evict L2) or `prime` (one untimed call of fn: a warm L2) run
    just before each start event, so the GPU is busy when the timed call is queued and the CPU's launch
    gap is not timed with it."""
    import torch

    samples = []
    for _ in range(repeats):
        if flush is not None:
            flush()
        if prime:
            fn()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        samples.append(start.elapsed_time(end))
    return samples


def _stats(samples) -> dict:
    ordered = sorted(samples)
    quartiles = statistics.quantiles(ordered, n=20) if len(ordered) >= 4 else [ordered[0]] * 19
    return {"n": len(ordered), "median_ms": _sig(statistics.median(ordered)), "mean_ms": _sig(statistics.fmean(ordered)),
            "min_ms": _sig(ordered[0]), "max_ms": _sig(ordered[-1]), "p5_ms": _sig(quartiles[0]),
            "p25_ms": _sig(quartiles[4]), "p75_ms": _sig(quartiles[14]), "p95_ms": _sig(quartiles[18])}


def honesty_demos() -> dict:
    """Measured examples of each benchmarking mistake (lesson 06). GPU only; about 15 s.

    Each entry holds the numbers of the wrong and the right way, measured one after the other.
    """
    import torch
    import torch.nn.functional as F

    from ..timing import _L2Flusher

    demos = {}
    flush = _L2Flusher()
    big = dict(B=4, H=16, L=4096, D=128, dtype="float16")  # the host's baseline configuration
    small = dict(B=1, H=16, L=1024, D=64, dtype="float16")  # 6 MiB of inputs: fits in the 50 MiB L2

    def qkv(B, H, L, D, dtype, zeros=False):
        make = torch.zeros if zeros else torch.randn
        gen = {} if zeros else {"generator": torch.Generator(device="cuda").manual_seed(0)}
        return tuple(make(B, H, L, D, device="cuda", dtype=getattr(torch, dtype), **gen) for _ in range(3))

    # 1. Warm-up: the first call of a numba kernel includes its compilation.
    try:
        from numba import cuda

        @cuda.jit
        def scale_in_place(x, factor):  # a fresh kernel, never compiled before in this process
            i = cuda.grid(1)
            if i < x.size:
                x[i] *= factor

        x = torch.ones(1 << 20, device="cuda")
        view = cuda.as_cuda_array(x)
        blocks = (x.numel() + 255) // 256
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        scale_in_place[blocks, 256](view, 1.0)
        torch.cuda.synchronize()
        first_ms = (time.perf_counter() - t0) * 1e3
        steady = [(lambda: (time.perf_counter(), scale_in_place[blocks, 256](view, 1.0), torch.cuda.synchronize(),
                            time.perf_counter()))() for _ in range(20)]
        steady_ms = [(s[3] - s[0]) * 1e3 for s in steady]
        q, k, v = qkv(1, 16, 1536, 128, "float16")  # a shape no other measurement uses: a cold plan
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        F.scaled_dot_product_attention(q, k, v)
        torch.cuda.synchronize()
        sdpa_first = (time.perf_counter() - t0) * 1e3
        sdpa_steady = [(lambda: (time.perf_counter(), F.scaled_dot_product_attention(q, k, v), torch.cuda.synchronize(),
                                 time.perf_counter()))() for _ in range(20)]
        demos["warmup"] = {
            "what": "wall-clock time of the first call vs the median of the next 20 (synchronized)",
            "numba_kernel_first_ms": _sig(first_ms), "numba_kernel_steady_median_ms": _sig(statistics.median(steady_ms)),
            "sdpa_first_ms": _sig(sdpa_first),
            "sdpa_steady_median_ms": _sig(statistics.median([(s[3] - s[0]) * 1e3 for s in sdpa_steady])),
            "sdpa_shape": "B1 H16 L1536 D128 fp16"}
    except Exception as error:  # noqa: BLE001
        demos["warmup"] = {"error": _short(error)}

    # 2. Asynchrony: a CPU timer without synchronization measures only the launch.
    q, k, v = qkv(**big)
    call = lambda: F.scaled_dot_product_attention(q, k, v)  # noqa: E731
    for _ in range(3):
        call()
    torch.cuda.synchronize()
    no_sync, with_sync = [], []
    for _ in range(20):
        t0 = time.perf_counter()
        call()
        no_sync.append((time.perf_counter() - t0) * 1e3)
        torch.cuda.synchronize()
    for _ in range(20):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        call()
        torch.cuda.synchronize()
        with_sync.append((time.perf_counter() - t0) * 1e3)
    events = _event_ms(call, 20)
    demos["async"] = {"what": "SDPA B4 H16 L4096 D128 fp16 timed three ways, medians of 20",
                      "cpu_timer_no_sync_ms": _sig(statistics.median(no_sync)),
                      "cpu_timer_with_sync_ms": _sig(statistics.median(with_sync)),
                      "cuda_events_ms": _sig(statistics.median(events))}

    # 3. Medians: 300 repeats of a short call; the mean is pulled by a few slow samples.
    qs, ks, vs = qkv(**small)
    short_call = lambda: F.scaled_dot_product_attention(qs, ks, vs)  # noqa: E731
    for _ in range(5):
        short_call()
    samples = _event_ms(short_call, 300)
    demos["medians"] = {"what": "SDPA B1 H16 L1024 D64 fp16, 300 CUDA-event samples, no flush",
                        **_stats(samples), "samples_ms": [_sig(s, 4) for s in samples]}

    # 4. L2: a small problem timed right after the same call finds its inputs in the L2 cache.
    hot = _event_ms(short_call, 50, prime=True)
    cold = _event_ms(short_call, 50, flush=flush)
    buffer = torch.empty(4 << 20, dtype=torch.float32, device="cuda")  # 16 MiB
    other = torch.empty_like(buffer)
    copy_hot = _event_ms(lambda: other.copy_(buffer), 50, prime=True)
    copy_cold = _event_ms(lambda: other.copy_(buffer), 50, flush=flush)
    copy_gbps = lambda ms: _sig(2 * buffer.numel() * 4 / (ms / 1e3) / 1e9)  # noqa: E731
    demos["l2"] = {"what": "the same call right after itself (warm L2) vs right after an L2 flush",
                   "sdpa_shape": "B1 H16 L1024 D64 fp16 (6 MiB of inputs)",
                   "sdpa_warm_ms": _sig(statistics.median(hot)), "sdpa_flushed_ms": _sig(statistics.median(cold)),
                   "copy_mib": 16, "copy_warm_gbps": copy_gbps(statistics.median(copy_hot)),
                   "copy_flushed_gbps": copy_gbps(statistics.median(copy_cold)),
                   "l2_bytes": int(getattr(torch.cuda.get_device_properties(0), "L2_cache_size", 0))}
    del buffer, other

    # 5. Clocks: they move with idle time, load, power and temperature; watch one matmul call by call.
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.float16)
    b = torch.randn(8192, 8192, device="cuda", dtype=torch.float16)
    torch.cuda.synchronize()
    clock_idle = _nvidia_smi("clocks.sm")
    time.sleep(2.0)
    after_idle = _event_ms(lambda: torch.matmul(a, b), 120)
    clock_busy = _nvidia_smi("clocks.sm")
    demos["clocks"] = {"what": "fp16 matmul 8192^3 timed call by call right after 2 s of idle",
                       "first_ms": _sig(after_idle[0]), "first5_median_ms": _sig(statistics.median(after_idle[:5])),
                       "last20_median_ms": _sig(statistics.median(after_idle[-20:])),
                       "min_ms": _sig(min(after_idle)), "max_ms": _sig(max(after_idle)),
                       "samples_ms": [_sig(s, 4) for s in after_idle],
                       "sm_clock_mhz_idle": clock_idle, "sm_clock_mhz_busy": clock_busy,
                       "sm_clock_mhz_max": _nvidia_smi("clocks.max.sm")}

    # 6. Zeros vs random data: the same matmul on zeros draws less power and may run faster.
    za = torch.zeros_like(a)
    zb = torch.zeros_like(b)
    random_ms, zeros_ms = [], []
    for _ in range(2):  # interleaved blocks, so a clock drift does not favour one side
        random_ms += _event_ms(lambda: torch.matmul(a, b), 25)
        zeros_ms += _event_ms(lambda: torch.matmul(za, zb), 25)
    zq, zk, zv = qkv(**big, zeros=True)
    sdpa_random = _event_ms(call, 30, flush=flush)
    sdpa_zeros = _event_ms(lambda: F.scaled_dot_product_attention(zq, zk, zv), 30, flush=flush)
    flop = 2.0 * 8192 ** 3
    demos["zeros"] = {"what": "the same work on random inputs and on zeros, CUDA-event medians",
                      "matmul_random_ms": _sig(statistics.median(random_ms)),
                      "matmul_zeros_ms": _sig(statistics.median(zeros_ms)),
                      "matmul_random_tflops": _sig(flop / statistics.median(random_ms) / 1e9),
                      "matmul_zeros_tflops": _sig(flop / statistics.median(zeros_ms) / 1e9),
                      "sdpa_random_ms": _sig(statistics.median(sdpa_random)),
                      "sdpa_zeros_ms": _sig(statistics.median(sdpa_zeros))}
    del a, b, za, zb
    _free_device_memory()
    return demos


# ----------------------------------------------------------------------------------------------
# The results file
# ----------------------------------------------------------------------------------------------

def _version(package: str) -> Optional[str]:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return None


def environment() -> dict:
    """Where and with what the numbers were measured."""
    import numpy
    import torch

    from .. import __version__
    from ..backend import device_name

    env = {
        "date": _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "backend": BACKEND.name, "device": device_name(), "python": platform.python_version(),
        "torch": torch.__version__, "numpy": numpy.__version__, "numba": _version("numba"),
        "numba_cuda": _version("numba-cuda"), "wb_kernels": __version__,
    }
    if _device() == "cuda":
        props = torch.cuda.get_device_properties(0)
        env.update(gpu=torch.cuda.get_device_name(0), compute_capability=f"{props.major}.{props.minor}",
                   sm_count=props.multi_processor_count, gpu_memory_gib=round(props.total_memory / 2**30, 1),
                   cuda=torch.version.cuda, cudnn=torch.backends.cudnn.version(),
                   driver=_nvidia_smi("driver_version"), flash_attn=_version("flash-attn"), vllm=_version("vllm"))
    else:
        env.update(gpu=None, cuda=torch.version.cuda, driver=None)
    try:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO_ROOT, capture_output=True,
                                text=True, timeout=10).stdout.strip()
        env["git_commit"] = commit or None
    except Exception:  # noqa: BLE001
        env["git_commit"] = None
    return env


def load_results(path) -> dict:
    return json.loads(Path(path).read_text())


def save_results(results: dict, path) -> None:
    """Write atomically: a sweep killed mid-write leaves the previous complete file."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    temporary = path.with_suffix(path.suffix + ".tmp")
    temporary.write_text(json.dumps(results, indent=1, allow_nan=False) + "\n")
    os.replace(temporary, path)


def add_speedups(results: dict) -> dict:
    """For every timed record: ``speedup_vs[baseline]`` = baseline's median / this median (>1: faster)."""
    timed = {}
    for r in results["records"]:
        if r.get("status") == "ok":
            timed.setdefault(r["key"].split("|", 1)[1], {})[r["contender"]] = r
    for group in timed.values():
        baselines = {name: r for name, r in group.items() if r["kind"] == "baseline"}
        for r in group.values():
            r["speedup_vs"] = {name: _sig(b["median_ms"] / r["median_ms"], 4)
                               for name, b in baselines.items() if name != r["contender"]}
    return results


def _new_results(presets, command=None) -> dict:
    return {"schema": SCHEMA_VERSION, "environment": environment(), "presets": list(presets), "command": command,
            "ceilings": None, "honesty": None, "unavailable": {}, "records": []}


def default_output(kind: str) -> Path:
    if kind == "cuda":
        import torch

        slug = "".join(c if c.isalnum() else "-" for c in torch.cuda.get_device_name(0).lower()).strip("-")
        slug = "-".join(part for part in slug.split("-") if part and part != "nvidia")
        return RESULTS_DIR / f"{slug}_{_dt.date.today().isoformat()}.json"
    return RESULTS_DIR / "simulator_smoke.json"


def committed_results(kind: str = "gpu") -> Optional[Path]:
    """The newest benchmark results file of that kind ("gpu" or "simulator") under results/, or None.
    Other JSON files there (tuning logs, ...) are recognised by their lack of "records" and ignored."""
    found = []
    for path in sorted((REPO_ROOT / "results").rglob("*.json")):
        try:
            data = load_results(path)
        except (OSError, ValueError):
            continue
        if isinstance(data, dict) and "records" in data and data.get("environment", {}).get("backend") == kind:
            found.append((data["environment"].get("date", ""), path))
    return max(found)[1] if found else None


# ----------------------------------------------------------------------------------------------
# The sweep
# ----------------------------------------------------------------------------------------------

class Refused(Exception):
    """The request cannot run on this machine (printed as a clear message, exit code 2)."""


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
            if contender.needs_gpu and _device() != "cuda":
                if name in explicit:
                    raise Refused(f"stage {name!r} runs only on a CUDA GPU, and this machine runs the CUDA "
                                  "simulator: run it on a GPU, or leave it out here" if contender.kind == "stage" else
                                  f"baseline {name!r} needs a CUDA GPU; this machine has none")
                notes[name] = "needs a CUDA GPU"
                continue
            if contender.unavailable:
                notes[name] = contender.unavailable
                continue
            if name == "reference" and _device() == "cuda" and name not in explicit:
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
    from tqdm.auto import tqdm

    started = time.monotonic()
    policy = policy or TimingPolicy()
    table = table if table is not None else contenders()
    jobs, notes = plan(sweeps, table, explicit=explicit)
    out_path = Path(out_path)
    if resume and out_path.exists():
        results = load_results(out_path)
        if results["environment"].get("device") != environment()["device"]:
            raise Refused(f"{out_path} holds results from {results['environment'].get('device')}; this machine is "
                          f"{environment()['device']}. Write to another file (--out) or start over (--fresh).")
    else:
        results = _new_results([s.name for s in sweeps], command)
    results["presets"] = sorted(set(results["presets"]) | {s.name for s in sweeps})
    results["unavailable"].update(notes)
    for name, why in notes.items():
        log(f"  {name}: absent ({why})")
    done = {r["key"] for r in results["records"]}
    todo = [job for job in jobs if record_key(job[0].name, job[1]) not in done]
    log(f"{len(jobs)} measurements planned, {len(jobs) - len(todo)} already in {out_path}, {len(todo)} to run "
        f"on {results['environment']['device']}")

    on_cuda = _device() == "cuda"
    if on_cuda and ceilings and results.get("ceilings") is None:
        log("measuring the roofline ceilings (fp16/bf16/fp32 matmul, copy)")
        results["ceilings"] = measure_ceilings()
        save_results(results, out_path)
    if honesty:
        if not on_cuda:
            log("honesty demonstrations: need a GPU, skipped here")
        elif results.get("honesty") is None:
            log("running the honest-benchmarking demonstrations")
            results["honesty"] = honesty_demos()
            save_results(results, out_path)

    cache = _InputCache(seed)
    ref_cache = {}
    stopped = False
    bar = tqdm(todo, disable=not progress, unit="run", dynamic_ncols=True, file=sys.stderr)
    for contender, config, sweep_names in bar:
        if time_budget is not None and time.monotonic() - started > time_budget:
            stopped = True
            break
        bar.set_description(f"{contender.name} {config.dtype} L={config.L} D={config.D}"
                            f"{' causal' if config.causal else ''}")
        inputs = cache.get(config)
        ref_key = (config.shape_key, config.dtype, config.causal)
        if ref_key not in ref_cache:
            ref_cache.clear()
            ref_cache[ref_key] = _reference_first_head(*inputs, config.causal)
        record = measure(contender, config, inputs, ref_cache[ref_key], policy)
        record["presets"] = sweep_names
        results["records"].append(record)
        if record["status"] != "ok":
            tqdm.write(f"  {record['key']}: {record['status']}: {record['reason']}", file=sys.stderr)
        add_speedups(results)
        save_results(results, out_path)
    bar.close()
    cache.clear()
    add_speedups(results)
    results["complete"] = not stopped
    save_results(results, out_path)
    counts = {s: sum(r["status"] == s for r in results["records"]) for s in ("ok", "skipped", "failed")}
    log(f"{out_path}: {counts['ok']} timed, {counts['skipped']} skipped, {counts['failed']} failed"
        + (f"; stopped after {time_budget:.0f} s (--time-budget): run the same command again to continue"
           if stopped else ""))
    return results


# ----------------------------------------------------------------------------------------------
# README table
# ----------------------------------------------------------------------------------------------

def readme_table(results: dict, source: str | None = None) -> str:
    """The README's performance table (Markdown) from a GPU results file: the public configurations,
    fp16, causal and not; median ms and TFLOP/s of each stage and of the main baselines."""
    env = results["environment"]
    columns = [name for name in list(available_stages()) + list(BASELINES)
               if name in ("sdpa", "sdpa-flash", "flash_attn") or (name in available_stages() and name != "reference")]
    by_key = {r["key"]: r for r in results["records"]}
    public = [Config(B, H, L, D, "float16", causal) for causal in (False, True) for (B, H, L, D) in PUBLIC_CONFIGS]
    present = [c for c in columns
               if any(by_key.get(record_key(c, config), {}).get("status") == "ok" for config in public)]
    lines = [f"Measured on {env.get('gpu') or env.get('device')} (CUDA {env.get('cuda')}, torch {env.get('torch')}, "
             f"driver {env.get('driver')}) on {env.get('date', '')[:10]}"
             + (f", from `{source}`" if source else "") + ". Median of CUDA-event timings with the L2 cache "
             "flushed, fp16, ms (TFLOP/s); a dash: not run or does not support the configuration.",
             "", "| B | H | L | D | causal | " + " | ".join(present) + " |",
             "|---:|---:|---:|---:|:---:|" + "---:|" * len(present)]
    for config in public:
        cells = []
        for name in present:
            r = by_key.get(record_key(name, config))
            cells.append(f"{r['median_ms']:.3g} ({r['tflops']:.0f}){' †' if r.get('check_failed') else ''}"
                         if r and r.get("status") == "ok" else "–")
        lines.append(f"| {config.B} | {config.H} | {config.L} | {config.D} | {'yes' if config.causal else 'no'} | "
                     + " | ".join(cells) + " |")
    if any("†" in line for line in lines):
        lines += ["", "† outside the check tolerance (2x PyTorch's error in the same precision); timed anyway."]
    return "\n".join(lines)


def update_readme(results_path, readme=REPO_ROOT / "README.md") -> Path:
    readme = Path(readme)
    text = readme.read_text() if readme.exists() else ""
    if README_START not in text or README_END not in text:
        raise Refused(f"{readme} has no {README_START} ... {README_END} block to fill; add the two markers "
                      "where the table belongs")
    relative = Path(results_path).resolve()
    try:
        relative = relative.relative_to(REPO_ROOT)
    except ValueError:
        pass
    table = readme_table(load_results(results_path), source=str(relative))
    head, rest = text.split(README_START, 1)
    _, tail = rest.split(README_END, 1)
    readme.write_text(f"{head}{README_START}\n{table}\n{README_END}{tail}")
    return readme


# ----------------------------------------------------------------------------------------------
# Command line
# ----------------------------------------------------------------------------------------------

def _ints(text: str) -> tuple:
    return tuple(int(x) for x in text.replace(",", " ").split())


def _names(text: str) -> tuple:
    return tuple(x for x in text.replace(",", " ").split())


def _parser() -> argparse.ArgumentParser:
    presets = "\n".join(f"  {name:15s} {text}" for name, text in PRESET_HELP.items())
    parser = argparse.ArgumentParser(
        prog="python -m wb_kernels.bench", formatter_class=argparse.RawDescriptionHelpFormatter,
        description="Benchmark the attention stages of wb_kernels against PyTorch (and flash-attn, vLLM when "
                    "installed). Results go to one JSON file per run, written after every measurement and "
                    "resumed when the same command runs again.",
        epilog=f"presets:\n{presets}\n\nfree flags (--stages, --lengths, ...) define one more sweep; without a "
               "preset they are the whole run. Examples:\n"
               "  python -m wb_kernels.bench --preset smoke\n"
               "  python -m wb_kernels.bench --preset all --time-budget 330\n"
               "  python -m wb_kernels.bench --stages flash --baselines sdpa --lengths 1024,4096 --head-dims 64\n"
               "  python -m wb_kernels.bench --figures results/bench/FILE.json")
    parser.add_argument("--preset", action="append", choices=list(PRESET_HELP), help="a named sweep (repeatable)")
    parser.add_argument("--stages", type=_names, help="stages to run, comma-separated (default with free flags: all)")
    parser.add_argument("--baselines", type=_names, help=f"baselines, comma-separated, from: {', '.join(BASELINES)}")
    parser.add_argument("--lengths", type=_ints, help="sequence lengths L (Lq = Lk), e.g. 512,1024")
    parser.add_argument("--head-dims", type=_ints, help="head dims D, e.g. 64,128")
    parser.add_argument("--dtypes", type=_names, help="float16, bfloat16, float32 (default float32)")
    parser.add_argument("--batch-heads", type=_ints, metavar="B,H", help="batch and heads (default: B*L = --tokens)")
    parser.add_argument("--tokens", type=int, default=None, help=f"B = tokens // L (default {TOKENS} on a GPU)")
    parser.add_argument("--heads", type=int, default=16, help="heads when B comes from --tokens (default 16)")
    parser.add_argument("--causal", choices=("no", "yes", "both"), default="no")
    parser.add_argument("--out", type=Path, help="results file (default: results/bench/<gpu>_<date>.json, or "
                                                 "results/bench/simulator_smoke.json on the simulator)")
    parser.add_argument("--fresh", action="store_true", help="start a new file instead of resuming")
    parser.add_argument("--seconds", type=float, default=None,
                        help="stop repeating a measurement after about this many seconds of samples "
                             "(default 0.3 on a GPU, 0.05 on the simulator)")
    parser.add_argument("--min-repeats", type=int, default=3)
    parser.add_argument("--max-repeats", type=int, default=100)
    parser.add_argument("--no-flush", action="store_true", help="do not flush the L2 cache between repeats")
    parser.add_argument("--time-failed-checks", action="store_true",
                        help="also time a stage whose output fails the check (flagged check_failed in the file, "
                             "marked in figures and the README table); by default it is recorded as failed, untimed")
    parser.add_argument("--time-budget", type=float, help="stop starting new measurements after this many "
                                                          "seconds (the file can be resumed)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    parser.add_argument("--no-figures", action="store_true", help="do not draw figures/bench_*.png after a GPU run")
    parser.add_argument("--list", action="store_true", help="list presets, stages and baselines, then exit")
    parser.add_argument("--figures", nargs="?", const=True, metavar="RESULTS.json",
                        help="with a file: draw figures/bench_*.png from it, then exit; alone: draw them after the "
                             "run (the default on a GPU)")
    parser.add_argument("--update-readme", type=Path, metavar="RESULTS.json",
                        help="rewrite README.md's performance table from a results file, then exit")
    return parser


def _custom_sweep(args, on_cuda: bool) -> Optional[Sweep]:
    if not any((args.stages, args.baselines, args.lengths, args.head_dims, args.dtypes, args.batch_heads)):
        return None
    stages = args.stages if args.stages is not None else tuple(
        name for name in available_stages() if name != "reference" or not on_cuda)
    baselines = args.baselines if args.baselines is not None else ("sdpa",)
    lengths = args.lengths or ((1024, 4096) if on_cuda else (32,))
    head_dims = args.head_dims or ((64,) if on_cuda else (16,))
    dtypes = args.dtypes or ("float32",)
    causals = {"no": (False,), "yes": (True,), "both": (False, True)}[args.causal]
    configs = []
    for dtype in dtypes:
        for causal in causals:
            for D in head_dims:
                for L in lengths:
                    if args.batch_heads:
                        if len(args.batch_heads) != 2:
                            raise Refused(f"--batch-heads wants two numbers B,H; got {args.batch_heads}")
                        B, H = args.batch_heads
                    else:
                        tokens = args.tokens or (TOKENS if on_cuda else L)
                        B, H = max(1, tokens // L), args.heads if on_cuda or args.tokens else 1
                    configs.append(Config(B, H, L, D, dtype, causal))
    return Sweep("custom", tuple(stages) + tuple(baselines), tuple(configs))


def _listing() -> str:
    lines = ["presets:"] + [f"  {n:15s} {t}" for n, t in PRESET_HELP.items()] + ["stages (this package):"]
    for name, stage in available_stages().items():
        lines.append(f"  {name:15s} {stage.summary} [{', '.join(stage.dtypes)}]"
                     + (" (GPU only)" if stage.needs_gpu else ""))
    lines.append("baselines:")
    table = contenders()
    for name in BASELINES:
        why = table[name].unavailable
        lines.append(f"  {name:15s} {BASELINE_HELP[name]}" + (f" -- absent: {why}" if why else ""))
    return "\n".join(lines)


def main(argv=None) -> int:
    args = _parser().parse_args(argv)
    try:
        if args.list:
            print(_listing())
            return 0
        if args.update_readme:
            print(f"updated {update_readme(args.update_readme)}")
            return 0
        if isinstance(args.figures, str):
            from .figures import save_all

            for path in save_all(load_results(args.figures)):
                print(f"wrote {path}")
            return 0
        on_cuda = _device() == "cuda"
        presets = list(args.preset or [])
        if "all" in presets:
            presets = [p for p in presets if p != "all"] + ["public", "ladder", "flash-fp32", "tensor-cores", "honesty"]
        custom = _custom_sweep(args, on_cuda)
        if not presets and custom is None:
            presets = ["smoke"]
        if not on_cuda:
            gpu_only = [p for p in presets if p in GPU_PRESETS]
            if gpu_only:
                raise Refused(f"preset {', '.join(gpu_only)} needs a CUDA GPU (sizes up to L=16384); this machine "
                              "runs the CUDA simulator. Use --preset smoke, or small free flags such as "
                              "--lengths 32 --head-dims 16.")
        sweeps = [sweep for p in dict.fromkeys(presets) for sweep in PRESETS.get(p, [])]
        if custom is not None:
            sweeps.append(custom)
        explicit = tuple(args.stages or ()) + tuple(args.baselines or ())
        seconds = args.seconds if args.seconds is not None else (0.3 if on_cuda else 0.05)
        policy = TimingPolicy(seconds=seconds, min_repeats=args.min_repeats, max_repeats=args.max_repeats,
                              flush_l2=not args.no_flush, time_failed_checks=args.time_failed_checks)
        out = default_output("cuda" if on_cuda else "cpu")
        if args.out is not None:  # a folder (existing, or written with a trailing slash) gets the default name
            folder = args.out.is_dir() or str(args.out).endswith(("/", "\\"))
            out = args.out / out.name if folder else args.out
        print(f"writing {out}")
        run(sweeps, out, policy=policy, resume=not args.fresh, seed=args.seed, progress=not args.no_progress,
            time_budget=args.time_budget, honesty="honesty" in presets, explicit=explicit,
            command="python -m wb_kernels.bench " + " ".join(argv if argv is not None else sys.argv[1:]))
        wants_figures = (on_cuda and not args.no_figures) or args.figures is True
        if wants_figures and any(r["status"] == "ok" for r in load_results(out)["records"]):
            from .figures import save_all

            for path in save_all(load_results(out)):
                print(f"wrote {path}")
    except Refused as refusal:
        print(f"error: {refusal}", file=sys.stderr)
        return 2
    return 0

