"""The CUDA build of the tensor-core stage (wb_kernels/cuda_build.py) under stress (issue: robustness):
a changed source rebuilds, two processes building at once do not corrupt the cache, and a compile
error surfaces the compiler's own message.

What needs no GPU runs everywhere: the cache key, the cross-process file lock, and nvcc's error
messages (where nvcc is installed). Building with load_inline needs a CUDA GPU and a CUDA torch; those
tests skip on the simulator.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch

import wb_kernels as wb
from wb_kernels import cuda_build
from wb_kernels.stages.wmma import build as wmma_build

REPO = Path(__file__).resolve().parent.parent
gpu_only = pytest.mark.skipif(not (wb.BACKEND.is_gpu and torch.version.cuda),
                              reason="load_inline builds need a CUDA GPU and a CUDA build of torch")
FLAGS = ["-O3", "-gencode", "arch=compute_90,code=sm_90"]  # fixed flags: the key must not need a GPU


def marked(source: str, tag: str) -> str:
    """`source` with a harmless change: a new cache key without touching the kernel."""
    return source + f"\n// {tag}\n"


# --- a changed source rebuilds -----------------------------------------------------------------------

def test_the_cache_key_follows_the_file_on_disk(tmp_path, monkeypatch):
    copy = tmp_path / "flash_wmma.cu"
    copy.write_text(wmma_build.package_source())
    monkeypatch.setattr(wmma_build.SOURCE, "path", copy)
    before = cuda_build.extension_name(wmma_build.current_source(), FLAGS, "flash_wmma")
    assert cuda_build.extension_name(wmma_build.current_source(), FLAGS, "flash_wmma") == before  # unchanged: cached
    copy.write_text(copy.read_text().replace("tile_sum += p[t];", "tile_sum += 1.0f * p[t];"))
    after = cuda_build.extension_name(wmma_build.current_source(), FLAGS, "flash_wmma")
    assert after != before and after.startswith("wb_flash_wmma_")


def test_the_cache_key_follows_edited_regions():
    name = next(iter(cuda_build.module_regions(wmma_build.SOURCE_PATH)))
    shipped = cuda_build.module_regions(wmma_build.SOURCE_PATH)[name]
    original = cuda_build.extension_name(wmma_build.current_source(), FLAGS, "flash_wmma")
    try:
        wmma_build.set_region(name, shipped + "\n// a learner's edit", verbose=False)
        edited = cuda_build.extension_name(wmma_build.current_source(), FLAGS, "flash_wmma")
        wmma_build.set_region(name, shipped, verbose=False)  # back to the shipped text: the shipped key
        assert edited != original
        assert cuda_build.extension_name(wmma_build.current_source(), FLAGS, "flash_wmma") == original
    finally:
        wmma_build.reset_regions()


def test_the_cache_key_follows_flags_and_toolchain(monkeypatch):
    source = wmma_build.package_source()
    key = cuda_build.extension_name(source, FLAGS, "flash_wmma")
    assert cuda_build.extension_name(source, FLAGS[:-1] + ["arch=compute_80,code=sm_80"], "flash_wmma") != key
    monkeypatch.setattr(torch, "__version__", torch.__version__ + "+other")
    assert cuda_build.extension_name(source, FLAGS, "flash_wmma") != key  # another torch: its ABI may differ


# --- two processes at once ----------------------------------------------------------------------------

LOCK_HOLDER = textwrap.dedent("""
    import json, sys, time
    from pathlib import Path
    from wb_kernels.cuda_build import _file_lock
    with _file_lock(Path(sys.argv[1])):
        entered = time.monotonic()
        time.sleep(float(sys.argv[2]))
        left = time.monotonic()
    print(json.dumps([entered, left]))
