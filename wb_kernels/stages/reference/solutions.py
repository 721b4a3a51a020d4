"""Worked solutions to lesson 01's exercises. Try them first: the lesson's check cell tells you when you are right."""

import math

answer_1 = 2 * 8 * 32 * 8192**2 * 2 / 2**30  # two matrices x B x H x L^2 x 2 bytes, in GiB
answer_2 = math.log(65504.0)                 # float16's largest finite value is 65504
answer_3 = 1000 * 1001 // 2                  # row i sees i + 1 keys: 1 + 2 + ... + 1000
