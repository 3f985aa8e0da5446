"""Drop-in use inside transformers models: qwen3layer.torch.DecoderLayer is a torch.nn.Module
with Qwen3MoeDecoderLayer's forward signature that runs the C layer, sharing the transformers
layer's weights without copies; patch_model swaps every decoder layer of a Qwen3MoeModel or
Qwen3MoeForCausalLM in place, unpatch_model puts the originals back.

The keys and values live in the layer's own C cache. The model's cache (transformers'
DynamicCache, passed as `cache` or `past_key_values`) still drives its bookkeeping
(get_seq_length, the masks it builds), so each call also appends placeholders of one
element per token to it: 4 bytes per token, sequence and layer in fp32, instead of a second
copy of K and V (2 * num_kv_heads * head_dim elements per token). Left-padded batches work:
each sequence's padding is read off generate's position_ids and set on the C cache, so real
tokens neither attend to the padding nor count it in their positions.

Each layer's C cache rides on the model cache's entry for that layer (its `_q3_cache`), and the
entry's class is swapped for a subclass that mirrors on the C cache every operation
generation performs on the entry: reorder_cache (beam search), crop (assisted and
prompt-lookup decoding), batch_repeat_interleave, batch_select_indices and reset; and
copy.deepcopy of the model cache copies the C cache with it (KVCache.__deepcopy__). An
operation it cannot mirror (offloading) raises NotImplementedError naming it.
"""
from __future__ import annotations

from typing import Any, Dict, Optional

import torch

from .layer import DecoderLayer as _CoreLayer


class DecoderLayer(torch.nn.Module):
    """A Qwen3MoeDecoderLayer replacement backed by qwen3layer's C engine, for inference:
    its outputs carry no gradient."""

    def __init__(self, core: _CoreLayer, layer_idx: int, original: Optional[torch.nn.Module] = None,
                 max_tokens: int = 4096) -> None:
        super().__init__()
        self.core = core
        self.layer_idx = layer_idx
        self.max_tokens = max_tokens
        self.kv_cache = None  # the C cache of the generation in progress
        # kept out of the module tree so that the model's parameters are not listed twice
        self.__dict__["original"] = original

    @classmethod
    def from_hf(cls, hf_layer: torch.nn.Module, max_tokens: int = 4096) -> "DecoderLayer":
        """From a transformers Qwen3MoeDecoderLayer; its weights are shared, not copied, and
        the C layer runs where they are (the CPU, or their CUDA device, on torch's stream).
        max_tokens: the longest sequence (prompt + generated) a generation may reach."""
        layer_idx = getattr(hf_layer.self_attn, "layer_idx", 0)
        where = next(hf_layer.parameters()).device
        device = "cpu" if where.type == "cpu" else f"cuda:{where.index or 0}"
        return cls(_CoreLayer.from_hf(hf_layer, device=device), layer_idx, hf_layer, max_tokens)

    def _cache_for(self, model_cache: Any, batch: int, position_ids: Optional[torch.Tensor]):
        """The C cache riding on the model cache's entry for this layer, or a new one when a
        generation starts (each sequence's left padding read off its first position_ids)."""
        seen = model_cache.get_seq_length(self.layer_idx) if model_cache is not None else 0
        entry = _entry(model_cache, self.layer_idx)
        kv = getattr(entry, "_q3_cache", None)
        if seen == 0 or kv is None:
            if seen:
                raise RuntimeError(f"qwen3layer layer {self.layer_idx}: the model cache holds {seen} tokens this "
                                   "layer never saw (was it patched in the middle of a generation?)")
            kv = self.core.new_cache(self.max_tokens, batch)
            for b, pad in enumerate(_left_padding(position_ids, batch)):
                if pad:
                    kv.set_padding(pad, b)
        elif kv.lengths != (seen,) * batch:
            raise RuntimeError(f"qwen3layer layer {self.layer_idx}: the model cache holds {seen} tokens, this "
                               f"layer's cache {kv.lengths}")
        self.kv_cache = kv  # the last one used, for inspection
        return kv

    def forward(self, hidden_states: torch.Tensor, attention_mask: Optional[torch.Tensor] = None,
                position_ids: Optional[torch.LongTensor] = None, past_key_values: Any = None,
                use_cache: Optional[bool] = False, cache_position: Optional[torch.LongTensor] = None,
                position_embeddings: Any = None, cache: Any = None, **kwargs: Any) -> torch.Tensor:
        model_cache = cache if cache is not None else past_key_values
        B, L, _ = hidden_states.shape
        x = hidden_states.detach().contiguous()  # inference only: the C layer has no backward
        if model_cache is None or not use_cache:
            return self.core.prefill(x, self.core.new_cache(L, B))
        kv = self._cache_for(model_cache, B, position_ids)
        y = self.core.prefill(x, kv)
        marker = torch.zeros(B, 1, L, 1, dtype=hidden_states.dtype, device=hidden_states.device)
        model_cache.update(marker, marker, self.layer_idx)
        _attach(_entry(model_cache, self.layer_idx), kv)
        return y


