"""wb.decode on a GPU as a serving engine uses it (issue #30): captured in a CUDA graph and replayed on two streams
with other cache contents and lengths, compiled with torch.compile(fullgraph=True), opcheck'ed, run on two streams
at once; lengths on the GPU that the launch does not cover (a max_seqlen below them) or that exceed the cache are
computed in full or clamped and reported by ``decode_problems``; NHD, strided and sliced caches read in place;
misaligned ones refused. Every result is held to the float64 reference. All of it needs a CUDA GPU (skipped here);
the CPU side of the same promises is tests/test_decode_robustness.py.
"""

from __future__ import annotations

import pytest

import wb_kernels as wb
from wb_kernels import api, execution, validation

torch = pytest.importorskip("torch")

pytestmark = pytest.mark.skipif(not (wb.BACKEND.is_gpu and torch.cuda.is_available()),
                                reason="needs a CUDA GPU (runs on the numba simulator here)")

TOLERANCE = {torch.float16: 3e-3, torch.bfloat16: 2e-2}


def _reference(q, k, v, lens, table=None, kv_layout="HND"):
    """float64 (out, lse) of the problem as the caller gave it (read back from the GPU)."""
    k, v = validation.as_hnd(k, kv_layout), validation.as_hnd(v, kv_layout)
    out, lse = execution.reference_decode(q, k, v, lens.cpu(), block_table=None if table is None else table.cpu())
    return torch.from_numpy(out), torch.from_numpy(lse)


def _assert_matches(out, q, k, v, lens, table=None, kv_layout="HND", lse=None):
    expected, expected_lse = _reference(q, k, v, lens, table, kv_layout)
    tol = TOLERANCE[q.dtype]
    torch.testing.assert_close(out.double().cpu(), expected, atol=tol, rtol=tol)
    if lse is not None:
        finite = torch.isfinite(expected_lse)
        torch.testing.assert_close(lse.double().cpu()[finite], expected_lse[finite], atol=1e-3, rtol=1e-3)
        assert torch.isneginf(lse.cpu()[~finite]).all()


def _random_cache(B, H, Hk, D, capacity, *, page_size=None, dtype=torch.float16, seed=0):
    """q, k, v (contiguous (B, Hk, capacity, D), or pages with a shuffled table when page_size is given), table."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    q = torch.randn(B, H, D, device="cuda", generator=g).to(dtype)
    if page_size is None:
        k, v = (torch.randn(B, Hk, capacity, D, device="cuda", generator=g).to(dtype) for _ in range(2))
        return q, k, v, None
    pages_per_seq = -(-capacity // page_size)
    num_pages = B * pages_per_seq + 5
    k, v = (torch.randn(num_pages, Hk, page_size, D, device="cuda", generator=g).to(dtype) for _ in range(2))
    table = torch.randperm(num_pages, device="cuda", generator=g)[:B * pages_per_seq]
    return q, k, v, table.reshape(B, pages_per_seq).to(torch.int32)


# ---------------------------------------------------------------- CUDA graphs, streams, torch.compile, opcheck


@pytest.mark.parametrize("paged", [False, True], ids=["contiguous", "paged"])
def test_gpu_decode_captured_in_a_cuda_graph_replays_on_two_streams(paged):
    """One capture with a length bucket of 1024; replayed on stream 1 and on stream 2, each time with new cache
    contents and new lengths (0, 1, odd, at the bucket, and one past it, which the last split reads in full and
    decode_problems reports); both replays match the float64 reference."""
    B, H, Hk, D, capacity = 4, 32, 8, 128, 2048
    q, k, v, table = _random_cache(B, H, Hk, D, capacity, page_size=16 if paged else None, seed=1)
    lens = torch.full((B,), 5, dtype=torch.int32, device="cuda")
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up off the default stream, as torch.cuda.graphs asks
        wb.decode(q, k, v, lens, block_table=table, max_seqlen=1024)
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    api.decode_problems()  # start with no flag raised

    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out, lse = wb.decode(q, k, v, lens, block_table=table, max_seqlen=1024, return_lse=True)

    streams = [torch.cuda.Stream(), torch.cuda.Stream()]
    for stream, seed, lengths, late in ((streams[0], 2, [0, 1, 1000, 517], False),
                                        (streams[1], 3, [1024, 3, 2000, 64], True)):
        fresh = _random_cache(B, H, Hk, D, capacity, page_size=16 if paged else None, seed=seed)
        for static, new in zip((q, k, v, table), fresh):
            if static is not None:
                static.copy_(new)
        lens.copy_(torch.tensor(lengths, dtype=torch.int32))
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            graph.replay()
        torch.cuda.current_stream().wait_stream(stream)
        torch.cuda.synchronize()
        _assert_matches(out, q, k, v, lens, table, lse=lse)
        problems = api.decode_problems()
        assert bool(problems) == late and all("max_seqlen" in p for p in problems), problems


def test_gpu_two_streams_at_once_each_with_its_own_counters():
    """Calls queued on two streams, interleaved, never share the fused merge's counters (each call owns its own)."""
    problems = [_random_cache(8, 32, 8, 128, 4096, seed=s) for s in (4, 5)]
    lens = [torch.randint(0, 4097, (8,), device="cuda", dtype=torch.int32) for _ in range(2)]
    expected = [wb.decode(q, k, v, n, num_splits=16) for (q, k, v, _), n in zip(problems, lens)]
    streams = [torch.cuda.Stream(), torch.cuda.Stream()]
    outs = [[], []]
    for stream in streams:
        stream.wait_stream(torch.cuda.current_stream())
    for _ in range(20):
        for i, stream in enumerate(streams):
            with torch.cuda.stream(stream):
                q, k, v, _ = problems[i]
                outs[i].append(wb.decode(q, k, v, lens[i], num_splits=16))
    torch.cuda.synchronize()
    for i in range(2):
        for out in outs[i]:
            assert torch.equal(out, expected[i])
        q, k, v, _ = problems[i]
        _assert_matches(expected[i], q, k, v, lens[i])


