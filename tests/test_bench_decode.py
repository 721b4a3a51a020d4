"""The decode presets of the benchmark (wb_kernels/bench/decode.py): workloads, byte counts, the results file, the
README table and the figure, and a run at tiny sizes on the simulator."""

from __future__ import annotations

import warnings

import numpy as np
import pytest

import wb_kernels as wb
from wb_kernels import bench
from wb_kernels.bench import decode, figures, sweeps
from wb_kernels.bench import results as results_file
from wb_kernels.bench.measure import TimingPolicy
from wb_kernels.bench.sweeps import DECODE_PRESETS, DecodeWorkload

ON_SIMULATOR = wb.BACKEND.is_simulator
simulator_only = pytest.mark.skipif(not ON_SIMULATOR, reason="what a machine without a GPU does")

# The smallest decode run that still has GQA, two sequences (the check reads the last one too), two pages per
# sequence and FlexAttention planned; and a bf16 workload, which the decode stage does not take.
TINY = (DecodeWorkload(2, 2, 1, 32, 16, "float32", flex=True), DecodeWorkload(1, 2, 2, 16, 16, "bfloat16"))
FAST = ["--seconds", "0.001", "--min-repeats", "1", "--max-repeats", "1", "--no-progress", "--no-figures"]


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory):
    """The decode-smoke preset, made tinier, run into a file: each measurement one checked call, one to estimate,
    one timed (the command line, which adds warm-up calls, resumes it in test_tiny_run_resumes_and_round_trips)."""
    out = tmp_path_factory.mktemp("decode") / "decode.json"
    policy = TimingPolicy(seconds=0.001, min_repeats=1, max_repeats=1, warmup=0)
    decode.run_decode(TINY, out, presets=("decode-smoke",), policy=policy, progress=False, log=lambda *a: None)
    return out


def _by_key(results):
    return {r["key"]: r for r in results["records"]}


# ---------------------------------------------------------------- what is measured


def test_decode_preset_covers_the_issues_workloads():
    workloads = set(DECODE_PRESETS["decode"])
    shapes = {(w.B, w.H, w.Hk, w.Lk, w.D, w.dtype) for w in workloads}
    for bar in sweeps.DECODE_BAR:
        assert bar in shapes
    assert (8, 32, 8, 8192, 128, "float16") in shapes and (1, 32, 8, 32768, 128, "float16") in shapes
    grid = {(B, 32, Hk, Lk, 128, "float16") for B in (1, 8, 64) for Hk in (32, 8, 1) for Lk in sweeps.DECODE_LENGTHS}
    assert grid <= shapes
    assert sweeps.DECODE_LENGTHS == (1024, 4096, 8192, 32768, 131072)
    assert {(w.dtype, w.D) for w in workloads} == {("float16", 128), ("bfloat16", 128), ("float16", 64)}
    assert all(w.Lk % sweeps.DECODE_PAGE_SIZE == 0 for p in DECODE_PRESETS.values() for w in p)
    # FlexAttention (a compilation per shape) at the figure's shapes: the bar shapes' Lk sweeps
    assert {(w.B, w.Hk, w.D, w.dtype) for w in workloads if w.flex} == {(8, 8, 128, "float16"), (1, 8, 128, "float16")}
    mqa = {w for w in workloads if (w.B, w.H, w.Hk, w.Lk, w.D, w.dtype) in sweeps.DECODE_MQA_BAR}
    assert len(mqa) == 2 and set(DECODE_PRESETS["decode-bar"]) == {w for w in workloads if w.flex} | mqa
    for name in ("decode", "decode-bar"):
        assert name in sweeps.GPU_PRESETS and name not in sweeps.ALL_PRESETS and name in sweeps.PRESET_HELP
    assert "decode-smoke" not in sweeps.GPU_PRESETS


def test_plan_runs_every_contender_on_both_layouts_bar_first():
    table = decode.decode_contenders()
    jobs = decode.plan_decode(DECODE_PRESETS["decode"], table)
    first = [(w.B, w.H, w.Hk, w.Lk, w.D, w.dtype) for w in dict.fromkeys(w for w, _, _ in jobs)][:2]
    assert set(first) == set(sweeps.DECODE_BAR)
    bar = jobs[0][0]
    ours = {(c.name, layout) for w, c, layout in jobs if w == bar}
    assert {("wb.decode", "contiguous"), ("wb.decode", "paged"), ("decode_forward", "contiguous"),
            ("decode_forward", "paged"), ("copy", "contiguous"), ("flex", "contiguous")} <= ours
    assert {name for name, _ in ours} >= {"sdpa", "sdpa-flash", "sdpa-efficient", "sdpa-cudnn", "sdpa-math"}
    # SDPA has no paged cache; FlashInfer's decode reads nothing else
    assert all(layout == ("paged" if c.name.startswith("flashinfer") else "contiguous")
               for _, c, layout in jobs if c.kind != "stage")
    assert {("flashinfer", "paged"), ("flashinfer-tc", "paged")} <= ours
    layouts = [layout for w, _, layout in jobs if w == bar]
    assert layouts == sorted(layouts, key=lambda layout: layout != "contiguous")  # paged last: the cache is dropped
    assert not any(c.name == "flex" and not w.flex for w, c, _ in jobs)
    assert len(jobs) == len(set((w, c.name, layout) for w, c, layout in jobs))


