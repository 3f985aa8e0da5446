"""The Python package on aarch64, under emulation (issue 43): an arm64 CPython 3.11 from Debian's
packages unpacked into a folder (apt-get download and dpkg -x: nothing is installed), numpy's
aarch64 wheel and pytest's pure-Python ones unzipped beside it, the extension qwen3layer._C
cross-built with Debian's aarch64 toolchain (setup.py's recipe: the engine, the CUDA host
side, the glue, the kernels once per aarch64 variant), and that Python run under qemu-aarch64.
Everything lives in build/arm-python/ (debs, root, site, package); only what is missing or
stale is fetched or compiled again.

    python benchmarks/arm_python.py setup                # fetch and unpack (needs arm64 in dpkg's
                                                         # architectures: dpkg --add-architecture arm64;
                                                         # apt-get update; .ci/run does it)
    python benchmarks/arm_python.py build [--simt] [--cuda]   # cross-build the package [the SIMT
                                                         # executor] [libq3cuda.so, nvcc's aarch64 host side]
    python benchmarks/arm_python.py test [--cpu max] [--simt] [--cuda] [pytest args]   # tests/numpy, emulated
    python benchmarks/arm_python.py python [--cpu max] -c "import qwen3layer"

`test` runs tests/numpy (the layer with numpy alone against a float64 reference, and the
checkpoint round trip) with that Python; its exit status is pytest's. --cpu: qemu's CPU model
(max: BF16, I8MM, SVE2, so neon_bf16 is the default path; cortex-a72: ASIMD alone, neon).
"""
from __future__ import annotations

import argparse
import glob
import re
import importlib.util
import os
import shutil
import subprocess
import sys
import zipfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
OUT = os.path.join(ROOT, "build", "arm-python")
CC, CXX = "aarch64-linux-gnu-gcc", "aarch64-linux-gnu-g++"
# CPython 3.11 and what it, numpy and the extension load (libgomp: OpenMP; libgcc-s1: its
# unwinder; libstdc++6: the SIMT executor's)
DEBS = ["python3.11-minimal", "libpython3.11-minimal", "libpython3.11-stdlib", "libpython3.11-dev", "libc6",
        "libexpat1", "zlib1g", "libffi8", "libgomp1", "libgcc-s1", "libstdc++6"]
WHEELS = ["numpy", "pytest", "pluggy", "iniconfig", "packaging", "pygments"]
PYTHON = os.path.join("usr", "bin", "python3.11")
# the GPUs of the ARM machines (Jetson Orin, GH200, Jetson Thor, GB10), for libq3cuda.so on aarch64
ARM_SASS = ["sm_87", "sm_90", "sm_110", "sm_121"]
SUFFIX = ".cpython-311-aarch64-linux-gnu.so"  # Debian's arm64 CPython's extension suffix


def _setup_py():
    """setup.py as a module (its setup() call runs only as __main__): the build's recipe"""
    spec = importlib.util.spec_from_file_location("q3_setup", os.path.join(ROOT, "setup.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def fetch() -> None:
    """build/arm-python/root: the Debian packages unpacked; site: the wheels unzipped"""
    root, site = os.path.join(OUT, "root"), os.path.join(OUT, "site")
    if read_text(os.path.join(root, "debs.txt")) != " ".join(DEBS):  # the packages unpacked there
        foreign = subprocess.run(["dpkg", "--print-foreign-architectures"], capture_output=True, text=True).stdout
        if "arm64" not in foreign.split():
            sys.exit("arm_python.py: dpkg does not know arm64 packages here: run `dpkg --add-architecture arm64 && "
                     "apt-get update` (as root) first; nothing is installed, the packages are only downloaded")
        debs = os.path.join(OUT, "debs")
        shutil.rmtree(debs, ignore_errors=True)
        os.makedirs(debs)
        subprocess.run(["apt-get", "download", "-q", *(f"{name}:arm64" for name in DEBS)], cwd=debs, check=True)
        staging = root + ".new"
        shutil.rmtree(staging, ignore_errors=True)
        for deb in sorted(glob.glob(os.path.join(debs, "*.deb"))):
            subprocess.run(["dpkg", "-x", deb, staging], check=True)
        with open(os.path.join(staging, "debs.txt"), "w") as f:
            f.write(" ".join(DEBS))
        shutil.rmtree(root, ignore_errors=True)
        os.rename(staging, root)  # whole or not at all
    unzipped(site, WHEELS, ["--implementation", "cp"])
    release = nvcc_release()
    if release:  # CUDA's aarch64 runtime (headers, libcudart_static.a) of nvcc's release, from its wheel
        unzipped(os.path.join(OUT, "cuda-runtime", release), [f"nvidia-cuda-runtime=={release}.*"])


def unzipped(target: str, wheels: list, pip_args: tuple = ()) -> None:
    """target: the aarch64 wheels of `wheels` (pip's requirement strings) unzipped, whole or not
    at all; fetched again when the list differs from the one target holds (wheels.txt)"""
    stamp = os.path.join(target, "wheels.txt")
    if read_text(stamp) == " ".join(wheels):
        return
    downloads, staging = target + ".wheels", target + ".new"
    for folder in (downloads, staging):
        shutil.rmtree(folder, ignore_errors=True)
    subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:",
                    "--platform", "manylinux_2_17_aarch64", "--platform", "manylinux2014_aarch64",
                    "--python-version", "3.11", *pip_args, "-d", downloads, *wheels], check=True)
    for wheel in sorted(glob.glob(os.path.join(downloads, "*.whl"))):
        with zipfile.ZipFile(wheel) as z:
            z.extractall(staging)
    with open(os.path.join(staging, "wheels.txt"), "w") as f:
        f.write(" ".join(wheels))
    shutil.rmtree(target, ignore_errors=True)
    os.rename(staging, target)
    shutil.rmtree(downloads, ignore_errors=True)


