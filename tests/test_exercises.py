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
    ("11_triton", "wb_kernels.stages.triton"),
    ("99_bench", "wb_kernels.bench"),  # the dashboard lesson: not a rung, its exercises live with the benchmark
]


def _modules(package):
    return importlib.import_module(f"{package}.exercises"), importlib.import_module(f"{package}.solutions")


def _needs_nvcc(package):
    """Lesson 05's first exercise is graded from the compiled kernel: nvcc and cuobjdump are needed."""
    if package.endswith(".wmma"):
        for find in (cuda_build.find_nvcc, cuda_build.find_cuobjdump):
            tool_or_skip(find, "grade lesson 05's exercises")


def _needs_triton(package):
    """Lesson 11's puzzle runs Triton kernels (its interpreter without a GPU): triton is needed (Linux wheels)."""
    if package.endswith(".triton"):
        pytest.importorskip("triton", reason="lesson 11's puzzle runs Triton kernels: pip install triton")


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
    _needs_triton(package)
    puzzle, solution = _puzzle(package)
    assert len(puzzle.wrong) >= 2, "list the plausible wrong answers the grader must reject"
    assert "solved ✓" in puzzle_verdict(puzzle, solution)
    # a wrong answer that is a race (a missing barrier) fails reliably only on the simulator, which switches threads
    # at every step; a GPU may happen to order the threads so that it gives the right numbers
    races = getattr(_modules(package)[0], "RACES", frozenset()) if wb.BACKEND.is_gpu else frozenset()
    fooled = {label: line for label, build in puzzle.wrong.items()
              if label not in races and "✓" in (line := puzzle_verdict(puzzle, build()))}
    assert not fooled, f"the grader passes wrong answers: {fooled}"


# --- graders a learner can trust: copies, several timings, every taught formula, no answer shown early ----------

# the rungs' puzzles (the dashboard lesson's, with the benchmark, times a pretend device: its answer is handed no arrays)
PUZZLE_LESSONS = [(lesson, package) for lesson, package in LESSONS if package.startswith("wb_kernels.stages.")]


@pytest.mark.parametrize("lesson, package", PUZZLE_LESSONS, ids=[lesson for lesson, _ in PUZZLE_LESSONS])
def test_every_puzzle_grader_hands_the_learner_copies(lesson, package):
    puzzle, _ = _puzzle(package)
    assert getattr(puzzle.check, "hands_copies", False), (
        f"{package}.exercises: wrap {puzzle.check.__name__} in wb_kernels.exercises.hands_copies")


def _scribbling(answer):
    """The right answer, which then overwrites every array it was given with NaN (after keeping what it returns)."""
    import numpy as np
    import torch

    from wb_kernels.exercises import _copied

    def scribble(value):
        if isinstance(value, np.ndarray) and value.dtype.kind == "f":
            value[...] = np.nan
        elif isinstance(value, torch.Tensor) and value.is_floating_point():
            value.fill_(math.nan)
        elif isinstance(value, (tuple, list)):
            for x in value:
                scribble(x)

    def scribbler(*args):
        result = _copied(answer(*args))
        scribble(args)
        return result

    return scribbler


@pytest.mark.parametrize("lesson, package", PUZZLE_LESSONS, ids=[lesson for lesson, _ in PUZZLE_LESSONS])
def test_a_right_answer_that_overwrites_its_inputs_afterwards_still_solves_the_puzzle(lesson, package):
    """A grader that handed the learner its own arrays (views of the problem, the model's running state) would read
    the NaN back: in later steps, or in the reference it computes after the learner's function ran."""
    import inspect

    from wb_kernels.exercises import puzzle_verdict

    _needs_triton(package)
    puzzle, solution = _puzzle(package)
    if not inspect.isfunction(solution) or inspect.isgeneratorfunction(solution):
        pytest.skip("the answer is a kernel, a kernel factory, a source string or a generator: it is given no arrays")
    assert "solved ✓" in puzzle_verdict(puzzle, _scribbling(solution))


@pytest.mark.parametrize("package, label", [
    ("wb_kernels.stages.backward", "dO overwritten with zeros, no share returned (the inputs are the grader's?)"),
    ("wb_kernels.stages.reference", "v overwritten with zeros, zeros returned (the inputs are the grader's?)")])
def test_an_answer_that_overwrites_its_inputs_fools_a_grader_without_copies_and_not_ours(package, label):
    from wb_kernels.exercises import Puzzle, puzzle_verdict

    puzzle, _ = _puzzle(package)
    without_copies = Puzzle(puzzle.check.__wrapped__, puzzle.solution, puzzle.wrong)
    assert "solved ✓" in puzzle_verdict(without_copies, puzzle.wrong[label]())  # the leak, as it was
    assert "not solved yet" in puzzle_verdict(puzzle, puzzle.wrong[label]())


