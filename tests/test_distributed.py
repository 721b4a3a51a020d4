"""Exact attention across processes (issue #32, wb_kernels/stages/distributed): pure functions in-process, and
every method under torchrun on gloo at W = 2 and W = 4 in float64 against one process's result.

A hang is a failure: each launch runs in its own process group under a hard time limit and is killed whole when
it passes it; the ranks' collectives also time out on their own (--timeout).
"""

from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from wb_kernels.reference import causal_offset
from wb_kernels.stages.decode.splitkv import merge_partials, partial_attention
from wb_kernels.stages.distributed import merge, run, scaling, sharding

ROOT = Path(__file__).resolve().parents[1]
LAUNCH_SECONDS = 150  # a launch takes ~6 s at W = 2 and ~11 s at W = 4 on 2 idle cores


# ---- the merge -------------------------------------------------------------------------------------------------

def _partials(rng, rows=6, keys=11, D=5, cuts=(0, 4, 4, 11)):
    """Partials of attention over the key splits cut at `cuts` (one empty split), some rows masked out entirely
    in one split, and row 0 in every split: a row that sees no key."""
    q, k, v = rng.standard_normal((rows, D)), rng.standard_normal((keys, D)), rng.standard_normal((keys, D))
    allowed = rng.random((rows, keys)) < 0.6
    allowed[0] = False
    allowed[1, :4] = False
    parts = [partial_attention(q, k[a:b], v[a:b], 0.4, allowed[:, a:b]) for a, b in zip(cuts, cuts[1:])]
    return parts, partial_attention(q, k, v, 0.4, allowed)


def test_merge_pair_is_lesson_07s_merge():
    parts, (full_out, full_lse) = _partials(np.random.default_rng(0))
    acc_out, acc_lse = (torch.zeros(6, 5, dtype=torch.float64), torch.full((6,), -math.inf, dtype=torch.float64))
    for out, lse in parts:  # folded pair by pair, as the ring does
        acc_out, acc_lse = merge.merge_pair(acc_out, acc_lse, torch.from_numpy(out), torch.from_numpy(lse))
    want_out, want_lse = merge_partials([p[0] for p in parts], [p[1] for p in parts])
    assert not torch.isnan(acc_out).any() and not torch.isnan(acc_lse).any()
    np.testing.assert_allclose(acc_out.numpy(), want_out, rtol=0, atol=1e-15)
    np.testing.assert_allclose(acc_out.numpy(), full_out, rtol=0, atol=1e-14)
    assert acc_lse[0] == -math.inf and (acc_out[0] == 0).all()  # the row that sees no key
    np.testing.assert_allclose(acc_lse.numpy()[1:], want_lse[1:], rtol=0, atol=1e-14)
    np.testing.assert_allclose(acc_lse.numpy()[1:], full_lse[1:], rtol=0, atol=1e-14)


def test_merge_stack_in_float32_keeps_float32_and_empty_rows():
    parts, (full_out, _) = _partials(np.random.default_rng(1))
    outs = torch.stack([torch.from_numpy(p[0]).float() for p in parts])
    lses = torch.stack([torch.from_numpy(p[1]).float() for p in parts])
    out, lse = merge.merge_stack(outs, lses)
    assert out.dtype == lse.dtype == torch.float32
    np.testing.assert_allclose(out.numpy(), full_out, rtol=0, atol=1e-6)
    assert lse[0] == -math.inf and (out[0] == 0).all()
    assert merge.accumulation_dtype(torch.bfloat16) == merge.accumulation_dtype(torch.float16) == torch.float32
    assert merge.accumulation_dtype(torch.float64) == torch.float64


