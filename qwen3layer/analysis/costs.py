"""The analytic cost model of one layer: for prefill or decode, every stage with its shapes,
the weight bytes it reads, the activation bytes it reads and writes, its FLOPs and its
arithmetic intensity. No weights needed; stage names are the engine's (layer.profile).

Counting rules: FLOPs are those of the matrix products (2 per multiply-add: projections,
router, experts, attention scores and values); elementwise stages count bytes only.
Activations move as fp32 (the engine's working precision), the KV cache and weights in
`dtype`; with weight_format "fp8_e4m3_block128" the projection matrices (q/k/v/o_proj, the
experts' gate/up/down_proj) are 1 byte an element plus one `scale_dtype` scale per 128 x 128
block (partial blocks count whole), with "gptq_int4" half a byte an element plus an fp16
scale and a 4-bit zero per output and group of 128 inputs and an int32 g_idx per input; norms
and router staying in `dtype`. Weights are read once per pass (a chunk, or a decode step) for all its tokens; a
pass of R tokens is charged the experts that its R * k routing choices hit, expected under
uniform routing (E * (1 - (1 - k/E)^R)). Attention reads each KV head's cache once per pass.
"""
from __future__ import annotations

import dataclasses
import math
from typing import List, Optional

from ..config import LayerConfig
from ..placement import check_placement, contiguous_placement

STAGES = ("io", "input_norm", "qkv_proj", "qk_norm_rope", "kv_write", "attention", "o_proj",
          "post_norm", "router", "top_k", "experts")
KERNELS = {"io": "convert", "input_norm": "rmsnorm", "qkv_proj": "matmul", "qk_norm_rope": "rmsnorm + rope",
           "kv_write": "kv_write", "attention": "attention", "o_proj": "matmul (+= residual)",
           "post_norm": "rmsnorm", "router": "matmul (fp32)", "top_k": "router_topk + moe_group",
           "experts": "gather, matmul x3, swiglu, scatter_add"}
ACT = 4  # bytes of an activation element


WEIGHT_FORMATS = ("dense", "fp8_e4m3_block128", "gptq_int4")


def _size(dtype: str) -> int:
    return 4 if dtype == "float32" else 2


@dataclasses.dataclass(frozen=True)
class _Matrices:
    """Bytes of a projection matrix [n, k] as stored: dense (`dense` bytes an element), FP8
    (1 byte an element and `scale` bytes per 128 x 128 block) or GPTQ int4 (`group` > 0: a
    nibble an element, and per group of `group` inputs an fp16 scale and a nibble zero per
    output, and an int32 g_idx per input: the engine's q3_layer_weight_bytes)."""
    dense: int
    scale: int = 0  # 0: the dense format
    group: int = 0  # GPTQ int4: the group size

    def bytes(self, n: int, k: int) -> int:
        if self.group:
            g = k // self.group
            return k // 8 * n * 4 + g * n * 2 + g * (n // 8) * 4 + k * 4
        if not self.scale:
            return n * k * self.dense
        return n * k + math.ceil(n / 128) * math.ceil(k / 128) * self.scale


def _matrices(dtype: str, weight_format: str, scale_dtype: str) -> _Matrices:
    """how the format stores a matrix (GPTQ: group 128, the engine's default)"""
    if weight_format == "gptq_int4":
        return _Matrices(_size(dtype), 0, 128)
    return _Matrices(_size(dtype), _size(scale_dtype) if weight_format != "dense" else 0)


@dataclasses.dataclass
class Stage:
    name: str
    kernel: str
    inputs: List[tuple]
    outputs: List[tuple]
    weight_bytes: int = 0
    act_read: int = 0
    act_written: int = 0
    flops: float = 0.0

    @property
    def bytes(self) -> int:
        return self.weight_bytes + self.act_read + self.act_written

    @property
    def intensity(self) -> float:
        """FLOPs per byte moved."""
        return self.flops / self.bytes if self.bytes else 0.0


@dataclasses.dataclass
class CostModel:
    mode: str
    tokens: int
    context: int
    batch: int
    chunk_size: int
    passes: int
    stages: List[Stage]

    @property
    def weight_bytes(self) -> int:
        return sum(s.weight_bytes for s in self.stages)

    @property
    def bytes(self) -> int:
        return sum(s.bytes for s in self.stages)

    @property
    def flops(self) -> float:
        return sum(s.flops for s in self.stages)

    def stage(self, name: str) -> Stage:
        """The stage called `name`; ValueError naming the stages for another."""
        for s in self.stages:
            if s.name == name:
                return s
        raise ValueError(f"name: expected one of {[s.name for s in self.stages]}, got {name!r}")


def experts_hit(cfg: LayerConfig, rows: int) -> float:
    """Expected distinct experts chosen by `rows` tokens under uniform routing."""
    E, k = cfg.num_experts, cfg.num_experts_per_tok
    return E * (1.0 - (1.0 - k / E) ** rows)


