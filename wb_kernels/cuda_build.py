"""Building and compiling the series' CUDA C++ kernels (lesson 05 on; each rung's ``build.py`` describes its file).

What every CUDA C++ rung shares:

- :class:`EditableSource`: a ``.cu`` file of the package and the package's headers it includes
  (``#include "file.cuh"``, recursively), which a lesson shows region by region (``// region: NAME``). A notebook
  cell that starts with ``# region: NAME (wb_kernels/stages/<rung>/<file>.cu)`` (or ``.cuh``) holds C++; once
  :func:`enable_region_cells` has run, running the cell records the learner's version of that region, and the
  next build or compile of every source that includes the file uses it. What nvcc compiles is one text, the headers
  put in behind ``#line`` directives, so the cache key below covers every file.
- :class:`Extension`: a rung's extension (source, exported functions) with the ``build`` and ``extension``
  functions every rung's ``build.py`` offers.
- :func:`build_extension` (needs a CUDA GPU and a CUDA build of torch): ``torch.utils.cpp_extension.load_inline``
  turns a source into a Python extension. Its name carries a hash of the source and the flags, so an edited source
  (or other flags) is a new extension and is rebuilt, and an unchanged one is loaded from the cache in
  milliseconds. A file lock keeps two processes from building the same extension at once. A failed build raises
  :class:`CudaBuildError` with only the compiler's error lines, not the several hundred lines of a ninja log.
- :func:`compile_cubin`, :func:`ptxas_entries` and :func:`sass_lines` (need only nvcc, no GPU, no CUDA torch):
  compile the kernels alone (``-DWB_KERNEL_ONLY``) to a cubin for sm_80 or sm_90, read registers, spills and
  stack from ``ptxas -v``, and list machine instructions (the tensor-core HMMA ones, say) via ``cuobjdump -sass``.
  :func:`serialized_wgmma` finds ptxas' notes that it serialized a Hopper kernel's ``wgmma`` (codes C7510, C7520:
  "Potential Performance Loss"), which ptxas prints as information, not as a warning, so that a build passes
  with them; a rung that uses ``wgmma`` refuses a build that has one (``stages/hopper/build.py``).
  The tools come from the CUDA wheels on PyPI when installed (``make lab``), else from a toolkit
  (:mod:`wb_kernels.cuda_toolchain`). CI runs these, so a broken ``.cu`` fails CI on machines without a GPU.
"""

from __future__ import annotations

import fcntl
import hashlib
import os
import re
import subprocess
import sys
import tempfile
import time
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from .cuda_toolchain import NvccNotFound, find_cuobjdump, find_nvcc  # noqa: F401 (where nvcc comes from)
from .lesson_sync import PACKAGE_ROOT, install_input_transformer, lines_changed, module_regions, replace_region

__all__ = [
    "CudaBuildError", "NvccNotFound", "EditableSource", "Extension", "enable_region_cells", "record_region_cell", "build_flags",
    "extension_name", "build_extension", "find_nvcc", "find_cuobjdump", "compile_cubin", "PtxasEntry",
    "ptxas_entries", "sass_lines", "trim_compiler_output", "gencode", "serialized_wgmma", "source_files",
]


class CudaBuildError(RuntimeError):
    """The CUDA source did not compile; the message holds the compiler's error lines."""


# ---------------------------------------------------------------------------------------------
# A source, with the learner's edits

_OWNERS: dict = {}  # every file of every source, as lessons name it ("wb_kernels/stages/<rung>/<file>") -> a source of it
_EDITS: dict = {}  # file as lessons name it -> {region name: the text the learner ran in the lesson}
_LOCAL_INCLUDE = re.compile(r'^[ \t]*#[ \t]*include[ \t]+"([^"]+)"[ \t]*$')
_LINE_DIRECTIVE = re.compile(r'^#line (\d+) "([^"]+)"$')


def _lesson_name(path: Path) -> str:
    """`path` as lessons name it: relative to the repository ("wb_kernels/stages/<rung>/<file>")."""
    try:
        return Path(path).resolve().relative_to(PACKAGE_ROOT.parent).as_posix()
    except ValueError:
        return Path(path).as_posix()


