"""Every rejected input raises an exception naming the argument, the expected and the
received value, and leaves the cache exactly as it was."""
import numpy as np
import pytest
import torch

import qwen3layer as q3
from hf_reference import hf_model

CFG = q3.LayerConfig.tiny()
H = CFG.hidden_size


@pytest.fixture(scope="module")
def layer():
    return q3.DecoderLayer.random(CFG, seed=5, dtype="float32")


@pytest.fixture
def cache(layer):
    c = layer.new_cache(16, batch=2)
    layer.prefill(torch.randn(2, 5, H), c)
    layer.decode(torch.randn(2, H), c)
    return c


def snapshot(c):
    return c.lengths, [(torch.from_dlpack(c.keys(b)).clone(), torch.from_dlpack(c.values(b)).clone())
                       for b in range(c.batch)]


def assert_unchanged(c, before):
    lengths, kv = snapshot(c)
    assert lengths == before[0]
    for (k, v), (k0, v0) in zip(kv, before[1]):
        assert torch.equal(k, k0) and torch.equal(v, v0)


class OnGpu:
    """A tensor that says it lives on cuda:0."""

    def __dlpack_device__(self):
        return (2, 0)

    def __dlpack__(self, **kw):
        raise AssertionError("must not be exported: the device check comes first")


CALL_ERRORS = [
    # (description, call, exception, message fragment)
    ("wrong hidden size", lambda l, c: l.prefill(torch.randn(3, H + 1), c), ValueError,
     r"x: expected shape \[tokens, hidden=64\], got \[3, 65\]"),
    ("rank 1", lambda l, c: l.prefill(torch.randn(H), c), ValueError, r"x: expected shape .*got \[64\]"),
    ("rank 4", lambda l, c: l.prefill(torch.randn(2, 1, 3, H), c), ValueError, r"got \[2, 1, 3, 64\]"),
    ("zero tokens", lambda l, c: l.prefill(torch.randn(0, H), c), ValueError, "at least 1 token, got 0"),
    ("float64", lambda l, c: l.prefill(torch.randn(3, H, dtype=torch.float64), c), TypeError,
     "x: expected dtype float32, bfloat16 or float16, got float64"),
    ("float8", lambda l, c: l.prefill(torch.randn(3, H).to(torch.float8_e4m3fn), c), TypeError, "got float8_e4m3fn"),
    ("int32", lambda l, c: l.prefill(torch.ones(3, H, dtype=torch.int32), c), TypeError, "got int32"),
    ("numpy float64", lambda l, c: l.prefill(np.zeros((3, H)), c), TypeError, "got float64"),
    ("wrong device", lambda l, c: l.prefill(OnGpu(), c), ValueError, "expected a tensor on device cpu, got cuda:0"),
    # a torch tensor elsewhere is refused by the layer before torch exports it (or is asked for a stream)
    ("torch tensor on meta", lambda l, c: l.prefill(torch.empty(2, H, device="meta"), c), ValueError,
     r"^x: expected a tensor on cpu \(the layer's device\), got a torch tensor on meta$"),
    ("out on meta", lambda l, c: l.decode(torch.randn(2, H), c, out=torch.empty(2, H, device="meta")), ValueError,
     r"^out: expected a tensor on cpu \(the layer's device\), got a torch tensor on meta$"),
    ("expert ids on meta", lambda l, c: l.expert_half(torch.randn(2, H), torch.zeros(2, 2, dtype=torch.int32,
                                                                                    device="meta"), torch.ones(2, 2)),
     ValueError, r"^experts: expected a tensor on cpu \(the layer's device\), got a torch tensor on meta$"),
    ("non-contiguous", lambda l, c: l.prefill(torch.randn(H, 3).t(), c), ValueError,
     r"x: expected a contiguous tensor, got strides \[1, 3\]"),
    ("decode batch != cache batch", lambda l, c: l.decode(torch.randn(1, H), c), ValueError,
     r"x: expected shape \[batch=2, hidden=64\], got \[1, 64\]"),
    ("decode 3-d", lambda l, c: l.decode(torch.randn(2, 1, H), c), ValueError, r"\[batch=2, hidden=64\]"),
    ("prefill batch != cache batch", lambda l, c: l.prefill(torch.randn(3, 2, H), c), ValueError,
     r"\[batch=2, tokens, hidden=64\]"),
    ("seq out of range", lambda l, c: l.prefill(torch.randn(2, H), c, seq=2), IndexError,
     r"seq: expected 0 <= seq < 2 \(the cache's batch\), got 2"),
    ("negative seq", lambda l, c: l.prefill(torch.randn(2, H), c, seq=-1), IndexError, "got -1"),
    ("seq past a C int", lambda l, c: l.prefill(torch.randn(2, H), c, seq=1 << 40), IndexError,
     r"seq: expected 0 <= seq < 2 \(the cache's batch\), got 1099511627776"),
    ("seq past int64", lambda l, c: l.prefill(torch.randn(2, H), c, seq=-(1 << 70)), IndexError,
     "got -1180591620717411303424"),
    ("seq a bool", lambda l, c: l.prefill(torch.randn(2, H), c, seq=True), TypeError, "seq: expected an int, got bool"),
    ("seq not an int", lambda l, c: l.prefill(torch.randn(2, H), c, seq="0"), TypeError, "seq: expected an int, got str"),
    ("seq with batched x", lambda l, c: l.prefill(torch.randn(2, 2, H), c, seq=0), ValueError, "seq: expected None"),
    ("overflow", lambda l, c: l.prefill(torch.randn(11, H), c, seq=1), q3.CacheFullError,
     "sequence 1 holds 6 of 16 tokens: 11 more do not fit"),
    ("batched overflow", lambda l, c: l.prefill(torch.randn(2, 11, H), c, chunk_size=2), q3.CacheFullError,
     "sequence 0 holds 6 of 16 tokens"),
    ("not a tensor", lambda l, c: l.prefill([[0.0] * H], c), TypeError,
     r"x: expected a tensor with __dlpack__ .*got list"),
    ("cache not a KVCache", lambda l, c: l.prefill(torch.randn(2, H), "cache"), TypeError,
     "cache: expected a qwen3layer KVCache"),
    ("chunk_size 0", lambda l, c: l.prefill(torch.randn(2, H), c, chunk_size=0), ValueError,
     "chunk_size: expected a positive int or None, got 0"),
    ("out wrong shape", lambda l, c: l.prefill(torch.randn(2, H), c, out=torch.empty(3, H)), ValueError,
     r"out: expected shape \[2, 64\], got \[3, 64\]"),
    ("out wrong dtype", lambda l, c: l.prefill(torch.randn(2, H), c, out=torch.empty(2, H).bfloat16()), TypeError,
     "out: expected dtype float32"),
    ("out non-contiguous", lambda l, c: l.prefill(torch.randn(2, H), c, out=torch.empty(H, 2).t()), ValueError,
     "out: expected a contiguous tensor"),
]


