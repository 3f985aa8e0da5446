"""Command line: `python -m qwen3layer run` (the main job), `map` (the battle map), `check`
(the three rulers), `write-checkpoint` (a checkpoint folder of random layers: cli/write.py).

run: builds one decoder layer (the real Qwen3-235B-A22B geometry by default, random bf16
weights, or with --fp8 random block-scaled FP8 projection matrices, with --int4 random 4-bit GPTQ
ones: RTN, group 128), prefills --tokens tokens
chunk by chunk with a progress line, decodes --new-tokens steps, and prints the time of each
phase with the rate it implies (decode: GB/s of the weight bytes as stored). Needs neither
torch nor numpy: inputs and outputs are the extension's own tensors.

check --fp8: the rulers on an FP8 layer; its accuracy is measured against transformers on the
dequantized weights (fp32 reference; bf16: at most twice transformers' own bf16 error).
"""
from __future__ import annotations

import argparse
import dataclasses
import statistics
import sys
import time

from .. import _C
from ..analysis.costs import cost_model, decode_weight_bytes, prefill_flops
from ..analysis.profile import join, stage_table
from ..analysis.rulers import activation_bytes
from ..layer import DecoderLayer
from .common import decode_steps, geometry, progress
from .write import add_parser as add_write_parser

FP8 = "fp8_e4m3_block128"
INT4 = "gptq_int4"

def cmd_run(args: argparse.Namespace) -> int:
    if args.ep != 1:
        if args.ep < 1:
            print(f"run: --ep: expected a number of processes >= 1, got {args.ep}", file=sys.stderr)
            return 2
        from .ep import cmd_run_ep
        return cmd_run_ep(args)
    cfg = geometry(args.geometry)
    if args.expert_device is not None:
        from .hybrid import cmd_run_hybrid
        return cmd_run_hybrid(args, cfg)
    info = _C.build_info()
    print(f"qwen3layer {info['version']}: {info['threads']} threads, cpu path {info['cpu_path']} "
          f"(of {', '.join(info['cpu_paths'])}), {info['compiler']}")
    t0 = time.perf_counter()
    if args.checkpoint:
        how = "read into one block" if args.no_mmap else "memory-mapped"
        print(f"loading layer {args.layer} of {args.checkpoint} ({how}) ...", flush=True)
        layer = DecoderLayer.from_checkpoint(args.checkpoint, args.layer, device=args.device, dtype=args.dtype,
                                             mmap=not args.no_mmap)
        cfg = layer.config
    else:
        quantized = FP8 if args.fp8 else INT4 if args.int4 else None
        kind = f"{'FP8' if args.fp8 else '4-bit GPTQ (RTN)'} ({quantized}) matrices and {args.dtype or 'bfloat16'} " \
            "norms and router" if quantized else f"{args.dtype or 'bfloat16'}"
        print(f"building a {args.geometry}-geometry layer with random {kind} weights ...", flush=True)
        layer = DecoderLayer.random(cfg, seed=args.seed, dtype=args.dtype or "bfloat16", device=args.device,
                                    weight_format=quantized)
    args.dtype = layer.dtype
    fmt = dict(weight_format=layer.weight_format, scale_dtype=layer._core.scale_dtype or "float32")
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
        x = layer.random_input((n, H), args.seed * 7919 + done)
        layer.prefill(x, cache, chunk_size=chunk)
        done += n
        progress(done, args.tokens, started, "prefill")
    prefill_s = time.perf_counter() - started
    prefill_stages = layer._core.profile_seconds()
    layer._core.set_profiling(True)
    sys.stderr.write("\n")

    step_ms = [s * 1e3 for s in decode_steps(layer, cache, args.new_tokens, args.seed)]

    flops = prefill_flops(cfg, args.tokens)
    print(f"\nprefill  {args.tokens} tokens in chunks of {chunk}: {prefill_s:.2f} s, "
          f"{args.tokens / prefill_s:.1f} tok/s, {flops / prefill_s / 1e9:.1f} GFLOP/s")
    if step_ms:
        med = statistics.median(step_ms)
        wbytes = decode_weight_bytes(cfg, args.dtype, **fmt)
        stored = {FP8: "FP8 weights and scales", INT4: "4-bit weights, scales, zeros and g_idx"}.get(
            layer.weight_format, "weights")
        print(f"decode   {args.new_tokens} steps at context {args.tokens}..{args.tokens + args.new_tokens - 1}: "
              f"median {med:.2f} ms/token (min {min(step_ms):.2f}), "
              f"{wbytes / 1e6:.1f} MB of {stored} per token -> {wbytes / med / 1e6:.1f} GB/s")
    decode_stages = layer._core.profile_seconds()
    layer._core.set_profiling(False)
    if layer.device != "cpu" and args.new_tokens:
        graph_ms = graph_decode_ms(layer, cache, args)
        print(f"decode   {args.new_tokens} more steps replaying a CUDA graph of the step: "
              f"{graph_ms:.3f} ms/token (wall clock, launches included)")
    print(f"cache    {cache}\nworkspace {layer.workspace_bytes / 2**20:.1f} MiB")
    print()
    pre = cost_model(cfg, "prefill", args.tokens, chunk_size=chunk, dtype=args.dtype, **fmt)
    print(stage_table(join(pre, prefill_stages), f"the map, prefill of {args.tokens} tokens in {pre.passes} "
                      f"chunk(s) of {chunk} (all chunks together):"))
    if args.new_tokens:
        dec = cost_model(cfg, "decode", args.new_tokens, context=args.tokens, dtype=args.dtype, **fmt)
        print()
        print(stage_table(join(dec, decode_stages), f"the map, decode: {args.new_tokens} steps from context "
                          f"{args.tokens} (all steps together):"))
    return 0


