"""The decode rung's tensor-core kernel for MQA and large groups (issue #30): ``decode_mma_kernel`` in decode_mma_kernel.cuh,
one block per (sequence, KV head, split) with the group's query heads as the M rows of mma.sync, so each split reads
its keys once.

On the CPU: which kernel a shape dispatches to, the launcher's plan for it (with the extension stubbed), and the
bytes each kernel asks of memory (:func:`launcher.decode_bytes`). On a GPU (skipped here): every result against the
float64 reference by wb.check's rule, for MQA (Hk = 1, H = 8 to 64), GQA 4 and 8 (forced onto the kernel), D 64 and
128, float16 and bfloat16, contiguous and paged caches, ragged lengths with 0 and 1, several split counts, both
merges, an NHD cache read in place, a CUDA graph replayed with other lengths, the status flags, and that the kernel
is the one launched.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

import numpy as np
import pytest

import wb_kernels as wb
from wb_kernels import api
from wb_kernels.stages.decode import build, launcher, tune

sys.path.insert(0, str(Path(__file__).parent))
from test_decode import check_decode, make_cache  # noqa: E402  (the decode tests' problems and wb.check's rule)

ON_GPU = wb.BACKEND.is_gpu
gpu_only = pytest.mark.skipif(not ON_GPU, reason="needs a CUDA GPU (runs on the numba simulator here)")


# ---------------------------------------------------------------- CPU: dispatch, plan, bytes


@pytest.mark.parametrize("H, Hk, kernel", [(32, 1, "mma"), (64, 1, "mma"), (8, 1, "mma"), (16, 2, "mma"),
                                           (40, 8, "mma"), (32, 8, "split"), (32, 16, "split"), (32, 32, "split"),
                                           (128, 1, "split")])
def test_which_kernel_a_shape_dispatches_to(H, Hk, kernel):
    """Groups from MMA_MIN_GROUP (5: the first the split kernel reads twice) to 64 take the tensor-core kernel;
    smaller groups and groups past its 4 row tiles keep the split kernel."""
    assert launcher.MMA_MIN_GROUP == 5
    assert launcher.cuda_kernel_for(H, Hk) == kernel


def test_the_threshold_is_a_parameter(monkeypatch):
    assert launcher.cuda_kernel_for(32, 8, min_group=4) == "mma"
    assert launcher.cuda_kernel_for(32, 4, min_group=16) == "split"
    assert launcher.cuda_kernel_for(32, 32, min_group=1) == "mma"
    monkeypatch.setattr(launcher, "MMA_MIN_GROUP", 8)
    assert launcher.cuda_kernel_for(56, 8) == "split" and launcher.cuda_kernel_for(64, 8) == "mma"


def test_bytes_per_block_before_and_after():
    """MQA at the issue's shape (B8 H32 Hk1 Lk8192 D128 fp16): the split kernel's 8 row chunks ask for the cache 8
    times (256 MiB for 32 MiB of K and V); the mma kernel once. The same blocks' share of a split either way."""
    before = launcher.decode_bytes(8, 32, 1, 8192, 128, 2, 32, "split")
    after = launcher.decode_bytes(8, 32, 1, 8192, 128, 2, 32, "mma")
    assert before.kv_unique == after.kv_unique == 2 * 8 * 8192 * 128 * 2 == 32 * 2**20
    assert (before.reads_per_key, after.reads_per_key) == (8, 1)
    assert before.kv_requested == 8 * after.kv_requested == 256 * 2**20
    assert before.blocks == 8 * after.blocks == 8 * 8 * 32
    assert before.kv_per_block == after.kv_per_block == 256 * 2 * 128 * 2  # 256 keys of K and V per split
    assert after.other == before.other > 0  # q, out, the splits' partial results: the same for both
    # groups of up to 4 query heads: one block per split either way
    for H, Hk in ((32, 8), (8, 8), (16, 8)):
        assert launcher.decode_bytes(1, H, Hk, 4096, 64, 2, 4, "split").kv_requested == \
               launcher.decode_bytes(1, H, Hk, 4096, 64, 2, 4, "mma").kv_requested
    assert launcher.decode_bytes(1, 40, 8, 4096, 64, 2, 4, "split").reads_per_key == 2  # a group of 5
    assert launcher.decode_bytes(1, 64, 1, 4096, 64, 2, 1, "mma").other == 2 * 64 * 64 * 2  # one split: no partials
    with pytest.raises(ValueError, match="kernel must be"):
        launcher.decode_bytes(1, 8, 1, 64, 64, 2, 1, "flash")


