"""The FP8 kernels (kernels/fp8.h, kernels/cpu/matmul_fp8.c) through their test entries: the
e4m3 conversion code by code against torch.float8_e4m3fn, and the block-scaled matmul of each
CPU path against a float64 reference on the dequantized weights, at sizes with partial
128-blocks, decode (GEMV) and prefill (dequantized tiles) token counts, bf16 and fp32 scales."""
import numpy as np
import pytest
import torch

import qwen3layer as q3
from qwen3layer import _testing

PATHS = q3.build_info()["cpu_paths"]
BEST = PATHS[-1]
CODES = torch.arange(256, dtype=torch.uint8)
TORCH_VALUES = CODES.view(torch.float8_e4m3fn).float()
NAN_CODES = (0x7F, 0xFF)


@pytest.fixture(autouse=True)
def restore_path():
    yield
    q3.set_cpu_path(BEST)


def blocks(n):
    return (n + 127) // 128


def random_fp8(n, k, seed):
    """[n, k] e4m3 bytes: every finite code (both NaN codes left out), random"""
    g = torch.Generator().manual_seed(seed)
    finite = torch.tensor([c for c in range(256) if c not in NAN_CODES], dtype=torch.uint8)
    return finite[torch.randint(0, len(finite), (n, k), generator=g)]


def random_scale(n, k, dtype, seed):
    """[ceil(n/128), ceil(k/128)] positive scales over a few binades, as in a checkpoint"""
    g = torch.Generator().manual_seed(seed)
    return torch.exp2(torch.rand(blocks(n), blocks(k), generator=g) * 6 - 12).to(dtype)


def scale_args(scale):
    if scale.dtype == torch.bfloat16:
        return scale.view(torch.int16).numpy(), "bfloat16"
    return scale.numpy(), "float32"


def dequant_torch(w, scale):
    """float64 W [n, k] = e4m3(w) * scale_inv[i // 128, j // 128], by torch"""
    n, k = w.shape
    s = scale.double().repeat_interleave(128, 0)[:n].repeat_interleave(128, 1)[:, :k]
    return w.view(torch.float8_e4m3fn).double() * s


def fp8_matmul(x, w, scale, y=None, accumulate=False):
    t, k = x.shape
    n = w.shape[0]
    y = torch.zeros(t, n) if y is None else y.clone()
    s, sdt = scale_args(scale)
    _testing.fp8_matmul(y.numpy(), x.contiguous().numpy(), w.contiguous().numpy(), s, sdt, t, n, k, int(accumulate))
    return y


def test_every_code_converts_as_torch_does():
    out = np.empty(256, dtype=np.float32)
    _testing.fp8_to_f32(CODES.numpy(), out)
    out = torch.from_numpy(out)
    nan = torch.isnan(TORCH_VALUES)
    assert nan.nonzero().flatten().tolist() == list(NAN_CODES)
    assert torch.isnan(out[nan]).all()
    assert torch.equal(out[~nan], TORCH_VALUES[~nan])
    # signed zeros: 0x80 is -0.0 in both
    assert torch.equal(torch.signbit(out[~nan]), torch.signbit(TORCH_VALUES[~nan]))
    assert TORCH_VALUES[0x7E] == 448 and TORCH_VALUES[0x01] == 2.0 ** -9


@pytest.mark.parametrize("sdtype", [torch.float32, torch.bfloat16])
def test_scalar_dequantization_matches_torch(sdtype):
    n, k = 200, 300
    w, scale = random_fp8(n, k, 1), random_scale(n, k, sdtype, 2)
    out = np.empty((n, k), dtype=np.float32)
    s, sdt = scale_args(scale)
    _testing.fp8_matmul(out, np.empty(0, np.float32), w.numpy(), s, sdt, 0, n, k, 0, 1)
    assert torch.equal(torch.from_numpy(out).double(), dequant_torch(w, scale).float().double())


