"""Stage 05: FlashAttention-2 on tensor cores, CUDA C++ with nvcuda::wmma (lesson 05_wmma).

The kernel is ``flash_wmma.cu`` in this folder, built by ``build.py`` (on the shared :mod:`wb_kernels.cuda_build`) with torch's
``load_inline`` the first time the stage runs (cached afterwards). It takes CUDA torch tensors in
float16 or bfloat16 with head dim 64 or 128 (K and V may have fewer heads: grouped-query attention, read in
place; causal top-left or bottom-right) and needs an sm_80 or newer GPU; the benchmark and
this folder's tune.py use it through ``wb_kernels.attention(..., stage="wmma")`` like every other stage.
"""

from __future__ import annotations

from . import build as wmma_build
from .. import Stage
from ...reference import causal_offset

__all__ = ["STAGE", "forward", "DEFAULT_VARIANT", "variant_for"]

# (num_warps, q_in_registers, row_frags) per head dim, chosen by tune.py on the GPU (NOTES.md has
# the measurements).
DEFAULT_VARIANT = {64: (4, True, 2), 128: (4, False, 1)}


def variant_for(head_dim: int):
    return DEFAULT_VARIANT[head_dim]


def forward(q, k, v, *, causal=False, key_padding_mask=None, scale=None, module=None, variant=None):
    """Run the WMMA kernel on CUDA tensors; returns ``(out, lse)`` as CUDA tensors.

    `module`: an extension from :func:`wb_kernels.stages.wmma.build.build` (a lesson passes the one it
    built from its own edited source); by default the package's kernel, built once and cached.
    `variant`: ``(num_warps, q_in_registers, row_frags)`` (see ``build.VARIANTS``), by default the
    tuned one for the head dim.
    """
    import torch

    if module is None:
        module = wmma_build.extension()
    D = q.shape[-1]
    num_warps, q_in_registers, row_frags = variant if variant is not None else variant_for(D)
    scale = float(D) ** -0.5 if scale is None else float(scale)
    offset = causal_offset(causal, q.shape[2], k.shape[2])  # query i sees keys j <= i + offset; None: not causal
    if key_padding_mask is None:
        keep = torch.empty(0, dtype=torch.uint8, device=q.device)
    else:
        keep = torch.as_tensor(key_padding_mask).to(device=q.device, dtype=torch.uint8).contiguous()
    out, lse = module.flash_wmma_forward(q.contiguous(), k.contiguous(), v.contiguous(), keep, offset is not None,
                                         offset or 0, scale, int(num_warps), bool(q_in_registers), int(row_frags))
    return out, lse


STAGE = Stage(
    name="wmma",
    lesson="05_wmma",
    summary="FlashAttention-2 in CUDA C++ on tensor cores (nvcuda::wmma), fp16/bf16, D 64 or 128, O(L) memory",
    forward=forward,
    dtypes=("float16", "bfloat16"),
    head_dims=(64, 128),
    needs_gpu=True,
    workspace_bytes=lambda B, H, Lq, Lk, D: 2 * B * H * Lq * D + 4 * B * H * Lq,  # out + lse
    order=5,
    linear_memory=True,
)
