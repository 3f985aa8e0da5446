"""Random FP8 weights made in C: the fp32 -> e4m3fn rounding (kernels/fp8.h q3_f32_to_e4m3)
against torch's .to(torch.float8_e4m3fn) value by value (ties, subnormals, the 448/464/480
boundaries where torch saturates, negatives, inf and NaN); random_weights(..., "fp8_e4m3_block128") against a
quantization of the dense draws of the same seed done by torch (odd sizes: partial blocks, a
gate/up split inside a block); dequantize_fp8 against torch; a layer on them equal to the
dense layer on the dequantized weights."""
import numpy as np
import pytest
import torch

import qwen3layer as q3
from qwen3layer import _C, _testing

FP8 = "fp8_e4m3_block128"
ODD = q3.LayerConfig(hidden_size=200, num_attention_heads=4, num_key_value_heads=2, head_dim=48,
                     num_experts=4, num_experts_per_tok=2, moe_intermediate_size=130)


def ours_e4m3(x: torch.Tensor) -> np.ndarray:
    src = x.to(torch.float32).contiguous().numpy()
    dst = np.zeros(src.size, dtype=np.uint8)
    _testing.f32_to_fp8(src, dst)
    return dst


def torch_e4m3(x: torch.Tensor) -> np.ndarray:
    return x.to(torch.float32).to(torch.float8_e4m3fn).view(torch.uint8).numpy().reshape(-1)


def test_rounding_matches_torch_on_every_code_and_between():
    finite = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).float()
    finite = finite[torch.isfinite(finite)].unique()  # sorted, -448 .. 448
    mid = (finite[1:] + finite[:-1]) / 2  # ties (exact in fp32): to the even code
    above, below = torch.nextafter(mid, torch.tensor(1e9)), torch.nextafter(mid, torch.tensor(-1e9))
    edges = torch.tensor([448.0, 456.0, 463.99997, 464.0, 464.00003, 470.0, 479.99997, 480.0, 480.00003, 500.0,
                          1e30, float("inf"), float("nan"), 0.0, 2.0 ** -6, 2.0 ** -7, 2.0 ** -9, 2.0 ** -10,
                          2.0 ** -10 * 3, 2.0 ** -11, 1e-30, 1e-45, 2.0 ** -126])
    edges = torch.cat([edges, -edges, torch.tensor([-0.0])])
    g = torch.Generator().manual_seed(0)
    normal = torch.randn(200_000, generator=g) * torch.exp2(torch.randint(-14, 10, (200_000,), generator=g).float())
    for x in (finite, mid, above, below, edges, normal):
        assert np.array_equal(ours_e4m3(x), torch_e4m3(x)), x
    # torch saturates: past 448 (inf too) is +-448; NaN stays NaN with its sign
    big = torch.tensor([464.00003, 480.0, 1e30, float("inf"), float("nan")])
    assert ours_e4m3(big).tolist() == [0x7E] * 4 + [0x7F]
    assert ours_e4m3(-big).tolist() == [0xFE] * 4 + [0xFF]


def test_rounding_every_fp32_bit_pattern_in_a_stride():
    # a stride through all 2^32 patterns: every exponent, mantissas of every low bit
    bits = torch.arange(0, 2 ** 32, 65_537, dtype=torch.int64).to(torch.int32)
    x = bits.view(torch.float32)
    ours, theirs = ours_e4m3(x), torch_e4m3(x)
    nan = np.isnan(x.numpy())  # torch keeps a NaN's sign; so do we
    assert np.array_equal(ours[~nan], theirs[~nan]) and np.array_equal(ours[nan] & 0x7F, theirs[nan] & 0x7F)


def blocks(n):
    return (n + 127) // 128


