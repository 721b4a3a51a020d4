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
float64 reference. A stub left as shipped prints "not solved yet", not an error. Every grader is wrapped in
:func:`hands_copies`: the learner's function gets copies of the grader's arrays, never the arrays the grader goes
on to read (a step that overwrote its inputs could otherwise move the reference to its own wrong answer).

``tests/test_exercises.py`` holds every rung's solutions to its checks, and checks that the committed lessons
ship every exercise unanswered.
"""

from __future__ import annotations

import functools
import inspect
import math
import numbers
import warnings
from dataclasses import dataclass, field
from typing import Callable, Mapping

import numpy as np

__all__ = ["Exercise", "Puzzle", "THREE_FIGURES", "grade", "check_answers", "check_puzzle", "hands_copies",
           "merged_lse_allowance", "on_copies", "puzzle_verdict"]

# A numeric answer rounded to three significant figures is within half a unit of the third figure: at most 0.5 %
# from the exact value (1.005 -> 1.00). The default tolerance accepts exactly that much, and no more.
THREE_FIGURES = 5e-3


@dataclass(frozen=True)
class Exercise:
    """One question: what its answer must equal, a hint for the learner, and the plausible wrong answers.

    ``wrong`` lists, as data, the answers a learner who misses the question's point would give (label -> the
    value, or a function computing it from the package); ``tests/test_exercises.py`` fails when the grader accepts
    any of them, or when it rejects the right answer rounded to three significant figures."""

    name: str  # "exercise 1"; the lesson's variable is answer_1
    expected: Callable[[], object]  # computes the answer from the package when graded
    hint: str = ""
    # relative tolerance for a float answer; an int answer must be exact (a count is not rounded)
    rel: float = THREE_FIGURES
    wrong: Mapping[str, object] = field(default_factory=dict)

    def wrong_answers(self) -> dict[str, object]:
        """The plausible wrong answers, each computed (a value stored as a function is called)."""
        return {label: value() if callable(value) else value for label, value in self.wrong.items()}


@dataclass(frozen=True)
class Puzzle:
    """A lesson's coding puzzle: its grader (prints one line, "solved ✓" only when the answer is right) and the
    plausible wrong answers as data (label -> a function building the answer the learner would pass), which
    ``tests/test_exercises.py`` feeds to the grader: a grader that says "solved ✓" to one of them is a bug."""

    check: Callable[[object], None]
    solution: str  # the name of the worked answer in the rung's solutions.py
    wrong: Mapping[str, Callable[[], object]]
    # the package's functions ("module:function") whose code is the puzzle's complete answer too (the solution is
    # one): the lesson shows none of them before the puzzle cell (tests/test_exercises.py checks it)
    answers: tuple = ()


def _copied(value):
    """A copy of an array (NumPy or torch), and of the arrays inside a tuple, list or dict; anything else as is."""
    if isinstance(value, np.ndarray):
        return value.copy()
    if type(value).__module__.startswith("torch") and callable(getattr(value, "clone", None)):
        return value.clone()
    if isinstance(value, (tuple, list)):
        return type(value)(_copied(x) for x in value)
    if isinstance(value, dict):
        return {key: _copied(x) for key, x in value.items()}
    return value


def on_copies(answer):
    """The learner's Python function, called with copies of its array arguments (a kernel, a string or any other
    answer is returned as it is): whatever it writes into its inputs stays with it."""
    if not (inspect.isfunction(answer) or isinstance(answer, functools.partial)):
        return answer

    @functools.wraps(answer)
    def called_on_copies(*args, **kwargs):
        return answer(*_copied(args), **_copied(kwargs))

    return called_on_copies


def hands_copies(grader):
    """Wrap a puzzle's grader (``grader(answer, ...)``) so that the learner's answer is called through
    :func:`on_copies`. Every rung's grader is wrapped; ``tests/test_exercises.py`` checks that each is."""

    @functools.wraps(grader)
    def grade_on_copies(answer, *args, **kwargs):
        return grader(on_copies(answer), *args, **kwargs)

    grade_on_copies.hands_copies = True
    return grade_on_copies


def merged_lse_allowance(lse_ref, v, merges: int) -> float:
    """What a correct merge may be off by in its output when it weighs each part by ``exp(lse_part - lse)`` with the
    merged ``lse`` itself (the formula lessons 07 and 10 teach): that lse is rounded to about ``|lse| * eps``, an
    error each of the `merges` merges carries into its weights, and so into an output of size up to ``max |v|``. At
    LSEs near two thousand that is ~1e-13 in float64, far above the 2x rule's tolerance for the other formula
    (weights from the larger part's lse, divided by their sum), and far below any of the wrong merges' errors."""
    finite = np.abs(np.asarray(lse_ref, dtype=np.float64))
    finite = finite[np.isfinite(finite)]
    if not finite.size:
        return 0.0
    largest_v = float(np.abs(np.asarray(v, dtype=np.float64)).max(initial=0.0))
    return 2.0 * merges * float(finite.max()) * float(np.finfo(np.float64).eps) * largest_v


def _unanswered(given) -> bool:
    return given is None or given is ...


def _is_number(x) -> bool:
    return isinstance(x, numbers.Real) and not isinstance(x, bool)


def _matches(given, expected, rel: float) -> bool:
    if _is_number(expected):
        if not _is_number(given):
            return False
        if isinstance(expected, numbers.Integral):
            return given == expected
        return math.isclose(given, expected, rel_tol=rel, abs_tol=0.0 if expected else 1e-12)
    if isinstance(expected, str):  # "Async" and "async " are the same word
        return isinstance(given, str) and given.strip().casefold() == expected.strip().casefold()
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


def puzzle_verdict(puzzle: Puzzle, answer) -> str:
    """Run ``puzzle.check(answer)`` and return the line it printed (for tests and tools, not for lessons)."""
    import contextlib
    import io

    buffer = io.StringIO()
    with contextlib.redirect_stdout(buffer):
        puzzle.check(answer)
    return buffer.getvalue()


def check_puzzle(name: str, run: Callable, *, hint: str = "") -> None:
    """Run the learner's kernel with ``run()`` (which returns a :class:`wb_kernels.check.CheckResult`, the
    result of ``wb.check(..., verbose=False)``, or any object with ``passed=False`` and a ``reason`` when the kernel
    failed before its output could be compared) and print whether the puzzle is solved. Returns nothing, so that
    the lesson's cell shows that one line."""
    with warnings.catch_warnings():
        # a wrong kernel computes with garbage (unset shared or device memory); on the simulator NumPy then warns
        # of overflows, a message about the symptom rather than the bug, and one that differs from run to run
        warnings.simplefilter("ignore", RuntimeWarning)
        result = run()
    if result.passed:
        print(f"{name}: solved ✓ (the output matches the float64 reference)")
    elif getattr(result, "reason", None):  # the kernel failed before its output could be compared: say how
        print(f"{name}: not solved yet: {result.reason}")
    else:
        print(f"{name}: not solved yet: the output does not match the float64 reference. {hint}".rstrip())
