"""Lesson 07 (decode): the decoder's tokens-per-second benchmark (``wb_kernels/bench/decoder_tokens.py``), its greedy
check and the reader the lesson prints from. On the CPU: the smoke run (TINY, wb.decode on the simulator)."""

from __future__ import annotations

import json

import pytest
import torch

from wb_kernels.models import llama_decoder as dec
from wb_kernels.stages.decode import slider
from wb_kernels.bench import decoder_tokens as tokens

ROW_FIELDS = ("key", "kind", "config", "dtype", "batch", "context", "mode", "layout", "page_size", "attend", "steps",
              "warmup", "status", "tokens_per_s", "ms_per_step", "attention_ms_per_step", "attention_share",
              "bytes_per_step", "roofline", "fraction_of_roofline")
GREEDY_FIELDS = ("config", "dtype", "batch", "prompt_len", "new_tokens", "reference", "other", "status", "identical",
                 "sequences_identical", "max_logit_diff", "logit_absmax", "relative_logit_diff", "rounding_tolerance",
                 "agree_to_rounding", "min_reference_margin", "first_divergence", "note")


@pytest.fixture(scope="module")
def smoke(tmp_path_factory):
    """The smoke run through the command line: (exit code, its results file's path, what it printed)."""
    import contextlib
    import io

    out = tmp_path_factory.mktemp("decoder") / "decoder_smoke.json"
    printed = io.StringIO()
    threads = torch.get_num_threads()
    try:
        with contextlib.redirect_stdout(printed):
            code = tokens.main(["--smoke", "--json", str(out), "--no-progress"])
    finally:
        torch.set_num_threads(threads)
    return code, out, printed.getvalue()


