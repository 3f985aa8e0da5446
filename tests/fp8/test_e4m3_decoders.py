"""The e4m3 decoder variants of the check harness (csrc/check/e4m3_decoders*.c, timed against
each other by benchmarks/bench_e4m3_decoders.py), each that this CPU runs: every code through
its vector code, bit for bit as torch.float8_e4m3fn (NaN codes NaN, the sign kept), by its
exact decoder and by its GEMV's; its GEMV against a float64 reference at odd sizes (K not a
multiple of 32, partial 128-blocks of rows and columns), a row with a NaN code giving NaN, on
one and on every thread; its dequantization as the scalar reference, bit for bit, whole and in
a ring of rows; and the entries' rejected arguments."""
import numpy as np
import pytest
import torch

import qwen3layer as q3
from qwen3layer import _testing

VARIANTS = [v["name"] for v in _testing.e4m3_variants()]
MISSING = [v for v in _testing.e4m3_variants(all=True) if not v["runs"]]
THREADS = sorted({1, q3.build_info()["threads"]})
CODES = np.arange(256, dtype=np.uint8)
TORCH_VALUES = torch.from_numpy(CODES).view(torch.float8_e4m3fn).float().numpy()
NAN_CODES = (0x7F, 0xFF)
FINITE = np.array([c not in NAN_CODES for c in range(256)])

needs_variants = pytest.mark.skipif(not VARIANTS, reason="no e4m3 decoder variant runs on this CPU (x86-64 only)")
each_variant = pytest.mark.parametrize("variant", VARIANTS)


def blocks(n):
    return (n + 127) // 128


def random_fp8(n, k, seed):
    """[n, k] random e4m3 codes (NaN codes left out) and [ceil(n/128), ceil(k/128)] fp32 scales
    over a few binades, each block its own"""
    rng = np.random.default_rng(seed)
    finite = CODES[FINITE]
    w = finite[rng.integers(0, len(finite), (n, k))]
    scale = np.exp2(rng.uniform(-12, -6, (blocks(n), blocks(k)))).astype(np.float32)
    return w, scale


def dequant64(w, scale):
    """float64 W [n, k] = e4m3(w) * scale[i // 128, j // 128]"""
    n, k = w.shape
    s = np.repeat(np.repeat(scale.astype(np.float64), 128, 0)[:n], 128, 1)[:, :k]
    return torch.from_numpy(w).view(torch.float8_e4m3fn).double().numpy() * s


def decode(variant, codes, fast=False):
    out = np.full(len(codes), 12345.0, np.float32)  # any lane left unwritten shows
    _testing.e4m3_decode(variant, np.ascontiguousarray(codes), out, fast=fast)
    return out


def assert_codes_decode(got, codes, nan_too=True):
    """got [n] fp32 against torch's values of codes [n]: bits equal where finite; NaN (sign kept) for NaN codes"""
    want = TORCH_VALUES[codes]
    finite = FINITE[codes]
    bad = np.nonzero(got[finite].view(np.uint32) != want[finite].view(np.uint32))[0]
    assert not len(bad), [(hex(c), float(g), float(w)) for c, g, w in
                          zip(codes[finite][bad][:8], got[finite][bad][:8], want[finite][bad][:8])]
    if nan_too:
        assert np.isnan(got[~finite]).all()
        assert (np.signbit(got[~finite]) == (codes[~finite] >= 0x80)).all()


@needs_variants
def test_the_shipped_constructions_are_among_the_variants():
    shipped = {v["shipped"] for v in _testing.e4m3_variants(all=True)}
    assert {"avx2", "avx512"} <= shipped


@needs_variants
@each_variant
def test_every_code_decodes_as_torch_does(variant):
    got = decode(variant, CODES)
    assert_codes_decode(got, CODES)
    # and as kernels/fp8.h's scalar conversion, the oracle of the kernels, where finite
    scalar = np.empty(256, np.float32)
    _testing.fp8_to_f32(CODES, scalar)
    assert np.array_equal(got[FINITE].view(np.uint32), scalar[FINITE].view(np.uint32))
    assert got[0x80].view(np.uint32) == 0x80000000 and TORCH_VALUES[0x01] == 2.0 ** -9 and got[0x01] == 2.0 ** -9


@needs_variants
@each_variant
def test_the_gemv_decoder_reads_every_finite_code_exactly(variant):
    # its lanes out of column order are put back by the entry: a wrong order shows here
    assert_codes_decode(decode(variant, CODES, fast=True), CODES, nan_too=False)


@needs_variants
@each_variant
@pytest.mark.parametrize("fast", [False, True])
def test_codes_in_any_order_and_a_partial_last_chunk(variant, fast):
    codes = np.random.default_rng(3).integers(0, 256, 1001).astype(np.uint8)  # 1001: no multiple of 32 or 64
    if fast:
        codes = codes[FINITE[codes]]
    assert_codes_decode(decode(variant, codes, fast), codes, nan_too=not fast)


