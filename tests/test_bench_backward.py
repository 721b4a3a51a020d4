"""The backward preset of the benchmark (wb_kernels/bench/backward.py): its plan, FLOP counts, the O(L) memory formula,
the skip logic, a tiny run on the CPU into a results file, the command line and the README table. No timing is
asserted: the CPU's numbers say nothing about a GPU's."""

from __future__ import annotations

import json

import pytest

torch = pytest.importorskip("torch")

import wb_kernels as wb  # noqa: E402
from wb_kernels.bench import backward as bw  # noqa: E402
from wb_kernels.bench import cli  # noqa: E402
from wb_kernels.bench.measure import TimingPolicy  # noqa: E402
from wb_kernels.bench.results import same_timing  # noqa: E402

ON_SIMULATOR = wb.BACKEND.is_simulator
FAST = TimingPolicy(seconds=0.001, min_repeats=1, max_repeats=1, warmup=0)
TINY = bw.BackwardWorkload(1, 2, 1, 33, 16, "float32", True)


def _differentiable() -> bool:
    q = torch.randn(1, 1, 4, 16, requires_grad=True)
    return getattr(wb.attention(q, q.detach(), q.detach(), stage="reference"), "grad_fn", None) is not None


def test_flops_are_two_and_a_half_forwards():
    w = bw.BackwardWorkload(2, 16, 16, 8192, 128, "float16", False)
    forward = 4.0 * 2 * 16 * 8192 * 8192 * 128
    assert bw.backward_flops(2, 16, 8192, 8192, 128, False) == 2.5 * forward
    assert bw.pass_flops(w, "bwd") == 2.5 * forward
    assert bw.pass_flops(w, "fwd+bwd") == 3.5 * forward
    causal = bw.BackwardWorkload(2, 16, 16, 8192, 128, "float16", True)
    assert bw.pass_flops(causal, "fwd+bwd") == 3.5 * forward / 2
    with pytest.raises(ValueError, match="mode"):
        bw.pass_flops(w, "forward")


def test_linear_memory_formula():
    # out and dq (B, H, L, D), dk and dv (B, Hk, L, D) in fp16; LSE and Delta (B, H, L) in float32
    w = bw.BackwardWorkload(1, 32, 8, 4096, 128, "float16", False)
    rows = 32 * 4096
    backward = 2 * (rows * 128 + 2 * 8 * 4096 * 128) + 4 * rows
    assert bw.linear_memory_bytes(w, "bwd") == backward
    assert bw.linear_memory_bytes(w, "fwd+bwd") == backward + 2 * rows * 128 + 4 * rows
    # at L = 16k one L x L buffer dwarfs everything an O(L) backward needs
    long = bw.BackwardWorkload(1, 16, 16, 16384, 128, "float16", False)
    assert bw.quadratic_bytes(long) == 2 * 16 * 16384 ** 2
    assert bw.quadratic_bytes(long) > 30 * bw.linear_memory_bytes(long)


def test_plan_covers_the_issue_workloads():
    table = bw.backward_contenders()
    jobs = bw.plan_backward(bw.PRESET_GROUPS["backward"], table)
    workloads = {w for _, w, _, _ in jobs}
    tensor = {w for w in workloads if w.dtype != "float32"}
    assert {w.B * w.L for w in tensor} == {16384}
    assert {(w.H, w.Hk) for w in tensor} == {(16, 16), (32, 8)}
    assert {w.D for w in tensor} == {64, 128} and {w.causal for w in tensor} == {False, True}
    assert {w.dtype for w in tensor} == {"float16", "bfloat16"}
    by_name = {}
    for contender, workload, mode, presets in jobs:
        by_name.setdefault(contender.name, set()).add((workload.dtype, mode))
    assert {m for _, m in by_name["mma"]} == set(bw.BACKWARD_MODES)
    assert {d for d, _ in by_name["mma"]} == {"float16", "bfloat16"}  # mma takes 16-bit inputs only
    assert {d for d, _ in by_name["flash"]} == {"float32"}  # the numba rung against SDPA's fp32 backward
    assert {d for d, _ in by_name["sdpa-flash"]} == {"float16", "bfloat16"}
    assert "mma-kernel" in by_name and "flex" in by_name and "sdpa-efficient" in by_name
    keys = [bw.backward_record_key(c.name, m, w) for c, w, m, _ in jobs]
    assert len(keys) == len(set(keys))


