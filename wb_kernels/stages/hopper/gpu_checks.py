"""The primitives lab's checks on a Hopper GPU, one per process (rung ``hopper``; run by tests/test_hopper.py).

    python -m wb_kernels.stages.hopper.gpu_checks tma gemm registers named_barriers   # one line per check
    compute-sanitizer --tool memcheck --error-exitcode 1 python -m wb_kernels.stages.hopper.gpu_checks tma gemm attention_quick v2_quick v3_quick v4_quick
    compute-sanitizer --tool synccheck --error-exitcode 1 python -m wb_kernels.stages.hopper.gpu_checks tma gemm attention_quick

A kernel that waits on an mbarrier hangs instead of failing when the barrier is wrong, and a trapped kernel leaves
the process's CUDA context unusable: so the tests start this module in a subprocess under a time limit, and the
extension carries the watchdog (``build.WATCHDOG_SECONDS``). Each check prints ``CHECK <name> ok|FAILED: <detail>``;
the exit status is the number of failed checks.

- ``tma``: (a) TMA boxes of fp16 and bf16 tensors, inside and across the tensor's edges, bit for bit against the
  NumPy model of the 128-byte swizzle (:mod:`.tma_swizzle`), ragged parts zero;
- ``gemm``: (b, c) every GEMM variant (SS and RS, B K-major and MN-major, N = 64 and 128, K = 16, 40, 64) in fp16
  and bf16 against torch.matmul in float64 of the same inputs;
- ``registers``: (d) ``setmaxnreg``: the consumers' 200 live values per thread give NumPy's float32 result, and the
  launch finishes (a ``.inc`` that the pool cannot serve would block for ever);
- ``named_barriers``: (e) two warpgroups take 64 turns each through ``bar.sync`` / ``bar.arrive``: the log must read
  0, 1, 0, 1, ... although warpgroup 0 sleeps before each of its turns;
- ``attention``: v1 (work in progress) against the float64 reference with wb.check's rule; ``attention_quick``: two
  of its cases (fp16, D 64 and 128, ragged, GQA, bottom-right causal, key padding) plus rows without keys, for the
  sanitizers; ``v2``, ``v3``, ``v4`` (and ``v2_quick`` ... ``v4_quick``): the same for the warp-specialized
  versions, with two shapes more (nine key tiles: the ring wraps; Lq far above Lk: blocks without a key tile);
- ``watchdog``: a TMA load whose barrier expects 16 bytes more than arrive: the phase never completes, and the
  watchdog's trap must end the kernel with an error (this check passes when the launch fails);
- ``dq_product`` (issue 47): the backward's dQ product alone (``lab.backward_dq_product``: SS wgmma with A M-major,
  never run by the ``gemm`` check, and B MN-major from column 0, 32 or 64) in fp16 and bf16, D 64 and 128, both
  consumers' halves, against float64 with ``gemm``'s bound: run it first, a wrong descriptor shows here alone;
- ``backward`` (issue 47, work in progress: not yet the stage's backward): the Hopper backward's dq, dk, dv
  (``launcher.backward_gradients``, fed by the stage's own forward) against the float64 reference gradients with
  wb.check's rule (``check_gradients``): both dtypes and head dims, ragged lengths, Lq != Lk, L = 1, both causal
  alignments, key padding, GQA, whole key blocks past the diagonal, and rows that see no key (zero dq); each
  fp16 case in the default (atomic) and the deterministic mode, bf16 in the default. ``backward_quick``: one shape (fp16, D 64 and 128,
  bottom-right causal, key padding, GQA) and the rows without keys, for the sanitizers;
- ``deterministic``: the deterministic mode gives the same bits three times in a row (dq, dk, dv), and by
  ``torch.use_deterministic_algorithms(True)`` too; it reports whether the atomic mode's dq differed between runs
  and the two modes' times (CUDA events), for NOTES.md.

``backward`` stops starting new problems after ``BACKWARD_SECONDS`` and says how many it did not run (the float64
reference is most of its time); with the watchdog a wrong barrier traps instead of hanging, and the GPU run wraps
each process in ``timeout`` as well.
"""

from __future__ import annotations

import sys

import numpy as np

from ...check import check as check_against_reference
from ...inputs import random_padding_mask, random_qkv
from . import lab
from .build import GEMM_VARIANTS
from .tma_swizzle import swizzled_image, tma_box

__all__ = ["check_tma", "check_gemm", "check_registers", "check_named_barriers", "check_attention", "check_watchdog",
           "check_dq_product", "check_backward", "check_deterministic", "register_split_expected", "CHECKS", "main"]