def test_merge_into_is_merge_pair_in_place():
    parts, (full_out, full_lse) = _partials(np.random.default_rng(3))
    acc_out, acc_lse = torch.zeros(6, 5, dtype=torch.float64), torch.full((6,), -math.inf, dtype=torch.float64)
    for out, lse in parts:  # into views of halves of the rows, as the ring merges into acc[:, :, rows]
        for rows in (slice(0, 3), slice(3, 6)):
            merge.merge_into(acc_out[rows], acc_lse[rows], torch.from_numpy(out)[rows], torch.from_numpy(lse)[rows])
    assert acc_lse[0] == -math.inf and (acc_out[0] == 0).all() and not torch.isnan(acc_out).any()
    np.testing.assert_allclose(acc_out.numpy(), full_out, rtol=0, atol=1e-14)
    np.testing.assert_allclose(acc_lse.numpy()[1:], full_lse[1:], rtol=0, atol=1e-14)
    half_out = torch.zeros(6, 5)  # float32 accumulator, float16 partial: converted on the fly
    half_lse = torch.full((6,), -math.inf)
    merge.merge_into(half_out, half_lse, torch.from_numpy(parts[2][0]).half(), torch.from_numpy(parts[2][1]).float())
    assert half_out.dtype == torch.float32
    np.testing.assert_allclose(half_out.numpy(), parts[2][0], rtol=0, atol=1e-3)


def test_pack_unpack_round_trip():
    out, lse = torch.randn(2, 3, 4, 5).half(), torch.randn(2, 3, 4)
    lse[0, 0, 0] = -math.inf
    back_out, back_lse = merge.unpack(merge.pack(out, lse), torch.float16)
    assert back_out.dtype == torch.float16 and torch.equal(back_out, out) and torch.equal(back_lse, lse)


# ---- sharding ----------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("layout", sharding.LAYOUTS)
@pytest.mark.parametrize("length,world", [(37, 2), (37, 4), (5, 4), (0, 2), (64, 4), (1, 3)])
def test_shards_cover_every_position_once(layout, length, world):
    indices = [sharding.local_indices(length, world, r, layout) for r in range(world)]
    assert sorted(np.concatenate(indices).tolist()) == list(range(length))
    sizes = [len(i) for i in indices]
    assert sizes == [sharding.shard_length(length, world, r, layout) for r in range(world)]
    assert max(sizes) - min(sizes) <= (1 if layout == "contiguous" else 2)


def test_zigzag_holds_chunk_r_and_its_mirror():
    chunks = sharding.chunk_bounds(37, 8)  # 37 = 8 * 4 + 5: the first five chunks are one longer
    assert [b - a for a, b in chunks] == [5] * 5 + [4] * 3
    for r in range(4):
        assert sharding.shard_pieces(37, 4, r, "zigzag") == [chunks[r], chunks[7 - r]]
    assert sharding.local_indices(10, 2, 0, "zigzag").tolist() == [0, 1, 2, 8, 9]
    assert sharding.local_indices(10, 2, 1, "zigzag").tolist() == [3, 4, 5, 6, 7]


def test_sharding_refuses_bad_arguments():
    with pytest.raises(ValueError, match="layout"):
        sharding.shard_pieces(10, 2, 0, "striped")
    with pytest.raises(ValueError, match="rank 2"):
        sharding.shard_pieces(10, 2, 2)
    with pytest.raises(ValueError, match="chunks"):
        sharding.chunk_bounds(10, 0)


def _mask(q_range, k_range, offset):
    rows, cols = np.arange(*q_range)[:, None], np.arange(*k_range)[None, :]
    return np.ones((len(rows), cols.shape[1]), bool) if offset is None else cols <= rows + offset


@pytest.mark.parametrize("causal", [False, "top_left", "bottom_right"])
def test_pair_blocks_cover_exactly_the_visible_pairs(causal):
    rng = np.random.default_rng(2)
    for _ in range(300):
        Lq, Lk = rng.integers(1, 30, size=2)
        offset = causal_offset(causal, int(Lq), int(Lk))
        qa, qb = sorted(rng.integers(0, Lq + 1, size=2))
        ka, kb = sorted(rng.integers(0, Lk + 1, size=2))
        want = _mask((qa, qb), (ka, kb), offset)
        got = np.zeros_like(want, dtype=int)
        for (q0, q1), (k0, k1), block_causal in sharding.pair_blocks((qa, qb), (ka, kb), offset):
            # each call's own mask, as wb.attention applies it to the sub-block
            local = _mask((0, q1 - q0), (0, k1 - k0), causal_offset(block_causal, q1 - q0, k1 - k0))
            assert local.any(axis=1).all(), "a call holds a row that sees none of its keys"
            got[q0 - qa:q1 - qa, k0 - ka:k1 - ka] += local
        assert (got == want).all()
        assert sharding.visible_pairs((qa, qb), (ka, kb), offset) == want.sum()


