"""Lesson 05's exercises: what each answer must equal (computed from the package when graded).

Exercise 1 is graded from the machine code: it compiles the kernel with nvcc and counts the HMMA instructions
(no GPU needed). The worked answers are in ``solutions.py`` next to this file: open it when you want them.
"""

from __future__ import annotations

from ... import cuda_build
from ...exercises import Exercise, check_answers
from .fragment_model import ulp

__all__ = ["EXERCISES", "check"]

EXERCISES = (
    Exercise("exercise 1", lambda: len(cuda_build.sass("sm_90", dtype="float16", head_dim=128, q_in_registers=False,
                                                       source=cuda_build.package_source())),
             "S: (D/16) x (64/16) WMMAs; PV: (64/16) x (D/16); two HMMA each."),
    Exercise("exercise 2", lambda: cuda_build.shared_memory_bytes(64, 4, True),
             "2 stages x 2 tiles x 64 rows x (64+8) x 2 bytes, plus 64 rows x (64+8) x (4 + 2) bytes, "
             "plus 2 x 64 x 4 + 64 x 4."),
    Exercise("exercise 3", lambda: float(ulp(1.0, "bfloat16")), "bf16 stores 7 bits after the leading 1."),
)


def check(answer_1, answer_2, answer_3) -> None:
    """Grade lesson 05's exercises (``...`` means not answered yet)."""
    check_answers(EXERCISES, answer_1, answer_2, answer_3)
