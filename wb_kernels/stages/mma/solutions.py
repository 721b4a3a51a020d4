"""Worked solutions to lesson 06's exercises and its puzzle. Try them first: the lesson's check cells tell you
when you are right."""

answer_1 = 16 * 128 // 32  # O: 16 rows x 128 fp32 columns per warp, over 32 lanes: (128 / 8) tiles x 4 registers
answer_2 = (64 // 8) * (128 // 16) + (128 // 8) * (64 // 16)  # S: 8 tiles x 8 k-steps; P V: 16 tiles x 4 k-steps
answer_3 = 8  # 256-byte rows: every row of a chunk column starts in the same four banks, so 8 passes

# The puzzle's solution is the package's own step, which the lesson shows right after the puzzle
# (region fragment_softmax_step of warp_model.py).
from .warp_model import fragment_softmax_step  # noqa: E402,F401