def test_decode_preset_fits_the_run_time_on_an_h100():
    """The plan's estimate (guessed rates, on the slow side for the kernels not measured yet) stays under 8 minutes
    for the full preset and under 3 for the bar's subset, at the command line's default of 0.1 s per measurement."""
    policy = TimingPolicy(seconds=0.1)
    table = decode.decode_contenders()
    full = decode.estimate_seconds(decode.plan_decode(DECODE_PRESETS["decode"], table), policy)
    bar = decode.estimate_seconds(decode.plan_decode(DECODE_PRESETS["decode-bar"], table), policy)
    assert 120 < full < 8 * 60 and 30 < bar < 3 * 60


def test_kv_bytes_are_k_and_v_read_once():
    assert sweeps.decode_kv_bytes(8, 8, 8192, 128, 2) == 2 * 8 * 8 * 8192 * 128 * 2 == 256 * 2**20
    w = DecodeWorkload(1, 32, 8, 32768, 128, "float16")
    assert w.kv_bytes == 128 * 2**20 and w.key == "float16|B1|H32|Hk8|Lk32768|D128"
    assert sweeps.decode_record_key("wb.decode", "paged", w) == "wb.decode|paged|float16|B1|H32|Hk8|Lk32768|D128"
    assert DecodeWorkload(64, 32, 32, 131072, 128, "float16").kv_bytes == 128 * 2**30


def test_memory_refusal_says_what_does_not_fit():
    h100_free = int(78 * 2**30)
    biggest = DecodeWorkload(64, 32, 32, 131072, 128, "float16")  # 128 GiB of K and V
    why = decode.memory_refusal(biggest, True, h100_free)
    assert why.startswith("does not fit: K and V take 128.0 GiB") and "78.0 GiB" in why
    for workload in DECODE_PRESETS["decode"]:
        if workload.kv_bytes <= 32 * 2**30:  # the cache and its paged pools: 2x, and some slack
            assert decode.memory_refusal(workload, True, h100_free) is None, workload
    assert "copy ceiling" in decode.memory_refusal(DecodeWorkload(64, 32, 8, 131072, 128, "float16"), False, 40 * 2**30)
    assert decode.memory_refusal(biggest, True, None) is None  # nothing to check off a GPU


def test_check_slice_reads_the_first_and_last_sequence_and_heads_of_several_kv_heads():
    assert decode.check_slice_indices(1, 4, 32, 16) == ([0], [0, 1, 2, 3])
    assert decode.check_slice_indices(8, 32, 1024, 128) == ([0, 7], list(range(32)))
    assert decode.check_slice_indices(8, 32, 8192, 128) == ([0, 7], [0, 1, 16, 31])
    assert decode.check_slice_indices(8, 32, 131072, 128) == ([0], [0, 1, 16, 31])
    for B, H, Lk, D in ((64, 32, 131072, 128), (1, 32, 131072, 128)):
        sequences, heads = decode.check_slice_indices(B, H, Lk, D)
        assert len(sequences) * len(heads) * Lk * D <= decode.CHECK_MAX


def test_paged_copy_holds_the_cache_where_the_block_table_says():
    torch = pytest.importorskip("torch")
    from wb_kernels.stages.decode.launcher import gather_pages

    w = DecodeWorkload(3, 4, 2, 48, 8, "float32")
    inputs = decode.make_inputs(w, 0, "cpu")
    k, v = inputs.k.clone(), inputs.v.clone()
    decode.add_pages(inputs, w, 0)
    assert inputs.k is None and inputs.v is None  # the contiguous cache is dropped
    table = inputs.block_table
    assert table.dtype == torch.int32 and table.shape == (3, 3)
    assert sorted(table.flatten().tolist()) == list(range(9)) and table.flatten().tolist() != list(range(9))
    for b in range(3):
        assert torch.equal(gather_pages(inputs.k_pages, table, 48, b), k[b])
        assert torch.equal(gather_pages(inputs.v_pages, table, 48, b), v[b])
    again = decode.make_inputs(w, 0, "cpu")  # a resumed run sees the same numbers
    assert torch.equal(again.k, k) and not torch.equal(decode.make_inputs(w, 1, "cpu").k, k)
    with pytest.raises(ValueError, match="multiple of the page size"):
        decode.add_pages(decode.make_inputs(DecodeWorkload(1, 1, 1, 20, 8, "float32"), 0, "cpu"),
                         DecodeWorkload(1, 1, 1, 20, 8, "float32"), 0)


def test_per_call_seconds_times_back_to_back_batches():
    calls = []
    samples = decode.per_call_seconds(lambda: calls.append(1), calls=10, batches=3, warmup=2)
    assert len(calls) == 2 + 10 * 3 and len(samples) == 3 and all(s >= 0 for s in samples)


