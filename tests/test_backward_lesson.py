"""Lesson 08_backward's CPU side: the blockwise NumPy backward (wb_kernels/stages/backward/blockwise.py) against the
float64 reference's gradients, the figures and counts of its slider.py, and its region cells (every region of both
backward kernels shown in file order; the numba factory rebuilt from edited pieces, wb_kernels/region_cells.py). The
kernels have their own files (tests/test_backward.py, tests/test_backward_mma.py); the exercises and the puzzle are
in tests/test_exercises.py."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

import wb_kernels as wb
from wb_kernels.reference import reference, reference_backward
from wb_kernels.stages.backward import blockwise, slider


def _problem(B, H, Hk, Lq, Lk, D, seed):
    q, k, v = wb.random_qkv(B, H, Lq, D, Lk=Lk, dtype="float64", seed=seed)
    dout = np.random.default_rng(seed + 100).standard_normal(q.shape)
    return q, k[:, :Hk].copy(), v[:, :Hk].copy(), dout


CASES = [  # (B, H, Hk, Lq, Lk, D, causal, padded, block_m, block_n)
    (1, 2, 2, 37, 37, 16, False, False, 16, 16),
    (2, 4, 2, 29, 45, 8, "top_left", True, 8, 16),
    (2, 4, 1, 45, 29, 8, "bottom_right", True, 16, 8),  # Lq > Lk: the first rows see no key
    (1, 3, 3, 1, 7, 4, True, False, 4, 4),  # L = 1
    (1, 2, 1, 17, 17, 32, "bottom_right", False, 64, 64),  # one tile covers everything
]


@pytest.mark.parametrize("B, H, Hk, Lq, Lk, D, causal, padded, block_m, block_n", CASES)
def test_blockwise_backward_equals_the_reference(B, H, Hk, Lq, Lk, D, causal, padded, block_m, block_n):
    q, k, v, dout = _problem(B, H, Hk, Lq, Lk, D, seed=Lq + Lk)
    keep = None
    if padded:
        keep = np.ones((B, Lk), dtype=bool)
        keep[0, :5] = False  # rows early in batch 0 see no key under the causal mask
        keep[-1, :] = False  # the last batch sees no key at all
    out, lse = reference(q, k, v, causal=causal, key_padding_mask=keep, scale=0.7)
    grads = blockwise.blockwise_backward(q, k, v, out, lse, dout, causal=causal, key_padding_mask=keep, scale=0.7,
                                         block_m=block_m, block_n=block_n)
    refs = reference_backward(q, k, v, dout, causal=causal, key_padding_mask=keep, scale=0.7)
    for grad, ref in zip(grads, refs):
        assert grad.shape == ref.shape and np.isfinite(grad).all()
        assert np.abs(grad - ref).max() <= 1e-12 * max(1.0, np.abs(ref).max())
    if padded:
        assert not grads[0][-1].any() and not grads[1][-1].any() and not grads[2][-1].any()


def test_blockwise_backward_refuses_heads_that_do_not_group():
    q, k, v, dout = _problem(1, 3, 2, 8, 8, 4, seed=1)
    with pytest.raises(ValueError, match="do not divide"):
        blockwise.blockwise_backward(q, k, v, q, np.zeros((1, 3, 8)), dout)


def test_row_dot_is_the_softmax_jacobians_row_sum():
    q, k, v, dout = _problem(1, 1, 1, 9, 13, 8, seed=2)
    out, _ = reference(q, k, v)
    scores = np.einsum("bhqd,bhkd->bhqk", q, k) / np.sqrt(8)
    probs = wb.safe_softmax(scores)
    dprobs = np.einsum("bhqd,bhkd->bhqk", dout, v)
    assert np.allclose(blockwise.row_dot(dout, out), (probs * dprobs).sum(-1), rtol=0, atol=1e-13)
    row = 3  # the softmax's Jacobian written out for one row, against the formula
    p = probs[0, 0, row]
    jacobian = np.diag(p) - np.outer(p, p)
    assert np.allclose(jacobian.T @ dprobs[0, 0, row], blockwise.softmax_backward(probs, dprobs)[0, 0, row],
                       rtol=0, atol=1e-14)


def test_recompute_probs_gives_zero_not_nan_for_a_row_without_keys():
    scores = np.array([[1.0, 2.0], [3.0, 4.0]])
    allowed = np.array([[True, False], [False, False]])
    lse = np.array([1.0, -np.inf])
    probs = blockwise.recompute_probs(scores, lse, allowed)
    assert probs[0, 0] == 1.0 and not probs[0, 1] and not probs[1].any()


def test_tile_pairs_skip_tiles_the_mask_hides():
    allowed = wb.attention_mask(32, 32, "top_left")[0, 0]
    assert len(blockwise.tile_pairs(32, 32, 16, 16)) == 4
    assert blockwise.tile_pairs(32, 32, 16, 16, allowed) == [(0, 0), (16, 0), (16, 16)]


def test_saved_bytes_and_the_memory_figure():
    assert slider.saved_bytes("P", 1024, B=1, H=1, dtype_bytes=2) == 2 * 1024**2
    assert slider.saved_bytes("O+LSE", 1024, B=1, H=1, D=64, dtype_bytes=2) == 1024 * (64 * 2 + 4)
    ratio = [slider.saved_bytes("P", L) / slider.saved_bytes("O+LSE", L) for L in (1024, 2048)]
    assert ratio[1] == pytest.approx(2 * ratio[0])  # quadratic over linear
    with pytest.raises(ValueError, match="keep"):
        slider.saved_bytes("S", 8)
    fig = slider.draw_memory(4096)
    assert len(fig.axes[0].lines) >= 2


def test_flop_counts_and_mma_counts():
    assert slider.flop_ratio("backward (one kernel, atomic dQ)") == 2.5
    assert slider.flop_ratio("backward (two kernels, deterministic)") == 3.5
    assert slider.matmul_flops("forward", B=2, H=3, Lq=5, Lk=7, D=11) == 2 * 2 * 2 * 3 * 5 * 7 * 11
    assert slider.mma_count(64, 32, 128) == 4 * 4 * 8
    tile = slider.mma_per_tile("dkdv", block_m=32, block_n=64, D=128)
    assert sorted(tile.values()) == [128] * 4  # each product is 64 x 32 x 128 multiply-adds
    assert sum(slider.mma_per_tile("dq", block_m=64, block_n=64, D=64).values()) == 3 * 4 * 8 * 4
    with pytest.raises(ValueError, match="m16n8k16"):
        slider.mma_count(8, 8, 16)
    with pytest.raises(ValueError, match="kernel"):
        slider.mma_per_tile("dv", block_m=16, block_n=16, D=16)


@pytest.mark.parametrize("causal", [False, "top_left", "bottom_right"])
def test_owner_maps_cover_each_pair_once_and_match_the_mask(causal):
    Lq, Lk, bm, bn = 40, 24, 16, 8
    dkdv = slider.owner_map("dkdv", Lq, Lk, bm, bn, causal)
    dq = slider.owner_map("dq", Lq, Lk, bm, bn, causal)
    assert ((dkdv < 0) == (dq < 0)).all()  # both kernels skip the same pairs
    columns = np.broadcast_to(np.arange(dkdv.shape[1]), dkdv.shape)
    rows = np.broadcast_to(np.arange(dq.shape[0])[:, None], dq.shape)
    assert (dkdv[dkdv >= 0] == columns[dkdv >= 0]).all() and (dq[dq >= 0] == rows[dq >= 0]).all()
    allowed = wb.attention_mask(Lq, Lk, causal)[0, 0]
    for i in range(dq.shape[0]):
        for j in range(dq.shape[1]):
            assert (dq[i, j] >= 0) == allowed[i * bm:(i + 1) * bm, j * bn:(j + 1) * bn].any()
    fig = slider.draw_schedule(Lq, Lk, block_m=bm, block_n=bn, causal=causal)
    assert len(fig.axes) == 2


# --- the lesson's region cells: every region of both backward kernels, the numba factory rebuilt from them ----------

REPO = Path(__file__).resolve().parent.parent
LESSON = REPO / "notebooks" / "08_backward.ipynb"
NUMBA_FILE = "wb_kernels/stages/backward/cuda_cores.py"


@pytest.mark.parametrize("file", [NUMBA_FILE, "wb_kernels/stages/backward/flash_backward.cu"])
def test_the_lesson_shows_every_region_of_the_kernels_in_file_order(file):
    from wb_kernels.lesson_sync import module_regions, notebook_regions

    shown = [name for name, module, _ in notebook_regions(LESSON) if module == file]
    assert shown == list(module_regions(REPO / file)), "show every region once, in the file's order"


def test_the_backward_pieces_rebuild_the_package_factory():
    import inspect

    from wb_kernels import region_cells
    from wb_kernels.stages.backward import cuda_cores
    from wb_kernels.lesson_sync import module_regions

    function, pieces = region_cells.PIECES[NUMBA_FILE]
    assert [name for name in module_regions(REPO / NUMBA_FILE) if name in pieces] == list(pieces)
    rebuilt = region_cells.assemble(NUMBA_FILE)
    assert inspect.getsource(rebuilt) == inspect.getsource(getattr(cuda_cores, function))


def test_an_edited_backward_piece_is_what_the_launcher_runs(monkeypatch, capsys):
    from wb_kernels import region_cells
    from wb_kernels.stages.backward import cuda_cores
    from wb_kernels.lesson_sync import module_regions

    shipped = module_regions(REPO / NUMBA_FILE)["backward_dkdv_accumulate"]
    edited = shipped.replace("acc_dv[i, dd] += p_reg[i]", "acc_dv[i, dd] += 2 * p_reg[i]")
    assert edited != shipped
    namespace = {}
    # the lesson defines its own get_kernels from the rebuilt factory; here the module's is patched the same way
    monkeypatch.setattr(cuda_cores, "get_kernels", lambda D, config: namespace["make_backward_kernels"](D, config))
    q, k, v = wb.random_qkv(1, 2, 13, 16, Lk=11, seed=5)
    k, v = k[:, :1].copy(), v[:, :1].copy()  # GQA
    dout = np.random.default_rng(6).standard_normal(q.shape).astype(np.float32)
    out, lse = wb.attention(q, k, v, stage="flash", causal="bottom_right", return_lse=True)

    def gradients_pass():
        grads = cuda_cores.flash_gradients(q, k, v, out, lse, dout, causal="bottom_right")
        return wb.check_gradients("flash", grads, q, k, v, dout, causal="bottom_right", verbose=False,
                                  raise_on_failure=False).passed

    try:
        region_cells.record_piece(NUMBA_FILE, "backward_dkdv_accumulate", edited, namespace)
        assert "edited (1 line(s) differ" in capsys.readouterr().out
        assert region_cells.edited_pieces() == [(NUMBA_FILE, "backward_dkdv_accumulate")]
        assert not gradients_pass()
        region_cells.record_piece(NUMBA_FILE, "backward_dkdv_accumulate", shipped, namespace)
        assert "as in" in capsys.readouterr().out
        assert gradients_pass()
    finally:
        region_cells.reset()
    with pytest.raises(KeyError, match="not a piece"):
        region_cells.record_piece(NUMBA_FILE, "backward_launch", "")


def _lesson_cells():
    import json

    lesson = Path(__file__).resolve().parent.parent / "notebooks" / "08_backward.ipynb"
    return [(c["cell_type"], "".join(c["source"])) for c in json.loads(lesson.read_text())["cells"]]


def test_the_determinism_prose_names_the_cell_that_prints_it():
    """'Two runs may differ in the last bits' points at the cell that prints whether they did: the check cell, which
    comes before the timing cell (it once said "the cell above", the timings), and claims no gain the timings may
    not show."""
    cells = _lesson_cells()
    prose = next(i for i, (kind, text) in enumerate(cells) if text.startswith("**Determinism against speed.**"))
    code_above = [text for kind, text in cells[:prose] if kind == "code"]
    timings, check = code_above[-1], code_above[-2]
    assert "time_call" in timings and "same bits twice" in check and "same bits twice" not in timings
    text = cells[prose][1]
    assert "check cell before the timings" in " ".join(text.split()) and "cell above prints" not in text
    assert "shows v2 gains" not in " ".join(text.split())


def test_the_puzzle_comes_before_the_packages_tile_step():
    cells = _lesson_cells()
    puzzle = next(i for i, (kind, text) in enumerate(cells) if "check_tile_step_puzzle(my_backward_tile_step)" in text)
    region = next(i for i, (kind, text) in enumerate(cells) if text.startswith("# region: backward_tile_step"))
    assert puzzle < region
