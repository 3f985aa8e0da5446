"""Every public name, parameter and CLI flag against docs/, both ways (what "appears" means and
how the names are found: tests/helpers/public_names.py), and the checks shown to catch a name
planted on either side. Reads files and imports the package; runs nothing."""
import argparse
import types

import pytest

import qwen3layer

from public_names import (ALLOWED, CLASSES, CLI_PAGE, DOCS, NAMES, README, members, page_spans, read, resolves,
                          stale_flags, stale_references, undocumented_flags, undocumented_names,
                          undocumented_parameters)
from qwen3layer import cli


def test_every_public_name_is_documented():
    missing = undocumented_names(page_spans(DOCS))
    assert not missing, "public names no docs/*.md page names in inline code: " + ", ".join(missing)


def test_every_parameter_is_documented():
    missing = undocumented_parameters(page_spans(DOCS))
    assert not missing, "parameters no documented signature names:\n" + "\n".join(missing)


def test_every_cli_flag_is_documented():
    missing = undocumented_flags(read(CLI_PAGE))
    assert not missing, "flags docs/cli.md's flag table does not list for the command: " + ", ".join(missing)


def test_every_documented_name_exists():
    stale = stale_references([README] + DOCS)
    assert not stale, "names the docs give that the code does not have:\n" + "\n".join(stale)


def test_every_documented_flag_exists():
    stale = stale_flags([README] + DOCS, read(CLI_PAGE))
    assert not stale, "flags the docs give that the commands do not take:\n" + "\n".join(stale)


def test_allowed_names_exist():
    """an allowance outliving its name would hide nothing but mislead"""
    for name in ALLOWED:
        if name.endswith("()"):
            cls = next(c for c, n in CLASSES.items() if n == name[:-2])
            assert "__init__" in vars(cls), name
            continue
        head, _, member = name.rpartition(".")
        cls = next(c for c, n in CLASSES.items() if n == head)
        assert member in members(cls), name


def test_doc_names_are_unique():
    """two classes under one name could not be told apart in the docs: DOC_NAMES must separate them"""
    names = list(CLASSES.values())
    assert len(names) == len(set(names)), sorted(n for n in names if names.count(n) > 1)


# ---- the checks catch what they are for: names planted on either side ----

def test_a_planted_public_name_is_caught(monkeypatch):
    spans = page_spans(DOCS)

    class Planted:
        def frobnicate(self, level):
            """a public method no page names"""

    Planted.__module__ = "qwen3layer.planted"  # members() takes a class's own and its qwen3layer bases' names

    monkeypatch.setitem(CLASSES, Planted, "Planted")
    monkeypatch.setitem(NAMES, "qwen3layer.cuda.planted_function", lambda depth: None)
    missing = undocumented_names(spans)
    assert "`qwen3layer.cuda.planted_function`" in missing and "`Planted.frobnicate`" in missing
    spans.append("q3.cuda.planted_function(depth)")  # the alias counts
    assert "`qwen3layer.cuda.planted_function`" not in undocumented_names(spans)
    spans.append("Planted.frobnicate()")  # named, but without its parameter
    assert any(m.startswith("Planted.frobnicate: level") for m in undocumented_parameters(spans))
    spans.append("Planted.frobnicate(level)")
    assert not any(m.startswith("Planted.frobnicate") for m in undocumented_parameters(spans))


def test_a_planted_flag_is_caught(monkeypatch):
    build = cli.build_parser

    def planted():
        p = build()
        sub = next(a for a in p._actions if isinstance(a, argparse._SubParsersAction))
        sub.choices["map"].add_argument("--planted-flag")
        return p

    monkeypatch.setattr(cli, "build_parser", planted)
    assert undocumented_flags(read(CLI_PAGE)) == ["map --planted-flag"]


def test_a_planted_doc_of_a_missing_name_is_caught(tmp_path):
    page = tmp_path / "planted.md"
    page.write_text("`q3.cuda.no_such_function()`, `KVCache.no_such_member`, `KVCache.lengths`,\n"
                    "`qwen3layer.torch.patch_model`, `python -m qwen3layer check --no-such-flag`\n\n"
                    "```python\nq3.DecoderLayer.no_such_method(1)\n```\n")
    stale = stale_references([str(page)])
    assert stale == ["planted.md: `qwen3layer.DecoderLayer.no_such_method`",
                     "planted.md: `qwen3layer.cuda.no_such_function`", "planted.md: `KVCache.no_such_member`"]
    assert stale_flags([str(page)], "| `--json` | map |\n") == [
        "planted.md: `check --no-such-flag`", "cli.md's flag table: `map --json`"]


def test_a_planted_import_of_a_missing_name_is_caught(tmp_path, monkeypatch):
    """a from-import's names are checked in the module it names, and a module is checked where
    `import` finds it: one set only as its package's attribute is not importable by that path"""
    monkeypatch.setattr(qwen3layer, "attribute_only", types.ModuleType("qwen3layer.attribute_only"), raising=False)
    page = tmp_path / "planted.md"
    page.write_text("`from qwen3layer.analysis.costs import cost_model, no_such_model`\n\n"
                    "```python\nfrom qwen3layer.costs import (experts_hit,\n"
                    "                              no_such_count as n)\nimport qwen3layer.attribute_only\n```\n")
    assert stale_references([str(page)]) == ["planted.md: `qwen3layer.analysis.costs.no_such_model`",
                                             "planted.md: `qwen3layer.attribute_only`",
                                             "planted.md: `qwen3layer.costs.no_such_count`"]


@pytest.mark.parametrize("path", ["qwen3layer.cuda.device_count", "qwen3layer._C.take_rows",
                                  "qwen3layer.torch.patch_model", "qwen3layer.KVCache.all_keys",
                                  "qwen3layer.DecoderLayer.device", "qwen3layer.DecoderLayer.gpu_experts",
                                  "qwen3layer.analysis.costs.cost_model", "qwen3layer.costs_hybrid.Machine"])
def test_real_paths_resolve(path):
    """the other way's resolver takes modules (an analysis module by its old path too: the
    package registers it), attributes and what methods assign on self"""
    assert resolves(path)
