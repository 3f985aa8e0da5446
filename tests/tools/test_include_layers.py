"""The C/CUDA tree keeps its layers (tests/tools/include_layers.py): the real tree has no include
against the rule, and each kind of violation planted in a small tree is reported."""
import os

import include_layers


def test_tree_follows_the_layering_rule():
    files = include_layers.sources()
    assert any(f.startswith("csrc/engine/") for f in files) and any(f.startswith("kernels/cuda/") for f in files)
    assert include_layers.violations() == []


def test_every_csrc_file_is_in_a_layer_folder():
    for path in include_layers.sources():
        assert include_layers.layer_of(path) is not None, path


def plant(root, files):
    for path, text in files.items():
        full = os.path.join(root, path)
        os.makedirs(os.path.dirname(full), exist_ok=True)
        with open(full, "w") as f:
            f.write(text)


def test_planted_violations_are_reported(tmp_path):
    plant(tmp_path, {
        "kernels/dtype.h": "#include <stdint.h>\n",
        "kernels/cpu/ops.h": '#include "../dtype.h"\n',
        "kernels/cuda/ops_cuda.h": '#include "../dtype.h"\n#include <cuda_runtime.h>\n',
        "kernels/cuda/twin.cu": '#include "../cpu/ops.h"\n',                        # sibling
        "csrc/engine/q3.h": '#include "../../kernels/dtype.h"\n',
        "csrc/engine/glue.c": "#include <Python.h>\n",                            # Python outside python/
        "csrc/engine/cudart.c": "#include <cuda_bf16.h>\n",                        # CUDA outside kernels/cuda/
        "csrc/engine/lost.c": '#include "missing.h"\n',                           # no such file
        "csrc/engine/layer_internal.h": '#include "q3.h"\n',
        "csrc/engine/layer.c": '#include "q3.h"\n#include "../cuda/backend.h"\n'     # upward
                               '#include "layer_internal.h"\n',                   # the engine's own, at home
        "csrc/cuda/passes.c": '#include "../engine/layer_internal.h"\n',          # the engine's own
        "csrc/cuda/backend.h": '#include "../engine/q3.h"\n#include "../../kernels/cuda/ops_cuda.h"\n',
        "csrc/cuda/q3_cuda.h": '#include "../engine/q3.h"\n',
        "csrc/python/module.c": '#include <Python.h>\n#include "../engine/q3.h"\n#include "../cuda/q3_cuda.h"\n'
                                '#include "../cuda/backend.h"\n#include "../check/h.h"\n',   # internals
        "csrc/check/h.h": '#include "../python/x.h"\n',                            # upward
        "csrc/python/x.h": "\n",
        "csrc/stray.c": "\n",                                                    # in no layer
    })
    found = include_layers.violations(str(tmp_path))
    expected = [
        ("csrc/check/h.h:1", "from csrc/python/, a layer above"),
        ("csrc/cuda/passes.c:1", "csrc/engine/layer_internal.h, the engine's own"),
        ("csrc/engine/cudart.c:1", "cuda_bf16.h"),
        ("csrc/engine/glue.c:1", "Python.h"),
        ("csrc/engine/layer.c:2", "from csrc/cuda/, a layer above"),
        ("csrc/engine/lost.c:1", "no file of the tree"),
        ("csrc/python/module.c:4", "csrc/cuda/backend.h, no public header of the engine"),
        ("csrc/python/module.c:5", "csrc/check/h.h, no public header of the engine"),
        ("csrc/stray.c", "in no layer"),
        ("kernels/cuda/twin.cu:1", "from kernels/cpu/, a layer beside"),
    ]
    assert len(found) == len(expected), found
    for (where, what), line in zip(expected, sorted(found)):
        assert line.startswith(where + ":") and what in line, (where, what, line)