@pytest.mark.parametrize("mode", ["default", "reduce-overhead"])
def test_gpu_torch_compile_fullgraph_takes_wb_decode(mode):
    """A decode step (projection, wb.decode, another op) compiles with fullgraph=True; with reduce-overhead,
    inductor's CUDA graphs replay it with other lengths."""
    q, k, v, _ = _random_cache(2, 16, 4, 64, 1024, seed=6)
    weight = torch.randn(64, 64, device="cuda", dtype=torch.float16) / 8

    def step(q, k, v, lens):
        return wb.decode(q @ weight, k, v, lens, max_seqlen=512) @ weight

    compiled = torch.compile(step, fullgraph=True, mode=None if mode == "default" else mode)
    for lengths in ([512, 1], [17, 300], [0, 511], [256, 512]):
        lens = torch.tensor(lengths, dtype=torch.int32, device="cuda")
        expected = step(q, k, v, lens)  # eager first: an eager call registers the op if importing wb_kernels did not
        torch.testing.assert_close(compiled(q, k, v, lens).float(), expected.float(), atol=1e-2, rtol=1e-2)


def test_gpu_opcheck():
    from wb_kernels.torch_ops import register

    register()
    q, k, v, table = _random_cache(3, 8, 2, 128, 100, page_size=16, seed=7)
    lens = torch.tensor([0, 37, 100], dtype=torch.int32, device="cuda")
    torch.library.opcheck(torch.ops.wb.decode.default, (q, k, v, lens, table, "decode", None, None, 128, "HND"))
    torch.library.opcheck(torch.ops.wb.decode.default, (q, k, v, lens, table, "decode", 0.3, 3, None, "HND"))


# ---------------------------------------------------------------- lengths on the GPU: covered, clamped, reported


def test_gpu_max_seqlen_below_a_device_length_loses_no_key_and_is_reported():
    q, k, v, _ = _random_cache(3, 32, 8, 128, 8192, seed=8)
    lens = torch.tensor([8192, 100, 4000], dtype=torch.int32, device="cuda")
    api.decode_problems()
    out, lse = wb.decode(q, k, v, lens, max_seqlen=256, return_lse=True)
    _assert_matches(out, q, k, v, lens, lse=lse)
    (problem,) = api.decode_problems()
    assert "above max_seqlen" in problem and "pass a larger max_seqlen" in problem
    assert api.decode_problems() == []  # read and reset
    wb.decode(q, k, v, lens, max_seqlen=8192)
    assert api.decode_problems() == []