def test_stage_without_backward_or_gpu_is_skipped_with_its_reason():
    table = bw.backward_contenders()
    assert "no backward" in table["naive"].refusal(TINY, False)
    assert "no backward" in table["naive-kernel"].refusal(TINY, True)
    gpu = bw.BackwardWorkload(1, 2, 2, 64, 64, "float16", False)
    assert "GPU" in table["sdpa-flash"].refusal(gpu, False)
    if "mma" in wb.stages.available_backwards():
        assert "CUDA GPU" in table["mma"].refusal(gpu, False)
    record = bw.measure_one(table["naive"], TINY, "bwd", None, None, FAST, on_cuda=False)
    assert record["status"] == "skipped" and "no backward" in record["reason"]
    assert record["flops"] == bw.pass_flops(TINY, "bwd")


@pytest.mark.skipif(not ON_SIMULATOR, reason="the CPU run; a GPU runs --preset backward")
def test_tiny_run_checks_and_records(tmp_path):
    names = ("reference", "reference-kernel", "naive", "sdpa")
    table = {name: c for name, c in bw.backward_contenders().items() if name in names}
    out = tmp_path / "backward.json"
    bw.run_backward(["backward-smoke"], out, policy=FAST, progress=False, table=table, log=lambda *a: None)
    results = json.loads(out.read_text())
    assert results["kind"] == "backward" and results["complete"]
    records = {r["key"]: r for r in results["records"]}
    workloads = bw.BACKWARD_PRESETS["backward-smoke"][1]
    assert len(records) == len(workloads) * len(bw.BACKWARD_MODES) * len(names)
    for mode in bw.BACKWARD_MODES:
        for w in workloads:
            kernel = records[bw.backward_record_key("reference-kernel", mode, w)]
            assert kernel["status"] == "ok" and kernel["check"]["passed"], kernel
            assert kernel["check"]["errors"][0] < 1e-12  # float64 against float64
            assert records[bw.backward_record_key("naive", mode, w)]["status"] == "skipped"
            sdpa = records[bw.backward_record_key("sdpa", mode, w)]
            assert sdpa["check"]["passed"] and sdpa["linear_bytes"] == bw.linear_memory_bytes(w, mode)
            if _differentiable():
                assert records[bw.backward_record_key("reference", mode, w)]["status"] == "ok"
    # the same command resumes: nothing left to run
    again = bw.run_backward(["backward-smoke"], out, policy=FAST, progress=False, table=table, log=lambda *a: None)
    assert len(again["records"]) == len(records)
    # a failed record is kept as done, unless retry_failed asks for it again (after a fix): then it is measured anew
    key = bw.backward_record_key("sdpa", "bwd", workloads[0])
    saved = json.loads(out.read_text())
    next(r for r in saved["records"] if r["key"] == key).update(status="failed", reason="made up by the test")
    out.write_text(json.dumps(saved))
    kept = bw.run_backward(["backward-smoke"], out, policy=FAST, progress=False, table=table, log=lambda *a: None)
    assert {r["key"]: r for r in kept["records"]}[key]["status"] == "failed"
    retried = bw.run_backward(["backward-smoke"], out, policy=FAST, progress=False, table=table, retry_failed=True,
                              log=lambda *a: None)
    assert len(retried["records"]) == len(records)
    assert {r["key"]: r for r in retried["records"]}[key]["status"] == "ok"


def test_command_line_refuses_what_cannot_run_here(capsys):
    assert cli.main(["--preset", "backward", "--preset", "smoke"]) == 2
    assert "file of its own" in capsys.readouterr().err
    if ON_SIMULATOR:
        assert cli.main(["--preset", "backward"]) == 2
        assert "backward-smoke" in capsys.readouterr().err


