"""What the CUDA compiler makes of a numba kernel: registers, shared memory, spills (lessons 02-04; CI).

The simulator runs any Python, including code the CUDA compiler rejects, so every numba kernel of the
package is also compiled for real: ``numba.cuda.compile_ptx`` (NVVM, from the ``nvidia-cuda-nvrtc`` /
``nvidia-nvvm`` wheels, no GPU needed) turns it into PTX, and ``ptxas -v`` assembles that for an
architecture and reports the resources one thread and one block need. Where the installed ptxas is
older than the PTX that NVVM writes (``Unsupported .version``), or there is none, the same report comes
from nvJitLink, the PTX assembler inside the CUDA wheels that numba-cuda already depends on.

The simulator cannot compile, so in a simulator process the work goes to a child process that imports
the package with ``WB_BACKEND=compile-only`` (numba's real compiler, no device). That child finds a
kernel by the name it was registered under: every stage module calls :func:`register_kernel` for each
kernel it defines, so ``tests/test_ptx_compile.py`` compiles all of them, later stages' included.

    from wb_kernels.resources import kernel_resources
    from wb_kernels.stages.naive.kernel import scores_kernel, SCORES_SIGNATURE
    kernel_resources(scores_kernel, SCORES_SIGNATURE, cc=(9, 0))
    # {'registers': 30, 'shared_bytes': 0, 'local_bytes': 0, 'spill_stores': 0, 'spill_loads': 0, ...}
"""

from __future__ import annotations

import importlib
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

from .backend import BACKEND

if BACKEND.is_simulator:  # every numba rung imports this module before it defines a kernel
    from .simulator import make_shared_arrays_thread_safe

    make_shared_arrays_thread_safe()

__all__ = ["KernelEntry", "register_kernel", "registered_kernels", "defining_module", "find_entry", "compile_ptx",
           "kernel_resources", "resources_of_entries", "ptx_resources", "CCS"]

# The architectures every kernel is compiled for in CI: A100 (sm_80) and H100 (sm_90).
CCS = ((8, 0), (9, 0))


@dataclass(frozen=True)
class KernelEntry:
    """One numba kernel of the package and the argument types it is launched with."""

    name: str  # unique, e.g. "naive.scores_kernel" or "tiled.scores_kernel[tile=16]"
    kernel: object  # the numba kernel (a CUDADispatcher, or the simulator's FakeCUDAKernel)
    signatures: tuple  # numba signature strings, e.g. "void(float32[:, :, ::1], ...)"
    # how a fresh process re-creates a kernel made by a factory: (module, function, args); calling it
    # must register `name` again. None for kernels defined at module level (importing is enough).
    rebuild: tuple | None = None


_REGISTRY: dict = {}


def register_kernel(name: str, kernel, signatures, rebuild=None):
    """Record `kernel` under `name` with the signatures it is launched with; returns the kernel."""
    if isinstance(signatures, str):
        signatures = (signatures,)
    _REGISTRY[name] = KernelEntry(name, kernel, tuple(signatures), rebuild)
    return kernel


def registered_kernels() -> list:
    """Every kernel registered so far in this process, by name. A rung registers its kernels when it is imported:
    :func:`wb_kernels.stages.registered_kernels` imports every rung first (this module sits below the rungs and
    imports none of them)."""
    return sorted(_REGISTRY.values(), key=lambda entry: entry.name)


def defining_module(entry: KernelEntry) -> str | None:
    """The module whose import registers `entry` (or whose factory re-creates it): what a fresh process imports."""
    if entry.rebuild is not None:
        return entry.rebuild[0]
    function = getattr(entry.kernel, "py_func", None) or getattr(entry.kernel, "fn", None)
    return getattr(function, "__module__", None)


def find_entry(kernel) -> KernelEntry:
    """The registry entry of a kernel object (or a registered name)."""
    if isinstance(kernel, str):
        if kernel in _REGISTRY:
            return _REGISTRY[kernel]
        raise KeyError(f"no kernel registered as {kernel!r} (a rung registers its kernels when it is imported: "
                       f"wb_kernels.available_stages() imports them all); registered: {', '.join(sorted(_REGISTRY))}")
    for entry in _REGISTRY.values():
        if entry.kernel is kernel:
            return entry
    raise KeyError(
        f"{getattr(kernel, '__name__', kernel)!r} is not a registered kernel of wb_kernels. On the simulator "
        "only registered kernels can be compiled (a separate process rebuilds them from the package); "
        "register yours with wb_kernels.resources.register_kernel, or compile it on a GPU machine.")


def _fastmath(kernel) -> bool:
    options = getattr(kernel, "targetoptions", None)
    if options is not None:
        return bool(options.get("fastmath", False))
    return bool(getattr(kernel, "_fastmath", False))


