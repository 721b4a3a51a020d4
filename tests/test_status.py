"""The README's status section is generated from the recorded runs (scripts/status.py), never typed; the release
(scripts/gpu_check.sh release K/N) names one commit, and after it only outputs and status files change."""

from __future__ import annotations

import importlib.util
import json
import re
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
_spec = importlib.util.spec_from_file_location("status", ROOT / "scripts" / "status.py")
status = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(status)

JUNIT = """<?xml version="1.0" encoding="utf-8"?><testsuites><testsuite name="pytest" errors="1" failures="2"
skipped="3" tests="20" time="1.0"></testsuite></testsuites>"""


def _junit(passed=3, failed=0, file="tests.test_status", seconds=1.5):
    cases = "".join(f'<testcase classname="{file}" name="t{i}" time="{seconds}"/>' for i in range(passed + failed))
    return (f'<?xml version="1.0" encoding="utf-8"?><testsuites><testsuite name="pytest" errors="0" '
            f'failures="{failed}" skipped="0" tests="{passed + failed}" time="1.0">{cases}</testsuite></testsuites>')


def test_readme_status_is_what_the_recorded_runs_render():
    text = (ROOT / "README.md").read_text()
    block = text[text.index(status.README_START):text.index(status.README_END) + len(status.README_END)]
    assert block == status.render(), "README's status is stale: python scripts/status.py --update-readme"


def test_every_recorded_run_names_its_machine_date_and_commit():
    runs = list(status.STATUS_DIR.glob("*.json"))
    assert runs, "no run recorded in results/status/: the README's status would be empty"
    for path in runs:
        data = json.loads(path.read_text())
        if "release" in data or "history" in data:
            release = data.get("release")
            if release:
                assert release["commit"] and release["date"] and release["parts"], path.name
                assert release["passed"] == all(
                    release["parts"].get(f"{k}/{release['parts_total']}", {}).get("status") == "passed"
                    for k in range(1, release["parts_total"] + 1)), path.name
            runs_kept = data.get("history", [])
        else:
            runs_kept = [data]
        for run in runs_kept:
            assert run["date"] and run["machine"]["git_commit"] and run["suites"], path.name


def test_junit_counts_and_render_from_a_fabricated_run(tmp_path):
    (tmp_path / "tests.xml").write_text(JUNIT)
    assert status.junit_counts(tmp_path / "tests.xml") == {"passed": 14, "failed": 2, "errors": 1, "skipped": 3}
    run = {"name": "h100", "date": "2026-11-25", "seconds": 600,
           "machine": {"gpu": "NVIDIA H100 80GB HBM3", "git_commit": "abc1234", "torch": "2.11.0"},
           "suites": {"tests": status.junit_counts(tmp_path / "tests.xml")}}
    (tmp_path / "runs").mkdir()
    (tmp_path / "runs" / "h100.json").write_text(json.dumps(run))
    block = status.render(tmp_path / "runs")
    assert "**NVIDIA H100 80GB HBM3**, 2026-11-25, commit `abc1234`" in block
    assert "tests: 14 passed, 2 failed, 1 errors, 3 skipped" in block and "10 min in all" in block


# ------------------------------------------------------------------------------------------------- the release
@pytest.mark.parametrize("parts", [1, 2, 3, 4])
def test_release_plan_runs_every_test_file_and_lesson_once(parts):
    plan = status.release_plan(parts, {"tests/test_status.py": 500.0})
    assert sorted(plan) == sorted(f"{k}/{parts}" for k in range(1, parts + 1))
    tests = [t for part in plan.values() for t in part["tests"]]
    lessons = [nb for part in plan.values() for nb in part["lessons"]]
    assert sorted(tests) == sorted(status._test_files() + ["properties"])
    assert sorted(lessons) == sorted(status._lessons()) and lessons
    if parts > 1:  # a file that took long last time has a part to itself, or nearly
        heavy = next(p for p in plan.values() if "tests/test_status.py" in p["tests"])
        assert heavy["estimate_s"]["tests"] <= 500.0 + max(p["estimate_s"]["tests"] for p in plan.values()
                                                           if p is not heavy)


