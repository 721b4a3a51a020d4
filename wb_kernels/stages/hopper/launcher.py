"""Stage 09: FlashAttention on Hopper by hand, TMA + mbarriers + wgmma in CUDA C++ (lesson 09_hopper).

The kernels are in ``hopper_attention.cuh`` (their torch entry point in ``hopper_host.cu``), built by ``build.py`` for
``sm_90a`` the first time the stage runs (cached afterwards); ``lab.py`` launches them. This module is what
``wb.attention(..., stage="hopper")`` runs: a version of :data:`VERSIONS`, chosen by the head dim
(:data:`DEFAULT_VERSION_BY_HEAD_DIM`), on CUDA torch tensors in float16 or bfloat16 with head dim 64 or 128 (K and V
may have fewer heads: grouped-query attention, read in place; causal top-left or bottom-right). It needs a Hopper GPU
(sm_90: H100, H200); on any other GPU the build refuses, naming ``stage="mma"``, which runs on sm_80 and newer.
"""

from __future__ import annotations

from . import lab
from .. import Stage
from ...reference import positive_scale

__all__ = ["STAGE", "forward", "VERSIONS", "DEFAULT_VERSION", "DEFAULT_VERSION_BY_HEAD_DIM", "launcher_of",
           "GRID_Y_BLOCKS", "backward_gradients"]

# The versions of the kernel that lab.py launches, by name, each ``(q, k, v, *, causal, key_padding_mask, scale,
# module) -> (out, lse)`` taking a positive scale. A version joins the table by existing in lab.py as flash_<name>
# (NOTES.md, "Versions", says what each adds). The stage runs, per head dim, the version that was fastest on an H100
# (hopper-bar benchmark, NOTES.md) among those that passed the whole test matrix there: v4 (a producer, two consumers
# in ping-pong, softmax under P V) at D = 128; at D = 64 v1 (one warpgroup, two blocks an SM) at L = 4096.
# DEFAULT_VERSION is the one for any other head dim.
VERSIONS = {name: getattr(lab, f"flash_{name}") for name in ("v1", "v2", "v3", "v4", "v5")
            if hasattr(lab, f"flash_{name}")}
DEFAULT_VERSION = "v4"
DEFAULT_VERSION_BY_HEAD_DIM = {64: "v1", 128: "v4"}

# v1 numbers its (batch, head) pairs along gridDim.y, which CUDA limits to 65,535 blocks (gridDim.x goes to
# 2**31 - 1; issue 29 moved every other rung's pairs there). Until the kernel does the same, a larger batch runs as
# several launches of whole sequences, at most this many (batch, head) pairs each.
GRID_Y_BLOCKS = 65_535


def forward(q, k, v, *, causal=False, key_padding_mask=None, scale=None, module=None, version=None):
    """Run a version of the Hopper kernel on CUDA tensors; returns ``(out, lse)`` as CUDA tensors.

    `version`: a key of :data:`VERSIONS` (default: :data:`DEFAULT_VERSION_BY_HEAD_DIM` for q's head dim). `module`: an extension from
    :func:`wb_kernels.stages.hopper.build.build` (a lesson passes the one it built from its own edited source); by
    default the package's, built once per process. Any finite scale: the kernels take a positive one, which
    :func:`~wb_kernels.reference.positive_scale` makes of 0 and negative scales, as for the mma rung.
    """
    run = launcher_of(version, q.shape[-1])
    q, scale = positive_scale(q, scale)
    B, H = q.shape[0], q.shape[1]
    per_launch = max(1, GRID_Y_BLOCKS // H)
    if B <= per_launch:
        return run(q, k, v, causal=causal, key_padding_mask=key_padding_mask, scale=scale, module=module)
    import torch

    parts = [run(q[b:b + per_launch], k[b:b + per_launch], v[b:b + per_launch], causal=causal,
                 key_padding_mask=None if key_padding_mask is None else key_padding_mask[b:b + per_launch],
                 scale=scale, module=module)
             for b in range(0, B, per_launch)]
    return torch.cat([out for out, _ in parts]), torch.cat([lse for _, lse in parts])


def launcher_of(version=None, head_dim=None):
    """The launcher of `version` (default: the one for `head_dim` in :data:`DEFAULT_VERSION_BY_HEAD_DIM`, else
    :data:`DEFAULT_VERSION`); a ValueError naming the versions there are."""
    name = DEFAULT_VERSION_BY_HEAD_DIM.get(head_dim, DEFAULT_VERSION) if version is None else version
    if name not in VERSIONS:
        raise ValueError(f"the hopper rung has no version {name!r}; it has {', '.join(VERSIONS)}")
    return VERSIONS[name]


def backward_gradients(q, k, v, out, lse, dout, *, causal=False, key_padding_mask=None, scale=None, module=None,
                       deterministic=None):
    """FlashAttention-3's backward on Hopper (``hopper_backward.cuh``, issue 47): ``(dq, dk, dv)`` for the forward's
    ``out`` and ``lse``, dk and dv summed over each group of query heads (GQA), in q's dtype.

    Work in progress: NOT registered as the stage's :class:`~wb_kernels.stages.Backward` (no ``BACKWARDS`` here)
    until it has passed its checks on an H100 (``gpu_checks backward``); an untested kernel must not run behind
    ``wb.attention``. `deterministic`: dQ added in key-block order (semaphores), bit-identical across runs; by
    default ``torch.are_deterministic_algorithms_enabled()``, the PyTorch switch. A positive `scale` (as the forward
    takes: :func:`~wb_kernels.reference.positive_scale`); one launch needs B * Hk <= 65,535.
    """
    import torch

    from ...reference import causal_offset
    from .build import extension

    module = module or extension()
    D = q.shape[-1]
    scale = float(D) ** -0.5 if scale is None else float(scale)
    if not scale > 0:
        raise ValueError(f"the hopper backward takes a positive scale, got {scale}")
    if deterministic is None:
        deterministic = torch.are_deterministic_algorithms_enabled()
    offset = causal_offset(causal, q.shape[2], k.shape[2])
    if key_padding_mask is None:
        keep = torch.empty(0, dtype=torch.uint8, device=q.device)
    else:
        keep = torch.as_tensor(key_padding_mask).to(device=q.device, dtype=torch.uint8).contiguous()
    dq, dk, dv = module.hopper_flash_backward(q.contiguous(), k.contiguous(), v.contiguous(), out.contiguous(),
                                              lse.float().contiguous(), dout.contiguous(), keep, offset is not None,
                                              offset or 0, scale, bool(deterministic))
    return dq, dk, dv


STAGE = Stage(
    name="hopper",
    lesson="09_hopper",
    summary="FlashAttention on Hopper by hand (TMA, mbarriers, wgmma), fp16/bf16, D 64 or 128; needs sm_90 "
            "(H100, H200)",
    forward=forward,
    dtypes=("float16", "bfloat16"),
    head_dims=(64, 128),
    needs_gpu=True,
    workspace_bytes=lambda B, H, Lq, Lk, D: B * H * Lq * (2 * D + 4),  # the 16-bit output and the float32 LSE
    order=9,
    linear_memory=True,
    versions=tuple(VERSIONS),
)
