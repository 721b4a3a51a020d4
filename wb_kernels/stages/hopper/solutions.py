"""Worked solutions to lesson 09's exercises and its puzzle. Try them first: the lesson's check cells tell you
when you are right."""

# 1. Lq = 300, Lk = 500, bottom-right: query i sees keys j <= i + 200. The block of rows 128 .. 191 needs keys up to
#    its last row's diagonal, 191 + 200 = 391: 392 keys, in tiles of 64: ceil(392 / 64) = 7 (the kernel's n_tiles).
answer_1 = -(-(min(128 + 64, 300) + 500 - 300) // 64)  # 7

# 2. Element (13, 21) is byte 13 x 128 + 21 x 2 = 1706 of the box. Bits 7-9 of 1706 are 13 % 8 = 5; XORed into bits
#    4-6: chunk 21 // 8 = 2 of the row moves to chunk 2 ^ 5 = 7, the byte within the chunk stays (21 % 8) x 2 = 10.
answer_2 = 13 * 128 + ((2 ^ 5) << 4) + 10  # 1786

# 3. Row 37 is warp 37 // 16 = 2's row 5: lanes 4 x 5 .. 4 x 5 + 3 hold it (h = 0). Column 50 is 50 % 8 = 2 within its
#    8-column group: lane % 4 = 2 // 2 = 1. So lane 21 of warp 2: thread 2 x 32 + 21.
answer_3 = 2 * 32 + 4 * 5 + 1  # 85

# The puzzle: the producer waits on the empty barrier with the parity *before* the consumers' (phase ^ 1), so that its
# first lap, over slots nobody has read yet, does not wait; and it flips its phase each time the slot index wraps.
# That is the package's producer (region ring_loops of barrier_ring.py, shown in the lesson after the puzzle).
from .barrier_ring import producer as my_producer  # noqa: E402,F401
