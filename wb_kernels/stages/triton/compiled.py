"""What Triton's compiler makes of the triton stage's kernels (lesson 11, "what the compiler does for you"): the
tensor-core instructions it chose, how it moves tiles into shared memory, its registers, spills and shared memory.

- On a GPU, :func:`compiled_report` summarizes the forward kernel a launch compiled, as a committed results file the
  lesson reads on any machine::

      python -m wb_kernels.stages.triton.compiled --json results/triton/compiled_<gpu>.json     # on a GPU

- Without one, :func:`compile_report` compiles what a GPU launch would compile (the launcher run on meta tensors,
  a recorder in place of the kernels module; any pass, variant or mod) for the targets of :data:`COMPILE_TARGETS`,
  in a fresh process whose Triton compiles (the interpreter compiles nothing), and reads the PTX and ``ptxas -v``;
  with ``keys_only`` it says what Triton's cache keys each launch on instead.

:func:`summarize_ptx` is plain text processing, tested on the CPU.
"""

from __future__ import annotations

import argparse
import json
import re
from collections import Counter
from pathlib import Path

__all__ = ["INSTRUCTION_FAMILIES", "summarize_ptx", "compiled_report", "COMPILE_TARGETS", "instruction_count",
           "compile_here", "launch_keys_here", "compile_report", "main"]

# PTX instruction families that say what the compiler did with each part of lessons 05-06 and 09 done by hand
INSTRUCTION_FAMILIES = {
    "wgmma (Hopper warpgroup tensor-core MMA, lesson 09)": r"^\s*wgmma\.mma_async",
    "mma.sync (warp tensor-core MMA, lesson 06)": r"^\s*mma\.sync",
    "ldmatrix (shared -> registers in fragments, lesson 06)": r"^\s*ldmatrix",
    "cp.async (global -> shared without registers, pipelined)": r"^\s*cp\.async\.(ca|cg)",
    "cp.async.bulk (TMA, lesson 09)": r"^\s*cp\.async\.bulk",
    "mbarrier (asynchronous barriers, lesson 09)": r"^\s*mbarrier",
    "ex2.approx (exp2 of the online softmax)": r"^\s*ex2\.approx",
    "bar.sync (block barriers)": r"^\s*(bar\.sync|barrier\.sync)",
}


def summarize_ptx(ptx: str) -> dict:
    """Counts of each :data:`INSTRUCTION_FAMILIES` entry in a PTX listing (static instructions, not executions), and
    the shapes of the tensor-core instructions used (``m64n64k16`` ...)."""
    lines = ptx.splitlines()
    counts = {name: sum(1 for line in lines if re.search(pattern, line)) for name, pattern in
              INSTRUCTION_FAMILIES.items()}
    shapes = Counter(match.group(1) for line in lines
                     for match in [re.search(r"\b(?:wgmma\.mma_async|mma\.sync)\.[\w.]*?\.(m\d+n\d+k\d+)", line)]
                     if match)
    return {"instructions": counts, "mma_shapes": dict(shapes), "ptx_lines": len(lines)}


def compiled_report(*, B=1, H=16, L=4096, D=128, dtype="float16", causal=True) -> dict:
    """Run the triton stage's forward once on the GPU for one configuration and summarize the compiled kernel."""
    import torch

    from . import launcher

    torch.manual_seed(0)
    q, k, v = (torch.randn(B, H, L, D, device="cuda", dtype=getattr(torch, dtype)) for _ in range(3))
    launcher.forward(q, k, v, causal="top_left" if causal else None)
    torch.cuda.synchronize()
    kernel = launcher.LAST_COMPILED.get("forward")
    if kernel is None or not hasattr(kernel, "asm"):
        raise RuntimeError("no compiled kernel: the triton stage ran on the interpreter (no GPU?)")
    ptx = kernel.asm.get("ptx", "")
    metadata = kernel.metadata
    config = launcher.launch_config(D, dtype)
    report = {"problem": dict(B=B, H=H, L=L, D=D, dtype=dtype, causal=causal), "config": config,
              "registers": getattr(kernel, "n_regs", None), "spills": getattr(kernel, "n_spills", None),
              "shared_memory_bytes": getattr(metadata, "shared", None), **summarize_ptx(ptx)}
    mma_lines = [line.strip() for line in ptx.splitlines()
                 if re.search(r"wgmma\.mma_async|mma\.sync|cp\.async|ldmatrix|ex2\.approx", line)]
    report["excerpt"] = mma_lines[:12]
    return report


