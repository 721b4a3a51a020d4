"""Lesson 11_triton's helpers without a browser: the figures' NumPy models against the kernels' own counts and block
masks, the kernel shown in parts, the compiled-code report (Triton compiles for a GPU without one), the exercises'
answers against what the stage computes, the puzzle as the lesson ships it, and the lesson without triton.

Tests that launch a kernel need triton (Linux wheels) and run on its interpreter without a GPU.
"""

from __future__ import annotations

import wb_kernels  # noqa: F401  (first: without a GPU it asks for Triton's interpreter before triton loads)

import importlib.util  # noqa: E402
import json  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import textwrap  # noqa: E402
from pathlib import Path  # noqa: E402
from types import SimpleNamespace  # noqa: E402

import numpy as np  # noqa: E402
import pytest  # noqa: E402

from wb_kernels.lesson_sync import notebook_regions, region_source  # noqa: E402
from wb_kernels.stages.triton import compiled, exercises, figures, solutions  # noqa: E402

try:
    import triton
    import triton.language as tl
except ImportError:  # the tests that launch a kernel skip; the others run
    triton = None

ROOT = Path(__file__).resolve().parent.parent
LESSON = ROOT / "notebooks" / "11_triton.ipynb"
MODS_FILE = str(Path(__file__).with_name("triton_mods.py"))  # mods a compiling process loads by path

if triton is not None:
    BAND = tl.constexpr(9)  # (a global: Triton's interpreter runs a jit function with its module's globals)

    @triton.jit
    def banded(b, h, q_idx, kv_idx):
        return (kv_idx <= q_idx) & (q_idx - kv_idx <= BAND)


def _needs_triton():
    return pytest.importorskip("triton", reason="the triton stage's kernels need triton (pip install triton)")


def _device():
    from wb_kernels.stages.triton import launcher

    return "cpu" if launcher.interpreting() else "cuda"


def _problem(L, Lk=None, *, H=1, seed=0):
    import torch

    generator = torch.Generator().manual_seed(seed)
    Lk = L if Lk is None else Lk
    q = torch.randn(1, H, L, 16, generator=generator)
    k, v = (torch.randn(1, H, Lk, 16, generator=generator) for _ in range(2))
    return tuple(x.to(_device()) for x in (q, k, v))


# ---------------------------------------------------------------------------------------------- the NumPy models

def test_key_block_range_by_hand():
    # rows 32..47 of 96, blocks of 16: causal sees key blocks 0..2; a window of 8 keys before the query, blocks 1..2
    assert figures.key_block_range(32, 96, 96, 16, 16, causal="top_left") == (0, 3)
    assert figures.key_block_range(32, 96, 96, 16, 16, causal="top_left", window=(8, 0)) == (1, 3)
    assert figures.key_block_range(32, 96, 96, 16, 16) == (0, 6)  # no mask: every key block
    # bottom_right with Lk = Lq + 32: the diagonal moves two blocks right
    assert figures.key_block_range(0, 64, 96, 16, 16, causal="bottom_right") == (0, 3)


def test_tile_states_and_counts_by_hand():
    i, j = np.arange(32)[:, None], np.arange(32)[None, :]
    states = figures.tile_states(j <= i, 16, 16)
    assert states.tolist() == [[1, 0], [2, 1]]
    assert figures.tile_counts(states) == {"empty": 1, "partial": 2, "full": 1}
    ragged = figures.tile_states(np.ones((20, 20), dtype=bool), 16, 16)  # edge tiles: full inside the matrix
    assert ragged.tolist() == [[2, 2], [2, 2]]


def test_visit_scaling_grows_with_the_window_not_with_L():
    scaling = figures.visit_scaling(16, windows=(8, 64, 512), lengths=(256, 1024, 4096), window_at=128,
                                    length_at=4096)
    assert scaling["window_vs_L"] == [9, 9, 9] and scaling["causal_vs_L"] == [16, 64, 256]
    assert scaling["window_vs_w"] == [2, 5, 33] and scaling["causal_vs_w"] == [256] * 3


def test_dense_mask_is_the_references():
    from wb_kernels.reference import visible_keys
    from wb_kernels.variants import Variants

    ids = np.array([0] * 10 + [1] * 14)
    mask = figures.dense_mask(24, 24, causal="top_left", window=(5, 0), document_ids=ids)
    expected = visible_keys(24, 24, "top_left", None, 1, Variants(window=(5, 0), document_ids=(ids[None], ids[None])))
    assert np.array_equal(mask, expected[0, 0])


