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
           "COMPILE_TARGETS", "instruction_count", "compile_here", "launch_keys_here", "compile_report",
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


# ---------------------------------------------------------------------------------------------- compiled code

COMPILE_TARGETS = (("sm_80", 80, "A100"), ("sm_90a", 90, "H100"))  # (ptxas arch, capability, a GPU of it)


def instruction_count(row: dict, family: str) -> int:
    """How many instructions of `family` (the first words of a key of ``compiled.INSTRUCTION_FAMILIES``: "mma.sync",
    "wgmma", "cp.async", "cp.async.bulk", ...) a summary row counts."""
    found = [count for name, count in row["instructions"].items() if name.split(" (")[0] == family]
    if len(found) != 1:
        raise KeyError(f"{family!r}: not one of {[name.split(' (')[0] for name in row['instructions']]}")
    return found[0]


def _signature(fn, values: dict) -> tuple:
    """(signature, constexprs, attrs) of a Triton ``ASTSource`` for a call of `fn` with `values` {argument: value},
    specialized as a launch specializes it: None, bools, ints equal to 1 (a unit stride, one head) and constexpr
    arguments become constants, tensors pointers aligned to 16 bytes (torch's allocations are), ints divisible by
    16 say so; an int the kernel names in ``do_not_specialize`` stays a plain int."""
    import torch

    pointer_types = {torch.float16: "*fp16", torch.bfloat16: "*bf16", torch.float32: "*fp32", torch.int32: "*i32",
                     torch.int64: "*i64", torch.int8: "*i8", torch.uint8: "*u8"}
    signature, constexprs, attrs = {}, {}, {}
    for index, param in enumerate(fn.params):
        if param.name not in values:
            raise KeyError(f"{fn.__name__}: no value for its argument {param.name!r}")
        value = values[param.name]
        free = getattr(param, "do_not_specialize", False)  # (the kernel's do_not_specialize: a plain int, always)
        if param.is_constexpr or value is None or isinstance(value, bool) or (
                type(value) is int and value == 1 and not free):
            signature[param.name], constexprs[param.name] = "constexpr", value
        elif isinstance(value, torch.Tensor):
            signature[param.name] = pointer_types[value.dtype]
            attrs[(index,)] = [["tt.divisibility", 16]]
        elif isinstance(value, int):
            signature[param.name] = "i32" if -2**31 <= value < 2**31 else "i64"
            if value % 16 == 0 and not free:
                attrs[(index,)] = [["tt.divisibility", 16]]
        else:
            signature[param.name] = "fp32"
    return signature, constexprs, attrs


class _LaunchRecorder:
    """Stands in for the kernels module while the launcher prepares a call: each ``kernel[grid](...)`` is recorded
    as (name, kernel, positional arguments, keyword arguments) and nothing runs. The launcher then builds exactly the
    arguments a GPU launch gets, for any variants, on meta tensors (shapes and dtypes, no data)."""

    INTERPRETING = False

    def __init__(self, kernels):
        self._kernels = kernels
        self.launches = []

    def __getattr__(self, name):
        found = getattr(self._kernels, name)
        if not hasattr(found, "params"):  # not a @triton.jit kernel: a helper or a constant
            return found
        recorder = self

        class _Grid:
            def __getitem__(self, grid):
                def launch(*args, **kwargs):
                    recorder.launches.append((name, found, args, kwargs))
                return launch
        return _Grid()


def _compiled_variants(name: str, B: int, H: int, L: int, dtype):
    """The variants of a compile problem, on meta tensors: "plain", one of ``VARIANT_NAMES`` alone, or "every
    named variant" (softcap, ALiBi, a (1, H, L, L) bias, a two-sided window, document ids and sinks at once)."""
    import torch

    from ...variants import NO_VARIANTS, VARIANT_NAMES

    meta = lambda *shape, dtype=dtype: torch.empty(*shape, dtype=dtype, device="meta")  # noqa: E731
    each = dict(softcap=30.0, alibi_slopes=meta(B, H, dtype=torch.float32), bias=meta(1, H, L, L), window=(64, 16),
                document_ids=(meta(B, L, dtype=torch.int64),) * 2, sinks=meta(H, dtype=torch.float32))
    assert set(each) == set(VARIANT_NAMES), "a variant without a compile example"
    if name == "plain":
        return NO_VARIANTS
    if name == "every named variant":
        return Variants(**each)
    if name in each:
        return Variants(**{name: each[name]})
    raise ValueError(f"variants: 'plain', 'every named variant' or one of {list(each)}, not {name!r}")


