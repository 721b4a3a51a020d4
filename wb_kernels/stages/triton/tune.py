#!/usr/bin/env python3
"""Time the triton stage's forward over its launch parameters on one GPU, next to SDPA's FLASH and cuDNN backends and
FlexAttention, in one run: the numbers :func:`launcher.launch_config` is chosen from (NOTES.md's table).

    python -m wb_kernels.stages.triton.tune --json results/triton/tune_<gpu>.json

A grid of query rows per block (``block_m``), keys per tile (``block_n``), warps and pipeline stages, at B·L = 16k
tokens, H = 16, fp16, D = 64 and 128, causal and not. Each configuration is checked against SDPA's output first (the
max error over the output, against 4x SDPA's own float16 rounding: a wrong configuration must not be timed), then
timed with the benchmark's one method (:data:`wb_kernels.timing.DEVICE_TIME`). Triton's compiler may refuse a
configuration (too much shared memory): the row says so.
"""

from __future__ import annotations

import argparse
import itertools
import json
from pathlib import Path

from ...attention_costs import attention_flops
from ...timing import DEVICE_TIME, time_call
from ...tuning import sdpa_call

from . import launcher

GRID = dict(block_m=(64, 128), block_n=(32, 64, 128), num_warps=(4, 8), num_stages=(2, 3, 4))


def configurations(quick: bool = False):
    """Every combination of :data:`GRID` (``quick``: FlashAttention-2's usual neighbourhood only)."""
    for block_m, block_n, num_warps, num_stages in itertools.product(*GRID.values()):
        if quick and (block_m != 128 or block_n == 32):
            continue
        yield dict(block_m=block_m, block_n=block_n, num_warps=num_warps, num_stages=num_stages)


def _flex_call(q, k, v, causal):
    import torch
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    mask = None
    if causal:
        mask = create_block_mask(lambda b, h, i, j: j <= i, None, None, q.shape[2], k.shape[2], device=q.device)
    compiled = torch.compile(flex_attention)
    return lambda: compiled(q, k, v, block_mask=mask)


def tune(D: int, causal: bool, L: int = 4096, quick: bool = False) -> list:
    import torch

    B, H = 16384 // L, 16
    torch.manual_seed(0)
    q, k, v = (torch.randn(B, H, L, D, device="cuda", dtype=torch.float16) for _ in range(3))
    flops = attention_flops(B, H, L, L, D, causal)
    rows = []

    def timed(name, fn, **extra):
        ms = time_call(fn, warmup=3, repeats=20, **DEVICE_TIME).median_ms
        rows.append(dict(name=name, D=D, causal=causal, L=L, ms=round(ms, 4), tflops=round(flops / ms / 1e9, 1),
                         **extra))
        print(f"D={D} causal={causal} {name:>28}: {ms:.3f} ms {flops / ms / 1e9:6.1f} TFLOP/s", flush=True)

    expected = sdpa_call(q, k, v, "FLASH_ATTENTION", is_causal=causal)()
    exact = torch.nn.functional.scaled_dot_product_attention(*(x.double() for x in (q, k, v)), is_causal=causal)
    bound = 4 * float((expected.double() - exact).abs().max())
    for backend in ("FLASH_ATTENTION", "CUDNN_ATTENTION"):
        timed(f"sdpa-{backend.split('_')[0].lower()}", sdpa_call(q, k, v, backend, is_causal=causal))
    try:
        timed("flex", _flex_call(q, k, v, causal))
    except Exception as error:  # (FlexAttention's compile can fail on a host: the row says why)
        rows.append(dict(name="flex", D=D, causal=causal, L=L, error=f"{type(error).__name__}: {error}"[:300]))
    for config in configurations(quick):
        name = "triton b{block_m}x{block_n} w{num_warps} s{num_stages}".format(**config)

        def call(config=config):
            return launcher.forward(q, k, v, causal="top_left" if causal else None, **config)[0]

        try:
            error = float((call().double() - exact).abs().max())
        except Exception as failure:  # the compiler refused it (shared memory, registers): not a result
            rows.append(dict(name=name, D=D, causal=causal, L=L, **config,
                             error=f"{type(failure).__name__}: {failure}"[:300]))
            continue
        if not error <= bound:
            rows.append(dict(name=name, D=D, causal=causal, L=L, **config, error=f"max error {error:.3g} > {bound:.3g}"))
            continue
        timed(name, call, **config)
    return rows


def main(argv=None) -> int:
    from ...results_files import environment

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", required=True)
    parser.add_argument("--quick", action="store_true", help="block_m 128, block_n 64 and 128 only")
    parser.add_argument("--head-dims", type=int, nargs="+", default=[64, 128])
    args = parser.parse_args(argv)
    rows = []
    for D, causal in itertools.product(args.head_dims, (False, True)):
        rows += tune(D, causal, quick=args.quick)
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps({"kind": "triton-tune", "timing": dict(DEVICE_TIME),
                                               "environment": environment(), "rows": rows}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