class EditableSource:
    """A ``.cu`` file of the package (the translation unit), the package's headers it includes with
    ``#include "file.cuh"`` (found next to the including file, looked for recursively), and the regions a learner
    edited in any of those files in this Python process.

    What nvcc compiles is one text: the ``.cu`` file with each of its headers put in place of its ``#include`` line
    (each header once), behind ``#line`` directives, so that compiler messages name the right file and line. A
    source's cache key (:func:`extension_name` of that text) therefore covers every file, with the learner's edits.
    A region cell may name any of the files (``# region: NAME (wb_kernels/stages/<rung>/<file>.cuh)``); region names
    are unique across a source's files, so :meth:`set_region` finds the file by the name alone."""

    def __init__(self, path: Path):
        self.path = Path(path)
        self.name = self.path.relative_to(PACKAGE_ROOT.parent).as_posix()  # "wb_kernels/stages/<rung>/<file>.cu"
        self.file_name = self.path.name  # what compiler messages call it
        for file in self.files():
            _OWNERS.setdefault(file, self)

    # -- the files
    def _key(self, path: Path) -> str:
        return self.name if Path(path) == self.path else _lesson_name(path)

    def _includes(self, path: Path) -> list:
        """The package's headers `path` includes with quotes, in order (a quoted name that is no file there is left
        to the compiler)."""
        found = []
        for line in Path(path).read_text().splitlines():
            match = _LOCAL_INCLUDE.match(line)
            if match and (Path(path).parent / match.group(1)).is_file():
                found.append((Path(path).parent / match.group(1)).resolve())
        return found

    def files(self) -> dict:
        """{file as lessons name it: path}: the ``.cu`` file first, then every header it includes, recursively."""
        found, pending = {}, [self.path]
        while pending:
            path = pending.pop(0)
            if self._key(path) in found:
                continue
            found[self._key(path)] = path
            pending.extend(self._includes(path))
        return found

    def regions(self) -> dict:
        """{region name: text} of every file, in the order nvcc reads them (each header where it is first included,
        before the rest of the file that includes it): the order in which a lesson shows them, helpers first."""
        texts = {}
        for path in self.files().values():
            texts.update(module_regions(path))
        order = re.findall(r"^[ \t]*// region: (\w+)[ \t]*$", self.package_source(), re.MULTILINE)
        return {name: texts[name] for name in order}

    def _file_of_region(self, name: str) -> str:
        holders = [file for file, path in self.files().items() if name in module_regions(path)]
        if not holders:
            every = sorted(r for path in self.files().values() for r in module_regions(path))
            raise KeyError(f"{self.name} and its headers have no region {name!r}; they have {every}")
        return holders[0]

    # -- the text nvcc compiles
    def _expand(self, path: Path, edits: dict, done: set) -> str:
        key = self._key(path)
        done.add(key)
        text = Path(path).read_text()
        for name, body in edits.get(key, {}).items():
            text = self._replace_region(text, name, body, key)
        lines, out = text.split("\n"), []
        for number, line in enumerate(lines, start=1):
            if line.strip() == "#pragma once":  # a header's guard: it is put in once here, and a main file warns of it
                out.append("")
                continue
            match = _LOCAL_INCLUDE.match(line)
            header = (Path(path).parent / match.group(1)) if match else None
            if header is None or not header.is_file():
                out.append(line)
                continue
            header = header.resolve()
            if self._key(header) not in done:  # each header once, as include guards would have it
                out.append(f'#line 1 "{header.name}"')
                out.append(self._expand(header, edits, done).rstrip("\n"))
            out.append(f'#line {number + 1} "{Path(path).name}"')
        return "\n".join(out)

    def _source(self, edits: dict) -> str:
        return self._expand(self.path, edits, set())

    def package_source(self) -> str:
        """The files as the package ships them, the headers put in: what nvcc compiles."""
        return self._source({})

    def _replace_region(self, source: str, name: str, text: str, file: str | None = None) -> str:
        try:
            return replace_region(source, name, text, comment="//")
        except KeyError:
            raise KeyError(f"{file or self.name} has no region {name!r}") from None

    def _edits(self) -> dict:
        return {file: dict(_EDITS[file]) for file in self.files() if _EDITS.get(file)}

    def current_source(self) -> str:
        """The package source with every region the learner edited in this Python process put in."""
        return self._source(self._edits())

    def source_with(self, name: str, text: str) -> str:
        """The package source with `text` in region `name` (a one-off version, e.g. a puzzle's answer)."""
        return self._source({self._file_of_region(name): {name: text}})

    def set_region(self, name: str, text: str, verbose: bool = True, file: str | None = None) -> bool:
        """Use `text` for region `name` (of `file`, by default the file that has it) in later builds; returns (and
        prints) whether it differs from the package."""
        file = file or self._file_of_region(name)
        shipped = module_regions(self.files()[file])
        if name not in shipped:
            raise KeyError(f"{file} has no region {name!r}; it has {sorted(shipped)}")
        text = text.strip("\n")
        if text == shipped[name]:
            _EDITS.get(file, {}).pop(name, None)
            if verbose:
                print(f"region {name}: as in {file}")
            return False
        _EDITS.setdefault(file, {})[name] = text
        if verbose:
            changed = lines_changed(shipped[name], text)
            print(f"region {name}: edited ({changed} line(s) differ from {file}); "
                  "the next build compiles your version")
        return True

    def reset_regions(self) -> None:
        """Forget the learner's edits: builds use the package source again."""
        for file in self.files():
            _EDITS.pop(file, None)

    def edited_regions(self) -> list:
        return sorted(name for edits in self._edits().values() for name in edits)


