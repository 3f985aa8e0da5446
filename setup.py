"""Build of the qwen3layer C extensions: qwen3layer._C, the one users load (csrc/engine,
csrc/cuda and the CPython glue csrc/python, with the CPU kernels kernels/cpu/), and
qwen3layer._testing, the kernel check harness (csrc/check) and the test-only entries (its glue
csrc/testing), which q3.cuda.check_kernels(), the tests and the benchmarks import. C11 with
OpenMP; nothing here needs torch. Every #include is a path relative to its file, so no
include directories are passed.

Both are compiled with -fvisibility=hidden: each exports its PyInit_ function alone
(tests/tools/test_symbols.py reads the dynamic symbol tables). _testing links no engine code: it
calls _C's engine through the table of functions _C exports as a capsule
(csrc/cuda/engine_api.h), so it runs on the one engine of the process. It has its own copy of
the portable CPU kernels, compiled with the twins of the CUDA kernels (-DQ3_TWINS=1,
kernels/cpu/isa.h): the oracle of the kernel check, which the shipped _C does not carry. _testing is built by
default (an extra such as [test] cannot change what setup.py builds, and the module costs
nothing until imported); Q3_TESTING=0 leaves it out (a package of _C alone).

The kernels are compiled once per instruction set, each copy with its own names
(kernels/cpu/isa.h): "portable" for the architecture's baseline and, on x86-64, "avx2"
(with FMA) and "avx512" (F, BW, VL, DQ; BF16 and AMX code inside it is enabled per
function); on aarch64 "portable" scalar, "neon" (ARMv8.0), "neon_bf16" (ARMv8.6 with BF16)
and "sve". The engine picks the best one the CPU can run when the module is imported
(csrc/engine/cpu_dispatch.c); QWEN3LAYER_CPU_PATH=portable|avx2|avx512|avx512bf16|amx forces one
(on aarch64: portable|neon|neon_bf16|sve: portable scalar, neon the ARMv8.0 ASIMD copy, neon_bf16
the ARMv8.6 copy with BFDOT bf16 products, sve the copy for SVE, offered where named, never the default).

Where nvcc is found (PATH, $CUDA_HOME/bin or /usr/local/cuda/bin), kernels/cuda/*.cu are
built into qwen3layer/libq3cuda.so for sm_80, sm_87, sm_90, sm_100, sm_110, sm_120 and sm_121
(SASS) and compute_121 (PTX, for later GPUs), with the CUDA runtime linked in statically (CUDA_SASS; a change of
the targets or flags recompiles every CUDA object): the engine opens it only when a CUDA
device is asked for, so the package works on machines without CUDA. Q3_CUDA=0 skips it; without nvcc the build says it is CPU-only.

Where the CUDA toolkit's headers are found (cuda_runtime.h, cuda_bf16.h; no CUDA library is
needed), the same kernels/cuda/*.cu are also compiled by the host C++ compiler ($CXX, g++)
with -DQ3_SIMT against the SIMT executor (kernels/simt: its cuda_runtime.h and mma.h come
first on the include path) into qwen3layer/libq3simt.so: a CUDA device that runs the real
kernels on the CPU (qwen3layer.cuda.emulate()). Q3_SIMT=0 skips it. A sanitized build
instruments it too. The kernels' every typed access is checked for alignment
(-fsanitize=alignment, handled by the executor itself: a misaligned load fails the launch, as
on a GPU; not the executor's own code, FOLDER_FLAGS). Its recipe is in module-level helpers
(simt_recipe, compile_objects, link_library), which benchmarks/simt_check.py imports to build
variants with a defect planted (-DQ3_MUTANT_ID=n), and its objects in build/simt-check/plain/base
(SIMT_OBJECTS), where those variants take the files without a defect from: setup() runs only
where this file is the main script (pip's build backend, python setup.py).

Q3_SANITIZE=address,undefined (any list of -fsanitize= kinds) builds the extension, kernel
variants included, instrumented: -fsanitize=<kinds> -fno-sanitize-recover=undefined
-fno-omit-frame-pointer -fno-wrapv -g -O1 (-fno-wrapv: Python's CFLAGS define signed overflow,
which would hide it from UBSan), linked against the sanitizers' runtimes, in build/sanitize/
(objects of a normal build are never reused), and without the CUDA library (the SIMT
executor is built, instrumented). Python is not
built with ASan, so such an extension loads only with the runtime preloaded
(LD_PRELOAD=$(gcc -print-file-name=libasan.so)); .ci/sanitize builds and tests it that way
in a copy of the checkout.
"""
import concurrent.futures
import glob
import os
import platform
import shutil
import subprocess

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

