"""Run the distributed methods on W processes and check each against one process's result.

Start with torchrun (rank code must live in a module: functions defined in a notebook cannot be sent to
``mp.spawn``)::

    python -m torch.distributed.run --standalone --nproc_per_node=2 -m wb_kernels.stages.distributed.run \\
        [--method ring,zigzag,ulysses,decode,ring_backward,zigzag_backward,ulysses_backward] [--dtype float64]
        [--stage reference] [--json]

Every rank builds the same inputs (seeded), computes the single-process result with ``wb.attention`` on the whole
sequence, runs the method on its shard, and compares its rows (output and LSE; for the ``*_backward`` methods, the
method's forward then its backward, dq, dk and dv against ``wb.attention_backward``). One line per rank and case
(``--json``: one JSON object per line); the exit status is 1 if any comparison failed. ``--case`` replaces the
built-in cases: ``B,H,Hk,Lq,Lk,D,causal,mask`` with causal one of none/top_left/bottom_right and mask 0/1 (1: a
random key padding mask whose last sequence, when B > 1, has no key at all).

Outside float64 (``--backend nccl --dtype float16 --stage mma``, each rank on ``cuda:LOCAL_RANK``) the rows of every
rank are gathered into the whole output and graded by the project's rule, ``wb.check``: at most 2x the error that
PyTorch's SDPA makes on one device in the same precision, against the float64 reference (the distance to the one
process's result is reported beside it). The default cases then are tensor-core sized (D 64 and 128, lengths near
1000 that divide by nothing in particular), since such a stage takes no D = 8.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
from dataclasses import asdict, dataclass

import torch
import torch.distributed as dist

from .decode import split_kv_decode
from .merge import pack, unpack
from .ring import ring_attention, ring_attention_backward
from .sharding import local_indices
from .ulysses import ulysses_attention, ulysses_attention_backward

METHODS = ("ring", "zigzag", "ulysses", "decode", "ring_backward", "zigzag_backward", "ulysses_backward")
CAUSAL = {"none": False, "top_left": "top_left", "bottom_right": "bottom_right"}


@dataclass(frozen=True)
class Case:
    B: int
    H: int
    Hk: int
    Lq: int
    Lk: int
    D: int
    causal: str = "none"  # a key of CAUSAL
    mask: bool = False

    def label(self) -> str:
        return (f"B{self.B} H{self.H}/{self.Hk} Lq{self.Lq} Lk{self.Lk} D{self.D} {self.causal}"
                + (" mask" if self.mask else ""))


# Odd lengths (not divisible by 2W at W = 2 or 4), GQA, both alignments, Lq != Lk (rows that see no key under
# bottom-right with Lq > Lk), a padding mask with a sequence that sees nothing, and a sequence shorter than 2W
# (empty zigzag chunks at W = 4).
SEQUENCE_CASES = (
    Case(1, 2, 2, 37, 37, 8),
    Case(2, 4, 2, 37, 37, 8, "top_left"),
    Case(2, 4, 2, 21, 21, 8, "bottom_right", True),
    Case(2, 2, 1, 29, 41, 8, "none", True),
    Case(1, 2, 1, 29, 41, 8, "top_left"),
    Case(1, 2, 1, 29, 41, 8, "bottom_right"),
    Case(1, 2, 2, 41, 29, 8, "top_left", True),
    Case(1, 2, 2, 41, 29, 8, "bottom_right"),
    Case(1, 1, 1, 5, 5, 4, "top_left"),
)
ULYSSES_CASES = (  # W must divide H and Hk: W = 2 and 4
    Case(1, 4, 4, 37, 37, 8),
    Case(2, 8, 4, 37, 37, 8, "top_left", True),
    Case(1, 8, 4, 29, 41, 8, "bottom_right"),
    Case(1, 4, 4, 41, 29, 8, "top_left"),
)
DECODE_CASES = (  # a decode step (Lq = 1) and a few queries (speculative or chunked), bottom-right
    Case(2, 4, 1, 1, 37, 8, "none", True),
    Case(1, 4, 2, 1, 3, 8, "bottom_right"),
    Case(2, 4, 2, 3, 37, 8, "bottom_right", True),
    Case(1, 2, 2, 5, 41, 8, "top_left"),
)
CASES = {"ring": SEQUENCE_CASES, "zigzag": SEQUENCE_CASES, "ulysses": ULYSSES_CASES, "decode": DECODE_CASES,
         "ring_backward": SEQUENCE_CASES, "zigzag_backward": SEQUENCE_CASES, "ulysses_backward": ULYSSES_CASES}

# The same kinds of problem at the sizes a tensor-core stage takes (D 64 or 128): for --dtype float16/bfloat16 with
# --stage mma on NCCL. Lengths are odd or prime, so shards and zigzag chunks differ in length.
TENSOR_CORE_SEQUENCE_CASES = (
    Case(1, 4, 4, 1037, 1037, 128),
    Case(2, 4, 2, 1037, 1037, 64, "top_left"),
    Case(2, 4, 2, 533, 533, 128, "bottom_right", True),
    Case(1, 4, 1, 701, 1029, 128, "top_left"),
    Case(1, 4, 2, 1029, 701, 64, "bottom_right"),
    Case(2, 4, 4, 701, 1029, 128, "none", True),
    Case(1, 2, 1, 2053, 2053, 128, "top_left"),  # many tiles; the float64 reference of the check stays cheap
)
TENSOR_CORE_ULYSSES_CASES = (
    Case(1, 8, 4, 1037, 1037, 128),
    Case(2, 8, 4, 701, 1029, 64, "bottom_right", True),
    Case(1, 8, 8, 1029, 701, 128, "top_left"),
)
TENSOR_CORE_DECODE_CASES = (
    Case(2, 8, 2, 1, 4099, 128, "none", True),
    Case(1, 8, 8, 5, 2051, 64, "bottom_right"),
)
TENSOR_CORE_BACKWARD_CASES = (  # fewer: wb.check_gradients' float64 reference and floors cost seconds each on a CPU
    Case(1, 2, 2, 1037, 1037, 128),
    Case(2, 4, 2, 533, 533, 128, "bottom_right", True),
    Case(1, 4, 1, 701, 1029, 128, "top_left"),
    Case(1, 4, 2, 1029, 701, 64, "bottom_right"),
)
TENSOR_CORE_CASES = {"ring": TENSOR_CORE_SEQUENCE_CASES, "zigzag": TENSOR_CORE_SEQUENCE_CASES,
                     "ulysses": TENSOR_CORE_ULYSSES_CASES, "decode": TENSOR_CORE_DECODE_CASES,
                     "ring_backward": TENSOR_CORE_BACKWARD_CASES, "zigzag_backward": TENSOR_CORE_BACKWARD_CASES,
                     "ulysses_backward": TENSOR_CORE_ULYSSES_CASES[:2]}


def default_cases(stage: str):
    """The built-in cases for `stage`: the small ones (D 4 and 8) where it takes them, else the tensor-core ones."""
    import wb_kernels as wb

    head_dims = wb.get_stage(stage).head_dims
    return CASES if head_dims is None or {4, 8} <= set(head_dims) else TENSOR_CORE_CASES


def parse_case(text: str) -> Case:
    fields = text.split(",")
    if len(fields) != 8 or fields[6] not in CAUSAL:
        raise argparse.ArgumentTypeError(f"--case: expected B,H,Hk,Lq,Lk,D,causal,mask with causal one of "
                                         f"{'/'.join(CAUSAL)}, got {text!r}")
    return Case(*map(int, fields[:6]), fields[6], bool(int(fields[7])))


def make_inputs(case: Case, dtype, device, seed: int):
    """The same inputs on every rank (a CPU generator seeded per case)."""
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(case.B, case.H, case.Lq, case.D, generator=gen, dtype=torch.float64)
    k = torch.randn(case.B, case.Hk, case.Lk, case.D, generator=gen, dtype=torch.float64)
    v = torch.randn(case.B, case.Hk, case.Lk, case.D, generator=gen, dtype=torch.float64)
    mask = None
    if case.mask:
        mask = torch.rand(case.B, case.Lk, generator=gen) < 0.7
        if case.B > 1:
            mask[-1] = False  # a whole sequence that sees no key: zeros and -inf, never NaN
        mask = mask.to(device)
    return (*(x.to(device=device, dtype=dtype) for x in (q, k, v)), mask)


def run_case(method: str, case: Case, *, dtype, device, stage: str, seed: int, grade: bool = False):
    """``(errors, graded)``: the largest distances of this rank's results to the single-process ones (a dict: "out"
    and "lse", or "dq", "dk" and "dv" for the backward methods), and with `grade` the whole result gathered from
    every rank graded by ``wb.check`` (``wb.check_gradients`` for gradients; every rank grades the same gathered
    result; None without `grade`). None where the method does not apply (Ulysses with W not dividing the heads)."""
    import wb_kernels as wb

    world, rank = dist.get_world_size(), dist.get_rank()
    causal = CAUSAL[case.causal]
    if method.startswith("ulysses") and (case.H % world or case.Hk % world):
        return None
    q, k, v, mask = make_inputs(case, dtype, device, seed)
    layout = "zigzag" if method.startswith("zigzag") else "contiguous"
    kidx = torch.as_tensor(local_indices(case.Lk, world, rank, layout), device=device)
    k_local, v_local = k[:, :, kidx].contiguous(), v[:, :, kidx].contiguous()
    rows = torch.as_tensor(local_indices(case.Lq, world, rank, layout), device=device)
    common = dict(Lq=case.Lq, Lk=case.Lk, causal=causal, key_padding_mask=mask, stage=stage)
    if method.endswith("_backward"):
        return _run_backward_case(method, case, q, k, v, mask, k_local, v_local, rows, kidx, layout, common,
                                  seed=seed, grade=grade)
    ref_out, ref_lse = wb.attention(q, k, v, stage=stage, causal=causal, key_padding_mask=mask, return_lse=True)
    if method == "decode":
        out, lse = split_kv_decode(q, k_local, v_local, Lk=case.Lk, layout=layout, causal=causal,
                                   key_padding_mask=mask, stage=stage)
        rows = torch.arange(case.Lq, device=device)
    elif method == "ulysses":
        out, lse = ulysses_attention(q[:, :, rows].contiguous(), k_local, v_local, **common)
    else:
        out, lse = ring_attention(q[:, :, rows].contiguous(), k_local, v_local, layout=layout, **common)
    errors = {"out": _error(out, ref_out[:, :, rows]), "lse": _error(lse, ref_lse[:, :, rows])}
    if not grade:
        return errors, None
    if method == "decode":  # every rank already holds the whole result
        whole_out, whole_lse = out, lse
    else:
        whole_out, whole_lse = unpack(gather_sequence(pack(out, lse), case.Lq, layout), out.dtype)
    graded = wb.check(f"{method} {case.label()}", whole_out, q, k, v, lse=whole_lse, causal=causal,
                      key_padding_mask=mask, verbose=False, raise_on_failure=False)
    return errors, graded


def _run_backward_case(method, case, q, k, v, mask, k_local, v_local, rows, kidx, layout, common, *, seed, grade):
    """run_case for ``ring_backward``, ``zigzag_backward`` and ``ulysses_backward``: the method's forward, then its
    backward, against one process's ``wb.attention_backward`` (the whole problem, the same stage)."""
    import wb_kernels as wb

    generator = torch.Generator().manual_seed(seed + 1)
    dout = torch.randn(q.shape, generator=generator, dtype=torch.float64).to(device=q.device, dtype=q.dtype)
    ref_dq, ref_dk, ref_dv = wb.attention_backward(q, k, v, dout, stage=common["stage"], causal=common["causal"],
                                                   key_padding_mask=mask)
    q_local, dout_local = q[:, :, rows].contiguous(), dout[:, :, rows].contiguous()
    if method == "ulysses_backward":
        out, lse = ulysses_attention(q_local, k_local, v_local, **common)
        dq, dk, dv = ulysses_attention_backward(q_local, k_local, v_local, out, lse, dout_local, **common)
    else:
        out, lse = ring_attention(q_local, k_local, v_local, layout=layout, **common)
        dq, dk, dv = ring_attention_backward(q_local, k_local, v_local, out, lse, dout_local, layout=layout,
                                             **common)
    errors = {"dq": _error(dq, ref_dq[:, :, rows]), "dk": _error(dk, ref_dk[:, :, kidx]),
              "dv": _error(dv, ref_dv[:, :, kidx])}
    if not grade:
        return errors, None
    whole = (gather_sequence(dq, case.Lq, layout), gather_sequence(dk, case.Lk, layout),
             gather_sequence(dv, case.Lk, layout))
    graded = wb.check_gradients(f"{method} {case.label()}", whole, q, k, v, dout, causal=common["causal"],
                                key_padding_mask=mask, verbose=False, raise_on_failure=False)
    return errors, graded


