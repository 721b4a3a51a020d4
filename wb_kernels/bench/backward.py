"""The backward benchmark (lesson 08_backward): the gradients of attention, ``--preset backward``.

    python -m wb_kernels.bench --preset backward --time-budget 540     # a GPU: results/backward/bench_<gpu>.json
    python -m wb_kernels.bench --preset backward-smoke                  # tiny sizes: what the simulator runs
    python -m wb_kernels.bench --update-readme results/backward/bench_h100.json   # the README's backward table

The problems are :class:`BackwardWorkload` (:data:`BACKWARD_PRESETS`): B*L = 16k tokens, H = 16, D = 64 and 128,
causal and not, fp16 and bf16; GQA with H = 32, Hk = 8; and the numba ``flash`` rung's backward against SDPA's fp32
backward (EFFICIENT) at a smaller size. Each is measured in two modes:

- ``fwd+bwd``: the forward, then the gradients of q, k and v for a random ``dout`` (a training step's attention);
- ``bwd``: the gradients alone, the forward run once outside the timing (its graph kept for repeated backwards).

Contenders (:func:`backward_contenders`), each checked, then timed with the one method every preset uses
(:data:`wb_kernels.timing.DEVICE_TIME`, recorded in the file; :func:`wb_kernels.bench.results.same_timing` compares
files):

- a stage by name (``mma``, ``flash``, ``reference``): ``wb.attention(q, k, v, stage=name, causal=...)`` on tensors
  that require grad, then ``torch.autograd.grad``: what a user calls (validation, the registered op, autograd);
- ``<stage>-kernel``: the bare backward, ``wb_kernels.stages.get_backward(name).gradients(q, k, v, out, lse, dout)``
  (after the stage's own ``forward`` in the fwd+bwd mode), no validation, no autograd;
- SDPA with PyTorch's choice and forced to FLASH, cuDNN, EFFICIENT (MATH in the smoke preset), and FlexAttention
  compiled once per workload (its backward too; fp16 workloads only, as each compilation costs seconds) where triton
  is importable, all through ``torch.autograd.grad``.

A stage without a registered backward, or that cannot run here, is a row with status "skipped" and the reason.
FLOPs: the backward counts 2.5x the forward's ``4 B H Lq Lk D`` (five matrix products against two), halved when
causal; fwd+bwd counts 3.5x. Memory: the peak bytes allocated during each checked call, beside the analytic
O(L) value (:func:`linear_memory_bytes`: out, LSE, dq, dk, dv and one float32 row statistic) and the size of one
L x L buffer (what the flash backward never allocates). The check: dq, dk, dv of batch 0 and the first group of query
heads (one key/value head) against float64 autograd on the device, within twice SDPA's own error in the same dtype
plus the rounding of storing the reference in that dtype.

Results go to their own file (``"kind": "backward"``, under ``results/backward/``), written after every measurement;
the same command resumes a run cut short (``--time-budget``). :func:`run_backward` runs a preset.
"""

from __future__ import annotations

import time
import warnings
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional

from ..attention_costs import ITEMSIZE, attention_flops
from ..results_files import REPO_ROOT, fill_block, gpu_results_path, load_results, round_significant, shown_path
from ..timing import free_device_memory
from ..tuning import sdpa_call
from .failures import error_line, is_refusal
from .measure import (TimingPolicy, causal_mask_mod, finish_results, flex_problem, measure_jobs, open_results,
                      stamp_timing, tensor_device, time_checked)
from .results import add_speedups, new_results, timing_method
from .sweeps import TOKENS, Refused

__all__ = ["BackwardWorkload", "BACKWARD_PRESETS", "BACKWARD_MODES", "BackwardContender", "backward_contenders",
           "backward_flops", "pass_flops", "linear_memory_bytes", "quadratic_bytes", "plan_backward",
           "backward_record_key", "run_backward", "default_backward_output", "backward_table",
           "update_backward_readme", "overhead_table", "measure_backward_overhead", "README_BACKWARD_START", "README_BACKWARD_END", "BACKWARD_NOTES"]

BACKWARD_MODES = ("fwd+bwd", "bwd")
README_BACKWARD_START = "<!-- perf-table-backward:start -->"
README_BACKWARD_END = "<!-- perf-table-backward:end -->"


@dataclass(frozen=True)
class BackwardWorkload:
    """One problem: q (B, H, L, D), k and v (B, Hk, L, D), Lq = Lk = L, top-left causal or none."""

    B: int
    H: int
    Hk: int
    L: int
    D: int
    dtype: str
    causal: bool

    @property
    def key(self) -> str:
        return f"{self.dtype}|B{self.B}|H{self.H}|Hk{self.Hk}|L{self.L}|D{self.D}|{'causal' if self.causal else 'full'}"

    @property
    def group(self) -> int:
        """Query heads per key/value head."""
        return self.H // self.Hk


