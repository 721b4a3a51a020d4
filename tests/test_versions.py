"""Every kernel rung's kept versions are runnable by name (``wb_kernels.stages.<rung>.VERSIONS``, as the hopper rung's
launcher has them), each entry matches the float64 reference, and the rung's NOTES.md names every entry.

The numba rungs' entries run here at tiny sizes (the simulator on a CPU, the GPU on one). The CUDA C++ rungs' entries
need a GPU to run; without one, each must name a launch variant that the rung's compile report covers
(``tests/test_<rung>.py`` compiles every variant of ``build.VARIANTS`` with nvcc on the CPU).
"""

from __future__ import annotations

import importlib
from pathlib import Path

import numpy as np
import pytest

import wb_kernels as wb

ROOT = Path(__file__).resolve().parent.parent
RUNGS = ("naive", "tiled", "flash", "wmma", "mma", "backward", "hopper")
NUMBA_RUNGS = ("naive", "tiled", "flash")
CUDA_RUNGS = ("wmma", "mma")
ON_GPU = wb.BACKEND.is_gpu
HOPPER = False
if ON_GPU:
    import torch

    HOPPER = torch.cuda.get_device_capability()[0] == 9
needs_gpu = pytest.mark.skipif(not ON_GPU, reason="a CUDA C++ kernel runs on a GPU; this machine runs the simulator")


def table(rung):
    if rung == "hopper":
        return importlib.import_module("wb_kernels.stages.hopper.launcher").VERSIONS
    return importlib.import_module(f"wb_kernels.stages.{rung}").VERSIONS


def entries(rungs):
    return [pytest.param(rung, name, id=f"{rung}-{name}") for rung in rungs for name in table(rung)]


@pytest.mark.parametrize("rung", RUNGS)
def test_each_rung_has_a_table_of_callables_by_name(rung):
    versions = table(rung)
    assert isinstance(versions, dict) and versions, rung
    assert all(isinstance(name, str) and callable(run) for name, run in versions.items())


@pytest.mark.parametrize("rung", [r for r in RUNGS if r != "hopper"])
def test_notes_name_every_entry_and_what_is_history_only(rung):
    notes = (ROOT / "wb_kernels" / "stages" / rung / "NOTES.md").read_text()
    module = importlib.import_module(f"wb_kernels.stages.{rung}.versions")
    missing = [name for name in module.VERSIONS if f'VERSIONS["{name}"]' not in notes]
    assert not missing, f"{rung}/NOTES.md does not name these entries as VERSIONS[\"...\"]: {missing}"
    assert "versions.py" in notes and "history only" in notes.lower(), \
        f"{rung}/NOTES.md: say where the table is and which versions are history only (or that none is)"
    default = module.DEFAULT_VERSION
    defaults = default.values() if isinstance(default, dict) else [default]
    assert all(name in module.VERSIONS for name in defaults)


# ------------------------------------------------------------------------------------------------ numba rungs
# (B, H, Hk, Lq, Lk, D, causal, padded): tiny, lengths off every tile, both causal alignments, GQA
CASES = [(1, 2, 2, 9, 13, 16, True, False), (1, 2, 1, 7, 11, 16, "bottom_right", True),
         (2, 1, 1, 5, 5, 32, False, True)]


def _inputs(B, H, Hk, Lq, Lk, D, padded, seed):
    framework, device = ("torch", "cuda") if ON_GPU else ("numpy", None)
    q, k, v = wb.random_qkv(B, H, Lq, D, Lk=Lk, seed=seed, framework=framework, device=device)
    k, v = k[:, :Hk], v[:, :Hk]
    if framework == "torch":
        k, v = k.contiguous(), v.contiguous()
    else:
        k, v = np.ascontiguousarray(k), np.ascontiguousarray(v)
    mask = wb.random_padding_mask(B, Lk, seed=seed + 1, framework=framework, device=device) if padded else None
    return q, k, v, mask


def _supported(rung, name, Hk, H, causal, Lq, Lk):
    # flash's version 0 predates GQA and the bottom-right alignment (it refuses them: tested below)
    return not (rung == "flash" and name == "v0" and (Hk != H or (causal == "bottom_right" and Lq != Lk)))


@pytest.mark.parametrize("rung, name", entries(NUMBA_RUNGS))
@pytest.mark.parametrize("case", CASES, ids=lambda c: f"B{c[0]}H{c[1]}Hk{c[2]}-Lq{c[3]}-Lk{c[4]}-D{c[5]}-{c[6]}")
def test_numba_entry_matches_the_reference(rung, name, case):
    B, H, Hk, Lq, Lk, D, causal, padded = case
    if not _supported(rung, name, Hk, H, causal, Lq, Lk):
        pytest.skip("flash v0 refuses this case (test_flash_v0_refuses_what_it_predates)")
    if rung == "tiled" and name == "tile32" and not ON_GPU and D > 16:
        pytest.skip("a 32 x 32 tile is 1,024 simulated threads a block: one case is enough on the simulator")
    q, k, v, mask = _inputs(B, H, Hk, Lq, Lk, D, padded, seed=Lq + Lk)
    out, lse = table(rung)[name](q, k, v, causal=causal, key_padding_mask=mask)
    assert type(out) is type(q) and tuple(out.shape) == (B, H, Lq, D) and tuple(lse.shape) == (B, H, Lq)
    wb.check(f"{rung} {name}", out, q, k, v, lse=lse, causal=causal, key_padding_mask=mask, verbose=False)


