"""A prefill run pass by pass by Python around the layer's halves (the expert-parallel layer,
qwen3layer.parallel, and the layer split over the GPU and the host, qwen3layer.hybrid): the
insides of each pass gathered into the whole call's."""
from __future__ import annotations

from typing import Any, Optional, Sequence

import torch

from ._C import KVCache
from .config import LayerConfig


def rewind(cache: Any, lengths: Sequence[int]) -> None:
    """each sequence of the cache back to lengths[s] tokens: what a call that failed after
    appending (a split layer's, qwen3layer.hybrid and qwen3layer.parallel) undoes"""
    for s, n in enumerate(lengths):
        if cache.lengths[s] != n:
            cache.truncate(n, s)


class Insides:
    """A call's insides gathered pass by pass into the shapes DecoderLayer gives for the whole
    call: router rows at the pass's tokens; attention maps [batch, heads, tokens, context] with
    each pass's columns (the cache so far) placed and the rest 0, as the whole call's are where
    a query does not look."""

    def __init__(self, c: LayerConfig, kind: str, x: torch.Tensor, cache: KVCache, insides: dict,
                 seq: Optional[int]) -> None:
        lead = tuple(x.shape[:-1])
        self.router = insides["return_router"]
        at = x.device
        self.logits = torch.zeros(lead + (c.num_experts,), device=at) if self.router else None
        self.experts = torch.zeros(lead + (c.num_experts_per_tok,), dtype=torch.int32, device=at) \
            if self.router else None
        self.weights = torch.zeros(lead + (c.num_experts_per_tok,), device=at) if self.router else None
        self.maps = None
        if insides["return_attention"]:
            decode = kind == "decode"
            batch = x.shape[0] if decode or x.dim() == 3 else 1
            tokens = 1 if decode else x.shape[-2]
            seqs = range(batch) if decode or x.dim() == 3 else [seq or 0]
            context = max((cache.lengths[s] + tokens for s in seqs), default=0) if x.shape[0] else 0
            self.maps = torch.zeros(batch, c.num_attention_heads, tokens, context, device=at)

    def add(self, sl: slice, trace: Any) -> None:
        if self.router:
            for mine, theirs in ((self.logits, trace.router_logits), (self.experts, trace.experts),
                                 (self.weights, trace.expert_weights)):
                mine[..., sl, :] = theirs
        if self.maps is not None:
            maps = trace.attention
            self.maps[:, :, sl, :maps.shape[-1]] = maps

    def done(self, y: torch.Tensor) -> Any:
        from .trace import LayerTrace
        return LayerTrace(y, self.logits, self.experts, self.weights, self.maps)
