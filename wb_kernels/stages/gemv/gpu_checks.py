"""The GEMV kernels' checks on a CUDA GPU, against float64 on fresh random inputs (rung ``gemv``; tests/test_gemv.py
runs each in a subprocess under a time limit).

    python -m wb_kernels.stages.gemv.gpu_checks                  # every check, one line each
    python -m wb_kernels.stages.gemv.gpu_checks v1 v2 v3 fused in_place
    compute-sanitizer --tool memcheck --error-exitcode 1 python -m wb_kernels.stages.gemv.gpu_checks quick
    compute-sanitizer --tool racecheck --error-exitcode 1 python -m wb_kernels.stages.gemv.gpu_checks quick

Each check prints ``CHECK <name> ok|FAILED: <detail>``; the exit status is the number of failed checks.

- ``v1``: the batch-1 kernel at the model's products' shapes (work_split.MODEL_PRODUCTS, plain) and odd ones (one
  row, 7 rows, K = 8, K not a multiple of 256, K past 8192), float16 and bfloat16: every output within
  work_split.error_bound of float64, and equal bit for bit to work_split.emulate where the NumPy model is cheap
  enough to run (the same float32 sums in the same order);
- ``v2``: split-K at 1 to 8 splits on the same shapes: within the bound, bit for bit the model's sums for its split
  count, the same bits twice in a row (deterministic), and the workspace's counters back at zero after the call;
- ``v3``: every batch from 1 to 16 (3, 5, ... take the next kernel width), one and several splits;
- ``fused``: RMSNorm -> product (QKV, LM head), product + residual (o, down), RMSNorm -> gate/up -> SiLU * up, at the
  model's shapes at B = 1, 4 and 16 and at odd shapes, with the launcher's split choice and forced splits; the
  normed forms use the GPU's approximate rsqrt and exp, so their comparison with the NumPy model reports ulps;
- ``in_place``: ``gemv_residual(..., out=residual)`` updates the residual;
- ``quick``: a few small cases of each, for the sanitizers.
"""

from __future__ import annotations

import sys
import time

import numpy as np

from . import launcher
from . import work_split as ws

__all__ = ["CHECKS", "main", "report_line", "random_case", "check_case", "ulps"]

_current = {"case": "before the first launch"}
DEVICE = "cuda"  # where the inputs are made (tests/test_gemv.py runs the checks' own logic on the CPU with a stand-in)
ODD = ((1, 8), (7, 264), (33, 2056), (130, 8200), (5, 4096))  # (N, K): a row alone, K off every step, K past 8192
EMULATE_LIMIT = 2 ** 21  # rows x batch x 32 lanes the NumPy model runs through (a second or so each)


def random_case(form: str, n_out: int, k: int, batch: int, dtype: str, seed: int, squeeze: bool = False):
    """Fresh inputs on the GPU: W (rows, K) ~ N(0, 1/K) (outputs of order 1), x ~ N(0, 1), g ~ 1 + N(0, 0.1^2),
    the residual ~ N(0, 1)."""
    import torch

    gen = torch.Generator(device=DEVICE).manual_seed(seed)
    torch_dtype = getattr(torch, dtype)
    rows = 2 * n_out if form == "norm_gate_up" else n_out

    def normal(*shape, scale=1.0, shift=0.0):
        return (torch.randn(*shape, device=DEVICE, generator=gen) * scale + shift).to(torch_dtype)

    x = normal(k) if squeeze else normal(batch, k)
    case = {"w": normal(rows, k, scale=k ** -0.5), "x": x}
    if form in ("norm", "norm_gate_up"):
        case["norm_weight"] = normal(k, scale=0.1, shift=1.0)
    if form == "residual":
        case["residual"] = normal(n_out) if squeeze else normal(batch, n_out)
    return case


def _synchronize() -> None:
    import torch

    if torch.device(DEVICE).type == "cuda":
        _synchronize()


def _call(form: str, case: dict, splits, version: str = "gemv", workspace=None):
    if version == "v1":
        return launcher.gemv_v1(case["w"], case["x"])
    if form == "plain":
        return launcher.gemv(case["w"], case["x"], splits=splits, workspace=workspace)
    if form == "norm":
        return launcher.rmsnorm_gemv(case["w"], case["x"], case["norm_weight"], splits=splits, workspace=workspace)
    if form == "residual":
        return launcher.gemv_residual(case["w"], case["x"], case["residual"], splits=splits, workspace=workspace)
    return launcher.rmsnorm_gate_up_silu(case["w"], case["x"], case["norm_weight"], splits=splits,
                                         workspace=workspace)


