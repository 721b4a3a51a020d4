"""Execute lessons in place so that their stored outputs come from this machine.

    python scripts/execute_notebooks.py notebooks/02_naive_gpu.ipynb ...   (default: every lesson)

On a GPU machine this is how the committed outputs of GPU-only cells are produced; on a CPU machine it
refreshes the simulator outputs. Stops at the first cell that raises, naming the notebook and cell, and
keeps what ran so far in logs/partial/.

Why ``--timeout`` should stay a little above the slowest cell: with widgets, nbclient's wait for a cell's
reply sometimes returns only when the timeout runs out, though the reply had come (nbclient issue #312).
The cell's outputs are complete then, but a long timeout turns each such stall into minutes.
"""

from __future__ import annotations

import argparse
import signal
import sys
import time
from pathlib import Path

import nbformat
from nbclient import NotebookClient

ROOT = Path(__file__).resolve().parent.parent


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("notebooks", nargs="*", type=Path, help="default: notebooks/*.ipynb")
    parser.add_argument("--timeout", type=int, default=150, help="seconds per cell (see above)")
    args = parser.parse_args()
    # a time limit's SIGTERM becomes SystemExit, so that the except below still saves the partial notebook
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
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
        except BaseException as error:  # report which lesson broke, keep the traceback short
            last_line = (str(error).strip().splitlines() or [repr(error)])[-1]
            print(f"FAILED {path.name}: {type(error).__name__}: {last_line[:400]}", file=sys.stderr)
            partial = ROOT / "logs" / "partial" / path.name  # the outputs up to the failure, to look at
            partial.parent.mkdir(parents=True, exist_ok=True)
            nbformat.write(nb, partial)
            return 1
        nbformat.write(nb, path)
        print(f"executed {path.name} in {time.perf_counter() - start:.1f} s", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
