"""The variants benchmark (wb_kernels/bench/variants.py) on the CPU: the visible-pair FLOP counts against a brute-force
count, the sink correction FlexAttention gets against the reference, FlexAttention's version of each variant (eager,
on the CPU) against the reference, the plan and what a CPU skips, the tables on a fabricated results file, and the
smoke preset end to end on Triton's interpreter, stopped by its time budget and resumed. No timing is asserted: the
CPU's numbers say nothing about a GPU's."""

from __future__ import annotations

import os

os.environ["TRITON_INTERPRET"] = "1"  # before anything imports triton: the decorators read it (no GPU needed)

import json  # noqa: E402
import warnings  # noqa: E402

import numpy as np  # noqa: E402
import pytest  # noqa: E402

torch = pytest.importorskip("torch")

import wb_kernels as wb  # noqa: E402
from wb_kernels.bench import variants as bv  # noqa: E402
from wb_kernels.reference import reference_gradients, visible_keys  # noqa: E402
from wb_kernels.timing import DEVICE_TIME  # noqa: E402
from wb_kernels.variants import canonical_variants  # noqa: E402


def _brute_force_pairs(spec: bv.VariantSpec, L: int) -> int:
    """Visible pairs from the reference's own mask (wb_kernels.reference.visible_keys), L x L."""
    q = np.zeros((1, 1, L, 16))
    ids = bv.document_ids(L, spec.documents) if spec.documents else None
    variants = canonical_variants(q, q, window=bv.window_sides(spec), document_ids=None if ids is None else ids[None])
    return int(visible_keys(L, L, spec.causal, None, 1, variants).sum())


@pytest.mark.parametrize("L", [1, 5, 37, 64, 130])
def test_visible_pairs_match_a_brute_force_count(L):
    for name, spec in bv.VARIANTS.items():
        for window in (None, 1, 2, 7, 16, 200):
            if window is not None and spec.window is None:
                continue
            w = bv.VariantWorkload(name, 1, 1, L, 16, "float16", window=window).spec
            assert bv.visible_pairs(w, L) == _brute_force_pairs(w, L), (name, window, L)


