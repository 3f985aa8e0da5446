"""The CPU op harness (csrc/check/cpu_ops/, the program benchmarks/cpu_ops_check.py builds from
the sources): every op of the CPU kernel table (kernels/cpu/ops.h) on every CPU path this
machine runs, against the portable path, at odd sizes; "not supported on this CPU" for the
others; a run that compared nothing fails, as one where only portable runs does (portable
against itself proves nothing). A planted defect (--plant) must fail exactly where it was
planted: the comparisons are tight enough to see one element three tolerances off."""
import os
import re
import shutil
import subprocess
import sys

import pytest

import qwen3layer as q3

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..")
PATHS = q3.build_info()["cpu_paths"]
LEVELS = ["portable", "avx2", "avx512", "avx512bf16", "amx"]  # csrc/engine/cpu_dispatch.c's, lowest first
ROW = re.compile(r"^(\w+) +(\w+) +(\d+) cases +worst err/tol +(\S+) +(OK|FAIL)", re.M)
ONLY_PORTABLE = "only the portable path runs here: nothing to compare it with (the harness fails so)"


def read(*path):
    with open(os.path.join(ROOT, *path), encoding="utf-8") as f:
        return f.read()


def table_ops():
    """the kernels of q3_cpu_ops (kernels/cpu/ops.h), by field name"""
    struct = re.search(r"typedef struct \{(.*?)\} q3_cpu_ops;", read("kernels", "cpu", "ops.h"), re.S).group(1)
    return re.findall(r"q3_\w+_fn \*(\w+);", struct)


def environment():
    env = dict(os.environ)
    env.pop("LD_PRELOAD", None)  # under .ci/sanitize: the program and its compiler are not instrumented
    return env


@pytest.fixture(scope="module")
def program():
    r = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "cpu_ops_check.py"), "--build-only"],
                       capture_output=True, text=True, timeout=1200, env=environment())
    assert r.returncode == 0, r.stdout + r.stderr
    return r.stdout.split()[-1]


def run(program, *args):
    """the program's exit status, output and rows {(path, op): (cases, worst err/tol, OK|FAIL)}"""
    return run_command([program, *args])


def run_command(command):
    r = subprocess.run(command, capture_output=True, text=True, timeout=600, env=environment())
    rows = {(m[1], m[2]): (int(m[3]), float(m[4]), m[5]) for m in ROW.finditer(r.stdout)}
    return r.returncode, r.stdout + r.stderr, rows


def test_the_harness_has_a_case_for_every_kernel_of_the_table():
    ops = re.findall(r'^    \{"(\w+)", ops_\w+\},', read("csrc", "check", "cpu_ops", "main.c"), re.M)
    assert len(table_ops()) >= 19 and set(table_ops()) <= set(ops), set(table_ops()) - set(ops)
    assert "e4m3_decode" in ops  # the FP8 decoders, every code, through matmul_fp8's GEMV and dequantization


@pytest.mark.skipif(PATHS == ["portable"], reason=ONLY_PORTABLE)
def test_every_op_on_every_path_agrees_with_portable(program):
    rc, out, rows = run(program)
    assert rc == 0, out
    ops = set(table_ops()) | {"e4m3_decode"}
    for path in LEVELS:
        if path == "portable":
            assert "portable   the reference: not compared (against itself)" in out, out
        elif path not in PATHS:
            assert f"{path:<10} not supported on this CPU" in out and not any(p == path for p, _ in rows), out
        else:
            for op in ops:
                cases, worst, verdict = rows[(path, op)]
                assert cases > 0 and worst <= 1.0 and verdict == "OK", (path, op, rows[(path, op)])
    assert {p for p, _ in rows} == set(PATHS[1:])
    assert f"compared {len(ops) * (len(PATHS) - 1)} ops on {len(PATHS) - 1} paths" in out and "0 failed: OK" in out, out


@pytest.mark.skipif(PATHS == ["portable"], reason=ONLY_PORTABLE)
def test_a_planted_defect_fails_exactly_where_it_was_planted(program):
    """every op of the best path planted, and rope of the lowest vector path: each of them fails
    (one element three tolerances off, or one bit flipped for the exact ops), nothing else"""
    best, low = PATHS[-1], PATHS[1]
    rc, out, rows = run(program, "--plant", f"*:{best},rope:{low}")
    assert rc == 1 and rows, out
    for (path, op), (cases, worst, verdict) in rows.items():
        planted = path == best or (path, op) == (low, "rope")
        assert cases > 0 and (verdict == "FAIL" and worst > 1.0) == planted and (verdict == "OK") != planted, \
            (path, op, rows[(path, op)])
    planted = len(table_ops()) + 1 + (low != best)
    assert f"against portable: {planted} failed: FAIL" in out, out