_current = {"case": "before the first launch"}  # what ran last: a trap or a hang names it in the report


def _running(case: str) -> None:
    _current["case"] = case


def _bits(t):
    import torch

    return t.view(torch.int16).cpu().numpy()


def check_tma() -> str:
    import torch

    failures, cases = [], 0
    for dtype in (torch.float16, torch.bfloat16):
        x = torch.randn(100, 200, device="cuda").to(dtype)
        for row0, column0 in ((0, 0), (8, 64), (36, 136), (80, 160), (99, 192)):
            _running(f"tma {dtype} box at ({row0}, {column0})")
            dump = lab.tma_tile(x, row0, column0)
            torch.cuda.synchronize()
            expected = swizzled_image(tma_box(_bits(x), row0, column0))
            cases += 1
            if not np.array_equal(_bits(dump), expected):
                wrong = int((_bits(dump) != expected).sum())
                failures.append(f"{dtype} box at ({row0}, {column0}): {wrong} of {expected.size} elements differ")
    if failures:
        raise AssertionError("; ".join(failures))
    return f"{cases} boxes equal to the NumPy swizzle model bit for bit"


def _product_error(c, a, b):
    """max |c - a b| against float64, and its bound: fp32 accumulation of K exact products errs by at most
    K 2^-24 sum |a||b|; 1e-4 max(|a||b|) leaves room to spare."""
    error = float((c.double() - a.double() @ b.double()).abs().max())
    return error, 1e-4 * float((a.double().abs() @ b.double().abs()).max()) + 1e-6


def check_gemm() -> str:
    import torch

    failures, cases, worst = [], 0, 0.0
    for dtype in (torch.float16, torch.bfloat16):
        for variant in GEMM_VARIANTS:
            for K in ((16,) if variant.k_steps == 1 else (16, 40, 64)):
                if variant.k_steps == 4 and K == 16 and not variant.b_mn_major and variant.n == 64:
                    continue  # the launcher takes the one-step kernel for that shape
                a = torch.randn(64, K, device="cuda").to(dtype)
                b = torch.randn(K, variant.n, device="cuda").to(dtype)
                operand = b if variant.b_mn_major else b.t().contiguous()
                _running(f"gemm {dtype} {variant.label} K={K}")
                c = lab.wgmma_gemm(a, operand, a_in_registers=variant.a_in_registers, b_mn_major=variant.b_mn_major)
                error, bound = _product_error(c, a, b)
                cases += 1
                worst = max(worst, error)
                if not error <= bound:
                    failures.append(f"{dtype} {variant.label} K={K}: max |error| {error:.3g} > {bound:.3g}")
    if failures:
        raise AssertionError("; ".join(failures))
    return f"{cases} products within fp32 accumulation error of float64 (worst {worst:.2g})"


def register_split_expected(x: np.ndarray) -> np.ndarray:
    """What ``register_split_kernel`` computes, in NumPy float32 and the kernel's order."""
    x = np.asarray(x, np.float32)
    out = np.empty(3 * 128, np.float32)
    out[:128] = 2 * x[0, 0]
    for consumer in range(2):
        values = x[consumer]
        largest = values.max(axis=0)
        total = np.zeros(128, np.float32)
        for i in range(values.shape[0] - 1, -1, -1):
            total = np.float32(0.5) * total + (values[i] - largest)
        out[128 * (consumer + 1):128 * (consumer + 2)] = total
    return out


def check_registers() -> str:
    import torch

    x = torch.randn(2, lab.SPLIT_LIVE, 128, device="cuda")
    _running("register_split")
    out = lab.register_split(x).cpu().numpy()
    expected = register_split_expected(x.cpu().numpy())
    # same operations in the same order; room only for a contraction ptxas may choose (0.5 t + d as one FMA is exact)
    if not np.allclose(out, expected, rtol=1e-6, atol=1e-5):
        wrong = int((~np.isclose(out, expected, rtol=1e-6, atol=1e-5)).sum())
        raise AssertionError(f"{wrong} of 384 outputs differ from NumPy (first thread's: {out[0]} vs {expected[0]})")
    return (f"384 threads as NumPy: warpgroup 0 after setmaxnreg.dec, warpgroups 1-2 after setmaxnreg.inc with "
            f"{lab.SPLIT_LIVE} live values each")


def check_named_barriers() -> str:
    import torch

    rounds = 64
    _running(f"named_barrier_turns rounds={rounds}")
    log = lab.named_barrier_turns(rounds, torch.empty(1, device="cuda")).cpu().tolist()
    expected = [0, 1] * rounds
    if log != expected:
        first = next(i for i, (a, b) in enumerate(zip(log, expected)) if a != b)
        raise AssertionError(f"turn {first} went to warpgroup {log[first]}: {log[:16]} ...")
    return f"{2 * rounds} turns alternated 0, 1, 0, 1, ... (warpgroup 0 sleeping before each of its turns)"


