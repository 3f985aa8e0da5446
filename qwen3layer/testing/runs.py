"""The runs qwen3layer.testing compares: a qwen3layer DecoderLayer over hidden states, a
transformers Qwen3MoeDecoderLayer over the same (causal, from position 0, with a cache; the
one implementation of it: tests/helpers/hf_reference.py's run calls it), a model patched by
qwen3layer.torch.patch_model and its unpatched transformers twin over the same forward kwargs,
and the copies of a reference in another dtype. Each run gives {output name: (tensor, token
axis)}; hidden states are [batch, tokens, hidden], keys and values [batch, kv heads, tokens,
head_dim]. No math of the layer: transformers computes the reference, the C layer ours."""
from __future__ import annotations

import copy
import inspect
from dataclasses import dataclass
from typing import Any, Dict, Optional, Sequence, Tuple

import torch

Outputs = Dict[str, Tuple[torch.Tensor, int]]


@dataclass
class LayerRun:
    """What a transformers decoder layer's call gave, and what its cache then held."""
    y: torch.Tensor       # [B, S, H]
    keys: torch.Tensor    # [B, Hkv, start + S, D]
    values: torch.Tensor  # [B, Hkv, start + S, D]
    router_logits: torch.Tensor  # [B * S, E]
    attention: Optional[torch.Tensor] = None  # [B, Hq, S, start + S] eager attention's probabilities


def _cache_kwarg(hf_layer: torch.nn.Module) -> str:
    params = inspect.signature(hf_layer.forward).parameters
    return "cache" if "cache" in params else "past_key_values"  # 5.x names it cache, 4.57 past_key_values


def rotary_of(hf_layer: torch.nn.Module) -> torch.nn.Module:
    """Qwen3MoeRotaryEmbedding of the layer's config, in float32 (its inv_freq as a model
    loaded in any dtype keeps it; a model cast by .to() rounds it, the C layer never)."""
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeRotaryEmbedding
    return Qwen3MoeRotaryEmbedding(config=hf_layer.self_attn.config)


def run_hf_layer(hf_layer: torch.nn.Module, rotary: torch.nn.Module, x: torch.Tensor, config: Any,
                 cache: Any = None, start: int = 0, allowed: Optional[torch.Tensor] = None,
                 positions: Optional[torch.Tensor] = None) -> LayerRun:
    """hf_layer over x [B, S, H] at positions [start, start + S), causal, appending to `cache`
    (a transformers DynamicCache of `config`; a new one by default); cos and sin from rotary.
    allowed [B, S, start + S] bool: the keys each query sees instead (transformers' 4D mask,
    additive); positions [B, S]: the tokens' positions instead."""
    from transformers.cache_utils import DynamicCache
    layer_idx = hf_layer.self_attn.layer_idx
    B, S, _ = x.shape
    cache = cache if cache is not None else DynamicCache(config=config)
    pos = positions if positions is not None else torch.arange(start, start + S)[None].expand(B, S)
    cos, sin = rotary(x, pos)
    total = start + S
    mask = torch.full((S, total), torch.finfo(x.dtype).min, dtype=x.dtype)
    mask = torch.triu(mask, diagonal=start + 1)[None, None].expand(B, 1, S, total)
    if allowed is not None:
        mask = torch.zeros(B, 1, S, total, dtype=x.dtype).masked_fill(~allowed[:, None], torch.finfo(x.dtype).min)
    logits, maps = [], []
    hooks = [hf_layer.mlp.gate.register_forward_hook(
                 lambda m, i, o: logits.append((o[0] if isinstance(o, tuple) else o).detach())),
             hf_layer.self_attn.register_forward_hook(  # (attn_output, attn_weights): eager gives the weights
                 lambda m, i, o: maps.append(o[1].detach() if isinstance(o, tuple) and o[1] is not None else None))]
    try:
        with torch.no_grad():
            y = hf_layer(x, attention_mask=mask, position_ids=pos, use_cache=True,
                         position_embeddings=(cos, sin), **{_cache_kwarg(hf_layer): cache})
    finally:
        for h in hooks:
            h.remove()
    y = y[0] if isinstance(y, tuple) else y
    return LayerRun(y, cache.layers[layer_idx].keys, cache.layers[layer_idx].values, logits[0], maps[0])