def test_portable_alone_compares_nothing_and_fails(program):
    """the other paths hidden (as on a CPU without them; on a machine with portable alone, the
    plain run): every other level "not supported on this CPU", no op row, and a failure"""
    rc, out, rows = run(program, *(["--hide", ",".join(PATHS[1:])] if len(PATHS) > 1 else []))
    assert rc == 1 and not rows, out
    for path in LEVELS[1:]:
        assert f"{path:<10} not supported on this CPU" in out, out
    assert "compared nothing: no path but portable runs here, and portable against itself is no comparison: FAIL" \
        in out, out


@pytest.mark.parametrize("plant", ["foo:avx2", "matmul:portable", "matmul", "rope:avx2,"])
def test_a_plant_that_names_no_op_or_path_is_refused(program, plant):
    rc, out, rows = run(program, "--plant", plant)
    assert rc == 2 and not rows and "--plant: expected OP:PATH[,OP:PATH...], OP an op of the harness or *" in out, out


AARCH64_CC, QEMU = "aarch64-linux-gnu-gcc", "qemu-aarch64"


@pytest.fixture(scope="module")
def aarch64_program():
    """the harness cross-built for aarch64 with Debian's toolchain (an AArch64 ELF)"""
    r = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "cpu_ops_check.py"), "--build-only",
                        "--cc", AARCH64_CC, "--machine", "aarch64"], capture_output=True, text=True, timeout=1200,
                       env=environment())
    assert r.returncode == 0, r.stdout + r.stderr
    built = r.stdout.split()[-1]
    assert built.endswith(os.path.join("aarch64", "cpu_ops_check"))
    with open(built, "rb") as f:
        header = f.read(20)
    assert header[:4] == b"\x7fELF" and int.from_bytes(header[18:20], "little") == 183  # EM_AARCH64
    return built


def under_qemu(program, cpu, *args):
    """run() of the aarch64 program under qemu-user, emulating `cpu`; its libraries from the
    cross toolchain's target folder (Debian's: <prefix>/aarch64-linux-gnu beside <prefix>/bin)"""
    target = os.path.join(os.path.dirname(os.path.dirname(shutil.which(AARCH64_CC))), "aarch64-linux-gnu")
    return run_command([QEMU, "-cpu", cpu, "-L", target, program, *args])


needs_qemu = pytest.mark.skipif(not (shutil.which(AARCH64_CC) and shutil.which(QEMU)),
                                reason=f"no {AARCH64_CC} and {QEMU} here (Debian's gcc-aarch64-linux-gnu and "
                                       "qemu-user; .ci/run installs them)")


@needs_qemu
def test_the_neon_bf16_path_runs_every_op_against_portable_under_qemu(aarch64_program):
    """issue 43's proof without ARM hardware: on an emulated CPU with BF16 (qemu's `max`), the
    neon_bf16 level (portable's ops, bf16 products on BFDOT) is compared with portable, op by op,
    within the bf16 paths' tolerance; the x86 levels are not listed on aarch64"""
    rc, out, rows = under_qemu(aarch64_program, "max")
    assert rc == 0, out
    assert {path for path, _ in rows} == {"neon_bf16"} and len(rows) >= 19, out
    assert all(result == "OK" and cases > 0 for cases, _, result in rows.values()), out
    assert rows[("neon_bf16", "matmul")][0] >= 100  # its bf16-scratch cases are BFDOT's
    assert not any(level in out for level in LEVELS[1:]), out


@needs_qemu
def test_a_cpu_without_bf16_runs_portable_alone_and_a_planted_defect_fails_under_qemu(aarch64_program):
    """a Cortex-A72 (ARMv8.0, no BF16): neon_bf16 "not supported on this CPU", nothing compared,
    a failure; on `max`, a defect planted in neon_bf16's matmul fails there and nowhere else"""
    rc, out, rows = under_qemu(aarch64_program, "cortex-a72")
    assert rc == 1 and not rows, out
    assert "neon_bf16  not supported on this CPU" in out
    assert "compared nothing: no path but portable runs here" in out
    rc, out, rows = under_qemu(aarch64_program, "max", "--plant", "matmul:neon_bf16")
    assert rc == 1, out
    assert [key for key, row in rows.items() if row[2] == "FAIL"] == [("neon_bf16", "matmul")], out
