"""Lesson 10's exercises and its coding puzzle: what each answer must equal, and the grader of the puzzle.

Every answer is computed from the package (``sharding.py``'s ceiling and layouts, ``slider.py``'s overlap
condition and communication volumes), so none is typed twice. The puzzle, the merge step each rank runs after every
ring step, is graded by running the ring in one process (:func:`.slider.simulate_ring`, four ranks, zigzag, causal)
with the learner's merge and holding the output and LSE to the float64 reference with ``wb.check``: no GPU and no
torch.distributed needed. The worked answers are in ``solutions.py`` next to this file: open it when you want them.
"""

from __future__ import annotations

import math

import numpy as np

from ...check import check as check_against_reference
from ...inputs import random_qkv
from ...reference import reference
from ...check import CheckResult
from ...exercises import Exercise, Puzzle, check_answers, check_puzzle, hands_copies, merged_lse_allowance
from .sharding import causal_ceiling
from .slider import LINKS, chunk_pair_map, communication_bytes, overlap_tokens, simulate_ring

__all__ = ["EXERCISES", "PUZZLE", "check", "check_merge_step_puzzle", "puzzle_inputs", "later_chunk_full_pairs",
           "PUZZLE_WORLD", "PUZZLE_SCALE"]

PCIE = LINKS["PCIe Gen5 x16"]


def later_chunk_full_pairs(world: int, rank: int, layout: str = "zigzag") -> int:
    """Against how many key chunks the later of `rank`'s two query chunks runs a full call (every (query, key) pair
    visible under the causal mask: not skipped, not the diagonal's half). It depends on which chunks the layout gives
    the rank: unlike the rank's total work, which zigzag makes the same for every rank."""
    m = chunk_pair_map(2 * world * 4, world, layout)
    later = int(np.flatnonzero(m["owner"] == rank).max())
    return int((m["visible"][later] == 1.0).sum())


EXERCISES = (
    Exercise("exercise 1", lambda: causal_ceiling(16),
             "Contiguous shards under a causal mask: the last rank does W - 1/2 blocks while the average is W/2.",
             wrong={"W = 8's ceiling, which the lesson prints": lambda: causal_ceiling(8),
                    "the limit for large W": 0.5,
                    "1 / (2W - 1)": 1 / 31,
                    "(W - 1) / W": 15 / 16}),
    Exercise("exercise 2", lambda: overlap_tokens(600, PCIE, H=32, Hk=8, dtype_bytes=2, causal=True),
             "Compute per step: 4 n^2 D H, halved under a balanced causal mask; transfer: 2 n D Hk x 2 bytes each way.",
             wrong={"MHA without a mask, the lesson's figure": lambda: overlap_tokens(600, PCIE),
                    "the causal halving forgotten": lambda: overlap_tokens(600, PCIE, H=32, Hk=8),
                    "the GQA ratio forgotten": lambda: overlap_tokens(600, PCIE, causal=True),
                    "the causal mask taken to halve the tokens instead of doubling them":
                        lambda: overlap_tokens(600, PCIE, H=32, Hk=8) / 2,
                    "on NVLink": lambda: overlap_tokens(600, LINKS["NVLink 4 (H100 SXM, 18 links)"], H=32, Hk=8,
                                                        causal=True)}),
    Exercise("exercise 3", lambda: later_chunk_full_pairs(8, 2, "zigzag"),
             "Rank r holds query chunks r and 2W - 1 - r; a query chunk sees the key chunks before it in full, its own "
             "by half, and none after it.",
             wrong={"the earlier chunk's (chunk 2)": 2,
                    "both of its chunks together (the same for every rank)": 15,
                    "the diagonal counted as full": lambda: later_chunk_full_pairs(8, 2, "zigzag") + 1,
                    "contiguous shards (rank 2's later chunk is chunk 5)": lambda: later_chunk_full_pairs(
                        8, 2, "contiguous"),
                    "rank 5's later chunk (chunk 10), not rank 2's": lambda: later_chunk_full_pairs(
                        8, 5, "zigzag"),
                    "the key chunks it skips": 2}),
    Exercise("exercise 4", lambda: communication_bytes("ring", 1 << 17, 8, H=32, Hk=8, D=128)
             / communication_bytes("ulysses", 1 << 17, 8, H=32, Hk=8, D=128),
             "Ring: W - 1 blocks of K and V (2 Hk heads) of L/W tokens. Ulysses: q, k, v and the output "
             "(2H + 2Hk heads) of L/W tokens, (W - 1)/W of each sent away.",
             wrong={"MHA's ratio, W / 2": 4.0,
                    "upside down": lambda: communication_bytes("ulysses", 1 << 17, 8, H=32, Hk=8, D=128)
                    / communication_bytes("ring", 1 << 17, 8, H=32, Hk=8, D=128),
                    "the output's all-to-all left out of Ulysses": 8 * 7 * 2 * 8 / ((32 + 2 * 8) * 7),
                    "W - 1 blocks against one": 7.0}),
)


