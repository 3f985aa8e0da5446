"""FP8 test weights (weight_format fp8_e4m3_block128) made with torch's float8_e4m3fn from
the library's random weights: every projection quantized in 128 x 128 blocks, each block's
largest magnitude to 448 (the largest e4m3), its scale_inv beside it; norms and the router in
the layer's dtype. For tests/executor/test_cuda_executor_fp8.py and tests/gpu/test_cuda.py."""
import math

import torch

from qwen3layer import _C


def quantize(w, scale_dtype):
    """w [N, K] fp32 -> e4m3 [N, K] and scale_inv [ceil(N/128), ceil(K/128)]: each block's
    largest magnitude to 448"""
    N, K = w.shape
    nb, kb = math.ceil(N / 128), math.ceil(K / 128)
    padded = torch.zeros(nb * 128, kb * 128)
    padded[:N, :K] = w
    blocks = padded.view(nb, 128, kb, 128)
    scale = (blocks.abs().amax(dim=(1, 3)) / 448).clamp(min=1e-12).to(scale_dtype)
    q = (blocks / scale.float()[:, None, :, None]).view(nb * 128, kb * 128)[:N, :K]
    return q.contiguous().to(torch.float8_e4m3fn), scale


def fp8_weights(cfg, dtype, scale_dtype, fused, seed):
    """{name: host tensor} of an FP8 layer of config cfg: norms and router of dtype, scales
    of scale_dtype, experts per expert or fused (transformers 5.x: gate_up_proj [E, 2I, H]
    with its scale [E, 2 ceil(I/128), ceil(H/128)], down_proj [E, H, I])"""
    w = {k: torch.from_dlpack(v) for k, v in _C.random_weights(cfg, seed, "float32").items()}
    out = {}
    for k, v in w.items():
        if k.startswith("self_attn.") and k.endswith("proj.weight"):
            out[k], out[k + "_scale_inv"] = quantize(v, scale_dtype)
        elif k.startswith("mlp.experts."):
            continue
        else:
            out[k] = v.to(getattr(torch, dtype))
    gu, dn = w["mlp.experts.gate_up_proj"], w["mlp.experts.down_proj"]
    E, I = gu.shape[0], gu.shape[1] // 2
    per = {}
    for e in range(E):
        for name, m in (("gate_proj", gu[e, :I]), ("up_proj", gu[e, I:]), ("down_proj", dn[e])):
            per[(e, name)] = quantize(m.contiguous(), scale_dtype)
    if fused:
        out["mlp.experts.gate_up_proj"] = torch.stack(
            [torch.cat([per[(e, "gate_proj")][0], per[(e, "up_proj")][0]]) for e in range(E)])
        out["mlp.experts.gate_up_proj_scale_inv"] = torch.stack(
            [torch.cat([per[(e, "gate_proj")][1], per[(e, "up_proj")][1]]) for e in range(E)])
        out["mlp.experts.down_proj"] = torch.stack([per[(e, "down_proj")][0] for e in range(E)])
        out["mlp.experts.down_proj_scale_inv"] = torch.stack([per[(e, "down_proj")][1] for e in range(E)])
    else:
        for (e, name), (q, s) in per.items():
            out[f"mlp.experts.{e}.{name}.weight"], out[f"mlp.experts.{e}.{name}.weight_scale_inv"] = q, s
    return out