def ulps(a, b, dtype: str) -> int:
    """The largest distance between two arrays of `dtype` values (given as float32), in units of `dtype`'s last
    place (-0 and +0 the same value)."""
    def line(v):  # the 16-bit patterns, sign and magnitude, onto one monotonic line of integers
        v = np.asarray(v, np.float32)
        bits = v.astype(np.float16).view(np.uint16) if dtype == "float16" else (v.view(np.uint32) >> 16)
        bits = bits.astype(np.int64) & 0xFFFF
        return np.where(bits & 0x8000, -(bits & 0x7FFF), bits)

    return int(np.abs(line(a) - line(b)).max()) if np.size(a) else 0


def check_case(form: str, n_out: int, k: int, batch: int, dtype: str, *, splits=None, version: str = "gemv",
               seed: int = 0, squeeze: bool = False, bits: str = "auto") -> dict:
    """One call against float64 (and against the NumPy model where cheap): raises AssertionError on a failure,
    returns {"error_over_bound": worst ratio, "model": "equal" | "n ulps" | "not run"}."""
    _current["case"] = f"{version} {form} N={n_out} K={k} B={batch} {dtype} splits={splits}"
    case = random_case(form, n_out, k, batch, dtype, seed, squeeze)
    y = _call(form, case, splits, version)
    _synchronize()
    expected_shape = (n_out,) if squeeze else (batch, n_out)
    assert tuple(y.shape) == expected_shape and y.dtype == case["w"].dtype, (tuple(y.shape), y.dtype)
    plan_splits = splits or 1
    if splits is None and version == "gemv":
        plan_splits = launcher.auto_splits(ws.Product("call", n_out, k, form, batch), case["w"].device.index)
    args = {name: case[name] for name in ("norm_weight", "residual") if name in case}
    ref = ws.reference64(case["w"], case["x"], form=form, **args)
    bound = ws.error_bound(case["w"], case["x"], dtype=dtype, form=form, splits=plan_splits, **args)
    ratio = (y.double().reshape(ref.shape) - ref).abs() / bound
    worst = float(ratio.max())
    if not worst <= 1.0:
        raise AssertionError(f"{_current['case']}: |error| / bound = {worst:.3g} (> 1) at "
                             f"{np.unravel_index(int(ratio.argmax()), tuple(ratio.shape))}")
    model = "not run"
    rows = case["w"].shape[0]
    if bits != "skip" and rows * batch * ws.LANES <= EMULATE_LIMIT:
        host = {name: t.float().cpu().numpy() for name, t in case.items()}
        emulated = ws.emulate(host.pop("w"), host.pop("x"), dtype=dtype, form=form, splits=plan_splits, **host)
        got = y.float().cpu().numpy().reshape(emulated.shape)
        distance = ulps(got, emulated, dtype)
        if form in ("plain", "residual") and distance != 0:
            raise AssertionError(f"{_current['case']}: not the NumPy model's bits (up to {distance} ulps apart): "
                                 "the kernel's order of summation is not the one work_split.emulate documents")
        model = "equal" if distance == 0 else f"{distance} ulps"
    return {"error_over_bound": worst, "model": model}


def _run_cases(cases) -> str:
    worst, equal, compared = 0.0, 0, 0
    for case in cases:
        result = check_case(**case)
        worst = max(worst, result["error_over_bound"])
        if result["model"] != "not run":
            compared += 1
            equal += result["model"] == "equal"
    return f"{len(cases)} calls within the float64 bound (worst {worst:.2f} of it); {equal} of {compared} equal to " \
           "the NumPy model bit for bit"


def _model_shapes(form_of_product: bool):
    return [(p.form if form_of_product else "plain", p.n_out, p.k) for p in ws.MODEL_PRODUCTS]


def check_v1() -> str:
    cases = [dict(form="plain", n_out=n, k=k, batch=1, dtype=dtype, version="v1", seed=i)
             for dtype in ("float16", "bfloat16") for i, (n, k) in enumerate(
                 [(p.weight_rows, p.k) for p in ws.MODEL_PRODUCTS] + list(ODD))]
    cases.append(dict(form="plain", n_out=64, k=512, batch=1, dtype="float16", version="v1", squeeze=True))
    return _run_cases(cases)


