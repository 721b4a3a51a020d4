"""The one public entry point, ``attention(q, k, v, stage=..., causal=...)`` (all lessons, tests, bench).

Everything is validated here, before any kernel is launched or any buffer allocated, and each
error names the argument, the value it got and what is accepted.
"""

from __future__ import annotations

import math
import os

import numpy as np

from .backend import BACKEND
from .device import is_torch, like_input
from .stages import available_stages, get_stage

__all__ = ["attention", "validate", "SIMULATOR_MAX_SECONDS"]

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


def _gib(n: float) -> str:
    return f"{n / 2**30:.2f} GiB"


def validate(q, k, v, *, stage: str = "reference", causal: bool = False, key_padding_mask=None,
             scale=None):
    """Raise a clear ValueError/TypeError/MemoryError for anything `stage` cannot run. Returns the Stage."""
    spec = get_stage(stage) if isinstance(stage, str) else None
    if spec is None:
        raise TypeError(f"stage={stage!r}: must be a stage name, one of {', '.join(available_stages())}")

    for name, x in (("q", q), ("k", k), ("v", v)):
        if not (is_torch(x) or isinstance(x, np.ndarray)):
            raise TypeError(f"{name}: expected a NumPy array or torch tensor, got {type(x).__name__}")
        if x.ndim != 4:
            raise ValueError(f"{name}: expected rank 4 (B, H, L, D), got rank {x.ndim} with shape {tuple(x.shape)}")
    (B, H, Lq, D), (Bk, Hk, Lk, Dk), (Bv, Hv, Lv, Dv) = q.shape, k.shape, v.shape
    if (Bk, Hk) != (B, H) or (Bv, Hv) != (B, H):
        raise ValueError(f"batch/heads differ: q has (B, H)=({B}, {H}), k ({Bk}, {Hk}), v ({Bv}, {Hv}); they must match")
    if Dk != D or Dv != D:
        raise ValueError(f"head dim differs: q has D={D}, k D={Dk}, v D={Dv}; they must match")
    if Lv != Lk:
        raise ValueError(f"v has Lk={Lv} keys but k has Lk={Lk}; k and v must have the same length")
    if min(B, H, Lq, Lk, D) == 0:
        raise ValueError(f"empty input: q {tuple(q.shape)}, k {tuple(k.shape)}; every dimension must be >= 1")

    dtypes = {_dtype_name(x) for x in (q, k, v)}
    if len(dtypes) != 1:
        raise TypeError(f"q, k, v have different dtypes {sorted(dtypes)}; use one dtype")
    dtype = dtypes.pop()
    if dtype not in spec.dtypes:
        raise TypeError(f"stage {stage!r} does not take dtype {dtype}; it accepts {', '.join(spec.dtypes)}")
    if spec.head_dims is not None and D not in spec.head_dims:
        raise ValueError(f"stage {stage!r} does not support head dim D={D}; it supports D in {list(spec.head_dims)}")

    devices = {_device_of(x) for x in (q, k, v)}
    if len(devices) != 1:
        raise ValueError(f"q, k, v are on different devices {sorted(devices)}; put them on one device")
    device = devices.pop()
    if spec.needs_gpu and not device.startswith("cuda"):
        raise ValueError(
            f"stage {stage!r} runs only on a CUDA GPU and takes CUDA torch tensors; got inputs on {device}"
            + ("" if BACKEND.is_gpu else " (and this machine has no CUDA GPU)"))
    if device.startswith("cuda") and not BACKEND.is_gpu:
        raise ValueError(f"inputs are on {device}, but wb_kernels runs on the CUDA simulator; pass CPU data")

    if key_padding_mask is not None:
        if not (is_torch(key_padding_mask) or isinstance(key_padding_mask, np.ndarray)):
            raise TypeError(f"key_padding_mask: expected a bool array of shape (B, Lk)=({B}, {Lk}), got {type(key_padding_mask).__name__}")
        if tuple(key_padding_mask.shape) != (B, Lk):
            raise ValueError(f"key_padding_mask: expected shape (B, Lk)=({B}, {Lk}), got {tuple(key_padding_mask.shape)}")
        if _dtype_name(key_padding_mask) != "bool":
            raise TypeError(f"key_padding_mask: expected dtype bool (True = key takes part), got {_dtype_name(key_padding_mask)}")
    if not isinstance(causal, (bool, np.bool_)):
        raise TypeError(f"causal: expected True or False, got {causal!r}")
    if scale is not None and not (isinstance(scale, (int, float)) and math.isfinite(scale)):
        raise ValueError(f"scale: expected a finite number or None (= 1/sqrt(D)), got {scale!r}")

    if spec.workspace_bytes is not None:
        need = spec.workspace_bytes(B, H, Lq, Lk, D)
        on_cuda = BACKEND.is_gpu and spec.name != "reference"
        free = _free_bytes(on_cuda)
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


def attention(q, k, v, *, stage: str = "reference", causal: bool = False, key_padding_mask=None,
              scale: float | None = None, return_lse: bool = False):
    """Exact attention softmax(scale * q k^T [masked]) v with the chosen stage's kernel.

    q: (B, H, Lq, D); k, v: (B, H, Lk, D), NumPy arrays or torch tensors (CPU, or CUDA on a GPU).
    causal: query i attends keys j <= i (top-left alignment, as SDPA's is_causal).
    key_padding_mask: bool (B, Lk), True = the key takes part.
    scale: defaults to 1/sqrt(D).
    Returns the output (B, H, Lq, D) in the caller's kind (NumPy or torch on q's device), and with
    ``return_lse=True`` also the per-row log-sum-exp (B, H, Lq) in float32 (float64 for the reference).
    Rows that see no key get zeros (and LSE -inf).
    """
    spec = validate(q, k, v, stage=stage, causal=causal, key_padding_mask=key_padding_mask, scale=scale)
    out, lse = spec.forward(q, k, v, causal=bool(causal), key_padding_mask=key_padding_mask, scale=scale)
    out = like_input(out, q)
    if return_lse:
        return out, like_input(lse, q)
    return out
