"""Worked solutions to lesson 05's exercises. Try them first: the lesson's check cell tells you when you are right."""

answer_1 = 2 * (128 // 16 * 64 // 16 + 64 // 16 * 128 // 16)  # S and PV: 32 WMMAs each, 2 HMMA per WMMA
answer_2 = 2 * 2 * 64 * (64 + 8) * 2 + 64 * (64 + 8) * (4 + 2) + 2 * 64 * 4 + 64 * 4  # K/V stages, S and P scratch, bias, rows
answer_3 = 2.0 ** -7  # bf16 has 8 significant bits: the next number after 1 is 1 + 2^-7

# The puzzle's solution is the package's own tile kernel, which the lesson shows right after the puzzle
# (region wmma_tile_kernel of wmma_tile.cu).
from .tile import kernel_text  # noqa: E402

tile_kernel = kernel_text()