def quantize_like_torch(w: torch.Tensor):
    """[N, K] fp32 -> e4m3 bytes and [ceil(N/128), ceil(K/128)] scale_inv = amax / 448"""
    N, K = w.shape
    s = torch.ones(blocks(N), blocks(K))
    q = torch.zeros(N, K, dtype=torch.uint8)
    for i in range(blocks(N)):
        for j in range(blocks(K)):
            b = w[i * 128:(i + 1) * 128, j * 128:(j + 1) * 128]
            amax = b.abs().max()
            s[i, j] = amax / 448 if amax > 0 else 1.0
            q[i * 128:(i + 1) * 128, j * 128:(j + 1) * 128] = (b / s[i, j]).to(torch.float8_e4m3fn).view(torch.uint8)
    return q, s


def matrices(cfg, dense, fp8):
    """(name, dense fp32 [N, K], fp8 bytes [N, K], scale [nb, kb]) of every FP8 matrix"""
    I = cfg.moe_intermediate_size
    for name in ("q_proj", "k_proj", "v_proj", "o_proj"):
        n = f"self_attn.{name}.weight"
        yield n, torch.from_dlpack(dense[n]), torch.from_dlpack(fp8[n]).view(torch.uint8), \
            torch.from_dlpack(fp8[n + "_scale_inv"])
    gu, gus = torch.from_dlpack(fp8["mlp.experts.gate_up_proj"]).view(torch.uint8), \
        torch.from_dlpack(fp8["mlp.experts.gate_up_proj_scale_inv"])
    dn, dns = torch.from_dlpack(fp8["mlp.experts.down_proj"]).view(torch.uint8), \
        torch.from_dlpack(fp8["mlp.experts.down_proj_scale_inv"])
    gud, dnd = torch.from_dlpack(dense["mlp.experts.gate_up_proj"]), torch.from_dlpack(dense["mlp.experts.down_proj"])
    ib = blocks(I)
    for e in range(cfg.num_experts):
        yield f"gate {e}", gud[e, :I], gu[e, :I], gus[e, :ib]
        yield f"up {e}", gud[e, I:], gu[e, I:], gus[e, ib:]
        yield f"down {e}", dnd[e], dn[e], dns[e]


@pytest.mark.parametrize("cfg", [ODD, q3.LayerConfig.tiny()], ids=["odd", "tiny"])
def test_random_fp8_is_the_quantized_dense_draws(cfg):
    dense = _C.random_weights(cfg, 5, "float32")
    fp8 = _C.random_weights(cfg, 5, "bfloat16", FP8)
    assert fp8["self_attn.q_proj.weight"].dtype == "float8_e4m3fn"
    assert fp8["mlp.experts.gate_up_proj_scale_inv"].shape == (
        cfg.num_experts, 2 * blocks(cfg.moe_intermediate_size), blocks(cfg.hidden_size))
    assert fp8["mlp.experts.down_proj_scale_inv"].shape == (
        cfg.num_experts, blocks(cfg.hidden_size), blocks(cfg.moe_intermediate_size))
    for name in ("input_layernorm.weight", "mlp.gate.weight", "self_attn.q_norm.weight"):
        assert fp8[name].dtype == "bfloat16"
        assert torch.equal(torch.from_dlpack(fp8[name]),
                           torch.from_dlpack(_C.random_weights(cfg, 5, "bfloat16")[name]))
    for name, w, q, s in matrices(cfg, dense, fp8):
        q_ref, s_ref = quantize_like_torch(w)
        # the dense draws may differ from ours in the last fp32 bit (FMA contraction in the
        # ISA-specific fill): scales to 1 ulp, and a byte off by one code at a rounding tie
        torch.testing.assert_close(s, s_ref, rtol=2e-7, atol=0, msg=name)
        diff = (q.int() - q_ref.int()).abs()
        assert diff.max() <= 1 and (diff > 0).float().mean() < 1e-3, name


def test_random_fp8_deterministic_in_seed():
    a, b, c = (_C.random_weights(ODD, s, "float32", FP8) for s in (3, 3, 4))
    for name in a:
        ta, tb, tc = (torch.from_dlpack(t[name]).view(torch.uint8) if t[name].dtype == "float8_e4m3fn"
                      else torch.from_dlpack(t[name]) for t in (a, b, c))
        assert torch.equal(ta, tb), name
        assert not torch.equal(ta, tc), name