def _compiled_mods(mods) -> dict:
    """A compile problem's ``score_mod``, ``score_mod_derivative`` and ``mask_mod``: ``mods`` names a Python file and
    the functions in it ({"file": path, "score_mod": name, ...}; Triton compiles a jit function from its source
    file, so they come from one). A mask_mod's block mask is built by the launcher as for a call: its tile kernel
    recorded (and compiled) with the rest, its lists computed on meta tensors."""
    if not mods:
        return {}
    import importlib.util

    spec = importlib.util.spec_from_file_location("compiled_mods", mods["file"])
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return {name: getattr(module, mods[name]) for name in ("score_mod", "score_mod_derivative", "mask_mod")
            if mods.get(name)}


def _recorded_launches(problem: dict, kernels) -> list:
    """The launches (name, kernel, args, kwargs) of one problem: a dict with B, H, L, D, dtype, causal; optional
    block_m, block_n, num_warps, num_stages (override the launcher's), pass ("forward", the default, or
    "backward": the backward's kernels), variants (:func:`_compiled_variants`) and mods (:func:`_compiled_mods`)."""
    import torch

    from . import launcher

    B, H, L, D = (problem[name] for name in ("B", "H", "L", "D"))
    dtype = getattr(torch, problem["dtype"])
    meta = lambda *shape, dtype=dtype: torch.empty(*shape, dtype=dtype, device="meta")  # noqa: E731
    q = meta(B, H, L, D)
    variants = _compiled_variants(problem.get("variants", "plain"), B, H, L, dtype)
    options = dict(causal=problem["causal"], variants=variants,
                   **{name: problem.get(name) for name in ("block_m", "block_n", "num_warps", "num_stages")})
    options.update(_compiled_mods(problem.get("mods")))
    recorder = _LaunchRecorder(kernels)
    launcher.use_compiled_kernels(recorder)
    try:
        if problem.get("pass", "forward") == "forward":
            options.pop("score_mod_derivative", None)
            launcher.forward(q, q, q, **options)
        else:
            lse = meta(B, H, L, dtype=torch.float32)
            launcher.gradients(q, q, q, q, lse, q, **options)
    finally:
        launcher.use_compiled_kernels(kernels)
    return recorder.launches


def _specialized_launches(problem: dict, kernels) -> list:
    """[(name, kernel, signature, constexprs, attrs, launch options)] of one problem's recorded launches, specialized
    as Triton specializes a launch (:func:`_signature`)."""
    found = []
    for name, fn, args, kwargs in _recorded_launches(problem, kernels):
        values = dict(zip((param.name for param in fn.params), args))
        values.update(kwargs)
        launch = dict(num_warps=values.pop("num_warps", 4), num_stages=values.pop("num_stages", 3))
        found.append((name, fn, *_signature(fn, values), launch, values))
    return found


def _compiler_kernels():
    from . import kernels, launcher

    if kernels.INTERPRETING:
        raise RuntimeError("compiling needs TRITON_INTERPRET=0 before triton is imported (compile_report starts such "
                           "a process)")
    # the launcher would choose the interpreter on a machine without a GPU: it is told that the kernels compile
    launcher.use_compiled_kernels(kernels)
    return kernels


def launch_keys_here(problems: list) -> list:
    """For each problem, what Triton keys each launch's compiled kernel on: the kernel's name, the argument types and
    divisibility marks, the constants and the launch options (as text). Two problems with equal keys share compiled
    kernels; :func:`compile_report` with ``keys_only`` runs it in a compiling process."""
    kernels = _compiler_kernels()
    return [[[name, repr(sorted(signature.items())), repr(sorted((k, repr(v)) for k, v in constexprs.items())),
              repr(sorted(attrs.items())), repr(sorted(launch.items()))]
             for name, _, signature, constexprs, attrs, launch, _ in _specialized_launches(problem, kernels)]
            for problem in problems]


