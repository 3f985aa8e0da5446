"""transformers' own Qwen3-MoE test suite, run twice against the installed transformers: as it
is, and with every Qwen3MoeModel patched by qwen3layer's drop-in (qwen3layer.torch.patch_model).
A measurement, not a gate: it prints each run's counts (passed, failed, skipped, errors) and
every test whose outcome differs between the runs, with the first line of the patched run's
error, grouped by the error's kind (masks refused, fp16 refused, training refused, ...).

    python benchmarks/hf_suite.py                       # the tests cached, else downloaded
    python benchmarks/hf_suite.py --source DIR          # the tests from a transformers checkout
    PYTHONPATH=. python benchmarks/hf_suite.py          # this checkout's qwen3layer

Each run is `python -m pytest tests/models/qwen3_moe` in a subprocess (nice -n 10, pytest-xdist
with 2 workers where installed), reported by a junit xml: 40-80 s a run on 2 shared cores
(315 tests, 149 of them skipped), plus the tree's assembly the first time (seconds from a local
checkout and the sdist). Exit status 0 once both runs ran, whatever they counted; 2 when they
could not run (no tests, a missing package, a collection error), with the logs kept.

The tests: the transformers wheel has none, and its sdist (PyPI) has only the top-level
tests/*.py, not tests/models/ nor tests/generation/. So the tree comes from, in order:
  - --tests-dir (default: <user cache>/qwen3layer/hf-tests-<version>) when it holds the suite;
  - --source DIR, a transformers checkout or git repository (its HEAD) of another 5.x version
    (a fork's, where the tag cannot be reached): its tests/, utils/ and conftest.py, with the
    installed version's sdist over them (tests/*.py, pyproject.toml and src/, which
    test_pipeline_mixin imports); a module those top-level files import that the checkout
    lacks is written as a stub whose names skip the test that calls them, and the literal
    constants of the checkout's transformers.testing_utils that the installed one lacks are
    added to it by the plugin. HF_SUITE_SOURCE.txt in the tree says what it was made of;
  - else GitHub's tarball of the tag v<version> (the exact tree).
A tree is assembled in a folder beside --tests-dir and renamed into place when complete.

Both runs load benchmarks/hf_suite_plugin.py (copied into a temporary folder and passed with
-p), identical but for its "patch" setting: the tester's hidden_act set to "silu", the real
model's activation (the tester's default, gelu, is not what Qwen3-MoE runs); each test seeded
from its id, so that both runs give it the same inputs (the workers take the tests in another
order each run, and a random mask may hold a hole in one run and none in the other); and, in
the patched run, Qwen3MoeModel.__call__ patching the model at its first call. Not at __init__
or post_init: from_pretrained builds the model on the meta device and assigns the loaded
weights afterwards, and tests move or cast a model (to(), half()) between building and calling
it; patch_model borrows the weights it sees (no copy), and a weight replaced after patching is
refused at the next call. Patching where a user would, once the model is ready to run, makes a
test of the drop-in of every test whose model is built and then called, save/load round trips
included (the loaded model is patched at its own first call); a weight changed in place
afterwards (load_state_dict) is read by the C layer where it is.
Both runs set HF_HUB_OFFLINE=1 (no hub here; the tests that need one fail alike),
OMP_WAIT_POLICY=passive, OPENBLAS_NUM_THREADS=1 and, with workers, OMP_NUM_THREADS=1.
Counts are of tests, one outcome each, pytest 9's subtests folded in (a failing subtest fails
its test; a test with a skip and no failure is skipped), as the junit xml gives them; pytest's
own summary line counts subtests apart.
"""
from __future__ import annotations

import argparse
import ast
import collections
import importlib.util
import io
import json
import os
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
import urllib.request
import xml.etree.ElementTree as ET
from pathlib import Path

SUITE = "tests/models/qwen3_moe"
MARKER = SUITE + "/test_modeling_qwen3_moe.py"
TARBALL = "https://codeload.github.com/huggingface/transformers/tar.gz/refs/tags/v{version}"
FROM_CHECKOUT = ("tests", "utils", "conftest.py", "src/transformers/testing_utils.py")
PLUGIN = Path(__file__).with_name("hf_suite_plugin.py")
PLUGIN_NAME = "qwen3layer_hf_suite"
COMPAT_FILE = "hf_suite_compat.json"

