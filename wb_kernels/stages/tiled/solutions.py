"""Worked solutions to lesson 03's exercises and its bug hunt. Try them first: the lesson's check cells tell you
when you are right."""

from .kernel import make_tiled_scores_kernel

answer_1 = 2 * 16 * 16 * (64 // 16)  # two tiles of 16 x 16 per step, D / T = 4 steps
answer_2 = 4 * (24 * 24 + 24 * 25)   # q_tile (T x T) and the padded k_tile (T x (T + 1)), float32
answer_3 = 1 + 7 + 1 + 1 + 7         # the max: 1 + log2(128), one more before the partials are reused; the sum: 1 + log2(128)


def make_scores_kernel(tile):
    """The bug hunt's kernel with its missing line back: ``cuda.syncthreads()`` right after the two tiles are
    loaded. Without it a thread multiplies tiles its neighbours have not finished writing (on the simulator, where
    each CUDA thread is a Python thread, the first threads even run before the others have started)."""
    return make_tiled_scores_kernel(tile)
