"""KVCache.grow (csrc/engine/cache_ops.c's q3_cache_grow; a view holds a reference to the
blocks it reads, csrc/engine/cache.c's q3_cache_blocks_ref): every sequence's room grows, what
each sequence holds (tokens, lengths, padding, first positions) moves with it, decoding on
afterwards gives the bits a
cache made that large from the start gives, and views taken before the growth keep reading
the memory they were taken of, however long they outlive it or the cache. Its rejections are
in test_cache_ops.py's table."""
import gc

import pytest
import torch

import qwen3layer as q3
from test_cache_ops import (CFG, H, assert_same, decode_steps, filled, prompts, state, x_of)

LENGTHS, PADS, FIRSTS = [3, 7, 0, 5], [1, 0, 0, 2], [0, 4, 0, 9]


@pytest.fixture(scope="module", params=["float32", "bfloat16", "float16"])
def layer(request):
    return q3.DecoderLayer.random(CFG, seed=5, dtype=request.param)


def test_grow_keeps_every_sequence_and_counts(layer):
    cache = filled(layer, prompts(LENGTHS), PADS, capacity=8, firsts=FIRSTS)
    before, nbytes = state(cache), cache.nbytes
    assert cache.growths == 0
    cache.grow(20)
    assert (cache.capacity, cache.growths, cache.nbytes) == (20, 1, nbytes * 20 // 8)
    assert_same(state(cache), before)
    cache.grow(20)  # already that large: nothing moves, nothing counted
    assert cache.growths == 1
    # positions past a sequence's length read zeros in the new memory (all_keys' contract)
    keys = torch.from_dlpack(cache.all_keys(20))
    assert not keys[0, :, 3:].any() and not keys[2].any()


def test_decoding_past_the_old_capacity_equals_a_cache_that_large_from_the_start(layer):
    xs = prompts(LENGTHS)
    grown = filled(layer, xs, PADS, capacity=8, firsts=FIRSTS)
    large = filled(layer, xs, PADS, capacity=64, firsts=FIRSTS)
    grown.grow(16)
    ys_grown = decode_steps(layer, grown, steps=6)  # sequence 1 goes from 7 to 13 tokens
    grown.grow(40)
    ys_grown += decode_steps(layer, grown, steps=5, seed=200)
    ys_large = decode_steps(layer, large, steps=6) + decode_steps(layer, large, steps=5, seed=200)
    for a, b in zip(ys_grown, ys_large):
        assert torch.equal(a, b)
    assert_same(state(grown), state(large))
    assert grown.growths == 2 and grown.lengths == (14, 18, 11, 16)


def test_a_full_cache_refuses_then_takes_the_tokens_once_grown(layer):
    cache = filled(layer, prompts([6]), capacity=8)
    x = x_of(4, H, seed=3)
    with pytest.raises(q3.CacheFullError):
        layer.prefill(x, cache)
    assert cache.lengths == (6,)
    cache.grow(10)
    y = layer.prefill(x, cache)
    ref_cache = filled(layer, prompts([6]), capacity=10)
    assert torch.equal(y, layer.prefill(x, ref_cache))


def test_views_taken_before_a_growth_keep_the_old_memory(layer):
    cache = filled(layer, prompts(LENGTHS), PADS, capacity=8, firsts=FIRSTS)
    old_keys = torch.from_dlpack(cache.keys(1))
    old_all = torch.from_dlpack(cache.all_values(7))
    saved_keys, saved_all = old_keys.clone(), old_all.clone()
    cache.grow(32)
    new_keys = torch.from_dlpack(cache.keys(1))
    assert new_keys.data_ptr() != old_keys.data_ptr()
    assert torch.equal(new_keys, saved_keys)
    decode_steps(layer, cache, steps=2)  # writes go to the new memory only
    del cache
    gc.collect()
    # the cache is gone; the old views still own what they read (a freed block would read
    # garbage or fault here, and the sanitized suite would report it)
    assert torch.equal(old_keys, saved_keys) and torch.equal(old_all, saved_all)


def test_a_view_taken_after_a_growth_keeps_the_cache_alive(layer):
    cache = filled(layer, prompts([5, 2]), capacity=8)
    cache.grow(16)
    view = torch.from_dlpack(cache.keys(0))
    saved = view.clone()
    del cache
    gc.collect()
    assert torch.equal(view, saved)


def test_a_failed_growth_leaves_the_cache_as_it_was(layer):
    cache = filled(layer, prompts(LENGTHS), PADS, capacity=8, firsts=FIRSTS)
    before = state(cache)
    view = torch.from_dlpack(cache.keys(0))
    with pytest.raises(MemoryError, match="max_tokens: cannot allocate"):
        cache.grow(1 << 39)  # 4 x 2 x 16 x 2^39 elements: no machine has them
    assert (cache.capacity, cache.growths) == (8, 0)
    assert_same(state(cache), before)
    assert view.data_ptr() == torch.from_dlpack(cache.keys(0)).data_ptr()