# ------------------------------------------------------------------------------- compiling without a GPU

COMPILE_TARGETS = (("sm_80", 80, "A100"), ("sm_90a", 90, "H100"))  # (ptxas arch, capability, a GPU of it)


def instruction_count(row: dict, family: str) -> int:
    """How many instructions of `family` (the first words of a key of ``compiled.INSTRUCTION_FAMILIES``: "mma.sync",
    "wgmma", "cp.async", "cp.async.bulk", ...) a summary row counts."""
    found = [count for name, count in row["instructions"].items() if name.split(" (")[0] == family]
    if len(found) != 1:
        raise KeyError(f"{family!r}: not one of {[name.split(' (')[0] for name in row['instructions']]}")
    return found[0]


def _signature(fn, values: dict) -> tuple:
    """(signature, constexprs, attrs) of a Triton ``ASTSource`` for a call of `fn` with `values` {argument: value},
    specialized as a launch specializes it: None, bools, ints equal to 1 (a unit stride, one head) and constexpr
    arguments become constants, tensors pointers aligned to 16 bytes (torch's allocations are), ints divisible by
    16 say so; an int the kernel names in ``do_not_specialize`` stays a plain int."""
    import torch

    pointer_types = {torch.float16: "*fp16", torch.bfloat16: "*bf16", torch.float32: "*fp32", torch.int32: "*i32",
                     torch.int64: "*i64", torch.int8: "*i8", torch.uint8: "*u8"}
    signature, constexprs, attrs = {}, {}, {}
    for index, param in enumerate(fn.params):
        if param.name not in values:
            raise KeyError(f"{fn.__name__}: no value for its argument {param.name!r}")
        value = values[param.name]
        free = getattr(param, "do_not_specialize", False)  # (the kernel's do_not_specialize: a plain int, always)
        if param.is_constexpr or value is None or isinstance(value, bool) or (
                type(value) is int and value == 1 and not free):
            signature[param.name], constexprs[param.name] = "constexpr", value
        elif isinstance(value, torch.Tensor):
            signature[param.name] = pointer_types[value.dtype]
            attrs[(index,)] = [["tt.divisibility", 16]]
        elif isinstance(value, int):
            signature[param.name] = "i32" if -2**31 <= value < 2**31 else "i64"
            if value % 16 == 0 and not free:
                attrs[(index,)] = [["tt.divisibility", 16]]
        else:
            signature[param.name] = "fp32"
    return signature, constexprs, attrs


class _LaunchRecorder:
    """Stands in for the kernels module while the launcher prepares a call: each ``kernel[grid](...)`` is recorded
    as (name, kernel, positional arguments, keyword arguments) and nothing runs. The launcher then builds exactly the
    arguments a GPU launch gets, for any variants, on meta tensors (shapes and dtypes, no data)."""

    INTERPRETING = False

    def __init__(self, kernels):
        self._kernels = kernels
        self.launches = []

    def __getattr__(self, name):
        found = getattr(self._kernels, name)
        if not hasattr(found, "params"):  # not a @triton.jit kernel: a helper or a constant
            return found
        recorder = self

        class _Grid:
            def __getitem__(self, grid):
                def launch(*args, **kwargs):
                    recorder.launches.append((name, found, args, kwargs))
                return launch
        return _Grid()


def _compiled_variants(name: str, B: int, H: int, L: int, dtype):
    """The variants of a compile problem, on meta tensors: "plain", one of ``VARIANT_NAMES`` alone, or "every
    named variant" (softcap, ALiBi, a (1, H, L, L) bias, a two-sided window, document ids and sinks at once)."""
    import torch

    from ...variants import NO_VARIANTS, VARIANT_NAMES, Variants

    meta = lambda *shape, dtype=dtype: torch.empty(*shape, dtype=dtype, device="meta")  # noqa: E731
    each = dict(softcap=30.0, alibi_slopes=meta(B, H, dtype=torch.float32), bias=meta(1, H, L, L), window=(64, 16),
                document_ids=(meta(B, L, dtype=torch.int64),) * 2, sinks=meta(H, dtype=torch.float32))
    assert set(each) == set(VARIANT_NAMES), "a variant without a compile example"
    if name == "plain":
        return NO_VARIANTS
    if name == "every named variant":
        return Variants(**each)
    if name in each:
        return Variants(**{name: each[name]})
    raise ValueError(f"variants: 'plain', 'every named variant' or one of {list(each)}, not {name!r}")


