"""A patched model's C caches grow as transformers' DynamicCache does: a generation starts
with a cache of its prompt's size (at least qwen3layer.torch.cache.FIRST_CAPACITY tokens, a power of two)
and doubles it when a call needs more (KVCache.grow: the tokens held copied once a growth),
up to the model's context (max_position_embeddings, or the YaRN-scaled one) or
patch_model(max_tokens=) below it; past that, and past a StaticCache's max_cache_len,
CacheFullError naming what set the limit, before any work. Generations past each growth give
transformers' tokens."""
import pytest
import torch
from transformers import StaticCache

import qwen3layer as q3
import qwen3layer.torch as q3t
from qwen3layer.torch import cache as torch_cache
from hf_reference import left_padded, tiny_model


def prompt(n, seed=0, batch=1):
    return torch.randint(1, 101, (batch, n), generator=torch.Generator().manual_seed(seed))


def greedy(model, ids, new, **kw):
    return model.generate(ids, max_new_tokens=new, min_new_tokens=new, do_sample=False, pad_token_id=0, **kw)


def patched_caches(model):
    return [layer.kv_cache for layer in model.model.layers]


def test_a_generation_past_4096_tokens_gives_transformers_tokens_with_one_growth():
    model = tiny_model(11, max_position_embeddings=8192, attn_implementation="sdpa")
    ids = prompt(4000, seed=1)
    ref = greedy(model, ids, 120)
    q3t.patch_model(model)
    out = greedy(model, ids, 120)
    assert out.shape[-1] == 4120
    assert torch.equal(out, ref)
    # 4000 tokens start a cache of 4096; the 4097th doubles it, once for each layer
    assert [(kv.capacity, kv.growths) for kv in patched_caches(model)] == [(8192, 1)] * 2


@pytest.mark.parametrize("beams", [1, 3])
def test_doubling_from_a_small_first_cache_gives_transformers_tokens(monkeypatch, beams):
    monkeypatch.setattr(torch_cache, "FIRST_CAPACITY", 16)
    model = tiny_model(12)
    ids, mask = left_padded([10, 6], 10, seed=2)
    ref = greedy(model, ids, 60, attention_mask=mask, num_beams=beams)
    q3t.patch_model(model)
    out = greedy(model, ids, 60, attention_mask=mask, num_beams=beams)
    assert torch.equal(out, ref)
    # 10 + 60 tokens: 16 -> 32 -> 64 -> 128 (beam search's caches are new ones of the beams,
    # made by repeat_interleave at the first capacity, then grown alike)
    assert [(kv.capacity, kv.growths) for kv in patched_caches(model)] == [(128, 3)] * 2


def test_the_cap_of_patch_model_is_named_when_a_generation_reaches_it():
    model = q3t.patch_model(tiny_model(13), max_tokens=40)
    with pytest.raises(q3.CacheFullError) as e:
        greedy(model, prompt(10, seed=3), 50)
    assert str(e.value) == ("the sequences would hold 41 tokens, past patch_model(max_tokens=40) (below the model's "
                            "context of 512 positions (max_position_embeddings=512))")
    # up to the cap, it generates transformers' tokens
    ref = greedy(tiny_model(13), prompt(10, seed=3), 30)
    assert torch.equal(greedy(model, prompt(10, seed=3), 30), ref)


def test_the_models_context_is_the_limit_without_a_cap():
    model = q3t.patch_model(tiny_model(14, max_position_embeddings=48))
    with pytest.raises(q3.CacheFullError) as e:
        greedy(model, prompt(10, seed=4), 50)
    assert str(e.value) == ("the sequences would hold 49 tokens, past the model's context of 48 positions "
                            "(max_position_embeddings=48)")
    with pytest.raises(q3.CacheFullError, match="the sequences would hold 60 tokens, past the model's context"), \
            torch.no_grad():
        model(prompt(60, seed=5), use_cache=True)


@pytest.mark.filterwarnings("ignore:.past_key_values. is deprecated:FutureWarning")  # 5.x's new name: `cache`
def test_a_static_cache_keeps_its_length_and_names_it_when_full():
    model = q3t.patch_model(tiny_model(15))
    cache = StaticCache(config=model.config, max_cache_len=20)
    ids = prompt(25, seed=6)
    with torch.no_grad():
        model(ids[:, :15], past_key_values=cache, use_cache=True)
        assert [kv.capacity for kv in patched_caches(model)] == [20, 20]
        with pytest.raises(q3.CacheFullError) as e:
            model(ids[:, 15:], past_key_values=cache, use_cache=True)
    assert str(e.value).startswith("StaticCache: max_cache_len=20 tokens a sequence, and this call brings them to 25")
    assert [(kv.lengths, kv.growths) for kv in patched_caches(model)] == [((15,), 0)] * 2


@pytest.mark.parametrize("bad", [0, -5, 2.5, True, "64"])
def test_max_tokens_must_be_a_positive_int(bad):
    with pytest.raises(ValueError, match=f"max_tokens: expected a positive int or None .*, got {bad!r}"):
        q3t.patch_model(tiny_model(16), max_tokens=bad)


def test_the_context_of_a_yarn_config_is_its_scaled_one():
    base = dict(hidden_size=64, num_attention_heads=8, num_key_value_heads=2, head_dim=16, num_experts=8,
                num_experts_per_tok=2, moe_intermediate_size=32, max_position_embeddings=40960)
    assert q3.LayerConfig(**base).context_length == 40960
    assert q3.LayerConfig(**base, rope_type="yarn", rope_factor=4.0,
                          rope_original_max_position_embeddings=32768).context_length == 131072
    assert q3.LayerConfig(**base, rope_type="yarn", rope_factor=2.0).context_length == 81920
    assert q3.LayerConfig(**base, rope_type="linear", rope_factor=4.0).context_length == 40960
