"""Every lesson's exercises and puzzles: the shipped lessons leave them unanswered, every solution passes its check.

Each rung with exercises has ``stages/<rung>/exercises.py`` (the checks) and ``solutions.py`` (the worked
answers). The lesson's own run under nbval shows the unanswered state ("not yet", "not solved yet"); these tests
hold the other side: each solution is graded correct, a wrong answer fails loudly, and the committed lessons do
not ship an answer.
"""

from __future__ import annotations

import importlib
import math
import json
import re
from pathlib import Path

import pytest

import wb_kernels as wb
from wb_kernels import cuda_build
from stage_cases import tool_or_skip
from wb_kernels.exercises import Exercise, check_answers, grade

ROOT = Path(__file__).resolve().parent.parent
# (lesson, module holding exercises.py and solutions.py)
LESSONS = [
    ("01_reference", "wb_kernels.stages.reference"),
    ("02_naive", "wb_kernels.stages.naive"),
    ("03_tiled", "wb_kernels.stages.tiled"),
    ("04_flash", "wb_kernels.stages.flash"),
    ("05_wmma", "wb_kernels.stages.wmma"),
    ("06_mma", "wb_kernels.stages.mma"),
    ("07_decode", "wb_kernels.stages.decode"),
    ("08_backward", "wb_kernels.stages.backward"),
    ("09_hopper", "wb_kernels.stages.hopper"),
    ("10_distributed", "wb_kernels.stages.distributed"),  # not a stage: the code around the other stages
    ("11_bench", "wb_kernels.bench"),  # the dashboard lesson: not a rung, its exercises live with the benchmark
]


def _modules(package):
    return importlib.import_module(f"{package}.exercises"), importlib.import_module(f"{package}.solutions")


def _needs_nvcc(package):
    """Lesson 05's first exercise is graded from the compiled kernel: nvcc and cuobjdump are needed."""
    if package.endswith(".wmma"):
        for find in (cuda_build.find_nvcc, cuda_build.find_cuobjdump):
            tool_or_skip(find, "grade lesson 05's exercises")


def test_every_lesson_has_exercises():
    rungs = {stage.lesson for stage in wb.available_stages().values()}
    lessons = {path.stem for path in (ROOT / "notebooks").glob("*.ipynb")}
    assert rungs <= lessons and {lesson for lesson, _ in LESSONS} == lessons


@pytest.mark.parametrize("lesson, package", LESSONS, ids=[lesson for lesson, _ in LESSONS])
def test_solutions_pass_their_checks(lesson, package, capsys):
    _needs_nvcc(package)
    exercises, solutions = _modules(package)
    answers = [getattr(solutions, f"answer_{n + 1}") for n in range(len(exercises.EXERCISES))]
    exercises.check(*answers)
    lines = capsys.readouterr().out.splitlines()
    assert lines == [f"{e.name}: correct ✓" for e in exercises.EXERCISES]


@pytest.mark.parametrize("lesson, package", LESSONS, ids=[lesson for lesson, _ in LESSONS])
def test_unanswered_says_not_yet_and_a_wrong_answer_fails(lesson, package, capsys):
    exercises, _ = _modules(package)
    count = len(exercises.EXERCISES)
    exercises.check(*[...] * count)  # the lesson as shipped: no error, one "not yet" per exercise
    assert all(": not yet." in line for line in capsys.readouterr().out.splitlines())
    with pytest.raises(AssertionError, match="exercise 1"):
        exercises.check(*[-12345.0] + [...] * (count - 1))


@pytest.mark.parametrize("lesson, package", LESSONS, ids=[lesson for lesson, _ in LESSONS])
def test_lesson_ships_its_exercises_unanswered(lesson, package):
    cells = ["".join(c["source"]) for c in json.loads((ROOT / "notebooks" / f"{lesson}.ipynb").read_text())["cells"]
             if c["cell_type"] == "code"]
    answer_cells = [c for c in cells if c.startswith("answer_1 = ")]
    assert len(answer_cells) == 1, lesson
    assignments = re.findall(r"^(answer_\d+) = (.*?)(?:\s*#.*)?$", answer_cells[0], re.MULTILINE)
    exercises, _ = _modules(package)
    assert [name for name, _ in assignments] == [f"answer_{n + 1}" for n in range(len(exercises.EXERCISES))]
    assert all(value == "..." for _, value in assignments), assignments
    check_cell = f"from {package} import exercises\n\nexercises.check("
    assert any(c.startswith(check_cell) for c in cells), f"{lesson} does not grade its answers with {package}.exercises"