def test_pair_blocks_full_diagonal_skipped():
    assert sharding.pair_blocks((10, 20), (0, 10), 0) == [((10, 20), (0, 10), False)]  # keys before the queries
    assert sharding.pair_blocks((0, 10), (10, 20), 0) == []  # keys after: skipped
    assert sharding.pair_blocks((10, 20), (10, 20), 0) == [((10, 20), (10, 20), "bottom_right")]  # the diagonal
    assert sharding.pair_blocks((0, 10), (10, 20), None) == [((0, 10), (10, 20), False)]


# ---- the causal ceiling and zigzag's balance --------------------------------------------------------------------

def test_causal_ceiling_formula():
    assert sharding.causal_ceiling(1) == 1
    assert sharding.causal_ceiling(2) == pytest.approx(2 / 3)
    assert sharding.causal_ceiling(8) == pytest.approx(8 / 15)  # 53 %: ring-flash-attention's 52 % on 8 GPUs
    with pytest.raises(ValueError):
        sharding.causal_ceiling(0)


@pytest.mark.parametrize("world", [2, 4, 8])
def test_contiguous_causal_ring_meets_the_ceiling(world):
    work = sharding.ring_work(world * 2000, world * 2000, world, "contiguous", causal_offset=0)
    # counted in pairs the diagonal block is n (n + 1) / 2, not n^2 / 2: the ceiling up to 1 / n
    assert sharding.predicted_efficiency(work) == pytest.approx(sharding.causal_ceiling(world), abs=1e-3)
    assert work[1:, 0].sum() == 0 and (work[1:, -1] == 2000 ** 2).all()  # rank 0 idles, the last rank never does


@pytest.mark.parametrize("world", [2, 4, 8])
def test_zigzag_balances_causal_work(world):
    work = sharding.ring_work(world * 64, world * 64, world, "zigzag", causal_offset=0)
    assert (work == work[:, :1]).all()  # every rank the same work at every step: L divisible by 2W
    assert sharding.predicted_efficiency(work) == 1.0
    odd = sharding.ring_work(world * 64 + 3, world * 64 + 3, world, "zigzag", causal_offset=0)
    assert sharding.predicted_efficiency(odd) > 0.97  # unequal chunks: nearly balanced
    assert sharding.predicted_efficiency(sharding.ring_work(world * 25, world * 25, world, "contiguous", None)) == 1.0


# ---- one process (W = 1): dtypes and errors, without torchrun ---------------------------------------------------

@pytest.fixture
def single_rank():
    """A gloo group of one rank in this process (no network: an in-memory store), torn down after the test."""
    import torch.distributed as dist

    if dist.is_initialized():
        pytest.skip("a process group is already initialized in this process")
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield dist
    dist.destroy_process_group()


def test_single_rank_methods_keep_dtypes(single_rank):
    import wb_kernels as wb
    from wb_kernels.stages.distributed.decode import split_kv_decode
    from wb_kernels.stages.distributed.ring import ring_attention
    from wb_kernels.stages.distributed.ulysses import ulysses_attention

    q, k, v, mask = run.make_inputs(run.Case(2, 4, 2, 9, 13, 8, "bottom_right", True), torch.float32, "cpu", 0)
    want_out, want_lse = wb.attention(q, k, v, causal="bottom_right", key_padding_mask=mask, return_lse=True)
    for method in (lambda: ring_attention(q, k, v, Lq=9, Lk=13, causal="bottom_right", key_padding_mask=mask),
                   lambda: split_kv_decode(q, k, v, Lk=13, causal="bottom_right", key_padding_mask=mask),
                   lambda: ulysses_attention(q, k, v, Lq=9, Lk=13, causal="bottom_right", key_padding_mask=mask)):
        out, lse = method()
        assert out.dtype == lse.dtype == torch.float32  # fp32 accumulation, the caller's dtype out
        assert run._error(out, want_out) < 1e-6 and run._error(lse, want_lse) < 1e-6
        assert lse[-1].eq(-math.inf).all() and out[-1].eq(0).all()  # the sequence with no key


