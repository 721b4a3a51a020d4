"""Lesson 10's figure, model and slider logic (wb_kernels/stages/distributed/slider.py), without a browser and
without torch.distributed: the ring in one process, the block map, the overlap condition, the communication
volumes, the launcher's time limit and summary, and the bars read from a scaling file's records."""

from __future__ import annotations

import math
import sys

import numpy as np
import pytest
import torch
from matplotlib.figure import Figure

import wb_kernels as wb
from wb_kernels.stages.distributed import sharding, slider


def _qkv(B=2, H=4, Hk=2, Lq=23, Lk=23, D=8, seed=0):
    q = torch.as_tensor(wb.random_qkv(B, H, Lq, D, dtype="float64", seed=seed)[0])
    _, k, v = (torch.as_tensor(x) for x in wb.random_qkv(B, Hk, Lk, D, dtype="float64", seed=seed + 1))
    return q, k, v


@pytest.mark.parametrize("layout", sharding.LAYOUTS)
@pytest.mark.parametrize("causal", [False, "top_left", "bottom_right"])
@pytest.mark.parametrize("lengths", [(23, 23), (17, 29), (29, 17)])
def test_simulated_ring_is_exact(layout, causal, lengths):
    q, k, v = _qkv(Lq=lengths[0], Lk=lengths[1])
    mask = torch.rand(2, lengths[1], generator=torch.Generator().manual_seed(0)) < 0.7
    mask[1] = False  # a sequence that sees no key: 0 and -inf, never NaN
    out, lse, schedule = slider.simulate_ring(q, k, v, 3, layout=layout, causal=causal, key_padding_mask=mask)
    want_out, want_lse = wb.attention(q, k, v, causal=causal, key_padding_mask=mask, return_lse=True)
    assert not torch.isnan(out).any() and not torch.isnan(lse).any()
    torch.testing.assert_close(out, want_out, rtol=0, atol=1e-14)
    assert torch.equal(torch.isinf(lse), torch.isinf(want_lse))
    seen = torch.isfinite(want_lse)
    torch.testing.assert_close(lse[seen], want_lse[seen], rtol=0, atol=1e-13)
    assert {step for step, *_ in schedule} <= set(range(3))


def test_simulated_ring_calls_the_given_merge():
    q, k, v = _qkv()
    calls = []

    def counting(acc_out, acc_lse, out, lse):
        calls.append(out.shape[2])
        from wb_kernels.stages.distributed.merge import merge_pair
        return merge_pair(acc_out, acc_lse, out, lse)

    _, _, schedule = slider.simulate_ring(q, k, v, 4, layout="zigzag", causal=True, merge=counting)
    assert len(calls) == len(schedule) and sum(calls) > 0


@pytest.mark.parametrize("world", [2, 3, 4, 8])
def test_chunk_pair_map(world):
    L = 2 * world * 5
    for layout in sharding.LAYOUTS:
        m = slider.chunk_pair_map(L, world, layout)
        n = 2 * world
        assert np.all(m["visible"][np.triu_indices(n, 1)] == 0)  # keys after the query chunk: skipped
        assert np.all(m["visible"][np.tril_indices(n, -1)] == 1)  # before it: full
        assert np.all((0.5 < np.diag(m["visible"])) & (np.diag(m["visible"]) < 1))  # the diagonal's half and a bit
        assert sorted(np.bincount(m["owner"], minlength=world)) == [2] * world
        # the step at which a rank computes a block is when it holds the key chunk's owner's block
        for i in range(n):
            for j in range(n):
                assert (m["rank"][i, j] - m["step"][i, j]) % world == m["owner"][j]
    zigzag = slider.chunk_pair_map(L, world, "zigzag")
    skipped = [int(((zigzag["rank"] == r) & (zigzag["visible"] == 0)).sum()) for r in range(world)]
    assert skipped == [2 * world - 1] * world  # the same for every rank: the balance
    with pytest.raises(ValueError, match="divisible"):
        slider.chunk_pair_map(2 * world + 1, world)


def test_overlap_condition():
    nvlink, pcie, ib = (slider.overlap_tokens(600, bw) for bw in slider.LINKS.values())
    assert (round(nvlink), round(pcie), round(ib)) == (1333, 9375, 12000)
    assert slider.overlap_tokens(600, 64e9, causal=True) == 2 * pcie
    assert slider.overlap_tokens(600, 64e9, H=32, Hk=8) == pcie / 4
    # at the threshold a step's compute and transfer take the same time, whatever D and H
    compute, transfer = slider.step_times(pcie, 600, 64e9, D=64, H=8, Hk=8)
    assert math.isclose(float(compute), float(transfer), rel_tol=1e-12)