def test_smoke_run_writes_a_complete_file(smoke):
    code, out, printed = smoke
    assert code == 0
    results = json.loads(out.read_text())
    assert results["schema"] == 1 and results["kind"] == "decoder_tokens" and results["mode"] == "smoke"
    assert results["complete"] is True and results["elapsed_s"] > 0
    assert results["command"].startswith("python -m wb_kernels.bench.decoder_tokens --smoke")
    env = results["environment"]
    for key in ("date", "torch", "cuda", "device", "gpu", "git_commit", "backend"):
        assert key in env, key
    assert results["settings"]["configs"] == ["tiny"] and results["configs"]["tiny"]["params"] == dec.TINY.params()
    assert results["ceilings"]["copy_gbps"] > 0

    rows = results["records"]
    assert {(r["layout"], r["attend"]) for r in rows if r["mode"] == "eager"} == {
        (layout, attend) for layout in ("contiguous", "paged") for attend in ("sdpa", "wb")} | {("paged", "flashinfer")}
    # the sweep: every contender once, in the smoke's one cell; on the CPU nothing is captured, and the row says so
    assert [(r["mode"], r["layout"], r["attend"]) for r in rows if r["mode"] != "eager"] == list(
        tokens.SWEEP_CONTENDERS)
    assert all(r["captured"] is False for r in rows if r["mode"] != "eager" and r["attend"] != "flashinfer")
    assert results["wb_graph_support"]["graph_safe"] is None
    # FlashInfer needs a CUDA GPU: on the CPU its rows (eager, and in a graph) are there, skipped, and say why
    missing = [r for r in rows if r["attend"] == "flashinfer"]
    assert [(r["mode"], r["status"]) for r in missing] == [("eager", "skipped"), ("graph", "skipped")]
    assert all("flashinfer" in r["reason"] for r in missing)
    rows = [r for r in rows if r["attend"] != "flashinfer"]
    for r in rows:
        assert r["status"] == "ok", r
        missing = [field for field in ROW_FIELDS if field not in r]
        assert not missing, (r["key"], missing)
        assert r["tokens_per_s"] > 0 and r["ms_per_step"] > 0
        if r["mode"] == "eager":  # the attention's own time is measured in the eager step only
            assert 0 < r["attention_ms_per_step"] <= r["ms_per_step"] and 0 < r["attention_share"] <= 1
        else:
            assert r["attention_share"] is None and r["capacity"] >= r["context"] + r["steps"] + r["warmup"]
        assert r["bytes_per_step"] == roofline_bytes(r)
        # tokens/s and ms/step are the same measurement: batch tokens per step
        assert r["tokens_per_s"] == pytest.approx(r["batch"] * 1e3 / r["ms_per_step"], rel=1e-3)
        roofline = r["roofline"]
        assert roofline["step_ms"] > 0 and roofline["bandwidth_gbps"] == results["ceilings"]["copy_gbps"]
        assert r["fraction_of_roofline"] == pytest.approx(roofline["step_ms"] / r["ms_per_step"], rel=1e-2)
        # over SDPA in the same mode and layout, where that row exists (compile runs SDPA on the contiguous cache only)
        sdpa_row = any(o["mode"] == r["mode"] and o["layout"] == r["layout"] and o["attend"] == "sdpa" for o in rows)
        assert ("vs_sdpa" in r) == (r["attend"] != "sdpa" and sdpa_row)
        assert ("vs_sdpa_contiguous" in r) == (r["layout"] == "paged")
        assert (r["page_size"] is None) == (r["layout"] == "contiguous")
    by = {(r["layout"], r["attend"]): r for r in rows if r["mode"] == "eager"}
    wb_paged = by[("paged", "wb")]
    assert wb_paged["vs_sdpa"] == pytest.approx(wb_paged["tokens_per_s"] / by[("paged", "sdpa")]["tokens_per_s"],
                                                rel=1e-2)

    compiled = next(r for r in rows if r["mode"] == "compile")
    assert compiled["vs_graph_sdpa"] == pytest.approx(
        compiled["tokens_per_s"] / next(r for r in rows if r["key"] == compiled["key"].replace("compile", "graph"))[
            "tokens_per_s"], rel=1e-2)

    greedy = results["greedy"]
    assert [g["other"] for g in greedy] == ["wb, contiguous", "wb, paged", "flashinfer, paged",
                                            "sdpa, contiguous, graph", "wb, contiguous, graph", "wb, paged, graph",
                                            "flashinfer, paged, graph", "sdpa, contiguous, compile",
                                            "wb, contiguous, compile"]
    assert all(greedy[i]["status"] == "skipped" and "flashinfer" in greedy[i]["reason"] for i in (2, 6))
    assert greedy[3]["buckets"] == [1, 2] and greedy[3]["captured"] is False
    for g in greedy[:2] + greedy[3:6] + greedy[7:]:
        missing = [field for field in GREEDY_FIELDS if field not in g]
        assert not missing, missing
        # float32 on the CPU: the simulator's kernel and SDPA agree to rounding, and TINY has no near tie here
        assert g["status"] == "ok" and g["identical"] and g["first_divergence"] is None and g["agree_to_rounding"]
        assert "identical tokens" in g["note"]

    assert "tiny" in printed and "greedy, tiny" in printed and f"wrote {out}" in printed
    assert "CUDA graph, wb, paged: " in printed and "% of the roofline at best" in printed


def roofline_bytes(row):
    """Weights and the KV cache at the row's mean context, in the row's dtype: what decode_step_roofline counts."""
    return dec.decode_step_roofline(tokens.CONFIGS[row["config"]], batch=row["batch"],
                                    context_len=row["roofline"]["context"], dtype_bytes=4,
                                    bandwidth_bytes_per_s=1.0)["bytes_per_step"]


def test_smoke_file_is_a_valid_results_file_for_the_repository_checks(smoke):
    # tests/test_bench.py checks every committed results/**/*.json with "records": the same rules hold here
    results = json.loads(smoke[1].read_text())
    assert all(r["status"] in ("ok", "skipped", "failed") for r in results["records"])
    assert all(r["kind"] not in ("stage", "baseline") for r in results["records"])


# ---- the greedy check -------------------------------------------------------------------------------------

def broken_from_call(first_broken_call: int):
    """SDPA until its `first_broken_call`-th call (0-based), then SDPA's output replaced by large noise: a decode
    attention that goes wrong part-way through a generation."""
    generator = torch.Generator().manual_seed(9)

    def attend(q, k_cache, v_cache, cache_seqlens, block_table=None, **hints):
        out = dec.sdpa_attend(q, k_cache, v_cache, cache_seqlens, block_table, **hints)
        attend.calls += 1
        if attend.calls > first_broken_call:
            return 50.0 * torch.randn(out.shape, generator=generator, dtype=out.dtype)
        return out

    attend.calls = 0
    return attend


