"""Stage 04 (lesson 04): the numba FlashAttention kernel, its NumPy derivation and its slider logic.

On the simulator the kernels run with small tiles and small sizes; the GPU tests (skipped on the
simulator) use the tuned tiles, large sizes, peak memory and L = 65536.
"""

from __future__ import annotations

import json
import math
import os
import re
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

import wb_kernels as wb
from wb_kernels.stages.flash import kernel as fc
from wb_kernels.stages.flash import online_softmax as osm
from wb_kernels.stages.flash import slider as flash_widgets

REPO = Path(__file__).resolve().parent.parent
gpu_only = pytest.mark.skipif(not wb.BACKEND.is_gpu, reason="needs a CUDA GPU (runs on the numba simulator here)")


def run_and_check(B, H, Lq, D, *, Lk=None, causal=False, mask=None, seed=0, std=1.0, Hk=None, **kwargs):
    framework = "torch" if wb.BACKEND.is_gpu else "numpy"
    device = "cuda" if wb.BACKEND.is_gpu else None
    q, k, v = wb.random_qkv(B, H, Lq, D, Lk=Lk, seed=seed, std=std, framework=framework, device=device)
    if Hk is not None:  # grouped-query attention: Hk key/value heads, each read by H // Hk query heads
        k, v = (x[:, :Hk].contiguous() if framework == "torch" else np.ascontiguousarray(x[:, :Hk]) for x in (k, v))
    if mask is not None and wb.BACKEND.is_gpu:
        import torch

        mask = torch.from_numpy(mask).cuda()
    out, lse = fc.flash_forward(q, k, v, causal=causal, key_padding_mask=mask, **kwargs)
    # Where every row sees at most one key, LSE is that key's score alone and PyTorch's own error can be
    # ~0 by luck, leaving a tolerance below the rounding of a float32 dot product: bound LSE by that instead.
    single_key = (Lk or Lq) == 1 or (causal in (True, "top_left") and Lq == 1)
    result = wb.check(f"flash B{B} H{H} Lq{Lq} Lk{Lk or Lq} D{D}", out, q, k, v, lse=None if single_key else lse,
                      causal=causal, key_padding_mask=mask)
    assert result.passed
    if single_key:
        q64, k64 = (np.asarray(wb.device.like_input(x, np.zeros(1)), dtype=np.float64) for x in (q, k))
        k64 = np.repeat(k64, H // k64.shape[1], axis=1)  # GQA: each key head serves H // Hk query heads
        scale = kwargs.get("scale") or 1 / math.sqrt(D)
        ref_lse = wb.reference(q, k, v, causal=causal, key_padding_mask=mask)[1]
        bound = 2 * D * np.finfo(np.float32).eps * scale * (np.abs(q64[..., :, None, :]) * np.abs(k64[..., None, :1, :])).sum(-1)[..., 0]
        lse64 = np.asarray(wb.device.like_input(lse, np.zeros(1)), dtype=np.float64)
        assert np.all(np.abs(lse64 - ref_lse) <= bound + 1e-12)
    return out, lse


# --- the kernel on the simulator (or the GPU): shapes, masks, edge cases -------------------------

@pytest.mark.parametrize("D, L", [(16, 37), (32, 33), (64, 21), (128, 9)])
def test_each_head_dim_odd_length(D, L):
    run_and_check(1, 2, L, D, seed=D)


@pytest.mark.parametrize("Lq, Lk", [(29, 45), (45, 29), (1, 1), (1, 40), (17, 1)])
@pytest.mark.parametrize("causal", [False, True])
def test_lq_differs_from_lk(Lq, Lk, causal):
    run_and_check(1, 1, Lq, 16, Lk=Lk, causal=causal, seed=Lq + Lk)


@pytest.mark.parametrize("H, Hk, Lq, Lk, causal", [
    (4, 2, 9, 40, "bottom_right"),  # decoding-like: a few queries after many cached keys
    (2, 1, 40, 9, "bottom_right"),  # Lq > Lk: rows 0-30 see no key, the first two 16-row blocks none at all
    (3, 1, 33, 33, "bottom_right"),  # Lq = Lk: the same mask as top-left
    (4, 2, 21, 30, "top_left"),
    (4, 4, 17, 21, "bottom_right"),
    (4, 2, 1, 20, True),  # one query, top-left causal: it sees key 0 alone (the single-key LSE bound, grouped)
])
def test_gqa_and_bottom_right(H, Hk, Lq, Lk, causal):
    mask = wb.random_padding_mask(1, Lk, seed=Lk)
    run_and_check(1, H, Lq, 16, Lk=Lk, Hk=Hk, causal=causal, mask=mask, seed=Lq * 3 + Lk)


def test_causal_and_padding_together():
    mask = wb.random_padding_mask(2, 40, seed=4)
    run_and_check(2, 1, 40, 32, causal=True, mask=mask, seed=5)


def test_fully_masked_rows_give_zero_and_minus_inf_lse():
    # batch 0 keeps keys 5.., so under the causal mask rows 0-4 see nothing; batch 1 keeps no key at all
    mask = np.ones((2, 24), dtype=bool)
    mask[0, :5] = False
    mask[1, :] = False
    out, lse = run_and_check(2, 1, 24, 16, causal=True, mask=mask, seed=6)
    out, lse = np.asarray(wb.device.like_input(out, np.zeros(1))), np.asarray(wb.device.like_input(lse, np.zeros(1)))
    assert not np.isnan(out).any() and not np.isnan(lse).any()
    assert np.all(out[0, :, :5] == 0) and np.all(np.isneginf(lse[0, :, :5]))
    assert np.all(out[1] == 0) and np.all(np.isneginf(lse[1]))
    assert np.all(np.isfinite(lse[0, :, 5:]))


def test_large_logits_do_not_overflow():
    run_and_check(1, 1, 33, 32, std=12.0, seed=7)


def test_custom_scale():
    framework = "torch" if wb.BACKEND.is_gpu else "numpy"
    q, k, v = wb.random_qkv(1, 1, 20, 16, seed=8, framework=framework, device="cuda" if wb.BACKEND.is_gpu else None)
    out, lse = fc.flash_forward(q, k, v, scale=0.3)
    assert wb.check("flash scale=0.3", out, q, k, v, lse=lse, scale=0.3).passed


def test_through_the_public_api_returns_the_callers_kind():
    q, k, v = wb.random_qkv(1, 1, 18, 16, seed=9)
    out, lse = wb.attention(q, k, v, stage="flash", causal=True, return_lse=True)
    assert isinstance(out, np.ndarray) and out.dtype == np.float32 and lse.shape == (1, 1, 18)
    wb.check("flash via api", out, q, k, v, lse=lse, causal=True)


def test_a_lesson_can_pass_its_own_kernel():
    config = fc.FlashConfig(block_m=8, block_n=8, rows_per_thread=2, threads_per_row=4)
    kernel = fc.make_flash_kernel(16, config)
    run_and_check(1, 1, 19, 16, causal=True, config=config, kernel=kernel, seed=10)


def test_the_gpu_tile_shape_on_the_simulator():
    """The tuned GPU tiles run the same code with other constants: check one of them here too."""
    D = 64
    config = fc.GPU_CONFIGS[D]
    run_and_check(1, 1, config.block_m + 3, D, Lk=config.block_n + 5, causal=True,
                  mask=np.arange(config.block_n + 5)[None, :] < config.block_n, config=config, seed=11)


def test_bad_configs_are_refused_with_a_reason():
    with pytest.raises(ValueError, match="multiple of rows_per_thread"):
        fc.FlashConfig(block_m=10, block_n=16, rows_per_thread=4, threads_per_row=4).validate(16)
    with pytest.raises(ValueError, match="power of two"):
        fc.FlashConfig().validate(48)


def test_stage_is_registered_with_linear_memory():
    stage = wb.get_stage("flash")
    assert stage.order == 4 and stage.linear_memory and stage.lesson == "04_flash"
    assert stage.workspace_bytes(2, 3, 100, 50, 64) == 4 * 2 * 3 * 100 * (64 + 1)  # O + LSE, no Lk term


def test_shared_memory_layout_has_no_bank_conflicts():
    """Within one warp, the addresses each shared-memory instruction touches fall in distinct banks
    (lanes reading the same word are a broadcast and count once)."""
    for D, config in [(64, fc.FlashConfig(64, 64, 4, 8)), (128, fc.FlashConfig(64, 32, 4, 8)),
                      (64, fc.FlashConfig(64, 64, 4, 16))]:
        lay = fc.shared_layout(D, config)
        rg_count = config.block_m // config.rows_per_thread
        tpr = config.threads_per_row
        lanes = range(32)

        def conflict_free(addresses):
            words = set(addresses)
            return len({a % 32 for a in words}) == len(words)

        g = [lane // tpr for lane in lanes]
        c = [lane % tpr for lane in lanes]
        for i in range(config.rows_per_thread):  # Q^T reads, P writes and P reads
            assert conflict_free([lay["q_off"] + 5 * lay["q_stride"] + g[x] + rg_count * i for x in lanes])
            assert conflict_free([lay["p_off"] + (g[x] + rg_count * i) * lay["p_stride"] + c[x] for x in lanes])
            assert conflict_free([lay["p_off"] + (g[x] + rg_count * i) * lay["p_stride"] + 7 for x in lanes])
        assert conflict_free([lay["kv_off"] + 3 * lay["k_stride"] + c[x] for x in lanes])  # K^T reads
        assert conflict_free([lay["kv_off"] + x * lay["k_stride"] for x in lanes])  # transposing K stores
        assert lay["bytes"] == 4 * lay["words"]


# --- compiled for the GPU without a GPU: PTX for sm_80 and sm_90, registers and spills -----------

PTX_SCRIPT = textwrap.dedent("""
    import json, sys
    import wb_kernels
    from numba import cuda
    from wb_kernels.stages.flash import kernel as fc
    found = []
    for D, config in sorted(fc.GPU_CONFIGS.items()):
        kernel = fc.make_flash_kernel(D, config)
        for cc in ((8, 0), (9, 0)):
            ptx, _ = cuda.compile_ptx(kernel.py_func, fc.kernel_signature(D), cc=cc, fastmath=True,
                                      launch_bounds=kernel.targetoptions.get("launch_bounds"))
            found.append(dict(D=D, cc=cc, ptx=ptx))
    json.dump(found, sys.stdout)
""")


def _ptxas(ptx: str, cc) -> str:
    """ptxas -v output; an older ptxas than the PTX's version gets the version it supports."""
    ptxas = shutil.which("ptxas")
    arch = f"-arch=sm_{cc[0]}{cc[1]}"
    for _ in range(2):
        done = subprocess.run([ptxas, arch, "-v", "-o", os.devnull, "-"], input=ptx, capture_output=True, text=True)
        supported = re.search(r"current version is '(\d+\.\d+)'", done.stderr)
        if done.returncode == 0 or not supported:
            break
        ptx = re.sub(r"^\.version \d+\.\d+", f".version {supported.group(1)}", ptx, flags=re.M)
    assert done.returncode == 0, done.stderr
    return done.stderr


@pytest.fixture(scope="module")
def compiled_ptx():
    env = dict(os.environ, WB_BACKEND="compile-only", NUMBA_ENABLE_CUDASIM="0")
    done = subprocess.run([sys.executable, "-c", PTX_SCRIPT], capture_output=True, text=True, env=env, cwd=REPO,
                          timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout)


def test_kernel_compiles_to_ptx_for_sm80_and_sm90(compiled_ptx):
    assert {(entry["D"], tuple(entry["cc"])) for entry in compiled_ptx} >= {(64, (8, 0)), (128, (9, 0))}
    for entry in compiled_ptx:
        ptx = entry["ptx"]
        assert "ex2.approx" in ptx  # exp2 with log2(e) folded into the scale: one MUFU instruction
        assert "bar.sync" in ptx
        assert "shfl" not in ptx  # no warp shuffles: the same code runs on the simulator
        # float64 only in the once-per-row LSE epilogue: the loops' multiply-adds are float32
        assert ptx.count("fma.rn.ftz.f32") >= 64 and "fma.rn.f64" not in ptx.split("bar.sync")[1]


@pytest.mark.skipif(shutil.which("ptxas") is None, reason="ptxas (CUDA toolkit) not installed")
def test_tuned_kernels_do_not_spill(compiled_ptx):
    for entry in compiled_ptx:
        report = _ptxas(entry["ptx"], entry["cc"])
        spills = [int(x) for x in re.findall(r"(\d+) bytes spill (?:stores|loads)", report)]
        registers = int(re.search(r"Used (\d+) registers", report).group(1))
        assert spills and max(spills) == 0, f"D={entry['D']} cc={entry['cc']} spills: {report}"
        assert registers <= 255


# --- the NumPy derivation (wb_kernels.stages.flash.online_softmax) --------------------------------------------

def test_online_softmax_matches_two_pass():
    x = np.random.default_rng(0).standard_normal(50) * 30
    m, l, history = osm.online_max_sum(x)
    assert math.isclose(m, x.max()) and math.isclose(l, np.exp(x - x.max()).sum(), rel_tol=1e-12)
    np.testing.assert_allclose(osm.two_pass_softmax(x), wb.safe_softmax(x), rtol=1e-12)
    assert len(history["m"]) == 50 and history["m"][-1] == m


def test_blockwise_attention_is_exact_and_records_statistics():
    q, k, v = wb.random_qkv(1, 1, 13, 8, Lk=37, seed=3)
    mask = np.arange(37) < 30
    out, lse, history = osm.blockwise_attention(q[0, 0], k[0, 0], v[0, 0], block_n=8, causal=True, key_mask=mask)
    ref_out, ref_lse = wb.reference(q, k, v, causal=True, key_padding_mask=mask[None])
    np.testing.assert_allclose(out, ref_out[0, 0], atol=1e-12)
    np.testing.assert_allclose(lse, ref_lse[0, 0], atol=1e-12)
    assert len(history) == math.ceil(37 / 8) and history[0]["m"].shape == (13,)
    assert np.all(np.diff(np.stack([h["m"] for h in history]), axis=0) >= 0)  # the running max never falls


# --- slider logic (wb_kernels.stages.flash.slider) --------------------------------------------------

def test_memory_model_naive_quadratic_flash_linear():
    naive = flash_widgets.memory_bytes("naive", 4096, B=1, H=16, D=64)
    flash = flash_widgets.memory_bytes("flash", 4096, B=1, H=16, D=64)
    assert flash == wb.get_stage("flash").workspace_bytes(1, 16, 4096, 4096, 64)
    assert naive > 16 * flash
    assert flash_widgets.memory_bytes("flash", 8192, B=1, H=16, D=64) == pytest.approx(2 * flash, rel=1e-9)
    fig = flash_widgets.draw_memory(2048)
    assert len(fig.axes) >= 1


def test_tile_schedule_skips_the_upper_triangle():
    steps = flash_widgets.tile_schedule(Lq=64, Lk=64, block_m=16, block_n=16, causal=True)
    computed = [s for s in steps if not s["skipped"]]
    assert len(steps) == 16 and len(computed) == 10  # 4 + 3 + 2 + 1 tiles saved
    work = flash_widgets.causal_work(64, 64, 16, 16)
    assert work["computed"] == 10 and work["total"] == 16


def test_step_through_figure_for_every_step():
    q, k, v = wb.random_qkv(1, 1, 32, 16, seed=1)
    n = flash_widgets.step_count(32, 32, 16, 8, causal=True)
    for step in (0, n - 1):
        fig = flash_widgets.draw_tile_step(step, q=q[0, 0], k=k[0, 0], v=v[0, 0], block_m=16, block_n=8, causal=True)
        assert len(fig.axes) >= 2


# --- GPU only: tuned tiles, large sizes, memory, L = 65536 --------------------------------------

@gpu_only
@pytest.mark.parametrize("D", [64, 128])
@pytest.mark.parametrize("causal", [False, True])
def test_gpu_large_shapes(D, causal):
    run_and_check(2, 4, 1000, D, Lk=1537, causal=causal, seed=D)
    mask = wb.random_padding_mask(2, 777, seed=2)
    run_and_check(2, 3, 777, D, causal=causal, mask=mask, seed=D + 1)


@gpu_only
@pytest.mark.parametrize("D", [64, 128])
@pytest.mark.parametrize("H, Hk, Lq, Lk", [(8, 2, 1, 1537), (8, 1, 257, 1000), (4, 2, 1000, 333), (6, 3, 777, 777)])
def test_gpu_gqa_and_bottom_right(D, H, Hk, Lq, Lk):
    """Several tiles of GPU_CONFIGS' sizes: the bottom-right diagonal crosses some, skips others (and with
    Lq > Lk whole query blocks see no key); K/V heads read in place by H // Hk query heads."""
    mask = wb.random_padding_mask(2, Lk, seed=Lk)
    run_and_check(2, H, Lq, D, Lk=Lk, Hk=Hk, causal="bottom_right", mask=mask, seed=D + Lq)
    run_and_check(1, H, Lq, D, Lk=Lk, Hk=Hk, causal=True, seed=D + Lk)


@gpu_only
@pytest.mark.parametrize("D", [16, 32])
def test_gpu_small_head_dims(D):
    run_and_check(1, 4, 513, D, causal=True, seed=D)


@gpu_only
def test_gpu_peak_memory_is_o_plus_lse():
    B, H, L, D = 1, 16, 4096, 64
    q, k, v = wb.random_qkv(B, H, L, D, framework="torch", device="cuda")
    fc.flash_forward(q, k, v)  # compile first: numba's own allocations are not the kernel's
    _, use = wb.peak_memory(fc.flash_forward, q, k, v)
    expected = fc.STAGE.workspace_bytes(B, H, L, L, D)
    assert abs(use.peak_bytes - expected) <= 0.05 * expected, (use.peak_bytes, expected)


@gpu_only
def test_gpu_runs_at_65536_where_naive_cannot_allocate():
    import torch

    B, H, L, D = 1, 8, 65536, 64  # naive would need 2 * 4 * 8 * 65536^2 bytes = 275 GB for S and P
    q, k, v = wb.random_qkv(B, H, L, D, framework="torch", device="cuda", seed=3)
    with pytest.raises(MemoryError):
        wb.validate(q, k, v, stage="naive")
    out, lse = fc.flash_forward(q, k, v, causal=True)
    rows = torch.tensor([0, 1, 4097, L - 1], device="cuda")
    qs, kd, vd = q[:, :, rows].double(), k.double(), v.double()
    s = (qs @ kd.transpose(-1, -2)) / math.sqrt(D)
    s = s.masked_fill(torch.arange(L, device="cuda")[None, None, None, :] > rows[None, None, :, None], float("-inf"))
    ref = torch.softmax(s, dim=-1) @ vd
    assert torch.isfinite(out).all()
    assert (out[:, :, rows].double() - ref).abs().max().item() < 1e-4
    assert (lse[:, :, rows].double() - torch.logsumexp(s, dim=-1)).abs().max().item() < 1e-4


def test_register_blocking_owners_match_the_kernel():
    """Each thread owns TM rows x block_n/TPR keys of S, rows strided by the number of row groups, keys by TPR."""
    config = fc.SIMULATOR_CONFIG
    owner = flash_widgets.owners(config.block_m, config.block_n, config.rows_per_thread, config.threads_per_row)
    counts = np.bincount(owner.ravel(), minlength=config.threads)
    assert set(counts) == {config.rows_per_thread * config.block_n // config.threads_per_row}
    rows, cols = np.nonzero(owner == 5)
    row_groups = config.block_m // config.rows_per_thread
    assert set(np.diff(np.unique(rows))) == {row_groups} and set(np.diff(np.unique(cols))) == {config.threads_per_row}
    assert len(flash_widgets.draw_register_blocking(config, 32).axes) == 2


# --- the lesson's region cells and the puzzle's problem ------------------------------------------------------

def test_region_pieces_rebuild_the_package_factories():
    import inspect

    from wb_kernels.stages.flash import one_row_per_thread, region_cells
    from wb_kernels.lesson_sync import module_regions

    for file, (function, pieces) in region_cells.PIECES.items():
        assert [name for name in module_regions(REPO / file) if name in pieces] == list(pieces), file
        rebuilt = region_cells.assemble(file)
        module = fc if file.endswith("kernel.py") else one_row_per_thread
        assert inspect.getsource(rebuilt) == inspect.getsource(getattr(module, function))


def test_an_edited_piece_is_what_the_lesson_builds(capsys):
    from wb_kernels.stages.flash import region_cells
    from wb_kernels.lesson_sync import module_regions

    file = "wb_kernels/stages/flash/kernel.py"
    shipped = module_regions(REPO / file)["flash_pv"]
    namespace = {}
    try:
        region_cells.record_piece(file, "flash_pv", shipped.replace("+= a_reg[i] * b_reg[dd]", "+= 2 * a_reg[i] * b_reg[dd]"),
                                  namespace)
        assert "edited (1 line(s) differ" in capsys.readouterr().out
        q, k, v = wb.random_qkv(1, 1, 20, 32, seed=1)
        config = fc.config_for(32)
        out, lse = fc.flash_forward(q, k, v, config=config, kernel=namespace["make_flash_kernel"](32, config))
        assert not wb.check("edited", out, q, k, v, lse=lse, verbose=False, raise_on_failure=False).passed
        region_cells.record_piece(file, "flash_pv", shipped, namespace)
        assert "as in" in capsys.readouterr().out
        out, lse = fc.flash_forward(q, k, v, config=config, kernel=namespace["make_flash_kernel"](32, config))
        assert wb.check("shipped", out, q, k, v, lse=lse, verbose=False).passed
    finally:
        region_cells.reset()


def test_the_puzzle_problem_shows_every_mistake_it_is_meant_to():
    from wb_kernels.stages.flash import exercises

    q, k, v, keep = exercises.puzzle_problem()
    block = exercises.PUZZLE_BLOCK
    scores = q[0, 0] @ k[0, 0].T / 4
    visible = (np.arange(k.shape[2])[None, :] <= np.arange(q.shape[2])[:, None]) & keep[None, :]
    assert not visible[:block].any()  # rows 0..7 see no key (their max stays -inf)
    assert not visible[:, :block].any() and visible[block:].any(axis=1).all()  # the others start in block 2
    assert np.abs(scores[visible]).min() > 710  # exp overflows (or underflows to 0) in float64 without the max
    # rows that first see a key in a later block with every score far below 0: a max of 0 carried there (the
    # guarded stand-in returned as m) underflows each of their terms to 0
    negative = [row for row in range(block, q.shape[2]) if scores[row][visible[row]].max() < -710]
    assert len(negative) >= 5
    _, _, history = osm.blockwise_attention(q[0, 0], k[0, 0], v[0, 0], block_n=block, causal=True, key_mask=keep)
    first_max = np.full(q.shape[2], np.nan)  # each row's max after the first block in which it sees a key
    for entry in history:
        new = np.isnan(first_max) & np.isfinite(entry["m"])
        first_max[new] = entry["m"][new]
    moved = np.isfinite(first_max) & (history[-1]["m"] > first_max)
    assert moved.sum() >= 5  # a later block holds a larger score than the first for these rows
