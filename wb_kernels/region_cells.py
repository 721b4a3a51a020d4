"""A numba kernel factory shown region by region, each region an editable cell that rebuilds it (lessons 04, 08).

A kernel factory (``make_flash_kernel`` in ``stages/flash/kernel.py``, ``make_one_row_kernel`` in
``stages/flash/one_row_per_thread.py``, ``make_backward_kernels`` in ``stages/backward/cuda_cores.py``) is one
Python function, but a lesson shows it in consecutive regions (``# region: flash_scores`` ...), each in its own cell
with prose between: no cell of 180 lines. A piece of a function body is not Python a cell can run by itself, so
once :func:`enable_region_cells` has run, a cell headed ``# region: NAME (wb_kernels/stages/<rung>/<file>.py)``
whose region is such a piece records the learner's text of it instead, rebuilds the whole factory from the package
file with every recorded piece put in, and defines it in the notebook under its own name. The cells after it then
build and launch the learner's version, as they would after a cell holding the whole function. A region that is a
whole definition (``flash_launch``, ``backward_launch``) is not a piece: its cell runs as plain Python.

:data:`PIECES` lists the factories and their pieces, file by file. The CUDA C++ rungs do the same for ``.cu`` files
(:mod:`wb_kernels.cuda_build`); this is the Python counterpart.
"""

from __future__ import annotations

import importlib
import re
from pathlib import Path

from .lesson_sync import PACKAGE_ROOT, install_input_transformer, lines_changed, module_regions, replace_region

__all__ = ["PIECES", "enable_region_cells", "record_piece", "assemble", "reset", "edited_pieces"]

# file (as the lesson names it) -> (the function its pieces make up, the pieces in file order)
PIECES = {
    "wb_kernels/stages/flash/kernel.py": (
        "make_flash_kernel", ("flash_constants", "flash_signature", "flash_q_tile_and_registers", "flash_scores",
                              "flash_masks", "flash_online_softmax", "flash_pv", "flash_epilogue")),
    "wb_kernels/stages/flash/one_row_per_thread.py": (
        "make_one_row_kernel", ("one_row_setup", "one_row_tile_loop")),
    "wb_kernels/stages/backward/cuda_cores.py": (
        "make_backward_kernels", ("backward_constants", "backward_tile_helpers", "backward_two_products",
                                  "backward_dkdv_setup", "backward_dkdv_scores", "backward_dkdv_accumulate",
                                  "backward_dq_setup", "backward_dq_loop")),
}

_edits: dict = {}  # (file, piece) -> the learner's text
_CELL = re.compile(r"^# region: (\w+) \((wb_kernels/stages/\w+/\w+\.py)\)\s*$")


def _path(file: str) -> Path:
    return PACKAGE_ROOT.parent / file


def _pieces(file: str):
    if file not in PIECES:
        raise KeyError(f"{file} has no kernel factory shown in pieces; these do: {sorted(PIECES)}")
    return PIECES[file]


def assemble(file: str):
    """The factory of `file` with the learner's recorded pieces put in, defined in the module's namespace (its
    imports and constants) and returned."""
    function, pieces = _pieces(file)
    source = _path(file).read_text()
    for piece in pieces:
        if (file, piece) in _edits:
            source = replace_region(source, piece, _edits[file, piece])
    start = re.search(r"^[ \t]*# region: " + pieces[0] + r"[ \t]*$", source, re.MULTILINE).start()
    last = re.search(r"^[ \t]*# region: " + pieces[-1] + r"[ \t]*$", source, re.MULTILINE).end()
    end = re.compile(r"^[ \t]*# endregion[ \t]*$", re.MULTILINE).search(source, last).end()
    module = importlib.import_module(file.removesuffix(".py").replace("/", "."))
    namespace = dict(vars(module))
    # blank lines keep the line numbers of the file, so a traceback points at the right line of it
    code = "\n" * source[:start].count("\n") + source[start:end]
    exec(compile(code, str(_path(file)), "exec"), namespace)
    return namespace[function]


def record_piece(file: str, name: str, text: str, user_namespace: dict | None = None) -> None:
    """What a piece's cell runs: remember `text` for piece `name` (or forget it when it is the package's), print
    one line, and define the rebuilt factory in `user_namespace`."""
    function, pieces = _pieces(file)
    if name not in pieces:
        raise KeyError(f"{name!r} is not a piece of {function} in {file}; its pieces: {list(pieces)}")
    shipped = module_regions(_path(file))[name].strip("\n")
    text = text.strip("\n")
    if text == shipped:
        _edits.pop((file, name), None)
        print(f"region {name}: as in {file}")
    else:
        _edits[file, name] = text
        changed = lines_changed(shipped, text)
        print(f"region {name}: edited ({changed} line(s) differ from {file}); {function} now builds your version")
    if user_namespace is not None:
        user_namespace[function] = assemble(file)


def edited_pieces() -> list:
    """[(file, piece)] the learner changed in this process (the factories those files build are then theirs)."""
    return sorted(_edits)


def reset() -> None:
    """Forget every recorded piece: the factories are the package's again."""
    _edits.clear()


def _transform(lines: list) -> list:
    """IPython input transformer: a piece's cell becomes the call that records it."""
    match = _CELL.match(lines[0].rstrip("\n")) if lines else None
    if match is None or match.group(2) not in PIECES or match.group(1) not in PIECES[match.group(2)][1]:
        return lines
    name, file = match.groups()
    text = "".join(lines[1:])
    return [f"__import__('wb_kernels.region_cells', fromlist=['record_piece']).record_piece("
            f"{file!r}, {name!r}, {text!r}, globals())\n"]


def enable_region_cells() -> bool:
    """Let this notebook's piece cells run (see the module docstring). Returns False outside IPython."""
    return install_input_transformer(_transform)
