"""The CUDA kernel launchers, read from their table (kernels/cuda/ops_cuda.h: the q3_cuda_ops
fields after its "kernels:" comment, the runtime helpers before it), and the launchers the kernel
self-check's cases name (csrc/check/kernel_check.c: RUN's first argument, '+'-separated), so
that no test keeps a hand copy of either list."""
import os
import re

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..")
KERNELS_MARK = "/* kernels: the CPU twin's arguments, then the stream */"


def _read(*path):
    with open(os.path.join(ROOT, *path), encoding="utf-8") as f:
        return f.read()


def header_launchers():
    """the kernel launchers of q3_cuda_ops, in the header's order"""
    text = _read("kernels", "cuda", "ops_cuda.h")
    struct = re.search(r"typedef struct \{(.*?)\} q3_cuda_ops;", text, re.S).group(1)
    assert struct.count(KERNELS_MARK) == 1, "ops_cuda.h: the kernels' comment marks where the launchers begin"
    return re.findall(r"\bint \(\*(\w+)\)\(", struct.split(KERNELS_MARK)[1])


def checked_launchers():
    """the launchers some case of the kernel self-check names"""
    runs = re.findall(r'\bRUN\("([\w+]+)"', _read("csrc", "check", "kernel_check.c"))
    return {name for kernels in runs for name in kernels.split("+")}