class _RecordingExtension:
    """Stands in for the CUDA extension: records which entry point the launcher calls, and with what plan."""

    def __init__(self):
        self.calls = []
        self.occupancy = []

    def flash_decode_forward(self, q, k, v, table, lens, status, keys_per_split, num_splits, scale):
        self.calls.append(("split", keys_per_split, num_splits))
        return q, q[:, :, 0]

    def flash_decode_mma_forward(self, q, k, v, table, lens, status, keys_per_split, num_splits, scale):
        self.calls.append(("mma", keys_per_split, num_splits))
        return q, q[:, :, 0]

    def flash_decode_blocks_per_sm(self, bf16, D, group, paged):
        self.occupancy.append(("split", group))
        return 2

    def flash_decode_mma_blocks_per_sm(self, bf16, D, group, paged):
        self.occupancy.append(("mma", group))
        return 2


@pytest.fixture
def recording(monkeypatch):
    torch = pytest.importorskip("torch")
    recorder = _RecordingExtension()
    monkeypatch.setattr(build, "extension", lambda: recorder)
    monkeypatch.setattr(launcher, "num_sms", lambda: 132)
    monkeypatch.setattr(launcher, "status_buffer", lambda index: None)
    monkeypatch.setattr(torch.cuda, "device", lambda index: _NoDevice())
    launcher.cuda_launch_plan.cache_clear()
    launcher.cuda_blocks_per_sm.cache_clear()
    yield recorder
    launcher.cuda_launch_plan.cache_clear()
    launcher.cuda_blocks_per_sm.cache_clear()


class _NoDevice:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def test_mqa_launches_the_mma_kernel_with_one_block_per_split(recording):
    """B8 H32 Hk1 Lk8192: the mma entry point, its own occupancy, and splits counted without row chunks (the split
    kernel's 8 row chunks made 5 splits fill the GPU; one block per split takes about 8 times as many)."""
    import torch

    q = torch.zeros(8, 32, 128, dtype=torch.float16)
    k = torch.zeros(8, 1, 8192, 128, dtype=torch.float16)
    launcher.cuda_decode_forward(q, k, k, torch.full((8,), 8192, dtype=torch.int32))
    kernel, keys, splits = recording.calls[-1]
    assert kernel == "mma" and ("mma", 32) in recording.occupancy
    assert keys * splits >= 8192 and keys % build.KEYS_PER_STEP == 0
    split_kernel_splits = launcher.choose_num_splits(8, 1, 8192, 132, row_chunks=8, blocks_per_sm=2,
                                                     keys_step=build.KEYS_PER_STEP)
    assert splits >= 4 * split_kernel_splits, (splits, split_kernel_splits)

    q4 = torch.zeros(8, 32, 128, dtype=torch.float16)
    k4 = torch.zeros(8, 8, 8192, 128, dtype=torch.float16)
    launcher.cuda_decode_forward(q4, k4, k4, torch.full((8,), 8192, dtype=torch.int32))
    assert recording.calls[-1][0] == "split"  # GQA 4: the split kernel, as before


def test_the_tuning_run_reads_the_threshold_off_its_rows():
    """tune.py --mma-threshold: the smallest group from which on the mma kernel wins at every shape (and every larger
    group); a failed check or a loss at one shape keeps that group on the split kernel."""
    from wb_kernels.stages.decode.tune import smallest_winning_group

    def rows(times):  # {(B, group): (split ms, mma ms)}
        return [dict(B=B, Lk=8192, D=128, group=group, kernel=kernel, median_ms=ms, ok=True)
                for (B, group), pair in times.items() for kernel, ms in zip(("split", "mma"), pair)]

    assert smallest_winning_group(rows({(8, 4): (1.0, 1.1), (8, 8): (2.0, 1.0), (8, 32): (8.0, 1.0)})) == 8
    assert smallest_winning_group(rows({(8, 4): (1.0, 0.9), (8, 8): (2.0, 1.0), (1, 8): (1.0, 1.2),
                                        (8, 32): (8.0, 1.0), (1, 32): (8.0, 1.0)})) == 32
    assert smallest_winning_group(rows({(8, 4): (1.0, 0.9), (8, 8): (2.0, 2.5), (8, 32): (8.0, 1.0)})) == 32
    assert smallest_winning_group(rows({(8, 32): (1.0, 2.0)})) is None
    failed = rows({(8, 8): (2.0, 1.0), (8, 32): (8.0, 1.0)})
    failed[1]["ok"] = False  # the mma kernel's output at group 8 failed its check
    assert smallest_winning_group(failed) == 32


def test_cuda_kernels_are_listed_in_the_compile_report_by_kind():
    """build.KernelResources tells the mma kernel's variants apart (rows = 16 x row tiles, paged or not)."""
    resources = build.KernelResources("sm_90", "mma", "float16", 128, 32, 168, 0, 0, True)
    assert resources.paged and resources.rows == 32


