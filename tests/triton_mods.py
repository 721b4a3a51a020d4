"""score_mod / mask_mod functions the triton stage's tests share, in a file of their own so that a compiling
process (``compiled.compile_report``, ``TRITON_INTERPRET=0``) can load them by path as well as the tests' own process:
Triton compiles a jit function from its source file. Each uses triton.language only (no helper of the kernels)."""

import triton
import triton.language as tl

HEADS = tl.constexpr(2)


@triton.jit
def alibi_mod(score, b, h, q_idx, kv_idx):
    slope = tl.exp2(-8.0 * (h + 1).to(tl.float32) / HEADS)
    return score - slope * tl.abs(kv_idx - q_idx).to(tl.float32)


@triton.jit
def unit_derivative(score, b, h, q_idx, kv_idx):
    return 1.0  # a constant: a mod that adds a term independent of the score


@triton.jit
def causal_mask(b, h, q_idx, kv_idx):
    return kv_idx <= q_idx


# wrong answers the kernels must refuse, not broadcast

@triton.jit
def summed_score_mod(score, b, h, q_idx, kv_idx):
    return tl.sum(score, 1)  # one number per row: it would spread over the row's keys


@triton.jit
def integer_score_mod(score, b, h, q_idx, kv_idx):
    return (score > 0).to(tl.int32)


@triton.jit
def numeric_mask(b, h, q_idx, kv_idx):
    return (kv_idx <= q_idx).to(tl.int32)


@triton.jit
def row_mask(b, h, q_idx, kv_idx):
    return tl.sum((kv_idx <= q_idx).to(tl.int32), 1) > 0
