"""`map --machine NAME`: a layer's prefill and decode predicted on a machine this one is not,
from its published figures (qwen3layer.analysis.machines): nothing is built or measured. With
--expert-device cpu, the GPU + host split's prediction at that machine's GPU, link and CPU
(qwen3layer/cli/hybrid.py's tables)."""
from __future__ import annotations

import argparse

from ..analysis.machines import machine, predict, predicted_table

# map's flags that measure something on this machine: no meaning with --machine
MEASURING = {"hidden_keys": "--hidden-keys", "sweep_chunk": "--sweep-chunk"}
# ... and those of the measured layer and its drawing, each with its default: given otherwise, refused
UNUSED = (("repeat", "--repeat", 2), ("out", "--out", "qwen3layer-map"), ("seed", "--seed", 0))


def check_machine_args(args: argparse.Namespace) -> None:
    """ValueError naming a flag that measures on this machine (or a flag of the measured layer
    given another value than its default), or --device, given with --machine"""
    for name, flag in MEASURING.items():
        if getattr(args, name, None):
            raise ValueError(f"{flag}: measures this machine; with --machine {args.machine} nothing is measured")
    for name, flag, default in UNUSED:
        if getattr(args, name, default) != default:
            raise ValueError(f"{flag} {getattr(args, name)}: with --machine {args.machine} no layer is built, "
                             "measured or drawn")
    if args.device != "cpu":
        raise ValueError(f"--device {args.device}: with --machine the machine's own CPU and GPU are predicted "
                         "(both, where it has a GPU)")


def cmd_map_machine(args: argparse.Namespace, cfg, weight_format: str) -> int:
    m = machine(args.machine)
    check_machine_args(args)
    context = args.tokens if args.context is None else args.context
    print(f"{m.name}: {m.what}; CPU {m.cpu}: {m.read / 1e9:.0f} GB/s read, {m.fp32 / 1e12:.2f} TFLOP/s fp32"
          + (f"; GPU {m.gpu_read / 1e12:.2f} TB/s, {m.gpu_bf16 / 1e12:.0f} TFLOP/s bf16" if m.has_gpu else "")
          + (f"; link {m.link / 1e9:.0f} GB/s each way" if m.link else "") + " (published: docs/cli.md)")
    kind = f"{args.geometry} geometry, {args.dtype}, {weight_format} weights"
    for on_gpu in ((False, True) if m.has_gpu else (False,)):
        where = "GPU" if on_gpu else "CPU"
        model, times = predict(cfg, m, "prefill", args.tokens, chunk_size=args.chunk_size, dtype=args.dtype,
                               weight_format=weight_format, on_gpu=on_gpu)
        print()
        print(predicted_table(model, times, f"{m.name} {where}: prefill of {args.tokens} tokens in chunks of "
                                            f"{args.chunk_size}, {kind}"))
        model, times = predict(cfg, m, "decode", 1, context=context, dtype=args.dtype, weight_format=weight_format,
                               on_gpu=on_gpu)
        print()
        print(predicted_table(model, times, f"{m.name} {where}: a decode step at context {context}, {kind}"))
    if m.has_gpu and not m.link:
        print(f"\n{m.name}'s CPU and GPU read one memory: no split over a link to predict (--expert-device)")
    return 0
