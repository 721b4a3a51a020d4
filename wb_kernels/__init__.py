"""WaveBoost: exact attention, step by step, from a CPU reference to tensor cores.

    import wb_kernels as wb
    q, k, v = wb.random_qkv(B=1, H=2, Lq=64, D=32)
    out = wb.attention(q, k, v, stage="reference", causal=True)
    wb.check("reference", out, q, k, v, causal=True)

The backend (real GPU or numba's CUDA simulator) is chosen first, before numba can be imported
by anything else in the package; see :mod:`wb_kernels.backend`.
"""

from .backend import BACKEND, banner, device_name  # noqa: I001  (must come first: sets NUMBA_ENABLE_CUDASIM)
from .api import attention, validate
from .check import CheckFailed, CheckResult, check
from .decoding import decode
from .inputs import random_padding_mask, random_qkv
from .reference import attention_mask, reference, safe_softmax
from .stages import available_stages, get_stage
from .timing import peak_memory, time_call

__all__ = [
    "BACKEND", "banner", "device_name", "attention", "decode", "validate", "check", "CheckFailed", "CheckResult",
    "random_qkv", "random_padding_mask", "reference", "attention_mask", "safe_softmax", "available_stages", "get_stage", "peak_memory",
    "time_call",
]
__version__ = "0.1.0"
