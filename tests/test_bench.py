"""The benchmark CLI, its results file, figures, README table and the dashboard lesson's dashboard functions."""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest

import wb_kernels as wb
from wb_kernels import api, bench, stages
from wb_kernels.bench import cli, dashboard, figures, measure, pitfalls, sweeps
from wb_kernels.bench import results as results_file  # (tests name their results dicts `results`)
from wb_kernels.reference import reference
from wb_kernels.stages import Stage

ON_SIMULATOR = wb.BACKEND.is_simulator
needs_gpu = pytest.mark.skipif(ON_SIMULATOR, reason="needs a CUDA GPU: wb_kernels runs on the CUDA simulator here")

# The smallest sweep that still exercises a stage, the reference and two baselines, causal and not.
TINY = ["--stages", "reference", "--baselines", "sdpa,sdpa-math,torch-eager", "--lengths", "8,13",
        "--head-dims", "16", "--batch-heads", "1,1", "--causal", "both", "--seconds", "0.005", "--min-repeats", "2", "--no-progress", "--no-figures"]


@pytest.fixture(scope="module")
def tiny_results(tmp_path_factory):
    out = tmp_path_factory.mktemp("bench") / "tiny.json"
    assert bench.main(TINY + ["--out", str(out)]) == 0
    return out


