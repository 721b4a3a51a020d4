"""Building the tensor-core kernel (lesson 05; used by the "wmma" stage, its tests and its tune.py).

The one CUDA source is ``wb_kernels/stages/wmma/flash_wmma.cu``. Two ways to compile it:

- :func:`build` (needs a CUDA GPU and a CUDA build of torch): ``torch.utils.cpp_extension.load_inline``
  turns it into a Python extension. The extension's name carries a hash of the source and the flags,
  so an edited source (or other flags) is a new extension and is rebuilt, and an unchanged one is
  loaded from the cache in milliseconds. A file lock keeps two processes from building the same
  extension at once. A failed build raises :class:`CudaBuildError` with only the compiler's error
  lines, not the several hundred lines of a ninja log.
- :func:`nvcc_compile_report` and :func:`sass` (need only nvcc, no GPU, no CUDA torch): compile the
  kernels alone (``-DWB_KERNEL_ONLY``) to a cubin for sm_80 or sm_90 and report registers, spills
  and shared memory from ``ptxas -v``, and the tensor-core (HMMA) instructions of the machine code
  via ``cuobjdump -sass``. The tools come from the CUDA wheels on PyPI when installed (``make lab``), else
  from a toolkit (:mod:`wb_kernels.cuda_toolchain`). CI runs this, so a broken ``.cu`` fails CI on machines
  without a GPU.

A lesson shows the source region by region (``// region: NAME``). :func:`enable_region_cells` lets a
notebook cell that starts with ``# region: NAME (wb_kernels/stages/wmma/flash_wmma.cu)`` hold C++: running the
cell records the learner's version of that region (:func:`set_region`), and the next :func:`build` or
:func:`nvcc_compile_report` without an explicit source compiles the edited kernel.
"""

from __future__ import annotations

import fcntl
import hashlib
import os
import re
import subprocess
import tempfile
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from .cuda_toolchain import NvccNotFound, find_cuobjdump, find_nvcc  # noqa: F401 (where nvcc comes from)
from .sync import PACKAGE_ROOT, module_regions

__all__ = [
    "SOURCE_PATH", "SOURCE_NAME", "CudaBuildError", "NvccNotFound", "KernelResources", "package_source",
    "current_source", "set_region", "record_region_cell", "reset_regions", "edited_regions", "enable_region_cells",
    "build_flags", "extension_name", "build", "find_nvcc", "find_cuobjdump", "nvcc_compile_report", "sass",
    "shared_memory_bytes", "VARIANTS", "build_extension", "compile_cubin", "sass_lines",
]

SOURCE_PATH = PACKAGE_ROOT / "stages" / "wmma" / "flash_wmma.cu"
SOURCE_NAME = "wb_kernels/stages/wmma/flash_wmma.cu"  # as lessons name it in their region cells
_FUNCTIONS = ["flash_wmma_forward"]
_CPP_DECLARATION = (
    "std::vector<torch::Tensor> flash_wmma_forward(torch::Tensor q, torch::Tensor k, torch::Tensor v, "
    "torch::Tensor key_keep, bool causal, double scale, int64_t num_warps, bool q_in_registers, "
    "int64_t row_frags);"
)
# Every variant the launcher can choose: (num_warps, q_in_registers, row_frags), as WB_FOR_EACH_VARIANT
# in flash_wmma.cu lists them. A warp owns row_frags x 16 query rows. The compile report covers all.
VARIANTS = ((4, True, 1), (8, True, 1), (4, False, 1), (8, False, 1), (4, True, 2), (4, False, 2))


class CudaBuildError(RuntimeError):
    """The CUDA source did not compile; the message holds the compiler's error lines."""


# ---------------------------------------------------------------------------------------------
# The source, with the learner's edits


_edits: dict = {}  # region name -> text the learner ran in the lesson


def package_source() -> str:
    """The .cu file as the package ships it."""
    return SOURCE_PATH.read_text()


