"""Issue #29: every forward launcher puts the (batch, head) pairs in gridDim.x, the one grid dimension CUDA lets grow
past 65,535 blocks (to 2**31 - 1), so a large batch of short sequences runs.

On a GPU: every forward stage at B*H = 140,000 (B = 70,000, H = 2, one K/V head, L = 3), with a causal mask and key
padding (the last sequence sees no key), held to the float64 reference on sampled sequences; decode also through
``wb.decode`` (the CUDA C++ kernel, B*Hk = 70,000). On the CPU: the grids the launchers build (bh in x), the CUDA C++
sources' grids, and the refusal of a length whose blocks would pass y's or z's 65,535.
"""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pytest

import wb_kernels as wb
from wb_kernels.stages.naive import kernel as naive
from wb_kernels.stages.tiled.kernel import tiled_forward
from stage_cases import head_dim

STAGES_DIR = Path(wb.__file__).parent / "stages"
BIG_B, H, HK, L = 70_000, 2, 1, 3  # B*H = 140,000 and B*Hk = 70,000: both past gridDim.y's 65,535
FORWARD_STAGES = [name for name in wb.available_stages() if name != "reference"]  # reference: NumPy, no grid

gpu_only = pytest.mark.skipif(not wb.BACKEND.is_gpu, reason="B*H = 140,000 needs a CUDA GPU: on the numba simulator "
                                                            "it would start ~10^7 Python threads")


def _sample(B: int, count: int = 48, seed: int = 0) -> np.ndarray:
    """Sequences to compare: the first, the last (the largest block index) and some between."""
    rng = np.random.default_rng(seed)
    return np.unique(np.concatenate([[0, 1, B // 2, B - 2, B - 1], rng.integers(0, B, count)]))


# --- on a GPU --------------------------------------------------------------------------------------------------

@gpu_only
@pytest.mark.parametrize("name", FORWARD_STAGES)
def test_large_batch_of_short_sequences(name):
    import torch

    stage = wb.get_stage(name)
    dtype = "float32" if "float32" in stage.dtypes else "float16"
    D = head_dim(stage, 64)
    q, _, _ = wb.random_qkv(BIG_B, H, L, D, dtype=dtype, framework="torch", device="cuda", seed=1)
    _, k, v = wb.random_qkv(BIG_B, HK, L, D, dtype=dtype, framework="torch", device="cuda", seed=2)
    mask = torch.rand(BIG_B, L, device="cuda", generator=torch.Generator("cuda").manual_seed(3)) < 0.8
    mask[:, 0] = True
    mask[-1] = False  # the last sequence, in the last blocks along x, sees no key: zeros, LSE -inf
    out, lse = wb.attention(q, k, v, stage=name, causal="bottom_right", key_padding_mask=mask, return_lse=True)
    rows = torch.as_tensor(_sample(BIG_B), device="cuda")
    wb.check(f"{name} B*H={BIG_B * H:,}", out[rows], q[rows], k[rows], v[rows], lse=lse[rows],
             causal="bottom_right", key_padding_mask=mask[rows])


@gpu_only
def test_decode_entry_at_large_batch():
    import torch

    D = 128
    q, _, _ = wb.random_qkv(BIG_B, H, 1, D, dtype="float16", framework="torch", device="cuda", seed=4)
    _, k, v = wb.random_qkv(BIG_B, HK, 8, D, dtype="float16", framework="torch", device="cuda", seed=5)
    lens = torch.randint(1, 9, (BIG_B,), dtype=torch.int32, device="cuda", generator=torch.Generator("cuda").manual_seed(6))
    lens[-1] = 0  # an empty cache: zeros and LSE -inf
    out, lse = wb.decode(q[:, :, 0], k, v, lens, return_lse=True)
    rows = torch.as_tensor(_sample(BIG_B), device="cuda")
    keep = torch.arange(8, device="cuda")[None, :] < lens[rows, None]
    wb.check(f"wb.decode B*Hk={BIG_B * HK:,}", out[rows][:, :, None], q[rows], k[rows], v[rows],
             lse=lse[rows][:, :, None], key_padding_mask=keep)


# --- on the CPU ------------------------------------------------------------------------------------------------

def test_naive_grids_put_batch_head_in_x():
    grids = naive.grid_shapes(B=BIG_B, H=H, Lq=40, Lk=56, D=64)
    for kernel, (grid, _) in grids.items():
        assert grid[0] == BIG_B * H, kernel
        assert all(blocks <= 65_535 for blocks in grid[1:]), kernel
    naive.check_grid("naive", grids["scores_kernel"][0], ("B*H", "Lq / 16", "Lk / 16"))  # allowed: no error


def test_check_grid_refuses_y_and_z_past_65535_by_name():
    naive.check_grid("x", (2**31 - 1, 65_535, 65_535), ("B*H", "a", "b"))
    with pytest.raises(ValueError, match=r"gridDim\.z would be Lk / 16 = 65,536 blocks.*65,535"):
        naive.check_grid("naive", (1, 1, 65_536), ("B*H", "Lq / 16", "Lk / 16"))
    with pytest.raises(ValueError, match=r"gridDim\.x would be B\*H"):
        naive.check_grid("naive", (2**31, 1, 1), ("B*H", "Lq / 16", "Lk / 16"))


def test_launchers_refuse_lengths_past_the_grid_before_any_launch():
    # block=1: 65,536 keys are 65,536 blocks along z, one past the limit, at a size the simulator allocates quickly
    q, k, v = (np.zeros((1, 1, n, 16), dtype=np.float32) for n in (1, 65_536, 65_536))
    with pytest.raises(ValueError, match=r"stage='naive': gridDim\.z would be Lk / 1 = 65,536"):
        naive.naive_forward(q, k, v, block=1)
    # tiled's softmax numbers all B*H*Lq rows along x; its scores grid holds Lq in y: 65,535 * 8 rows at most
    q, k, v = (np.zeros((1, 1, n, 16), dtype=np.float32) for n in (65_535 * 8 + 1, 1, 1))
    with pytest.raises(ValueError, match=r"stage='tiled': gridDim\.y would be Lq / 8 = 65,536"):
        tiled_forward(q, k, v, tile=8)


@pytest.mark.parametrize("source, batch_heads", [("mma/flash_mma.cu", "params.B * params.H"),
                                                 ("wmma/flash_wmma.cu", "params.B * params.H"),
                                                 ("decode/decode_host.cu", "params.B * params.Hk")])
def test_cuda_sources_launch_batch_heads_in_x(source, batch_heads):
    """The CUDA C++ kernels cannot run here; their launch lines can be read: (batch, head) is the grid's first
    dimension, and the kernel reads it from blockIdx.x, never from blockIdx.y. (The text nvcc compiles: the file with
    the headers it includes, where the decode kernels are.)"""
    from wb_kernels.cuda_build import EditableSource

    text = EditableSource(STAGES_DIR / source).package_source()
    grids = re.findall(r"const dim3 grid\(([^;]*)\);", text)
    assert grids and all(g.startswith(batch_heads) for g in grids), grids
    assert re.search(r"\b(bh|b) = blockIdx\.x\b", text)
    assert not re.search(r"\bbh = blockIdx\.y|blockIdx\.y [/%] p\.Hk?\b", text)