def _pass(cfg: LayerConfig, batch: int, L: int, n: int, wb: int, cb: int, mat: _Matrices,
          att: Optional[_Matrices] = None) -> List[Stage]:
    """Stages of one pass: L new tokens for each of `batch` sequences holding n tokens; wb:
    bytes of a norm or router element, mat: of the projection matrices, att: of q/k/v/o_proj
    where they are stored otherwise (None: as mat)."""
    att = att or mat
    H, D, Hq, Hkv = cfg.hidden_size, cfg.head_dim, cfg.num_attention_heads, cfg.num_key_value_heads
    E, k, I = cfg.num_experts, cfg.num_experts_per_tok, cfg.moe_intermediate_size
    R = batch * L
    qkv = (Hq + 2 * Hkv) * D
    keys_seen = batch * (L * n + L * (L + 1) // 2)     # summed over the pass's query tokens
    cache_rows = batch * Hkv * (n + L)                  # (sequence, KV head, position) rows read
    return [
        Stage("io", KERNELS["io"], [(R, H)], [(R, H)], 0, R * H * wb, R * H * wb),
        Stage("input_norm", KERNELS["input_norm"], [(R, H)], [(R, H)], H * wb, R * H * ACT, R * H * ACT),
        Stage("qkv_proj", KERNELS["qkv_proj"], [(R, H)], [(R, Hq * D), (R, Hkv * D), (R, Hkv * D)],
              att.bytes(Hq * D, H) + 2 * att.bytes(Hkv * D, H), R * H * ACT, R * qkv * ACT, 2.0 * R * H * qkv),
        Stage("qk_norm_rope", KERNELS["qk_norm_rope"], [(R, Hq, D), (R, Hkv, D)], [(R, Hq, D), (R, Hkv, D)],
              2 * D * wb, R * (Hq + Hkv) * D * ACT, R * (Hq + Hkv) * D * ACT),
        Stage("kv_write", KERNELS["kv_write"], [(R, Hkv, D), (R, Hkv, D)], [(batch, Hkv, n + L, D)] * 2,
              0, 2 * R * Hkv * D * ACT, 2 * R * Hkv * D * cb),
        Stage("attention", KERNELS["attention"], [(R, Hq, D), (batch, Hkv, n + L, D), (batch, Hkv, n + L, D)],
              [(R, Hq, D)], 0, R * Hq * D * ACT + 2 * cache_rows * D * cb, R * Hq * D * ACT,
              4.0 * Hq * D * keys_seen),
        Stage("o_proj", KERNELS["o_proj"], [(R, Hq * D), (R, H)], [(R, H)], att.bytes(H, Hq * D),
              R * (Hq * D + H) * ACT, R * H * ACT, 2.0 * R * Hq * D * H),
        Stage("post_norm", KERNELS["post_norm"], [(R, H)], [(R, H)], H * wb, R * H * ACT, R * H * ACT),
        Stage("router", KERNELS["router"], [(R, H)], [(R, E)], E * H * wb, R * H * ACT, R * E * ACT,
              2.0 * R * H * E),
        Stage("top_k", KERNELS["top_k"], [(R, E)], [(R, k), (R, k)], 0, R * E * ACT, 2 * R * k * 4),
        Stage("experts", KERNELS["experts"], [(R, H), (R, k)], [(R, H)], round(experts_hit(cfg, R)) * (2 * mat.bytes(I, H) + mat.bytes(H, I)),
              R * k * H * ACT + R * H * ACT, R * H * ACT, 2.0 * R * k * 3 * H * I),
    ]


def cost_model(cfg: LayerConfig, mode: str = "prefill", tokens: int = 1, context: int = 0,
               chunk_size: Optional[int] = None, dtype: str = "bfloat16", batch: int = 1,
               weight_format: str = "dense", scale_dtype: str = "float32", dense_attention: bool = False) -> CostModel:
    """The work of `tokens` new tokens per sequence for `batch` sequences that hold `context`
    tokens: prefill in passes of chunk_size tokens (default: all at once), or decode (one
    token per sequence per pass: `tokens` steps). weight_format: 'dense' (matrices in dtype),
    'fp8_e4m3_block128' (matrices in e4m3 with scale_dtype block scales) or 'gptq_int4' (4-bit
    GPTQ, group 128); dense_attention: q/k/v/o_proj in dtype whatever the format (a GPTQ layer
    quantized to its experts alone)."""
    if mode not in ("prefill", "decode"):
        raise ValueError(f"mode: expected 'prefill' or 'decode', got {mode!r}")
    for name, value in (("tokens", tokens), ("batch", batch)):
        if not isinstance(value, int) or value < 1:
            raise ValueError(f"{name}: expected a positive int, got {value!r}")
    if not isinstance(context, int) or context < 0:
        raise ValueError(f"context: expected a non-negative int, got {context!r}")
    if chunk_size is not None and (not isinstance(chunk_size, int) or chunk_size < 1):
        raise ValueError(f"chunk_size: expected a positive int or None, got {chunk_size!r}")
    if dtype not in ("bfloat16", "float32", "float16"):
        raise ValueError(f"dtype: expected 'float32', 'bfloat16' or 'float16', got {dtype!r}")
    if weight_format not in WEIGHT_FORMATS:
        raise ValueError(f"weight_format: expected one of {WEIGHT_FORMATS}, got {weight_format!r}")
    if scale_dtype not in ("bfloat16", "float32"):
        raise ValueError(f"scale_dtype: expected 'float32' or 'bfloat16', got {scale_dtype!r}")
    wb = cb = _size(dtype)
    mat = _matrices(dtype, weight_format, scale_dtype)
    step = 1 if mode == "decode" else min(chunk_size or tokens, tokens)
    passes = math.ceil(tokens / step)
    total: List[Stage] = []
    for p in range(passes):
        L = min(step, tokens - p * step)
        stages = _pass(cfg, batch, L, context + p * step, wb, cb, mat,
                       _matrices(dtype, "dense", scale_dtype) if dense_attention else None)
        if not total:
            total = stages  # shapes of the first pass
            continue
        for t, s in zip(total, stages):
            t.weight_bytes += s.weight_bytes
            t.act_read += s.act_read
            t.act_written += s.act_written
            t.flops += s.flops
    return CostModel(mode, tokens, context, batch, step, passes, total)


def decode_weight_bytes(cfg: LayerConfig, dtype: str = "bfloat16", weight_format: str = "dense",
                        scale_dtype: str = "float32") -> int:
    """Weight bytes one decode token reads (batch 1): attention, norms, router, its top-k experts."""
    return cost_model(cfg, "decode", 1, 0, dtype=dtype, weight_format=weight_format,
                      scale_dtype=scale_dtype).weight_bytes


def decode_bytes(cfg: LayerConfig, context: int, dtype: str = "bfloat16", weight_format: str = "dense",
                 scale_dtype: str = "float32") -> int:
    """Bytes one decode token must read at `context` cached tokens: its weights and the KV cache."""
    m = cost_model(cfg, "decode", 1, context, dtype=dtype, weight_format=weight_format, scale_dtype=scale_dtype)
    return m.weight_bytes + 2 * cfg.num_key_value_heads * cfg.head_dim * _size(dtype) * (context + 1)


def prefill_flops(cfg: LayerConfig, tokens: int, context: int = 0) -> float:
    """Matrix FLOPs of a causal prefill of `tokens` new tokens after `context` cached ones."""
    return cost_model(cfg, "prefill", tokens, context).flops


@dataclasses.dataclass(frozen=True)
class Exchange:
    """What expert parallelism moves in one pass of `rows` rows on every rank (qwen3layer.parallel),
    expected under uniform routing. Per rank r: rows_out[r] rows go to other ranks' experts
    (a row once to each rank holding one of its top-k), rows_in[r] come in for its own; bytes
    counted as layer.stats counts them: a row out is hidden x dtype plus its k expert ids and
    weights (8 bytes each), and its sum comes back at hidden x dtype."""
    world: int
    rows: int
    rows_out: List[float]
    rows_in: List[float]
    bytes_sent: List[float]
    bytes_received: List[float]
    expert_bytes: List[int]   # the experts each rank holds, as stored


def ep_exchange(cfg: LayerConfig, world: int, rows: int, dtype: str = "bfloat16",
                placement: Optional[List[List[int]]] = None, weight_format: str = "dense",
                scale_dtype: str = "float32") -> Exchange:
    """The exchange of a pass with `rows` rows on each of `world` ranks; placement: the expert
    ids of each rank (default: contiguous shards, the first E % world ranks one more)."""
    if not isinstance(world, int) or world < 1:
        raise ValueError(f"world: expected a positive int, got {world!r}")
    if not isinstance(rows, int) or rows < 0:
        raise ValueError(f"rows: expected a non-negative int, got {rows!r}")
    E, k, H, I = cfg.num_experts, cfg.num_experts_per_tok, cfg.hidden_size, cfg.moe_intermediate_size
    shards = contiguous_placement(E, world) if placement is None else check_placement(placement, E, world)
    counts = [len(ids) for ids in shards]
    # P(a row's k distinct experts include one of rank d's n) = 1 - C(E - n, k) / C(E, k)
    reach = [1.0 - math.comb(E - n, k) / math.comb(E, k) for n in counts]
    row, back = H * _size(dtype) + 8 * k, H * _size(dtype)
    out = [rows * sum(p for d, p in enumerate(reach) if d != r) for r in range(world)]
    into = [(world - 1) * rows * reach[r] for r in range(world)]
    mat = _matrices(dtype, weight_format, scale_dtype)
    per_expert = 2 * mat.bytes(I, H) + mat.bytes(H, I)
    return Exchange(world, rows, out, into, [o * row + i * back for o, i in zip(out, into)],
                    [i * row + o * back for o, i in zip(out, into)], [n * per_expert for n in counts])

