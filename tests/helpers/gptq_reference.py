"""GPTQ int4 test material, written here from the packing rules alone (not from the library's
C): a matrix W [N, K] (out, in) is qweight int32 [K/8, N] (eight 4-bit values a word along
the inputs, lowest nibble first), qzeros int32 [G, N/8] (packed along the outputs), scales
float16 [G, N] and g_idx int32 [K] (each input's group); in the "gptq" (v1) format a zero is
the stored value plus 1. W[n, k] = scales[g_idx[k], n] * (q[k, n] - zero[g_idx[k], n]).

quantize() is a round-to-nearest quantizer into that layout (symmetric, zero 8, any g_idx:
desc_act's permuted groups too); dequantize() reads it back; gptq_model() turns the projections
of a transformers model into GPTQ tensors and puts their dequantized values into the model, so
that the model is the reference the layer is compared with."""
from __future__ import annotations

import torch
from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

from hf_reference import converted, draw_input, randomize_for_generation, rel_err, run

SHIFTS = torch.arange(8, dtype=torch.int64) * 4
ATTENTION = ("q_proj", "k_proj", "v_proj", "o_proj")


def pack(values: torch.Tensor, dim: int) -> torch.Tensor:
    """int values 0..15 packed eight to an int32 word along dim (0 or 1), lowest nibble first"""
    v = values.to(torch.int64)
    if dim == 1:
        return pack(v.t(), 0).t().contiguous()
    words = (v.reshape(v.shape[0] // 8, 8, *v.shape[1:]) << SHIFTS.view(1, 8, *([1] * (v.dim() - 1)))).sum(1)
    return torch.where(words >= 2 ** 31, words - 2 ** 32, words).to(torch.int32)


def unpack(words: torch.Tensor, dim: int) -> torch.Tensor:
    """pack's inverse: int64 values 0..15, eight per word along dim"""
    w = words.to(torch.int64) & 0xFFFFFFFF
    if dim == 1:
        return unpack(w.t(), 0).t()
    nib = (w.unsqueeze(1) >> SHIFTS.view(1, 8, *([1] * (w.dim() - 1)))) & 0xF
    return nib.reshape(w.shape[0] * 8, *w.shape[1:])


def quantize(w: torch.Tensor, group: int, g_idx: torch.Tensor | None = None, v1: bool = True,
             sym: bool = True) -> dict:
    """W [N, K] -> {qweight, qzeros, scales, g_idx}: per group and output, over the inputs of
    that group (g_idx: default k // group), symmetric: scale = fp16(2 amax / 15), zero 8;
    asymmetric (sym False): scale = fp16((max - min) / 15), zero = round(-min / scale) in 0..15;
    q = clamp(round(W / scale) + zero, 0, 15) by the stored scale; zeros stored minus 1 in v1"""
    N, K = w.shape
    g_idx = torch.arange(K) // group if g_idx is None else g_idx
    G = int(g_idx.max()) + 1
    w = w.float()
    scales = torch.empty(G, N, dtype=torch.float16)
    zeros = torch.full((G, N), 8, dtype=torch.int64)
    for g in range(G):
        part = w[:, g_idx == g]
        if sym:
            amax = part.abs().amax(dim=1)
            scales[g] = torch.where(amax == 0, torch.ones_like(amax), amax).mul(2 / 15).half()
        else:
            lo, hi = part.amin(dim=1).clamp(max=0), part.amax(dim=1).clamp(min=0)
            scales[g] = torch.where(hi == lo, torch.ones_like(hi), (hi - lo) / 15).half()
            zeros[g] = torch.round(-lo / scales[g].float()).clamp(0, 15).to(torch.int64)
    s = scales.float()[g_idx].t()  # [N, K]
    q = (torch.round(w / s) + zeros[g_idx].t()).clamp(0, 15)
    stored = zeros - int(v1)
    assert (stored >= 0).all(), "a v1 zero of 0 cannot be stored"
    return {"qweight": pack(q.t(), 0), "qzeros": pack(stored, 1), "scales": scales, "g_idx": g_idx.to(torch.int32)}


def dequantize(t: dict, v1: bool = True) -> torch.Tensor:
    """{qweight, qzeros, scales, g_idx} -> W [N, K] fp32"""
    q = unpack(t["qweight"], 0)  # [K, N]
    z = unpack(t["qzeros"], 1) + int(v1)  # [G, N]
    g = t["g_idx"].to(torch.int64)
    return (t["scales"].float()[g] * (q - z[g]).float()).t().contiguous()


def desc_act_g_idx(K: int, group: int, seed: int) -> torch.Tensor:
    """a permuted g_idx, as desc_act writes one: `group` inputs a group, in no order"""
    perm = torch.randperm(K, generator=torch.Generator().manual_seed(seed))
    return (perm // group).to(torch.int32)


def gptq_model(model, group: int = 128, desc_act: bool = False, seed: int = 0, v1: bool = True,
               sym: bool = True, dense_attention: bool = False) -> dict:
    """The GPTQ tensors of layer 0's projections ({checkpoint name: tensor}, experts per expert)
    with its norms and router as they are (the model's dtype), and the model's projections
    replaced in place by their dequantized values (transformers 5.x's fused experts or 4.57's
    per-expert modules); dense_attention: q/k/v/o_proj left as they are, their ".weight"s
    among the tensors (a checkpoint quantized to its experts alone)"""
    layer = model.model.layers[0]
    params = dict(layer.named_parameters())
    out = {}

    def one(module: str, w: torch.Tensor, k: int) -> torch.Tensor:
        size = w.shape[1] if group == -1 else group  # -1: one group of every input
        g_idx = desc_act_g_idx(w.shape[1], size, seed + k) if desc_act else None
        t = quantize(w.detach(), size, g_idx, v1, sym)
        for name, v in t.items():
            out[f"{module}.{name}"] = v
        return dequantize(t, v1).to(w.dtype)

    with torch.no_grad():
        for i, proj in enumerate(ATTENTION):
            p = params[f"self_attn.{proj}.weight"]
            if dense_attention:
                out[f"self_attn.{proj}.weight"] = p.detach().clone()
            else:
                p.copy_(one(f"self_attn.{proj}", p, i))
        if "mlp.experts.gate_up_proj" in params:  # transformers 5.x: gate_up [E, 2I, H], down [E, H, I]
            gu, dn = params["mlp.experts.gate_up_proj"], params["mlp.experts.down_proj"]
            I = gu.shape[1] // 2
            for e in range(gu.shape[0]):
                gu[e, :I] = one(f"mlp.experts.{e}.gate_proj", gu[e, :I], 10 + 3 * e)
                gu[e, I:] = one(f"mlp.experts.{e}.up_proj", gu[e, I:], 11 + 3 * e)
                dn[e] = one(f"mlp.experts.{e}.down_proj", dn[e], 12 + 3 * e)
        else:  # 4.57: mlp.experts.{e}.{gate,up,down}_proj.weight
            for name, p in params.items():
                if name.startswith("mlp.experts."):
                    e, proj = name.split(".")[2], name.split(".")[3]
                    p.copy_(one(f"mlp.experts.{e}.{proj}", p, 10 + 3 * int(e) + ("gate_proj", "up_proj",
                                                                                 "down_proj").index(proj)))
        for name, p in params.items():
            if not name.startswith("mlp.experts.") and not any(f".{a}." in name for a in ATTENTION):
                out[name] = p.detach().clone()
    return out


def random_model(geometry: dict, seed: int) -> Qwen3MoeForCausalLM:
    """a one-layer fp32 model of the geometry, every parameter re-randomised (norms near 1,
    matrices 1/sqrt(fan_in): hf_reference.randomize_for_generation), then the attention's
    q/k/v/o_proj normal(0, 0.15): scores large enough that a wrong mask, position or key shows"""
    torch.manual_seed(seed)
    cfg = Qwen3MoeConfig(vocab_size=16, intermediate_size=64, num_hidden_layers=1, max_position_embeddings=512,
                         rope_theta=1e6, rms_norm_eps=1e-6, attn_implementation="eager", pad_token_id=0, **geometry)
    model = Qwen3MoeForCausalLM(cfg).eval()
    randomize_for_generation(model)
    with torch.no_grad():
        for a in ATTENTION:
            getattr(model.model.layers[0].self_attn, a).weight.normal_(0.0, 0.15)
    return model


def prefill_then_decode_error(layer, model, tokens: int, seed: int) -> float:
    """rel_err of the layer's update (y - x) against transformers' float64 run of `model`, over
    a prefill of tokens - 1 and one decode step on one sequence"""
    x = draw_input(model, (1, tokens, model.config.hidden_size), seed=seed)
    exact = run(converted(model, torch.float64), x.double())
    cache = layer.new_cache(tokens + 3)
    y = torch.cat([torch.from_dlpack(layer.prefill(x[:, :-1].contiguous(), cache)),
                   torch.from_dlpack(layer.decode(x[:, -1].contiguous(), cache)).unsqueeze(1)], dim=1)
    return rel_err(y - x, exact.y - x.double())
