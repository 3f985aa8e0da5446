"""The decode GEMV of one expert projection with block-scaled e4m3 weights against the same
projection in bf16 (the layer's weights today), on the active CPU path (QWEN3LAYER_CPU_PATH
chooses), in one run: GB/s of weight bytes (FP8: the bytes plus the fp32 scales) beside the
read probe, and GFLOP/s (for --tokens 16 and more: the prefill path). Geometry of Qwen3-235B-A22B's experts: gate/up [1536, 4096], down [4096, 1536].

    python benchmarks/bench_fp8_gemv.py [--repeats 200] [--tokens 1] [--shapes 1536x4096,4096x8192]
"""
import argparse
import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
import qwen3layer as q3  # noqa: E402
from qwen3layer import _C  # noqa: E402

_testing = q3.cuda.testing_module()  # the single-kernel entries

SHAPES = "1536x4096,4096x1536"  # N x K: gate/up_proj, down_proj of one expert (qkv: 9216x4096, o: 4096x8192)


def best_seconds(fns, repeats):
    """best time of each of fns, called in turn (so both see the same load from other work)"""
    best = [float("inf")] * len(fns)
    for r in range(repeats + 1):
        for i, fn in enumerate(fns):
            t0 = time.perf_counter()
            fn(r)
            if r:
                best[i] = min(best[i], time.perf_counter() - t0)
    return best


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeats", type=int, default=200)
    ap.add_argument("--tokens", type=int, default=1)
    ap.add_argument("--copies", type=int, default=8,
                    help="weight copies called in turn, so the weights come from memory, not L3 (1: cached)")
    ap.add_argument("--shapes", default=SHAPES, help="N x K pairs, comma-separated (default: %(default)s)")
    a = ap.parse_args()
    rng = np.random.default_rng(0)
    read = _C.probe_read_bandwidth(1 << 30, 3)
    print(f"CPU path {_C.build_info()['cpu_path']}, T = {a.tokens}, {a.copies} weight copies in turn; read probe {read:.1f} GB/s (1 GiB, all threads)")
    print(f"{'N x K':>12} {'weights':>8} {'us':>9} {'GB/s':>7} {'of probe':>9} {'GFLOP/s':>8}")
    for n, k in (tuple(int(v) for v in s.split("x")) for s in a.shapes.split(",")):
        x = rng.standard_normal((a.tokens, k), dtype=np.float32)
        y = np.empty((a.tokens, n), np.float32)
        finite = np.array([c for c in range(256) if c not in (0x7F, 0xFF)], np.uint8)
        c = a.copies
        w8 = finite[rng.integers(0, len(finite), (c, n, k))]
        scale = rng.uniform(1e-4, 1e-3, (c, (n + 127) // 128, (k + 127) // 128)).astype(np.float32)
        # bf16 of normal(0, 0.02) draws: random bit patterns would hold subnormals, whose
        # products take the slow microcode path on Intel CPUs (a 10x slower GEMV, seen there)
        wb = ((rng.standard_normal((c, n, k), dtype=np.float32) * 0.02).view(np.uint32) >> 16).astype(np.uint16)
        names, nbytes = ["bf16", "fp8"], [wb[0].nbytes, w8[0].nbytes + scale[0].nbytes]
        secs = best_seconds([lambda r: _testing.matmul_dense(y, x, wb[r % c], "bfloat16", a.tokens, n, k),
                             lambda r: _testing.fp8_matmul(y, x, w8[r % c], scale[r % c], "float32", a.tokens, n, k)],
                            a.repeats)
        for name, nb, s in zip(names, nbytes, secs):
            gbs = nb / s / 1e9
            print(f"{n:>5} x {k:<5} {name:>8} {s * 1e6:9.1f} {gbs:7.1f} {gbs / read:8.0%} {2 * a.tokens * n * k / s / 1e9:8.1f}")


if __name__ == "__main__":
    main()