def test_the_ring_puzzle_is_graded_at_several_timings():
    """The producer that waits on the next slot's empty barrier works while the consumers are slower than the copies
    (the one timing the grader used to run) and hangs when they keep up: only several timings catch it."""
    from wb_kernels.stages.hopper import barrier_ring, exercises

    producer = exercises.PUZZLE.wrong["waits on the next slot's empty barrier: hangs when the consumers keep up"]()
    slow_consumers = (2, 4)  # copies land in 2 to 4 steps, consumers compute 4 steps per tile
    assert exercises.TIMINGS[0] == slow_consumers and len(set(exercises.TIMINGS)) >= 4
    for stages, consumers in exercises.RING_CASES:
        for seed in range(6):
            exercises._run_ring(producer, stages, consumers, seed, *slow_consumers)  # finishes: right at this speed
    with pytest.raises(barrier_ring.Deadlock):
        for timing in exercises.TIMINGS:
            for stages, consumers in exercises.RING_CASES:
                for seed in range(6):
                    exercises._run_ring(producer, stages, consumers, seed, *timing)


def _hint_merge_step(acc_out, acc_lse, out, lse):
    """Lesson 10's hint coded word for word: subtract the larger LSE before exp; lse = max + log(sum of the weights);
    weigh each side by exp(lse_side - lse); where both sides are -inf keep 0 and -inf."""
    import torch

    top = torch.maximum(acc_lse, lse)
    seen = torch.isfinite(top)
    shift = torch.where(seen, top, torch.zeros_like(top))
    merged_lse = torch.where(seen, shift + torch.log(torch.exp(acc_lse - shift) + torch.exp(lse - shift)), top)
    at = torch.where(seen, merged_lse, torch.zeros_like(top))
    out = torch.exp(acc_lse - at)[..., None] * acc_out + torch.exp(lse - at)[..., None] * out
    return out, merged_lse


def _stack_merge_step(acc_out, acc_lse, out, lse):
    """The merge lesson 10 prints after its puzzle (merge.merge_stack), of the two sides stacked."""
    import torch

    from wb_kernels.stages.distributed import merge

    return merge.merge_stack(torch.stack((acc_out, out)), torch.stack((acc_lse, lse)))


def _hint_merge_partials(outs, lses):
    """Lesson 07's hint coded word for word: lse = log(sum_s exp(lse_s)) after subtracting the largest lse_s; weigh
    split s by exp(lse_s - lse); empty splits weigh 0, a row with every split empty gives 0 and -inf."""
    import numpy as np

    top = lses.max(axis=0)
    seen = np.isfinite(top)
    shift = np.where(seen, top, 0.0)
    lse = np.where(seen, shift + np.log(np.exp(lses - shift).sum(axis=0)), -np.inf)
    weights = np.exp(lses - np.where(seen, lse, 0.0))
    return (weights[..., None] * outs).sum(axis=0), lse


@pytest.mark.parametrize("package, merge", [
    ("wb_kernels.stages.distributed", _hint_merge_step), ("wb_kernels.stages.distributed", _stack_merge_step),
    ("wb_kernels.stages.decode", _hint_merge_partials)], ids=["10-hint", "10-merge_stack", "07-hint"])
def test_the_merge_puzzles_accept_every_formula_their_lessons_teach(package, merge):
    """exp(lse_side - lse) with the merged lse near two thousand carries that lse's rounding (~1e-13) into the
    weights: right, and rejected by the 2x rule alone; the graders allow for it (the wrong merges stay rejected:
    test_each_puzzle_solves_with_its_solution_and_rejects_every_listed_wrong_answer)."""
    from wb_kernels.exercises import puzzle_verdict

    puzzle, _ = _puzzle(package)
    assert "solved ✓" in puzzle_verdict(puzzle, merge)


def test_lesson_10s_chunk_exercise_depends_on_the_rank_asked_about():
    """Exercise 3 once asked for a count that zigzag makes the same for every rank: any rank's reasoning passed."""
    from wb_kernels.stages.distributed import exercises

    exercise = exercises.EXERCISES[2]
    others = {rank: exercises.later_chunk_full_pairs(8, rank) for rank in range(8) if rank != 2}
    assert all(grade(exercise, value) == "wrong" for value in others.values()), others


# --- no lesson shows a puzzle's answer before the puzzle cell ----------------------------------------------------

