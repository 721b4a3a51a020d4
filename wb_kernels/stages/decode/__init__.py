"""Stage 07: decoding with a KV cache — split-KV (flash-decoding), GQA/MQA and a paged cache (lesson 07_decode).

Files:

- ``splitkv.py``: the NumPy model — one split's partial output and LSE, the exact merge, the choice of the number
  of splits;
- ``kernel.py``: the split-KV and merge kernels in numba.cuda (GQA: a block serves a KV head's query heads; paged:
  keys gathered through the block table); they run on the simulator and on a GPU;
- ``decode_host.cu`` (with the device code in ``decode_params.cuh``, ``decode_merge.cuh``, ``decode_split_kernel.cuh``,
  ``decode_mma_kernel.cuh``) + ``build.py``: the same algorithm in CUDA C++ for the GPU (16-byte loads, several keys in
  flight per lane, the KV group's query heads in registers), built with torch's ``load_inline``; what ``wb.decode``
  runs on a GPU for float16/bfloat16 at D 64 or 128;
- ``launcher.py``: launching them, the paged-cache helpers, and this stage's ``wb.attention`` entry;
- ``costs.py``: what a decode step costs (FLOPs and bytes, the merge's weights, splits and blocks per workload against
  the SMs, a paged cache against contiguous ones); ``figures.py``: the lesson's figures drawn from them;
  ``committed_runs.py``: the committed GPU runs the lesson reads; ``slider.py``: the lesson's slider, and every name
  the lesson reads as ``decode_slider``;
- ``tune.py``: builds, checks and times the CUDA kernels' launch settings and split counts on a GPU (``--mma-sweep``:
  the tensor-core kernel's builds A/B'd in one run);
- ``exercises.py`` and ``solutions.py``: the lesson's exercises and its puzzle (the merge), their worked answers;
- ``NOTES.md``: the versions, each with its prediction and measurement;
- the decode entry point itself is ``wb.decode`` (``wb_kernels/api.py``; its checks in ``validation.py``, its run in ``execution.py``).

The LLaMA-shaped decoder that lesson 07 generates with is a user of this rung, not part of it:
``wb_kernels/models/llama_decoder.py`` and its tokens-per-second benchmark ``wb_kernels/bench/decoder_tokens.py``.
What code outside the rung may use (the benchmark's contenders) is exported here: ``decode_forward`` (the launcher
behind ``wb.decode``, without its validation), the CUDA kernel's dtypes and head dims, and ``decoder_table`` (the
decoder benchmark's file as the lesson prints it, which the benchmark's README section prints too).

Lesson: ``notebooks/07_decode.ipynb``; tests: ``tests/test_decode.py``.
"""

import math

from .. import Stage
from .committed_runs import decoder_table
from .launcher import CUDA_KERNEL_DTYPES, CUDA_KERNEL_HEAD_DIMS, decode_forward, forward
from .splitkv import split_bounds


def _simulator_seconds(B, H, Lq, Lk, D):
    # measured on a 2-core machine with the simulator's config (16 threads, 16-key tiles): about 20 ms per tile of
    # a block at D = 16, growing with D
    tiles = B * H * math.ceil(Lq / 4) * math.ceil(Lk / 16)
    return 0.1 + tiles * 0.02 * math.sqrt(D / 16)


STAGE = Stage(
    name="decode",
    lesson="07_decode",
    summary="split-KV (flash-decoding) in numba.cuda: GQA/MQA, paged KV cache; wb.decode for one token per sequence",
    forward=forward,
    dtypes=("float32", "float16"),
    head_dims=(16, 32, 64, 128),
    workspace_bytes=lambda B, H, Lq, Lk, D: 4 * B * H * Lq * (D + 1) * 65,  # O + LSE, and up to 64 splits of them
    simulator_seconds=_simulator_seconds,
    order=7,
    linear_memory=True,
)

__all__ = ["STAGE", "split_bounds", "decode_forward", "CUDA_KERNEL_DTYPES", "CUDA_KERNEL_HEAD_DIMS", "decoder_table"]
