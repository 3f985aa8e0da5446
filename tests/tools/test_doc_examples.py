"""Every Python block of README.md and docs/*.md runs, as doctest would run a page, so that the
next example that is false (a name the package lost, a call it refuses, a repr that raises)
fails CI. The reading and running are tests/helpers/doc_examples.py's. The rules:

- which blocks: every ```python fence. A block is not run only where the nearest non-blank
  line above its fence is `<!-- not run: REASON -->` (it needs a GPU, a checkpoint folder,
  several processes, or minutes); NOT_RUN below counts them a page, so a new skip shows in the
  change that makes it;
- in order, one namespace a page, in a process of its own a page (q3.cuda.emulate() holds for
  the rest of a process), its working directory a temporary folder;
- at tiny geometry: `LayerConfig.qwen3_235b_a22b()` becomes `LayerConfig.tiny()` before a
  block runs; the examples read their sizes from the config (`cfg.hidden_size`), never a
  literal 4096;
- the reader's own objects a page takes as given (docs/torch_dropin.md's `model`, `ids`,
  `mask`) are made small by doc_examples.given;
- each top-level expression's value is shown as a REPL or a notebook would (repr, and its
  HTML or SVG where it has one); the `test_*` functions a block defines (a pytest file's
  tests, taking no fixtures) are called after it."""
import json
import os
import subprocess
import sys

import pytest

import doc_examples
from doc_examples import PAGES, blocks

# the blocks each page marks not run (and why, in its marker): a page's count changes only with
# a marker added or removed
NOT_RUN = {
    "README.md": 1,            # a GPU and a checkpoint: the split over a GPU and the host
    "docs/checkpoints.md": 3,  # a checkpoint folder (tests/io/test_checkpoint.py writes and loads one)
    "docs/cuda.md": 1,         # a GPU: a decode graph (tests/executor/test_cuda_executor.py replays one)
    "docs/hybrid.md": 1,       # a GPU and a checkpoint
    "docs/parallel.md": 2,     # several processes (tests/parallel runs them)
    "docs/simt.md": 1,         # a minute: every kernel's cases (tests/executor and simt_check.py run them)
}

RUNNABLE = {page: sum(b.not_run is None for b in blocks(page)) for page in PAGES}


def test_the_blocks_marked_not_run_are_the_ones_listed():
    skipped = {page: [b for b in blocks(page) if b.not_run is not None] for page in PAGES}
    assert {page: len(b) for page, b in skipped.items() if b} == NOT_RUN
    assert sum(RUNNABLE.values()) > 0, "no Python block of the docs runs"


@pytest.mark.parametrize("page", [p for p in PAGES if RUNNABLE[p]],
                         ids=lambda p: f"{p}-{RUNNABLE[p]}-run-{NOT_RUN.get(p, 0)}-not-run")
def test_the_pages_python_blocks_run(page, tmp_path):
    r = subprocess.run([sys.executable, doc_examples.__file__, page], cwd=tmp_path, capture_output=True,
                       text=True, timeout=600)
    assert r.returncode == 0, f"a block of {page} failed:\n{r.stderr[-6000:]}"
    assert json.loads(r.stdout.strip().splitlines()[-1]) == {"ran": RUNNABLE[page]}