# the kind of a patched failure, by its first line: the first row whose pattern matches
KINDS = (
    ("training refused", r"inference-only|in training mode"),
    ("fp16 refused", r"float16"),
    ("masks refused", r"attention_mask|cu_seq_lens"),
    ("positions refused", r"position_ids|cache_position"),
    ("past the context", r"CacheFullError"),
    ("config refused", r"Error: config\."),
    ("weights replaced", r"no longer the tensor the C layer reads"),
    ("a mock of transformers' code not called", r"Expected '\w+' to have been called"),
    ("not implemented", r"NotImplementedError"),
)
OTHER = "other"

Outcome = collections.namedtuple("Outcome", "status message")  # status: passed failed error skipped


class Unavailable(Exception):
    """the suite could not be obtained or run"""


def default_tests_dir(version: str) -> Path:
    cache = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(cache) / "qwen3layer" / f"hf-tests-{version}"


def write_plugin(folder: Path, patch: bool, compat: dict) -> Path:
    """hf_suite_plugin.py as folder/PLUGIN_NAME.py, its settings beside it; the plugin's path"""
    path = Path(folder) / f"{PLUGIN_NAME}.py"
    shutil.copyfile(PLUGIN, path)
    path.with_suffix(".json").write_text(json.dumps({"patch": patch, "compat": compat}, indent=1) + "\n")
    return path


def literal_constants(source: str) -> dict:
    """the module-level NAME = <literal> assignments of a Python file's text"""
    found = {}
    for node in ast.parse(source).body:
        if isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name):
            try:
                found[node.targets[0].id] = ast.literal_eval(node.value)
            except ValueError:
                pass
    return found


