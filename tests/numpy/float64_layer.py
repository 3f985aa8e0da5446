"""A float64 Qwen3-MoE decoder layer in numpy alone, written from transformers' qwen3_moe
math: the reference of tests/numpy, which run without torch (and so under emulation on
aarch64, where no torch is installed: benchmarks/arm_python.py).

x [T, hidden] appended to a sequence holding `past` tokens (k, v: their keys and values after
RoPE, [past, kv_heads, head_dim]); positions past .. past + T - 1."""
from __future__ import annotations

import numpy as np


def rmsnorm(x, w, eps):
    """x / sqrt(mean(x^2) + eps) * w over the last axis"""
    return x / np.sqrt((x * x).mean(axis=-1, keepdims=True) + eps) * w


def rope(x, positions, theta):
    """x [T, heads, D] rotated as transformers' rotate_half: the first and second halves of
    each head paired, angle position * theta^(-2i/D)"""
    d = x.shape[-1]
    inv_freq = theta ** (-np.arange(0, d, 2, dtype=np.float64) / d)
    angle = np.concatenate([np.outer(positions, inv_freq)] * 2, axis=-1)[:, None, :]
    half = d // 2
    rotated = np.concatenate([-x[..., half:], x[..., :half]], axis=-1)
    return x * np.cos(angle) + rotated * np.sin(angle)


def random_weights(config, seed, attention_scale=0.15):
    """{checkpoint name: float32 array} of a layer of `config`: attention and router matrices
    N(0, attention_scale) (a wrong mask or position shows at that scale), experts N(0, 0.05),
    norms N(1, 0.1)"""
    rng = np.random.default_rng(seed)
    h, hq, hkv, d = config.hidden_size, config.num_attention_heads, config.num_key_value_heads, config.head_dim
    inter = config.moe_intermediate_size
    shapes = {"self_attn.q_proj.weight": (hq * d, h), "self_attn.k_proj.weight": (hkv * d, h),
              "self_attn.v_proj.weight": (hkv * d, h), "self_attn.o_proj.weight": (h, hq * d),
              "mlp.gate.weight": (config.num_experts, h)}
    w = {name: rng.normal(0.0, attention_scale, shape) for name, shape in shapes.items()}
    for name, n in (("input_layernorm.weight", h), ("post_attention_layernorm.weight", h),
                    ("self_attn.q_norm.weight", d), ("self_attn.k_norm.weight", d)):
        w[name] = rng.normal(1.0, 0.1, n)
    for e in range(config.num_experts):
        for proj, shape in (("gate_proj", (inter, h)), ("up_proj", (inter, h)), ("down_proj", (h, inter))):
            w[f"mlp.experts.{e}.{proj}.weight"] = rng.normal(0.0, 0.05, shape)
    return {name: a.astype(np.float32) for name, a in w.items()}


class Float64Layer:
    """the layer's math in float64 on the float32 weights, with its own cache of one sequence"""

    def __init__(self, config, weights):
        self.c = config
        self.w = {name: a.astype(np.float64) for name, a in weights.items()}
        self.k = np.zeros((0, config.num_key_value_heads, config.head_dim))
        self.v = np.zeros_like(self.k)

    def __call__(self, x):
        c, w = self.c, self.w
        x = np.asarray(x, dtype=np.float64)
        t, past = x.shape[0], self.k.shape[0]
        hq, hkv, d = c.num_attention_heads, c.num_key_value_heads, c.head_dim
        positions = np.arange(past, past + t, dtype=np.float64)
        xn = rmsnorm(x, w["input_layernorm.weight"], c.rms_norm_eps)
        q = (xn @ w["self_attn.q_proj.weight"].T).reshape(t, hq, d)
        k = (xn @ w["self_attn.k_proj.weight"].T).reshape(t, hkv, d)
        v = (xn @ w["self_attn.v_proj.weight"].T).reshape(t, hkv, d)
        q = rope(rmsnorm(q, w["self_attn.q_norm.weight"], c.rms_norm_eps), positions, c.rope_theta)
        k = rope(rmsnorm(k, w["self_attn.k_norm.weight"], c.rms_norm_eps), positions, c.rope_theta)
        self.k, self.v = np.concatenate([self.k, k]), np.concatenate([self.v, v])
        keys = past + t
        causal = np.arange(keys)[None, :] <= (past + np.arange(t))[:, None]  # [t, keys]
        out = np.empty((t, hq, d))
        for head in range(hq):
            g = head // (hq // hkv)  # GQA: the query heads of a group share its key head
            s = q[:, head] @ self.k[:, g].T / np.sqrt(d)
            s = np.where(causal, s, -np.inf)
            p = np.exp(s - s.max(axis=-1, keepdims=True))
            out[:, head] = (p / p.sum(axis=-1, keepdims=True)) @ self.v[:, g]
        h = x + out.reshape(t, hq * d) @ w["self_attn.o_proj.weight"].T
        hn = rmsnorm(h, w["post_attention_layernorm.weight"], c.rms_norm_eps)
        logits = hn @ w["mlp.gate.weight"].T
        probs = np.exp(logits - logits.max(axis=-1, keepdims=True))
        probs /= probs.sum(axis=-1, keepdims=True)
        top = np.argsort(-probs, axis=-1, kind="stable")[:, :c.num_experts_per_tok]
        y = h.copy()
        for i in range(t):
            chosen = probs[i, top[i]]
            if c.norm_topk_prob:
                chosen = chosen / chosen.sum()
            for e, weight in zip(top[i], chosen):
                gate = hn[i] @ w[f"mlp.experts.{e}.gate_proj.weight"].T
                up = hn[i] @ w[f"mlp.experts.{e}.up_proj.weight"].T
                y[i] += weight * ((gate / (1.0 + np.exp(-gate)) * up) @ w[f"mlp.experts.{e}.down_proj.weight"].T)
        return y, logits

    def routing_margin(self, logits):
        """the smallest gap, over tokens, between the k-th and (k+1)-th router logit: a layer
        whose fp32 rounding could swap an expert shows it here"""
        s = -np.sort(-logits, axis=-1)
        k = self.c.num_experts_per_tok
        return float((s[:, k - 1] - s[:, k]).min())