""")


def test_the_build_lock_excludes_another_process(tmp_path):
    """Two processes that take the build lock at once hold it one after the other, never together."""
    lock = tmp_path / "wb_flash_wmma_test.lock"
    env = {"PYTHONPATH": str(REPO), "WB_BACKEND": "simulator", "PATH": "/usr/bin:/bin"}
    procs = [subprocess.Popen([sys.executable, "-c", LOCK_HOLDER, str(lock), "1.0"], stdout=subprocess.PIPE,
                              text=True, env=env) for _ in range(2)]
    spans = sorted(json.loads(p.communicate(timeout=60)[0].strip().splitlines()[-1]) for p in procs)
    assert all(p.returncode == 0 for p in procs)
    (first_in, first_out), (second_in, second_out) = spans
    assert second_in >= first_out, f"both held the lock: {spans}"


def test_a_process_that_dies_releases_the_lock(tmp_path):
    """flock is released by the kernel when its holder dies: no stale lock blocks later builds."""
    lock = tmp_path / "wb_flash_wmma_dead.lock"
    env = {"PYTHONPATH": str(REPO), "WB_BACKEND": "simulator", "PATH": "/usr/bin:/bin"}
    holder = subprocess.Popen([sys.executable, "-c", LOCK_HOLDER, str(lock), "60"], env=env,
                              stdout=subprocess.DEVNULL)
    time.sleep(2.0)  # let it take the lock
    holder.kill()
    holder.wait(timeout=30)
    start = time.monotonic()
    with cuda_build._file_lock(lock):
        waited = time.monotonic() - start
    assert waited < 5.0


def test_a_lock_file_left_by_a_killed_build_does_not_hold_the_next_one(tmp_path, monkeypatch):
    """torch's load_inline waits while its own lock file is in the build directory; a build killed mid-way leaves it
    (on the H100, 2026-11-27, the next build waited until its time limit). Under the package's lock the leftover is
    removed before load_inline runs. No GPU needed: load_inline is replaced by a stand-in that looks for the file."""
    import torch
    import torch.utils.cpp_extension as cpp_extension

    monkeypatch.setenv("WB_CUDA_CACHE", str(tmp_path))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.version, "cuda", "13.0")
    seen = {}

    def load_inline(name, build_directory, **kwargs):
        seen["lock there"] = (Path(build_directory) / "lock").exists()
        return object()

    monkeypatch.setattr(cpp_extension, "load_inline", load_inline)
    source = "// a lock test " + str(time.time_ns()) + "\n"
    name = cuda_build.extension_name(source, ["-O3"], "lock_test")
    (tmp_path / name).mkdir()
    (tmp_path / name / "lock").write_text("")  # what a killed build leaves
    cuda_build.build_extension(source, file_name="lock_test.cu", declarations="", functions=[], flags=["-O3"])
    assert seen == {"lock there": False}


CONCURRENT_BUILD = textwrap.dedent("""
    import sys, torch
    import wb_kernels as wb
    from wb_kernels import cuda_build
    from wb_kernels.stages.wmma import build as wmma_build
    source = wmma_build.package_source() + "\\n// concurrent build test " + sys.argv[1] + "\\n"
    module = wmma_build.build(source)
    q, k, v = wb.random_qkv(1, 2, 100, 64, dtype="float16", framework="torch", device="cuda", seed=1)
    out, lse = wb.get_stage("wmma").forward(q, k, v, causal=True, key_padding_mask=None, scale=None, module=module)
    wb.check("wmma", out, q, k, v, lse=lse, causal=True, verbose=False)
    print(cuda_build.extension_name(source, cuda_build.build_flags(), "flash_wmma"))
