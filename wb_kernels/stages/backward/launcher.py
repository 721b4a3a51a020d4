"""The mma stage's gradients on tensor cores: ``flash_backward.cu`` launched from Python (lesson 08_backward).

- :func:`mma_gradients`: the :class:`~wb_kernels.stages.Backward` contract, on CUDA torch tensors (fp16 or bf16, head
  dim 64 or 128): ``(dq, dk, dv)`` in the input dtype, dk and dv summed over each GQA group, zero for rows that see no
  key. Version "v1" (the default): three kernels, deterministic, no atomics; "v2": FlashAttention-2's single
  kernel, dQ added up by fp32 atomics, so not bitwise reproducible (NOTES.md).
- ``python -m wb_kernels.stages.backward.launcher`` (a GPU): checks each version against the float64 reference and
  SDPA's error, then times it against SDPA's FLASH backward at B4 H16 L4096, D 128 and 64, causal and not
  (:func:`bench_main`).
"""

from __future__ import annotations

from . import build as backward_build
from ...reference import causal_offset

__all__ = ["VERSIONS", "DEFAULT_VERSION", "DEFAULT_VARIANT", "mma_gradients", "gradient_errors", "backward_flops",
           "bench_main"]

VERSIONS = ("v1", "v2")
DEFAULT_VERSION = "v1"  # deterministic: the same inputs give the same bits (v2's atomics add in any order)
# Each version's launch configuration per head dim (flash_backward.cu, region variants, says why 32 query rows
# at D = 128). v2: 128 keys per block (8 warps), as FlashAttention-2: half the atomics of 64 keys per block.
DEFAULT_VARIANT = {(version, D): backward_build.Variant(version, D, 64 if D == 64 else 32, block_n)
                   for version, block_n in (("v1", 64), ("v2", 128)) for D in (64, 128)}


def mma_gradients(q, k, v, out, lse, dout, *, causal=False, key_padding_mask=None, scale=None, variant=None,
                  module=None):
    """Gradients of attention from the forward's ``out`` and ``lse`` (natural log, float32 (B, H, Lq)).

    `variant`: a version name from :data:`VERSIONS` (default :data:`DEFAULT_VERSION`, "v1") or a
    :class:`~.build.Variant`. "v2" is not deterministic (deterministic=False: dQ's fp32 atomic additions come in
    any order, so the last bits of dq may differ between runs; dk and dv do not). Any finite scale (its sign does
    not matter here: the backward keeps no running maximum); NaN or Inf is refused.
    """
    import torch

    if module is None:
        module = backward_build.extension()
    D = q.shape[-1]
    if D not in (64, 128):
        raise ValueError(f"the mma backward takes head dims [64, 128], got {D}")
    if variant is None or variant in VERSIONS:
        variant = DEFAULT_VARIANT[(variant or DEFAULT_VERSION, D)]
    elif not isinstance(variant, backward_build.Variant):
        raise ValueError(f"variant: one of {VERSIONS} or a build.Variant, got {variant!r}")
    elif variant not in backward_build.VARIANTS or variant.head_dim != D:
        raise ValueError(f"variant {variant} is not compiled for head dim {D}; see build.VARIANTS")
    scale = float(D) ** -0.5 if scale is None else float(scale)
    offset = causal_offset(causal, q.shape[2], k.shape[2])
    if key_padding_mask is None:
        keep = torch.empty(0, dtype=torch.uint8, device=q.device)
    else:
        keep = torch.as_tensor(key_padding_mask).to(device=q.device, dtype=torch.uint8).contiguous()
    lse = lse.to(torch.float32).contiguous()
    dq, dk, dv = module.flash_backward(q.contiguous(), k.contiguous(), v.contiguous(), out.contiguous(), lse,
                                       dout.contiguous(), keep, offset is not None, offset or 0, scale,
                                       int(variant.version[1:]), variant.block_m, variant.block_n)
    return dq, dk, dv


def backward_flops(B, H, Lq, Lk, D, causal=False) -> float:
    """The backward's useful FLOPs, counted as 2.5x the forward's 4 B H Lq Lk D (five matrix products against the
    forward's two), halved for a causal mask (top-left, Lq = Lk)."""
    flops = 2.5 * 4 * B * H * Lq * Lk * D
    return flops / 2 if causal else flops


