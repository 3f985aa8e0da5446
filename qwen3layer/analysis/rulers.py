"""The three rulers of `python -m qwen3layer check`, each a measurement, a threshold and a
verdict: accuracy against transformers on the same weights, decode latency against this
machine's floor (bytes / a read probe run in the same command; not judged where the threshold
is below one call's overhead), and prefill memory beyond the weights and the KV cache. The
accuracy ruler needs torch and transformers; without them it says so instead of failing."""
from __future__ import annotations

import dataclasses
import statistics
import time
from typing import Optional

from .. import _C
from ..config import LayerConfig
from ..hf_config import hf_rope_kwargs
from ..layer import DecoderLayer
from .costs import cost_model


@dataclasses.dataclass
class Ruler:
    name: str
    value: Optional[float]
    threshold: Optional[float]
    unit: str
    passed: Optional[bool]  # None: not run
    detail: str

    def line(self) -> str:
        verdict = {True: "PASS", False: "FAIL", None: "NOT RUN"}[self.passed]
        if self.value is None:
            return f"{verdict:7s} {self.name}: {self.detail}"
        return f"{verdict:7s} {self.name}: {self.value:.4g} {self.unit} (threshold {self.threshold:.4g}) - {self.detail}"


def accuracy(cfg: LayerConfig, weights: dict, layer: DecoderLayer, dtype: str, tokens: int, seed: int) -> Ruler:
    """Our layer and transformers' on the same weights and input, each against an fp32 run of
    transformers on those (bf16-valued) weights: fp32 must agree to 1e-5, bf16 must err at most
    twice as much as transformers' own bf16 run. An FP8 or 4-bit layer: `weights` are its
    matrices dequantized to fp32 (transformers' bf16 run then rounds them to bf16); a 4-bit
    layer's experts, named one by one, are stacked into transformers' fused tensors."""
    name = "accuracy against transformers"
    try:
        import torch
        from transformers import Qwen3MoeConfig
        from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeDecoderLayer, Qwen3MoeRotaryEmbedding
    except ImportError as e:
        return Ruler(name, None, None, "", None, f"transformers and torch are needed for it ({e}); "
                     "pip install torch transformers")
    hc = Qwen3MoeConfig(hidden_size=cfg.hidden_size, num_attention_heads=cfg.num_attention_heads,
                        num_key_value_heads=cfg.num_key_value_heads, head_dim=cfg.head_dim,
                        num_experts=cfg.num_experts, num_experts_per_tok=cfg.num_experts_per_tok,
                        moe_intermediate_size=cfg.moe_intermediate_size, norm_topk_prob=cfg.norm_topk_prob,
                        rms_norm_eps=cfg.rms_norm_eps, **hf_rope_kwargs(cfg), num_hidden_layers=1,
                        vocab_size=16, intermediate_size=64, max_position_embeddings=cfg.max_position_embeddings)
    hc._attn_implementation, hc._experts_implementation = "sdpa", "grouped_mm"

    def hf_layer(tensor_dtype):
        with torch.device("meta"):
            m = Qwen3MoeDecoderLayer(hc, 0)
        state = {k: torch.from_dlpack(v).to(tensor_dtype) for k, v in weights.items()}
        if "mlp.experts.0.gate_proj.weight" in state:  # per expert (a 4-bit layer's): transformers 5.x holds them fused
            E = cfg.num_experts
            parts = {x: [state.pop(f"mlp.experts.{e}.{x}_proj.weight") for e in range(E)] for x in ("gate", "up", "down")}
            state["mlp.experts.gate_up_proj"] = torch.stack([torch.cat([g, u]) for g, u in zip(parts["gate"], parts["up"])])
            state["mlp.experts.down_proj"] = torch.stack(parts["down"])
        m.load_state_dict(state, assign=True)
        return m.eval()

    # an FP8 layer is measured against the dequantized weights it was given as reference
    what = ("" if layer.weight_format == "dense" else
            f", {'FP8' if layer.weight_format.startswith('fp8') else '4-bit'} weights against their dequantization")
    tdt = getattr(torch, dtype)  # float32, bfloat16 or float16
    theirs, exact = hf_layer(tdt), hf_layer(torch.float32)
    rope = Qwen3MoeRotaryEmbedding(hc)
    x = torch.randn(1, tokens, cfg.hidden_size, generator=torch.Generator().manual_seed(seed)).to(tdt)
    pos = torch.arange(tokens)[None]
    with torch.no_grad():
        cos, sin = rope(x.float(), pos)
        y_exact = exact(x.float(), position_ids=pos, position_embeddings=(cos, sin)).double()
        cos, sin = rope(x, pos)
        y_theirs = theirs(x, position_ids=pos, position_embeddings=(cos, sin)).double()
    y_ours = torch.from_dlpack(layer.prefill(x[0].to(layer.device), layer.new_cache(tokens))).double().cpu()
    delta = (y_exact[0] - x[0].double()).norm()
    err_ours = float((y_ours - y_exact[0]).norm() / delta)
    err_theirs = float((y_theirs[0] - y_exact[0]).norm() / delta)
    if dtype == "float32":
        return Ruler(name, err_ours, 1e-5, "relative error", err_ours <= 1e-5,
                     f"float32{what}, {tokens} tokens; transformers' own error is {err_theirs:.2e}")
    return Ruler(name, err_ours, 2 * err_theirs, "relative error", err_ours <= 2 * err_theirs,
                 f"{dtype}{what}, {tokens} tokens; the threshold is twice transformers' own {dtype} error")


