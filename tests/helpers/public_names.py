"""Every public name against docs/, both ways: the discovery and the checks
(tests/tools/test_public_names.py runs them).

Found by introspection: the public names of the modules in MODULES (qwen3layer.testing once it
exists; `__all__` where a module has one, else the functions and classes it defines), the
members of every class among them and of the result types in RESULT_TYPES (what `vars()` of the
class and its qwen3layer bases hold, dataclass and named-tuple fields, and the attributes its
methods assign on `self`), the parameters of every function, method and constructor
(`inspect.signature`), and the flags of every `python -m qwen3layer` subcommand
(`qwen3layer.cli.build_parser()`). No leading underscore is public.

"Appears" means, in inline code (between backticks, outside fenced blocks) of a docs/*.md page:
- a module's name as `q3.name` or `qwen3layer.name` (`qwen3layer.cuda.name`, `q3.cuda.name`,
  `qwen3layer.torch.name`, `q3t.name`, ...: ALIASES); a class also alone, as `Stage`; a name
  several modules export (`q3.cost_model`, `qwen3layer.analysis.costs.cost_model`) under one
  of them;
- a class's member as `Class.member` (Class its __name__, or its module path where two classes
  share a name: DOC_NAMES);
- each parameter of a callable as a word inside the parentheses of a span that names the
  callable followed by "(": `DecoderLayer.profile(mode, tokens, ..., repeat=3, batch=1)`;
- a flag as `--flag` in a row of docs/cli.md's flag table whose second cell names the
  subcommand.
The other way: every `q3.a.b` / `qwen3layer.a.b` path, every name of a `from qwen3layer.a import
b, c` and every `Class.member` of a class above named in README.md or docs/ (inline code and
fenced blocks) resolves from where it is given: each module on the way imported by its dotted
path, as `import` and `from ... import` find it (a module only set as its package's attribute
does not count), then the names in it. And every `--flag` of a
`python -m qwen3layer <command>` span, of docs/cli.md's inline code and of its flag table
belongs to that command (or, outside a command's span, to some command). ALLOWED lists the
names left out, each with its reason. Reads files and imports the package; runs nothing."""
import argparse
import ast
import dataclasses
import glob
import importlib
import inspect
import os
import re
import textwrap

from qwen3layer import cli

ROOT = os.path.normpath(os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))
DOCS = sorted(glob.glob(os.path.join(ROOT, "docs", "*.md")))
README = os.path.join(ROOT, "README.md")
CLI_PAGE = os.path.join(ROOT, "docs", "cli.md")

# the modules whose public names are the API (qwen3layer.testing where it exists)
MODULES = ["qwen3layer", "qwen3layer.cuda", "qwen3layer.analysis.costs", "qwen3layer.analysis.costs_hybrid",
           "qwen3layer.parallel", "qwen3layer.torch", "qwen3layer.testing"]
# classes the API returns or raises that no module above exports
RESULT_TYPES = ["qwen3layer.analysis.profile.Profile", "qwen3layer.analysis.profile.StageTime",
                "qwen3layer.checkpoint.UnsupportedDtypeError"]
ALIASES = {"q3": "qwen3layer", "q3t": "qwen3layer.torch"}  # the docs' `import qwen3layer as q3` and `... as q3t`
DOC_NAMES = {"qwen3layer.torch.DecoderLayer": "qwen3layer.torch.DecoderLayer"}  # q3.DecoderLayer keeps the name
ALLOWED = {
    "DecodeGraph()": "made by DecoderLayer.decode_graph, never by a caller",
    "qwen3layer.torch.DecoderLayer()": "made by patch_model or DecoderLayer.from_hf, never by a caller",
    "qwen3layer.torch.DecoderLayer.training": "torch.nn.Module's own flag, set from the layer it replaces",
    "qwen3layer.torch.DecoderLayer.call": "the eager body of forward (also the custom op's), not for callers",
}