# ---------------------------------------------------------------- refusals without a GPU


@simulator_only
def test_what_needs_a_gpu_says_so(capsys, tmp_path):
    out = tmp_path / "x.json"
    for preset in ("decode", "decode-bar"):
        assert bench.main(["--preset", preset, "--out", str(out)]) == 2
        err = capsys.readouterr().err
        assert "needs a CUDA GPU" in err and "--preset decode-smoke" in err
    assert bench.main(["--preset", "decode-smoke", "--preset", "smoke", "--out", str(out)]) == 2
    assert "file of its own" in capsys.readouterr().err
    assert bench.main(["--preset", "decode-smoke", "--lengths", "32", "--out", str(out)]) == 2
    assert not out.exists()
    table = decode.decode_contenders()
    w = DecodeWorkload(1, 2, 1, 16, 16, "float16", flex=True)
    assert "needs a CUDA GPU" in decode.refusal(table["flex"], w, on_cuda=False) or table["flex"].unavailable
    rows = decode.measure_overhead()["rows"]
    assert [row["name"] for row in rows] == ["sdpa", "wb.attention(stage='mma')", "wb.attention(stage='wmma')",
                                             "sdpa", "wb.decode", "decode_forward"]
    assert all(row["status"] == "skipped" and decode.NEEDS_GPU in row["reason"] for row in rows)


def test_overhead_rows_check_then_time_each_call():
    """The per-call overhead's GPU code path, run on CPU tensors at sizes the simulator takes: each call checked,
    timed beside SDPA's on the same problem; a GPU-only stage fails with its reason instead of a number."""
    rows = decode.measure_overhead(device="cpu", attention=(1, 2, 16, 16, "float32"),
                                   workload=DecodeWorkload(1, 2, 1, 16, 16, "float32"), calls=2, batches=2, warmup=0)
    rows = {(row["name"], row["problem"].split(",")[0]): row for row in rows["rows"]}
    attention, decoding = "B1 H2 L16 D16 float32", "B1 H2 Hk1 Lk16 D16 float32"
    assert list(rows) == [("sdpa", attention), ("wb.attention(stage='mma')", attention),
                          ("wb.attention(stage='wmma')", attention), ("sdpa", decoding), ("wb.decode", decoding),
                          ("decode_forward", decoding)]
    for key in (("sdpa", attention), ("sdpa", decoding)):
        assert rows[key]["status"] == "ok" and rows[key]["check"]["passed"] and "ratio_to_sdpa" not in rows[key]
    for name in ("wb.decode", "decode_forward"):
        row = rows[(name, decoding)]
        assert row["status"] == "ok" and row["check"]["passed"] and len(row["samples_us"]) == 2
        assert row["sdpa_per_call_us"] == rows[("sdpa", decoding)]["per_call_us"] and row["bar"] == decode.OVERHEAD_BAR
        assert row["ratio_to_sdpa"] == pytest.approx(row["per_call_us"] / row["sdpa_per_call_us"], rel=5e-3)
        assert row["meets_bar"] == (row["per_call_us"] <= 2 * row["sdpa_per_call_us"])
    for stage in ("mma", "wmma"):
        row = rows[(f"wb.attention(stage={stage!r})", attention)]
        if stage in wb.available_stages() and ON_SIMULATOR:
            assert row["status"] == "failed" and "runs only on a CUDA GPU" in row["reason"]


def test_refusals_name_their_reason():
    table = decode.decode_contenders()
    bf16 = DecodeWorkload(1, 32, 8, 1024, 128, "bfloat16")
    assert decode.refusal(table["wb.decode"], bf16, on_cuda=True) is None  # the CUDA kernel takes bfloat16
    why = decode.refusal(table["wb.decode"], bf16, on_cuda=False)  # the numba kernel does not
    assert why.startswith("the decode stage takes") and "bfloat16" in why
    assert "bfloat16" in decode.refusal(table["decode_forward"], DecodeWorkload(1, 32, 8, 1024, 32, "bfloat16"), True)
    assert decode.refusal(table["sdpa-flash"], bf16, on_cuda=True) is None
    small, big = DecodeWorkload(8, 32, 8, 8192, 128, "float16"), DecodeWorkload(8, 32, 8, 32768, 128, "float16")
    assert decode.refusal(table["sdpa-math"], small, on_cuda=True) is None  # 256 MiB of K and V, 1 GiB repeated
    assert "MATH repeats K and V" in decode.refusal(table["sdpa-math"], big, on_cuda=True)