def source_files(source: str, file_name: str) -> dict:
    """{file name: text} of the files a compiled `source` names in its ``#line`` directives (and `file_name`, the
    file its first lines belong to), each with the lines of it that `source` holds at their line numbers (a line
    that `source` replaced, an ``#include`` say, is blank). The compiler reads these files to show an offending line,
    and ninja counts them among the build's dependencies. A source without directives is `file_name` as it is."""
    if "#line " not in source:
        return {file_name: source}
    files: dict = {}
    current, number = file_name, 1
    lines = source.split("\n")
    for line in lines[:-1] if lines[-1] == "" else lines:  # a last newline ends a line, it starts none
        match = _LINE_DIRECTIVE.match(line)
        if match:
            number, current = int(match.group(1)), match.group(2)
            continue
        files.setdefault(current, {})[number] = line
        number += 1
    return {name: "\n".join(numbered.get(i, "") for i in range(1, max(numbered) + 1)) + "\n"
            for name, numbered in files.items()}


_REGION_CELL = re.compile(r"^# region: (\w+) \((wb_kernels/[\w/.]+\.cuh?)\)\s*$")


def _region_cell_transform(lines: list) -> list:
    """IPython input transformer: a cell headed ``# region: NAME (wb_kernels/stages/<rung>/<file>.cu)`` (or a
    ``.cuh`` header of it) holds C++; turn it into the Python call that records it."""
    match = _REGION_CELL.match(lines[0].rstrip("\n")) if lines else None
    if match is None or match.group(2) not in _OWNERS:
        return lines
    name, source = match.groups()
    text = "".join(lines[1:])
    return [f"__import__('wb_kernels.cuda_build').cuda_build.record_region_cell({source!r}, {name!r}, {text!r})\n"]


def record_region_cell(source: str, name: str, text: str) -> None:
    """What a C++ region cell runs: ``set_region`` for region `name` of file `source`, returning nothing (so the
    cell shows one line)."""
    _OWNERS[source].set_region(name, text, file=source)


def enable_region_cells() -> bool:
    """Let this notebook's C++ region cells run (see the module docstring). Returns False outside IPython."""
    return install_input_transformer(_region_cell_transform)


# ---------------------------------------------------------------------------------------------
# Building with load_inline (GPU)


def _gencode_for_current_device() -> list:
    import torch

    major, minor = torch.cuda.get_device_capability()
    if major < 8:
        raise RuntimeError(f"the CUDA C++ kernels of this series need an sm_80 or newer GPU (bf16 tensor cores, cp.async); "
                           f"this one is sm_{major}{minor}")
    return ["-gencode", f"arch=compute_{major}{minor},code=sm_{major}{minor}"]


def build_flags(gencode=None) -> list:
    """nvcc flags for the extension: -O3, fast math (exp2f -> ex2.approx), the GPU's own architecture."""
    return ["-O3", "--use_fast_math", "-std=c++17", "-lineinfo",
            *(gencode if gencode is not None else _gencode_for_current_device())]


def extension_name(source: str, flags: list, prefix: str) -> str:
    """A name that changes whenever the source, the flags or the torch/CUDA versions change."""
    import torch

    digest = hashlib.sha256("\0".join([source, " ".join(flags), torch.__version__,
                                       str(torch.version.cuda)]).encode()).hexdigest()
    return f"wb_{prefix}_{digest[:16]}"


def _shown(path: Path) -> str:
    """`path` as a message shows it: under the home folder as ~/..., so that a lesson's output names no machine."""
    try:
        return "~/" + str(Path(path).relative_to(Path.home()))
    except ValueError:
        return str(path)


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


def trim_compiler_output(output: str, max_errors: int = 12) -> str:
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


_trim_compiler_output = trim_compiler_output  # the old name, which tests/test_wmma.py still calls


_loaded: dict = {}


def _write_source_files(directory: Path, source: str, file_name: str) -> None:
    """Every file :func:`source_files` finds in `source`, written to `directory` only where it changed."""
    for name, text in source_files(source, file_name).items():
        named_copy = directory / name
        if not named_copy.exists() or named_copy.read_text() != text:
            named_copy.write_text(text)