def check(answer_1, answer_2, answer_3, answer_4) -> None:
    """Grade lesson 10's exercises (``...`` means not answered yet)."""
    check_answers(EXERCISES, answer_1, answer_2, answer_3, answer_4)


PUZZLE_WORLD = 4
PUZZLE_SCALE = 120.0  # scores up to about two thousand: exp(lse) overflows float64, as a merge must not


def puzzle_inputs():
    """The puzzle's problem (float64 torch tensors, B = 2, H = 2 query heads sharing Hk = 1, 37 positions, D = 16,
    top-left causal): key 0 of sequence 0 is padding, so that row 0 sees no key at all; sequence 1 is all padding,
    so every partial of it is empty (out 0, LSE -inf); 37 is not a multiple of 2W, so the zigzag chunks differ in
    length; and a large scale puts LSEs near two thousand."""
    import torch

    q, k, v = random_qkv(2, 2, 37, 16, dtype="float64", seed=9)
    q, k, v = (torch.as_tensor(x) for x in (q, k, v))
    k, v = k[:, :1].contiguous(), v[:, :1].contiguous()
    keep = torch.ones(2, 37, dtype=torch.bool)
    keep[0, 0] = False
    keep[1] = False
    return q, k, v, keep


@hands_copies
def check_merge_step_puzzle(merge_step) -> None:
    """Run the ring of :func:`.slider.simulate_ring` on the puzzle's problem (4 ranks, zigzag, causal) with the
    learner's ``merge_step(acc_out, acc_lse, out, lse) -> (out, lse)`` folding each block's partial into each
    rank's accumulator, and check output and LSE against the float64 reference. Prints one line."""
    import torch

    q, k, v, keep = puzzle_inputs()

    def run():
        try:
            out, lse, _ = simulate_ring(q, k, v, PUZZLE_WORLD, layout="zigzag", causal=True, key_padding_mask=keep,
                                        scale=PUZZLE_SCALE, merge=merge_step)
        except Exception as error:  # a shape or dtype mistake: say which, rather than a traceback from the model
            return _Failed(f"the merge raised {type(error).__name__}: {error}")
        out, lse = torch.as_tensor(out, dtype=torch.float64), torch.as_tensor(lse, dtype=torch.float64)
        if torch.isnan(out).any() or torch.isnan(lse).any():
            return CheckResult("your merge", math.nan, 0.0)  # a NaN is never right
        ref = reference(q.numpy(), k.numpy(), v.numpy(), causal=True, key_padding_mask=keep.numpy(),
                           scale=PUZZLE_SCALE)
        result = check_against_reference("your merge", out.numpy(), q.numpy(), k.numpy(), v.numpy(), lse=lse.numpy(), causal=True,
                          key_padding_mask=keep.numpy(), scale=PUZZLE_SCALE, ref=ref, verbose=False,
                          raise_on_failure=False)
        # the hint's formula, exp(lse_side - lse) with the merged lse, carries that lse's rounding (near two
        # thousand: ~1e-13) into every merge's weights: a right merge, which the 2x rule alone would reject
        allowance = merged_lse_allowance(ref[1], v.numpy(), merges=2 * PUZZLE_WORLD)
        return CheckResult(result.name, result.max_err, result.tol + allowance, result.lse_err, result.lse_tol)

    check_puzzle("puzzle", run, hint="Subtract the larger of the two LSEs before exp; weigh each side by "
                                     "exp(lse_side - lse) with lse = max + log(sum of the weights); where both "
                                     "sides are -inf keep 0 and -inf, never NaN.")


