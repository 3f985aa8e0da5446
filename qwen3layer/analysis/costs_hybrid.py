"""The cost model of a layer split over one GPU and the host: attention, the router and the
`gpu_experts` on the GPU, the other experts in host memory run by the CPU (DecoderLayer with
expert_device="cpu"). Per pass (a prefill chunk or a decode step of `rows` rows):

  GPU:   attention and router (qwen3layer.analysis.costs' stages before the experts), then its
         experts
  PCIe:  as qwen3layer.placement.hybrid moves them (link_bytes): every row's k expert ids
         down (4 bytes each); the rows that chose a host expert, their normed input (hidden x
         dtype) and k router weights (4 bytes each) down, their index (4 bytes) and their host
         sums (hidden x fp32) up; with GPU experts, the rows' k device ids up (4 bytes each)
  host:  the host experts the pass hits, each read once from host memory

The GPU's experts run while the CPU computes, so a pass takes the attention's time, the
copies', and the longer of the two sides' experts: the `bound` side. Each stage's time is its
roofline, max(bytes / bandwidth, FLOPs / peak), at the machine figures given (`Machine`; the
host's from the probes qwen3layer._C runs, the device's and the link's an H200's and PCIe 5.0
x16's, qwen3layer/analysis/gpu_figures.py with their sources). Routing is uniform unless
`shares` (each expert's fraction of the choices, from a calibration call's counts) is given;
with shares, a row's k choices are taken as independent draws (the rows that reach the host
are then an estimate)."""
from __future__ import annotations

import dataclasses
import math
from typing import Optional, Sequence

from ..config import LayerConfig, expert_ids
from .costs import WEIGHT_FORMATS, CostModel, Stage, _matrices, _size, cost_model
from .gpu_figures import H200_BF16_FLOPS, H200_COPY_BYTES_PER_S, PCIE5_X16_BYTES_PER_S


@dataclasses.dataclass(frozen=True)
class Machine:
    """The figures a prediction uses: bytes/s and FLOP/s"""
    device_read: float = H200_COPY_BYTES_PER_S  # an H200's copy rate (gpu_figures.py: 4.3 TB/s)
    device_flops: float = H200_BF16_FLOPS       # an H200's bf16 matrix rate (790 TFLOP/s)
    link: float = PCIE5_X16_BYTES_PER_S         # PCIe 5.0 x16, each way (50 GB/s)
    host_read: float = 36e9         # this project's CPU VM; pass the read probe's
    host_flops: float = 180e9       # fp32 FMA, 2 cores; pass the FMA probe's


@dataclasses.dataclass(frozen=True)
class HybridSplit:
    """One pass of `rows` rows with `gpu_experts` of the experts on the GPU (bytes and seconds)"""
    rows: int
    gpu_experts: int
    rows_to_host: float           # rows with a host expert among their k
    link_down_bytes: float
    link_up_bytes: float
    host_expert_bytes: float      # host experts' weights read from host memory
    device_expert_bytes: float    # the GPU's experts' weights read from device memory
    device_other_bytes: float     # attention, norms, router, KV cache, activations
    attention_s: float
    device_experts_s: float
    link_s: float
    host_experts_s: float

    @property
    def pass_s(self) -> float:
        return self.attention_s + self.link_s + max(self.device_experts_s, self.host_experts_s)

    @property
    def bound(self) -> str:
        """the side whose experts the pass waits for: 'device' or 'host'"""
        return "host" if self.host_experts_s > self.device_experts_s else "device"


def _shares(cfg: LayerConfig, shares: Optional[Sequence[float]]) -> list:
    E = cfg.num_experts
    if shares is None:
        return [1.0 / E] * E
    got = [float(s) for s in shares]
    if len(got) != E or any(not math.isfinite(s) or s < 0 for s in got) or not sum(got) > 0:
        raise ValueError(f"shares: expected {E} non-negative numbers (each expert's fraction of the choices), "
                         f"got {len(got)} of them" + ("" if len(got) != E else f" summing to {sum(got)}"))
    total = sum(got)
    return [s / total for s in got]


def _gpu_ids(cfg: LayerConfig, gpu_experts: Sequence[int]) -> set:
    return set(expert_ids(gpu_experts, cfg.num_experts, "gpu_experts"))


def link_bytes(cfg: LayerConfig, rows: int, rows_to_host: float, gpu_used: bool, dtype: str = "bfloat16") -> tuple:
    """(down, up): the bytes a call of `rows` rows moves from the GPU to the host and back, as
    qwen3layer.placement.hybrid moves them, `rows_to_host` of the rows with a host expert
    among their k and `gpu_used` whether any row chose a GPU expert (HybridRunner.stats counts
    the same)"""
    k, H, es = cfg.num_experts_per_tok, cfg.hidden_size, _size(dtype)
    down = rows * 4 * k + rows_to_host * (H * es + 4 * k)
    up = rows_to_host * (4 + H * 4) + (rows * 4 * k if gpu_used else 0)
    return down, up