""")


@gpu_only
def test_two_processes_building_the_same_source_at_once(tmp_path):
    """Both get a working extension; the cache holds one build that a third process then only loads."""
    env = {**__import__("os").environ, "PYTHONPATH": str(REPO), "WB_CUDA_CACHE": str(tmp_path / "cache")}
    tag = str(time.time_ns())
    procs = [subprocess.Popen([sys.executable, "-c", CONCURRENT_BUILD, tag], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True, env=env) for _ in range(2)]
    results = [p.communicate(timeout=600) for p in procs]
    for p, (out, err) in zip(procs, results):
        assert p.returncode == 0, err[-3000:]
    names = {out.strip().splitlines()[-1] for out, _ in results}
    assert len(names) == 1
    builds = [d for d in (tmp_path / "cache").iterdir() if d.is_dir()]
    assert [d.name for d in builds] == list(names)
    # "only loads": the third process leaves the cached library as it was (a timing would pass or fail with
    # the machine's load; a rebuild rewrites the file)
    library = next(builds[0].glob("*.so"))
    before = library.stat().st_mtime_ns
    third = subprocess.run([sys.executable, "-c", CONCURRENT_BUILD, tag], capture_output=True, text=True, env=env,
                           timeout=600)
    assert third.returncode == 0, third.stderr[-3000:]
    assert library.stat().st_mtime_ns == before, "the third process rebuilt instead of loading the cached extension"


@gpu_only
def test_a_changed_source_is_rebuilt_and_the_old_one_kept():
    original = wmma_build.build(wmma_build.package_source())
    changed = wmma_build.build(marked(wmma_build.package_source(), f"rebuild test {time.time_ns()}"))
    assert changed is not original and changed.__name__ != original.__name__
    assert wmma_build.build(wmma_build.package_source()) is original


# --- a compile error surfaces the compiler's message ------------------------------------------------------

BROKEN = ("tile_sum += p[t];", "tile_sum += p_undefined_in_this_scope[t];")


def _nvcc_or_skip():
    try:
        cuda_build.find_nvcc()
    except cuda_build.NvccNotFound as error:
        pytest.skip(str(error))


def _broken_line() -> int:
    lines = wmma_build.package_source().splitlines()
    return next(i for i, line in enumerate(lines, 1) if BROKEN[0] in line)


def test_nvcc_error_names_the_identifier_the_file_and_the_line():
    _nvcc_or_skip()
    broken = wmma_build.package_source().replace(*BROKEN)
    with pytest.raises(cuda_build.CudaBuildError) as raised:
        wmma_build.nvcc_compile_report("sm_80", source=broken)
    message = str(raised.value)
    assert "p_undefined_in_this_scope" in message and "is undefined" in message
    assert f"flash_wmma.cu({_broken_line()})" in message
    assert "sm_80" in message and len(message.splitlines()) < 20


def test_nvcc_syntax_error_is_reported_not_swallowed():
    _nvcc_or_skip()
    broken = wmma_build.package_source().replace(BROKEN[0], "tile_sum += p[t]  // missing semicolon", 1)
    with pytest.raises(cuda_build.CudaBuildError, match=r"flash_wmma\.cu\(\d+\): error"):
        wmma_build.nvcc_compile_report("sm_90", source=broken)


def test_trimmed_error_drops_the_ninja_command_of_torchs_wrapper_line():
    """torch puts the first ninja step on the same line as "Error building extension" (seen on a GPU machine)."""
    raw = ("Error building extension 'wb_flash_wmma_0123': [1/3] /usr/local/cuda/bin/nvcc -MD -MF cuda.cuda.o.d "
           "-ccbin /usr/bin/gcc -DTORCH_EXTENSION_NAME=wb_flash_wmma_0123 -c cuda.cu -o cuda.cuda.o\n"
           "FAILED: cuda.cuda.o\n"
           "flash_wmma.cu(170): error: identifier \"p_undefined_in_this_scope\" is undefined\n"
           "              tile_sum += p_undefined_in_this_scope[t];\n"
           "                          ^\n"
           "1 error detected in the compilation of \"cuda.cu\".\n"
           "ninja: build stopped: subcommand failed.\n")
    message = cuda_build.trim_compiler_output(raw)
    assert "ninja" not in message.lower() and "nvcc -MD" not in message
    assert "Error building extension 'wb_flash_wmma_0123'" in message
    assert "flash_wmma.cu(170): error: identifier" in message and "p_undefined_in_this_scope[t]" in message


@gpu_only
def test_load_inline_error_names_the_identifier_and_the_line():
    broken = marked(wmma_build.package_source().replace(*BROKEN), f"broken {time.time_ns()}")
    with pytest.raises(cuda_build.CudaBuildError) as raised:
        wmma_build.build(broken)
    message = str(raised.value)
    assert "p_undefined_in_this_scope" in message and f"flash_wmma.cu({_broken_line()})" in message
    assert "ninja" not in message.lower() and len(message.splitlines()) < 30


# --- a cached build is loaded, not rebuilt ----------------------------------------------------------------

def test_build_directory_holds_the_file_the_line_directive_names(tmp_path):
    text = cuda_build.prepare_build_directory(tmp_path / "b", "int x;\n", wmma_build.LINE_NAME)
    named = tmp_path / "b" / wmma_build.LINE_NAME
    assert text == f'#line 1 "{wmma_build.LINE_NAME}"\nint x;\n' and named.read_text() == "int x;\n"
    before = named.stat().st_mtime_ns
    time.sleep(0.01)
    cuda_build.prepare_build_directory(tmp_path / "b", "int x;\n", wmma_build.LINE_NAME)
    assert named.stat().st_mtime_ns == before  # unchanged source: the copy keeps its older timestamp
    cuda_build.prepare_build_directory(tmp_path / "b", "int y;\n", wmma_build.LINE_NAME)
    assert named.read_text() == "int y;\n"


def test_every_dependency_nvcc_reports_exists_in_the_build_directory(tmp_path):
    """ninja rebuilds whenever a dependency from the compiler's depfile is missing. The #line directive makes
    nvcc report flash_wmma.cu as one (relative to the build directory, where ninja runs); before the build
    directory held that file, every new process recompiled the extension instead of loading it."""
    _nvcc_or_skip()
    text = cuda_build.prepare_build_directory(tmp_path, "#include <cstdio>\n__global__ void kernel() {}\n", wmma_build.LINE_NAME)
    (tmp_path / "cuda.cu").write_text(text)
    done = subprocess.run([cuda_build.find_nvcc(), "-M", "cuda.cu", "-MF", "cuda.d"], cwd=tmp_path,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    dependencies = (tmp_path / "cuda.d").read_text().replace("\\\n", " ").split(":", 1)[1].split()
    assert wmma_build.LINE_NAME in dependencies
    missing = [d for d in dependencies if not (tmp_path / d).exists()]
    assert not missing, f"ninja would rebuild every time: missing {missing}"


# --- Hopper's target and ptxas' notes (the hopper rung) ---------------------------------------------


def test_gencode_names_the_architecture_specific_target():
    assert cuda_build.gencode("sm_90a") == ["-gencode", "arch=compute_90a,code=sm_90a"]
    assert cuda_build.gencode("90") == ["-gencode", "arch=compute_90,code=sm_90"]
    assert cuda_build.build_flags(cuda_build.gencode("sm_90a"))[-2:] == ["-gencode", "arch=compute_90a,code=sm_90a"]
    with pytest.raises(ValueError, match="sm_80 or newer"):
        cuda_build.gencode("sm_75")


def test_serialized_wgmma_notes_are_found_in_a_ptxas_log():
    """ptxas prints these as ``info``, so the build itself succeeds: the rung has to look for them (C7520 as
    nvcc 13.0 printed it for a printf on a divergent path; C7510 for a printf on every path; C7512 when registers
    ran short)."""
    log = ("ptxas info    : Compiling entry function '_Z6kernelv' for 'sm_90a'\n"
           "ptxas info    : (C7520) Potential Performance Loss: wgmma.mma_async instructions are serialized due to "
           "program dependence on compiler-inserted WG.AR in divergent path in the function '_Z6kernelv'\n"
           "ptxas info    : (C7510) Potential Performance Loss: wgmma.mma_async instructions are serialized due to "
           "the presence of Extern calls in the function '_Z5otherv'\n"
           "ptxas info    : (C7512) Potential Performance Loss: wgmma.mma_async instructions are serialized due to "
           "insufficient register resources for the function '_Z5thirdv'\n"
           "ptxas info    : Used 90 registers, used 1 barriers, 24584 bytes smem\n")
    assert cuda_build.serialized_wgmma(log) == [
        ("C7520", "program dependence on compiler-inserted WG.AR in divergent path", "_Z6kernelv"),
        ("C7510", "the presence of Extern calls", "_Z5otherv"),
        # nvcc 13.0's words for a kernel whose registers ran short ("for", not "in", the function): the rung's v3
        # and v4 hit it once, and the pattern before this test missed it
        ("C7512", "insufficient register resources", "_Z5thirdv")]
    assert cuda_build.serialized_wgmma("ptxas info    : Used 90 registers") == []


def test_compile_cubin_caches_per_extra_flags():
    _nvcc_or_skip()
    source = "__global__ void k(float* x) {\n#ifdef TWICE\n x[0] *= 2.0f;\n#endif\n x[0] += 1.0f; }\n"
    plain, _ = cuda_build.compile_cubin("sm_90a", source, "tiny.cu")
    twice, _ = cuda_build.compile_cubin("sm_90a", source, "tiny.cu", extra_flags=("-DTWICE",))
    assert plain != twice and cuda_build.compile_cubin("sm_90a", source, "tiny.cu")[0] == plain


# --- a source of several files (issue 45: decode and hopper split into headers) ----------------------------

def test_a_source_is_its_file_and_the_headers_it_includes_put_in_once():
    from wb_kernels.stages.decode import build as decode_build

    files = decode_build.SOURCE.files()
    assert list(files) == [f"wb_kernels/stages/decode/{name}" for name in (
        "decode_host.cu", "decode_params.cuh", "decode_merge.cuh", "decode_split_kernel.cuh", "decode_mma_kernel.cuh")]
    text = decode_build.package_source()
    for name, path in files.items():
        if name.endswith(".cuh"):
            assert text.count(f'#line 1 "{path.name}"') == 1, name  # each header once, though three include params
    assert '#include "decode' not in text and "#pragma once" not in text
    # what the compiler reads back to show a line: each file's lines at their own numbers, its includes blank
    for name, compiled in cuda_build.source_files(text, decode_build.LINE_NAME).items():
        shipped = (REPO / "wb_kernels/stages/decode" / name).read_text().splitlines()
        for number, line in enumerate(compiled.splitlines(), 1):
            assert line == shipped[number - 1] or (line == "" and shipped[number - 1].startswith(("#include \"",
                                                                                                "#pragma once"))), (name, number)


def test_an_edit_of_a_header_region_is_built_and_changes_the_cache_key():
    from wb_kernels.stages.decode import build as decode_build

    source = decode_build.SOURCE
    header = "wb_kernels/stages/decode/decode_split_kernel.cuh"
    shipped = cuda_build.module_regions(REPO / header)["split_kernel_block_merge"]
    key = cuda_build.extension_name(decode_build.current_source(), FLAGS, "decode_host")
    cell = [f"# region: split_kernel_block_merge ({header})\n", shipped + "\n// a learner's edit\n"]
    code = "".join(cuda_build._region_cell_transform(cell))
    assert "record_region_cell" in code  # a .cuh cell is recognised as C++
    try:
        exec(compile(code, "<cell>", "exec"), {})
        assert source.edited_regions() == ["split_kernel_block_merge"]
        assert "// a learner's edit" in decode_build.current_source()
        assert "// a learner's edit" not in decode_build.package_source()
        assert cuda_build.extension_name(decode_build.current_source(), FLAGS, "decode_host") != key
    finally:
        source.reset_regions()
    assert cuda_build.extension_name(decode_build.current_source(), FLAGS, "decode_host") == key
    with pytest.raises(KeyError, match="no region 'no_such_region'"):
        source.set_region("no_such_region", "x")


def test_a_compile_error_in_a_header_names_the_header_and_its_line():
    _nvcc_or_skip()
    from wb_kernels.stages.decode import build as decode_build

    header = REPO / "wb_kernels/stages/decode/decode_params.cuh"
    broken = decode_build.SOURCE.source_with("vector_loads", cuda_build.module_regions(header)["vector_loads"].replace(
        "x[2 * i] = f.x;", "x[2 * i] = f_undefined_here.x;", 1))
    line = next(i for i, text in enumerate(header.read_text().splitlines(), 1) if "x[2 * i] = f.x;" in text)
    with pytest.raises(cuda_build.CudaBuildError) as raised:
        cuda_build.compile_cubin("sm_90", broken, decode_build.LINE_NAME, decode_build.SOURCE_NAME)
    assert f"decode_params.cuh({line})" in str(raised.value) and "f_undefined_here" in str(raised.value)


def test_extension_builds_the_text_its_rung_asks_for(monkeypatch):
    """A rung's build() compiles its current or package text by default, naming its file; extension() builds once."""
    from wb_kernels.stages.decode import build as decode_build
    from wb_kernels.stages.mma import build as mma_build

    built = []
    monkeypatch.setattr(cuda_build, "build_extension", lambda source, **kw: built.append((source, kw)) or object())
    extension = cuda_build.Extension(decode_build.SOURCE, "", ["f"], default="package")
    assert extension.extension() is extension.extension() and len(built) == 1
    source, kw = built[0]
    assert source == decode_build.package_source()
    assert kw["file_name"] == "decode_host.cu" and kw["display_name"] == "wb_kernels/stages/decode/decode_host.cu"
    cuda_build.Extension(mma_build.SOURCE, "", ["f"]).build(flags=["-O3"])
    assert built[-1][0] == mma_build.current_source() and built[-1][1]["flags"] == ["-O3"]