VERSION = "0.1.0"
# csrc/<layer>/ of each module, bottom first (the rule: tests/tools/include_layers.py); _testing also
# compiles the glue's shared conversions (csrc/python/py_convert.c: no state)
CSRC_LAYERS = ["engine", "cuda", "python"]
TESTING_SOURCES = ["csrc/python/py_convert.c"]
TESTING_LAYERS = ["check", "testing"]
COMMON = ["-std=c11", "-O3", "-ffp-contract=fast", "-fopenmp", "-Wall", "-Wextra", "-Wno-unused-parameter",
          "-fno-strict-aliasing", "-D_GNU_SOURCE", "-fvisibility=hidden"]


def isa_variants(machine=None):
    """{variant: its compile flags} for `machine` (platform.machine()'s name; this one's by default)."""
    machine = (machine or platform.machine()).lower()
    if machine in ("aarch64", "arm64"):
        # portable scalar (the reference the harness checks the others against: ASIMD is the
        # neon variant's), neon the ARMv8.0 baseline, neon_bf16 with BFDOT and SDOT (kernels/cpu/
        # matmul_neon_bf16.c, matmul_int4_sdot.c; +dotprod: ARMv8.6 has it, clang 14 asks for
        # it by name), sve vector-length agnostic loops
        return {"portable": ["-march=armv8-a+nosimd"], "neon": ["-march=armv8-a"],
                "neon_bf16": ["-march=armv8.6-a+bf16+dotprod"], "sve": ["-march=armv8.2-a+sve"]}
    if machine not in ("x86_64", "amd64"):
        return {"portable": []}
    return {
        "portable": [],
        "avx2": ["-mavx2", "-mfma", "-mf16c"],
        "avx512": ["-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mavx2", "-mfma", "-mf16c"],
    }


SANITIZE = os.environ.get("Q3_SANITIZE", "").strip()


def sanitize_flags(kinds):
    """The compile flags of a build instrumented with -fsanitize=<kinds> ([] for none).
    -fno-wrapv: Python's own CFLAGS carry -fwrapv, which defines signed overflow and so hides
    it from UBSan; the sanitized build checks it as the C standard has it (undefined)."""
    return ([f"-fsanitize={kinds}", "-fno-sanitize-recover=undefined", "-fno-omit-frame-pointer",
             "-fno-wrapv", "-g", "-O1"] if kinds else [])


SANITIZE_FLAGS = sanitize_flags(SANITIZE)
# The GPUs libq3cuda.so is compiled for: SASS for each (A100, Jetson Orin, H100/H200/GH200,
# B200, Jetson Thor, RTX 50xx, GB10 / DGX Spark), and PTX for the newest as well, which the
# driver compiles (JIT) on a later GPU. A SASS runs on a later GPU of its major version only,
# and PTX on a GPU at least its version: Thor (11.0) runs nothing without its own sm_110; Orin
# (8.7) and GB10 (12.1) would run sm_80's and sm_120's, compiled for themselves here. The list is also
# compiled into the library (Q3_CUDA_TARGETS, reported by q3_cuda_targets() in
# kernels/cuda/runtime.cu), which is where q3.build_info()["cuda_targets"] reads it.
CUDA_SASS = ["sm_80", "sm_87", "sm_90", "sm_100", "sm_110", "sm_120", "sm_121"]


def cuda_targets(sass=CUDA_SASS):
    """The targets, in the form cuobjdump names them: each SASS, then compute_<newest> (PTX)."""
    return [*sass, "compute_" + sass[-1].split("_")[1]]


