"""Machines this layer was not measured on, by their published figures: memory bandwidth, the
CPU's fp32 multiply-add peak, and where there is one, the GPU's memory bandwidth, its bf16
matrix rate and the CPU <-> GPU link. `map --machine NAME` predicts a layer's prefill and decode
on one of them from the cost model (qwen3layer.analysis.costs): each stage's time is the larger
of its bytes over the bandwidth and its FLOPs over the peak, a roofline floor. Every figure
below is predicted, not measured: on the x86 machines measured, decode reads at about the rate
of the machine's own read probe, below its published bandwidth, and prefill reaches a fraction
of the FLOP peak (benchmarks/RESULTS.md); and the ARM
paths of issue 43 (NEON, BF16, SVE) are not written yet, so an ARM CPU runs the portable C
kernels today, well under these peaks. docs/cli.md gives each figure's source."""
from __future__ import annotations

import dataclasses
from typing import Dict, List, Optional

from ..config import LayerConfig
from .costs import CostModel, cost_model
from .costs_hybrid import Machine


@dataclasses.dataclass(frozen=True)
class PublishedMachine:
    """A machine's published figures (bytes/s and FLOP/s): the CPU's memory read bandwidth and
    fp32 multiply-add peak (cores x clock x the FP pipes' lanes x 2); for a machine with a GPU,
    its memory bandwidth (on a unified-memory board, the same memory's), its dense bf16 matrix
    rate and the link each way between the CPU's memory and the GPU (0 where they share one
    memory). `what` names the parts, `cpu` the cores."""
    name: str
    what: str
    cpu: str
    read: float
    fp32: float
    gpu_read: float = 0.0
    gpu_bf16: float = 0.0
    link: float = 0.0

    @property
    def has_gpu(self) -> bool:
        return self.gpu_read > 0

    def split(self) -> Machine:
        """the figures of costs_hybrid's GPU + host split: the GPU's, the link's and the CPU's"""
        if not self.has_gpu or not self.link:
            raise ValueError(f"--machine {self.name}: the GPU + host split needs a GPU reached over a link (the "
                             f"machines with one: {', '.join(n for n, m in MACHINES.items() if m.has_gpu and m.link)})")
        return Machine(device_read=self.gpu_read, device_flops=self.gpu_bf16, link=self.link, host_read=self.read,
                       host_flops=self.fp32)


_GRACE = dict(cpu="72 Arm Neoverse V2 cores, 3.1 GHz, 4 x 128-bit FP pipes", read=500e9,
              fp32=72 * 3.1e9 * 4 * 4 * 2)
MACHINES: Dict[str, PublishedMachine] = {m.name: m for m in (
    PublishedMachine("grace", "NVIDIA Grace, the CPU of a GH200 (LPDDR5X)", **_GRACE),
    PublishedMachine("gh200", "NVIDIA GH200: Grace and an H100 (96 GB HBM3) over NVLink-C2C", **_GRACE,
                     gpu_read=4.0e12, gpu_bf16=989e12, link=450e9),
    PublishedMachine("gb10", "NVIDIA GB10 / DGX Spark: one 128 GB LPDDR5X memory for CPU and GPU",
                     "10 Cortex-X925 (3.9 GHz, 6 x 128-bit FP pipes) + 10 Cortex-A725 (2.8 GHz, 2 pipes)",
                     read=273e9, fp32=10 * 3.9e9 * 6 * 4 * 2 + 10 * 2.8e9 * 2 * 4 * 2,
                     gpu_read=273e9, gpu_bf16=62e12),
    PublishedMachine("orin", "NVIDIA Jetson AGX Orin 64GB: one LPDDR5 memory for CPU and GPU",
                     "12 Cortex-A78AE, 2.2 GHz, 2 x 128-bit FP pipes", read=204.8e9, fp32=12 * 2.2e9 * 2 * 4 * 2,
                     gpu_read=204.8e9, gpu_bf16=42.5e12),
    PublishedMachine("graviton4", "AWS Graviton4 (12 channels of DDR5-5600)",
                     "96 Arm Neoverse V2 cores, 2.8 GHz, 4 x 128-bit FP pipes", read=536.7e9,
                     fp32=96 * 2.8e9 * 4 * 4 * 2),
)}


def machine(name: str) -> PublishedMachine:
    """MACHINES[name]; ValueError naming the machines for another"""
    try:
        return MACHINES[name]
    except KeyError:
        raise ValueError(f"--machine: expected one of {', '.join(MACHINES)}, got {name!r}") from None


@dataclasses.dataclass(frozen=True)
class StageTime:
    """one stage's predicted seconds (the larger of its bytes over `read` and its FLOPs over
    `flops`) and which of the two bounds it"""
    name: str
    bytes: int
    flops: float
    seconds: float
    bound: str


def predict(cfg: LayerConfig, m: PublishedMachine, mode: str, tokens: int, context: int = 0,
            chunk_size: Optional[int] = None, dtype: str = "bfloat16", weight_format: str = "dense",
            on_gpu: bool = False) -> tuple:
    """(the cost model, [StageTime]) of a prefill of `tokens` (in chunks of chunk_size) or
    `tokens` decode steps from `context`, on m's CPU (its read bandwidth and fp32 peak) or, with
    on_gpu, its GPU (its memory and bf16 matrix rate): every stage at the roofline floor"""
    if on_gpu and not m.has_gpu:
        raise ValueError(f"--machine {m.name}: it has no GPU")
    read, flops = (m.gpu_read, m.gpu_bf16) if on_gpu else (m.read, m.fp32)
    model: CostModel = cost_model(cfg, mode, tokens, context=context, chunk_size=chunk_size, dtype=dtype,
                                  weight_format=weight_format)
    times: List[StageTime] = []
    for s in model.stages:
        t_bytes, t_flops = s.bytes / read, s.flops / flops
        times.append(StageTime(s.name, s.bytes, s.flops, max(t_bytes, t_flops),
                               "compute" if t_flops > t_bytes else "memory"))
    return model, times


def predicted_table(model: CostModel, times: List[StageTime], title: str) -> str:
    """the stages' predicted times as a table, marked predicted, with the total and its rate"""
    total = sum(t.seconds for t in times)
    lines = [f"{title} (PREDICTED from published figures, a roofline floor; not measured)",
             "stage          |  weights+act MB |     GFLOP |    ms | bound"]
    for t in times:
        lines.append(f"{t.name:<14} | {t.bytes / 1e6:15.2f} | {t.flops / 1e9:9.3f} | {t.seconds * 1e3:5.3f} | "
                     f"{t.bound}")
    rate = model.tokens * model.batch / total if total else float("inf")
    unit = "tok/s" if model.mode == "prefill" else "steps/s"
    per = total / model.tokens if model.mode == "decode" else total
    what = f"{per * 1e3:.3f} ms a step" if model.mode == "decode" else f"{total * 1e3:.2f} ms"
    lines.append(f"total {what}, {rate:.0f} {unit} of this one layer (predicted; a model pays it once a layer)")
    return "\n".join(lines)