def _replace_region(source: str, name: str, text: str) -> str:
    pattern = re.compile(
        r"(^[ \t]*// region: " + re.escape(name) + r"[ \t]*\n)(.*?)(^[ \t]*// endregion[ \t]*$)",
        re.MULTILINE | re.DOTALL)
    match = pattern.search(source)
    if match is None:
        raise KeyError(f"{SOURCE_NAME} has no region {name!r}")
    return source[:match.start(2)] + text.strip("\n") + "\n" + source[match.end(2):]


def current_source() -> str:
    """The package source with every region the learner edited in this Python process put in."""
    source = package_source()
    for name, text in _edits.items():
        source = _replace_region(source, name, text)
    return source


def set_region(name: str, text: str, verbose: bool = True) -> bool:
    """Use `text` for region `name` in later builds; returns (and prints) whether it differs from the package."""
    shipped = module_regions(SOURCE_PATH)
    if name not in shipped:
        raise KeyError(f"{SOURCE_NAME} has no region {name!r}; it has {sorted(shipped)}")
    text = text.strip("\n")
    if text == shipped[name]:
        _edits.pop(name, None)
        if verbose:
            print(f"region {name}: as in {SOURCE_NAME}")
        return False
    _edits[name] = text
    if verbose:
        old, new = shipped[name].splitlines(), text.splitlines()
        changed = sum(a != b for a, b in zip(old, new)) + abs(len(old) - len(new))
        print(f"region {name}: edited ({changed} line(s) differ from {SOURCE_NAME}); "
              "the next build compiles your version")
    return True


def reset_regions() -> None:
    """Forget the learner's edits: builds use the package source again."""
    _edits.clear()


def edited_regions() -> list:
    return sorted(_edits)


_REGION_CELL = re.compile(r"^# region: (\w+) \(" + re.escape(SOURCE_NAME) + r"\)\s*$")


def _region_cell_transform(lines: list) -> list:
    """IPython input transformer: a cell headed ``# region: NAME (wb_kernels/stages/wmma/flash_wmma.cu)``
    holds C++; turn it into the Python call that records it."""
    if not lines or not _REGION_CELL.match(lines[0].rstrip("\n")):
        return lines
    name = _REGION_CELL.match(lines[0].rstrip("\n")).group(1)
    text = "".join(lines[1:])
    return [f"__import__('wb_kernels.cuda_build').cuda_build.record_region_cell({name!r}, {text!r})\n"]


def record_region_cell(name: str, text: str) -> None:
    """What a C++ region cell runs: :func:`set_region`, returning nothing (so the cell shows one line)."""
    set_region(name, text)


def enable_region_cells() -> bool:
    """Let this notebook's C++ region cells run (see the module docstring). Returns False outside IPython."""
    try:
        from IPython import get_ipython
    except ImportError:
        return False
    shell = get_ipython()
    if shell is None:
        return False
    transforms = shell.input_transformers_cleanup
    if _region_cell_transform not in transforms:
        transforms.insert(0, _region_cell_transform)
    return True


# ---------------------------------------------------------------------------------------------
# Building with load_inline (GPU)


def _gencode_for_current_device() -> list:
    import torch

    major, minor = torch.cuda.get_device_capability()
    if major < 8:
        raise RuntimeError(f"the tensor-core kernel needs an sm_80 or newer GPU (bf16 WMMA, cp.async); "
                           f"this one is sm_{major}{minor}")
    return ["-gencode", f"arch=compute_{major}{minor},code=sm_{major}{minor}"]


def build_flags(gencode=None) -> list:
    """nvcc flags for the extension: -O3, fast math (exp2f -> ex2.approx), the GPU's own architecture."""
    return ["-O3", "--use_fast_math", "-std=c++17", "-lineinfo",
            *(gencode if gencode is not None else _gencode_for_current_device())]


def extension_name(source: str, flags: list, prefix: str = "flash_wmma") -> str:
    """A name that changes whenever the source, the flags or the torch/CUDA versions change."""
    import torch

    digest = hashlib.sha256("\0".join([source, " ".join(flags), torch.__version__,
                                       str(torch.version.cuda)]).encode()).hexdigest()
    return f"wb_{prefix}_{digest[:16]}"


