"""Lesson 07 (decode): the compiled step's variants (``decoder_graphs.COMPILE_VARIANTS``) and the run that compares
them (``decoder_tokens --variants``), for the bar of the decoder at its roofline.

On the CPU: the names and their errors, every variant's Inductor options accepted by this torch's ``torch.compile``,
the split gate/up step against the fused one, the timing of a compiled step, the time budget, and the smoke run
through the command line (the step traced with ``backend="eager"``: the variants' options do not apply there, so the
CPU checks their plumbing, not their speed). On a GPU (marked, skipped here): two variants compiled by Inductor.
"""

from __future__ import annotations

import json
import time
from dataclasses import replace

import pytest
import torch

from wb_kernels.models import decoder_graphs as dg
from wb_kernels.bench import decoder_tokens as tokens
from wb_kernels.bench import decoder_variants as variants
from wb_kernels.models import llama_decoder as dec

ON_CUDA = torch.cuda.is_available()


@pytest.fixture(scope="module")
def tiny_model():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield dec.Decoder(dec.TINY, dtype=torch.float32, seed=4)
    torch.set_num_threads(threads)


# ---- the variants -----------------------------------------------------------------------------------------

def test_variant_names_put_the_baseline_first_and_refuse_unknown_names():
    assert dg.variant_names("default") == dg.DEFAULT_VARIANTS
    assert dg.DEFAULT_VARIANTS[0] == "reduce-overhead" and dg.DEFAULT_VARIANTS[-1] == "max-autotune"
    assert dg.variant_names("coordinate-descent") == ("reduce-overhead", "coordinate-descent")
    assert dg.variant_names("max-autotune, reduce-overhead,max-autotune") == ("reduce-overhead", "max-autotune")
    assert set(dg.variant_names("all")) == set(dg.COMPILE_VARIANTS)
    for bad in ("fastest", "default,nope", " , "):
        with pytest.raises(ValueError, match="variant"):
            dg.variant_names(bad)


def test_a_variant_is_a_mode_or_options():
    with pytest.raises(ValueError, match="mode or options"):
        dg.CompileVariant("both", "x", mode="reduce-overhead", options=(("max_autotune", True),))
    with pytest.raises(ValueError, match="mode or options"):
        dg.CompileVariant("neither", "x")
    assert dg.COMPILE_VARIANTS["reduce-overhead"].compile_kwargs() == {"mode": "reduce-overhead"}
    options = dg.COMPILE_VARIANTS["coordinate-descent"].compile_kwargs()["options"]
    assert options["coordinate_descent_tuning"] is True and options["triton.cudagraphs"] is True


@pytest.mark.parametrize("name", sorted(dg.COMPILE_VARIANTS))
def test_every_variant_is_replayed_in_cuda_graphs_and_its_options_are_inductors(name):
    """torch.compile checks the names of its options when it is called (an unknown one raises at once): every
    variant's are known to this torch. Each variant keeps reduce-overhead's CUDA graphs (a mode that does not,
    or options without triton.cudagraphs, would time the host's launches, not the step)."""
    from torch._inductor import list_mode_options

    variant = dg.COMPILE_VARIANTS[name]
    torch.compile(lambda x: x + 1, **variant.compile_kwargs())  # raises RuntimeError on an unknown option
    options = list_mode_options(variant.mode) if variant.mode else dict(variant.options)
    assert options.get("triton.cudagraphs") is True, name


def test_the_split_gate_up_step_is_the_fused_step(tiny_model):
    """Two products over the row halves of the MLP's matrix: the same logits up to float32 rounding."""
    logits = []
    for split in (False, True):
        cache = tiny_model.new_cache(2, 12)
        tiny_model.prefill(torch.randint(0, dec.TINY.vocab_size, (2, 5), generator=torch.Generator().manual_seed(1)),
                           cache)
        with torch.inference_mode():
            logits.append(tiny_model.forward_step(torch.tensor([3, 7]), cache, dec.sdpa_attend, max_seqlen=12,
                                                  equal_lengths=False, split_gate_up=split))
    assert not torch.equal(logits[0], torch.zeros_like(logits[0]))
    torch.testing.assert_close(logits[1], logits[0], rtol=1e-5, atol=1e-5)


def test_time_compiled_times_from_the_same_context_each_repeat(tiny_model):
    cache = tiny_model.new_cache(1, 10)
    runner = dg.CompiledDecoder.for_variant(tiny_model, dec.sdpa_attend, cache=cache,
                                            variant=dg.COMPILE_VARIANTS["coordinate-descent-split-gate-up"],
                                            backend="eager")
    assert runner.split_gate_up and runner.first_step_s is None
    result = dg.time_compiled(runner, context=6, steps=3, warmup=1, repeats=3)
    assert len(result["ms_per_step_repeats"]) == 3 and result["ms_per_step_min"] <= result["ms_per_step"]
    assert result["tokens_per_s"] == pytest.approx(1e3 / result["ms_per_step"])
    assert result["mean_context"] == 6 + 1 + 2
    assert cache.cache_seqlens.tolist() == [6 + 1 + 3]  # the last repeat's steps, from 6 keys again
    assert runner.first_step_s is not None and runner.first_step_s > 0
    with pytest.raises(ValueError, match="capacity"):
        dg.time_compiled(runner, context=7, steps=3, warmup=1)


