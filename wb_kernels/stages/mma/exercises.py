"""Lesson 06's exercises and its coding puzzle: what each answer must equal, the plausible wrong answers, and the
grader of the puzzle.

Every answer is computed from the package's models (the register budget, the ldmatrix loads of a launch variant, the
shared-memory layouts), so none is typed twice, and each asks for what the lesson does not print: another head dim,
another launch variant, the whole block instead of one tile. The puzzle, the online softmax on a warp's registers, is
graded by running the register-level model of the kernel with the learner's step and holding its output to the
float64 reference with ``wb.check``: no GPU needed. :data:`PUZZLE` lists the steps a learner would plausibly write
that are still wrong; tests/test_exercises.py feeds each to the grader. The worked answers are in ``solutions.py``
next to this file: open it when you want them.
"""

from __future__ import annotations

import numpy as np

from ...check import check as check_against_reference
from ...inputs import random_qkv
from ...exercises import Exercise, Puzzle, check_answers, check_puzzle, hands_copies
from . import swizzle, warp_model

__all__ = ["EXERCISES", "PUZZLE", "check", "check_fragment_softmax_puzzle", "puzzle_inputs", "softmax_step"]

# exercise 1: another head dim than the lesson's D = 64 and 128, at the default 32 rows per warp
_D_WIDE = 256


def _o_registers(head_dim: int, row_tiles: int) -> int:
    return warp_model.registers_per_lane(head_dim, row_tiles=row_tiles)["O accumulators (fp32)"]


def _default(head_dim: int):
    from .launcher import variant_for  # the stage's default launch variant (launcher imports build, not torch)

    return variant_for(head_dim)


