"""The package's arrows run one way (STYLE.md, "Code that uses the kernels"): lessons -> models and the benchmark ->
api -> stages (the rungs) -> the shared floor (results files, timing, counts). Enforced here, read from the source:

1. No import cycle anywhere in ``wb_kernels``.
2. A rung (anything under ``wb_kernels/stages/``) never imports ``wb_kernels.bench`` or ``wb_kernels.models``: a rung
   does not know the code that measures or uses it. What both need sits on the floor below them
   (``results_files``, ``timing``, ``attention_costs``, ``nsight``, ``tuning``, ``inputs``, and the check, the
   reference and what they stand on: ``check``, ``reference``, ``arguments``, ``device``, ``backend``).
3. ``bench`` and ``models`` reach a rung only through the stage registry (``wb_kernels.stages``), a rung's
   ``__init__`` exports (``wb_kernels.stages.<rung>``) or the public API (``wb_kernels``), never a rung's module
   (``wb_kernels.stages.<rung>.<module>``).
4. The floor imports neither the rungs nor ``bench`` nor ``models``.
5. ``bench``, ``models`` and the floor do not import another module's ``_private`` names: what two modules share is
   public in the one that defines it.

What counts as an import (:func:`imported_modules`): ``import x`` and ``from x import y`` at any depth (a lazy import
inside a function is as much an arrow as one at the top of a file), and the dynamic lookups of the package's own
modules, ``importlib.import_module(...)``, ``__import__(...)``, ``sys.modules[...]`` and ``sys.modules.get(...)``,
whose name is a literal or an f-string (each field of an f-string matches any one name, so it is an arrow to every
module it can name: the registry's ``import_module(f"{__name__}.{name}")`` reaches every rung's ``__init__``;
``__name__`` and ``__package__`` in it are the importing module's own). A module importing a package it
lives in is not counted: Python runs a package's ``__init__`` before any of its modules anyway.

The checker is one function, :func:`layering_problems`, run on the real package and, to show that it fails when it
should, on small packages planted in a temporary folder.
"""

from __future__ import annotations

import ast
import functools
import re
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "wb_kernels"
FLOOR = ("results_files", "timing", "attention_costs", "nsight", "tuning", "inputs", "check", "reference", "arguments",
         "device", "backend")  # below both the rungs and the benchmark
USERS = ("bench", "models")  # the code that measures or uses the rungs


# ---------------------------------------------------------------------------------------------- the import graph


def package_modules(package_dir: Path) -> dict:
    """{dotted module name: path} of every ``.py`` file under `package_dir` (a package's ``__init__.py`` is named
    after the package)."""
    root = package_dir.parent
    modules = {}
    for path in sorted(package_dir.rglob("*.py")):
        parts = path.relative_to(root).with_suffix("").parts
        if parts[-1] == "__init__":
            parts = parts[:-1]
        modules[".".join(parts)] = path
    return modules


def _resolve_relative(module: str, is_package: bool, level: int, name: str | None) -> str:
    base = module.split(".") if is_package else module.split(".")[:-1]
    base = base[:len(base) - (level - 1)]
    return ".".join(base + ([name] if name else []))