@pytest.mark.parametrize("case", [
    dict(L=96, causal="top_left"), dict(L=80, causal="top_left", window=(11, 0)), dict(L=70, window=(5, 3)),
    dict(L=64, Lk=96, causal="bottom_right", window=(20, 0)), dict(L=96, causal="top_left", cu_seqlens=(0, 20, 36, 80, 96)),
    dict(L=96, cu_seqlens=(0, 40, 64, 96)), dict(L=50, Lk=37, causal="top_left")])
def test_visited_key_blocks_model_equals_the_kernels_count(case):
    _needs_triton()
    import torch

    from wb_kernels.stages.triton import launcher
    from wb_kernels.variants import canonical_variants, document_ids_from_cu_seqlens

    L, Lk = case["L"], case.get("Lk", case["L"])
    q, k, v = _problem(L, Lk, seed=L + Lk)
    ids = None
    if "cu_seqlens" in case:
        ids = document_ids_from_cu_seqlens(torch.tensor(case["cu_seqlens"]), L)
    variants = canonical_variants(q, k, window=case.get("window"),
                                  document_ids=None if ids is None else ids[None].to(q.device))
    _, _, visits = launcher.visited_key_blocks(q, k, v, causal=case.get("causal"), variants=variants, block_m=16,
                                               block_n=16)
    model = figures.visited_key_blocks(L, Lk, 16, 16, causal=case.get("causal"), window=case.get("window"),
                                       document_ids=None if ids is None else ids.numpy())
    assert visits[0, 0].tolist() == model.tolist()


def test_tile_states_model_equals_the_block_mask_kernel():
    _needs_triton()
    from wb_kernels.stages.triton import launcher

    mask = launcher.block_mask(banded, 1, 1, 70, 70, 16, 16)
    expected = figures.tile_states(figures.dense_mask(70, 70, causal="top_left", window=(9, 0)), 16, 16)
    assert np.array_equal(mask.tile_state[0, 0].cpu().numpy(), expected)


# ---------------------------------------------------------------------------------------------- figures

def test_figures_draw():
    states = {"causal": figures.tile_states(np.tril(np.ones((48, 48), dtype=bool)), 16, 16),
              "window": figures.tile_states(figures.dense_mask(48, 48, causal="top_left", window=(7, 0)), 16, 16)}
    assert len(figures.draw_tile_states(states, 16, 16).axes) == 2
    scaling = figures.visit_scaling(16, windows=(8, 32), lengths=(64, 128), window_at=8, length_at=128)
    assert len(figures.draw_visit_scaling(scaling, 16).axes) == 2
    slider = figures.draw_window_tiles(96, 24)
    assert "at most 3 key blocks" in slider._suptitle.get_text()


# ---------------------------------------------------------------------------------------------- the kernel in parts

@pytest.mark.parametrize("name", sorted(figures.KERNEL_PARTS))
def test_kernel_parts_are_the_region_cut_in_order(name):
    parts = figures.kernel_parts(name)
    assert list(parts) == [part for part, _ in figures.KERNEL_PARTS[name]]
    assert "\n".join(parts.values()) == region_source(figures.KERNEL_FILE, name)
    shown = figures.kernel_part(name, list(parts)[-1])
    assert shown.data.startswith(f"# {name} ({figures.KERNEL_FILE}), part {len(parts)} of {len(parts)}")


def test_a_missing_cut_line_says_which(monkeypatch):
    monkeypatch.setitem(figures.KERNEL_PARTS, "attention_forward", (("arguments", None), ("gone", "no such line")))
    with pytest.raises(KeyError, match="no such line"):
        figures.kernel_parts("attention_forward")


def test_the_lesson_shows_every_part_it_names_and_the_short_regions_as_cells():
    cells = ["".join(c["source"]) for c in json.loads(LESSON.read_text())["cells"] if c["cell_type"] == "code"]
    shown = [c for c in cells if c.startswith("figures.kernel_part(")]
    for cell in shown:
        name, part = eval(cell.removeprefix("figures.kernel_part"))  # ("name", "part")
        assert part in figures.kernel_parts(name)
    regions = {name for name, _, _ in notebook_regions(LESSON)}
    assert {"key_block_range", "tile_scores", "forward_tile", "backward_tile", "block_mask_tiles"} <= regions


# ---------------------------------------------------------------------------------------------- compiled code