def compile_ptx(kernel, signature: str, cc=(8, 0)) -> str:
    """PTX of a numba kernel for compute capability `cc` (needs numba's real CUDA target, not the simulator)."""
    if BACKEND.is_simulator:
        raise RuntimeError("numba's CUDA simulator cannot compile to PTX; use kernel_resources(), which "
                           "compiles in a separate process")
    from numba import cuda

    # launch bounds change how many registers ptxas may use, so compile with the kernel's own
    launch_bounds = (getattr(kernel, "targetoptions", None) or {}).get("launch_bounds")
    ptx, _ = cuda.compile_ptx(kernel.py_func, signature, cc=tuple(cc), fastmath=_fastmath(kernel),
                              launch_bounds=launch_bounds)
    return ptx


# --- assembling PTX and reading the resource report ---------------------------------------------------

def _ptxas_candidates() -> list:
    found = []
    for directory in (os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH")):
        if directory:
            found.append(Path(directory) / "bin" / "ptxas")
    nvcc = shutil.which("nvcc")
    if nvcc:
        found.append(Path(nvcc).resolve().parent / "ptxas")
    on_path = shutil.which("ptxas")
    if on_path:
        found.append(Path(on_path))
    unique = []
    for path in found:
        if path.is_file() and path not in unique:
            unique.append(path)
    return unique


def _run_ptxas(ptxas: Path, ptx: str, arch: str):
    """(report text, None) or (None, why it failed)."""
    with tempfile.TemporaryDirectory() as tmp:
        source = Path(tmp) / "kernel.ptx"
        source.write_text(ptx)
        done = subprocess.run([str(ptxas), "-v", f"-arch={arch}", str(source), "-o", str(Path(tmp) / "kernel.cubin")],
                              capture_output=True, text=True)
    if done.returncode != 0:
        return None, f"{ptxas}: {(done.stderr or done.stdout).strip().splitlines()[0]}"
    return done.stderr + done.stdout, None


def _run_nvjitlink(ptx: str, arch: str):
    try:
        from cuda.bindings import nvjitlink
    except ImportError as error:  # pragma: no cover - depends on the installation
        return None, f"nvJitLink: not installed ({error})"
    data = ptx.encode()
    handle = nvjitlink.create(2, [f"-arch={arch}", "-verbose"])
    try:
        try:
            nvjitlink.add_data(handle, nvjitlink.InputType.PTX, data, len(data), "kernel.ptx")
            nvjitlink.complete(handle)
        except Exception as error:
            size = nvjitlink.get_error_log_size(handle)
            log = bytearray(size)
            nvjitlink.get_error_log(handle, log)
            return None, f"nvJitLink: {error}: {log.decode(errors='replace').strip()}"
        size = nvjitlink.get_info_log_size(handle)
        log = bytearray(size)
        nvjitlink.get_info_log(handle, log)
        return log.decode(errors="replace").rstrip("\x00"), None
    finally:
        nvjitlink.destroy(handle)


def _declared_shared_bytes(ptx: str) -> int:
    """Static shared memory declared in the PTX (numba declares every cuda.shared.array at module scope)."""
    total = 0
    for match in re.finditer(r"^\s*(?:\.visible\s+|\.global\s+)?\.shared\s+\.align\s+\d+\s+\.b8\s+\w+\[(\d+)\]",
                             ptx, flags=re.MULTILINE):
        total += int(match.group(1))
    return total


def _parse_report(report: str, ptx: str) -> dict:
    def number(pattern, default=0):
        match = re.search(pattern, report)
        return int(match.group(1)) if match else default

    registers = number(r"[Uu]sed (\d+) registers", default=None)
    if registers is None:
        raise RuntimeError(f"could not read the register count from the assembler's report:\n{report}")
    smem = re.search(r"ptxas info\s*:\s*Used .*?(\d+) bytes smem", report)
    return {
        "registers": registers,
        # static shared memory per block; the driver adds 1 KiB per block of its own on sm_80 and later
        "shared_bytes": int(smem.group(1)) if smem else _declared_shared_bytes(ptx),
        "local_bytes": number(r"(\d+) bytes stack frame"),
        "spill_stores": number(r"(\d+) bytes spill stores"),
        "spill_loads": number(r"(\d+) bytes spill loads"),
    }


def ptx_resources(ptx: str, cc=(8, 0)) -> dict:
    """Assemble PTX for `cc` and return registers, shared_bytes, local_bytes, spill_stores, spill_loads
    (bytes) and the assembler that reported them."""
    arch = f"sm_{cc[0]}{cc[1]}"
    failures = []
    for ptxas in _ptxas_candidates():
        report, why = _run_ptxas(ptxas, ptx, arch)
        if report is not None:
            return {**_parse_report(report, ptx), "assembler": "ptxas"}
        failures.append(why)
    report, why = _run_nvjitlink(ptx, arch)
    if report is not None:
        return {**_parse_report(report, ptx), "assembler": "nvJitLink"}
    failures.append(why)
    raise RuntimeError(
        f"no PTX assembler could assemble this kernel for {arch}. Tried: " + "; ".join(failures or ["nothing found"])
        + ". Install the CUDA toolkit (ptxas next to nvcc, or CUDA_HOME set) or the nvidia-nvjitlink wheel.")


def _resources_here(entry_or_kernel, signature: str, cc) -> dict:
    kernel = entry_or_kernel.kernel if isinstance(entry_or_kernel, KernelEntry) else entry_or_kernel
    return ptx_resources(compile_ptx(kernel, signature, cc), cc)


# --- the child process used on the simulator ----------------------------------------------------------

def _child_environment() -> dict:
    env = dict(os.environ)
    env["WB_BACKEND"] = "compile-only"
    env["NUMBA_ENABLE_CUDASIM"] = "0"
    root = str(Path(__file__).resolve().parent.parent)
    env["PYTHONPATH"] = root + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    return env


def resources_of_entries(requests) -> list:
    """Resources for many ``(entry, signature, cc)`` at once: one child process on the simulator.

    Each result is the dict of :func:`ptx_resources` plus ``name``, ``signature`` and ``cc``, or, when the
    compiler rejects the kernel, ``error`` with its message (so one bad kernel does not hide the others).
    """
    requests = [(find_entry(e) if not isinstance(e, KernelEntry) else e, sig, tuple(cc)) for e, sig, cc in requests]
    if not BACKEND.is_simulator:
        return [_compile_one(entry, sig, cc) for entry, sig, cc in requests]
    payload = json.dumps([{"name": e.name, "module": defining_module(e), "rebuild": e.rebuild, "signature": s,
                           "cc": list(cc)} for e, s, cc in requests])
    done = subprocess.run([sys.executable, "-m", "wb_kernels.resources"], input=payload, capture_output=True,
                          text=True, env=_child_environment())
    if done.returncode != 0:
        raise RuntimeError(f"compiling in a separate process failed:\n{done.stderr.strip()}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def _compile_one(entry: KernelEntry, signature: str, cc) -> dict:
    head = {"name": entry.name, "signature": signature, "cc": list(cc)}
    try:
        return {**head, **_resources_here(entry, signature, cc)}
    except Exception as error:  # the compiler's message is the result the caller wants to see
        return {**head, "error": f"{type(error).__name__}: {error}"}


def kernel_resources(kernel, signature: str | None = None, cc=(8, 0)) -> dict:
    """Registers, shared_bytes, local_bytes, spill_stores and spill_loads of one kernel for `cc`.

    `kernel` is a numba kernel (or a registered name); `signature` defaults to the first registered one.
    Raises RuntimeError with the compiler's message when the kernel does not compile.
    """
    if BACKEND.is_simulator or isinstance(kernel, str):
        entry = find_entry(kernel)
        signature = signature or entry.signatures[0]
        result = resources_of_entries([(entry, signature, cc)])[0]
    else:
        if signature is None:
            signature = find_entry(kernel).signatures[0]
        name = getattr(kernel, "__name__", None) or getattr(getattr(kernel, "py_func", None), "__name__", "kernel")
        result = {"name": name, "signature": signature, "cc": list(cc)}
        try:
            result.update(_resources_here(kernel, signature, cc))
        except Exception as error:  # the compiler's own message says what it rejected
            result["error"] = f"{type(error).__name__}: {error}"
    if "error" in result:
        raise RuntimeError(f"{result['name']} for sm_{cc[0]}{cc[1]}: {result['error']}")
    return result


def _child_main() -> None:
    """Read requests (JSON on stdin), compile each with numba's real compiler, print JSON results."""
    requests = json.loads(sys.stdin.read())
    results = []
    for request in requests:
        name = request["name"]
        if name not in _REGISTRY and request.get("module"):  # importing the kernel's module registers it
            importlib.import_module(request["module"])
        if name not in _REGISTRY and request.get("rebuild"):
            module, function, args = request["rebuild"]
            getattr(importlib.import_module(module), function)(*args)
        if name not in _REGISTRY:
            results.append({"name": name, "signature": request["signature"], "cc": request["cc"],
                            "error": f"KeyError: no kernel registered as {name!r} in a fresh process"})
            continue
        results.append(_compile_one(_REGISTRY[name], request["signature"], tuple(request["cc"])))
    print(json.dumps(results))


if __name__ == "__main__":
    # `python -m` runs this file as __main__, a second copy of the module: use the package's copy,
    # which is the one the stage modules register their kernels in.
    from wb_kernels.resources import _child_main as main

    main()