def _cache_root() -> Path:
    root = os.environ.get("WB_CUDA_CACHE")
    path = Path(root) if root else Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "wb_kernels" / "cuda"
    path.mkdir(parents=True, exist_ok=True)
    return path


@contextmanager
def _file_lock(path: Path):
    """An exclusive lock the kernel releases when the process dies (no stale lock files)."""
    with open(path, "w") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


_ERROR_LINE = re.compile(r"(error|Error)[ :]|ptxas fatal|undefined reference")


def _trim_compiler_output(output: str, max_errors: int = 12) -> str:
    """The compiler's error lines, each with the source line and caret nvcc prints after it."""
    lines = output.splitlines()
    # torch's wrapper line, "Error building extension 'name': [1/3] <the whole nvcc command>", names the
    # extension and then the first ninja step; only the name is worth showing
    lines = [re.sub(r"^(Error building extension '[^']*'):.*$", r"\1", line) for line in lines]
    kept, errors = [], 0
    for i, line in enumerate(lines):
        if _ERROR_LINE.search(line) and "ninja: build stopped" not in line and not line.startswith("FAILED"):
            errors += 1
            if errors > max_errors:
                kept.append(f"... and more errors ({sum(bool(_ERROR_LINE.search(x)) for x in lines)} lines mention an error)")
                break
            kept.append(line.strip())
            for follow in lines[i + 1:i + 3]:  # nvcc: the offending source line, then the caret
                if follow.strip() and not _ERROR_LINE.search(follow) and not follow.startswith(("[", "FAILED", "ninja:")):
                    kept.append("    " + follow.rstrip())
    return "\n".join(kept) if kept else "\n".join(lines[-20:])


_loaded: dict = {}


LINE_NAME = "flash_wmma.cu"  # the file name compiler messages give, through a #line directive


def prepare_build_directory(build_dir: Path, source: str, file_name: str = LINE_NAME) -> str:
    """Make `build_dir` and return the text to hand to load_inline: `source` behind ``#line 1 "flash_wmma.cu"``,
    so that compiler messages point at lines of flash_wmma.cu, not of load_inline's copy.

    The directive makes nvcc list ``flash_wmma.cu`` among the dependencies it reports to ninja; a dependency
    that does not exist marks the build out of date, and every new process then recompiled the extension
    (a minute) instead of loading it. So the source is also written there under that name, and rewritten only
    when it changed, so that its timestamp stays older than the library built from it."""
    build_dir.mkdir(parents=True, exist_ok=True)
    named_copy = build_dir / file_name
    if not named_copy.exists() or named_copy.read_text() != source:
        named_copy.write_text(source)
    return f'#line 1 "{file_name}"\n{source}'


def build_extension(source: str, *, file_name: str, declarations: str, functions: list,
                    flags: list | None = None, verbose: bool = False, display_name: str | None = None):
    """Compile (or load from the cache) any CUDA source of the package as a Python extension with `functions`
    (declared in C++ by `declarations`). Compiler messages name `file_name`; errors name `display_name` (the
    path lessons use), by default `file_name`. Needs a CUDA GPU and a CUDA build of torch."""
    import torch

    display_name = display_name or file_name

    if not torch.cuda.is_available() or torch.version.cuda is None:
        raise RuntimeError(
            f"building {display_name} needs a CUDA GPU and a CUDA build of torch "
            f"(this torch is {torch.__version__}); without one, use the compile report (nvcc alone)")
    flags = build_flags() if flags is None else list(flags)
    name = extension_name(source, flags, prefix=Path(file_name).stem)
    if name in _loaded:
        return _loaded[name]
    from torch.utils.cpp_extension import load_inline

    build_dir = _cache_root() / name
    cuda_source = prepare_build_directory(build_dir, source, file_name)
    with _file_lock(_cache_root() / f"{name}.lock"):
        try:
            module = load_inline(name=name, cpp_sources=[declarations], cuda_sources=[cuda_source],
                                 functions=functions, extra_cuda_cflags=flags, build_directory=str(build_dir),
                                 verbose=verbose)
        except RuntimeError as error:
            raise CudaBuildError(f"building {display_name} failed:\n{_trim_compiler_output(str(error))}") from None
    _loaded[name] = module
    return module


