"""Execute lessons in place so that their stored outputs come from this machine.

    python scripts/execute_notebooks.py notebooks/02_naive_gpu.ipynb ...   (default: every lesson)

On a GPU machine this is how the committed outputs of GPU-only cells are produced; on a CPU machine it
refreshes the simulator outputs. Stops at the first cell that raises, naming the notebook and cell.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import nbformat
from nbclient import NotebookClient

ROOT = Path(__file__).resolve().parent.parent


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("notebooks", nargs="*", type=Path, help="default: notebooks/*.ipynb")
    parser.add_argument("--timeout", type=int, default=900, help="seconds per cell")
    args = parser.parse_args()
    paths = args.notebooks or sorted((ROOT / "notebooks").glob("*.ipynb"))
    for path in paths:
        start = time.perf_counter()
        nb = nbformat.read(path, as_version=4)
        cell_start = {}

        def started(cell, cell_index, **_):
            cell_start[cell_index] = time.perf_counter()

        def finished(cell, cell_index, **_):
            # per-cell progress, so a slow or stuck cell is named while the run goes on
            print(f"  {path.name} cell {cell_index}: {time.perf_counter() - cell_start[cell_index]:.1f} s", flush=True)

        client = NotebookClient(nb, timeout=args.timeout, kernel_name="python3",
                                resources={"metadata": {"path": str(path.parent)}},
                                on_cell_start=started, on_cell_executed=finished)
        try:
            client.execute()
        except Exception as error:  # report which lesson broke, keep the traceback short
            last_line = (str(error).strip().splitlines() or [repr(error)])[-1]
            print(f"FAILED {path.name}: {last_line[:400]}", file=sys.stderr)
            return 1
        nbformat.write(nb, path)
        print(f"executed {path.name} in {time.perf_counter() - start:.1f} s", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
