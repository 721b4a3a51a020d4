"""The package's arrows run one way (STYLE.md, "Code that uses the kernels"): lessons -> models -> api -> stages ->
shared machinery. A rung does not import the code that uses it, and the benchmark does not reach into a rung's
internal modules: it goes through ``wb.decode``/``wb.attention``, the stage registry or a rung's ``__init__`` exports.

Read from the source (``ast``), so a lazy import inside a function counts as much as one at the top of a file.
"""

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "wb_kernels"


def _imported_modules(path: Path) -> list:
    """Every module `path` imports, as an absolute dotted name (relative imports resolved against its package)."""
    package = path.relative_to(PACKAGE.parent).with_suffix("").parts[:-1]
    names = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = list(package[:len(package) - node.level + 1]) if node.level else []
            module = ".".join(base + ([node.module] if node.module else []))
            names.append(module)
            # `from . import llama_decoder` imports a submodule: count it too
            names += [f"{module}.{alias.name}" for alias in node.names]
    return names


def _files(folder: str) -> list:
    return sorted((PACKAGE / folder).rglob("*.py"))


def test_the_decoder_lives_beside_the_models_not_in_the_rung():
    decode = PACKAGE / "stages" / "decode"
    assert not (decode / "decoder.py").exists() and not (decode / "tokens.py").exists()
    assert (PACKAGE / "models" / "llama_decoder.py").exists() and (PACKAGE / "models" / "decoder_tokens.py").exists()


@pytest.mark.parametrize("path", _files("stages"), ids=lambda p: str(p.relative_to(PACKAGE)))
def test_no_rung_imports_the_models(path):
    offending = [name for name in _imported_modules(path) if name.startswith("wb_kernels.models")]
    assert not offending, f"{path.relative_to(PACKAGE)} imports {offending}: a rung does not know its users"


@pytest.mark.parametrize("path", _files("bench"), ids=lambda p: str(p.relative_to(PACKAGE)))
def test_the_benchmark_does_not_reach_into_a_rungs_modules(path):
    """``wb_kernels.stages`` (the registry) and ``wb_kernels.stages.<rung>`` (its exports) are fine;
    ``wb_kernels.stages.<rung>.<module>`` is a rung's internals."""
    offending = [name for name in _imported_modules(path)
                 if name.startswith("wb_kernels.stages.") and name.count(".") >= 3
                 and not _is_export(name)]
    assert not offending, f"{path.relative_to(PACKAGE)} imports a rung's internals: {offending}"


def _is_export(name: str) -> bool:
    """`from ..stages.decode import decode_forward` yields "wb_kernels.stages.decode.decode_forward": an export of the
    rung's __init__, not a module, when no such file exists."""
    rung, _, leaf = name.rpartition(".")
    folder = PACKAGE.parent.joinpath(*rung.split("."))
    return rung.count(".") == 2 and not (folder / f"{leaf}.py").exists() and not (folder / leaf).is_dir()


def test_the_decoder_modules_import_and_the_old_paths_are_gone():
    import importlib

    from wb_kernels.models import decoder_tokens, llama_decoder

    assert decoder_tokens.dec is llama_decoder
    for old in ("wb_kernels.stages.decode.decoder", "wb_kernels.stages.decode.tokens"):
        with pytest.raises(ModuleNotFoundError):
            importlib.import_module(old)
