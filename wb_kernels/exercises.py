"""Checking a learner's exercise answers (every lesson's "Exercises" section).

``check_answer`` prints one line and raises ``AssertionError`` with a hint when the answer is wrong,
so an exercise cell fails loudly in JupyterLab and under nbval.
"""

from __future__ import annotations

import math

__all__ = ["check_answer"]


def check_answer(name: str, given, expected, *, rel: float = 1e-6, hint: str = "") -> None:
    """Compare a numeric (or bool/str) answer with the expected one."""
    if given is None or given is ...:
        raise AssertionError(f"{name}: no answer yet. {hint}".strip())
    if isinstance(expected, (int, float)) and not isinstance(expected, bool):
        ok = isinstance(given, (int, float)) and math.isclose(given, expected, rel_tol=rel, abs_tol=rel)
    else:
        ok = given == expected
    if not ok:
        raise AssertionError(f"{name}: {given!r} is not right. {hint}".strip())
    print(f"{name}: correct ✓")
