"""The one public entry point, ``attention(q, k, v, stage=..., causal=...)`` (all lessons, tests, bench).

Everything is validated here, before any kernel is launched or any buffer allocated, and each
error names the argument, the value it got and what is accepted (``tests/test_api_errors.py``).
Here, too, the package keeps its promises about edge cases for every stage at once: inputs are made
contiguous once, and NaN/Inf in the inputs give the result SDPA gives (``tests/test_edge_cases.py``),
even from kernels compiled with fast math, which may assume that no value is ever NaN or Inf.
"""

from __future__ import annotations

import contextlib
import functools
import math
import numbers
import os
import warnings
from dataclasses import dataclass

import numpy as np

from .backend import BACKEND
from .device import ValidatedCalls, cuda_signature, is_torch, like_input
from .reference import CAUSAL_ALIGNMENTS, attention_mask, causal_offset
from .stages import available_stages, get_stage

__all__ = ["attention", "validate", "validate_inputs", "require_array", "Inputs", "propagate_non_finite",
           "SIMULATOR_MAX_SECONDS"]

# CUDA inputs' signatures that passed validate, and its Stage: a signature checked once is not checked again (the
# checks cost more than a small kernel's launch; see device.ValidatedCalls)
_VALIDATED = ValidatedCalls()
# Sizes the simulator would need longer than this for are refused (override: WB_SIM_MAX_SECONDS).
SIMULATOR_MAX_SECONDS = float(os.environ.get("WB_SIM_MAX_SECONDS", "120"))


def _dtype_name(x) -> str:
    return str(x.dtype).replace("torch.", "")


def _device_of(x) -> str:
    return str(x.device) if is_torch(x) else "cpu"


def _free_bytes(on_cuda: bool) -> int:
    if on_cuda:
        import torch

        return torch.cuda.mem_get_info()[0]
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


@functools.lru_cache(maxsize=None)
def _total_gpu_bytes(device_index: int) -> int:
    import torch

    return torch.cuda.get_device_properties(device_index).total_memory


def _may_not_fit(need: int, on_cuda: bool) -> bool:
    """Whether a buffer of `need` bytes is large enough to ask the device how much memory is free.

    Asking the GPU (``cudaMemGetInfo``) costs tens of microseconds, a noticeable part of a small call; a buffer under
    1/16 of the GPU's memory is left to PyTorch's allocator, whose own out-of-memory error is clear enough.
    """
    if not on_cuda:
        return True
    import torch

    return need > _total_gpu_bytes(torch.cuda.current_device()) // 16


def _gib(n: float) -> str:
    return f"{n / 2**30:.2f} GiB"


def _kind(x) -> str:
    return "torch tensor" if is_torch(x) else "NumPy array"


def _as_flag(name: str, value, expected: str = "True or False (or 0/1)") -> bool:
    """True/False from a bool-like value; refuses strings ("False" is truthy) and other numbers."""
    if isinstance(value, (bool, np.bool_)):
        return bool(value)
    if isinstance(value, (int, np.integer)) and value in (0, 1):
        return bool(value)
    if (isinstance(value, np.ndarray) or is_torch(value)) and tuple(value.shape) == () \
            and _dtype_name(value) == "bool":
        return bool(value.item())
    raise TypeError(f"{name}: expected {expected}, got {value!r} of type {type(value).__name__}")


def _check_causal(causal):
    """`causal` as the stages take it: False, "top_left" or "bottom_right" (True and bool-likes mean "top_left").

    An unknown alignment name is a ValueError that lists the accepted values (:func:`causal_offset`); any other
    type a TypeError, as for a flag.
    """
    if isinstance(causal, str):
        causal_offset(causal, 0, 0)
        return causal
    alignments = " or ".join(map(repr, CAUSAL_ALIGNMENTS))
    return "top_left" if _as_flag("causal", causal, f"True or False (or 0/1), or {alignments}") else False


def _check_scale(scale):
    if scale is None:
        return None
    if isinstance(scale, (bool, np.bool_)) or not isinstance(scale, numbers.Real):
        raise TypeError(f"scale: expected a finite number or None (= 1/sqrt(D)), got {scale!r} of type "
                        f"{type(scale).__name__}")
    if not math.isfinite(float(scale)):
        raise ValueError(f"scale: expected a finite number or None (= 1/sqrt(D)), got {scale!r}")
    return float(scale)


