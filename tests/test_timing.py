"""Timing and peak-memory helpers measure what they claim (CPU path here, CUDA path on a GPU)."""

import time

import numpy as np
import pytest

import wb_kernels as wb
from wb_kernels.timing import Timing, on_gpu


def test_time_call_warms_up_and_repeats():
    calls = []

    def work(seconds):
        calls.append(seconds)
        time.sleep(seconds)

    t = wb.time_call(work, 0.01, warmup=2, repeats=5)
    assert len(calls) == 7 and len(t.samples_ms) == 5
    assert 9.0 <= t.median_ms < 60.0  # a 10 ms sleep, with scheduler slack
    assert t.min_ms <= t.median_ms <= t.max_ms and t.iqr_ms >= 0


def test_time_call_sees_a_slower_call():
    # 25 times longer: a busy machine (a GPU check runs tests beside the lessons) stretches a short sleep by
    # milliseconds, which a factor of 10 between the two did not survive on the H100 host
    fast = wb.time_call(time.sleep, 0.002, warmup=0, repeats=5).median_ms
    slow = wb.time_call(time.sleep, 0.05, warmup=0, repeats=5).median_ms
    assert slow > 5 * fast


def test_timing_statistics():
    t = Timing((1.0, 2.0, 3.0, 4.0, 100.0))
    assert t.median_ms == 3.0 and t.min_ms == 1.0 and t.max_ms == 100.0
    assert t.iqr_ms < 60  # the outlier barely moves the spread measure
    assert "median 3.000 ms" in str(t)


def test_time_call_rejects_bad_arguments():
    with pytest.raises(ValueError):
        wb.time_call(lambda: None, repeats=0)


def test_peak_memory_counts_allocations():
    n = 4_000_000  # 32 MB of float64
    result, use = wb.peak_memory(lambda: np.ones(n).sum(), device="host")
    assert result == n
    assert 0.95 * 8 * n <= use.peak_bytes <= 1.2 * 8 * n
    _, small = wb.peak_memory(lambda: np.ones(10).sum(), device="host")
    assert small.peak_bytes < 10_000


def test_peak_memory_of_the_reference_grows_as_l_squared():
    peaks = []
    for L in (128, 256):
        q, k, v = wb.random_qkv(1, 1, L, 16, dtype="float64")
        peaks.append(wb.peak_memory(wb.reference, q, k, v, device="host")[1].peak_bytes)
    assert 3.5 < peaks[1] / peaks[0] < 4.5


@pytest.mark.skipif(not on_gpu(), reason="CUDA events and the caching allocator need a GPU")
def test_cuda_timing_and_memory():
    import torch

    x = torch.randn(4096, 4096, device="cuda")
    small = wb.time_call(torch.mm, x[:512, :512], x[:512, :512], repeats=10, flush_l2=True)
    big = wb.time_call(torch.mm, x, x, repeats=10, flush_l2=True)
    assert small.device == "cuda" and big.median_ms > 4 * small.median_ms
    _, use = wb.peak_memory(lambda: torch.empty(2**26, device="cuda").fill_(1))
    assert 2**28 <= use.peak_bytes <= 2**28 + 2**21


def test_a_timing_method_is_the_mapping_of_time_calls_keywords_and_round_trips_through_a_record():
    from wb_kernels.timing import DEVICE_TIME, EVENTS_AROUND_CALL, TimingMethod

    for method in (DEVICE_TIME, EVENTS_AROUND_CALL):
        record = dict(method)
        assert list(record) == ["flush_l2", "flush_mode", "hold_us"]  # the order a results file has always had
        assert TimingMethod.from_record(record) == method and len(method) == 3
    with pytest.raises(KeyError):
        DEVICE_TIME["label"]
    assert wb.time_call(lambda: None, warmup=0, repeats=2, device="cpu", **DEVICE_TIME).device == "cpu"
