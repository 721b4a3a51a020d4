"""Where a tile's 16-byte chunks land in shared memory, and what that costs ``ldmatrix`` (lesson 06, rung ``mma``).

The kernel keeps Q, K and V tiles in shared memory as rows of D 16-bit elements (128 or 256 bytes), and reads them
with ``ldmatrix``: each of its 8 x 8 matrices is 8 rows of 16 bytes, one row address per lane, served in one phase.
Shared memory has 32 banks of 4 bytes (:mod:`wb_kernels.shared_memory`), so one phase is conflict-free when its
8 x 16 = 128 bytes cover every bank exactly once. Three ways to store the rows:

- ``plain``: row r starts at r * 2D bytes. Every row start is a multiple of 128 bytes, so the 8 rows of one chunk
  column sit in the same four banks: an 8-way conflict, 8 passes (wavefronts) instead of 1.
- ``padded`` (lesson 05's choice): 8 extra elements per row, so row r is shifted by r * 16 bytes and the 8 rows of
  a column hit 8 different groups of four banks. Conflict-free, but it costs 16 bytes per row, and the rows are no
  longer 128-byte aligned: a tile is not one dense block, so a copy engine that writes dense, aligned tiles (the
  Hopper Tensor Memory Accelerator) cannot fill it.
- ``swizzled``: no padding; chunk c of row r is stored at chunk position c XOR (r mod 8). Within every row the
  chunks are only permuted, and the 8 rows of one logical column land at 8 different positions: conflict-free, no
  extra memory, rows stay aligned. The TMA's swizzle modes apply the same XOR idea to the tiles it writes.

:func:`swizzled_offset` is the kernel's own address arithmetic; :func:`wavefronts` counts the passes of one
``ldmatrix`` phase for each layout; :func:`draw_banks` draws where each chunk lands.

Sources: NVIDIA, *CUDA C++ Programming Guide*, "Shared Memory" (banks) and the TMA swizzle modes; *PTX ISA*,
"ldmatrix".
"""

from __future__ import annotations

import numpy as np

from ...plots import new_figure
from ...shared_memory import BANKS, WORD_BYTES, conflict_degree

__all__ = ["LAYOUTS", "CHUNK_BYTES", "CHUNK_ELEMENTS", "PAD_ELEMENTS", "swizzled_chunk", "swizzled_offset",
           "row_stride_bytes", "offset_bytes", "tile_bytes", "phase_banks", "wavefronts", "worst_wavefronts",
           "layout_summary", "bank_groups", "store_tile", "draw_banks"]

LAYOUTS = ("plain", "padded", "swizzled")
ELEMENT_BYTES = 2             # fp16 and bf16
CHUNK_BYTES = 16              # one cp.async copy, one ldmatrix row
CHUNK_ELEMENTS = CHUNK_BYTES // ELEMENT_BYTES
PAD_ELEMENTS = 8              # lesson 05's padding: one chunk per row
PHASE_ROWS = 8                # an ldmatrix 8 x 8 matrix: 8 rows of 16 bytes, one phase
LINE_BYTES = BANKS * WORD_BYTES  # 128: one pass over all banks


def _check_head_dim(head_dim: int) -> int:
    chunks = head_dim // CHUNK_ELEMENTS
    # the XOR with row % 8 needs at least 8 chunks (128 bytes) per row, and whole groups of 8
    if head_dim % CHUNK_ELEMENTS or chunks % PHASE_ROWS:
        raise ValueError(f"head_dim={head_dim}: the swizzle needs rows of a multiple of 64 elements (128 bytes)")
    return chunks


def swizzled_chunk(row, chunk):
    """Where chunk `chunk` of row `row` is stored within its row: ``chunk ^ (row % 8)`` (NumPy arrays too)."""
    return chunk ^ (row & 7)


# region: swizzled_offset
def swizzled_offset(row, chunk, head_dim: int):
    """Element offset of the 16-byte chunk `chunk` of row `row` in a swizzled tile with rows of `head_dim` elements:
    the chunk moves to position chunk XOR (row % 8) of its own row, so rows stay dense and 128-byte aligned while
    the 8 rows of one ldmatrix phase fall into 8 different groups of four banks."""
    return row * head_dim + ((chunk ^ (row & 7)) << 3)  # << 3: 8 elements per chunk
# endregion


def row_stride_bytes(layout: str, head_dim: int) -> int:
    """Bytes from one row's start to the next."""
    _check_layout(layout)
    return (head_dim + (PAD_ELEMENTS if layout == "padded" else 0)) * ELEMENT_BYTES


def _check_layout(layout: str) -> None:
    if layout not in LAYOUTS:
        raise ValueError(f"layout={layout!r}: use one of {', '.join(LAYOUTS)}")


def offset_bytes(layout: str, row, chunk, head_dim: int):
    """Byte offset in shared memory of the 16-byte chunk `chunk` of row `row` (NumPy arrays too)."""
    _check_head_dim(head_dim)
    if layout == "swizzled":
        return swizzled_offset(row, chunk, head_dim) * ELEMENT_BYTES
    return row * row_stride_bytes(layout, head_dim) + chunk * CHUNK_BYTES


def tile_bytes(layout: str, rows: int, head_dim: int) -> int:
    """Shared memory one tile of `rows` rows takes."""
    return rows * row_stride_bytes(layout, head_dim)