def graph_decode_ms(layer: DecoderLayer, cache, args: argparse.Namespace) -> float:
    """The decode step captured in a CUDA graph, replayed --new-tokens times over the same
    context as the plain steps (the cache is cut back to the prompt first), timed from the
    first launch to the device's end. The graph's input holds zeros: a token like another."""
    from .. import cuda

    index = int(layer.device.partition(":")[2] or 0)
    cache.truncate(args.tokens, 0)
    graph = layer.decode_graph(cache)
    cuda.synchronize(index)
    t = time.perf_counter()
    for _ in range(args.new_tokens):
        graph()
    cuda.synchronize(index)
    return (time.perf_counter() - t) * 1e3 / args.new_tokens


def cmd_map(args: argparse.Namespace) -> int:
    import os

    from ..analysis.mapplot import draw_map, draw_sweep

    cfg = geometry(args.geometry)
    if args.expert_device is not None:
        from .hybrid import cmd_map_hybrid
        return cmd_map_hybrid(args, cfg)
    if args.machine is not None:  # predicted from published figures: nothing built or measured
        from .machines import cmd_map_machine
        return cmd_map_machine(args, cfg, FP8 if args.fp8 else INT4 if args.int4 else "dense")
    context = args.tokens if args.context is None else args.context
    os.makedirs(args.out, exist_ok=True)
    fmt = FP8 if args.fp8 else INT4 if args.int4 else None
    kind = ", FP8 weights" if args.fp8 else ", 4-bit GPTQ weights (RTN)" if args.int4 else ""
    print(f"building a {args.geometry} layer ({args.dtype}{kind}, {args.device}) ...", flush=True)
    weights = _C.random_weights(cfg, args.seed, args.dtype, fmt)
    layer = DecoderLayer(cfg, weights, device=args.device, dtype=args.dtype)
    print(f"measuring prefill of {args.tokens} tokens in chunks of {args.chunk_size} ...", flush=True)
    pre = layer.profile("prefill", args.tokens, 0, args.chunk_size, repeat=args.repeat)
    print(f"measuring decode at context {context} ...", flush=True)
    dec = layer.profile("decode", 1, context, repeat=max(3, args.repeat))
    print()
    print(pre.table())
    print()
    print(dec.table())
    if args.hidden_keys:  # masked attention's cost: the same decode over a context with holes
        print(f"\nmeasuring decode at context {context} with {args.hidden_keys:g} of it hidden ...", flush=True)
        masked = layer.profile("decode", 1, context, repeat=max(3, args.repeat), hidden_keys=args.hidden_keys)
        print(masked.table())
        a, b = (next(s.seconds for s in p.stages if s.name == "attention") for p in (dec, masked))
        print(f"attention, masked against unmasked: {b * 1e3:.3f} ms against {a * 1e3:.3f} ms "
              f"({b / a if a else float('nan'):.2f}x; the hidden keys are read and scored, then dropped)")
    stem = os.path.join(args.out, "map")
    draw_map(pre, dec, f"one {args.geometry}-geometry Qwen3-MoE decoder layer, {args.dtype}{kind}, {args.device}",
             [stem + ".svg", stem + ".png"])
    print(f"\nwrote {stem}.svg and {stem}.png")
    if args.sweep_chunk:
        points = []
        for chunk in args.sweep_chunk:
            fresh = DecoderLayer(cfg, weights, device=args.device, dtype=args.dtype)  # its own workspace, the same weights
            print(f"sweep: prefill of {args.tokens} tokens in chunks of {chunk} ...", flush=True)
            p = fresh.profile("prefill", args.tokens, 0, chunk, repeat=1)
            points.append((chunk, p.call_seconds, activation_bytes(fresh, min(chunk, args.tokens), args.dtype)))
        print("\nchunk size | prefill s | tok/s | activation memory MiB")
        for c, t, m in points:
            print(f"{c:10d} | {t:9.3f} | {args.tokens / t:5.0f} | {m / 2**20:.1f}")
        stem = os.path.join(args.out, "sweep")
        draw_sweep(points, f"prefill of {args.tokens} tokens: time and memory against chunk size",
                   [stem + ".svg", stem + ".png"])
        print(f"wrote {stem}.svg and {stem}.png")
    return 0