FENCE = re.compile(r"^\s*```.*?^\s*```", re.MULTILINE | re.DOTALL)
SPAN = re.compile(r"`([^`]+)`")
PATH = re.compile(r"(?<![\w./-])(q3t|q3|qwen3layer)((?:\.\w+)+)(?![\w/])")
IMPORTED = r"\w+(?:\s+as\s+\w+)?"  # one name of a from-import: b, or b as c
FROM_IMPORT = re.compile(rf"\bfrom\s+(qwen3layer(?:\.\w+)*)\s+import\s+\(?\s*({IMPORTED}(?:\s*,\s*{IMPORTED})*)")
FILE_SUFFIXES = {"h", "c", "py", "pyi", "so", "md", "cu", "cuh"}  # qwen3layer.h is a header, not a name
FLAG = re.compile(r"(?<![\w-])(--[a-z][a-z0-9-]*)")


def read(path):
    with open(path, encoding="utf-8") as f:
        return f.read()


def inline_spans(text):
    """the inline code of a page, fenced blocks left out"""
    return SPAN.findall(FENCE.sub("", text))


def fenced_blocks(text):
    return FENCE.findall(text)


def module(name):
    """the module, or None where it does not exist (qwen3layer.testing before it is written)"""
    try:
        return importlib.import_module(name)
    except ModuleNotFoundError as e:
        if e.name == name:
            return None
        raise


def exported(mod):
    """a module's public names: __all__, else the functions and classes it defines"""
    if hasattr(mod, "__all__"):
        return list(mod.__all__)
    return [n for n, v in vars(mod).items() if not n.startswith("_") and (inspect.isfunction(v) or inspect.isclass(v))
            and getattr(v, "__module__", None) == mod.__name__]


def own_classes(cls):
    return [k for k in cls.__mro__ if k.__module__.partition(".")[0] == "qwen3layer"]


def self_attributes(cls):
    """names a class's methods assign on self (self.x = ..., self.__dict__["x"] = ...)"""
    names = set()
    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(cls)))
    except (OSError, TypeError):  # a C type
        return names
    for node in ast.walk(tree):
        targets = node.targets if isinstance(node, ast.Assign) else \
            [node.target] if isinstance(node, (ast.AnnAssign, ast.AugAssign)) else []
        for t in [e for t in targets for e in (t.elts if isinstance(t, ast.Tuple) else [t])]:
            if isinstance(t, ast.Attribute) and isinstance(t.value, ast.Name) and t.value.id == "self":
                names.add(t.attr)
            elif (isinstance(t, ast.Subscript) and isinstance(t.value, ast.Attribute) and t.value.attr == "__dict__"
                  and isinstance(t.slice, ast.Constant) and isinstance(t.slice.value, str)):
                names.add(t.slice.value)
    return names


def members(cls):
    """a class's public members: its own and its qwen3layer bases', fields and self attributes"""
    names = set()
    for k in own_classes(cls):
        names |= set(vars(k)) | self_attributes(k)
    if dataclasses.is_dataclass(cls):
        names |= {f.name for f in dataclasses.fields(cls)}
    names |= set(getattr(cls, "_fields", ()))  # a NamedTuple's
    return sorted(n for n in names if not n.startswith("_"))


def public_api():
    """(spellings, classes): each module name -> its callable object, each class -> doc name"""
    names, classes = {}, []
    for modname in MODULES:
        mod = module(modname)
        if mod is None:
            continue
        for n in exported(mod):
            obj = getattr(mod, n)
            names[f"{modname}.{n}"] = obj
            if inspect.isclass(obj):
                classes.append(obj)
    for path in RESULT_TYPES:
        modname, _, n = path.rpartition(".")
        classes.append(getattr(importlib.import_module(modname), n))
    doc = {cls: DOC_NAMES.get(f"{cls.__module__}.{cls.__qualname__}", cls.__name__) for cls in classes}
    return names, doc


NAMES, CLASSES = public_api()


def spellings(path):
    """the ways the docs may write a module path: qwen3layer.cuda.x, q3.cuda.x; qwen3layer.torch.x, q3t.x"""
    out = [path]
    for alias, full in ALIASES.items():
        if path == full or path.startswith(full + "."):
            out.append(alias + path[len(full):])
    return out