def test_flops_count_the_visible_pairs():
    L, D, B, H = 4096, 128, 4, 16
    causal = bv.VariantWorkload("causal", B, H, L, D, "float16")
    assert bv.visible_pairs(causal.spec, L) == L * (L + 1) // 2  # causal: about half
    assert bv.pass_flops(causal, "forward") == 4.0 * B * H * (L * (L + 1) // 2) * D
    assert bv.pass_flops(causal, "fwd+bwd") == 3.5 * bv.pass_flops(causal, "forward")
    plain = bv.VariantWorkload("plain", B, H, L, D, "float16")
    assert bv.pass_flops(plain, "forward") == 4.0 * B * H * L * L * D
    # a causal window of w keys: w per row once the window is full, L * w less the first rows' triangle
    window = bv.VariantWorkload("window", B, H, L, D, "float16")
    w = window.spec.window
    assert bv.window_sides(window.spec) == (w - 1, 0)
    assert bv.visible_pairs(window.spec, L) == L * w - w * (w - 1) // 2
    # a bidirectional window also sees w keys (w // 2 before, the rest after) away from the edges
    assert bv.window_sides(bv.VARIANTS["window-bidirectional"]) == (512, 511)
    # documents: about the sum of each document's causal triangle
    lengths = bv.document_lengths(L, 4)
    assert sum(lengths) == L and len(set(lengths)) == 4
    assert bv.visible_pairs(bv.VARIANTS["documents"], L) == sum(n * (n + 1) // 2 for n in lengths)
    with pytest.raises(ValueError, match="mode"):
        bv.pass_flops(plain, "bwd")


@pytest.mark.parametrize("causal", [False, True, "bottom_right"])
def test_sink_correction_matches_the_reference(causal):
    generator = torch.Generator().manual_seed(3)
    B, H, Lq, Lk, D = 2, 3, 21, 13, 8  # Lq > Lk: with "bottom_right" the first rows see no key
    q = torch.randn(B, H, Lq, D, generator=generator, dtype=torch.float64)
    k, v = (torch.randn(B, H, Lk, D, generator=generator, dtype=torch.float64) for _ in range(2))
    sinks = torch.randn(H, generator=generator, dtype=torch.float64) * 2
    out, lse = (torch.from_numpy(x) for x in wb.reference(q, k, v, causal=causal))  # plain attention, no sinks
    out_ref, lse_ref = wb.reference(q, k, v, causal=causal, sinks=sinks)
    np.testing.assert_allclose(bv.with_sinks(out, lse, sinks).numpy(), out_ref, rtol=0, atol=1e-12)
    np.testing.assert_allclose(bv.lse_with_sinks(lse, sinks).numpy(), lse_ref, rtol=0, atol=1e-12)
    if causal == "bottom_right":  # a row that sees no key: output 0, LSE the sink alone
        assert np.all(out_ref[:, :, 0] == 0) and np.allclose(lse_ref[:, :, 0], sinks.numpy()[None])


def _flex_or_skip():
    try:
        from torch.nn.attention import flex_attention  # noqa: F401
    except ImportError as error:  # torch before 2.5
        pytest.skip(f"FlexAttention is not in this torch: {error}")


@pytest.mark.parametrize("name", ["alibi", "bias", "window-bidirectional", "documents", "gpt-oss", "gemma2"])
def test_flex_modifications_compute_the_variant(name):
    """The benchmark's FlexAttention version of a variant (score_mod, block mask, sinks on its LSE), run eagerly on
    the CPU (unfused, float32), against the float64 reference; the bias's and the sinks' gradients too (FlexAttention
    refuses a backward on the CPU only for q, k, v)."""
    _flex_or_skip()
    workload = bv.VariantWorkload(name, 2, 2, 40, 16, "float32", window=9 if bv.VARIANTS[name].window else None)
    spec = workload.spec
    problem = bv.make_problem(workload, 0, "cpu")
    leaves, arguments = problem.leaves()
    own = dict(zip(spec.differentiable, leaves[3:]))
    tensors = dict(problem.tensors, **own)
    block_mask = bv.flex_block_mask(workload, tensors.get("document_ids"))
    attend = bv.flex_attention_with(spec, block_mask=block_mask, slopes=tensors.get("alibi_slopes"),
                                    bias=tensors.get("bias"), sinks=tensors.get("sinks"))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "flex_attention called without torch.compile()": meant here
        out = attend(problem.q, problem.k, problem.v)
    plain = problem.variant_arguments()
    ref, _ = wb.reference(problem.q, problem.k, problem.v, causal=spec.causal, **plain)
    np.testing.assert_allclose(out.detach().numpy(), ref, rtol=0, atol=2e-5)
    if own:
        grads = torch.autograd.grad(out, list(own.values()), problem.dout)
        expected = reference_gradients(problem.q, problem.k, problem.v, problem.dout, causal=spec.causal, **plain)
        for what, grad in zip(own, grads):
            np.testing.assert_allclose(grad.numpy(), expected[what], rtol=0, atol=2e-5, err_msg=what)


def test_plan_rows_and_what_a_cpu_skips():
    table = bv.variant_contenders()
    jobs = bv.plan_variants(["bar"], table)
    keys = [bv.variant_record_key(c.name, m, w) for c, w, m, _ in jobs]
    assert len(keys) == len(set(keys))
    rows = {(c.name, w.variant, m) for c, w, m, _ in jobs}
    for variant in bv.VARIANTS:
        for mode in bv.MODES:
            assert {("triton", variant, mode), ("triton-kernel", variant, mode), ("flex", variant, mode)} <= rows
    for name in ("sdpa-flash", "sdpa-cudnn", "mma", "hopper"):  # plain and causal only
        assert {v for c, v, _ in rows if c == name} == {"plain", "causal"}
    assert len(jobs) == 3 * len(bv.VARIANTS) * 2 + 4 * 2 * 2
    assert {(w.L, w.D, w.dtype, w.B * w.L, w.H) for _, w, _, _ in jobs} == {(4096, 128, "float16", 16384, 16)}

    # the window sweep: forward only, the window against L = 16k, then L at a window of 1024 beside causal
    sweep = bv.plan_variants(["window-sweep"], table)
    assert {m for _, _, m, _ in sweep} == {"forward"}
    windows = {w.spec.window for _, w, _, _ in sweep if w.L == 16384 and w.variant == "window"}
    assert windows == {2 ** n for n in range(7, 15)}
    assert {w.L for _, w, _, _ in sweep if w.variant == "causal"} == {1024, 2048, 4096, 8192, 16384}
    assert all(w.B * w.L == 16384 for _, w, _, _ in sweep)

    # on a CPU: the triton stage runs (Triton's interpreter), everything else is skipped with its reason
    smoke = bv.plan_variants(["smoke"], table)
    reasons = {(c.name, w.variant, m): bv.skip_reason(c, w, m, on_cuda=False) for c, w, m, _ in smoke}
    for (name, variant, mode), why in reasons.items():
        if name.startswith("triton"):
            assert why is None, (name, variant, mode, why)
        else:
            assert "needs a CUDA GPU" in why, (name, variant, mode, why)
    # on a GPU the hopper stage has no backward: its fwd+bwd rows say so
    hopper = bv.VariantWorkload("causal", 1, 16, 4096, 128, "float16")
    assert "no backward" in bv.skip_reason(table["hopper"], hopper, "fwd+bwd", on_cuda=True)


def _record(contender, variant, mode, ms, *, kind=None, status="ok", check_failed=False, L=4096):
    workload = bv.VariantWorkload(variant, 4, 16, L, 128, "float16")
    flops = bv.pass_flops(workload, mode)
    record = {"key": bv.variant_record_key(contender, mode, workload), "contender": contender, "mode": mode,
              "kind": kind or ("baseline" if contender in ("flex", "sdpa-flash") else "stage"), "variant": variant,
              "dtype": "float16", "B": 4, "H": 16, "Lq": L, "Lk": L, "D": 128, "causal": workload.spec.causal,
              "window": bv.window_sides(workload.spec), "window_override": None, "status": status,
              "visible_fraction": bv.visible_pairs(workload.spec, L) / L ** 2, "flops": flops, "presets": ["bar"]}
    if status == "ok":
        record.update(median_ms=ms, tflops=flops / (ms / 1e3) / 1e12, peak_bytes=2 ** 30)
    if check_failed:
        record["check_failed"] = True
    return record


def test_table_and_bars_on_fabricated_results():
    records = [
        _record("triton", "plain", "forward", 1.0), _record("sdpa-flash", "plain", "forward", 1.1),
        _record("flex", "plain", "forward", 1.5), _record("triton-kernel", "plain", "forward", 0.9),
        _record("triton", "causal", "fwd+bwd", 2.0), _record("flex", "causal", "fwd+bwd", 1.5),  # 0.75: below 0.8
        _record("triton", "sinks", "forward", 1.0), _record("flex", "sinks", "forward", 0.95, check_failed=True),
        _record("triton", "bias", "forward", 1.0, status="failed"), _record("flex", "bias", "forward", 1.0),
    ]
    results = {"kind": "variants", "timing": dict(DEVICE_TIME), "records": records,
               "environment": {"backend": "gpu", "gpu": "NVIDIA H100", "cuda": "12.8", "torch": "2.13",
                               "date": "2026-12-01T00:00:00"}}
    text = bv.variants_table(results, "results/triton/variants_h100.json")
    lines = text.splitlines()
    assert lines[0].startswith("Measured on NVIDIA H100") and "float16, B4 H16 L4096 D128" in lines[0]
    plain = next(line for line in lines if line.startswith("| plain | forward"))
    assert "| 1.50 | ✓ |" in plain  # flex's 1.5 ms over triton's 1.0
    causal = next(line for line in lines if line.startswith("| causal | fwd+bwd"))
    assert "| 0.75 | ✗ |" in causal
    sinks = next(line for line in lines if line.startswith("| sinks | forward"))
    assert sinks.endswith("| - | - |")  # FlexAttention failed its check: no ratio
    bias = next(line for line in lines if line.startswith("| bias | forward"))
    assert bias.split("|")[4].strip() == "-"  # triton failed: a dash
    verdicts = {(v["against"], v["variant"], v["mode"]): v for v in bv.bar_verdicts(results)}
    assert verdicts[("sdpa-flash", "plain", "forward")]["ratio"] == 1.1
    assert verdicts[("sdpa-flash", "plain", "forward")]["met"]
    assert not verdicts[("flex", "causal", "fwd+bwd")]["met"]
    assert verdicts[("flex", "sinks", "forward")]["ratio"] is None
    assert "- forward ≥ 1x sdpa-flash: 1/1 ✓ (lowest: plain 1.10)" in lines
    assert "- fwd+bwd ≥ 0.8x flex: 0/1 ✗ (lowest: causal 0.75)" in lines
    assert any(line.startswith("- forward ≥ 0.9x flex: 1/3 ✗") for line in lines)
    assert bv.window_sweep_table(results) == ""
    assert bv.memory_table(results) == ""
    assert "| plain | forward | float16 | 128 | 1.00 |" in bv.memory_table(results, L=4096)
    with pytest.raises(bv.Refused):
        bv.variants_table({"kind": "backward", "records": []})


def test_smoke_preset_end_to_end_and_resumed(tmp_path, capsys):
    pytest.importorskip("triton", reason="the triton stage needs triton (pip install triton)")
    path = tmp_path / "variants_smoke.json"
    command = ["--preset", "smoke", "--json", str(path), "--no-progress"]
    # cut short by its time budget, then resumed by the same command to the end
    assert bv.main(command + ["--time-budget", "4"]) == 0
    partial = json.loads(path.read_text())
    first = {r["key"]: r for r in partial["records"]}
    assert not partial["complete"] and 0 < len(first) < len(bv.plan_variants(["smoke"], bv.variant_contenders()))
    assert "stopped after 4 s" in capsys.readouterr().out
    assert bv.main(command) == 0
    results = json.loads(path.read_text())
    assert results["kind"] == "variants" and results["complete"]
    assert "--json variants_smoke.json" in results["command"]  # the file's name, no machine path
    by_key = {r["key"]: r for r in results["records"]}
    assert len(by_key) == len(results["records"]) == len(bv.plan_variants(["smoke"], bv.variant_contenders()))
    for key, record in first.items():  # the first run's rows are kept, not measured again
        assert by_key[key] == record
    for record in results["records"]:
        if record["contender"].startswith("triton"):
            assert record["status"] == "ok", record
            assert record["check"]["passed"], record["check"]["line"]
            workload = bv.VariantWorkload(record["variant"], 1, 2, 64, 16, "float16",
                                          window=record["window_override"])
            assert record["flops"] == bv.pass_flops(workload, record["mode"])
            if record["mode"] == "fwd+bwd":
                assert record["check"]["names"][3:] == [f"d{n}" for n in workload.spec.differentiable]
        else:
            assert record["status"] == "skipped" and "needs a CUDA GPU" in record["reason"], record
    out = capsys.readouterr().out
    assert "| gpt-oss | fwd+bwd |" in out and "| plain | forward | 100% |" in out
    # a third run finds everything done
    assert bv.main(command) == 0
    assert "0 to run" in capsys.readouterr().out
    assert len(json.loads(path.read_text())["records"]) == len(by_key)