def require_array(name: str, x, dtypes=None):
    """Raise a TypeError naming `name` unless `x` is a NumPy array or a torch tensor (of one of `dtypes`)."""
    if not (is_torch(x) or isinstance(x, np.ndarray)):
        raise TypeError(f"{name}: expected a NumPy array or torch tensor, got {type(x).__name__}")
    if dtypes is not None and _dtype_name(x) not in dtypes:
        raise TypeError(f"{name}: expected a dtype among {', '.join(dtypes)}, got {_dtype_name(x)}")


@dataclass(frozen=True)
class Inputs:
    """What :func:`validate_inputs` found out about valid q, k, v."""

    B: int
    H: int  # query heads
    Hk: int  # key/value heads: H, or a divisor of H (grouped-query attention)
    Lq: int
    Lk: int
    D: int
    dtype: str  # e.g. "float32"
    device: str  # "cpu", "cuda:0", ...


def validate_inputs(q, k, v, *, causal=False, key_padding_mask=None, scale=None) -> Inputs:
    """Raise a clear ValueError/TypeError for inputs that no stage takes; the rules every entry point shares.

    wb.attention (through :func:`validate`), wb.reference and wb.check call this, so that a mistake gets
    the same message from each. What a stage adds (dtypes, head dims, a GPU, memory) is in :func:`validate`.
    """
    for name, x in (("q", q), ("k", k), ("v", v)):
        require_array(name, x)
        if x.ndim != 4:
            raise ValueError(f"{name}: expected rank 4 (B, H, L, D), got rank {x.ndim} with shape {tuple(x.shape)}")
    kinds = {name: _kind(x) for name, x in (("q", q), ("k", k), ("v", v))}
    if len(set(kinds.values())) != 1:
        raise TypeError(f"q, k, v: expected all NumPy arrays or all torch tensors, got "
                        + ", ".join(f"{name} a {kind}" for name, kind in kinds.items()))
    (B, H, Lq, D), (Bk, Hk, Lk, Dk), (Bv, Hv, Lv, Dv) = q.shape, k.shape, v.shape
    shapes = f"q has (B, H)=({B}, {H}), k ({Bk}, {Hk}), v ({Bv}, {Hv})"
    if Bk != B or Bv != B:
        raise ValueError(f"batch/heads differ: {shapes}; the batch sizes must match")
    if Hv != Hk:
        raise ValueError(f"batch/heads differ: {shapes}; k and v must have the same number of heads Hk")
    if Hk and H % Hk:
        raise ValueError(f"heads: q has H={H} heads, k and v have Hk={Hk}; Hk must divide H (Hk = H, or "
                         "grouped-query attention: query head h uses key/value head h // (H // Hk))")
    if Dk != D or Dv != D:
        raise ValueError(f"head dim differs: q has D={D}, k D={Dk}, v D={Dv}; they must match")
    if Lv != Lk:
        raise ValueError(f"v has Lk={Lv} keys but k has Lk={Lk}; k and v must have the same length")
    if min(B, H, Hk, Lq, Lk, D) == 0:
        raise ValueError(f"empty input: q {tuple(q.shape)}, k {tuple(k.shape)}; every dimension must be >= 1")

    dtypes = {_dtype_name(x) for x in (q, k, v)}
    if len(dtypes) != 1:
        raise TypeError(f"q, k, v have different dtypes ({_dtype_name(q)}, {_dtype_name(k)}, {_dtype_name(v)}); "
                        "use one dtype")
    devices = {_device_of(x) for x in (q, k, v)}
    if len(devices) != 1:
        raise ValueError(f"q, k, v are on different devices {sorted(devices)}; put them on one device")
    device = devices.pop()

    if key_padding_mask is not None:
        if not (is_torch(key_padding_mask) or isinstance(key_padding_mask, np.ndarray)):
            raise TypeError(f"key_padding_mask: expected a bool array of shape (B, Lk)=({B}, {Lk}), got {type(key_padding_mask).__name__}")
        if tuple(key_padding_mask.shape) != (B, Lk):
            raise ValueError(f"key_padding_mask: expected shape (B, Lk)=({B}, {Lk}), got {tuple(key_padding_mask.shape)}")
        if _dtype_name(key_padding_mask) != "bool":
            raise TypeError(f"key_padding_mask: expected dtype bool (True = key takes part), got {_dtype_name(key_padding_mask)}")
        mask_device = _device_of(key_padding_mask)
        if mask_device not in ("cpu", device):
            raise ValueError(f"key_padding_mask: is on {mask_device} but q, k, v are on {device}; "
                             "put it on the CPU or on their device")
    _check_causal(causal)
    _check_scale(scale)
    return Inputs(B, H, Hk, Lq, Lk, D, dtypes.pop(), device)


