"""Tests on the SIMT executor in a subprocess: a module marked `pytest.mark.executor_subprocess`
holds its cases as plain pytest tests (fixtures, parametrize, asserts), but they run in a
pytest of their own, once per module, with `q3.cuda.emulate()` called first: the executor
becomes the CUDA backend of the whole process that opens it, so it cannot share the suite's.
Here, each case of such a module is an item of the same id that reports what its run there
reported (passed, failed with its message, skipped); the module's code does not run here.
The cases of a module run in the order written, in one process: a case may rely on the
process state the cases before it left (cuBLAS opened, a path setting).
"""
import json
import os
import subprocess
import sys
import tempfile

import pytest

ROOT = os.path.normpath(os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))
MARK = "executor_subprocess"
REPORT = "Q3_EXECUTOR_REPORT"  # set in the subprocess: the file its results go to, a JSON line a case
DEFAULT_TIMEOUT = 900  # seconds for a module's run; a module's TIMEOUT overrides it


def inner() -> bool:
    """whether this process is a module's run on the executor"""
    return REPORT in os.environ


def pytest_configure(config):
    config.addinivalue_line("markers", f"{MARK}: the module's cases run in a subprocess on the SIMT executor "
                                       "(tests/executor/conftest.py)")


def pytest_sessionstart(session):
    if inner():
        import qwen3layer as q3

        q3.cuda.emulate()


def case_id(nodeid: str) -> str:
    """a case's id within its module (the same in both processes, whatever their rootdir)"""
    return nodeid.split("::", 1)[1]


def pytest_runtest_logreport(report):
    """in the subprocess: each case's outcome as soon as it is known (a crash keeps the earlier ones)"""
    if not inner() or (report.when != "call" and report.passed):
        return
    if report.skipped and isinstance(report.longrepr, tuple):
        text = report.longrepr[2].removeprefix("Skipped: ")
    else:
        text = "" if report.passed else str(report.longrepr)
    with open(os.environ[REPORT], "a", encoding="utf-8") as f:
        f.write(json.dumps({"id": case_id(report.nodeid), "when": report.when, "outcome": report.outcome,
                            "text": text}) + "\n")


def run_module(path: str, timeout: int) -> dict:
    """runs the module's cases in a pytest of their own: {case id: [(when, outcome, text)]},
    and under None the subprocess's exit status and the end of its output"""
    with tempfile.TemporaryDirectory(prefix="q3-executor-") as tmp:
        report = os.path.join(tmp, "report.jsonl")
        open(report, "w").close()
        # its own options only (not the suite's addopts: no parallel workers, no reordering)
        cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:randomly", "-p", "no:xdist",
               "-o", "addopts=", "-rN", path]
        try:
            r = subprocess.run(cmd, cwd=ROOT, env=dict(os.environ, **{REPORT: report}), capture_output=True,
                               text=True, timeout=timeout)
            status = (r.returncode, (r.stdout + r.stderr)[-6000:])
        except subprocess.TimeoutExpired as e:
            out = (e.stdout or b"").decode(errors="replace") + (e.stderr or b"").decode(errors="replace")
            status = (f"timed out after {timeout} s", out[-6000:])
        results = {None: status}
        with open(report, encoding="utf-8") as f:
            for line in f:
                r = json.loads(line)
                results.setdefault(r["id"], []).append((r["when"], r["outcome"], r["text"]))
    return results


class ExecutorCase(pytest.Item):
    """a case of a marked module, as its run in the subprocess reported it"""

    def __init__(self, *, case, **kw):
        super().__init__(**kw)
        self.case = case
        self.own_markers = list(case.own_markers)
        self.keywords.update(case.keywords)

    def runtest(self):
        module = self.case.module
        key = os.path.abspath(module.__file__)
        runs = self.config.stash.setdefault(RUNS, {})
        if key not in runs:
            runs[key] = run_module(key, getattr(module, "TIMEOUT", DEFAULT_TIMEOUT))
        results = runs[key]
        reports = results.get(case_id(self.nodeid))
        if not reports:
            code, tail = results[None]
            pytest.fail(f"the executor's run of {os.path.relpath(key, ROOT)} stopped (exit {code}) before this case "
                        f"reported; its output ends:\n{tail}", pytrace=False)
        for when, outcome, text in reports:
            if outcome == "skipped":
                pytest.skip(text)
            if outcome == "failed":
                pytest.fail(f"on the executor ({when}):\n{text}", pytrace=False)

    def reportinfo(self):
        return self.case.reportinfo()


RUNS = pytest.StashKey[dict]()


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config, items):
    """here (not in the subprocess): each case of a marked module becomes its ExecutorCase"""
    if inner():
        return
    for i, item in enumerate(items):
        if isinstance(item, pytest.Function) and item.get_closest_marker(MARK) is not None:
            items[i] = ExecutorCase.from_parent(item.parent, name=item.name, case=item)