@pytest.fixture(scope="module")
def tiny_model():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield dec.Decoder(dec.TINY, dtype=torch.float32, seed=3)
    torch.set_num_threads(threads)


def tiny_prompt(batch=4, length=6):
    return torch.randint(0, dec.TINY.vocab_size, (batch, length), generator=torch.Generator().manual_seed(2))


def test_greedy_check_of_an_attention_with_itself_is_identical(tiny_model):
    record = tokens.compare_greedy(tiny_model, tiny_prompt(), 6, dec.sdpa_attend, dec.sdpa_attend, other_paged=True,
                                   page_size=4)
    assert record["identical"] and record["first_divergence"] is None
    assert record["sequences_identical"] == 4 and record["agree_to_rounding"]
    assert record["max_logit_diff"] < 1e-5 and record["min_reference_margin"] > 0


@pytest.mark.parametrize("broken_step", [1, 3])
def test_greedy_check_finds_the_step_where_a_wrong_attention_diverges(tiny_model, broken_step):
    # TINY has 2 layers: decode step s (1-based) makes calls 2(s-1) and 2(s-1)+1
    other = broken_from_call(2 * (broken_step - 1))
    record = tokens.compare_greedy(tiny_model, tiny_prompt(), 6, dec.sdpa_attend, other)
    first = record["first_divergence"]
    assert not record["identical"] and first is not None
    assert first["step"] == broken_step, first
    assert first["reference_token"] != first["other_token"]
    assert 1 <= first["sequences_diverged"] <= 4 and record["sequences_identical"] == 4 - first["sequences_diverged"]
    # noise is not rounding: the check must not excuse it as a near tie
    assert not record["agree_to_rounding"] and not first["near_tie"]
    assert first["logit_max_abs_diff"] > 1e-2
    assert "suspect" in tokens.greedy_note(record)


def test_a_near_tie_is_reported_as_one(tiny_model):
    # a perturbation at rounding level that flips a token can only do so at a near tie
    record = {"identical": False, "sequences_identical": 3, "max_logit_diff": 2e-7, "logit_absmax": 0.5,
              "relative_logit_diff": 4e-7, "rounding_tolerance": 1.9e-6, "agree_to_rounding": True,
              "min_reference_margin": 1e-7,
              "first_divergence": {"step": 5, "sequence": 1, "reference_token": 3, "other_token": 7,
                                   "reference_top2_margin": 1e-7, "logit_max_abs_diff": 2e-7, "near_tie": True,
                                   "sequences_diverged": 1}}
    note = tokens.greedy_note(record)
    assert "step 5" in note and "near tie" in note and "suspect" not in note


def test_greedy_check_refuses_zero_tokens(tiny_model):
    with pytest.raises(ValueError, match="new_tokens"):
        tokens.compare_greedy(tiny_model, tiny_prompt(), 0, dec.sdpa_attend, dec.sdpa_attend)


# ---- the command line -------------------------------------------------------------------------------------

def test_full_run_is_refused_off_a_gpu(capsys, tmp_path):
    from wb_kernels.timing import on_gpu

    if on_gpu():
        pytest.skip("this machine has a GPU: the full run is allowed here")
    assert tokens.main(["--json", str(tmp_path / "x.json")]) == 2
    assert "needs a CUDA GPU" in capsys.readouterr().err and not (tmp_path / "x.json").exists()


@pytest.mark.parametrize("argv, message", [
    (["--smoke", "--steps", "0"], "steps=0"),
    (["--smoke", "--batches", "1,x"], "comma-separated integers"),
    (["--smoke", "--batches", "1000"], "at most 256"),
    (["--smoke", "--contexts", "600"], "max_seq_len=512"),
    (["--smoke", "--configs", "llama_1b"], "only --configs tiny"),
    (["--smoke", "--configs", "tiny,nope"], "configs"),
    (["--smoke", "--greedy-tokens", "1000"], "greedy_tokens"),
])
def test_bad_arguments_get_clear_errors(capsys, argv, message):
    with pytest.raises(SystemExit) as exit_info:
        tokens.main(argv)
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err


