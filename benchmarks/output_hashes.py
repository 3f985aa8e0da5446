"""The bits a fixed set of layer calls produce, hashed: for a refactor that must not change a
number ("no behaviour change, proven"). Run it before and after, on the same machine, and
compare the two files:

    python benchmarks/output_hashes.py --save /tmp/before.json            # the CPU paths
    python benchmarks/output_hashes.py --executor --save /tmp/before-simt.json
    ... change the code, rebuild ...
    python benchmarks/output_hashes.py --check /tmp/before.json           # exit 1 on a difference

Each case is a layer of random weights (fixed seeds) in fp32, bf16 and FP8 (bf16 activations),
at the tiny geometry and one large enough for the kernels' tiles, called as prefill in chunks
over a left-padded batch, decode steps, a batched decode step, a call with its insides (router
logits, experts, attention maps), and the two halves; what is hashed is every output's bytes
and the cache's keys and values. On every CPU path this machine runs (--paths to choose), or
with --executor on the SIMT executor's emulated CUDA device (the CUDA kernels' host build), once
with each prefill MoE path forced (a measured choice would follow the timing). A
path's hashes are compared with the same path's only. Not a test: the bits legitimately change
when a kernel does."""
import argparse
import hashlib
import json
import sys

import numpy as np

import qwen3layer as q3
from qwen3layer import _C

GEOMETRIES = {
    "tiny": q3.LayerConfig.tiny(),
    "tiles": q3.LayerConfig(hidden_size=256, num_attention_heads=8, num_key_value_heads=2, head_dim=64,
                            num_experts=16, num_experts_per_tok=4, moe_intermediate_size=96),
}
FORMATS = [("float32", None), ("bfloat16", None), ("bfloat16", "fp8_e4m3_block128")]


SIZES = {"float32": 4, "int32": 4, "bfloat16": 2, "float8_e4m3fn": 1}


def host_bytes(t) -> bytes:
    """the bytes of an extension tensor in C order, read in place through its shape and strides
    (host memory, or the executor's device memory, which is host memory too)"""
    import ctypes
    size = SIZES[t.dtype]
    span = 1 + sum((n - 1) * s for n, s in zip(t.shape, t.strides)) if all(t.shape) else 0
    if not span:
        return b""
    words = np.frombuffer((ctypes.c_char * (size * span)).from_address(t.data_ptr), f"u{size}")
    return np.ascontiguousarray(np.lib.stride_tricks.as_strided(words, t.shape, [size * s for s in t.strides])).tobytes()


class Hasher:
    def __init__(self):
        self.h = hashlib.sha256()

    def add(self, *tensors) -> None:
        for t in tensors:
            if t is not None:
                self.h.update(repr((tuple(t.shape), t.dtype)).encode())
                self.h.update(host_bytes(t))

    def cache(self, cache) -> None:
        for s in range(cache.batch):
            self.add(cache.keys(s), cache.values(s))

    def hexdigest(self) -> str:
        return self.h.hexdigest()[:24]


def cases(layer, cfg, dtype):
    """name -> hash of each call sequence on `layer`"""
    H = cfg.hidden_size
    out = {}

    def x(shape, seed):
        return layer.random_input(shape, seed, dtype)

    h = Hasher()  # prefill in chunks over a left-padded batch of 2, then decode steps
    cache = layer.new_cache(96, batch=2)
    cache.set_padding(5, 1)
    h.add(layer.prefill(x((2, 37, H), 1), cache, chunk_size=16))
    for t in range(3):
        h.add(layer.decode(x((2, H), 10 + t), cache))
    h.cache(cache)
    out["prefill chunks + decode"] = h.hexdigest()

    h = Hasher()  # one sequence's prefill in one pass, then a batched decode of 5 sequences
    cache = layer.new_cache(64, batch=5)
    for s in range(5):
        h.add(layer.prefill(x((3 + 4 * s, H), 20 + s), cache, s))
    h.add(layer.decode(x((5, H), 30), cache))
    h.cache(cache)
    out["ragged batch decode"] = h.hexdigest()

    h = Hasher()  # the insides
    cache = layer.new_cache(32, batch=1)
    trace = layer.prefill(x((9, H), 40), cache, return_router=True, return_attention=True)
    h.add(trace.output, trace.router_logits, trace.experts, trace.expert_weights, trace.attention)
    out["insides"] = h.hexdigest()

    h = Hasher()  # the two halves, the bit-exact sum
    cache = layer.new_cache(32, batch=1)
    resid, normed, experts, weights = layer.attention_half(x((11, H), 50), cache)
    h.add(resid, normed, experts, weights, layer.expert_half(normed, experts, weights))
    h.cache(cache)
    out["halves"] = h.hexdigest()
    return out


# the executor's prefill MoE paths, each forced in turn: left measured, the choice follows timing
# and can flip a hash from run to run under load
EXECUTOR_MOE_PATHS = ("per_expert_wmma", "grouped_wmma")


def run(paths, device):
    result = {}
    for path in paths:
        if device == "cpu":
            q3.set_cpu_path(path)
        for gname, cfg in GEOMETRIES.items():
            for dtype, fmt in FORMATS:
                layer = q3.DecoderLayer.random(cfg, seed=7, dtype=dtype, device=device, weight_format=fmt)
                if device != "cpu":
                    q3.cuda.moe_path(layer, path.split("/", 1)[1])
                for name, digest in cases(layer, cfg, dtype).items():
                    result[f"{path} {gname} {fmt or dtype} {name}"] = digest
                print(f"  {path} {gname} {fmt or dtype}: done", file=sys.stderr)
    return result


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--paths", help="CPU paths, comma-separated (default: every one build_info() lists)")
    p.add_argument("--executor", action="store_true", help="on the SIMT executor's emulated CUDA device")
    p.add_argument("--save", help="write the hashes to this JSON file")
    p.add_argument("--check", help="compare with the hashes of this JSON file (exit 1 on a difference)")
    a = p.parse_args()
    if a.executor:
        q3.cuda.emulate()
        paths, device = [f"simt/{m}" for m in EXECUTOR_MOE_PATHS], "cuda"
    else:
        paths, device = (a.paths.split(",") if a.paths else q3.build_info()["cpu_paths"]), "cpu"
    result = run(paths, device)
    if a.save:
        with open(a.save, "w", encoding="utf-8") as f:
            json.dump(result, f, indent=1, sort_keys=True)
    if a.check:
        with open(a.check, encoding="utf-8") as f:
            before = json.load(f)
        common = sorted(set(before) & set(result))
        differ = [k for k in common if before[k] != result[k]]
        for k in differ:
            print(f"DIFFERS  {k}: {before[k]} -> {result[k]}")
        print(f"{len(common) - len(differ)} of {len(common)} cases bit-identical"
              f"{' (only in one run: ' + str(len(set(before) ^ set(result))) + ')' if set(before) ^ set(result) else ''}")
        return 1 if differ or not common else 0
    for k, v in sorted(result.items()):
        print(f"{v}  {k}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
