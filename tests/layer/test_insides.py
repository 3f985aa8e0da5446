"""The layer's insides on request (prefill/decode with return_router / return_attention):
the router's logits, choices and weights and the attention probabilities, against the
float64 reference and transformers (eager attention), from the call's own passes."""
import numpy as np
import pytest
import torch

import qwen3layer as q3
from hf_reference import GEOMETRIES, converted, draw_input, hf_model, rel_err, run

GEOS = sorted(GEOMETRIES)


def _topk(logits: torch.Tensor, k: int, normalize: bool):
    p = torch.softmax(logits.double(), dim=-1)
    w, idx = torch.topk(p, k, dim=-1)
    return idx, (w / w.sum(-1, keepdim=True) if normalize else w)


@pytest.mark.parametrize("geometry", GEOS)
def test_float32_prefill_in_chunks_then_decode_insides_match_float64(geometry):
    """Two sequences prefilled in chunks of 4 (a call of several passes), then a decode step:
    router logits, the chosen experts and their weights, and the attention maps of every
    row equal the float64 reference's; the output is the one the call gives without insides."""
    model = hf_model(geometry, seed=3)
    cfg = model.config
    H, S, k = cfg.hidden_size, 10, cfg.num_experts_per_tok
    x = draw_input(model, (2, S + 1, H), seed=3)
    exact = run(converted(model, torch.float64), x.double())
    layer = q3.DecoderLayer.from_hf(model.model.layers[0])
    plain = layer.prefill(x[:, :S].contiguous(), layer.new_cache(16, batch=2), chunk_size=4)
    cache = layer.new_cache(16, batch=2)
    t = layer.prefill(x[:, :S].contiguous(), cache, chunk_size=4, return_router=True, return_attention=True)
    assert isinstance(t, q3.LayerTrace) and torch.equal(t.output, plain)
    assert t.router_logits.shape == (2, S, cfg.num_experts) and t.router_logits.dtype == torch.float32
    assert t.experts.shape == (2, S, k) and t.experts.dtype == torch.int32
    assert t.expert_weights.shape == (2, S, k) and t.attention.shape == (2, cfg.num_attention_heads, S, S)

    logits = exact.router_logits.view(2, S + 1, -1)
    idx, w = _topk(logits, k, cfg.norm_topk_prob)
    assert rel_err(t.router_logits, logits[:, :S]) <= 1e-5
    assert torch.equal(t.experts.long(), idx[:, :S])
    assert rel_err(t.expert_weights, w[:, :S]) <= 1e-5
    assert rel_err(t.attention, exact.attention[:, :, :S, :S]) <= 1e-5
    assert float((t.attention - exact.attention[:, :, :S, :S]).abs().max()) <= 1e-5

    d = layer.decode(x[:, S].contiguous(), cache, return_router=True, return_attention=True)
    assert d.router_logits.shape == (2, cfg.num_experts) and d.attention.shape == (2, cfg.num_attention_heads, 1, S + 1)
    assert rel_err(d.router_logits, logits[:, S]) <= 1e-5
    assert torch.equal(d.experts.long(), idx[:, S])
    assert rel_err(d.expert_weights, w[:, S]) <= 1e-5
    assert rel_err(d.attention, exact.attention[:, :, S:]) <= 1e-5


@pytest.mark.parametrize("geometry", ["gqa4_topk_norm", "mha_no_norm"])
def test_float32_insides_match_transformers(geometry):
    """The same against transformers' own float32 layer (its gate's logits, its eager maps)."""
    model = hf_model(geometry, seed=4)
    S = 9
    x = draw_input(model, (1, S, model.config.hidden_size), seed=4)
    ref = run(model, x)
    layer = q3.DecoderLayer.from_hf(model.model.layers[0])
    t = layer.prefill(x[0], layer.new_cache(16), return_router=True, return_attention=True)
    assert rel_err(t.router_logits, ref.router_logits) <= 1e-5
    assert rel_err(t.attention, ref.attention) <= 1e-5
    idx, _ = _topk(ref.router_logits, model.config.num_experts_per_tok, model.config.norm_topk_prob)
    assert torch.equal(t.experts.long(), idx)


def test_bfloat16_insides_within_twice_transformers_error():
    """A bf16 layer's logits and maps make at most twice the error transformers' bf16 layer
    makes against the float64 reference."""
    model = hf_model("gqa4_topk_norm", seed=5)
    S = 12
    x = draw_input(model, (1, S, model.config.hidden_size), seed=5)
    exact = run(converted(model, torch.float64), x.double())
    bf = converted(model, torch.bfloat16)
    theirs = run(bf, x.bfloat16())
    layer = q3.DecoderLayer.from_hf(bf.model.layers[0])
    t = layer.prefill(x[0].bfloat16(), layer.new_cache(16), return_router=True, return_attention=True)
    assert t.router_logits.dtype == torch.float32 and t.attention.dtype == torch.float32
    assert rel_err(t.router_logits, exact.router_logits) <= 2 * rel_err(theirs.router_logits, exact.router_logits)
    assert rel_err(t.attention, exact.attention) <= 2 * rel_err(theirs.attention, exact.attention)