def build(source: str | None = None, *, flags: list | None = None, verbose: bool = False):
    """Compile (or load from the cache) the tensor-core kernel's extension; returns the Python module.

    `source` defaults to :func:`current_source` (the package's kernel with the learner's edits).
    Needs a CUDA GPU and a CUDA build of torch.
    """
    source = current_source() if source is None else source
    return build_extension(source, file_name=LINE_NAME, declarations=_CPP_DECLARATION, functions=_FUNCTIONS,
                           flags=flags, verbose=verbose, display_name=SOURCE_NAME)


# ---------------------------------------------------------------------------------------------
# Without a GPU: nvcc alone


def _check_arch(arch) -> str:
    arch = str(arch).replace("sm_", "")
    if arch not in ("80", "86", "89", "90"):
        raise ValueError(f"arch={arch!r}: the kernel targets sm_80 or newer, e.g. 'sm_80' or 'sm_90'")
    return arch


_cubins: dict = {}  # (source hash, arch) -> (cubin path, ptxas log)


def compile_cubin(arch: str, source: str, file_name: str = LINE_NAME, display_name: str = SOURCE_NAME):
    """nvcc alone (no GPU): `source` compiled for `arch` to a cubin, ``-DWB_KERNEL_ONLY`` (the kernels without their
    torch launcher); returns (cubin path, ptxas's -v report). Cached per source and arch in this process."""
    arch = _check_arch(arch)
    key = (hashlib.sha256(source.encode()).hexdigest(), arch)
    if key in _cubins and Path(_cubins[key][0]).exists():
        return _cubins[key]
    workdir = Path(tempfile.mkdtemp(prefix="wb_nvcc_"))
    cu = workdir / file_name
    cu.write_text(source)
    cubin = workdir / f"{Path(file_name).stem}_sm{arch}.cubin"
    command = [find_nvcc(), "-std=c++17", "-O3", "--use_fast_math", "-DWB_KERNEL_ONLY", "-cubin",
               "-gencode", f"arch=compute_{arch},code=sm_{arch}", "-Xptxas", "-v", "-o", cubin.name, cu.name]  # relative: messages name flash_wmma.cu, not a temp dir
    result = subprocess.run(command, capture_output=True, text=True, cwd=workdir)
    log = result.stdout + result.stderr
    if result.returncode != 0:
        raise CudaBuildError(f"nvcc for sm_{arch} failed on {display_name}:\n{_trim_compiler_output(log)}")
    _cubins[key] = (str(cubin), log)
    return _cubins[key]


@dataclass(frozen=True)
class KernelResources:
    """What ptxas reports for one instantiation of the kernel (per thread, except shared memory)."""

    arch: str
    dtype: str  # "float16" or "bfloat16"
    head_dim: int
    num_warps: int
    q_in_registers: bool
    row_frags: int  # a warp owns row_frags x 16 query rows
    registers: int
    spill_stores: int  # bytes per thread written to local memory because registers ran out
    spill_loads: int
    stack_bytes: int
    shared_bytes: int  # dynamic shared memory per block (from the layout; ptxas sees only static)

    @property
    def label(self) -> str:
        return (f"{self.dtype} D={self.head_dim} warps={self.num_warps} rows/warp={16 * self.row_frags} "
                f"Q in {'registers' if self.q_in_registers else 'smem'}")