def compile_here(problems: list) -> list:
    """Compile what each problem launches (see :func:`_recorded_launches`: the forward of a plain call by default)
    for each of :data:`COMPILE_TARGETS` (or the problem's "targets", arch names), and read what came out: the
    PTX's instructions by family (``compiled.summarize_ptx``, which summarizes a GPU run's kernel the same way),
    shared memory, and ptxas's registers and spills, one dict per (problem, kernel, target). Needs a process whose
    Triton compiles (``TRITON_INTERPRET=0``): :func:`compile_report` runs it in one. Nothing is launched, so no GPU
    is needed: Triton compiles for a target it is given, down to the binary (its wheel brings ptxas)."""
    import re
    import subprocess
    import tempfile

    import triton
    from triton.backends.compiler import GPUTarget
    from triton.backends.nvidia.compiler import get_ptxas

    from . import launcher
    from .compiled import summarize_ptx

    kernels = _compiler_kernels()
    found = []
    for problem in problems:
        targets = [t for t in COMPILE_TARGETS if t[0] in problem.get("targets", [t[0] for t in COMPILE_TARGETS])]
        for name, fn, signature, constexprs, attrs, launch, values in _specialized_launches(problem, kernels):
            for arch, capability, gpu in targets:
                source = triton.compiler.ASTSource(fn=fn, signature=signature, constexprs=constexprs, attrs=attrs)
                try:
                    compiled = triton.compile(source, target=GPUTarget("cuda", capability, 32), options=launch)
                except Exception as error:  # noqa: BLE001 - a mod's refusal said as a launch says it
                    said = launcher.mod_complaint(error)
                    if said is None:
                        raise
                    raise ValueError(said) from error
                ptx = compiled.asm["ptx"]
                ptxas = get_ptxas(capability)
                with tempfile.TemporaryDirectory() as folder:
                    with open(f"{folder}/kernel.ptx", "w") as handle:
                        handle.write(ptx)
                    report = subprocess.run([ptxas.path, "-v", f"--gpu-name={arch}", f"{folder}/kernel.ptx", "-o",
                                             f"{folder}/kernel.cubin"], capture_output=True, text=True,
                                            check=True).stderr
                found.append(dict(
                    kernel=name, variants=problem.get("variants", "plain"), arch=arch, gpu=gpu, D=values.get("D"),
                    dtype=problem["dtype"], block_m=values.get("BLOCK_M"), block_n=values.get("BLOCK_N"),
                    num_warps=launch["num_warps"], num_stages=launch["num_stages"],
                    shared_bytes=int(compiled.metadata.shared),
                    registers=int(re.search(r"Used (\d+) registers", report).group(1)),
                    spill_bytes=sum(int(n) for n in re.findall(r"(\d+) bytes spill (?:stores|loads)", report)),
                    triton=triton.__version__, ptxas=str(ptxas.version), **summarize_ptx(ptx)))
    return found


def compile_report(problems: list, timeout: float = 300.0, *, keys_only: bool = False) -> list:
    """:func:`compile_here` (or, with ``keys_only``, :func:`launch_keys_here`) in a fresh Python process with
    ``TRITON_INTERPRET=0``: Triton decides between its interpreter and its compiler once per process, when it is
    imported, and a lesson's process without a GPU runs the interpreter. Raises RuntimeError with the child's last
    lines when it fails (no triton, no CUDA backend)."""
    import json
    import os
    import subprocess
    import sys

    function = "launch_keys_here" if keys_only else "compile_here"
    env = dict(os.environ, TRITON_INTERPRET="0", TRITON_DEFAULT_FP_FUSION="1")  # (1: the default, stated: no warning)
    code = (f"import json, sys; from wb_kernels.stages.triton.figures import {function}; "
            f"print(json.dumps({function}(json.loads(sys.argv[1]))))")
    run = subprocess.run([sys.executable, "-c", code, json.dumps(list(problems))], capture_output=True, text=True,
                         env=env, timeout=timeout)
    if run.returncode != 0:
        raise RuntimeError(f"{function} failed:\n" + "\n".join(run.stderr.strip().splitlines()[-8:]))
    return json.loads(run.stdout.strip().splitlines()[-1])
