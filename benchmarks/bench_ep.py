"""Expert parallelism on this machine: ExpertParallelLayer over 1 and 2 gloo processes of 1
thread each against the single-process DecoderLayer with every thread, the same work each time.

    python benchmarks/bench_ep.py            # real Qwen3-235B-A22B geometry, bf16 (~5 GB of weights in all)
    python benchmarks/bench_ep.py --small    # a small geometry, for a quick look

Work: W sequences, one a rank (W = 2: the single-process layer runs them as a batch of 2, the
1-process layer one after the other). Prefill: `--tokens` tokens a sequence in one chunk;
decode: `--steps` steps at a context of `--context`. Each figure is the median of `--repeats`
calls (the ranks start each call together: the slowest rank's time counts), with the rank's
phases (attention half, dispatch, experts, combine) and the bytes it sent and received a pass.
The processes share the machine's cores and memory bandwidth; on 2 cores, 2 processes of 1
thread do the work 1 process of 2 threads does, and pay the exchange on top: this measures
that cost, not a speed-up (expert parallelism pays where the experts do not fit one memory).
"""
from __future__ import annotations

import argparse
import datetime
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))


def config(small: bool):
    import qwen3layer as q3
    if small:
        return q3.LayerConfig(hidden_size=1024, num_attention_heads=16, num_key_value_heads=2, head_dim=128,
                              num_experts=32, num_experts_per_tok=4, moe_intermediate_size=512)
    return q3.LayerConfig.qwen3_235b_a22b()


def _median_call(fn, repeats):
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def rank_main(rank, world, init_file, args, queue):
    import torch
    import torch.distributed as dist
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=600))
    from qwen3layer.parallel import ExpertParallelLayer
    cfg = config(args.small)
    ep = ExpertParallelLayer.random(cfg, seed=0, dtype="bfloat16")
    H = cfg.hidden_size
    x = ep.layer.random_input((args.tokens, H), seed=1 + rank)
    ctx = ep.layer.random_input((args.context, H), seed=11 + rank)
    step = ep.layer.random_input((1, H), seed=21 + rank)
    result = {}
    for kind in ("prefill", "decode"):
        cache = ep.new_cache(args.context + args.tokens + args.steps * (args.repeats + 1) + 1)
        if kind == "decode":
            ep.prefill(ctx, cache, chunk_size=args.context)

        def call():
            if kind == "prefill":
                cache.truncate(0)
                ep.prefill(x, cache, chunk_size=args.tokens)
            else:
                for _ in range(args.steps):
                    ep.decode(step, cache)
                cache.truncate(args.context)
        call()  # warm
        ep.reset_stats()
        times = []
        for _ in range(args.repeats):
            dist.barrier()
            t0 = time.perf_counter()
            call()
            times.append(time.perf_counter() - t0)
        slowest = [None] * world
        dist.all_gather_object(slowest, times)
        per_call = [max(t[i] for t in slowest) for i in range(args.repeats)]
        passes = max(ep.stats["passes"], 1)
        result[kind] = dict(seconds=statistics.median(per_call),
                            phases={k: ep.stats[k] / passes for k in ("attention_s", "dispatch_s", "experts_s",
                                                                       "combine_s")},
                            sent=ep.stats["bytes_sent"] / passes, received=ep.stats["bytes_received"] / passes)
    dist.barrier()
    dist.destroy_process_group()
    queue.put((rank, result))


def run_world(world, args):
    from qwen3layer.cli.ep import spawn_ranks
    results = spawn_ranks(rank_main, world, args, threads=1)
    if results is None:
        raise SystemExit(f"bench_ep: a rank of {world} failed")
    return results


def single(args, world):
    import torch
    import qwen3layer as q3
    cfg = config(args.small)
    layer = q3.DecoderLayer.random(cfg, seed=0, dtype="bfloat16")
    H = cfg.hidden_size
    x = torch.stack([torch.from_dlpack(layer.random_input((args.tokens, H), seed=1 + r)) for r in range(world)])
    ctx = torch.stack([torch.from_dlpack(layer.random_input((args.context, H), seed=11 + r)) for r in range(world)])
    step = torch.cat([torch.from_dlpack(layer.random_input((1, H), seed=21 + r)) for r in range(world)])
    out = {}
    cache = layer.new_cache(args.tokens + 1, batch=world)

    def prefill():
        for s in range(world):
            cache.truncate(0, s)
        layer.prefill(x, cache, chunk_size=args.tokens)
    prefill()
    out["prefill"] = _median_call(prefill, args.repeats)
    dcache = layer.new_cache(args.context + args.steps + 1, batch=world)
    layer.prefill(ctx, dcache, chunk_size=args.context)

    def decode():
        for _ in range(args.steps):
            layer.decode(step, dcache)
        for s in range(world):
            dcache.truncate(args.context, s)
    decode()
    out["decode"] = _median_call(decode, args.repeats)
    return out


def _size(n: float) -> str:
    return f"{n / 1e6:.2f} MB" if n >= 1e6 else f"{n / 1e3:.1f} KB"


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--small", action="store_true")
    ap.add_argument("--tokens", type=int, default=512)
    ap.add_argument("--context", type=int, default=512)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    import qwen3layer as q3
    from machine import cpu_name
    print(f"machine: {cpu_name()}, {os.cpu_count()} CPUs; qwen3layer cpu path {q3.build_info()['cpu_path']}; "
          f"{'small' if args.small else 'real'} geometry, bf16; prefill {args.tokens} tokens a sequence, decode "
          f"{args.steps} steps at context {args.context}; medians of {args.repeats}")
    rows = []
    for world in (1, 2):
        base = single(args, world)
        ep = run_world(world, args)
        for kind in ("prefill", "decode"):
            slow = max(r[kind]["seconds"] for r in ep.values())
            work = world * (args.tokens if kind == "prefill" else args.steps)
            ph = ep[0][kind]["phases"]
            rows.append((f"{kind}, {world} seq", base[kind], slow, work, ph, ep[0][kind]["sent"],
                         ep[0][kind]["received"], kind))
    print()
    print(f"{'work':<24}| {'single, all threads':>20} | {'EP ranks x 1 thread':>20} | {'EP/single':>9} | "
          f"{'rank 0 a pass: attention / dispatch / experts / combine ms':>58} | {'sent / recv a pass':>18}")
    print("-" * 24 + "|" + "-" * 22 + "|" + "-" * 22 + "|" + "-" * 11 + "|" + "-" * 60 + "|" + "-" * 19)
    for name, base_s, ep_s, work, ph, sent, recv, kind in rows:
        world = int(name.split(", ")[1][0])
        unit = "tok/s" if kind == "prefill" else "ms/tok"
        fmt = (lambda s: f"{work / s:9.1f} {unit}") if kind == "prefill" else \
            (lambda s: f"{1e3 * s / (work / world):9.2f} {unit}")
        phases = " / ".join(f"{1e3 * ph[k]:.2f}" for k in ("attention_s", "dispatch_s", "experts_s", "combine_s"))
        print(f"{name + f' ({world} rank)':<24}| {fmt(base_s):>20} | {fmt(ep_s):>20} | {ep_s / base_s:8.2f}x | "
              f"{phases:>58} | {_size(sent)} / {_size(recv)}")
    print("\nEP/single > 1: the EP layer is slower by that factor on the same work. decode ms/tok: a step's time "
          "(each rank decodes its own sequence in the step).")


if __name__ == "__main__":
    main()