def stub_missing_modules(tests: Path, why: str) -> dict:
    """a stub for each module the top-level tests/*.py import relatively (from .name import ...)
    that the tree lacks: each imported name a function that skips its caller's test.
    {module: [names]} of the stubs written"""
    wanted = collections.defaultdict(set)
    for path in sorted(tests.glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.level == 1 and node.module and "." not in node.module \
                    and not (tests / f"{node.module}.py").exists() and not (tests / node.module).is_dir():
                wanted[node.module].update(alias.name for alias in node.names)
    for module, names in wanted.items():
        lines = [f'"""stub written by qwen3layer\'s benchmarks/hf_suite.py: {why}"""', "import unittest", "",
                 "", "def _absent(*args, **kwargs):",
                 f"    raise unittest.SkipTest({module + '.py is not in this tree (' + why + ')'!r})", ""]
        lines += [f"{name} = _absent" for name in sorted(names)]
        (tests / f"{module}.py").write_text("\n".join(lines) + "\n")
    return {module: sorted(names) for module, names in wanted.items()}


def extract(archive: tarfile.TarFile, dest: Path, keep) -> int:
    """the archive's members whose path (less its first folder) keep(path) accepts, into dest"""
    n = 0
    for member in archive.getmembers():
        rel = member.name.split("/", 1)[1] if "/" in member.name else ""
        if rel and (member.isfile() or member.isdir()) and keep(rel):
            member.name = rel
            archive.extract(member, dest, filter="data")
            n += member.isfile()
    return n


def from_tag(dest: Path, version: str) -> str:
    url = TARBALL.format(version=version)
    with urllib.request.urlopen(url, timeout=60) as reply:
        data = reply.read()
    with tarfile.open(fileobj=io.BytesIO(data), mode="r:gz") as archive:
        n = extract(archive, dest, lambda rel: rel.split("/")[0] in ("tests", "utils", "src", "conftest.py",
                                                                     "pyproject.toml"))
    return f"transformers v{version} from {url} ({n} files)"


def source_files(source: Path, dest: Path) -> str:
    """FROM_CHECKOUT of a checkout (a folder with tests/) or of a git repository's HEAD, into dest"""
    if (source / "tests").is_dir():
        for rel in FROM_CHECKOUT:
            if (source / rel).is_dir():
                shutil.copytree(source / rel, dest / rel)
            elif (source / rel).is_file():
                (dest / rel).parent.mkdir(parents=True, exist_ok=True)
                shutil.copy2(source / rel, dest / rel)
        what = f"the checkout {source}"
    else:
        git = ["git", "-C", str(source)]
        listed = subprocess.run(git + ["ls-tree", "--name-only", "HEAD", *FROM_CHECKOUT], capture_output=True,
                                text=True)
        if listed.returncode != 0 or "tests" not in listed.stdout.split():
            raise Unavailable(f"--source {source}: neither a folder with tests/ nor a git repository with tests/ "
                              f"at HEAD ({listed.stderr.strip() or 'no tests/'})")
        tar = subprocess.run(git + ["archive", "--format=tar", "HEAD", *listed.stdout.split()], capture_output=True,
                             check=True)
        with tarfile.open(fileobj=io.BytesIO(tar.stdout)) as archive:
            archive.extractall(dest, filter="data")
        head = subprocess.run(git + ["log", "-1", "--format=%H %cs"], capture_output=True, text=True).stdout.strip()
        what = f"the git repository {source} at HEAD {head}"
    init = source / "src" / "transformers" / "__init__.py"
    text = init.read_text() if init.is_file() else subprocess.run(
        ["git", "-C", str(source), "show", "HEAD:src/transformers/__init__.py"], capture_output=True, text=True).stdout
    found = re.search(r'^__version__ = "([^"]+)"', text, re.M)
    return f"{what} (transformers {found.group(1) if found else 'of unknown version'})"


def overlay_sdist(dest: Path, version: str) -> str:
    """the installed version's sdist (PyPI) over dest: its tests/*.py, pyproject.toml and src/"""
    with tempfile.TemporaryDirectory() as tmp:
        got = subprocess.run([sys.executable, "-m", "pip", "download", f"transformers=={version}", "--no-binary",
                              ":all:", "--no-deps", "-q", "-d", tmp], capture_output=True, text=True)
        sdists = list(Path(tmp).glob("transformers-*.tar.gz"))
        if got.returncode != 0 or not sdists:
            raise Unavailable(f"pip download transformers=={version} (the sdist): {got.stderr.strip()[-400:]}")
        shutil.rmtree(dest / "src", ignore_errors=True)
        with tarfile.open(sdists[0]) as archive:
            n = extract(archive, dest, lambda rel: re.fullmatch(r"tests/[^/]+\.py|pyproject\.toml|src(/.*)?", rel))
    return f"the transformers {version} sdist over it: tests/*.py, pyproject.toml, src/ ({n} files)"


def assemble_tree(tests_dir: Path, version: str, source: Path | None) -> str:
    """the suite's tree in tests_dir (made in a folder beside it, renamed when complete); its
    description"""
    tests_dir.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=tests_dir.name + ".part-", dir=tests_dir.parent))
    try:
        if source is not None:
            lines = ["tests/, utils/ and conftest.py of " + source_files(source, staging)]
            save_compat(staging)  # before the sdist's src/ replaces the checkout's testing_utils.py
            lines.append(overlay_sdist(staging, version))
            stubs = stub_missing_modules(staging / "tests", f"transformers {version}'s tests import it; the "
                                                            "checkout has no such file")
            lines += [f"stub tests/{m}.py: {', '.join(n)} skip their test" for m, n in stubs.items()]
        else:
            try:
                lines = [from_tag(staging, version)]
            except (OSError, tarfile.TarError) as e:
                raise Unavailable(f"GitHub's tarball of v{version}: {e}. The wheel and the sdist have no "
                                  f"tests/models/: give --source, a transformers 5.x checkout or git repository")
        if not (staging / MARKER).is_file():
            raise Unavailable(f"the assembled tree has no {MARKER}")
        (staging / "HF_SUITE_SOURCE.txt").write_text("\n".join(lines) + "\n")
        if tests_dir.exists():
            shutil.rmtree(tests_dir)
        staging.rename(tests_dir)
        staging = None
    finally:
        if staging is not None:
            shutil.rmtree(staging, ignore_errors=True)
    return "\n".join(lines)


def save_compat(tree: Path) -> None:
    """the literal constants of the checkout's transformers.testing_utils, which its tests may
    import and the installed one may lack (the plugin's COMPAT), as tree/COMPAT_FILE"""
    utils = tree / "src" / "transformers" / "testing_utils.py"
    found = literal_constants(utils.read_text()) if utils.is_file() else {}
    kept = {}
    for name, value in found.items():
        try:
            kept[name] = json.loads(json.dumps(value))
        except (TypeError, ValueError):
            pass
    (tree / COMPAT_FILE).write_text(json.dumps(kept, indent=1, sort_keys=True) + "\n")


