"""The KVCache's arguments as the engine checks them (csrc/engine/cache.c, cache_ops.c: the glue,
csrc/python/py_cache*.c, only converts, issue 40): sequence indices, index entries and counts
past a C int reach the engine as int64 and are named with the value given; past int64 the
conversion itself refuses them. Each refusal leaves the cache as it was."""
import pytest
import torch

import qwen3layer as q3

CFG = q3.LayerConfig.tiny()
BIG = 1 << 40  # past a C int: the engine sees the value as given, not a truncated one


@pytest.fixture(scope="module")
def layer():
    return q3.DecoderLayer.random(CFG, seed=5, dtype="float32")


@pytest.fixture
def cache(layer):
    c = layer.new_cache(16, batch=3)
    for s, n in enumerate([3, 2, 0]):
        if n:
            layer.prefill(torch.randn(n, CFG.hidden_size, generator=torch.Generator().manual_seed(s)), c, s)
    return c


def snapshot(c):
    return c.lengths, c.padding, c.first_positions, c.capacity, c.batch


@pytest.mark.parametrize("call, error, message", [
    (lambda c: c.keys(3), IndexError, "seq: expected 0 <= seq < 3 (the cache's batch), got 3"),
    (lambda c: c.values(-1), IndexError, "seq: expected 0 <= seq < 3 (the cache's batch), got -1"),
    (lambda c: c.keys(BIG), IndexError, f"seq: expected 0 <= seq < 3 (the cache's batch), got {BIG}"),
    (lambda c: c.keys(None), TypeError, "seq: expected an int, got NoneType"),
    (lambda c: c.keys(1 << 70), OverflowError, ""),
    (lambda c: c.reset(-1), IndexError, "seq: expected 0 <= seq < 3 (the cache's batch), got -1"),
    (lambda c: c.reset(BIG), IndexError, f"got {BIG}"),
    (lambda c: c.truncate(0, BIG), IndexError, f"seq: expected 0 <= seq < 3 (the cache's batch), got {BIG}"),
    (lambda c: c.set_padding(0, -BIG), IndexError, f"got {-BIG}"),
    (lambda c: c.crop(1, -1), IndexError, "seq: expected 0 <= seq < 3 (the cache's batch), got -1"),
    (lambda c: c.crop(1, BIG), IndexError, f"got {BIG}"),
    (lambda c: c.copy_prefix(BIG, 0, 1), IndexError, f"src_seq: expected 0 <= src_seq < 3 (the cache's batch), got {BIG}"),
    (lambda c: c.copy_prefix(0, -BIG, 1), IndexError, f"dst_seq: expected 0 <= dst_seq < 3 (the cache's batch), got {-BIG}"),
    (lambda c: c.reorder([0, 1, BIG]), IndexError, f"index[2]: expected 0 <= index < 3 (the cache's batch), got {BIG}"),
    (lambda c: c.select([-BIG]), IndexError, f"index[0]: expected 0 <= index < 3 (the cache's batch), got {-BIG}"),
    (lambda c: c.reorder([0, 1 << 70, 2]), ValueError, "index[1]: expected a 64-bit int, got 1180591620717411303424"),
    (lambda c: c.reorder([9, 1]), IndexError, "index[0]: expected 0 <= index < 3"),  # the entries before the count
    (lambda c: c.all_keys(BIG), ValueError, f"tokens: expected 0 <= tokens <= 16 (the cache's capacity), got {BIG}"),
    (lambda c: c.all_values(None), ValueError, "tokens: the sequences hold different lengths (sequence 0: 3, sequence 1: 2)"),
])
def test_arguments_past_a_c_int_are_named_as_given(cache, call, error, message):
    before = snapshot(cache)
    with pytest.raises(error) as e:
        call(cache)
    assert message in str(e.value)
    assert snapshot(cache) == before


def test_views_have_the_engines_shapes_and_strides(cache):
    k = torch.from_dlpack(cache.keys(1))
    assert k.shape == (CFG.num_key_value_heads, 2, CFG.head_dim)
    assert k.stride() == (16 * CFG.head_dim, CFG.head_dim, 1)
    a = torch.from_dlpack(cache.all_values(True))  # a bool is an int for tokens=, as before
    assert a.shape == (3, CFG.num_key_value_heads, 1, CFG.head_dim)
    assert a.stride() == (CFG.num_key_value_heads * 16 * CFG.head_dim, 16 * CFG.head_dim, CFG.head_dim, 1)
    torch.testing.assert_close(a[1], torch.from_dlpack(cache.values(1))[:, :1])


def test_per_sequence_tuples_and_repr(cache):
    cache.truncate(1, 0)
    assert cache.lengths == (1, 2, 0) and cache.padding == (0, 0, 0) and cache.first_positions == (0, 0, 0)
    assert "filled=3/48 tokens" in repr(cache)


def test_the_new_caches_are_their_own(cache):
    for new in (cache.copy(), cache.select([1, 1]), cache.repeat_interleave(2)):
        assert isinstance(new, q3.KVCache) if hasattr(q3, "KVCache") else True
        new.reset()
        assert cache.lengths == (3, 2, 0)
    assert cache.repeat_interleave(2).lengths == (3, 3, 2, 2, 0, 0)
    assert cache.select([2, 0]).lengths == (0, 3)
