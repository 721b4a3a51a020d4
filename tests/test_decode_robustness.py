"""wb.decode tried as a hostile user would (issue #30): every bad option and input refused before any launch, with a
message that names the allowed values and says what to do; the NHD layout and strided caches read in place; the split
count independent of the lengths' values; the registered op's fake implementation, opcheck and a fullgraph trace on
the CPU. The kernel's side of the same promises (flags for lengths on the GPU, strided and misaligned caches, graphs)
is in tests/test_decode_graph.py, which needs a GPU.
"""

from __future__ import annotations

import numpy as np
import pytest

import wb_kernels as wb
from wb_kernels import validation
from wb_kernels.stages.decode import launcher

torch = pytest.importorskip("torch")


def _problem(B=2, H=4, Hk=2, D=16, lens=(5, 8), page_size=4, seed=0, dtype=np.float32):
    """q (B, H, D), a paged cache (pages shuffled), its table, the same cache contiguous, and the lengths."""
    rng = np.random.default_rng(seed)
    capacity = max(lens)
    pages_per_seq = -(-capacity // page_size)
    num_pages = B * pages_per_seq + 1
    kp = rng.standard_normal((num_pages, Hk, page_size, D)).astype(dtype)
    vp = rng.standard_normal((num_pages, Hk, page_size, D)).astype(dtype)
    table = rng.permutation(num_pages)[:B * pages_per_seq].reshape(B, pages_per_seq).astype(np.int32)
    q = rng.standard_normal((B, H, D)).astype(dtype)
    full = pages_per_seq * page_size
    kc = np.stack([launcher.gather_pages(kp, table, full, b) for b in range(B)])
    vc = np.stack([launcher.gather_pages(vp, table, full, b) for b in range(B)])
    return q, kp, vp, table, kc, vc, np.asarray(lens, np.int32)


# ---------------------------------------------------------------- num_splits and max_seqlen


@pytest.mark.parametrize("num_splits, error, words", [
    (0, ValueError, r"num_splits: expected an int in \[1, 64\]"),
    (-2, ValueError, r"num_splits: expected an int in \[1, 64\]"),
    ("2", TypeError, r"num_splits: expected an int in \[1, 64\].*got '2' of type str"),
    (2.0, TypeError, r"num_splits: expected an int .*got 2.0 of type float"),
    (True, TypeError, r"num_splits: expected an int .*got True of type bool"),
    (1000, ValueError, r"num_splits: expected an int in \[1, 64\] \(at most max\(64, the cache's 8 keys"),
    (np.int64(10**6), ValueError, r"num_splits: expected an int in \[1, 64\]"),
])
def test_bad_num_splits_are_refused_before_any_launch(num_splits, error, words, monkeypatch):
    monkeypatch.setattr(launcher, "split_kv_forward", lambda *a, **k: pytest.fail("launched"))
    q, kp, vp, table, kc, vc, lens = _problem()
    with pytest.raises(error, match=words):
        wb.decode(q, kc, vc, lens, num_splits=num_splits)
    with pytest.raises(error, match=words):
        wb.decode(q, kp, vp, lens, block_table=table, num_splits=num_splits)


def test_num_splits_range_grows_with_the_cache_and_stops_at_the_maximum():
    q, kp, vp, table, kc, vc, lens = _problem()
    with pytest.raises(ValueError, match=r"\[1, 4096\]"):
        validation.check_decode_options(4097, None, 5000, lens)
    assert validation.check_decode_options(4096, None, 5000, lens) == (4096, None)
    assert validation.check_decode_options(64, None, 8, lens) == (64, None)  # more splits than keys: empty splits, allowed
    assert validation.check_decode_options(np.int32(3), 8, 8, lens) == (3, 8)


@pytest.mark.parametrize("max_seqlen, error, words", [
    (-1, ValueError, r"max_seqlen: expected an int in \[0, 2147483647\]"),
    ("8", TypeError, "max_seqlen: expected an int"),
    (8.0, TypeError, "max_seqlen: expected an int"),
    (False, TypeError, "max_seqlen: expected an int"),
    (7, ValueError, r"max_seqlen=7 is below the longest sequence \(8 keys\); pass max_seqlen >= 8"),
])
def test_bad_max_seqlen_is_refused(max_seqlen, error, words):
    q, kp, vp, table, kc, vc, lens = _problem()
    with pytest.raises(error, match=words):
        wb.decode(q, kc, vc, lens, max_seqlen=max_seqlen)


def test_max_seqlen_above_the_capacity_is_the_capacity():
    q, kp, vp, table, kc, vc, lens = _problem()
    np.testing.assert_array_equal(wb.decode(q, kc, vc, lens, max_seqlen=10**9, num_splits=2),
                                  wb.decode(q, kc, vc, lens, num_splits=2))


def test_seqlen_bucket():
    assert [validation.seqlen_bucket(n, 10_000) for n in (0, 1, 256, 257, 1000, 4097)] == [256, 256, 256, 512, 1024,
                                                                                          8192]
    assert validation.seqlen_bucket(9000, 10_000) == 10_000  # never past the capacity
    assert validation.seqlen_bucket(5, 8) == 8
    with pytest.raises(ValueError, match="seqlen_bucket"):
        validation.seqlen_bucket(-1, 8)


# ---------------------------------------------------------------- shapes, dtypes, the simulator's time


@pytest.mark.parametrize("shapes, words", [
    (dict(q=(2, 0, 16), k=(2, 2, 8, 16)), "empty input"),  # H = 0
    (dict(q=(2, 4, 16), k=(2, 0, 8, 16)), "empty input"),  # Hk = 0
    (dict(q=(2, 4, 0), k=(2, 2, 8, 0)), "empty input"),  # D = 0
    (dict(q=(0, 4, 16), k=(0, 2, 8, 16)), "empty input"),  # B = 0
    (dict(q=(2, 4, 16), k=(2, 2, 0, 16)), "empty input"),  # a cache of no slots
])
def test_empty_dimensions_are_refused_with_what_to_do(shapes, words):
    q = np.zeros(shapes["q"], np.float32)
    k = np.zeros(shapes["k"], np.float32)
    lens = np.zeros(shapes["q"][0], np.int32)
    with pytest.raises(ValueError, match=words) as error:
        wb.decode(q, k, k, lens)
    assert "must be >= 1" in str(error.value)


@pytest.mark.parametrize("dtype", ["int32", "bool", "complex64", "float64", "int8"])
def test_dtypes_the_stage_does_not_take_are_refused(dtype):
    q, kp, vp, table, kc, vc, lens = _problem()
    q, kc, vc = (x.astype(dtype) for x in (q, kc, vc))
    with pytest.raises(TypeError, match=f"stage 'decode' does not take dtype {dtype}; it accepts float32, float16"):
        wb.decode(q, kc, vc, lens)
    as_torch = [torch.from_numpy(x) for x in (q, kc, vc, lens)]
    with pytest.raises(TypeError, match=f"does not take dtype {dtype}"):
        wb.decode(*as_torch)


def test_float64_points_to_the_reference_which_computes_it_exactly():
    q, kp, vp, table, kc, vc, lens = _problem()
    q, kp, vp, kc, vc = (x.astype(np.float64) for x in (q, kp, vp, kc, vc))
    with pytest.raises(TypeError, match="stage='reference' computes float64 exactly"):
        wb.decode(q, kc, vc, lens)
    out, lse = wb.decode(q, kp, vp, lens, block_table=table, stage="reference", return_lse=True)
    assert out.dtype == np.float64 and lse.dtype == np.float64
    group = 2
    for b, n in enumerate(lens):
        for h in range(4):
            scores = kc[b, h // group, :n] @ q[b, h] / 4.0
            weights = np.exp(scores - scores.max())
            np.testing.assert_allclose(out[b, h], weights @ vc[b, h // group, :n] / weights.sum(), rtol=1e-12)


def test_unsupported_head_dim_is_refused_as_wb_attention_refuses_it():
    q, kp, vp, table, kc, vc, lens = _problem(D=24)
    with pytest.raises(ValueError, match=r"stage 'decode' does not support head dim D=24; it supports D in"):
        wb.decode(q, kc, vc, lens)


def test_the_simulator_time_limit_applies_to_wb_decode_as_to_wb_attention():
    """A problem wb.attention(stage="decode") refuses at once on the simulator is refused by wb.decode too."""
    if not wb.BACKEND.is_simulator:
        pytest.skip("the limit is the simulator's")
    B, H, Hk, L, D = 1, 32, 8, 8192, 64
    q = np.zeros((B, H, D), np.float32)
    k = np.zeros((B, Hk, L, D), np.float32)
    lens = np.full(B, L, np.int32)
    with pytest.raises(ValueError, match="CUDA simulator"):
        wb.attention(q[:, :, None], np.repeat(k, 4, 1), np.repeat(k, 4, 1), stage="decode")
    with pytest.raises(ValueError, match=r"would take about \d+ s on the CUDA simulator .*WB_SIM_MAX_SECONDS"):
        wb.decode(q, k, k, lens)
    # many splits of a tiny cache: every split is a block that costs a tile, whatever its keys
    q, kp, vp, table, kc, vc, lens = _problem(B=4, H=16, Hk=8, D=64, lens=(64, 64, 64, 64))
    with pytest.raises(ValueError, match="num_splits=64"):
        wb.decode(q, kc, vc, lens, num_splits=64)


def test_lengths_past_a_paged_cache_hint_at_its_layout():
    q, kp, vp, table, kc, vc, lens = _problem()
    with pytest.raises(ValueError, match=r"in \[0, 8\].*if the pages are laid out NHD, pass kv_layout='NHD'"):
        wb.decode(q, kp, vp, np.array([9, 1], np.int32), block_table=table)


def test_block_table_without_pages_is_refused():
    q, kp, vp, table, kc, vc, lens = _problem()
    with pytest.raises(ValueError, match="at least one page"):
        wb.decode(q, kp, vp, np.zeros(2, np.int32), block_table=np.zeros((2, 0), np.int32))


def test_stage_and_layout_names_are_checked():
    q, kp, vp, table, kc, vc, lens = _problem()
    with pytest.raises(ValueError, match="decode stages: reference, decode"):
        wb.decode(q, kc, vc, lens, stage=["decode"])
    with pytest.raises(ValueError, match="kv_layout: expected 'HND'"):
        wb.decode(q, kc, vc, lens, kv_layout="nhd")


# ---------------------------------------------------------------- layouts: NHD and strided caches, read in place


def test_nhd_caches_give_the_hnd_answer():
    q, kp, vp, table, kc, vc, lens = _problem()
    expected = wb.decode(q, kc, vc, lens, num_splits=2)
    nhd = [np.ascontiguousarray(x.transpose(0, 2, 1, 3)) for x in (kc, vc, kp, vp)]  # (…, keys, Hk, D)
    np.testing.assert_array_equal(wb.decode(q, nhd[0], nhd[1], lens, num_splits=2, kv_layout="NHD"), expected)
    np.testing.assert_array_equal(
        wb.decode(q, nhd[2], nhd[3], lens, block_table=table, num_splits=2, kv_layout="NHD"), expected)
    as_torch = [torch.from_numpy(x) for x in (q, nhd[2], nhd[3], lens, table)]
    out = wb.decode(*as_torch[:4], block_table=as_torch[4], num_splits=2, kv_layout="NHD")
    np.testing.assert_array_equal(out.numpy(), expected)


def test_an_nhd_cache_read_as_hnd_is_refused_when_its_heads_cannot_be_hnd_heads():
    """(num_pages, page_size=3, Hk=2, D) read as HND has "Hk" = 3, which does not divide H = 4: refused, and the
    message names kv_layout='NHD'. (Where the page size divides H both readings are valid shapes: only kv_layout can
    say which one the caller means, see the module docstring.)"""
    q, kp, vp, table, kc, vc, lens = _problem(page_size=3, lens=(5, 6))
    nhd = np.ascontiguousarray(kp.transpose(0, 2, 1, 3))
    with pytest.raises(ValueError, match="If the cache is laid out NHD, pass kv_layout='NHD'"):
        wb.decode(q, nhd, nhd, lens, block_table=table)


def test_a_slice_of_a_longer_cache_is_read_without_copying_it():
    q, kp, vp, table, kc, vc, lens = _problem()
    longer = torch.zeros(2, 2, 32, 16)
    longer[:, :, :8] = torch.from_numpy(kc)
    sliced = longer[:, :, :8]  # strided: (B, Hk, 8 of 32 keys, D)
    assert not sliced.is_contiguous()
    out = wb.decode(torch.from_numpy(q), sliced, sliced, torch.from_numpy(lens), num_splits=2)
    np.testing.assert_array_equal(out.numpy(), wb.decode(q, kc, kc, lens, num_splits=2))


# ---------------------------------------------------------------- graph safety: the split count and the op


class _RecordingExtension:
    """Stands in for the CUDA extension: records what the launcher asks it to launch."""

    def __init__(self):
        self.calls = []

    def flash_decode_forward(self, q, k, v, table, lens, status, keys_per_split, num_splits, scale):
        self.calls.append((keys_per_split, num_splits, table is None))
        return q, q[:, :, 0]


def test_the_cuda_split_count_comes_from_the_capacity_or_the_bucket_never_from_the_lengths(monkeypatch):
    """The launch (and so a captured graph) depends on the cache's capacity, or max_seqlen, and the shapes: two calls
    whose lengths differ launch the same thing, and no length is read on the host."""
    from wb_kernels.stages.decode import build

    recorder = _RecordingExtension()
    monkeypatch.setattr(build, "extension", lambda: recorder)
    monkeypatch.setattr(launcher, "cuda_blocks_per_sm", lambda *a: 2)
    monkeypatch.setattr(launcher, "num_sms", lambda: 132)
    monkeypatch.setattr(launcher, "status_buffer", lambda index: None)
    launcher.cuda_launch_plan.cache_clear()

    q = torch.zeros(8, 32, 128, dtype=torch.float16)
    k = torch.zeros(8, 8, 8192, 128, dtype=torch.float16)
    for lengths in ([1] * 8, [8192] * 8, [17, 4000, 0, 1, 2, 3, 4, 5]):
        launcher.cuda_decode_forward(q, k, k, torch.tensor(lengths, dtype=torch.int32))
    launcher.cuda_decode_forward(q, k, k, torch.tensor([1] * 8, dtype=torch.int32), max_seqlen=1024)
    launcher.cuda_decode_forward(q, k, k, torch.tensor([900] * 8, dtype=torch.int32), max_seqlen=1024)
    launcher.cuda_launch_plan.cache_clear()
    by_capacity, by_bucket = recorder.calls[:3], recorder.calls[3:]
    assert len(set(by_capacity)) == 1 and len(set(by_bucket)) == 1
    keys, splits, contiguous = by_capacity[0]
    assert contiguous and keys * splits >= 8192  # the splits cover the capacity
    assert by_bucket[0][0] * by_bucket[0][1] >= 1024 and by_bucket[0][1] <= splits


def test_numba_path_with_device_lengths_covers_the_capacity(monkeypatch):
    """Where lengths live on a device (never read on the host), the numba kernels' splits cover the whole capacity,
    so max_seqlen below a length cannot drop keys; with host lengths it is checked."""
    seen = []
    monkeypatch.setattr(launcher, "split_kv_forward", lambda *a, **k: seen.append(k["max_len"]) or (
        np.zeros((2, 4, 1, 16), np.float32), np.zeros((2, 4, 1), np.float32)))

    q, kp, vp, table, kc, vc, lens = _problem()
    launcher.decode_forward(q, kc, vc, lens, max_seqlen=8)
    on_a_device = torch.from_numpy(lens).to("meta")  # (a stand-in for lengths on a GPU: not "cpu")
    launcher.decode_forward(q, kc, vc, on_a_device, max_seqlen=3)
    assert seen == [8, 8]


def test_the_op_fake_implementation_gives_shapes_and_dtypes():
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        q = torch.empty(3, 8, 64, dtype=torch.float16)
        k = torch.empty(10, 2, 16, 64, dtype=torch.float16)
        lens = torch.empty(3, dtype=torch.int32)
        table = torch.empty(3, 4, dtype=torch.int32)
        out, lse = wb.decode(q, k, k, lens, block_table=table, return_lse=True)
        assert out.shape == (3, 8, 64) and out.dtype == torch.float16
        assert lse.shape == (3, 8) and lse.dtype == torch.float32
        with pytest.raises(ValueError, match="Hk must divide H"):
            wb.decode(q[:, :3], k, k, lens, block_table=table)
    meta = [torch.empty(s, device="meta", dtype=d) for s, d in
            (((2, 4, 16), torch.float32), ((2, 2, 8, 16), torch.float32), ((2,), torch.int32))]
    out = wb.decode(meta[0], meta[1], meta[1], meta[2])
    assert out.shape == (2, 4, 16) and out.is_meta


def _op_args():
    q, kp, vp, table, kc, vc, lens = _problem()
    return (torch.from_numpy(q), torch.from_numpy(kp), torch.from_numpy(vp), torch.from_numpy(lens),
            torch.from_numpy(table), "decode", None, 2, None, "HND")


def test_opcheck_on_the_cpu():
    """torch.library.opcheck of torch.ops.wb.decode where the stage runs on the CPU (the numba kernels; the
    simulator here): schema, fake implementation against the real one, and the dispatcher's paths."""
    from wb_kernels.torch_ops import register

    register()
    torch.library.opcheck(torch.ops.wb.decode.default, _op_args(),
                          test_utils=("test_schema", "test_faketensor", "test_aot_dispatch_static"))
    out, lse = torch.ops.wb.decode(*_op_args())
    q, kp, vp, lens, table = _op_args()[:5]
    expected = wb.decode(q, kp, vp, lens, block_table=table, num_splits=2)
    torch.testing.assert_close(out, expected, rtol=0, atol=0)


def test_a_fullgraph_trace_takes_wb_decode():
    """torch.compile(fullgraph=True) traces a decode step without a graph break (the op is opaque to it); the
    aot_eager backend keeps this test cheap on the CPU (tests/test_decode_graph.py compiles with inductor on a GPU)."""
    q, kp, vp, lens, table = _op_args()[:5]

    def step(q, kp, vp, lens, table):
        return wb.decode(q * 1.0, kp, vp, lens, block_table=table, num_splits=2) + 1.0

    expected = step(q, kp, vp, lens, table)  # eager first: it registers the op if importing wb_kernels did not
    compiled = torch.compile(step, fullgraph=True, backend="aot_eager")
    torch.testing.assert_close(compiled(q, kp, vp, lens, table), expected, rtol=0, atol=0)


def test_the_op_is_registered_when_wb_kernels_comes_after_torch():
    """A compiler cannot register the op while it traces: importing wb_kernels after torch registers it, and the
    first eager call does otherwise (a compile before either says so)."""
    import subprocess
    import sys

    code = ("import torch, wb_kernels.torch_ops as op; assert op.registered(); "
            "print(torch.ops.wb.decode.default._schema.name)")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and "wb::decode" in done.stdout, done.stderr[-2000:]


# ---------------------------------------------------------------- very negative scores (GPU)

ON_GPU = wb.BACKEND.is_gpu


def _very_negative_problem(B, H, Hk, D, lens, magnitude, winners, *, page_size=16, seed=0, dtype="bfloat16",
                           scale=None):
    """Every score of every row near -`magnitude` (natural units), keys opposite to the query: q = a (1, ..., 1) per
    head, key j = -a f_j (1, ..., 1) with f_j = 1 (the row's largest score) or 1.25, so that the answer averages V over
    the keys with f = 1 and their LSE is near -magnitude. `winners`: which keys have f = 1: "all", "third" (a random
    third, the first key of each sequence among them) or "one" (one key per sequence, anywhere in it). In float16 the
    magnitude comes from the scale, in bfloat16 from the values. Returns q, the paged cache, its table, the
    contiguous cache (float64 numpy, already rounded to `dtype`), the lengths and the scale."""
    rng = np.random.default_rng(seed)
    capacity = max(max(lens), 1)
    pages_per_seq = -(-capacity // page_size)
    num_pages = B * pages_per_seq + 2
    scale = 1 / np.sqrt(D) if scale is None else scale
    side = float(np.sqrt(magnitude / (D * scale)))  # a^2 D scale = magnitude
    table = rng.permutation(num_pages)[:B * pages_per_seq].reshape(B, pages_per_seq).astype(np.int32)
    chosen = {"all": 1.0, "third": 1 / 3, "one": 0.0}[winners]
    f = np.where(rng.random((num_pages, Hk, page_size)) < chosen, 1.0, 1.25)
    for b, n in enumerate(lens):
        key = 0 if winners == "third" else int(rng.integers(max(n, 1)))
        f[table[b, key // page_size], :, key % page_size] = 1.0
    kp = -side * f[..., None] * np.ones(D)
    vp = rng.standard_normal((num_pages, Hk, page_size, D))
    q = side * np.ones((B, H, D))
    q, kp, vp = (torch.from_numpy(x).to(getattr(torch, dtype)).double().numpy() for x in (q, kp, vp))
    full = pages_per_seq * page_size
    kc = np.stack([launcher.gather_pages(kp, table, full, b) for b in range(B)])
    vc = np.stack([launcher.gather_pages(vp, table, full, b) for b in range(B)])
    return q, kp, vp, table, kc, vc, np.asarray(lens, np.int32), scale


def _float64_decode(q, kc, vc, lens, scale):
    """The answer in float64: softmax(q k^T scale) v per query head over the sequence's first lens[b] keys."""
    B, H, D = q.shape
    group = H // kc.shape[1]
    out, lse = np.zeros((B, H, D)), np.full((B, H), -np.inf)
    for b in range(B):
        n = int(lens[b])
        if n == 0:
            continue
        for h in range(H):
            s = kc[b, h // group, :n] @ q[b, h] * scale
            top = s.max()
            w = np.exp(s - top)
            out[b, h] = w @ vc[b, h // group, :n] / w.sum()
            lse[b, h] = top + np.log(w.sum())
    return out, lse


@pytest.mark.skipif(not ON_GPU, reason="needs a CUDA GPU: the CUDA C++ decode kernels")
@pytest.mark.parametrize("magnitude", [1e31, 1e33, 1e35])
@pytest.mark.parametrize("H, Hk, kernel", [(8, 2, "split"), (16, 2, "mma"), (32, 1, "mma")])
@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_gpu_very_negative_scores_are_computed_not_taken_for_masking(magnitude, H, Hk, kernel, dtype, monkeypatch):
    """Scores around -1e31 .. -1e35 in every row: the answer averages V over the keys with the largest score, and the
    LSE is near -magnitude, as the float64 reference says; the kernels' finite minus infinity (-1e30 until issue 45)
    made such rows look like rows that see no key (zeros, LSE -inf). The split kernel (groups up to 4) and the
    tensor-core kernel (larger groups), contiguous and paged caches; an empty sequence still gives 0 and -inf.

    Several largest keys ("all", "third") with one split: the block's own merges (lanes, warps, slices) keep each
    state's maximum and sum apart, so the average is exact. One largest key ("one") also with the launcher's split
    count and 8 splits: the merges weigh the splits by their LSEs, all near -magnitude. (Splits that each hold
    several largest keys are weighed alike: at |LSE| ~ 1e31 a float32 LSE has no room for the log of a split's
    count, whose ulp is ~1e24; the merge of splits rounds so from |LSE| ~ 1e7 on, as FlashDecoding's does.)"""
    from wb_kernels.stages.decode import build

    assert launcher.cuda_kernel_for(H, Hk) == kernel
    used = []
    real = build.extension()

    class Recording:
        def __getattr__(self, name):
            if name.startswith("flash_decode") and name.endswith("forward"):
                used.append(name)
            return getattr(real, name)

    monkeypatch.setattr(build, "extension", lambda: Recording())
    D = 128 if H == 16 else 64
    # float16 holds values up to 65504: its scores reach the magnitude through the scale (values of 100)
    scale = magnitude / (D * 100.0 ** 2) if dtype == "float16" else None
    for winners, splits in (("all", (1,)), ("third", (1,)), ("one", (None, 1, 8))):
        q, kp, vp, table, kc, vc, lens, scale = _very_negative_problem(
            4, H, Hk, D, [700, 1, 0, 333], magnitude, winners, dtype=dtype, scale=scale,
            seed=int(np.log10(magnitude)) + H)
        want_out, want_lse = _float64_decode(q, kc, vc, lens, scale)
        assert np.all(want_lse[lens > 0] < -0.5 * magnitude)  # the problem is what it says
        as_cuda = lambda x: torch.from_numpy(np.ascontiguousarray(x)).cuda().to(getattr(torch, dtype))  # noqa: E731
        q_, kp_, vp_, kc_, vc_ = (as_cuda(x) for x in (q, kp, vp, kc, vc))
        table_, lens_ = torch.from_numpy(table).cuda(), torch.from_numpy(lens).cuda()
        for num_splits in splits:
            for paged in (False, True):
                cache = (kp_, vp_) if paged else (kc_, vc_)
                out, lse = wb.decode(q_, *cache, lens_, block_table=table_ if paged else None, scale=scale,
                                     num_splits=num_splits, return_lse=True)
                where = (f"{kernel} kernel, {dtype}, {winners} largest, {'paged' if paged else 'contiguous'}, "
                         f"splits {num_splits}")
                got_out, got_lse = out.double().cpu().numpy(), lse.double().cpu().numpy()
                np.testing.assert_allclose(got_out, want_out, rtol=2e-2, atol=2e-2, err_msg=where)
                np.testing.assert_allclose(got_lse[lens > 0], want_lse[lens > 0], rtol=1e-4, err_msg=where)
                assert np.all(np.isneginf(got_lse[lens == 0])) and np.all(got_out[lens == 0] == 0), where
    assert set(used) == {"flash_decode_mma_forward" if kernel == "mma" else "flash_decode_forward"}
