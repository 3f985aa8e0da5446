"""The CPU twins of the fused CUDA kernels (kernels/cpu/twins.h) and the oracle of the kernel
check, read from the sources: each twin is defined once, beside its op (in the kernels/cpu
file named as its kernels/cuda one), in the portable variant of qwen3layer._testing only
(#if Q3_CPU_TWINS), and calls the portable
kernels by name; the kernel check (csrc/check) compares against the portable table, never the
one the engine picked for the machine. That the twins agree with the CUDA kernels is
check_kernels' part (tests/executor/test_cuda_executor.py runs it on the executor)."""
import glob
import os
import re

import cuda_launchers

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..")
CPU = os.path.join(ROOT, "kernels", "cpu")
PORTABLE_REGION = re.compile(r"^#if Q3_CPU_TWINS\n(.*?)^#endif", re.S | re.M)


def read(path):
    with open(path, encoding="utf-8") as f:
        return f.read()


def twin_names():
    return re.findall(r"^\w[\w ]*?\b(q3_\w+)\(", read(os.path.join(CPU, "twins.h")), re.M)


def test_each_twin_is_defined_once_beside_its_op_in_the_portable_variant_only():
    names = twin_names()
    assert len(names) >= 16 and len(set(names)) == len(names)
    defined = {}
    for path in sorted(glob.glob(os.path.join(CPU, "*.c"))):
        text = read(path)
        portable = "".join(m.group(1) for m in PORTABLE_REGION.finditer(text))
        assert "#if" not in portable, path  # one level: the region's #endif is its own
        for name in names:
            definitions = re.findall(r"^\w[\w ]*?\b%s\([^;{]*\{" % name, text, re.M)
            if definitions:
                assert len(definitions) == 1 and re.search(r"^\w[\w ]*?\b%s\(" % name, portable, re.M), (name, path)
                defined.setdefault(name, []).append(os.path.basename(path))
        # the portable kernels by name, not this variant's (Q3_CPU_FN) nor the engine's table
        assert "Q3_CPU_FN" not in portable and "cpu_ops" not in portable, path
    assert sorted(defined) == sorted(names) and all(len(v) == 1 for v in defined.values()), defined
    for name, (file,) in defined.items():  # the twin of kernels/cuda/<op>.cu is in kernels/cpu/<op>.c
        assert os.path.exists(os.path.join(ROOT, "kernels", "cuda", file[:-2] + ".cu")), (name, file)


def test_the_kernel_check_compares_against_the_portable_kernels():
    # (entries.c's single-kernel entries run the path the engine picked on purpose: the tests
    # set each path in turn; engine_link.c forwards the engine's functions)
    sources = glob.glob(os.path.join(ROOT, "csrc", "check", "kernel_check*.[ch]"))
    assert len(sources) >= 5
    for path in sources:
        text = read(path)
        assert "q3_cpu_ops_active" not in text and "cpu_dispatch.h" not in text, path
    assert "&q3_ops_cpu_portable" in read(os.path.join(ROOT, "csrc", "check", "kernel_check.c"))


def test_every_launcher_of_the_cuda_table_has_a_case_in_the_kernel_check():
    """the launchers read from kernels/cuda/ops_cuda.h (tests/helpers/cuda_launchers.py, which the
    executor's test of the check compares the cases it ran against) each named by a case of
    csrc/check/kernel_check.c, and no case naming a launcher the table lacks"""
    launchers = cuda_launchers.header_launchers()
    assert len(launchers) >= 29 and len(set(launchers)) == len(launchers)
    assert {"rmsnorm", "attention", "matmul_fp8", "from_f32"} <= set(launchers)  # the first, some, the last
    assert not {"synchronize", "capture_begin", "time_matmul"} & set(launchers)  # the runtime helpers are not
    checked = cuda_launchers.checked_launchers()
    assert set(launchers) - checked == set(), "launchers without a case in the kernel check"
    assert checked - set(launchers) == set(), "cases naming no launcher of ops_cuda.h"