def float_dtype(module: torch.nn.Module) -> Optional[torch.dtype]:
    """the one dtype of the module's floating parameters (None: none, or several)"""
    kinds = {p.dtype for p in module.parameters() if p.is_floating_point()}
    return kinds.pop() if len(kinds) == 1 else None


def in_dtype(module: torch.nn.Module, dtype: torch.dtype) -> torch.nn.Module:
    """module itself where its parameters are all `dtype`, else a copy in it. In float64 the
    copy runs transformers 5.x's experts one by one (grouped_mm has no float64 kernel)."""
    if float_dtype(module) == dtype:
        return module
    twin = copy.deepcopy(module).to(dtype)
    if dtype == torch.float64:
        for m in twin.modules():
            cfg = getattr(m, "config", None)
            if hasattr(cfg, "_experts_implementation_internal"):
                cfg._experts_implementation_internal = "eager"
    return twin


def reference_layer_outputs(hf_layer: torch.nn.Module, rotary: torch.nn.Module,
                            x: torch.Tensor) -> Tuple[Outputs, torch.Tensor]:
    """a transformers decoder layer's output and cache over x [B, S, H] in one call, and its
    router logits [B * S, E]"""
    run = run_hf_layer(hf_layer, rotary, x, hf_layer.self_attn.config)
    return {"y": (run.y, 1), "keys": (run.keys, 2), "values": (run.values, 2)}, run.router_logits


def routing_margin(logits: torch.Tensor, k: int) -> float:
    """Smallest gap between the k-th and (k+1)-th router probability over all tokens (1.0
    where every expert is chosen): where it is below rounding, a choice can flip."""
    p = torch.softmax(logits.double(), dim=-1)
    top = torch.topk(p, min(k + 1, p.shape[-1]), dim=-1).values
    return float((top[:, k - 1] - top[:, k]).min()) if top.shape[-1] > k else 1.0


def _call_sizes(call: Any) -> Tuple[int, Optional[int]]:
    tokens, chunk = call if isinstance(call, tuple) else (call, None)
    return int(tokens), None if chunk is None else int(chunk)


def layer_outputs(layer: Any, x: torch.Tensor, calls: Sequence[Any]) -> Outputs:
    """our layer over x [B, S, H] through a new cache, in `calls` (checked by the caller): the
    first a prefill, a later call of 1 token a decode step, any other a prefill continuing the
    cache; a (tokens, chunk_size) pair a prefill of passes of chunk_size tokens"""
    B, S, H = x.shape
    cache = layer.new_cache(S, batch=B)
    ys, done = [], 0
    for i, call in enumerate(calls):
        tokens, chunk = _call_sizes(call)
        part = x[:, done:done + tokens]
        if i > 0 and tokens == 1 and chunk is None:
            y = layer.decode(part[:, 0].contiguous(), cache)
        else:
            y = layer.prefill((part if B > 1 else part[0]).contiguous(), cache, chunk_size=chunk)
        ys.append(y.reshape(B, tokens, H))
        done += tokens
    keys = torch.stack([torch.from_dlpack(cache.keys(b)).clone() for b in range(B)])
    values = torch.stack([torch.from_dlpack(cache.values(b)).clone() for b in range(B)])
    return {"y": (torch.cat(ys, dim=1), 1), "keys": (keys, 2), "values": (values, 2)}


def model_outputs(model: torch.nn.Module, inputs: Dict[str, Any]) -> Outputs:
    """a model's logits and, where it returns its cache, every layer's keys and values"""
    with torch.no_grad():
        out = model(**inputs)
    outs: Outputs = {"logits": (out.logits.detach().clone(), 1)}
    cache = out["cache"] if "cache" in out else out.get("past_key_values")  # 5.x: cache, 4.57: past_key_values
    for i, entry in enumerate(getattr(cache, "layers", None) or ()):
        outs[f"layers.{i}.keys"] = (entry.keys.detach().clone(), 2)
        outs[f"layers.{i}.values"] = (entry.values.detach().clone(), 2)
    return outs
