"""Matrix-vector products by hand for the decode step (issue 48, first step): y = W x at copy speed, split-K, small
batches, and the fusions that save bytes. Not an attention stage: this folder defines no ``STAGE`` (the registry
passes over it, wb_kernels/stages/__init__.py), and the decoder does not use it yet.

Files:

- ``gemv.cuh``: the device code: v1 (batch 1, a warp per row, eight 16-byte loads per lane in flight, the warp's
  shuffle sum), and one kernel for the rest: split-K (v2: the last block of a row tile adds the splits in order),
  batches up to 16 (v3: one weight read serves every row of x), RMSNorm fused before the product, SiLU(gate) * up
  and the residual add after it. Another kernel (the persistent step to come) can include it;
- ``gemv_host.cu`` + ``build.py``: the torch entry points (``gemv_v1``, ``gemv_forward``) and the build through
  ``wb_kernels.cuda_build`` (on a GPU), and the compile report (nvcc alone: registers, spills per kernel);
- ``work_split.py``: NumPy, runs anywhere: which block, warp and lane read which bytes, bytes in flight per SM,
  waves, the split-K choice per product of LLaMA 3.2 1B on an H100, the copy-rate roofline, and an emulation of the
  kernels' float32 sums in their order, held against float64;
- ``launcher.py``: the Python functions (``gemv_v1``, ``gemv``, ``rmsnorm_gemv``, ``gemv_residual``,
  ``rmsnorm_gate_up_silu``), each validating its inputs before any launch;
- ``gpu_checks.py``: every kernel against float64 on a GPU (``python -m wb_kernels.stages.gemv.gpu_checks``);
- ``bench.py``: each version against cuBLAS and the copy ceiling, L2 flushed, into ``results/gemv/bench_<gpu>.json``
  (``python -m wb_kernels.stages.gemv.bench``);
- ``NOTES.md``: the design, the versions with their predictions, what waits for the H100.

Lesson: none yet (the decode step's lesson of issue 48); tests: ``tests/test_gemv.py``.
"""