def test_wrong_shards_are_refused(single_rank):
    from wb_kernels.stages.distributed.decode import split_kv_decode
    from wb_kernels.stages.distributed.ring import ring_attention

    q, k, v, _ = run.make_inputs(run.Case(1, 2, 2, 9, 13, 8), torch.float64, "cpu", 0)
    with pytest.raises(ValueError, match="should hold 9 queries and 13 keys"):
        ring_attention(q, k[:, :, :12], v[:, :, :12], Lq=9, Lk=13)
    with pytest.raises(ValueError, match="should hold 14 keys"):
        split_kv_decode(q, k, v, Lk=14)


def test_single_rank_ring_backward_is_lesson_08s(single_rank):
    """W = 1: one block, the whole forward's out and LSE: the gradients of reference_backward; wrong shards refused."""
    import wb_kernels as wb
    from wb_kernels.stages.distributed.ring import ring_attention, ring_attention_backward

    q, k, v, mask = run.make_inputs(run.Case(2, 4, 2, 9, 13, 8, "bottom_right", True), torch.float64, "cpu", 0)
    dout = torch.randn(q.shape, dtype=torch.float64)
    out, lse = ring_attention(q, k, v, Lq=9, Lk=13, causal="bottom_right", key_padding_mask=mask)
    grads = ring_attention_backward(q, k, v, out, lse, dout, Lq=9, Lk=13, causal="bottom_right", key_padding_mask=mask,
                                    overlap=False)
    want = wb.attention_backward(q, k, v, dout, causal="bottom_right", key_padding_mask=mask)
    assert all(run._error(got, ref) < 1e-14 for got, ref in zip(grads, want))
    assert grads[0][-1].eq(0).all()  # the sequence with no key: no gradient
    with pytest.raises(ValueError, match="should hold 9 queries"):
        ring_attention_backward(q, k, v, out[:, :, :8], lse, dout, Lq=9, Lk=13)


def _descriptions(world, Lq=9, Lk=9, H=6, Hk=2, **changes):
    """What `world` ranks would exchange for a contiguous Ulysses or ring call (agreement.describe), with
    `changes` = {rank: {argument: value}} applied to some ranks."""
    from wb_kernels.stages.distributed import agreement

    rows = []
    for rank in range(world):
        q, k, v, _ = run.make_inputs(run.Case(1, H, Hk, Lq, Lk, 8), torch.float64, "cpu", 0)
        call = dict(q=q[:, :, :sharding.shard_length(Lq, world, rank)], k=k[:, :, :sharding.shard_length(Lk, world, rank)],
                    key_padding_mask=None, Lq=Lq, Lk=Lk, causal=False, scale=None, layout="contiguous")
        call["v"] = call["k"]
        call.update(changes.get(f"rank{rank}", {}))
        rows.append(agreement.describe(**call))
    return rows


def test_ulysses_refuses_more_ranks_than_heads():
    from wb_kernels.stages.distributed.agreement import check_agreement

    with pytest.raises(ValueError, match=r"W = 3 must divide .* \(6\) and .* \(2\)"):
        check_agreement("ulysses_attention", _descriptions(3), same=("Lq",), shards="contiguous", heads_divide=True)


def test_agreement_names_which_rank_has_what():
    """The checks every rank runs on the exchanged descriptions: one error naming each disagreement by rank."""
    from wb_kernels.stages.distributed.agreement import check_agreement
    from wb_kernels.stages.distributed.ring import SAME

    q32 = torch.zeros(1, 6, 3, 8, dtype=torch.float32)
    rows = _descriptions(3, rank2=dict(q=q32, causal="bottom_right", scale=0.5))
    with pytest.raises(ValueError) as refused:
        check_agreement("ring_attention", rows, same=SAME, shards="contiguous")
    text = str(refused.value)
    assert "the ranks disagree on q's dtype: ranks 0, 1: torch.float64; rank 2: torch.float32" in text
    assert "causal: ranks 0, 1: False; rank 2: 'bottom_right'" in text
    assert "scale: ranks 0, 1: None; rank 2: 0.5" in text
    check_agreement("ring_attention", _descriptions(3), same=SAME, shards="contiguous")  # agreeing ranks pass
    with pytest.raises(ValueError, match=r"rank 1 of 2 \(contiguous\) should hold 4 queries and 4 keys, got q "
                                         r"\(1, 6, 5, 8\)"):  # Ulysses' shard lengths (they were never checked)
        q_long = torch.zeros(1, 6, 5, 8, dtype=torch.float64)
        check_agreement("ulysses_attention", _descriptions(2, Lq=8, Lk=8, rank1=dict(q=q_long)), same=SAME,
                        shards="contiguous", heads_divide=True)


