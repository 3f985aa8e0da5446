"""The Python package's modules import each other without a circle, lazily or not: read from
the source (every `import` and `from ... import` of the package, at any depth of a function),
a module that imports another never has that one import it back through any chain. And every
subpackage is one the build installs (pyproject.toml's packages), and the analysis modules'
paths from before they moved into qwen3layer.analysis import the same modules, with no file
left at the old place. qwen3layer.parallel, moved into qwen3layer.placement, keeps its public
path as a module re-exporting the new one's names (it imports torch, which `import qwen3layer`
must not, so the package cannot register it as the analysis paths are)."""
import ast
import os
import subprocess
import sys
import tomllib

ROOT = os.path.normpath(os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))


def modules(root: str = ROOT) -> dict:
    """{dotted module name: file} of the package qwen3layer under root"""
    found = {}
    for folder, _, files in os.walk(os.path.join(root, "qwen3layer")):
        for f in files:
            if f.endswith(".py"):
                path = os.path.join(folder, f)
                name = os.path.relpath(path, root)[:-3].replace(os.sep, ".")
                found[name.removesuffix(".__init__")] = path
    return found


def imports(name: str, path: str, known: dict) -> set:
    """the package's modules that module `name` imports (`from . import x` names x, not the
    package it comes from: that one is being imported already)"""
    package = name if path.endswith("__init__.py") else name.rpartition(".")[0]
    out = set()
    for node in ast.walk(ast.parse(open(path, encoding="utf-8").read(), path)):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names if a.name in known)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                parts = package.split(".")
                base = ".".join(parts[:len(parts) - node.level + 1])
                target = f"{base}.{node.module}" if node.module else base
            else:
                target = node.module
            if node.module and target in known:
                out.add(target)
            out.update(f"{target}.{a.name}" for a in node.names if f"{target}.{a.name}" in known)
    out.discard(name)
    return out