def cmd_check(args: argparse.Namespace) -> int:
    import json

    from ..analysis import rulers

    cfg = geometry(args.geometry)
    weights = _C.random_weights(cfg, args.seed, args.dtype, FP8 if args.fp8 else INT4 if args.int4 else None)
    ours = dict(weights)
    if args.perturb:  # for demonstrating the accuracy ruler: our copy of one weight is changed
        if args.perturb not in ours:
            raise SystemExit(f"--perturb: expected one of {sorted(ours)}, got {args.perturb!r}")
        t = ours[args.perturb]
        if t.dtype == "float8_e4m3fn":
            raise SystemExit(f"--perturb: {args.perturb} is an FP8 matrix; with --fp8 change its scale "
                             f"{args.perturb}_scale_inv, a norm or the router")
        if args.perturb.endswith((".qweight", ".qzeros", ".scales", ".g_idx")):
            raise SystemExit(f"--perturb: {args.perturb} is a 4-bit matrix's {t.dtype} tensor; with --int4 change a "
                             "norm or the router")
        ours[args.perturb] = _C.random_tensor(tuple(t.shape), 99, t.dtype, 0.05)
    layer = DecoderLayer(cfg, ours, device=args.device, dtype=args.dtype)
    # the reference's weights: an FP8 or 4-bit layer's matrices dequantized to fp32 (in C), as they are meant
    reference = dequantized(weights) if args.fp8 or args.int4 else weights
    results = [
        rulers.accuracy(cfg, reference, layer, args.dtype, args.accuracy_tokens, args.seed),
        rulers.decode_latency(cfg, layer, args.dtype, args.context, args.latency_factor),
        rulers.prefill_memory(cfg, weights, args.dtype, args.device, args.tokens, args.chunk_size, args.max_memory_mb),
    ]
    failed = any(r.passed is False for r in results)
    if args.json:
        print(json.dumps({"geometry": args.geometry, "dtype": args.dtype, "weight_format": layer.weight_format,
                          "device": args.device, "pass": not failed,
                          "rulers": [dataclasses.asdict(r) for r in results]}, indent=2))
    else:
        for r in results:
            print(r.line())
    return 1 if failed else 0


def dequantized(weights: dict) -> dict:
    """weights with every FP8 matrix replaced by its fp32 dequantization (scales dropped), and
    every 4-bit GPTQ one (<module>.qweight, .qzeros, .scales, .g_idx) by <module>.weight"""
    out = {}
    for name, t in weights.items():
        if name.endswith(("_scale_inv", ".qzeros", ".scales", ".g_idx")):
            continue
        if name.endswith(".qweight"):
            module = name[:-len(".qweight")]
            out[module + ".weight"] = _C.dequantize_int4(t, weights[module + ".qzeros"], weights[module + ".scales"],
                                                         weights[module + ".g_idx"])
            continue
        if t.dtype == "float8_e4m3fn":  # a fused gate_up_proj holds the gate's blocks, then the up's
            out[name] = _C.dequantize_fp8(t, weights[name + "_scale_inv"], 2 if name.endswith("gate_up_proj") else 1)
        else:
            out[name] = t
    return out