def test_resync_names_the_file_a_region_moved_to(tmp_path):
    """flash_decode.cu became five files: a lesson's cell naming the old file is rewritten with the region's new one."""
    from wb_kernels.lesson_sync import notebook_regions, resync_notebook

    text = cuda_build.module_regions(REPO / "wb_kernels/stages/decode/decode_merge.cuh")["merge_splits"]
    notebook = {"cells": [{"cell_type": "code", "metadata": {}, "outputs": [], "execution_count": None,
                           "source": ["# region: merge_splits (wb_kernels/stages/decode/flash_decode.cu)\n", text]}],
                "metadata": {}, "nbformat": 4, "nbformat_minor": 5}
    path = tmp_path / "lesson.ipynb"
    path.write_text(json.dumps(notebook))
    assert resync_notebook(path) == ["merge_splits"]
    assert notebook_regions(path) == [("merge_splits", "wb_kernels/stages/decode/decode_merge.cuh", text)]
    assert resync_notebook(path) == []


def test_a_sources_regions_come_in_the_order_nvcc_reads_them():
    """Each header's regions where the header is first included, before the regions of the file that includes it:
    the order lesson 07 shows them in (helpers before their callers)."""
    from wb_kernels.stages.decode import build as decode_build

    regions = decode_build.SOURCE.regions()
    order = list(regions)
    assert order.index("params_and_guards") < order.index("merge_splits") < order.index("split_kernel_setup") \
        < order.index("launch_split_kernel") < order.index("forward_launch")
    assert regions["merge_splits"] == cuda_build.module_regions(REPO / "wb_kernels/stages/decode/decode_merge.cuh")[
        "merge_splits"]
    every = [name for path in decode_build.SOURCE.files().values() for name in cuda_build.module_regions(path)]
    assert sorted(order) == sorted(every) and len(set(order)) == len(order)