def gather_sequence(x, length: int, layout: str, group=None):
    """Every rank's rows of x (B, H, n_r, X), sharded under `layout`, put together in global order: the whole
    (B, H, length, X) on every rank. One all-gather of the shards padded to the longest."""
    world = dist.get_world_size(group)
    indices = [local_indices(length, world, r, layout) for r in range(world)]
    longest = max(len(i) for i in indices)
    padded = x.new_zeros(x.shape[:2] + (longest, x.shape[3]))
    padded[:, :, :x.shape[2]] = x
    gathered = [torch.empty_like(padded) for _ in range(world)]
    dist.all_gather(gathered, padded, group=group)
    whole = x.new_empty(x.shape[:2] + (length, x.shape[3]))
    for rows, part in zip(indices, gathered):
        whole[:, :, torch.as_tensor(rows, device=whole.device)] = part[:, :, :len(rows)]
    return whole


def _check_record(graded) -> dict:
    """A CheckResult or GradientCheckResult as JSON."""
    if hasattr(graded, "errors"):
        return {"errors": list(graded.errors), "tolerances": list(graded.tols), "passed": graded.passed,
                "line": graded.line()}
    return {"error": graded.max_err, "tolerance": graded.tol, "lse_error": graded.lse_err,
            "lse_tolerance": graded.lse_tol, "passed": graded.passed, "line": graded.line()}


