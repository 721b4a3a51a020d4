"""The README's status section is generated from the recorded runs (scripts/status.py), never typed."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
_spec = importlib.util.spec_from_file_location("status", ROOT / "scripts" / "status.py")
status = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(status)

JUNIT = """<?xml version="1.0" encoding="utf-8"?><testsuites><testsuite name="pytest" errors="1" failures="2"
skipped="3" tests="20" time="1.0"></testsuite></testsuites>"""


def test_readme_status_is_what_the_recorded_runs_render():
    text = (ROOT / "README.md").read_text()
    block = text[text.index(status.README_START):text.index(status.README_END) + len(status.README_END)]
    assert block == status.render(), "README's status is stale: python scripts/status.py --update-readme"


def test_every_recorded_run_names_its_machine_date_and_commit():
    runs = list(status.STATUS_DIR.glob("*.json"))
    assert runs, "no run recorded in results/status/: the README's status would be empty"
    for path in runs:
        data = json.loads(path.read_text())
        assert data["date"] and data["machine"]["git_commit"] and data["suites"], path.name


def test_junit_counts_and_render_from_a_fabricated_run(tmp_path):
    (tmp_path / "tests.xml").write_text(JUNIT)
    assert status.junit_counts(tmp_path / "tests.xml") == {"passed": 14, "failed": 2, "errors": 1, "skipped": 3}
    run = {"name": "h100", "date": "2026-11-25", "seconds": 600,
           "machine": {"gpu": "NVIDIA H100 80GB HBM3", "git_commit": "abc1234", "torch": "2.11.0"},
           "suites": {"tests": status.junit_counts(tmp_path / "tests.xml")}}
    (tmp_path / "runs").mkdir()
    (tmp_path / "runs" / "h100.json").write_text(json.dumps(run))
    block = status.render(tmp_path / "runs")
    assert "**NVIDIA H100 80GB HBM3**, 2026-11-25, commit `abc1234`" in block
    assert "tests: 14 passed, 2 failed, 1 errors, 3 skipped" in block and "10 min in all" in block