def decode_step_median(layer: DecoderLayer, context: int, steps: int = 12) -> float:
    """Median seconds of one decode step at `context` tokens (the first two steps left out),
    the cache truncated back after each step."""
    cache = layer.new_cache(context + 1)
    H = layer.config.hidden_size
    for t0 in range(0, context, 512):
        layer.prefill(layer.random_input((min(512, context - t0), H), 5 + t0), cache)
    x = layer.random_input((1, H), 9)
    times = []
    for _ in range(steps):
        t = time.perf_counter()
        layer.decode(x, cache)
        times.append(time.perf_counter() - t)
        cache.truncate(context)
    return statistics.median(times[2:])


def decode_latency(cfg: LayerConfig, layer: DecoderLayer, dtype: str, context: int, factor: float) -> Ruler:
    """Median decode time per token against bytes / read bandwidth probed now. Not judged
    (passed None) where the threshold is below one call's overhead, measured as a decode step
    of LayerConfig.tiny() at context 0 on the same device (it reads under 0.15 MB):
    no kernel could meet such a threshold, so a tiny geometry measures the call, not memory."""
    name = "decode latency"
    gbs = _C.probe_read_bandwidth(1 << 30, 3)
    med = decode_step_median(layer, context)
    m = cost_model(cfg, "decode", 1, context, dtype=dtype, weight_format=layer.weight_format,
                   scale_dtype=layer._core.scale_dtype or "float32")
    floor = m.bytes / (gbs * 1e9)
    detail = (f"context {context}; floor {floor * 1e3:.3f} ms = {m.bytes / 1e6:.1f} MB / {gbs:.1f} GB/s read "
              f"probe; threshold {factor}x the floor")
    overhead = decode_step_median(DecoderLayer.random(LayerConfig.tiny(), 0, dtype, device=layer.device), 0)
    if factor * floor < overhead:
        return Ruler(name, med * 1e3, factor * floor * 1e3, "ms/token", None,
                     f"{detail}; not judged: the threshold is below one call's overhead ({overhead * 1e3:.3f} ms, "
                     "a decode step of the tiny geometry at context 0), so it measures the call, not the memory "
                     "(a larger geometry or --latency-factor judges it)")
    return Ruler(name, med * 1e3, factor * floor * 1e3, "ms/token", med <= factor * floor, detail)


def activation_bytes(layer: DecoderLayer, tokens: int, dtype: str) -> int:
    """Memory of a prefill beyond weights and cache: the workspace, the input and the output."""
    return layer.workspace_bytes + 2 * tokens * layer.config.hidden_size * (4 if dtype == "float32" else 2)


def prefill_memory(cfg: LayerConfig, weights: dict, dtype: str, device: str, tokens: int, chunk: int,
                   limit_mb: float) -> Ruler:
    """Activation memory of a prefill (workspace, input, output), beyond weights and cache."""
    layer = DecoderLayer(cfg, weights, device=device)
    layer.prefill(layer.random_input((tokens, cfg.hidden_size), 3), layer.new_cache(tokens), chunk_size=chunk)
    used = activation_bytes(layer, tokens, dtype)
    return Ruler("prefill memory", used / 2**20, limit_mb, "MiB", used / 2**20 <= limit_mb,
                 f"{tokens} tokens in chunks of {chunk}: workspace {layer.workspace_bytes / 2**20:.1f} MiB "
                 f"(grows with the chunk, not with the tokens) + input and output")