def test_a_mask_longer_than_the_keys_is_refused_in_the_callers_terms(single_rank):
    """It was cut to the keys silently (ring, split-KV decode), and a mask of another batch was refused quoting an
    internal block's shape."""
    from wb_kernels.stages.distributed.decode import split_kv_decode
    from wb_kernels.stages.distributed.ring import ring_attention
    from wb_kernels.stages.distributed.ulysses import ulysses_attention

    q, k, v, _ = run.make_inputs(run.Case(2, 2, 2, 9, 13, 8), torch.float64, "cpu", 0)
    longer = torch.ones(2, 17, dtype=torch.bool)
    for method in (lambda m: ring_attention(q, k, v, Lq=9, Lk=13, key_padding_mask=m),
                   lambda m: split_kv_decode(q, k, v, Lk=13, key_padding_mask=m),
                   lambda m: ulysses_attention(q, k, v, Lq=9, Lk=13, key_padding_mask=m)):
        with pytest.raises(ValueError, match=r"key_padding_mask has shape \(2, 17\), but it must be the whole "
                                             r"sequence's \(B, Lk\) = \(2, 13\)"):
            method(longer)
        with pytest.raises(ValueError, match=r"key_padding_mask has shape \(1, 13\)"):
            method(longer[:1, :13])


# ---- torchrun, gloo -------------------------------------------------------------------------------------------

def test_run_refuses_bad_arguments(monkeypatch):
    monkeypatch.delenv("RANK", raising=False)
    for argv in (["--method", "spiral"], [], ["--dtype", "float32"]):
        with pytest.raises(SystemExit):
            run.main(argv)
    assert run.parse_case("1,2,1,5,7,8,bottom_right,1") == run.Case(1, 2, 1, 5, 7, 8, "bottom_right", True)
    with pytest.raises(Exception, match="causal"):
        run.parse_case("1,2,1,5,7,8,diagonal,0")


def _torchrun(world: int, module: str, *arguments):
    """torchrun with `world` ranks running `module` with `arguments`: (stdout, stderr). Killed with its children
    when it passes LAUNCH_SECONDS (a hang)."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={world}",
               "-m", module, *arguments]
    process = subprocess.Popen(command, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                               text=True, start_new_session=True)
    try:
        stdout, stderr = process.communicate(timeout=LAUNCH_SECONDS)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        process.communicate()
        pytest.fail(f"torchrun at W = {world} hung: killed after {LAUNCH_SECONDS} s")
    assert process.returncode == 0, f"torchrun at W = {world} exited {process.returncode}:\n{stdout}\n{stderr[-4000:]}"
    return stdout, stderr


def _launch(world: int, *arguments):
    """Every method's cases under torchrun at `world` ranks: their JSON records."""
    stdout, _ = _torchrun(world, "wb_kernels.stages.distributed.run", "--json", "--timeout", "60", *arguments)
    return [json.loads(line) for line in stdout.splitlines() if line.startswith("{")]


@pytest.mark.parametrize("world", [2, 4])
def test_every_method_is_exact_under_torchrun(world):
    records = _launch(world)
    expected = {(m, c.label(), r) for m in run.METHODS for c in run.CASES[m] for r in range(world)}
    assert {(x["method"], x["case"], x["rank"]) for x in records} == expected
    assert all(x["world"] == world for x in records)
    bad = [x for x in records if x["status"] != "ok" or max(x["errors"].values()) > 1e-12]
    assert not bad, bad
    # what the cases exercise: GQA, both alignments, Lq != Lk, masks, odd lengths, rows that see no key
    cases = {(x["method"], x["case"]): x for x in records}.values()
    for method in run.METHODS:
        mine = [x for x in cases if x["method"] == method]
        assert any(x["Hk"] < x["H"] for x in mine) and any(x["mask"] for x in mine)
        assert {x["causal"] for x in mine} >= {"none", "top_left", "bottom_right"} - ({"none"} if method == "ulysses"
                                                                                      else set())
        assert any(x["Lk"] % (2 * world) for x in mine)
    assert any(x["Lq"] > x["Lk"] and x["causal"] == "bottom_right" for x in cases if x["method"] == "ring")


