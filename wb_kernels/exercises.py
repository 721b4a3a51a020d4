"""Grading a learner's exercises and coding puzzles (every lesson's "Exercises" section).

Each rung keeps its exercises in ``stages/<rung>/exercises.py`` (the checks: what each answer must equal,
computed from the package, never typed by hand) and the worked answers in ``stages/<rung>/solutions.py``, a
file the learner opens on purpose. The lesson ships the answers unanswered (``answer_1 = ...``):

- an unanswered exercise prints ``exercise 1: not yet`` with a hint, so the lesson still runs top to bottom;
- a right answer prints ``exercise 1: correct ✓``;
- a wrong one prints ``exercise 1: not right`` with the hint, and the cell raises ``AssertionError`` after all
  answers are graded, so a wrong answer fails loudly in JupyterLab and under nbval.

A coding puzzle (a kernel stub to complete, or a bug to find) is graded by :func:`check_puzzle` with
``wb.check``: the learner's kernel runs (on the simulator when there is no GPU) and its output is held to the
float64 reference. A stub left as shipped prints "not solved yet", not an error.

``tests/test_exercises.py`` holds every rung's solutions to its checks, and checks that the committed lessons
ship every exercise unanswered.
"""

from __future__ import annotations

import math
import warnings
from dataclasses import dataclass
from typing import Callable

__all__ = ["Exercise", "grade", "check_answers", "check_puzzle"]


@dataclass(frozen=True)
class Exercise:
    """One question: what its answer must equal, and a hint for the learner."""

    name: str  # "exercise 1"; the lesson's variable is answer_1
    expected: Callable[[], object]  # computes the answer from the package when graded
    hint: str = ""
    rel: float = 1e-6  # relative (and absolute) tolerance for numeric answers


def _unanswered(given) -> bool:
    return given is None or given is ...


def _matches(given, expected, rel: float) -> bool:
    if isinstance(expected, (int, float)) and not isinstance(expected, bool):
        return (isinstance(given, (int, float)) and not isinstance(given, bool)
                and math.isclose(given, expected, rel_tol=rel, abs_tol=rel))
    return given == expected


def grade(exercise: Exercise, given) -> str:
    """"not yet", "correct" or "wrong"."""
    if _unanswered(given):
        return "not yet"
    return "correct" if _matches(given, exercise.expected(), exercise.rel) else "wrong"


def check_answers(exercises, *answers) -> None:
    """Grade ``answers[i]`` against ``exercises[i]``; one line each, then raise if any answer is wrong."""
    if len(answers) != len(exercises):
        raise TypeError(f"{len(exercises)} answers expected (answer_1 ... answer_{len(exercises)}), got {len(answers)}")
    wrong = []
    for exercise, given in zip(exercises, answers):
        verdict = grade(exercise, given)
        if verdict == "correct":
            print(f"{exercise.name}: correct ✓")
        elif verdict == "not yet":
            print(f"{exercise.name}: not yet. {exercise.hint}".rstrip())
        else:
            print(f"{exercise.name}: {given!r} is not right. {exercise.hint}".rstrip())
            wrong.append(exercise.name)
    if wrong:
        raise AssertionError(f"not right yet: {', '.join(wrong)} (the hints above say where to look)")


def check_puzzle(name: str, run: Callable, *, hint: str = "") -> None:
    """Run the learner's kernel with ``run()`` (which returns a :class:`wb_kernels.check.CheckResult`, the
    result of ``wb.check(..., verbose=False)``) and print whether the puzzle is solved. Returns nothing, so that
    the lesson's cell shows that one line."""
    with warnings.catch_warnings():
        # a wrong kernel computes with garbage (unset shared or device memory); on the simulator NumPy then warns
        # of overflows, a message about the symptom rather than the bug, and one that differs from run to run
        warnings.simplefilter("ignore", RuntimeWarning)
        result = run()
    if result.passed:
        print(f"{name}: solved ✓ (the output matches the float64 reference)")
    else:
        print(f"{name}: not solved yet: the output does not match the float64 reference. {hint}".rstrip())
