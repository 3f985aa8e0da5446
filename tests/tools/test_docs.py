"""README.md and docs/*.md against the repository: the README stays short and keeps the line
.ci/run takes the test command from, every docs page is linked from it, every repository path
the pages name exists, and no page retypes a count that a script prints (the SIMT check's
kernels, cases and planted defects, sass_check's kernels and architectures): those drift the
day a case is added, so a page says which script prints them instead. Reads files only."""
import glob
import os
import re

import pytest

ROOT = os.path.normpath(os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))
README = os.path.join(ROOT, "README.md")
DOCS = sorted(glob.glob(os.path.join(ROOT, "docs", "*.md")))
PAGES = [README] + DOCS

TEST_COMMAND = 'pip install -e ".[test]" && python -m pytest -n auto tests'
MAIN_COMMAND = "python -m qwen3layer run"
README_MAX_LINES = 220

# Backticked words that look like paths (a '/' or a source suffix) but name no file of the
# repository: things outside it, files a build or a run writes, and words that are not paths.
NOT_REPO_PATHS = {
    "qwen3layer/libq3cuda.so",  # built by setup.py where nvcc is found
    ".ci-asan/",                # the sanitized copy .ci/sanitize makes
    "build/simt-check/",        # simt_check.py's objects
    "build/cpu-ops-check/",     # cpu_ops_check.py's objects and program
    "build/arm-python/root",    # arm_python.py's unpacked arm64 CPython (made by its setup)
    "blobs/",                   # a Hugging Face cache snapshot's folder
    "Qwen3-235B-A22B/",         # a checkpoint folder of the user's
    "Qwen3-235B-A22B-FP8/",
    "sweep.svg/png",            # files `qwen3layer map` writes
    "cu_seq_lens_q/k",          # transformers' two keyword arguments
    "Python.h",                 # CPython's header
}
SOURCE_SUFFIXES = (".py", ".c", ".h", ".cu", ".cuh", ".cpp", ".md", ".sh", ".pyi")
PATH_TOKEN = re.compile(r"^[A-Za-z0-9_.\-*/<>]+$")
INLINE_CODE = re.compile(r"`([^`\n]+)`")
LINK = re.compile(r"\[[^\]\n]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")

# a digit count of what simt_check.py or sass_check.py print, or of the planted defects
SCRIPT_COUNT = re.compile(
    r"\b\d+\s+(?:[\w-]+\s+){0,2}(?:kernels|cases|variants|functions|architectures)\b"
    r"|\b\d+\s*/\s*\d+\s+planted"
    r"|\b(?:\d+|two|three|four|five|six|seven|eight|nine|ten|eleven|twelve|thirteen|fourteen|fifteen)"
    r"\s+(?:are\s+)?(?:planted\s+)?defects\b"
    r"|\btwelve\s+are\s+planted\b", re.IGNORECASE)


def read(path: str) -> str:
    with open(path, encoding="utf-8") as f:
        return f.read()


def prose(text: str) -> str:
    """the text outside fenced code blocks (a fence's lines blanked, so line numbers stay)"""
    out, fenced = [], False
    for line in text.split("\n"):
        if line.lstrip().startswith("```"):
            fenced = not fenced
            out.append("")
            continue
        out.append("" if fenced else line)
    return "\n".join(out)


def path_tokens(text: str) -> list:
    """(line number, word) for each word of inline code outside fences that looks like a path"""
    found = []
    for n, line in enumerate(prose(text).split("\n"), 1):
        for span in INLINE_CODE.findall(line):
            for word in span.split():
                word = word.strip("\"'(),:;")
                if not PATH_TOKEN.match(word) or not re.search(r"[A-Za-z0-9]", word):
                    continue
                if "/" in word or word.endswith(SOURCE_SUFFIXES):
                    found.append((n, word))
    return found


def link_targets(text: str, anchors: bool = False) -> list:
    """(line number, target) for each markdown link outside fences that is not a URL or an
    anchor of the same page; with anchors, the target keeps its '#part'"""
    found = []
    for n, line in enumerate(prose(text).split("\n"), 1):
        for target in LINK.findall(line):
            if re.match(r"^[a-z][a-z0-9+.\-]*:", target) or target.startswith("#"):
                continue
            found.append((n, target if anchors else target.split("#", 1)[0]))
    return found


def heading_anchors(text: str) -> set:
    """the anchors GitHub gives a page's headings: lower case, punctuation dropped, spaces to '-'"""
    out = set()
    for line in prose(text).split("\n"):
        m = re.match(r"^#{1,6}\s+(.*?)\s*#*\s*$", line)
        if m:
            title = re.sub(r"`", "", m.group(1)).lower()
            out.add(re.sub(r"[^\w\- ]", "", title).replace(" ", "-"))
    return out


def exists_in_repo(word: str) -> bool:
    """word relative to the repository root: a file, a folder (a trailing '/'), or a glob
    ('*', and '<name>' placeholders read as '*') matching at least one file"""
    pattern = re.sub(r"<[^<>/]+>", "*", word)
    full = os.path.normpath(os.path.join(ROOT, pattern))
    if not (full == ROOT or full.startswith(ROOT + os.sep)):
        return False
    if "*" in pattern:
        return bool(glob.glob(full, recursive=True))
    if word.endswith("/"):
        return os.path.isdir(full)
    return os.path.exists(full)


