"""Exact attention across processes (issue #32; lesson 10_distributed): the merge of lessons 04 and 07 over ranks.

This folder has no ``STAGE``: like the backward rung, it uses the other stages (each rank's local attention is
``wb.attention(..., stage=..., return_lse=True)``) and adds the communication around them, on ``torch.distributed``
(gloo on CPU, tested; NCCL with ``--backend nccl``, written but not yet run on GPUs: NOTES.md).

Files:

- ``merge.py``: the log-sum-exp merge of partial (out, LSE) in torch, fp32 (fp64 for fp64), rows that see no key.
- ``agreement.py``: one small all-gather before a method's first collective: every rank checks that the ranks agree
  on shapes, dtypes, heads, lengths, mask, causal and scale (and split-KV decode's q), and all raise the same error.
- ``sharding.py``: contiguous and zigzag layouts, causal block pairs (full, diagonal, skipped), the work per rank
  and the causal ceiling W / (2W - 1). Pure functions.
- ``decode.py``: split-KV decode across ranks (one all-gather of (out, LSE), then the merge).
- ``ring.py``: ring attention, K/V passed with ``batch_isend_irecv``, the next exchange issued before the local
  block's attention (on CUDA from a stream of its own, ``BlockExchange``); contiguous or zigzag layout.
- ``ulysses.py``: DeepSpeed-Ulysses, ``all_to_all_single`` from sequence-sharded to head-sharded and back.
- ``run.py``: the torchrun entry point that checks every method against one process (float64), or grades it by
  ``wb.check``'s rule (fp16/bf16 on NCCL with the mma stage).
- ``scaling.py``: the scaling benchmark against one GPU and PyTorch's ``context_parallel`` (torchrun), and what the
  lesson reads from its results: ``find_scaling_results``, ``load_scaling``, ``scaling_table``,
  ``efficiency_figure``.
- ``slider.py``: lesson 10's figures and models: the ring in one process, which blocks each rank computes at each
  step, the overlap condition, ring against Ulysses bytes, the plan past one machine, torchrun from a cell.
- ``exercises.py`` / ``solutions.py``: lesson 10's exercises and its puzzle (the ring's merge step), and their answers.
- ``NOTES.md``: the design, what is checked where, and what remains.

Tests: ``tests/test_distributed.py``; the lesson's logic in ``tests/test_distributed_lesson.py``. Only ``sharding``
is imported here: the folder is imported whenever the stages are discovered, and torch.distributed is not needed for
that.
"""

from .sharding import causal_ceiling, chunk_bounds, local_indices, pair_blocks, shard_pieces  # noqa: F401
