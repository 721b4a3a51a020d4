"""Lesson 05's exercises and its coding puzzle: what each answer must equal, and the grader of the puzzle.

Exercise 1 and the puzzle are graded from the machine code: nvcc compiles the kernel and the tensor-core (HMMA)
instructions are counted, no GPU needed; on a GPU the puzzle's product is also checked against NumPy. The worked
answers are in ``solutions.py`` next to this file: open it when you want them.
"""

from __future__ import annotations

from ...cuda_build import CudaBuildError
from ...backend import BACKEND
from . import build, tile
from ...exercises import Exercise, check_answers
from .fragment_model import ulp

__all__ = ["EXERCISES", "check", "check_tile_puzzle"]

EXERCISES = (
    Exercise("exercise 1", lambda: len(build.sass("sm_90", dtype="float16", head_dim=128, q_in_registers=False,
                                                  source=build.package_source())),
             "S: (D/16) x (64/16) WMMAs; PV: (64/16) x (D/16); two HMMA each."),
    Exercise("exercise 2", lambda: build.shared_memory_bytes(64, 4, True),
             "2 stages x 2 tiles x 64 rows x (64+8) x 2 bytes, plus 64 rows x (64+8) x (4 + 2) bytes, "
             "plus 2 x 64 x 4 + 64 x 4."),
    Exercise("exercise 3", lambda: float(ulp(1.0, "bfloat16")), "bf16 stores 7 bits after the leading 1."),
)


def check(answer_1, answer_2, answer_3) -> None:
    """Grade lesson 05's exercises (``...`` means not answered yet)."""
    check_answers(EXERCISES, answer_1, answer_2, answer_3)


def check_tile_puzzle(kernel: str) -> None:
    """Grade the learner's ``wmma_tile_kernel`` (C++ text): it must compile, and the compiler must turn it into
    tensor-core instructions (a 16 x 16 x 16 fp16 product is two ``HMMA.16816`` on sm_80 and newer); on a GPU its
    product must also match NumPy's. Prints one line (the compiler's errors after it, if any)."""
    import numpy as np

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
    if BACKEND.is_gpu:
        import torch

        rng = np.random.default_rng(5)
        a, b = (rng.standard_normal((16, 16)).astype(np.float16) for _ in range(2))
        c = tile.product(*(torch.from_numpy(x).cuda() for x in (a, b)), source=source).cpu().numpy()
        expected = a.astype(np.float64) @ b.astype(np.float64)
        if not np.allclose(c, expected, rtol=1e-5, atol=1e-4):  # fp16 products are exact; fp32 sums of 16 terms
            print("tile puzzle: not solved yet: it runs on the tensor cores, but C differs from NumPy's A @ B")
            return
    print("tile puzzle: solved ✓ (it compiles to tensor-core instructions"
          + (", and C matches NumPy's A @ B)" if BACKEND.is_gpu else "; on a GPU its product is checked too)"))