ATTENTION_SHAPES = [(1, 2, 1, 1, 2), (2, 3, 100, 77, 3), (1, 2, 64, 64, 1), (1, 2, 200, 70, 2), (2, 4, 130, 300, 2),
                    (1, 4, 77, 513, 1)]  # (B, H, Lq, Lk, Hk)
# v2, v3 and v4 also: 9 key tiles of 128 (the ring wraps two or three times), and Lq far above Lk, where bottom-right
# causal leaves whole 128-row blocks without a key tile (the producer loads Q only)
WS_EXTRA_SHAPES = [(1, 2, 300, 1100, 1), (1, 2, 1030, 200, 2)]
LAUNCHERS = {1: lab.flash_v1, 2: lab.flash_v2, 3: lab.flash_v3, 4: lab.flash_v4}


def check_attention(version: int = 1, quick: bool = False) -> str:
    """v1, v2, v3 or v4 against the float64 reference with wb.check's rule: both dtypes and head dims, ragged lengths,
    Lq != Lk, L = 1, both causal alignments, key padding, GQA, rows that see no key. `quick`: one shape (fp16, D = 64
    and 128, bottom-right causal, key padding) and the rows without keys, for the sanitizers."""
    import torch

    flash = LAUNCHERS[version]
    failures, cases = [], 0
    shapes = ATTENTION_SHAPES + (WS_EXTRA_SHAPES if version > 1 else [])
    dtypes, head_dims = ("float16", "bfloat16"), (64, 128)
    if quick:
        shapes, dtypes = [(2, 4, 130, 300, 2)], ("float16",)
    for dtype in dtypes:
        for D in head_dims:
            for B, H, Lq, Lk, Hk in shapes:
                q, k, v = random_qkv(B, H, Lq, D, Lk=Lk, dtype=dtype, framework="torch", device="cuda",
                                        seed=Lq + 3 * Lk + D)
                k, v = k[:, :Hk].contiguous(), v[:, :Hk].contiguous()
                for causal in (("bottom_right",) if quick else (False, "top_left", "bottom_right")):
                    for padded in ((True,) if quick else (False, True)):
                        mask = random_padding_mask(B, Lk, seed=Lk, framework="torch", device="cuda") if padded else None
                        name = f"v{version} {dtype} D={D} {(B, H, Lq, Lk)} Hk={Hk} causal={causal} padded={padded}"
                        _running(name)
                        out, lse = flash(q, k, v, causal=causal, key_padding_mask=mask)
                        torch.cuda.synchronize()
                        cases += 1
                        try:
                            result = check_against_reference(name, out, q, k, v, lse=lse, causal=causal, key_padding_mask=mask,
                                              verbose=False, raise_on_failure=False)
                        except AssertionError as error:  # wb.check's CheckFailed: a wrong shape
                            failures.append(f"{name}: {error}")
                            continue
                        if not result.passed:
                            failures.append(result.line())
    # rows 0-4 see only keys 0-4, all padded out: zeros and an LSE of -inf
    for D in head_dims:
        q, k, v = random_qkv(1, 2, 70, D, dtype="float16", framework="torch", device="cuda", seed=3)
        mask = torch.ones(1, 70, dtype=torch.bool, device="cuda")
        mask[0, :5] = False
        _running(f"v{version} rows without keys D={D}")
        out, lse = flash(q, k, v, causal=True, key_padding_mask=mask)
        cases += 1
        if not (torch.all(out[:, :, :5] == 0) and torch.all(lse[:, :, :5] == float("-inf"))
                and torch.isfinite(out).all() and torch.isfinite(lse[:, :, 5:]).all()):
            failures.append(f"D={D} rows without a key: not zeros and -inf")
    if failures:
        raise AssertionError(f"{len(failures)} of {cases} cases failed: " + "; ".join(failures[:6]))
    return (f"v{version}: {cases} cases within wb.check's rule (both dtypes, D 64/128, masks, GQA, rows without keys)"
            if not quick else f"v{version}: {cases} cases within wb.check's rule")


def check_watchdog() -> str:
    import torch

    x = torch.randn(64, 64, device="cuda").half()
    try:
        lab.tma_tile(x, expect_bytes=64 * 128 + 16)
        torch.cuda.synchronize()
    except RuntimeError as error:
        return f"the wrong byte count trapped: {str(error).splitlines()[0][:120]}"
    raise AssertionError("a barrier expecting 16 bytes too many completed: the watchdog did not fire")