def test_a_backend_that_refuses_is_a_row_with_its_reason():
    """What SDPA does on a GPU when a forced backend does not take the shape: it warns why, then raises."""
    def refusing(inputs, layout, workload):
        def call():
            warnings.warn("Memory efficient kernel not used because: Query.sizes(-3): 32, Key sizes(-3): 8")
            raise RuntimeError("No available kernel. Aborting execution.")

        return call, None

    contender = decode.DecodeContender("sdpa-efficient", "baseline", "x", refusing)
    record = decode.measure_one(contender, DecodeWorkload(1, 1, 1, 16, 8, "float32"), "contiguous", None, None,
                                TimingPolicy())
    assert record["status"] == "skipped" and record["reason"].startswith("RuntimeError: No available kernel")
    assert "Query.sizes(-3): 32, Key sizes(-3): 8" in record["reason"]


def test_a_failure_on_the_way_is_a_row_not_a_crash(tmp_path, monkeypatch):
    """What may go wrong only on a GPU (the paged pools out of memory, an output of the wrong shape) ends as rows
    that say why; the run goes on to the next contender."""
    def no_memory(*args, **kwargs):
        raise RuntimeError("CUDA out of memory. Tried to allocate 32.00 GiB")

    def wrong_shape(inputs, layout, workload):
        return (lambda: inputs.q[..., :1]), None  # (B, H, 1): not an output (B, H, D)

    monkeypatch.setattr(decode, "add_pages", no_memory)
    wrong = decode.DecodeContender("wrong-shape", "baseline", "x", wrong_shape)
    table = {name: c for name, c in decode.decode_contenders().items() if name in ("decode_forward", "copy")}
    w = DecodeWorkload(1, 2, 1, 16, 16, "float32")
    results = decode.run_decode([w], tmp_path / "x.json", table={**table, "wrong-shape": wrong}, overhead=False,
                                policy=TimingPolicy(seconds=0.001, min_repeats=1, max_repeats=1, warmup=0),
                                progress=False, log=lambda *a: None)
    rows = {(r["contender"], r["layout"]): r for r in results["records"]}
    assert rows[("decode_forward", "contiguous")]["status"] == "ok" and rows[("copy", "contiguous")]["status"] == "ok"
    paged = rows[("decode_forward", "paged")]
    assert paged["status"] == "skipped" and paged["reason"].startswith("could not build the paged cache: RuntimeError")
    shape = rows[("wrong-shape", "contiguous")]
    assert shape["status"] == "failed" and shape["reason"].startswith("check: CheckFailed: wrong-shape: output shape")


# ---------------------------------------------------------------- a run at tiny sizes (the simulator's)


def test_tiny_run_checks_and_times_every_contender(tiny_run):
    results = bench.load_results(tiny_run)
    assert results["kind"] == "decode" and results["presets"] == ["decode-smoke"] and results["complete"]
    assert set(results["notes"]) >= {"metric", "ceiling", "layouts", "check", "overhead"}
    assert set(results["contenders"]) >= {"wb.decode", "decode_forward", "sdpa", "copy", "flex"}
    for key in ("date", "backend", "device", "torch", "git_commit", "gpu", "cuda", "driver"):
        assert key in results["environment"]
    records = _by_key(results)
    fp32, bf16 = TINY
    for layout in ("contiguous", "paged"):
        for name in ("wb.decode", "decode_forward"):
            r = records[sweeps.decode_record_key(name, layout, fp32)]
            assert r["status"] == "ok" and r["check"]["passed"], r
            assert r["check"]["slice"] == "sequences [0, 1], heads [0, 1]"
            assert r["kind"] == "stage" and r["layout"] == layout and r["Lq"] == 1
            assert (r.get("page_size") == sweeps.DECODE_PAGE_SIZE) == (layout == "paged")
            why = records[sweeps.decode_record_key(name, layout, bf16)]
            assert why["status"] == "skipped" and "the decode stage takes" in why["reason"]
    for r in results["records"]:
        assert r["status"] in ("ok", "skipped", "failed") and r["presets"] == ["decode-smoke"]
        assert r["status"] != "failed", r
        if r["status"] == "ok":
            moved = r["kv_bytes"] * (2 if r["kind"] == "ceiling" else 1)
            assert r["gbps"] == pytest.approx(moved / (r["median_ms"] / 1e3) / 1e9, rel=1e-3)
            assert r["kv_bytes"] == sweeps.decode_kv_bytes(r["B"], r["Hk"], r["Lk"], r["D"], 4 if r["dtype"] ==
                                                           "float32" else 2)
            if r["kind"] != "ceiling":
                assert r["check"]["passed"]
        else:
            assert r["reason"]
    flex = records[sweeps.decode_record_key("flex", "contiguous", fp32)]
    # FlexAttention needs a GPU: skipped on the simulator, measured and checked on one
    assert flex["status"] == ("skipped" if ON_SIMULATOR else "ok"), flex
    assert ON_SIMULATOR or flex["check"]["passed"]
    assert not any(r["contender"] == "flex" for r in results["records"] if r["key"].endswith(bf16.key))
    assert all(row["status"] == "skipped" for row in results["overhead"]["rows"]) == ON_SIMULATOR
    # FlashInfer: a paged row on every workload, each saying why it was not timed (not installed or no GPU here; on
    # a GPU these tiny head dims are below what its kernels take)
    for workload in TINY:
        for name in ("flashinfer", "flashinfer-tc"):
            r = records[sweeps.decode_record_key(name, "paged", workload)]
            assert r["status"] == "skipped" and "flashinfer" in r["reason"], r


