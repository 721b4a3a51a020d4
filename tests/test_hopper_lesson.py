"""Lesson 09's figure, committed-number and slider logic (wb_kernels/stages/hopper/slider.py), without a browser and
without a GPU; the lesson's measure cells with the rung's results file absent and present (a small fixture); the
lesson's puzzle stub, fixed, solving the puzzle; ping-pong's schematic timeline; and every region of the attention
kernels shown, in the file's order."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from wb_kernels.stages.hopper import exercises, slider, wgmma_fragments
from wb_kernels.stages.mma import swizzle as mma_swizzle

ROOT = Path(__file__).resolve().parents[1]
LESSON = ROOT / "notebooks" / "09_hopper.ipynb"


def _record(contender, tflops, *, dtype="float16", B=4, H=16, L=4096, D=128, causal=False, status="ok"):
    return {"contender": contender, "tflops": tflops, "dtype": dtype, "B": B, "H": H, "Lq": L, "Lk": L, "D": D,
            "causal": causal, "status": status, "device": "cuda", "median_ms": 1.0, "l2_flush_mode": "read",
            "hold_us": 300.0}


def _fixture():
    return {"environment": {"backend": "gpu", "gpu": "NVIDIA H100 80GB HBM3", "torch": "2.11.0", "date": "2026-12-01T00:00:00Z",
                            "git_commit": "abc1234"},
            "records": [_record("hopper-v1", 420.0), _record("hopper-v2", 560.0), _record("mma", 330.0),
                        _record("sdpa-cudnn", 650.0), _record("flashinfer-fa3", 660.0),
                        _record("hopper-v1", 300.0, causal=True), _record("sdpa-cudnn", 500.0, causal=True),
                        _record("hopper-v3", 1.0, status="failed"), _record("mma", 1.0, L=512)]}


def test_tflops_at_reads_one_problem_and_leaves_failed_runs_out():
    found = slider.tflops_at(_fixture(), **slider.HEADLINE)
    assert found == {"hopper-v1": 420.0, "hopper-v2": 560.0, "mma": 330.0, "sdpa-cudnn": 650.0, "flashinfer-fa3": 660.0}


def test_hopper_rows_compare_the_best_hopper_contender_with_each_baseline_of_the_same_file():
    rows = slider.hopper_rows(_fixture())
    assert [(r["causal"], sorted(r["hopper"])) for r in rows] == [(False, ["hopper-v1", "hopper-v2"]), (True, ["hopper-v1"])]
    full = rows[0]
    assert full["ratio"]["sdpa-cudnn"] == pytest.approx(560 / 650) and full["ratio"]["mma"] == pytest.approx(560 / 330)
    assert rows[1]["baselines"] == {"sdpa-cudnn": 500.0}  # no mma or FA3 row at that problem: left out, not zero


def test_load_bench_says_none_when_the_file_is_absent(tmp_path):
    assert slider.load_bench(tmp_path / "missing.json") is None
    path = tmp_path / "bench.json"
    path.write_text(json.dumps(_fixture()))
    assert slider.load_bench(path)["records"][0]["contender"] == "hopper-v1"


def test_the_version_table_reads_notes_and_the_measurement():
    versions = slider.notes_versions(slider.notes_text())
    assert [v["version"] for v in versions][:3] == ["v0", "v1", "v2"] and all(v["prediction"] for v in versions[1:])
    table = slider.version_table(slider.notes_text(), _fixture())
    measured = {row["version"]: row["measured"] for row in table}
    assert measured["v1"] == 420.0 and measured["v2"] == 560.0 and measured["v0"] is None
    assert all(row["measured"] is None for row in slider.version_table(slider.notes_text(), None))
    text = "# x\n## Versions\n\n| version | what | prediction | measurement |\n|---|---|---|---|\n| v7 | a | b | c |\n## Next\n| v8 | d | e | f |"
    assert slider.notes_versions(text) == [{"version": "v7", "what": "a", "prediction": "b", "notes": "c"}]
    assert all(row["notes"] for row in versions if row["version"] in ("v1", "v2", "v3"))  # NOTES says what ran where


def test_profile_contrast_tells_the_wgmma_kernel_apart():
    contrast = slider.profile_contrast(slider.load_json("results/mma/ncu_h100.json"))
    assert contrast["sdpa-cudnn"]["wgmma_in_name"] and not contrast["mma"]["wgmma_in_name"]
    assert contrast["sdpa-cudnn"]["threads_per_block"] == 384


def test_the_swizzle_picture_is_the_mma_rungs_xor():
    positions = slider.swizzle_positions(16)
    rows, chunks = np.meshgrid(np.arange(16), np.arange(8), indexing="ij")
    assert np.array_equal(positions, chunks ^ (rows % 8))
    assert np.array_equal(positions * 8 + rows * 64, mma_swizzle.swizzled_offset(rows, chunks, 64))
    assert slider.draw_swizzle() is not None


@pytest.mark.parametrize("thread", [0, 5, 37, 127])
def test_a_threads_p_operand_is_its_s_accumulators(thread):
    held = slider.thread_elements(thread)
    assert len(held["S"]) == len(held["P"]) == 32 and set(held["S"]) == set(held["P"])
    assert all(held["S"][coord] == index for coord, (_, _, index) in held["P"].items())
    assert {row // 16 for row, _ in held["S"]} == {thread // 32}
    assert slider.draw_thread(thread) is not None
    assert slider.THREAD_CHOICES == list(range(wgmma_fragments.WARPGROUP))


def test_pingpong_keeps_the_tensor_cores_busy_where_v2_leaves_them_idle():
    for softmax in (0.3, 0.8, 1.0):  # a softmax no longer than the products: v3 never idles between its products
        v2, v3 = (slider.pingpong_schedule(version, tiles=5, gemm=1.0, softmax=softmax) for version in (2, 3))
        assert v3["tensor_busy"] == pytest.approx(1.0) and v2["tensor_busy"] == pytest.approx(2 * 5 / (4 * (2 + softmax) + 2))
        assert v3["end"] < v2["end"]  # (v2: 5 tiles of 2 units of shared products, 4 softmaxes between them)
    longer = slider.pingpong_schedule(3, tiles=50, gemm=1.0, softmax=1.5)["tensor_busy"]
    assert 0.8 < longer < 1  # a softmax longer than the products: the tensor cores wait for it even in turns


def test_pingpong_turns_never_overlap_and_follow_each_warpgroups_softmax():
    bars = slider.pingpong_schedule(3, tiles=4, gemm=1.0, softmax=0.8)["bars"]
    products = sorted((start, end, c) for c, start, end, kind, _ in bars if kind == "gemm")
    assert all(a[1] <= b[0] for a, b in zip(products, products[1:]))  # one warpgroup on the tensor cores at a time
    assert [c for _, _, c in products] == [0, 1] * 4  # in turn, consumer 0 first
    for c in (0, 1):
        mine = sorted((start, end, kind) for who, start, end, kind, _ in bars if who == c)
        assert all(a[1] <= b[0] + 1e-12 for a, b in zip(mine, mine[1:]))  # a warpgroup does one thing at a time
    with pytest.raises(ValueError):
        slider.pingpong_schedule(1)
    assert slider.draw_pingpong() is not None


# ---- the lesson's cells --------------------------------------------------------------------------------------------

def _code_cells():
    return ["".join(c["source"]) for c in json.loads(LESSON.read_text())["cells"] if c["cell_type"] == "code"]


def _run_measure_cell(capsys):
    from wb_kernels import bench

    cell = next(c for c in _code_cells() if c.startswith("measured = hopper_slider.load_bench()"))
    namespace = {"hopper_slider": slider, "bench": bench}
    exec(cell, namespace)
    return capsys.readouterr().out


def test_the_measure_cell_says_clearly_when_the_file_is_absent(monkeypatch, tmp_path, capsys):
    monkeypatch.setattr(slider, "BENCH_FILE", slider.REPOSITORY / "results" / "hopper" / "not_there.json")
    out = _run_measure_cell(capsys)
    assert "is not committed yet" in out and slider.MEASURE_COMMAND in out


def test_the_measure_cell_prints_every_problem_of_a_committed_file(monkeypatch, tmp_path, capsys):
    path = slider.REPOSITORY / "results" / "hopper" / "bench_h100.json"
    fixture = tmp_path / "bench_h100.json"
    fixture.write_text(json.dumps(_fixture()))
    monkeypatch.setattr(slider, "BENCH_FILE", fixture)
    out = _run_measure_cell(capsys)
    assert "NVIDIA H100 80GB HBM3" in out and "hopper-v2 560" in out and "0.86x sdpa-cudnn" in out
    assert len([line for line in out.splitlines() if "best hopper" in line]) == 2
    assert path.name == fixture.name  # the lesson reads the file of this name


def test_the_lessons_puzzle_stub_is_unsolved_and_its_two_fixes_solve_it(capsys):
    from wb_kernels.stages.hopper.barrier_ring import ArriveExpectTx, Copy, Wait

    cell = next(c for c in _code_cells() if c.startswith("def my_producer"))
    definition = cell.split("\n\n\nfrom ")[0]
    namespace = {"Wait": Wait, "ArriveExpectTx": ArriveExpectTx, "Copy": Copy}
    exec(definition, namespace)
    exercises.check_ring_puzzle(namespace["my_producer"])
    assert "not solved yet" in capsys.readouterr().out
    parity = "yield Wait(ring.empty[stage], phase)"
    flip = "            stage = 0  # TODO: a new lap is a new phase"
    assert definition.count(parity) == 1 and definition.count(flip) == 1
    fixed = definition.replace(parity, "yield Wait(ring.empty[stage], phase ^ 1)").replace(
        flip, "            stage, phase = 0, phase ^ 1")
    exec(fixed, namespace)
    exercises.check_ring_puzzle(namespace["my_producer"])
    assert "solved ✓" in capsys.readouterr().out


def test_every_attention_region_is_shown_once_in_the_files_order():
    """The shared tile steps, v1, v2, v3 and the host side: every region, once, in the file's order (so each function
    is shown before its caller); the primitives v2 and v3 use, before their kernels."""
    from wb_kernels.stages.hopper import build as hopper_build
    from wb_kernels.lesson_sync import notebook_regions

    files = hopper_build.SOURCE.files()  # hopper_host.cu and the headers it includes
    shown = [name for name, module, _ in notebook_regions(LESSON) if module in files]
    attention = [name for name in hopper_build.SOURCE.regions() if name.startswith(("flash_", "tma_3d"))]
    assert {"flash_tile_steps", "flash_v1_tile_loop", "flash_v2_consumer", "flash_v3_turn", "flash_ws_roles"} <= set(attention)
    assert [name for name in shown if name in attention] == attention
    assert len(shown) == len(set(shown))
    for primitive, user in (("setmaxnreg", "flash_ws_roles"), ("register_split_kernel", "flash_ws_layout"),
                            ("named_barrier", "flash_v3_consumer"), ("named_barrier_kernel", "flash_v3_consumer")):
        assert shown.index(primitive) < shown.index(user)
    ring = [name for name, module, _ in notebook_regions(LESSON) if module.endswith("barrier_ring.py")]
    assert ring == ["mbarrier_model", "ring_loops", "named_barrier_model", "ws_loops"]


def _all_cells():
    return [(c["cell_type"], "".join(c["source"])) for c in json.loads(LESSON.read_text())["cells"]]


def test_the_prose_about_flash_ws_kernel_names_every_version_it_runs():
    """flash_ws_kernel runs the versions its static_assert allows (v2 to v4): a paragraph about that kernel that
    names only some of them (it once said "v2 and v3") tells the learner v4 is another kernel."""
    import re

    cells = _all_cells()
    bounds = {m.groups() for kind, text in cells if kind == "code"
              for m in re.finditer(r"static_assert\(VERSION >= (\d) && VERSION <= (\d)", text)}
    assert len(bounds) == 1, bounds
    low, high = map(int, bounds.pop())
    versions = [f"v{n}" for n in range(low, high + 1)]
    paragraphs = [p for kind, text in cells if kind == "markdown" for p in text.split("\n\n")
                  if "`flash_ws_kernel" in p or p.startswith("### One kernel for")]
    assert paragraphs
    missing = {p[:80]: [v for v in versions if not re.search(rf"\b{v}\b", p)] for p in paragraphs}
    assert not any(missing.values()), missing


def test_a_register_past_168_is_claimed_only_beside_a_cell_that_asserts_it():
    """The lesson once said the consumers reach "past 168" where its own output showed v2's highest register below
    168: prose that says "past 168" must sit next to a code cell asserting a register number > 168."""
    cells = _all_cells()
    for index, (kind, text) in enumerate(cells):
        if kind == "markdown" and "past 168" in text:
            neighbours = [cells[i][1] for i in (index - 1, index + 1) if 0 <= i < len(cells) and cells[i][0] == "code"]
            assert any("> 168" in line for code in neighbours for line in code.splitlines()
                       if line.lstrip().startswith("assert")), text[:120]
