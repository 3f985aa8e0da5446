"""`run` and `map` with --expert-device cpu --gpu-experts N: a layer split over one GPU and
the host (qwen3layer.placement.hybrid). `map` prints the cost model's split
(qwen3layer.analysis.costs_hybrid) at this machine's host figures, probed now, and the H200's
and PCIe 5's of qwen3layer/analysis/gpu_figures.py; `run` measures the split layer (it needs
the CUDA device) beside that prediction."""
from __future__ import annotations

import argparse
import statistics
import sys
import time

from .. import _C
from .common import decode_steps
from ..analysis.costs_hybrid import Machine, hybrid_split
from ..layer import DecoderLayer


def gpu_expert_ids(args: argparse.Namespace, num_experts: int) -> list:
    """--gpu-experts: N (experts 0 .. N-1: random weights route near uniformly, so any N are
    as hot; a checkpoint's hottest come from a calibration call, DecoderLayer(expert_counts=))
    or a comma-separated list of ids"""
    text = str(args.gpu_experts)
    try:
        ids = [int(t) for t in text.split(",") if t.strip()]
    except ValueError:
        raise ValueError(f"--gpu-experts: expected N or a comma-separated list of expert ids, got {text!r}") from None
    if "," not in text and len(ids) == 1:
        if not 0 <= ids[0] <= num_experts:
            raise ValueError(f"--gpu-experts: expected N in [0, {num_experts}], got {ids[0]}")
        return list(range(ids[0]))
    return ids


def machine_now() -> Machine:
    print("probing this machine's host read bandwidth and FMA peak ...", flush=True)
    return Machine(host_read=_C.probe_read_bandwidth(1 << 30, 3) * 1e9, host_flops=_C.probe_fma_peak(0.3) * 1e9)


def split_table(cfg, rows: int, mode: str, gpu: list, context: int, dtype: str, m: Machine) -> str:
    lines = [f"predicted pass: {mode} of {rows} row(s) at context {context}, {dtype}; host {m.host_read / 1e9:.0f} "
             f"GB/s read, {m.host_flops / 1e9:.0f} GFLOP/s; device {m.device_read / 1e12:.1f} TB/s; link "
             f"{m.link / 1e9:.0f} GB/s each way",
             "gpu experts | rows to host | link down MB | up MB | host experts MB | device experts MB | "
             "attention ms | device experts ms | host experts ms | link ms | pass ms | bound"]
    E = cfg.num_experts
    for ids in sorted({tuple(range(n)) for n in (0, E // 8, E // 2, E)} | {tuple(gpu)}, key=len):
        s = hybrid_split(cfg, rows, list(ids), mode=mode, context=context, dtype=dtype, machine=m)
        mark = "*" if list(ids) == gpu else " "
        lines.append(f"{len(ids):10d}{mark} | {s.rows_to_host:12.1f} | {s.link_down_bytes / 1e6:12.2f} | "
                     f"{s.link_up_bytes / 1e6:5.2f} | {s.host_expert_bytes / 1e6:15.1f} | "
                     f"{s.device_expert_bytes / 1e6:17.1f} | {s.attention_s * 1e3:12.3f} | "
                     f"{s.device_experts_s * 1e3:17.3f} | {s.host_experts_s * 1e3:15.2f} | {s.link_s * 1e3:7.3f} | "
                     f"{s.pass_s * 1e3:7.2f} | {s.bound}")
    lines.append("(* this run's gpu experts)")
    return "\n".join(lines)


def cmd_map_hybrid(args: argparse.Namespace, cfg) -> int:
    if args.fp8 or args.int4:  # the split's cost model prices dense weights: not a silent other answer
        raise ValueError("--expert-device cpu: the split's prediction is of dense weights in this version (no --fp8, "
                         "--int4)")
    gpu = gpu_expert_ids(args, cfg.num_experts)
    if getattr(args, "machine", None) is not None:  # a named machine's published figures, not this one's probes
        from ..analysis.machines import machine
        from .machines import check_machine_args
        check_machine_args(args)
        named = machine(args.machine)
        m = named.split()
        print(f"{named.name}: {named.what} (published figures, docs/cli.md; predicted, not measured)")
    else:
        m = machine_now()
    context = args.tokens if args.context is None else args.context
    print(split_table(cfg, min(args.chunk_size, args.tokens), "prefill", gpu, 0, args.dtype, m))
    print()
    print(split_table(cfg, 1, "decode", gpu, context, args.dtype, m))
    if getattr(args, "machine", None) is None:
        print("\nmeasured: python -m qwen3layer run with the same flags, on a machine with the CUDA device")
    return 0


def cmd_run_hybrid(args: argparse.Namespace, cfg) -> int:
    if args.fp8 or args.int4 or args.checkpoint:
        raise ValueError("--expert-device cpu: random dense weights only in this version (no --fp8, --int4, "
                         "--checkpoint)")
    gpu = gpu_expert_ids(args, cfg.num_experts)
    dtype = args.dtype or "bfloat16"
    print(f"building a {args.geometry}-geometry layer split over {args.device} (attention, router, {len(gpu)} "
          f"experts) and the host ({cfg.num_experts - len(gpu)} experts), random {dtype} weights ...", flush=True)
    layer = DecoderLayer.random(cfg, args.seed, dtype, device=args.device, expert_device="cpu", gpu_experts=gpu)
    m = machine_now()
    hybrid = layer._hybrid
    cache = layer.new_cache(args.tokens + args.new_tokens)
    H, chunk, done, passes = cfg.hidden_size, args.chunk_size, 0, []
    while done < args.tokens:
        n = min(chunk, args.tokens - done)
        x = hybrid.device_input(layer.random_input((n, H), args.seed * 7919 + done))  # torch's, where it has CUDA
        t = time.perf_counter()
        layer.prefill(x, cache, chunk_size=chunk)
        hybrid.synchronize()
        passes.append((n, time.perf_counter() - t))
        done += n
        sys.stderr.write(f"\rprefill {done}/{args.tokens}")
    sys.stderr.write("\n")
    steps = decode_steps(layer, cache, args.new_tokens, args.seed, hybrid.device_input, hybrid.synchronize)
    pre = sum(t for _, t in passes)
    print(f"\nprefill  {args.tokens} tokens in chunks of {chunk}: {pre:.2f} s, {args.tokens / pre:.1f} tok/s "
          f"(predicted a full chunk: {hybrid_split(cfg, min(chunk, args.tokens), gpu, mode='prefill', dtype=dtype, machine=m).pass_s * 1e3:.1f} ms, "
          f"measured {passes[0][1] * 1e3:.1f} ms)")
    if steps:
        want = hybrid_split(cfg, 1, gpu, context=args.tokens, dtype=dtype, machine=m).pass_s
        print(f"decode   {args.new_tokens} steps: median {statistics.median(steps) * 1e3:.2f} ms/token "
              f"(predicted {want * 1e3:.2f} ms)")
    print(f"rows and choices per side: {layer.hybrid_stats}")
    print()
    print(split_table(cfg, 1, "decode", gpu, args.tokens, dtype, m))
    # each side's stages measured (profiled calls run the two sides' experts one after the other)
    print()
    print(layer.profile("prefill", min(chunk, args.tokens), 0, chunk, repeat=1).table())
    print()
    print(layer.profile("decode", 1, args.tokens, repeat=3).table())
    return 0
