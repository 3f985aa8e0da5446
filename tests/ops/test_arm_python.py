"""The Python package on aarch64 under emulation (issue 43): benchmarks/arm_python.py builds the
extension with Debian's aarch64 toolchain and runs tests/numpy (an fp32 layer's prefill,
chunked prefill and decode against a float64 reference; the checkpoint round trip and a
tampered shard) with an arm64 CPython under qemu-aarch64, on each aarch64 CPU path: the
default on `max` (neon_bf16) and on a Cortex-A72 (neon), and sve and portable named; and the
SIMT executor, cross-built too, runs its smallest layer case there (tests/numpy/executor_case.py),
and the main job (`python -m qwen3layer run`) runs at the tiny geometry. libq3cuda.so, cross-built
with nvcc for the ARM boards' GPUs (host code by aarch64 g++, CUDA's aarch64 runtime from its
wheel), loads there, names its targets and finds no CUDA device, as it should without a driver."""
import os
import re
import shutil
import subprocess
import sys

import pytest

ROOT = os.path.realpath(os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))
SCRIPT = os.path.join(ROOT, "benchmarks", "arm_python.py")
PYTHON = os.path.join(ROOT, "build", "arm-python", "root", "usr", "bin", "python3.11")
TOOLS = ("aarch64-linux-gnu-gcc", "aarch64-linux-gnu-g++", "qemu-aarch64", "nvcc")
MISSING = [t for t in TOOLS if not shutil.which(t)] + ([] if os.path.exists(PYTHON) else [
    "the arm64 CPython (`python benchmarks/arm_python.py setup`; .ci/run runs it)"])


def cases_in_the_folder():
    """the cases of tests/numpy, as this machine's pytest collects them"""
    r = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "--noconftest", "-p", "no:cacheprovider",
                        os.path.join(ROOT, "tests", "numpy")], capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert r.returncode == 0, r.stdout + r.stderr
    return sum("::" in line for line in r.stdout.splitlines())


# under .ci/sanitize (its suite runs with libasan preloaded, in a copy of the checkout without
# build/): the aarch64 build is not instrumented, and the plain suite ran it
SANITIZED = "libasan" in os.environ.get("LD_PRELOAD", "")


@pytest.mark.skipif(SANITIZED, reason="under .ci/sanitize: the aarch64 build is not instrumented (the plain suite runs it)")
@pytest.mark.skipif(bool(MISSING) and os.environ.get("CI") != "true", reason=f"missing here: {MISSING}")
def test_the_package_under_emulation_on_every_arm_path():
    assert not MISSING, MISSING  # under CI, .ci/run installed and fetched them: nothing may be missing
    build = subprocess.run([sys.executable, SCRIPT, "build", "--simt", "--cuda"], capture_output=True, text=True,
                           timeout=1200)
    assert build.returncode == 0, build.stdout[-3000:] + build.stderr[-3000:]
    with open(os.path.join(build.stdout.split()[-1], "qwen3layer", "_C.cpython-311-aarch64-linux-gnu.so"), "rb") as f:
        header = f.read(20)
    assert header[:4] == b"\x7fELF" and int.from_bytes(header[18:20], "little") == 183  # EM_AARCH64
    expected = cases_in_the_folder()
    assert expected >= 8
    plain = dict(os.environ)
    plain.pop("QWEN3LAYER_CPU_PATH", None)
    for cpu, path in (("max", None), ("cortex-a72", None), ("max", "sve"), ("max", "portable")):
        env = dict(plain, QWEN3LAYER_CPU_PATH=path) if path else plain
        r = subprocess.run([sys.executable, SCRIPT, "test", "--cpu", cpu], capture_output=True, text=True, timeout=600,
                           env=env)
        out = r.stdout + r.stderr
        assert r.returncode == 0 and re.search(rf"\b{expected} passed in", out), (cpu, path, out[-3000:])
        assert not re.search(r"skipped|failed|error", out.splitlines()[-1]), (cpu, path, out[-3000:])
    # the executor's smallest case: the real CUDA kernels, on the emulated aarch64 CPU
    r = subprocess.run([sys.executable, SCRIPT, "python", "--cpu", "max", os.path.join(ROOT, "tests", "numpy",
                                                                                  "executor_case.py")],
                       capture_output=True, text=True, timeout=600, env=plain)
    assert r.returncode == 0 and "executor on aarch64 (neon_bf16)" in r.stdout and ": OK" in r.stdout, \
        r.stdout[-3000:] + r.stderr[-3000:]
    # the main job's command, as README's gives it, at the tiny geometry (the real one's 446 MB of
    # bf16 weights take minutes under emulation)
    r = subprocess.run([sys.executable, SCRIPT, "python", "--cpu", "max", "-m", "qwen3layer", "run", "--geometry",
                        "tiny", "--tokens", "64", "--new-tokens", "4"], capture_output=True, text=True, timeout=600,
                       env=plain)
    assert r.returncode == 0 and "the map, decode: 4 steps from context 64" in r.stdout, \
        r.stdout[-3000:] + r.stderr[-3000:]
    # the CUDA library for aarch64: it loads, its targets are the ARM boards', and with no driver
    # under qemu it sees no device (the backend is then not opened: emulate() is still possible)
    r = subprocess.run([sys.executable, SCRIPT, "python", "--cpu", "max", "-c",
                        "import qwen3layer as q3\nprint(q3.cuda.built(), ','.join(q3.cuda.targets()))\n"
                        "try:\n    q3.cuda.load()\nexcept RuntimeError as e:\n    print(e)"],
                       capture_output=True, text=True, timeout=600, env=plain)
    assert r.returncode == 0 and "True sm_87,sm_90,sm_110,sm_121,compute_121" in r.stdout, r.stdout + r.stderr
    assert "qwen3layer.cuda.load(): no CUDA device on this machine (0 found)" in r.stdout, r.stdout + r.stderr
