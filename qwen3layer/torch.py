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
"""
from __future__ import annotations

from typing import Any, Optional

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
        """The C cache matching the model cache's state: a new one when a generation starts,
        with each sequence's left padding read off its first position_ids."""
        seen = model_cache.get_seq_length(self.layer_idx) if model_cache is not None else 0
        if seen == 0 or self.kv_cache is None or self.kv_cache.batch != batch:
            if seen:
                raise RuntimeError(f"qwen3layer layer {self.layer_idx}: the model cache holds {seen} tokens this "
                                   "layer never saw (was it patched in the middle of a generation?)")
            self.kv_cache = self.core.new_cache(self.max_tokens, batch)
            for b, pad in enumerate(_left_padding(position_ids, batch)):
                if pad:
                    self.kv_cache.set_padding(pad, b)
        elif self.kv_cache.lengths != (seen,) * batch:
            raise RuntimeError(f"qwen3layer layer {self.layer_idx}: the model cache holds {seen} tokens, this "
                               f"layer's cache {self.kv_cache.lengths}")
        return self.kv_cache

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
        return y


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
