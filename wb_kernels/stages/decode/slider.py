"""Lesson 07's slider, and every name the lesson reads as ``decode_slider``.

The slider: three sliders (:data:`SLIDER_BATCHES`, :data:`SLIDER_KV_HEADS`, :data:`SLIDER_LENGTHS`) drive
:func:`wb_kernels.stages.decode.figures.draw_split_choice` through :func:`wb_kernels.widgets.link_sliders`. The rest
lives where its name says and is gathered here, so that the lesson imports one module:

- :mod:`.costs`: what a decode step costs and how its grid fills the GPU (numbers);
- :mod:`.figures`: the lesson's figures drawn from them;
- :mod:`.committed_runs`: the committed GPU runs the lesson reads (tuning, benchmark, decoder) and the tables and
  rows it takes from them.
"""

from __future__ import annotations

from .committed_runs import (BEFORE_PAGED_FIX, NO_DECODER_RUN, OLDER_KERNEL, PAGED_FIX, committed_decode_bar_results,
                             committed_decoder_results, committed_gpu, committed_tune_results, copy_bandwidths,
                             decode_bench_rows, decoder_speedups, decoder_table, describe_decoder_run,
                             describe_tune_run, implied_block_overhead_keys)
from .costs import (CUDA_ROWS_PER_BLOCK, WORKLOAD_BATCHES, WORKLOAD_KV_HEADS, WORKLOAD_LENGTHS, attention_cost,
                    cache_memory, kernel_bytes_rows, random_sequence_lengths, row_chunks, sm_wave, split_weights,
                    splits_table)
from .figures import (draw_cache_memory, draw_fused_merge, draw_page_pool, draw_roofline, draw_split_choice,
                      draw_split_weights, draw_splits_heatmap)

__all__ = ["attention_cost", "committed_gpu", "draw_roofline", "split_weights", "draw_split_weights",
           "row_chunks", "splits_table", "draw_splits_heatmap", "sm_wave", "draw_split_choice", "random_sequence_lengths",
           "cache_memory", "draw_cache_memory", "draw_page_pool", "committed_tune_results",
           "describe_tune_run", "committed_decoder_results", "decoder_table", "describe_decoder_run",
           "NO_DECODER_RUN", "draw_fused_merge", "implied_block_overhead_keys", "decode_bench_rows", "copy_bandwidths",
           "committed_decode_bar_results", "OLDER_KERNEL", "BEFORE_PAGED_FIX", "PAGED_FIX", "kernel_bytes_rows",
           "decoder_speedups", "CUDA_ROWS_PER_BLOCK", "SLIDER_BATCHES", "SLIDER_KV_HEADS", "SLIDER_LENGTHS",
           "WORKLOAD_BATCHES", "WORKLOAD_KV_HEADS", "WORKLOAD_LENGTHS"]

SLIDER_BATCHES = (1, 2, 4, 8, 16, 32, 64, 128)
SLIDER_KV_HEADS = (1, 2, 4, 8, 16, 32)
SLIDER_LENGTHS = WORKLOAD_LENGTHS  # 1k to 128k keys, the lengths the rung is measured at