def prepare_build_directory(build_dir: Path, source: str, file_name: str) -> str:
    """Make `build_dir` and return the text to hand to load_inline: `source` behind ``#line 1 "<file_name>"``,
    so that compiler messages point at lines of that file, not of load_inline's copy (and a source with headers put
    in by :class:`EditableSource`, at lines of theirs).

    The directive makes nvcc list `file_name` among the dependencies it reports to ninja; a dependency
    that does not exist marks the build out of date, and every new process then recompiled the extension
    (a minute) instead of loading it. So the source is also written there under that name, and rewritten only
    when it changed, so that its timestamp stays older than the library built from it; so are the headers the
    source's ``#line`` directives name (:func:`source_files`)."""
    build_dir.mkdir(parents=True, exist_ok=True)
    _write_source_files(build_dir, source, file_name)
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
    cold = not any(build_dir.glob(f"{name}*.so"))
    if cold:
        # nvcc gives no sign of life for a minute or more: say what is happening, and when it is over
        print(f"building {display_name} for this GPU (the first time takes a minute or more; later runs load it "
              f"from {_shown(build_dir.parent)} in milliseconds) ...", file=sys.stderr, flush=True)
        started = time.perf_counter()
    cuda_source = prepare_build_directory(build_dir, source, file_name)
    with _file_lock(_cache_root() / f"{name}.lock"):
        # torch's load_inline keeps a lock file of its own in the build directory and waits while it exists; a build
        # killed mid-way leaves it, and every later build of the extension waited for it forever. Under our lock no
        # other build of this extension runs, so a file there now is such a leftover.
        (build_dir / "lock").unlink(missing_ok=True)
        try:
            module = load_inline(name=name, cpp_sources=[declarations], cuda_sources=[cuda_source],
                                 functions=functions, extra_cuda_cflags=flags, build_directory=str(build_dir),
                                 verbose=verbose)
            if cold:
                print(f"built {display_name} in {time.perf_counter() - started:.0f} s", file=sys.stderr, flush=True)
        except RuntimeError as error:
            raise CudaBuildError(f"building {display_name} failed:\n{trim_compiler_output(str(error))}") from None
    _loaded[name] = module
    return module


class Extension:
    """A rung's extension as its ``build.py`` describes it: the source (an :class:`EditableSource`; `compose`, when
    given, turns its text into what nvcc compiles), the C++ declarations of the functions it exports, and which text
    :meth:`build` compiles by default (`default`: "current", the learner's edits put in, or "package"). A rung's
    ``build`` and ``extension`` are this object's methods."""

    def __init__(self, source: EditableSource, declarations: str, functions: list, *, compose=None,
                 default: str = "current"):
        if default not in ("current", "package"):
            raise ValueError(f"default={default!r}: 'current' or 'package'")
        self.source, self.declarations, self.functions = source, declarations, list(functions)
        self._compose = compose or (lambda text: text)
        self.default = default
        self._module = None

    def package_source(self) -> str:
        """What nvcc compiles for the package's files as shipped."""
        return self._compose(self.source.package_source())

    def current_source(self) -> str:
        """What nvcc compiles with the learner's edits (the lesson's region cells) put in."""
        return self._compose(self.source.current_source())

    def build(self, source: str | None = None, *, flags: list | None = None, verbose: bool = False):
        """Compile (or load from the disk cache) the extension from `source` (by default the package's text, or the
        learner's edits put in: see the class); returns the Python module. Needs a CUDA GPU and a CUDA torch."""
        if source is None:
            source = self.current_source() if self.default == "current" else self.package_source()
        return build_extension(source, file_name=self.source.file_name, declarations=self.declarations,
                               functions=self.functions, flags=flags, verbose=verbose, display_name=self.source.name)

    def extension(self):
        """The package's extension (the learner's edits left out), built or loaded from the disk cache once per
        process: what ``wb.attention`` and ``wb.decode`` call, without reading or hashing the source on every call."""
        if self._module is None:
            self._module = self.build(self.package_source())
        return self._module


# ---------------------------------------------------------------------------------------------
# Without a GPU: nvcc alone


def _check_arch(arch) -> str:
    arch = str(arch).replace("sm_", "")
    if arch not in ("80", "86", "89", "90", "90a"):  # 90a: Hopper's arch-specific target (wgmma, setmaxnreg)
        raise ValueError(f"arch={arch!r}: the kernel targets sm_80 or newer, e.g. 'sm_80', 'sm_90' or 'sm_90a'")
    return arch


