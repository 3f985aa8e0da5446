"""Build of the qwen3layer C extension (qwen3layer._C): csrc/ (the engine, its CUDA host
side, the check harness and the CPython glue, one folder each) and the CPU kernels
(kernels/cpu/), C11 with OpenMP. Nothing here needs torch. Every #include is a path
relative to its file, so no include directories are passed.

The kernels are compiled once per instruction set, each copy with its own names
(kernels/cpu/isa.h): "portable" for the architecture's baseline and, on x86-64, "avx2"
(with FMA) and "avx512" (F, BW, VL, DQ; BF16 and AMX code inside it is enabled per
function). The engine picks the best one the CPU can run when the module is imported
(csrc/engine/cpu_dispatch.c); QWEN3LAYER_CPU_PATH=portable|avx2|avx512|avx512bf16|amx forces one.

Where nvcc is found (PATH, $CUDA_HOME/bin or /usr/local/cuda/bin), kernels/cuda/*.cu are
built into qwen3layer/libq3cuda.so for sm_80 and sm_90, with the CUDA runtime linked in
statically: the engine opens it only when a CUDA device is asked for, so the package works
on machines without CUDA. Q3_CUDA=0 skips it; without nvcc the build says it is CPU-only.

Q3_SANITIZE=address,undefined (any list of -fsanitize= kinds) builds the extension, kernel
variants included, instrumented: -fsanitize=<kinds> -fno-sanitize-recover=undefined
-fno-omit-frame-pointer -fno-wrapv -g -O1 (-fno-wrapv: Python's CFLAGS define signed overflow,
which would hide it from UBSan), linked against the sanitizers' runtimes, in build/sanitize/
(objects of a normal build are never reused), and without the CUDA library. Python is not
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
CSRC_LAYERS = ["engine", "cuda", "check", "python"]  # csrc/<layer>/, bottom first (the rule: tests/include_layers.py)
COMMON = ["-std=c11", "-O3", "-ffp-contract=fast", "-fopenmp", "-Wall", "-Wextra", "-Wno-unused-parameter",
          "-fno-strict-aliasing", "-D_GNU_SOURCE"]


def isa_variants():
    if platform.machine().lower() not in ("x86_64", "amd64"):
        return {"portable": []}
    return {
        "portable": [],
        "avx2": ["-mavx2", "-mfma", "-mf16c"],
        "avx512": ["-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mavx2", "-mfma", "-mf16c"],
    }


SANITIZE = os.environ.get("Q3_SANITIZE", "").strip()
# -fno-wrapv: Python's own CFLAGS carry -fwrapv, which defines signed overflow and so hides it
# from UBSan; the sanitized build checks it as the C standard has it (undefined)
SANITIZE_FLAGS = ([f"-fsanitize={SANITIZE}", "-fno-sanitize-recover=undefined", "-fno-omit-frame-pointer",
                   "-fno-wrapv", "-g", "-O1"] if SANITIZE else [])
CUDA_ARCHS = ["-gencode", "arch=compute_80,code=sm_80", "-gencode", "arch=compute_90,code=sm_90"]


def find_nvcc():
    if os.environ.get("Q3_CUDA") == "0" or SANITIZE:
        return None
    for candidate in (shutil.which("nvcc"), os.path.join(os.environ.get("CUDA_HOME", "/usr/local/cuda"), "bin", "nvcc")):
        if candidate and os.path.exists(candidate):
            return candidate
    return None


class BuildKernelVariants(build_ext):
    """Compiles kernels/cpu/*.c once per variant and links every copy into the extension;
    builds libq3cuda.so beside it when nvcc is there."""

    def finalize_options(self):
        super().finalize_options()
        if SANITIZE:  # its own objects: a sanitized and a plain build never share one
            tag = SANITIZE.replace(",", "-")
            self.build_temp = os.path.join("build", "sanitize", tag, "temp")
            self.build_lib = os.path.join("build", "sanitize", tag, "lib")

    def build_cuda(self, ext):
        nvcc = find_nvcc()
        target = os.path.join(os.path.dirname(self.get_ext_fullpath(ext.name)), "libq3cuda.so")
        if not nvcc:
            print("qwen3layer: nvcc not found: building the CPU-only package (no CUDA backend)")
            if os.path.exists(target):
                os.remove(target)
            return
        objdir = os.path.join(self.build_temp, "cuda")
        os.makedirs(objdir, exist_ok=True)
        objects, stale = [], []
        headers = glob.glob("kernels/cuda/*.cuh") + glob.glob("kernels/cuda/*.h") + glob.glob("kernels/*.h")
        for src in sorted(glob.glob("kernels/cuda/*.cu")):
            obj = os.path.join(objdir, os.path.basename(src) + ".o")
            if self.force or not os.path.exists(obj) or os.path.getmtime(obj) < max(map(os.path.getmtime, [src] + headers)):
                stale.append((src, obj))
            objects.append(obj)

        def compile_one(job):
            src, obj = job
            print(f"nvcc {src}")
            subprocess.check_call([nvcc, "-std=c++17", "-O3", "-Xcompiler", "-fPIC", *CUDA_ARCHS,
                                   "-Ikernels", "-c", src, "-o", obj])

        # nvcc runs one file on one core: the files in parallel
        with concurrent.futures.ThreadPoolExecutor(max_workers=os.cpu_count() or 1) as pool:
            list(pool.map(compile_one, stale))
        os.makedirs(os.path.dirname(target), exist_ok=True)
        subprocess.check_call([nvcc, "-shared", "-cudart", "static", *CUDA_ARCHS, *objects, "-o", target])
        print(f"qwen3layer: built the CUDA backend {target}")

    def run(self):
        inplace = self.inplace
        super().run()
        if inplace:  # setuptools builds in build/lib, then copies only the extension back
            for ext in self.extensions:
                package = os.path.dirname(ext.name.replace(".", os.sep))
                built = os.path.join(self.build_lib, package, "libq3cuda.so")
                source = os.path.join(package, "libq3cuda.so")
                if os.path.exists(built):
                    shutil.copyfile(built, source)
                    os.chmod(source, 0o755)
                elif os.path.exists(source):
                    os.remove(source)

    def build_extension(self, ext):
        self.build_cuda(ext)
        sources = sorted(glob.glob("kernels/cpu/*.c"))
        objects = []
        for isa, flags in isa_variants().items():
            objects += self.compiler.compile(
                sources, output_dir=os.path.join(self.build_temp, "isa", isa),
                macros=[("Q3_ISA", isa)], include_dirs=ext.include_dirs,
                extra_postargs=COMMON + flags + SANITIZE_FLAGS, depends=ext.depends)
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


setup(
    version=VERSION,
    cmdclass={"build_ext": BuildKernelVariants},
    ext_modules=[
        Extension(
            "qwen3layer._C",
            sources=[src for layer in CSRC_LAYERS for src in sorted(glob.glob(f"csrc/{layer}/*.c"))],
            extra_compile_args=COMMON + [f'-DQ3_VERSION="{VERSION}"'] + SANITIZE_FLAGS,
            extra_link_args=["-fopenmp", "-ldl"] + SANITIZE_FLAGS,
            depends=sorted(glob.glob("csrc/*/*.h")) + sorted(glob.glob("kernels/*.h"))
            + sorted(glob.glob("kernels/cpu/*.h")),
        )
    ],
)
