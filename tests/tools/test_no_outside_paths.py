"""Nothing under benchmarks/, qwen3layer/ or tests/ reads a file outside the checkout: a fresh
clone runs and tests alone. Three checks, each run on the tree and on planted violations:
  - every text file: no name of a place beside or above a checkout (the sibling folder of
    shared notes, the machine's work folder, a home directory);
  - Python: every path built from __file__ (os.path.join / dirname / abspath / normpath,
    pathlib's / .parent .parents[n] .resolve(), and the names they are assigned to) stays
    inside the checkout, and no string is an absolute path but the system's own (/proc, /sys,
    /dev, /tmp, the CUDA toolkit's);
  - shell: `$(dirname "$0")` climbs no more folders than the script is deep."""
import ast
import os
import re

import pytest

ROOT = os.path.normpath(os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))
SCANNED = ("benchmarks", "qwen3layer", "tests")
TEXT = (".py", ".pyi", ".sh", ".md", ".c", ".h", ".txt", ".toml", ".json", ".cfg", ".ini")
# written with classes so that this line does not name them itself
OUTSIDE_NAMES = re.compile(r"[.][.]/shared\b|\bshared[/]REFERENCE|(?<![\w.])[/]work[/]|[/]home[/]|[~][/]|[$]HOME\b")
SYSTEM = ("/proc/", "/sys/", "/dev/", "/tmp/", "/tmp", "/usr/local/cuda")
ABSOLUTE = re.compile(r"^/[\w.-]+(/[\w.-]*)*$")
PATH_FUNCS = {"join", "dirname", "abspath", "normpath", "realpath", "Path", "PurePath"}
UNKNOWN = object()


class PathValues(ast.NodeVisitor):
    """The paths a Python file builds from its own location, and the absolute ones it names:
    each (line, text) that leaves `root`."""

    def __init__(self, path: str, root: str):
        self.file, self.root = os.path.abspath(path), os.path.abspath(root)
        self.names: dict = {}
        self.found: list = []

    def value(self, node):
        """the path node evaluates to, anchored at this file: None where unknown or not a path
        built from __file__ (a constant alone is relative to nothing here)"""
        v = self._value(node)
        return v[0] if v and v[1] else None

    def _value(self, node):  # (text, anchored) or None
        if isinstance(node, ast.Constant) and isinstance(node.value, str):
            return node.value, False
        if isinstance(node, ast.Name):
            if node.id == "__file__":
                return self.file, True
            got = self.names.get(node.id)
            return None if got is UNKNOWN else got
        if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Div):
            return self._join([node.left, node.right])
        if isinstance(node, ast.Attribute) and node.attr == "parent":
            inner = self._value(node.value)
            return inner and (os.path.dirname(inner[0]), inner[1])
        if isinstance(node, ast.Subscript) and isinstance(node.value, ast.Attribute) and \
                node.value.attr == "parents" and isinstance(node.slice, ast.Constant):
            inner = self._value(node.value.value)
            if not inner or not isinstance(node.slice.value, int):
                return None
            text = inner[0]
            for _ in range(node.slice.value + 1):
                text = os.path.dirname(text)
            return text, inner[1]
        if isinstance(node, ast.Call):
            func = node.func
            name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", None)
            if name in ("resolve", "absolute") and isinstance(func, ast.Attribute) and not node.args:
                return self._value(func.value)
            if name not in PATH_FUNCS or node.keywords:
                return None
            if name == "join":
                return self._join(node.args)
            if len(node.args) != 1:
                return None
            inner = self._value(node.args[0])
            if not inner:
                return None
            text = inner[0]
            if name == "dirname":
                text = os.path.dirname(text)
            elif name in ("abspath", "normpath", "realpath"):
                text = os.path.normpath(text)
            return text, inner[1]
        return None

    def _join(self, parts):
        values = [self._value(p) for p in parts]
        if not values or any(v is None for v in values):
            return None
        return os.path.join(*(v[0] for v in values)), any(v[1] for v in values)

    def visit_Assign(self, node):
        self.generic_visit(node)
        got = self._value(node.value)
        for target in node.targets:
            if isinstance(target, ast.Name):  # a name given two different paths is known as neither
                old = self.names.get(target.id, got)
                self.names[target.id] = got if old == got else UNKNOWN

    def generic_visit(self, node):
        if isinstance(node, (ast.Call, ast.BinOp, ast.Attribute, ast.Subscript)):
            text = self.value(node)
            if text is not None and not self.inside(text):
                self.found.append((node.lineno, os.path.normpath(text)))
                return  # the outermost expression only, not the pieces it is built of
        if isinstance(node, ast.JoinedStr):  # an f-string's pieces are not paths alone
            return
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and ABSOLUTE.match(node.value) \
                and not node.value.startswith(SYSTEM) and node.value.count("/") > 1:
            self.found.append((node.lineno, node.value))
        super().generic_visit(node)

    def inside(self, text: str) -> bool:
        full = os.path.normpath(os.path.join(os.path.dirname(self.file), text))
        return full == self.root or full.startswith(self.root + os.sep)