def test_settings_are_bounded():
    tokens.check_settings(tokens.GPU_SETTINGS)
    tokens.check_settings(tokens.SMOKE_SETTINGS)
    # the default GPU run's plan: under 7 minutes (6 until the graph rows of FlashInfer came, 2026-11-27)
    assert tokens.estimate_seconds(tokens.GPU_SETTINGS) < 420
    with pytest.raises(ValueError, match="steps"):
        tokens.check_settings(tokens.Settings(**{**tokens.SMOKE_SETTINGS.__dict__, "steps": tokens.MAX_STEPS + 1}))


# ---- the reader the lesson uses -----------------------------------------------------------------------------

def test_reader_without_a_committed_run(tmp_path):
    assert slider.committed_decoder_results(tmp_path) is None
    assert slider.committed_decoder_results(tmp_path / "no such folder") is None
    assert slider.describe_decoder_run(tmp_path) == slider.NO_DECODER_RUN
    assert "results/decode/decoder_<gpu>.json" in slider.NO_DECODER_RUN


def test_reader_picks_the_newest_gpu_run_and_skips_the_rest(tmp_path, smoke):
    results = json.loads(smoke[1].read_text())
    (tmp_path / "decoder_smoke.json").write_text(json.dumps(results))  # a smoke run: not GPU numbers
    (tmp_path / "decoder_broken.json").write_text("{ not json")
    (tmp_path / "bench_h100.json").write_text(json.dumps({**results, "mode": "gpu"}))  # not a decoder_ file
    assert slider.committed_decoder_results(tmp_path) is None
    for name, date in (("decoder_h100.json", "2026-01-02T00:00:00Z"), ("decoder_h200.json", "2026-03-04T00:00:00Z")):
        gpu_run = {**results, "mode": "gpu", "environment": {**results["environment"], "gpu": "Test GPU", "date": date}}
        (tmp_path / name).write_text(json.dumps(gpu_run))
    assert slider.committed_decoder_results(tmp_path).name == "decoder_h200.json"
    text = slider.describe_decoder_run(tmp_path)
    assert text.startswith("decoder_h200.json:") and "Test GPU, 2026-03-04" in text
    assert "smoke run" not in text


def test_decoder_table_shows_every_row_and_the_greedy_verdicts(smoke):
    results = json.loads(smoke[1].read_text())
    results["records"].append({**results["records"][0], "status": "skipped", "reason": "does not fit: test"})
    lines = slider.decoder_table(results).splitlines()
    header = next(line for line in lines if line.startswith("config"))
    for column in ("batch", "context", "layout", "attend", "tokens/s", "ms/step", "attention", "vs SDPA",
                   "roofline"):
        assert column in header
    for column in ("mode",):
        assert column in header
    rows = [line for line in lines if line.startswith("tiny ")]
    assert len(rows) == 14 and rows[-1].endswith("skipped: does not fit: test")
    # no GPU here: FlashInfer's eager and graph rows say why
    assert sum("flashinfer" in row and "skipped: flashinfer" in row for row in rows) == 2
    wb_rows = [row.split() for row in rows if row.split()[5] == "wb"]
    # vs SDPA, vs FlashInfer (none to compare with here: a dash), roofline
    # (compile runs SDPA on the contiguous cache only: the compiled paged row has no SDPA to compare with, a dash)
    assert len(wb_rows) == 6 and all(cells[-3] == ("–" if cells[3:5] == ["compile", "paged"] else cells[-3])
                                     and cells[-3][-1] in "x–" and cells[-2] == "–" and cells[-1].endswith("%")
                                     for cells in wb_rows)
    assert sum(cells[-3].endswith("x") for cells in wb_rows) == 5
    # a graph row has no attention share of its own: a dash
    assert all(cells[-4] == "–" for cells in wb_rows if cells[3] == "graph")
    assert sum(line.startswith("greedy, tiny") for line in lines) == 9
    assert "smoke run" in lines[0]