def test_float32_results_are_graded_by_the_projects_rule():
    """Outside float64 the ranks' rows are gathered and graded by wb.check (2x SDPA's error in the same precision),
    the path NCCL runs in float16 with the mma stage; here float32 with the reference stage on gloo. The backwards
    (ring, Ulysses) are graded by wb.check_gradients."""
    records = _launch(2, "--dtype", "float32", "--method", "ring,zigzag,ulysses,decode,ring_backward,ulysses_backward")
    assert records and all(x["status"] == "ok" and x["check"]["passed"] for x in records), records
    forward = [x for x in records if not x["method"].endswith("_backward")]
    assert forward and all(x["check"]["error"] <= x["check"]["tolerance"] for x in forward)
    backward = [x for x in records if x["method"].endswith("_backward")]  # wb.check_gradients' rule
    assert backward and all(max(e / t for e, t in zip(x["check"]["errors"], x["check"]["tolerances"])) <= 1
                            for x in backward)
    assert {x["overlap"] for x in records if x["method"] in ("ring", "zigzag")} == {True}


# ---- the scaling benchmark: reading results (the lesson's functions) and the CPU smoke run ------------------------

def _synthetic_scaling(date="2026-11-26T10:00:00Z", gpu="NVIDIA H200"):
    """A small results file of the benchmark's schema, made up for the tests (never committed to results/)."""
    records = []
    for L in (32768, 65536, 131072):
        for causal in (False, True):
            for method, overlap, efficiency in (("ring", True, 0.93), ("ring", False, 0.90), ("zigzag", True, 0.88),
                                                ("ulysses", False, 0.91), ("context_parallel", False, 0.95)):
                if method == "zigzag" and not causal:
                    continue
                problem = scaling.Problem("float16", 1, 16, 16, L, 128, causal)
                key = scaling.Method(method, "sdpa" if method == "context_parallel" else "mma", overlap).key(problem)
                records.append({"key": key, "method": method, "local": "mma", **problem.__dict__, "world_size": 2,
                                "overlap": overlap, "median_ms": 10.0, "one_gpu_ms": 20.0 * efficiency,
                                "efficiency": efficiency, "status": "ok", "reason": "",
                                "check": {"error": 1e-4, "tolerance": 2e-3, "passed": True}})
    records.append({**records[-1], "key": "context_parallel | float16 B1 H32/8 L32768 D128 causal", "H": 32, "Hk": 8,
                    "status": "failed", "reason": "RuntimeError: made up", "median_ms": None, "efficiency": None})
    return {"schema": 1, "environment": {"date": date, "gpu": gpu, "world_size": 2, "torch": "2.11.0+cu130",
                                         "nccl": "2.27.5", "git_commit": "abc1234"},
            "command": "python -m torch.distributed.run ...", "timing": {"method": "CUDA events", "repeats": 5},
            "records": records, "unavailable": {}, "complete": True}


# what each hostile call (run.hostile_calls) must raise on every rank: a ValueError naming the problem
HOSTILE_ERRORS = {
    "decode: a different q on each rank": "the ranks disagree on q's values",
    "decode: a key padding mask longer than the keys": "key_padding_mask has shape (2, 17), but it must be",
    "ring: a key padding mask longer than the keys": "key_padding_mask has shape (2, 17), but it must be",
    "ring: a key padding mask of another batch": "key_padding_mask has shape (1, 13), but it must be",
    "ring: rank 1 in float32": "the ranks disagree on q's dtype: rank 0: torch.float64; rank 1: torch.float32",
    "ring: rank 1 with one key/value head": "the ranks disagree on the key/value heads Hk: rank 0: 2; rank 1: 1",
    "ring: rank 1 told another Lk": "the ranks disagree on Lk: rank 0: 13; rank 1: 14",
    "ulysses: rank 0 with one query too many": "rank 0 of 2 (contiguous) should hold 5 queries and 7 keys",
    "ulysses: a key padding mask longer than the keys": "key_padding_mask has shape (2, 17), but it must be",
}


