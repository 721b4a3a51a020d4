"""Lesson 04 shows its two kernels region by region, and a learner can edit any region and re-run it.

The mechanism is the package's :mod:`wb_kernels.region_cells` (lesson 08 uses it for the backward's kernels too):
once :func:`enable_region_cells` has run, a cell headed ``# region: NAME (wb_kernels/stages/flash/<file>.py)`` whose
region is a piece of a kernel factory (``make_flash_kernel`` in ``kernel.py``, ``make_one_row_kernel`` in
``one_row_per_thread.py``) records the learner's text of it, rebuilds the factory with it and defines it in the
notebook. This module keeps the names lesson 04 imports; :data:`PIECES` here lists this rung's factories only.
"""

from __future__ import annotations

from ...region_cells import PIECES as _ALL_PIECES
from ...region_cells import assemble, enable_region_cells, record_piece, reset

__all__ = ["PIECES", "enable_region_cells", "record_piece", "assemble", "reset"]

# file (as the lesson names it) -> (the function its pieces make up, the pieces in file order): this rung's
PIECES = {file: entry for file, entry in _ALL_PIECES.items() if file.startswith("wb_kernels/stages/flash/")}