def read_text(path: str) -> str:
    """the file's text, or '' where there is none"""
    try:
        with open(path) as f:
            return f.read()
    except OSError:
        return ""


def nvcc_release():
    """nvcc's release here ('13.0'), or None without nvcc"""
    nvcc = _setup_py().find_nvcc()
    if not nvcc:
        return None
    found = re.search(r"release (\d+\.\d+)", subprocess.run([nvcc, "--version"], capture_output=True, text=True).stdout)
    return found.group(1) if found else None


def build(quiet: bool = True, simt: bool = False, cuda: bool = False) -> str:
    """build/arm-python/package/qwen3layer: the package's Python files and _C cross-built for
    aarch64 against the unpacked CPython's headers (simt: and the SIMT executor; cuda: and
    libq3cuda.so); returns the package folder"""
    s = _setup_py()
    root = os.path.join(OUT, "root")
    # Debian's pyconfig.h includes <aarch64-linux-gnu/python3.11/pyconfig.h>: the root's include folder last
    include = [f"-I{os.path.join(root, 'usr', 'include', 'python3.11')}",
               f"-idirafter{os.path.join(root, 'usr', 'include')}"]
    if not os.path.exists(os.path.join(root, "usr", "include", "python3.11", "Python.h")):
        sys.exit("arm_python.py: no arm64 CPython headers in build/arm-python/root: run `arm_python.py setup` first")
    headers = sorted(glob.glob(os.path.join(ROOT, "kernels", "*.h")) + glob.glob(os.path.join(ROOT, "kernels", "cpu", "*.h"))
                     + glob.glob(os.path.join(ROOT, "csrc", "*", "*.h")))
    kernels = sorted(glob.glob(os.path.join(ROOT, "kernels", "cpu", "*.c")))
    units = [(f"isa-{isa}", [f"-DQ3_ISA={isa}", *flags], kernels) for isa, flags in s.isa_variants("aarch64").items()]
    units += [(f"csrc-{layer}", [f'-DQ3_VERSION="{s.VERSION}"', *include],  # a folder each: names repeat
               sorted(glob.glob(os.path.join(ROOT, "csrc", layer, "*.c")))) for layer in s.CSRC_LAYERS]
    objects = []
    for name, flags, sources in units:
        objdir, command = os.path.join(OUT, "objects", name), [CC, *s.COMMON, "-fPIC", *flags]
        objects += s.compile_objects(CC, command[1:], sources, headers, objdir, s.command_changed(objdir, command),
                                     quiet=quiet)
        s.record_command(objdir, command)
    package = os.path.join(OUT, "package")
    for path in glob.glob(os.path.join(ROOT, "qwen3layer", "**", "*"), recursive=True):
        if os.path.isfile(path) and path.endswith((".py", ".pyi", "py.typed")):
            target = os.path.join(package, os.path.relpath(path, ROOT))
            os.makedirs(os.path.dirname(target), exist_ok=True)
            shutil.copyfile(path, target)
    s.link_library(CC, objects, ["-shared", "-fopenmp", "-ldl"], os.path.join(package, "qwen3layer", "_C" + SUFFIX))
    if simt:
        build_simt(s, package, quiet)
    if cuda:
        build_cuda(s, package, quiet)
    return package