def cuda_arch_flags(sass=CUDA_SASS):
    """nvcc's -gencode flags: SASS for each of `sass`, PTX for the newest too."""
    flags = []
    for i, arch in enumerate(sass):
        num = arch.split("_")[1]
        code = f"[sm_{num},compute_{num}]" if i == len(sass) - 1 else f"sm_{num}"
        flags += ["-gencode", f"arch=compute_{num},code={code}"]
    return flags


CUDA_ARCHS = cuda_arch_flags()
# compiling: the targets recorded in the library; --threads 2: a file's gencode passes run
# two at a time (the pool runs a file per core, but the build ends with its slowest file alone).
# Measured on the project's 2 cores (2026-11-30, other builds running): the 13 files took 22 s
# for sm_80 + sm_90, 53 s for four targets and the PTX, 45 s with --threads 2; 85 s for the
# seven targets and the PTX of today (2026-12-06).
CUDA_COMPILE = ["-std=c++17", "-O3", "-Xcompiler", "-fPIC", *CUDA_ARCHS, "--threads", "2",
                f'-DQ3_CUDA_TARGETS="{",".join(cuda_targets())}"', "-Ikernels"]


def find_nvcc():
    if os.environ.get("Q3_CUDA") == "0" or SANITIZE:
        return None
    for candidate in (shutil.which("nvcc"), os.path.join(os.environ.get("CUDA_HOME", "/usr/local/cuda"), "bin", "nvcc")):
        if candidate and os.path.exists(candidate):
            return candidate
    return None


def find_cuda_headers():
    """The CUDA toolkit's include folder (cuda_runtime.h and cuda_bf16.h: headers only, no
    library) for the SIMT executor, or None; Q3_SIMT=0 skips the executor."""
    if os.environ.get("Q3_SIMT") == "0":
        return None
    roots = [os.environ.get("CUDA_HOME"), "/usr/local/cuda"]
    nvcc = shutil.which("nvcc")
    if nvcc:
        roots.append(os.path.dirname(os.path.dirname(os.path.realpath(nvcc))))
    for root in filter(None, roots):
        include = os.path.join(root, "include")
        if all(os.path.exists(os.path.join(include, h)) for h in ("cuda_runtime.h", "cuda_bf16.h")):
            return include
    return None


# flags a folder's sources get after the recipe's: the SIMT executor's runtime is not checked
# for alignment (its own types keep it aligned; the check is for the kernels' accesses, and
# in the runtime's hot paths, the warp primitives and the scheduler, it cost a quarter of
# their time)
FOLDER_FLAGS = {"kernels/simt": ["-fno-sanitize=alignment"]}


def compile_objects(tool, compile_flags, sources, headers, objdir, force=False, quiet=False):
    """Compiles the stale sources (newer than their object or a header) with `tool`, in
    parallel (one core a file), into objdir/<name>.o; the objects in the sources' order.
    A source in a folder of FOLDER_FLAGS gets that folder's flags last. quiet: no line a file."""
    os.makedirs(objdir, exist_ok=True)
    objects, stale = [], []
    newest_header = max(map(os.path.getmtime, headers), default=0)
    for src in sources:
        obj = os.path.join(objdir, os.path.basename(src) + ".o")
        if force or not os.path.exists(obj) or os.path.getmtime(obj) < max(os.path.getmtime(src), newest_header):
            stale.append((src, obj))
        objects.append(obj)

    def compile_one(job):
        src, obj = job
        if not quiet:
            print(f"{os.path.basename(tool)} {src}")
        extra = FOLDER_FLAGS.get(os.path.dirname(os.path.normpath(src)), [])
        subprocess.check_call([tool, *compile_flags, *extra, "-c", src, "-o", obj])

    with concurrent.futures.ThreadPoolExecutor(max_workers=os.cpu_count() or 1) as pool:
        list(pool.map(compile_one, stale))
    return objects


def command_changed(objdir, command):
    """Whether objdir's objects were compiled with another command than `command` (or an
    unknown one: no objdir/command.txt, which record_command writes after a build): the targets
    or flags changed, so every object is stale, whatever its time."""
    try:
        with open(os.path.join(objdir, "command.txt")) as f:
            return f.read() != " ".join(command) + "\n"
    except OSError:
        return True


def record_command(objdir, command):
    with open(os.path.join(objdir, "command.txt"), "w") as f:
        f.write(" ".join(command) + "\n")