def validate(q, k, v, *, stage: str = "reference", causal=False, key_padding_mask=None, scale=None):
    """Raise a clear ValueError/TypeError/MemoryError for anything `stage` cannot run. Returns the Stage.

    First the stage name, then the rules of every entry point (:func:`validate_inputs`), then the stage's
    own: where it runs (a GPU-only stage says so before anything else: the right dtype would not help on
    the CPU), its dtypes and head dims, and the memory and simulator time the sizes need.
    """
    if not isinstance(stage, str):
        raise TypeError(f"stage: expected a stage name (str), one of {', '.join(available_stages())}; "
                        f"got {stage!r} of type {type(stage).__name__}")
    spec = get_stage(stage)  # ValueError naming the stages there are
    inputs = validate_inputs(q, k, v, causal=causal, key_padding_mask=key_padding_mask, scale=scale)
    B, H, Lq, Lk, D, device = inputs.B, inputs.H, inputs.Lq, inputs.Lk, inputs.D, inputs.device

    if spec.needs_gpu and not device.startswith("cuda"):
        raise ValueError(
            f"stage {stage!r} runs only on a CUDA GPU and takes CUDA torch tensors; got inputs on {device}"
            + ("" if BACKEND.is_gpu else " (and this machine has no CUDA GPU)"))
    if inputs.dtype not in spec.dtypes:
        raise TypeError(f"q, k, v: stage {stage!r} does not take dtype {inputs.dtype}; it accepts {', '.join(spec.dtypes)}")
    if spec.head_dims is not None and D not in spec.head_dims:
        raise ValueError(f"stage {stage!r} does not support head dim D={D}; it supports D in {list(spec.head_dims)}")
    if device.startswith("cuda") and not BACKEND.is_gpu:
        raise ValueError(f"inputs are on {device}, but wb_kernels runs on the CUDA simulator; pass CPU data")

    if spec.workspace_bytes is not None:
        need = spec.workspace_bytes(B, H, Lq, Lk, D)
        on_cuda = BACKEND.is_gpu and spec.name != "reference"
        free = _free_bytes(on_cuda) if _may_not_fit(need, on_cuda) else need
        if need > free:
            flash = [name for name, st in available_stages().items() if st.linear_memory]
            raise MemoryError(
                f"stage {stage!r} needs {_gib(need)} of {'GPU' if on_cuda else 'host'} memory for the "
                f"Lq x Lk = {Lq} x {Lk} score and probability matrices (B*H = {B * H}), but only {_gib(free)} "
                f"is free. The flash stages keep memory O(L): try stage={'/'.join(flash) or 'flash'}.")
    if BACKEND.is_simulator and spec.simulator_seconds is not None:
        seconds = spec.simulator_seconds(B, H, Lq, Lk, D)
        if seconds > SIMULATOR_MAX_SECONDS:
            raise ValueError(
                f"stage {stage!r} at B={B} H={H} Lq={Lq} Lk={Lk} D={D} would take about {seconds:.0f} s on the "
                f"CUDA simulator (limit {SIMULATOR_MAX_SECONDS:.0f} s, set WB_SIM_MAX_SECONDS to change it); "
                "use smaller sizes here, or run on a GPU.")
    return spec


def _contiguous(x):
    """`x` as a C-contiguous array of the same kind, copied only if it is not one already.

    Kernels index raw memory, and ``torch.from_numpy`` refuses negative strides; torch tensors are
    also detached, because the stages compute forward only (no autograd).
    """
    if is_torch(x):
        return x.detach().contiguous()
    return np.ascontiguousarray(x)


def _may_hold_non_finite(q, k) -> bool:
    """Whether q or k may hold a NaN or an Inf: one pass over each and one number back.

    A sum is NaN or Inf when any term is (+Inf + -Inf gives NaN); it can also overflow for huge finite
    inputs, which only sends those to the exact (slower) path of propagate_non_finite, where nothing
    is changed.
    """
    if is_torch(q):
        import torch

        acc = torch.float64 if q.dtype == torch.float64 else torch.float32
        sums = torch.stack([q.sum(dtype=acc), k.sum(dtype=acc)])
        return not bool(torch.isfinite(sums).all())
    with np.errstate(over="ignore", invalid="ignore"):
        return not (np.isfinite(q.sum(dtype=np.float64)) and np.isfinite(k.sum(dtype=np.float64)))


def _numpy64(x) -> np.ndarray:
    if is_torch(x):
        return x.detach().cpu().double().numpy()
    return np.asarray(x, dtype=np.float64)


