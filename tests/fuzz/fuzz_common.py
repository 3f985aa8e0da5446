"""What the fuzzers (tests/fuzz_*.py) share: the runner and the findings log.

A fuzzer script is run as a libFuzzer binary would be:

    python tests/fuzz_X.py -max_total_time=60 CORPUS_DIR     # fuzz (seeds CORPUS_DIR if it is empty)
    python tests/fuzz_X.py FILE...                            # run these inputs once (reproduce)

The script first runs as a plain Python parent: it writes the seed corpus into an empty (or
missing) corpus folder, then runs itself again as the atheris child with the same
arguments, and afterwards prints what the child found and exits non-zero if it found
anything. Two kinds of findings:
- a crash: a sanitizer report, a signal, a hang or an uncaught exception stops the child;
  libFuzzer saves the input (-artifact_prefix) and its exit code is passed on;
- a wrong answer the child can check for itself (an undocumented exception type, a deleter
  called twice, a tensor read outside its bytes): recorded, with its input saved beside the
  findings log, and fuzzing goes on, so that one run reports every kind it meets (each kind,
  keyed by exception type and place, once). Q3_FUZZ_RAISE=1 raises them instead (to get
  libFuzzer's crash file, or a traceback when reproducing).

Environment: Q3_FUZZ_FINDINGS (the findings log; default: a temporary file, printed at
the end), Q3_FUZZ_RAISE.

Not collected by pytest (the names do not start with test_); atheris is needed only by the
child: pip install atheris.
"""
from __future__ import annotations

import collections
import hashlib
import os
import subprocess
import sys
import tempfile
import traceback
from typing import Callable, Dict, Optional

CHILD = "Q3_FUZZ_CHILD"


class Finding(Exception):
    """A wrong answer that is not an exception of the code under test."""


class Log:
    """The child's findings log: each new kind once (with its input saved beside the log),
    and counts of every outcome in <log>.stats."""

    def __init__(self, name: str):
        self.name = name
        self.path = os.environ.get("Q3_FUZZ_FINDINGS")
        self.raise_ = os.environ.get("Q3_FUZZ_RAISE") == "1"
        self.seen: set = set()
        self.outcomes: collections.Counter = collections.Counter()
        self.runs = 0

    def outcome(self, what: str) -> None:
        self.outcomes[what] += 1
        self.runs += 1
        if self.path and self.runs % 500 == 0:
            self.write_stats()

    def write_stats(self) -> None:
        if not self.path:
            return
        with open(self.path + ".stats", "w") as f:
            f.write(f"{self.name}: {self.runs} inputs\n")
            for what, n in self.outcomes.most_common():
                f.write(f"  {n:8d}  {what}\n")

    def finding(self, kind: str, message: str, data: bytes, exc: Optional[BaseException] = None) -> None:
        """Records a finding (kind: a short stable key; message: what was wrong)."""
        self.outcome(f"FINDING {kind}")
        if self.raise_:
            if exc is not None:
                raise exc
            raise Finding(f"{kind}: {message}")
        where = ""
        if exc is not None:
            frames = traceback.extract_tb(exc.__traceback__)
            ours = [f for f in frames if f"{os.sep}qwen3layer{os.sep}" in f.filename] or frames
            if ours:  # the deepest frame in the package (a C function raises from its caller's line)
                where = f"{os.path.basename(ours[-1].filename)}:{ours[-1].lineno}"
        key = (kind, type(exc).__name__ if exc is not None else "", where)
        if key in self.seen:
            return
        self.seen.add(key)
        digest = hashlib.sha1(data).hexdigest()[:12]
        saved = ""
        text = [f"== {self.name}: {kind}" + (f" ({where})" if where else ""), message]
        if exc is not None:
            text.append("".join(traceback.format_exception(exc)).rstrip())
        if self.path:
            saved = os.path.join(os.path.dirname(os.path.abspath(self.path)), f"{self.name}-finding-{digest}")
            with open(saved, "wb") as f:
                f.write(data)
            text.append(f"input: {saved} ({len(data)} bytes; reproduce: python tests/{self.name}.py {saved})")
        else:
            text.append(f"input ({len(data)} bytes): {data[:256]!r}")
        entry = "\n".join(text) + "\n"
        sys.stderr.write(entry)
        if self.path:
            with open(self.path, "a") as f:
                f.write(entry + "\n")
            self.write_stats()


def _seed(argv, seeds: Callable[[], Dict[str, bytes]]) -> None:
    dirs = [a for a in argv[1:] if not a.startswith("-") and (os.path.isdir(a) or not os.path.exists(a))]
    made = None
    for d in dirs:
        os.makedirs(d, exist_ok=True)
        if os.listdir(d):
            continue
        made = made if made is not None else seeds()
        for name, data in made.items():
            with open(os.path.join(d, name), "wb") as f:
                f.write(data)
        print(f"{os.path.basename(argv[0])}: seeded {d} with {len(made)} inputs", file=sys.stderr)


def run(name: str, test_one_input: Callable[[bytes], None], seeds: Callable[[], Dict[str, bytes]],
        prepare: Callable[[], None]) -> None:
    """The entry point of a fuzzer script (see the module's docstring). prepare() imports
    the code under test: its Python modules (qwen3layer) are instrumented for coverage."""
    if os.environ.get(CHILD) == "1":
        import atheris

        with atheris.instrument_imports(include=["qwen3layer"]):
            prepare()
        # internal: libFuzzer from atheris itself, also when .ci/sanitize preloads that very library
        atheris.Setup(sys.argv, test_one_input, internal_libfuzzer=True)
        atheris.Fuzz()
        return
    _seed(sys.argv, seeds)
    env = dict(os.environ, **{CHILD: "1"})
    own_log = "Q3_FUZZ_FINDINGS" not in env
    if own_log:
        env["Q3_FUZZ_FINDINGS"] = os.path.join(tempfile.mkdtemp(prefix=f"{name}-"), "findings.txt")
    log = env["Q3_FUZZ_FINDINGS"]
    if os.path.exists(log):
        os.remove(log)
    rc = subprocess.call([sys.executable, os.path.abspath(sys.argv[0])] + sys.argv[1:], env=env)
    found = os.path.exists(log) and os.path.getsize(log) > 0
    if os.path.exists(log + ".stats"):
        print(open(log + ".stats").read().rstrip(), file=sys.stderr)
    if found:
        print(f"{name}: findings (log: {log}):", file=sys.stderr)
        if own_log:
            print(open(log).read(), file=sys.stderr)
    if rc != 0:
        print(f"{name}: the fuzzer stopped with exit code {rc} (a crash: its report and input are above)",
              file=sys.stderr)
    elif not found:
        print(f"{name}: no finding", file=sys.stderr)
    sys.exit(rc if rc != 0 else (1 if found else 0))