def build_cuda(s, package: str, quiet: bool) -> None:
    """package/qwen3layer/libq3cuda.so: kernels/cuda/*.cu with nvcc here for ARM_SASS (and PTX
    for the newest), its host code by Debian's aarch64 g++ (-ccbin), against CUDA's aarch64
    runtime from its wheel (`setup` fetches it: headers first, the toolkit's own after for
    nvcc's crt/ headers) and linked with its libcudart_static.a, as setup.py links it"""
    nvcc, release = s.find_nvcc(), nvcc_release()
    runtime = os.path.join(OUT, "cuda-runtime", release or "none", "nvidia", "cu" + (release or "").split(".")[0])
    if not nvcc or not s.find_cuda_headers() or not os.path.exists(os.path.join(runtime, "lib", "libcudart_static.a")) \
            or not shutil.which(CXX):
        sys.exit(f"arm_python.py: --cuda needs nvcc (found: {nvcc}), {CXX} and CUDA's aarch64 runtime of nvcc's "
                 "release (`arm_python.py setup` fetches it)")
    toolkit = s.find_cuda_headers()  # the toolkit's include folder (its crt/ headers)
    cross = ["-ccbin", CXX, f"-I{os.path.join(runtime, 'include')}", "-Xcompiler", f"-idirafter,{toolkit}"]
    archs = s.cuda_arch_flags(ARM_SASS)
    flags = ["-std=c++17", "-O3", "-Xcompiler", "-fPIC", *archs, "--threads", "2",
             f'-DQ3_CUDA_TARGETS="{",".join(s.cuda_targets(ARM_SASS))}"', "-Ikernels", *cross]
    cwd = os.getcwd()
    os.chdir(ROOT)  # -Ikernels and the sources are relative to the checkout
    try:
        headers = glob.glob("kernels/cuda/*.cuh") + glob.glob("kernels/cuda/*.h") + glob.glob("kernels/*.h")
        objdir = os.path.join(OUT, "objects", "cuda")
        objects = s.compile_objects(nvcc, flags, sorted(glob.glob("kernels/cuda/*.cu")), headers, objdir,
                                    s.command_changed(objdir, [nvcc, *flags]), quiet=quiet)
        s.record_command(objdir, [nvcc, *flags])
        s.link_library(nvcc, objects, ["-shared", "-cudart", "static", *archs, *cross,
                                       f"-L{os.path.join(runtime, 'lib')}"], os.path.join(package, "qwen3layer",
                                                                                          "libq3cuda.so"))
    finally:
        os.chdir(cwd)


def build_simt(s, package: str, quiet: bool) -> None:
    """package/qwen3layer/libq3simt.so: the SIMT executor with kernels/cuda/*.cu (setup.py's
    simt_recipe) cross-built with Debian's aarch64 g++, against the CUDA toolkit's headers here
    (headers only: the executor's own runtime stands in for CUDA's)"""
    include = s.find_cuda_headers()
    if not include or not shutil.which(CXX):
        sys.exit(f"arm_python.py: --simt needs the CUDA toolkit's headers (found: {include}) and {CXX} "
                 "(Debian's g++-aarch64-linux-gnu)")
    cwd = os.getcwd()
    os.chdir(ROOT)  # the recipe's paths are relative to the checkout
    try:
        _, flags, link, sources, headers = s.simt_recipe(include, sanitize=[])
        objdir = os.path.join(OUT, "objects", "simt")
        objects = s.compile_objects(CXX, flags, sources, headers, objdir, s.command_changed(objdir, [CXX, *flags]),
                                    quiet=quiet)
        s.record_command(objdir, [CXX, *flags])
        s.link_library(CXX, objects, link, os.path.join(package, "qwen3layer", "libq3simt.so"))
    finally:
        os.chdir(cwd)


def command(cpu: str, args: list) -> tuple:
    """(argv, env) of the emulated CPython on the built package and the unzipped wheels"""
    root = os.path.join(OUT, "root")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([os.path.join(OUT, "package"), os.path.join(OUT, "site")]),
               PYTHONDONTWRITEBYTECODE="1")
    for name in ("LD_PRELOAD", "PYTHONHOME", "VIRTUAL_ENV"):  # the host's, not the guest's
        env.pop(name, None)
    return ["qemu-aarch64", "-cpu", cpu, "-L", root, os.path.join(root, PYTHON), *args], env


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("what", choices=["setup", "build", "test", "python"])
    p.add_argument("--cpu", help="test, python: qemu-aarch64's CPU model (default max)")
    p.add_argument("--simt", action="store_true", help="build, test: the SIMT executor too (libq3simt.so)")
    p.add_argument("--cuda", action="store_true", help="build, test: libq3cuda.so too (nvcc, for the ARM boards' GPUs)")
    args, rest = p.parse_known_args()
    if args.what in ("setup", "build") and (rest or args.cpu):  # refused, not ignored
        p.error(f"{args.what} takes no --cpu and no other arguments, got {(['--cpu', args.cpu] if args.cpu else []) + rest}")
    if args.what in ("setup", "python") and (args.simt or args.cuda):
        p.error(f"{args.what}: --simt and --cuda are build's and test's (they choose what is built)")
    if args.what == "setup":
        fetch()
        return 0
    if args.what == "build":
        print(build(simt=args.simt, cuda=args.cuda))
        return 0
    if args.what == "test":
        build(simt=args.simt, cuda=args.cuda)
        rest = ["-m", "pytest", "-q", "--noconftest", "-p", "no:cacheprovider", "-o", "addopts=",
                os.path.join(ROOT, "tests", "numpy"), *rest]
    argv, env = command(args.cpu or "max", rest)
    # from build/arm-python: `python -m` puts the working folder first on sys.path, and the
    # checkout's qwen3layer (this machine's build) must not be the one imported
    return subprocess.run(argv, env=env, cwd=OUT).returncode


if __name__ == "__main__":
    sys.exit(main())
