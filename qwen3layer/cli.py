"""Command line: `python -m qwen3layer run` (the main job).

run: builds one decoder layer (the real Qwen3-235B-A22B geometry by default, random bf16
weights), prefills --tokens tokens chunk by chunk with a progress line, decodes
--new-tokens steps, and prints the time of each phase with the rate it implies. Needs
neither torch nor numpy: inputs and outputs are the extension's own tensors.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time

from . import _C
from .config import LayerConfig
from .costs import cost_model, decode_weight_bytes, prefill_flops
from .profile import join, stage_table
from .layer import DecoderLayer

GEOMETRIES = {"real": LayerConfig.qwen3_235b_a22b, "tiny": LayerConfig.tiny}


def progress(done: int, total: int, started: float, label: str) -> None:
    width = 30
    filled = width * done // total
    rate = done / max(time.perf_counter() - started, 1e-9)
    sys.stderr.write(f"\r{label} [{'#' * filled}{'.' * (width - filled)}] {done}/{total} tokens "
                     f"{rate:8.1f} tok/s")
    sys.stderr.flush()


def cmd_run(args: argparse.Namespace) -> int:
    cfg = GEOMETRIES[args.geometry]()
    info = _C.build_info()
    print(f"qwen3layer {info['version']}: {info['threads']} threads, cpu path {info['cpu_path']} "
          f"(of {', '.join(info['cpu_paths'])}), {info['compiler']}")
    t0 = time.perf_counter()
    print(f"building a {args.geometry}-geometry layer with random {args.dtype} weights ...", flush=True)
    layer = DecoderLayer.random(cfg, seed=args.seed, dtype=args.dtype)
    print(f"  {layer}\n  built in {time.perf_counter() - t0:.1f} s")
    cache = layer.new_cache(args.tokens + args.new_tokens)
    H = cfg.hidden_size

    chunk = args.chunk_size
    layer._core.set_profiling(True)  # stage times of this run, for the map tables
    started = time.perf_counter()
    done = 0
    progress(0, args.tokens, started, "prefill")
    while done < args.tokens:
        n = min(chunk, args.tokens - done)
        x = _C.random_tensor((n, H), args.seed * 7919 + done, args.dtype)
        layer.prefill(x, cache, chunk_size=chunk)
        done += n
        progress(done, args.tokens, started, "prefill")
    prefill_s = time.perf_counter() - started
    prefill_stages = layer._core.profile_seconds()
    layer._core.set_profiling(True)
    sys.stderr.write("\n")

    step_ms = []
    for i in range(args.new_tokens):
        x = _C.random_tensor((1, H), args.seed * 104729 + i, args.dtype)
        t = time.perf_counter()
        layer.decode(x, cache)
        step_ms.append((time.perf_counter() - t) * 1e3)

    flops = prefill_flops(cfg, args.tokens)
    print(f"\nprefill  {args.tokens} tokens in chunks of {chunk}: {prefill_s:.2f} s, "
          f"{args.tokens / prefill_s:.1f} tok/s, {flops / prefill_s / 1e9:.1f} GFLOP/s")
    if step_ms:
        med = statistics.median(step_ms)
        wbytes = decode_weight_bytes(cfg, args.dtype)
        print(f"decode   {args.new_tokens} steps at context {args.tokens}..{args.tokens + args.new_tokens - 1}: "
              f"median {med:.2f} ms/token (min {min(step_ms):.2f}), "
              f"{wbytes / 1e6:.1f} MB of weights per token -> {wbytes / med / 1e6:.1f} GB/s")
    print(f"cache    {cache}\nworkspace {layer.workspace_bytes / 2**20:.1f} MiB")
    decode_stages = layer._core.profile_seconds()
    layer._core.set_profiling(False)
    print()
    pre = cost_model(cfg, "prefill", args.tokens, chunk_size=chunk, dtype=args.dtype)
    print(stage_table(join(pre, prefill_stages), f"the map, prefill of {args.tokens} tokens in {pre.passes} "
                      f"chunk(s) of {chunk} (all chunks together):"))
    if args.new_tokens:
        dec = cost_model(cfg, "decode", args.new_tokens, context=args.tokens, dtype=args.dtype)
        print()
        print(stage_table(join(dec, decode_stages), f"the map, decode: {args.new_tokens} steps from context "
                          f"{args.tokens} (all steps together):"))
    return 0


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m qwen3layer", description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="command", required=True)
    run = sub.add_parser("run", help="prefill and decode through one layer, timing each phase")
    run.add_argument("--geometry", choices=sorted(GEOMETRIES), default="real")
    run.add_argument("--dtype", choices=["bfloat16", "float32"], default="bfloat16")
    run.add_argument("--tokens", type=int, default=512, help="prompt tokens to prefill (default 512)")
    run.add_argument("--chunk-size", type=int, default=128, help="prefill chunk (default 128)")
    run.add_argument("--new-tokens", type=int, default=16, help="decode steps (default 16)")
    run.add_argument("--seed", type=int, default=0)
    run.set_defaults(func=cmd_run)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    for name in ("tokens", "chunk_size"):
        if getattr(args, name) < 1:
            build_parser().error(f"--{name.replace('_', '-')}: expected a positive int, got {getattr(args, name)}")
    if args.new_tokens < 0:
        build_parser().error(f"--new-tokens: expected a non-negative int, got {args.new_tokens}")
    try:
        return args.func(args)
    except KeyboardInterrupt:
        sys.stderr.write("\ninterrupted\n")
        return 130