# ---------------------------------------------------------------- GPU


def _cuda(*arrays, dtype):
    import torch

    return [torch.from_numpy(np.ascontiguousarray(x)).cuda().to(getattr(torch, dtype)) if x.dtype.kind == "f"
            else torch.from_numpy(np.ascontiguousarray(x)).cuda() for x in arrays]


class _WhichEntry:
    """The real extension, recording which entry point each call used."""

    def __init__(self, extension):
        self.extension, self.used = extension, []

    def __getattr__(self, name):
        if name.startswith("flash_decode") and name.endswith("forward"):
            self.used.append(name)
        return getattr(self.extension, name)


@pytest.fixture
def which_entry(monkeypatch):
    recorder = _WhichEntry(build.extension())
    monkeypatch.setattr(build, "extension", lambda: recorder)
    return recorder


def _check(q, kc, vc, lens, out, lse=None):
    """wb.check's rule against float64, on the rounded inputs the kernel saw; out stays in its 16-bit dtype."""
    as32 = [x.float().cpu().numpy() for x in (q, kc, vc)]
    result = check_decode(out, *as32, lens, lse=lse)
    assert result.passed, result


MQA_CASES = [  # (B, H, Hk, D, lengths, page_size, num_splits)
    (4, 8, 1, 128, [0, 1, 1000, 4099], 16, None),
    (4, 16, 1, 64, [0, 1, 77, 3000], 16, None),
    (4, 32, 1, 128, [1, 0, 4099, 2500], 16, None),
    (3, 64, 1, 64, [4099, 63, 1], 16, None),
    (3, 64, 1, 128, [200, 0, 2049], 7, 3),
    (2, 32, 1, 64, [65, 129], 5, 7),
    (3, 24, 1, 128, [1000, 0, 17], 16, 1),  # a group of 24: two row tiles, 8 padding rows; one split, one empty
    (2, 48, 2, 64, [333, 1], 16, 4),  # a group of 24 on 2 KV heads
    (4, 32, 4, 128, [0, 1, 999, 1500], 16, None),  # GQA 8 (the mma kernel by default)
]


@gpu_only
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("case", MQA_CASES, ids=lambda c: f"B{c[0]}H{c[1]}Hk{c[2]}D{c[3]}p{c[5]}s{c[6]}")
def test_gpu_mma_kernel_matches_the_reference(case, dtype, which_entry):
    """Paged (shuffled table, pages not dividing lengths) and contiguous caches, LSE included; empty sequences give
    0 and -inf."""
    B, H, Hk, D, lens, page_size, num_splits = case
    q, (kp, vp, table), (kc, vc), lens = make_cache(B, H, Hk, D, lens, page_size=page_size, seed=H + D)
    q_, kp_, vp_, kc_, vc_, table_, lens_ = _cuda(q, kp, vp, kc, vc, table, lens, dtype=dtype)
    out, lse = wb.decode(q_, kp_, vp_, lens_, block_table=table_, num_splits=num_splits, return_lse=True)
    assert which_entry.used == ["flash_decode_mma_forward"]
    assert out.dtype == q_.dtype
    _check(q_, kc_, vc_, lens, out, lse=lse.cpu().numpy())
    empty = np.asarray(lens) == 0
    assert bool(out[torch_tensor(empty)].eq(0).all()) and bool(lse[torch_tensor(empty)].isneginf().all())
    # the same problem on the contiguous cache (the kernel without a block table)
    _check(q_, kc_, vc_, lens, wb.decode(q_, kc_, vc_, lens_, num_splits=num_splits))


@gpu_only
def test_gpu_a_second_build_in_one_process_launches_its_own_mma_kernel():
    """The package's build runs first (its mma kernel opts in to more than 48 KB of shared memory, and remembers
    it), then a build of the same file with other flags (the sweep's warps4): the second must opt in for its own
    kernel. Before the flag moved into an unnamed namespace, the one flag served both builds and every launch of the
    second failed with "invalid argument" (the tuning sweeps of 2026-11-26)."""
    import torch

    from wb_kernels.cuda_build import build_flags

    B, H, Hk, D, lens = 2, 32, 1, 128, [700, 129]
    q, (kp, vp, table), (kc, vc), lens = make_cache(B, H, Hk, D, lens, page_size=16, seed=5)
    q_, kc_, vc_, lens_ = _cuda(q, kc, vc, lens, dtype="float16")
    status = torch.zeros(1, dtype=torch.int32, device="cuda")
    for ext in (build.extension(), build.build(build.package_source(),
                                               flags=build_flags() + ["-DWB_DECODE_MMA_WARPS=4"])):
        out = ext.flash_decode_mma_forward(q_, kc_, vc_, None, lens_, status, 256, 3, D ** -0.5)[0]
        _check(q_, kc_, vc_, lens, out)
    assert int(status.item()) == 0


