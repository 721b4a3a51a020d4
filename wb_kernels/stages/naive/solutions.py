"""Worked solutions to lesson 02's exercises and its puzzle. Try them first: the lesson's check cells tell you
when you are right."""

import math

from numba import cuda, float32

answer_1 = 63 * 63 * 16 * 16 * 2 * 8     # ceil(1000 / 16) = 63 blocks each way, 256 threads each, B*H = 16 grids
answer_2 = 2 * 12 * 12288**2 * 4 / 2**30  # S alone: B * H * L^2 float32 numbers, in GiB
answer_3 = 3 * 2 * 8 * 1000**2 * 4 / 2**20  # three passes over S (max, sum, probabilities), 4 bytes each, in MiB


# The puzzle: lesson 02's row_softmax_kernel with the scale folded in. Every score is multiplied by `scale` where
# it is read; the maximum is the maximum of the scaled row, so that exp never sees a positive argument.
@cuda.jit
def scaled_row_softmax_kernel(scores,  # (B*H, Lq, Lk) float32 input: unscaled Q K^T, masked entries -inf
                              scale,   # float32 multiplier of the scores (positive)
                              probs,   # (B*H, Lq, Lk) float32 output P = softmax(scale * S) by rows
                              lse):    # (B*H, Lq) float32 output: log-sum-exp of each row of scale * S
    bh = cuda.blockIdx.x  # (batch, head) pair
    i = cuda.blockIdx.y * cuda.blockDim.x + cuda.threadIdx.x  # row (query)
    if i >= scores.shape[1]:
        return
    n = scores.shape[2]
    row_max = float32(-math.inf)  # pass 1: the maximum of the scaled row
    for j in range(n):
        row_max = max(row_max, scale * scores[bh, i, j])
    if row_max == -math.inf:  # the row sees no key: output 0, LSE -inf (never 0/0 = NaN)
        for j in range(n):
            probs[bh, i, j] = 0.0
        lse[bh, i] = -math.inf
        return
    total = float32(0.0)  # pass 2: the normaliser, every term in it before any division
    for j in range(n):
        total += math.exp(scale * scores[bh, i, j] - row_max)
    for j in range(n):  # pass 3: the probabilities
        probs[bh, i, j] = math.exp(scale * scores[bh, i, j] - row_max) / total
    lse[bh, i] = row_max + math.log(total)