def test_gpu_lengths_outside_the_cache_are_clamped_and_reported():
    q, k, v, _ = _random_cache(2, 8, 2, 64, 300, seed=9)
    api.decode_problems()
    out = wb.decode(q, k, v, torch.tensor([301, -4], dtype=torch.int32, device="cuda"))
    _assert_matches(out, q, k, v, torch.tensor([300, 0], dtype=torch.int32))
    (problem,) = api.decode_problems(reset=False)
    assert "outside [0, the cache's capacity]" in problem
    assert api.decode_problems() == [problem] and api.decode_problems() == []



@pytest.mark.parametrize("D", [64, 128])
@pytest.mark.parametrize("H, Hk", [(8, 8), (32, 8)], ids=["group1", "group4"])
def test_gpu_split_kernel_clamps_and_reports_a_page_outside_the_pool(H, Hk, D):
    """The split kernel (groups below the tensor-core kernel's) reads the nearest page for a table entry outside the
    pool and raises status bit 4, whichever split the entry falls in; a valid table raises nothing."""
    q, k, v, table = _random_cache(3, H, Hk, D, 700, page_size=16, seed=11)
    lens = torch.tensor([700, 333, 517], dtype=torch.int32, device="cuda")
    api.decode_problems()
    out = wb.decode(q, k, v, lens, block_table=table, num_splits=4)
    _assert_matches(out, q, k, v, lens, table)
    assert api.decode_problems() == []
    bad = table.clone()
    bad[0, 40] = k.shape[0] + 10  # keys 640-655 of sequence 0: its last split
    bad[2, 3] = -3  # keys 48-63 of sequence 2: its first split
    out = wb.decode(q, k, v, lens, block_table=bad, num_splits=4)
    assert not bool(out.isnan().any())
    _assert_matches(out, q, k, v, lens, bad.clamp(0, k.shape[0] - 1))
    problems = api.decode_problems()
    assert any("page number" in p for p in problems), problems

# ---------------------------------------------------------------- layouts: read in place, or refused clearly


