"""Validation shared by every entry point: ``validate`` (a stage and its inputs), ``validate_inputs`` (the rules
every entry point shares), ``require_array``, ``Inputs`` and the ``_check_*`` helpers (all lessons, through
``wb.attention``, ``wb.attention_backward``, ``wb.check``, ``wb.reference`` and ``wb.decode``).

Each error names the argument, the value it got and what is accepted (``tests/test_api_errors.py``). This module
imports neither the reference nor the API, so that the imports run one way: validation <- reference <- api.
The stage registry is read through its module (``stages.get_stage``), so that a test that swaps the registry
swaps it here too.
"""

from __future__ import annotations

import functools
import math
import numbers
import os
from dataclasses import dataclass

import numpy as np

from . import stages as _stages
from .backend import BACKEND
from .device import is_torch

__all__ = ["validate", "validate_inputs", "validate_gradient", "require_array", "Inputs", "CAUSAL_ALIGNMENTS",
           "SIMULATOR_MAX_SECONDS", "check_simulator_time"]

# The values of ``causal`` that name an alignment; True means "top_left" (wb_kernels.reference.causal_offset gives
# each its diagonal).
CAUSAL_ALIGNMENTS = ("top_left", "bottom_right")
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

    An unknown alignment name is a ValueError that lists the accepted values (the message
    :func:`wb_kernels.reference.causal_offset` gives); any other type a TypeError, as for a flag.
    """
    if isinstance(causal, str):
        if causal not in CAUSAL_ALIGNMENTS:
            raise ValueError(f"causal: expected True, False or one of {', '.join(map(repr, CAUSAL_ALIGNMENTS))} "
                             f"(True = 'top_left'), got {causal!r}")
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
        raise TypeError(f"stage: expected a stage name (str), one of {', '.join(_stages.available_stages())}; "
                        f"got {stage!r} of type {type(stage).__name__}")
    spec = _stages.get_stage(stage)  # ValueError naming the stages there are
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
            flash = [name for name, st in _stages.available_stages().items() if st.linear_memory]
            raise MemoryError(
                f"stage {stage!r} needs {_gib(need)} of {'GPU' if on_cuda else 'host'} memory for the "
                f"Lq x Lk = {Lq} x {Lk} score and probability matrices (B*H = {B * H}), but only {_gib(free)} "
                f"is free. The flash stages keep memory O(L): try stage={'/'.join(flash) or 'flash'}.")
    if BACKEND.is_simulator and spec.simulator_seconds is not None:
        check_simulator_time(stage, spec.simulator_seconds(B, H, Lq, Lk, D), f"B={B} H={H} Lq={Lq} Lk={Lk} D={D}")
    return spec


def check_simulator_time(stage: str, seconds: float, sizes: str) -> None:
    """Refuse a problem the CUDA simulator would need more than ``SIMULATOR_MAX_SECONDS`` for (wb.attention and
    wb.decode alike); `sizes` names the sizes in the message."""
    if seconds > SIMULATOR_MAX_SECONDS:
        raise ValueError(
            f"stage {stage!r} at {sizes} would take about {seconds:.0f} s on the "
            f"CUDA simulator (limit {SIMULATOR_MAX_SECONDS:.0f} s, set WB_SIM_MAX_SECONDS to change it); "
            "use smaller sizes here, or run on a GPU.")




def validate_gradient(dout, q, inputs: Inputs) -> None:
    """Raise a clear error unless `dout` (the loss's gradient with respect to the output) could be one for `q`:
    the same kind, shape (B, H, Lq, D), dtype and device (what :func:`wb_kernels.attention_backward` needs)."""
    require_array("dout", dout)
    if _kind(dout) != _kind(q):
        raise TypeError(f"dout: expected a {_kind(q)} as q is, got a {_kind(dout)}")
    expected = (inputs.B, inputs.H, inputs.Lq, inputs.D)
    if tuple(dout.shape) != expected:
        raise ValueError(f"dout: expected the output's shape (B, H, Lq, D)={expected}, got {tuple(dout.shape)}")
    if _dtype_name(dout) != inputs.dtype:
        raise TypeError(f"dout: expected dtype {inputs.dtype} as q, k, v have, got {_dtype_name(dout)}")
    if _device_of(dout) != inputs.device:
        raise ValueError(f"dout: is on {_device_of(dout)} but q, k, v are on {inputs.device}; put it on their device")