def backward_flops(B: int, H: int, Lq: int, Lk: int, D: int, causal: bool) -> float:
    """The backward's useful FLOPs: 2.5x the forward's (five L x L matrix products, S = QK^T recomputed, dV = P^T dO,
    dP = dO V^T, dQ = dS K, dK = dS^T Q, against the forward's two), halved when causal."""
    return 2.5 * attention_flops(B, H, Lq, Lk, D, causal)


def pass_flops(workload: BackwardWorkload, mode: str) -> float:
    """FLOPs of one timed call: the backward's, plus the forward's in the fwd+bwd mode."""
    w = workload
    backward = backward_flops(w.B, w.H, w.L, w.L, w.D, w.causal)
    if mode == "bwd":
        return backward
    if mode == "fwd+bwd":
        return backward + attention_flops(w.B, w.H, w.L, w.L, w.D, w.causal)
    raise ValueError(f"mode: one of {BACKWARD_MODES}, got {mode!r}")


def linear_memory_bytes(workload: BackwardWorkload, mode: str = "fwd+bwd") -> int:
    """The bytes an O(L) attention must allocate beyond q, k, v and dout: in the fwd+bwd mode the forward's out
    (B, H, L, D) and LSE (B, H, L) float32, then dq (B, H, L, D), dk and dv (B, Hk, L, D) and one float32 row
    statistic (B, H, L) (Delta = rowsum(dO * O)); in the bwd mode the backward's part alone. Anything beyond is the
    implementation's choice (a float32 dq accumulator, a workspace); an L x L buffer would be
    :func:`quadratic_bytes`."""
    w = workload
    item = ITEMSIZE[w.dtype]
    rows = w.B * w.H * w.L
    backward = item * (rows * w.D + 2 * w.B * w.Hk * w.L * w.D) + 4 * rows
    if mode == "bwd":
        return backward
    if mode == "fwd+bwd":
        return backward + item * rows * w.D + 4 * rows
    raise ValueError(f"mode: one of {BACKWARD_MODES}, got {mode!r}")


def quadratic_bytes(workload: BackwardWorkload) -> int:
    """One L x L buffer per head in the inputs' dtype (P or dS kept whole): what the O(L) backward avoids."""
    w = workload
    return ITEMSIZE[w.dtype] * w.B * w.H * w.L * w.L


def backward_record_key(contender: str, mode: str, workload: BackwardWorkload) -> str:
    # the contender first: add_speedups groups records by the rest of the key (mode and workload)
    return f"{contender}|{mode}|{workload.key}"