@pytest.fixture
def status_dir(tmp_path, monkeypatch):
    monkeypatch.setattr(status, "STATUS_DIR", tmp_path / "status")
    monkeypatch.setattr(status, "RELEASE_COPY", tmp_path / "warm_copy")
    monkeypatch.setattr(status, "_machine", lambda: {"gpu": "NVIDIA H100 80GB HBM3", "torch": "2.11.0",
                                                     "git_commit": "ignored"})
    return tmp_path


def _part_logs(where: Path, *, failed=0) -> Path:
    where.mkdir(parents=True)
    (where / "tests.xml").write_text(_junit(passed=4, failed=failed))
    (where / "properties.xml").write_text(_junit(passed=2, file="tests.test_status"))
    for lesson in status._lessons():
        (where / f"nbval_{Path(lesson).stem}.xml").write_text(_junit(passed=2, file="notebooks.x"))
    return where


def _rcs(plan: dict, *, tests=0, lessons=0, seconds=20.0) -> dict:
    """Exit statuses of every unit of a part's plan, as gpu_check.sh passes them."""
    rcs = {"build_mma": 0}
    if any(t != "properties" for t in plan["tests"]):
        rcs["tests"] = tests
    if "properties" in plan["tests"]:
        rcs["properties"] = tests
    for lesson in plan["lessons"]:
        rcs.update({f"execute:{lesson}": lessons, f"nbval:{lesson}": 0, f"seconds:{lesson}": seconds})
    return rcs


def _release(status_dir) -> dict:
    return json.loads((status_dir / "status" / "h100.json").read_text())["release"]


def test_release_parts_are_recorded_resumed_and_rendered(status_dir):
    gpu, commit = "h100", "abc1234"
    assert not status.release_done(gpu, "1/2", commit)
    plans = {part: status.plan_for(gpu, part, commit) for part in ("1/2", "2/2")}
    status.release_record(gpu, "1/2", commit, logs=_part_logs(status_dir / "p1"),
                          step_rcs=_rcs(plans["1/2"], seconds=12.5), seconds=400)
    release = _release(status_dir)
    assert release["commit"] == commit and release["parts"]["1/2"]["status"] == "passed" and not release["passed"]
    lesson = plans["1/2"]["lessons"][0]
    assert release["timings"][lesson] == 12.5 and release["timings"]["tests/test_status.py"] == 6.0
    assert status.release_done(gpu, "1/2", commit) and not status.release_done(gpu, "1/2", "fff0000")
    # the second part splits as the first part's plan said, although the first part's timings are known now
    assert status.plan_for(gpu, "2/2", commit) == plans["2/2"]
    assert "release at commit `abc1234`: not yet passed: part 2/2 has not passed" in status.render(status_dir / "status")

    # a part stopped by its time limit is not passed; run again, it does only what has not passed
    rcs = _rcs(plans["2/2"])
    first, *others = plans["2/2"]["lessons"]
    rcs[f"execute:{first}"] = 124
    status.release_record(gpu, "2/2", commit, logs=_part_logs(status_dir / "p2"), step_rcs=rcs, seconds=540)
    part = _release(status_dir)["parts"]["2/2"]
    assert part["status"] == "stopped" and part["not_yet_passed"] == [first]
    assert status.units_left(gpu, "2/2", commit) == {"tests": [], "properties": False, "lessons": [first]}
    status.release_record(gpu, "2/2", commit, logs=_part_logs(status_dir / "p2b"),
                          step_rcs={f"execute:{first}": 0, f"nbval:{first}": 0}, seconds=100)
    release = _release(status_dir)
    assert release["passed"] and release["machine"]["git_commit"] == commit
    assert release["parts"]["2/2"]["seconds"] == 640 and release["parts"]["2/2"]["calls"] == 2
    block = status.render(status_dir / "status")
    assert "release at commit `abc1234`: every GPU test, property test and lesson passed (2 parts)" in block
    assert f"tests: 8 passed; properties: 2 passed; nbval: {2 * len(status._lessons())} passed" in block

    # a failing test fails the part; a release at a new commit starts afresh and keeps the last one in history
    status.release_record(gpu, "1/2", "def5678", logs=_part_logs(status_dir / "p3", failed=1),
                          step_rcs={"tests": 1}, seconds=100)
    data = json.loads((status_dir / "status" / "h100.json").read_text())
    assert data["release"]["commit"] == "def5678" and data["release"]["parts"]["1/2"]["status"] == "failed"
    assert any("release_at_abc1234" in suite for run in data["history"] for suite in run["suites"])
    assert data["release"]["base_timings"][lesson] == 12.5