# region: backward_checks
BACKWARD_SHAPES = ATTENTION_SHAPES + [(1, 2, 300, 1100, 1), (1, 2, 1030, 200, 2), (2, 4, 520, 520, 1)]
BACKWARD_QUICK_SHAPES = [(2, 4, 130, 300, 2)]
BACKWARD_SECONDS = 240.0  # a whole check's budget; the GPU run wraps the process in `timeout` as well
BACKWARD_DEVICE = "cuda"  # tests/test_hopper_backward.py runs check_backward's logic on "cpu" with the NumPy model


def _synchronize() -> None:
    import torch

    if BACKWARD_DEVICE == "cuda":
        torch.cuda.synchronize()


def _backward_case(dtype, D, B, H, Lq, Lk, Hk, causal, padded, seed):
    import torch

    from .launcher import forward

    device = BACKWARD_DEVICE
    q, k, v = random_qkv(B, H, Lq, D, Lk=Lk, dtype=dtype, framework="torch", device=device, seed=seed)
    k, v = k[:, :Hk].contiguous(), v[:, :Hk].contiguous()
    mask = random_padding_mask(B, Lk, seed=Lk, framework="torch", device=device) if padded else None
    out, lse = forward(q, k, v, causal=causal, key_padding_mask=mask)
    dout = torch.randn(q.shape, generator=torch.Generator(device).manual_seed(seed), device=device).to(q.dtype)
    return q, k, v, out, lse, dout, mask