def hybrid_split(cfg: LayerConfig, rows: int, gpu_experts: Sequence[int], *, mode: str = "decode", context: int = 0,
                 dtype: str = "bfloat16", weight_format: str = "dense", shares: Optional[Sequence[float]] = None,
                 machine: Machine = Machine()) -> HybridSplit:
    """The pass of `rows` rows (mode "decode": a step of `rows` sequences; "prefill": a
    chunk of `rows` tokens of one sequence), `context` tokens already cached (each), with the
    experts `gpu_experts` (ids) on the GPU and the rest on the host."""
    if not isinstance(rows, int) or rows < 1:
        raise ValueError(f"rows: expected a positive int, got {rows!r}")
    if weight_format not in WEIGHT_FORMATS:
        raise ValueError(f"weight_format: expected one of {WEIGHT_FORMATS}, got {weight_format!r}")
    E, k, H, I = cfg.num_experts, cfg.num_experts_per_tok, cfg.hidden_size, cfg.moe_intermediate_size
    on_gpu = _gpu_ids(cfg, gpu_experts)
    p = _shares(cfg, shares)
    mat = _matrices(dtype, weight_format, "float32")  # FP8: fp32 block scales; GPTQ: group 128
    per_expert = 2 * mat.bytes(I, H) + mat.bytes(H, I)
    # an expert is read when a row chooses it: P = 1 - (1 - k p_e)^rows
    hit = [1.0 - max(0.0, 1.0 - k * pe) ** rows for pe in p]
    host_share = sum(pe for e, pe in enumerate(p) if e not in on_gpu)
    if shares is None:  # a row's k distinct experts all on the GPU: C(n, k) / C(E, k)
        all_gpu = math.comb(len(on_gpu), k) / math.comb(E, k)
    else:
        all_gpu = (1.0 - host_share) ** k
    to_host = rows * (1.0 - all_gpu)
    down, up = link_bytes(cfg, rows, to_host, bool(on_gpu), dtype)
    host_bytes = per_expert * sum(h for e, h in enumerate(hit) if e not in on_gpu)
    dev_bytes = per_expert * sum(h for e, h in enumerate(hit) if e in on_gpu)
    expert_flops = 2.0 * rows * k * 3 * H * I
    if mode not in ("prefill", "decode"):
        raise ValueError(f"mode: expected 'prefill' or 'decode', got {mode!r}")
    m = cost_model(cfg, "prefill", rows, context, dtype=dtype, weight_format=weight_format) if mode == "prefill" \
        else cost_model(cfg, "decode", 1, context, dtype=dtype, weight_format=weight_format, batch=rows)
    other = [s for s in m.stages if s.name != "experts"]
    other_bytes = sum(s.bytes for s in other)
    ex = m.stage("experts")
    act = ex.act_read + ex.act_written  # the rows in and out of the experts, on the GPU
    mc = machine
    return HybridSplit(
        rows, len(on_gpu), to_host, down, up, host_bytes, dev_bytes, other_bytes + act,
        attention_s=max(other_bytes / mc.device_read, sum(s.flops for s in other) / mc.device_flops),
        device_experts_s=max((dev_bytes + act) / mc.device_read, expert_flops * (1 - host_share) / mc.device_flops),
        link_s=(down + up) / mc.link,
        host_experts_s=max(host_bytes / mc.host_read, expert_flops * host_share / mc.host_flops))


def split_cost_model(cfg: LayerConfig, mode: str, tokens: int, context: int, chunk_size: Optional[int],
                     dtype: str, batch: int, weight_format: str, scale_dtype: str,
                     gpu_experts: Sequence[int], dense_attention: bool = False) -> CostModel:
    """The cost model of a split layer's call (its profile()): cost_model's stages with the
    experts stage split in three, pass by pass as hybrid_split expects them under uniform
    routing: `gpu_experts` (the GPU's experts: their weights and the rows' activations on the
    device), `link` (the bytes down to the host and back, as link_bytes counts them; measured,
    it is the rest of the call: the copies, takes, combine and the Python between them) and
    `host_experts` (the host experts' weights read from host memory); the FLOPs in proportion
    to the experts each side holds. dense_attention: as cost_model's (a GPTQ layer's q/k/v/o_proj
    dense)."""
    whole = cost_model(cfg, mode, tokens, context, chunk_size, dtype, batch, weight_format, scale_dtype,
                       dense_attention)
    ex = whole.stage("experts")
    on_gpu = sorted(_gpu_ids(cfg, gpu_experts))
    step = whole.chunk_size  # tokens a pass (1 for decode), as cost_model took them
    dev = host = down = up = 0.0
    for p in range(whole.passes):
        rows = batch * min(step, tokens - p * step)
        s = hybrid_split(cfg, rows, on_gpu, mode=mode, context=context + p * step, dtype=dtype,
                         weight_format=weight_format)
        dev, host = dev + s.device_expert_bytes, host + s.host_expert_bytes
        down, up = down + s.link_down_bytes, up + s.link_up_bytes
    gpu_share = len(on_gpu) / cfg.num_experts
    rows = ex.inputs[0]
    stages = [s for s in whole.stages if s.name != "experts"] + [
        Stage("gpu_experts", ex.kernel + " (GPU)", ex.inputs, ex.outputs, round(dev), ex.act_read, ex.act_written,
              ex.flops * gpu_share),
        Stage("link", "the rest: rows to the host, sums back (PCIe), take, combine", [rows], [rows], 0,
              round(down), round(up)),
        Stage("host_experts", ex.kernel + " (CPU, host memory)", ex.inputs, ex.outputs, round(host), 0, 0,
              ex.flops * (1 - gpu_share))]
    return dataclasses.replace(whole, stages=stages)
