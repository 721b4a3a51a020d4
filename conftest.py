"""pytest hooks for every test run from the repository root: tests/ and the lessons under nbval."""

import os


def pytest_runtest_logreport(report):
    """With WB_FAILURE_LOG set, append each failure's traceback to that file the moment it happens.

    pytest prints tracebacks only in its final summary, which a run stopped at a time limit (a GPU check)
    never reaches. Only the main process writes (pytest-xdist workers pass their reports up to it)."""
    path = os.environ.get("WB_FAILURE_LOG")
    if not path or not report.failed or os.environ.get("PYTEST_XDIST_WORKER"):
        return
    with open(path, "a", encoding="utf-8") as log:
        log.write(f"=== {report.nodeid} ({report.when})\n{report.longreprtext[-4000:]}\n\n")