def propagate_non_finite(out, lse, q, k, *, causal=False, key_padding_mask=None, scale=None):
    """Make NaN/Inf in q and k reach `out` and `lse` as they do in SDPA (see :func:`attention`).

    A row gets NaN (all of its output and its LSE) when it sees at least one key and either its query
    holds a NaN/Inf, or its score with some key it attends is NaN or +Inf (a NaN in that key, or an
    Inf that meets a query value of the same sign or a zero). Scores that come out -Inf leave the key
    out of the row, as in SDPA; the kernels handle those themselves. Values (v) need nothing here:
    ``P @ V`` carries their NaN/Inf in every kernel. Returns ``(out, lse)``, changed in place where
    possible. Costs O(B*H*Lq*D) plus O(Lq*D) per key that holds a NaN/Inf.
    """
    qn, kn = _numpy64(q), _numpy64(k)
    B, H, Lq, D = qn.shape
    Hk, Lk = kn.shape[1], kn.shape[2]
    group = H // Hk  # query heads per key head (GQA)
    scale = 1.0 / math.sqrt(D) if scale is None else float(scale)
    allowed = attention_mask(Lq, Lk, causal, key_padding_mask, batch=B)[:, 0]  # (B, Lq, Lk)
    poisoned = ~np.isfinite(qn).all(-1)  # (B, H, Lq)
    bad_keys = ~np.isfinite(kn).all(-1)  # (B, Hk, Lk)
    chunk = 256  # keys per step: bounds the (group, Lq, chunk) scores held at once
    with np.errstate(invalid="ignore", over="ignore"):
        for b, hk in zip(*np.nonzero(bad_keys.any(-1))):
            heads = slice(hk * group, (hk + 1) * group)  # the query heads that read key head hk
            keys = np.flatnonzero(bad_keys[b, hk])
            for first in range(0, len(keys), chunk):
                some = keys[first:first + chunk]
                scores = scale * (qn[b, heads] @ kn[b, hk, some].T)  # (group, Lq, len(some)), IEEE: inf*0 = NaN
                hot = (np.isnan(scores) | (scores == np.inf)) & allowed[b][:, some]
                poisoned[b, heads] |= hot.any(-1)
    poisoned &= allowed.any(-1)[:, None, :]  # a row that sees no key stays 0, LSE -inf
    if not poisoned.any():
        return out, lse
    if is_torch(out):
        import torch

        rows = torch.from_numpy(poisoned).to(out.device)
        return (out.masked_fill(rows[..., None], float("nan")),
                lse.masked_fill(rows, float("nan")) if lse is not None else None)
    out = np.array(out, copy=True)
    out[poisoned] = np.nan
    if lse is not None:
        lse = np.array(lse, copy=True)
        lse[poisoned] = np.nan
    return out, lse