def test_flash_v0_refuses_what_it_predates():
    q, k, v, _ = _inputs(1, 2, 1, 5, 7, 16, False, seed=3)
    with pytest.raises(ValueError, match="grouped-query"):
        table("flash")["v0"](q, k, v)
    q, k, v, _ = _inputs(1, 2, 2, 5, 7, 16, False, seed=3)
    with pytest.raises(ValueError, match="top-left"):
        table("flash")["v0"](q, k, v, causal="bottom_right")


def test_backward_on_cuda_cores_matches_the_reference():
    q, k, v, mask = _inputs(1, 2, 1, 9, 11, 16, True, seed=5)
    dout = _inputs(1, 2, 2, 9, 11, 16, False, seed=6)[0]
    out, lse = table("flash")["v7"](q, k, v, causal="bottom_right", key_padding_mask=mask)
    grads = table("backward")["cuda-cores"](q, k, v, out, lse, dout, causal="bottom_right", key_padding_mask=mask)
    assert all(type(g) is type(q) for g in grads)
    wb.check_gradients("backward cuda-cores", grads, q, k, v, dout, causal="bottom_right", key_padding_mask=mask,
                       verbose=False)


# ------------------------------------------------------------------------------------------- CUDA C++ rungs
def _variant_of(rung, name, D):
    if rung == "wmma":
        from wb_kernels.stages.wmma import build, versions

        return next(variant for variant in build.VARIANTS if versions.version_name(variant) == name), build.VARIANTS
    if rung == "mma":
        from wb_kernels.stages.mma import build, versions

        return versions.VARIANT_OF[name][D], build.VARIANTS
    from wb_kernels.stages.backward import build, launcher

    if name in launcher.VERSIONS:
        return launcher.DEFAULT_VARIANT[(name, D)], build.VARIANTS
    block_n = int(name.split("/")[1])
    return build.Variant("v2", D, 64 if D == 64 else 32, block_n), build.VARIANTS


@pytest.mark.parametrize("D", [64, 128])
@pytest.mark.parametrize("rung, name", entries(CUDA_RUNGS) + [p for p in entries(["backward"]) if p.id != "backward-cuda-cores"])
def test_cuda_entry_names_a_compiled_variant(rung, name, D):
    variant, compiled = _variant_of(rung, name, D)
    assert variant in compiled, f"{rung} {name} at D={D}: {variant} is not among build.VARIANTS, which nvcc compiles"


@needs_gpu
@pytest.mark.parametrize("D", [64, 128])
@pytest.mark.parametrize("rung, name", entries(CUDA_RUNGS))
def test_gpu_cuda_entry_matches_the_reference(rung, name, D):
    for dtype, causal, Hk in (("float16", True, 2), ("bfloat16", "bottom_right", 1)):
        q, k, v = wb.random_qkv(2, 2, 70, D, Lk=133, dtype=dtype, framework="torch", device="cuda", seed=D)
        k, v = k[:, :Hk].contiguous(), v[:, :Hk].contiguous()
        mask = wb.random_padding_mask(2, 133, seed=1, framework="torch", device="cuda")
        out, lse = table(rung)[name](q, k, v, causal=causal, key_padding_mask=mask)
        wb.check(f"{rung} {name} {dtype} D={D}", out, q, k, v, lse=lse, causal=causal, key_padding_mask=mask,
                 verbose=False)


@needs_gpu
@pytest.mark.parametrize("D", [64, 128])
@pytest.mark.parametrize("name", ["v1", "v2", "v2/64"])
def test_gpu_backward_entry_matches_the_reference(name, D):
    q, k, v = wb.random_qkv(1, 4, 70, D, Lk=133, dtype="float16", framework="torch", device="cuda", seed=D)
    k, v = k[:, :2].contiguous(), v[:, :2].contiguous()
    dout = wb.random_qkv(1, 4, 70, D, dtype="float16", framework="torch", device="cuda", seed=D + 1)[0]
    out, lse = table("mma")["v2"](q, k, v, causal=True)
    grads = table("backward")[name](q, k, v, out, lse, dout, causal=True)
    wb.check_gradients(f"backward {name} D={D}", grads, q, k, v, dout, causal=True, verbose=False)


@pytest.mark.skipif(not HOPPER, reason="the hopper rung's versions run on a Hopper GPU (sm_90)")
@pytest.mark.parametrize("name", list(table("hopper")))
def test_gpu_hopper_entry_matches_the_reference(name):
    q, k, v = wb.random_qkv(1, 2, 200, 128, Lk=300, dtype="float16", framework="torch", device="cuda", seed=4)
    out, lse = table("hopper")[name](q, k, v, causal=True, key_padding_mask=None, scale=128 ** -0.5)
    wb.check(f"hopper {name}", out, q, k, v, lse=lse, causal=True, verbose=False)
