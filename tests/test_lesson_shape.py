"""The lessons' shape, checked: small steps and claims that nbval holds.

- No code cell of a lesson is longer than ``MAX_CODE_CELL_LINES``: a kernel is shown region by region, each region
  introduced by prose, not in one cell that brings five ideas at once.
- A sentence of prose that states a fact about a computed result is asserted in the code cell that computes it, so
  the lesson's run under nbval fails when the fact stops holding. ``tests/claims/<lesson>.json`` lists such
  sentences: ``{"prose": <a phrase of a markdown cell>, "assert": <a phrase of an assert line>}``; the assert must
  sit in the nearest code cell above the markdown cell that holds the phrase.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
LESSONS = sorted((ROOT / "notebooks").glob("*.ipynb"))
CLAIMS = ROOT / "tests" / "claims"
MAX_CODE_CELL_LINES = 60


def _cells(lesson: Path):
    return [(c["cell_type"], "".join(c["source"])) for c in json.loads(lesson.read_text())["cells"]]


@pytest.mark.parametrize("lesson", LESSONS, ids=[p.stem for p in LESSONS])
def test_no_code_cell_is_longer_than_the_limit(lesson):
    long = [(index, len(text.splitlines())) for index, (kind, text) in enumerate(_cells(lesson))
            if kind == "code" and len(text.splitlines()) > MAX_CODE_CELL_LINES]
    assert not long, f"code cells over {MAX_CODE_CELL_LINES} lines (cell, lines): {long}; show them in steps"


def _claims(lesson: Path):
    path = CLAIMS / f"{lesson.stem}.json"
    return json.loads(path.read_text()) if path.exists() else []


@pytest.mark.parametrize("lesson", LESSONS, ids=[p.stem for p in LESSONS])
def test_every_listed_claim_is_asserted_in_the_cell_that_computes_it(lesson):
    cells = _cells(lesson)
    claims = _claims(lesson)
    assert claims, f"{lesson.stem} lists no claim in tests/claims/{lesson.stem}.json"
    problems = []
    for claim in claims:
        holders = [i for i, (kind, text) in enumerate(cells) if kind == "markdown" and claim["prose"] in text]
        if len(holders) != 1:
            problems.append(f"{claim['prose']!r}: in {len(holders)} markdown cells, not 1")
            continue
        above = [i for i in range(holders[0]) if cells[i][0] == "code"]
        if not above:
            problems.append(f"{claim['prose']!r}: no code cell above it")
            continue
        code = cells[above[-1]][1]
        asserts = [line for line in code.splitlines() if line.lstrip().startswith("assert")]
        if not any(claim["assert"] in line for line in asserts):
            problems.append(f"{claim['prose']!r}: cell {above[-1]} has no assert with {claim['assert']!r}")
    assert not problems, "\n".join(problems)


def test_the_claim_check_would_catch_an_unasserted_claim(tmp_path):
    lesson = tmp_path / "99_demo.ipynb"
    lesson.write_text(json.dumps({"cells": [
        {"cell_type": "code", "source": ["x = 1 + 1\n", "print(x)"]},
        {"cell_type": "markdown", "source": ["So x is two."]}]}))
    (tmp_path / "claims").mkdir()
    (tmp_path / "claims" / "99_demo.json").write_text(json.dumps([{"prose": "x is two", "assert": "x == 2"}]))
    globals()["CLAIMS"], saved = tmp_path / "claims", CLAIMS
    try:
        with pytest.raises(AssertionError, match="no assert"):
            test_every_listed_claim_is_asserted_in_the_cell_that_computes_it(lesson)
    finally:
        globals()["CLAIMS"] = saved
