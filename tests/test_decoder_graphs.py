"""Lesson 07 (decode): the decoder without its host overhead (``wb_kernels/models/decoder_graphs.py``): the batch
buckets, the static step, the graph and compiled runners, the time budget and resume of the tokens run, and the
roofline chart (``wb_kernels/models/decoder_roofline.py``).

On the CPU everything but the capture itself: the bucket logic, the static step run eagerly (``capture=False``)
against the eager decoder, ``torch.compile`` traced as one graph (``backend="eager"``), the chart from results made up
here. On a GPU (marked, skipped here): capture and replay, the greedy tokens against the uncaptured step and the eager
decoder, ``wb.decode``'s capture probe.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from wb_kernels.models import decoder_graphs as dg
from wb_kernels.models import decoder_roofline as roof
from wb_kernels.bench import decoder_tokens as tokens
from wb_kernels.models import llama_decoder as dec

ON_CUDA = torch.cuda.is_available()
gpu_only = pytest.mark.skipif(not ON_CUDA, reason="needs a CUDA GPU: CUDA graphs capture GPU work only")


@pytest.fixture(scope="module")
def tiny_model():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield dec.Decoder(dec.TINY, dtype=torch.float32, seed=5)
    torch.set_num_threads(threads)


def prompt(batch=3, length=6, seed=2):
    return torch.randint(0, dec.TINY.vocab_size, (batch, length), generator=torch.Generator().manual_seed(seed))


# ---- buckets (pure Python) -----------------------------------------------------------------------------------

@pytest.mark.parametrize("batch, bucket", [(1, 1), (2, 2), (3, 4), (8, 8), (9, 16), (64, 64), (65, 128), (256, 256)])
def test_a_batch_runs_in_the_smallest_bucket_that_holds_it(batch, bucket):
    assert dg.bucket_for(batch) == bucket


def test_buckets_up_to_a_batch_and_their_errors():
    assert dg.buckets_up_to(8) == (1, 2, 4, 8)
    assert dg.buckets_up_to(5, (8, 1, 4, 4)) == (1, 4, 8)
    assert dg.buckets_up_to(64, (64,)) == (64,)
    with pytest.raises(ValueError, match="largest bucket"):
        dg.bucket_for(300)
    for bad in (0, -1, 2.0, True):
        with pytest.raises(ValueError, match="positive int"):
            dg.bucket_for(bad)
    with pytest.raises(ValueError, match="positive ints"):
        dg.buckets_up_to(2, (1, 0))


def test_padding_and_capacity():
    padded = dg.pad_tokens(torch.tensor([5, 7, 9]), 4)
    assert padded.tolist() == [5, 7, 9, 0]
    with pytest.raises(ValueError, match="token ids"):
        dg.pad_tokens(torch.tensor([1, 2, 3]), 2)
    assert dg.graph_capacity(1024, 35) == 1059 and dg.graph_capacity(1024, 35, page_size=16) == 1072


# ---- the static step and the runners, eagerly on the CPU -----------------------------------------------------------

@pytest.mark.parametrize("paged", [False, True])
def test_the_static_step_generates_the_eager_tokens_in_every_bucket(tiny_model, paged):
    """A graph's step read the whole capacity with a mask, not the keys there are: the same tokens, for batches that
    fill their bucket and batches padded to it, one runner reused across them."""
    runner = dg.GraphedDecoder(tiny_model, dec.sdpa_attend, max_batch=3, capacity=20, paged=paged, page_size=4,
                               buckets=(1, 2, 4), capture=False)
    assert runner.buckets == (1, 2, 4) and not runner.captured and runner.cache.cache_seqlens.shape == (4,)
    for batch in (3, 1, 2):
        ids = prompt(batch)
        assert torch.equal(runner.generate(ids, 8), tiny_model.generate(ids, 8, dec.sdpa_attend)), batch


def test_the_static_step_with_the_series_kernel(tiny_model):
    ids = prompt(2, 5)
    runner = dg.GraphedDecoder(tiny_model, dec.wb_attend, max_batch=2, capacity=8, paged=True, page_size=4,
                               capture=False)
    assert torch.equal(runner.generate(ids, 3), tiny_model.generate(ids, 3, dec.sdpa_attend))


def test_graph_runner_refuses_what_it_cannot_hold(tiny_model):
    runner = dg.GraphedDecoder(tiny_model, dec.sdpa_attend, max_batch=2, capacity=8, capture=False)
    with pytest.raises(ValueError, match="largest bucket"):
        runner.generate(prompt(3), 2)
    with pytest.raises(ValueError, match="capacity 8"):
        runner.generate(prompt(2, 6), 4)
    with pytest.raises(ValueError, match="start"):
        dg.GraphedDecoder(tiny_model, dec.sdpa_attend, max_batch=1, capacity=8, capture=False).step()
    with pytest.raises(ValueError, match="CUDA GPU"):  # the model is on the CPU, whatever the machine has
        dg.GraphedDecoder(tiny_model, dec.sdpa_attend, max_batch=1, capacity=8, capture=True)
    runner.start(prompt(2, 7))
    runner.step()
    with pytest.raises(ValueError, match="full"):
        runner.step()


def test_the_compiled_step_traces_as_one_graph_and_generates_the_eager_tokens(tiny_model):
    """fullgraph=True: a graph break anywhere in the step (a host read, a Python branch on a GPU value) fails here."""
    ids = prompt(3)
    compiled = dg.CompiledDecoder(tiny_model, dec.sdpa_attend, cache=tiny_model.new_cache(3, 12), backend="eager")
    record = tokens.compare_runners(dg.EagerRunner(tiny_model, dec.sdpa_attend, capacity=12), compiled, ids, 6,
                                    tiny_model.dtype)
    assert record["identical"] and record["agree_to_rounding"]


def test_time_static_on_the_cpu(tiny_model):
    for mode in ("graph", "eager"):
        result = dg.time_static(tiny_model, mode, dec.sdpa_attend, batch=2, context=10, steps=3, warmup=1)
        assert result["ms_per_step"] > 0 and result["captured"] is False
        assert result["tokens_per_s"] == pytest.approx(2 * 1e3 / result["ms_per_step"])
        assert result["capacity"] == 14 and result["mean_context"] == 10 + 1 + 2
    with pytest.raises(ValueError, match="mode"):
        dg.time_static(tiny_model, "fast", dec.sdpa_attend, batch=1, context=4, steps=1, warmup=0)


def test_the_timing_cache_is_full_and_random(tiny_model):
    cache = tiny_model.new_cache(2, 12, paged=True, page_size=4)
    dg.fill_for_timing(cache, 9)
    assert cache.cache_seqlens.tolist() == [9, 9] and cache.host_max_len == 9
    assert all(float(k.std()) > 0.5 for k in cache.keys)
    with pytest.raises(ValueError, match="capacity"):
        dg.fill_for_timing(cache, 13)


def test_the_capture_probe_off_a_gpu_says_why():
    if ON_CUDA:
        pytest.skip("this machine has a GPU: the probe runs (see the GPU tests)")
    support = dg.wb_decode_graph_support("float16")
    assert support["graph_safe"] is False and "no CUDA GPU" in support["reason"]


# ---- the time budget and resuming ------------------------------------------------------------------------------

def test_a_run_stopped_by_its_budget_resumes_where_it_stopped(tmp_path, capsys, monkeypatch):
    settings = tokens.Settings(**{**tokens.SMOKE_SETTINGS.__dict__, "batches": (1,), "contexts": (8,),
                                  "sweep_batches": (1,), "sweep_contexts": (8,), "compile_cells": (),
                                  "greedy_tokens": 2, "steps": 2})
    # wb.decode on the simulator is the slow part of the smoke: SDPA only here
    monkeypatch.delitem(tokens.ATTENDS, "wb")
    monkeypatch.setattr(tokens, "SWEEP_CONTENDERS", (("graph", "contiguous", "sdpa"),))
    monkeypatch.setattr(tokens, "GREEDY_OTHERS", ())
    monkeypatch.setattr(tokens, "GREEDY_MODES", (("graph", "contiguous", "sdpa"),))
    out = tmp_path / "decoder_smoke.json"
    first = tokens.run_tokens(settings, out, smoke=True, time_budget=0.0)
    assert first["complete"] is False and first["records"] == [] and first["ceilings"] is not None
    assert "run the same command again" in capsys.readouterr().err
    # a row that failed in the stopped run (say, out of memory) is tried again
    first_key = tokens.row_key(*tokens._plan(settings)[0][:1], settings.dtype, *tokens._plan(settings)[0][1:])
    stopped = json.loads(out.read_text())
    stopped["records"].append({"key": first_key, "status": "failed", "reason": "out of memory (made up)"})
    out.write_text(json.dumps(stopped))
    done = tokens.run_tokens(settings, out, smoke=True)
    assert "resuming" in capsys.readouterr().err
    assert done["complete"] is True and len(done["resumed"]) == 1 and done["ceilings"] == first["ceilings"]
    assert all(r["status"] != "failed" for r in done["records"])
    keys = [r["key"] for r in done["records"]]
    assert keys == [tokens.row_key(*row[:1], settings.dtype, *row[1:]) for row in tokens._plan(settings)]
    assert [g["other"] for g in done["greedy"]] == ["sdpa, contiguous, graph"]
    assert json.loads(out.read_text())["complete"] is True
    # a finished file is not resumed: the next run starts over
    tokens.run_tokens(settings, out, smoke=True, time_budget=0.0)
    assert "starting a new one" in capsys.readouterr().err



def test_a_sigterm_whose_exception_was_swallowed_stops_at_the_next_row_without_a_budget(tmp_path, capsys,
                                                                                        monkeypatch):
    """SIGTERM raises in whatever code runs; when that code swallows the exception (a weakref callback did, in a
    garbage collection), the flag stops the run at the next row, with no --time-budget to quote (that message once
    raised a TypeError formatting None, and the run lost its table)."""
    settings = tokens.Settings(**{**tokens.SMOKE_SETTINGS.__dict__, "batches": (1,), "contexts": (8,),
                                  "sweep_batches": (1,), "sweep_contexts": (8,), "compile_cells": (),
                                  "greedy_tokens": 2, "steps": 2})
    monkeypatch.setitem(tokens._STOP, "requested", True)
    results = tokens.run_tokens(settings, tmp_path / "decoder_smoke.json", smoke=True)
    assert results["complete"] is False and results["records"] == []
    assert "--time-budget" not in capsys.readouterr().err

def test_the_gpu_plan_runs_every_row_once_with_the_compiled_rows_last(capsys):
    settings = tokens.GPU_SETTINGS
    staged = [row for _, phase, work in tokens._stages(settings) if phase == "rows" for row in work]
    assert sorted(staged) == sorted(tokens._plan(settings)) and len(staged) == len(set(staged))
    modes = [row[3] for row in staged]
    assert modes == sorted(modes, key=["eager", "graph", "compile"].index)
    cells = {(row[1], row[2]) for row in staged if row[3] == "graph"}
    assert cells == {(b, c) for b in (1, 8, 64) for c in (1024, 8192, 32768)}
    assert tokens.main(["--plan"]) == 0  # on any machine: nothing runs
    printed = capsys.readouterr().out.splitlines()
    assert printed[-1].startswith(f"{len(staged)} rows, 12 greedy checks; about ")
    assert printed[-2] == "greedy check llama_1b: wb, contiguous, compile against sdpa, contiguous (eager)"


@pytest.mark.parametrize("change, message", [
    ({"compile_cells": ((2, 99),)}, "compile_cells"),
    ({"compile_backend": "tensorrt"}, "compile_backend"),
    ({"num_splits": 0}, "num_splits"),
    ({"sweep_batches": (0,)}, "sweep_batches"),
    ({"sweep_configs": ("nope",)}, "sweep_configs"),
    ({"sweep_contexts": ()}, "together"),
    ({"sweep_contexts": (600,), "compile_cells": ()}, "max_seq_len=512"),
])
def test_sweep_settings_are_checked(change, message):
    with pytest.raises(ValueError, match=message):
        tokens.check_settings(tokens.Settings(**{**tokens.SMOKE_SETTINGS.__dict__, **change}))


def test_the_command_line_drops_the_sweep_or_the_compiled_cells(capsys):
    assert tokens.main(["--plan", "--sweep-configs", "none"]) == 0
    assert "|graph|" not in capsys.readouterr().out
    assert tokens.main(["--plan", "--compile-cells", "none"]) == 0
    out = capsys.readouterr().out
    assert "|compile|" not in out and "compile against" not in out and "|graph|" in out
    assert tokens.main(["--plan", "--compile-cells", "1x1024,64x8192", "--num-splits", "4"]) == 0
    assert capsys.readouterr().out.count("|compile|") == 2 * 3  # SDPA, wb contiguous and paged
    with pytest.raises(SystemExit):
        tokens.main(["--plan", "--compile-cells", "1by1024"])


def test_the_compiled_check_reuses_a_timed_cells_shapes():
    assert tokens.compile_check_shape(tokens.GPU_SETTINGS) == (1, 1024 + 3 + 32)
    too_short = tokens.Settings(**{**tokens.GPU_SETTINGS.__dict__, "greedy_tokens": 64})
    assert tokens.compile_check_shape(too_short) == (8, 1024 + 64)
    assert tokens.compile_check_shape(tokens.Settings(**{**tokens.GPU_SETTINGS.__dict__, "compile_cells": ()})) == (
        8, 1024 + 32)


def test_a_run_stopped_from_outside_still_prints_its_table_and_draws_its_chart(tmp_path):
    """gpu_check's time limit sends SIGTERM: the rows finished so far are shown and drawn, and the file resumes."""
    import os
    import signal
    import subprocess
    import sys
    import time

    out, figure = tmp_path / "decoder_smoke.json", tmp_path / "chart.png"
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    child = subprocess.Popen([sys.executable, "-m", "wb_kernels.bench.decoder_tokens", "--smoke", "--json", str(out),
                              "--figure", str(figure)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                             env=env)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:  # until the first row is in the file
        if out.exists() and json.loads(out.read_text())["records"]:
            break
        time.sleep(0.2)
    child.send_signal(signal.SIGTERM)
    stdout, stderr = child.communicate(timeout=120)
    results = json.loads(out.read_text())
    assert "stopped by SIGTERM" in stderr, stderr[-2000:]
    assert results["complete"] is False and results["records"]
    assert "not finished: run the same command again to resume" in stdout and figure.exists()


# ---- the roofline chart (results made up here) ------------------------------------------------------------------

def made_up_results():
    """Two contenders at two cells, and a row of a file written before the modes (no mode, bytes under roofline)."""
    def row(mode, attend, batch, context, gb, ms, **extra):
        roofline_ms = gb / 3.0  # 3000 GB/s: GB / (GB/ms)
        return {"key": f"llama_1b|float16|B{batch}|L{context}|{mode}|contiguous|{attend}", "config": "llama_1b",
                "batch": batch, "context": context, "mode": mode, "layout": "contiguous", "attend": attend,
                "status": "ok", "ms_per_step": ms, "bytes_per_step": gb * 1e9,
                "roofline": {"step_ms": roofline_ms, "bytes_per_step": gb * 1e9},
                "fraction_of_roofline": roofline_ms / ms, **extra}

    old = row("eager", "sdpa", 1, 1024, 2.5, 25.0)
    del old["mode"], old["bytes_per_step"]
    return {"ceilings": {"copy_gbps": 3000.0}, "environment": {"gpu": "Made-up GPU"},
            "records": [row("graph", "sdpa", 1, 1024, 2.5, 1.25), row("graph", "wb", 64, 32768, 70.0, 30.0),
                        row("compile", "sdpa", 1, 1024, 2.5, 1.0), old,
                        {**row("graph", "wb", 8, 8192, 10.0, 5.0), "status": "skipped"},
                        {**row("graph", "sdpa", 1, 1024, 2.5, 1.0), "config": "llama_1b_d128"}]}


def test_roofline_points_read_every_timed_row_and_the_old_format():
    points = roof.roofline_points(made_up_results(), config="llama_1b")
    assert [p["label"] for p in points] == ["CUDA graph, sdpa, contiguous", "CUDA graph, wb, contiguous",
                                            "torch.compile, sdpa, contiguous", "eager, sdpa, contiguous"]
    assert points[0]["fraction"] == pytest.approx(2.5 / 3.0 / 1.25)
    assert points[3]["bytes_per_step"] == 2.5e9  # read from under "roofline"
    assert len(roof.roofline_points(made_up_results())) == 5  # every config


def test_roofline_summary_names_best_and_worst():
    lines = roof.roofline_summary(made_up_results(), config="llama_1b")
    assert lines[0].startswith("CUDA graph, sdpa, contiguous: 67 % of the roofline at best (B=1, context 1024)")


def test_roofline_chart_is_a_figure_with_the_ceiling_and_a_marker_per_row():
    fig = roof.roofline_chart(made_up_results())
    ax = fig.axes[0]
    assert ax.get_xscale() == "log" and ax.get_yscale() == "log"
    ceiling = next(line for line in ax.lines if line.get_label().startswith("copy ceiling"))
    (x0, x1), (y0, y1) = ceiling.get_xdata(), ceiling.get_ydata()
    assert y0 / x0 == pytest.approx(1e3 / 3000.0) and y1 / x1 == pytest.approx(1e3 / 3000.0)  # ms per GB
    markers = [line for line in ax.lines if len(line.get_xdata()) and not line.get_label().startswith("copy")]
    assert sum(len(line.get_xdata()) for line in markers) == 4  # one per timed llama_1b row
    legend = [text.get_text() for text in ax.get_legend().get_texts()]
    assert "CUDA graph, wb, contiguous" in legend and "batch 64" in legend and "Made-up GPU" in ax.get_title()
    with pytest.raises(ValueError, match="copy bandwidth"):
        roof.roofline_chart({**made_up_results(), "ceilings": {}})


# ---- on a GPU ------------------------------------------------------------------------------------------------

# TINY's shape with D = 64: wb.decode runs its CUDA kernel (16-bit, D 64 or 128), the one that can be captured
GPU_TINY = dec.DecoderConfig(vocab_size=256, dim=128, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=64, ffn_dim=256,
                             max_seq_len=512, tie_embeddings=False)


@pytest.fixture(scope="module")
def gpu_model():
    if not ON_CUDA:
        pytest.skip("needs a CUDA GPU")
    return dec.Decoder(GPU_TINY, dtype=torch.float16, device="cuda", seed=5)


@gpu_only
@pytest.mark.parametrize("paged", [False, True])
def test_captured_graphs_replay_the_uncaptured_steps_tokens(gpu_model, paged):
    """A replay runs the kernels of the step it captured: the same tokens as that step run eagerly, in every
    bucket (a batch of 3 replays the bucket of 4); and against the eager decoder, identical or a near tie."""
    ids = prompt(3, 12).cuda()
    captured = dg.GraphedDecoder(gpu_model, dec.sdpa_attend, max_batch=4, capacity=48, paged=paged, page_size=16,
                                 buckets=(1, 2, 4))
    uncaptured = dg.GraphedDecoder(gpu_model, dec.sdpa_attend, max_batch=4, capacity=48, paged=paged, page_size=16,
                                   buckets=(1, 2, 4), capture=False)
    assert captured.captured and sorted(captured.graphs) == [1, 2, 4]
    for batch in (3, 1):
        assert torch.equal(captured.generate(ids[:batch], 24), uncaptured.generate(ids[:batch], 24))
    record = tokens.compare_runners(dg.EagerRunner(gpu_model, dec.sdpa_attend, capacity=48), captured, ids, 24,
                                    gpu_model.dtype)
    assert record["identical"] or record["first_divergence"]["near_tie"], record


@gpu_only
def test_wb_decode_in_a_graph(gpu_model):
    support = dg.wb_decode_graph_support("float16")
    # wb.decode is graph-safe (issue #30): a probe that says otherwise, crashed or timed out is a failure here
    assert support["graph_safe"], support["reason"]
    ids = prompt(2, 12).cuda()
    for paged in (False, True):
        captured = dg.GraphedDecoder(gpu_model, dec.wb_attend, max_batch=2, capacity=64, paged=paged, page_size=16)
        record = tokens.compare_runners(dg.EagerRunner(gpu_model, dec.sdpa_attend, capacity=64), captured, ids, 24,
                                        gpu_model.dtype)
        assert record["agree_to_rounding"] and (record["identical"] or record["first_divergence"]["near_tie"]), record


@gpu_only
def test_reduce_overhead_generates_the_eager_tokens_or_a_near_tie(gpu_model):
    """Inductor fuses and reorders: tokens identical, or the first flip at a near tie (the rule of compare_greedy)."""
    ids = prompt(2, 12).cuda()
    compiled = dg.CompiledDecoder(gpu_model, dec.sdpa_attend, cache=gpu_model.new_cache(2, 40))
    try:
        record = tokens.compare_runners(dg.EagerRunner(gpu_model, dec.sdpa_attend, capacity=40), compiled, ids, 24,
                                        gpu_model.dtype)
    finally:
        torch._dynamo.reset()
    assert record["agree_to_rounding"] and (record["identical"] or record["first_divergence"]["near_tie"]), record


@gpu_only
def test_time_static_captures_on_a_gpu(gpu_model):
    result = dg.time_static(gpu_model, "graph", dec.sdpa_attend, batch=2, context=64, steps=8, warmup=2)
    assert result["captured"] is True and result["ms_per_step"] > 0


@gpu_only
def test_flashinfer_in_a_graph_is_planned_before_every_replay(gpu_model):
    """FlashInfer's run captured, planned on the host before each replay (FlashInferGraphAttend): the tokens of the
    same step run uncaptured (which plans from the lengths on the GPU), and the eager SDPA decoder's to rounding."""
    from wb_kernels.bench import flashinfer

    if flashinfer.problem() is not None:
        pytest.skip(flashinfer.problem())
    ids = prompt(2, 12).cuda()
    captured = dg.GraphedDecoder(gpu_model, dec.FlashInferGraphAttend(), max_batch=2, capacity=64, paged=True,
                                 page_size=16, buckets=(2,))
    uncaptured = dg.GraphedDecoder(gpu_model, dec.FlashInferGraphAttend(), max_batch=2, capacity=64, paged=True,
                                   page_size=16, buckets=(2,), capture=False)
    assert captured.captured
    # 40 new tokens from 12: the lengths cross page boundaries (16, 32, 48), so the plans' page lists change
    assert torch.equal(captured.generate(ids, 40), uncaptured.generate(ids, 40))
    captured = dg.GraphedDecoder(gpu_model, dec.FlashInferGraphAttend(), max_batch=2, capacity=64, paged=True,
                                 page_size=16, buckets=(2,))
    record = tokens.compare_runners(dg.EagerRunner(gpu_model, dec.sdpa_attend, capacity=64), captured, ids, 40,
                                    gpu_model.dtype)
    assert record["agree_to_rounding"] and (record["identical"] or record["first_divergence"]["near_tie"]), record


def test_flashinfer_in_a_graph_refuses_a_contiguous_cache():
    q = torch.zeros(1, 4, 64)
    with pytest.raises(ValueError, match="paged cache"):
        dec.FlashInferGraphAttend()(q, torch.zeros(1, 2, 16, 64), torch.zeros(1, 2, 16, 64), torch.tensor([3]))


def test_flashinfers_page_lists_pack_each_sequences_pages_in_order():
    """What both FlashInfer plans are given: offsets and last-page lengths on the host, the pages packed in order,
    the same whether the lengths are equal (a slice of the table) or not (a mask)."""
    from wb_kernels.bench.flashinfer import page_lists

    table = torch.tensor([[7, 3, 9, 1], [2, 8, 5, 6]], dtype=torch.int32)
    indptr, indices, last = page_lists(table, [33, 16], 16)
    assert indptr.tolist() == [0, 3, 4] and indices.tolist() == [7, 3, 9, 2] and last.tolist() == [1, 16]
    indptr, indices, last = page_lists(table, [20, 32], 16)
    assert indptr.tolist() == [0, 2, 4] and indices.tolist() == [7, 3, 2, 8] and last.tolist() == [4, 16]
    assert indptr.device.type == last.device.type == "cpu" and indices.dtype == torch.int32
    _, indices, last = page_lists(table, [0, 0], 16)  # empty sequences: no page
    assert indices.numel() == 0 and last.tolist() == [0, 0]