def test_fractions_and_ratios_are_of_the_same_workload(tiny_run):
    results = bench.load_results(tiny_run)
    for workload in TINY:
        group = [r for r in results["records"] if r["key"].endswith(workload.key) and r["status"] == "ok"]
        copy = [r for r in group if r["contender"] == "copy"][0]
        sdpa = [r for r in group if r["contender"].startswith("sdpa")]
        best = min(sdpa, key=lambda r: r["median_ms"])
        for r in group:
            assert r["fraction_of_copy"] == pytest.approx(r["gbps"] / copy["gbps"], rel=5e-3)  # 3 digits
            if r["kind"] != "ceiling":
                assert r["vs_best_sdpa"]["backend"] == best["contender"]
                assert r["vs_best_sdpa"]["ratio"] == pytest.approx(best["median_ms"] / r["median_ms"], rel=5e-3)
        assert copy["fraction_of_copy"] == 1.0 and "vs_best_sdpa" not in copy


def test_tiny_run_resumes_and_round_trips(tiny_run, tmp_path, capsys):
    out = tmp_path / "again.json"
    out.write_text(tiny_run.read_text())
    before = bench.load_results(out)
    with pytest.MonkeyPatch.context() as patch:
        patch.setitem(DECODE_PRESETS, "decode-smoke", TINY)
        assert bench.main(["--preset", "decode-smoke", "--out", str(out)] + FAST) == 0
    printed = capsys.readouterr().out
    assert f"writing {out}" in printed and "0 to run" in printed
    assert bench.load_results(out) == before
    bench.save_results(before, tmp_path / "copy.json")
    assert bench.load_results(tmp_path / "copy.json") == before
    # a file of another kind is not resumed as a decode file
    bench.save_results({**before, "kind": None}, out)
    with pytest.raises(bench.Refused, match="not a decode results file"):
        decode.run_decode(TINY, out, progress=False, log=lambda *a: None)


def test_tiny_runs_figure(tiny_run, tmp_path):
    results = bench.load_results(tiny_run)
    (path,) = figures.save_all(results, directory=tmp_path)  # a decode file gets the decode figure
    assert path.name == "bench_decode_bandwidth.png" and path.stat().st_size > 5000


# ---------------------------------------------------------------- README table and figure of a GPU file


def _gpu_results():
    """A fabricated decode results file (a test fixture, not a measurement): the bar shapes' sweeps over two lengths,
    every contender timed at a rate of its own, one SDPA backend refused, and the overhead rows."""
    rate = {"wb.decode": 1500.0, "decode_forward": 1600.0, "sdpa": 2000.0, "sdpa-flash": 2100.0,
            "sdpa-efficient": 900.0, "flex": 1800.0}
    records = []
    for B, Lk in ((8, 4096), (8, 8192), (1, 8192), (1, 32768)):
        w = DecodeWorkload(B, 32, 8, Lk, 128, "float16", flex=True)
        for name, layout, gbps in ([(n, "contiguous", g) for n, g in rate.items()]
                                   + [("wb.decode", "paged", 1400.0), ("copy", "contiguous", 3000.0),
                                      ("flashinfer", "paged", 1900.0), ("flashinfer-tc", "paged", 2400.0)]):
            kind = "stage" if name in ("wb.decode", "decode_forward") else "ceiling" if name == "copy" else "baseline"
            moved = w.kv_bytes * (2 if kind == "ceiling" else 1)
            records.append({"key": sweeps.decode_record_key(name, layout, w), "contender": name, "kind": kind,
                            "layout": layout, "dtype": w.dtype, "B": B, "H": 32, "Hk": 8, "Lq": 1, "Lk": Lk, "D": 128,
                            "kv_bytes": w.kv_bytes, "status": "ok", "median_ms": moved / gbps / 1e6, "gbps": gbps})
        records.append({"key": sweeps.decode_record_key("sdpa-cudnn", "contiguous", w), "contender": "sdpa-cudnn",
                        "kind": "baseline", "layout": "contiguous", "dtype": w.dtype, "B": B, "H": 32, "Hk": 8,
                        "Lq": 1, "Lk": Lk, "D": 128, "kv_bytes": w.kv_bytes, "status": "skipped",
                        "reason": "RuntimeError: No available kernel"})
    overhead = {"rows": [
        {"name": "sdpa", "problem": "B1 H16 L512 D64 float16", "status": "ok", "per_call_us": 20.0},
        {"name": "wb.attention(stage='mma')", "problem": "B1 H16 L512 D64 float16", "status": "ok",
         "per_call_us": 50.0, "sdpa_per_call_us": 20.0, "ratio_to_sdpa": 2.5, "meets_bar": False},
        {"name": "wb.decode", "problem": "B1 H32 Hk8 Lk1024 D128 float16, contiguous", "status": "ok",
         "per_call_us": 30.0, "sdpa_per_call_us": 20.0, "ratio_to_sdpa": 1.5, "meets_bar": True},
        {"name": "wb.attention(stage='wmma')", "problem": "B1 H16 L512 D64 float16", "status": "skipped",
         "reason": "stage 'wmma' is not registered in this checkout"}]}
    results = {"schema": bench.SCHEMA_VERSION, "kind": "decode", "presets": ["decode"], "records": records,
               "overhead": overhead, "environment": {"gpu": "Test GPU", "cuda": "13.0", "torch": "2.11",
                                                     "driver": "580", "date": "2026-11-24", "git_commit": "abc1234"}}
    return decode.add_decode_ratios(results)