def _string_pattern(node, module: str, is_package: bool):
    """A regex for the module name an expression gives (a literal, or an f-string whose fields match any one name;
    ``__name__``/``__package__`` there are the importing module's), or None when it is neither."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return re.escape(node.value)
    if isinstance(node, ast.JoinedStr):
        parts = []
        for value in node.values:
            if isinstance(value, ast.Constant):
                parts.append(re.escape(str(value.value)))
            elif isinstance(value, ast.FormattedValue) and isinstance(value.value, ast.Name) \
                    and value.value.id in ("__name__", "__package__"):
                own = module if value.value.id == "__name__" or is_package else module.rpartition(".")[0]
                parts.append(re.escape(own))
            else:
                parts.append(r"\w+")
        return "".join(parts)
    return None


def _is_sys_modules(node) -> bool:
    return isinstance(node, ast.Attribute) and node.attr == "modules" and isinstance(node.value, ast.Name) \
        and node.value.id == "sys"


def _dynamic_names(node, module: str, is_package: bool) -> list:
    """The patterns of the module names a dynamic lookup in `node` asks for (none for other nodes)."""
    argument = None
    if isinstance(node, ast.Call):
        function = node.func
        name = function.attr if isinstance(function, ast.Attribute) else getattr(function, "id", None)
        if name in ("import_module", "__import__") and node.args:
            argument = node.args[0]
            if name == "import_module" and isinstance(argument, ast.Constant) and str(argument.value).startswith("."):
                level = len(argument.value) - len(argument.value.lstrip("."))
                return [re.escape(_resolve_relative(module, is_package, level, argument.value[level:] or None))]
        elif name == "get" and isinstance(function, ast.Attribute) and _is_sys_modules(function.value) and node.args:
            argument = node.args[0]
    elif isinstance(node, ast.Subscript) and _is_sys_modules(node.value):
        argument = node.slice
    pattern = None if argument is None else _string_pattern(argument, module, is_package)
    return [] if pattern is None else [pattern]


def imported_modules(module: str, path: Path, modules: dict) -> set:
    """The modules of `modules` that `module` (the file at `path`) imports, statically or by a dynamic lookup."""
    is_package = path.name == "__init__.py"
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        names = []
        if isinstance(node, ast.Import):
            for alias in node.names:  # `import a.b.c` imports a.b.c (and its packages)
                names.append(alias.name)
        elif isinstance(node, ast.ImportFrom):
            base = _resolve_relative(module, is_package, node.level, node.module) if node.level else node.module
            names.append(base)
            names += [f"{base}.{alias.name}" for alias in node.names]  # `from . import x`: the module x
        else:
            for pattern in _dynamic_names(node, module, is_package):
                names += [name for name in modules if re.fullmatch(pattern, name)]
        for name in names:
            if name in modules and name != module and not module.startswith(name + "."):
                found.add(name)
    return found


@functools.lru_cache(maxsize=8)  # the real package's graph, read once for all its tests
def import_graph(package_dir: Path) -> dict:
    """{module: the package's modules it imports} for every module under `package_dir`."""
    modules = package_modules(package_dir)
    return {name: imported_modules(name, path, modules) for name, path in modules.items()}


def import_cycles(graph: dict) -> list:
    """The strongly connected components of more than one module (each a sorted list): every import cycle."""
    index, low, on_stack, stack, cycles = {}, {}, set(), [], []

    def visit(start):  # Tarjan's algorithm, iterative (no recursion limit on a deep chain of imports)
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, targets = work[-1]
            for target in targets:
                if target not in index:
                    index[target] = low[target] = len(index)
                    stack.append(target)
                    on_stack.add(target)
                    work.append((target, iter(sorted(graph[target]))))
                    break
                if target in on_stack:
                    low[node] = min(low[node], index[target])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    component = []
                    while True:
                        member = stack.pop()
                        on_stack.discard(member)
                        component.append(member)
                        if member == node:
                            break
                    if len(component) > 1:
                        cycles.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return sorted(cycles)


def shortest_loop(graph: dict, component: list) -> list:
    """One shortest loop of imports inside `component` (a cycle), as [a, b, ..., a]: where to cut it."""
    members, best = set(component), None
    for start in component:
        paths, frontier = {start: [start]}, [start]
        while frontier and best is None or (frontier and len(paths[frontier[0]]) < len(best) - 1):
            following = []
            for node in frontier:
                for target in sorted(graph[node] & members):
                    if target == start and (best is None or len(paths[node]) + 1 < len(best)):
                        best = paths[node] + [start]
                    elif target not in paths:
                        paths[target] = paths[node] + [target]
                        following.append(target)
            frontier = following
    return best


def _private_imports(package: str, modules: dict, module: str, path: Path) -> list:
    """`from x import _name` in `module`, where x is another module of the package `package` (its `modules`)."""
    is_package = path.name == "__init__.py"
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            source = _resolve_relative(module, is_package, node.level, node.module) if node.level else node.module
            if source and (source == package or source.startswith(package + ".")) and source != module:
                found += [f"{source}.{alias.name}" for alias in node.names
                          if alias.name.startswith("_") and not alias.name.startswith("__")
                          and f"{source}.{alias.name}" not in modules]
    return found


# ---------------------------------------------------------------------------------------------- the rules


def layering_problems(package_dir: Path, rules=("cycles", "rungs", "users", "floor", "private")) -> list:
    """Every breach of the one-way order in the package at `package_dir`, one line each (empty: none)."""
    package = package_dir.name
    graph = import_graph(package_dir.resolve())
    stages, users = f"{package}.stages", tuple(f"{package}.{name}" for name in USERS)
    floor = tuple(f"{package}.{name}" for name in FLOOR)

    def under(name: str, prefixes) -> bool:
        return any(name == prefix or name.startswith(prefix + ".") for prefix in prefixes)

    problems = []
    if "cycles" in rules:
        problems += ["import cycle: " + " <-> ".join(cycle) + "\n  for one: " + " -> ".join(shortest_loop(graph, cycle))
                     for cycle in import_cycles(graph)]
    for module, targets in sorted(graph.items()):
        for target in sorted(targets):
            if "rungs" in rules and under(module, (stages,)) and under(target, users):
                problems.append(f"a rung imports what uses it: {module} -> {target}")
            if "users" in rules and under(module, users) and under(target, (stages,)) \
                    and target.count(".") > stages.count(".") + 1:
                problems.append(f"reaches into a rung's module (use the registry, the rung's exports or the public "
                                f"API): {module} -> {target}")
            if "floor" in rules and under(module, floor) and under(target, (stages,) + users):
                problems.append(f"the floor imports what stands on it: {module} -> {target}")
    if "private" in rules:
        modules = package_modules(package_dir)
        for module, path in sorted(modules.items()):
            if under(module, users + floor):
                problems += [f"imports another module's private name: {module} <- {name}"
                             for name in _private_imports(package, modules, module, path)]
    return problems


RULES = {
    "cycles": "no import cycle anywhere in the package",
    "rungs": "no rung imports the benchmark or the models",
    "users": "the benchmark and the models reach rungs only through the registry, a rung's exports or the public API",
    "floor": "the floor imports neither the rungs nor their users",
    "private": "the benchmark, the models and the floor share only public names",
}


@pytest.mark.parametrize("rule", RULES, ids=list(RULES))
def test_the_package_runs_one_way(rule):
    problems = layering_problems(PACKAGE, rules=(rule,))
    assert not problems, RULES[rule] + ":\n" + "\n".join(problems)


# ---------------------------------------------------------------------------------------------- the checker checked


def _plant(root: Path, files: dict) -> Path:
    """A package ``pkg`` under `root` with `files` ({relative path: source}), every folder a package."""
    package = root / "pkg"
    for relative, source in {"__init__.py": "", "stages/__init__.py": "", "bench/__init__.py": "",
                             "stages/toy/__init__.py": "from .kernel import forward\n", **files}.items():
        path = package / relative
        path.parent.mkdir(parents=True, exist_ok=True)
        for folder in path.relative_to(package).parents:
            (package / folder / "__init__.py").touch()
        path.write_text(source)
    return package


CLEAN = {
    "results_files.py": "import json\n\ndef load(path):\n    return json.loads(open(path).read())\n",
    "stages/toy/kernel.py": "from ...results_files import load\n\ndef forward(x):\n    return x\n",
    "bench/measure.py": "from ..stages import toy\nfrom ..results_files import load\n\n"
                        "def run():\n    from ..stages.toy import forward\n    return forward(1)\n",
}


def test_the_checker_passes_a_package_that_runs_one_way(tmp_path):
    assert layering_problems(_plant(tmp_path, CLEAN), rules=("cycles", "rungs", "users", "floor")) == []


@pytest.mark.parametrize("how", ["top", "function", "import_module", "f-string", "sys.modules", "sys.modules.get"])
def test_the_checker_fails_on_a_planted_cycle(tmp_path, how):
    back = {"top": "from . import measure\n",
            "function": "def f():\n    from .measure import run\n    return run\n",
            "import_module": "import importlib\n\ndef f():\n    return importlib.import_module('pkg.bench.measure')\n",
            "f-string": "import importlib\n\ndef f(name='measure'):\n"
                        "    return importlib.import_module(f'{__package__}.{name}')\n",
            "sys.modules": "import sys\n\ndef f():\n    return sys.modules['pkg.bench.measure']\n",
            "sys.modules.get": "import sys\n\ndef f():\n    return sys.modules.get(f'pkg.bench.{\"measure\"}')\n"}[how]
    package = _plant(tmp_path, {**CLEAN, "bench/helpers.py": back,
                                "bench/measure.py": CLEAN["bench/measure.py"] + "from .helpers import f\n"})
    problems = layering_problems(package, rules=("cycles",))
    assert problems == ["import cycle: pkg.bench.helpers <-> pkg.bench.measure\n  for one: "
                        "pkg.bench.helpers -> pkg.bench.measure -> pkg.bench.helpers"], problems


def test_the_checker_fails_on_a_planted_rung_to_bench_import(tmp_path):
    slider = "def figure():\n    from ...bench.measure import run\n    return run()\n"  # lazy: still an arrow
    package = _plant(tmp_path, {**CLEAN, "stages/toy/slider.py": slider})
    problems = layering_problems(package, rules=("rungs",))
    assert problems == ["a rung imports what uses it: pkg.stages.toy.slider -> pkg.bench.measure"], problems
    assert "import cycle" not in " ".join(layering_problems(package, rules=("cycles",)))  # caught without a cycle


def test_the_checker_fails_when_the_benchmark_reaches_into_a_rungs_module(tmp_path):
    package = _plant(tmp_path, {**CLEAN, "stages/toy/slider.py": "X = 1\n",
                                "bench/figures.py": "from ..stages.toy.slider import X\n"})
    assert layering_problems(package, rules=("users",)) == [
        "reaches into a rung's module (use the registry, the rung's exports or the public API): "
        "pkg.bench.figures -> pkg.stages.toy.slider"]


def test_the_checker_fails_on_a_floor_that_imports_the_benchmark_or_a_private_name(tmp_path):
    package = _plant(tmp_path, {**CLEAN, "timing.py": "def t():\n    from . import bench\n",
                                "bench/figures.py": "from .measure import _helper\n"})
    assert layering_problems(package, rules=("floor", "private")) == [
        "the floor imports what stands on it: pkg.timing -> pkg.bench",
        "imports another module's private name: pkg.bench.figures <- pkg.bench.measure._helper"]


# ---------------------------------------------------------------------------------------------- where things live


def test_the_decoder_lives_beside_the_models_and_its_benchmark_in_bench():
    decode = PACKAGE / "stages" / "decode"
    assert not (decode / "decoder.py").exists() and not (decode / "tokens.py").exists()
    assert (PACKAGE / "models" / "llama_decoder.py").exists()
    assert (PACKAGE / "bench" / "decoder_tokens.py").exists() and not (PACKAGE / "models" / "decoder_tokens.py").exists()


def test_the_decoder_modules_import_and_the_old_paths_are_gone():
    import importlib

    from wb_kernels.bench import decoder_tokens
    from wb_kernels.models import llama_decoder

    assert decoder_tokens.dec is llama_decoder
    for old in ("wb_kernels.stages.decode.decoder", "wb_kernels.stages.decode.tokens", "wb_kernels.models.decoder_tokens"):
        with pytest.raises(ModuleNotFoundError):
            importlib.import_module(old)


# Rung modules that still import the package root (`import wb_kernels`), which re-exports the public API above the
# rungs: users of wb.attention that live in rung folders. The distributed runner runs other stages on each rank (a
# user of the API, like the models); the sliders and tuning scripts time their rung as a user calls it. Each is a
# loop rung -> wb_kernels -> api -> stages -> rung that the cycle rule above does not see (a module's import of a
# package it lives in is not counted); moving them beside the models (or through the registry) is open work. The list
# may shrink, never grow: a grader or helper imports what it needs from the floor (check, inputs, reference, ...).
ROOT_IMPORTERS = {
    "stages/decode/tune.py", "stages/flash/tune.py", "stages/mma/tune.py", "stages/tiled/tune.py",
    "stages/wmma/tune.py", "stages/flash/rounding_emulation.py", "stages/naive/slider.py", "stages/tiled/slider.py",
    "stages/distributed/ring.py", "stages/distributed/run.py", "stages/distributed/scaling.py",
    "stages/distributed/slider.py", "stages/distributed/ulysses.py",
}


def _imports_the_package_root(path: Path) -> bool:
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import) and any(alias.name == PACKAGE.name for alias in node.names):
            return True
    return False


