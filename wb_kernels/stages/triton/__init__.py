"""Rung 11, ``triton``: FlashAttention-2 written in Triton, with the variants real models use and FlexAttention's
``score_mod`` / ``mask_mod`` (lesson 11_triton).

- ``kernels.py``: the Triton kernels: the forward (online softmax in base 2, block skipping for causal masks,
  windows, documents and block masks), the backward's preprocess, dK/dV and dQ kernels, and the kernel that builds
  a block mask from a ``mask_mod``;
- ``launcher.py``: the host side: block sizes (:func:`launcher.launch_config`), the variants turned into kernel
  arguments, :func:`launcher.forward`, :func:`launcher.gradients`, :func:`launcher.block_mask` and the choice
  between Triton's compiler and its CPU interpreter;
- ``NOTES.md``: status, decisions, the interpreter's workarounds and what is open.

Importing this package does not import triton (every test imports every rung): the launcher imports it at the first
launch, and a machine without triton is told to ``pip install triton`` then.

Lesson: ``notebooks/11_triton.ipynb``; tests: ``tests/test_triton.py``.
"""

from .. import Backward, Stage
from .launcher import simulator_seconds, stage_forward, stage_gradients

__all__ = ["STAGE", "BACKWARDS"]

STAGE = Stage(
    name="triton",
    lesson="11_triton",
    summary="FlashAttention-2 in Triton: softcap, ALiBi, bias, windows, documents, sinks, score_mod/mask_mod and "
            "block masks that skip what no query sees",
    forward=stage_forward,
    dtypes=("float16", "bfloat16", "float32"),
    head_dims=(16, 32, 64, 128),
    needs_gpu=False,  # Triton's interpreter runs it on the CPU, slowly
    workspace_bytes=lambda B, H, Lq, Lk, D: 4 * B * H * Lq * (D + 1),  # out and the float32 LSE (at most)
    simulator_seconds=simulator_seconds,
    order=11,
    linear_memory=True,
    # not yet: the kernels keep NaN/Inf as SDPA does on the interpreter (tests/test_edge_cases.py passes with this
    # True there), but a GPU's tl.max may drop a NaN where NumPy's keeps it; until that runs on a GPU, wb.attention's
    # host-side pass stays (it costs the H100 about 0.3 ms at B4 H16 L4096 D128: results/triton/variants_h100.json)
    non_finite_in_kernel=False,
    variants=("softcap", "alibi_slopes", "bias", "window", "document_ids", "sinks"),
)

BACKWARDS = (
    Backward("triton", "Triton: preprocess (delta, sinks), dK/dV per key block over the GQA group, dQ per query "
             "block; deterministic dq, dk, dv (a bias broadcast over B or H gets its gradient by atomic adds)",
             stage_gradients),
)