def _compiled_mods(mods) -> dict:
    """A compile problem's ``score_mod``, ``score_mod_derivative`` and ``mask_mod``: ``mods`` names a Python file and
    the functions in it ({"file": path, "score_mod": name, ...}; Triton compiles a jit function from its source
    file, so they come from one). A mask_mod's block mask is built by the launcher as for a call: its tile kernel
    recorded (and compiled) with the rest, its lists computed on meta tensors."""
    if not mods:
        return {}
    import importlib.util

    spec = importlib.util.spec_from_file_location("compiled_mods", mods["file"])
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return {name: getattr(module, mods[name]) for name in ("score_mod", "score_mod_derivative", "mask_mod")
            if mods.get(name)}


def _recorded_launches(problem: dict, kernels) -> list:
    """The launches (name, kernel, args, kwargs) of one problem: a dict with B, H, L, D, dtype, causal; optional
    block_m, block_n, num_warps, num_stages (override the launcher's), pass ("forward", the default, or
    "backward": the backward's kernels), variants (:func:`_compiled_variants`) and mods (:func:`_compiled_mods`)."""
    import torch

    from . import launcher

    B, H, L, D = (problem[name] for name in ("B", "H", "L", "D"))
    dtype = getattr(torch, problem["dtype"])
    meta = lambda *shape, dtype=dtype: torch.empty(*shape, dtype=dtype, device="meta")  # noqa: E731
    q = meta(B, H, L, D)
    variants = _compiled_variants(problem.get("variants", "plain"), B, H, L, dtype)
    options = dict(causal=problem["causal"], variants=variants,
                   **{name: problem.get(name) for name in ("block_m", "block_n", "num_warps", "num_stages")})
    options.update(_compiled_mods(problem.get("mods")))
    recorder = _LaunchRecorder(kernels)
    launcher.use_compiled_kernels(recorder)
    try:
        if problem.get("pass", "forward") == "forward":
            options.pop("score_mod_derivative", None)
            launcher.forward(q, q, q, **options)
        else:
            lse = meta(B, H, L, dtype=torch.float32)
            launcher.gradients(q, q, q, q, lse, q, **options)
    finally:
        launcher.use_compiled_kernels(kernels)
    return recorder.launches


def _specialized_launches(problem: dict, kernels) -> list:
    """[(name, kernel, signature, constexprs, attrs, launch options)] of one problem's recorded launches, specialized
    as Triton specializes a launch (:func:`_signature`)."""
    found = []
    for name, fn, args, kwargs in _recorded_launches(problem, kernels):
        values = dict(zip((param.name for param in fn.params), args))
        values.update(kwargs)
        launch = dict(num_warps=values.pop("num_warps", 4), num_stages=values.pop("num_stages", 3))
        found.append((name, fn, *_signature(fn, values), launch, values))
    return found


def _compiler_kernels():
    from . import kernels, launcher

    if kernels.INTERPRETING:
        raise RuntimeError("compiling needs TRITON_INTERPRET=0 before triton is imported (compile_report starts such "
                           "a process)")
    # the launcher would choose the interpreter on a machine without a GPU: it is told that the kernels compile
    launcher.use_compiled_kernels(kernels)
    return kernels


def launch_keys_here(problems: list) -> list:
    """For each problem, what Triton keys each launch's compiled kernel on: the kernel's name, the argument types and
    divisibility marks, the constants and the launch options (as text). Two problems with equal keys share compiled
    kernels; :func:`compile_report` with ``keys_only`` runs it in a compiling process."""
    kernels = _compiler_kernels()
    return [[[name, repr(sorted(signature.items())), repr(sorted((k, repr(v)) for k, v in constexprs.items())),
              repr(sorted(attrs.items())), repr(sorted(launch.items()))]
             for name, _, signature, constexprs, attrs, launch, _ in _specialized_launches(problem, kernels)]
            for problem in problems]


