"""What each extension module exports and links (setup.py: -fvisibility=hidden): _C's dynamic
symbol table holds PyInit__C alone and _testing's PyInit__testing alone; the check harness and
the twins of the CUDA kernels are in _testing, not in _C (_testing has its own portable CPU
kernels, the oracle); and _testing needs no engine symbol from elsewhere: it reaches _C's one
engine through the capsule's table (csrc/cuda/engine_api.h), so no engine is linked twice; and
check_kernels() names the module and its build where it is absent. The tables are read with
binutils' nm (those tests skip where there is none)."""
import shutil
import subprocess

import pytest

from qwen3layer import _C, _testing

NM = shutil.which("nm")
needs_nm = pytest.mark.skipif(NM is None, reason="binutils' nm is not installed")
# what the linker itself defines in every shared object, not the code's
LINKER = {"_init", "_fini", "_edata", "_end", "__bss_start"}


def symbols(path, *flags):
    out = subprocess.run([NM, *flags, path], capture_output=True, text=True, check=True).stdout
    return [line.split() for line in out.splitlines() if line.strip()]


def exported(path):
    return {fields[-1] for fields in symbols(path, "-D", "--defined-only")} - LINKER


@needs_nm
def test_each_module_exports_only_its_init_function():
    assert exported(_C.__file__) == {"PyInit__C"}
    assert exported(_testing.__file__) == {"PyInit__testing"}


@needs_nm
def test_the_check_harness_is_not_in_the_shipped_extension():
    names = {fields[-1] for fields in symbols(_C.__file__)}  # the static table too (not stripped)
    assert "PyInit__C" in names and "q3_layer_forward" in names
    assert not {"q3_cuda_check", "q3_case_matmul", "q3_matmul_fp8_host", "q3_moe_gate_up_host"} & names


@needs_nm
def test_testing_links_no_engine_of_its_own():
    undefined = {fields[-1] for fields in symbols(_testing.__file__, "-u")}
    assert not {name for name in undefined if name.startswith("q3_")}
    defined = {fields[-1] for fields in symbols(_testing.__file__, "--defined-only")}
    assert "q3_cuda_check" in defined
    # the engine's functions are the forwarders of csrc/check/engine_link.c, not their code
    assert not {"q3_layer_forward", "q3_cpu_select", "q3_cuda_open"} & defined
    # its own oracle: the portable kernels with the twins, no other variant
    assert {"q3_matmul_cpu_portable", "q3_ops_cpu_portable", "q3_moe_gate_up_host"} <= defined
    assert not {name for name in defined if name.endswith(("_cpu_avx2", "_cpu_avx512"))}


def test_check_kernels_names_the_module_and_its_build_when_it_is_absent(monkeypatch):
    import sys

    import qwen3layer as q3

    monkeypatch.delattr(q3, "_testing", raising=False)
    monkeypatch.setitem(sys.modules, "qwen3layer._testing", None)  # as if never built: imports fail
    with pytest.raises(ImportError, match=r"qwen3layer\._testing .*build_ext --inplace") as e:
        q3.cuda.check_kernels()
    assert e.value.name == "qwen3layer._testing"


def test_a_missing_testing_module_fails_under_ci_and_is_never_skipped(monkeypatch):
    """tests/conftest.py refuses to run the suite under CI=true without qwen3layer._testing
    (tests/helpers/ci_checks.py), and
    no test module skips itself for want of it (pytest.importorskip): in CI it is always built"""
    import glob
    import os
    import sys

    import ci_checks

    monkeypatch.setitem(sys.modules, "qwen3layer._testing", None)  # as if never built: imports fail
    monkeypatch.setenv("CI", "true")
    with pytest.raises(pytest.UsageError, match=r"CI=true: qwen3layer\._testing does not import"):
        ci_checks.require_testing_in_ci()
    monkeypatch.delenv("CI")
    ci_checks.require_testing_in_ci()  # not asked outside CI
    tests = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
    for path in glob.glob(os.path.join(tests, "**", "*.py"), recursive=True):
        with open(path, encoding="utf-8") as f:
            assert "importorskip(\"qwen3layer._testing" not in f.read(), path


def test_testing_runs_on_the_engine_of_c():
    """_testing sees the backend _C opened (one engine a process): before emulate() the harness
    finds none; after it, the SIMT executor's three schedules. In a fresh process, as emulate()
    is once a process."""
    import os
    import subprocess
    import sys

    import qwen3layer as q3

    if not os.path.exists(q3.cuda.SIMT_LIBRARY):
        pytest.skip("this build has no SIMT executor")
    code = """
import pytest, qwen3layer as q3
from qwen3layer import _testing
assert _testing.cuda_schedules() == 1
with pytest.raises(RuntimeError, match="cuda check: the CUDA backend is not loaded"):
    _testing.cuda_check(0)
q3.cuda.emulate()
assert _testing.cuda_schedules() == 3
_testing.cuda_set_schedule(2, 7)
with pytest.raises(ValueError, match="schedule"):
    _testing.cuda_set_schedule(3)
print("shared")
"""
    root = os.path.dirname(os.path.dirname(os.path.abspath(q3.__file__)))
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=root, timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "shared", out.stderr
