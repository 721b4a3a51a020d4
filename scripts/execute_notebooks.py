"""Execute lessons in place so that their stored outputs come from this machine.

    python scripts/execute_notebooks.py notebooks/02_naive.ipynb ...   (default: every lesson)

On a GPU machine this is how the committed outputs of GPU-only cells are produced; on a CPU machine it
refreshes the simulator outputs. Stops at the first cell that raises, naming the notebook and cell, and
keeps what ran so far in logs/partial/.

With widget cells, nbclient's wait for a cell's reply sometimes returned only when the per-cell timeout ran
out, though the reply had come (nbclient issue #312): the asynchronous poll of the shell socket can miss a
message that is already there. ``ReplyPollingClient`` looks for the reply with a plain (level-triggered)
poll at least once a second, so such a miss costs a second, not the timeout. ``--timeout`` stays short all
the same: a stall of another kind should not eat a GPU run's time limit.
"""

from __future__ import annotations

import argparse
import signal
import sys
import time
from pathlib import Path
from queue import Empty

import nbformat
from nbclient import NotebookClient

ROOT = Path(__file__).resolve().parent.parent
POLL_SLICE_SECONDS = 1.0


class ReplyPollingClient(NotebookClient):
    """NotebookClient whose wait for a shell reply checks the socket directly at least once a second."""

    async def async_start_new_kernel_client(self):
        kernel_client = await super().async_start_new_kernel_client()
        channel = kernel_client.shell_channel
        wait_for_message = channel.get_msg

        async def get_msg(timeout=None):
            deadline = None if timeout is None else time.monotonic() + timeout
            while True:
                try:
                    return await wait_for_message(timeout=0)  # a plain poll: sees a reply already queued
                except Empty:
                    pass
                remaining = POLL_SLICE_SECONDS if deadline is None else deadline - time.monotonic()
                if remaining <= 0:
                    raise Empty
                try:
                    return await wait_for_message(timeout=min(POLL_SLICE_SECONDS, remaining))
                except Empty:
                    continue

        channel.get_msg = get_msg
        return kernel_client


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

        client = ReplyPollingClient(nb, timeout=args.timeout, kernel_name="python3",
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
        # written beside it, then moved over it: a test reading the lesson meanwhile sees the old file or the new one
        written = path.with_name(f".{path.name}.executed")
        nbformat.write(nb, written)
        written.replace(path)
        print(f"executed {path.name} in {time.perf_counter() - start:.1f} s", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
