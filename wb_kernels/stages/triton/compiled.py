"""What Triton's compiler made of the forward kernel for one configuration on a GPU (lesson 11, "what the compiler
does for you"): the tensor-core instructions it chose, how it moves tiles into shared memory, its registers, spills
and shared memory, and the inner loop's instructions, as a committed results file the lesson reads on any machine.

    python -m wb_kernels.stages.triton.compiled --json results/triton/compiled_<gpu>.json     # on a GPU

The interpreter runs the kernels as NumPy and compiles nothing, so on a CPU the lesson shows the committed file.
:func:`summarize_ptx` is plain text processing, tested on the CPU.
"""

from __future__ import annotations

import argparse
import json
import re
from collections import Counter
from pathlib import Path

__all__ = ["INSTRUCTION_FAMILIES", "summarize_ptx", "compiled_report", "main"]

# PTX instruction families that say what the compiler did with each part of lessons 05-06 and 09 done by hand
INSTRUCTION_FAMILIES = {
    "wgmma (Hopper warpgroup tensor-core MMA, lesson 09)": r"^\s*wgmma\.mma_async",
    "mma.sync (warp tensor-core MMA, lesson 06)": r"^\s*mma\.sync",
    "ldmatrix (shared -> registers in fragments, lesson 06)": r"^\s*ldmatrix",
    "cp.async (global -> shared without registers, pipelined)": r"^\s*cp\.async\.(ca|cg)",
    "cp.async.bulk (TMA, lesson 09)": r"^\s*cp\.async\.bulk",
    "mbarrier (asynchronous barriers, lesson 09)": r"^\s*mbarrier",
    "ex2.approx (exp2 of the online softmax)": r"^\s*ex2\.approx",
    "bar.sync (block barriers)": r"^\s*(bar\.sync|barrier\.sync)",
}


def summarize_ptx(ptx: str) -> dict:
    """Counts of each :data:`INSTRUCTION_FAMILIES` entry in a PTX listing (static instructions, not executions), and
    the shapes of the tensor-core instructions used (``m64n64k16`` ...)."""
    lines = ptx.splitlines()
    counts = {name: sum(1 for line in lines if re.search(pattern, line)) for name, pattern in
              INSTRUCTION_FAMILIES.items()}
    shapes = Counter(match.group(1) for line in lines
                     for match in [re.search(r"\b(?:wgmma\.mma_async|mma\.sync)\.[\w.]*?\.(m\d+n\d+k\d+)", line)]
                     if match)
    return {"instructions": counts, "mma_shapes": dict(shapes), "ptx_lines": len(lines)}


def compiled_report(*, B=1, H=16, L=4096, D=128, dtype="float16", causal=True) -> dict:
    """Run the triton stage's forward once on the GPU for one configuration and summarize the compiled kernel."""
    import torch

    from . import launcher

    torch.manual_seed(0)
    q, k, v = (torch.randn(B, H, L, D, device="cuda", dtype=getattr(torch, dtype)) for _ in range(3))
    launcher.forward(q, k, v, causal="top_left" if causal else None)
    torch.cuda.synchronize()
    kernel = launcher.LAST_COMPILED.get("forward")
    if kernel is None or not hasattr(kernel, "asm"):
        raise RuntimeError("no compiled kernel: the triton stage ran on the interpreter (no GPU?)")
    ptx = kernel.asm.get("ptx", "")
    metadata = kernel.metadata
    config = launcher.launch_config(D, dtype)
    report = {"problem": dict(B=B, H=H, L=L, D=D, dtype=dtype, causal=causal), "config": config,
              "registers": getattr(kernel, "n_regs", None), "spills": getattr(kernel, "n_spills", None),
              "shared_memory_bytes": getattr(metadata, "shared", None), **summarize_ptx(ptx)}
    mma_lines = [line.strip() for line in ptx.splitlines()
                 if re.search(r"wgmma\.mma_async|mma\.sync|cp\.async|ldmatrix|ex2\.approx", line)]
    report["excerpt"] = mma_lines[:12]
    return report


def main(argv=None) -> int:
    from ...results_files import environment

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", required=True, help="where to write the summary (results/triton/compiled_<gpu>.json)")
    args = parser.parse_args(argv)
    found = {"kind": "triton-compiled", "environment": environment(), "forward": compiled_report()}
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(found, indent=1) + "\n")
    print(json.dumps(found["forward"], indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
