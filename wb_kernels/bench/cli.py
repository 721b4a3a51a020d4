"""The benchmark's command line, ``python -m wb_kernels.bench`` (the dashboard lesson; the GPU run behind every lesson's numbers).

    python -m wb_kernels.bench --help
    python -m wb_kernels.bench --list                       # presets, stages, baselines
    python -m wb_kernels.bench --preset smoke               # tiny sweep (the simulator's preset)
    python -m wb_kernels.bench --preset all --time-budget 330   # on a GPU: results/bench/<gpu>_<date>.json
    python -m wb_kernels.bench --figures results/bench/FILE.json        # figures/bench_*.png from a results file
    python -m wb_kernels.bench --update-readme results/bench/FILE.json  # README's performance table
    python -m wb_kernels.bench --preset decode --json results/decode/bench_h100.json --time-budget 480  # decode
    python -m wb_kernels.bench --preset backward --time-budget 540     # gradients: results/backward/bench_<gpu>.json
    python -m wb_kernels.bench --preset hopper-bar --time-budget 300   # the hopper rung's bar: results/hopper/

Flags become :class:`~wb_kernels.bench.sweeps.Sweep` objects and a
:class:`~wb_kernels.bench.measure.TimingPolicy` for :func:`~wb_kernels.bench.measure.run`, timing every preset
with :data:`wb_kernels.timing.DEVICE_TIME` (recorded in the results file); the decode presets go to
:func:`~wb_kernels.bench.decode.run_decode` and the backward presets to :func:`~wb_kernels.bench.backward.run_backward`
instead, each into a file of its own, as a rung's preset (``hopper-bar``) goes into results/<rung>/. A request that cannot run here is a
one-line error and exit code 2.
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import replace
from pathlib import Path
from typing import Optional

from ..stages import available_stages
from ..timing import DEVICE_TIME
from .backward import PRESET_GROUPS as BACKWARD_GROUPS
from .backward import default_backward_output, run_backward, update_backward_readme
from .decode import default_decode_output, run_decode
from .measure import TimingPolicy, tensor_device, contenders, run
from ..results_files import recorded_arguments
from .results import REPO_ROOT, default_output, load_results, rung_bar_table, update_readme
from .sweeps import (ALL_PRESETS, BACKWARD_PRESET_HELP, BASELINE_HELP, BASELINES, DECODE_PRESETS, GPU_PRESETS,
                     PRESET_HELP, PRESETS, RUNG_PRESETS, TOKENS, Config, Refused, Sweep)

__all__ = ["main"]

EVERY_PRESET_HELP = {**PRESET_HELP, **BACKWARD_PRESET_HELP}


def _ints(text: str) -> tuple:
    return tuple(int(x) for x in text.replace(",", " ").split())


def _names(text: str) -> tuple:
    return tuple(x for x in text.replace(",", " ").split())


def _parser() -> argparse.ArgumentParser:
    presets = "\n".join(f"  {name:15s} {text}" for name, text in EVERY_PRESET_HELP.items())
    parser = argparse.ArgumentParser(
        prog="python -m wb_kernels.bench", formatter_class=argparse.RawDescriptionHelpFormatter,
        description="Benchmark the attention stages of wb_kernels against PyTorch (SDPA's backends, FlexAttention; "
                    "flash-attn and vLLM when installed). Results go to one JSON file per run, written after every "
                    "measurement and resumed when the same command runs again.",
        epilog=f"presets:\n{presets}\n\nfree flags (--stages, --lengths, ...) define one more sweep; without a "
               "preset they are the whole run. Examples:\n"
               "  python -m wb_kernels.bench --preset smoke\n"
               "  python -m wb_kernels.bench --preset all --time-budget 330\n"
               "  python -m wb_kernels.bench --stages flash --baselines sdpa --lengths 1024,4096 --head-dims 64\n"
               "  python -m wb_kernels.bench --figures results/bench/FILE.json\n"
               "  python -m wb_kernels.bench --preset decode --json results/decode/bench_h100.json --time-budget 480")
    parser.add_argument("--preset", action="append", choices=list(EVERY_PRESET_HELP),
                        help="a named sweep (repeatable)")
    parser.add_argument("--stages", type=_names, help="stages to run, comma-separated (default with free flags: all)")
    parser.add_argument("--baselines", type=_names, help=f"baselines, comma-separated, from: {', '.join(BASELINES)}")
    parser.add_argument("--lengths", type=_ints, help="sequence lengths L (Lq = Lk), e.g. 512,1024")
    parser.add_argument("--head-dims", type=_ints, help="head dims D, e.g. 64,128")
    parser.add_argument("--dtypes", type=_names, help="float16, bfloat16, float32 (default float32)")
    parser.add_argument("--batch-heads", type=_ints, metavar="B,H", help="batch and heads (default: B*L = --tokens)")
    parser.add_argument("--tokens", type=int, default=None, help=f"B = tokens // L (default {TOKENS} on a GPU)")
    parser.add_argument("--heads", type=int, default=16, help="heads when B comes from --tokens (default 16)")
    parser.add_argument("--causal", choices=("no", "yes", "both"), default="no")
    parser.add_argument("--out", "--json", type=Path,
                        help="results file (default: results/bench/<gpu>_<date>.json, or "
                             "results/bench/simulator_smoke.json on the simulator; for the decode presets "
                             "results/decode/bench_<gpu>.json, or results/decode/simulator_smoke.json)")
    parser.add_argument("--fresh", action="store_true", help="start a new file instead of resuming")
    parser.add_argument("--seconds", type=float, default=None,
                        help="stop repeating a measurement after about this many seconds of samples "
                             "(default 0.3 on a GPU, 0.1 for the decode presets, 0.05 on the simulator)")
    parser.add_argument("--min-repeats", type=int, default=3)
    parser.add_argument("--max-repeats", type=int, default=100)
    parser.add_argument("--no-flush", action="store_true", help="do not flush the L2 cache between repeats")
    parser.add_argument("--retry-failed", action="store_true",
                        help="backward presets: measure again the records a resumed file holds as failed (after a "
                             "fix), instead of keeping them as done")
    parser.add_argument("--retake-slowed", action="store_true",
                        help="decode presets: measure again the records of a resumed file that a burst slowed (more "
                             "than 5%% of their samples over 2x the lower quartile: something outside the call, as "
                             "measure.slowed_samples says; new runs retake such a measurement at once)")
    parser.add_argument("--time-failed-checks", action="store_true",
                        help="also time a stage whose output fails the check (flagged check_failed in the file, "
                             "marked in figures and the README table); by default it is recorded as failed, untimed")
    parser.add_argument("--time-budget", type=float, help="stop starting new measurements after this many "
                                                          "seconds (the file can be resumed)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    parser.add_argument("--no-figures", action="store_true", help="do not draw figures/bench_*.png after a GPU run")
    parser.add_argument("--list", action="store_true", help="list presets, stages and baselines, then exit")
    parser.add_argument("--figures", nargs="?", const=True, metavar="RESULTS.json",
                        help="with a file: draw figures/bench_*.png from it, then exit; alone: draw them after the "
                             "run (the default on a GPU)")
    parser.add_argument("--update-readme", type=Path, metavar="RESULTS.json",
                        help="rewrite README.md's performance table from a results file, then exit")
    return parser


def _custom_sweep(args, on_cuda: bool) -> Optional[Sweep]:
    if not any((args.stages, args.baselines, args.lengths, args.head_dims, args.dtypes, args.batch_heads)):
        return None
    stages = args.stages if args.stages is not None else tuple(
        name for name in available_stages() if name != "reference" or not on_cuda)
    baselines = args.baselines if args.baselines is not None else ("sdpa",)
    lengths = args.lengths or ((1024, 4096) if on_cuda else (32,))
    head_dims = args.head_dims or ((64,) if on_cuda else (16,))
    dtypes = args.dtypes or ("float32",)
    causals = {"no": (False,), "yes": (True,), "both": (False, True)}[args.causal]
    configs = []
    for dtype in dtypes:
        for causal in causals:
            for D in head_dims:
                for L in lengths:
                    if args.batch_heads:
                        if len(args.batch_heads) != 2:
                            raise Refused(f"--batch-heads wants two numbers B,H; got {args.batch_heads}")
                        B, H = args.batch_heads
                    else:
                        tokens = args.tokens or (TOKENS if on_cuda else L)
                        B, H = max(1, tokens // L), args.heads if on_cuda or args.tokens else 1
                    configs.append(Config(B, H, L, D, dtype, causal))
    return Sweep("custom", tuple(stages) + tuple(baselines), tuple(configs))


def _rung_output(preset: str) -> Path:
    """results/<rung>/bench_<gpu>.json for a rung's preset (sweeps.RUNG_PRESETS; needs a GPU, as the preset does)."""
    from ..results_files import gpu_short_name

    return REPO_ROOT / "results" / RUNG_PRESETS[preset] / f"bench_{gpu_short_name()}.json"