def class_spellings(cls):
    name = CLASSES[cls]
    return spellings(name) if "." in name else [name]


def member_regex(spelled):
    return re.compile(r"(?<![\w.])" + re.escape(spelled) + r"(?!\w)")


def documented(spans, spelled):
    rx = member_regex(spelled)
    return any(rx.search(s) for s in spans)


def call_words(spans, spelled):
    """the words inside the parentheses after `spelled(` in every span naming it so"""
    rx = re.compile(r"(?<![\w.])" + re.escape(spelled) + r"\(")
    words = set()
    for s in spans:
        for m in rx.finditer(s):
            depth, i = 1, m.end()
            while i < len(s) and depth:
                depth += {"(": 1, ")": -1}.get(s[i], 0)
                i += 1
            words |= set(re.findall(r"\w+", s[m.end():i]))
    return words


def parameters(fn):
    """the names a caller passes, or None where the callable has no signature"""
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError):
        return None
    return [p.name for p in sig.parameters.values()
            if p.name not in ("self", "cls") and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]


def callables():
    """(spellings of the callable, the callable, what it is called in an error) for every public
    function, method and constructor"""
    out, seen = [], {}
    for path, obj in NAMES.items():  # q3.cost_model, qwen3layer.analysis.costs.cost_model: one callable
        if inspect.isfunction(obj) or inspect.isbuiltin(obj):
            if id(obj) in seen:
                seen[id(obj)][0].extend(spellings(path))
                continue
            seen[id(obj)] = (spellings(path), obj, path)
            out.append(seen[id(obj)])
    for cls in CLASSES:
        init = vars(cls).get("__init__")
        if inspect.isfunction(init) and not dataclasses.is_dataclass(cls):  # a constructor of its own
            out.append((class_spellings(cls), init, f"{CLASSES[cls]}()"))
        for n in members(cls):
            raw = inspect.getattr_static(cls, n, None)
            fn = raw.__func__ if isinstance(raw, (classmethod, staticmethod)) else raw
            if inspect.isfunction(fn) or inspect.ismethoddescriptor(fn) and callable(fn):
                out.append(([f"{s}.{n}" for s in class_spellings(cls)], getattr(cls, n), f"{CLASSES[cls]}.{n}"))
    return out


def page_spans(pages):
    spans = []
    for p in pages:
        spans += inline_spans(read(p))
    return spans


def subcommands():
    """command -> its flags (argparse's option strings, --help left out)"""
    parser = cli.build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return {name: {o for a in p._actions for o in a.option_strings if o.startswith("--") and o != "--help"}
            for name, p in sub.choices.items()}


def flag_table(text):
    """(flag, commands) of each row of the flag table: a row whose first cell starts with `--`"""
    rows = []
    for line in text.split("\n"):
        cells = [c.strip() for c in line.strip().strip("|").split("|")] if line.lstrip().startswith("|") else []
        if len(cells) >= 2 and cells[0].startswith("`--"):
            flags = FLAG.findall(" ".join(SPAN.findall(cells[0])))
            rows.append((flags[0], set(re.findall(r"(?<![\w-])[a-z][a-z-]*(?![\w-])", cells[1])) & set(subcommands())))
    return rows


# ---- checks: each returns its problems, so that the tests below and the planted cases share them ----

def undocumented_names(spans):
    missing = []
    paths = {}  # an object several modules export (q3.cost_model, qwen3layer.analysis.costs...) is named once
    for path, obj in NAMES.items():
        paths.setdefault(id(obj), []).append(path)
    bare = {s.strip() for s in spans}
    for group in paths.values():
        obj = NAMES[group[0]]
        if inspect.isclass(obj) and CLASSES[obj] in bare:  # a class may be named alone: `Stage`
            continue
        if not any(p in ALLOWED or documented(spans, s) for p in group for s in spellings(p)):
            missing.append(" or ".join(f"`{p}`" for p in group))
    for cls in CLASSES:
        for n in members(cls):
            name = f"{CLASSES[cls]}.{n}"
            if name not in ALLOWED and not any(documented(spans, f"{s}.{n}") for s in class_spellings(cls)):
                missing.append(f"`{name}`")
    return missing


