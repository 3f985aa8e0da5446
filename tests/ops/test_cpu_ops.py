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
    assert "int4_digits" in ops  # the int4 decode's activation digits, bit for bit, through matmul_int4's GEMV


@pytest.mark.skipif(PATHS == ["portable"], reason=ONLY_PORTABLE)
def test_every_op_on_every_path_agrees_with_portable(program):
    rc, out, rows = run(program)
    assert rc == 0, out
    ops = set(table_ops()) | {"e4m3_decode", "int4_digits"}
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
    planted = len(table_ops()) + 2 + (low != best)  # the table's ops, e4m3_decode and int4_digits
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


def cross_build(cc, *args, root=ROOT):
    """the harness of the sources under root cross-built for aarch64 with the compiler command cc
    (an AArch64 ELF): its path"""
    r = subprocess.run([sys.executable, os.path.join(root, "benchmarks", "cpu_ops_check.py"), "--build-only",
                        "--cc", cc, "--machine", "aarch64", *args], capture_output=True, text=True, timeout=1200,
                       env=environment())
    assert r.returncode == 0, r.stdout + r.stderr
    built = r.stdout.split()[-1]
    assert os.path.realpath(built).startswith(os.path.realpath(root)), (built, root)
    with open(built, "rb") as f:
        header = f.read(20)
    assert header[:4] == b"\x7fELF" and int.from_bytes(header[18:20], "little") == 183  # EM_AARCH64
    return built


@pytest.fixture(scope="module")
def aarch64_program():
    """the harness cross-built for aarch64 with Debian's toolchain"""
    built = cross_build(AARCH64_CC)
    assert built.endswith(os.path.join("aarch64", "cpu_ops_check"))
    return built


def under_qemu(program, cpu, *args):
    """run() of the aarch64 program under qemu-user, emulating `cpu`; its libraries from the
    cross toolchain's target folder (Debian's: <prefix>/aarch64-linux-gnu beside <prefix>/bin)"""
    target = os.path.join(os.path.dirname(os.path.dirname(shutil.which(AARCH64_CC))), "aarch64-linux-gnu")
    return run_command([QEMU, "-cpu", cpu, "-L", target, program, *args])


needs_qemu = pytest.mark.skipif(not (shutil.which(AARCH64_CC) and shutil.which(QEMU)),
                                reason=f"no {AARCH64_CC} and {QEMU} here (Debian's gcc-aarch64-linux-gnu and "
                                       "qemu-user; .ci/run installs them)")


ARM_LEVELS = ["neon", "neon_bf16", "sve"]  # cpu_dispatch.c's aarch64 levels above portable, lowest first


def compared_every_op(rows, path, out):
    """every op of the table compared on `path`, each OK"""
    ops = set(table_ops()) | {"e4m3_decode", "int4_digits"}
    assert {op for p, op in rows if p == path} == ops, out
    assert all(rows[(path, op)][0] > 0 and rows[(path, op)][2] == "OK" for op in ops), out


@needs_qemu
def test_the_arm_paths_run_every_op_against_portable_under_qemu(aarch64_program):
    """issue 43's proof without ARM hardware: on an emulated CPU with BF16 and SVE (qemu's `max`),
    neon (the ARMv8.0 ASIMD copy of the kernels), neon_bf16 (neon's, bf16 products on BFDOT) and
    sve (the kernels compiled for SVE) are each compared with portable (scalar on aarch64), op
    by op; the x86 levels are not listed on aarch64"""
    rc, out, rows = under_qemu(aarch64_program, "max")
    assert rc == 0, out
    assert {path for path, _ in rows} == set(ARM_LEVELS), out
    for path in ARM_LEVELS:
        compared_every_op(rows, path, out)
    assert rows[("neon_bf16", "matmul")][0] >= 100  # its bf16-scratch cases are BFDOT's
    assert rows[("neon", "matmul_fp8")][0] >= 100 and rows[("neon", "e4m3_decode")][0] > 0  # the fcvtl decoders
    assert not any(level in out for level in LEVELS[1:]), out


@needs_qemu
@pytest.mark.parametrize("bits", [128, 256, 512])
def test_the_sve_path_at_each_vector_length_under_qemu(aarch64_program, bits):
    """vector-length agnostic: the same sve code at 128, 256 and 512 bits (qemu's sve-max-vq, in
    128-bit units; the harness prints the length the kernel granted), every op against portable"""
    rc, out, rows = under_qemu(aarch64_program, f"max,sve-max-vq={bits // 128}", "--hide", "neon,neon_bf16")
    assert rc == 0 and f"sve vector length: {bits} bits" in out, out
    assert {path for path, _ in rows} == {"sve"}, out
    compared_every_op(rows, "sve", out)


@needs_qemu
def test_a_cpu_with_neon_alone_and_a_planted_defect_under_qemu(aarch64_program):
    """a Cortex-A72 (ARMv8.0: ASIMD, no BF16, no SVE): neon compared, neon_bf16 and sve "not
    supported on this CPU"; with neon hidden too, nothing compared and a failure. On `max`, the
    harness's planted defects fail where they were planted and nowhere else"""
    rc, out, rows = under_qemu(aarch64_program, "cortex-a72")
    assert rc == 0 and {path for path, _ in rows} == {"neon"}, out
    compared_every_op(rows, "neon", out)
    assert "neon_bf16  not supported on this CPU" in out and "sve        not supported on this CPU" in out, out
    assert "sve vector length" not in out, out
    rc, out, rows = under_qemu(aarch64_program, "cortex-a72", "--hide", "neon")
    assert rc == 1 and not rows and "compared nothing: no path but portable runs here" in out, out
    rc, out, rows = under_qemu(aarch64_program, "max", "--plant", "matmul:neon_bf16,rope:sve")
    assert rc == 1, out
    assert sorted(key for key, row in rows.items() if row[2] == "FAIL") == [("neon_bf16", "matmul"), ("sve", "rope")]