def test_signature_specializes_as_a_launch_does():
    torch = pytest.importorskip("torch")
    fn = SimpleNamespace(__name__="f", params=[SimpleNamespace(name=n, is_constexpr=c) for n, c in (
        ("X", False), ("n", False), ("m", False), ("scale", False), ("FLAG", False), ("Unused", False),
        ("stride", False), ("BLOCK", True))])
    x = torch.empty(4, dtype=torch.float16, device="meta")
    signature, constexprs, attrs = compiled._signature(fn, dict(X=x, n=64, m=7, scale=0.5, FLAG=True, Unused=None,
                                                               stride=1, BLOCK=32))
    assert signature == {"X": "*fp16", "n": "i32", "m": "i32", "scale": "fp32", "FLAG": "constexpr",
                         "Unused": "constexpr", "stride": "constexpr", "BLOCK": "constexpr"}
    assert constexprs == {"FLAG": True, "Unused": None, "stride": 1, "BLOCK": 32}  # a launch specializes 1 too
    assert set(attrs) == {(0,), (1,)}  # the pointer and the int divisible by 16


def test_compile_report_without_a_gpu():
    """Triton compiles the forward for an A100 and an H100 on any Linux machine: mma.sync, then wgmma; cp.async only
    with more than one stage."""
    _needs_triton()
    problem = dict(B=1, H=2, L=256, D=64, dtype="float16", causal="top_left")
    rows = compiled.compile_report([problem, dict(problem, num_stages=1)])
    count = {(r["arch"], r["num_stages"] > 1): {family: compiled.instruction_count(r, family) for family in
                                                 ("mma.sync", "wgmma", "cp.async")} for r in rows}
    assert count["sm_80", True]["mma.sync"] > 0 and count["sm_80", True]["wgmma"] == 0
    assert count["sm_90a", True]["wgmma"] > 0 and count["sm_90a", True]["mma.sync"] == 0
    assert count["sm_80", True]["cp.async"] > 0 and count["sm_80", False]["cp.async"] == 0
    assert all(r["registers"] > 0 and r["shared_bytes"] > 0 for r in rows)
    with pytest.raises(KeyError):
        compiled.instruction_count(rows[0], "no such family")



def test_every_variant_compiles_for_the_h100_pipelined_without_spills():
    """What a GPU launch of each named variant would compile (the launcher's own arguments, on meta tensors), for
    sm_90a at D = 128 in float16: every kernel uses wgmma and pipelines its loads (cp.async); the forward and dQ
    kernels spill nothing. The interpreter cannot show a kernel that does not compile (a jit function returning None
    does not), nor one that loses its pipelining (a branch around a tile's loads did, for document ids). The
    dK/dV kernel holds five tiles and sits at the 255-register limit: with most variants it spills up to about 200
    bytes, which the H100 run is to weigh (NOTES.md)."""
    _needs_triton()
    from wb_kernels.variants import VARIANT_NAMES

    base = dict(B=1, H=2, L=256, D=128, dtype="float16", causal="top_left", targets=["sm_90a"])
    names = ("plain", *VARIANT_NAMES)
    rows = compiled.compile_report([dict(base, variants=name, **{"pass": p}) for name in names
                                   for p in ("forward", "backward")], timeout=900)
    found = {(r["kernel"], r["variants"]): r for r in rows}
    kernels = ("attention_forward", "backward_preprocess", "backward_dk_dv", "backward_dq")
    assert set(found) == {(kernel, name) for kernel in kernels for name in names}
    for (kernel, name), row in found.items():
        if kernel == "backward_preprocess":
            assert row["spill_bytes"] == 0
            continue
        assert compiled.instruction_count(row, "wgmma") > 0, (kernel, name)
        assert compiled.instruction_count(row, "cp.async") > 0, (kernel, name)
        if kernel == "backward_dk_dv":  # (a blow-up, not the few dozen registers' worth it spills today)
            assert row["spill_bytes"] < 256, (kernel, name, row["spill_bytes"])
        else:
            assert row["spill_bytes"] == 0, (kernel, name, row["spill_bytes"])