def _ldmatrix_flops_per_byte(head_dim: int, *, q_reread: bool = True, row_tiles=None, block_n=None) -> float:
    """Tensor-core FLOPs per byte of ldmatrix traffic, per warp and key tile, of the default variant at `head_dim`."""
    variant = _default(head_dim)
    row_tiles = variant.row_tiles if row_tiles is None else row_tiles
    block_n = variant.block_n if block_n is None else block_n
    loads = warp_model.ldmatrix_per_key_tile(head_dim, row_tiles=row_tiles, block_n=block_n,
                                             q_in_registers=not q_reread)
    products = row_tiles * ((block_n // 8) * (head_dim // 16) + (head_dim // 8) * (block_n // 16))
    return products * 2 * 16 * 8 * 16 / (sum(loads.values()) * 4 * 8 * 16)


def _padding_bytes(head_dim: int, *, buffers: int = 2, with_q: bool = True) -> int:
    """Bytes lesson 05's padding would add to one block of the default variant: the Q tile and `buffers` stages of
    K and V tiles."""
    variant = _default(head_dim)
    tiles = ([variant.block_m] if with_q else []) + [variant.block_n] * (2 * buffers)
    return sum(swizzle.tile_bytes("padded", rows, head_dim) - swizzle.tile_bytes("swizzled", rows, head_dim)
               for rows in tiles)


EXERCISES = (
    Exercise("exercise 1", lambda: _o_registers(_D_WIDE, row_tiles=2),
             "O is (16 x row tiles) x D fp32 values per warp, spread evenly over its 32 lanes.",
             wrong={"16 rows per warp": lambda: _o_registers(_D_WIDE, row_tiles=1),
                    "the lesson's D = 128 at 32 rows": lambda: _o_registers(128, row_tiles=2),
                    "fp32 values of the warp, not per lane": 32 * _D_WIDE,
                    "two registers per fp32 value": lambda: 2 * _o_registers(_D_WIDE, row_tiles=2),
                    "255 (the cap, not the need)": 255}),
    Exercise("exercise 2", lambda: _ldmatrix_flops_per_byte(64),
             "Per warp and key tile of 128: count the ldmatrix.x4 of K, V and (re-read every tile) Q, 512 bytes each, "
             "and the mma.sync of both row tiles, 4096 FLOPs each.",
             wrong={"Q kept in registers (no re-read)": lambda: _ldmatrix_flops_per_byte(64, q_reread=False),
                    "16 rows per warp": lambda: _ldmatrix_flops_per_byte(64, row_tiles=1, q_reread=False),
                    "64-key tiles": lambda: _ldmatrix_flops_per_byte(64, block_n=64),
                    "the D = 128 default's": lambda: _ldmatrix_flops_per_byte(128),
                    "the H100's balance point": 32.0}),
    Exercise("exercise 3", lambda: _padding_bytes(128),
             "Lesson 05 pads every row of a tile by 8 elements of 2 bytes; the block holds a Q tile of block_m rows "
             "and two stages of a K and a V tile of block_n rows each.",
             wrong={"one 64-row tile": lambda: swizzle.tile_bytes("padded", 64, 128) - swizzle.tile_bytes(
                        "swizzled", 64, 128),
                    "K and V only": lambda: _padding_bytes(128, with_q=False),
                    "one stage of K and V": lambda: _padding_bytes(128, buffers=1),
                    "8 bytes per row": lambda: _padding_bytes(128) // 2,
                    "the swizzle's padding": 0}),
)


def check(answer_1, answer_2, answer_3) -> None:
    """Grade lesson 06's exercises (``...`` means not answered yet)."""
    check_answers(EXERCISES, answer_1, answer_2, answer_3)


def puzzle_inputs():
    """The puzzle's problem (torch fp16, 2 x 1 x 100 x 100, D = 64, causal): ragged key tiles; in batch 0 the
    first key is padding, so its row 0 sees no key at all; in batch 1 the first 70 keys are padding, so its rows
    see their first key only in the second tile; and a wide spread of scores (std 3), so each row's own max matters.

    Batch 1's scores are also all far below 0 (dimension 0 of its queries is -40 and of its keys 40: -200 each,
    about -290 in the kernel's log2 units, and every row's max below -170, -240 in log2 units): a step that returns
    its stand-in max 0 for a row without keys (in place of -inf) carries it into the second tile, where every
    p = 2^(s - 0) then underflows to 0 even in fp32."""
    import torch

    q, k, v = random_qkv(2, 1, 100, 64, dtype="float16", framework="torch", seed=6, std=3.0)
    keep = torch.ones(2, 100, dtype=torch.bool)
    keep[0, 0] = False
    keep[1, :70] = False
    q[1, ..., 0] = -40.0
    k[1, ..., 0] = 40.0
    return q, k, v, keep


@hands_copies
def check_fragment_softmax_puzzle(step) -> None:
    """Run the register-level model of the kernel (``warp_model.forward``) with the learner's `step` in place of
    ``fragment_softmax_step`` and check its output and LSE against the float64 reference. Prints one line."""
    import torch

    q, k, v, keep = puzzle_inputs()

    def run():
        with np.errstate(all="ignore"):  # a wrong step makes inf - inf or overflows: its verdict says so, not NumPy
            out, lse = warp_model.forward(q, k, v, causal=True, key_padding_mask=keep, dtype="float16",
                                          softmax_step=step)
        return check_against_reference("your fragment softmax", torch.from_numpy(np.asarray(out)).half(), q, k, v,
                        lse=np.asarray(lse), causal=True, key_padding_mask=keep, verbose=False,
                        raise_on_failure=False)

    check_puzzle("puzzle", run, hint="Each row's max must be the max over its four lanes (shuffle_xor with lane "
                                     "masks 1 and 2), and a row whose max is still -inf must subtract 0, not -inf.")


# --- the puzzle's plausible wrong answers, as data -------------------------------------------------------------

def _quad_max(x):
    return warp_model.quad_allreduce(x, np.maximum)


def _own_lane(x):
    return x


def _first_shuffle_only(x):  # xor 1 only: the max of two lanes of the row, not four
    return np.maximum(x, warp_model.shuffle_xor(x, 1))


def _whole_warp_max(x):  # one max for all 16 rows: exact on paper, but rows far below it underflow in fp16
    for lane_mask in (1, 2, 4, 8, 16):
        x = np.maximum(x, warp_model.shuffle_xor(x, lane_mask))
    return x


def softmax_step(reduce_row_max=_quad_max, *, guard: bool = True, exp=np.exp2, alpha_inverted: bool = False,
                 rescale_l: bool = True, quad_sum_every_tile: bool = False, p_from_old_max: bool = False,
                 return_safe_max: bool = False):
    """A version of the lesson's fragment softmax step with each of its pieces right or wrong: the defaults give a
    right step; every other setting is a mistake a learner could make (see :data:`PUZZLE`)."""

    def step(scores, m_old, l_old):
        m_new = np.maximum(m_old, reduce_row_max(scores.max(axis=-1)))
        m_safe = np.where(m_new == -np.inf, np.float32(0), m_new) if guard else m_new
        alpha = exp(m_safe - m_old) if alpha_inverted else exp(m_old - m_safe)
        reference = np.where(m_old == -np.inf, np.float32(0), m_old) if p_from_old_max else m_safe
        p = exp(scores - reference[..., None])
        part = p.sum(axis=-1)
        if quad_sum_every_tile:  # each lane then holds the row's whole sum, and the epilogue adds four of them
            part = warp_model.quad_allreduce(part, np.add)
        l_new = (l_old * alpha if rescale_l else l_old) + part
        return (m_safe if return_safe_max else m_new), l_new, p, alpha

    return step


PUZZLE = Puzzle(
    check=check_fragment_softmax_puzzle,
    solution="fragment_softmax_step",
    wrong={
        "the stub as shipped (each lane's own max, no guard)": lambda: softmax_step(_own_lane, guard=False),
        "quad max without the guard (NaN in rows whose first key comes late)": lambda: softmax_step(guard=False),
        "each lane's own max with the guard (lanes disagree on m)": lambda: softmax_step(_own_lane),
        "one max for the whole warp (rows far below it underflow)": lambda: softmax_step(_whole_warp_max),
        "one shuffle only (xor 1: two lanes of four)": lambda: softmax_step(_first_shuffle_only),
        "exp instead of exp2 (the scores carry log2 e already)": lambda: softmax_step(exp=np.exp),
        "alpha inverted (2^(m_new - m_old))": lambda: softmax_step(alpha_inverted=True),
        "l not rescaled by alpha": lambda: softmax_step(rescale_l=False),
        "the quad's sum every tile (the epilogue adds the four parts again)":
            lambda: softmax_step(quad_sum_every_tile=True),
        "p against the old max": lambda: softmax_step(p_from_old_max=True),
        "the guarded max returned as m_new (a row without keys carries m = 0)":
            lambda: softmax_step(return_safe_max=True),
    },
)
