"""One source of truth: every kernel a lesson shows in full is the package's code, character for character."""

import json
import re
from pathlib import Path

import pytest

from wb_kernels.lesson_sync import module_regions, notebook_regions, region_source, resync_notebook

ROOT = Path(__file__).resolve().parent.parent
NOTEBOOKS = sorted((ROOT / "notebooks").glob("*.ipynb"))


@pytest.mark.parametrize("notebook", NOTEBOOKS, ids=lambda p: p.name)
def test_region_cells_equal_the_package(notebook):
    for name, module, text in notebook_regions(notebook):
        assert text == region_source(module, name), (
            f"{notebook.name}: the cell showing region {name!r} of {module} differs from the package; "
            "run `python -m wb_kernels.lesson_sync` on the lesson, or copy the cell into the package")


def test_sync_detects_drift(tmp_path):
    module = tmp_path / "m.py"
    module.write_text("x = 1\n# region: kernel\ndef f():\n    return 1\n# endregion\n")
    assert module_regions(module) == {"kernel": "def f():\n    return 1"}


@pytest.mark.parametrize("notebook", NOTEBOOKS, ids=lambda p: p.name)
def test_lesson_structure_and_markers(notebook):
    cells = json.loads(notebook.read_text())["cells"]
    text = "\n".join("".join(c["source"]) for c in cells if c["cell_type"] == "markdown")
    for heading in ("What you will learn", "## Summary", "## Exercises"):
        assert heading in text, f"{notebook.name} lacks the section {heading!r}"
    code = ["".join(c["source"]) for c in cells if c["cell_type"] == "code"]
    assert any("slider" in c for c in code), f"{notebook.name} has no slider"
    for source in code:
        for line in source.splitlines():
            # nbval only honours a marker alone on its line; "# NBVAL_IGNORE_OUTPUT (why)" is silently checked
            if re.match(r"\s*#\s*NBVAL_\w+\b\s*\S", line):
                pytest.fail(f"{notebook.name}: marker with trailing text is ignored by nbval: {line!r}")
    for cell in cells:
        for output in cell.get("outputs", []):
            assert output.get("output_type") != "error", f"{notebook.name} is committed with an error output"


def test_resync_restores_an_edited_region_cell_and_keeps_outputs(tmp_path):
    lesson = ROOT / "notebooks" / "02_naive.ipynb"
    copy = tmp_path / lesson.name
    notebook = json.loads(lesson.read_text())
    index = next(i for i, c in enumerate(notebook["cells"]) if "".join(c["source"]).startswith("# region: "))
    cell = notebook["cells"][index]
    outputs = cell["outputs"]
    cell["source"] = cell["source"][:1] + ["# a learner's edit\n"]
    copy.write_text(json.dumps(notebook, indent=1, ensure_ascii=False) + "\n")
    name = "".join(cell["source"]).split()[2]
    assert resync_notebook(copy) == [name]
    restored = json.loads(copy.read_text())["cells"][index]
    assert restored["source"] == json.loads(lesson.read_text())["cells"][index]["source"]
    assert restored["outputs"] == outputs
    assert resync_notebook(copy) == []  # now in sync: nothing rewritten


def test_replace_region_swaps_one_body_and_raises_key_error_for_a_missing_region():
    from wb_kernels.lesson_sync import lines_changed, replace_region

    python = "a = 1\n    # region: body\n    x = 1\n    # endregion\nb = 2\n"
    assert replace_region(python, "body", "\n    x = 2\n") == "a = 1\n    # region: body\n    x = 2\n    # endregion\nb = 2\n"
    cuda = "// region: k\nint x;\n// endregion\n"
    assert replace_region(cuda, "k", "int y;", comment="//") == "// region: k\nint y;\n// endregion\n"
    with pytest.raises(KeyError):
        replace_region(python, "other", "x = 3")
    with pytest.raises(KeyError):  # a '#' marker is not a '//' one
        replace_region(python, "body", "x = 3", comment="//")
    assert lines_changed("a\nb\nc", "a\nB\nc\nd") == 2
