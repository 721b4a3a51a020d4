"""Stage 06: FlashAttention-2 by hand on tensor cores, PTX mma.sync in CUDA C++ (lesson 06_mma).

The kernel is ``flash_mma.cu`` in this folder, built by ``build.py`` with torch's ``load_inline`` the first time the
stage runs (cached afterwards). It takes CUDA torch tensors in float16 or bfloat16 with head dim 64 or 128 (K and V may
have fewer heads: grouped-query attention, read in place; causal top-left or bottom-right) and needs an sm_80 or newer
GPU; the benchmark and ``tune.py`` use it through ``wb_kernels.attention(..., stage="mma")``.
"""

from __future__ import annotations

from . import build as mma_build
from .. import Stage
from ...reference import causal_offset, positive_scale

__all__ = ["STAGE", "forward", "DEFAULT_VARIANT", "variant_for"]

# The launch variant per head dim, chosen by tune.py on the H100 (results/mma/tune_h100.json, NOTES.md): at both head
# dims 4 warps of 32 query rows each, Q re-read from shared memory, as FlashAttention-2 does; 128 keys per tile at
# D = 64, 64 at D = 128.
DEFAULT_VARIANT = {64: mma_build.Variant(64, 4, 2, 128, False), 128: mma_build.Variant(128, 4, 2, 64, False)}


def variant_for(head_dim: int) -> "mma_build.Variant":
    return DEFAULT_VARIANT[head_dim]


def forward(q, k, v, *, causal=False, key_padding_mask=None, scale=None, module=None, variant=None):
    """Run the mma.sync kernel on CUDA tensors; returns ``(out, lse)`` as CUDA tensors.

    `module`: an extension from :func:`wb_kernels.stages.mma.build.build` (a lesson passes the one it built from
    its own edited source); by default the package's kernel, built once and cached.
    `variant`: a :class:`~wb_kernels.stages.mma.build.Variant` (see ``build.VARIANTS``), by default the tuned one.
    """
    import torch

    if module is None:
        module = mma_build.extension()
    D = q.shape[-1]
    variant = variant if variant is not None else variant_for(D)
    q, scale = positive_scale(q, scale)  # the kernel tracks the maximum of the raw scores: it needs scale > 0
    offset = causal_offset(causal, q.shape[2], k.shape[2])  # query i sees keys j <= i + offset; None: not causal
    if key_padding_mask is None:
        keep = _no_mask(q.device)
    else:
        keep = torch.as_tensor(key_padding_mask).to(device=q.device, dtype=torch.uint8).contiguous()
    out, lse = module.flash_mma_forward(q.contiguous(), k.contiguous(), v.contiguous(), keep, offset is not None,
                                        offset or 0, scale, variant.num_warps, variant.row_tiles, variant.block_n,
                                        variant.q_in_registers)
    return out, lse


_NO_MASKS: dict = {}


def _no_mask(device):
    """The empty mask tensor that says "no key padding", made once per device rather than on every call."""
    mask = _NO_MASKS.get(device)
    if mask is None:
        import torch

        mask = _NO_MASKS[device] = torch.empty(0, dtype=torch.uint8, device=device)
    return mask


STAGE = Stage(
    name="mma",
    lesson="06_mma",
    summary="FlashAttention-2 by hand on tensor cores (PTX mma.sync, ldmatrix, swizzle), fp16/bf16, D 64 or 128",
    forward=forward,
    dtypes=("float16", "bfloat16"),
    head_dims=(64, 128),
    needs_gpu=True,
    non_finite_in_kernel=True,  # flash_mma.cu, region non_finite_queries: no pass over q and k on the host
    workspace_bytes=lambda B, H, Lq, Lk, D: 2 * B * H * Lq * D + 4 * B * H * Lq,  # out + lse
    order=6,
    linear_memory=True,
)
