"""Worked solutions to lesson 06's exercises and its puzzle. Try them first: the lesson's check cells tell you
when you are right."""

# 1. O at D = 256 with 32 rows per warp (2 row tiles): 2 x (256 / 8) tiles of 16 x 8, 4 fp32 registers each per lane;
#    more than the 255 registers a thread may have, before S, P, Q or any address.
answer_1 = 2 * (256 // 8) * 4

# 2. The D = 64 default (4 warps x 32 rows, 128-key tiles, Q re-read from shared memory), per warp and key tile:
#    ldmatrix.x4 of K: (128 / 16) x (64 / 16) = 32; of V: (128 / 16) x (64 / 16) = 32; of Q: 2 row tiles x 4 k-steps
#    = 8; 72 loads of 512 bytes. mma.sync: 2 row tiles x ((128 / 8) x (64 / 16) + (64 / 8) x (128 / 16)) = 256, of
#    2 x 16 x 8 x 16 = 4096 FLOPs each.
answer_2 = 256 * 4096 / (72 * 512)  # 28.4 FLOPs per byte

# 3. The D = 128 default block holds Q (128 rows) and two stages of K and V (64 rows each): 128 + 4 x 64 = 384 rows,
#    padded by 8 elements of 2 bytes each.
answer_3 = (128 + 4 * 64) * 8 * 2  # 6144 bytes

# The puzzle's solution is the package's own step (region fragment_softmax_step of warp_model.py), which the lesson
# shows beside the kernel's C++ version, well after the puzzle.
from .warp_model import fragment_softmax_step  # noqa: E402,F401
