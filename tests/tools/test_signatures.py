"""The extension's own signatures (the first line of each C docstring, which help() and
inspect.signature read) name the parameters the C code parses, as the type stubs do: a
parameter added to a call and not to its docstring or stub shows here."""
import ast
import inspect
import os

import pytest

import qwen3layer as q3
from qwen3layer import _C

STUB = os.path.join(os.path.dirname(q3.__file__), "_C.pyi")


def _stubbed():
    """{qualified name: [(parameter, kind)]} of every function and method of _C.pyi"""
    with open(STUB) as f:
        tree = ast.parse(f.read())
    out = {}

    def params(fn):
        a = fn.args
        names = [(p.arg, "positional") for p in a.posonlyargs + a.args if p.arg != "self"]
        return names + [(p.arg, "keyword") for p in a.kwonlyargs]

    for node in tree.body:
        if isinstance(node, ast.FunctionDef):
            out[node.name] = params(node)
        elif isinstance(node, ast.ClassDef):
            for item in node.body:
                if isinstance(item, ast.FunctionDef) and not item.name.startswith("__"):
                    out[f"{node.name}.{item.name}"] = params(item)
    return out


STUBBED = _stubbed()


def _runtime(qualname):
    obj = _C
    for part in qualname.split("."):
        obj = getattr(obj, part)
    return obj


@pytest.mark.parametrize("qualname", sorted(STUBBED))
def test_the_docstring_signature_names_the_stubs_parameters(qualname):
    obj = _runtime(qualname)
    if isinstance(obj, property) or not callable(obj) or type(obj).__name__ == "getset_descriptor":
        pytest.skip(f"{qualname} is an attribute")
    sig = inspect.signature(obj)  # raises ValueError when the C docstring has no valid signature line
    got = [(p.name, "keyword" if p.kind is p.KEYWORD_ONLY else "positional") for p in sig.parameters.values()
           if p.name not in ("self", "$self", "module", "$module")]
    assert got == STUBBED[qualname], f"{qualname}: C docstring {got}, stub {STUBBED[qualname]}"