def torch_tensor(mask):
    import torch

    return torch.from_numpy(mask).cuda()


@gpu_only
@pytest.mark.parametrize("group", [1, 2, 4, 8, 16, 17, 33, 64])
@pytest.mark.parametrize("D", [64, 128])
def test_gpu_mma_kernel_forced_on_any_group(group, D, monkeypatch, which_entry):
    """With the threshold at 1 every group up to 64 takes the mma kernel (15 of 16 rows padding at group 1)."""
    monkeypatch.setattr(launcher, "MMA_MIN_GROUP", 1)
    launcher.cuda_launch_plan.cache_clear()
    q, (kp, vp, table), (kc, vc), lens = make_cache(3, 2 * group, 2, D, [0, 1, 2100], page_size=16, seed=group)
    q_, kp_, vp_, kc_, vc_, table_, lens_ = _cuda(q, kp, vp, kc, vc, table, lens, dtype="float16")
    for num_splits in (None, 1, 5):
        out = wb.decode(q_, kp_, vp_, lens_, block_table=table_, num_splits=num_splits)
        _check(q_, kc_, vc_, lens, out)
        _check(q_, kc_, vc_, lens, wb.decode(q_, kc_, vc_, lens_, num_splits=num_splits))
    assert set(which_entry.used) == {"flash_decode_mma_forward"}
    launcher.cuda_launch_plan.cache_clear()


@gpu_only
@pytest.mark.parametrize("D", [64, 128])
def test_gpu_mma_kernel_with_more_splits_than_its_fused_merge_holds(D):
    """64 query heads x 256 splits of weights do not fit the stages' shared memory at D = 64 (12,288 floats): the
    merge kernel runs instead; at D = 128 the fused merge holds them. Both give the reference."""
    q, (kp, vp, table), (kc, vc), lens = make_cache(2, 64, 1, D, [256 * 64, 5000], page_size=64, seed=D)
    q_, kp_, vp_, kc_, vc_, table_, lens_ = _cuda(q, kp, vp, kc, vc, table, lens, dtype="float16")
    out = wb.decode(q_, kp_, vp_, lens_, block_table=table_, num_splits=256)
    _check(q_, kc_, vc_, lens, out)


@gpu_only
def test_gpu_mma_kernel_reads_nhd_caches_in_place():
    """kv_layout="NHD": (B, L, Hk, D) and (pages, page_size, Hk, D) read through their strides."""
    q, (kp, vp, table), (kc, vc), lens = make_cache(3, 32, 2, 128, [0, 1500, 301], page_size=16, seed=3)
    q_, kp_, vp_, kc_, vc_, table_, lens_ = _cuda(q, kp, vp, kc, vc, table, lens, dtype="bfloat16")
    nhd = [x.transpose(1, 2).contiguous() for x in (kp_, vp_, kc_, vc_)]
    out_paged = wb.decode(q_, nhd[0], nhd[1], lens_, block_table=table_, kv_layout="NHD", num_splits=3)
    out_contiguous = wb.decode(q_, nhd[2], nhd[3], lens_, kv_layout="NHD", num_splits=3)
    _check(q_, kc_, vc_, lens, out_paged)
    _check(q_, kc_, vc_, lens, out_contiguous)


@gpu_only
@pytest.mark.parametrize("splits", [None, 1])  # the launcher's (merged), and one split (written by its block)
def test_gpu_mma_kernel_non_finite_inputs(splits):
    """A NaN in one query head's row poisons that row only (where the sequence has keys); a NaN in a key poisons
    every row of its sequence; a sequence with no keys stays 0, whatever its query."""
    import torch

    q, (kp, vp, table), (kc, vc), lens = make_cache(3, 32, 1, 64, [300, 0, 300], page_size=16, seed=4)
    q[0, 5, 3] = np.nan
    q[1, 2, 0] = np.nan
    kc[2, 0, 100, 7] = np.nan
    q_, kc_, vc_, lens_ = _cuda(q, kc, vc, lens, dtype="float16")
    out, lse = wb.decode(q_, kc_, vc_, lens_, num_splits=splits, return_lse=True)
    nan = out.isnan().any(-1).cpu()
    expected = torch.zeros(3, 32, dtype=torch.bool)
    expected[0, 5] = True
    expected[2] = True
    assert torch.equal(nan, expected), nan
    assert torch.equal(lse.isnan().cpu(), expected)
    assert bool((out[1] == 0).all()) and bool(lse[1].isneginf().all())


