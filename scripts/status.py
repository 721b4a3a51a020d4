"""The README's "Status" section, generated from what was run instead of typed.

    python scripts/status.py record NAME JUNIT.xml ... [--seconds S] [--venv .venv]   -> results/status/NAME.json
    python scripts/status.py --update-readme                                          -> README.md's status block

``record`` reads the JUnit XML files pytest wrote (``--junitxml``; one file per suite: unit tests, the property
suite, the lessons under nbval, ``make test`` as a whole) and keeps, per suite, how many tests passed, failed,
errored and were skipped, with the machine (GPU name or "CPU, N cores"), versions, date and commit. Where
``--seconds`` is given it is the wall time of the whole run, and ``--venv`` the size of the environment it
installed: the README's quick start quotes both for ``make test`` on a CPU-only machine.

``scripts/gpu_check.sh`` records its steps into ``results/status/<gpu>.json``; ``make test``'s run on a CPU-only
machine is recorded as ``results/status/cpu.json`` (``make status-cpu``). ``tests/test_status.py`` fails when the
README's block differs from what the committed files render.

The release (``scripts/gpu_check.sh release K/N``): every GPU test, every property test and every lesson under nbval
at one named commit, in N parts of one command each. ``release-plan`` splits the test files and the lessons into
the N parts by the seconds each took in the last release (before any: a test file's lines, a lesson's stored cell
timings), and ``--shell`` prints what of one part has not passed yet; ``release-done`` says whether a part already
passed at the commit (the part is then skipped); ``release-record`` writes each unit's counts and verdict (the
part's test files, the property suite, each lesson) into the ``release`` entry of ``results/status/<gpu>.json``.
That entry names the commit and whether every part passed; runs recorded before the release path (partial suites
at many commits) are kept under ``history``, where ``record`` also puts a later run of some steps.
``tests/test_status.py`` checks that after the release commit only lesson outputs, ``results/``, ``figures/`` and the
status files changed.

    python scripts/status.py release-plan 3                    -> what each of the 3 parts runs, and its estimate
    python scripts/status.py gpu                               -> h100 (the GPU's short name)
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import os
import re
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
STATUS_DIR = ROOT / "results" / "status"
README_START = "<!-- status:start -->"
README_END = "<!-- status:end -->"


def junit_counts(path: Path) -> dict:
    """passed / failed / errors / skipped of one pytest JUnit XML file (every testsuite in it)."""
    root = ET.parse(path).getroot()
    suites = [root] if root.tag == "testsuite" else root.findall("testsuite")
    totals = {"tests": 0, "failures": 0, "errors": 0, "skipped": 0}
    for suite in suites:
        for key in totals:
            totals[key] += int(suite.get(key, 0))
    return {"passed": totals["tests"] - totals["failures"] - totals["errors"] - totals["skipped"],
            "failed": totals["failures"], "errors": totals["errors"], "skipped": totals["skipped"]}


def _machine() -> dict:
    sys.path.insert(0, str(ROOT))
    try:  # the record of GPU, versions and commit that every results file carries
        from wb_kernels.results_files import environment
    except ImportError:
        from wb_kernels.bench.results import environment

    env = environment()
    env["cpu_cores"] = os.cpu_count()
    return env


def _folder_mb(path: Path) -> int:
    out = subprocess.run(["du", "-sm", str(path)], capture_output=True, text=True, check=True).stdout
    return int(out.split()[0])


def record(name: str, junit_files, seconds=None, venv=None) -> Path:
    data = {"name": name, "date": _dt.date.today().isoformat(), "machine": _machine(),
            "suites": {Path(f).stem: junit_counts(Path(f)) for f in junit_files}}
    if seconds is not None:
        data["seconds"] = round(float(seconds))
    if venv is not None:
        data["venv_mb"] = _folder_mb(Path(venv))
    STATUS_DIR.mkdir(parents=True, exist_ok=True)
    path = STATUS_DIR / f"{name}.json"
    if path.exists() and "release" in json.loads(path.read_text()):
        # a machine with a release entry: a run of some steps goes into its history, the release stays as it is
        kept = json.loads(path.read_text())
        kept.setdefault("history", []).append(data)
        data = kept
    path.write_text(json.dumps(data, indent=1) + "\n")
    return path


def _counts(c: dict) -> str:
    text = f"{c['passed']} passed"
    for key in ("failed", "errors", "skipped"):
        if c[key]:
            text += f", {c[key]} {key}"
    return text


# Suites recorded by hand name the lessons they ran by number. A number means the lesson of that number at the
# run's commit; where the lessons were renumbered since, the README says what that lesson is called now, and the
# recorded file keeps the name it was written with. (The dashboard, 08_bench, became 09_bench when lesson
# 08_backward came in, and 99_bench when lesson 10_distributed came in.)
RENUMBERED_SUITES = {
    "nbval_05_06_07_08_at_2c4bac3": "nbval of lessons 05, 06, 07 and the dashboard (then 08_bench, now 99_bench) at 2c4bac3",
}


def _suite_label(name: str) -> str:
    return RENUMBERED_SUITES.get(name, name)


def _where(data: dict) -> str:
    m = data["machine"]
    return m.get("gpu") or f"a CPU-only machine ({m.get('cpu_cores')} cores)"


def _total(suites) -> dict:
    """The counts of several suites added up."""
    total = {"passed": 0, "failed": 0, "errors": 0, "skipped": 0}
    for counts in suites:
        for key in total:
            total[key] += counts.get(key, 0)
    return total


def release_summary(release: dict) -> str:
    """One sentence for a release entry: its commit, whether every part passed, the counts of each suite."""
    parts = release.get("parts", {})
    total = int(release["parts_total"])
    passed = sorted(name for name, part in parts.items() if part["status"] == "passed")
    by_suite: dict = {}
    for name in sorted(parts):
        for suite, counts in parts[name].get("suites", {}).items():
            if any(counts.values()):  # (a suite stopped before its JUnit file counts nothing)
                by_suite.setdefault(suite, []).append(counts)
    counts = "; ".join(f"{suite}: {_counts(_total(c))}" for suite, c in sorted(by_suite.items(), key=_suite_order))
    if release.get("passed"):
        verdict = f"every GPU test, property test and lesson passed ({total} parts)"
    else:
        missing = [f"{k}/{total}" for k in range(1, total + 1) if f"{k}/{total}" not in passed]
        verdict = f"not yet passed: part{'s' if len(missing) > 1 else ''} {', '.join(missing)} " \
                  f"{'have' if len(missing) > 1 else 'has'} not passed"
    return f"release at commit `{release['commit']}`: {verdict}" + (f"; {counts}" if counts else "")


def _suite_order(item):
    return {"tests": 0, "properties": 1, "nbval": 2}.get(item[0], 3), item[0]


def render(status_dir: Path = STATUS_DIR) -> str:
    """The README's status block: one bullet per machine, newest first; a machine with a release entry shows the
    release (its commit, its verdict) and says how many earlier partial runs its history keeps."""
    def newest(data):
        release = data.get("release") or {}
        return release.get("date") or data.get("date") or max((h["date"] for h in data.get("history", [])),
                                                              default="")

    runs = sorted((json.loads(p.read_text()) for p in sorted(status_dir.glob("*.json"))),
                  key=lambda d: (newest(d), d["name"]), reverse=True)
    lines = [README_START,
             "Generated by `python scripts/status.py --update-readme` from `results/status/` (what was run, where, "
             "at which commit):", ""]
    for data in runs:
        if "release" in data or "history" in data:
            lines.append(_render_release_file(data))
            continue
        m = data["machine"]
        suites = "; ".join(f"{_suite_label(suite)}: {_counts(c)}" for suite, c in data["suites"].items())
        head = f"- **{_where(data)}**, {data['date']}, commit `{m.get('git_commit')}` (torch {m.get('torch')})"
        extra = ""
        if "seconds" in data:
            extra += f", {data['seconds'] / 60:.0f} min in all"
        if "venv_mb" in data:
            extra += f", {data['venv_mb'] / 1024:.1f} GB installed into `.venv`"
        lines.append(f"{head}{extra}: {suites}.")
    lines.append(README_END)
    return "\n".join(lines)


def _render_release_file(data: dict) -> str:
    history = data.get("history", [])
    earlier = ""
    if history:
        # a suite recorded by hand names its commit ("..._at_92857a2"); the others ran at their record's commit
        commits = {(re.search(r"_at_([0-9a-f]{7,40})", suite) or [None, h["machine"].get("git_commit")])[1]
                   for h in history for suite in h["suites"]}
        suites = sum(len(h["suites"]) for h in history)
        earlier = (f" Before the release path: {suites} partial suites recorded at {len(commits)} commit"
                   f"{'s' if len(commits) > 1 else ''} (`results/status/{data['name']}.json`, \"history\").")
    release = data.get("release")
    if not release:
        where = history[-1]["machine"].get("gpu") if history else data["name"]
        return (f"- **{where}**: no release run recorded yet (`scripts/gpu_check.sh release 1/3`, then 2/3 "
                f"and 3/3).{earlier}")
    m = release["machine"]
    seconds = sum(part.get("seconds", 0) for part in release.get("parts", {}).values())
    calls = sum(part.get("calls", 1) for part in release.get("parts", {}).values())
    return (f"- **{m.get('gpu') or data['name']}**, {release['date']} (torch {m.get('torch')}, {seconds / 60:.0f} min "
            f"in {calls} run{'s' if calls != 1 else ''} of its parts), {release_summary(release)}.{earlier}")


def update_readme(readme: Path = ROOT / "README.md", status_dir: Path = STATUS_DIR) -> Path:
    text = readme.read_text()
    start, end = text.index(README_START), text.index(README_END) + len(README_END)
    readme.write_text(text[:start] + render(status_dir) + text[end:])
    return readme


# ---------------------------------------------------------------------------------------------------- the release
# A part is named "K/N" (part K of N). Its record lives in the release entry of results/status/<gpu>.json, and a copy
# in logs/release/<gpu>.json, which a GPU machine reused between parts still has when the tree sent to it lacks
# the record of the part before.
RELEASE_COPY = ROOT / "logs" / "release"
# Seconds a unit is assumed to take when no release has recorded it: a test file by its lines, a lesson by the cell
# timings of its last execution, the property suite as a share of all the test files. Only the balance between parts
# depends on them.
SECONDS_PER_TEST_LINE = 0.05
SECONDS_PER_CODE_CELL = 3.0  # a cell whose last execution stored no timing
LESSON_START_SECONDS = 10.0  # a kernel's start, twice, and pytest's
PROPERTIES_SHARE = 0.3


def gpu_short_name() -> str:
    """h100, h200, a100, b200 (or gpu): the GPU's name in the status file's name, as results files use it."""
    if os.environ.get("WB_GPU_NAME"):  # a dry run of the release's bookkeeping on a machine without a GPU
        return os.environ["WB_GPU_NAME"]
    import torch

    name = torch.cuda.get_device_name(0)
    return next((g for g in ("H100", "H200", "A100", "B200") if g in name), "gpu").lower()


def parse_part(part: str):
    """"2/3" -> (2, 3); a ValueError for anything else."""
    try:
        k, n = (int(x) for x in part.split("/"))
    except ValueError:
        raise ValueError(f"a release part is K/N (part K of N, e.g. 1/3), got {part!r}") from None
    if not 1 <= k <= n:
        raise ValueError(f"a release part is K/N with 1 <= K <= N, got {part!r}")
    return k, n


def load_status(gpu: str) -> dict:
    """The machine's status file merged with the reused machine's copy (the parts either of them recorded)."""
    path = STATUS_DIR / f"{gpu}.json"
    data = json.loads(path.read_text()) if path.exists() else {"name": gpu, "release": None, "history": []}
    if "release" not in data and "suites" in data:  # a file from before the release path: all of it is history
        data = {"name": gpu, "release": None, "history": [data]}
    copy = RELEASE_COPY / f"{gpu}.json"
    if copy.exists():
        kept = json.loads(copy.read_text()).get("release")
        release = data.get("release")
        if kept and release and kept["commit"] == release["commit"]:
            for name, part in kept.get("parts", {}).items():
                mine = release.setdefault("parts", {}).get(name)
                if mine is None or part["date"] > mine["date"]:
                    release["parts"][name] = part
            for n, plan in kept.get("plans", {}).items():
                release.setdefault("plans", {}).setdefault(n, plan)
        elif kept and (not release or (kept.get("date", "") > release.get("date", ""))):
            data["release"] = kept
    return data


def _test_files() -> list:
    return sorted(str(p.relative_to(ROOT)) for p in (ROOT / "tests").glob("test_*.py") if p.name != "test_properties.py")


def _lessons() -> list:
    return sorted(str(p.relative_to(ROOT)) for p in (ROOT / "notebooks").glob("*.ipynb"))


def _lesson_seconds(path: str) -> float:
    """A lesson's seconds under the release (executed, then again under nbval), guessed from the cell timings its
    last execution stored (nbclient's ``metadata.execution``), else from its number of code cells."""
    seconds, cells = 0.0, 0
    for cell in json.loads((ROOT / path).read_text()).get("cells", []):
        if cell.get("cell_type") != "code":
            continue
        cells += 1
        timing = cell.get("metadata", {}).get("execution", {})
        start, end = timing.get("iopub.execute_input"), timing.get("shell.execute_reply")
        if start and end:
            took = _dt.datetime.fromisoformat(end.replace("Z", "+00:00")) - \
                _dt.datetime.fromisoformat(start.replace("Z", "+00:00"))
            seconds += max(took.total_seconds(), 0.0)
        else:
            seconds += SECONDS_PER_CODE_CELL
    return 2 * seconds + LESSON_START_SECONDS if cells else 0.0


def _balanced(items: dict, parts: int) -> list:
    """Items {name: seconds} into `parts` lists of about equal seconds (the longest first into the lightest)."""
    bins = [[0.0, []] for _ in range(parts)]
    for name, seconds in sorted(items.items(), key=lambda item: (-item[1], item[0])):
        lightest = min(range(parts), key=lambda b: (bins[b][0], b))
        bins[lightest][0] += seconds
        bins[lightest][1].append(name)
    return [(round(total), sorted(names)) for total, names in bins]


def release_plan(parts: int, timings: dict | None = None) -> dict:
    """{"K/N": {"tests": [files; "properties" for the property suite], "lessons": [notebooks], "estimate_s": {...}}}.

    `timings`: seconds per test file, per lesson and for "properties" from an earlier release; units it lacks are
    estimated from their size. Tests and lessons run side by side in a part, so each is balanced on its own."""
    timings = timings or {}
    tests = {f: timings.get(f, SECONDS_PER_TEST_LINE * len((ROOT / f).read_text().splitlines())) for f in _test_files()}
    tests["properties"] = timings.get("properties", PROPERTIES_SHARE * sum(tests.values()))
    lessons = {nb: timings.get(nb, _lesson_seconds(nb)) for nb in _lessons()}
    plan = {}
    for k, ((t_s, t_names), (l_s, l_names)) in enumerate(zip(_balanced(tests, parts), _balanced(lessons, parts)), 1):
        plan[f"{k}/{parts}"] = {"tests": t_names, "lessons": l_names, "estimate_s": {"tests": t_s, "lessons": l_s}}
    return plan


def plan_for(gpu: str, part: str, commit: str) -> dict:
    """The plan of `part` at `commit`: the one recorded when the release at this commit began (so every part of it
    splits the same way), else a new one from the timings of the last release before it."""
    k, n = parse_part(part)
    release = load_status(gpu).get("release") or {}
    if release.get("commit") == commit:
        if str(n) in release.get("plans", {}):
            return release["plans"][str(n)][part]
        return release_plan(n, release.get("base_timings"))[part]
    return release_plan(n, release.get("timings"))[part]


def _units(plan: dict) -> list:
    """A part's units, each run, recorded and skipped on its own: its test files as one ("tests"), the property
    suite ("properties"), each lesson (its path)."""
    tests = [t for t in plan["tests"] if t != "properties"]
    return (["tests"] if tests else []) + (["properties"] if "properties" in plan["tests"] else []) + plan["lessons"]


def _part_record(gpu: str, part: str, commit: str) -> dict:
    release = load_status(gpu).get("release") or {}
    return release.get("parts", {}).get(part, {}) if release.get("commit") == commit else {}


def release_done(gpu: str, part: str, commit: str) -> bool:
    return _part_record(gpu, part, commit).get("status") == "passed"


def units_left(gpu: str, part: str, commit: str) -> dict:
    """The part's plan without the units that already passed at `commit` (a part stopped by its time limit, run
    again, goes on where it stopped)."""
    plan = plan_for(gpu, part, commit)
    passed = {u for u, r in _part_record(gpu, part, commit).get("units", {}).items() if r["status"] == "passed"}
    return {"tests": [t for t in plan["tests"] if t != "properties"] if "tests" not in passed else [],
            "properties": "properties" in plan["tests"] and "properties" not in passed,
            "lessons": [nb for nb in plan["lessons"] if nb not in passed]}


def _junit_file_seconds(path: Path) -> dict:
    """Seconds per test file (summed over its tests, whichever worker ran them) from a JUnit XML file."""
    seconds: dict = {}
    for case in ET.parse(path).getroot().iter("testcase"):
        module = case.get("classname", "").split(".")
        for i in range(len(module), 0, -1):
            key = "/".join(module[:i]) + ".py"
            if (ROOT / key).exists():
                seconds[key] = seconds.get(key, 0.0) + float(case.get("time", 0) or 0)
                break
    return seconds


def _verdict(rcs: list, suites: dict) -> str:
    if any(rc not in (0, 124, 137) for rc in rcs) or any(c["failed"] or c["errors"] for c in suites.values()):
        return "failed"
    return "stopped" if any(rc in (124, 137) for rc in rcs) else "passed"


def release_record(gpu: str, part: str, commit: str, *, logs: Path, step_rcs: dict, seconds: float) -> Path:
    """Write part `part`'s result into the release entry of results/status/<gpu>.json (and the reused machine's copy).

    `logs`: the part's folder (tests.xml, properties.xml, nbval_<lesson>.xml); `step_rcs`: each step's exit status
    (124 or 137: stopped by the part's time limit): ``tests``, ``properties``, ``execute:<lesson>``,
    ``nbval:<lesson>``, ``build_<rung>``, and ``seconds:<lesson>``. A unit (the test files, the property suite, a
    lesson) passed when its steps exited 0 and its suite counts no failure or error; the part passed when every unit
    of its plan has passed at the commit, in this call or an earlier one."""
    k, n = parse_part(part)
    data = load_status(gpu)
    release = data.get("release") or {}
    if release.get("commit") != commit:  # a new release: the last one's timings balance this one's parts
        kept = {f"release_at_{release['commit']}_{name.replace('/', 'of')}_{suite}": c
                for name, p in release.get("parts", {}).items() for suite, c in p.get("suites", {}).items()
                if any(c.values())} if release else {}
        if kept:  # the last release's counts, one suite per part, named by its commit
            data.setdefault("history", []).append({"date": release["date"], "machine": release["machine"],
                                                   "suites": kept})
        release = {"commit": commit, "parts_total": n, "passed": False, "base_timings": release.get("timings", {}),
                   "timings": dict(release.get("timings", {})), "plans": {}, "parts": {}}
    plan = release.setdefault("plans", {}).setdefault(str(n), release_plan(n, release.get("base_timings")))[part]
    timings = release.setdefault("timings", {})
    previous = release.setdefault("parts", {}).get(part, {})
    units = dict(previous.get("units", {}))
    now = _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")
    for suite in ("tests", "properties"):
        if suite in step_rcs:
            rc, junit = step_rcs[suite], logs / f"{suite}.xml"
            # pytest stopped at the limit writes no JUnit file: stopped, not failed; one that exited 0 without it failed
            counts = junit_counts(junit) if junit.exists() else {"passed": 0, "failed": 0, "errors": 0, "skipped": 0}
            units[suite] = {"status": _verdict([rc] + ([1] if rc == 0 and not junit.exists() else []),
                                               {suite: counts}), "date": now, "suites": {suite: counts}}
            if (logs / f"{suite}.xml").exists():
                file_seconds = _junit_file_seconds(logs / f"{suite}.xml")
                if suite == "tests":
                    timings.update({f: round(t, 1) for f, t in file_seconds.items()})
                else:
                    timings["properties"] = round(sum(file_seconds.values()), 1)
    for lesson in plan["lessons"]:
        rcs = [step_rcs[f"{step}:{lesson}"] for step in ("execute", "nbval") if f"{step}:{lesson}" in step_rcs]
        if not rcs:
            continue  # not run in this call (it passed before)
        junit = logs / f"nbval_{Path(lesson).stem}.xml"
        counts = junit_counts(junit) if junit.exists() else {"passed": 0, "failed": 0, "errors": 0, "skipped": 0}
        missing = [] if junit.exists() or any(rc != 0 for rc in rcs) else [1]  # nbval ran but wrote nothing
        units[lesson] = {"status": _verdict(rcs + missing, {"nbval": counts}), "date": now,
                         "suites": {"nbval": counts}}
        if f"seconds:{lesson}" in step_rcs:
            units[lesson]["seconds"] = step_rcs[f"seconds:{lesson}"]
            timings[lesson] = float(step_rcs[f"seconds:{lesson}"])
    wanted = _units(plan)
    statuses = [units.get(u, {}).get("status", "not run") for u in wanted]
    builds = {name: rc for name, rc in step_rcs.items() if name.startswith("build_")}
    status = ("passed" if all(s == "passed" for s in statuses) else
              "failed" if "failed" in statuses else "stopped")
    suites: dict = {}
    for unit in wanted:
        for suite, counts in units.get(unit, {}).get("suites", {}).items():
            suites[suite] = _total([suites.get(suite, {}), counts])
    record_ = {"status": status, "date": now, "seconds": round(seconds) + previous.get("seconds", 0),
               "calls": previous.get("calls", 0) + 1, "builds": builds, "suites": suites, "units": units}
    if status == "stopped":
        record_["not_yet_passed"] = [u for u, s in zip(wanted, statuses) if s != "passed"]
    release["parts"][part] = record_
    try:
        machine = _machine()
    except Exception as error:  # the part's verdict is recorded all the same, with what can be known
        machine = {"gpu": None, "cpu_cores": os.cpu_count(), "machine_error": f"{type(error).__name__}: {error}"}
    machine["git_commit"] = commit
    release.update(date=_dt.date.today().isoformat(), machine=machine, parts_total=n)
    release["passed"] = all(release["parts"].get(f"{i}/{n}", {}).get("status") == "passed" for i in range(1, n + 1))
    data["release"] = release
    data["name"] = gpu
    for key in ("date", "machine", "suites"):  # the pre-release layout's keys live under history now
        data.pop(key, None)
    text = json.dumps(data, indent=1) + "\n"
    STATUS_DIR.mkdir(parents=True, exist_ok=True)
    (STATUS_DIR / f"{gpu}.json").write_text(text)
    RELEASE_COPY.mkdir(parents=True, exist_ok=True)
    (RELEASE_COPY / f"{gpu}.json").write_text(text)
    return STATUS_DIR / f"{gpu}.json"


def _shell_words(words) -> str:
    import shlex

    return " ".join(shlex.quote(w) for w in words)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--update-readme", action="store_true", help="rewrite README.md's status block")
    sub = parser.add_subparsers(dest="command")
    rec = sub.add_parser("record", help="record one run's JUnit files as results/status/NAME.json")
    rec.add_argument("name")
    rec.add_argument("junit", nargs="+")
    rec.add_argument("--seconds", type=float)
    rec.add_argument("--venv")
    sub.add_parser("gpu", help="print the GPU's short name (h100, h200, ...)")
    plan = sub.add_parser("release-plan", help="what each part of a release runs (default: every part of 3)")
    plan.add_argument("part", nargs="?", default="3", help="K/N for one part (with --shell), or N for all N parts")
    plan.add_argument("--gpu", default="h100")
    plan.add_argument("--commit", default=None, help="the release commit (default: git's HEAD)")
    plan.add_argument("--shell", action="store_true", help="one part's files as shell variables, for gpu_check.sh")
    done = sub.add_parser("release-done", help="exit 0 when the part already passed at the commit")
    done.add_argument("gpu")
    done.add_argument("part")
    done.add_argument("--commit", required=True)
    rrec = sub.add_parser("release-record", help="record a release part's result")
    rrec.add_argument("gpu")
    rrec.add_argument("part")
    rrec.add_argument("--commit", required=True)
    rrec.add_argument("--logs", required=True, type=Path)
    rrec.add_argument("--seconds", type=float, required=True)
    rrec.add_argument("--step", action="append", default=[], help="NAME=EXIT_STATUS of a step the part ran")
    args = parser.parse_args(argv)
    if args.command == "record":
        present = [f for f in args.junit if Path(f).exists()]
        print(f"recorded {record(args.name, present, args.seconds, args.venv)}")
    elif args.command == "gpu":
        print(gpu_short_name())
    elif args.command == "release-plan":
        commit = args.commit or subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True,
                                               text=True).stdout.strip()
        if args.shell:  # what is left of the part: the units that have not passed at the commit
            left = units_left(args.gpu, args.part, commit)
            print(f"PART_TESTS={_shell_words([_shell_words(left['tests'])])}")
            print(f"PART_PROPERTIES={int(left['properties'])}")
            print(f"PART_LESSONS={_shell_words([_shell_words(left['lessons'])])}")
        else:
            n = parse_part(args.part)[1] if "/" in args.part else int(args.part)
            for k in range(1, n + 1):
                part = plan_for(args.gpu, f"{k}/{n}", commit)
                est = part["estimate_s"]
                print(f"part {k}/{n} (estimated: tests {est['tests']} s of test time beside lessons "
                      f"{est['lessons']} s):\n  tests: {' '.join(part['tests'])}\n  lessons: {' '.join(part['lessons'])}")
    elif args.command == "release-done":
        return 0 if release_done(args.gpu, args.part, args.commit) else 1
    elif args.command == "release-record":
        steps = {}
        for item in args.step:
            name, rc = item.rsplit("=", 1)
            steps[name] = float(rc) if name.startswith("seconds:") else int(rc)
        path = release_record(args.gpu, args.part, args.commit, logs=args.logs, step_rcs=steps, seconds=args.seconds)
        part = json.loads(path.read_text())["release"]["parts"][args.part]
        print(f"release {args.part} at {args.commit}: {part['status']}; recorded in {path}")
        return 0 if part["status"] == "passed" else 1
    if args.update_readme:
        print(f"updated {update_readme()}")
    if not args.update_readme and args.command is None:
        parser.print_help()
    return 0


if __name__ == "__main__":
    sys.exit(main())
