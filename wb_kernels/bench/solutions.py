"""Worked solutions to lesson 08's exercises. Try them first: the lesson's check cell tells you when you are right."""

answer_1 = 4 * 4 * 16 * 4096**2 * 128 / 2 / 0.5e-3 / 1e12  # causal: half of 4*B*H*L*L*D, over 0.5 ms, in TFLOP/s
answer_2 = 4096 / 2                                        # 4*L*L*D FLOPs / (2 bytes * 4*L*D): L/2
answer_3 = 760e12 / 2970e9                                 # FLOP/s over byte/s
answer_4 = "async"                                         # only the launch was timed: no synchronize
