"""Rung ``hopper``: FlashAttention on Hopper by hand, TMA, mbarriers, wgmma, warp specialization (issue #31).

Work in progress (NOTES.md says what runs and what remains); registered as the stage ``"hopper"`` of
``wb.attention``, which runs v1 on a Hopper GPU. Files:

- ``hopper_primitives_lab.cuh``: v0, the primitives lab (mbarrier, the TMA tile load with the 128-byte swizzle, the
  wgmma shared-memory descriptor, wgmma in its SS and RS forms, setmaxnreg, named barriers, each in a small kernel);
- ``hopper_attention.cuh``: attention with those pieces: v1 (one warpgroup), v2 (a producer warpgroup and two
  consumers, full/empty mbarrier ring, setmaxnreg), v3 (v2's consumers in ping-pong through named barriers) and v4
  (the softmax of a tile under the previous tile's P V);
- ``hopper_backward.cuh``: the backward (issue 47, work in progress, not yet the stage's): preprocessing (D, LSE in
  base 2, the dQ accumulator zeroed), the key/value-stationary main kernel (a producer, two consumers of 64 keys,
  dK/dV in registers, dQ by float32 atomics or in key-block order by semaphores) and dQ's conversion;
- ``hopper_host.cu``: the tensor maps and the torch entry points of all three (it includes the headers);
- ``build.py``: the lab described to the shared :mod:`wb_kernels.cuda_build`, for ``sm_90a``: the extension (with the
  barrier watchdog by default) and, without a GPU, the compile report and the SASS (``HGMMA``, ``UTMALDG``); a wgmma
  that ptxas serialized fails both;
- ``launcher.py``: the stage (``STAGE``): ``forward``, which runs a version of the kernel (``VERSIONS``) from
  ``wb.attention``;
- ``lab.py``: the Python launchers of the lab's kernels; ``gpu_checks.py``: their checks against torch and NumPy,
  one process each (``python -m wb_kernels.stages.hopper.gpu_checks tma gemm watchdog``);
- ``tma_swizzle.py``: the TMA's 128-byte swizzle in NumPy, the same XOR as the mma rung's ``swizzle.py``;
- ``wgmma_fragments.py``: which thread holds which element of a wgmma accumulator and of the RS form's A operand,
  from the mma rung's fragment model, and how v1 packs P from S's accumulators;
- ``v1_model.py``: v1's control flow and arithmetic in NumPy (tiles loaded, masks, online softmax), for ``wb.check``;
- ``backward_model.py``: the backward's tile schedule and arithmetic in NumPy, and dQ's two accumulation orders;
- ``barrier_ring.py``: the full/empty mbarrier ring of a warp-specialized kernel as a Python model that raises on a
  deadlock, a stale read or an overwrite instead of hanging;
- ``NOTES.md``: the version table, what is checked where, what remains.

Tests: ``tests/test_hopper.py`` (the kernels), ``tests/test_hopper_stage.py`` (the stage),
``tests/test_hopper_backward.py`` (the backward's compile check and model).
"""

from .launcher import STAGE

__all__ = ["STAGE"]