def attention(q, k, v, *, stage: str = "reference", causal=False, key_padding_mask=None,
              scale: float | None = None, return_lse: bool = False, check_finite: bool = True):
    """Exact attention softmax(scale * q k^T [masked]) v with the chosen stage's kernel.

    Inputs
        q: (B, H, Lq, D); k, v: (B, Hk, Lk, D) where Hk = H, or Hk divides H: grouped-query attention
        (GQA; MQA when Hk = 1), as SDPA's ``enable_gqa=True``: query head h uses key/value head
        h // (H // Hk). The kernels read that head in place; nothing is copied. All NumPy arrays or all
        torch tensors (CPU, or CUDA on a GPU), of one dtype the stage accepts (``wb.get_stage(name).dtypes``)
        and a head dim D it supports. Non-contiguous inputs (slices, transposes) are copied once; torch
        tensors are used detached (forward only, no autograd).
    causal
        ``False`` (no mask), ``True`` or ``"top_left"``, or ``"bottom_right"``: query i attends keys
        j <= i + offset, where the offset is 0 at the top left and Lk - Lq at the bottom right
        (:func:`wb_kernels.reference.causal_offset`). The two differ only when Lq != Lk::

                    Lq=2, Lk=4                           Lq=4, Lk=2
                    top_left   bottom_right              top_left   bottom_right
            key     0 1 2 3    0 1 2 3           key     0 1        0 1
            query 0 x . . .    x x x .           query 0 x .        . .
            query 1 x x . .    x x x x           query 1 x x        . .
                                                 query 2 x x        x .
                                                 query 3 x x        x x

        *top-left* is SDPA's ``is_causal=True``: row i sees keys 0..i whatever Lk is. *bottom-right* is
        flash-attn's, what decoding with a KV cache and chunked prefill need: the Lq queries are the last
        Lq positions of a sequence whose first Lk - Lq keys are already cached, so the last query sees
        every key. With Lq > Lk its first Lq - Lk rows see no key (zeros, LSE -inf, as below).
        ``wb_kernels.plots.causal_alignment_figure(Lq, Lk)`` draws both. Accepts True/False, NumPy
        bools and 0/1 for the flag; another string is refused with the accepted values.
    key_padding_mask
        bool (B, Lk), True = the key takes part (SDPA's boolean ``attn_mask`` convention), on the CPU
        or the inputs' device.
    scale
        a finite number; defaults to 1/sqrt(D).

    Returns the output (B, H, Lq, D) in the caller's kind (NumPy, or torch on q's device), and with
    ``return_lse=True`` also the per-row log-sum-exp (B, H, Lq) (float32; float64 for the reference).

    Edge cases, the same for every stage:
        - A row that sees no key (every key masked) gets zeros and LSE -inf, never NaN.
        - Large logits (|scale * q.k| up to 1e4 and beyond) do not overflow: the row maximum is
          subtracted before exp.
        - NaN/Inf in the inputs propagate as in PyTorch's SDPA (checked against its math backend):
          a NaN or Inf in query row i makes output row i NaN; a NaN in key row j makes every row that
          attends key j NaN; an Inf in key row j makes a row's score +Inf, -Inf or NaN depending on the
          query's signs: +Inf and NaN make the row NaN, -Inf leaves key j out of that row; a NaN/Inf
          in v[j, d] reaches column d of every row that attends key j. LSE is NaN (or +Inf) in rows
          that are NaN. Exceptions: a row that sees no key stays 0 even if its query is NaN; and
          whether a NaN/Inf in a *masked* key's k or v reaches a row is not specified (SDPA's math
          backend lets it through, as it adds the mask as a -Inf bias; the stages here never use a
          masked key's k, but may multiply its v by 0, and 0 * NaN = NaN).
          The kernels themselves may assume finite inputs (the flash kernels are compiled with fast
          math), so this function keeps the promise: it looks for NaN/Inf in q and k first (one pass
          over each) and, when there are any, marks the rows SDPA would make NaN
          (:func:`propagate_non_finite`). ``check_finite=False`` skips that pass; the result for
          non-finite inputs is then whatever the kernel makes of them. A stage whose kernel keeps the
          promise itself (``Stage.non_finite_in_kernel``: the mma rung) gets no pass: that pass reads a
          number back from the GPU, which stalls the host on every call.

    Raises, before launching anything: TypeError (wrong kind or dtype of an argument, unknown kind of
    stage name), ValueError (shapes that disagree, Hk not dividing H, an unknown causal alignment,
    unsupported head dim, an unknown stage, CPU inputs for a GPU-only stage, a size the simulator would
    take minutes for), MemoryError (a stage's Lq x Lk
    buffers would not fit: the message says how much they need and suggests the flash stages).
    """
    key = cuda_signature(q, k, v, key_padding_mask)
    if key is not None and isinstance(scale, (float, int, type(None))) and isinstance(causal, (bool, str)):
        key = (key, stage, causal, scale)  # CUDA inputs: the checks read shapes, dtypes and devices only
    else:
        key = None
    spec = _VALIDATED.get(key)
    if spec is None:
        spec = _VALIDATED.remember(key, validate(q, k, v, stage=stage, causal=causal,
                                                 key_padding_mask=key_padding_mask, scale=scale))
    causal, scale = _check_causal(causal), _check_scale(scale)
    caller_q = q
    q, k, v = (_contiguous(x) for x in (q, k, v))
    if key_padding_mask is not None:
        key_padding_mask = _contiguous(key_padding_mask)
    # a stage whose kernel handles NaN/Inf itself needs no pass here (that pass waits for the GPU: see Stage)
    non_finite = check_finite and not spec.non_finite_in_kernel and _may_hold_non_finite(q, k)
    quiet = non_finite or BACKEND.is_simulator
    # (no warnings filter on a GPU's ordinary call: saving and restoring the filters costs microseconds per call)
    with warnings.catch_warnings() if quiet else contextlib.nullcontext():
        if quiet:
            # NumPy arithmetic (the reference, and every kernel on the simulator) warns about NaN/Inf that
            # are the right answer here; a GPU computes the same silently
            warnings.simplefilter("ignore", RuntimeWarning)
        out, lse = spec.forward(q, k, v, causal=causal, key_padding_mask=key_padding_mask, scale=scale)
    out, lse = like_input(out, caller_q), like_input(lse, caller_q)
    if non_finite:
        out, lse = propagate_non_finite(out, lse, q, k, causal=causal, key_padding_mask=key_padding_mask,
                                        scale=scale)
    if return_lse:
        return out, lse
    return out
