"""CUDA kernel benchmark, first step of the CUDA backend: the device's own copy bandwidth,
and the decode GEMV (matmul with 1 or 16 tokens, bf16 weights) at the real geometry's shapes,
each in TB/s against that copy rate. Also a per-token estimate: the sum of the GEMV times of
one decode token's weights (attention, router, 8 experts) against the read floor. The layer
does not run on CUDA yet; its own figures (and transformers on the same GPU) come with it.
Needs a CUDA device; prints a table last.
"""
from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import qwen3layer as q3  # noqa: E402
from qwen3layer import _C  # noqa: E402
from qwen3layer.costs import decode_weight_bytes  # noqa: E402

# (name, N, K) of y = x W^T for one layer of Qwen3-235B-A22B
SHAPES = [("q_proj", 8192, 4096), ("k_proj / v_proj", 512, 4096), ("o_proj", 4096, 8192),
          ("router", 128, 4096), ("expert gate / up", 1536, 4096), ("expert down", 4096, 1536)]


def main() -> int:
    if q3.cuda.device_count() == 0:
        print("bench_cuda: no CUDA device visible", file=sys.stderr)
        return 2
    copy_bytes = 4 << 30
    copy_ms = _C.cuda_time("copy", bytes=copy_bytes, repeats=10)
    copy_tbs = 2 * copy_bytes / copy_ms / 1e9  # read + write
    rows = []
    per_token_ms = 0.0
    uses = {"q_proj": 1, "k_proj / v_proj": 2, "o_proj": 1, "router": 1, "expert gate / up": 16, "expert down": 8}
    for name, N, K in SHAPES:
        for T in (1, 16):
            ms = _C.cuda_time("matmul", T=T, N=N, K=K, dtype="bfloat16", repeats=50)
            tbs = N * K * 2 / ms / 1e9
            rows.append((f"{name} [{N} x {K}]", T, f"{ms * 1e3:.1f} us", f"{tbs:.2f} TB/s", f"{tbs / copy_tbs:.0%}"))
            if T == 1:
                per_token_ms += uses[name] * ms
    cfg = q3.LayerConfig.qwen3_235b_a22b()
    floor_ms = decode_weight_bytes(cfg) / (copy_tbs * 1e9)
    print(f"device copy: {copy_tbs:.2f} TB/s (read + write of {copy_bytes >> 30} GiB, CUDA events)\n")
    head = ("matmul (bf16 weights)", "tokens", "time", "weights read", "of copy rate")
    widths = [max(len(str(r[i])) for r in rows + [head]) for i in range(5)]
    print(" | ".join(h.ljust(w) for h, w in zip(head, widths)))
    print("-|-".join("-" * w for w in widths))
    for r in rows:
        print(" | ".join(str(v).ljust(w) for v, w in zip(r, widths)))
    print(f"\none decode token's weight GEMVs (sum of kernel times): {per_token_ms * 1e3:.0f} us; "
          f"read floor at the copy rate: {floor_ms * 1e3:.0f} us ({floor_ms / per_token_ms:.0%} of it reached)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
