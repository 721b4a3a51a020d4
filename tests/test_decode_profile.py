"""The decode rung's profile (``wb_kernels.stages.decode.profile``): what it reads from ncu's details page, and the
command it runs. The profile itself needs a GPU and ncu; its committed run is ``results/decode/ncu_mma_h100.json``."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from wb_kernels.stages.decode import profile

# Lines of an H100 run's ``ncu -i <report> --page details`` (2026-11-26, the 4-warp mma kernel, MQA B8 Lk8192 with
# 16 splits), trimmed to the metrics the parser reads and a line it must not read (the percent "Memory Throughput")
DETAILS = """\
==PROF== Connected to process 1234
  void decode_mma_kernel<__half, 128, 2, 0>(DecodeParams) (8, 16, 1)x(128, 1, 1), Context 1, Stream 7, Device 0, CC 9.0
    Section: GPU Speed Of Light Throughput
    SM Frequency                    Ghz         1.49
    Memory Throughput                 %        40.63
    DRAM Throughput                   %        40.63
    Duration                         us        26.18
    Memory Throughput                          Tbyte/s         1.36
    L2 Hit Rate                                      %        52.95
    Issued Warp Per Scheduler                        0.21
    Warp Cycles Per Issued Instruction             cycle         4.81
    Registers Per Thread             register/thread             168
    Achieved Occupancy                        %         6.07
  void decode_merge_kernel<__half, 128>(const float *, const float *, T1 *, float *, int, int) (256, 1, 1)x(128, 1, 1), Context 1, Stream 7, Device 0, CC 9.0
    SM Frequency                    Ghz         1.58
    Memory Throughput                 %        10.23
    DRAM Throughput                   %        10.23
    Duration                         us         6.24
    Memory Throughput                          Gbyte/s       341.46
    L2 Hit Rate                                      %        35.05
    Issued Warp Per Scheduler                        0.08
    Registers Per Thread             register/thread              40
"""


def test_the_details_page_gives_each_kernels_numbers():
    mma, merge = profile.parse_details(DETAILS)
    assert (mma["kernel"], mma["grid"], mma["threads"]) == ("mma", [8, 16, 1], 128)
    assert mma["duration_us"] == 26.18 and mma["dram_throughput_pct"] == 40.63 and mma["dram_bytes_per_s"] == 1.36e12
    assert mma["dram_bytes"] == round(1.36e12 * 26.18e-6)  # about 35.6 MB: K and V (33.6 MB) read once, and more
    assert (mma["l2_hit_rate_pct"], mma["issued_warps_per_scheduler"], mma["warp_cycles_per_issue"]) == (52.95, 0.21, 4.81)
    assert (mma["registers"], mma["achieved_occupancy_pct"], mma["sm_frequency_ghz"]) == (168, 6.07, 1.49)
    assert (merge["kernel"], merge["grid"], merge["dram_bytes_per_s"]) == ("merge", [256, 1, 1], 341.46e9)
    assert merge["warp_cycles_per_issue"] is None and merge["achieved_occupancy_pct"] is None  # absent: None, not 0


def test_a_page_without_a_decode_kernel_gives_nothing():
    assert profile.parse_details("==PROF== Disconnected\n  void other_kernel<float>(int) (1, 1, 1)x(32, 1, 1)\n") == []


def test_the_ncu_command_profiles_one_child_process_from_its_profiler_start():
    command = profile.ncu_command("ncu", Path("/x/report"), (8, 32, 1, 8192, 0))
    assert command[:5] == ["ncu", "--profile-from-start", "off", "--set", "full"]
    assert "wb_kernels.stages.decode.profile" in command
    assert command[command.index("-o") + 1] == "/x/report" and command[-2:] == ["--child", "8,32,1,8192,0"]


def test_the_committed_profile_is_what_the_lesson_reads():
    """Every point of POINTS is in the committed run (its splits: the launcher's of that commit, or the point's),
    each with the mma kernel's row, and every row carries the numbers lesson 07 prints."""
    path = Path(__file__).resolve().parents[1] / "results" / "decode" / "ncu_mma_h100.json"
    data = json.loads(path.read_text())
    assert data["kind"] == "decode_ncu_mma" and "H100" in data["environment"]["gpu"]
    shapes = {(r["B"], r["H"], r["Hk"], r["Lk"]) for r in data["records"] if r["kernel"] == "mma"}
    assert shapes == {point[:4] for point in profile.POINTS}
    for row in data["records"]:
        for key in ("splits", "grid", "duration_us", "dram_bytes", "issued_warps_per_scheduler"):
            assert row[key] is not None, (row["kernel"], key)


def test_without_a_gpu_the_profile_says_so_and_stops(capsys):
    import wb_kernels

    if wb_kernels.BACKEND.is_gpu:
        pytest.skip("on a GPU the profile would run")
    assert profile.main([]) == 2
    assert "needs a CUDA GPU" in capsys.readouterr().err