@gpu_only
def test_gpu_mma_kernel_flags_a_page_outside_the_pool():
    """A table entry past the pool is clamped (no read outside it) and reported by decode_problems (status bit 4)."""
    q, (kp, vp, table), _, lens = make_cache(2, 32, 1, 64, [100, 100], page_size=16, seed=5)
    table[1, 2] = kp.shape[0] + 10
    q_, kp_, vp_, table_, lens_ = _cuda(q, kp, vp, table, lens, dtype="float16")
    api.decode_problems()
    out = wb.decode(q_, kp_, vp_, lens_, block_table=table_)
    assert not bool(out.isnan().any())
    problems = api.decode_problems()
    assert any("page number" in p for p in problems), problems


@gpu_only
def test_gpu_mma_kernel_in_a_cuda_graph_replays_other_lengths():
    """Captured once with a bucket of 1024 keys, replayed with other contents and lengths (0, 1, past the bucket:
    read in full by the last split and reported)."""
    import torch

    B, H, Hk, D, capacity, page = 4, 32, 1, 128, 2048, 16
    g = torch.Generator(device="cuda").manual_seed(6)
    pages = B * capacity // page
    q_ = torch.randn(B, H, D, device="cuda", generator=g).half()
    kp_, vp_ = (torch.randn(pages, Hk, page, D, device="cuda", generator=g).half() for _ in range(2))
    table_ = torch.randperm(pages, device="cuda", generator=g).reshape(B, -1).to(torch.int32)
    lens_ = torch.full((B,), 5, dtype=torch.int32, device="cuda")
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up off the default stream, as torch.cuda.graphs asks
        wb.decode(q_, kp_, vp_, lens_, block_table=table_, max_seqlen=1024)
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    api.decode_problems()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = wb.decode(q_, kp_, vp_, lens_, block_table=table_, max_seqlen=1024)
    for lengths, late in (([0, 1, 1000, 517], False), ([1024, 3, 2000, 64], True)):
        for static in (q_, kp_, vp_):
            static.copy_(torch.randn(static.shape, device="cuda", generator=g).half())
        lens_.copy_(torch.tensor(lengths, dtype=torch.int32))
        graph.replay()
        torch.cuda.synchronize()
        # each sequence's pages in table order: (B, pages per sequence, Hk, page, D) -> (B, Hk, capacity, D)
        kc_, vc_ = (x[table_.long()].transpose(1, 2).reshape(B, Hk, capacity, D) for x in (kp_, vp_))
        _check(q_, kc_, vc_, np.asarray(lengths), out)
        assert bool(api.decode_problems()) == late


# ---------------------------------------------------------------- CPU: the kernel's lanes in NumPy
# One block of decode_mma_kernel, warp by warp, with the kernel's own index arithmetic (swizzled stores, ldmatrix
# row addresses, fragment registers, quad shuffles, the slices' merge), on the mma rung's model of the PTX ISA's
# fragment layouts (wb_kernels/stages/mma/fragments.py). A wrong address or register in the kernel's formulas, as
# copied here, gives a wrong answer against float64; the GPU tests check the kernel itself.

WARPS = 8  # WB_DECODE_MMA_WARPS


def mma_shape(tiles_m, warps=WARPS):
    """decode_mma_kernel.cuh's MmaShape: (slices, keys per tile, keys per warp) for `tiles_m` row tiles."""
    slices = warps // tiles_m
    keys = max(slices * 16, 64)
    return slices, keys, keys // slices


def test_the_model_has_the_kernels_shape():
    """The model's warps and tile rule are the ones decode_mma_kernel.cuh's MmaShape states."""
    source = build.package_source()
    assert f"#define WB_DECODE_MMA_WARPS {WARPS}\n" in source
    assert "static constexpr int KEYS = SLICES * 16 > 64 ? SLICES * 16 : 64;" in source
    assert [mma_shape(t) for t in (1, 2, 4)] == [(8, 128, 16), (4, 64, 16), (2, 64, 32)]


def _swizzled(row, chunk, D):  # decode_swizzled
    return row * D + ((chunk ^ (row & 7)) << 3)


def _lanes_address(row, chunk, D):  # the kernel's address(): row % 8 == lane % 8, so the swizzle term is lane % 8
    lane = np.arange(32)
    assert np.all(row % 8 == lane % 8)
    return row * D + ((chunk ^ (lane % 8)) << 3)


