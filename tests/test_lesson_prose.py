"""No measured number is typed into a lesson's prose: speeds, times, ratios and percentages are printed by a cell
(computed there, or read from a committed results file whose GPU the cell names), so they cannot go stale.

A typed number that contradicts its source cannot be caught in general; what can be caught is a typed number of
the kinds that come from measurements. Allowed: the tolerance rule's factor ("2× rule"), tile and matrix shapes
("16 × 16"), and the exercises' givens (the text after "## Exercises").
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

LESSONS = sorted((Path(__file__).resolve().parent.parent / "notebooks").glob("*.ipynb"))
MEASURED = re.compile(
    r"(?<![\w$\\])\d+(?:\.\d+)?(?:[–-]\d+(?:\.\d+)?)?\s?(?:×|x\b)(?!\s*\d)(?! rule)"  # a ratio: 0.5×, 7.3x, 2.1–2.4×
    r"|\d+(?:\.\d+)?\s*(?:TFLOP/s|GB/s|ms\b|µs\b|s\b|seconds?\b|minutes?\b)"        # a speed or a time
    r"|\d+(?:\.\d+)?\s?%")                                                             # a percentage


def _prose(lesson: Path):
    for index, cell in enumerate(json.loads(lesson.read_text())["cells"]):
        if cell["cell_type"] == "markdown":
            text = "".join(cell["source"]).split("## Exercises")[0]
            yield index, text


@pytest.mark.parametrize("lesson", LESSONS, ids=[p.stem for p in LESSONS])
def test_no_measured_number_is_typed_into_the_prose(lesson):
    typed = [f"cell {index}: ...{text[max(0, m.start() - 40):m.end() + 10]!r}..."
             for index, text in _prose(lesson) for m in MEASURED.finditer(text)]
    assert not typed, "print these from a cell instead:\n" + "\n".join(typed)


def test_the_check_would_catch_a_typed_ratio():
    assert MEASURED.search("it lands at 0.5–0.7× FlashAttention-2")
    assert MEASURED.search("about 4 TFLOP/s on this GPU")
    assert MEASURED.search("raised D=64 by 30 %")
    assert MEASURED.search("measures all six again, live (about 15 seconds)")
    assert not MEASURED.search("tiles of 16 × 16 and the 2× rule")
