"""The drop-in layer's call as a torch custom op (torch.ops.qwen3layer.decoder_layer), for
torch.compile.

Under torch.compile, Dynamo traces the model's forward; the C layer's call (reading the mask,
finding the C cache, the DLPack exchange, the C engine) cannot be traced and would break the
graph, and a mask read into Python would specialise the graph on each length. So a patched
layer traced by Dynamo calls this op instead: one opaque node whose fake implementation
gives the output's shape and dtype (those of the hidden states), so a forward and a decode
step compile with fullgraph=True and shapes stay symbolic. At run time the op does what the
eager call does (qwen3layer.torch.DecoderLayer.call), with the same checks and errors.

The op takes tensors and ints only. The layer travels as a handle (an int per layer); the
model cache as the keys tensor of the layer's entry, which after the first call is a view
of the layer's C cache (qwen3layer.torch.cache): its address finds the model cache it
belongs to. So a compiled call continues a cache made by an eager call (generate's
prefill, or a first forward); a compiled first call with a cache (use_cache=True on a new
DynamicCache) raises RuntimeError saying so. No gradient flows through the op.
"""
from __future__ import annotations

import weakref
from typing import Any, Dict, Optional, Tuple

import torch

_LAYERS: Dict[int, Any] = {}    # handle -> weakref of a drop-in DecoderLayer
_CACHES: Dict[int, Tuple[Any, int]] = {}  # address of a C cache's keys -> (weakref of the model cache, layer)
_PRUNE_AT = [4096]  # the registry's size at which dead entries are dropped (doubles with the live ones)


def register_layer(layer: Any) -> int:
    handle = id(layer)
    _LAYERS[handle] = weakref.ref(layer, lambda _, h=handle: _LAYERS.pop(h, None))
    return handle


def register_cache(keys: torch.Tensor, model_cache: Any, layer_idx: int) -> None:
    """the model cache whose entry for layer_idx holds these keys (a view of a C cache)"""
    if not keys.numel():
        return
    address = keys.data_ptr()
    known = _CACHES.get(address)
    if known is not None and known[0]() is model_cache and known[1] == layer_idx:
        return  # every step of a generation: the same C cache
    if len(_CACHES) >= _PRUNE_AT[0]:  # the model caches of finished generations
        for dead in [a for a, (ref, _) in _CACHES.items() if ref() is None]:
            del _CACHES[dead]
        _PRUNE_AT[0] = max(4096, 2 * len(_CACHES))
    _CACHES[address] = (weakref.ref(model_cache), layer_idx)


def _model_cache(keys: Optional[torch.Tensor], layer_idx: int) -> Any:
    found = _CACHES.get(keys.data_ptr()) if keys is not None and keys.numel() else None
    cache = found[0]() if found is not None else None
    if cache is None or found[1] != layer_idx:
        raise RuntimeError(
            f"qwen3layer layer {layer_idx}: under torch.compile, the model cache's keys must be the C cache's view an "
            "eager call left there: run the first call with a cache (the prefill) uncompiled, or compile a forward "
            "with use_cache=False (generate compiles only its decode steps)")
    return cache


@torch.library.custom_op("qwen3layer::decoder_layer", mutates_args=())
def decoder_layer(hidden_states: torch.Tensor, attention_mask: Optional[torch.Tensor],
                  position_ids: Optional[torch.Tensor], cu_seq_lens: Optional[torch.Tensor],
                  cache_position: Optional[torch.Tensor], keys: Optional[torch.Tensor], handle: int,
                  with_cache: bool) -> torch.Tensor:
    """the drop-in layer `handle`'s call on hidden_states [batch, tokens, hidden]; with_cache:
    the call appends to the model cache whose entry holds `keys`"""
    ref = _LAYERS.get(handle)
    layer = ref() if ref is not None else None
    if layer is None:
        raise RuntimeError(f"qwen3layer: the drop-in layer of handle {handle} is gone")
    model_cache = _model_cache(keys, layer.layer_idx) if with_cache else None
    kwargs = {name: t for name, t in (("cu_seq_lens_q", cu_seq_lens), ("cache_position", cache_position))
              if t is not None}
    with torch.no_grad():
        return layer.call(hidden_states, attention_mask, position_ids, model_cache, kwargs)


@decoder_layer.register_fake
def _(hidden_states, attention_mask, position_ids, cu_seq_lens, cache_position, keys, handle, with_cache):
    return torch.empty_like(hidden_states)
