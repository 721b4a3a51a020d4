"""Rung mma (in progress): the NumPy model of mma.sync's register layouts, against plain matrix products."""

from __future__ import annotations

import numpy as np
import pytest

from wb_kernels.stages.mma import fragments as fr

rng = np.random.default_rng(0)


@pytest.mark.parametrize("coords, shape", [(fr.a_coords, (16, 16)), (fr.b_coords, (16, 8)), (fr.c_coords, (16, 8))])
def test_every_element_is_held_by_exactly_one_register(coords, shape):
    held = [rc for lane in range(32) for rc in coords(lane)]
    assert sorted(held) == [(r, c) for r in range(shape[0]) for c in range(shape[1])]


def test_the_model_multiplies_like_numpy():
    a, b, c = rng.standard_normal((16, 16)), rng.standard_normal((16, 8)), rng.standard_normal((16, 8))
    d = fr.mma_m16n8k16(fr.distribute(a, fr.a_coords), fr.distribute(b, fr.b_coords), fr.distribute(c, fr.c_coords))
    np.testing.assert_allclose(fr.gather(d, fr.c_coords, (16, 8)), a @ b + c, rtol=1e-12)


def test_a_row_of_the_accumulator_lives_in_one_group_of_four_lanes():
    """So a row's max (or sum) is two shuffles: xor 1 and xor 2 within the group."""
    for row in range(16):
        lanes = {lane for lane in range(32) for r, _ in fr.c_coords(lane) if r == row}
        assert len(lanes) == 4 and len({lane // 4 for lane in lanes}) == 1
        assert {lane ^ 1 for lane in lanes} == lanes and {lane ^ 2 for lane in lanes} == lanes


def test_ldmatrix_x4_delivers_the_a_fragment():
    tile = rng.standard_normal((16, 16))
    np.testing.assert_array_equal(fr.ldmatrix_x4(tile), fr.distribute(tile, fr.a_coords))


def test_the_accumulator_of_s_is_the_a_operand_of_p_v():
    """S (16 x 16) is two 16 x 8 mma results; their C fragments, side by side in each lane, are exactly the A
    fragment of the 16 x 16 tile: P = f(S) elementwise can feed the next mma without leaving registers."""
    s = rng.standard_normal((16, 16))
    left, right = fr.distribute(s[:, :8], fr.c_coords), fr.distribute(s[:, 8:], fr.c_coords)
    np.testing.assert_array_equal(fr.accumulator_as_a_operand(left, right), fr.distribute(s, fr.a_coords))
    # and the product with V, from those registers, is P V
    p = np.exp(s - s.max(axis=1, keepdims=True))
    v = rng.standard_normal((16, 8))
    pv = fr.mma_m16n8k16(fr.distribute(p, fr.a_coords), fr.distribute(v, fr.b_coords), np.zeros((32, 4)))
    np.testing.assert_allclose(fr.gather(pv, fr.c_coords, (16, 8)), p @ v, rtol=1e-12)
