"""KV cache operations for generation (csrc/engine/cache_ops.c): reorder, select,
repeat_interleave, crop, copy and copy_prefix (grow: test_cache_grow.py; its rejections here). Each is checked by content (the keys and
values each sequence holds, its length and padding), by behaviour (decoding after the
operation equals decoding on a cache built directly in the resulting state), and by its
rejections (an error naming the argument, and the cache left as it was). On a CUDA cache (the
SIMT executor's emulated device, tests/executor/test_cache_ops_executor.py) each equals the host one."""
import _thread
import copy
import random
import signal
import sys
import threading
import time

import pytest
import torch

import qwen3layer as q3
from dlpack_ctypes import Announcing

CFG = q3.LayerConfig.tiny()
H = CFG.hidden_size


@pytest.fixture(scope="module")
def layer():
    return q3.DecoderLayer.random(CFG, seed=5, dtype="float32")


def x_of(*shape, seed):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def state(cache):
    """what the cache holds: lengths, padding, and each sequence's keys and values (copies),
    first positions, hidden tokens (plan_state, the one read of four of them, checked against them)"""
    kv = [(torch.from_dlpack(cache.keys(s)).clone(), torch.from_dlpack(cache.values(s)).clone())
          for s in range(cache.batch)]
    assert cache.plan_state == (cache.lengths, cache.padding, cache.first_positions, cache.hidden)
    return cache.lengths, cache.padding, kv, cache.first_positions, cache.hidden


def assert_same(a, b):
    assert a[0] == b[0] and a[1] == b[1] and a[3] == b[3] and a[4] == b[4]
    for (ka, va), (kb, vb) in zip(a[2], b[2]):
        assert torch.equal(ka, kb) and torch.equal(va, vb)


def prompts(lengths, seed=0):
    return [x_of(n, H, seed=seed + i) for i, n in enumerate(lengths)]


def token_mask(n, hidden):
    """a token mask of n tokens hiding those of `hidden`"""
    mask = torch.ones(n, dtype=torch.bool)
    mask[list(hidden)] = False
    return mask


def filled(layer, xs, pads=None, capacity=32, firsts=None, hidden=None):
    """a cache whose sequence i holds prompt xs[i] (pads[i] of its first tokens padding, its
    first real token at position firsts[i], the tokens of hidden[i] hidden by the call's mask)"""
    cache = layer.new_cache(capacity, batch=len(xs))
    for s, x in enumerate(xs):
        if pads and pads[s]:
            cache.set_padding(pads[s], s)
        if firsts and firsts[s]:
            cache.set_first_position(firsts[s], s)
        if len(x):
            mask = token_mask(len(x), hidden[s]) if hidden and hidden[s] else None
            layer.prefill(x, cache, s, token_mask=mask)
    return cache


def gathered(st, index):
    """the state of a cache whose sequence i is sequence index[i] of state st"""
    return tuple(tuple(part[i] for i in index) if isinstance(part, tuple) else [part[i] for i in index]
                 for part in st)


LENGTHS, PADS, FIRSTS = [3, 7, 0, 5, 2, 6], [1, 0, 0, 2, 0, 3], [0, 4, 0, 9, 1, 0]
HIDDEN = [(), (2, 5, 6), (), (4,), (1,), (3, 4)]  # holes, right padding, a hidden first real token


@pytest.fixture
def cache(layer):
    c = filled(layer, prompts(LENGTHS), PADS, firsts=FIRSTS, hidden=HIDDEN)
    assert c.hidden == tuple(HIDDEN)
    return c


# ---- content ------------------------------------------------------------------------


@pytest.mark.parametrize("index", [[0, 1, 2, 3, 4, 5], [1, 2, 0, 4, 5, 3], [5, 4, 3, 2, 1, 0], [3, 3, 3, 3, 3, 3],
                                   [1, 0, 0, 1, 5, 5], [2, 0, 1, 1, 4, 4], [0, 0, 1, 2, 3, 4]])
