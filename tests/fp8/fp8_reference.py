"""FP8 test material: transformers models' projection matrices quantized to float8_e4m3fn in
128 x 128 blocks (the fine-grained FP8 format), the dequantized weights they stand for, and
FP8 checkpoints written from them (config.json with its quantization_config, one
model.safetensors) as the published Qwen3 FP8 checkpoints hold them: per-expert
mlp.experts.{e}.{gate,up,down}_proj.weight, each projection with its .weight_scale_inv."""
from __future__ import annotations

import json
import os

import torch
from safetensors.torch import save_file
from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

from hf_reference import randomize_for_generation

E4M3_MAX = 448.0
QUANT = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [128, 128]}
ATTENTION = ("q_proj", "k_proj", "v_proj", "o_proj")

# hidden 200 = 128 + 72, q/o 4 x 48 = 192 = 128 + 64, k/v 96, moe_inter 136 = 128 + 8: every
# matrix has a partial block in both directions, or is smaller than one block (the experts'
# rows are a multiple of 8, as transformers' bf16 grouped_mm needs)
ODD = dict(hidden_size=200, num_attention_heads=4, num_key_value_heads=2, head_dim=48, num_experts=6,
           num_experts_per_tok=2, moe_intermediate_size=136, norm_topk_prob=True)
# every dimension a multiple of 128 or below it: the only geometries transformers' dequantize
# reads right (it takes the block from the scale grid: rows // ceil(rows / 128), so 200 rows in
# two blocks of 100 rather than 128 + 72); hidden 96 and moe_inter 64 are single partial blocks
ALIGNED = dict(hidden_size=96, num_attention_heads=4, num_key_value_heads=2, head_dim=64, num_experts=6,
               num_experts_per_tok=2, moe_intermediate_size=64, norm_topk_prob=True)


def fp8_config(geometry: dict, layers: int = 1, vocab: int = 16) -> Qwen3MoeConfig:
    return Qwen3MoeConfig(vocab_size=vocab, intermediate_size=64, num_hidden_layers=layers, max_position_embeddings=512,
                          rope_theta=1e6, rms_norm_eps=1e-6, attn_implementation="eager", pad_token_id=0, **geometry)


def random_model(geometry: dict, seed: int, layers: int = 1, vocab: int = 16) -> Qwen3MoeForCausalLM:
    """A tiny fp32 model, every parameter re-randomised (norms near 1, matrices 1/sqrt(fan_in);
    embeddings and lm_head N(0, 9) so that greedy generation varies)."""
    torch.manual_seed(seed)
    model = Qwen3MoeForCausalLM(fp8_config(geometry, layers, vocab)).eval()
    randomize_for_generation(model)
    return model


def _blocks(t: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
    """[ceil(rows/128), ceil(cols/128)] per-block values expanded back to [rows, cols]"""
    return t.repeat_interleave(128, 0)[:rows].repeat_interleave(128, 1)[:, :cols]


def quantize(w: torch.Tensor, scale_dtype: torch.dtype = torch.float32):
    """(e4m3 [N, K], scale_inv [ceil(N/128), ceil(K/128)] of scale_dtype): each block's largest
    magnitude maps to 448; the division uses the stored (rounded) scale, so every quotient fits."""
    n, k = w.shape
    nb, kb = -(-n // 128), -(-k // 128)
    padded = torch.zeros(nb * 128, kb * 128, dtype=torch.float32)
    padded[:n, :k] = w.float()
    amax = padded.abs().reshape(nb, 128, kb, 128).amax(dim=(1, 3))
    scale = (amax / E4M3_MAX).clamp_min(1e-12).to(scale_dtype)
    q = (w.float() / _blocks(scale.float(), n, k)).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)
    return q.contiguous(), scale.contiguous()


def dequantize(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """W = q * scale_inv of its block, in fp32 (exact for bf16 scales; one rounding for fp32)"""
    n, k = q.shape
    return q.float() * _blocks(scale.float(), n, k)


def layer_matrices(hf_layer) -> dict:
    """{per-layer checkpoint name: fp32 matrix} of a Qwen3MoeDecoderLayer's projections, experts
    per expert whichever way the installed transformers holds them"""
    out = {f"self_attn.{a}.weight": getattr(hf_layer.self_attn, a).weight.detach() for a in ATTENTION}
    experts = hf_layer.mlp.experts
    if hasattr(experts, "gate_up_proj"):  # 5.x: fused [E, 2I, H] and [E, H, I]
        inter = experts.gate_up_proj.shape[1] // 2
        for e in range(experts.gate_up_proj.shape[0]):
            out[f"mlp.experts.{e}.gate_proj.weight"] = experts.gate_up_proj[e, :inter].detach()
            out[f"mlp.experts.{e}.up_proj.weight"] = experts.gate_up_proj[e, inter:].detach()
            out[f"mlp.experts.{e}.down_proj.weight"] = experts.down_proj[e].detach()
    else:
        for e, expert in enumerate(experts):
            for p in ("gate_proj", "up_proj", "down_proj"):
                out[f"mlp.experts.{e}.{p}.weight"] = getattr(expert, p).weight.detach()
    return out


def dense_tensors(model: Qwen3MoeForCausalLM) -> dict:
    """{checkpoint name: tensor} of the whole model as a dense checkpoint holds it (experts
    one by one, whichever way the installed transformers holds them)"""
    tensors = {k: v.detach().contiguous() for k, v in model.state_dict().items() if ".layers." not in k}
    for i, layer in enumerate(model.model.layers):
        tensors.update({f"model.layers.{i}.{k}": v.detach().contiguous() for k, v in layer.state_dict().items()
                        if "proj" not in k})
        tensors.update({f"model.layers.{i}.{k}": v.contiguous() for k, v in layer_matrices(layer).items()})
    return tensors


def quantize_model(model: Qwen3MoeForCausalLM, scale_dtype: torch.dtype = torch.float32) -> dict:
    """{checkpoint name: tensor} of the whole model with every layer's projections in FP8 (their
    scales beside them) and everything else as it is; the model's own projections are set to
    the dequantized values, so that the model is the FP8 checkpoint's exact dense twin."""
    tensors = {k: v.detach().contiguous() for k, v in model.state_dict().items() if ".layers." not in k}
    for i, layer in enumerate(model.model.layers):
        prefix = f"model.layers.{i}."
        for name, w in layer.state_dict().items():
            if "proj" not in name:
                tensors[prefix + name] = w.detach().contiguous()
        for name, w in layer_matrices(layer).items():
            q, s = quantize(w, scale_dtype)
            tensors[prefix + name], tensors[prefix + name + "_scale_inv"] = q, s
            with torch.no_grad():
                w.copy_(dequantize(q, s).to(w.dtype))
    return tensors


def write_checkpoint(path, model: Qwen3MoeForCausalLM, tensors: dict, quant: dict | None = None) -> str:
    """config.json (the model's, with `quant` as its quantization_config) and model.safetensors"""
    os.makedirs(path, exist_ok=True)
    cfg = model.config.to_dict()
    cfg["quantization_config"] = QUANT if quant is None else quant
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(cfg, f)
    save_file(tensors, os.path.join(path, "model.safetensors"), metadata={"format": "pt"})
    return str(path)