def test_communication_and_plan():
    ring = slider.communication_bytes("ring", 4096, 4, H=16, Hk=16, D=64)
    ulysses = slider.communication_bytes("ulysses", 4096, 4, H=16, Hk=16, D=64)
    assert ring == 3 * 2 * 1024 * 16 * 64 * 2 and math.isclose(ring / ulysses, 2.0)
    with pytest.raises(ValueError, match="ring' or 'ulysses"):
        slider.communication_bytes("tree", 4096, 4, H=16, Hk=16, D=64)
    plan = slider.hierarchical_plan(4, 8, 131072, H=64, Hk=8)
    assert plan["ring_degree"] == 4 and plan["ulysses_degree"] == 8 and plan["tokens_per_ring_shard"] == 32768
    assert plan["overlap_threshold"] == slider.overlap_tokens(slider.ACHIEVED_TFLOPS, 50e9, H=8, Hk=1)
    with pytest.raises(ValueError, match="divide"):
        slider.hierarchical_plan(4, 8, 131072, H=32, Hk=4)


def test_figures():
    for world in slider.SLIDER_WORLDS:
        assert isinstance(slider.draw_ring_blocks(world), Figure)
    for tflops in (slider.SLIDER_TFLOPS[0], slider.SLIDER_TFLOPS[-1]):
        assert isinstance(slider.draw_overlap(tflops), Figure)


def test_launch_kills_a_hang():
    with pytest.raises(TimeoutError, match="killed"):
        slider.launch([sys.executable, "-c", "import time; time.sleep(60)"], timeout=1)


def test_summary_is_machine_independent():
    records = [{"method": "ring", "case": c, "rank": r, "world": 2, "status": "ok",
                "errors": {"out": e, "lse": 0.0}}
               for c, e in (("a", 1e-16), ("b", 3e-16)) for r in (1, 0)]
    records.append({"method": "ulysses", "case": "c", "rank": 0, "world": 2, "status": "skipped"})
    lines, worst = slider.summarize_launch(records)
    assert lines == ["ring     2 cases x 2 ranks: 4 of 4 within 1e-12 of one process",
                     "ulysses  1 cases x 2 ranks: 0 of 0 within 1e-12 of one process, 1 skipped"]
    assert worst == 3e-16
    assert slider.summarize_launch(list(reversed(records[:4])))[0] == lines[:1]  # rank order does not matter


def test_scaling_bars_read_records():
    def record(method, causal, efficiency, L=131072, world=2, status="ok"):
        return {"method": method, "causal": causal, "L": L, "world_size": world, "efficiency": efficiency,
                "status": status}

    records = [record("ring", False, 0.93), record("zigzag", False, 0.91), record("zigzag", True, 0.84),
               record("ring", True, 0.66), record("context_parallel", True, 0.99),
               record("zigzag", True, 0.99, L=32768), record("ulysses", False, 0.97, status="failed")]
    bars = slider.scaling_bars(slider.scaling_records({"records": records, "environment": {}}))
    assert bars["non-causal"] == (0.93, None, 0.90)
    assert bars["causal (zigzag)"] == (0.84, 0.99, 0.85)
    with pytest.raises(KeyError, match="records"):
        slider.scaling_records({"environment": {}})


# ---- the lesson's measure cells, against the committed results file and altered copies of it ---------------------

def _measure_cells():
    import json
    from pathlib import Path

    lesson = Path(__file__).resolve().parents[1] / "notebooks" / "10_distributed.ipynb"
    cells = ["".join(c["source"]) for c in json.loads(lesson.read_text())["cells"] if c["cell_type"] == "code"]
    start = next(i for i, c in enumerate(cells) if "find_scaling_results" in c)
    return cells[start:start + 3]


def test_measure_cells_hold_only_while_the_file_says_so(capsys):
    """The cells run on the committed file (nbval compares their output); the same cells fail when a configuration
    was timed without passing its check, or when the causal bar stops holding: the prose's claims are asserted."""
    import copy

    read, bars, figure = _measure_cells()
    namespace = {"__builtins__": __builtins__, "display": lambda *a: None, "Markdown": str, "wb": wb,
                 "dist_slider": slider, "sharding": sharding}
    exec(read, namespace)
    committed = namespace["scaling"]
    exec(bars, namespace)
    exec(figure, namespace)
    assert "causal (zigzag)  L = 128k, 2 GPUs: " in capsys.readouterr().out
    unchecked = copy.deepcopy(committed)
    next(r for r in unchecked["records"] if r["status"] == "ok")["check"]["passed"] = False
    slow = copy.deepcopy(committed)
    for r in slow["records"]:
        if r["method"] == "zigzag":
            r["efficiency"] = 0.8  # below the causal bar
    for altered in (unchecked, slow):
        namespace["scaling"] = altered
        with pytest.raises(AssertionError):
            exec(bars, namespace)
