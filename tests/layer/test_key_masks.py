"""Key masks and explicit positions in the C attention (issue 42): a call's token_mask hides
tokens from every later query (right padding, holes), the cache keeps the flags, and
positions place each token's RoPE. Against transformers' Qwen3MoeDecoderLayer under the
equivalent 4D mask and position_ids, in float64, with normal(0, 0.15) attention weights so
that a wrong mask shows far outside the tolerance; on the portable path and this CPU's best."""
import pytest
import torch

import qwen3layer as q3
from hf_reference import converted, rel_err, sharp_attention_model
from qwen3layer.testing.runs import run_hf_layer

from test_parity_hf import cpu_path  # noqa: F401  (autouse: the portable path and this CPU's best)


@pytest.fixture(scope="module")
def model():
    return sharp_attention_model()


def reference(model, x, allowed, positions, cache=None, start=0):
    ref = converted(model, torch.float64)
    return run_hf_layer(ref.model.layers[0], ref.model.rotary_emb, x.double(), ref.config, cache, start,
                        allowed=allowed, positions=positions), ref


def seen_rows(allowed):
    """[B, S] the queries that see at least one key (a query with none is not compared:
    transformers spreads it over every key, the C layer has it see itself)"""
    return allowed.any(-1)


MASKS = {  # per sequence of 10 tokens: False hides a token
    "holes": [[1, 1, 0, 1, 1, 1, 0, 0, 1, 1], [1, 1, 1, 1, 1, 1, 1, 1, 1, 1]],
    "right_padding": [[1, 1, 1, 1, 1, 1, 0, 0, 0, 0], [1, 1, 1, 1, 1, 1, 1, 1, 1, 0]],
    "hidden_first": [[0, 0, 1, 1, 1, 0, 1, 1, 1, 1], [0, 1, 1, 1, 1, 1, 1, 1, 1, 1]],
}


@pytest.mark.parametrize("chunk", [None, 3])
@pytest.mark.parametrize("kind", sorted(MASKS))
def test_a_prefill_with_hidden_tokens_matches_transformers(model, kind, chunk):
    tm = torch.tensor(MASKS[kind], dtype=torch.bool)
    B, S, H = *tm.shape, model.config.hidden_size
    x = torch.randn(B, S, H, generator=torch.Generator().manual_seed(5))
    pos = torch.arange(S).expand(B, S).contiguous()  # holes keep their positions (a plain forward's)
    allowed = torch.ones(S, S, dtype=torch.bool).tril()[None] & tm[:, None, :]
    ref, _ = reference(model, x, allowed, pos)
    causal, _ = reference(model, x, torch.ones(S, S, dtype=torch.bool).tril()[None].expand(B, S, S), pos)
    layer = q3.DecoderLayer.from_hf(model.model.layers[0])
    cache = layer.new_cache(16, batch=B)
    y = layer.prefill(x, cache, chunk_size=chunk, token_mask=tm, positions=pos)
    rows = seen_rows(allowed)
    assert rel_err(y[rows], ref.y[rows]) <= 1e-5
    assert rel_err(ref.y[rows], causal.y[rows]) > 1e-2  # the mask matters at this scale
    assert rel_err(torch.from_dlpack(cache.all_keys()), ref.keys) <= 1e-5
    assert cache.hidden == tuple(tuple(int(i) for i in (~m).nonzero()) for m in tm)


def test_right_padded_prompts_continued_by_decode_match_transformers(model):
    """generate's case: right-padded prompts (positions from the mask's cumsum, padding at 1),
    then decode steps whose positions run on from each prompt's real tokens; transformers
    keeps masking the padding it cached"""
    prompt = torch.tensor([[1, 1, 1, 1, 0, 0, 0], [1, 1, 1, 1, 1, 1, 1], [1, 1, 0, 1, 1, 0, 0]], dtype=torch.bool)
    B, S, H = *prompt.shape, model.config.hidden_size
    g = torch.Generator().manual_seed(6)
    x = torch.randn(B, S, H, generator=g)
    pos = (prompt.long().cumsum(-1) - 1).masked_fill(~prompt, 1)
    allowed = torch.ones(S, S, dtype=torch.bool).tril()[None] & prompt[:, None, :]
    ref, hf = reference(model, x, allowed, pos)
    layer = q3.DecoderLayer.from_hf(model.model.layers[0])
    cache = layer.new_cache(16, batch=B)
    y = layer.prefill(x, cache, token_mask=prompt, positions=pos)
    assert rel_err(y[prompt], ref.y[prompt]) <= 1e-5
    from transformers.cache_utils import DynamicCache
    hf_cache = DynamicCache(config=hf.config)
    run_hf_layer(hf.model.layers[0], hf.model.rotary_emb, x.double(), hf.config, hf_cache, 0, allowed=allowed,
                 positions=pos)
    keys_mask, next_pos = prompt, prompt.sum(-1)
    for step in range(4):
        xt = torch.randn(B, H, generator=g)
        keys_mask = torch.cat([keys_mask, torch.ones(B, 1, dtype=torch.bool)], dim=1)
        want = run_hf_layer(hf.model.layers[0], hf.model.rotary_emb, xt[:, None].double(), hf.config, hf_cache,
                            S + step, allowed=keys_mask[:, None, :], positions=next_pos[:, None])
        got = layer.decode(xt, cache, positions=next_pos.clone())
        assert rel_err(got, want.y[:, 0]) <= 1e-5, step
        next_pos = next_pos + 1
    assert cache.hidden == ((4, 5, 6), (), (2, 5, 6))


