"""`python -m qwen3layer run --ep N`: the layer's experts over N local processes (gloo over a
file rendezvous, torch.multiprocessing spawn), each rank prefilling and decoding its own
sequence; prints each rank's time in the four phases of a pass (attention, dispatch, experts,
combine) and what it moved, beside the cost model's expectation of the exchange."""
from __future__ import annotations

import argparse
import datetime
import os
import statistics
import sys
import tempfile
import time
from typing import Any, Optional

from ..analysis.costs import ep_exchange
from ..placement import contiguous_placement

PHASES = ("attention_s", "dispatch_s", "experts_s", "combine_s")


def _rank(rank: int, world: int, init: str, opts: dict, queue) -> None:
    import torch
    import torch.distributed as dist

    from .common import geometry
    from ..placement.parallel import ExpertParallelLayer

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=opts["timeout"]))
    report = {"rank": rank}
    try:
        cfg = geometry(opts["geometry"])
        t0 = time.perf_counter()
        layer = ExpertParallelLayer.random(cfg, seed=opts["seed"], dtype=opts["dtype"],
                                           weight_format=opts["weight_format"])
        report.update(experts=layer.experts, weight_bytes=layer.layer.weight_bytes, build_s=time.perf_counter() - t0)
        H, tokens, chunk = cfg.hidden_size, opts["tokens"], opts["chunk_size"]
        cache = layer.new_cache(tokens + opts["new_tokens"])
        x = layer.layer.random_input((tokens, H), opts["seed"] * 7919 + rank)
        dist.barrier()
        layer.reset_stats()
        t0 = time.perf_counter()
        layer.prefill(x, cache, chunk_size=chunk)
        report["prefill_s"] = time.perf_counter() - t0
        report["prefill"] = dict(layer.stats)
        layer.reset_stats()
        steps = []
        for i in range(opts["new_tokens"]):
            t = layer.layer.random_input((1, H), opts["seed"] * 104729 + 31 * rank + i)
            t0 = time.perf_counter()
            layer.decode(t, cache)
            steps.append(time.perf_counter() - t0)
        report["decode_ms"] = 1e3 * statistics.median(steps) if steps else None
        report["decode"] = dict(layer.stats)
        dist.barrier()
    except BaseException as e:  # noqa: BLE001 -- reported by the parent, which exits nonzero
        report["error"] = f"{type(e).__name__}: {e}"
    finally:
        dist.destroy_process_group()
    queue.put((rank, report))


def spawn_ranks(target, world: int, opts: Any, threads: Optional[int] = None) -> Optional[dict]:
    """`world` spawned processes running target(rank, world, rendezvous file, opts, queue), each
    putting (rank, report) on the queue; threads: OMP_NUM_THREADS of each (read as its extension
    loads). {rank: report}, or None if a rank died before reporting (the others then killed)."""
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    queue = ctx.SimpleQueue()
    init = os.path.join(tempfile.mkdtemp(prefix="qwen3layer-ep-"), "rendezvous")
    saved = os.environ.get("OMP_NUM_THREADS")
    if threads is not None:
        os.environ["OMP_NUM_THREADS"] = str(threads)
    try:
        procs = [ctx.Process(target=target, args=(r, world, init, opts, queue)) for r in range(world)]
        for p in procs:
            p.start()
    finally:
        if saved is None:
            os.environ.pop("OMP_NUM_THREADS", None)
        else:
            os.environ["OMP_NUM_THREADS"] = saved
    reports: dict = {}
    while len(reports) < world:  # a rank that dies says so here instead of leaving us waiting
        if not queue.empty():
            rank, report = queue.get()
            reports[rank] = report
        elif any(p.exitcode not in (None, 0) for p in procs):
            for p in procs:
                p.kill()
            print(f"a rank of {world} died (exit codes {[p.exitcode for p in procs]})", file=sys.stderr)
            return None
        else:
            time.sleep(0.05)
    for p in procs:
        p.join(60)
    return reports


def _size(n: float) -> str:
    return f"{n / 1e9:.2f} GB" if n >= 1e9 else f"{n / 1e6:.2f} MB" if n >= 1e6 else f"{n / 1e3:.1f} KB"


def _phases(stats: dict) -> str:
    n = max(stats["passes"], 1)
    return " / ".join(f"{1e3 * stats[k] / n:.2f}" for k in PHASES)


def cmd_run_ep(args: argparse.Namespace) -> int:
    import importlib.util
    if importlib.util.find_spec("torch") is None:
        print("run --ep: needs torch (pip install torch): the ranks exchange rows with torch.distributed",
              file=sys.stderr)
        return 2
    from .. import _C
    from .common import geometry

    world = args.ep
    cfg = geometry(args.geometry)
    if args.checkpoint or args.device != "cpu":
        print("run --ep: random weights on the CPU only (so far): no --checkpoint or --device", file=sys.stderr)
        return 2
    threads = max(1, _C.build_info()["threads"] // world)
    dtype = args.dtype or "bfloat16"
    fmt = "fp8_e4m3_block128" if args.fp8 else "gptq_int4" if args.int4 else None
    print(f"expert parallelism: {world} local processes (gloo), {threads} thread(s) each; {args.geometry} "
          f"geometry, random {dtype} weights{f' ({fmt} matrices)' if fmt else ''}; each rank prefills its own "
          f"{args.tokens} tokens in chunks of {args.chunk_size}, then decodes {args.new_tokens} steps", flush=True)
    opts = dict(geometry=args.geometry, seed=args.seed, dtype=dtype, tokens=args.tokens, chunk_size=args.chunk_size,
                new_tokens=args.new_tokens, timeout=600, weight_format=fmt)
    reports = spawn_ranks(_rank, world, opts, threads)
    if reports is None:
        return 1
    failed = [r for r in reports.values() if "error" in r]
    for r in failed:
        print(f"rank {r['rank']}: {r['error']}", file=sys.stderr)
    if failed:
        return 1
    steps = -(-args.tokens // args.chunk_size)
    pre = ep_exchange(cfg, world, args.tokens // steps, dtype, contiguous_placement(cfg.num_experts, world))
    dec = ep_exchange(cfg, world, 1, dtype)
    print(f"\n{'rank':<5}| {'experts':<14}| {'weights':>9} | {'speed':>12} | "
          f"{'a pass: attention / dispatch / experts / combine ms':>52} | {'sent / received a pass':>24}")
    for phase, model in (("prefill", pre), ("decode", dec)):
        print(f"{phase}:")
        for rank in range(world):
            r = reports[rank]
            st = r[phase]
            ids = r["experts"]
            span = f"{ids[0]}..{ids[-1]} ({len(ids)})" if ids else "none"
            n = max(st["passes"], 1)
            speed = f"{args.tokens / r['prefill_s']:.1f} tok/s" if phase == "prefill" else \
                (f"{r['decode_ms']:.2f} ms/tok" if r["decode_ms"] is not None else "-")
            print(f"{rank:<5}| {span:<14}| {_size(r['weight_bytes']):>9} | {speed:>12} | {_phases(st):>52} | "
                  f"{_size(st['bytes_sent'] / n)} / {_size(st['bytes_received'] / n)} "
                  f"(model {_size(model.bytes_sent[rank])} / {_size(model.bytes_received[rank])})")
    print(f"\nprefill: {steps} pass(es) a rank; the model: uniform routing, every rank {pre.rows} rows a pass "
          "(the mean; bytes: rows out with their routes, and the sums back)")
    return 0
