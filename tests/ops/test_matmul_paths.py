"""The dense matmul of every CPU path (kernels/cpu/matmul*.c: the generic tiles, the packed
panels of avx2 and avx512, the GEMV, AVX512-BF16 and AMX) against float64 on the same
operands, at sizes that reach every edge: K not a multiple of the vector (7, 300), K past one
packed k block (5000), K a multiple of 2048 (the bf16 dot products' x rows a cache line apart
past their length), N not a multiple of a tile's rows, 1, 2, 3, 5, 7, 17 and more tokens, with
and without accumulate; each against the one reference of what its path multiplies (x rounded
to bf16 or not)."""
import os
import subprocess
import sys

import numpy as np
import pytest
import torch

import qwen3layer as q3
from qwen3layer import _testing  # the kernel entries
PATHS = q3.build_info()["cpu_paths"]
ROOT = os.path.join(os.path.dirname(__file__), "..", "..")
HELPERS = os.path.join(os.path.dirname(__file__), "..", "helpers")
# on bf16 weights they round x to bf16 before their dot products, at any T (kernels/cpu/matmul_dot.c:
# the GEMV below 8 tokens, the dot products' tiles from 8; AMX falls back to them off its tiles)
BF16_PATHS = {"avx512bf16", "amx"}
# (T, N, K); with T < 8 the GEMVs (avx512bf16: below 4 tokens and at 7; its dot products' tiles at
# 4-6): tokens in groups of 4 and a rest (5, 6, 7), rows in tiles of 4 or 6 and a rest (5, 7, 9,
# 11, 13), K off the 32 bf16 of a step (7, 100, 300, 2050)
SHAPES = [(1, 5, 7), (2, 16, 64), (3, 7, 300), (8, 13, 300), (17, 37, 300), (40, 64, 96), (130, 19, 72),
          (9, 6, 5000), (33, 50, 2050), (14, 11, 2048), (21, 13, 4096), (5, 9, 100), (7, 13, 4096),
          (4, 11, 300), (6, 7, 2050)]


@pytest.fixture(autouse=True)
def restore_path():
    yield
    q3.set_cpu_path(PATHS[-1])


def operands(T, N, K, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(T, K, generator=g)
    w = torch.randn(N, K, generator=g).to(getattr(torch, dtype))
    y0 = torch.randn(T, N, generator=g)
    return x, w, y0


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
@pytest.mark.parametrize("accumulate", [False, True])
def test_matmul_matches_float64(path, dtype, accumulate):
    q3.set_cpu_path(path)
    assert q3.build_info()["cpu_path"] == path
    for i, (T, N, K) in enumerate(SHAPES):
        x, w, y0 = operands(T, N, K, dtype, 100 + i)
        y = y0.clone()
        _testing.matmul_dense(y.numpy(), x.numpy(), w.view(torch.int16).numpy() if dtype == "bfloat16" else w.numpy(),  # (numpy has float16, not bf16)
                              dtype, T, N, K, accumulate)
        # the operands the path multiplies: a rounding it skips, or one it adds, is ~1e-3 here
        xr = x.to(torch.bfloat16) if dtype == "bfloat16" and path in BF16_PATHS else x
        want = xr.double() @ w.double().T + (y0.double() if accumulate else 0)
        scale = (xr.double().abs() @ w.double().abs().T).numpy() + 1.0  # a bound on each sum's rounding
        err = float((np.abs(y.double().numpy() - want.numpy()) / scale).max())
        assert np.isfinite(y.numpy()).all(), (path, T, N, K)
        assert err <= 1e-5, (path, dtype, T, N, K, err)


def run_with_kc(value):
    env = dict(os.environ, QWEN3LAYER_PACKED_KC=value)
    return subprocess.run([sys.executable, os.path.join(HELPERS, "packed_blocks_check.py")], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=300)


@pytest.mark.skipif(not {"avx2", "avx512"} & set(PATHS), reason="no packed-matmul path on this CPU")
@pytest.mark.parametrize("kc", ["1344", "200", "37"])
def test_other_machines_k_blocks(kc):
    """k blocks of other sizes: 1344 (a k block that ends inside a 128-column FP8 scale block),
    200 and 37 (off the vector width): dense bf16 and FP8 on every packed path against float64"""
    r = run_with_kc(kc)
    assert r.returncode == 0, r.stdout + r.stderr
    assert r.stdout.count("err/bound") == 2 * len({"avx2", "avx512"} & set(PATHS)), r.stdout


def test_bad_k_block_fails_the_import():
    r = run_with_kc("4096")
    assert r.returncode != 0 and "QWEN3LAYER_PACKED_KC: packed k block: expected 0 (from the L1 data cache) " \
        "to 2048 columns, got '4096'" in r.stderr, r.stderr
