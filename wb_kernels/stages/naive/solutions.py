"""Worked solutions to lesson 02's exercises and its puzzle. Try them first: the lesson's check cells tell you
when you are right."""

answer_1 = 63 * 63 * 16 * 16 * 2 * 8  # ceil(1000 / 16) = 63 blocks each way, 256 threads each, B*H = 16 grids
answer_2 = 16 * 16384**2 * 4 / 2**30  # H * L^2 float32 numbers, in GiB
answer_3 = 3                          # the max, the sum, the probabilities: three loops over the row

# The puzzle's solution is the package's own kernel, which the lesson shows right after the puzzle
# (region row_softmax_kernel of kernel.py): three passes, and zeros for a row that sees no key.
from .kernel import row_softmax_kernel  # noqa: E402,F401