@needs_variants
@each_variant
@pytest.mark.parametrize("threads", THREADS)
@pytest.mark.parametrize("n,k", [(131, 1000), (257, 4096 + 77), (3, 31)])
def test_gemv_matches_float64(variant, threads, n, k):
    w, scale = random_fp8(n, k, n + k)
    x = np.random.default_rng(k).standard_normal(k).astype(np.float32)
    y = np.full(n, np.nan, np.float32)
    _testing.e4m3_gemv(variant, y, x, w, scale, n, k, threads=threads)
    W = dequant64(w, scale)
    want = W @ x.astype(np.float64)
    # fp32 sums of k products: a few ulps of the sum of magnitudes (a code decoded wrong, a
    # scale of the wrong block or a column of x in the wrong lane is far above this)
    tol = 8 * np.finfo(np.float32).eps * np.sqrt(k) * (np.abs(W) @ np.abs(x.astype(np.float64)))
    assert np.all(np.abs(y - want) <= tol), float(np.max(np.abs(y - want) / tol))


@needs_variants
@each_variant
def test_gemv_row_with_a_nan_code_is_nan(variant):
    n, k = 200, 300
    w, scale = random_fp8(n, k, 7)
    w[3, 299], w[n - 1, 5] = 0x7F, 0xFF  # in a partial chunk at a row's end, and in a full one
    x = np.ones(k, np.float32)
    y = np.zeros(n, np.float32)
    _testing.e4m3_gemv(variant, y, x, w, scale, n, k)
    nan = np.isnan(y)
    assert nan[3] and nan[n - 1] and nan.sum() == 2


@needs_variants
@each_variant
@pytest.mark.parametrize("threads", THREADS)
def test_dequantization_is_the_scalar_reference(variant, threads):
    n, k = 131, 1000
    w, scale = random_fp8(n, k, 11)
    w[5, 17], w[130, 999] = 0x7F, 0xFF
    want = np.empty((n, k), np.float32)
    _testing.fp8_matmul(want, np.empty(0, np.float32), w, scale, "float32", 1, n, k, 0, 1)  # scalar, kernels/fp8.h
    got = np.full((n, k), 12345.0, np.float32)
    _testing.e4m3_dequant(variant, got, w, scale, n, k, threads=threads)
    nan = np.isnan(want)
    assert nan.sum() == 2 and np.array_equal(np.isnan(got), nan)
    assert np.array_equal(got[~nan].view(np.uint32), want[~nan].view(np.uint32))
    # a ring of 2 rows a thread: one thread's last two rows are there
    ring = np.full((2, k), 12345.0, np.float32)
    _testing.e4m3_dequant(variant, ring, w, scale, n, k, rows=2)
    for row in (n - 2, n - 1):  # the last holds the NaN code 0xff
        assert np.array_equal(ring[row % 2], want[row], equal_nan=True)


@needs_variants
def test_an_unknown_variant_is_named_with_those_this_cpu_runs():
    with pytest.raises(ValueError, match="variant: expected one of .*'" + VARIANTS[0] + "'.*got 'avx3_nibble'"):
        _testing.e4m3_decode("avx3_nibble", CODES, np.empty(256, np.float32))


@pytest.mark.parametrize("info", MISSING, ids=[v["name"] for v in MISSING])
def test_a_variant_this_cpu_cannot_run_is_refused(info):
    w, scale = random_fp8(4, 40, 0)
    with pytest.raises(ValueError, match=f"variant: '{info['name']}' needs .*which this CPU lacks"):
        _testing.e4m3_gemv(info["name"], np.empty(4, np.float32), np.empty(40, np.float32), w, scale, 4, 40)


@needs_variants
def test_rejected_arguments_name_what_was_expected():
    v = VARIANTS[0]
    n, k = 130, 200
    w, scale = random_fp8(n, k, 0)
    x, y = np.ones(k, np.float32), np.empty(n, np.float32)
    with pytest.raises(ValueError, match=r"dst: 1020 bytes, expected at least 1024"):
        _testing.e4m3_decode(v, CODES, np.empty(255, np.float32))
    with pytest.raises(ValueError, match=r"y: 516 bytes, expected at least 520"):
        _testing.e4m3_gemv(v, np.empty(n - 1, np.float32), x, w, scale, n, k)
    with pytest.raises(ValueError, match=r"w: 25999 bytes, expected at least 26000"):
        _testing.e4m3_gemv(v, y, x, w.reshape(-1)[1:], scale, n, k)
    with pytest.raises(ValueError, match=r"scale: 12 bytes, expected at least 16"):
        _testing.e4m3_gemv(v, y, x, w, scale.reshape(-1)[1:], n, k)
    with pytest.raises(ValueError, match=r"threads: expected 1 to \d+, got 0"):
        _testing.e4m3_gemv(v, y, x, w, scale, n, k, threads=0)
    with pytest.raises(ValueError, match=r"repeats: expected 1 to 2\^20, got 0"):
        _testing.e4m3_gemv(v, y, x, w, scale, n, k, repeats=0)
    with pytest.raises(ValueError, match=r"T, N, K: expected each 0 to 2\^20, got 1, -1, 200"):
        _testing.e4m3_gemv(v, y, x, w, scale, -1, k)
    with pytest.raises(ValueError, match=r"rows: expected N \(130\) or from threads \(1\) to N, got 131"):
        _testing.e4m3_dequant(v, np.empty((n + 1, k), np.float32), w, scale, n, k, rows=n + 1)
    with pytest.raises(ValueError, match=r"dst: 1600 bytes, expected at least 2400"):
        _testing.e4m3_dequant(v, np.empty((2, k), np.float32), w, scale, n, k, rows=3)
