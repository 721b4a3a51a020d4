"""Lesson 05's exercises and its coding puzzle: what each answer must equal, the puzzle's grader, and the plausible
wrong answers each must reject (as data: ``tests/test_exercises.py`` feeds them to the graders).

Exercise 1 is graded from the machine code (nvcc compiles the kernel, the tensor-core HMMA instructions are
counted; no GPU needed). The puzzle, one tile of S = Q K^T with WMMA, is graded on every machine in two halves:
nvcc must compile it to tensor-core instructions, and the kernel, run on the CPU against a model of the WMMA API
(:func:`tile.host_product`: which matrix, layout and leading dimension each call names, and a fragment that holds
garbage until it is filled), must compute A B^T. On a GPU the tensor cores' product is checked as well. The worked
answers are in ``solutions.py`` next to this file: open it when you want them.
"""

from __future__ import annotations

import numpy as np

from ...backend import BACKEND
from ...cuda_build import CudaBuildError
from ...exercises import Exercise, Puzzle, check_answers, hands_copies
from . import build, tile
from .fragment_model import ulp

__all__ = ["EXERCISES", "PUZZLE", "check", "check_tile_puzzle", "tile_kernel_variant"]

EXERCISES = (
    Exercise("exercise 1", lambda: len(build.sass("sm_90", dtype="float16", head_dim=64, num_warps=4, q_in_registers=True,
                                                  row_frags=1, source=build.package_source())),
             "S: (D/16) x (64/16) WMMAs; PV: (64/16) x (D/16); two HMMA each.",
             wrong={"WMMA calls, not HMMA instructions": 32, "S only": 32, "the D = 128 count the lesson prints": 128,
                    "32 rows per warp (the D = 64 default)": 128}),
    Exercise("exercise 2", lambda: build.shared_memory_bytes(256, 4, True),
             "2 stages x 2 tiles x 64 rows x (D+8) x 2 bytes, plus 64 rows x (64+8) x (4 + 2) bytes, "
             "plus 2 x 64 x 4 + 64 x 4.",
             wrong={"rows not padded": 2 * 2 * 64 * 256 * 2 + 64 * 64 * 6 + 2 * 64 * 4 + 64 * 4,
                    "one stage of K and V": 64 * (256 + 8) * 2 * 2 + 64 * 72 * 6 + 2 * 64 * 4 + 64 * 4,
                    "with a Q tile": build.shared_memory_bytes(256, 4, False),
                    "D = 64 (what the lesson prints)": build.shared_memory_bytes(64, 4, True)}),
    Exercise("exercise 3", lambda: float(ulp(1.0, "bfloat16")), "bf16 stores 7 bits after the leading 1.",
             wrong={"fp16's spacing": 2.0 ** -10, "8 bits after the point": 2.0 ** -8, "fp32's spacing": 2.0 ** -23}),
)


def check(answer_1, answer_2, answer_3) -> None:
    """Grade lesson 05's exercises (``...`` means not answered yet)."""
    check_answers(EXERCISES, answer_1, answer_2, answer_3)


# --- the puzzle: one tile of S = Q K^T ------------------------------------------------------------------------

def _puzzle_inputs():
    rng = np.random.default_rng(5)
    return tuple(rng.standard_normal((16, 16)).astype(np.float16) for _ in range(2))


def _close(c, expected) -> bool:  # fp16 products are exact in fp32; fp32 sums of 16 terms
    return bool(np.all(np.isfinite(c))) and np.allclose(c, expected, rtol=1e-5, atol=1e-4)


def _what_it_computed(c, a, b) -> str:
    a64, b64 = a.astype(np.float64), b.astype(np.float64)
    if not np.all(np.isfinite(c)):
        return "C holds NaN: did the accumulator start from zero, and does every element of C get stored?"
    for product, words in ((a64 @ b64, "A B, not A B^T: which fragment layout reads a row-major K as K^T?"),
                           ((a64 @ b64.T).T, "the transpose of A B^T: how is C stored?"),
                           (b64 @ b64.T, "B B^T: which matrix does the matrix_a fragment load?")):
        if _close(c, product):
            return f"it computes {words}"
    return "C is not A B^T: check which matrix each load names, its layout and its leading dimension"