def test_a_suite_stopped_before_its_junit_file_is_stopped_and_one_that_wrote_none_failed(status_dir):
    plan = status.plan_for("h100", "1/1", "abc1234")
    (status_dir / "empty").mkdir()
    status.release_record("h100", "1/1", "abc1234", logs=status_dir / "empty", step_rcs={"tests": 124}, seconds=540)
    assert _release(status_dir)["parts"]["1/1"]["units"]["tests"]["status"] == "stopped"
    status.release_record("h100", "1/1", "abc1234", logs=status_dir / "empty", step_rcs={"tests": 0}, seconds=5)
    assert _release(status_dir)["parts"]["1/1"]["units"]["tests"]["status"] == "failed"
    assert status.units_left("h100", "1/1", "abc1234")["lessons"] == plan["lessons"]


def test_a_warm_machines_copy_resumes_a_release_the_sent_tree_lacks(status_dir):
    plan = status.plan_for("h100", "1/3", "abc1234")
    status.release_record("h100", "1/3", "abc1234", logs=_part_logs(status_dir / "p1"), step_rcs=_rcs(plan),
                          seconds=10)
    (status_dir / "status" / "h100.json").unlink()  # the tree sent with the next call has no record of part 1
    assert status.release_done("h100", "1/3", "abc1234")


def test_gpu_check_release_needs_a_part(tmp_path):
    script = ROOT / "scripts" / "gpu_check.sh"
    assert subprocess.run(["bash", "-n", str(script)]).returncode == 0
    run = subprocess.run(["bash", str(script), "release"], capture_output=True, text=True,
                         env={"OUT": str(tmp_path), "PATH": "/usr/bin:/bin"})
    assert run.returncode == 2 and "release K/N" in run.stdout
    assert not any(tmp_path.iterdir()), "the usage error wrote into $OUT"


# A status file's release names the commit every GPU test and lesson passed at. After it, only what that run and
# later measurements produce may change: lesson outputs (not a cell's source), results/, figures/, the README's
# status block.
OUTPUT_PREFIXES = ("results/", "figures/")


def _git(*args, cwd=ROOT):
    return subprocess.run(["git", *args], cwd=cwd, capture_output=True, text=True)


def _cells(text: str) -> list:
    return [(c.get("cell_type"), "".join(c.get("source", ""))) for c in json.loads(text).get("cells", [])]


def _without_status_block(text: str) -> str:
    start, end = text.find(status.README_START), text.find(status.README_END)
    return text if start < 0 or end < 0 else text[:start] + text[end:]


def changes_beyond_outputs(commit: str, repo: Path = ROOT, head: str = "HEAD") -> list:
    """Paths changed between `commit` and `head` in ways a release's outputs do not explain."""
    changed = _git("diff", "--no-renames", "--name-status", commit, head, cwd=repo).stdout.splitlines()
    wrong = []
    for line in changed:
        kind, path = line.split("\t", 1)
        if path.startswith(OUTPUT_PREFIXES):
            continue
        if kind == "M" and (path == "README.md" or re.fullmatch(r"notebooks/[^/]+\.ipynb", path)):
            before = _git("show", f"{commit}:{path}", cwd=repo).stdout
            after = _git("show", f"{head}:{path}", cwd=repo).stdout
            if path == "README.md" and _without_status_block(before) == _without_status_block(after):
                continue
            if path.endswith(".ipynb") and _cells(before) == _cells(after):
                continue
            wrong.append(f"{path} ({'a cell source' if path.endswith('.ipynb') else 'outside the status block'})")
            continue
        wrong.append(f"{path} ({kind})")
    return wrong


