"""Lesson 11's figures, tables and slider logic as plain functions (inputs -> numbers or a matplotlib Figure), which
``tests/test_triton_lesson.py`` calls without a browser or a GPU.

- which key blocks the forward visits: :func:`key_block_range` and :func:`visited_key_blocks`, NumPy copies of the
  kernel's arithmetic (``key_block_range`` and ``document_block_range`` in ``kernels.py``), which the tests hold to the
  counts the kernel itself reports (:func:`launcher.visited_key_blocks`); :func:`visit_scaling` against the window
  and against L;
- a block mask's tiles: :func:`dense_mask` (the reference's mask for a call's causal flag, window and documents) and
  :func:`tile_states` (0 empty, 1 partial, 2 full per tile, as the ``block_mask_tiles`` kernel finds them);
- the figures: :func:`draw_tile_states`, :func:`draw_visit_scaling`, and the slider's :func:`draw_window_tiles`;
- :func:`kernel_part`: a long kernel of ``kernels.py`` in parts (a lesson cell holds at most 60 lines; the parts are
  cut from the package's text at fixed lines of it, so the lesson never holds a copy that could drift).

Nothing here imports triton: the lesson's figures draw without it.
"""

from __future__ import annotations

import numpy as np

from ...lesson_sync import region_source
from ...plots import new_figure, style
from ...reference import causal_offset, visible_keys
from ...variants import Variants, canonical_window

__all__ = ["key_block_range", "visited_key_blocks", "visit_scaling", "dense_mask", "tile_states", "tile_counts",
           "draw_tile_states", "draw_visit_scaling", "draw_window_tiles", "KERNEL_FILE", "KERNEL_PARTS",
           "kernel_parts", "kernel_part", "TILE_NAMES"]

KERNEL_FILE = "wb_kernels/stages/triton/kernels.py"
TILE_NAMES = ("empty", "partial", "full")  # the block mask's tile states 0, 1, 2
_TILE_COLORS = ("#ffffff", "#9ecae1", "#08519c")


# ---------------------------------------------------------------------------------------------- visited key blocks

def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def key_block_range(start_m: int, Lq: int, Lk: int, block_m: int, block_n: int, *, causal=None, window=None) -> tuple:
    """The key blocks ``[lo, hi)`` the query block starting at row `start_m` may see, as the kernel's
    ``key_block_range`` finds them: the first row bounds the keys from below (window), the last row from above
    (causal, window). `window` is ``wb.attention``'s (an int w or a pair (left, right))."""
    offset = causal_offset(causal, Lq, Lk) or 0
    left, right = canonical_window(window) or (None, None)
    last_row = min(start_m + block_m, Lq) - 1
    lo, hi = 0, Lk
    if causal:
        hi = min(hi, last_row + offset + 1)
    if right is not None:
        hi = min(hi, last_row + offset + right + 1)
    if left is not None:
        lo = max(lo, start_m + offset - left)
    lo_block = lo // block_n
    return lo_block, (_cdiv(hi, block_n) if hi > lo else lo_block)


def visited_key_blocks(Lq: int, Lk: int, block_m: int, block_n: int, *, causal=None, window=None,
                       document_ids=None) -> np.ndarray:
    """Key blocks the forward visits per query block (a plain call's loop: the range of :func:`key_block_range`,
    narrowed for documents to the span of key blocks whose ids can meet the query block's, as the kernel's
    ``document_block_range``). ``document_ids``: one (L,) array of sorted or unsorted ids for q and k (Lq = Lk)."""
    num_q_blocks, num_k_blocks = _cdiv(Lq, block_m), _cdiv(Lk, block_n)
    if document_ids is not None:
        ids = np.asarray(document_ids, dtype=np.int64)
        q_range = [(ids[m * block_m:(m + 1) * block_m].min(), ids[m * block_m:(m + 1) * block_m].max())
                   for m in range(num_q_blocks)]
        k_range = [(ids[n * block_n:(n + 1) * block_n].min(), ids[n * block_n:(n + 1) * block_n].max())
                   for n in range(num_k_blocks)]
    visits = np.zeros(num_q_blocks, dtype=np.int64)
    for m in range(num_q_blocks):
        lo, hi = key_block_range(m * block_m, Lq, Lk, block_m, block_n, causal=causal, window=window)
        if document_ids is not None:
            meeting = [n for n in range(num_k_blocks)
                       if q_range[m][0] <= k_range[n][1] and k_range[n][0] <= q_range[m][1]]
            lo, hi = (max(lo, meeting[0]), min(hi, meeting[-1] + 1)) if meeting else (0, 0)
        visits[m] = max(0, hi - lo)
    return visits


