"""`python -m qwen3layer write-checkpoint PATH`: a checkpoint folder of random layers (config.json
and sharded safetensors, as transformers lays one out) for tests, benchmarks and `run
--checkpoint`, in bf16/fp32, FP8 or 4-bit GPTQ (RTN: the draws rounded to nearest, not GPTQ's
error-compensating algorithm). qwen3layer.checkpoint.writer does the work."""
from __future__ import annotations

import argparse
import sys
import time

from ..checkpoint.writer import DEFAULT_SHARD_BYTES, write_random_checkpoint
from .common import geometry

FP8 = "fp8_e4m3_block128"
INT4 = "gptq_int4"


def add_parser(sub) -> None:
    w = sub.add_parser("write-checkpoint", help="write a checkpoint folder of random layers (safetensors)")
    w.add_argument("path", help="the folder to make (must not exist)")
    w.add_argument("--geometry", default="tiny", help="real, tiny (default), or a config.json path")
    w.add_argument("--layers", type=int, default=1, help="decoder layers (default 1)")
    w.add_argument("--dtype", choices=["bfloat16", "float32", "float16"], default="bfloat16",
                   help="the dense tensors' dtype (norms, router, embeddings; all of them without a format)")
    w.add_argument("--seed", type=int, default=0, help="layer i holds DecoderLayer.random(config, seed + i)'s weights")
    fmt = w.add_mutually_exclusive_group()
    fmt.add_argument("--fp8", action="store_true", help=f"{FP8} projection matrices")
    fmt.add_argument("--int4", action="store_true", help=f"{INT4} projection matrices (RTN, symmetric)")
    w.add_argument("--weight-format", choices=["dense", FP8, INT4], default=None,
                   help=f"the projection matrices' format by its API name: dense, {FP8} (as --fp8) or {INT4} (as --int4)")
    w.add_argument("--group-size", type=int, default=128, help="with --int4: inputs a group, or -1 (default 128)")
    w.add_argument("--gptq-v2", action="store_true", help="with --int4: zeros stored as they are (checkpoint_format "
                   "gptq_v2; default: gptq, a zero stored minus 1)")
    w.add_argument("--dense-attention", action="store_true", help="with --int4: the experts alone 4-bit, q/k/v/o_proj "
                   "dense (config.json's dynamic rule \"-:.*self_attn.*\")")
    w.add_argument("--vocab-size", type=int, default=256, help="embed_tokens and lm_head rows (default 256)")
    w.add_argument("--shard-mb", type=int, default=DEFAULT_SHARD_BYTES // 1_000_000,
                   help=f"megabytes a shard at most (default {DEFAULT_SHARD_BYTES // 1_000_000})")
    w.set_defaults(func=cmd_write)


def cmd_write(args: argparse.Namespace) -> int:
    if not args.int4 and (args.group_size != 128 or args.gptq_v2 or args.dense_attention):
        print("write-checkpoint: --group-size, --gptq-v2 and --dense-attention are read with --int4 only",
              file=sys.stderr)
        return 2
    cfg = geometry(args.geometry)
    fmt = FP8 if args.fp8 else INT4 if args.int4 else None
    qc = {"group_size": args.group_size, "checkpoint_format": "gptq_v2" if args.gptq_v2 else "gptq"} if args.int4 \
        else None
    if args.dense_attention:
        qc["dynamic"] = {"-:.*self_attn.*": {}}
    started = time.perf_counter()

    def progress(done: int, total: int) -> None:
        sys.stderr.write(f"\rwrite-checkpoint: {done}/{total} layers written, {time.perf_counter() - started:.1f} s")
        sys.stderr.flush()

    path = write_random_checkpoint(args.path, cfg, args.layers, args.seed, args.dtype, fmt, qc, args.vocab_size,
                                   args.shard_mb * 1_000_000, progress)
    sys.stderr.write("\n")
    what = f"{fmt} experts, {args.dtype} attention" if args.dense_attention else fmt or args.dtype
    print(f"wrote {path}: {args.layers} layer(s) of {cfg}, weights {what}")
    return 0
