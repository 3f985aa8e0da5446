"""The e4m3 -> fp32 decoder variants of the check harness (csrc/check/e4m3_decoders*.c) against
each other, each in the same one-token GEMV and dequantization loops: GB/s of FP8 weight bytes
(the bytes alone, not the scales), medians of repeats, the variants called in turn within each
repeat (so all see the same load from other work). The GEMV at an expert's [1536, 4096]: from
memory (distinct matrices of about --mb MB in all, one call each in turn), from L3 (one such
matrix, 6.3 MB) and from L2 (one [256, 4096], 1 MiB); the dequantization (exact decoders, NaN
codes NaN) of the same matrices into a ring of rows that stays in L1 (rows=2 a thread), from
memory and from L2. On one thread and on all threads. `*` marks the fastest of a column; the
ratio is against the variant of the shipped GEMV of the active CPU path (`shipped`).

    python benchmarks/bench_e4m3_decoders.py [--repeats 7] [--mb 200] [--variants a,b]
"""
import argparse
import os
import statistics
import sys
import time

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
import qwen3layer as q3  # noqa: E402
from qwen3layer import _C  # noqa: E402
from machine import cpu_name  # noqa: E402

_testing = q3.cuda.testing_module()

N, K = 1536, 4096   # an expert's gate/up projection
N_L2 = 256          # the L2 matrix's rows: 1 MiB
TARGET_S = 0.02     # a cached measurement repeats its call about this long



def cache_sizes():
    """'L2 2048K, L3 491520K' from sysfs (cpu0), or '' where it cannot be read"""
    out = []
    base = "/sys/devices/system/cpu/cpu0/cache"
    try:
        for index in sorted(i for i in os.listdir(base) if i.startswith("index")):
            with open(os.path.join(base, index, "level")) as f:
                level = f.read().strip()
            with open(os.path.join(base, index, "type")) as f:
                kind = f.read().strip()
            with open(os.path.join(base, index, "size")) as f:
                size = f.read().strip()
            if kind != "Instruction" and level in ("2", "3"):
                out.append(f"L{level} {size}")
    except OSError:
        return ""
    return ", ".join(out)