def gencode(arch: str) -> list:
    """nvcc's flags for one target: ``gencode("sm_90a")`` -> ``["-gencode", "arch=compute_90a,code=sm_90a"]``
    (the ``a`` target: Hopper's wgmma and setmaxnreg; pass it to :func:`build_flags` on a Hopper GPU)."""
    arch = _check_arch(arch)
    return ["-gencode", f"arch=compute_{arch},code=sm_{arch}"]


_cubins: dict = {}  # (source hash, arch, flags, nvcc) -> (cubin path, ptxas log)


def compile_cubin(arch: str, source: str, file_name: str, display_name: str | None = None, *,
                  extra_flags: tuple = (), nvcc: str | None = None):
    """nvcc alone (no GPU): `source` compiled for `arch` to a cubin, ``-DWB_KERNEL_ONLY`` (the kernels without their
    torch launcher); returns (cubin path, ptxas's -v report). `extra_flags`: more nvcc flags (``-D...`` build
    options); `nvcc`: a compiler other than :func:`find_nvcc`'s. Cached per source, arch, flags and nvcc in this
    process."""
    arch = _check_arch(arch)
    display_name = display_name or file_name
    nvcc = nvcc or find_nvcc()
    key = (hashlib.sha256(source.encode()).hexdigest(), arch, tuple(extra_flags), nvcc)
    if key in _cubins and Path(_cubins[key][0]).exists():
        return _cubins[key]
    workdir = Path(tempfile.mkdtemp(prefix="wb_nvcc_"))
    # the compiled text behind a #line directive naming `file_name`, and the files its directives name beside it, so
    # that messages name flash_wmma.cu (relative: not a temp dir) and show its lines, headers put in or not
    _write_source_files(workdir, source, file_name)
    cu = workdir / "wb_compiled_source.cu"
    cu.write_text(f'#line 1 "{file_name}"\n{source}')
    cubin = workdir / f"{Path(file_name).stem}_sm{arch}.cubin"
    command = [nvcc, "-std=c++17", "-O3", "--use_fast_math", "-DWB_KERNEL_ONLY", *extra_flags, "-cubin",
               *gencode(arch), "-Xptxas", "-v", "-o", cubin.name, cu.name]
    result = subprocess.run(command, capture_output=True, text=True, cwd=workdir)
    log = result.stdout + result.stderr
    if result.returncode != 0:
        raise CudaBuildError(f"nvcc for sm_{arch} failed on {display_name}:\n{trim_compiler_output(log)}")
    _cubins[key] = (str(cubin), log)
    return _cubins[key]


@dataclass(frozen=True)
class PtxasEntry:
    """What ``ptxas -v`` reports for one kernel of a cubin (per thread)."""

    function: str  # the mangled name: a rung decodes its template arguments from it
    arch: str  # "sm_90"
    registers: int
    spill_stores: int  # bytes per thread written to local memory because registers ran out
    spill_loads: int
    stack_bytes: int


_ENTRY = re.compile(r"Compiling entry function '(\w+)' for 'sm_(\d+a?)'")
_SPILLS = re.compile(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads")
_REGISTERS = re.compile(r"Used (\d+) registers")


def ptxas_entries(log: str) -> list:
    """Every kernel ``ptxas -v`` reported in `log` (the second value :func:`compile_cubin` returns)."""
    found, function, arch, spills = [], None, None, None
    for line in log.splitlines():
        entry = _ENTRY.search(line)
        if entry:
            function, arch, spills = entry.group(1), entry.group(2), None
            continue
        if function is None:
            continue
        match = _SPILLS.search(line)
        if match:
            spills = tuple(int(x) for x in match.groups())
            continue
        match = _REGISTERS.search(line)
        if match and spills is not None:
            found.append(PtxasEntry(function, f"sm_{arch}", int(match.group(1)), spills[1], spills[2], spills[0]))
            function = None
    return found


_SERIALIZED_WGMMA = re.compile(r"\((C75\d\d)\) Potential Performance Loss: wgmma\.mma_async instructions are "
                               r"serialized due to ([^']*?) (?:in|for) the function '(\w+)'")


def serialized_wgmma(log: str) -> list:
    """ptxas' notes in `log` that it serialized the wgmma of a kernel: (code, reason, mangled function) each.

    ptxas then waits for every wgmma before issuing the next, which costs a Hopper kernel most of its tensor-core
    throughput; a printf in the kernel, accumulator registers touched while a wgmma is in flight, or a wgmma
    reached on a divergent path cause it. The note comes as ``ptxas info``, so the build itself succeeds."""
    return [match.groups() for match in _SERIALIZED_WGMMA.finditer(log)]


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