def compat_constants(tree: Path) -> dict:
    saved = tree / COMPAT_FILE
    return json.loads(saved.read_text()) if saved.is_file() else {}


def parse_junit(path: Path) -> dict:
    """{test: Outcome} of a pytest junit xml; test is Class::name (or the file's for a test
    outside a class); message the first line of the failure's, error's or skip's message"""
    results = {}
    for case in ET.parse(path).getroot().iter("testcase"):
        cls = (case.get("classname") or "").rsplit(".", 1)[-1]
        test = f"{cls}::{case.get('name')}" if cls else case.get("name")
        status, message = "passed", ""
        for tag, meaning in (("failure", "failed"), ("error", "error"), ("skipped", "skipped")):
            child = case.find(tag)
            if child is not None:
                text = child.get("message") or child.text or ""
                status, message = meaning, (text.strip().splitlines() or [""])[0]
                break
        results[test] = Outcome(status, message)
    return results


def counts(results: dict) -> collections.Counter:
    return collections.Counter(outcome.status for outcome in results.values())


def kind_of(message: str) -> str:
    for kind, pattern in KINDS:
        if re.search(pattern, message):
            return kind
    return OTHER


def differences(plain: dict, patched: dict) -> dict:
    """{kind: [(test, plain status, patched status, patched message)]} of the tests whose outcome
    differs, each kind's tests sorted; a test only one run has counts as 'absent' in the other"""
    absent = Outcome("absent", "")
    grouped = collections.defaultdict(list)
    for test in sorted(set(plain) | set(patched)):
        a, b = plain.get(test, absent), patched.get(test, absent)
        if a.status != b.status:
            kind = kind_of(b.message) if b.status in ("failed", "error") else f"{b.status} patched"
            grouped[kind].append((test, a.status, b.status, b.message))
    order = [kind for kind, _ in KINDS] + [OTHER]
    rank = {kind: i for i, kind in enumerate(order)}
    return dict(sorted(grouped.items(), key=lambda kv: (rank.get(kv[0], len(order)), kv[0])))


def count_line(results: dict) -> str:
    c = counts(results)
    return f"{c['passed']} passed, {c['failed']} failed, {c['skipped']} skipped, {c['error']} errors"


def report(plain: dict, patched: dict, seconds: tuple) -> str:
    lines = [f"unpatched: {count_line(plain)} ({seconds[0]:.0f} s)",
             f"patched:   {count_line(patched)} ({seconds[1]:.0f} s)"]
    groups = differences(plain, patched)
    lines.append(f"\n{sum(len(rows) for rows in groups.values())} tests differ (unpatched -> patched, the patched "
                 "run's error):")
    for kind, rows in groups.items():
        lines.append(f"\n{kind}: {len(rows)}")
        width = max(len(test) for test, *_ in rows)
        lines += [f"  {test:<{width}}  {a} -> {b}  {message}".rstrip() for test, a, b, message in rows]
    return "\n".join(lines)


def read_notes(folder: Path) -> collections.Counter:
    notes = collections.Counter()
    for path in Path(folder).iterdir():
        notes.update(path.read_text().splitlines())
    return notes


def run_suite(tree: Path, patch: bool, compat: dict, work: Path, workers: int, niceness: int) -> tuple:
    """one pytest run of the suite: (its results, seconds, notes)"""
    name = "patched" if patch else "unpatched"
    plugin_dir, notes = work / f"plugin-{name}", work / f"notes-{name}"
    shutil.rmtree(notes, ignore_errors=True)
    plugin_dir.mkdir(exist_ok=True)
    notes.mkdir()
    write_plugin(plugin_dir, patch, compat)
    junit, log = work / f"{name}.xml", work / f"{name}.log"
    env = dict(os.environ, HF_SUITE_NOTES=str(notes),
               PYTHONPATH=os.pathsep.join(p for p in (str(plugin_dir), os.environ.get("PYTHONPATH")) if p))
    for key, value in (("HF_HUB_OFFLINE", "1"), ("OMP_WAIT_POLICY", "passive"), ("OPENBLAS_NUM_THREADS", "1")) + \
            ((("OMP_NUM_THREADS", "1"),) if workers else ()):
        env.setdefault(key, value)
    cmd = [sys.executable, "-m", "pytest", SUITE, "-p", PLUGIN_NAME, "-p", "no:cacheprovider", "-q",
           "-o", "log_cli=false", f"--junitxml={junit}"] + (["-n", str(workers)] if workers else [])
    if niceness and shutil.which("nice"):
        cmd = ["nice", "-n", str(niceness)] + cmd
    start = time.monotonic()
    with open(log, "w") as out:
        rc = subprocess.run(cmd, cwd=tree, env=env, stdout=out, stderr=subprocess.STDOUT).returncode
    seconds = time.monotonic() - start
    if rc not in (0, 1) or not junit.is_file():
        tail = log.read_text()[-3000:]
        raise Unavailable(f"the {name} run: pytest exited {rc} (0 or 1 expected; its log {log}):\n{tail}")
    results, noted = parse_junit(junit), read_notes(notes)
    if not results:
        raise Unavailable(f"the {name} run collected no test (its log {log})")
    if not any(line.startswith("hidden_act ") for line in noted):
        raise Unavailable(f"the {name} run set no tester's hidden_act to silu (no test class with a "
                          f"model_tester_class ran; its log {log})")
    return results, seconds, noted