class _Failed:
    passed = False

    def __init__(self, reason):
        self.reason = reason


# ---------------------------------------------------------------- the plausible wrong merges, as data

def _stub(acc_out, acc_lse, out, lse):  # the lesson's cell as shipped: the accumulator kept, every block lost
    return acc_out, acc_lse


def _replace(acc_out, acc_lse, out, lse):  # the newest block wins: only the last step's keys count
    return out, lse


def _without_the_max(acc_out, acc_lse, out, lse):  # exact on paper; exp(lse) overflows at the puzzle's scores
    import torch

    wa, wb_ = torch.exp(acc_lse), torch.exp(lse)
    total = wa + wb_
    return (wa[..., None] * acc_out + wb_[..., None] * out) / total[..., None], torch.log(total)


def _without_the_guard(acc_out, acc_lse, out, lse):  # right wherever a key was seen; NaN where both are -inf
    import torch

    top = torch.maximum(acc_lse, lse)
    wa, wb_ = torch.exp(acc_lse - top), torch.exp(lse - top)
    total = wa + wb_
    return (wa[..., None] * acc_out + wb_[..., None] * out) / total[..., None], top + torch.log(total)


def _guarded(acc_lse, lse):
    import torch

    top = torch.maximum(acc_lse, lse)
    seen = torch.isfinite(top)
    shift = torch.where(seen, top, torch.zeros_like(top))
    wa, wb_ = torch.exp(acc_lse - shift), torch.exp(lse - shift)
    total = torch.where(seen, wa + wb_, torch.ones_like(top))
    return top, seen, wa, wb_, total


def _not_normalised(acc_out, acc_lse, out, lse):  # weights exp(lse - max), the division by their sum forgotten
    import torch

    top, seen, wa, wb_, total = _guarded(acc_lse, lse)
    merged = wa[..., None] * acc_out + wb_[..., None] * out
    return merged, torch.where(seen, top + torch.log(total), top)


def _max_as_lse(acc_out, acc_lse, out, lse):  # the output merged right, the larger LSE passed on as the row's
    top, seen, wa, wb_, total = _guarded(acc_lse, lse)
    return (wa[..., None] * acc_out + wb_[..., None] * out) / total[..., None], top


def _larger_side_only(acc_out, acc_lse, out, lse):  # keep whichever side has the larger LSE: a max, not a sum
    import torch

    take = lse > acc_lse
    return torch.where(take[..., None], out, acc_out), torch.where(take, lse, acc_lse)


def _plain_average(acc_out, acc_lse, out, lse):  # both sides weigh the same, whatever mass they carry
    top, seen, wa, wb_, total = _guarded(acc_lse, lse)
    import torch

    return (acc_out + out) / 2, torch.where(seen, top + torch.log(total), top)


PUZZLE = Puzzle(
    check=check_merge_step_puzzle,
    solution="merge_step",
    answers=("wb_kernels.stages.distributed.merge:merge_stack",),  # the merge of S parts: of two, the answer
    wrong={"the stub as shipped": lambda: _stub,
           "the newest block replaces the accumulator": lambda: _replace,
           "without the max: exp(lse) overflows": lambda: _without_the_max,
           "without the guard: NaN where both sides are -inf": lambda: _without_the_guard,
           "weights not normalised": lambda: _not_normalised,
           "the larger LSE used as the merged LSE": lambda: _max_as_lse,
           "the side with the larger LSE kept, the other dropped": lambda: _larger_side_only,
           "a plain average of the two outputs": lambda: _plain_average},
)