def test_no_new_rung_module_imports_the_package_root():
    found = {str(path.relative_to(PACKAGE)) for path in sorted((PACKAGE / "stages").rglob("*.py"))
             if _imports_the_package_root(path)}
    assert found <= ROOT_IMPORTERS, (f"{sorted(found - ROOT_IMPORTERS)} import the package root, which re-exports the "
                                     "API above the rungs: import from the floor (check, inputs, reference, timing, ...)")
    assert not ROOT_IMPORTERS - found, f"no longer importing the root (take them off the list): {ROOT_IMPORTERS - found}"


# One file, one thing: a file of the package past this many lines says why in its first lines ("long because ...").
LONG_FILE_LINES = 900
LONG_FILE_SUFFIXES = (".py", ".cu", ".cuh")


def _long_files_without_a_reason(package: Path) -> list:
    found = []
    for path in sorted(package.rglob("*")):
        if path.suffix not in LONG_FILE_SUFFIXES or "__pycache__" in path.parts:
            continue
        lines = path.read_text(encoding="utf-8").splitlines()
        if len(lines) > LONG_FILE_LINES and "long because" not in "\n".join(lines[:40]).lower():
            found.append(f"{path.relative_to(package.parent).as_posix()} ({len(lines)} lines)")
    return found


def test_no_file_is_long_without_saying_why():
    assert _long_files_without_a_reason(PACKAGE) == []


def test_the_length_check_fails_on_a_planted_long_file(tmp_path):
    package = tmp_path / "wb_kernels"
    package.mkdir()
    (package / "short.py").write_text("x = 1\n")
    (package / "long.py").write_text("x = 1\n" * (LONG_FILE_LINES + 1))
    (package / "explained.py").write_text('"""Long because it is one table."""\n' + "x = 1\n" * LONG_FILE_LINES)
    assert _long_files_without_a_reason(package) == [f"wb_kernels/long.py ({LONG_FILE_LINES + 1} lines)"]