def test_docs_folder_has_pages():
    assert DOCS, "docs/ holds no .md page"


def test_readme_is_short():
    lines = read(README).count("\n")
    assert lines <= README_MAX_LINES, f"README.md has {lines} lines, at most {README_MAX_LINES}: move depth to docs/"


def first_fenced_line_after(text: str, marker: str):
    """what .ci/run's awk takes: the first line inside the first fenced block after the marker"""
    lines = text.split("\n")
    if marker not in lines:
        return None
    fence = 0
    for line in lines[lines.index(marker) + 1:]:
        if line.startswith("```"):
            fence += 1
            continue
        if fence == 1:
            return line
    return None


def test_readme_test_command():
    text = read(README)
    lines = text.split("\n")
    assert "<!-- test-command -->" in lines, "README.md lost the <!-- test-command --> marker .ci/run reads"
    after = lines[lines.index("<!-- test-command -->") + 1]
    assert after == "```sh", f"the marker must be followed by a ```sh fence, got {after!r}"
    assert first_fenced_line_after(text, "<!-- test-command -->") == TEST_COMMAND


def test_readme_main_command_first():
    text = read(README)
    line = first_fenced_line_after(text, "<!-- main-command -->")
    assert line is not None and line.endswith(MAIN_COMMAND), f"main command block: {line!r}"
    # the two commands come before any other fenced block
    first_fences = [i for i, l in enumerate(text.split("\n")) if l.startswith("```")]
    blocks = [text.split("\n")[first_fences[2 * k] + 1] for k in range(2)]
    assert blocks[0].endswith(MAIN_COMMAND) and blocks[1] == TEST_COMMAND, blocks


@pytest.mark.parametrize("page", PAGES, ids=lambda p: os.path.relpath(p, ROOT))
def test_named_paths_exist(page):
    missing = [f"line {n}: `{w}`" for n, w in path_tokens(read(page))
               if w not in NOT_REPO_PATHS and not exists_in_repo(w)]
    assert not missing, f"{os.path.relpath(page, ROOT)} names paths that do not exist: " + "; ".join(missing)


@pytest.mark.parametrize("page", PAGES, ids=lambda p: os.path.relpath(p, ROOT))
def test_link_targets_exist(page):
    base = os.path.dirname(page)
    missing = [f"line {n}: ({t})" for n, t in link_targets(read(page))
               if not os.path.exists(os.path.normpath(os.path.join(base, t)))]
    assert not missing, f"{os.path.relpath(page, ROOT)} links to nothing: " + "; ".join(missing)


@pytest.mark.parametrize("page", PAGES, ids=lambda p: os.path.relpath(p, ROOT))
def test_link_anchors_exist(page):
    base = os.path.dirname(page)
    bad = []
    for n, target in link_targets(read(page), anchors=True):
        path, _, anchor = target.partition("#")
        full = os.path.normpath(os.path.join(base, path))
        if anchor and path.endswith(".md") and os.path.exists(full) and anchor not in heading_anchors(read(full)):
            bad.append(f"line {n}: ({target})")
    assert not bad, f"{os.path.relpath(page, ROOT)} links to headings that do not exist: " + "; ".join(bad)


def test_every_docs_page_linked_from_readme():
    linked = {os.path.normpath(os.path.join(ROOT, t)) for _, t in link_targets(read(README))}
    unlinked = [os.path.relpath(p, ROOT) for p in DOCS if os.path.normpath(p) not in linked]
    assert not unlinked, f"README.md does not link: {unlinked}"


@pytest.mark.parametrize("page", PAGES, ids=lambda p: os.path.relpath(p, ROOT))
def test_no_retyped_script_counts(page):
    hits = [f"line {n}: {m.group(0)!r}" for n, line in enumerate(read(page).split("\n"), 1)
            for m in SCRIPT_COUNT.finditer(line)]
    assert not hits, (f"{os.path.relpath(page, ROOT)} retypes a count a script prints (say which "
                      f"script prints it instead): " + "; ".join(hits))


def test_extractor_reads_what_it_should():
    """the extractor itself, on a made-up page"""
    page = ("A `kernels/cuda/*.cu` glob, `python benchmarks/simt_check.py --mutants`, `qwen3layer.torch`,\n"
            "a [link](docs/x.md#part), a [url](https://example.com), `x / y`, `a // b`.\n"
            "```\nkernels/not_checked.c\n```\n")
    assert [w for _, w in path_tokens(page)] == ["kernels/cuda/*.cu", "benchmarks/simt_check.py"]
    assert link_targets(page) == [(2, "docs/x.md")]
    assert link_targets(page, anchors=True) == [(2, "docs/x.md#part")]
    assert heading_anchors("## The layer's insides, on request\n```\n# not a heading\n```\n") == \
        {"the-layers-insides-on-request"}
    assert exists_in_repo("kernels/cuda/*.cu") and exists_in_repo("kernels/<op>.h")
    assert not exists_in_repo("kernels/cuda/no_such_kernel.cu") and not exists_in_repo("../elsewhere/notes.md")
    assert SCRIPT_COUNT.search("simt: 28 kernels, 418 cases, 12/12 planted defects caught")
    assert SCRIPT_COUNT.search("twelve are planted in the real kernels")
    assert SCRIPT_COUNT.search("the 361 kernel self-check cases on the executor")
    assert not SCRIPT_COUNT.search("three grouped kernels (gate/up, down, combine)")