def test_grading_rules():
    exercise = Exercise("exercise 9", lambda: 2.0, "hint", rel=1e-3)
    assert grade(exercise, ...) == grade(exercise, None) == "not yet"
    assert grade(exercise, 2.001) == "correct" and grade(exercise, 2.01) == "wrong"
    assert grade(Exercise("e", lambda: 3), 3.5) == "wrong"
    assert grade(exercise, True) == "wrong"  # a bool is not a number here
    assert grade(Exercise("e", lambda: "async"), "async") == "correct"
    with pytest.raises(TypeError, match="3 answers expected"):
        check_answers([exercise] * 3, 1, 2)


# --- the coding puzzles: each solution solves its puzzle -----------------------------------------------

def _solved(check, solution, capsys) -> bool:
    check(solution)
    return "solved ✓" in capsys.readouterr().out


def test_tiled_bug_hunt_solution(capsys):
    from wb_kernels.stages.tiled import exercises, solutions

    assert _solved(exercises.check_scores_puzzle, solutions.make_scores_kernel, capsys)


def test_tiled_bug_hunt_in_the_lesson_is_solvable(capsys):
    """The lesson's buggy kernel, with its one missing line put back, solves the bug hunt: it takes the arguments
    the launcher passes today (a changed kernel signature must reach the puzzle's copy too)."""
    from wb_kernels.stages.tiled import exercises

    cells = ["".join(c["source"]) for c in json.loads((ROOT / "notebooks" / "03_tiled.ipynb").read_text())["cells"]]
    cell = next(c for c in cells if c.startswith("def make_buggy_scores_kernel"))
    definition = cell.split("\n\n\nfrom ")[0]
    loaded = "                k_tile[ty, tx] = 0.0\n"
    assert definition.count(loaded) == 1
    fixed = definition.replace(loaded, loaded + "            cuda.syncthreads()\n")
    namespace = {}
    exec("import math\nfrom numba import cuda, float32\n" + fixed, namespace)
    assert _solved(exercises.check_scores_puzzle, namespace["make_buggy_scores_kernel"], capsys)


# --- graders that test the idea: every plausible wrong answer is rejected (data in each exercises.py) ----------

def _exercises(lesson_package):
    return _modules(lesson_package)[0].EXERCISES


@pytest.mark.parametrize("lesson, package", LESSONS, ids=[lesson for lesson, _ in LESSONS])
def test_every_listed_wrong_answer_is_graded_wrong(lesson, package):
    _needs_nvcc(package)
    accepted = [f"{e.name}: {label} = {value!r}" for e in _exercises(package)
                for label, value in e.wrong_answers().items() if grade(e, value) != "wrong"]
    assert not accepted, "the grader accepts plausible wrong answers:\n" + "\n".join(accepted)


@pytest.mark.parametrize("lesson, package", LESSONS, ids=[lesson for lesson, _ in LESSONS])
def test_a_right_answer_rounded_to_three_figures_or_in_other_case_is_accepted(lesson, package):
    _needs_nvcc(package)
    for exercise in _exercises(package):
        expected = exercise.expected()
        if isinstance(expected, str):
            assert grade(exercise, f" {expected.swapcase()} ") == "correct", exercise.name
        elif isinstance(expected, float):
            assert grade(exercise, float(f"{expected:.3g}")) == "correct", (exercise.name, expected)


def test_three_figures_rule():
    exercise = Exercise("e", lambda: math.log(65504.0))
    assert grade(exercise, 11.1) == "correct" and grade(exercise, 11.0899) == "correct"
    assert grade(exercise, 11.2) == "wrong"
    assert grade(Exercise("e", lambda: 16257024), 16257024.0) == "correct"
    assert grade(Exercise("e", lambda: 16257024), 16257000) == "wrong"  # a count is exact
    assert grade(Exercise("e", lambda: "async"), "Async") == "correct"


def _puzzle(package):
    exercises, solutions = _modules(package)
    assert hasattr(exercises, "PUZZLE"), f"{package}.exercises has no PUZZLE (grader + wrong answers as data)"
    return exercises.PUZZLE, getattr(solutions, exercises.PUZZLE.solution)


@pytest.mark.parametrize("lesson, package", LESSONS, ids=[lesson for lesson, _ in LESSONS])
def test_each_puzzle_solves_with_its_solution_and_rejects_every_listed_wrong_answer(lesson, package):
    from wb_kernels.exercises import puzzle_verdict

    _needs_nvcc(package)
    puzzle, solution = _puzzle(package)
    assert len(puzzle.wrong) >= 2, "list the plausible wrong answers the grader must reject"
    assert "solved ✓" in puzzle_verdict(puzzle, solution)
    # a wrong answer that is a race (a missing barrier) fails reliably only on the simulator, which switches threads
    # at every step; a GPU may happen to order the threads so that it gives the right numbers
    races = getattr(_modules(package)[0], "RACES", frozenset()) if wb.BACKEND.is_gpu else frozenset()
    fooled = {label: line for label, build in puzzle.wrong.items()
              if label not in races and "✓" in (line := puzzle_verdict(puzzle, build()))}
    assert not fooled, f"the grader passes wrong answers: {fooled}"