def test_ranks_that_disagree_get_one_clear_error_on_every_rank():
    """Issue 45: a different q per rank in split-KV decode returned one merged answer right for neither; masks longer
    than the keys were cut silently; dtypes, heads and lengths that differ aborted inside gloo; Ulysses never
    checked shard lengths. Now one small all-gather before the first collective, and every rank raises."""
    stdout, _ = _torchrun(2, "wb_kernels.stages.distributed.run", "--hostile", "--json", "--timeout", "20")
    met = {}
    for line in stdout.splitlines():
        if line.startswith("{"):
            record = json.loads(line)
            met[(record["call"], record["rank"])] = record["met"]
    assert set(met) == {(call, rank) for call in HOSTILE_ERRORS for rank in (0, 1)}, stdout
    wrong = {key: text for key, text in met.items()
             if not (text.startswith("ValueError") and HOSTILE_ERRORS[key[0]] in text)}
    assert not wrong, "\n".join(f"{call} (rank {rank}): {text}" for (call, rank), text in sorted(wrong.items()))


def test_scaling_table_and_figure_read_a_results_file(tmp_path):
    path = tmp_path / "scaling_h200x2.json"
    path.write_text(json.dumps(_synthetic_scaling()))
    results = scaling.load_scaling(path)
    table = scaling.scaling_table(results)
    first = table.splitlines()[0]
    assert "NVIDIA H200" in first and "2026-11-26" in first and first.startswith("Scaling on 2x")
    row = "| float16 | H16/16 | 128k | causal | zigzag | mma | yes | 10.00 | 17.60 | 88.0% | 1.0e-04 ≤ 2.0e-03 |"
    assert row in table
    assert "failed: RuntimeError: made up" in table
    figure = scaling.efficiency_figure(results)
    assert len(figure.axes) == 2
    causal_axis = figure.axes[1]
    labels = [line.get_label() for line in causal_axis.get_lines()]
    assert "bar 85%" in labels and any("ceiling" in label for label in labels) and "zigzag H16/16" in labels
    assert "bar 90%" in [line.get_label() for line in figure.axes[0].get_lines()]
    assert "ring (no overlap) H16/16" in labels
    bars = scaling.bar_results(results)
    assert {(x["method"], x["causal"], x["met"]) for x in bars} >= {("ring", False, True), ("zigzag", True, True),
                                                                   ("ring (no overlap)", False, True)}
    assert all(x["bar"] == (0.85 if x["causal"] else 0.90) for x in bars)
    for r in results["records"]:  # zigzag below its bar
        if r["method"] == "zigzag" and r["L"] == 131072:
            r["efficiency"] = 0.80
    assert [x["met"] for x in scaling.bar_results(results) if x["method"] == "zigzag"] == [False]
    bad = tmp_path / "old.json"
    bad.write_text(json.dumps({**_synthetic_scaling(), "schema": 0}))
    with pytest.raises(ValueError, match="schema"):
        scaling.load_scaling(bad)


def test_find_scaling_results_takes_the_newest_committed_file(tmp_path):
    assert scaling.find_scaling_results(tmp_path) is None
    folder = tmp_path / "results" / "distributed"
    folder.mkdir(parents=True)
    (folder / "scaling_h100x2.json").write_text(json.dumps(_synthetic_scaling("2026-11-20T10:00:00Z", "H100")))
    (folder / "scaling_h200x2.json").write_text(json.dumps(_synthetic_scaling("2026-11-26T10:00:00Z")))
    (folder / "notes.json").write_text("{}")
    assert scaling.find_scaling_results(tmp_path).name == "scaling_h200x2.json"  # not a git checkout: every file
    git = ["git", "-c", "user.email=t@example.com", "-c", "user.name=t"]
    subprocess.run([*git, "init", "-q"], cwd=tmp_path, check=True)
    subprocess.run([*git, "add", "results/distributed/scaling_h100x2.json"], cwd=tmp_path, check=True)
    subprocess.run([*git, "commit", "-qm", "results"], cwd=tmp_path, check=True)
    assert scaling.find_scaling_results(tmp_path).name == "scaling_h100x2.json"  # the newer one is not committed