# defects written into the ARM kernels themselves, (file, old text, new text) each, in a copy of
# the sources; a mutant: its defects, the paths it runs (--hide the others) and the rows that must
# fail. "dots": BFDOT's second accumulator reads the first 8 inputs again (neon_bf16's matmul:
# its decode and remainders), and the NEON e4m3 decoders' upper 4 weights of 8 are the lower 4
# (every ARM path's FP8 rows); "tiles": a BFMMLA tile multiplies the first pair of weight rows
# where the second belongs (neon_bf16's matmul from 4 tokens on, and its int4 prefill); "sdot": the int4 decode's odd
# nibbles of the first 4 columns dotted with the even inputs' digits (neon_bf16's matmul_int4 and int4_digits);
# "int4_prefill": the int4 prefill's bf16 weight rows with neighbouring inputs swapped (the same)
BF16_FILE, FP8_FILE = os.path.join("kernels", "cpu", "matmul_neon_bf16.c"), os.path.join("kernels", "cpu", "matmul_fp8.c")
INT4_FILE = os.path.join("kernels", "cpu", "matmul_int4_sdot.c")
KERNEL_DEFECTS = {
    "dots": ([(BF16_FILE, "s1 = vbfdotq_f32(s1, vld1q_bf16((const bfloat16_t *)(a + k + 8))",
               "s1 = vbfdotq_f32(s1, vld1q_bf16((const bfloat16_t *)(a + k))"),
              (FP8_FILE, "*hi = (q3_vf)vcvt_high_f32_f16(vreinterpretq_f16_s16(h));",
               "*hi = (q3_vf)vcvt_f32_f16(vreinterpret_f16_s16(vget_low_s16(h)));")],
             [], {("neon_bf16", "matmul")} | {(p, op) for p in ARM_LEVELS for op in ("matmul_fp8", "e4m3_decode")}),
    "tiles": ([(BF16_FILE, "c[0][1] = vbfmmlaq_f32(c[0][1], a01, b23);", "c[0][1] = vbfmmlaq_f32(c[0][1], a01, b01);")],
              ["--hide", "neon,sve"], {("neon_bf16", "matmul"), ("neon_bf16", "matmul_int4")}),
    "sdot": ([(INT4_FILE, "hi[t][0] = vdotq_s32(vdotq_s32(hi[t][0], e0, he), o0, ho);",
               "hi[t][0] = vdotq_s32(vdotq_s32(hi[t][0], e0, he), o0, he);")],
             ["--hide", "neon,sve"], {("neon_bf16", "matmul_int4"), ("neon_bf16", "int4_digits")}),
    "int4_prefill": ([(BF16_FILE, "rows[i * K + k] = q3_f32_to_bf16(row[k]);", "rows[i * K + k] = q3_f32_to_bf16(row[k ^ 1]);")],
                     ["--hide", "neon,sve"], {("neon_bf16", "matmul_int4")}),
}


@needs_qemu
@pytest.mark.parametrize("mutant", sorted(KERNEL_DEFECTS))
def test_defects_written_into_the_neon_kernels_fail_under_qemu(tmp_path, mutant):
    """the harness catches a defect in the kernel code, not only its own planted ones: a copy of
    the sources with a mutant's defects written in, cross-built and run on `max`, fails exactly
    the rows those kernels serve"""
    defects, args, expected = KERNEL_DEFECTS[mutant]
    for part in ("kernels", os.path.join("csrc", "engine"), os.path.join("csrc", "check", "cpu_ops")):
        shutil.copytree(os.path.join(ROOT, part), tmp_path / part)
    for part in ("setup.py", os.path.join("benchmarks", "cpu_ops_check.py")):
        os.makedirs(tmp_path / os.path.dirname(part), exist_ok=True)
        shutil.copy(os.path.join(ROOT, part), tmp_path / part)
    for name, old, new in defects:
        text = (tmp_path / name).read_text()
        assert text.count(old) == 1, (name, old)
        (tmp_path / name).write_text(text.replace(old, new))
    rc, out, rows = under_qemu(cross_build(AARCH64_CC, root=tmp_path), "max", *args)
    assert rc == 1, out
    assert {key for key, row in rows.items() if row[2] == "FAIL"} == expected, out


@needs_qemu
@pytest.mark.skipif(not shutil.which("clang"), reason="no clang here (Debian's clang; .ci/run installs it)")
def test_clang_builds_the_arm_paths_and_they_agree_under_qemu():
    """the kernels as clang compiles them for aarch64 (--target; serial: no aarch64 OpenMP runtime
    for a cross clang here), neon and neon_bf16 on `max` against clang's portable"""
    built = cross_build("clang --target=aarch64-linux-gnu", "--no-openmp")
    assert built.endswith(os.path.join("aarch64-clang", "cpu_ops_check"))
    rc, out, rows = under_qemu(built, "max", "--hide", "sve")
    assert rc == 0 and {path for path, _ in rows} == {"neon", "neon_bf16"}, out
    for path in ("neon", "neon_bf16"):
        compared_every_op(rows, path, out)
