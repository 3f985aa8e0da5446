"""The Python blocks of README.md and docs/*.md, and a runner of one page's blocks (run as
`python tests/helpers/doc_examples.py PAGE`, in a process of its own: a page may call
q3.cuda.emulate(), which holds for the rest of its process). tests/tools/test_doc_examples.py
says which blocks run and how; this file does the reading and the running.

The runner runs a page's blocks in order in one namespace, each top-level statement as a
REPL or a notebook cell would: an expression's value is shown (repr, and _repr_html_ /
_repr_svg_ where it has them), so a repr that raises fails too; where the expression's comment
opens with a Python literal (`cache.lengths  # (513,)`, `q3.cuda.emulated()  # True: ...`),
the value must equal it, as doctest compares a shown value. Tracebacks name the page and
its own line numbers. Its last line of output is a JSON object {"ran": n} once every block ran."""
import ast
import inspect
import io
import json
import os
import re
import sys
import tokenize
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Tuple

ROOT = os.path.normpath(os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))
PAGES = ["README.md"] + sorted("docs/" + f for f in os.listdir(os.path.join(ROOT, "docs")) if f.endswith(".md"))

NOT_RUN = re.compile(r"^<!-- not run: (\S.*\S) -->$")  # the line above a fence: why the block is not run
REAL = "LayerConfig.qwen3_235b_a22b()"
TINY = "LayerConfig.tiny()"


@dataclass
class Block:
    page: str
    line: int            # the page's line number of the block's first line of code
    code: str
    not_run: Optional[str]  # the marker's reason, None for a block that runs


def blocks(page: str) -> List[Block]:
    """every ```python fence of the page, with the reason of a `<!-- not run: ... -->` marker on
    the nearest non-blank line above it"""
    with open(os.path.join(ROOT, page), encoding="utf-8") as f:
        lines = f.read().split("\n")
    out, i = [], 0
    while i < len(lines):
        if lines[i].strip() == "```python":
            end = next(j for j in range(i + 1, len(lines)) if lines[j].strip().startswith("```"))
            above = next((lines[j].strip() for j in range(i - 1, -1, -1) if lines[j].strip()), "")
            marker = NOT_RUN.match(above)
            out.append(Block(page, i + 2, "\n".join(lines[i + 1:end]), marker.group(1) if marker else None))
            i = end
        i += 1
    return out


def given(page: str) -> Dict[str, object]:
    """the names a page's blocks take as the reader's own (a model and its inputs), made small"""
    if page == "docs/torch_dropin.md":
        from hf_reference import left_padded, tiny_model

        ids, mask = left_padded([5, 3], 5, seed=0)
        return {"model": tiny_model(seed=0), "ids": ids, "mask": mask}
    return {}


def show(value: object) -> None:
    """what a REPL or a notebook does with an expression's value"""
    repr(value)
    for name in ("_repr_html_", "_repr_svg_"):
        if hasattr(type(value), name):
            getattr(value, name)()


def comments(source: str) -> Dict[int, str]:
    """line number -> the text of the comment that ends it"""
    lines = io.StringIO(source).readline
    return {t.start[0]: t.string[1:].strip() for t in tokenize.generate_tokens(lines) if t.type == tokenize.COMMENT}


def stated(comment: str) -> Tuple[bool, Any]:
    """the value an expression's comment states, where it opens with a Python literal (the whole
    comment, or what comes before its first ': '): (True, value); else (False, None)"""
    for text in (comment, comment.split(": ", 1)[0]):
        try:
            return True, ast.literal_eval(text)
        except (ValueError, SyntaxError, TypeError, MemoryError, RecursionError):
            pass
    return False, None


def run(block: Block, namespace: dict) -> None:
    source = "\n" * (block.line - 1) + block.code.replace(REAL, TINY)  # the page's own line numbers
    said = comments(source)
    before = set(namespace)
    for stmt in ast.parse(source, filename=block.page).body:
        if isinstance(stmt, ast.Expr):
            value = eval(compile(ast.Expression(stmt.value), block.page, "eval"), namespace)
            show(value)
            literal, want = stated(said.get(stmt.end_lineno, ""))
            if literal and value != want:
                raise AssertionError(f"{block.page}:{stmt.end_lineno}: the expression is {value!r}; its comment "
                                     f"says {want!r}")
        else:
            exec(compile(ast.Module([stmt], type_ignores=[]), block.page, "exec"), namespace)
    # a pytest file's tests (test_* functions of no arguments), called as pytest would
    for name in sorted(set(namespace) - before):
        if name.startswith("test_") and callable(namespace[name]):
            if inspect.signature(namespace[name]).parameters:
                raise TypeError(f"{block.page}:{block.line}: {name} takes arguments (fixtures): "
                                "write its example without them, or mark the block not run")
            namespace[name]()


def main(page: str) -> int:
    import matplotlib

    matplotlib.use("Agg")  # a block's plot draws off screen
    sys.path.insert(0, ROOT)
    namespace = {"__name__": "__doc_example__"}
    namespace.update(given(page))
    ran = 0
    for block in blocks(page):
        if block.not_run is None:
            run(block, namespace)
            ran += 1
    print(json.dumps({"ran": ran}))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