def test_resumed_records_mark_the_interrupted_one_failed():
    old = _synthetic_scaling()
    kept = old["records"][:3]
    old["records"], old["in_progress"] = kept, {**old["records"][3], "status": "failed", "reason": ""}
    done = scaling.resumed_records(old)
    assert [done[r["key"]] for r in kept] == kept
    interrupted = done[old["in_progress"]["key"]]
    assert interrupted["status"] == "failed" and "stopped inside it" in interrupted["reason"]
    assert scaling.resumed_records(None) == {}


def test_scaling_problems_and_methods():
    gpu = scaling.problems("gpu", ("float16", "bfloat16"))
    assert gpu[0] == scaling.Problem("float16", 1, 16, 16, 32768, 128, False)
    assert {p.L for p in gpu} == {32768, 65536, 131072, 262144} and {(p.H, p.Hk) for p in gpu} == {(16, 16), (32, 8)}
    assert all(p.dtype == "float16" for p in gpu[:14]) and any(p.dtype == "bfloat16" for p in gpu)
    causal = [m.name for m in scaling.methods_for(scaling.Problem("float16", 1, 16, 16, 8, 128, True), "mma")]
    full = [m.key(gpu[0]) for m in scaling.methods_for(gpu[0], "mma")]
    assert causal == ["ring", "ring", "zigzag", "ulysses", "context_parallel"]
    assert full == [f"{name} | {gpu[0].key()}" for name in ("ring", "ring (no overlap)", "ulysses",
                                                              "context_parallel")]
    with pytest.raises(ValueError, match="preset"):
        scaling.problems("huge")


def test_scaling_smoke_run_on_gloo_writes_and_resumes(tmp_path):
    """The benchmark end to end at W = 2 on the CPU (gloo, the reference stage, tiny sizes): every method checked,
    context_parallel recorded as unavailable; the same command again measures nothing new."""
    arguments = ("--out", str(tmp_path), "--backend", "gloo", "--device", "cpu", "--timeout", "60", "--repeats", "2")
    stdout, _ = _torchrun(2, "wb_kernels.stages.distributed.scaling", *arguments)
    path = tmp_path / "scaling_cpux2.json"
    results = scaling.load_scaling(path)
    assert results["complete"] and results["environment"]["world_size"] == 2
    assert "CUDA" in results["unavailable"]["context_parallel"] and results["link"]["gb_per_s"] > 0
    statuses = {(r["method"], r["status"]) for r in results["records"]}
    assert statuses == {("ring", "ok"), ("zigzag", "ok"), ("ulysses", "ok"), ("context_parallel", "skipped")}
    for r in results["records"]:
        if r["status"] == "ok":
            assert r["check"]["passed"] and r["check"]["error"] <= r["check"]["tolerance"]
            assert r["check"]["one_gpu_distance"] < 1e-5 and r["efficiency"] > 0
    assert {r["overlap"] for r in results["records"] if r["method"] == "ring"} == {True, False}
    assert "Scaling on 2x CPU processes (gloo)" in stdout
    again, _ = _torchrun(2, "wb_kernels.stages.distributed.scaling", *arguments)
    assert scaling.load_scaling(path)["records"] == results["records"]
    assert " s] " not in again  # no progress line: nothing was measured again


def test_readme_scaling_table_is_the_committed_files(tmp_path):
    """README's scaling block is what the newest committed results file renders (regenerate it with
    ``python -m wb_kernels.stages.distributed.scaling --update-readme FILE`` after a run)."""
    from pathlib import Path

    from wb_kernels.stages.distributed import scaling

    root = Path(__file__).resolve().parents[1]
    committed = scaling.find_scaling_results(root)
    readme = (root / "README.md").read_text()
    if committed is None:
        pytest.skip("no scaling results committed")
    copy = tmp_path / "README.md"
    copy.write_text(readme)
    (tmp_path / "results" / "distributed").mkdir(parents=True)
    placed = tmp_path / "results" / "distributed" / committed.name
    placed.write_text(committed.read_text())
    scaling.update_readme(placed, copy)
    assert copy.read_text() == readme