def test_left_padding_and_uneven_lengths_in_the_maps():
    """Sequence 0 starts with 3 padding tokens: its real queries give the padding columns 0
    and equal the unpadded sequence's maps shifted by 3; a padding query sees only itself.
    A decode step over sequences of different lengths: columns past the shorter one are 0."""
    model = hf_model("gqa4_topk_norm", seed=6)
    H, S, pad = model.config.hidden_size, 8, 3
    x = draw_input(model, (1, S, H), seed=6)
    layer = q3.DecoderLayer.from_hf(model.model.layers[0])
    alone = layer.prefill(x[0], layer.new_cache(16), return_attention=True).attention
    cache = layer.new_cache(16, batch=2)
    cache.set_padding(pad, 0)
    xs = torch.cat([torch.randn(1, pad, H), x], 1)
    t = layer.prefill(xs[0], cache, 0, return_attention=True)
    assert t.attention.shape == (1, model.config.num_attention_heads, pad + S, pad + S)
    real = t.attention[0, :, pad:]
    assert float(real[..., :pad].abs().max()) == 0.0
    torch.testing.assert_close(real[..., pad:], alone[0], rtol=1e-5, atol=1e-6)
    assert torch.equal(t.attention[0, :, :pad, :pad], torch.eye(pad).expand(model.config.num_attention_heads, pad, pad))
    layer.prefill(x[0, :4].contiguous(), cache, 1)
    d = layer.decode(torch.randn(2, H), cache, return_attention=True).attention
    assert d.shape == (2, model.config.num_attention_heads, 1, pad + S + 1)
    assert float(d[1, ..., 5:].abs().max()) == 0.0 and float(d[1, ..., :5].min()) > 0.0
    torch.testing.assert_close(d.sum(-1), torch.ones(2, model.config.num_attention_heads, 1))


def test_insides_as_the_input_kind_and_with_out():
    cfg = q3.LayerConfig(64, 4, 2, 16, 8, 2, 32)
    layer = q3.DecoderLayer.random(cfg, seed=1, dtype="float32")
    x = np.random.default_rng(0).standard_normal((5, 64), dtype=np.float32)
    t = layer.prefill(x, layer.new_cache(8), return_router=True)
    assert isinstance(t.output, np.ndarray) and isinstance(t.experts, np.ndarray) and t.attention is None
    assert t.experts.dtype == np.int32 and t.experts.shape == (5, 2)
    assert ((t.experts >= 0) & (t.experts < 8)).all()
    out = np.empty_like(x)
    t2 = layer.prefill(x, layer.new_cache(8), out=out, return_attention=True)
    assert t2.output is out and np.array_equal(out, t.output) and t2.router_logits is None
    np.testing.assert_allclose(t2.attention.sum(-1), 1.0, rtol=1e-6)
    assert layer.prefill(x, layer.new_cache(8), return_router=False).shape == (5, 64)  # the output alone


def test_attention_limit_refuses_before_anything_runs():
    cfg = q3.LayerConfig(64, 4, 2, 16, 8, 2, 32)
    layer = q3.DecoderLayer.random(cfg, seed=1, dtype="float32")
    cache = layer.new_cache(64)
    layer.prefill(torch.randn(10, 64), cache)
    with pytest.raises(ValueError, match=r"attention maps \[1, 4, 6, 16\] .* would take 1536 bytes, above "
                                         r"attention_limit=1000 bytes"):
        layer.prefill(torch.randn(6, 64), cache, return_attention=True, attention_limit=1000)
    assert cache.lengths == (10,)  # nothing ran
    t = layer.prefill(torch.randn(6, 64), cache, return_attention=True, attention_limit=1536)
    assert t.attention.shape == (1, 4, 6, 16) and cache.lengths == (16,)
    with pytest.raises(ValueError, match="attention_limit: only with return_attention=True"):
        layer.decode(torch.randn(1, 64), cache, attention_limit=10)
    with pytest.raises(ValueError, match=r"attention_limit: expected a number of bytes >= 0 or None, got -1"):
        layer.decode(torch.randn(1, 64), cache, return_attention=True, attention_limit=-1)
    with pytest.raises(TypeError, match="attention_limit: expected an int or None, got str"):
        layer.decode(torch.randn(1, 64), cache, return_attention=True, attention_limit="big")
    assert cache.lengths == (16,)


def test_a_failed_call_with_insides_changes_nothing():
    cfg = q3.LayerConfig(64, 4, 2, 16, 8, 2, 32)
    layer = q3.DecoderLayer.random(cfg, seed=1, dtype="float32")
    cache = layer.new_cache(8)
    layer.prefill(torch.randn(6, 64), cache)
    with pytest.raises(q3.CacheFullError):
        layer.prefill(torch.randn(3, 64), cache, return_router=True, return_attention=True)
    assert cache.lengths == (6,)