def test_reorder_moves_tokens_lengths_and_padding(cache, index):
    before = state(cache)
    cache.reorder(index)
    assert_same(state(cache), gathered(before, index))


def test_a_host_cache_says_where_it_lives(cache):
    assert cache.device == "cpu"  # a device cache says "cuda:N" (tests/executor/test_cache_ops_executor.py)


def test_reorder_any_map_and_index_kinds(cache):
    """random maps (cycles, chains, repeats), given as lists, tuples, ranges and torch and
    numpy integer arrays"""
    import numpy as np

    rng = random.Random(0)
    kinds = [list, tuple, lambda i: torch.tensor(i), lambda i: torch.tensor(i, dtype=torch.int32),
             lambda i: np.array(i, dtype=np.int64)]
    for trial in range(60):
        index = [rng.randrange(6) for _ in range(6)] if trial % 2 else rng.sample(range(6), 6)
        before = state(cache)
        cache.reorder(kinds[trial % len(kinds)](index))
        assert_same(state(cache), gathered(before, index))
    before = state(cache)
    cache.reorder(range(6))
    assert_same(state(cache), before)


def test_select_makes_a_new_cache_of_the_chosen_sequences(cache):
    before = state(cache)
    for index in ([4], [3, 1], [5, 5, 0, 2, 1, 1, 3, 4, 0]):
        sub = cache.select(index)
        assert isinstance(sub, q3.KVCache) and sub.batch == len(index) and sub.capacity == cache.capacity
        assert (sub.num_kv_heads, sub.head_dim, sub.dtype) == (cache.num_kv_heads, cache.head_dim, cache.dtype)
        assert_same(state(sub), gathered(before, index))
    assert_same(state(cache), before)


