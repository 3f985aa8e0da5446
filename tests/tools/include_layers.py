"""The layering rule of the C and CUDA sources, read from their #include lines.

A folder is a layer. A file includes only from its own folder and from layers below it:

    kernels/                 op declarations shared by both backends (rank 0)
    kernels/simt/            the SIMT executor: the CUDA runtime the CPU build of the CUDA
                             kernels sees (its include/ folder is part of it) (rank 1)
    kernels/cpu/, kernels/cuda/    the kernels of each backend (rank 2, siblings)
    csrc/engine/             the engine: layer, KV cache, workspace, CPU dispatch (rank 3)
    csrc/cuda/               the engine's CUDA host side (rank 4)
    csrc/check/              kernel self-check against the CPU twins (rank 5); its cpu_ops/
                             folder is part of it (the CPU op harness, a program of its own)
    csrc/python/             the CPython glue of qwen3layer._C (rank 6)
    csrc/testing/            the CPython glue of qwen3layer._testing, the check harness's
                             module (rank 7)

The glue includes, besides its own folder, only the engine's public headers: csrc/engine/q3.h
and csrc/cuda/q3_cuda.h (csrc/testing/ also csrc/check/q3_check.h and csrc/python/py_convert.h),
so that engine internals (structs, dispatch tables) stay the engine's. The engine's own
headers (ENGINE_OWN: the CPU's stages and pass loop) are included from csrc/engine/ alone: a
device backend sees the layer through csrc/engine/layer_object.h.

Folders of equal rank do not include each other (the CPU and CUDA kernels are twins, not
clients). Quoted includes are paths relative to the including file (the build passes no
include directories but the executor's, reached with <...>), so each must name a file of the
tree. Python's headers belong to the glue (csrc/python/, csrc/testing/) alone, the CUDA toolkit's to kernels/cuda/ and
kernels/simt/ alone: the engine reaches CUDA only through the launcher table.

    python tests/tools/include_layers.py        # prints each violation, exit 1 if any
"""
from __future__ import annotations

import os
import re
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

LAYERS = {
    "kernels": 0,
    "kernels/simt": 1,
    "kernels/cpu": 2,
    "kernels/cuda": 2,
    "csrc/engine": 3,
    "csrc/cuda": 4,
    "csrc/check": 5,
    "csrc/python": 6,
    "csrc/testing": 7,
}
GLUE_LAYERS = ("csrc/python", "csrc/testing")  # the folders that may include Python's headers
# Below its own folder the glue sees the engine only through its public headers (and the
# testing module's glue the check harness's and the conversions shared with _C's glue)
PUBLIC_HEADERS = ("csrc/engine/q3.h", "csrc/cuda/q3_cuda.h")
GLUE_SEES = {"csrc/python": PUBLIC_HEADERS,
             "csrc/testing": PUBLIC_HEADERS + ("csrc/check/q3_check.h", "csrc/python/py_convert.h")}
ENGINE_OWN = ("csrc/engine/layer_internal.h",)
PART_OF = {"kernels/simt/include": "kernels/simt", "csrc/check/cpu_ops": "csrc/check"}  # a folder that belongs to another's layer
CUDA_LAYERS = ("kernels/cuda", "kernels/simt")
SOURCE_EXTENSIONS = (".c", ".h", ".cu", ".cuh", ".cpp")
PYTHON_HEADERS = re.compile(r"^(Python\.h|pythread\.h|structmember\.h|numpy/.*)$")
CUDA_HEADERS = re.compile(r"^(cuda(_runtime|_runtime_api|_bf16|_fp16|_fp8)?\.h|mma\.h|cublas.*\.h|"
                          r"library_types\.h|vector_types\.h|cooperative_groups.*|cuda/.*)$")
INCLUDE = re.compile(r'^\s*#\s*include\s*([<"])([^>"]+)[>"]')


def sources(root: str = ROOT) -> list[str]:
    """Every C/CUDA source under csrc/ and kernels/, as paths relative to root."""
    found = []
    for top in ("csrc", "kernels"):
        for folder, _, files in os.walk(os.path.join(root, top)):
            found += [os.path.relpath(os.path.join(folder, f), root) for f in files if f.endswith(SOURCE_EXTENSIONS)]
    return sorted(found)


def layer_of(path: str) -> str | None:
    folder = os.path.dirname(path).replace(os.sep, "/")
    folder = PART_OF.get(folder, folder)
    return folder if folder in LAYERS else None


def violations(root: str = ROOT) -> list[str]:
    """'file:line: what is wrong' for every include that breaks the rule."""
    out = []
    for path in sources(root):
        layer = layer_of(path)
        if layer is None:
            out.append(f"{path}: in no layer (the layers are {', '.join(sorted(LAYERS))})")
            continue
        with open(os.path.join(root, path), encoding="utf-8", errors="replace") as f:
            lines = f.readlines()
        for number, line in enumerate(lines, 1):
            m = INCLUDE.match(line)
            if not m:
                continue
            quote, name = m.groups()
            where = f"{path}:{number}"
            if PYTHON_HEADERS.match(os.path.basename(name)) or PYTHON_HEADERS.match(name):
                if layer not in GLUE_LAYERS:
                    out.append(f"{where}: includes {name}, which only csrc/python/ and csrc/testing/ may")
                continue
            if CUDA_HEADERS.match(name):
                if layer not in CUDA_LAYERS:
                    out.append(f"{where}: includes the CUDA toolkit's {name}, which only kernels/cuda/ and "
                               "kernels/simt/ may")
                continue
            if quote == "<":
                continue
            target = os.path.normpath(os.path.join(os.path.dirname(path), name))
            if target.startswith("..") or not os.path.isfile(os.path.join(root, target)):
                out.append(f'{where}: "{name}" is no file of the tree (quoted includes are relative to the file)')
                continue
            target_layer = layer_of(target)
            if target_layer is None:
                out.append(f'{where}: "{name}" is {target}, in no layer')
            elif target_layer != layer and LAYERS[target_layer] >= LAYERS[layer]:
                side = "beside" if LAYERS[target_layer] == LAYERS[layer] else "above"
                out.append(f"{where}: {layer}/ includes {target}, from {target_layer}/, a layer {side} it")
            elif target.replace(os.sep, "/") in ENGINE_OWN and layer != "csrc/engine":
                out.append(f"{where}: {layer}/ includes {target}, the engine's own (a backend sees the layer "
                           "through csrc/engine/layer_object.h)")
            elif target_layer != layer and layer in GLUE_SEES and target.replace(os.sep, "/") not in GLUE_SEES[layer]:
                out.append(f"{where}: {layer}/ includes {target}, no public header of the engine (the glue "
                           f"includes {', '.join(GLUE_SEES[layer])} and its own folder)")
    return out


if __name__ == "__main__":
    found = violations()
    for v in found:
        print(v)
    print(f"{len(sources())} files, {len(found)} include(s) against the layering rule", file=sys.stderr)
    sys.exit(1 if found else 0)
