"""Worked solutions to the dashboard lesson's exercises and its timing puzzle. Try them first: the lesson's check cells tell you
when you are right."""

import statistics

answer_1 = 4 * 4 * 16 * 4096**2 * 128 / 2 / 0.5e-3 / 1e12  # causal: half of 4*B*H*L*L*D, over 0.5 ms, in TFLOP/s
answer_2 = 6144 / 2                                        # 4*L*L*D FLOPs / (2 bytes * 4*L*D): L/2
answer_3 = 312e12 / 1555e9                                 # FLOP/s over byte/s
answer_4 = "l2"                                            # 8 MiB stays in the L2 between back-to-back calls
answer_5 = (0.2324 - 0.18426) * 1e3                        # the file's B1 Hk32 wb.decode rows: write, no hold - read, hold


def time_it(fn, device, repeats=30):
    """The median time, in ms, of the device's work for one call of ``fn()``, from a clean L2 cache."""
    fn()  # warm-up: the first call compiles (and plans, and allocates)
    device.synchronize()
    samples = []
    for _ in range(repeats):
        device.sleep(300)  # hold the device: the flush, the events and fn's host work are all queued behind it
        device.flush_l2("read")  # evict the last call's data, leaving clean lines (nothing to write back)
        start, end = device.Event(), device.Event()
        start.record()  # after the flush: the window holds fn's kernel alone
        fn()
        end.record()
        end.synchronize()
        samples.append(start.elapsed_time(end))
    return statistics.median(samples)  # a slow run (an interrupt, a clock change) moves the mean, not the median