def test_decode_readme_table_from_a_fabricated_file():
    lines = results_file.decode_readme_table(_gpu_results(), source="results/decode/x.json").splitlines()
    assert "Test GPU" in lines[0] and "results/decode/x.json" in lines[0] and "commit abc1234" in lines[0]
    assert lines[2] == ("| B | Lk | copy GB/s | wb.decode | decode_forward | wb.decode, paged | best SDPA | ×SDPA | "
                        "×SDPA, paged | flex | FlashInfer, paged | ×best peer |")
    rows = [line for line in lines if line.startswith("| ") and "|---" not in line][1:]
    # FlashInfer's faster kernel (tensor cores, 2400 GB/s) is the best peer: 1500 / 2400 for wb.decode's faster layout
    same = ("1500 (0.50) | 1600 (0.53) | 1400 (0.47) | 2100 (0.70) flash | 0.71 | 0.67 | 1800 (0.60) | "
            "2400 (0.80) tensor cores | 0.62 (flashinfer-tc) |")
    assert rows[:4] == [f"| 1 | 8192 | 3000 | {same}", f"| **1** | **32768** | 3000 | {same}",
                        f"| 8 | 4096 | 3000 | {same}", f"| **8** | **8192** | 3000 | {same}"]
    overhead = rows[4:]
    assert overhead[0].startswith("| call |")
    assert "| wb.attention(stage='mma') | B1 H16 L512 D64 float16 | 50.0 | 20.0 | 2.50 ✗ |" in overhead
    assert "| wb.decode | B1 H32 Hk8 Lk1024 D128 float16, contiguous | 30.0 | 20.0 | 1.50 ✓ |" in overhead
    assert "| wb.attention(stage='wmma') | B1 H16 L512 D64 float16 | skipped | – | – |" in overhead
    assert not any(line.startswith("| sdpa |") for line in overhead)


def test_decode_readme_block_is_filled_by_update_readme(tmp_path):
    path = tmp_path / "bench_h100.json"
    bench.save_results(_gpu_results(), path)
    readme = tmp_path / "README.md"
    ladder = f"{bench.README_START}\nladder table\n{bench.README_END}\n"
    readme.write_text(f"# T\n{ladder}{results_file.README_DECODE_START}\nplaceholder\n{results_file.README_DECODE_END}\n"
                      "after\n")
    bench.update_readme(path, readme)
    text = readme.read_text()
    assert "placeholder" not in text and ladder in text and text.endswith(f"{results_file.README_DECODE_END}\nafter\n")
    assert "| **8** | **8192** |" in text
    bench.update_readme(path, readme)
    assert readme.read_text() == text  # idempotent
    readme.write_text(ladder)
    with pytest.raises(bench.Refused, match="perf-table-decode:start"):
        bench.update_readme(path, readme)


def _readme_block(start: str, end: str) -> str:
    """The README's text between two markers (both must be there)."""
    text = (bench.REPO_ROOT / "README.md").read_text()
    assert start in text and end in text
    return text.split(start, 1)[1].split(end, 1)[0].strip("\n")


def test_readme_has_the_decode_block_and_it_is_up_to_date():
    block = _readme_block(results_file.README_DECODE_START, results_file.README_DECODE_END)
    path = results_file.committed_decode_results()
    if path is None:
        assert "results/decode/bench_h100.json" in block and "once that file is committed" in block
        return
    relative = str(path.relative_to(bench.REPO_ROOT))
    assert block == results_file.decode_readme_table(bench.load_results(path), source=relative), (
        f"README.md's decode table is stale: run python -m wb_kernels.bench --update-readme {relative}")