@pytest.mark.parametrize("what,call,exc,msg", CALL_ERRORS, ids=[e[0] for e in CALL_ERRORS])
def test_rejected_call_leaves_cache_unchanged(layer, cache, what, call, exc, msg):
    before = snapshot(cache)
    with pytest.raises(exc, match=msg):
        call(layer, cache)
    assert_unchanged(cache, before)


def test_cache_of_another_geometry_is_rejected(layer, cache):
    other = q3.DecoderLayer.random(q3.LayerConfig(hidden_size=64, num_attention_heads=4, num_key_value_heads=4,
                                                  head_dim=16, num_experts=4, num_experts_per_tok=2,
                                                  moe_intermediate_size=16), dtype="float32")
    before = snapshot(cache)
    with pytest.raises(ValueError, match=r"cache: expected 4 KV heads of dim 16 \(this layer.s\), got 2 of dim 16"):
        other.prefill(torch.randn(2, H), cache)
    assert_unchanged(cache, before)


def test_cache_methods_reject_bad_arguments(cache):
    before = snapshot(cache)
    with pytest.raises(ValueError, match=r"n: expected 0 <= n <= 6 \(the length of sequence 0\), got 7"):
        cache.truncate(7)
    with pytest.raises(ValueError, match="got -1"):
        cache.truncate(-1)
    with pytest.raises(IndexError, match="seq: expected 0 <= seq < 2"):
        cache.truncate(1, seq=2)
    with pytest.raises(IndexError, match="got -1"):
        cache.reset(seq=-1)
    with pytest.raises(IndexError, match="got 5"):
        cache.keys(5)
    with pytest.raises(TypeError, match="seq: expected an int or None, got float"):
        cache.reset(seq=1.0)
    assert_unchanged(cache, before)
    with pytest.raises(TypeError):
        q3.KVCache()


def test_new_cache_rejects_bad_sizes(layer):
    with pytest.raises(ValueError, match="max_tokens: expected a positive integer, got 0"):
        layer.new_cache(0)
    with pytest.raises(ValueError, match="batch: expected a positive integer, got 0"):
        layer.new_cache(8, batch=0)
    with pytest.raises(TypeError, match="dtype: expected 'float32', 'bfloat16' or 'float16', got 'int8'"):
        layer.new_cache(8, dtype="int8")


# ---- construction ------------------------------------------------------------------------

@pytest.fixture(scope="module")
def hf_weights():
    hf_layer = hf_model("gqa4_topk_norm").model.layers[0]
    return q3.LayerConfig.from_hf(hf_layer.self_attn.config), {
        k: v.detach() for k, v in hf_layer.state_dict().items()}


def test_missing_weight(hf_weights):
    cfg, w = hf_weights
    w = dict(w)
    del w["mlp.gate.weight"]
    with pytest.raises(ValueError, match="weights: missing 'mlp.gate.weight'"):
        q3.DecoderLayer(cfg, w)