def chunk_list(text: str) -> list:
    try:
        chunks = [int(c) for c in text.split(",") if c.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated positive ints, got {text!r}") from None
    if not chunks or min(chunks) < 1:
        raise argparse.ArgumentTypeError(f"expected comma-separated positive ints, got {text!r}")
    return chunks


def hidden_fraction(text: str) -> float:
    try:
        f = float(text)
    except ValueError:
        f = -1.0
    if not 0 <= f < 1:
        raise argparse.ArgumentTypeError(f"expected a fraction of the context in [0, 1), got {text!r}")
    return f


def weight_format_option(p: argparse.ArgumentParser) -> None:
    """--weight-format: the random weights' format by the API's name (DecoderLayer.random's weight_format)"""
    p.add_argument("--weight-format", choices=["dense", FP8, INT4], default=None,
                   help=f"the random weights' format by its API name: dense, {FP8} (as --fp8) or {INT4} (as --int4)")


def format_flags(args: argparse.Namespace) -> dict:
    """--weight-format folded into --fp8 / --int4 (the commands read those), refused beside another
    format; the option each format flag came from, for the messages"""
    named = {"fp8": "--fp8", "int4": "--int4"}
    fmt = getattr(args, "weight_format", None)
    if fmt is None:
        return named
    if getattr(args, "checkpoint", None):
        build_parser().error(f"--weight-format {fmt}: random weights only (a checkpoint's weights keep their own format)")
    flag = {FP8: "fp8", INT4: "int4"}.get(fmt)
    for other in ("fp8", "int4"):
        if other != flag and getattr(args, other, False):
            build_parser().error(f"--weight-format {fmt}, --{other}: one weight format, got both")
    if flag:
        setattr(args, flag, True)
        named[flag] = f"--weight-format {fmt}"
    return named


def layer_options(p: argparse.ArgumentParser) -> None:
    """The options that choose the layer, shared by the commands."""
    p.add_argument("--geometry", default="real", help="real, tiny, or a config.json path")
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", choices=["bfloat16", "float32", "float16"], default="bfloat16")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--fp8", action="store_true", help=f"random {FP8} projection matrices (the accuracy "
                   "ruler then measures against the dequantized weights)")
    p.add_argument("--int4", action="store_true", help=f"random 4-bit weights ({INT4}: the draws rounded to "
                   "nearest into GPTQ's layout, group 128; the accuracy ruler then measures against them dequantized)")
    weight_format_option(p)