def _error(got, want) -> float:
    """max |got - want| in float64, where -inf must meet -inf (a row that sees no key) and NaN counts as infinite."""
    got, want = got.double().cpu(), want.double().cpu()
    if got.shape != want.shape:
        return float("inf")
    same_inf = torch.isinf(got) & torch.isinf(want) & (got == want)
    diff = torch.where(same_inf, torch.zeros_like(got), (got - want).abs())
    return float(torch.nan_to_num(diff, nan=float("inf")).max()) if diff.numel() else 0.0


def hostile_calls(rank: int):
    """Calls that disagree between the ranks, or that give a rank's method what it must refuse (W = 2, gloo): [(name,
    call), ...]. Each must raise a ValueError on every rank, naming the problem in the caller's terms (issue 45);
    none may return an answer or abort inside a collective. ``--hostile`` runs them and prints what each rank met."""
    case = Case(2, 4, 2, 9, 13, 8)
    q, k, v, _ = make_inputs(case, torch.float64, "cpu", 0)
    world = dist.get_world_size()
    kidx = torch.as_tensor(local_indices(13, world, rank))
    qidx = torch.as_tensor(local_indices(9, world, rank))
    k_local, v_local, q_local = k[:, :, kidx].contiguous(), v[:, :, kidx].contiguous(), q[:, :, qidx].contiguous()
    long_mask = torch.ones(2, 13 + 4, dtype=torch.bool)  # 4 keys longer than the sequence
    common = dict(Lq=9, Lk=13)
    return [
        ("decode: a different q on each rank",
         lambda: split_kv_decode(q + rank, k_local, v_local, Lk=13)),
        ("decode: a key padding mask longer than the keys",
         lambda: split_kv_decode(q, k_local, v_local, Lk=13, key_padding_mask=long_mask)),
        ("ring: a key padding mask longer than the keys",
         lambda: ring_attention(q_local, k_local, v_local, key_padding_mask=long_mask, **common)),
        ("ring: a key padding mask of another batch",
         lambda: ring_attention(q_local, k_local, v_local, key_padding_mask=long_mask[:1, :13], **common)),
        ("ring: rank 1 in float32",
         lambda: ring_attention(*(x.float() if rank == 1 else x for x in (q_local, k_local, v_local)), **common)),
        ("ring: rank 1 with one key/value head",
         lambda: ring_attention(q_local, *(x[:, :1] if rank == 1 else x for x in (k_local, v_local)), **common)),
        ("ring: rank 1 told another Lk",
         lambda: ring_attention(q_local, k_local, v_local, Lq=9, Lk=13 + rank)),
        ("ulysses: rank 0 with one query too many",
         lambda: ulysses_attention(q[:, :, :len(qidx) + 1 - rank].contiguous() if rank == 0 else q_local, k_local,
                                   v_local, **common)),
        ("ulysses: a key padding mask longer than the keys",
         lambda: ulysses_attention(q_local, k_local, v_local, key_padding_mask=long_mask, **common)),
    ]