def test_help_runs_as_a_module():
    done = subprocess.run([sys.executable, "-m", "wb_kernels.bench", "--help"], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr
    for text in ("--preset", "smoke", "tensor-cores", "--time-budget", "--update-readme", "--figures"):
        assert text in done.stdout


def test_flop_and_byte_counts():
    assert bench.attention_flops(1, 1, 4, 4, 2, causal=False) == 4 * 4 * 4 * 2
    assert bench.attention_flops(2, 3, 8, 8, 16, causal=True) == 4 * 2 * 3 * 8 * 8 * 16 / 2
    # q, k, v read once and the output written once, 2 bytes each in fp16
    assert bench.minimum_bytes(1, 1, 4, 4, 2, itemsize=2) == 2 * (4 * 2) * 4


def test_presets_cover_the_requested_configurations():
    public = {(c.B, c.H, c.L, c.D) for s in bench.PRESETS["public"] for c in s.configs}
    assert public == set(bench.PUBLIC_CONFIGS)
    ladder = bench.PRESETS["ladder"][0]
    assert {"naive", "tiled", "sdpa", "sdpa-math"} <= set(ladder.contenders)
    assert {(c.L, c.D) for c in ladder.configs} == {(L, D) for L in bench.LADDER_LENGTHS for D in (64, 128)}
    flash = bench.PRESETS["flash-fp32"][0]
    assert all(c.dtype == "float32" and c.B * c.L == 16384 and c.H == 16 for c in flash.configs)
    assert min(c.L for c in flash.configs) == 1024 and max(c.L for c in flash.configs) == 16384
    tensor = bench.PRESETS["tensor-cores"][0]
    assert {"wmma", "sdpa-flash", "sdpa"} <= set(tensor.contenders)
    assert {(c.dtype, c.causal) for c in tensor.configs} == {(d, c) for d in ("float16", "bfloat16")
                                                             for c in (False, True)}


def test_mma_preset_covers_the_rungs_workloads():
    """The mma rung's issue: fp16 and bf16, D 64 and 128, L 512..16384 at 16k tokens and 16 heads, causal and
    not, against wmma, SDPA's default, FLASH and cuDNN, and FlexAttention; plus the small public problem."""
    (sweep,) = bench.PRESETS["mma"]
    assert set(sweep.contenders) == {"wmma", "mma", "sdpa-flash", "sdpa-cudnn", "sdpa", "flex", "flashinfer-fa2",
                                     "flashinfer-fa3"}
    expected = {bench.Config(bench.TOKENS // L, 16, L, D, dtype, causal) for dtype in ("float16", "bfloat16")
                for D in (64, 128) for L in bench.LADDER_LENGTHS for causal in (False, True)}
    expected |= {bench.Config(1, 16, 512, 64, "float16", causal) for causal in (False, True)}
    assert set(sweep.configs) == expected and len(sweep.configs) == len(expected)
    assert "mma" in bench.PRESETS["public"][0].contenders and "flex" in bench.PRESETS["public"][0].contenders
    assert "mma" in sweeps.GPU_PRESETS and "mma" in sweeps.ALL_PRESETS
    assert set(sweeps.ALL_PRESETS) == (set(sweeps.PRESET_HELP) - {"smoke", "all"} - set(sweeps.DECODE_PRESETS)
                                       - set(sweeps.RUNG_PRESETS))


def test_a_stage_not_registered_yet_is_dropped_quietly():
    """The presets may name the mma rung before its folder exists: planned without it, with a note."""
    table = {name: c for name, c in measure.contenders().items() if name != "mma"}
    config = bench.Config(1, 1, 8, 16, "float32", False)
    jobs, notes = measure.plan([bench.Sweep("x", ("mma", "sdpa"), (config,))], table)
    assert [job[0].name for job in jobs] == ["sdpa"]
    assert notes == {"mma": "not a stage of this package yet"}


@pytest.mark.skipif(not ON_SIMULATOR, reason="the refusal is what a machine without a GPU does")
def test_flex_is_refused_without_a_gpu_with_a_reason(tmp_path, capsys):
    out = tmp_path / "flex.json"
    flags = ["--stages", "", "--lengths", "8", "--head-dims", "16", "--dtypes", "float16", "--batch-heads", "1,1",
             "--no-progress", "--no-figures", "--out", str(out)]
    # named explicitly: refused before anything runs
    assert bench.main(flags + ["--baselines", "flex"]) == 2
    assert "baseline 'flex' needs a CUDA GPU" in capsys.readouterr().err
    assert not out.exists()
    # in a sweep: left out, and the results file says why, as it does for flash_attn and vllm
    config = bench.Config(1, 1, 8, 16, "float16", False)
    results = measure.run([bench.Sweep("x", ("flex",), (config,))], out, progress=False, log=lambda *a: None)
    assert results["records"] == [] and results["unavailable"]["flex"] == "needs a CUDA GPU"
    assert "flex" in cli._listing().split("baselines:")[1]
    flex_line = [line for line in cli._listing().splitlines() if line.strip().startswith("flex ")][0]
    assert "absent:" in flex_line


def test_flex_names_what_it_is_missing(monkeypatch):
    """An old torch (no flex_attention module) or no triton: the reason names the missing module."""
    real = measure._import_problem
    monkeypatch.setattr(measure, "_import_problem",
                        lambda module: "triton is not importable here (X)" if module == "triton" else real(module))
    assert "triton" in measure.contenders()["flex"].unavailable
    monkeypatch.setattr(measure, "_import_problem", lambda module: f"{module} is not importable here (X)")
    assert measure.contenders()["flex"].unavailable.startswith("torch.nn.attention.flex_attention")
    assert measure.contenders()["flex"].dtypes == ("float16", "bfloat16") and measure.contenders()["flex"].needs_gpu


def test_torch_reference_matches_the_numpy_reference():
    torch = pytest.importorskip("torch")
    q, k, v = wb.random_qkv(1, 1, 13, 16, framework="torch", seed=3)
    for causal in (False, True):
        out, lse = measure.torch_reference(q, k, v, causal)
        out_ref, lse_ref = reference(q, k, v, causal=causal)
        np.testing.assert_allclose(out, out_ref, rtol=0, atol=1e-12)
        np.testing.assert_allclose(lse, lse_ref, rtol=0, atol=1e-12)
    del torch


def test_tiny_sweep_records_every_measurement(tiny_results):
    results = bench.load_results(tiny_results)
    env = results["environment"]
    for key in ("date", "backend", "device", "torch", "numba", "cuda", "driver", "gpu", "python"):
        assert key in env
    assert env["backend"] == wb.BACKEND.name
    records = results["records"]
    contenders = {"reference", "sdpa", "sdpa-math", "torch-eager"}
    assert {r["contender"] for r in records} == contenders
    assert len(records) == len(contenders) * 2 * 2  # two lengths, causal and not
    for r in records:
        assert r["status"] == "ok", r
        assert r["check"]["passed"], r["check"]
        assert r["repeats"] >= 2 and len(r["samples_ms"]) == r["repeats"]
        assert r["min_ms"] <= r["median_ms"] <= r["max_ms"]
        flops = bench.attention_flops(r["B"], r["H"], r["Lq"], r["Lk"], r["D"], r["causal"])
        assert r["flops"] == flops
        assert r["tflops"] == pytest.approx(flops / (r["median_ms"] / 1e3) / 1e12, rel=1e-3)
        assert r["tokens_per_s"] == pytest.approx(r["B"] * r["Lq"] / (r["median_ms"] / 1e3), rel=1e-3)
        assert r["peak_bytes"] >= 0
        assert set(r["speedup_vs"]) == {"sdpa", "sdpa-math", "torch-eager"} - {r["contender"]}
    by_key = {r["key"]: r for r in records}
    one = by_key[bench.record_key("torch-eager", bench.Config(1, 1, 13, 16, "float32", True))]
    sdpa = by_key[bench.record_key("sdpa", bench.Config(1, 1, 13, 16, "float32", True))]
    assert one["speedup_vs"]["sdpa"] == pytest.approx(sdpa["median_ms"] / one["median_ms"], rel=1e-3)
    ref = by_key[bench.record_key("reference", bench.Config(1, 1, 8, 16, "float32", False))]
    assert ref["workspace_bytes"] == 3 * 8 * 8 * 8


def test_resume_skips_what_is_done(tiny_results, tmp_path, capsys):
    out = tmp_path / "resume.json"
    out.write_text(tiny_results.read_text())
    before = bench.load_results(out)
    assert bench.main(TINY + ["--out", str(out)]) == 0
    assert "0 to run" in capsys.readouterr().out
    assert bench.load_results(out)["records"] == before["records"]
    # one more length: only its measurements run, the old ones stay as they were
    more = [x if x != "8,13" else "8,13,5" for x in TINY]
    assert bench.main(more + ["--out", str(out)]) == 0
    after = bench.load_results(out)
    old = {r["key"]: r for r in before["records"]}
    assert len(after["records"]) == len(before["records"]) * 3 // 2
    for r in after["records"]:
        if r["key"] in old:
            assert r["median_ms"] == old[r["key"]]["median_ms"]
        else:
            assert r["Lq"] == 5
    # --fresh starts over
    assert bench.main(TINY + ["--out", str(out), "--fresh"]) == 0
    assert len(bench.load_results(out)["records"]) == len(before["records"])


def test_git_commit_is_the_running_trees_head_and_says_when_it_is_dirty(tmp_path, monkeypatch):
    """The commit a results file records: the checkout's HEAD, +dirty for changed or new files outside what a run
    writes (results/, figures/, ...), None for a folder that is not the top of a checkout."""
    monkeypatch.delenv("WB_GIT_COMMIT", raising=False)  # a GPU run names its commit this way; this test reads git
    def git(*args):
        subprocess.run(["git", "-c", "user.name=t", "-c", "user.email=t@t", *args], cwd=tmp_path, check=True,
                       capture_output=True)

    assert results_file.git_commit(tmp_path) is None
    git("init", "-q")
    (tmp_path / "code.py").write_text("x = 1\n")
    git("add", "code.py")
    git("commit", "-q", "-m", "one")
    head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=tmp_path, capture_output=True,
                          text=True).stdout.strip()
    assert results_file.git_commit(tmp_path) == head
    (tmp_path / "results").mkdir()
    (tmp_path / "results" / "run.json").write_text("{}")  # the run's own output
    assert results_file.git_commit(tmp_path) == head
    (tmp_path / "code.py").write_text("x = 2\n")
    assert results_file.git_commit(tmp_path) == head + "+dirty"
    git("checkout", "-q", "code.py")
    (tmp_path / "new_module.py").write_text("")
    assert results_file.git_commit(tmp_path) == head + "+dirty"
    (tmp_path / "sub").mkdir()
    assert results_file.git_commit(tmp_path / "sub") is None  # not the checkout's top


def test_results_file_is_written_atomically_and_is_strict_json(tiny_results):
    text = tiny_results.read_text()
    json.loads(text)
    assert "NaN" not in text and "Infinity" not in text
    assert not tiny_results.with_suffix(".json.tmp").exists()


def _fake_registry(monkeypatch, *extra):
    """Add stages to the registry that every module consults."""
    real = stages.available_stages()
    fake = {**real, **{s.name: s for s in extra}}
    for module in (stages, api, measure, results_file, cli):
        monkeypatch.setattr(module, "available_stages", lambda: dict(fake))


def _reference_forward(q, k, v, *, causal, key_padding_mask, scale):
    return reference(q, k, v, causal=causal, key_padding_mask=key_padding_mask, scale=scale)


@pytest.mark.skipif(not ON_SIMULATOR, reason="the refusal is what the simulator does")
def test_gpu_only_stage_is_refused_with_a_clear_message(monkeypatch, capsys, tmp_path):
    gpu_stage = Stage(name="gpu_only_demo", lesson="-", summary="needs a GPU", forward=_reference_forward,
                      dtypes=("float32",), needs_gpu=True, order=99)
    _fake_registry(monkeypatch, gpu_stage)
    code = bench.main(["--stages", "gpu_only_demo", "--lengths", "8", "--head-dims", "16", "--no-progress",
                       "--out", str(tmp_path / "x.json")])
    err = capsys.readouterr().err
    assert code == 2
    assert "'gpu_only_demo' runs only on a CUDA GPU" in err and "simulator" in err
    assert not (tmp_path / "x.json").exists()


@pytest.mark.skipif(not ON_SIMULATOR, reason="the refusal is what the simulator does")
def test_real_gpu_stages_and_gpu_presets_are_refused_on_the_simulator(capsys, tmp_path):
    for name, stage in wb.available_stages().items():
        if stage.needs_gpu:
            assert bench.main(["--stages", name, "--out", str(tmp_path / "x.json"), "--no-progress"]) == 2
            assert f"stage {name!r} runs only on a CUDA GPU" in capsys.readouterr().err
    for preset in ("ladder", "tensor-cores", "mma", "all", "honesty"):
        assert bench.main(["--preset", preset, "--out", str(tmp_path / "x.json")]) == 2
        assert "needs a CUDA GPU" in capsys.readouterr().err
    assert bench.main(["--stages", "no_such_stage", "--out", str(tmp_path / "x.json")]) == 2
    assert "neither a stage" in capsys.readouterr().err


def test_a_size_the_stage_refuses_is_recorded_as_skipped(monkeypatch, tmp_path):
    huge = Stage(name="huge_workspace_demo", lesson="-", summary="asks for more memory than exists",
                 forward=_reference_forward, dtypes=("float32",), workspace_bytes=lambda B, H, Lq, Lk, D: 1 << 62,
                 order=98)
    _fake_registry(monkeypatch, huge)
    out = tmp_path / "skip.json"
    assert bench.main(["--stages", "huge_workspace_demo", "--baselines", "sdpa", "--lengths", "8", "--no-figures",
                       "--batch-heads", "1,1",
                       "--head-dims", "16", "--seconds", "0.005", "--no-progress", "--out", str(out)]) == 0
    records = {r["contender"]: r for r in bench.load_results(out)["records"]}
    assert records["huge_workspace_demo"]["status"] == "skipped"
    assert records["huge_workspace_demo"]["reason"].startswith("MemoryError: stage 'huge_workspace_demo' needs")
    assert records["huge_workspace_demo"]["workspace_bytes"] == 1 << 62
    assert records["sdpa"]["status"] == "ok"


def test_a_wrong_stage_is_not_timed(monkeypatch, tmp_path):
    def wrong_forward(q, k, v, *, causal, key_padding_mask, scale):
        out, lse = reference(q, k, v, causal=causal, key_padding_mask=key_padding_mask, scale=scale)
        return out + 1e-3, lse

    wrong = Stage(name="off_by_a_bit_demo", lesson="-", summary="wrong on purpose", forward=wrong_forward,
                  dtypes=("float32",), order=97)
    _fake_registry(monkeypatch, wrong)
    out = tmp_path / "wrong.json"
    flags = ["--stages", "off_by_a_bit_demo", "--baselines", "", "--lengths", "8", "--head-dims", "16",
             "--batch-heads", "1,1", "--no-progress", "--no-figures", "--seconds", "0.005", "--out", str(out)]
    assert bench.main(flags) == 0
    (record,) = bench.load_results(out)["records"]
    assert record["status"] == "failed" and record["reason"].startswith("check: off_by_a_bit_demo")
    assert not record["check"]["passed"] and "median_ms" not in record
    # on request it is timed, and flagged wherever it is shown
    assert bench.main(flags + ["--fresh", "--time-failed-checks"]) == 0
    (record,) = bench.load_results(out)["records"]
    assert record["status"] == "ok" and record["check_failed"] and record["median_ms"] > 0


def test_figures_are_drawn_from_a_results_file(tiny_results, tmp_path):
    results = bench.load_results(tiny_results)
    paths = figures.save_all(results, directory=tmp_path)
    assert [p.name for p in paths] == [f"{name}.png" for name in figures.FIGURE_NAMES]
    assert all(p.stat().st_size > 5000 for p in paths)
    view = figures.default_view(results)
    data = figures.series(results, view)
    assert set(data) == {r["contender"] for r in results["records"]}
    fig = figures.latency_figure(results, view)
    (ax,) = fig.axes
    drawn = {line.get_label(): line for line in ax.get_lines()}
    sdpa = [r for r in data["sdpa"]]
    assert list(drawn["sdpa"].get_xdata()) == [r["Lq"] for r in sdpa]
    assert list(drawn["sdpa"].get_ydata()) == [r["median_ms"] for r in sdpa]
    # with ceilings (a GPU run measures them) the roofline draws the roof: min(peak, bandwidth x intensity)
    results["ceilings"] = {"float32_matmul_tflops": 50.0, "copy_gbps": 3000.0}
    roof_ax = figures.roofline_figure(results, view).axes[0]
    roof = [line for line in roof_ax.get_lines() if not line.get_label().startswith(tuple(data))][0]
    x, y = roof.get_xdata(), roof.get_ydata()
    np.testing.assert_allclose(y, np.minimum(50.0, 3000.0 * 1e9 * x / 1e12))


def _public_results(timed=(("sdpa", "baseline", 1.0), ("wmma", "stage", 2.0)), shapes=bench.PUBLIC_CONFIGS):
    """A GPU results file's README-relevant records: each (name, kind, ms) timed at `shapes`, fp16, causal and not."""
    records = []
    for causal in (False, True):
        for i, (B, H, L, D) in enumerate(shapes):
            for name, kind, ms in timed:
                config = bench.Config(B, H, L, D, "float16", causal)
                flops = bench.attention_flops(B, H, L, L, D, causal)
                records.append({"key": bench.record_key(name, config), "contender": name, "status": "ok",
                                "kind": kind, "median_ms": ms + i, "tflops": flops / (ms + i) / 1e9})
    return {"environment": {"gpu": "Test GPU", "cuda": "13.0", "torch": "2.11", "driver": "580", "date": "2026-11-21"},
            "records": records}


def test_readme_table_lists_the_public_configurations():
    table = bench.readme_table(_public_results(), source="results/x.json")
    lines = table.splitlines()
    assert "Test GPU" in lines[0] and "results/x.json" in lines[0]
    header = [line for line in lines if line.startswith("| B |")][0]
    present = [c for c in ("wmma", "sdpa") if c in wb.available_stages() or c == "sdpa"]
    assert header == "| B | H | L | D | causal | " + " | ".join(present) + " | wmma ×best peer |"
    rows = [line for line in lines if line.startswith("| ") and not line.startswith("| B |")]
    assert len(rows) == 2 * len(bench.PUBLIC_CONFIGS)
    assert rows[0].startswith("| 1 | 16 | 512 | 64 | no | ")
    assert "1 (" in rows[0]  # sdpa's 1.0 ms, as 3 significant digits


def test_readme_table_shows_the_mma_rung_and_flex_when_the_file_has_them():
    """Columns for a contender the file timed (the mma stage even before this checkout registers it, FlexAttention
    among the baselines), none for one it did not; rows only for the public configurations the file has."""
    timed = (("sdpa", "baseline", 1.0), ("flex", "baseline", 1.5), ("mma", "stage", 1.2), ("wmma", "stage", 2.0))
    shapes = bench.PUBLIC_CONFIGS[:3]
    results = _public_results(timed, shapes)
    results["records"].append({"key": "sdpa-cudnn|float16|B1|H16|L512|D64|full", "contender": "sdpa-cudnn",
                               "status": "ok", "kind": "baseline", "median_ms": 1.0, "tflops": 1.0})
    bench.add_speedups(results)  # as the benchmark derives them after every record it stores

    def contender_columns(table):
        header = [line for line in table.splitlines() if line.startswith("| B |")][0]
        return [c for c in header.strip("| ").split(" | ")[5:] if not c.endswith("×best peer")]

    lines = bench.readme_table(results).splitlines()
    columns = contender_columns("\n".join(lines))
    assert set(columns) == {"wmma", "mma", "sdpa", "flex"}  # sdpa-cudnn is no README column
    assert columns.index("mma") < columns.index("sdpa") < columns.index("flex")  # stages first, then baselines
    rows = [line for line in lines if line.startswith("| ") and not line.startswith("| B |")]
    assert len(rows) == 2 * len(shapes)
    flex_cell = rows[0].strip("| ").split(" | ")[5 + columns.index("flex")]
    assert flex_cell.startswith("1.5 (")
    # the highest rung against the fastest baseline of the row, whichever the file timed (sdpa-cudnn too): 1.0 / 1.2
    assert "mma ×best peer" in lines[2] and rows[0].endswith(" | 0.83 (sdpa) |")
    # without flex and mma in the file, the table is the one it was before they existed
    assert contender_columns(bench.readme_table(_public_results())) == ["wmma", "sdpa"]


def test_figures_and_dashboard_draw_flex_and_the_mma_rung(tiny_results, tmp_path):
    """A file holding records of FlexAttention and of the mma stage: both drawn, in colors of their own, and
    compared with the baselines of the same file."""
    results = bench.load_results(tiny_results)
    renamed = {"sdpa-math": ("flex", "baseline"), "reference": ("mma", "stage")}
    for r in results["records"]:
        if r["contender"] in renamed:
            name, kind = renamed[r["contender"]]
            r.update(contender=name, kind=kind, key=name + "|" + r["key"].split("|", 1)[1])
    bench.add_speedups(results)
    view = figures.default_view(results)
    data = figures.series(results, view)
    assert {"flex", "mma"} <= set(data)
    assert all("flex" in r["speedup_vs"] for r in data["mma"])
    ax = figures.latency_figure(results, view).axes[0]
    colors = {line.get_label(): line.get_color() for line in ax.get_lines()}
    assert len({colors["flex"], colors["mma"], colors["sdpa"], colors["torch-eager"]}) == 4
    assert "#333333" not in (colors["flex"], colors["mma"])  # the color of a contender nobody named
    assert len(figures.save_all(results, directory=tmp_path)) == len(figures.FIGURE_NAMES)
    rows = dashboard.summary_rows(results, view["dtype"], view["D"], view["causal"], 8)
    assert any(row.strip().startswith("flex:") for row in rows) and any(row.strip().startswith("mma:") for row in rows)


def test_every_baseline_has_a_color_and_a_line_style():
    from wb_kernels.plots import STAGE_COLORS

    for name in bench.BASELINES:
        assert name in figures._BASELINE_COLORS and name in figures._BASELINE_STYLE, name
    assert {"mma", "hopper"} <= set(STAGE_COLORS)


def test_update_readme_rewrites_only_the_block(tmp_path):
    results = tmp_path / "r.json"
    bench.save_results(_public_results(), results)
    readme = tmp_path / "README.md"
    readme.write_text(f"# Title\n\nbefore\n{bench.README_START}\nold table\n{bench.README_END}\nafter\n")
    bench.update_readme(results, readme)
    text = readme.read_text()
    assert text.startswith("# Title\n\nbefore\n") and text.endswith(f"{bench.README_END}\nafter\n")
    assert "old table" not in text and "| B | H | L | D |" in text
    bench.update_readme(results, readme)
    assert readme.read_text() == text  # idempotent
    readme.write_text("no markers")
    with pytest.raises(bench.Refused, match="perf-table:start"):
        bench.update_readme(results, readme)


def test_readme_table_is_up_to_date_with_the_committed_gpu_results():
    path = bench.committed_results("gpu")
    if path is None:
        pytest.skip("no GPU results file is committed under results/ yet")
    readme = bench.REPO_ROOT / "README.md"
    text = readme.read_text() if readme.exists() else ""
    assert bench.README_START in text and bench.README_END in text, (
        f"README.md needs a {bench.README_START} ... {bench.README_END} block; then run "
        f"python -m wb_kernels.bench --update-readme {path.relative_to(bench.REPO_ROOT)}")
    block = text.split(bench.README_START, 1)[1].split(bench.README_END, 1)[0].strip("\n")
    expected = bench.readme_table(bench.load_results(path), source=str(path.relative_to(bench.REPO_ROOT)))
    assert block == expected, (f"README.md's performance table is stale: run python -m wb_kernels.bench "
                               f"--update-readme {path.relative_to(bench.REPO_ROOT)}")


NOT_BENCHMARK_KINDS = ("decode_tune", "decode_tune_mma", "decode_tune_mma_sweep", "decode_ncu_mma", "decode_mma_trace", "decode_split_trace",
                       "decode_timing_modes",
                       "distributed_scaling")  # results/ files of other shapes (tuning logs of tune.py, one-offs)


def test_committed_results_files_are_complete():
    for path in sorted((bench.REPO_ROOT / "results").rglob("*.json")):
        results = bench.load_results(path)
        if not (isinstance(results, dict) and "records" in results) or results.get("kind") in NOT_BENCHMARK_KINDS:
            continue  # not a benchmark file (a tuning log of the decode rung's tune.py, a one-off measurement)
        assert results["schema"] == bench.SCHEMA_VERSION
        env = results["environment"]
        for key in ("date", "backend", "device", "torch", "numba", "cuda", "driver", "gpu"):
            assert key in env, (path, key)
        if env["backend"] == "gpu":
            assert env["gpu"] and env["driver"] and env["cuda"], path
            # the backward and variants presets report ratios to baselines measured beside them, no roofline
            if results.get("kind") not in ("backward", "variants"):
                assert results["ceilings"]["float16_matmul_tflops"] > 0
        for r in results["records"]:
            assert r["status"] in ("ok", "skipped", "failed"), r
            if r["status"] == "ok" and r["kind"] == "stage":
                assert r["check"]["passed"] or r.get("check_failed"), r


def test_dashboard_functions(tiny_results):
    results = bench.load_results(tiny_results)
    options = dashboard.choices(results)
    assert options == {"dtype": ["float32"], "D": [16], "causal": [False, True]}
    assert dashboard.lengths(results, "float32", 16, True) == [8, 13]
    rows = dashboard.summary_rows(results, "float32", 16, True, 13)
    assert len(rows) == len({r["contender"] for r in results["records"]})
    assert any(row.strip().startswith("sdpa-math:") and "x sdpa" in row for row in rows)
    fig = dashboard.draw(results, "float32", 16, False, 8)
    assert len(fig.axes) == 6
    with pytest.raises(ValueError, match="no timings for float16"):
        dashboard.draw(results, "float16", 16, False)


def test_dashboard_widget_builds(tiny_results):
    pytest.importorskip("ipywidgets")
    widget = dashboard.dashboard_widget(bench.load_results(tiny_results))
    controls, slider, output = widget.children
    assert [c.description for c in controls.children] == ["dtype", "D", "mask"]
    assert list(slider.options) == [8, 13]
    controls.children[2].value = True  # causal: the slider keeps its lengths, the output redraws
    assert list(slider.options) == [8, 13]


@needs_gpu
def test_gpu_sweep_over_every_stage(tmp_path):
    """Every GPU stage and the main baselines at small sizes, fp32 and fp16: all checked, all timed."""
    out = tmp_path / "gpu.json"
    gpu_stages = [name for name in wb.available_stages() if name != "reference"]
    code = bench.main(["--stages", ",".join(gpu_stages), "--baselines", "sdpa,sdpa-math,torch-eager,sdpa-flash",
                       "--lengths", "256,1000", "--head-dims", "64,128", "--dtypes", "float32,float16",
                       "--batch-heads", "2,4", "--causal", "both", "--seconds", "0.05", "--no-progress",
                       "--no-figures", "--out", str(out)])
    assert code == 0
    results = bench.load_results(out)
    assert results["ceilings"]["float16_matmul_tflops"] > 50
    records = results["records"]
    for r in records:
        if r["kind"] == "stage":
            assert r["status"] == "ok", r
            assert r["device"] == "cuda" and r["l2_flushed"]
    assert {r["contender"] for r in records if r["status"] == "ok"} >= set(gpu_stages) | {"sdpa", "sdpa-math"}
    flash_fp32 = [r for r in records if r["contender"] == "sdpa-flash" and r["dtype"] == "float32"]
    assert all(r["status"] == "skipped" for r in flash_fp32)  # no FLASH kernel for fp32: a line, not a crash


@needs_gpu
def test_gpu_honesty_demos_measure_each_effect():
    demos = bench.honesty_demos()
    assert set(demos) == {"warmup", "async", "medians", "l2", "clocks", "zeros"}
    assert "error" not in demos["warmup"], demos["warmup"]
    assert demos["warmup"]["numba_kernel_first_ms"] > 10 * demos["warmup"]["numba_kernel_steady_median_ms"]
    assert demos["async"]["cpu_timer_no_sync_ms"] < demos["async"]["cuda_events_ms"]
    assert demos["medians"]["n"] == 300


SYNTHETIC_DEMOS = {
    "warmup": {"numba_kernel_first_ms": 300.0, "numba_kernel_steady_median_ms": 0.03, "sdpa_first_ms": 5.0,
               "sdpa_steady_median_ms": 0.5, "sdpa_shape": "B1 H16 L1536 D128 fp16"},
    "async": {"cpu_timer_no_sync_ms": 0.02, "cpu_timer_with_sync_ms": 0.95, "cuda_events_ms": 0.9},
    "medians": {"n": 4, "median_ms": 0.1, "mean_ms": 0.2, "min_ms": 0.09, "max_ms": 0.5, "p5_ms": 0.09,
                "p25_ms": 0.095, "p75_ms": 0.11, "p95_ms": 0.4, "samples_ms": [0.09, 0.1, 0.1, 0.5]},
    "l2": {"sdpa_shape": "B1 H16 L1024 D64 fp16", "sdpa_warm_ms": 0.05, "sdpa_flushed_ms": 0.06, "copy_mib": 16,
           "copy_warm_gbps": 5000.0, "copy_flushed_gbps": 2500.0, "l2_bytes": 50 * 2**20},
    "clocks": {"first_ms": 2.0, "first5_median_ms": 1.8, "last20_median_ms": 1.5, "samples_ms": [2.0, 1.8, 1.5],
               "sm_clock_mhz_idle": "345", "sm_clock_mhz_busy": "1980", "sm_clock_mhz_max": "1980"},
    "zeros": {"matmul_random_ms": 1.5, "matmul_zeros_ms": 1.2, "matmul_random_tflops": 733.0,
              "matmul_zeros_tflops": 916.0, "sdpa_random_ms": 0.9, "sdpa_zeros_ms": 0.85},
}


def test_honesty_lines_print_each_demonstration():
    results = {"honesty": SYNTHETIC_DEMOS}
    assert "10,000x" in pitfalls.honesty_lines(results, "warmup")[1]
    assert pitfalls.honesty_lines(results, "async")[-1] == "the unsynchronized number is 45x too small"
    assert "mean 0.2000 ms" in pitfalls.honesty_lines(results, "medians")[0]
    assert "(2.00x)" in pitfalls.honesty_lines(results, "l2")[1]
    assert "last 20: 1.20x)" in pitfalls.honesty_lines(results, "clocks")[0]
    assert "zeros take 0.80x the time" in pitfalls.honesty_lines(results, "zeros")[0]
    assert pitfalls.honesty_lines({"honesty": None}, "l2") == [pitfalls.NO_DEMOS]
    assert "failed" in pitfalls.honesty_lines({"honesty": {"warmup": {"error": "X"}}}, "warmup")[0]
    with pytest.raises(ValueError):
        pitfalls.honesty_lines(results, "nonsense")
    fig = pitfalls.samples_figure(results)
    assert len(fig.axes) == 2
    assert pitfalls.samples_figure({"honesty": None}) is None


def test_out_may_name_a_folder_and_figures_may_follow_the_run(tmp_path):
    folder = tmp_path / "results"
    folder.mkdir()
    flags = ["--stages", "", "--baselines", "sdpa", "--lengths", "8", "--head-dims", "16", "--batch-heads", "1,1",
             "--seconds", "0.005", "--no-progress"]
    assert bench.main(flags + ["--out", str(folder), "--no-figures"]) == 0
    (written,) = folder.glob("*.json")
    assert written.name == bench.default_output("cuda" if not ON_SIMULATOR else "cpu").name
    assert bench.load_results(written)["records"][0]["status"] == "ok"


def test_mistake_sizes_from_the_committed_file():
    from wb_kernels.bench import pitfalls

    results = bench.load_results(pitfalls.demos_path())  # the committed run that holds the demos, as the dashboard lesson reads
    lines = pitfalls.mistake_sizes(results)
    assert len(lines) == 9 and lines[0].startswith("timing the first call")
    factors = [float(line.split("x", 1)[0].split()[-1].replace(",", "")) for line in lines]
    assert factors[0] > 100 and factors[2] < 0.5  # warm-up and asynchrony: factors, not percents
    assert pitfalls.mistake_sizes({"honesty": {}}) == [pitfalls.NO_DEMOS]


# ---------------------------------------------------------------------------------------------
# Shared-memory traffic under Nsight Compute (wb_kernels/bench/ncu_traffic.py): the parts that need no GPU


def _ncu_csv(launches, metrics=None, environment=None):
    """What `ncu --csv --print-units base` prints: its own lines, the program's, then one row per metric of each
    profiled launch. `launches`: (launch ID, kernel name, scale of the values)."""
    from wb_kernels.bench import ncu_traffic

    units = {"sm__sass_data_bytes_mem_shared.sum": "byte", "gpu__time_duration.sum": "nsecond"}
    header = ('"ID","Process ID","Process Name","Host Name","Kernel Name","Context","Stream","Block Size",'
              '"Grid Size","Device","CC","Section Name","Metric Name","Metric Unit","Metric Value"')
    lines = ["==PROF== Connected to process 4242 (python3)",
             '==PROF== Profiling "flash_wmma_kernel" - 0: 0%....50%....100% - 9 passes']
    if environment is not None:
        lines.append(ncu_traffic.ENVIRONMENT_TAG + json.dumps(environment))
    lines += ["==PROF== Disconnected from process 4242", header]
    for launch_id, kernel, scale in launches:
        for n, metric in enumerate(metrics or ncu_traffic.METRICS):
            value = f"{int(scale * 1000 * (n + 1)):,}"  # ncu groups thousands
            lines.append(f'"{launch_id}","4242","python3","host","{kernel}","1","7","(128, 1, 1)","(64, 64, 1)",'
                         f'"0","9.0","Command line profiler metrics","{metric}","{units.get(metric, "")}","{value}"')
    return "\n".join(lines) + "\n"


WMMA_KERNEL = "void wb::flash_wmma_kernel<__half, 128, 4, false, 1>(wb::FlashParams)"
MMA_KERNEL = "void wb::flash_mma_kernel<__half, 128, 4>(wb::FlashParams)"


def test_ncu_csv_parser_finds_each_stages_launch():
    from wb_kernels.bench import ncu_traffic

    text = _ncu_csv([(0, WMMA_KERNEL, 1), (1, MMA_KERNEL, 2), (2, "void at::native::reduce_kernel<512, 1>()", 5)])
    found = ncu_traffic.parse_ncu_csv(text, ["wmma", "mma"])
    assert set(found) == {"wmma", "mma"}
    assert found["wmma"]["kernel"] == WMMA_KERNEL and found["mma"]["kernel"] == MMA_KERNEL
    assert found["wmma"]["metrics"]["sm__sass_data_bytes_mem_shared.sum"] == 1000  # "1,000" byte
    assert found["mma"]["metrics"]["sm__sass_data_bytes_mem_shared.sum"] == 2000
    duration = "gpu__time_duration.sum"
    assert found["wmma"]["metrics"][duration] == pytest.approx(1000 * (ncu_traffic.METRICS.index(duration) + 1) * 1e-9)
    # one stage's kernel name is not inside the other's: flash_mma_kernel never matches flash_wmma_kernel
    assert ncu_traffic.parse_ncu_csv(text, ["wmma"])["wmma"]["kernel"] == WMMA_KERNEL


def test_ncu_csv_parser_says_what_is_missing():
    from wb_kernels.bench import ncu_traffic

    with pytest.raises(ValueError, match="no ncu CSV table"):
        ncu_traffic.parse_ncu_csv("==PROF== nothing profiled\n", ["wmma"])
    with pytest.raises(ValueError, match="no launch of flash_mma_kernel"):
        ncu_traffic.parse_ncu_csv(_ncu_csv([(0, WMMA_KERNEL, 1)]), ["wmma", "mma"])
    with pytest.raises(ValueError, match="2 launches of flash_wmma_kernel"):
        ncu_traffic.parse_ncu_csv(_ncu_csv([(0, WMMA_KERNEL, 1), (1, WMMA_KERNEL, 1)]), ["wmma"])
    partial = _ncu_csv([(0, WMMA_KERNEL, 1)], metrics=ncu_traffic.METRICS[:-2])
    with pytest.raises(ValueError, match=r"no value for smsp__sass_inst_executed_op_ldgsts\.sum, gpu__time_duration"):
        ncu_traffic.parse_ncu_csv(partial, ["wmma"])
    refused = ("==PROF== Connected to process 1\n"
               "==ERROR== Failed to find metric regex:^smsp__sass_inst_executed_op_ldgsts(\\.(sum|avg))?$\n")
    message = ncu_traffic.missing_metrics_message(refused)
    assert "ncu does not know smsp__sass_inst_executed_op_ldgsts.sum" in message and "--query-metrics" in message
    assert ncu_traffic.missing_metrics_message("==PROF== Disconnected\n") is None


def test_ncu_result_is_per_flop_of_the_problem():
    from wb_kernels.bench import ncu_traffic

    found = ncu_traffic.parse_ncu_csv(_ncu_csv([(0, WMMA_KERNEL, 1), (1, MMA_KERNEL, 2)]), ["wmma", "mma"])
    problem = dict(ncu_traffic.DEFAULT_PROBLEM)
    result = ncu_traffic.build_result(found, problem, {"gpu": "Test GPU", "date": "2026-11-23T00:00:00Z",
                                                       "torch": "2.11"}, command="python -m x", ncu_version="2025.1")
    flops = bench.attention_flops(4, 16, 4096, 4096, 128, causal=False)
    assert result["problem"]["flops"] == flops and result["gpu"] == "Test GPU" and result["date"].startswith("2026")
    assert result["environment"]["torch"] == "2.11" and result["command"] == "python -m x"
    assert result["ncu_version"] == "2025.1" and result["ncu_metrics"] == list(ncu_traffic.METRICS)
    wmma, mma = result["stages"]["wmma"], result["stages"]["mma"]
    assert wmma["shared_bytes_per_flop"] == pytest.approx(1000 / flops)
    assert mma["shared_bytes_per_flop"] == pytest.approx(2 * wmma["shared_bytes_per_flop"])
    assert wmma["bank_conflicts_per_wavefront"] == pytest.approx(3000 / 2000)  # 3rd metric over the 2nd
    assert wmma["tflops_under_ncu"] == pytest.approx(flops / (wmma["duration_ms_under_ncu"] / 1e3) / 1e12)
    json.dumps(result, allow_nan=False)


def test_ncu_traffic_from_a_csv_writes_the_json(tmp_path, capsys):
    from wb_kernels.bench import ncu_traffic

    csv_path = tmp_path / "ncu.csv"
    csv_path.write_text(_ncu_csv([(0, WMMA_KERNEL, 1), (1, MMA_KERNEL, 2)],
                                 environment={"gpu": "Test GPU", "date": "2026-11-23T00:00:00Z"}))
    out = tmp_path / "smem.json"
    assert ncu_traffic.main(["--stages", "wmma", "mma", "--from-csv", str(csv_path), "--json", str(out)]) == 0
    result = json.loads(out.read_text())
    assert set(result["stages"]) == {"wmma", "mma"} and result["gpu"] == "Test GPU"
    assert result["command"].startswith("python -m wb_kernels.bench.ncu_traffic --stages wmma mma")
    assert "wrote" in capsys.readouterr().out


def test_ncu_command_profiles_one_launch_per_stage_after_the_warmup():
    from wb_kernels.bench import ncu_traffic

    command = ncu_traffic.ncu_command("ncu", ["wmma", "mma"], dict(ncu_traffic.DEFAULT_PROBLEM, causal=True), 3)
    option = {name: command[command.index(name) + 1] for name in ("--launch-skip", "--launch-count", "--kernel-name")}
    assert option == {"--launch-skip": "6", "--launch-count": "2",
                      "--kernel-name": "regex:flash_wmma_kernel|flash_mma_kernel"}
    assert command[command.index("--metrics") + 1].split(",") == list(ncu_traffic.METRICS)
    child = command[command.index("--child"):]
    assert child[:4] == ["--child", "--stages", "wmma", "mma"] and child[-1] == "--causal"


@pytest.mark.parametrize("argv, message", [
    (["--stages", "wmma", "wmma"], "names a stage twice"),
    (["--stages", "no_such_stage"], "'no_such_stage' is not registered"),
    (["--stages", "naive"], "'naive' is not a CUDA C++ rung"),
    (["--stages", "wmma", "--D", "96"], "head dims 64, 128, not 96"),
    (["--stages", "wmma", "--L", "0"], "must be a positive integer"),
    (["--stages", "wmma", "--dtype", "float32"], "invalid choice"),
    (["--stages", "wmma", "--ncu", "/no/such/ncu"], "needs a CUDA GPU" if ON_SIMULATOR else "ncu not found"),
    (["--stages", "wmma", "--from-csv", "/no/such.csv"], "no file"),
    (["--L", "64"], "--stages"),
])
def test_ncu_traffic_refuses_bad_arguments(argv, message, capsys):
    from wb_kernels.bench import ncu_traffic

    with pytest.raises(SystemExit) as stopped:
        ncu_traffic.main(argv)
    assert stopped.value.code == 2
    assert message in capsys.readouterr().err


def test_git_commit_told_by_the_environment_wins(tmp_path, monkeypatch):
    """A copy of the tree run elsewhere is told its commit (WB_GIT_COMMIT): a stale .git there must not name it."""
    monkeypatch.setenv("WB_GIT_COMMIT", "abc1234")
    assert results_file.git_commit(tmp_path) == "abc1234"
    monkeypatch.setenv("WB_GIT_COMMIT", "ac43df8bfd424bfbfb9c4a75f487cb8ecb413e21")  # a full hash: the short form
    assert results_file.git_commit(tmp_path) == "ac43df8"
    monkeypatch.delenv("WB_GIT_COMMIT")
    assert results_file.git_commit(tmp_path) is None


# --- one way of timing across presets, recorded in the file; files timed differently are not compared ------------


def test_every_preset_times_with_the_one_device_time_method():
    from wb_kernels.bench.decode import DECODE_TIMING
    from wb_kernels.timing import DEVICE_TIME

    assert bench.TimingPolicy().method is DEVICE_TIME and DECODE_TIMING is DEVICE_TIME  # one object, not copies
    assert DEVICE_TIME.device_time and DEVICE_TIME.flush_l2 and DEVICE_TIME.flush_mode == "read"
    assert dict(DEVICE_TIME) == {"flush_l2": True, "flush_mode": "read", "hold_us": DEVICE_TIME.hold_us}
    assert DECODE_TIMING["hold_us"] > 0  # the decode tuning script reads it by key


def test_the_command_line_gives_the_prefill_and_decode_presets_the_same_method(monkeypatch, tmp_path):
    from wb_kernels.bench import cli
    from wb_kernels.timing import DEVICE_TIME

    seen = {}
    monkeypatch.setattr(cli, "run", lambda sweeps, out, policy, **kw: seen.setdefault("prefill", policy))
    monkeypatch.setattr(cli, "run_decode", lambda w, out, policy, **kw: seen.setdefault("decode", policy))
    assert cli.main(["--preset", "smoke", "--no-figures", "--out", str(tmp_path / "a.json")]) == 0
    assert cli.main(["--preset", "decode-smoke", "--no-figures", "--out", str(tmp_path / "b.json")]) == 0
    assert seen["prefill"].method is DEVICE_TIME and seen["decode"].method is DEVICE_TIME


def _gpu_file(records, timing=None, gpu="NVIDIA H100 80GB HBM3"):
    return {"environment": {"backend": "gpu", "gpu": gpu, "device": gpu}, "timing": timing, "records": records}


def test_timing_method_reads_the_committed_files():
    from wb_kernels.timing import DEVICE_TIME, EVENTS_AROUND_CALL

    root = bench.REPO_ROOT / "results"
    assert bench.timing_method(bench.load_results(root / "decode" / "bench_h100.json")) == DEVICE_TIME
    assert bench.timing_method(bench.load_results(root / "mma" / "bench_h100.json")) == EVENTS_AROUND_CALL
    assert bench.timing_method(bench.load_results(root / "bench" / "simulator_smoke.json")) is None
    written = _gpu_file([], timing=dict(DEVICE_TIME))
    assert bench.timing_method(written) == DEVICE_TIME


def test_files_timed_differently_are_refused_in_one_comparison():
    from wb_kernels.bench.results import MixedTiming
    from wb_kernels.timing import DEVICE_TIME

    ok = {"status": "ok", "device": "cuda", "median_ms": 1.0}
    device_time = _gpu_file([dict(ok, l2_flush_mode="read", hold_us=300.0)])
    old = _gpu_file([dict(ok, l2_flushed=True)])
    root = bench.REPO_ROOT / "results"
    with pytest.raises(MixedTiming, match="timed differently"):
        bench.same_timing({"prefill": old, "decode": device_time})
    # two files both timed the old way: each has the host's launch time of its own run in its window
    with pytest.raises(MixedTiming, match="comparable within one run only"):
        bench.same_timing({"ladder": bench.load_results(root / "bench" / "h100-80gb-hbm3_2026-11-21.json"),
                           "mma": bench.load_results(root / "mma" / "bench_h100.json")})
    with pytest.raises(MixedTiming, match="different GPUs"):
        bench.same_timing({"a": device_time, "b": _gpu_file(device_time["records"], gpu="NVIDIA H200")})
    with pytest.raises(MixedTiming, match="records were timed in"):
        bench.timing_method(_gpu_file(old["records"] + device_time["records"]))
    assert bench.same_timing({"prefill": device_time, "decode": device_time}) == DEVICE_TIME
    assert bench.same_timing({"one file": old}).flush_mode == "write"  # one file is always comparable with itself


def test_a_run_refuses_to_add_records_timed_another_way(tmp_path):
    from wb_kernels.bench.measure import stamp_timing

    old = _gpu_file([{"status": "ok", "device": "cuda", "median_ms": 1.0, "l2_flushed": True}])
    with pytest.raises(bench.Refused, match="was timed as"):
        stamp_timing(old, bench.TimingPolicy(), tmp_path / "old.json")
    fresh = _gpu_file([])
    stamp_timing(fresh, bench.TimingPolicy(), tmp_path / "new.json")
    assert fresh["timing"] == dict(bench.TimingPolicy().method)


def test_readme_tables_say_how_their_file_was_timed_and_one_file_fills_both_prefill_tables(tmp_path):
    from wb_kernels.bench.results import README_MMA_END, README_MMA_START

    results = bench.load_results(bench.REPO_ROOT / "results" / "mma" / "bench_h100.json")
    assert "flushed by zeroing" in bench.readme_table(results) and "no kernel queued" in bench.readme_table(results)
    both = dict(results, presets=["mma", "public"], timing=dict(bench.TimingPolicy().method))
    path = tmp_path / "both.json"
    bench.save_results(both, path)
    readme = tmp_path / "README.md"
    readme.write_text(f"a\n{bench.README_START}\nold\n{bench.README_END}\nb\n{README_MMA_START}\nold\n{README_MMA_END}\n")
    bench.update_readme(path, readme)
    text = readme.read_text()
    tables = [text.split(start, 1)[1].split(end, 1)[0] for start, end in
              ((bench.README_START, bench.README_END), (README_MMA_START, README_MMA_END))]
    assert "old" not in text and tables[0] == tables[1] and "sleeping kernel" in tables[0]


# --- the dashboard lesson's helpers: the mma point, the overview of every rung, the timing modes, the puzzle's pretend GPU ------


def test_roofline_point_of_the_mma_rung_from_its_file():
    from wb_kernels.bench.figures import roofline_point

    results = bench.load_results(bench.REPO_ROOT / "results" / "mma" / "bench_h100.json")
    point = roofline_point(results, "mma")
    assert point["L"] == max(bench.LADDER_LENGTHS) and point["dtype"] == "float16" and point["D"] == 128
    assert point["intensity"] == pytest.approx(point["L"] / 2, rel=1e-3)  # fp16, not causal: L/2 FLOP per byte
    assert point["roof"] == min(point["peak"], point["bandwidth"] * 1e9 * point["intensity"] / 1e12)
    assert 0 < point["fraction"] < 1 and roofline_point(results, "naive") is None


def test_overview_refuses_files_timed_differently_and_labels_them_when_asked():
    from wb_kernels.bench import dashboard

    root = bench.REPO_ROOT / "results"
    files = {name: bench.load_results(root / name) for name in
             ("bench/h100-80gb-hbm3_2026-11-21.json", "mma/bench_h100.json", "decode/bench_h100.json")}
    with pytest.raises(bench.MixedTiming, match="timed differently"):
        dashboard.overview_lines(files)
    lines = dashboard.overview_lines(files, label=True)
    assert lines[0].startswith("NOT one comparison")
    rungs = [line.split()[0] for line in lines[2:]]
    assert {"naive", "tiled", "flash", "wmma", "mma", "decode"} <= set(rungs)
    assert all("[" in line for line in lines[2:])  # every line names how its file was timed


def test_overview_sources_are_the_newest_run_the_mma_run_while_it_lacks_mma_and_decode():
    from wb_kernels.bench import dashboard

    sources = dashboard.overview_sources()
    names = list(sources)
    assert names[0] == str(bench.committed_results("gpu").relative_to(bench.REPO_ROOT))
    assert names[-1] == str(bench.results.committed_decode_results().relative_to(bench.REPO_ROOT))
    newest_has_mma = any(r.get("contender") == "mma" and r["status"] == "ok" for r in sources[names[0]]["records"])
    assert (str(dashboard.MMA_RESULTS.relative_to(bench.REPO_ROOT)) in names) != newest_has_mma


def test_overview_of_files_timed_one_way_is_one_comparison():
    from wb_kernels.bench import dashboard
    from wb_kernels.timing import DEVICE_TIME

    prefill = bench.load_results(bench.REPO_ROOT / "results" / "mma" / "bench_h100.json")
    decode = bench.load_results(bench.REPO_ROOT / "results" / "decode" / "bench_h100.json")
    prefill = dict(prefill, timing=dict(DEVICE_TIME))  # as a run under DEVICE_TIME writes it
    lines = dashboard.overview_lines({"prefill": prefill, "decode": decode})
    assert lines[0] == f"every rung, timed one way: {DEVICE_TIME.label()}"
    assert [line.split()[0] for line in lines[2:]] == ["wmma", "mma", "decode", "decode"]


def test_timing_modes_file_reads_back_four_ways_per_call():
    from wb_kernels.bench import pitfalls

    modes = pitfalls.timing_modes(bench.REPO_ROOT / "results" / "decode" / "history" / "timing_modes_h100_42df32c.json")
    assert modes["gpu"] == "NVIDIA H100 80GB HBM3" and modes["commit"] == "42df32c"
    assert all(set(times) == set(pitfalls.TIMING_MODES) for times in modes["rows"].values())
    lines = pitfalls.timing_modes_lines(modes, Hk=8)
    assert len(lines) == 3 + sum(key[3] == 8 for key in modes["rows"])
    assert pitfalls.timing_modes_figure(modes, Hk=8) is not None


def test_the_lesson_reads_the_honesty_demonstrations_from_a_file_that_has_them():
    from wb_kernels.bench import pitfalls

    path = pitfalls.demos_path()
    assert path is not None and bench.load_results(path)["honesty"]["clocks"]


def test_the_pretend_gpu_is_asynchronous_and_stamps_events_on_its_own_timeline():
    from wb_kernels.bench.fake_gpu import FakeDevice

    device = FakeDevice(kernel_us=40.0, wrapper_us=80.0, compile_us=1000.0)
    device.kernel()  # compiles, then queues
    assert device.host_us == 1000.0 + 80.0 + device.launch_us < device.free_at  # returned before the work is done
    device.synchronize()
    assert device.host_us == device.free_at
    device.sleep(500)
    device.flush_l2("read")
    start, end = device.Event(), device.Event()
    start.record()
    device.kernel()
    end.record()
    with pytest.raises(RuntimeError, match="synchronize"):
        start.elapsed_time(end)
    end.synchronize()
    assert start.elapsed_time(end) == pytest.approx(device.truth_ms)
    device.flush_l2("write")
    device.synchronize()
    assert device.l2 == "dirty"
    with pytest.raises(ValueError):
        device.flush_l2("zero")


def test_the_timing_puzzle_names_the_lie_and_rejects_a_stub():
    from wb_kernels.bench import exercises
    from wb_kernels.exercises import puzzle_verdict

    assert "not solved yet: time_it returned None" in puzzle_verdict(exercises.PUZZLE, lambda fn, device: None)
    no_flush = exercises.WRONG_LOOPS["the L2 left warm (no flush)"]()
    assert "'the L2 left warm (no flush)'" in puzzle_verdict(exercises.PUZZLE, no_flush)

    def raises(fn, device):
        raise KeyError("oops")

    assert "raised KeyError" in puzzle_verdict(exercises.PUZZLE, raises)


# ---------------------------------------------------------------- grouped-query problems and the hopper rung's bar


def test_grouped_query_configs_have_their_own_keys_and_byte_counts():
    mha, gqa = bench.Config(4, 32, 4096, 128, "float16", True), bench.Config(4, 32, 4096, 128, "float16", True, Hk=8)
    assert mha.kv_heads == 32 and gqa.kv_heads == 8 and mha.shape_key == (4, 32, 4096, 128) != gqa.shape_key
    assert bench.record_key("mma", mha) == "mma|float16|B4|H32|L4096|D128|causal"  # as every committed file has it
    assert bench.record_key("mma", gqa) == "mma|float16|B4|H32|Hk8|L4096|D128|causal"
    assert bench.record_key("mma", bench.Config(4, 32, 4096, 128, "float16", True, Hk=32)) == bench.record_key("mma", mha)
    # q and the output with 32 heads, k and v with 8
    assert bench.minimum_bytes(1, 32, 4, 4, 2, itemsize=2, Hk=8) == 2 * 2 * (2 * 32 * 4 + 2 * 8 * 4)
    assert bench.minimum_bytes(1, 32, 4, 4, 2, itemsize=2, Hk=32) == bench.minimum_bytes(1, 32, 4, 4, 2, itemsize=2)


def test_a_grouped_query_sweep_runs_and_is_checked(tmp_path):
    """k and v with fewer heads reach every contender: the stage, SDPA (enable_gqa) and eager PyTorch (heads repeated);
    each is checked against the float64 reference of query head 0 (which reads key/value head 0)."""
    configs = (bench.Config(1, 4, 13, 16, "float32", True, Hk=2), bench.Config(1, 4, 9, 16, "float32", False, Hk=1))
    sweep = bench.Sweep("gqa", ("reference", "sdpa", "torch-eager"), configs)
    results = measure.run([sweep], tmp_path / "gqa.json", progress=False, log=lambda *a: None,
                          policy=measure.TimingPolicy(seconds=0.005, min_repeats=2))
    records = results["records"]
    assert len(records) == 6 and all(r["status"] == "ok" and r["check"]["passed"] for r in records)
    assert {(r["H"], r["Hk"]) for r in records} == {(4, 2), (4, 1)}
    assert {r["key"].split("|")[4] for r in records} == {"Hk2", "Hk1"}


def test_hopper_bar_preset_is_the_issues_workload():
    """Issue 31: fp16/bf16, D 64 and 128, L 512..16384 at 16k tokens and 16 heads, causal and not, and GQA with 32
    query heads on 8 key/value heads; hopper against mma, SDPA's FLASH and cuDNN and FlashInfer's FA3, in a file of
    its own (results/hopper/)."""
    (sweep,) = bench.PRESETS["hopper-bar"]
    assert sweep.contenders[0] == "hopper"
    assert set(sweep.contenders) == {"hopper", "hopper-v2", "hopper-v3", "hopper-v4", "mma", "sdpa-flash",
                                     "sdpa-cudnn", "flashinfer-fa3"}
    # every version contender names a version the stage has, and the benchmark knows it
    versions = {"hopper-v2", "hopper-v3", "hopper-v4"}
    assert {f"hopper-{v}" for v in wb.available_stages()["hopper"].versions} >= versions
    assert versions <= set(measure.contenders())
    mha = {(c.B, c.H, c.L, c.D, c.dtype, c.causal) for c in sweep.configs if c.kv_heads == c.H}
    assert mha == {(bench.TOKENS // L, 16, L, D, dtype, causal) for L in bench.LADDER_LENGTHS for D in (64, 128)
                   for dtype in ("float16", "bfloat16") for causal in (False, True)}
    gqa = [c for c in sweep.configs if c.kv_heads != c.H]
    assert gqa and all((c.H, c.kv_heads) == (32, 8) for c in gqa)
    assert {(c.dtype, c.causal) for c in gqa} == {(d, c) for d in ("float16", "bfloat16") for c in (False, True)}
    assert sweeps.RUNG_PRESETS["hopper-bar"] == "hopper" and "hopper-bar" in sweeps.GPU_PRESETS
    assert "hopper-bar" not in sweeps.ALL_PRESETS  # not in the ladder's file


def test_a_rung_preset_runs_alone_and_on_a_gpu(capsys, tmp_path):
    out = tmp_path / "x.json"
    assert bench.main(["--preset", "hopper-bar", "--preset", "smoke", "--out", str(out)]) == 2
    assert "file of its own" in capsys.readouterr().err
    if ON_SIMULATOR:
        assert bench.main(["--preset", "hopper-bar", "--out", str(out)]) == 2
        assert "needs a CUDA GPU" in capsys.readouterr().err
    assert not out.exists()


def test_rung_bar_table_gives_tflops_and_ratios_to_cudnn():
    config, gqa = bench.Config(4, 16, 4096, 128, "float16", False), bench.Config(4, 32, 4096, 128, "bfloat16", True, 8)
    sweep = bench.Sweep("bar", ("hopper", "mma", "sdpa-cudnn", "flashinfer-fa3"), (config, gqa))

    def record(name, kind, ms, c=config, **extra):
        return {"key": bench.record_key(name, c), "contender": name, "kind": kind, "status": "ok", "median_ms": ms,
                "tflops": 600 / ms, **extra}

    records = [record("hopper", "stage", 1.0), record("mma", "stage", 2.0), record("sdpa-cudnn", "baseline", 1.1),
               record("flashinfer-fa3", "baseline", 0.9), record("hopper", "stage", 3.0, gqa),
               record("sdpa-cudnn", "baseline", 1.5, gqa, check_failed=True)]
    results = bench.add_speedups({"environment": {"gpu": "Test GPU", "backend": "gpu", "date": "2026-11-26"},
                                  "timing": dict(measure.DEVICE_TIME), "records": records})
    lines = results_file.rung_bar_table(results, sweep).splitlines()
    assert lines[2] == "| dtype | D | causal | B | H | Hk | L | hopper | mma | sdpa-cudnn | flashinfer-fa3 | " \
                       "hopper ×sdpa-cudnn | hopper ×best |"
    assert lines[4] == "| float16 | 128 | no | 4 | 16 | 16 | 4096 | 600 | 300 | 545 | 667 | 1.10 | 0.90 (flashinfer-fa3) |"
    # a baseline outside the check tolerance is marked and is no peer to beat; its ratio is still shown
    assert lines[5] == "| bfloat16 | 128 | yes | 4 | 32 | 8 | 4096 | 200 | – | 400 † | – | 0.50 | – |"


def test_the_overview_reads_the_hopper_rungs_own_file():
    """Until a full run times the hopper rung, its preset's own file (results/hopper/, where the hopper-bar preset
    writes on an H100) gives its line of the overview, grouped-query problems named with their Hk."""
    assert dashboard.RUNG_RESULTS["hopper"] == bench.REPO_ROOT / "results" / sweeps.RUNG_PRESETS["hopper-bar"] / \
        "bench_h100.json"
    mma = bench.load_results(bench.REPO_ROOT / "results" / "mma" / "bench_h100.json")
    records = [dict(r, contender="hopper", key=r["key"].replace("mma|", "hopper|", 1), Hk=4)
               for r in mma["records"] if r["contender"] == "mma"]
    (line,) = [line for line in dashboard.overview_lines({"hopper": dict(mma, records=records)})
               if line.startswith("hopper")]
    assert " Hk4 " in line and "TFLOP/s" in line


def test_readme_hopper_block_is_the_committed_hopper_bar_file(tmp_path):
    """The README's hopper table is what its committed file renders, and --update-readme on a hopper-bar file fills
    that block alone (a file of that preset must leave the ladder's and the mma rung's tables as they are)."""
    from wb_kernels.bench.results import README_HOPPER_END, README_HOPPER_START, hopper_readme_table

    text = (bench.REPO_ROOT / "README.md").read_text()
    block = text.split(README_HOPPER_START, 1)[1].split(README_HOPPER_END, 1)[0].strip("\n")
    relative = "results/hopper/bench_h100.json"
    results = bench.load_results(bench.REPO_ROOT / relative)
    assert block == hopper_readme_table(results, source=relative), (
        f"README.md's hopper table is stale: run python -m wb_kernels.bench --update-readme {relative}")
    assert "| hopper |" not in block.splitlines()[0] and "hopper ×sdpa-cudnn" in block
    readme = tmp_path / "README.md"
    readme.write_text(f"a\n{bench.README_START}\nladder\n{bench.README_END}\n"
                      f"{README_HOPPER_START}\nold\n{README_HOPPER_END}\nb\n")
    results_file.update_readme(bench.REPO_ROOT / relative, readme=readme)
    written = readme.read_text()
    assert "\nladder\n" in written and "\nold\n" not in written and "hopper ×best" in written
