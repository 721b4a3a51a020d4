"""Every numba kernel of the package compiles for sm_80 and sm_90 (no GPU needed).

The simulator runs code that the CUDA compiler rejects (a float64 where float32 was meant, a
Python object in a kernel, a shared array of non-constant size), so CI compiles each kernel that a
stage module registered in :mod:`wb_kernels.resources`, with the argument types its launcher
passes, and reads the assembler's report. Later stages join by registering their kernels.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

from wb_kernels.resources import CCS, ptx_resources, resources_of_entries
from wb_kernels.stages import registered_kernels

ENTRIES = registered_kernels()
REQUESTS = [(entry, signature, cc) for entry in ENTRIES for signature in entry.signatures for cc in CCS]


def _request_id(request):
    entry, signature, cc = request
    extra = f"-sig{entry.signatures.index(signature)}" if len(entry.signatures) > 1 else ""
    return f"{entry.name}{extra}-sm_{cc[0]}{cc[1]}"


@pytest.fixture(scope="module")
def compiled():
    """All kernels compiled once (one child process on the simulator), keyed like the test ids."""
    return dict(zip(map(_request_id, REQUESTS), resources_of_entries(REQUESTS)))


def test_the_lessons_kernels_are_registered():
    names = {entry.name for entry in ENTRIES}
    for expected in ("naive.scores_kernel", "naive.row_softmax_kernel", "naive.weighted_sum_kernel",
                     "tiled.tiled_scores_kernel[tile=16]", "tiled.tiled_weighted_sum_kernel[tile=32]",
                     "tiled.block_softmax_kernel[threads=128]"):
        assert expected in names


@pytest.mark.parametrize("request_", REQUESTS, ids=[_request_id(r) for r in REQUESTS])
def test_kernel_compiles(request_, compiled):
    result = compiled[_request_id(request_)]
    assert "error" not in result, result.get("error")
    assert 0 < result["registers"] <= 255
    for key in ("shared_bytes", "local_bytes", "spill_stores", "spill_loads"):
        assert result[key] >= 0


def test_tiled_shared_memory_is_what_the_tiles_need(compiled):
    from wb_kernels.stages.tiled.kernel import TILE_SIZES, shared_bytes_per_block

    for tile in TILE_SIZES:
        for kernel, expected in shared_bytes_per_block(tile).items():
            for cc in CCS:
                result = compiled[f"tiled.{kernel}[tile={tile}]-sm_{cc[0]}{cc[1]}"]
                assert result["shared_bytes"] == expected, (kernel, tile, cc, result)
    assert compiled["tiled.block_softmax_kernel[threads=128]-sm_90"]["shared_bytes"] == 4 * 128


def test_naive_kernels_use_no_shared_memory_and_do_not_spill(compiled):
    for name in ("naive.scores_kernel", "naive.row_softmax_kernel", "naive.weighted_sum_kernel"):
        for cc in CCS:
            result = compiled[f"{name}-sm_{cc[0]}{cc[1]}"]
            assert result["shared_bytes"] == 0 and result["spill_stores"] == 0, result


def test_a_kernel_the_simulator_accepts_but_the_compiler_rejects_is_caught():
    """The check has teeth: a kernel that calls a Python object runs on the simulator, not on a GPU."""
    script = textwrap.dedent("""
        import wb_kernels
        from numba import cuda
        from wb_kernels.resources import kernel_resources

        @cuda.jit
        def bad_kernel(out):
            out[0] = len(dict(a=1.0))  # a Python dict: fine in the simulator, no GPU type for it

        try:
            kernel_resources(bad_kernel, "void(float32[::1])", cc=(9, 0))
        except RuntimeError as error:
            print("REJECTED", type(error).__name__)
        else:
            print("ACCEPTED")
    """)
    env = dict(os.environ, WB_BACKEND="compile-only", NUMBA_ENABLE_CUDASIM="0")
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env)
    assert "REJECTED" in done.stdout, done.stdout + done.stderr


def test_assembler_errors_are_clear():
    with pytest.raises(RuntimeError, match="no PTX assembler could assemble"):
        ptx_resources(".version 9.0\n.target sm_80\n.address_size 64\nthis is not ptx\n", cc=(8, 0))