def _gpu_file() -> dict:
    """A results file as a GPU run writes it (numbers made up; only the table's layout is tested)."""
    from wb_kernels.timing import DEVICE_TIME

    w = bw.BackwardWorkload(4, 16, 16, 4096, 128, "float16", True)
    records = []
    for name, kind, ms in (("mma", "stage", 2.0), ("sdpa-flash", "baseline", 3.0), ("sdpa-cudnn", "baseline", 1.5)):
        for mode in bw.BACKWARD_MODES:
            records.append({"key": bw.backward_record_key(name, mode, w), "contender": name, "kind": kind,
                            "mode": mode, "dtype": w.dtype, "B": w.B, "H": w.H, "Hk": w.Hk, "Lq": w.L, "Lk": w.L,
                            "D": w.D, "causal": w.causal, "status": "ok", "median_ms": ms,
                            "tflops": bw.pass_flops(w, mode) / ms / 1e9, "peak_vs_linear": 1.25})
    records.append(dict(records[0], key=bw.backward_record_key("flex", "bwd", w), contender="flex", kind="baseline",
                        mode="bwd", status="skipped", reason="triton is not importable"))
    env = {"backend": "gpu", "gpu": "NVIDIA H100 80GB HBM3", "device": "NVIDIA H100 80GB HBM3", "cuda": "13.0",
           "torch": "2.11.0", "date": "2026-11-25T12:00:00Z"}
    return {"kind": "backward", "environment": env, "timing": dict(DEVICE_TIME), "records": records}


def test_readme_table_from_a_results_file(tmp_path):
    results = _gpu_file()
    assert same_timing({"backward": results})  # timed as every preset is
    table = bw.backward_table(results, source="results/backward/bench_h100.json")
    lines = table.splitlines()
    assert "H100" in lines[0] and "2.5x" in lines[0]
    assert lines[2].startswith("| mode | B | H | Hk | L | D | causal | mma | sdpa-flash | sdpa-cudnn | flex |")
    assert lines[4].startswith("| fwd+bwd | 4 | 16 | 16 | 4096 | 128 | yes | 2 (")
    assert lines[4].endswith("| 1.25 | 1.50 | 0.75 (sdpa-cudnn) |")  # mem, x sdpa-flash (3 ms / 2), x best
    assert lines[5].startswith("| bwd |") and "| - |" in lines[5]  # flex skipped there
    readme = tmp_path / "README.md"
    readme.write_text("before\n")
    with pytest.raises(wb.bench.Refused, match="perf-table-backward"):
        bw.update_backward_readme(tmp_path / "x.json", readme)
    readme.write_text(f"before\n{bw.README_BACKWARD_START}\nold\n{bw.README_BACKWARD_END}\nafter\n")
    path = tmp_path / "backward.json"
    path.write_text(json.dumps(results))
    bw.update_backward_readme(path, readme)
    text = readme.read_text()
    assert "old" not in text and text.startswith("before\n") and text.endswith("after\n") and "| bwd |" in text
    with pytest.raises(wb.bench.Refused, match="not a backward"):
        bw.backward_table({"records": []})


def test_backward_overhead_rows_on_the_cpu():
    """The per-call rows (forward, fwd+bwd) beside SDPA's, with their ratio and the bar; no timing asserted."""
    from wb_kernels.bench.backward import measure_backward_overhead

    found = measure_backward_overhead(problem=(1, 2, 16, 16, "float32"), stage="reference", device="cpu", calls=2,
                                      batches=1, warmup=1)
    rows = {(r["mode"], r["name"]): r for r in found["rows"]}
    assert set(rows) == {(m, n) for m in ("forward", "fwd+bwd") for n in ("sdpa", "wb.attention(stage='reference')")}
    ours = rows[("fwd+bwd", "wb.attention(stage='reference')")]
    assert ours["per_call_us"] > 0 and ours["ratio_to_sdpa"] > 0 and isinstance(ours["meets_bar"], bool)


def test_readme_backward_table_is_the_committed_files():
    """The README's backward block is what --update-readme makes of the committed backward results file."""
    import pathlib

    from wb_kernels.bench import backward as bw

    root = pathlib.Path(__file__).resolve().parent.parent
    files = sorted((root / "results" / "backward").glob("bench_*.json"))
    if not files:
        pytest.skip("no committed backward results file yet")
    readme = root / "README.md"
    copy = pathlib.Path(pytest.importorskip("tempfile").mkdtemp()) / "README.md"
    copy.write_text(readme.read_text())
    bw.update_backward_readme(files[-1], readme=copy)
    assert copy.read_text() == readme.read_text(), (
        f"README.md's backward table is stale: run python -m wb_kernels.bench --update-readme "
        f"{files[-1].relative_to(root)}")