def undocumented_parameters(spans):
    missing = []
    for spelled, fn, name in callables():
        if name in ALLOWED:
            continue
        params = parameters(fn)
        if params is None:
            missing.append(f"{name}: no signature to check (give the C function a text signature)")
            continue
        words = set().union(*(call_words(spans, s) for s in spelled))
        lost = [p for p in params if p not in words]
        if lost:
            missing.append(f"{name}: {', '.join(lost)} (write `{spelled[0]}({', '.join(params)})`)")
    return missing


def undocumented_flags(cli_text):
    rows = flag_table(cli_text)
    missing = []
    for command, flags in subcommands().items():
        for flag in sorted(flags):
            if not any(f == flag and command in cmds for f, cmds in rows):
                missing.append(f"{command} {flag}")
    return missing


def resolves(path):
    """whether a dotted path under qwen3layer names something where it says: a module that
    `import` finds at that path, an attribute or a member"""
    parts = path.split(".")
    obj = importlib.import_module(parts[0])
    for i, part in enumerate(parts[1:], 1):
        dotted = ".".join(parts[:i + 1])
        if hasattr(obj, part):
            obj = getattr(obj, part)
            if inspect.ismodule(obj) and module(dotted) is not obj:
                return False  # a module its package holds that `import dotted` does not find
        elif inspect.ismodule(obj) and module(dotted) is not None:
            obj = importlib.import_module(dotted)
        elif inspect.isclass(obj) and part in members(obj):
            return True  # an instance attribute: nothing further to follow
        else:
            return False
    return True


def doc_references(text):
    """(path, Class.member) references of one page, inline code and fenced blocks alike"""
    code = inline_spans(text) + fenced_blocks(text)
    paths, attrs = set(), set()
    for s in code:
        for alias, rest in PATH.findall(s):
            if rest.rpartition(".")[2] not in FILE_SUFFIXES:
                paths.add(ALIASES.get(alias, alias) + rest)
        for mod, names in FROM_IMPORT.findall(s):  # from qwen3layer.a import b, c as d: a.b and a.c
            paths.update(f"{mod}.{n.split()[0]}" for n in names.split(","))
        for cls, name in CLASSES.items():
            if "." in name:
                continue
            for m in re.finditer(r"(?<![\w.])" + re.escape(name) + r"\.(\w+)", s):
                attrs.add((cls, m.group(1)))
    return paths, attrs


def stale_references(pages):
    stale = []
    for page in pages:
        paths, attrs = doc_references(read(page))
        where = os.path.basename(page)
        stale += [f"{where}: `{p}`" for p in sorted(paths) if not resolves(p)]
        stale += [f"{where}: `{CLASSES[c]}.{m}`" for c, m in sorted(attrs, key=str)
                  if m not in members(c) and not hasattr(c, m)]
    return stale


def stale_flags(pages, cli_text):
    commands = subcommands()
    every = set().union(*commands.values())
    stale = []
    for page in pages:
        for s in inline_spans(read(page)) + fenced_blocks(read(page)):
            for m in re.finditer(r"python -m qwen3layer ([\w-]+)([^\n`]*)", s):
                known = commands.get(m.group(1))
                if known is None:
                    stale.append(f"{os.path.basename(page)}: `python -m qwen3layer {m.group(1)}`: no such command")
                    continue
                stale += [f"{os.path.basename(page)}: `{m.group(1)} {f}`" for f in FLAG.findall(m.group(2))
                          if f not in known and f != "--help"]
    for s in inline_spans(cli_text):
        if s.startswith("--"):
            stale += [f"cli.md: `{f}`" for f in FLAG.findall(s) if f not in every]
    for flag, cmds in flag_table(cli_text):
        stale += [f"cli.md's flag table: `{c} {flag}`" for c in sorted(cmds) if flag not in commands[c]]
    return stale