def test_mods_compile_pipelined_and_wrong_ones_are_refused_by_the_compiler():
    """A score_mod with a constant derivative and a mask_mod (tests/triton_mods.py) compile for sm_90a, the block
    mask's loops pipelined (cp.async: the loops run over the list positions two binary searches find, with no test
    inside); and the compiler, like the interpreter, refuses a mod of the wrong shape or dtype with the kernels' own
    sentence (the compiling process fails with that ValueError)."""
    _needs_triton()
    base = dict(B=1, H=2, L=256, D=64, dtype="float16", causal=None, targets=["sm_90a"])
    good = dict(file=MODS_FILE, score_mod="alibi_mod", score_mod_derivative="unit_derivative",
                mask_mod="causal_mask")
    rows = compiled.compile_report([dict(base, mods=good, **{"pass": p}) for p in ("forward", "backward")],
                                  timeout=900)
    names = [row["kernel"] for row in rows]
    assert names.count("block_mask_tiles") == 2 and {"attention_forward", "backward_dk_dv", "backward_dq"} <= set(names)
    for row in rows:
        if row["kernel"] in ("attention_forward", "backward_dk_dv", "backward_dq"):
            assert compiled.instruction_count(row, "cp.async") > 0, row["kernel"]
    for bad, said in ((dict(score_mod="summed_score_mod"), "score_mod must return one score per"),
                      (dict(mask_mod="numeric_mask"), "mask_mod must return booleans")):
        with pytest.raises(RuntimeError, match=f"ValueError: {said}"):
            compiled.compile_report([dict(base, mods=dict(file=MODS_FILE, **bad))], timeout=900)


def test_a_new_length_compiles_no_new_kernel():
    """What Triton keys a compiled kernel on, for the launches a GPU call would make: a new sequence length reuses
    the kernels of any other length in its class, forward and backward, plain and with every named variant; the
    classes differ only in divisibility marks (kernels.LENGTH_ARGUMENTS). The class: whether Lk is a multiple of 16
    and, with a dense bias, whether its strides (Lq·Lk, Lk) are."""
    _needs_triton()
    base = dict(B=2, H=4, D=128, dtype="float16", causal="bottom_right")
    classes = {"plain": ((1000, 1001, 4097), (2048, 4096, 4112)),  # Lk ragged; Lk a multiple of 16
               "every named variant": ((1001, 1003, 4097), (2048, 4096, 4112))}  # (Lq·Lk odd in the first)
    problems = [dict(base, L=L, variants=variants, **{"pass": p}) for variants, lengths in classes.items()
                for p in ("forward", "backward") for group in lengths for L in group]
    keys = compiled.compile_report(problems, keys_only=True)
    for first in range(0, len(problems), 6):
        ragged, aligned = keys[first:first + 3], keys[first + 3:first + 6]
        assert ragged[0] == ragged[1] == ragged[2], problems[first]
        assert aligned[0] == aligned[1] == aligned[2], problems[first + 3]
        for ragged_launch, aligned_launch in zip(ragged[0], aligned[0]):
            assert ragged_launch[:3] == aligned_launch[:3]  # the same kernels, argument types and constants
            if "'Lk'" in ragged_launch[1]:  # a kernel that takes Lk: the aligned class marks it, the other does not
                assert ragged_launch[3] != aligned_launch[3]

# ---------------------------------------------------------------------------------------------- the exercises

def test_exercise_answers_are_what_the_stage_computes():
    """Each answer, computed from NumPy models and the reference, is what the triton stage itself does."""
    _needs_triton()
    import torch

    import wb_kernels as wb
    from wb_kernels.stages.triton import launcher
    from wb_kernels.variants import canonical_variants, document_ids_from_cu_seqlens

    answers = [e.expected() for e in exercises.EXERCISES]
    q, k, v = _problem(256, seed=1)
    _, _, visits = launcher.visited_key_blocks(q, k, v, causal="top_left", variants=canonical_variants(
        q, k, window=(39, 0)), block_m=16, block_n=16)
    assert int(visits[0, 0, 10]) == answers[0]
    q, k, v = _problem(3, seed=2)
    _, lse = wb.attention(q, k, v, stage="triton", key_padding_mask=torch.zeros(1, 3, dtype=torch.bool,
                          device=q.device), sinks=torch.tensor([-1.5], device=q.device), return_lse=True)
    assert float(lse[0, 0, 0]) == pytest.approx(answers[1], abs=1e-6)
    q, k, v = (x.expand(2, 4, 96, 16).contiguous().requires_grad_(True) for x in _problem(96, seed=3))
    bias = torch.zeros(1, 4, 1, 96, device=q.device, requires_grad=True)
    wb.attention(q, k, v, stage="triton", bias=bias).sum().backward()
    assert tuple(bias.grad.shape) == answers[2]
    q, k, v = _problem(128, seed=4)
    ids = document_ids_from_cu_seqlens(torch.tensor([0, 40, 64, 128]), 128)[None].to(q.device)
    _, _, visits = launcher.visited_key_blocks(q, k, v, causal="top_left", variants=canonical_variants(
        q, k, document_ids=ids), block_m=32, block_n=32)
    assert 16 - int(visits.sum()) == answers[3]


