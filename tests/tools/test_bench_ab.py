"""benchmarks/bench_ab.py, what it checks and compares (not its timings): the two sides' outputs
of the same input are compared, 0 where both run the same code, not 0 where the CPU paths
round differently; what it cannot compare is refused, naming the argument."""
import os
import subprocess
import sys

import pytest

import qwen3layer as q3

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..")
BENCH = os.path.join(ROOT, "benchmarks", "bench_ab.py")
QUICK = ["--small", "--contexts", "20", "--batches", "2", "--prefill-tokens", "24", "--decode-rounds", "2",
         "--prefill-rounds", "1"]


def run(*args):
    return subprocess.run([sys.executable, BENCH, *args], capture_output=True, text=True, timeout=300)


def differences(out):
    """{row: max |A - B|} of the table's rows"""
    rows = {}
    for line in out.splitlines():
        cells = [c.strip() for c in line.split("|")]
        if len(cells) == 7 and cells[0].startswith(("decode", "prefill")):
            rows[cells[0]] = float(cells[6])
    return rows


def test_one_path_against_itself_gives_the_same_bits():
    path = q3.build_info()["cpu_path"]
    r = run("--paths", f"{path},{path}", *QUICK)
    assert r.returncode == 0, r.stderr
    got = differences(r.stdout)
    assert set(got) == {"decode, context 20", "decode, 2 sequences at 512", "prefill, 24 tokens"}
    assert all(d == 0 for d in got.values()), got


@pytest.mark.skipif(q3.build_info()["cpu_paths"] == ["portable"], reason="this CPU runs the portable kernels only")
def test_two_paths_that_round_differently_show_the_difference():
    """bf16: the portable path and the CPU's best sum in other orders (and the bf16 dot
    products round x first): outputs a few bf16 roundings apart, well under 1"""
    best = q3.build_info()["cpu_paths"][-1]
    r = run("--paths", f"portable,{best}", *QUICK)
    assert r.returncode == 0, r.stderr
    got = differences(r.stdout)
    assert len(got) == 3 and all(0 < d < 1 for d in got.values()), got


@pytest.mark.parametrize("args,needle", [
    (["--paths", "portable"], "--paths portable: expected two of this CPU's paths"),
    (["--paths", "portable,nosuch"], "expected two of this CPU's paths"),
    (["--base", ROOT], "that is this checkout"),
    (["--base", os.path.join(ROOT, "docs")], "no qwen3layer/__init__.py there"),
    (["--base-rev", "no-such-rev"], "--base-rev no-such-rev: not a commit of the repository"),
])
def test_what_it_cannot_compare_is_refused(args, needle):
    r = run(*args)
    assert r.returncode != 0 and needle in r.stderr, r.stderr