def shell_climbs(path: str, text: str, root: str) -> list:
    """(line, text) where a script's `$(dirname "$0")/..` climbs above root"""
    depth = os.path.relpath(os.path.dirname(os.path.abspath(path)), root).count(os.sep) + 1
    found = []
    for n, line in enumerate(text.splitlines(), 1):
        for m in re.finditer(r"""\$\(dirname\s+["']?\$(?:0|\{BASH_SOURCE(?:\[0\])?\})["']?\)((?:/\.\.)+)""", line):
            if m.group(1).count("..") > depth:
                found.append((n, m.group(0)))
    return found


def violations(root: str) -> list:
    """'file:line: text' for every way a file under root's SCANNED folders names or builds a
    path outside root"""
    out = []
    for top in SCANNED:
        for folder, dirs, files in os.walk(os.path.join(root, top)):
            dirs[:] = [d for d in dirs if d != "__pycache__" and not d.startswith(".")]
            for name in sorted(files):
                path = os.path.join(folder, name)
                if not name.endswith(TEXT):
                    continue
                with open(path, encoding="utf-8", errors="replace") as f:
                    text = f.read()
                where = os.path.relpath(path, root)
                found = [(text.count("\n", 0, m.start()) + 1, m.group(0)) for m in OUTSIDE_NAMES.finditer(text)]
                if name.endswith(".py"):
                    visitor = PathValues(path, root)
                    visitor.visit(ast.parse(text, path))
                    found += visitor.found
                if name.endswith(".sh"):
                    found += shell_climbs(path, text, root)
                out += [f"{where}:{line}: {what}" for line, what in sorted(set(found))]
    return out


def test_nothing_in_the_tree_reads_outside_the_checkout():
    assert violations(ROOT) == []


PLANTED = {
    # what bench_cuda.py did: the notes beside the checkout
    "benchmarks/bench_x.py": 'import os\nROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))\n'
                             'NOTES = os.path.join(ROOT, "..", "notes.md")\n',
    "qwen3layer/x.py": 'from pathlib import Path\nHERE = Path(__file__).resolve()\nOUT = HERE.parents[2] / "data"\n'
                       'ALSO = HERE.parent.parent.parent / "data"\n',
    "tests/tools/test_x.py": 'open("/opt/project/data.bin")\n',
    "tests/tools/test_y.py": 'import os\ndef f():\n    return os.path.join(os.path.dirname(__file__), "..", "..", "..", "x")\n',
    "tests/README.md": "see " + "../" + "shared/notes.md and " + "/" + "work/other\n",
    "benchmarks/run.sh": 'cd "$(dirname "$0")/../.."\n',
}
FINE = {
    "benchmarks/ok.py": 'import os\nROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")\n'
                        'open(os.path.join(ROOT, "README.md"))\nopen("/proc/cpuinfo")\nx = f"{ROOT}/{2}"\n',
    "tests/tools/test_ok.py": 'from pathlib import Path\nROOT = Path(__file__).parents[2]\nDOC = ROOT / "docs"\n'
                              'print("GB/s", "a/b")\n',
    "benchmarks/ok.sh": 'cd "$(dirname "$0")/.."\n',
}


def plant(root, files: dict) -> None:
    for rel, text in files.items():
        os.makedirs(os.path.dirname(root / rel), exist_ok=True)
        (root / rel).write_text(text)


def test_each_planted_violation_is_found(tmp_path):
    plant(tmp_path, FINE)
    assert violations(str(tmp_path)) == []
    plant(tmp_path, PLANTED)
    found = violations(str(tmp_path))
    assert {v.split(":")[0] for v in found} == set(PLANTED)
    by_file = {f: [v for v in found if v.startswith(f + ":")] for f in PLANTED}
    assert by_file["benchmarks/bench_x.py"] == [f"benchmarks/bench_x.py:3: {tmp_path.parent / 'notes.md'}"]
    assert [v.split(":")[1] for v in by_file["qwen3layer/x.py"]] == ["3", "4"]  # parents[2], .parent x 3
    assert len(by_file["tests/README.md"]) == 2


@pytest.mark.parametrize("source", ['os.path.join(os.path.dirname(__file__), "..")',
                                    'Path(__file__).parents[1]', 'Path(__file__).parent.parent'])
def test_a_path_to_the_checkouts_top_is_inside(tmp_path, source):
    plant(tmp_path, {"tests/t.py": f"import os\nfrom pathlib import Path\nX = {source}\n"})
    assert violations(str(tmp_path)) == []
    plant(tmp_path, {"tests/t.py": f"import os\nfrom pathlib import Path\nX = os.path.join({source}, '..')\n"})
    assert len(violations(str(tmp_path))) == 1