def test_random_weights_rejects_a_bad_format():
    with pytest.raises(ValueError, match="weight_format: expected None, 'dense', 'fp8_e4m3_block128' or 'gptq_int4'"):
        _C.random_weights(ODD, 0, "float32", "fp8_e5m2")


def dequant_like_torch(q: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    N, K = q.shape
    return q.view(torch.float8_e4m3fn).float() * s.float().repeat_interleave(128, 0)[:N].repeat_interleave(128, 1)[:, :K]


@pytest.mark.parametrize("scale_dtype", [torch.float32, torch.bfloat16])
def test_dequantize_fp8_matches_torch(scale_dtype):
    fp8 = _C.random_weights(ODD, 2, "float32", FP8)
    w, s = torch.from_dlpack(fp8["self_attn.o_proj.weight"]), torch.from_dlpack(fp8["self_attn.o_proj.weight_scale_inv"])
    s = s.to(scale_dtype)
    assert torch.equal(torch.from_dlpack(_C.dequantize_fp8(w, s)), dequant_like_torch(w.view(torch.uint8), s))
    gu, gus = torch.from_dlpack(fp8["mlp.experts.gate_up_proj"]), torch.from_dlpack(fp8["mlp.experts.gate_up_proj_scale_inv"])
    out = torch.from_dlpack(_C.dequantize_fp8(gu, gus, 2))
    I, ib = ODD.moe_intermediate_size, blocks(ODD.moe_intermediate_size)
    for e in range(ODD.num_experts):
        assert torch.equal(out[e, :I], dequant_like_torch(gu[e, :I].view(torch.uint8), gus[e, :ib]))
        assert torch.equal(out[e, I:], dequant_like_torch(gu[e, I:].view(torch.uint8), gus[e, ib:]))


def test_dequantize_fp8_rejects_bad_input():
    fp8 = _C.random_weights(ODD, 2, "float32", FP8)
    w, s = fp8["mlp.experts.gate_up_proj"], fp8["mlp.experts.gate_up_proj_scale_inv"]
    with pytest.raises(ValueError, match=r"scale_inv: expected the block shape of weight \[4, 260, 200\] in 1 part"):
        _C.dequantize_fp8(w, s)  # 260 rows are 3 blocks as one matrix, 2 + 2 as gate and up
    with pytest.raises(ValueError, match="parts: expected a positive divisor of the weight's rows"):
        _C.dequantize_fp8(w, s, 3)
    with pytest.raises(ValueError, match="expected a contiguous float8_e4m3fn weight"):
        _C.dequantize_fp8(fp8["mlp.gate.weight"], s)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_random_fp8_layer_equals_the_dense_layer_on_its_dequantization(dtype):
    fp8_layer = q3.DecoderLayer.random(ODD, seed=4, dtype=dtype, weight_format=FP8)
    assert fp8_layer.weight_format == FP8 and fp8_layer.dtype == dtype
    fp8 = _C.random_weights(ODD, 4, dtype, FP8)
    dense = {}
    for name, t in fp8.items():
        if name.endswith("_scale_inv"):
            continue
        if t.dtype == "float8_e4m3fn":
            dense[name] = _C.dequantize_fp8(t, fp8[name + "_scale_inv"], 2 if name.endswith("gate_up_proj") else 1)
        else:
            dense[name] = torch.from_dlpack(t).float()
    ref = q3.DecoderLayer(ODD, dense, dtype="float32")
    x = torch.randn(9, ODD.hidden_size, generator=torch.Generator().manual_seed(1))
    y = torch.from_dlpack(fp8_layer.prefill(x.to(getattr(torch, dtype)), fp8_layer.new_cache(9))).float()
    y_ref = torch.from_dlpack(ref.prefill(x.to(getattr(torch, dtype)).float(), ref.new_cache(9)))
    tol = 1e-5 if dtype == "float32" else 3e-2
    torch.testing.assert_close(y, y_ref, rtol=tol, atol=tol)
