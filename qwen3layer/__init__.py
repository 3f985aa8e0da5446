"""qwen3layer: one Qwen3-235B-A22B decoder layer (GQA attention with QK-norm and RoPE,
128-expert top-8 MoE) in C, for prefill, chunked prefill and decode, with a KV cache
owned by C and tensors exchanged zero-copy through DLPack."""
from . import _C
from .config import LayerConfig
from .layer import DecoderLayer, KVCache, Tensor

CacheFullError = _C.CacheFullError
__version__ = _C.build_info()["version"]


def build_info() -> dict:
    """What this build contains: version, compiled backends, CPU features, threads, compiler."""
    return _C.build_info()


__all__ = ["LayerConfig", "DecoderLayer", "KVCache", "Tensor", "CacheFullError", "build_info"]