def test_a_decode_bar_file_fills_its_own_block_and_the_caption_says_what_else_it_holds(tmp_path):
    results = _gpu_results()
    results["presets"] = ["decode-bar"]
    path = tmp_path / "bench_decode_bar_h100_abc1234.json"
    bench.save_results(results, path)
    readme = tmp_path / "README.md"
    blocks = (f"{results_file.README_DECODE_START}\nfull preset\n{results_file.README_DECODE_END}\n"
              f"{results_file.README_DECODE_BAR_START}\nplaceholder\n{results_file.README_DECODE_BAR_END}\n")
    readme.write_text(blocks)
    bench.update_readme(path, readme)
    text = readme.read_text()
    assert "full preset" in text and "placeholder" not in text  # the full preset's table is left alone
    bar_block = text.split(results_file.README_DECODE_BAR_START, 1)[1]
    assert "| **8** | **8192** |" in bar_block
    # the caption names only what the file holds outside the table's view: nothing here, then what is added
    def caption():
        return results_file.decode_readme_table(results, source="x").splitlines()[0]

    assert caption().endswith("(the file says why).")
    results["records"].append(dict(results["records"][0], Hk=1))
    assert caption().endswith("(the file says why); other Hk are in the file.")
    results["records"][-1].update(Hk=8, dtype="bfloat16", D=64)
    assert caption().endswith("(the file says why); bf16 and D = 64 are in the file.")


def test_readme_has_the_decode_bar_block_and_it_is_up_to_date():
    """The README's second decode table is the newest committed decode-bar run's (what lesson 07 reads too)."""
    from wb_kernels.stages.decode import slider

    block = _readme_block(results_file.README_DECODE_BAR_START, results_file.README_DECODE_BAR_END)
    path = slider.committed_decode_bar_results()
    relative = str(path.relative_to(bench.REPO_ROOT))
    assert block == results_file.decode_readme_table(bench.load_results(path), source=relative), (
        f"README.md's decode-bar table is stale: run python -m wb_kernels.bench --update-readme {relative}")


def test_decode_figure_draws_the_bar_shapes(tmp_path):
    results = _gpu_results()
    assert figures.decode_families(results) == [("float16", 128, 32, 8, 8), ("float16", 128, 32, 8, 1)]
    fig = figures.decode_figure(results)
    assert len(fig.axes) == 2
    lines = {line.get_label(): line for line in fig.axes[0].get_lines()}
    assert {"wb.decode", "wb.decode, paged", "decode_forward", "sdpa", "sdpa-flash", "flex",
            "copy (ceiling: read + write)"} <= set(lines)
    np.testing.assert_array_equal(lines["wb.decode"].get_xdata(), [4096, 8192])
    np.testing.assert_array_equal(lines["wb.decode"].get_ydata(), [1500.0, 1500.0])
    assert len({lines[name].get_color() for name in ("wb.decode", "decode_forward", "sdpa", "flex")}) == 4
    (path,) = figures.save_decode_figures(results, directory=tmp_path)
    assert path.stat().st_size > 5000


def test_committed_results_leave_decode_files_out(tmp_path, monkeypatch):
    """The ladder's README table, the dashboard and lesson 03 read the newest file under results/bench/: a decode
    file there must not become it."""
    from wb_kernels import results_files  # where the newest committed file is looked for

    monkeypatch.setattr(results_files, "REPO_ROOT", tmp_path)
    decode_file = {**_gpu_results(), "environment": {"backend": "gpu", "date": "2026-12-01"}}
    ladder = {"records": [], "environment": {"backend": "gpu", "date": "2026-11-01"}}
    bench.save_results(decode_file, tmp_path / "results" / "bench" / "b.json")
    bench.save_results(ladder, tmp_path / "results" / "bench" / "a.json")
    assert results_files.committed_results("gpu").name == "a.json"
    assert results_files.committed_decode_results() is None
    bench.save_results(decode_file, tmp_path / "results" / "decode" / "bench_h100.json")
    assert results_files.committed_decode_results().name == "bench_h100.json"


def test_decode_bar_lines_judge_each_bar_shape_as_its_record_says():
    import copy

    from wb_kernels.bench.results import committed_decode_results, decode_bar_lines
    from wb_kernels.bench.sweeps import DECODE_BAR

    path = committed_decode_results()
    if path is None:
        pytest.skip("no decode benchmark is committed")
    results = copy.deepcopy(results_file.load_results(path))
    ours = [r for r in results["records"] if r.get("contender") == "wb.decode"
            and (r["B"], r["H"], r["Hk"], r["Lk"], r["D"], r["dtype"]) == DECODE_BAR[0]]
    contiguous = next(r for r in ours if r["layout"] == "contiguous")
    paged = next(r for r in ours if r["layout"] == "paged")
    contiguous.update(status="ok", fraction_of_copy=0.5)
    paged.update(status="skipped", reason="a reason")
    lines = decode_bar_lines(results)
    assert len(lines) == 1 + 2 * len(DECODE_BAR)
    assert "50.0% of copy: bar missed by 20.0%" in lines[1] and "contiguous" in lines[1]
    assert lines[2].endswith("not measured (a reason)")
    contiguous["fraction_of_copy"] = 0.9
    contiguous["vs_best_sdpa"] = {"backend": "sdpa", "ratio": 0.97}  # the goal's fraction, but slower than SDPA
    assert "bar met, the goal's fraction too" in decode_bar_lines(results)[1]
    contiguous["vs_best_sdpa"] = {"backend": "sdpa", "ratio": 1.02}
    assert "goal met" in decode_bar_lines(results)[1]


# ---------------------------------------------------------------- bursts: measurements slowed from outside the call