def test_repeat_interleave_expands_each_sequence(cache):
    before = state(cache)
    for n in (1, 3):
        big = cache.repeat_interleave(n)
        assert big.batch == 6 * n
        assert_same(state(big), gathered(before, [i // n for i in range(6 * n)]))
    assert_same(state(cache), before)


def test_crop(cache):
    before = state(cache)
    cache.crop(4, 1)  # one sequence
    assert cache.lengths == (3, 4, 0, 5, 2, 6)
    cache.crop(100)   # more than any holds: nothing changes (transformers' crop)
    assert cache.lengths == (3, 4, 0, 5, 2, 6)
    cache.crop(5)     # every sequence, keeping what the shorter ones hold
    assert cache.lengths == (3, 4, 0, 5, 2, 5)
    assert cache.hidden == ((), (2,), (), (4,), (1,), (3, 4))  # the hidden tokens kept, no others
    cache.crop(2)     # padding is never more than the length
    assert cache.lengths == (2, 2, 0, 2, 2, 2) and cache.padding == (1, 0, 0, 2, 0, 2)
    assert cache.hidden == ((), (), (), (), (1,), ())
    for s in range(6):  # the tokens kept are the first ones
        k, v = state(cache)[2][s]
        assert torch.equal(k, before[2][s][0][:, :2]) and torch.equal(v, before[2][s][1][:, :2])


def test_crop_negative_drops_from_the_end(layer):
    cache = filled(layer, prompts([4, 6, 3]), [0, 1, 2])
    cache.crop(-2)
    assert cache.lengths == (2, 4, 1) and cache.padding == (0, 1, 1)
    cache.crop(-1, seq=1)
    assert cache.lengths == (2, 3, 1)
    cache.crop(0)
    assert cache.lengths == (0, 0, 0) and cache.padding == (0, 0, 0)


def test_copy_deepcopy_and_copy_copy(cache):
    before = state(cache)
    for dup in (cache.copy(), copy.copy(cache), copy.deepcopy(cache), copy.deepcopy({"c": cache})["c"]):
        assert dup is not cache and dup.batch == cache.batch and dup.capacity == cache.capacity
        assert dup.keys(1).data_ptr != cache.keys(1).data_ptr
        assert_same(state(dup), before)
        dup.reset()
    assert_same(state(cache), before)


def test_copy_prefix(cache):
    before = state(cache)
    cache.copy_prefix(1, 2, 5)  # into an empty slot
    cache.copy_prefix(5, 0, 4)  # over a sequence that held tokens; padding 3 comes along
    cache.copy_prefix(3, 3, 4)  # onto itself: a truncation
    cache.copy_prefix(4, 4, 2)  # onto itself, whole: nothing changes
    st = state(cache)
    assert st[0] == (4, 7, 5, 4, 2, 6) and st[1] == (3, 0, 0, 2, 0, 3)
    assert st[4] == ((3,), (2, 5, 6), (2,), (), (1,), (3, 4))  # each dst's from its src, within the length
    for dst, src, n in ((2, 1, 5), (0, 5, 4), (3, 3, 4), (4, 4, 2), (1, 1, 7), (5, 5, 6)):
        assert torch.equal(st[2][dst][0], before[2][src][0][:, :n])
        assert torch.equal(st[2][dst][1], before[2][src][1][:, :n])
    cache.copy_prefix(3, 1, 1)  # padding is never more than the length
    assert cache.lengths[1] == 1 and cache.padding[1] == 1


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_half_precision_cache(layer, dtype):
    """a float32 layer's 16-bit cache: the operations move the rows as they are"""
    cache = layer.new_cache(16, batch=3, dtype=dtype)
    for s, n in enumerate([2, 5, 3]):
        layer.prefill(x_of(n, H, seed=s), cache, s)
    before = state(cache)
    cache.reorder([2, 2, 0])
    assert_same(state(cache), gathered(before, [2, 2, 0]))
    assert cache.select([1]).dtype == dtype and torch.from_dlpack(cache.keys(0)).dtype == getattr(torch, dtype)
    assert_same(state(cache.repeat_interleave(2)), gathered(state(cache), [0, 0, 1, 1, 2, 2]))


# ---- behaviour: decoding after an operation ----------------------------------------


def decode_steps(layer, cache, steps=3, seed=100):
    return [layer.decode(x_of(cache.batch, H, seed=seed + t), cache) for t in range(steps)]


def assert_decodes_equal(a, b):
    for ya, yb in zip(a, b):
        torch.testing.assert_close(ya, yb, rtol=1e-6, atol=1e-6)


def test_decode_after_reorder_equals_a_cache_built_in_that_order(layer):
    xs, pads = prompts([5, 9, 3, 7], seed=10), [0, 2, 0, 1]
    index = [3, 1, 1, 0]  # beams 1 and 3 survive, 1 twice; 0 moves
    cache = filled(layer, xs, pads)
    cache.reorder(index)
    direct = filled(layer, [xs[i] for i in index], [pads[i] for i in index])
    assert cache.lengths == direct.lengths and cache.padding == direct.padding
    assert_decodes_equal(decode_steps(layer, cache), decode_steps(layer, direct))


def test_decode_after_select_equals_a_cache_built_with_those_sequences(layer):
    xs, pads = prompts([5, 9, 3], seed=20), [1, 0, 2]
    sub = filled(layer, xs, pads).select([2, 0])
    assert_decodes_equal(decode_steps(layer, sub), decode_steps(layer, filled(layer, [xs[2], xs[0]], [2, 1])))


def test_repeat_interleave_then_decode_equals_separate_prefills(layer):
    xs = prompts([4, 6], seed=30)
    beams = filled(layer, xs, [1, 0]).repeat_interleave(3)
    separate = filled(layer, [xs[0]] * 3 + [xs[1]] * 3, [1, 1, 1, 0, 0, 0])
    assert_decodes_equal(decode_steps(layer, beams), decode_steps(layer, separate))


def test_crop_then_decode_equals_prefill_of_the_shorter_prompt(layer):
    xs = prompts([8, 6], seed=40)
    cache = filled(layer, xs, [2, 0])
    decode_steps(layer, cache, steps=2)  # rejected guesses, say
    cache.crop(-2)
    cache.crop(5, seq=0)
    shorter = filled(layer, [xs[0][:5], xs[1]], [2, 0])
    assert cache.lengths == shorter.lengths
    assert_decodes_equal(decode_steps(layer, cache), decode_steps(layer, shorter))


def test_copy_then_diverging_decodes_leave_the_original_untouched(layer):
    xs = prompts([5, 7], seed=50)
    cache = filled(layer, xs, [0, 3])
    before = state(cache)
    branch = copy.deepcopy(cache)
    a = decode_steps(layer, branch, seed=200)
    assert_same(state(cache), before)
    b = decode_steps(layer, cache, seed=300)
    # each branch decodes as a fresh prefill of the prefix would
    assert_decodes_equal(a, decode_steps(layer, filled(layer, xs, [0, 3]), seed=200))
    assert_decodes_equal(b, decode_steps(layer, filled(layer, xs, [0, 3]), seed=300))


def test_copy_prefix_reuse_equals_a_fresh_prefill(layer):
    prefix, tail0, tail1 = x_of(6, H, seed=60), x_of(3, H, seed=61), x_of(4, H, seed=62)
    cache = layer.new_cache(32, batch=2)
    layer.prefill(torch.cat([prefix, tail0]), cache, 0)
    layer.prefill(x_of(5, H, seed=63), cache, 1)  # what slot 1 held before is dropped
    cache.copy_prefix(0, 1, 6)
    y_reused = layer.prefill(tail1, cache, 1)
    fresh = filled(layer, [torch.cat([prefix, tail0]), torch.cat([prefix, tail1])])
    fresh_tail = layer.prefill(tail1, filled(layer, [prefix]), 0)
    torch.testing.assert_close(y_reused, fresh_tail, rtol=1e-6, atol=1e-6)
    assert cache.lengths == fresh.lengths
    assert_decodes_equal(decode_steps(layer, cache), decode_steps(layer, fresh))


# ---- rejections ---------------------------------------------------------------------


@pytest.mark.parametrize("call, error, message", [
    (lambda c: c.reorder([0, 1, 2, 3, 4, 6]), IndexError,
     "index[5]: expected 0 <= index < 6 (the cache's batch), got 6"),
    (lambda c: c.reorder([0, 1, -1, 3, 4, 5]), IndexError,
     "index[2]: expected 0 <= index < 6 (the cache's batch), got -1"),
    (lambda c: c.reorder([0, 1, 2]), ValueError, "index: expected 6 entries (the cache's batch), got 3"),
    (lambda c: c.reorder(torch.arange(6.0)), TypeError, "index: expected an integer dtype, got torch.float32"),
    (lambda c: c.reorder(torch.ones(6, dtype=torch.bool)), TypeError, "index: expected an integer dtype, got torch.bool"),
    (lambda c: c.reorder(torch.zeros(6, 1, dtype=torch.long)), ValueError, "index: expected 1 dimension, got 2"),
    (lambda c: c.reorder(3), TypeError, "index: expected a 1-D sequence of ints, got int"),
    (lambda c: c.reorder([0, 1, 2.0, 3, 4, 5]), TypeError, "index[2]: expected an int, got float"),
    (lambda c: c.reorder([0, 1, True, 3, 4, 5]), TypeError, "index[2]: expected an int, got bool"),
    (lambda c: c.reorder(None), TypeError, "index: expected a 1-D sequence of ints"),
    (lambda c: c.select([]), ValueError, "index: expected 1 to 2147483647 entries, got 0"),
    (lambda c: c.select([7]), IndexError, "index[0]: expected 0 <= index < 6 (the cache's batch), got 7"),
    (lambda c: c.repeat_interleave(0), ValueError, "n: expected 1 <= n <= 357913941"),
    (lambda c: c.repeat_interleave(1 << 30), ValueError,
     "n: expected 1 <= n <= 357913941 (a batch of at most 2147483647 from 6 sequences), got 1073741824"),
    (lambda c: c.crop(-3), ValueError, "length: expected -2 <= length (sequence 1 holds 2 tokens), got -3"),
    (lambda c: c.crop(-6, 1), ValueError, "length: expected -2 <= length (sequence 1 holds 2 tokens)"),
    (lambda c: c.crop(1, 6), IndexError, "seq: expected 0 <= seq < 6 (the cache's batch), got 6"),
    (lambda c: c.crop(1, "0"), TypeError, "seq: expected an int or None, got str"),
    (lambda c: c.crop(1, True), TypeError, "seq: expected an int or None, got bool"),
    (lambda c: c.reset(seq=False), TypeError, "seq: expected an int or None, got bool"),
    (lambda c: c.truncate(1, True), TypeError, "seq: expected an int, got bool"),
    (lambda c: c.set_padding(0, True), TypeError, "seq: expected an int, got bool"),
    (lambda c: c.keys(False), TypeError, "seq: expected an int, got bool"),
    (lambda c: c.copy_prefix(6, 0, 1), IndexError, "src_seq: expected 0 <= src_seq < 6 (the cache's batch), got 6"),
    (lambda c: c.copy_prefix(0, -1, 1), IndexError, "dst_seq: expected 0 <= dst_seq < 6 (the cache's batch), got -1"),
    (lambda c: c.copy_prefix(0, 1, 4), ValueError,
     "length: expected 0 <= length <= 3 (the length of sequence 0), got 4"),
    (lambda c: c.copy_prefix(0, 1, -1), ValueError, "length: expected 0 <= length <= 3"),
    (lambda c: c.reorder(range(6), stream=1), ValueError, "stream: expected None for a cache on the cpu"),
    (lambda c: c.select([0], stream=0), ValueError, "stream: expected None for a cache on the cpu"),
    (lambda c: c.copy_prefix(0, 1, 1, stream=7), ValueError, "stream: expected None for a cache on the cpu"),
    (lambda c: c.set_first_position(3, 0), RuntimeError,
     "first_position: sequence 0 already holds 3 tokens (set it while empty)"),
    (lambda c: c.set_first_position(-1, 2), ValueError,
     "position: expected 0 <= position <= 1099511627744 (2^40 less the capacity), got -1"),
    (lambda c: c.set_first_position(1 << 40, 2), ValueError, "position: expected 0 <= position <= 1099511627744"),
    (lambda c: c.set_first_position(1, 6), IndexError, "seq: expected 0 <= seq < 6 (the cache's batch), got 6"),
    (lambda c: c.all_keys(), ValueError,
     "tokens: the sequences hold different lengths (sequence 0: 3, sequence 1: 2): pass tokens="),
    (lambda c: c.all_values(33), ValueError, "tokens: expected 0 <= tokens <= 32 (the cache's capacity), got 33"),
    (lambda c: c.all_keys(-1), ValueError, "tokens: expected 0 <= tokens <= 32"),
    (lambda c: c.all_keys("3"), TypeError, "tokens: expected an int or None, got str"),
    (lambda c: c.grow(31), ValueError, "max_tokens: expected at least the cache's capacity 32, got 31"),
    (lambda c: c.grow(-1), ValueError, "max_tokens: expected at least the cache's capacity 32, got -1"),
    (lambda c: c.grow((1 << 40) + 1), ValueError,
     "max_tokens: expected at most 2^40 (the positions RoPE takes), got 1099511627777"),
    (lambda c: c.grow(1 << 60), ValueError, "max_tokens: expected at most 2^40"),
    (lambda c: c.grow(64, stream=1), ValueError, "stream: expected None for a cache on the cpu"),
    (lambda c: c.grow("64"), TypeError, "max_tokens: expected an int, got str"),
    (lambda c: c.grow(True), TypeError, "max_tokens: expected an int, got bool"),
    (lambda c: c.grow(1 << 70), ValueError, "max_tokens: expected at most 2^40 (the positions RoPE takes), got 1180"),
])
def test_rejections_name_the_argument_and_leave_the_cache_unchanged(layer, call, error, message):
    cache = filled(layer, prompts([3, 2, 0, 5, 1, 4]), [1, 0, 0, 2, 0, 0])
    before = state(cache)
    with pytest.raises(error) as e:
        call(cache)
    assert message in str(e.value)
    assert_same(state(cache), before)


def test_the_same_cache_can_take_a_reorder_after_a_rejection(cache):
    with pytest.raises(IndexError):
        cache.reorder([0, 0, 0, 0, 0, 9])
    before = state(cache)
    cache.reorder([5, 4, 3, 2, 1, 0])
    assert_same(state(cache), gathered(before, [5, 4, 3, 2, 1, 0]))


class Stop(Exception):
    pass


def test_operations_refuse_while_a_layer_call_runs_on_the_cache(layer):
    """Python code that runs while a prefill is inside the engine (a signal handler, run by
    the engine's poll at a chunk boundary) finds the cache busy: every operation refuses
    with RuntimeError and changes nothing; the prefill then stops and rolls back."""
    cache = filled(layer, prompts([3, 2]), capacity=8192)
    before = state(cache)
    started, refusals = threading.Event(), []


    def handler(signum, frame):
        for op in (lambda: cache.reorder([1, 0]), lambda: cache.select([0]), lambda: cache.repeat_interleave(2),
                   cache.copy, lambda: cache.crop(1), lambda: cache.copy_prefix(0, 1, 1),
                   lambda: cache.grow(16384)):
            try:
                op()
                refusals.append("accepted")
            except RuntimeError as e:
                refusals.append(str(e))
        raise Stop

    main = threading.get_ident()

    def interrupt():
        """once the main thread is inside the C call (its Python frame the wrapper's)"""
        if not started.wait(60):
            return
        deadline = time.monotonic() + 60
        while sys._current_frames()[main].f_code.co_name != "prefill":
            if time.monotonic() > deadline:
                return
            time.sleep(0.001)
        _thread.interrupt_main(signal.SIGINT)

    old = signal.signal(signal.SIGINT, handler)
    try:
        threading.Thread(target=interrupt, daemon=True).start()
        with pytest.raises(Stop):
            layer.prefill(Announcing(x_of(8000, H, seed=9), started), cache, 1, chunk_size=1)
    finally:
        signal.signal(signal.SIGINT, old)
    assert refusals == ["cache: in use by a running layer call on another thread"] * 7
    assert_same(state(cache), before)


def test_all_keys_and_values_are_views_of_every_sequence(layer):
    cache = filled(layer, prompts([3, 3]))
    keys, values = torch.from_dlpack(cache.all_keys()), torch.from_dlpack(cache.all_values(5))
    assert keys.shape == (2, cache.num_kv_heads, 3, cache.head_dim) and values.shape[2] == 5
    for s in range(2):
        assert torch.equal(keys[s], torch.from_dlpack(cache.keys(s)))
        assert torch.equal(values[s, :, :3], torch.from_dlpack(cache.values(s)))
    assert keys.data_ptr() == torch.from_dlpack(cache.keys(0)).data_ptr()  # no copy
    assert not values[:, :, 3:].any()  # rows never written read zeros


def test_a_first_position_moves_the_rope_positions(layer):
    """a sequence whose first real token is at position p: its real tokens' keys equal those of
    the same tokens without padding started at p, and differ from those started at 0; reset
    clears it"""
    x = x_of(4, H, seed=9)
    a = layer.new_cache(8, 1)
    a.set_padding(2)
    a.set_first_position(5)
    layer.prefill(x, a)
    b = layer.new_cache(8, 1)
    b.set_first_position(5)
    layer.prefill(x[2:].contiguous(), b)
    plain = layer.new_cache(8, 1)
    layer.prefill(x[2:].contiguous(), plain)
    ka, kb = torch.from_dlpack(a.keys()), torch.from_dlpack(b.keys())
    assert a.first_positions == (5,) and torch.equal(ka[:, 2:], kb)
    assert not torch.equal(kb, torch.from_dlpack(plain.keys()))
    a.reset()
    assert a.first_positions == (0,)