def phase_banks(layout: str, head_dim: int, chunk: int = 0, first_row: int = 0) -> list:
    """(lane, word, bank) for one ldmatrix phase: lanes 0..7 give rows first_row..first_row+7 at logical chunk
    `chunk`; each reads four consecutive 4-byte words."""
    rows = []
    for lane in range(PHASE_ROWS):
        start = int(offset_bytes(layout, first_row + lane, chunk, head_dim)) // WORD_BYTES
        rows += [(lane, word, word % BANKS) for word in range(start, start + CHUNK_BYTES // WORD_BYTES)]
    return rows


def wavefronts(layout: str, head_dim: int, chunk: int = 0, first_row: int = 0) -> int:
    """Passes shared memory needs for that phase: 1 when its 128 bytes hit every bank once, 8 at worst."""
    return conflict_degree(phase_banks(layout, head_dim, chunk, first_row))


def worst_wavefronts(layout: str, head_dim: int, rows: int = 64) -> int:
    """The most passes any phase of a `rows`-row tile needs (every chunk column, every aligned group of 8 rows:
    the groups the kernel's ldmatrix calls read)."""
    chunks = _check_head_dim(head_dim)
    return max(wavefronts(layout, head_dim, chunk, first) for chunk in range(chunks)
               for first in range(0, rows, PHASE_ROWS))


def layout_summary(head_dim: int, rows: int = 64) -> list:
    """Per layout: worst passes per ldmatrix phase, bytes of one tile of `rows` rows, and whether every row starts
    on a 128-byte boundary (what a copy engine writing dense tiles needs)."""
    return [{"layout": layout, "wavefronts": worst_wavefronts(layout, head_dim, rows),
             "tile_bytes": tile_bytes(layout, rows, head_dim),
             "rows_128_byte_aligned": row_stride_bytes(layout, head_dim) % LINE_BYTES == 0}
            for layout in LAYOUTS]


def bank_groups(layout: str, head_dim: int, rows: int = PHASE_ROWS) -> np.ndarray:
    """(rows, chunks): which group of four banks (0..7: banks 4g..4g+3) each logical chunk lands in."""
    chunks = _check_head_dim(head_dim)
    row, chunk = np.meshgrid(np.arange(rows), np.arange(chunks), indexing="ij")
    return (offset_bytes(layout, row, chunk, head_dim) % LINE_BYTES) // CHUNK_BYTES


def store_tile(tile, layout: str = "swizzled") -> np.ndarray:
    """A (rows, head_dim) tile as it lies in shared memory (flat, in elements): what the kernel's cp.async copies
    write, chunk by chunk. Read it back with :func:`offset_bytes` (or ``fragments.ldmatrix``)."""
    tile = np.asarray(tile)
    rows, head_dim = tile.shape
    chunks = _check_head_dim(head_dim)
    shared = np.zeros(tile_bytes(layout, rows, head_dim) // ELEMENT_BYTES, dtype=tile.dtype)
    row, chunk = np.meshgrid(np.arange(rows), np.arange(chunks), indexing="ij")
    start = offset_bytes(layout, row, chunk, head_dim) // ELEMENT_BYTES  # (rows, chunks)
    shared[start[..., None] + np.arange(CHUNK_ELEMENTS)] = tile.reshape(rows, chunks, CHUNK_ELEMENTS)
    return shared


def draw_banks(head_dim: int = 128, rows: int = PHASE_ROWS, phase_chunk: int = 0):
    """For each layout, rows x logical chunks of a tile, coloured by the group of four banks the chunk lands in; the
    framed column is one ldmatrix phase (8 rows at one logical chunk). One colour per row of the frame means one
    pass; a single colour all down the frame means 8 passes."""
    import matplotlib
    from matplotlib.patches import Rectangle

    chunks = _check_head_dim(head_dim)
    colours = matplotlib.colormaps["tab10"].colors[:PHASE_ROWS]
    fig, axes = new_figure(nrows=len(LAYOUTS), width=min(12.0, 1.6 + 0.55 * chunks), height=2.1 * len(LAYOUTS))
    for ax, layout in zip(axes, LAYOUTS):
        groups = bank_groups(layout, head_dim, rows)
        for r in range(rows):
            for c in range(chunks):
                g = int(groups[r, c])
                ax.add_patch(Rectangle((c, r), 1, 1, facecolor=colours[g], edgecolor="white", linewidth=1))
                ax.text(c + 0.5, r + 0.5, str(g), ha="center", va="center", fontsize=7, color="white")
        ax.add_patch(Rectangle((phase_chunk, 0), 1, min(rows, PHASE_ROWS), fill=False, edgecolor="black",
                               linewidth=2.2))
        passes = wavefronts(layout, head_dim, phase_chunk)
        ax.set(xlim=(0, chunks), ylim=(rows, 0), xticks=np.arange(chunks) + 0.5, xticklabels=range(chunks),
               yticks=np.arange(rows) + 0.5, yticklabels=range(rows), ylabel="row",
               title=f"{layout}: the framed ldmatrix phase takes {passes} pass{'es' if passes > 1 else ''}; "
                     f"{tile_bytes(layout, 64, head_dim) / 1024:.1f} KiB per 64-row tile", aspect="auto")
        ax.grid(False)
    axes[-1].set_xlabel(f"logical 16-byte chunk of the row (D = {head_dim}); number and colour: the chunk's group "
                        "of four banks")
    return fig