def _store_tile(rows, D, count):
    """rows (n <= count, D) into a swizzled flat tile of `count` rows, zero past n (cp.async's zero fill)."""
    tile = np.zeros(count * D)
    for r in range(count):
        for c in range(D // 8):
            if r < len(rows):
                tile[_swizzled(r, c, D) + np.arange(8)] = rows[r, 8 * c:8 * c + 8]
    return tile


def _quad(values, combine):  # two xor shuffles within groups of four lanes: (32,) -> (32,)
    grouped = values.reshape(8, 4)
    return np.repeat(combine(grouped, axis=1), 4)


def mma_block_model(q, k, v, scale_log2, warps=WARPS):
    """One block's split: q (group, D) and the split's keys k, v (n, D), already rounded to 16 bits; returns the
    split's (out (group, D), lse in log2 units (group,)) as the kernel's epilogue computes them, with `warps` warps
    (WB_DECODE_MMA_WARPS)."""
    from wb_kernels.stages.mma.fragments import ldmatrix, mma_m16n8k16

    group, D = q.shape
    tiles_m = 1 if group <= 16 else 2 if group <= 32 else 4
    rows = 16 * tiles_m
    slices, tile_keys, warp_keys = mma_shape(tiles_m, warps)
    s_q = _store_tile(q, D, rows)
    lane = np.arange(32)
    state = {}
    for warp in range(warps):
        row_tile, slice_ = warp % tiles_m, warp // tiles_m
        q_frag = [ldmatrix(s_q, _lanes_address(row_tile * 16 + (lane // 8 % 2) * 8 + lane % 8, 2 * ks + lane // 16,
                                               D)) for ks in range(D // 16)]
        o = np.zeros((D // 8, 32, 4))
        m_run, l_run = np.full((2, 32), -np.inf), np.zeros((2, 32))
        for t0 in range(0, len(k), tile_keys):
            k_tile, v_tile = (_store_tile(x[t0:t0 + tile_keys], D, tile_keys) for x in (k, v))
            warp_key0 = slice_ * warp_keys
            s = np.zeros((warp_keys // 8, 32, 4))
            for ks in range(D // 16):
                for np_ in range(warp_keys // 16):
                    kb = ldmatrix(k_tile, _lanes_address(warp_key0 + 16 * np_ + (lane // 16) * 8 + lane % 8,
                                                         2 * ks + lane // 8 % 2, D))
                    s[2 * np_] = mma_m16n8k16(q_frag[ks], kb[:, :4], s[2 * np_])
                    s[2 * np_ + 1] = mma_m16n8k16(q_frag[ks], kb[:, 4:], s[2 * np_ + 1])
            s *= scale_log2
            for n in range(warp_keys // 8):
                for i in range(4):
                    key = t0 + warp_key0 + 8 * n + 2 * (lane % 4) + (i & 1)
                    s[n, key >= len(k), i] = -np.inf
            for h in range(2):
                row_max = np.maximum(m_run[h], s[:, :, 2 * h:2 * h + 2].max(axis=(0, 2)))
                row_max = _quad(row_max, np.max)
                subtract = np.where(row_max == -np.inf, 0.0, row_max)
                alpha = np.exp2(m_run[h] - subtract)
                s[:, :, 2 * h:2 * h + 2] = np.exp2(s[:, :, 2 * h:2 * h + 2] - subtract[None, :, None])
                l_run[h] = l_run[h] * alpha + s[:, :, 2 * h:2 * h + 2].sum(axis=(0, 2))
                m_run[h] = row_max
                o[:, :, 2 * h:2 * h + 2] *= alpha[None, :, None]
            for kk in range(warp_keys // 16):
                pa = np.concatenate([s[2 * kk], s[2 * kk + 1]], axis=-1).astype(np.float16).astype(np.float64)
                for dp in range(D // 16):
                    vb = ldmatrix(v_tile, _lanes_address(warp_key0 + 16 * kk + (lane // 8 % 2) * 8 + lane % 8,
                                                         2 * dp + lane // 16, D), trans=True)
                    o[2 * dp] = mma_m16n8k16(pa, vb[:, :4], o[2 * dp])
                    o[2 * dp + 1] = mma_m16n8k16(pa, vb[:, 4:], o[2 * dp + 1])
        state[warp] = (m_run, np.stack([_quad(l_run[h], np.sum) for h in range(2)]), o)
    # the epilogue: each slice's rows into shared memory, then combined per row and column
    s_m, s_l, s_o = np.zeros((slices, rows)), np.zeros((slices, rows)), np.zeros((slices, rows, D))
    for warp, (m_run, l_run, o) in state.items():
        row_tile, slice_ = warp % tiles_m, warp // tiles_m
        for h in range(2):
            row = row_tile * 16 + lane // 4 + 8 * h
            s_m[slice_, row] = np.where(m_run[h] == -np.inf, -1e30, m_run[h])
            s_l[slice_, row] = l_run[h]
            for d in range(D // 8):
                s_o[slice_, row, 8 * d + 2 * (lane % 4)] = o[d, :, 2 * h]
                s_o[slice_, row, 8 * d + 2 * (lane % 4) + 1] = o[d, :, 2 * h + 1]
    top = s_m.max(axis=0)
    weight = np.exp2(s_m - top)
    total = (s_l * weight).sum(axis=0)
    value = (s_o * weight[:, :, None]).sum(axis=0)
    seen = total > 0
    out = np.where(seen[:, None], value / np.where(seen, total, 1)[:, None], 0.0)
    lse = np.where(seen, top + np.log2(np.where(seen, total, 1)), -1e30)
    return out[:group], lse[:group]


@pytest.mark.parametrize("warps", [8, 4])
@pytest.mark.parametrize("group, D, keys", [(1, 64, 0), (5, 64, 1), (16, 64, 64), (16, 64, 300), (24, 64, 130),
                                            (32, 128, 77), (40, 64, 200), (64, 64, 129)])
def test_the_kernels_lanes_compute_attention(group, D, keys, warps):
    """The NumPy lanes of one block (row tiles 1, 2 and 4; one and several tiles of keys, ragged; no key; the
    default 8 warps and the 4 of WB_DECODE_MMA_WARPS=4) against float64 attention of the same rounded inputs."""
    rng = np.random.default_rng(group + D + keys)
    q, k, v = (rng.standard_normal(shape).astype(np.float16).astype(np.float64)
               for shape in ((group, D), (keys, D), (keys, D)))
    scale_log2 = D ** -0.5 * np.log2(np.e)
    out, lse = mma_block_model(q, k, v, scale_log2, warps)
    if keys == 0:
        assert np.all(out == 0) and np.all(lse == -1e30)
        return
    scores = q @ k.T * scale_log2
    top = scores.max(axis=1, keepdims=True)
    p = np.exp2(scores - top)
    expected = (p / p.sum(axis=1, keepdims=True)) @ v
    np.testing.assert_allclose(lse, top[:, 0] + np.log2(p.sum(axis=1)), atol=1e-9, rtol=1e-9)
    np.testing.assert_allclose(out, expected, atol=2e-3, rtol=2e-3)  # P rounded to float16 before P V


# ---------------------------------------------------------------- CPU: the tuning sweep's knobs and its bookkeeping


def test_the_mma_sweep_times_each_split_count_once():
    """Around the launcher's count: an eighth of it to twice it (or to 8), as the kernel rounds them (whole 64-key
    steps)."""
    from wb_kernels.stages.decode.tune import mma_sweep_splits

    assert mma_sweep_splits(8192, 32) == [(4, 2048), (8, 1024), (16, 512), (32, 256), (64, 128)]
    assert mma_sweep_splits(2048, 16) == [(2, 1024), (4, 512), (8, 256), (16, 128), (32, 64)]
    # 256 splits of 32768 keys are 128 keys each; 512 would be past MMA_MAX_SWEEP_SPLITS
    assert mma_sweep_splits(32768, 128)[-1] == (256, 128)
    assert [s for s, _ in mma_sweep_splits(32768, 256)] == [32, 64, 128, 256]
    # 100 keys: every count rounds onto one or two splits of 64 keys, each timed once
    assert mma_sweep_splits(100, 4) == [(1, 128), (2, 64)]
    # MQA at batch 64, where the launcher plans 2 splits: up to 8, not 4
    assert mma_sweep_splits(1024, 2) == [(1, 1024), (2, 512), (4, 256), (8, 128)]


def _sweep_rows():
    shape = dict(B=1, H=32, Hk=1, Lk=2048, D=128, kv_bytes=2**20)
    rows = [dict(shape, variant=name, splits=s, keys_per_split=2048 // s, median_ms=ms, gbps=1.0, fraction_of_copy=0.5,
                 vs_sdpa_fastest=0.011 / ms, launcher_pick=s == 16, max_err_vs_fp32=0.0, lse_err_vs_fp32=0.0, ok=ok)
            for name, s, ms, ok in (("base", 16, 0.017, True), ("stages2", 16, 0.012, True), ("stages4", 8, 0.005, False))]
    shapes = [dict(shape, baselines_ms={"copy": 0.007, "sdpa": 0.012, "sdpa-cudnn": 0.011}, sdpa_fastest="sdpa-cudnn",
                   launcher_splits=16, blocks_per_sm=2)]
    return rows, shapes


def test_the_mma_sweep_table_names_the_best_checked_point():
    """A point whose output failed its check is printed as MISMATCH and is never the best, however fast."""
    from wb_kernels.stages.decode.tune import mma_sweep_table

    rows, shapes = _sweep_rows()
    table = mma_sweep_table(rows, shapes)
    assert "MISMATCH" in table.splitlines()[3]
    assert "best: stages2 at 16 splits: 12.0 us" in table
    assert "base at the launcher's 16 splits 17.0 us" in table and "sdpa-cudnn 11.0 us" in table


def test_the_mma_variants_are_knobs_of_the_kernels_source():
    """Each variant's macros exist in the decode CUDA sources with a default (so the default build is the measured one),
    its flags keep the package's nvcc flags, and an unknown variant's name is refused before anything runs."""
    from wb_kernels.stages.decode import tune

    source = build.package_source()
    names = [v.name for v in tune.MMA_VARIANTS]
    assert len(set(names)) == len(names) and names[0] == "base" and tune.MMA_VARIANTS[0].defines == ()
    for variant in tune.MMA_VARIANTS:
        for macro, _ in variant.defines:
            assert f"#ifndef {macro}\n#define {macro} " in source, macro
    assert tune.MmaVariant("x", (("WB_DECODE_MMA_WARPS", 4),)).flags(["-O3"]) == ["-O3", "-DWB_DECODE_MMA_WARPS=4"]
    # the split kernel's variants too build on the package's flags (flags given to a build replace them); the
    # package's flags name this GPU's architecture, so here a stand-in for them
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(tune, "build_flags", lambda: ["-O3", "--use_fast_math"])
        assert tune.DEFAULT.flags[:2] == ["-O3", "--use_fast_math"] and "-DWB_DECODE_WARPS=8" in tune.DEFAULT.flags
    with pytest.raises(SystemExit):
        tune.main(["--mma-sweep", "--mma-variants", "base,no_such_variant"])


@pytest.mark.parametrize("variant", [v for v in tune.MMA_VARIANTS if v.defines], ids=lambda v: v.name)
def test_the_mma_knobs_compile_without_spills(variant):
    """The sweep's candidate builds for the H100 (sm_90a): the contiguous mma kernels spill nothing."""
    from stage_cases import tool_or_skip

    from wb_kernels import cuda_build

    tool_or_skip(cuda_build.find_nvcc, "the mma knobs' compile check")
    flags = tuple(f"-D{macro}={value}" for macro, value in variant.defines)
    _, log = cuda_build.compile_cubin("sm_90a", build.package_source(), build.LINE_NAME, extra_flags=flags)
    mma = [e for e in cuda_build.ptxas_entries(log) if "decode_mma_kernel" in e.function and e.function.endswith("Lb0EEEvNS_12DecodeParamsE")]
    assert len(mma) == 12 and all(e.spill_stores == 0 for e in mma), mma


def test_the_trace_build_compiles_and_stamps_within_its_status_words():
    """tune.py --mma-trace's and --split-trace's builds (WB_DECODE_MMA_TRACE, WB_DECODE_SPLIT_TRACE): the kernels compile for the H100 without spills, and the
    stamps' layout (16 words of 64 bits a block after 4 int32 words) is the one tune.py allocates and reads."""
    from stage_cases import tool_or_skip

    from wb_kernels import cuda_build
    from wb_kernels.stages.decode import tune

    tool_or_skip(cuda_build.find_nvcc, "the trace build's compile check")
    _, log = cuda_build.compile_cubin("sm_90a", build.package_source(), build.LINE_NAME,
                                      extra_flags=("-DWB_DECODE_MMA_TRACE",))
    mma = [e for e in cuda_build.ptxas_entries(log) if "decode_mma_kernel" in e.function]
    assert len(mma) == 24 and all(e.spill_stores == 0 for e in mma)
    source = build.package_source()
    assert "reinterpret_cast<unsigned long long*>(p.status + 4)" in source
    assert "16 * (((size_t)blockIdx.z * gridDim.y + blockIdx.y) * gridDim.x + blockIdx.x)" in source
    assert "4 + 32 * blocks" in Path(tune.__file__).read_text() and len(tune.TRACE_PHASES) == 7
    # the split kernel's trace build: every split kernel compiles, and its stamps are at the phases
    # tune.py reads (the words of TRACE_PHASES it names)
    _, log = cuda_build.compile_cubin("sm_90a", build.package_source(), build.LINE_NAME,
                                      extra_flags=("-DWB_DECODE_SPLIT_TRACE",))
    split = [e for e in cuda_build.ptxas_entries(log) if "decode_split_kernel" in e.function]
    # a profiling build: the stamps cost the 128-register kernels up to 8 bytes of spill (the package's build has
    # none); the traced one, fp16 D = 128 on a contiguous cache, has none
    traced = [e for e in split if e.function.startswith("_ZN2wb19decode_split_kernelI6__halfLi128ELi4ELi8ELi2ELb0")]
    assert len(split) == 24 and all(e.spill_stores <= 8 for e in split) and traced[0].spill_stores == 0
    stamped = sorted(int(n) for n in re.findall(r"WB_SPLIT_TRACE\((\d)\);", source))
    assert stamped == [tune.TRACE_PHASES.index(name) for name in tune.KERNEL_TRACE_PHASES["split"]]
