"""Run the distributed methods on W processes and check each against one process's result.

Start with torchrun (rank code must live in a module: functions defined in a notebook cannot be sent to
``mp.spawn``)::

    python -m torch.distributed.run --standalone --nproc_per_node=2 -m wb_kernels.stages.distributed.run \\
        --method ring,zigzag,ulysses,decode [--dtype float64] [--stage reference] [--json]

Every rank builds the same inputs (seeded), computes the single-process result with ``wb.attention`` on the whole
sequence, runs the method on its shard, and compares its rows (output and LSE). One line per rank and case
(``--json``: one JSON object per line); the exit status is 1 if any comparison failed. ``--case`` replaces the
built-in cases: ``B,H,Hk,Lq,Lk,D,causal,mask`` with causal one of none/top_left/bottom_right and mask 0/1 (1: a
random key padding mask whose last sequence, when B > 1, has no key at all). ``--backend nccl`` puts each rank on
``cuda:LOCAL_RANK`` (untested here: see NOTES.md).
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
from .ring import ring_attention
from .sharding import local_indices
from .ulysses import ulysses_attention

METHODS = ("ring", "zigzag", "ulysses", "decode")
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
CASES = {"ring": SEQUENCE_CASES, "zigzag": SEQUENCE_CASES, "ulysses": ULYSSES_CASES, "decode": DECODE_CASES}


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


def run_case(method: str, case: Case, *, dtype, device, stage: str, seed: int):
    """(out_err, lse_err) of this rank's rows against the single-process result; None where the method does not
    apply (Ulysses with W not dividing the heads)."""
    import wb_kernels as wb

    world, rank = dist.get_world_size(), dist.get_rank()
    causal = CAUSAL[case.causal]
    if method == "ulysses" and (case.H % world or case.Hk % world):
        return None
    q, k, v, mask = make_inputs(case, dtype, device, seed)
    ref_out, ref_lse = wb.attention(q, k, v, stage=stage, causal=causal, key_padding_mask=mask, return_lse=True)
    layout = "zigzag" if method == "zigzag" else "contiguous"
    kidx = torch.as_tensor(local_indices(case.Lk, world, rank, layout), device=device)
    k_local, v_local = k[:, :, kidx].contiguous(), v[:, :, kidx].contiguous()
    if method == "decode":
        out, lse = split_kv_decode(q, k_local, v_local, Lk=case.Lk, layout=layout, causal=causal,
                                   key_padding_mask=mask, stage=stage)
        rows = torch.arange(case.Lq, device=device)
    else:
        rows = torch.as_tensor(local_indices(case.Lq, world, rank, layout), device=device)
        function = ulysses_attention if method == "ulysses" else ring_attention
        extra = {} if method == "ulysses" else {"layout": layout}
        out, lse = function(q[:, :, rows].contiguous(), k_local, v_local, Lq=case.Lq, Lk=case.Lk, causal=causal,
                            key_padding_mask=mask, stage=stage, **extra)
    return _error(out, ref_out[:, :, rows]), _error(lse, ref_lse[:, :, rows])


def _error(got, want) -> float:
    """max |got - want| in float64, where -inf must meet -inf (a row that sees no key) and NaN counts as infinite."""
    got, want = got.double().cpu(), want.double().cpu()
    if got.shape != want.shape:
        return float("inf")
    same_inf = torch.isinf(got) & torch.isinf(want) & (got == want)
    diff = torch.where(same_inf, torch.zeros_like(got), (got - want).abs())
    return float(torch.nan_to_num(diff, nan=float("inf")).max()) if diff.numel() else 0.0


def _say(line: str) -> None:
    """One line in one write: the ranks share torchrun's stdout, and print's separate writes of the text and its
    newline interleave between processes (a short line in one write to a pipe is atomic)."""
    sys.stdout.flush()
    os.write(sys.stdout.fileno(), (line + "\n").encode())


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m torch.distributed.run ... -m wb_kernels.stages.distributed.run",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--method", default="ring,zigzag,ulysses,decode",
                        help=f"comma-separated, of {', '.join(METHODS)} (default: all)")
    parser.add_argument("--dtype", default="float64", choices=("float64", "float32", "float16", "bfloat16"))
    parser.add_argument("--stage", default="reference", help="the rung each rank's local attention runs")
    parser.add_argument("--backend", default="gloo", choices=("gloo", "nccl"))
    parser.add_argument("--case", action="append", type=parse_case, help="B,H,Hk,Lq,Lk,D,causal,mask (repeatable)")
    parser.add_argument("--tolerance", type=float, default=None,
                        help="largest accepted error (default 1e-12 in float64; set one for other dtypes)")
    parser.add_argument("--timeout", type=float, default=60.0, help="seconds a collective may wait before failing")
    parser.add_argument("--json", action="store_true", help="one JSON object per line instead of text")
    args = parser.parse_args(argv)
    methods = [m.strip() for m in args.method.split(",") if m.strip()]
    unknown = [m for m in methods if m not in METHODS]
    if unknown:
        parser.error(f"--method: unknown {', '.join(unknown)}; expected {', '.join(METHODS)}")
    if args.tolerance is None and args.dtype != "float64":
        parser.error("--tolerance is needed outside float64 (exactness is only promised in float64)")
    tolerance = 1e-12 if args.tolerance is None else args.tolerance
    if "RANK" not in os.environ:
        parser.error("start this module with torchrun (python -m torch.distributed.run --nproc_per_node=W -m ...)")

    device = torch.device("cpu")
    if args.backend == "nccl":  # untested here: no GPUs
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
        torch.cuda.set_device(device)
    dist.init_process_group(args.backend, timeout=datetime.timedelta(seconds=args.timeout))
    world, rank = dist.get_world_size(), dist.get_rank()
    failed = 0
    try:
        for method in methods:
            for index, case in enumerate(args.case or CASES[method]):
                errors = run_case(method, case, dtype=getattr(torch, args.dtype), device=device, stage=args.stage,
                                  seed=1000 + index)
                record = {"rank": rank, "world": world, "method": method, "case": case.label(), **asdict(case)}
                if errors is None:
                    record.update(status="skipped", reason=f"W = {world} does not divide H = {case.H}, Hk = {case.Hk}")
                else:
                    ok = max(errors) <= tolerance
                    failed += not ok
                    record.update(status="ok" if ok else "FAILED", out_err=errors[0], lse_err=errors[1])
                detail = (record.get("reason") if errors is None
                          else f"max|out - ref| {errors[0]:.1e}  max|lse - ref| {errors[1]:.1e}")
                _say(json.dumps(record) if args.json
                     else f"rank {rank}/{world} {method:7s} {case.label():40s} {record['status']:7s} {detail}")
    finally:
        dist.destroy_process_group()
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