def _entry(model_cache: Any, layer_idx: int) -> Any:
    """the model cache's entry (a cache layer) for layer_idx, None before it has one"""
    layers = getattr(model_cache, "layers", None)
    if layers is None:
        raise NotImplementedError(f"qwen3layer: a model cache of type {type(model_cache).__name__} (without cache "
                                  "layers) cannot be mirrored on the C cache")
    return layers[layer_idx] if layer_idx < len(layers) else None


def _attach(entry: Any, kv: Any) -> None:
    """ties the C cache kv to the model cache's entry: the entry's class becomes one that
    mirrors generation's operations on it"""
    cls = type(entry)
    if not getattr(cls, "_q3_mirrors", False):
        entry.__class__ = _mirroring(cls)
    entry._q3_cache = kv


_MIRRORING: Dict[type, type] = {}


def _mirroring(base: type) -> type:
    """the subclass of a cache-layer class that mirrors its operations on `_q3_cache`"""
    if base in _MIRRORING:
        return _MIRRORING[base]

    def mirrored_length(self) -> None:
        """crop: whatever the transformers version's argument meant, the entry's new length is
        what the C cache keeps"""
        kv = getattr(self, "_q3_cache", None)
        if kv is not None:
            kv.crop(self.get_seq_length())

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        base.reorder_cache(self, beam_idx)
        if getattr(self, "_q3_cache", None) is not None:
            self._q3_cache.reorder(beam_idx.tolist())

    def crop(self, *args: Any, **kwargs: Any) -> None:
        base.crop(self, *args, **kwargs)
        mirrored_length(self)

    def batch_repeat_interleave(self, repeats: int) -> None:
        base.batch_repeat_interleave(self, repeats)
        if getattr(self, "_q3_cache", None) is not None:
            self._q3_cache = self._q3_cache.repeat_interleave(repeats)

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        base.batch_select_indices(self, indices)
        if getattr(self, "_q3_cache", None) is not None:
            idx = torch.as_tensor(indices)
            if idx.dtype == torch.bool:
                idx = idx.nonzero().flatten()
            self._q3_cache = self._q3_cache.select(idx.flatten().tolist())

    def reset(self) -> None:
        base.reset(self)
        if getattr(self, "_q3_cache", None) is not None:
            self._q3_cache.reset()

    def refuse(name: str):
        def method(self, *args: Any, **kwargs: Any) -> None:
            raise NotImplementedError(f"qwen3layer: {name} of a cache layer cannot be mirrored on the C cache")
        method.__name__ = name
        return method

    ns: Dict[str, Any] = {"_q3_mirrors": True, "reorder_cache": reorder_cache, "crop": crop,
                          "batch_repeat_interleave": batch_repeat_interleave,
                          "batch_select_indices": batch_select_indices, "reset": reset}
    for name in ("offload", "prefetch"):
        if hasattr(base, name):
            ns[name] = refuse(name)
    _MIRRORING[base] = type(f"Q3Mirrored{base.__name__}", (base,), ns)
    return _MIRRORING[base]


def _left_padding(position_ids: Optional[torch.Tensor], batch: int) -> list:
    """Leading padding tokens of each sequence in a generation's first call: generate gives a
    left-padded sequence's real tokens positions 0, 1, ... and its padding 0 (transformers 5)
    or 1 (4.57), so the padding ends at the last position 0."""
    if position_ids is None or position_ids.dim() != 2:
        return [0] * batch
    pads = []
    for row in position_ids.expand(batch, -1).tolist():
        zeros = [i for i, p in enumerate(row) if p == 0]
        pads.append(zeros[-1] if zeros else 0)
    return pads


def _layers(model: torch.nn.Module) -> torch.nn.ModuleList:
    inner = getattr(model, "model", model)
    layers = getattr(inner, "layers", None)
    if not isinstance(layers, torch.nn.ModuleList):
        raise TypeError(f"model: expected a Qwen3MoeModel or Qwen3MoeForCausalLM, got {type(model).__name__}")
    return layers


def patch_model(model: torch.nn.Module, max_tokens: int = 4096) -> torch.nn.Module:
    """Replaces every decoder layer of the model by a qwen3layer one (in place; returns the model)."""
    layers = _layers(model)
    for i, layer in enumerate(layers):
        if not isinstance(layer, DecoderLayer):
            layers[i] = DecoderLayer.from_hf(layer, max_tokens)
    return model


def unpatch_model(model: torch.nn.Module) -> torch.nn.Module:
    """Puts the original transformers layers back (in place; returns the model)."""
    layers = _layers(model)
    for i, layer in enumerate(layers):
        if isinstance(layer, DecoderLayer):
            layers[i] = layer.original
    return model