def test_gpu_nhd_and_strided_caches_are_read_in_place():
    """An NHD cache (B, L, Hk, D), paged NHD pages whose page size (16) divides H (32) named by kv_layout, and the
    first 3000 keys of a longer cache give the contiguous HND answer bit for bit, and allocate no copy of the cache."""
    B, H, Hk, D, L = 4, 32, 8, 128, 3000
    q, k, v, _ = _random_cache(B, H, Hk, D, L, seed=10)
    lens = torch.tensor([3000, 1, 0, 1234], dtype=torch.int32, device="cuda")
    expected = wb.decode(q, k, v, lens, num_splits=8)
    _assert_matches(expected, q, k, v, lens)
    cache_bytes = k.numel() * k.element_size()

    def without_copy(call):
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
        out = call()
        torch.cuda.synchronize()
        assert torch.cuda.max_memory_allocated() - before < cache_bytes / 4  # workspace, never a cache
        return out

    k_nhd, v_nhd = (x.transpose(1, 2).contiguous() for x in (k, v))  # (B, L, Hk, D)
    out = without_copy(lambda: wb.decode(q, k_nhd, v_nhd, lens, num_splits=8, kv_layout="NHD"))
    assert torch.equal(out, expected)

    longer_k, longer_v = (torch.zeros(B, Hk, 4096, D, device="cuda", dtype=k.dtype) for _ in range(2))
    longer_k[:, :, :L], longer_v[:, :, :L] = k, v
    out = without_copy(lambda: wb.decode(q, longer_k[:, :, :L], longer_v[:, :, :L], lens, num_splits=8))
    assert torch.equal(out, expected)

    page = 16
    pages = -(-L // page)
    table = torch.arange(B * pages, device="cuda", dtype=torch.int32).reshape(B, pages)
    padded = [torch.zeros(B, Hk, pages * page, D, device="cuda", dtype=k.dtype) for _ in range(2)]
    padded[0][:, :, :L], padded[1][:, :, :L] = k, v
    k_pages, v_pages = (x.reshape(B, Hk, pages, page, D).permute(0, 2, 3, 1, 4).reshape(B * pages, page, Hk, D)
                        for x in padded)  # NHD pages (num_pages, page_size, Hk, D)
    out = wb.decode(q, k_pages, v_pages, lens, block_table=table, kv_layout="NHD", num_splits=8)
    _assert_matches(out, q, k_pages, v_pages, lens, table, kv_layout="NHD")
    torch.testing.assert_close(out, expected, atol=0, rtol=0)


def test_gpu_caches_the_kernel_cannot_read_are_refused_with_what_to_do():
    B, H, Hk, D, L = 2, 8, 2, 64, 40
    q, k, v, _ = _random_cache(B, H, Hk, D, L, seed=11)
    lens = torch.tensor([40, 7], dtype=torch.int32, device="cuda")
    wide = torch.zeros(B, Hk, L, 68, device="cuda", dtype=k.dtype)[..., :64]  # a row stride of 68: not 8-aligned
    with pytest.raises(ValueError, match="strides multiples of 8 .*Allocate the cache once"):
        wb.decode(q, wide, wide, lens)
    shifted = torch.zeros(k.numel() + 1, device="cuda", dtype=k.dtype)[1:].view(k.shape)  # 2 bytes off
    with pytest.raises(ValueError, match="16-byte aligned"):
        wb.decode(q, shifted, shifted, lens)
    with pytest.raises(ValueError, match="same strides"):
        wb.decode(q, k, v.transpose(1, 2).contiguous().transpose(1, 2), lens)
    # q is small: a misaligned or strided q is copied, not refused
    q_shifted = torch.zeros(q.numel() + 1, device="cuda", dtype=q.dtype)[1:].view(q.shape)
    q_shifted.copy_(q)
    assert torch.equal(wb.decode(q_shifted, k, v, lens, num_splits=2), wb.decode(q, k, v, lens, num_splits=2))


@pytest.mark.parametrize("dtype", [torch.int32, torch.bool, torch.complex64, torch.float64])
def test_gpu_dtypes_no_kernel_takes_are_refused(dtype):
    q = torch.zeros(2, 8, 64, device="cuda").to(dtype)
    k = torch.zeros(2, 2, 40, 64, device="cuda").to(dtype)
    with pytest.raises(TypeError, match="does not take dtype"):
        wb.decode(q, k, k, torch.ones(2, dtype=torch.int32, device="cuda"))


def test_gpu_lengths_on_another_gpu_or_kind_are_refused_or_copied():
    q, k, v, _ = _random_cache(2, 8, 2, 64, 40, seed=12)
    cpu_lens = torch.tensor([40, 7], dtype=torch.int32)
    out = wb.decode(q, k, v, cpu_lens)  # the CPU: a copy per call (fine eagerly, not in a graph)
    _assert_matches(out, q, k, v, cpu_lens)
    with pytest.raises(TypeError, match="cache_seqlens: expected a dtype among int32"):
        wb.decode(q, k, v, cpu_lens.cuda().long())
    wb.decode(q, k, v, cpu_lens.cuda())  # warm-up before the capture
    graph = torch.cuda.CUDAGraph()
    with pytest.raises(ValueError, match="must be on the GPU .*update them in place"):
        with torch.cuda.graph(graph):
            wb.decode(q, k, v, cpu_lens)


_FIRST_CALL_IN_A_CAPTURE = """
import torch, wb_kernels as wb
q = torch.randn(1, 8, 64, device="cuda", dtype=torch.float16)
k = torch.randn(1, 2, 64, 64, device="cuda", dtype=torch.float16)
lens = torch.full((1,), 64, dtype=torch.int32, device="cuda")
graph = torch.cuda.CUDAGraph()
try:
    with torch.cuda.graph(graph):
        wb.decode(q, k, k, lens)
    print("captured")
except ValueError as error:
    print("refused", "call it once before capturing" in str(error))
"""


def test_gpu_first_call_inside_a_capture_is_refused_with_what_to_do():
    """A fresh process whose first wb.decode is inside a capture: refused (its status word would come from the graph's
    pool, zeroed by every replay), saying to call it once before."""
    import subprocess
    import sys

    found = subprocess.run([sys.executable, "-c", _FIRST_CALL_IN_A_CAPTURE], capture_output=True, text=True,
                           timeout=300)
    assert found.stdout.strip().splitlines()[-1:] == ["refused True"], found.stdout + found.stderr[-2000:]
