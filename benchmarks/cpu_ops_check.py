"""Builds and runs the CPU op harness, the program cpu_ops_check (csrc/check/cpu_ops/: every op
of the CPU kernel table on every CPU path this machine runs, against the portable path; in the
manner of ggml's test-backend-ops). It is built from the sources, not from the package: the
kernels of kernels/cpu/ once per instruction-set variant with setup.py's flags (isa_variants,
COMMON), the engine's path selection (csrc/engine/cpu_dispatch.c, status.c) and the harness,
into build/cpu-ops-check/<machine>/cpu_ops_check; only stale objects are compiled again. The
program needs no Python: --cc and --machine build it for another architecture (a cross
compiler), to run under emulation there (qemu-aarch64 build/cpu-ops-check/aarch64/cpu_ops_check).

    python benchmarks/cpu_ops_check.py                          # build, run, its exit status
    python benchmarks/cpu_ops_check.py --plant swiglu:avx2      # a planted defect: must fail
    python benchmarks/cpu_ops_check.py --hide avx2,avx512,avx512bf16,amx   # portable alone: fails
    python benchmarks/cpu_ops_check.py --build-only --cc aarch64-linux-gnu-gcc --machine aarch64
    python benchmarks/cpu_ops_check.py --build-only --cc "clang --target=aarch64-linux-gnu" --machine aarch64 --no-openmp

--cc is a command (words split as a shell does: a compiler and its target). A compiler other than
gcc builds into build/cpu-ops-check/<machine>-<its name>, beside gcc's. --no-openmp builds the
program serial (a cross clang has no aarch64 OpenMP runtime here: Debian's libomp is the host's).
The program's arguments (--plant, --hide) are passed through; its output is cpu_ops/main.c's.
"""
from __future__ import annotations

import argparse
import glob
import importlib.util
import os
import platform
import shlex
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ENGINE_SOURCES = ["csrc/engine/cpu_dispatch.c", "csrc/engine/status.c"]


def _setup():
    """setup.py as a module (its setup() call runs only as __main__): the build's flags."""
    spec = importlib.util.spec_from_file_location("q3_setup", os.path.join(ROOT, "setup.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def build(cc: str = "gcc", machine: str | None = None, quiet: bool = True, openmp: bool = True) -> str:
    """Compiles what is stale and links the program; returns its path. cc: the compiler's
    command (shell words)."""
    s = _setup()
    machine = (machine or platform.machine()).lower()
    words = shlex.split(cc)
    tool = os.path.basename(words[0])
    out = os.path.join("build", "cpu-ops-check", machine if tool.endswith("gcc") else f"{machine}-{tool}")
    common = [flag for flag in s.COMMON if openmp or flag != "-fopenmp"]
    headers = sorted(glob.glob("kernels/*.h") + glob.glob("kernels/cpu/*.h") + glob.glob("csrc/engine/*.h")
                     + glob.glob("csrc/check/cpu_ops/*.h"))
    units = [(f"isa-{isa}", [f"-DQ3_ISA={isa}", *flags], sorted(glob.glob("kernels/cpu/*.c")))
             for isa, flags in s.isa_variants(machine).items()]
    units += [("engine", [], ENGINE_SOURCES), ("harness", [], sorted(glob.glob("csrc/check/cpu_ops/*.c")))]
    objects = []
    cwd = os.getcwd()
    os.chdir(ROOT)  # setup.py's recipe and these paths are relative to the checkout
    try:
        for name, flags, sources in units:
            objdir, command = os.path.join(out, name), [*words, *common, *flags]
            objects += s.compile_objects(words[0], command[1:], sources, headers, objdir,
                                         s.command_changed(objdir, command), quiet=quiet)
            s.record_command(objdir, command)
        target = os.path.join(out, "cpu_ops_check")
        s.link_library(words[0], objects, [*words[1:], *(["-fopenmp"] if openmp else []), "-lm"], target)
        return os.path.join(ROOT, target)
    finally:
        os.chdir(cwd)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--cc", default=os.environ.get("CC", "gcc"),
                   help="the C compiler's command (a cross compiler for --machine, or e.g. \"clang --target=...\")")
    p.add_argument("--no-openmp", action="store_true", help="build without OpenMP (the program runs serial)")
    p.add_argument("--machine", help="the target's platform.machine() name (this machine's by default)")
    p.add_argument("--build-only", action="store_true", help="build and print the program's path, do not run it")
    p.add_argument("--verbose", action="store_true", help="print each file compiled")
    args, program_args = p.parse_known_args()
    program = build(args.cc, args.machine, quiet=not args.verbose, openmp=not args.no_openmp)
    if args.build_only:
        print(program)
        return 0
    return subprocess.run([program, *program_args]).returncode


if __name__ == "__main__":
    sys.exit(main())