def split_options(p: argparse.ArgumentParser) -> None:
    """The options of a layer split over one GPU and the host (qwen3layer/cli/hybrid.py)."""
    p.add_argument("--expert-device", choices=["cpu"], default=None,
                   help="the experts not in --gpu-experts in host memory, run by the CPU (with --device cuda)")
    p.add_argument("--gpu-experts", default="0", metavar="N|IDS",
                   help="with --expert-device: N puts experts 0..N-1 on the GPU (the random weights route near "
                        "uniformly, so any N are as hot; the API's gpu_experts=N instead takes the N hottest of "
                        "expert_counts), or a comma-separated list of ids")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m qwen3layer", description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="command", required=True)
    run = sub.add_parser("run", help="prefill and decode through one layer, timing each phase")
    run.add_argument("--geometry", default="real", help="real, tiny, or a config.json path")
    run.add_argument("--dtype", choices=["bfloat16", "float32", "float16"], default=None,
                     help="default: bfloat16, or the checkpoint's")
    run.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N")
    run.add_argument("--checkpoint", default=None, metavar="PATH",
                     help="a transformers safetensors checkpoint folder: use its layer --layer")
    run.add_argument("--layer", type=int, default=0, help="with --checkpoint: which layer (default 0)")
    run.add_argument("--no-mmap", action="store_true",
                     help="with --checkpoint: read the layer's tensors into one block on huge pages (decode reads "
                          "them faster) instead of mapping the files")
    run.add_argument("--tokens", type=int, default=512, help="prompt tokens to prefill (default 512)")
    run.add_argument("--chunk-size", type=int, default=128, help="prefill chunk (default 128)")
    run.add_argument("--new-tokens", type=int, default=16, help="decode steps (default 16)")
    run.add_argument("--seed", type=int, default=0)
    run.add_argument("--ep", type=int, default=1, metavar="N",
                     help="the experts over N local processes (gloo; needs torch): per-rank phase times and bytes")
    run.add_argument("--fp8", action="store_true", help=f"random FP8 weights ({FP8}: e4m3 projection matrices "
                     "with fp32 128x128 block scales, norms and router in --dtype)")
    run.add_argument("--int4", action="store_true", help=f"random 4-bit weights ({INT4}: the draws rounded to "
                     "nearest into GPTQ's layout, group 128; norms and router in --dtype)")
    weight_format_option(run)
    split_options(run)
    run.set_defaults(func=cmd_run)
    mp = sub.add_parser("map", help="the dual prefill/decode map: tables, SVG and PNG")
    layer_options(mp)
    mp.add_argument("--tokens", type=int, default=512, help="prefill tokens (default 512)")
    mp.add_argument("--context", type=int, default=None, help="decode context (default: --tokens)")
    mp.add_argument("--chunk-size", type=int, default=512)
    mp.add_argument("--hidden-keys", type=hidden_fraction, default=0.0, metavar="F",
                    help="also measure decode with this fraction of the context hidden by a token mask "
                         "(masked attention's cost)")
    mp.add_argument("--sweep-chunk", type=chunk_list, default=None, metavar="C1,C2,...",
                    help="also plot prefill time and memory against these chunk sizes")
    mp.add_argument("--repeat", type=int, default=2)
    mp.add_argument("--out", default="qwen3layer-map", help="folder for map.svg/png (and sweep.svg/png)")
    split_options(mp)
    mp.add_argument("--machine", default=None, metavar="NAME",
                    help="predict instead of measuring, from a machine's published figures: grace, gh200, gb10, "
                         "orin or graviton4 (with --expert-device cpu: gh200's GPU + host split)")
    mp.set_defaults(func=cmd_map)
    ck = sub.add_parser("check", help="the three rulers: accuracy, decode latency, prefill memory")
    layer_options(ck)
    ck.add_argument("--tokens", type=int, default=2048, help="prefill tokens of the memory ruler")
    ck.add_argument("--chunk-size", type=int, default=512)
    ck.add_argument("--context", type=int, default=512, help="decode context of the latency ruler")
    ck.add_argument("--accuracy-tokens", type=int, default=16)
    ck.add_argument("--latency-factor", type=float, default=1.33, help="pass when time <= factor x floor")
    ck.add_argument("--max-memory-mb", type=float, default=256.0)
    ck.add_argument("--perturb", default=None, metavar="WEIGHT", help="change our copy of one weight (a demo)")
    ck.add_argument("--json", action="store_true")
    ck.set_defaults(func=cmd_check)
    add_write_parser(sub)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    for name in ("tokens", "chunk_size", "repeat"):
        if getattr(args, name, 1) < 1:
            build_parser().error(f"--{name.replace('_', '-')}: expected a positive int, got {getattr(args, name)}")
    for name in ("new_tokens", "context"):
        value = getattr(args, name, None)
        if value is not None and value < 0:
            build_parser().error(f"--{name.replace('_', '-')}: expected a non-negative int, got {value}")
    named = format_flags(args)
    for flag in ("fp8", "int4"):
        if getattr(args, flag, False) and getattr(args, "checkpoint", None):
            build_parser().error(f"{named[flag]}: random weights only (a checkpoint's weights keep their own format)")
    if getattr(args, "fp8", False) and getattr(args, "int4", False):
        build_parser().error("--fp8, --int4: one weight format, got both")
    if getattr(args, "no_mmap", False) and not getattr(args, "checkpoint", None):
        build_parser().error("--no-mmap: with --checkpoint only (random weights are the layer's own block already)")
    try:
        return args.func(args)
    except KeyboardInterrupt:
        sys.stderr.write("\ninterrupted\n")
        return 130
    except (ValueError, TypeError, IndexError, FileExistsError) as e:  # a bad device, geometry, checkpoint or path
        sys.stderr.write(f"python -m qwen3layer {args.command}: {e}\n")
        return 2