@pytest.mark.parametrize("path", PATHS)
def test_vector_conversion_of_every_code_is_exact(path):
    """x = identity: y = W exactly, every finite code in every lane position, in the GEMV
    (T = 8: y row t = column t of W) and in the prefill tiles (T = 128: all of W)"""
    q3.set_cpu_path(path)
    finite = torch.tensor([c for c in range(256) if c not in NAN_CODES], dtype=torch.uint8)
    k = 128
    w = finite.repeat(3)[: 2 * k].reshape(2, k)
    w = torch.cat([w, w.roll(1, 1), w.roll(5, 1)])  # [6, 128]: each code at several offsets
    scale = torch.ones(1, 1)
    ref = dequant_torch(w, scale).float()
    for t in (8, 128):
        x = torch.eye(k)[:t]
        assert torch.equal(fp8_matmul(x, w, scale), ref[:, :t].T)


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("t", [1, 8, 17, 40])
@pytest.mark.parametrize("n,k", [(5, 200), (32, 256)])  # (32, 256): the amx path's tiles, step by step and whole rows
def test_nan_weight_gives_nan(path, t, n, k):
    q3.set_cpu_path(path)
    w = random_fp8(n, k, 3)
    w[2, 150] = 0xFF
    w[4, 7] = 0x7F
    y = fp8_matmul(torch.randn(t, k), w, torch.ones(1, 2))
    rest = [i for i in range(n) if i not in (2, 4)]
    assert torch.isnan(y[:, [2, 4]]).all() and not torch.isnan(y[:, rest]).any()


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("t", [1, 5, 17])
def test_nan_code_at_every_offset_gives_nan(path, t):
    """row i holds one NaN code, at column 9 i + i % 3 (every offset of a 16- and 32-byte load,
    both halves of the GEMV's pairs, the tails past the last whole vector); rows of 300 columns"""
    q3.set_cpu_path(path)
    n, k = 34, 300
    w = random_fp8(n, k, 5)
    for i in range(n - 1):  # the last row keeps no NaN code
        w[i, 9 * i + i % 3] = NAN_CODES[i % 2]
    y = fp8_matmul(torch.randn(t, k), w, torch.ones(1, 3))
    assert torch.isnan(y[:, : n - 1]).all() and not torch.isnan(y[:, n - 1]).any()


SIZES = [(200, 300), (5, 100), (130, 129), (256, 384), (1, 7), (48, 1056), (200, 320), (40, 4160), (20, 2048),
         (130, 4200), (7, 8256), (3, 12352)]
# (N, K): partial blocks, K < 128; rows past 128 in blocks of 6; three k blocks of the dot products;
# K a multiple of 2048 (x rows padded by a cache line in the dot products); K % 64 != 0 with rows
# past 128; x of 1 and 2 tokens within the VBMI GEMV's bf16 buffer (3 x 8192 elements) and of 3
# past it (8256); of 1 token within it and of 2 and 3 past it (12352)
VBMI = any(v["name"] == "avx512_vbmi" and v["runs"] for v in _testing.e4m3_variants(all=True))
BF16_GEMV_X = 3 * 8192  # kernels/cpu/matmul_fp8_vbmi.c's BF16_MAX_X


