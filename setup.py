"""Build of the qwen3layer C extension (qwen3layer._C): the engine (csrc/) and the CPU
kernels (kernels/cpu/), C11 with OpenMP. Nothing here needs torch.

Environment:
  Q3_PORTABLE=1   build for the baseline of the architecture instead of -march=native
                  (native is right for a build on the machine that runs it, as pip does)
"""
import glob
import os
import sys

from setuptools import Extension, setup

VERSION = "0.1.0"


def compile_args():
    args = ["-std=c11", "-O3", "-fopenmp", "-Wall", "-Wextra", "-Wno-unused-parameter",
            "-fno-strict-aliasing", "-D_GNU_SOURCE", f'-DQ3_VERSION="{VERSION}"']
    if os.environ.get("Q3_PORTABLE") != "1":
        args.append("-march=native")
    return args


if sys.platform == "win32":  # pragma: no cover - the project targets Linux and macOS toolchains
    raise SystemExit("qwen3layer builds with gcc or clang (C11 + OpenMP)")

sources = sorted(glob.glob("csrc/*.c")) + sorted(glob.glob("kernels/cpu/*.c"))

setup(
    version=VERSION,
    ext_modules=[
        Extension(
            "qwen3layer._C",
            sources=sources,
            include_dirs=["csrc", "kernels"],
            extra_compile_args=compile_args(),
            extra_link_args=["-fopenmp"],
            depends=sorted(glob.glob("csrc/*.h")) + sorted(glob.glob("kernels/*.h")),
        )
    ],
)