def _forward_and_dout(B, H, L, D, dtype, *, causal, seed=0, Hk=None):
    """Inputs, out and LSE from the mma stage's forward, and a random dout: what a training step's backward gets."""
    import torch

    from ..mma.launcher import forward

    gen = torch.Generator(device="cuda").manual_seed(seed)
    Hk = H if Hk is None else Hk
    q = torch.randn(B, H, L, D, device="cuda", dtype=dtype, generator=gen)
    k = torch.randn(B, Hk, L, D, device="cuda", dtype=dtype, generator=gen)
    v = torch.randn(B, Hk, L, D, device="cuda", dtype=dtype, generator=gen)
    dout = torch.randn(B, H, L, D, device="cuda", dtype=dtype, generator=gen)
    out, lse = forward(q, k, v, causal=causal)
    return q, k, v, out, lse, dout


def _time_ms(fn, repeats=20):
    """Median milliseconds of `fn` by CUDA events, the L2 cache flushed by a 256 MB write before each repeat."""
    import torch

    flush = torch.empty(256 * 1024 * 1024, dtype=torch.uint8, device="cuda")
    fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(repeats):
        flush.zero_()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return sorted(times)[len(times) // 2]


def gradient_errors(q, k, v, dout, *, causal=False, key_padding_mask=None, scale=None, variants=VERSIONS,
                    out_lse=None):
    """{variant: {"dq" | "dk" | "dv": (mma's max |error|, SDPA's max |error|, storage floor)}} against the float64
    reference, for each of `variants` (version names or :class:`~.build.Variant`; the reference and SDPA once).

    SDPA's error: torch autograd through ``scaled_dot_product_attention`` (K/V heads repeated for GQA, autograd
    summing their gradients; the masks as one boolean mask) in the inputs' dtype on their GPU; where SDPA gives NaN
    (a row that sees no key), its gradient counts as zero, the true value there. The floor is twice the rounding of
    storing the reference gradient in the dtype (:func:`wb_kernels.check.storage_floor`). `out_lse`: the forward's
    (out, lse) if not the mma stage's.
    """
    import numpy as np
    import torch
    import torch.nn.functional as F

    from ...check import storage_floor
    from ...reference import attention_mask, reference_backward, repeat_kv_heads
    from ..mma.launcher import forward

    dtype = str(q.dtype).replace("torch.", "")
    out, lse = out_lse if out_lse is not None else forward(q, k, v, causal=causal, key_padding_mask=key_padding_mask,
                                                           scale=scale)
    mask = None if key_padding_mask is None else np.asarray(torch.as_tensor(key_padding_mask).cpu().numpy(), bool)
    as64 = [x.detach().double().cpu().numpy() for x in (q, k, v, dout)]
    ref = [torch.from_numpy(x) for x in reference_backward(*as64, causal=causal, key_padding_mask=mask, scale=scale)]
    allowed = torch.from_numpy(attention_mask(q.shape[2], k.shape[2], causal, mask, batch=q.shape[0])).to(q.device)
    H = q.shape[1]
    leaves = [x.detach().clone().requires_grad_() for x in (q, k, v)]
    # GQA as the forward's check has it: K/V heads repeated (a copy, exact); autograd sums their gradients
    sdpa_out = F.scaled_dot_product_attention(leaves[0], repeat_kv_heads(leaves[1], H), repeat_kv_heads(leaves[2], H),
                                              attn_mask=allowed, scale=scale)
    sdpa = torch.autograd.grad(sdpa_out, leaves, dout)

    def max_error(x, exact):
        return float((x.double().cpu() - exact).abs().max()) if exact.numel() else 0.0

    baseline = {name: (max_error(torch.nan_to_num(theirs, nan=0.0, posinf=0.0, neginf=0.0), exact),
                       storage_floor(exact.numpy(), dtype))
                for name, theirs, exact in zip(("dq", "dk", "dv"), sdpa, ref)}
    errors = {}
    for variant in variants:
        got = mma_gradients(q, k, v, out, lse, dout, causal=causal, key_padding_mask=key_padding_mask, scale=scale,
                            variant=variant)
        errors[variant] = {name: (max_error(mine, exact), *baseline[name])
                           for name, mine, exact in zip(("dq", "dk", "dv"), got, ref)}
    return errors


def _variant_name(variant) -> str:
    """A short name: "v1", "v2", or "v2/64" for a configuration that is not its version's default."""
    if variant in DEFAULT_VARIANT.values():
        return variant.version
    return f"{variant.version}/{variant.block_n}" if variant.version == "v2" else f"{variant.version}/{variant.block_m}"


def _check_small_cases():
    """One line per dtype, head dim, mask and variant on a small odd GQA shape: each gradient's error, SDPA's
    error in the same dtype, and whether it is within 2x SDPA's plus the floor (the rule tests/test_backward_mma.py
    asserts)."""
    import torch

    failures = 0
    for dtype in (torch.float16, torch.bfloat16):
        for D in (64, 128):
            for causal in (False, True, "bottom_right"):
                B, H, Hk, Lq, Lk = 2, 4, 2, 133, 197
                gen = torch.Generator(device="cuda").manual_seed(D)
                q, dout = (torch.randn(B, H, Lq, D, device="cuda", dtype=dtype, generator=gen) for _ in range(2))
                k, v = (torch.randn(B, Hk, Lk, D, device="cuda", dtype=dtype, generator=gen) for _ in range(2))
                variants = [x for x in backward_build.VARIANTS if x.head_dim == D]
                for variant, errors in gradient_errors(q, k, v, dout, causal=causal, variants=variants).items():
                    ok = all(mine <= 2 * theirs + floor for mine, theirs, floor in errors.values())
                    failures += not ok
                    print(f"  {str(dtype)[6:]:8s} D={D:3d} causal={causal!s:12s} {_variant_name(variant):6s} "
                          + "  ".join(f"{name} {mine:.1e} (SDPA {theirs:.1e})"
                                      for name, (mine, theirs, _) in errors.items())
                          + ("  ok" if ok else "  FAIL"), flush=True)
    return failures


def _v2_repeatability():
    """How often v2's dq differs bitwise between two runs on one input (its atomics add in any order), and the
    largest difference; dk and dv must be equal."""
    import torch

    q, k, v, out, lse, dout = _forward_and_dout(2, 8, 1000, 128, torch.bfloat16, causal=False, Hk=2)
    first = mma_gradients(q, k, v, out, lse, dout, variant="v2")
    again = mma_gradients(q, k, v, out, lse, dout, variant="v2")
    differ = float((first[0] != again[0]).float().mean())
    largest = float((first[0].float() - again[0].float()).abs().max())
    same_kv = torch.equal(first[1], again[1]) and torch.equal(first[2], again[2])
    print(f"v2 run twice (B2 H8 Hk2 L1000 D128 bf16): {100 * differ:.2f}% of dq differ (largest {largest:.1e}); "
          f"dk, dv {'bitwise equal' if same_kv else 'DIFFER'}", flush=True)
    return 0 if same_kv else 1


def bench_main(argv=None) -> int:
    """Correctness on small shapes, then milliseconds and TFLOP/s of each version vs SDPA's FLASH backward."""
    import argparse

    import torch
    from torch.nn.attention import SDPBackend, sdpa_kernel

    parser = argparse.ArgumentParser(description=bench_main.__doc__)
    parser.add_argument("--shape", default="4,16,4096", help="B,H,L (default 4,16,4096)")
    parser.add_argument("--repeats", type=int, default=20)
    args = parser.parse_args(argv)
    B, H, L = (int(x) for x in args.shape.split(","))
    print(f"device: {torch.cuda.get_device_name()}  torch {torch.__version__}")
    print("correctness (B2 H4 Hk2 Lq133 Lk197, vs the float64 reference; SDPA's error in the same dtype):")
    failures = _check_small_cases()
    failures += _v2_repeatability()
    print(f"timing: B{B} H{H} L{L} fp16, median of {args.repeats} (L2 flushed), TFLOP/s = 2.5 x forward FLOPs / time")
    for D in (128, 64):
        for causal in (False, True):
            q, k, v, out, lse, dout = _forward_and_dout(B, H, L, D, torch.float16, causal=causal)
            flops = backward_flops(B, H, L, L, D, causal)
            qs, ks, vs = (x.detach().requires_grad_() for x in (q, k, v))
            with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
                sdpa_out = torch.nn.functional.scaled_dot_product_attention(qs, ks, vs, is_causal=causal)
            sdpa_ms = _time_ms(lambda: torch.autograd.grad(sdpa_out, (qs, ks, vs), dout, retain_graph=True),
                               args.repeats)
            print(f"  D={D:3d} causal={causal!s:5s} SDPA FLASH {sdpa_ms:7.3f} ms {flops / sdpa_ms / 1e9:6.1f} TFLOP/s",
                  flush=True)
            for variant in (x for x in backward_build.VARIANTS if x.head_dim == D):
                ms = _time_ms(lambda: mma_gradients(q, k, v, out, lse, dout, causal=causal, variant=variant),
                              args.repeats)
                print(f"      {_variant_name(variant):6s} {ms:7.3f} ms {flops / ms / 1e9:6.1f} TFLOP/s "
                      f"({sdpa_ms / ms:.2f}x)  {variant.label}", flush=True)
    return 1 if failures else 0


if __name__ == "__main__":
    raise SystemExit(bench_main())