def _tokens_workloads(lengths, head_dims, dtypes, *, H=16, Hk=16, tokens=TOKENS) -> tuple:
    return tuple(BackwardWorkload(max(1, tokens // L), H, Hk, L, D, dtype, causal)
                 for dtype in dtypes for D in head_dims for causal in (False, True) for L in lengths)


def _backward_presets() -> dict:
    tensor_cores = _tokens_workloads((1024, 4096, 16384), (64, 128), ("float16", "bfloat16"))
    gqa = _tokens_workloads((4096,), (128,), ("float16", "bfloat16"), H=32, Hk=8)
    # the numba rung on CUDA cores in fp32: a smaller size (B*L = 4k), against SDPA's fp32 backward (EFFICIENT)
    cuda_cores = _tokens_workloads((1024, 2048), (64,), ("float32",), tokens=4096)
    # the bar problems only (fp16, B4 H16 L4096, D 64/128, causal and not; GQA H32 Hk8 D128): what fits in a
    # few minutes of a GPU, the whole preset being 12-20
    bar = _tokens_workloads((4096,), (64, 128), ("float16",)) + _tokens_workloads((4096,), (128,), ("float16",),
                                                                                 H=32, Hk=8)
    tensor_core_contenders = ("mma", "mma-kernel", "sdpa", "sdpa-flash", "sdpa-cudnn", "sdpa-efficient", "flex")
    return {
        "backward-bar": (tensor_core_contenders, bar),
        "backward-bar-cuda-cores": (("flash", "flash-kernel", "sdpa-efficient"), cuda_cores[:2]),
        "backward": (tensor_core_contenders, tensor_cores + gqa),
        "backward-cuda-cores": (("flash", "flash-kernel", "sdpa-efficient", "sdpa"), cuda_cores),
        # naive: a forward-only rung, recorded as skipped with the reason. One workload (GQA, causal, a length that
        # is no tile multiple): the flash rows take about a minute each on the simulator (calls of seconds)
        "backward-smoke": (("reference", "reference-kernel", "naive", "flash", "flash-kernel", "sdpa", "sdpa-math"),
                           (BackwardWorkload(1, 2, 1, 33, 16, "float32", True),)),
    }


# {preset: ((contender names), (workloads))}; --preset backward runs "backward" and "backward-cuda-cores"
BACKWARD_PRESETS = _backward_presets()
PRESET_GROUPS = {"backward": ("backward", "backward-cuda-cores"), "backward-smoke": ("backward-smoke",),
                 "backward-bar": ("backward-bar", "backward-bar-cuda-cores")}

BACKWARD_NOTES = {
    "modes": "fwd+bwd: out = f(q, k, v), then torch.autograd.grad(out, (q, k, v), dout), timed together; bwd: the "
             "forward once outside the timing, then torch.autograd.grad(..., retain_graph=True) timed. <stage>-kernel: "
             "the registered Backward's gradients(q, k, v, out, lse, dout) called directly (after the stage's "
             "forward in fwd+bwd)",
    "flops": "backward = 2.5 x 4*B*H*Lq*Lk*D (halved when causal); fwd+bwd = 3.5 x",
    "memory": "peak_bytes: allocated during the checked call beyond what existed before it (q, k, v, dout; in the "
              "bwd mode also the forward's out and what autograd saved), gradients included; linear_bytes: what an "
              "O(L) implementation must allocate in that call (fwd+bwd: out, LSE, dq, dk, dv and one float32 row "
              "statistic; bwd: the last four); quadratic_bytes: one L x L buffer per head in the inputs' dtype; "
              "peak_vs_linear = peak_bytes / linear_bytes (on the simulator the host's tracemalloc, which does not "
              "see torch's CPU allocations)",
    "check": "dq, dk, dv of batch 0 and query heads 0..H/Hk-1 (key/value head 0) against float64 autograd on the "
             "device; tolerance 2 x SDPA's error (PyTorch's choice of backend, same dtype) + the storage floor",
}


# ----------------------------------------------------------------------------------------------
# Contenders
# ----------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class BackwardContender:
    """Something that computes attention's gradients. ``prepare(q, k, v, dout, workload, mode)`` does the untimed
    setup and returns the timed zero-argument call, which returns (dq, dk, dv); ``refusal(workload, on_cuda)`` says
    why it cannot run a workload here (recorded as skipped), or None."""

    name: str
    kind: str  # "stage" (through wb.attention and autograd), "kernel" (the bare backward) or "baseline"
    prepare: Callable
    what: str
    dtypes: Optional[tuple] = None  # None: any
    head_dims: Optional[tuple] = None
    refusal: Callable = lambda workload, on_cuda: None


def _causal(workload: BackwardWorkload):
    return "top_left" if workload.causal else False


def _autograd_call(forward: Callable, leaves, dout, mode: str) -> Callable:
    """The timed call for a differentiable `forward` (no arguments, returns out): fwd+bwd or bwd (module docstring)."""
    import torch

    if mode == "fwd+bwd":
        return lambda: torch.autograd.grad(forward(), leaves, dout)
    out = forward()
    return lambda: torch.autograd.grad(out, leaves, dout, retain_graph=True)


def _stage_refusal(name: str, bare: bool) -> Callable:
    def refusal(workload: BackwardWorkload, on_cuda: bool) -> Optional[str]:
        from ..stages import available_stages, get_backward

        stage = available_stages().get(name)
        if stage is None:
            return f"{name!r} is not a stage of this package"
        try:
            get_backward(name)
        except ValueError as error:
            return str(error)
        if stage.needs_gpu and not on_cuda:
            return "needs a CUDA GPU; this machine runs the CUDA simulator"
        if not bare:
            from ..api import validate

            try:  # the sizes the stage refuses here (memory, the simulator's time) are skipped, not crashed
                validate(*_meta_inputs(workload), stage=name, causal=workload.causal)
            except (MemoryError, ValueError, TypeError) as error:
                return error_line(error)
        return None

    return refusal


def _meta_inputs(workload: BackwardWorkload):
    """q, k, v of the workload's shape and dtype on the device, as tiny strided views of one element (validation
    reads shapes, dtypes and devices; the NaN scan is not part of validate)."""
    import torch

    w = workload
    device = "cuda" if tensor_device() == "cuda" else "cpu"
    one = torch.zeros(1, dtype=getattr(torch, w.dtype), device=device)
    return (one.expand(w.B, w.H, w.L, w.D), one.expand(w.B, w.Hk, w.L, w.D), one.expand(w.B, w.Hk, w.L, w.D))


def _stage_prepare(name: str):
    def prepare(q, k, v, dout, workload, mode):
        from ..api import attention

        return _autograd_call(lambda: attention(q, k, v, stage=name, causal=workload.causal), (q, k, v), dout, mode)

    return prepare


def _kernel_prepare(name: str):
    def prepare(q, k, v, dout, workload, mode):
        import torch

        from ..device import like_input
        from ..stages import get_backward, get_stage

        gradients, forward = get_backward(name).gradients, get_stage(name).forward
        q, k, v = (x.detach() for x in (q, k, v))
        options = dict(causal=_causal(workload), key_padding_mask=None, scale=None)

        def grads(out, lse):
            with torch.no_grad():
                return tuple(like_input(g, x) for g, x in zip(gradients(q, k, v, out, lse, dout, **options),
                                                                 (q, k, v)))

        if mode == "fwd+bwd":
            return lambda: grads(*forward(q, k, v, **options))
        saved = forward(q, k, v, **options)
        return lambda: grads(*saved)

    return prepare


def _sdpa_prepare(backend_name: Optional[str]):
    def prepare(q, k, v, dout, workload, mode):
        call = sdpa_call(q, k, v, backend_name, is_causal=workload.causal, enable_gqa=workload.Hk != workload.H)
        return _autograd_call(call, (q, k, v), dout, mode)

    return prepare


_FLEX_COMPILED = {}  # {workload: (compiled flex_attention, block mask)}: one compilation serves both modes


def _flex_prepare(q, k, v, dout, workload, mode):
    """FlexAttention compiled (forward and backward: the first grad compiles the backward, here, untimed)."""
    import torch
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    import torch._functorch.config as functorch_config

    # The bwd mode runs one forward and times its backward again and again (retain_graph=True); a backward compiled
    # with donated buffers refuses that (measured on the H100: RuntimeError on every bwd row). A patch of the setting
    # around the first calls was not enough (the run at c11746a failed every bwd row the same way), so it is off from
    # here to the end of the backward benchmark (run_backward restores it; donated buffers save memory, not time).
    functorch_config.donated_buffer = False
    if workload not in _FLEX_COMPILED:
        _FLEX_COMPILED.clear()
        torch._dynamo.reset()  # see measure._flex_prepare: past the recompile limit it would run unfused
        block_mask = (create_block_mask(causal_mask_mod, None, None, workload.L, workload.L, device=q.device)
                      if workload.causal else None)
        _FLEX_COMPILED[workload] = (torch.compile(flex_attention, dynamic=False, fullgraph=True), block_mask)
    compiled, block_mask = _FLEX_COMPILED[workload]
    call = _autograd_call(lambda: compiled(q, k, v, block_mask=block_mask, enable_gqa=workload.Hk != workload.H),
                          (q, k, v), dout, mode)
    call()
    return call


def backward_contenders() -> dict:
    """{name: BackwardContender}: every stage (through wb.attention) and its bare kernel, then the baselines."""
    from ..stages import available_stages

    found = {}
    for name, stage in available_stages().items():
        found[name] = BackwardContender(name, "stage", _stage_prepare(name), f"wb.attention(stage={name!r}) + autograd",
                                        tuple(stage.dtypes), stage.head_dims, _stage_refusal(name, bare=False))
        found[f"{name}-kernel"] = BackwardContender(
            f"{name}-kernel", "kernel", _kernel_prepare(name), f"get_backward({name!r}).gradients, bare",
            tuple(stage.dtypes), stage.head_dims, _stage_refusal(name, bare=True))
    sixteen = ("float16", "bfloat16")

    def gpu_only(why=None):
        return lambda workload, on_cuda: why or (None if on_cuda else "needs a CUDA GPU")

    for name, backend, dtypes in (("sdpa", None, None), ("sdpa-flash", "FLASH_ATTENTION", sixteen),
                                  ("sdpa-cudnn", "CUDNN_ATTENTION", sixteen),
                                  ("sdpa-efficient", "EFFICIENT_ATTENTION", None), ("sdpa-math", "MATH", None)):
        refusal = gpu_only() if backend in ("FLASH_ATTENTION", "CUDNN_ATTENTION") else (lambda w, c: None)
        found[name] = BackwardContender(name, "baseline", _sdpa_prepare(backend),
                                        f"SDPA ({backend or 'PyTorch picks'}) + autograd", dtypes, refusal=refusal)
    # fp16 only: each workload compiles its kernels (seconds to tens of seconds), the run's largest fixed cost
    found["flex"] = BackwardContender("flex", "baseline", _flex_prepare, "FlexAttention, compiled, + autograd",
                                      ("float16",), refusal=gpu_only(flex_problem()))
    return found


def plan_backward(presets, table: dict) -> list:
    """[(contender, workload, mode, [preset names])] for the presets' contenders and workloads; contenders not in
    `table` and dtypes or head dims a contender does not take are left out (a stage that cannot run is planned, and
    recorded as skipped with its reason)."""
    jobs = {}
    for preset in presets:
        names, workloads = BACKWARD_PRESETS[preset]
        for workload in workloads:
            for name in names:
                contender = table.get(name)
                if contender is None or (contender.dtypes is not None and workload.dtype not in contender.dtypes) \
                        or (contender.head_dims is not None and workload.D not in contender.head_dims):
                    continue
                for mode in BACKWARD_MODES:
                    key = backward_record_key(name, mode, workload)
                    jobs.setdefault(key, (contender, workload, mode, []))[3].append(preset)
    return list(jobs.values())


# ----------------------------------------------------------------------------------------------
# Inputs, the check, one measurement
# ----------------------------------------------------------------------------------------------

def _inputs(workload: BackwardWorkload, seed: int, device: str):
    """q, k, v (requiring grad) and dout, standard normal in the workload's dtype, drawn per workload (a resumed run
    sees the same numbers)."""
    import torch

    w = workload
    generator = torch.Generator(device=device).manual_seed((zlib.crc32(w.key.encode()) + seed) % 2**31)

    def draw(heads, grad):
        x = torch.randn((w.B, heads, w.L, w.D), generator=generator, device=device, dtype=getattr(torch, w.dtype))
        return x.requires_grad_(grad)

    return draw(w.H, True), draw(w.Hk, True), draw(w.Hk, True), draw(w.H, False)


def _slice_gradients(q, k, v, dout, causal: bool, dtype) -> tuple:
    """Autograd's (dq, dk, dv) for batch 0, query heads 0..g-1 and key/value head 0, in `dtype` on the inputs'
    device: float64 is the reference, the inputs' dtype (SDPA, PyTorch's choice of backend) is PyTorch's own error.
    k and v broadcast over the g query heads, so dk and dv come out summed over the group, as GQA's."""
    import torch
    import torch.nn.functional as F

    g = q.shape[1] // k.shape[1]
    leaves = [x[:1, :n].detach().to(dtype).requires_grad_() for x, n in ((q, g), (k, 1), (v, 1))]
    sq, sk, sv = leaves
    if dtype == torch.float64:
        scores = (sq @ sk.transpose(-1, -2)) * sq.shape[-1] ** -0.5
        if causal:
            allowed = torch.ones(scores.shape[-2:], dtype=torch.bool, device=sq.device).tril()
            scores = scores.masked_fill(~allowed, float("-inf"))
        out = torch.softmax(scores, dim=-1) @ sv
    else:
        out = F.scaled_dot_product_attention(sq, sk.expand(1, g, -1, -1), sv.expand(1, g, -1, -1), is_causal=causal)
    return tuple(x.detach() for x in torch.autograd.grad(out, leaves, dout[:1, :g].to(dtype)))


class _Judge:
    """The reference gradients of one workload's slice and their tolerances (module docstring: the check)."""

    def __init__(self, q, k, v, dout, workload: BackwardWorkload):
        import torch

        from ..check import storage_floor

        self.group = workload.group
        self.ref = _slice_gradients(q, k, v, dout, workload.causal, torch.float64)
        theirs = _slice_gradients(q, k, v, dout, workload.causal, q.dtype)
        self.tols = tuple(2.0 * float((t.double() - r).abs().max()) + storage_floor(r.cpu().numpy(), workload.dtype)
                          for t, r in zip(theirs, self.ref))

    def __call__(self, name: str, grads) -> dict:
        g = self.group
        mine = (grads[0][:1, :g], grads[1][:1, :1], grads[2][:1, :1])
        errors = [float((m.double().to(r.device) - r).abs().max()) for m, r in zip(mine, self.ref)]
        passed = all(e <= t for e, t in zip(errors, self.tols))
        line = f"{name} gradients: " + ", ".join(
            f"{what} max |err| {e:.1e} {'≤' if e <= t else '>'} tol {t:.1e}"
            for what, e, t in zip(("dq", "dk", "dv"), errors, self.tols)) + (" ✓" if passed else " ✗")
        return {"errors": [round_significant(e, 3) for e in errors], "tols": [round_significant(t, 3) for t in self.tols], "passed": passed,
                "line": line}


def _base_record(contender: BackwardContender, workload: BackwardWorkload, mode: str) -> dict:
    w = workload
    record = {"key": backward_record_key(contender.name, mode, w), "contender": contender.name,
              "kind": contender.kind, "mode": mode, "dtype": w.dtype, "B": w.B, "H": w.H, "Hk": w.Hk, "Lq": w.L,
              "Lk": w.L, "D": w.D, "causal": w.causal, "flops": pass_flops(w, mode),
              "linear_bytes": linear_memory_bytes(w, mode), "quadratic_bytes": quadratic_bytes(w)}
    return record


def measure_one(contender: BackwardContender, workload: BackwardWorkload, mode: str, inputs, judge: _Judge,
                policy: TimingPolicy, on_cuda: bool) -> dict:
    """Check, then time, one contender on one workload in one mode; never raises for the contender's own failures."""
    from ..timing import peak_memory

    record = _base_record(contender, workload, mode)
    why = contender.refusal(workload, on_cuda)
    if why:
        record.update(status="skipped", reason=why)
        return record
    q, k, v, dout = inputs
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # SDPA warns about each kernel it rejects before it raises
            call = contender.prepare(q, k, v, dout, workload, mode)
            grads, memory = peak_memory(call)
    except Exception as error:  # noqa: BLE001 - recorded, the sweep goes on
        record.update(status="skipped" if is_refusal(error) else "failed", reason=error_line(error))
        free_device_memory()
        return record
    record.update(peak_bytes=int(memory.peak_bytes), peak_device=memory.device,
                  peak_vs_linear=round_significant(memory.peak_bytes / record["linear_bytes"], 3))
    record["check"] = judge(contender.name, grads)
    del grads
    return time_checked(record, contender, call, policy, workload.B * workload.L)


# ----------------------------------------------------------------------------------------------
# The run
# ----------------------------------------------------------------------------------------------

def default_backward_output(on_cuda: bool) -> Path:
    """results/backward/bench_<gpu>.json (h100, h200, ...), or results/backward/simulator_smoke.json."""
    return gpu_results_path("backward", "bench", on_cuda=on_cuda, smoke_name="simulator_smoke.json")


def _new_backward(presets, command) -> dict:
    return {**new_results(presets, command), "kind": "backward", "notes": BACKWARD_NOTES}


def run_backward(presets, out_path, **options) -> dict:
    """Run the backward `presets` (names in :data:`BACKWARD_PRESETS`) into `out_path`; return the results (the
    options: :func:`_run_backward`'s). FlexAttention's compilation turns torch's donated buffers off
    (:func:`_flex_prepare`); the setting the caller had comes back afterwards."""
    try:
        import torch._functorch.config as functorch_config
    except ImportError:  # no torch: nothing to restore
        return _run_backward(presets, out_path, **options)
    donated = functorch_config.donated_buffer
    try:
        return _run_backward(presets, out_path, **options)
    finally:
        functorch_config.donated_buffer = donated


def _run_backward(presets, out_path, *, policy: Optional[TimingPolicy] = None, resume: bool = True,
                 retry_failed: bool = False, seed: int = 0,
                 progress: bool = True, time_budget: Optional[float] = None, table: Optional[dict] = None,
                 command: Optional[str] = None, log=print) -> dict:
    """Run the backward `presets` (names in :data:`BACKWARD_PRESETS`) into `out_path`; return the results.
    `retry_failed`: drop the records a resumed file holds as failed, so that they are measured again."""
    started = time.monotonic()
    policy = policy or TimingPolicy()
    table = table if table is not None else backward_contenders()
    on_cuda = tensor_device() == "cuda"
    out_path = Path(out_path)
    results = open_results(out_path, list(presets), resume=resume, command=command, kind="backward",
                           fresh=_new_backward)
    stamp_timing(results, policy, out_path)
    results["contenders"] = {name: c.what for name, c in table.items()}
    device = "cuda" if on_cuda else "cpu"

    def prepare(workload):
        inputs = _inputs(workload, seed, device)
        return inputs, _Judge(*inputs, workload)

    stopped = measure_jobs(
        results, plan_backward(presets, table), out_path, key_of=backward_record_key, prepare=prepare,
        measure_row=lambda contender, workload, mode, state: measure_one(
            contender, workload, mode, *(state or (None, None)), policy, on_cuda),
        base_record=_base_record,
        wants_inputs=lambda contender, workload, mode: contender.refusal(workload, on_cuda) is None,
        started=started, time_budget=time_budget, retry_failed=retry_failed, progress=progress, what="backward",
        log=log)
    if on_cuda and not stopped and "overhead" not in results:
        results["overhead"] = measure_backward_overhead(seed)
        log("per-call wall time (us): " + ", ".join(f"{r['name']} {r.get('per_call_us')}"
                                                     for r in results["overhead"]["rows"]))
    add_speedups(results)
    return finish_results(results, out_path, stopped=stopped, time_budget=time_budget, log=log)


OVERHEAD_PROBLEM = (1, 16, 512, 64, "float16")  # B, H, L, D, dtype: the small public problem, as the decode preset's


def measure_backward_overhead(seed: int = 0, *, problem=OVERHEAD_PROBLEM, stage: str = "mma", device: str = "cuda",
                              **timing) -> dict:
    """Per-call wall time, back to back, of what a user calls on a small problem, beside SDPA's: the forward with no
    grad (``wb.attention``, the direct path) and forward + backward through autograd (the ``torch.library`` op).
    The bar (issue #29): eager per-call cost at most twice SDPA's. `timing` goes to ``per_call_seconds``."""
    import statistics

    import torch
    import torch.nn.functional as F

    import wb_kernels as wb

    from ..inputs import random_qkv
    from .decode import OVERHEAD_BAR, per_call_seconds

    B, H, L, D, dtype = problem
    q, k, v = random_qkv(B, H, L, D, dtype=dtype, framework="torch", device=device, seed=seed)
    leaves = [x.detach().requires_grad_(True) for x in (q, k, v)]
    dout = torch.randn_like(q)

    def train_step(attend):
        def call():
            out = attend(*leaves)
            return torch.autograd.grad(out, leaves, dout)
        return call

    calls = {
        ("forward", "sdpa"): lambda: F.scaled_dot_product_attention(q, k, v),
        ("forward", f"wb.attention(stage={stage!r})"): lambda: wb.attention(q, k, v, stage=stage),
        ("fwd+bwd", "sdpa"): train_step(F.scaled_dot_product_attention),
        ("fwd+bwd", f"wb.attention(stage={stage!r})"): train_step(lambda a, b, c: wb.attention(a, b, c, stage=stage)),
    }
    rows, sdpa = [], {}
    for (mode, name), call in calls.items():
        median_us = statistics.median(per_call_seconds(call, **timing)) * 1e6
        row = {"mode": mode, "name": name, "per_call_us": round_significant(median_us, 4)}
        if name == "sdpa":
            sdpa[mode] = median_us
        else:
            row.update(ratio_to_sdpa=round_significant(median_us / sdpa[mode], 3), meets_bar=median_us <= OVERHEAD_BAR * sdpa[mode])
        rows.append(row)
    return {"problem": f"B{B} H{H} L{L} D{D} {dtype}", "bar": OVERHEAD_BAR, "rows": rows,
            "method": "wall clock around 200 back-to-back calls, one synchronisation at the end; median of 5"}


# ----------------------------------------------------------------------------------------------
# The README's table
# ----------------------------------------------------------------------------------------------

TABLE_CONTENDERS = ("mma", "mma-kernel", "sdpa-flash", "sdpa-cudnn", "sdpa-efficient", "flex")


def backward_table(results: dict, source: Optional[str] = None, *, dtype: str = "float16",
                   contenders=TABLE_CONTENDERS, ours: str = "mma", bar: str = "sdpa-flash") -> str:
    """The backward table (Markdown) from a backward results file: one row per mode and workload of `dtype`, median ms
    (TFLOP/s) per contender, then `ours`' peak memory over the O(L) value, its speed against `bar` (the issue's
    baseline: SDPA's FLASH backward in fp16/bf16, EFFICIENT in float32) and against the fastest baseline."""
    if results.get("kind") != "backward":
        raise Refused("not a backward results file (its 'kind' is not 'backward')")
    env = results["environment"]
    method = timing_method(results)
    by_key = {r["key"]: r for r in results["records"]}
    firsts = {}
    for r in results["records"]:
        if r["dtype"] == dtype:
            firsts.setdefault(r["key"].split("|", 1)[1], r)

    def order(rest):  # fwd+bwd rows first, then bwd; MHA before GQA; then mask, head dim and length
        r = firsts[rest]
        return (r["mode"] != "fwd+bwd", r["Hk"] != r["H"], r["causal"], r["D"], r["Lq"])

    def ratio_to(rest, names):  # (time of the fastest of `names` over ours, its name), or None
        mine = by_key.get(f"{ours}|{rest}") or {}
        peers = [(b["median_ms"], n) for n, b in ((n, by_key.get(f"{n}|{rest}")) for n in names)
                 if b is not None and b.get("kind") == "baseline" and b.get("status") == "ok"
                 and not b.get("check_failed")]
        return (min(peers)[0] / mine["median_ms"], min(peers)[1]) if peers and mine.get("status") == "ok" else None

    rows = sorted(firsts, key=order)
    columns = [c for c in contenders if any(r["contender"] == c and r["dtype"] == dtype for r in results["records"])]
    head = (f"Measured on {env.get('gpu') or env.get('device')} (CUDA {env.get('cuda')}, torch {env.get('torch')}) on "
            f"{str(env.get('date', ''))[:10]}" + (f", from `{source}`" if source else "") + ". Timed as: the median of "
            + (method.words() if method else "host-clock timings (no GPU)") + f". {dtype}, median ms (TFLOP/s); "
            "backward FLOPs = 2.5x the forward's, fwd+bwd 3.5x; a dash: not run, skipped or failed its check. "
            f"{ours}: wb.attention and autograd (what a user calls), {ours}-kernel: its backward called directly. "
            f"mem: {ours}'s peak bytes of fwd+bwd over the O(L) value (out, LSE, dq, dk, dv, one row statistic). "
            f"×{bar}: {bar}'s time over {ours}'s; ×best: the fastest baseline's (>1: {ours} is faster).")
    lines = [head, "", "| mode | B | H | Hk | L | D | causal | " + " | ".join(columns)
             + f" | {ours} mem | {ours} ×{bar} | {ours} ×best |",
             "|:---|---:|---:|---:|---:|---:|:---:|" + "---:|" * len(columns) + "---:|---:|---:|"]
    for rest in rows:
        first = firsts[rest]
        cells = []
        for name in columns:
            r = by_key.get(f"{name}|{rest}")
            ok = r is not None and r.get("status") == "ok" and not r.get("check_failed")
            cells.append(f"{r['median_ms']:.3g} ({r['tflops']:.0f})" if ok else "-")
        memory = by_key.get(f"{ours}|fwd+bwd|{rest.split('|', 1)[1]}") or {}
        mem = f"{memory['peak_vs_linear']:.2f}" if memory.get("peak_vs_linear") else "-"
        to_bar, best = ratio_to(rest, (bar,)), ratio_to(rest, contenders)
        lines.append(f"| {first['mode']} | {first['B']} | {first['H']} | {first['Hk']} | {first['Lq']} | "
                     f"{first['D']} | {'yes' if first['causal'] else 'no'} | " + " | ".join(cells)
                     + f" | {mem} | " + (f"{to_bar[0]:.2f}" if to_bar else "-")
                     + " | " + (f"{best[0]:.2f} ({best[1]})" if best else "-") + " |")
    return "\n".join(lines)


def overhead_table(results: dict) -> str:
    """The per-call rows (:func:`measure_backward_overhead`) as Markdown; empty when the file has none."""
    found = results.get("overhead")
    if not found:
        return ""
    lines = [f"Per-call wall time of back-to-back calls on {found['problem']} ({found['method']}; the bar: at most "
             f"{found['bar']:g}x SDPA's):", "", "| call | mode | µs per call | ×SDPA |", "|:---|:---|---:|---:|"]
    for r in found["rows"]:
        ratio = (f"{r['ratio_to_sdpa']:.2f} {'✓' if r['meets_bar'] else '✗'}" if "ratio_to_sdpa" in r else "")
        lines.append(f"| {r['name']} | {r['mode']} | {r['per_call_us']:.4g} | {ratio} |")
    return "\n".join(lines)


def update_backward_readme(results_path, readme=REPO_ROOT / "README.md") -> Path:
    """Rewrite the README's backward block (between :data:`README_BACKWARD_START` and ``_END``) from a results file."""
    def table_of_the_file() -> str:
        source = shown_path(results_path, REPO_ROOT)
        results = load_results(results_path)
        table = backward_table(results, source=source)
        if any(r["dtype"] == "float32" and r["contender"] == "flash" for r in results["records"]):
            # the numba rung on CUDA cores against SDPA's float32 backward (EFFICIENT: FLASH and cuDNN take no float32)
            table += "\n\n" + backward_table(results, source=source, dtype="float32",
                                              contenders=("flash", "flash-kernel", "sdpa-efficient"), ours="flash",
                                              bar="sdpa-efficient")
        if overhead_table(results):
            table += "\n\n" + overhead_table(results)
        return table

    return fill_block(readme, README_BACKWARD_START, README_BACKWARD_END, table_of_the_file, error=Refused)
