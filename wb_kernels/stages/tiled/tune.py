"""Check and time the tiled stage's tile sizes on one GPU, in one run (the lesson's slider times them one size at a time).

    python -m wb_kernels.stages.tiled.tune                             # prints a table
    python -m wb_kernels.stages.tiled.tune --json results/tiled/tune_h100.json

Each tile size is first checked against the float64 reference with the tolerance rule (odd lengths, causal, key
padding); a size that fails is reported and not timed. Then every size and the naive stage are timed at B*L = 16k
tokens, H = 16, fp32, for D = 64 and 128, all in the same process.
"""

from __future__ import annotations

import argparse
import datetime
import json
import sys
from pathlib import Path

import wb_kernels as wb
from wb_kernels.stages.tiled.kernel import TILE_SIZES, tiled_forward

TOKENS, HEADS = 16 * 1024, 16


def check(tile: int) -> bool:
    q, k, v = wb.random_qkv(2, 3, 333, 64, Lk=271, framework="torch", device="cuda", seed=tile)
    mask = wb.random_padding_mask(2, 271, seed=tile, framework="torch", device="cuda")
    out, lse = tiled_forward(q, k, v, causal=True, key_padding_mask=mask, tile=tile)
    return wb.check(f"tiled tile={tile}", out, q, k, v, lse=lse, causal=True, key_padding_mask=mask,
                    raise_on_failure=False).passed


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--lengths", default="1024,4096", help="sequence lengths, comma-separated")
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--json", type=Path, help="write the results here")
    args = parser.parse_args(argv)
    if not wb.BACKEND.is_gpu:
        sys.exit("python -m wb_kernels.stages.tiled.tune needs a CUDA GPU")
    import torch

    passed = {tile: check(tile) for tile in TILE_SIZES}
    results = {"device": wb.device_name(), "torch": torch.__version__, "date": datetime.date.today().isoformat(),
               "checked": {str(tile): ok for tile, ok in passed.items()}, "rows": []}
    print(f"{results['device']}, torch {results['torch']}; fp32, B*L = {TOKENS} tokens, H = {HEADS}, median ms")
    for D in (64, 128):
        for L in (int(x) for x in args.lengths.split(",")):
            q, k, v = wb.random_qkv(TOKENS // L, HEADS, L, D, framework="torch", device="cuda")
            row = {"D": D, "L": L, "naive": wb.time_call(wb.attention, q, k, v, stage="naive",
                                                          repeats=args.repeats).median_ms}
            for tile in (t for t in TILE_SIZES if passed[t]):
                row[f"tile {tile}"] = wb.time_call(tiled_forward, q, k, v, tile=tile, repeats=args.repeats).median_ms
            results["rows"].append(row)
            print(f"D={D:3d} L={L:5d}: " + ", ".join(f"{name} {ms:.2f}" for name, ms in row.items()
                                                    if name not in ("D", "L")))
            del q, k, v
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(results, indent=1) + "\n")
        print(f"wrote {args.json}")
    return 0 if all(passed.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