def notes_line(label: str, notes: collections.Counter) -> str:
    """what the plugin did in a run, from its notes"""
    testers = sorted({tuple(line.split()[1:3]) for line in notes if line.startswith("hidden_act ")})
    words = [f"{label}: hidden_act -> silu in " + ", ".join(f"{t} (was {was})" for t, was in testers)]
    added = sorted({line.split()[1] for line in notes if line.startswith("compat ")})
    if added:
        words.append("compat: " + ", ".join(added))
    where = [line.split(" ", 1)[1] for line in notes if line.startswith("qwen3layer ")]
    if where:
        words.append(f"{notes['patched']} models patched by qwen3layer {where[0]}")
    return "; ".join(words)


def main(argv=None) -> int:
    import transformers

    version = transformers.__version__
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--tests-dir", type=Path, default=default_tests_dir(version),
                   help="the suite's tree, assembled there when absent (default: %(default)s)")
    p.add_argument("--source", type=Path, help="a transformers 5.x checkout or git repository to take tests/ from, "
                                               "the installed version's sdist over it, assembled into --tests-dir "
                                               "(replacing what is there)")
    p.add_argument("--workers", type=int, default=min(2, os.cpu_count() or 1),
                   help="pytest-xdist workers, 0 for none (default: %(default)s, at most 2)")
    p.add_argument("--nice", type=int, default=10, help="the runs' niceness (default: %(default)s)")
    p.add_argument("--out", type=Path, help="a folder to keep the junit xml, logs and plugins in (default: a "
                                            "temporary one, removed)")
    args = p.parse_args(argv)
    workers = min(args.workers, 2) if importlib.util.find_spec("xdist") else 0
    try:
        for package in ("pytest", "parameterized"):
            if importlib.util.find_spec(package) is None:
                raise Unavailable(f"the suite imports {package}: pip install {package}")
        if args.source is not None or not (args.tests_dir / MARKER).is_file():
            print(f"assembling the tests in {args.tests_dir}", flush=True)
            assemble_tree(args.tests_dir, version, args.source)
        tree = args.tests_dir
        compat = compat_constants(tree)
        import qwen3layer

        print(f"transformers {version}, {SUITE} of {tree}:")
        print("  " + (tree / "HF_SUITE_SOURCE.txt").read_text().strip().replace("\n", "\n  ")
              if (tree / "HF_SUITE_SOURCE.txt").is_file() else "  (no HF_SUITE_SOURCE.txt)")
        print(f"qwen3layer {qwen3layer.__file__}; {workers or 'no'} xdist workers, nice {args.nice}", flush=True)
        work = Path(tempfile.mkdtemp(prefix="hf-suite-")) if args.out is None else args.out
        work.mkdir(parents=True, exist_ok=True)
        plain, t_plain, notes_plain = run_suite(tree, False, compat, work, workers, args.nice)
        patched, t_patched, notes = run_suite(tree, True, compat, work, workers, args.nice)
    except Unavailable as e:
        print(f"hf_suite: could not run: {e}", file=sys.stderr)
        return 2
    if args.out is None:
        shutil.rmtree(work, ignore_errors=True)
    print(notes_line("unpatched", notes_plain))
    print(notes_line("patched", notes))
    print()
    print(report(plain, patched, (t_plain, t_patched)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