def _release_commits() -> list:
    found = []
    for path in sorted(status.STATUS_DIR.glob("*.json")):
        release = json.loads(path.read_text()).get("release")
        if release:
            found.append((path.name, release["commit"]))
    return found


def test_after_the_release_commit_only_outputs_results_and_status_changed():
    releases = _release_commits()
    if not releases:
        pytest.skip("no release recorded in results/status/ yet (scripts/gpu_check.sh release K/N)")
    if _git("rev-parse", "--is-inside-work-tree").returncode != 0:
        pytest.skip("no git history here (an exported tree): the release commit cannot be compared with HEAD")
    for name, commit in releases:
        if _git("cat-file", "-e", f"{commit}^{{commit}}").returncode != 0:
            pytest.skip(f"{name}'s release commit {commit} is not in this clone's history (a shallow clone?)")
        if _git("merge-base", "--is-ancestor", commit, "HEAD").returncode != 0:
            pytest.skip(f"{name}'s release commit {commit} is not an ancestor of HEAD (another branch's release)")
        wrong = changes_beyond_outputs(commit)
        assert not wrong, (f"changed after the release commit {commit} ({name}), beyond lesson outputs, results/, "
                           f"figures/ and the status: {wrong}; run the release again at the new commit")


def test_the_diff_check_tells_outputs_from_sources(tmp_path):
    repo = tmp_path / "repo"
    (repo / "notebooks").mkdir(parents=True)
    (repo / "wb_kernels").mkdir()
    cell = {"cell_type": "code", "source": "print(1)", "outputs": [], "metadata": {}, "execution_count": None}
    nb = {"cells": [cell], "metadata": {}, "nbformat": 4, "nbformat_minor": 5}
    (repo / "notebooks" / "01_x.ipynb").write_text(json.dumps(nb))
    (repo / "README.md").write_text(f"intro\n{status.README_START}\nold\n{status.README_END}\n")
    (repo / "wb_kernels" / "api.py").write_text("x = 1\n")
    for args in (["init", "-q"], ["add", "-A"], ["-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", "r"]):
        assert _git(*args, cwd=repo).returncode == 0
    release = _git("rev-parse", "HEAD", cwd=repo).stdout.strip()

    def commit(message):
        _git("add", "-A", cwd=repo)
        _git("-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", message, cwd=repo)

    cell["outputs"] = [{"output_type": "stream", "name": "stdout", "text": "1\n"}]
    (repo / "notebooks" / "01_x.ipynb").write_text(json.dumps(nb))
    (repo / "README.md").write_text(f"intro\n{status.README_START}\nnew\n{status.README_END}\n")
    (repo / "results").mkdir()
    (repo / "results" / "run.json").write_text("{}")
    commit("outputs")
    assert changes_beyond_outputs(release, repo) == []

    cell["source"] = "print(2)"
    (repo / "notebooks" / "01_x.ipynb").write_text(json.dumps(nb))
    (repo / "wb_kernels" / "api.py").write_text("x = 2\n")
    (repo / "README.md").write_text(f"intro, changed\n{status.README_START}\nnew\n{status.README_END}\n")
    commit("sources")
    assert sorted(changes_beyond_outputs(release, repo)) == [
        "README.md (outside the status block)", "notebooks/01_x.ipynb (a cell source)", "wb_kernels/api.py (M)"]


def test_every_module_gpu_check_runs_exists():
    """gpu_check.sh names the modules its steps run (``python -m``) in *_MODULE variables: each is a file of the
    package, so a module that moved without the script fails here and not on the GPU machine."""
    script = (ROOT / "scripts" / "gpu_check.sh").read_text()
    found = re.findall(r"^(\w+_MODULE)=([\w.]+)$", script, re.M)
    assert len(found) >= 5, "gpu_check.sh: the *_MODULE variables were not found"
    missing = [(name, module) for name, module in found if not (ROOT / (module.replace(".", "/") + ".py")).exists()]
    assert not missing, f"gpu_check.sh runs modules that exist nowhere: {missing}"