# ---- the run ----------------------------------------------------------------------------------------------

def test_variant_settings_and_plan():
    tokens.check_variant_settings(tokens.GPU_VARIANT_SETTINGS)
    tokens.check_variant_settings(tokens.SMOKE_VARIANT_SETTINGS)
    two = replace(tokens.GPU_VARIANT_SETTINGS, contexts=(1024, 4096))
    plan = tokens.variant_plan(two)
    # every variant at 1k before any at 4k, the slowest compilation (max-autotune) after all the others
    assert plan[:4] == [(name, 1024) for name in dg.DEFAULT_VARIANTS[:4]]
    assert plan[4:8] == [(name, 4096) for name in dg.DEFAULT_VARIANTS[:4]]
    assert plan[8:] == [("max-autotune", 1024), ("max-autotune", 4096)]
    assert 100 < tokens.estimate_variant_seconds(tokens.GPU_VARIANT_SETTINGS) < 400
    for change, message in ((dict(greedy_tokens=40), "greedy_tokens"), (dict(variants=("nope",)), "variants"),
                            (dict(attend="flashinfer"), "attend"), (dict(contexts=(0,)), "contexts"),
                            (dict(repeats=0), "repeats"), (dict(contexts=(131072,)), "max_seq_len"),
                            (dict(profile_steps=35), "profile_steps"), (dict(profile_steps=-1), "profile_steps")):
        with pytest.raises(ValueError, match=message):
            tokens.check_variant_settings(replace(tokens.GPU_VARIANT_SETTINGS, **change))


def test_kernels_are_sorted_into_kinds_by_name():
    for name, kind in (("void wb::decode_split_kernel<__half, 128, 4, 8, 2, true>(wb::DecodeParams)", "attention"),
                       ("void flash_fwd_splitkv_kernel<Flash_fwd_kernel_traits<128>>", "attention"),
                       ("void gemv2T_kernel_val<int, int, __half, __half, float, 128, 16, 4, 4>", "matrix products"),
                       ("sm90_xmma_gemm_f16f16_f16f32_f32_tn_n_tilesize64x64x64", "matrix products"),
                       ("triton_red_fused__to_copy_add_mean_mul_pow_rsqrt_0", "Inductor (Triton)"),
                       ("Memcpy DtoD (Device -> Device)", "copies and fills"),
                       ("void at::native::vectorized_elementwise_kernel<4, at::native::FillFunctor<float>>",
                        "copies and fills"),
                       ("void at::native::reduce_kernel<512, 1>", "other")):
        assert dg.kernel_kind(name) == kind, name


def test_device_events_are_summed_per_step_by_kind_and_name():
    events = [("gemv2T_kernel", 10.0), ("gemv2T_kernel", 14.0), ("triton_poi_fused_silu_0", 3.0),
              ("wb::decode_split_kernel<>", 6.0), ("Memset (Device)", 1.0)] * 2  # two steps
    summary = dg.summarize_device_events(events, 2, top=2)
    assert summary["steps"] == 2 and summary["kernels_per_step"] == 5 and summary["kernel_us_per_step"] == 34
    assert list(summary["by_kind"]) == ["matrix products", "attention", "Inductor (Triton)", "copies and fills"]
    assert summary["by_kind"]["matrix products"] == {"kernels_per_step": 2, "us_per_step": 24}
    assert summary["top"] == [{"name": "gemv2T_kernel", "kind": "matrix products", "calls_per_step": 2,
                               "us_per_step": 24},
                              {"name": "wb::decode_split_kernel<>", "kind": "attention", "calls_per_step": 1,
                               "us_per_step": 6}]
    assert dg.summarize_device_events([], 3)["kernels_per_step"] == 0


def test_a_spent_budget_starts_no_variant(tmp_path):
    settings = replace(tokens.SMOKE_VARIANT_SETTINGS, attend="sdpa")
    results = tokens.run_variants(settings, tmp_path / "v.json", progress=False, time_budget=0.0, smoke=True)
    assert results["complete"] is False and results["ceilings"]["copy_gbps"] > 0
    assert [r["status"] for r in results["records"]] == ["skipped"] * len(dg.DEFAULT_VARIANTS)
    assert all("time budget" in r["reason"] for r in results["records"])
    assert json.loads((tmp_path / "v.json").read_text())["records"] == results["records"]


def test_the_deadline_stops_what_runs_past_it():
    with pytest.raises(variants._OutOfTime):
        with variants._deadline(0.05):
            time.sleep(2)
    with variants._deadline(None):  # no budget: nothing armed
        time.sleep(0.01)
    with variants._deadline(5.0):  # disarmed on the way out: no alarm later
        pass
    time.sleep(0.01)