@hands_copies
def check_tile_puzzle(kernel: str) -> None:
    """Grade the learner's ``wmma_tile_kernel`` (C++ text), which must compute C = A B^T (A, B row-major 16 x 16 fp16,
    C row-major fp32): nvcc must compile it to tensor-core (HMMA) instructions, and run on the CPU against the WMMA
    model its C must match NumPy's; on a GPU the tensor cores' C must match too. Prints one line (the compiler's
    errors after it, if any)."""
    source = tile.source_with(kernel)
    try:
        hmma = tile.hmma_instructions(source)
    except CudaBuildError as error:
        print("tile puzzle: not solved yet: nvcc rejects it:\n" + str(error).split("\n", 1)[-1])
        return
    if not hmma:
        print("tile puzzle: not solved yet: it compiles, but to no tensor-core (HMMA) instruction. Fill the accumulator "
              "with zeros, load A and B into fragments, mma_sync, store C.")
        return
    a, b = _puzzle_inputs()
    expected = a.astype(np.float64) @ b.astype(np.float64).T
    try:
        c = tile.host_product(a, b, kernel)
    except (CudaBuildError, tile.TileModelError) as error:
        print(f"tile puzzle: not solved yet: on the CPU's WMMA model {error}")
        return
    if not _close(c, expected):
        print(f"tile puzzle: not solved yet: on the CPU's WMMA model {_what_it_computed(c, a, b)}")
        return
    if BACKEND.is_gpu:
        import torch

        c = tile.product(*(torch.from_numpy(x).cuda() for x in (a, b)), source=source).cpu().numpy()
        if not _close(c, expected):
            print(f"tile puzzle: not solved yet: on the tensor cores {_what_it_computed(c, a, b)}")
            return
    print("tile puzzle: solved ✓ (tensor-core instructions; C = A B^T on the CPU's WMMA model"
          + (" and on the tensor cores)" if BACKEND.is_gpu else "; a GPU checks the tensor cores' C too)"))


def tile_kernel_variant(*, a_ptr="a", a_layout="row_major", b_ptr="b", b_layout="col_major", ldm_b=16,
                        store="mem_row_major", zero=True, lane_zero_only=False) -> str:
    """The puzzle's kernel with one choice changed (the defaults give the right answer): the wrong answers below."""
    fill = "    wmma::fill_fragment(c_frag, 0.0f);\n" if zero else ""
    body = (f"    wmma::load_matrix_sync(a_frag, {a_ptr}, 16);\n"
            f"    wmma::load_matrix_sync(b_frag, b, {ldm_b});\n"
            "    wmma::mma_sync(c_frag, a_frag, b_frag, c_frag);\n"
            f"    wmma::store_matrix_sync(c, c_frag, 16, wmma::{store});\n")
    if lane_zero_only:
        body = "    if (threadIdx.x == 0) {\n" + body.replace("    ", "        ") + "    }\n"
    return ("__global__ void wmma_tile_kernel(const half* a, const half* b, float* c) {\n"
            "    using namespace nvcuda;\n"
            f"    wmma::fragment<wmma::matrix_a, 16, 16, 16, half, wmma::{a_layout}> a_frag;\n"
            f"    wmma::fragment<wmma::matrix_b, 16, 16, 16, half, wmma::{b_layout}> b_frag;\n"
            "    wmma::fragment<wmma::accumulator, 16, 16, 16, float> c_frag;\n"
            + fill + body + "}")


PUZZLE = Puzzle(
    check=check_tile_puzzle,
    solution="tile_kernel",
    wrong={
        "the stub as shipped": lambda: tile.kernel_text().split("{")[0] + "{\n}",
        "the lesson's A B kernel, unchanged (B row-major)": tile.kernel_text,
        "B B^T (B loaded as matrix_a too)": lambda: tile_kernel_variant(a_ptr="b"),
        "column-major B and C": lambda: tile_kernel_variant(store="mem_col_major"),
        "a wrong leading dimension (8)": lambda: tile_kernel_variant(ldm_b=8),
        "a wrong leading dimension (32, past the end)": lambda: tile_kernel_variant(ldm_b=32),
        "the accumulator never zeroed": lambda: tile_kernel_variant(zero=False),
        "A loaded column-major": lambda: tile_kernel_variant(a_layout="col_major"),
        "only lane 0 makes the calls": lambda: tile_kernel_variant(lane_zero_only=True),
    },
)
