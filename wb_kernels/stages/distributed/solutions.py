"""Worked solutions to lesson 10's exercises and its puzzle. Try them first: the lesson's check cells tell you
when you are right."""

import torch

# Contiguous shards, causal: W / (2W - 1) = 16 / 31.
answer_1 = 16 / 31
# n = (Hk x 2 bytes) / (2 H x 1/2) x FLOP/s / bytes/s = (8 x 2) / (2 x 32 x 0.5) x 600e12 / 64e9 = 0.5 x 9375.
answer_2 = (8 * 2) / (2 * 32 * 0.5) * 600e12 / 64e9
# Rank 2 of 8 holds query chunks 2 and 13 of 16 (zigzag: r and 2W - 1 - r). The later, chunk 13, sees key chunks
# 0..12 in full, its own (13) by half, and skips 14 and 15.
answer_3 = 13
# Ring: 7 blocks x 2 x Hk = 112 head-blocks; Ulysses: (2 x 32 + 2 x 8) x 7/8 = 70 head-blocks (of L/W tokens, D wide).
answer_4 = (7 * 2 * 8) / ((2 * 32 + 2 * 8) * 7 / 8)


def merge_step(acc_out, acc_lse, out, lse):
    """Fold one block's partial (out, lse) into the accumulator (acc_out, acc_lse): the log-sum-exp merge of two
    partials over disjoint keys, shifted by the larger LSE, with rows where both sides are empty left at 0, -inf."""
    top = torch.maximum(acc_lse, lse)
    seen = torch.isfinite(top)  # False where neither side has seen a key yet
    shift = torch.where(seen, top, torch.zeros_like(top))  # no -inf - -inf
    w_acc, w_new = torch.exp(acc_lse - shift), torch.exp(lse - shift)  # the larger is 1: no overflow
    total = torch.where(seen, w_acc + w_new, torch.ones_like(top))
    merged = (w_acc[..., None] * acc_out + w_new[..., None] * out) / total[..., None]
    return merged, torch.where(seen, top + torch.log(total), top)