def rounds_to_bf16(path, t, n, k):
    """(x, weights): what the bf16 paths round to bf16. The FP8 prefill: x and each dequantized
    weight, for the AMX tiles or the bf16 dot products (kernels/cpu/matmul_fp8.c), where their
    shapes fit; the avx512bf16 level's decode GEMV on VBMI: x only (e4m3 is exact in bf16, the
    scale applied to the sums)"""
    if path == "amx":
        both = t >= 16 and n % 16 == 0 and k % 32 == 0
        return both, both
    if path != "avx512bf16":
        return False, False
    if t >= 4 and k % 32 == 0:
        return True, True
    return VBMI and t < 4 and t * k <= BF16_GEMV_X, False


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("sdtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("n,k", SIZES)
def test_matmul_matches_float64_reference(path, sdtype, n, k):
    q3.set_cpu_path(path)
    w, scale = random_fp8(n, k, n * 1000 + k), random_scale(n, k, sdtype, k)
    wd = dequant_torch(w, scale)
    # e4m3 times its fp32 scale, rounded to fp32 and then to bf16 (to nearest even), as the tiles take it
    wd_bf16 = wd.float().bfloat16().double()
    g = torch.Generator().manual_seed(7)
    for t in (1, 2, 3, 4, 6, 8, 17, 64):  # GEMV groups of 4 tokens + 1, 2, 3, 0, 2, 0 tokens; prefill
        x = torch.randn(t, k, generator=g)
        # the operands the path multiplies (the kernel is given x itself)
        round_x, round_w = rounds_to_bf16(path, t, n, k)
        xr = x.bfloat16().double() if round_x else x.double()
        wr = wd_bf16 if round_w else wd
        ref = xr @ wr.T
        # fp32 accumulation over k terms: bound by the magnitude of the terms, not of the sum
        bound = 1e-6 * (k ** 0.5 + 4) * (xr.abs() @ wr.abs().T) + 1e-30
        y = fp8_matmul(x, w, scale)
        assert ((y.double() - ref).abs() <= bound).all(), (path, t, float(((y.double() - ref).abs() / bound).max()))
        y0 = torch.randn(t, n, generator=g)
        ya = fp8_matmul(x, w, scale, y=y0, accumulate=True)
        assert ((ya.double() - (ref + y0.double())).abs() <= bound + 1e-6 * y0.double().abs()).all(), (path, t)


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("n,k", [(130, 320), (40, 4160), (20, 1056)])
def test_each_product_is_rounded_as_torch_rounds_it(path, n, k):
    """x one-hot (token t picks column c_t, spread over the steps of 64 and the scale blocks), so
    y[t, n] is one weight times its scale, exactly: bf16(e4m3 x scale) to the bit where the path
    rounds weights (the tables of the avx512bf16 level's row sources), fp32 where it does not"""
    q3.set_cpu_path(path)
    w, scale = random_fp8(n, k, 11 * n + k), random_scale(n, k, torch.float32, k)
    want = dequant_torch(w, scale).float()
    for t in (4, 17, 64):
        cols = [(37 * i + 5) % k for i in range(t)]
        x = torch.zeros(t, k)
        x[torch.arange(t), cols] = 1.0
        y = fp8_matmul(x, w, scale)
        round_w = rounds_to_bf16(path, t, n, k)[1]
        ref = want[:, cols].T
        assert torch.equal(y, ref.bfloat16().float() if round_w else ref), (path, t)


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("t", [1, 3, 4, 17])
def test_x_is_rounded_to_nearest_even(path, t):
    """W the identity (e4m3 1.0, scale 1) over 192 columns (three steps of 64), so y[t, n] is
    x[t, n] as the path takes it: x at ties between two bf16 neighbours (to the even one), just
    off them, and ordinary values, equal to torch's bf16 rounding where the path rounds x"""
    q3.set_cpu_path(path)
    k = 192
    w = torch.zeros(k, k, dtype=torch.uint8)
    w[torch.arange(k), torch.arange(k)] = 0x38  # e4m3 1.0
    scale = torch.ones(blocks(k), blocks(k))
    ulp = 2.0 ** -7  # of bf16 in [1, 2)
    g = torch.Generator().manual_seed(t)
    base = 1 + ulp * torch.randint(0, 128, (t, k), generator=g).float()  # bf16 values in [1, 2)
    kind = torch.randint(0, 4, (t, k), generator=g)
    offset = torch.tensor([0.5, 0.5 + 2.0 ** -12, 0.5 - 2.0 ** -12, 0.0])[kind] * ulp
    sign = torch.where(torch.rand(t, k, generator=g) < 0.5, -1.0, 1.0)
    x = sign * (base + offset) * torch.exp2(torch.randint(-20, 20, (t, k), generator=g).float())
    y = fp8_matmul(x, w, scale)
    round_x = rounds_to_bf16(path, t, k, k)[0]
    assert torch.equal(y, x.bfloat16().float() if round_x else x), (path, t)


def test_short_buffers_are_rejected():
    w, scale = random_fp8(4, 130, 1), torch.ones(1, 2)
    with pytest.raises(ValueError, match="scale"):
        _testing.fp8_matmul(np.zeros((1, 4), np.float32), np.zeros((1, 130), np.float32), w.numpy(),
                          np.ones(1, np.float32), "float32", 1, 4, 130, 0)
    with pytest.raises(ValueError, match="x"):
        _testing.fp8_matmul(np.zeros((1, 4), np.float32), np.zeros((1, 129), np.float32), w.numpy(),
                          scale.numpy(), "float32", 1, 4, 130, 0)
    with pytest.raises(ValueError, match=r"T, N, K: expected each 0 to 2\^20, got 1, 2097152, 130"):
        _testing.fp8_matmul(np.zeros((1, 4), np.float32), np.zeros((1, 130), np.float32), w.numpy(),
                          scale.numpy(), "float32", 1, 1 << 21, 130, 0)