def link_library(tool, objects, link_flags, target):
    """Links the objects into the shared library `target` with `tool`."""
    os.makedirs(os.path.dirname(target) or ".", exist_ok=True)
    subprocess.check_call([tool, *objects, *link_flags, "-o", target])


# the unsanitized executor's objects, shared by the package's libq3simt.so and
# benchmarks/simt_check.py's variants with a defect planted, which build with the same recipe:
# compiled once, by whichever comes first (relative to the checkout)
SIMT_OBJECTS = os.path.join("build", "simt-check", "plain", "base")


def simt_recipe(include, sanitize=SANITIZE_FLAGS):
    """How libq3simt.so (the SIMT executor with kernels/cuda/*.cu) is built, given the CUDA
    toolkit's include folder and the sanitizer flags: (compiler, compile flags, link flags,
    sources, headers). Also for benchmarks/simt_check.py's variants with planted defects.
    -fsanitize=alignment: every typed access is checked for its alignment, and the executor
    (kernels/simt/reports.cpp) handles the check itself, as a failed launch, so no UBSan
    runtime is needed (and in a sanitized build too: -fsanitize-recover=alignment)."""
    flags = ["-std=c++17", "-x", "c++", "-DQ3_SIMT", "-O2", "-g", "-fPIC", "-fno-strict-aliasing", "-Wall",
             "-Wno-unused-function", "-Wno-unknown-pragmas", "-Ikernels/simt/include", f"-I{include}", *sanitize,
             "-fsanitize=alignment", "-fsanitize-recover=alignment"]
    headers = (glob.glob("kernels/simt/*.h") + glob.glob("kernels/simt/include/*.h") + glob.glob("kernels/cuda/*.cuh")
               + glob.glob("kernels/cuda/*.h") + glob.glob("kernels/*.h"))
    sources = sorted(glob.glob("kernels/cuda/*.cu")) + sorted(glob.glob("kernels/simt/*.cpp"))
    link = ["-shared", "-pthread", *[f for f in sanitize if f.startswith("-fsanitize")]]
    return os.environ.get("CXX", "g++"), flags, link, sources, headers


