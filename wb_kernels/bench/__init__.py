"""The benchmark: every stage against PyTorch's attention, into one resumable JSON file (the dashboard lesson;
lesson 03 quotes its committed results, lesson 04 uses :data:`REPO_ROOT`).

    python -m wb_kernels.bench --help        # the command line: wb_kernels/bench/cli.py

One module per role:

- :mod:`.sweeps`    what is measured: Config, Sweep, the presets, FLOP and byte counts
- :mod:`.measure`   how: the contenders (stages, baselines), one checked and timed measurement,
                    the roofline's ceilings, and the resumable sweep (:func:`run`)
- :mod:`.results`   the results file, its environment, the newest committed one, the README table, how a
                    file was timed (:func:`timing_method`) and whether files may be compared (:func:`same_timing`)
- :mod:`.decode`    the decode presets (``--preset decode``): one new token per sequence against a KV
                    cache, wb.decode and its kernels against SDPA, FlexAttention and a copy, in a file
                    of their own; the per-call overhead
- :mod:`.cli`       ``python -m wb_kernels.bench`` (:func:`main`)
- :mod:`.figures`   figures from a results file (matplotlib; imported on use)
- :mod:`.pitfalls`  the honest-benchmarking demonstrations and how the dashboard lesson prints them
- :mod:`.dashboard` the dashboard lesson's widget (ipywidgets; imported on use) and its overview of every rung
- :mod:`.exercises` the dashboard lesson's exercises and timing puzzle, graded on :mod:`.fake_gpu` (a pretend GPU);
                    worked answers in :mod:`.solutions`
- :mod:`.ncu_traffic` the CUDA C++ stages' shared-memory traffic under Nsight Compute
                    (``python -m wb_kernels.bench.ncu_traffic``; a script, not imported here)
- :mod:`.backward`  the backward presets (``--preset backward-bar`` and others), in a file of their own
- :mod:`.failures`  how a measurement that could not be made is recorded (every module above uses it)
- :mod:`.decoder_tokens` lesson 07's decoder, tokens per second against its step's roofline
                    (``python -m wb_kernels.bench.decoder_tokens``; its compiled variants in
                    :mod:`.decoder_variants`, what both runs share in :mod:`.decoder_shared`)

Below the benchmark and the rungs alike (a rung's own tuning and profiling scripts use them too, without importing
the benchmark): :mod:`wb_kernels.results_files` (reading and writing results files, the environment record),
:mod:`wb_kernels.timing`, :mod:`wb_kernels.attention_costs` (FLOP and byte counts), :mod:`wb_kernels.nsight` and
:func:`wb_kernels.tuning.sdpa_call`. The benchmark reaches a rung only through the stage registry, a rung's
``__init__`` exports or the public API (``tests/test_architecture.py``).

``from wb_kernels import bench`` gives the names below, as the single module did; the lessons
import :mod:`.figures`, :mod:`.dashboard` and :mod:`.pitfalls` by name.
"""

from __future__ import annotations

from .cli import main
# (the function measure.measure is not lifted here: bench.measure stays the module)
from .measure import Contender, TimingPolicy, contenders, measure_ceilings, plan, run
from .pitfalls import honesty_demos
from .results import (README_END, README_START, REPO_ROOT, RESULTS_DIR, SCHEMA_VERSION, MixedTiming, add_speedups,
                      committed_results, decode_readme_table, default_output, environment, load_results,
                      readme_table, same_timing, save_results, timing_method, update_readme)
from .sweeps import (BASELINES, LADDER_LENGTHS, PRESETS, PUBLIC_CONFIGS, TOKENS, Config, Refused, Sweep,
                     attention_flops, minimum_bytes, record_key)

__all__ = [
    # what is measured (sweeps.py)
    "Config", "Sweep", "PRESETS", "PUBLIC_CONFIGS", "LADDER_LENGTHS", "TOKENS", "BASELINES", "attention_flops",
    "minimum_bytes", "record_key", "Refused",
    # how (measure.py)
    "Contender", "contenders", "TimingPolicy", "measure_ceilings", "plan", "run",
    # the results file (results.py)
    "SCHEMA_VERSION", "REPO_ROOT", "RESULTS_DIR", "README_START", "README_END", "environment", "load_results",
    "save_results", "add_speedups", "default_output", "committed_results", "readme_table",
    "decode_readme_table", "update_readme", "timing_method", "same_timing", "MixedTiming",
    # the demonstrations (pitfalls.py) and the command line (cli.py)
    "honesty_demos", "main",
]
