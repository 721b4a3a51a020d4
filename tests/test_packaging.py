"""pyproject.toml and environment.yml name the same dependencies; the README's commands exist."""

import re
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _name(requirement: str) -> str:
    return re.split(r"[\s\[<>=!~;]", requirement.strip(), maxsplit=1)[0].lower().replace("_", "-")


def _spec(requirement: str) -> str:
    """The version constraint without spaces or extras, e.g. '>=1.24,<2.5'."""
    req = re.sub(r"\[.*?\]", "", requirement.split(";")[0]).replace(" ", "")
    return req[len(_name(req)):]


def pyproject_requirements() -> dict:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    reqs = list(project["dependencies"])
    for extra in ("lab", "test"):
        reqs += project["optional-dependencies"][extra]
    return {_name(r): _spec(r) for r in reqs}


def environment_requirements() -> dict:
    reqs = {}
    for line in (ROOT / "environment.yml").read_text().splitlines():
        match = re.match(r"^\s*-\s+([A-Za-z0-9_.\-\[\]]+[^#]*?)\s*(#.*)?$", line)
        if not match or match.group(1).rstrip(":") in ("pip", "conda-forge"):
            continue
        req = match.group(1)
        if _name(req) in ("python",):
            continue
        reqs[_name(req)] = _spec(req)
    return reqs


def test_environment_yml_matches_pyproject():
    assert environment_requirements() == pyproject_requirements()


def test_numpy_is_pinned_below_2_5():
    assert "<2.5" in pyproject_requirements()["numpy"]


def test_torch_requirement_admits_the_cpu_build():
    # a requirement that torch 2.13.0 satisfies keeps `make test` from pulling the CUDA build
    spec = pyproject_requirements()["torch"]
    assert spec.startswith(">=") and "<" not in spec
    assert "TORCH_SPEC ?= torch==2.13.0" in (ROOT / "Makefile").read_text()


def test_readme_names_the_two_commands_and_ci_runs_the_test_one():
    readme = (ROOT / "README.md").read_text()
    assert "make lab" in readme and "make test" in readme
    ci = (ROOT / ".ci" / "run").read_text()
    assert re.search(r"^make test$", ci, re.M)


def test_lab_binds_loopback_with_a_token():
    makefile = (ROOT / "Makefile").read_text()
    lab = makefile.split("\nlab:")[1].split("\n\n")[0]
    assert "--ServerApp.ip=127.0.0.1" in lab
    assert "token=''" not in lab and 'token=""' not in lab and "disable_check_xsrf" not in lab


# A document cited by name: a path ending in .md inside code, prose or a lesson (not part of a URL).
_CITED_MD = re.compile(r"(?<![\w/.:-])((?:\.\.?/)?[\w.-]+(?:/[\w.-]+)*\.md)\b")


def _tracked(*patterns) -> list:
    import subprocess

    try:
        listed = subprocess.run(["git", "ls-files", *patterns], cwd=ROOT, capture_output=True, text=True, check=True)
    except (OSError, subprocess.CalledProcessError):
        return []
    return [ROOT / name for name in listed.stdout.split()]


def test_every_cited_document_exists():
    """A .md file that code, a NOTES file or a lesson names is in the repository: beside the file that names it, at
    the root, or (a bare file name such as NOTES.md) somewhere in the tree."""
    files = _tracked("*.py", "*.md", "*.ipynb", "*.sh", "Makefile")
    if not files:
        import pytest

        pytest.skip("no git checkout here: the tracked files cannot be listed")
    names = {path.name for path in files if path.suffix == ".md"}
    missing = []
    for path in files:
        if not path.exists():  # deleted in the working tree, not yet committed
            continue
        text = path.read_text(errors="replace")
        for match in _CITED_MD.finditer(text):
            cited = match.group(1)
            if re.search(r"https?://\S*$", text[max(0, match.start() - 200):match.start()]):
                continue  # a page of another project
            if (path.parent / cited).exists() or (ROOT / cited).exists() or ("/" not in cited and cited in names):
                continue
            missing.append(f"{path.relative_to(ROOT)} cites {cited}")
    assert not missing, "cited documents that are not in the repository:\n" + "\n".join(sorted(set(missing)))


def test_no_stray_files_at_the_root():
    """The root holds the project's own files; a compiler's output left there (an empty v5.sass once) is a stray."""
    strays = [path.name for path in _tracked() if path.parent == ROOT and path.suffix in (".sass", ".ptx", ".cubin", ".o")]
    assert not strays, f"compiler output at the repository's root: {strays}"
