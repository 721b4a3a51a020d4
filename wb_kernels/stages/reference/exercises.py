"""Lesson 01's exercises and its coding puzzle: what each answer must equal (computed from the package when
graded), the puzzle's grader, and the plausible wrong answers each must reject.

The worked answers (and a solution to the puzzle) are in ``solutions.py`` next to this file: open it when you
want them.
"""

from __future__ import annotations

import math
import warnings
from functools import partial

import numpy as np

from ...check import check as check_against_reference
from ...inputs import random_padding_mask, random_qkv
from ...exercises import Exercise, Puzzle, check_answers, hands_copies
from .slider import attention_probabilities, materialized_bytes

__all__ = ["EXERCISES", "PUZZLE", "check", "check_attention_puzzle", "puzzle_problems"]


def _causal_pairs(L: int) -> int:
    ones = np.ones((1, 1, L, 1))
    return int(attention_probabilities(ones, ones, causal=True).astype(bool).sum())


def _largest_equal_logit(dtype=np.float16, L: int = 1000) -> float:
    """The largest logit s for which the textbook softmax's sum of L terms e^s stays finite in `dtype`:
    L * e^s <= max, so s = ln(max / L) (computed in float64: np.log of a float16 rounds to float16)."""
    return math.log(float(np.finfo(dtype).max) / L)


EXERCISES = (
    Exercise("exercise 1", lambda: materialized_bytes(8192, B=8, H=32, itemsize=2) / 2**30,
             "Two matrices, B*H*L*L entries each, 2 bytes per float16; GiB = bytes / 2**30.",
             wrong={"float32 (4 bytes)": lambda: materialized_bytes(8192, B=8, H=32, itemsize=4) / 2**30,
                    "S alone": lambda: materialized_bytes(8192, B=8, H=32, itemsize=2) / 2 / 2**30,
                    "GB, not GiB": lambda: materialized_bytes(8192, B=8, H=32, itemsize=2) / 1e9}),
    Exercise("exercise 2", _largest_equal_logit,
             "The sum of 1000 equal terms is 1000 * e^s; it must stay at most float16's largest finite value.",
             wrong={"one term's limit, ln 65504": lambda: _largest_equal_logit(L=1),
                    "ln 65504 rounded in float16": 11.09375,
                    "float32's limit": lambda: _largest_equal_logit(np.float32),
                    "log10": lambda: math.log10(float(np.finfo(np.float16).max) / 1000)}),
    Exercise("exercise 3", lambda: _causal_pairs(1000), "Row i sees keys 0..i.",
             wrong={"L^2 / 2": 500000, "without the diagonal": 1000 * 999 // 2, "no mask": 1000 * 1000}),
)


def check(answer_1, answer_2, answer_3) -> None:
    """Grade lesson 01's exercises (``...`` means not answered yet)."""
    check_answers(EXERCISES, answer_1, answer_2, answer_3)


# --- the puzzle: bottom-right causal attention with key padding, in NumPy ------------------------------------

def puzzle_problems():
    """The grader's problems, each (q, k, v, key_padding_mask): float32, every one with Lq != Lk (top-left and
    bottom-right alignment differ), a batch element whose keys are all padding (its rows must give zeros), and
    logits up to the thousands (exp overflows there in float32 and in float64 without the max subtracted)."""
    problems = []
    for Lq, Lk, seed in ((6, 9, 21), (9, 5, 22)):  # Lq < Lk (decoding with a cache), then Lq > Lk
        q, k, v = random_qkv(2, 2, Lq, 16, Lk=Lk, seed=seed, std=20.0)
        mask = random_padding_mask(2, Lk, seed=seed)
        mask[0, :3] = True  # batch element 0 keeps some keys ...
        mask[1] = False     # ... and batch element 1 none: its rows see no key
        problems.append((q, k, v, mask))
    return problems


@hands_copies
def check_attention_puzzle(my_attention) -> None:
    """Run the learner's ``my_attention(q, k, v, key_padding_mask)`` on the puzzle's problems and hold each output
    to the float64 reference (``causal="bottom_right"``) with ``wb.check``'s rule, in float32. Prints one line."""
    for q, k, v, mask in puzzle_problems():
        with warnings.catch_warnings(), np.errstate(all="ignore"):
            # overflows and 0/0 are the symptoms of the mistakes this puzzle catches: the verdict says it
            warnings.simplefilter("ignore", RuntimeWarning)
            out = np.asarray(my_attention(q, k, v, mask), dtype=np.float32)
        result = check_against_reference("your attention", out, q, k, v, causal="bottom_right", key_padding_mask=mask,
                          verbose=False, raise_on_failure=False)
        if not result.passed:
            print(f"puzzle: not solved yet: the output (Lq={q.shape[2]}, Lk={k.shape[2]}) does not match the "
                  "float64 reference. Query i sees key j when j <= i + Lk - Lq and the key is not padding; "
                  "subtract each row's maximum before exp; a row that sees no key gives zeros.")
            return
    print("puzzle: solved ✓ (the output matches the float64 reference)")


def _attention(q, k, v, key_padding_mask, *, alignment="bottom_right", subtract_max=True, guard=True,
               scale=True, masked_value=-np.inf, padding=True, offset_shift=0):
    """The puzzle's answer with one of the lesson's mistakes switched on (the wrong answers below)."""
    Lq, Lk = q.shape[2], k.shape[2]
    scores = np.einsum("bhqd,bhkd->bhqk", q, k) * (1 / math.sqrt(q.shape[-1]) if scale else 1.0)
    offset = (Lk - Lq if alignment == "bottom_right" else 0) + offset_shift
    allowed = np.tri(Lq, Lk, k=offset, dtype=bool)[None, None]
    if padding:
        allowed = allowed & key_padding_mask[:, None, None, :]
    scores = np.where(allowed, scores, masked_value)
    row_max = scores.max(axis=-1, keepdims=True) if subtract_max else 0.0
    if guard and subtract_max:
        row_max = np.where(np.isfinite(row_max), row_max, 0.0)
    e = np.exp(scores - row_max)
    total = e.sum(axis=-1, keepdims=True)
    probs = np.divide(e, total, out=np.zeros_like(e), where=total != 0) if guard else e / total
    return np.einsum("bhqk,bhkd->bhqd", probs, v)


def _overwrites_v(q, k, v, key_padding_mask):  # zeroes v, returns zeros: were v the grader's own array, the
    v[...] = 0.0                                 # reference would be zeros too, and "match"
    return np.zeros(q.shape)


PUZZLE = Puzzle(
    check=check_attention_puzzle,
    solution="my_attention",
    wrong={  # each builds the function a learner might write, with one mistake
        "the textbook softmax (no max subtracted): overflows": lambda: partial(_attention, subtract_max=False),
        "top-left causal alignment": lambda: partial(_attention, alignment="top_left"),
        "a fully masked row gives NaN (no guard)": lambda: partial(_attention, guard=False),
        "forgets the scale": lambda: partial(_attention, scale=False),
        "masked logits set to 0 instead of -inf": lambda: partial(_attention, masked_value=0.0),
        "ignores the key padding": lambda: partial(_attention, padding=False),
        "off by one: j < i + Lk - Lq": lambda: partial(_attention, offset_shift=-1),
        "the stub as shipped (zeros)": lambda: lambda q, k, v, key_padding_mask: np.zeros(q.shape),
        "v overwritten with zeros, zeros returned (the inputs are the grader's?)": lambda: _overwrites_v,
    },
)