class BuildKernelVariants(build_ext):
    """Compiles kernels/cpu/*.c once per variant and links every copy into the extension;
    builds libq3cuda.so beside it when nvcc is there."""

    def finalize_options(self):
        super().finalize_options()
        if SANITIZE:  # its own objects: a sanitized and a plain build never share one
            tag = SANITIZE.replace(",", "-")
            self.build_temp = os.path.join("build", "sanitize", tag, "temp")
            self.build_lib = os.path.join("build", "sanitize", tag, "lib")

    def compile_library(self, tool, compile_flags, link_flags, sources, headers, objdir, target):
        """Compiles the stale sources with `tool` (compile_objects) and links `target`."""
        objects = compile_objects(tool, compile_flags, sources, headers, objdir, self.force)
        link_library(tool, objects, link_flags, target)

    def build_cuda(self, ext):
        nvcc = find_nvcc()
        target = os.path.join(os.path.dirname(self.get_ext_fullpath(ext.name)), "libq3cuda.so")
        if not nvcc:
            print("qwen3layer: nvcc not found: building the CPU-only package (no CUDA backend)")
            if os.path.exists(target):
                os.remove(target)
            return
        headers = glob.glob("kernels/cuda/*.cuh") + glob.glob("kernels/cuda/*.h") + glob.glob("kernels/*.h")
        objdir = os.path.join(self.build_temp, "cuda")
        command = [nvcc, *CUDA_COMPILE]
        forced, self.force = self.force, self.force or command_changed(objdir, command)
        try:
            self.compile_library(nvcc, CUDA_COMPILE, ["-shared", "-cudart", "static", *CUDA_ARCHS],
                                 sorted(glob.glob("kernels/cuda/*.cu")), headers, objdir, target)
        finally:
            self.force = forced
        record_command(objdir, command)
        print(f"qwen3layer: built the CUDA backend {target}")

    def build_simt(self, ext):
        """The same kernels for the SIMT executor: kernels/cuda/*.cu as C++ with the executor's
        runtime (kernels/simt), into libq3simt.so, which qwen3layer.cuda.emulate() opens."""
        include = find_cuda_headers()
        target = os.path.join(os.path.dirname(self.get_ext_fullpath(ext.name)), "libq3simt.so")
        if not include:
            print("qwen3layer: the CUDA toolkit's headers were not found: no SIMT executor (the CUDA kernels "
                  "cannot be run on the CPU)")
            if os.path.exists(target):
                os.remove(target)
            return
        cxx, flags, link, sources, headers = simt_recipe(include)
        objdir = os.path.join(self.build_temp, "simt") if SANITIZE else SIMT_OBJECTS
        self.compile_library(cxx, flags, link, sources, headers, objdir, target)
        print(f"qwen3layer: built the SIMT executor {target}")

    def run(self):
        inplace = self.inplace
        super().run()
        if inplace:  # setuptools builds in build/lib, then copies only the extension back
            for ext in self.extensions[:1]:  # the libraries sit beside _C
                package = os.path.dirname(ext.name.replace(".", os.sep))
                for library in ("libq3cuda.so", "libq3simt.so"):
                    built = os.path.join(self.build_lib, package, library)
                    source = os.path.join(package, library)
                    if os.path.exists(built):
                        shutil.copyfile(built, source)
                        os.chmod(source, 0o755)
                    elif os.path.exists(source):
                        os.remove(source)

    def build_extension(self, ext):
        sources = sorted(glob.glob("kernels/cpu/*.c"))
        objects = []
        if ext.name == "qwen3layer._C":
            self.build_cuda(ext)
            self.build_simt(ext)
            for isa, flags in isa_variants().items():
                objects += self.compiler.compile(
                    sources, output_dir=os.path.join(self.build_temp, "isa", isa),
                    macros=[("Q3_ISA", isa)], include_dirs=ext.include_dirs,
                    extra_postargs=COMMON + flags + SANITIZE_FLAGS, depends=ext.depends)
        else:  # _testing: the oracle, the portable kernels with the twins (Q3_CPU_TWINS, isa.h)
            objects += self.compiler.compile(
                sources, output_dir=os.path.join(self.build_temp, "isa", "portable-twins"),
                macros=[("Q3_ISA", "portable"), ("Q3_TWINS", "1")], include_dirs=ext.include_dirs,
                extra_postargs=COMMON + SANITIZE_FLAGS, depends=ext.depends)
        ext.extra_objects = objects
        # setuptools relinks only for newer sources or depends, not for newer extra objects:
        # a kernel edited alone must still reach the extension
        target = self.get_ext_fullpath(ext.name)
        stale = not os.path.exists(target) or any(os.path.getmtime(o) > os.path.getmtime(target) for o in objects)
        forced, self.force = self.force, self.force or stale
        try:
            super().build_extension(ext)
        finally:
            self.force = forced


def extensions():
    """_C, then _testing unless Q3_TESTING=0."""
    depends = sorted(glob.glob("csrc/*/*.h")) + sorted(glob.glob("kernels/*.h")) + sorted(glob.glob("kernels/cpu/*.h"))
    found = [Extension(
        "qwen3layer._C",
        sources=[src for layer in CSRC_LAYERS for src in sorted(glob.glob(f"csrc/{layer}/*.c"))],
        extra_compile_args=COMMON + [f'-DQ3_VERSION="{VERSION}"'] + SANITIZE_FLAGS,
        extra_link_args=["-fopenmp", "-ldl"] + SANITIZE_FLAGS,
        depends=depends,
    )]
    if os.environ.get("Q3_TESTING") != "0":
        found.append(Extension(
            "qwen3layer._testing",
            sources=TESTING_SOURCES + [src for layer in TESTING_LAYERS for src in sorted(glob.glob(f"csrc/{layer}/*.c"))],
            extra_compile_args=COMMON + SANITIZE_FLAGS,
            extra_link_args=["-fopenmp"] + SANITIZE_FLAGS,
            depends=depends,
        ))
    return found


if __name__ == "__main__":  # pip and `python setup.py` run it so; benchmarks/simt_check.py imports the helpers
    setup(
        version=VERSION,
        cmdclass={"build_ext": BuildKernelVariants},
        ext_modules=extensions(),
    )
