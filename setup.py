"""Build of the qwen3layer C extension (qwen3layer._C): the engine (csrc/) and the CPU
kernels (kernels/cpu/), C11 with OpenMP. Nothing here needs torch.

The kernels are compiled once per instruction set, each copy with its own names
(kernels/cpu/isa.h): "portable" for the architecture's baseline and, on x86-64, "avx2"
(with FMA) and "avx512" (F, BW, VL, DQ; BF16 and AMX code inside it is enabled per
function). The engine picks the best one the CPU can run when the module is imported
(csrc/cpu_dispatch.c); QWEN3LAYER_CPU_PATH=portable|avx2|avx512|avx512bf16|amx forces one.
"""
import glob
import os
import platform

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

VERSION = "0.1.0"
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


class BuildKernelVariants(build_ext):
    """Compiles kernels/cpu/*.c once per variant and links every copy into the extension."""

    def build_extension(self, ext):
        sources = sorted(glob.glob("kernels/cpu/*.c"))
        objects = []
        for isa, flags in isa_variants().items():
            objects += self.compiler.compile(
                sources, output_dir=os.path.join(self.build_temp, "isa", isa),
                macros=[("Q3_ISA", isa)], include_dirs=ext.include_dirs,
                extra_postargs=COMMON + flags, depends=ext.depends)
        ext.extra_objects = objects
        super().build_extension(ext)


setup(
    version=VERSION,
    cmdclass={"build_ext": BuildKernelVariants},
    ext_modules=[
        Extension(
            "qwen3layer._C",
            sources=sorted(glob.glob("csrc/*.c")),
            include_dirs=["csrc", "kernels"],
            extra_compile_args=COMMON + [f'-DQ3_VERSION="{VERSION}"'],
            extra_link_args=["-fopenmp"],
            depends=sorted(glob.glob("csrc/*.h")) + sorted(glob.glob("kernels/*.h"))
            + sorted(glob.glob("kernels/cpu/*.h")),
        )
    ],
)
