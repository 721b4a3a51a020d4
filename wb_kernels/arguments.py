"""The rules for each argument, whatever the stage: q, k, v (kinds, ranks, shapes, dtypes, devices), the key padding
mask, ``causal`` and ``scale``, and the canonical form of each value (all lessons, through every entry point:
``wb.attention``, ``wb.attention_backward``, ``wb.reference``, ``wb.check``, ``wb.decode``).

The floor under the reference and the rungs, which check their arguments with it: it imports nothing of the package
but :mod:`wb_kernels.device`. What depends on a stage (its dtypes, head dims, memory, the simulator's time) and a whole
call as one object are :mod:`wb_kernels.validation`'s, one floor up. Each error names the argument, the value it got
and what is accepted (``tests/test_api_errors.py``).
"""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass
from typing import Optional

import numpy as np

from .device import is_torch

__all__ = ["validate_inputs", "validate_gradient", "require_array", "Inputs", "CAUSAL_ALIGNMENTS", "canonical_causal",
           "canonical_scale", "as_flag", "dtype_name", "device_of", "kind_of"]

# The values of ``causal`` that name an alignment, and with None (no mask) its canonical forms; True means "top_left"
# (wb_kernels.reference.causal_offset gives each its diagonal).
CAUSAL_ALIGNMENTS = ("top_left", "bottom_right")


def dtype_name(x) -> str:
    return str(x.dtype).replace("torch.", "")


def device_of(x) -> str:
    return str(x.device) if is_torch(x) else "cpu"


def kind_of(x) -> str:
    return "torch tensor" if is_torch(x) else "NumPy array"


def as_flag(name: str, value, expected: str = "True or False (or 0/1)") -> bool:
    """True/False from a bool-like value; refuses strings ("False" is truthy) and other numbers."""
    if isinstance(value, (bool, np.bool_)):
        return bool(value)
    if isinstance(value, (int, np.integer)) and value in (0, 1):
        return bool(value)
    if (isinstance(value, np.ndarray) or is_torch(value)) and tuple(value.shape) == () \
            and dtype_name(value) == "bool":
        return bool(value.item())
    raise TypeError(f"{name}: expected {expected}, got {value!r} of type {type(value).__name__}")


def canonical_causal(causal) -> Optional[str]:
    """`causal` in its one canonical form, which the call keeps from here to the kernel and back (the stages, the
    registered op's schema ``str? causal``, the saved autograd context): None (no mask), "top_left" or
    "bottom_right". True and bool-likes mean "top_left"; False, 0 and None mean no mask.

    An unknown alignment name is a ValueError that lists the accepted values (the message
    :func:`wb_kernels.reference.causal_offset` gives); any other type a TypeError, as for a flag.
    """
    if causal is None or causal is False:
        return None
    if causal is True:
        return "top_left"
    if isinstance(causal, str):
        if causal not in CAUSAL_ALIGNMENTS:
            raise ValueError(f"causal: expected True, False or one of {', '.join(map(repr, CAUSAL_ALIGNMENTS))} "
                             f"(True = 'top_left'), got {causal!r}")
        return causal
    alignments = " or ".join(map(repr, CAUSAL_ALIGNMENTS))
    return "top_left" if as_flag("causal", causal, f"True or False (or 0/1, None), or {alignments}") else None


def canonical_scale(scale) -> Optional[float]:
    """`scale` in its canonical form: a finite float, or None (= 1/sqrt(D), which each kernel computes)."""
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
    if dtypes is not None and dtype_name(x) not in dtypes:
        raise TypeError(f"{name}: expected a dtype among {', '.join(dtypes)}, got {dtype_name(x)}")


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
    kinds = {name: kind_of(x) for name, x in (("q", q), ("k", k), ("v", v))}
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

    dtypes = {dtype_name(x) for x in (q, k, v)}
    if len(dtypes) != 1:
        raise TypeError(f"q, k, v have different dtypes ({dtype_name(q)}, {dtype_name(k)}, {dtype_name(v)}); "
                        "use one dtype")
    devices = {device_of(x) for x in (q, k, v)}
    if len(devices) != 1:
        raise ValueError(f"q, k, v are on different devices {sorted(devices)}; put them on one device")
    device = devices.pop()

    if key_padding_mask is not None:
        if not (is_torch(key_padding_mask) or isinstance(key_padding_mask, np.ndarray)):
            raise TypeError(f"key_padding_mask: expected a bool array of shape (B, Lk)=({B}, {Lk}), got {type(key_padding_mask).__name__}")
        if tuple(key_padding_mask.shape) != (B, Lk):
            raise ValueError(f"key_padding_mask: expected shape (B, Lk)=({B}, {Lk}), got {tuple(key_padding_mask.shape)}")
        if dtype_name(key_padding_mask) != "bool":
            raise TypeError(f"key_padding_mask: expected dtype bool (True = key takes part), got {dtype_name(key_padding_mask)}")
        mask_device = device_of(key_padding_mask)
        if mask_device not in ("cpu", device):
            raise ValueError(f"key_padding_mask: is on {mask_device} but q, k, v are on {device}; "
                             "put it on the CPU or on their device")
    canonical_causal(causal)
    canonical_scale(scale)
    return Inputs(B, H, Hk, Lq, Lk, D, dtypes.pop(), device)


def validate_gradient(dout, q, inputs: Inputs) -> None:
    """Raise a clear error unless `dout` (the loss's gradient with respect to the output) could be one for `q`:
    the same kind, shape (B, H, Lq, D), dtype and device (what :func:`wb_kernels.attention_backward` needs)."""
    require_array("dout", dout)
    if kind_of(dout) != kind_of(q):
        raise TypeError(f"dout: expected a {kind_of(q)} as q is, got a {kind_of(dout)}")
    expected = (inputs.B, inputs.H, inputs.Lq, inputs.D)
    if tuple(dout.shape) != expected:
        raise ValueError(f"dout: expected the output's shape (B, H, Lq, D)={expected}, got {tuple(dout.shape)}")
    if dtype_name(dout) != inputs.dtype:
        raise TypeError(f"dout: expected dtype {inputs.dtype} as q, k, v have, got {dtype_name(dout)}")
    if device_of(dout) != inputs.device:
        raise ValueError(f"dout: is on {device_of(dout)} but q, k, v are on {inputs.device}; put it on their device")