def circles(graph: dict) -> list:
    """the strongly connected groups of more than one module (each a circle of imports), and
    modules importing themselves through others"""
    index, low, stack, on, found, counter = {}, {}, [], set(), [], [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = []
            while True:
                w = stack.pop()
                on.discard(w)
                group.append(w)
                if w == v:
                    break
            if len(group) > 1:
                found.append(sorted(group))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def graph_of(root: str = ROOT) -> dict:
    known = modules(root)
    return {name: imports(name, path, known) for name, path in known.items()}


def test_no_module_imports_one_that_imports_it_back():
    graph = graph_of()
    assert "qwen3layer.torch.masks" in graph and "qwen3layer.layer" in graph["qwen3layer.torch"]
    assert circles(graph) == []


def test_a_planted_circle_is_found(tmp_path):
    pkg = tmp_path / "qwen3layer"
    (pkg / "cli").mkdir(parents=True)
    (pkg / "__init__.py").write_text("from .layer import Layer\n")
    (pkg / "layer.py").write_text("def f():\n    from .cli.ep import g\n")        # lazy: still an edge
    (pkg / "cli" / "__init__.py").write_text("")
    (pkg / "cli" / "ep.py").write_text("from .. import layer\nfrom . import common\n")
    (pkg / "cli" / "common.py").write_text("import qwen3layer.cli.ep\n")
    graph = graph_of(str(tmp_path))
    assert graph["qwen3layer.cli.ep"] == {"qwen3layer.layer", "qwen3layer.cli.common"}
    assert circles(graph) == [["qwen3layer.cli.common", "qwen3layer.cli.ep", "qwen3layer.layer"]]


def test_every_subpackage_is_installed():
    with open(os.path.join(ROOT, "pyproject.toml"), "rb") as f:
        listed = set(tomllib.load(f)["tool"]["setuptools"]["packages"])
    packages = {name for name, path in modules().items() if path.endswith("__init__.py")}
    assert packages == listed


def fresh(program: str) -> str:
    """what `program` prints, run in a fresh interpreter at the repository root (the test fails
    with its stderr where it raises)"""
    run = subprocess.run([sys.executable, "-c", program], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    return run.stdout


MOVED = ["costs", "costs_hybrid", "gpu_figures", "mapplot", "profile", "routing", "rulers"]  # into analysis/


def test_moved_modules_keep_their_old_paths():
    """in a fresh interpreter, a first `from qwen3layer.costs import ...` as a user's old code
    has it, then every old path against the new one: the same module object, an attribute of
    the package as before; the old files are gone"""
    program = (
        "import importlib, sys\n"
        "from qwen3layer.costs_hybrid import hybrid_split\n"
        "import qwen3layer.costs as costs\n"
        "import qwen3layer\n"
        "assert hybrid_split.__module__ == 'qwen3layer.analysis.costs_hybrid', hybrid_split.__module__\n"
        "assert costs.cost_model is qwen3layer.cost_model\n"
        f"for name in {MOVED!r}:\n"
        "    new = importlib.import_module('qwen3layer.analysis.' + name)\n"
        "    assert importlib.import_module('qwen3layer.' + name) is new, name\n"
        "    assert getattr(qwen3layer, name) is new, name\n"
        "print('ok')\n")
    assert fresh(program) == "ok\n"
    left = [name for name in MOVED if os.path.exists(os.path.join(ROOT, "qwen3layer", name + ".py"))]
    assert left == [] and {f"qwen3layer.analysis.{name}" for name in MOVED} <= set(modules())


PLACED = ["parallel", "hybrid", "passes"]  # into placement/, whose __init__.py is what placement.py was


def test_parallel_keeps_its_public_path_and_the_package_no_torch():
    """qwen3layer.parallel, expert parallelism's documented path, is a module that re-exports
    qwen3layer.placement.parallel's public names, the same objects, and holds nothing else;
    `import qwen3layer` and the torch-free qwen3layer.placement load neither it nor torch, and
    where torch is missing `import qwen3layer.parallel` fails at the import, naming torch
    (fresh interpreters). The placement modules left no flat file."""
    program = (
        "import pickle, sys\n"
        "import qwen3layer, qwen3layer.placement\n"
        "loaded = sorted(m for m in sys.modules if m.partition('.')[0] == 'torch'\n"
        "                or m in ('qwen3layer.parallel', 'qwen3layer.placement.parallel'))\n"
        "assert loaded == [], loaded\n"
        "import qwen3layer.parallel as p\n"
        "from qwen3layer.parallel import ExpertParallelLayer, contiguous_placement\n"
        "import qwen3layer.placement.parallel as impl\n"
        "assert p is qwen3layer.parallel and p.__all__ == impl.__all__, (p.__all__, impl.__all__)\n"
        "assert all(getattr(p, n) is getattr(impl, n) for n in impl.__all__)\n"
        "assert ExpertParallelLayer is impl.ExpertParallelLayer\n"
        "assert contiguous_placement is qwen3layer.placement.contiguous_placement\n"
        "assert sorted(n for n in vars(p) if not n.startswith('__')) == sorted(impl.__all__)\n"
        "assert pickle.loads(pickle.dumps(ExpertParallelLayer)) is ExpertParallelLayer\n"
        "print('ok')\n")
    assert fresh(program) == "ok\n"
    without_torch = (
        "import sys\n"
        "sys.modules['torch'] = None  # as where torch is not installed: `import torch` fails\n"
        "import qwen3layer, qwen3layer.placement\n"
        "assert qwen3layer.placement.check_placement([[2], [0, 1]], 3, 2) == [[2], [0, 1]]\n"
        "try:\n"
        "    import qwen3layer.parallel\n"
        "except ModuleNotFoundError as e:\n"
        "    print(e.name, 'qwen3layer.parallel' in sys.modules)\n")
    assert fresh(without_torch) == "torch False\n"
    graph = graph_of()
    # of the package's modules it imports config alone (the one expert-id check), which loads no
    # torch (the fresh process above imported the package without it)
    assert graph["qwen3layer.placement"] == {"qwen3layer.config"}
    assert {f"qwen3layer.placement.{name}" for name in PLACED} <= set(graph)
    left = [name for name in PLACED[1:] + ["placement"]
            if os.path.exists(os.path.join(ROOT, "qwen3layer", name + ".py"))]
    assert left == []