def run_hostile(json_lines: bool) -> int:
    """Run :func:`hostile_calls`; one line per call: what this rank met (the error, or "returned")."""
    rank = dist.get_rank()
    for name, call in hostile_calls(rank):
        try:
            call()
            met = "returned"
        except Exception as error:  # noqa: BLE001 - what the call met is the record
            met = f"{type(error).__name__}: {error}"[:700]
        say_line(json.dumps({"rank": rank, "call": name, "met": met}) if json_lines else f"rank {rank} {name}: {met}")
    return 0


def init_ranks(backend: str, timeout: float):
    """Join the process group that torchrun describes (its environment variables), every collective bounded by
    `timeout` seconds (a hang fails). NCCL: each rank on ``cuda:LOCAL_RANK``. Returns this rank's device."""
    device = torch.device("cpu")
    if backend == "nccl":
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
        torch.cuda.set_device(device)
    dist.init_process_group(backend, timeout=datetime.timedelta(seconds=timeout))
    return device


def say_line(line: str) -> None:
    """One line in one write: the ranks share torchrun's stdout, and print's separate writes of the text and its
    newline interleave between processes (a short line in one write to a pipe is atomic)."""
    sys.stdout.flush()
    os.write(sys.stdout.fileno(), (line + "\n").encode())


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m torch.distributed.run ... -m wb_kernels.stages.distributed.run",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--method", default=",".join(METHODS),
                        help=f"comma-separated, of {', '.join(METHODS)} (default: all)")
    parser.add_argument("--dtype", default="float64", choices=("float64", "float32", "float16", "bfloat16"))
    parser.add_argument("--stage", default="reference", help="the rung each rank's local attention runs")
    parser.add_argument("--backend", default="gloo", choices=("gloo", "nccl"))
    parser.add_argument("--case", action="append", type=parse_case, help="B,H,Hk,Lq,Lk,D,causal,mask (repeatable)")
    parser.add_argument("--tolerance", type=float, default=1e-12,
                        help="float64: the largest accepted distance to one process (default 1e-12); other dtypes "
                             "are graded by wb.check's rule instead")
    parser.add_argument("--timeout", type=float, default=60.0, help="seconds a collective may wait before failing")
    parser.add_argument("--json", action="store_true", help="one JSON object per line instead of text")
    parser.add_argument("--hostile", action="store_true",
                        help="run calls the ranks disagree on (W = 2, gloo) and print what each rank met")
    args = parser.parse_args(argv)
    methods = [m.strip() for m in args.method.split(",") if m.strip()]
    unknown = [m for m in methods if m not in METHODS]
    if unknown:
        parser.error(f"--method: unknown {', '.join(unknown)}; expected {', '.join(METHODS)}")
    if "RANK" not in os.environ:
        parser.error("start this module with torchrun (python -m torch.distributed.run --nproc_per_node=W -m ...)")

    device = init_ranks(args.backend, args.timeout)
    if args.hostile:
        try:
            return run_hostile(args.json)
        finally:
            dist.destroy_process_group()
    world, rank = dist.get_world_size(), dist.get_rank()
    grade = args.dtype != "float64"
    cases = default_cases(args.stage)
    failed = 0
    try:
        for method in methods:
            for index, case in enumerate(args.case or cases[method]):
                record = {"rank": rank, "world": world, "method": method, "case": case.label(), **asdict(case),
                          "dtype": args.dtype, "stage": args.stage, "backend": args.backend,
                          "overlap": method.split("_")[0] in ("ring", "zigzag")}
                try:
                    result = run_case(method, case, dtype=getattr(torch, args.dtype), device=device,
                                      stage=args.stage, seed=1000 + index, grade=grade)
                except Exception as error:  # noqa: BLE001 - recorded; every rank meets the same refusal in step
                    # (one that only some ranks meet leaves the others in a collective until --timeout ends it)
                    failed += 1
                    record.update(status="FAILED", reason=f"{type(error).__name__}: {error}"[:500])
                    say_line(json.dumps(record) if args.json
                         else f"rank {rank}/{world} {method:7s} {case.label():40s} FAILED  {record['reason']}")
                    continue
                if result is None:
                    record.update(status="skipped", reason=f"W = {world} does not divide H = {case.H}, Hk = {case.Hk}")
                    detail = record["reason"]
                else:
                    errors, graded = result
                    record["errors"] = errors
                    detail = "  ".join(f"max|{name} - one process| {error:.1e}" for name, error in errors.items())
                    if grade:
                        ok = graded.passed
                        record["check"] = _check_record(graded)
                        detail = f"{graded.line()}  ({detail})"
                    else:
                        ok = max(errors.values()) <= args.tolerance
                    failed += not ok
                    record["status"] = "ok" if ok else "FAILED"
                say_line(json.dumps(record) if args.json
                     else f"rank {rank}/{world} {method:7s} {case.label():40s} {record['status']:7s} {detail}")
    finally:
        dist.destroy_process_group()
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