def visit_scaling(block: int, *, windows, lengths, window_at: int, length_at: int) -> dict:
    """The most key blocks any query block visits (square blocks of `block`), causal with a sliding window of w keys
    (the query's own included: ``window=(w - 1, 0)``) and causal alone: against the window at L = `length_at`, and
    against L at w = `window_at`. ``{"windows": ..., "lengths": ..., "window_vs_w", "causal_vs_w", "window_vs_L",
    "causal_vs_L"}`` (lists)."""
    def most(L, w):
        window = None if w is None else (w - 1, 0)
        return int(visited_key_blocks(L, L, block, block, causal="top_left", window=window).max())

    return {
        "windows": list(windows), "lengths": list(lengths), "window_at": window_at, "length_at": length_at,
        "window_vs_w": [most(length_at, w) for w in windows], "causal_vs_w": [most(length_at, None) for _ in windows],
        "window_vs_L": [most(L, window_at) for L in lengths], "causal_vs_L": [most(L, None) for L in lengths],
    }


# ---------------------------------------------------------------------------------------------- tile states

def dense_mask(Lq: int, Lk: int, *, causal=None, window=None, document_ids=None) -> np.ndarray:
    """(Lq, Lk) bool, True where query i sees key j: the reference's mask (``wb_kernels.reference.visible_keys``)
    for one batch entry. ``document_ids``: one (L,) array for q and k."""
    docs = None
    if document_ids is not None:
        ids = np.asarray(document_ids)[None]
        docs = (ids, ids)
    variants = Variants(window=canonical_window(window), document_ids=docs)
    return visible_keys(Lq, Lk, causal, None, 1, variants)[0, 0]


def tile_states(visible, block_m: int, block_n: int) -> np.ndarray:
    """(query blocks, key blocks) int8 of a dense (Lq, Lk) mask: 0 where no element of the tile is visible (the kernel
    skips it), 2 where every element inside the matrix is (visited without the elementwise mask), 1 otherwise."""
    visible = np.asarray(visible, dtype=bool)
    Lq, Lk = visible.shape
    states = np.zeros((_cdiv(Lq, block_m), _cdiv(Lk, block_n)), dtype=np.int8)
    for m in range(states.shape[0]):
        for n in range(states.shape[1]):
            tile = visible[m * block_m:(m + 1) * block_m, n * block_n:(n + 1) * block_n]
            states[m, n] = 0 if not tile.any() else 2 if tile.all() else 1
    return states


def tile_counts(states) -> dict:
    """{"empty": ..., "partial": ..., "full": ...} tiles of a tile-state array."""
    states = np.asarray(states)
    return {name: int((states == value).sum()) for value, name in enumerate(TILE_NAMES)}


# ---------------------------------------------------------------------------------------------- figures

def _draw_states(ax, states, block_m: int, block_n: int, title: str) -> None:
    from matplotlib.colors import ListedColormap

    states = np.asarray(states)
    ax.imshow(states, cmap=ListedColormap(_TILE_COLORS), vmin=0, vmax=2, interpolation="nearest", aspect="auto")
    nq, nk = states.shape
    ax.set_xticks(np.arange(-0.5, nk, 1), minor=True)
    ax.set_yticks(np.arange(-0.5, nq, 1), minor=True)
    ax.grid(which="minor", color="#bbbbbb", lw=0.6)
    ax.grid(which="major", visible=False)
    ax.tick_params(which="minor", length=0)
    ax.set_xlabel(f"key block ({block_n} keys)")
    ax.set_ylabel(f"query block ({block_m} rows)")
    counts = tile_counts(states)
    ax.set_title(f"{title}\n{counts['full']} full, {counts['partial']} partial, {counts['empty']} skipped", fontsize=9)


def draw_tile_states(panels: dict, block_m: int, block_n: int):
    """One panel per block mask: `panels` {title: tile states (query blocks, key blocks)}, drawn white (empty: never
    visited), light (partial: visited with the elementwise mask) and dark (full: visited without it)."""
    from matplotlib.patches import Patch

    fig, axes = new_figure(ncols=len(panels), width=3.4 * len(panels), height=4.0)
    axes = np.atleast_1d(axes)
    with style():
        for ax, (title, states) in zip(axes, panels.items()):
            _draw_states(ax, states, block_m, block_n, title)
    handles = [Patch(facecolor=color, edgecolor="#888888", label=name) for name, color in zip(TILE_NAMES, _TILE_COLORS)]
    fig.legend(handles=handles, loc="outside lower center", ncol=3, frameon=False)
    return fig


