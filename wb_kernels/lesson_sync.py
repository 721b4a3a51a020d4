"""One source of truth between the lessons and the package (lessons 02-07; checked by CI).

A module marks a piece of code a lesson shows in full with

    # region: scores_kernel
    ...
    # endregion

(``// region: name`` and ``// endregion`` in CUDA sources). A lesson shows it in a code cell whose
first line is ``# region: scores_kernel (wb_kernels/stages/naive/kernel.py)``, followed by exactly the
same text. The learner may edit and re-run that cell; ``tests/test_lesson_sync.py`` fails when a
committed notebook and the package drift apart.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

__all__ = ["module_regions", "notebook_regions", "region_source", "resync_notebook", "replace_region", "lines_changed",
           "install_input_transformer", "PACKAGE_ROOT"]

PACKAGE_ROOT = Path(__file__).resolve().parent
_START = re.compile(r"^\s*(?:#|//) region: (\w+)\s*$")
_END = re.compile(r"^\s*(?:#|//) endregion\s*$")
_CELL_HEADER = re.compile(r"^# region: (\w+) \((wb_kernels/[\w/.]+)\)\s*$")


def module_regions(path) -> dict:
    """{name: source text} of the regions in a package file (markers excluded, text dedented not)."""
    regions, name, lines = {}, None, []
    for line in Path(path).read_text().splitlines():
        if name is None:
            match = _START.match(line)
            if match:
                name, lines = match.group(1), []
        elif _END.match(line):
            regions[name] = "\n".join(lines).strip("\n")
            name = None
        else:
            lines.append(line)
    if name is not None:
        raise ValueError(f"{path}: region {name!r} has no endregion")
    return regions


def region_source(relative_path: str, name: str) -> str:
    """The text of region `name` in ``wb_kernels/<...>`` (a path relative to the repository)."""
    path = PACKAGE_ROOT.parent / relative_path
    regions = module_regions(path)
    if name not in regions:
        raise KeyError(f"{relative_path} has no region {name!r}; it has {sorted(regions)}")
    return regions[name]


def replace_region(source: str, name: str, text: str, comment: str = "#") -> str:
    """`source` with the body of region `name` (marked ``<comment> region: NAME`` ... ``<comment> endregion``)
    replaced by `text`; raises KeyError when `source` has no such region."""
    marker = re.escape(comment)
    pattern = re.compile(r"(^[ \t]*" + marker + r" region: " + re.escape(name) + r"[ \t]*\n)(.*?)(^[ \t]*" + marker
                         + r" endregion[ \t]*$)", re.MULTILINE | re.DOTALL)
    match = pattern.search(source)
    if match is None:
        raise KeyError(f"no region {name!r}")
    return source[:match.start(2)] + text.strip("\n") + "\n" + source[match.end(2):]


def lines_changed(old: str, new: str) -> int:
    """How many lines of `new` differ from `old` (line by line, plus the difference in length)."""
    old_lines, new_lines = old.splitlines(), new.splitlines()
    return sum(a != b for a, b in zip(old_lines, new_lines)) + abs(len(old_lines) - len(new_lines))


def install_input_transformer(transform) -> bool:
    """Put `transform` first among this IPython shell's cleanup input transformers (once), so that a region cell
    a lesson edits becomes the Python call that records it. Returns False outside IPython."""
    try:
        from IPython import get_ipython
    except ImportError:
        return False
    shell = get_ipython()
    if shell is None:
        return False
    transforms = shell.input_transformers_cleanup
    if transform not in transforms:
        transforms.insert(0, transform)
    return True


def _region_cells(notebook: dict):
    """Yield (cell, header line, name, relative module path, cell text after the header) per region cell."""
    for cell in notebook["cells"]:
        if cell["cell_type"] != "code":
            continue
        first, _, rest = "".join(cell["source"]).partition("\n")
        match = _CELL_HEADER.match(first)
        if match:
            yield cell, first, match.group(1), match.group(2), rest.strip("\n")


def notebook_regions(notebook_path) -> list:
    """[(name, relative module path, cell text after the header)] for every region cell of a notebook."""
    notebook = json.loads(Path(notebook_path).read_text())
    return [(name, module, text) for _, _, name, module, text in _region_cells(notebook)]


def _moved_to(relative_path: str, name: str):
    """None when ``relative_path`` has region `name`; else the one file of its folder that has it now (a file split
    in several, a region moved to a header), as lessons name it. Raises KeyError when none or several have it."""
    path = PACKAGE_ROOT.parent / relative_path
    if path.is_file() and name in module_regions(path):
        return None
    holders = [other for other in sorted(path.parent.glob("*")) if other.suffix in (".py", ".cu", ".cuh")
               and name in module_regions(other)]
    if len(holders) != 1:
        raise KeyError(f"{relative_path} has no region {name!r}, and {len(holders)} files beside it have one")
    return holders[0].relative_to(PACKAGE_ROOT.parent).as_posix()


def resync_notebook(notebook_path) -> list:
    """Rewrite every region cell of a lesson from the package (after a kernel changed there); keeps the
    cells' outputs. A region that moved to another file of its folder (a file split in several) gets that file's
    name in its cell's header. Returns the names of the regions whose cell changed.

        python -m wb_kernels.lesson_sync notebooks/02_naive.ipynb ...
    """
    path = Path(notebook_path)
    notebook = json.loads(path.read_text())
    changed = []
    for cell, header, name, module, text in _region_cells(notebook):
        moved = _moved_to(module, name)
        if moved is not None:
            module, header = moved, f"# region: {name} ({moved})"
        package_text = region_source(module, name)
        if text != package_text or moved is not None:
            cell["source"] = (header + "\n" + package_text).splitlines(keepends=True)
            changed.append(name)
    if changed:  # the layout Jupyter itself writes, so that a resync shows as a small diff
        path.write_text(json.dumps(notebook, indent=1, ensure_ascii=False) + "\n")
    return changed


if __name__ == "__main__":
    import sys

    for argument in sys.argv[1:]:
        names = resync_notebook(argument)
        print(f"{argument}: {', '.join(names) if names else 'in sync'}")