@pytest.fixture(scope="module")
def variants_smoke(tmp_path_factory):
    """The smoke run of every default variant through the command line, with SDPA (wb.decode on the simulator is
    the slow part: the wb path is the next test's): (exit code, results, what it printed)."""
    import contextlib
    import io

    out = tmp_path_factory.mktemp("variants") / "decoder_variants_smoke.json"
    printed = io.StringIO()
    threads = torch.get_num_threads()
    try:
        with contextlib.redirect_stdout(printed):
            code = tokens.main(["--smoke", "--variants", "default", "--attend", "sdpa", "--json", str(out),
                                "--no-progress", "--profile-steps", "1"])
    finally:
        torch.set_num_threads(threads)
    return code, json.loads(out.read_text()), printed.getvalue()


def test_the_smoke_run_of_the_variants(variants_smoke):
    code, results, printed = variants_smoke
    assert code == 0 and results["kind"] == "decoder_variants" and results["mode"] == "smoke"
    assert results["complete"] is True and results["roofline_bar"] == 0.6
    assert results["command"].startswith("python -m wb_kernels.bench.decoder_tokens --smoke --variants default")
    records = results["records"]
    assert [r["variant"] for r in records] == list(dg.DEFAULT_VARIANTS)
    for r in records:
        assert r["status"] == "ok", r
        assert r["kind"] == "decoder_variant" and r["batch"] == 1 and r["context"] == 16 and r["attend"] == "sdpa"
        assert r["capacity"] == 16 + 1 + 3 and len(r["ms_per_step_repeats"]) == 2
        assert r["ms_per_step_min"] <= r["ms_per_step"] and r["compile_s"] > 0 and r["captured"] is False
        assert r["fraction_of_roofline"] == pytest.approx(r["roofline"]["step_ms"] / r["ms_per_step"], rel=1e-2)
        # TINY in float32, traced only: the very same tokens as the eager decoder
        assert r["greedy_verdict"] == "identical" and r["greedy"]["identical"] and r["greedy"]["new_tokens"] == 4
        assert r["options"] == dict(dg.COMPILE_VARIANTS[r["variant"]].options)
        assert ("vs_baseline" in r) == (r["variant"] != "reduce-overhead")
        # --profile-steps: on the CPU the profile has no device events, and says so
        assert r["profile"]["device"] == "cpu (no device events)" and r["profile"]["kernels_per_step"] == 0
        if "vs_baseline" in r:
            assert r["vs_baseline"] == pytest.approx(records[0]["ms_per_step"] / r["ms_per_step"], rel=1e-3)
    assert [r["split_gate_up"] for r in records] == [name.endswith("split-gate-up") for name in dg.DEFAULT_VARIANTS]
    assert "L=16: best " in printed and "the bar, 60 %, is not met" in printed and "wrote " in printed


def test_the_smoke_run_with_the_series_kernel(tmp_path):
    settings = replace(tokens.SMOKE_VARIANT_SETTINGS, variants=("reduce-overhead",), repeats=1, greedy_tokens=2)
    results = tokens.run_variants(settings, tmp_path / "v.json", progress=False, smoke=True)
    record = results["records"][0]
    assert record["status"] == "ok" and record["attend"] == "wb" and record["greedy_verdict"] == "identical"


def test_variant_arguments_and_their_errors(capsys, tmp_path):
    assert tokens.main(["--variants", "default", "--plan"]) == 0
    printed = capsys.readouterr().out
    assert "reduce-overhead at 1024 keys" in printed and "max-autotune at 1024 keys" in printed
    for argv, message in ((["--smoke", "--variants", "nope"], "variant 'nope'"),
                          (["--smoke", "--repeats", "3"], "belong to --variants"),
                          (["--smoke", "--variants", "default", "--configs", "llama_1b"], "only --configs tiny"),
                          (["--smoke", "--variants", "default", "--configs", "tiny,tiny"], "one name"),
                          (["--smoke", "--variants", "default", "--greedy-tokens", "9"], "greedy_tokens")):
        with pytest.raises(SystemExit) as exit_info:
            tokens.main(argv)
        assert exit_info.value.code == 2, argv
        assert message in capsys.readouterr().err, argv


# ---- on a GPU -----------------------------------------------------------------------------------------------

@pytest.mark.skipif(not ON_CUDA, reason="needs a CUDA GPU: Inductor's Triton kernels and CUDA graphs")
def test_two_variants_compiled_by_inductor_on_a_gpu(tmp_path):
    """TINY in float16 with wb.decode: the baseline and gpt-fast's coordinate descent compile, replay CUDA graphs
    and generate the eager decoder's tokens (or flip one at a near tie, which rounding explains)."""
    settings = replace(tokens.GPU_VARIANT_SETTINGS, variants=("reduce-overhead", "coordinate-descent"), config="tiny",
                       contexts=(64,), steps=8, repeats=2, greedy_tokens=8)
    results = tokens.run_variants(settings, tmp_path / "v.json", progress=False)
    for record in results["records"]:
        assert record["status"] == "ok", record
        assert record["captured"] is True and record["greedy_verdict"] in ("identical", "near tie"), record