def draw_visit_scaling(scaling: dict, block: int):
    """Two panels from :func:`visit_scaling`: the most key blocks a query block visits against the window (L fixed)
    and against L (window fixed), for a sliding window and for causal alone."""
    fig, (left, right) = new_figure(ncols=2, width=10.0, height=3.6)
    left.plot(scaling["windows"], scaling["window_vs_w"], "o-", label="causal + sliding window")
    left.plot(scaling["windows"], scaling["causal_vs_w"], "s--", label="causal alone")
    left.set(xlabel="window w (keys)", ylabel="most key blocks a query block visits", xscale="log", yscale="log",
             title=f"against the window, L = {scaling['length_at']}")
    right.plot(scaling["lengths"], scaling["window_vs_L"], "o-", label=f"causal + window of {scaling['window_at']}")
    right.plot(scaling["lengths"], scaling["causal_vs_L"], "s--", label="causal alone")
    right.set(xlabel="sequence length L", xscale="log", yscale="log", title=f"against L, w = {scaling['window_at']}")
    for ax, ticks in ((left, scaling["windows"]), (right, scaling["lengths"])):
        ax.set_xticks(ticks, [str(t) for t in ticks])
        ax.minorticks_off()
        ax.legend()
    fig.suptitle(f"blocks of {block} x {block}", fontsize=9)
    return fig


def draw_window_tiles(L: int, window: int, block: int = 16):
    """The slider's picture: the tiles of a causal sliding window of `window` keys (the query's own included) at
    length `L`, beside causal alone, with the key blocks each query block visits."""
    panels = {}
    for title, options in ((f"causal + window of {window}", dict(causal="top_left", window=(window - 1, 0))),
                           ("causal alone", dict(causal="top_left"))):
        panels[title] = tile_states(dense_mask(L, L, **options), block, block)
    fig = draw_tile_states(panels, block, block)
    visits = visited_key_blocks(L, L, block, block, causal="top_left", window=(window - 1, 0))
    fig.suptitle(f"L = {L}: a query block of the window visits at most {int(visits.max())} key blocks", fontsize=10)
    return fig


# ---------------------------------------------------------------------------------------------- kernels in parts

# region -> ((part, the first line of the part, stripped; None for the region's first line), ...)
KERNEL_PARTS = {
    "attention_forward": (
        ("arguments", None),
        ("one program's rows, pointers and running statistics", "pid_m = tl.program_id(0)"),
        ("the loop over key blocks", "lo, hi = key_block_range("),
        ("the epilogue", "# a row that saw no key"),
    ),
    "backward_dk_dv": (
        ("arguments", None),
        ("one program's key block", "pid_n = tl.program_id(0)"),
        ("the loop over the group's heads and their query blocks", "for g in range(0, group):"),
        ("the stores", "tl.store(DK + kv_at"),
    ),
    "backward_dq": (
        ("arguments", None),
        ("one program's query block", "pid_m = tl.program_id(0)"),
        ("the loop over key blocks", "lo, hi = key_block_range("),
    ),
}


def kernel_parts(name: str) -> dict:
    """{part: text} of region `name` of ``kernels.py``, cut at the lines :data:`KERNEL_PARTS` names; the parts joined
    by newlines are the region. Raises KeyError when a cut line is not found (the kernel changed: update KERNEL_PARTS)."""
    if name not in KERNEL_PARTS:
        raise KeyError(f"{name!r}: no parts defined; these have: {sorted(KERNEL_PARTS)}")
    lines = region_source(KERNEL_FILE, name).splitlines()
    starts = []
    for part, first in KERNEL_PARTS[name]:
        if first is None:
            starts.append(0)
            continue
        after = starts[-1] + 1 if starts else 0
        found = next((i for i in range(after, len(lines)) if lines[i].strip().startswith(first)), None)
        if found is None:
            raise KeyError(f"{KERNEL_FILE}, region {name}: no line starting {first!r} after line {after} (part "
                           f"{part!r}); update figures.KERNEL_PARTS")
        starts.append(found)
    bounds = starts + [len(lines)]
    return {part: "\n".join(lines[bounds[i]:bounds[i + 1]]) for i, (part, _) in enumerate(KERNEL_PARTS[name])}


def kernel_part(name: str, part: str):
    """Part `part` of kernel `name`, headed by where it comes from, as IPython shows code (highlighted in JupyterLab,
    its text in plain output)."""
    from IPython.display import Code

    parts = kernel_parts(name)
    if part not in parts:
        raise KeyError(f"{name} has the parts {list(parts)}, not {part!r}")
    number = list(parts).index(part) + 1
    header = f"# {name} ({KERNEL_FILE}), part {number} of {len(parts)}: {part}"
    return Code(header + "\n" + parts[part].strip("\n"), language="python")