def check_dq_product() -> str:
    import torch

    failures, cases, worst = [], 0, 0.0
    for dtype in (torch.float16, torch.bfloat16):
        for D in (64, 128):
            for consumer in (0, 1):
                a_t = torch.randn(128, 64, device="cuda").to(dtype)
                b = torch.randn(128, D, device="cuda").to(dtype)
                _running(f"dq_product {dtype} D={D} consumer={consumer}")
                c = lab.backward_dq_product(a_t, b, consumer)
                error, bound = _product_error(c, a_t.t(), b[:, consumer * D // 2:(consumer + 1) * D // 2])
                cases += 1
                worst = max(worst, error)
                if not error <= bound:
                    failures.append(f"{dtype} D={D} consumer {consumer}: max |error| {error:.3g} > {bound:.3g}")
    if failures:
        raise AssertionError("; ".join(failures))
    return f"{cases} dQ products (A M-major, B MN-major) within fp32 accumulation error of float64 (worst {worst:.2g})"


def check_backward(quick: bool = False) -> str:
    """The backward's gradients against float64 (module docstring); each case atomic and deterministic."""
    import time

    import torch

    from ...check import check_gradients
    from .launcher import backward_gradients, forward

    started = time.monotonic()
    failures, cases, skipped = [], 0, 0
    shapes, dtypes = BACKWARD_SHAPES, ("float16", "bfloat16")
    if quick:
        shapes, dtypes = BACKWARD_QUICK_SHAPES, ("float16",)
    for dtype in dtypes:
        for D in (64, 128):
            for B, H, Lq, Lk, Hk in shapes:
                for causal in (("bottom_right",) if quick else (False, "top_left", "bottom_right")):
                    for padded in ((True,) if quick else (False, True)):
                        if time.monotonic() - started > BACKWARD_SECONDS:
                            skipped += 1  # reported below: a partial run says so
                            continue
                        q, k, v, out, lse, dout, mask = _backward_case(dtype, D, B, H, Lq, Lk, Hk, causal, padded,
                                                                       seed=Lq + 3 * Lk + D)
                        for deterministic in ((False, True) if dtype == "float16" else (False,)):
                            name = (f"backward {dtype} D={D} {(B, H, Lq, Lk)} Hk={Hk} causal={causal} "
                                    f"padded={padded} deterministic={deterministic}")
                            _running(name)
                            grads = backward_gradients(q, k, v, out, lse, dout, causal=causal, key_padding_mask=mask,
                                                       deterministic=deterministic)
                            _synchronize()
                            cases += 1
                            result = check_gradients(name, grads, q, k, v, dout, causal=causal, key_padding_mask=mask,
                                                     verbose=False, raise_on_failure=False)
                            if not result.passed:
                                failures.append(result.line())
    # keys 0-4 padded out under top-left causal: queries 0-4 see no key; their dq and the padded keys' dk, dv are 0
    for D in (64, 128):
        q, k, v, out, lse, dout, _ = _backward_case("float16", D, 1, 2, 70, 70, 2, True, False, seed=3)
        mask = torch.ones(1, 70, dtype=torch.bool, device=BACKWARD_DEVICE)
        mask[0, :5] = False
        out, lse = forward(q, k, v, causal=True, key_padding_mask=mask)
        _running(f"backward rows without keys D={D}")
        dq, dk, dv = backward_gradients(q, k, v, out, lse, dout, causal=True, key_padding_mask=mask)
        cases += 1
        if not (torch.all(dq[:, :, :5] == 0) and torch.all(dk[:, :, :5] == 0) and torch.all(dv[:, :, :5] == 0)
                and all(torch.isfinite(g).all() for g in (dq, dk, dv))):
            failures.append(f"D={D} rows without a key: dq, dk, dv not zero there (or not finite)")
    if failures:
        raise AssertionError(f"{len(failures)} of {cases} cases failed: " + "; ".join(failures[:6]))
    partial = f" (stopped at {BACKWARD_SECONDS:.0f} s: {skipped} problems not run)" if skipped else ""
    return (f"backward: {cases} cases within wb.check's gradient rule (fp16 atomic and deterministic, bf16 "
            f"atomic){partial}")


def check_deterministic() -> str:
    """Bit-identical gradients in the deterministic mode (three runs, and through the PyTorch switch); the atomic
    mode's dq compared between two runs (reported, not required to differ); both modes timed."""
    import torch

    from .launcher import backward_gradients

    lines, failures = [], []
    for D, causal in ((128, False), (128, "bottom_right"), (64, False)):
        q, k, v, out, lse, dout, _ = _backward_case("bfloat16", D, 2, 8, 2048, 2048, 2, causal, False, seed=D)
        _running(f"deterministic D={D} causal={causal}")
        runs = [backward_gradients(q, k, v, out, lse, dout, causal=causal, deterministic=True) for _ in range(3)]
        torch.use_deterministic_algorithms(True)
        try:
            runs.append(backward_gradients(q, k, v, out, lse, dout, causal=causal))
        finally:
            torch.use_deterministic_algorithms(False)
        for run in runs[1:]:
            if not all(torch.equal(a.view(torch.int16), b.view(torch.int16)) for a, b in zip(runs[0], run)):
                failures.append(f"D={D} causal={causal}: the deterministic mode gave other bits")
        atomic = [backward_gradients(q, k, v, out, lse, dout, causal=causal, deterministic=False) for _ in range(2)]
        differs = not torch.equal(atomic[0][0].view(torch.int16), atomic[1][0].view(torch.int16))
        times = {}
        for mode in (False, True):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            backward_gradients(q, k, v, out, lse, dout, causal=causal, deterministic=mode)
            start.record()
            for _ in range(5):
                backward_gradients(q, k, v, out, lse, dout, causal=causal, deterministic=mode)
            end.record()
            torch.cuda.synchronize()
            times[mode] = start.elapsed_time(end) / 5
        lines.append(f"D={D} causal={causal}: atomic dq {'differed' if differs else 'equal'} across 2 runs, "
                     f"{times[False]:.3f} ms atomic vs {times[True]:.3f} ms deterministic "
                     f"({times[True] / times[False]:.2f}x; bf16 B2 H8 Hk2 L2048, the three kernels)")
    if failures:
        raise AssertionError("; ".join(failures) + " | " + "; ".join(lines))
    return "bit-identical in 4 runs each; " + "; ".join(lines)
# endregion


CHECKS = {"tma": check_tma, "gemm": check_gemm, "registers": check_registers, "named_barriers": check_named_barriers,
          "attention": check_attention, "attention_quick": lambda: check_attention(quick=True),
          "v2": lambda: check_attention(2), "v2_quick": lambda: check_attention(2, quick=True),
          "v3": lambda: check_attention(3), "v3_quick": lambda: check_attention(3, quick=True),
          "v4": lambda: check_attention(4), "v4_quick": lambda: check_attention(4, quick=True),
          "watchdog": check_watchdog, "dq_product": check_dq_product, "backward": check_backward,
          "backward_quick": lambda: check_backward(quick=True), "deterministic": check_deterministic}


def main(names) -> int:
    failed = 0
    for name in names or list(CHECKS):
        _running("before the first launch")
        try:
            detail = CHECKS[name]()
            print(f"CHECK {name} ok: {detail}", flush=True)
        except Exception as error:  # noqa: BLE001 (each check reports and the next one runs)
            failed += 1
            message = " ".join(str(error).split())[:1500]
            print(f"CHECK {name} FAILED (last launch: {_current['case']}): {type(error).__name__}: {message}",
                  flush=True)
    return failed


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