def _listing() -> str:
    lines = ["presets:"] + [f"  {n:15s} {t}" for n, t in EVERY_PRESET_HELP.items()] + ["stages (this package):"]
    for name, stage in available_stages().items():
        lines.append(f"  {name:15s} {stage.summary} [{', '.join(stage.dtypes)}]"
                     + (" (GPU only)" if stage.needs_gpu else ""))
    lines.append("baselines:")
    table = contenders()
    on_cuda = tensor_device() == "cuda"
    for name in BASELINES:
        why = table[name].unavailable or ("needs a CUDA GPU" if table[name].needs_gpu and not on_cuda else None)
        lines.append(f"  {name:15s} {BASELINE_HELP[name]}" + (f" -- absent: {why}" if why else ""))
    return "\n".join(lines)


def main(argv=None) -> int:
    args = _parser().parse_args(argv)
    try:
        if args.list:
            print(_listing())
            return 0
        if args.update_readme:
            backward_file = load_results(args.update_readme).get("kind") == "backward"
            print(f"updated {(update_backward_readme if backward_file else update_readme)(args.update_readme)}")
            return 0
        if isinstance(args.figures, str):
            from .figures import save_all

            for path in save_all(load_results(args.figures)):
                print(f"wrote {path}")
            return 0
        on_cuda = tensor_device() == "cuda"
        presets = list(args.preset or [])
        if "all" in presets:
            presets = [p for p in presets if p != "all"] + list(ALL_PRESETS)
        custom = _custom_sweep(args, on_cuda)
        if not presets and custom is None:
            presets = ["smoke"]
        decode = [p for p in dict.fromkeys(presets) if p in DECODE_PRESETS]
        backward = [p for p in dict.fromkeys(presets) if p in BACKWARD_GROUPS]
        rung = [p for p in dict.fromkeys(presets) if p in RUNG_PRESETS]
        for own, what in ((decode, "decode problems"), (backward, "gradients"), (rung, "a rung's problems")):
            if own and (len(own) != len(presets) or custom is not None):
                raise Refused(f"preset {', '.join(own)} measures {what} into a file of its own: run it "
                              "without other presets or free flags (--stages, --lengths, ...)")
        if args.retry_failed and not backward:
            raise Refused("--retry-failed applies to the backward presets (backward, backward-bar, backward-smoke) only")
        if args.retake_slowed and not decode:
            raise Refused("--retake-slowed applies to the decode presets (decode, decode-bar, decode-smoke) only")
        if not on_cuda:
            gpu_only = [p for p in presets if p in GPU_PRESETS]
            if gpu_only:
                raise Refused(f"preset {', '.join(gpu_only)} needs a CUDA GPU (sizes up to "
                              f"{'Lk=131072' if decode else 'L=16384'}); this machine runs the CUDA simulator. Use "
                              + ("--preset decode-smoke." if decode else "--preset backward-smoke." if backward
                                 else "--preset smoke, or small free flags such as --lengths 32 --head-dims 16."))
        explicit = tuple(args.stages or ()) + tuple(args.baselines or ())
        seconds = args.seconds if args.seconds is not None else (0.05 if not on_cuda else 0.1 if decode else 0.3)
        # every preset times with the one method, DEVICE_TIME (the object itself); --no-flush alone departs from it
        method = DEVICE_TIME if not args.no_flush else replace(DEVICE_TIME, flush_l2=False)
        policy = TimingPolicy(seconds=seconds, min_repeats=args.min_repeats, max_repeats=args.max_repeats,
                              method=method, time_failed_checks=args.time_failed_checks)
        out = (default_decode_output(on_cuda) if decode else default_backward_output(on_cuda) if backward
               else _rung_output(rung[0]) if rung else default_output("cuda" if on_cuda else "cpu"))
        if args.out is not None:  # a folder (existing, or written with a trailing slash) gets the default name
            folder = args.out.is_dir() or str(args.out).endswith(("/", "\\"))
            out = args.out / out.name if folder else args.out
        print(f"writing {out}")
        # the output path as the repository shows it (no machine paths in a committed file)
        command = "python -m wb_kernels.bench " + recorded_arguments(argv if argv is not None else sys.argv[1:],
                                                                      REPO_ROOT, ("--out", "--json"))
        if decode:
            workloads = [w for p in decode for w in DECODE_PRESETS[p]]
            run_decode(workloads, out, presets=decode, policy=policy, resume=not args.fresh, seed=args.seed,
                       progress=not args.no_progress, time_budget=args.time_budget, command=command,
                       retake_slowed=args.retake_slowed)
        elif backward:
            run_backward([group for p in backward for group in BACKWARD_GROUPS[p]], out, policy=policy,
                         resume=not args.fresh, retry_failed=args.retry_failed, seed=args.seed,
                         progress=not args.no_progress,
                         time_budget=args.time_budget, command=command)
        else:
            sweeps = [sweep for p in dict.fromkeys(presets) for sweep in PRESETS.get(p, [])]
            if custom is not None:
                sweeps.append(custom)
            run(sweeps, out, policy=policy, resume=not args.fresh, seed=args.seed, progress=not args.no_progress,
                time_budget=args.time_budget, honesty="honesty" in presets, explicit=explicit, command=command)
            for sweep in (sweeps if rung else []):  # a rung's bar: every row, with its ratios, in the log
                print(rung_bar_table(load_results(out), sweep))
        # (the backward file has its table, not figures of its own yet; a rung's run leaves the ladder's figures be)
        wants_figures = not backward and ((on_cuda and not args.no_figures and not rung) or args.figures is True)
        if wants_figures and any(r["status"] == "ok" for r in load_results(out)["records"]):
            from .figures import save_all

            for path in save_all(load_results(out)):
                print(f"wrote {path}")
    except Refused as refusal:
        print(f"error: {refusal}", file=sys.stderr)
        return 2
    return 0