def compile_here(problems: list) -> list:
    """Compile what each problem launches (see :func:`_recorded_launches`: the forward of a plain call by default)
    for each of :data:`COMPILE_TARGETS` (or the problem's "targets", arch names), and read what came out: the
    PTX's instructions by family (``compiled.summarize_ptx``, which summarizes a GPU run's kernel the same way),
    shared memory, and ptxas's registers and spills, one dict per (problem, kernel, target). Needs a process whose
    Triton compiles (``TRITON_INTERPRET=0``): :func:`compile_report` runs it in one. Nothing is launched, so no GPU
    is needed: Triton compiles for a target it is given, down to the binary (its wheel brings ptxas)."""
    import re
    import subprocess
    import tempfile

    import triton
    from triton.backends.compiler import GPUTarget
    from triton.backends.nvidia.compiler import get_ptxas

    from . import launcher

    kernels = _compiler_kernels()
    found = []
    for problem in problems:
        targets = [t for t in COMPILE_TARGETS if t[0] in problem.get("targets", [t[0] for t in COMPILE_TARGETS])]
        for name, fn, signature, constexprs, attrs, launch, values in _specialized_launches(problem, kernels):
            for arch, capability, gpu in targets:
                source = triton.compiler.ASTSource(fn=fn, signature=signature, constexprs=constexprs, attrs=attrs)
                try:
                    compiled = triton.compile(source, target=GPUTarget("cuda", capability, 32), options=launch)
                except Exception as error:  # noqa: BLE001 - a mod's refusal said as a launch says it
                    said = launcher.mod_complaint(error)
                    if said is None:
                        raise
                    raise ValueError(said) from error
                ptx = compiled.asm["ptx"]
                ptxas = get_ptxas(capability)
                with tempfile.TemporaryDirectory() as folder:
                    with open(f"{folder}/kernel.ptx", "w") as handle:
                        handle.write(ptx)
                    report = subprocess.run([ptxas.path, "-v", f"--gpu-name={arch}", f"{folder}/kernel.ptx", "-o",
                                             f"{folder}/kernel.cubin"], capture_output=True, text=True,
                                            check=True).stderr
                found.append(dict(
                    kernel=name, variants=problem.get("variants", "plain"), arch=arch, gpu=gpu, D=values.get("D"),
                    dtype=problem["dtype"], block_m=values.get("BLOCK_M"), block_n=values.get("BLOCK_N"),
                    num_warps=launch["num_warps"], num_stages=launch["num_stages"],
                    shared_bytes=int(compiled.metadata.shared),
                    registers=int(re.search(r"Used (\d+) registers", report).group(1)),
                    spill_bytes=sum(int(n) for n in re.findall(r"(\d+) bytes spill (?:stores|loads)", report)),
                    triton=triton.__version__, ptxas=str(ptxas.version), **summarize_ptx(ptx)))
    return found


def compile_report(problems: list, timeout: float = 300.0, *, keys_only: bool = False) -> list:
    """:func:`compile_here` (or, with ``keys_only``, :func:`launch_keys_here`) in a fresh Python process with
    ``TRITON_INTERPRET=0``: Triton decides between its interpreter and its compiler once per process, when it is
    imported, and a lesson's process without a GPU runs the interpreter. Raises RuntimeError with the child's last
    lines when it fails (no triton, no CUDA backend)."""
    import json
    import os
    import subprocess
    import sys

    function = "launch_keys_here" if keys_only else "compile_here"
    env = dict(os.environ, TRITON_INTERPRET="0", TRITON_DEFAULT_FP_FUSION="1")  # (1: the default, stated: no warning)
    code = (f"import json, sys; from wb_kernels.stages.triton.compiled import {function}; "
            f"print(json.dumps({function}(json.loads(sys.argv[1]))))")
    run = subprocess.run([sys.executable, "-c", code, json.dumps(list(problems))], capture_output=True, text=True,
                         env=env, timeout=timeout)
    if run.returncode != 0:
        raise RuntimeError(f"{function} failed:\n" + "\n".join(run.stderr.strip().splitlines()[-8:]))
    return json.loads(run.stdout.strip().splitlines()[-1])


def main(argv=None) -> int:
    from ...results_files import environment

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", required=True, help="where to write the summary (results/triton/compiled_<gpu>.json)")
    args = parser.parse_args(argv)
    found = {"kind": "triton-compiled", "environment": environment(), "forward": compiled_report()}
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(found, indent=1) + "\n")
    print(json.dumps(found["forward"], indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