def test_extra_weight(hf_weights):
    cfg, w = hf_weights
    with pytest.raises(ValueError, match="weights: unexpected 'self_attn.rotary.inv_freq'"):
        q3.DecoderLayer(cfg, w | {"self_attn.rotary.inv_freq": torch.ones(4)})


def test_misnamed_weight(hf_weights):
    cfg, w = hf_weights
    w = dict(w)
    w["self_attn.q_proj.weigth"] = w.pop("self_attn.q_proj.weight")
    with pytest.raises(ValueError, match=r"unexpected 'self_attn.q_proj.weigth' \(did you mean 'self_attn.q_proj.weight'\?\)"):
        q3.DecoderLayer(cfg, w)


def test_misshaped_weight(hf_weights):
    cfg, w = hf_weights
    bad = w | {"self_attn.k_proj.weight": w["self_attn.k_proj.weight"].t().contiguous()}
    with pytest.raises(ValueError, match=r"weights\['self_attn.k_proj.weight'\]: expected shape \[48, 64\], got \[64, 48\]"):
        q3.DecoderLayer(cfg, bad)
    bad = w | {"mlp.experts.down_proj": w["mlp.experts.down_proj"][:-1]}
    with pytest.raises(ValueError, match=r"expected shape \[8, 64, 32\], got \[7, 64, 32\]"):
        q3.DecoderLayer(cfg, bad)


def test_weight_of_unsupported_dtype(hf_weights):
    cfg, w = hf_weights
    with pytest.raises(TypeError, match=r"weights\['mlp.gate.weight'\]: expected dtype float32, bfloat16 or float16, got float64"):
        q3.DecoderLayer(cfg, w | {"mlp.gate.weight": w["mlp.gate.weight"].double()})


def test_weight_that_is_not_a_tensor(hf_weights):
    cfg, w = hf_weights
    with pytest.raises(TypeError, match=r"weights\['input_layernorm.weight'\]: expected a tensor .*got list"):
        q3.DecoderLayer(cfg, w | {"input_layernorm.weight": [1.0] * 64})


def test_weights_of_two_layers_or_two_expert_spellings(hf_weights):
    cfg, w = hf_weights
    mixed = {f"model.layers.{i % 2}.{k}": v for i, (k, v) in enumerate(w.items())}
    with pytest.raises(ValueError, match=r"expected the tensors of one layer, got layers \[0, 1\]"):
        q3.DecoderLayer(cfg, mixed)
    both = w | {"mlp.experts.0.gate_proj.weight": torch.zeros(32, 64)}
    with pytest.raises(ValueError, match="either fused .* or per expert"):
        q3.DecoderLayer(cfg, both)


def test_unsupported_device_and_dtype(hf_weights):
    cfg, w = hf_weights
    with pytest.raises(ValueError, match=r"device: .*'cuda'"):
        q3.DecoderLayer(cfg, w, device="cuda")
    with pytest.raises(TypeError, match="dtype: expected 'float32', 'bfloat16' or 'float16', got 'int8'"):
        q3.DecoderLayer(cfg, w, dtype="int8")


BAD_CONFIGS = [
    (dict(head_dim=15), "head_dim: expected an even number .*got 15"),
    (dict(num_attention_heads=6, num_key_value_heads=4), "num_attention_heads: expected a multiple of num_key_value_heads \\(4\\), got 6"),
    (dict(num_experts_per_tok=9), "num_experts_per_tok: expected at most num_experts \\(8\\), got 9"),
    (dict(hidden_size=0), "hidden_size: expected a positive integer, got 0"),
    (dict(rms_norm_eps=0.0), "rms_norm_eps: expected a positive number"),
]


@pytest.mark.parametrize("change,msg", BAD_CONFIGS)
def test_impossible_config(change, msg):
    base = dict(hidden_size=64, num_attention_heads=8, num_key_value_heads=2, head_dim=16, num_experts=8,
                num_experts_per_tok=2, moe_intermediate_size=32)
    with pytest.raises(ValueError, match=msg):
        q3.LayerConfig(**(base | change))


def test_config_field_of_wrong_type():
    with pytest.raises(TypeError, match="config.head_dim: expected an int, got float"):
        q3.LayerConfig(hidden_size=64, num_attention_heads=8, num_key_value_heads=2, head_dim=16.0,
                       num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32)


def test_hf_config_with_rope_parameters_not_a_mapping():
    fields = dict(hidden_size=64, num_attention_heads=8, num_key_value_heads=2, head_dim=16, num_experts=8,
                  num_experts_per_tok=2, moe_intermediate_size=32, rope_parameters=[1e6])
    with pytest.raises(ValueError, match="config.rope_parameters: expected a mapping, got list"):
        q3.LayerConfig.from_hf(fields)
    with pytest.raises(ValueError, match=r"config.hidden_size: expected at most 1048576, got 1267650600228229401496703205376"):
        q3.LayerConfig.from_hf(dict(fields, rope_parameters=None, hidden_size=2**100))