# An H100 run's samples (ms) of one 18 us kernel, as the decode run at ac43df8 recorded them: a burst slowed a run of
# repeats up to 1.5 ms, and the median with them (36 us, where the call takes 18).
_CLEAN = [0.018, 0.019, 0.018, 0.018, 0.018, 0.020, 0.018, 0.019] * 5
_BURST = _CLEAN[:5] + [0.160, 1.468, 1.510, 1.437, 1.519, 1.404, 1.653, 1.688, 0.652, 0.766, 0.585, 0.412, 0.418,
                       0.475, 0.274, 0.231, 0.311, 0.210, 0.208, 0.031, 0.077, 0.024] + _CLEAN[:13]


def _fake_time_call(monkeypatch, sample_sets, device="cuda"):
    """`wb_kernels.timing.time_call` answering the estimate with one sample, then each of `sample_sets` in turn."""
    from wb_kernels import timing

    answers = iter(sample_sets)
    calls = []

    def fake(fn, *, warmup=3, repeats=20, **how):
        calls.append(repeats)
        samples = (0.018,) if repeats == 1 and len(calls) == 1 else tuple(next(answers))
        return timing.Timing(samples, device=device)

    monkeypatch.setattr(timing, "time_call", fake)
    return calls


def test_slowed_samples_count_a_burst_and_not_a_calls_own_spread():
    from wb_kernels.bench.measure import slowed_samples

    assert slowed_samples(_CLEAN) == 0
    assert slowed_samples(_BURST) == 20  # the samples over 2 x 0.018 ms
    bimodal = [0.030, 0.052] * 20  # a small kernel's own two speeds (1.7x apart): not a burst
    assert slowed_samples(bimodal) == 0


def test_a_burst_is_measured_again_and_the_record_says_so(monkeypatch):
    from wb_kernels.bench.measure import time_into

    calls = _fake_time_call(monkeypatch, [_BURST, _CLEAN])
    record = {}
    timing = time_into(record, lambda: None, TimingPolicy(seconds=0.72, max_repeats=40))
    assert calls == [1, 40, 40] and timing.samples_ms == tuple(_CLEAN)
    assert record["median_ms"] == pytest.approx(0.018) and record["repeats"] == 40
    (attempt,) = record["retaken"]["attempts"]
    assert attempt["slowed"] == 20 and attempt["median_ms"] > 0.03 and record["retaken"]["kept_slowed"] == 0


def test_bursts_are_retaken_twice_at_most_and_the_least_slowed_attempt_is_kept(monkeypatch):
    from wb_kernels.bench.measure import time_into

    worse = _CLEAN[:10] + [1.0] * 30
    calls = _fake_time_call(monkeypatch, [worse, _BURST, worse, _CLEAN])
    record = {}
    timing = time_into(record, lambda: None, TimingPolicy(seconds=0.72, max_repeats=40))
    assert calls == [1, 40, 40, 40] and timing.samples_ms == tuple(_BURST)  # the fourth set is never asked for
    assert [a["slowed"] for a in record["retaken"]["attempts"]] == [30, 30]
    assert record["retaken"]["kept_slowed"] == 20


def test_clean_and_host_timings_are_taken_once(monkeypatch):
    from wb_kernels.bench.measure import time_into

    for device, samples in (("cuda", _CLEAN), ("cpu", _BURST)):  # the host's clock: no burst rule
        calls = _fake_time_call(monkeypatch, [samples, _CLEAN], device=device)
        record = {}
        time_into(record, lambda: None, TimingPolicy(seconds=0.72, max_repeats=40))
        assert calls == [1, 40] and "retaken" not in record


def test_retake_slowed_measures_again_the_records_a_burst_slowed(tiny_run, tmp_path, capsys):
    out = tmp_path / "slowed.json"
    results = bench.load_results(tiny_run)
    ok = [r for r in results["records"] if r["status"] == "ok"]
    victim, bystander = ok[0], ok[1]
    for r in (victim, bystander):  # as a GPU run would have recorded them
        r["device"] = "cuda"
    victim["samples_ms"], victim["median_ms"] = _BURST, 9.99
    bystander["samples_ms"] = _CLEAN
    bench.save_results(results, out)
    with pytest.MonkeyPatch.context() as patch:
        patch.setitem(DECODE_PRESETS, "decode-smoke", TINY)
        assert bench.main(["--preset", "decode-smoke", "--out", str(out), "--retake-slowed"] + FAST) == 0
    printed = capsys.readouterr().out
    assert f"1 records a burst slowed are measured again: {victim['key']}" in printed and "1 to run" in printed
    again = _by_key(bench.load_results(out))
    assert again[victim["key"]]["median_ms"] != 9.99 and again[bystander["key"]]["samples_ms"] == _CLEAN
    assert bench.main(["--retake-slowed", "--preset", "smoke", "--out", str(tmp_path / "p.json")] + FAST) == 2
    assert "--retake-slowed applies to the decode presets" in capsys.readouterr().err