def test_solutions_and_listed_wrong_answers():
    from wb_kernels.exercises import grade

    given = [solutions.answer_1, solutions.answer_2, solutions.answer_3, solutions.answer_4]
    for exercise, answer in zip(exercises.EXERCISES, given):
        assert grade(exercise, answer) == "correct"
        assert all(grade(exercise, wrong) == "wrong" for wrong in exercise.wrong_answers().values()), exercise.name


# ---------------------------------------------------------------------------------------------- the puzzle

def _puzzle_cell() -> str:
    cells = ["".join(c["source"]) for c in json.loads(LESSON.read_text())["cells"] if c["cell_type"] == "code"]
    (cell,) = [c for c in cells if "exercises.check_local_layer_puzzle(" in c]
    return cell


def _load_puzzle_cell(tmp_path, source: str):
    """The lesson's puzzle cell as a module (Triton's interpreter reads a jit function's source from its file), with
    what the set-up cell gives it (triton, tl, the kernels' tanh), without its last line (the grading call)."""
    from wb_kernels.stages.triton import launcher

    body = source.rsplit("\n\n\n", 1)[0]
    path = tmp_path / "puzzle_cell.py"
    path.write_text("import triton\nimport triton.language as tl\n"
                    "from wb_kernels.stages.triton.launcher import load_kernels\n"
                    "tanh = load_kernels().tanh\n\n" + body + "\n")
    spec = importlib.util.spec_from_file_location(f"puzzle_cell_{len(source)}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    assert launcher  # (imported for its side effect: the interpreter chosen before triton loads the kernels)
    return module


def test_the_lessons_stub_says_not_solved_and_its_completion_solves(tmp_path):
    _needs_triton()
    from wb_kernels.exercises import puzzle_verdict

    cell = _puzzle_cell()
    stub = _load_puzzle_cell(tmp_path, cell)
    assert "not solved yet" in puzzle_verdict(exercises.PUZZLE, (stub.my_score_mod, stub.my_mask_mod))
    score_stub, mask_stub = "    return score\n", "    return kv_idx >= 0\n"
    assert cell.count(score_stub) == 1 and cell.count(mask_stub) == 1
    completed = cell.replace(score_stub, "    return CAP * tanh(score / CAP) - puzzle_slope(h) * (q_idx - kv_idx).to("
                                         "tl.float32)\n")
    completed = completed.replace(mask_stub, "    return (kv_idx <= q_idx) & (q_idx - kv_idx < WINDOW)\n")
    answer = _load_puzzle_cell(tmp_path, completed)
    assert "solved ✓" in puzzle_verdict(exercises.PUZZLE, (answer.my_score_mod, answer.my_mask_mod))


def test_the_puzzles_constants_are_the_named_variants():
    assert exercises.PUZZLE_WINDOW > exercises.PUZZLE_BLOCK // 2 and exercises.PUZZLE_LENGTH > 2 * exercises.PUZZLE_WINDOW
    assert np.allclose(exercises.puzzle_slopes(), [0.5, 0.25, 0.125, 0.0625])


# ---------------------------------------------------------------------------------------------- without triton

def test_without_triton_the_helpers_import_and_the_puzzle_says_why():
    """As on a machine with no triton wheel: figures, exercises and solutions import; the exercises grade; the puzzle
    says that it cannot run; the lesson's region cells define plain functions under the set-up cell's stand-ins."""
    cells = [(name, text) for name, _, text in notebook_regions(LESSON)]
    script = textwrap.dedent(f"""
        import sys
        sys.modules["triton"] = None
        from types import SimpleNamespace
        import wb_kernels
        from wb_kernels.stages.triton import exercises, figures, solutions
        exercises.check(solutions.answer_1, solutions.answer_2, solutions.answer_3, solutions.answer_4)
        exercises.check_local_layer_puzzle((None, None))
        triton, tl = SimpleNamespace(jit=lambda fn: fn), SimpleNamespace(constexpr=lambda value=None: value)
        for name, text in {cells!r}:
            exec(text, {{"triton": triton, "tl": tl}})
        print("regions defined:", len({cells!r}))
    """)
    run = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]
    assert "exercise 4: correct ✓" in run.stdout
    assert "puzzle: not solved yet: triton is not installed" in run.stdout
    assert f"regions defined: {len(cells)}" in run.stdout