_ENTRY = re.compile(r"Compiling entry function '(\w+)' for 'sm_(\d+)'")
_MANGLED = re.compile(r"flash_wmma_kernelI(6__half|13__nv_bfloat16)Li(\d+)ELi(\d+)ELb([01])ELi(\d+)E")
_SPILLS = re.compile(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads")
_REGISTERS = re.compile(r"Used (\d+) registers")


def shared_memory_bytes(head_dim: int, num_warps: int, q_in_registers: bool, row_frags: int = 1) -> int:
    """Dynamic shared memory per block; mirrors ``Layout`` in flash_wmma.cu."""
    block_n, pad = 64, 8
    block_m = num_warps * row_frags * 16
    kv = 2 * 2 * block_n * (head_dim + pad) * 2  # 2 stages x (K, V), fp16/bf16
    s_scratch = block_m * (block_n + pad) * 4
    p_scratch = block_m * (block_n + pad) * 2
    bias = 2 * block_n * 4
    row = block_m * 4
    q = 0 if q_in_registers else block_m * (head_dim + pad) * 2
    return kv + s_scratch + p_scratch + bias + row + q


def nvcc_compile_report(arch="sm_90", source: str | None = None) -> list:
    """Compile every kernel variant for `arch` with nvcc; returns one :class:`KernelResources` each."""
    arch = _check_arch(arch)
    source = current_source() if source is None else source
    _, log = compile_cubin(arch, source)
    found, current = [], None
    for line in log.splitlines():
        entry = _ENTRY.search(line)
        if entry:
            current = _MANGLED.search(entry.group(1))
            spills = None
            continue
        if current is None:
            continue
        match = _SPILLS.search(line)
        if match:
            spills = tuple(int(x) for x in match.groups())
            continue
        match = _REGISTERS.search(line)
        if match and spills is not None:
            dtype = "float16" if current.group(1) == "6__half" else "bfloat16"
            head_dim, warps, q_regs = int(current.group(2)), int(current.group(3)), current.group(4) == "1"
            row_frags = int(current.group(5))
            found.append(KernelResources(f"sm_{arch}", dtype, head_dim, warps, q_regs, row_frags,
                                         int(match.group(1)), spills[1], spills[2], spills[0],
                                         shared_memory_bytes(head_dim, warps, q_regs, row_frags)))
            current = None
    if not found:
        raise CudaBuildError(f"nvcc for sm_{arch} reported no kernel; its output was:\n{log[-2000:]}")
    order = {"float16": 0, "bfloat16": 1}
    rank = {variant: i for i, variant in enumerate(VARIANTS)}
    return sorted(found, key=lambda r: (order[r.dtype], r.head_dim,
                                        rank[(r.num_warps, r.q_in_registers, r.row_frags)]))


def sass_lines(cubin: str, function, pattern: str = "HMMA") -> list:
    """The machine instructions containing `pattern` in the functions of `cubin` whose (mangled) name `function`
    accepts (a callable returning a bool)."""
    cuobjdump = find_cuobjdump()
    # cuobjdump -sass runs nvdisasm, which the nvidia-cuda-nvdisasm wheel puts next to it
    env = dict(os.environ, PATH=str(Path(cuobjdump).parent) + os.pathsep + os.environ.get("PATH", ""))
    result = subprocess.run([cuobjdump, "-sass", cubin], capture_output=True, text=True, env=env)
    if result.returncode != 0:
        raise RuntimeError(f"cuobjdump -sass failed: {result.stderr.strip()}")
    lines, inside = [], False
    for line in result.stdout.splitlines():
        if "Function :" in line:
            inside = bool(function(line.split("Function :", 1)[1].strip()))
            continue
        if inside and pattern in line:
            # "/*0450*/  HMMA.16816.F32 R24, R4, R16, R24 ;  /* 0x... */" -> "HMMA.16816.F32 R24, R4, R16, R24 ;"
            lines.append(line.split("*/", 1)[-1].split("/*", 1)[0].strip())
    return lines


def sass(arch="sm_90", *, dtype="float16", head_dim=128, num_warps=4, q_in_registers=True, row_frags=1,
         source: str | None = None, pattern: str = "HMMA") -> list:
    """The machine instructions of one kernel variant that contain `pattern` (tensor-core HMMA by default)."""
    source = current_source() if source is None else source
    cubin, _ = compile_cubin(arch, source)
    want = ("6__half" if dtype == "float16" else "13__nv_bfloat16", str(head_dim), str(num_warps),
            "1" if q_in_registers else "0", str(row_frags))

    def is_variant(name):
        match = _MANGLED.search(name)
        return bool(match) and match.groups() == want

    return sass_lines(cubin, is_variant, pattern)