def random_fp8(rng, copies, n, k):
    """[copies, n, k] random finite e4m3 codes (both NaN codes left out: the GEMV's NaN check
    then finds none, as in a checkpoint) and [copies, ceil(n/128), ceil(k/128)] fp32 scales"""
    finite = np.array([c for c in range(256) if c not in (0x7F, 0xFF)], np.uint8)
    w = finite[rng.integers(0, len(finite), (copies, n, k), dtype=np.uint8)]
    scale = rng.uniform(1e-4, 1e-3, (copies, (n + 127) // 128, (k + 127) // 128)).astype(np.float32)
    return w, scale


def medians(calls, repeats):
    """median seconds of each call in calls, called in turn each repeat (a warm-up first)"""
    times = [[] for _ in calls]
    for r in range(repeats + 1):
        for i, call in enumerate(calls):
            t0 = time.perf_counter()
            call()
            if r:
                times[i].append(time.perf_counter() - t0)
    return [statistics.median(t) for t in times]


def inner_repeats(nbytes, guess_gbs=10.0):
    """calls a cached measurement repeats: about TARGET_S at guess_gbs GB/s"""
    return max(1, int(TARGET_S * guess_gbs * 1e9 / nbytes))


def measure(names, threads, w, scale, w_l2, s_l2, x, y, dst, repeats):
    """{column: [GB/s of each name]} for one thread count"""
    copies = len(w)
    ring = 2 * threads
    r_l3 = inner_repeats(N * K)
    r_l2 = inner_repeats(N_L2 * K)
    columns = {
        "GEMV mem": (lambda v: lambda: [_testing.e4m3_gemv(v, y, x, w[c], scale[c], N, K, threads) for c in range(copies)],
                     copies * N * K),
        "GEMV L3": (lambda v: lambda: _testing.e4m3_gemv(v, y, x, w[0], scale[0], N, K, threads, r_l3), r_l3 * N * K),
        "GEMV L2": (lambda v: lambda: _testing.e4m3_gemv(v, y, x, w_l2, s_l2, N_L2, K, threads, r_l2), r_l2 * N_L2 * K),
        "dequant mem": (lambda v: lambda: [_testing.e4m3_dequant(v, dst, w[c], scale[c], N, K, ring, threads)
                                           for c in range(copies)], copies * N * K),
        "dequant L2": (lambda v: lambda: _testing.e4m3_dequant(v, dst, w_l2, s_l2, N_L2, K, ring, threads, r_l2),
                       r_l2 * N_L2 * K),
    }
    out = {}
    for column, (make, nbytes) in columns.items():
        secs = medians([make(v) for v in names], repeats)
        out[column] = [nbytes / s / 1e9 for s in secs]
    return out


def shipped_kernel(threads, w, scale, x, repeats):
    """GB/s of the shipped FP8 matmul (the active path's, every thread) from memory and from L3"""
    y = np.empty((1, N), np.float32)
    x2 = x.reshape(1, K)
    copies = len(w)
    mem = medians([lambda: [_testing.fp8_matmul(y, x2, w[c], scale[c], "float32", 1, N, K) for c in range(copies)]],
                  repeats)[0]
    r = inner_repeats(N * K)

    def l3():
        for _ in range(r):
            _testing.fp8_matmul(y, x2, w[0], scale[0], "float32", 1, N, K)

    cached = medians([l3], repeats)[0]
    return copies * N * K / mem / 1e9, r * N * K / cached / 1e9


def print_table(names, threads, results, shipped):
    cols = list(results)
    print(f"\n{threads} thread{'s' if threads > 1 else ''}: GB/s of FP8 bytes (x: against {shipped})")
    print(f"{'variant':<17}" + "".join(f"{c:>18}" for c in cols))
    ref = names.index(shipped) if shipped in names else None
    for i, name in enumerate(names):
        row = f"{name:<17}"
        for c in cols:
            vals = results[c]
            best = "*" if vals[i] == max(vals) else " "
            ratio = f"x{vals[i] / vals[ref]:.2f}" if ref is not None else ""
            row += f"{vals[i]:>9.2f}{best} {ratio:>7}"
        print(row)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--mb", type=float, default=200.0, help="MB of distinct weight matrices for the 'mem' columns")
    ap.add_argument("--variants", default="", help="','-separated names (default: every variant this CPU runs)")
    ap.add_argument("--threads", default="", help="','-separated thread counts (default: 1 and all)")
    a = ap.parse_args()

    infos = _testing.e4m3_variants()
    names = [v["name"] for v in infos]
    if a.variants:
        names = a.variants.split(",")
    path = _C.build_info()["cpu_path"]
    gemv_isa = {"avx512bf16": "avx512", "amx": "avx512"}.get(path, path)  # the amx levels' GEMV is avx512's
    shipped = next((v["name"] for v in infos if v["shipped"] == gemv_isa), None)
    most = _C.build_info().get("threads") or os.cpu_count()
    counts = [int(t) for t in a.threads.split(",")] if a.threads else sorted({1, most})

    rng = np.random.default_rng(0)
    copies = max(1, round(a.mb * 1e6 / (N * K)))
    w, scale = random_fp8(rng, copies, N, K)
    w_l2, s_l2 = (m[0] for m in random_fp8(rng, 1, N_L2, K))
    x = rng.standard_normal(K, dtype=np.float32)
    y = np.empty(N, np.float32)
    dst = np.empty((2 * max(counts), K), np.float32)
    read = _C.probe_read_bandwidth(2 << 30, 3)

    print(f"CPU: {cpu_name()} ({os.cpu_count()} logical CPUs; {cache_sizes()}); active CPU path {path} "
          f"(its GEMV decodes as {shipped})")
    print(f"read probe {read:.1f} GB/s (2 GiB, all threads); GEMV [{N}, {K}], T = 1; 'mem': {copies} distinct "
          f"matrices, {copies * N * K / 1e6:.0f} MB; medians of {a.repeats} repeats")
    for v in infos:
        if v["name"] in names:
            print(f"  {v['name']:<17} {v['what']}")
    for t in counts:
        load = os.getloadavg()[0]
        results = measure(names, t, w, scale, w_l2, s_l2, x, y, dst, a.repeats)
        print_table(names, t, results, shipped)
        if t == most:
            mem, l3 = shipped_kernel(t, w, scale, x, a.repeats)
            print(f"{'(shipped kernel)':<17}{mem:>9.2f}{'':9}{l3:>9.2f}   _testing.fp8_matmul, T = 1, {t} threads")
        # every thread waits for the slowest at the end of a GEMV: where other work takes a core,
        # a call lasts a time slice of the scheduler (seen here: ~1 GB/s for every variant)
        print(f"load average {load:.2f} before, {os.getloadavg()[0]:.2f} after ({os.cpu_count()} CPUs)")


if __name__ == "__main__":
    main()
