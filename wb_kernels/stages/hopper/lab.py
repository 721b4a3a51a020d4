"""The primitives lab's Python side (rung ``hopper``, v0): each launcher runs one small kernel of
``hopper_primitives_lab.cuh``.

Needs a Hopper GPU and a CUDA build of torch. A kernel that waits on an mbarrier hangs when the barrier is wrong:
the extension is built with the watchdog (``build.WATCHDOG_SECONDS``), and the tests run every launcher in a
subprocess under a time limit (:mod:`.gpu_checks`).

- :func:`tma_tile`: (a) one TMA box, 64 x 64 16-bit elements, returned as the raw shared-memory image;
- :func:`flash_v1` ... :func:`flash_v4`: attention (work in progress, not yet a stage): v1 TMA + wgmma, one
  warpgroup per 64 query rows; v2 a producer warpgroup and two consumers; v3 the consumers in ping-pong; v4 v3 with
  each consumer's softmax under its own P V;
- :func:`wgmma_gemm`: (b, c) C = A B in fp32 by one warpgroup, A (64, K <= 64) from shared memory (SS) or registers
  (RS), B K-major (given as its transpose, (N, K)) or MN-major ((K, N)), N = 64 or 128;
- :func:`register_split`: (d) ``setmaxnreg``: one warpgroup gives registers back, two take 240 each and use them;
- :func:`named_barrier_turns`: (e) ``bar.sync`` / ``bar.arrive``: two warpgroups taking turns, the order they took;
- :func:`backward_dq_product`: the backward's dQ product alone (issue 47): SS wgmma with A M-major (given as its
  transpose, as the consumers store dS^T) and B MN-major from a column offset.
"""

from __future__ import annotations

from . import build as hopper_build

__all__ = ["tma_tile", "wgmma_gemm", "register_split", "named_barrier_turns", "flash_v1", "flash_v2", "flash_v3",
           "flash_v4", "backward_dq_product", "SPLIT_LIVE"]

TILE_BYTES = 64 * 128
SPLIT_LIVE = 200  # values each consumer thread of register_split_kernel keeps live (the kernel's SPLIT_LIVE)


def tma_tile(x, row0: int = 0, column0: int = 0, *, expect_bytes: int | None = None, module=None):
    """Shared memory after one TMA load of the 64 x 64 box at (row0, column0) of `x` (2-D CUDA, fp16/bf16, row
    length a multiple of 8), flat, in x's dtype. `expect_bytes` (default: the box's 8192) is what thread 0
    announces with arrive.expect_tx; another value never completes the barrier's phase (the watchdog traps)."""
    module = module or hopper_build.extension()
    return module.hopper_tma_tile(x.contiguous(), int(row0), int(column0),
                                  TILE_BYTES if expect_bytes is None else int(expect_bytes))


def wgmma_gemm(a, b, *, a_in_registers: bool = False, b_mn_major: bool = False, module=None):
    """C = A B (64 x N, float32). `a`: (64, K); `b`: (N, K) (K-major, B's transpose) or, with `b_mn_major`, (K, N)."""
    module = module or hopper_build.extension()
    return module.hopper_wgmma_gemm(a.contiguous(), b.contiguous(), bool(a_in_registers), bool(b_mn_major))


def backward_dq_product(a_t, b, consumer: int = 0, *, module=None):
    """The backward's dQ product alone (``dq_product_kernel``, issue 47): ``a_t`` (128, 64) and ``b`` (128, D), D = 64
    or 128, CUDA fp16/bf16; returns (64, D / 2) float32 = ``a_t.T @ b[:, consumer D / 2 : (consumer + 1) D / 2]``, by
    the SS wgmma with A M-major (A given as its transpose) and B MN-major that the backward's consumers issue."""
    module = module or hopper_build.extension()
    return module.hopper_backward_dq_product(a_t.contiguous(), b.contiguous(), int(consumer))


def register_split(x, *, module=None):
    """(d) ``register_split_kernel``: `x` (2, SPLIT_LIVE, 128) float32 CUDA; returns 384 floats: threads 0-127 (the
    warpgroup that gave registers back) 2 x[0, 0, t]; consumer c's thread t the sum over i from the last,
    s = s / 2 + (x[c, i, t] - max_i x[c, i, t])."""
    module = module or hopper_build.extension()
    return module.hopper_register_split(x.contiguous())


def named_barrier_turns(rounds: int, device_like, *, module=None):
    """(e) ``named_barrier_kernel``: the warpgroup index of each of the 2 x `rounds` turns, in the order taken
    (int32 on `device_like`'s device); named barriers that work give 0, 1, 0, 1, ..."""
    module = module or hopper_build.extension()
    return module.hopper_named_barrier_turns(int(rounds), device_like)


def _flash(version: int, q, k, v, causal, key_padding_mask, scale, module):
    import torch

    from ...reference import causal_offset

    module = module or hopper_build.extension()
    D = q.shape[-1]
    scale = float(D) ** -0.5 if scale is None else float(scale)
    if not scale > 0:
        raise ValueError(f"flash_v{version} takes a positive scale, got {scale}")
    offset = causal_offset(causal, q.shape[2], k.shape[2])
    if key_padding_mask is None:
        keep = torch.empty(0, dtype=torch.uint8, device=q.device)
    else:
        keep = torch.as_tensor(key_padding_mask).to(device=q.device, dtype=torch.uint8).contiguous()
    return module.hopper_flash_forward(q.contiguous(), k.contiguous(), v.contiguous(), keep, offset is not None,
                                       offset or 0, scale, version)


def flash_v1(q, k, v, *, causal=False, key_padding_mask=None, scale=None, module=None):
    """v1 attention (work in progress, not a registered stage): q (B, H, Lq, D), k and v (B, Hk, Lk, D), CUDA,
    fp16/bf16, D = 64 or 128; causal False, True/"top_left" or "bottom_right"; returns (out, lse).
    Takes a positive scale only (the mma stage's launcher turns 0 and negative scales into positive ones; that logic
    moves to a shared helper before this becomes a stage)."""
    return _flash(1, q, k, v, causal, key_padding_mask, scale, module)


def flash_v2(q, k, v, *, causal=False, key_padding_mask=None, scale=None, module=None):
    """v2 attention: a producer warpgroup (TMA into a ring of full/empty mbarriers) and two consumer warpgroups of
    64 query rows each, registers split by setmaxnreg (24 / 240 / 240), 128 x 128 tiles. Arguments and result as
    :func:`flash_v1`."""
    return _flash(2, q, k, v, causal, key_padding_mask, scale, module)


def flash_v3(q, k, v, *, causal=False, key_padding_mask=None, scale=None, module=None):
    """v3 attention: v2 with the two consumers taking turns on the tensor cores through named barriers (ping-pong),
    so that one's softmax runs under the other's GEMMs. Arguments and result as :func:`flash_v1`."""
    return _flash(3, q, k, v, causal, key_padding_mask, scale, module)


def flash_v4(q, k, v, *, causal=False, key_padding_mask=None, scale=None, module=None):
    """v4 attention: v3's turns, and inside each turn S of this tile and P V of the last as two commit groups, the
    softmax running under the P V (wgmma.wait_group 1; FlashAttention-3's Algorithm 2). Arguments and result as
    :func:`flash_v1`."""
    return _flash(4, q, k, v, causal, key_padding_mask, scale, module)
