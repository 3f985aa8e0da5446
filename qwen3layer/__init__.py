"""qwen3layer: one Qwen3-235B-A22B decoder layer (GQA attention with QK-norm and RoPE,
128-expert top-8 MoE) in C, for prefill, chunked prefill and decode, with a KV cache
owned by C and tensors exchanged zero-copy through DLPack."""
import sys as _sys

from . import _C, cuda
from .analysis import costs, costs_hybrid, gpu_figures, mapplot, profile, routing, rulers
from .analysis.costs import CostModel, cost_model
from .analysis.mapplot import LayerMap, layer_map
from .analysis.routing import RoutingSummary, routing_summary
from .checkpoint import CheckpointError
from .config import LayerConfig
from .layer import DecodeGraph, DecoderLayer, KVCache, Tensor
from .trace import LayerTrace

# The analysis modules' paths before they moved into qwen3layer.analysis: `import
# qwen3layer.costs` and `from qwen3layer.costs_hybrid import ...` reach the same modules (the
# names above keep `qwen3layer.costs` and the others as attributes too).
for _module in (costs, costs_hybrid, gpu_figures, mapplot, profile, routing, rulers):
    _sys.modules[f"{__name__}.{_module.__name__.rpartition('.')[2]}"] = _module
del _module

CacheFullError = _C.CacheFullError
__version__ = _C.build_info()["version"]


def build_info() -> dict:
    """What this build contains: version, compiled backends ("cuda" when the CUDA library was
    built; it is loaded only when used), the GPU targets of the CUDA library ("cuda_targets":
    SASS such as 'sm_90', then 'compute_NN', the PTX of the newest, for later GPUs; [] without
    one), the CPU kernel path in use and those this CPU can run (lowest first), threads,
    compiler, default prefill chunk."""
    info = _C.build_info()
    if cuda.built():
        info["backends"] = info["backends"] + ["cuda"]
    info["cuda_targets"] = cuda.targets()
    return info


def set_cpu_path(name: str) -> None:
    """Use the CPU kernels of level `name` (one of build_info()['cpu_paths']) for the calls
    that start from now on. The best level is chosen at import (never avx512bf16: docs/api.md
    says why); the environment variable
    QWEN3LAYER_CPU_PATH chooses another. For comparisons and tests."""
    _C.set_cpu_path(name)


__all__ = ["LayerConfig", "DecoderLayer", "DecodeGraph", "KVCache", "Tensor", "CacheFullError", "CheckpointError",
           "build_info", "set_cpu_path", "cost_model", "CostModel", "LayerTrace",
           "LayerMap", "layer_map", "RoutingSummary", "routing_summary"]