def check_v2() -> str:
    import torch

    cases = []
    for dtype in ("float16", "bfloat16"):
        for n, k in [(p.weight_rows, p.k) for p in ws.MODEL_PRODUCTS if p.name != "lm_head"] + list(ODD):
            for splits in (1, 2, 3, 4, 8):
                if ws.split_plan(k, splits)[1] == splits:
                    cases.append(dict(form="plain", n_out=n, k=k, batch=1, dtype=dtype, splits=splits, seed=splits))
    summary = _run_cases(cases)
    # deterministic, and the counters left at zero for the next call on the same workspace
    case = random_case("plain", 2048, 8192, 1, "float16", seed=7)
    workspace = launcher.Workspace(2048, 1, 8, case["w"].device)
    first = _call("plain", case, 8, workspace=workspace)
    again = _call("plain", case, 8, workspace=workspace)
    _synchronize()
    assert torch.equal(first.view(torch.int16), again.view(torch.int16)), "two calls gave different bits"
    assert int(workspace.counters.abs().sum()) == 0, "the split-K counters were not left at zero"
    return summary + "; the same bits twice in a row, the counters back at zero"


def check_v3() -> str:
    cases = []
    for dtype in ("float16", "bfloat16"):
        for batch in range(1, 17):
            for n, k, splits in ((2048, 2048, None), (33, 2056, 1), (130, 8200, 3)):
                cases.append(dict(form="plain", n_out=n, k=k, batch=batch, dtype=dtype, splits=splits, seed=batch))
    return _run_cases(cases)


def check_fused() -> str:
    cases = []
    for dtype in ("float16", "bfloat16"):
        for form, n, k in _model_shapes(True):
            for batch in (1, 4, 16):
                cases.append(dict(form=form, n_out=n, k=k, batch=batch, dtype=dtype, seed=batch))
                cases.append(dict(form=form, n_out=n, k=k, batch=batch, dtype=dtype, splits=2, seed=batch + 1))
        for form in ws.FORMS:
            for n, k in ODD:
                cases.append(dict(form=form, n_out=n, k=k, batch=3, dtype=dtype, splits=None, seed=n))
                cases.append(dict(form=form, n_out=n, k=k, batch=1, dtype=dtype, splits=None, seed=n, squeeze=True))
    return _run_cases(cases)


def check_in_place() -> str:
    import torch

    case = random_case("residual", 2048, 2048, 2, "bfloat16", seed=3)
    before = case["residual"].clone()
    expected = launcher.gemv_residual(case["w"], case["x"], before)
    result = launcher.gemv_residual(case["w"], case["x"], case["residual"], out=case["residual"])
    _synchronize()
    assert result.data_ptr() == case["residual"].data_ptr(), "out= was not written in place"
    assert torch.equal(case["residual"].view(torch.int16), expected.view(torch.int16)), "in place gave other bits"
    return "out=residual updates it in place, with the bits of the out-of-place call"


def check_quick() -> str:
    cases = [dict(form=form, n_out=n, k=k, batch=b, dtype="float16", splits=ws.split_plan(k, s)[1], seed=1)
             for form in ws.FORMS for (n, k) in ((7, 264), (130, 2056)) for b, s in ((1, 1), (3, 2), (16, 3))]
    cases.append(dict(form="plain", n_out=33, k=2056, batch=1, dtype="bfloat16", version="v1"))
    return _run_cases(cases)


CHECKS = {"v1": check_v1, "v2": check_v2, "v3": check_v3, "fused": check_fused, "in_place": check_in_place,
          "quick": check_quick}


def report_line(name: str) -> str:
    """Run check `name`; its one line: ``CHECK <name> ok (<s> s): ...`` or ``CHECK <name> FAILED (last launch:
    <case>): <error>`` (a kernel's fault surfaces at the next synchronisation: the line names the last case launched)."""
    _current["case"] = "before the first launch"
    started = time.perf_counter()
    try:
        detail = CHECKS[name]()
        return f"CHECK {name} ok ({time.perf_counter() - started:.0f} s): {detail}"
    except Exception as error:  # noqa: BLE001 (each check reports and the next one runs)
        words = " ".join(str(error).split())[:1500]
        return f"CHECK {name} FAILED (last launch: {_current['case']}): {type(error).__name__}: {words}"


def main(names) -> int:
    """Run the checks `names` (all but ``quick`` when empty), one line each; returns how many failed (or were not
    checks)."""
    unknown = [name for name in names if name not in CHECKS]
    if unknown:
        print(f"unknown checks {unknown}; the checks are {list(CHECKS)}", file=sys.stderr)
        return len(unknown)
    lines = []
    for name in names or [n for n in CHECKS if n != "quick"]:
        lines.append(report_line(name))
        print(lines[-1], flush=True)
    return sum(" FAILED " in line for line in lines)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