def holes(model, seed):
    """MASKS["holes"] over random x: (token mask, x, positions, allowed keys, float64 reference)"""
    tm = torch.tensor(MASKS["holes"], dtype=torch.bool)
    B, S, H = *tm.shape, model.config.hidden_size
    x = torch.randn(B, S, H, generator=torch.Generator().manual_seed(seed))
    pos = torch.arange(S).expand(B, S).contiguous()
    allowed = torch.ones(S, S, dtype=torch.bool).tril()[None] & tm[:, None, :]
    return tm, x, pos, allowed, reference(model, x, allowed, pos)[0]


def test_the_attention_maps_under_a_token_mask_match_eager_attention(model):
    tm, x, pos, allowed, ref = holes(model, seed=7)
    B = tm.shape[0]
    layer = q3.DecoderLayer.from_hf(model.model.layers[0])
    trace = layer.prefill(x, layer.new_cache(16, batch=B), chunk_size=4, token_mask=tm, positions=pos,
                          return_attention=True)
    maps = trace.attention  # [B, heads, S, S]
    assert torch.all(maps.masked_select(~allowed[:, None]) == 0)  # no weight on a hidden or future key
    rows = seen_rows(allowed)[:, None, :, None].expand_as(maps)
    assert rel_err(maps[rows], ref.attention[rows].float()) <= 1e-5


def test_a_bfloat16_layer_with_hidden_tokens_is_within_twice_transformers_error(model):
    tm, x, pos, allowed, ref = holes(model, seed=8)
    B = tm.shape[0]
    hf16 = converted(model, torch.bfloat16)
    theirs = run_hf_layer(hf16.model.layers[0], hf16.model.rotary_emb, x.bfloat16(), hf16.config,
                          allowed=allowed, positions=pos)
    layer = q3.DecoderLayer.from_hf(hf16.model.layers[0])
    y = layer.prefill(x.bfloat16(), layer.new_cache(16, batch=B, dtype="bfloat16"), token_mask=tm, positions=pos)
    assert rel_err(y.double(), ref.y) <= 2 * rel_err(theirs.y.double(), ref.y)


def test_without_positions_a_call_counts_the_hidden_tokens_as_rows(model):
    """the cache's rule (first position + row - padding) takes no notice of hidden tokens:
    a decode step without positions is the step with position = the sequence's length"""
    layer = q3.DecoderLayer.from_hf(model.model.layers[0])
    tm = torch.tensor(MASKS["right_padding"], dtype=torch.bool)
    x = torch.randn(2, 10, model.config.hidden_size, generator=torch.Generator().manual_seed(9))
    a, b = layer.new_cache(16, batch=2), layer.new_cache(16, batch=2)
    for c in (a, b):
        layer.prefill(x, c, token_mask=tm)
    xt = x[:, 0].contiguous()
    assert torch.equal(layer.decode(xt, a), layer.decode(xt, b, positions=torch.tensor([10, 10])))
    assert not torch.equal(layer.decode(xt, a), layer.decode(xt, b, positions=torch.tensor([6, 9])))


@pytest.mark.parametrize("kw, error, message", [
    (dict(token_mask=torch.ones(2, 5)), TypeError, "token_mask: expected dtype bool or uint8, got float32"),
    (dict(token_mask=torch.ones(2, 4, dtype=torch.bool)), ValueError, "token_mask: expected shape [2, 5], got [2, 4]"),
    (dict(token_mask=torch.ones(5, 2, dtype=torch.bool).t()), ValueError, "token_mask: expected a contiguous tensor"),
    (dict(positions=torch.zeros(2, 5, dtype=torch.int32)), TypeError, "positions: expected dtype int64, got int32"),
    (dict(positions=torch.full((2, 5), -1)), ValueError,
     "positions[0, 0]: expected 0 <= position < 2^40, got -1"),
    (dict(positions=torch.tensor([[0, 1, 2, 3, 4], [0, 1, 2, 3, 1 << 40]])), ValueError,
     "positions[1, 4]: expected 0 <= position < 2^40, got 1099511627776"),
])
def test_token_inputs_are_checked_before_any_work(model, kw, error, message):
    layer = q3.DecoderLayer.from_hf(model.model.layers[0])
    cache = layer.new_cache(16, batch=2)
    with pytest.raises(error, match=message.replace("[", r"\[").replace("]", r"\]").replace("^", r"\^")):
        layer.prefill(torch.randn(2, 5, model.config.hidden_size), cache, **kw)
    assert cache.lengths == (0, 0) and cache.hidden == ((), ())
