"""Run as a script, in a process started with QWEN3LAYER_PACKED_KC set (the k block of the
packed matmul, kernels/cpu/matmul_packed.c): the dense bf16 and the FP8 matmuls of every CPU
path that has the packed kernel, at K past several k blocks and a 128-block boundary inside a
k block, against float64. Prints one line per path and matmul; exits 1 on a miss."""
import sys

import torch

import qwen3layer as q3
from qwen3layer import _testing

PACKED = [p for p in q3.build_info()["cpu_paths"] if p in ("avx2", "avx512")]


def bound(x, w, k):
    """fp32 sums of k terms: their rounding, bounded by the terms' magnitudes"""
    return 1e-6 * (k ** 0.5 + 4) * (x.double().abs() @ w.double().abs().T) + 1e-30


def dense(T, N, K, g):
    x, w = torch.randn(T, K, generator=g), torch.randn(N, K, generator=g).to(torch.bfloat16)
    y = torch.zeros(T, N)
    _testing.matmul_dense(y.numpy(), x.numpy(), w.view(torch.int16).numpy(), "bfloat16", T, N, K, False)
    return float(((y.double() - x.double() @ w.double().T).abs() / bound(x, w, K)).max())


def fp8(T, N, K, g):
    finite = torch.tensor([c for c in range(256) if c & 0x7F != 0x7F], dtype=torch.uint8)
    w = finite[torch.randint(0, len(finite), (N, K), generator=g)]
    scale = torch.exp2(torch.rand((N + 127) // 128, (K + 127) // 128, generator=g) * 6 - 12)
    wd = w.view(torch.float8_e4m3fn).double() * \
        scale.double().repeat_interleave(128, 0)[:N].repeat_interleave(128, 1)[:, :K]
    x, y = torch.randn(T, K, generator=g), torch.zeros(T, N)
    _testing.fp8_matmul(y.numpy(), x.numpy(), w.numpy(), scale.numpy(), "float32", T, N, K, 0)
    return float(((y.double() - x.double() @ wd.T).abs() / bound(x, wd, K)).max())


def main() -> int:
    g = torch.Generator().manual_seed(5)
    worst = 0.0
    for path in PACKED:
        q3.set_cpu_path(path)
        for name, fn in (("bf16", dense), ("fp8", fp8)):
            err = fn(17, 133, 3000, g)  # 17 tokens: 4 tiles and a tail; 133 rows straddle a row block
            print(f"{path} {name} err/bound {err:.3f}")
            worst = max(worst, err)
    return 0 if PACKED and worst <= 1.0 else 1


if __name__ == "__main__":
    sys.exit(main())
