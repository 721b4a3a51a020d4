"""WaveBoost: exact attention, step by step, from a CPU reference to tensor cores.

    import wb_kernels as wb
    q, k, v = wb.random_qkv(B=1, H=2, Lq=64, D=32)
    out = wb.attention(q, k, v, stage="reference", causal=True)
    wb.check("reference", out, q, k, v, causal=True)
    dq, dk, dv = wb.attention_backward(q, k, v, dout, causal=True)  # dout = dL/d(out); or torch autograd
    wb.check_gradients("reference", (dq, dk, dv), q, k, v, dout, causal=True)

The backend (real GPU or numba's CUDA simulator) is chosen first, before numba can be imported
by anything else in the package; see :mod:`wb_kernels.backend`.
"""

from .backend import BACKEND, banner, device_name  # noqa: I001  (must come first: sets NUMBA_ENABLE_CUDASIM)
from . import api
from .api import (attention, attention_backward, attention_varlen, available_backwards, available_stages, decode, decode_problems,
                  get_backward, get_stage, validate)
from .check import CheckFailed, CheckResult, GradientCheckResult, check, check_gradients
from .inputs import random_padding_mask, random_qkv
from .reference import attention_mask, reference, reference_gradients, safe_softmax
from .variants import VARIANT_NAMES, document_ids_from_cu_seqlens
from .timing import peak_memory, time_call
from .validation import seqlen_bucket

__all__ = [
    "BACKEND", "banner", "device_name", "attention", "attention_varlen", "attention_backward", "decode",
    "decode_problems", "seqlen_bucket", "validate", "check",
    "check_gradients", "CheckFailed", "CheckResult", "GradientCheckResult", "random_qkv", "random_padding_mask",
    "reference", "attention_mask", "safe_softmax", "available_stages", "get_stage", "available_backwards",
    "get_backward", "peak_memory", "time_call", "reference_gradients", "VARIANT_NAMES", "document_ids_from_cu_seqlens",
]
__version__ = "0.1.0"

if "torch" in __import__("sys").modules:  # torch came first: define the package's torch operators now (torch_ops.py)
    api.torch_operators()