def _normalized(line: str) -> str:
    """A line of code as the reveal check compares it: no comment, no indentation, single spaces."""
    line = re.sub(r"\s+(#|//).*$", "", line.strip())
    return "" if line.startswith(("#", "//")) else " ".join(line.split())


def _answer_lines(answer) -> list:
    """The code lines of an answer (a function, a kernel or a source string): no def line, decorator or docstring,
    nothing shorter than 8 characters (``return``, ``)``)."""
    import ast
    import inspect
    import textwrap

    if isinstance(answer, str):
        source = answer
    else:
        source = textwrap.dedent(inspect.getsource(getattr(answer, "py_func", answer)))
    skip = set()
    tree = ast.parse(source) if not isinstance(answer, str) else ast.Module(body=[], type_ignores=[])  # C++: as is
    if tree.body and isinstance(tree.body[0], (ast.FunctionDef, ast.AsyncFunctionDef)):
        body = tree.body[0].body
        skip |= set(range(1, body[0].lineno))  # decorators and the def
        if isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
            skip |= set(range(body[0].lineno, body[0].end_lineno + 1))
    return [norm for number, line in enumerate(source.splitlines(), 1)
            if number not in skip and len(norm := _normalized(line)) >= 8]


def _text_of(cell) -> str:
    text = "".join(cell["source"])
    for output in cell.get("outputs", []):
        text += "\n" + "".join(output.get("text", "")) + "\n" + "".join(output.get("data", {}).get("text/plain", ""))
    return text


def revealed_before_the_puzzle(cells, grader_name: str, answers) -> dict:
    """{answer's name: its lines shown before the puzzle cell} for each answer the lesson shows in full there.

    The puzzle cell is the first code cell that calls ``grader_name(``. An answer's lines are its code lines that the
    puzzle cell itself does not hold already (what the learner has to write); the lesson reveals the answer when
    every one of them appears, comments and indentation aside, in the source or the printed output of a cell above
    the puzzle cell. A lesson may show what the puzzle changes (the unscaled kernel, C = A B): then at least one
    line of the answer, the change, is still the learner's to find."""
    calls = re.compile(rf"^[^#\n]*\b{grader_name}\(", re.MULTILINE)
    puzzle = next(i for i, c in enumerate(cells) if c["cell_type"] == "code" and calls.search("".join(c["source"])))
    stub = {_normalized(line) for line in "".join(cells[puzzle]["source"]).splitlines()}
    shown = {_normalized(line) for cell in cells[:puzzle] for line in _text_of(cell).splitlines()}
    revealed = {}
    for name, answer in answers.items():
        to_write = [line for line in _answer_lines(answer) if line not in stub]
        if to_write and all(line in shown for line in to_write):
            revealed[name] = to_write
    return revealed


def _answers(package):
    import importlib

    puzzle, solution = _puzzle(package)
    answers = {puzzle.solution: solution}
    for dotted in puzzle.answers:
        module, name = dotted.split(":")
        answers[dotted] = getattr(importlib.import_module(module), name)
    return puzzle, answers


@pytest.mark.parametrize("lesson, package", LESSONS, ids=[lesson for lesson, _ in LESSONS])
def test_no_lesson_shows_a_puzzles_answer_before_the_puzzle_cell(lesson, package):
    _needs_nvcc(package)
    puzzle, answers = _answers(package)
    cells = json.loads((ROOT / "notebooks" / f"{lesson}.ipynb").read_text())["cells"]
    revealed = revealed_before_the_puzzle(cells, puzzle.check.__name__, answers)
    assert not revealed, f"{lesson} shows the puzzle's answer above the puzzle cell: {revealed}"


def test_the_reveal_check_catches_an_answer_printed_above_the_puzzle():
    from wb_kernels.stages.distributed import exercises, solutions

    def cell(kind, source, printed=""):
        outputs = [{"output_type": "stream", "name": "stdout", "text": printed}] if printed else []
        return {"cell_type": kind, "source": source, "outputs": outputs}

    stub = "def merge_step(acc_out, acc_lse, out, lse):\n    return acc_out, acc_lse\n"
    grade_cell = "exercises.check_merge_step_puzzle(merge_step)\n"
    answers = {"merge_step": solutions.merge_step}
    import inspect

    printed = cell("code", "print(inspect.getsource(merge_step))", inspect.getsource(solutions.merge_step))
    name = exercises.check_merge_step_puzzle.__name__
    assert revealed_before_the_puzzle([printed, cell("code", stub), cell("code", grade_cell)], name, answers)
    assert not revealed_before_the_puzzle([cell("code", stub), cell("code", grade_cell), printed], name, answers)
