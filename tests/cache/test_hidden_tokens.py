"""The hidden tokens a call's token_mask leaves in the cache (csrc/engine/cache.c's flags):
what each operation not covered by test_cache_ops.py's state checks does with them (reset,
truncate, growth, a call rolled back), that a flag never outlives its token (a later token in
the same rows is visible), and that decoding after an operation over hidden tokens equals
decoding on a cache built directly in the resulting state."""
import _thread
import os
import sys
import threading
import time

import pytest
import torch

import qwen3layer as q3
from dlpack_ctypes import Announcing
from test_cache_ops import (CFG, H, assert_decodes_equal, assert_same, decode_steps, filled, prompts, state,
                            token_mask, x_of)


@pytest.fixture(scope="module")
def layer():
    return q3.DecoderLayer.random(CFG, seed=7, dtype="float32")


def test_reset_of_one_and_of_all_forgets_the_hidden_tokens(layer):
    cache = filled(layer, prompts([5, 6, 4]), hidden=[(1, 3), (5,), (0,)])
    cache.reset(1)
    assert cache.hidden == ((1, 3), (), (0,)) and cache.lengths == (5, 0, 4)
    cache.reset()
    assert cache.hidden == ((), (), ()) and cache.lengths == (0, 0, 0)
    # the rows those tokens held take new, visible tokens: a fresh cache's result
    xs = prompts([5, 6, 4], seed=3)
    ys = [layer.prefill(x, cache, s) for s, x in enumerate(xs)]
    fresh = layer.new_cache(32, batch=3)
    for s, x in enumerate(xs):
        assert torch.equal(ys[s], layer.prefill(x, fresh, s))
    assert cache.hidden == ((), (), ())


def test_a_truncated_hidden_token_does_not_hide_the_token_that_replaces_it(layer):
    """flags past the length are cleared when it shrinks: a later masked call (which reads the
    flags of every row before it) must not see the dropped token's flag"""
    x = x_of(12, H, seed=1)
    cache = layer.new_cache(32)
    layer.prefill(x[:6], cache, token_mask=token_mask(6, [3]))
    cache.truncate(2)
    assert cache.hidden == ((),)
    layer.prefill(x[2:8], cache)                                   # row 3 again, visible now
    y = layer.prefill(x[8:12], cache, token_mask=token_mask(4, [1]))  # row 9 hidden
    assert cache.hidden == ((9,),)
    direct = layer.new_cache(32)
    layer.prefill(x[:8], direct)  # (its rows 2-5 made by a call of another size: equal but for rounding)
    torch.testing.assert_close(y, layer.prefill(x[8:12], direct, token_mask=token_mask(4, [1])), rtol=1e-5,
                               atol=1e-5)


def test_a_cache_grows_with_its_hidden_tokens(layer):
    cache = filled(layer, prompts([3, 7, 5]), [1, 0, 2], capacity=8, hidden=[(2,), (3, 4, 6), ()])
    before = state(cache)
    cache.grow(40)
    assert_same(state(cache), before)
    direct = filled(layer, prompts([3, 7, 5]), [1, 0, 2], capacity=40, hidden=[(2,), (3, 4, 6), ()])
    assert_decodes_equal(decode_steps(layer, cache, steps=3), decode_steps(layer, direct, steps=3))


@pytest.mark.parametrize("op", ["reorder", "select", "repeat_interleave", "copy_prefix", "crop"])
def test_decoding_after_an_operation_over_hidden_tokens_equals_a_direct_cache(layer, op):
    xs, pads, hidden = prompts([6, 8, 5], seed=11), [0, 2, 1], [(1, 4), (), (3, 4)]
    cache = filled(layer, xs, pads, hidden=hidden)
    if op == "reorder":
        cache.reorder([2, 2, 0])
        order = [2, 2, 0]
        direct = filled(layer, [xs[i] for i in order], [pads[i] for i in order], hidden=[hidden[i] for i in order])
    elif op == "select":
        cache = cache.select([2, 0])
        direct = filled(layer, [xs[2], xs[0]], [1, 0], hidden=[hidden[2], hidden[0]])
    elif op == "repeat_interleave":
        cache = cache.repeat_interleave(2)
        order = [0, 0, 1, 1, 2, 2]
        direct = filled(layer, [xs[i] for i in order], [pads[i] for i in order], hidden=[hidden[i] for i in order])
    elif op == "copy_prefix":
        cache.copy_prefix(2, 1, 4)  # sequence 2's first 4 tokens, its token 3 hidden
        direct = filled(layer, [xs[0], xs[2][:4], xs[2]], [0, 1, 1], hidden=[hidden[0], (3,), hidden[2]])
    else:
        cache.crop(4)
        direct = filled(layer, [x[:4] for x in xs], pads, hidden=[(1,), (), (3,)])
    assert cache.hidden == direct.hidden and cache.lengths == direct.lengths and cache.padding == direct.padding
    assert_decodes_equal(decode_steps(layer, cache), decode_steps(layer, direct))


def test_ctrl_c_rolls_the_hidden_tokens_back_with_the_call(layer):
    """a masked prefill stopped at a chunk boundary leaves no flag behind: the rows it wrote
    take visible tokens afterwards"""
    cache = layer.new_cache(8192)
    first = x_of(3, H, seed=2)
    layer.prefill(first, cache, token_mask=token_mask(3, [1]))
    started, main = threading.Event(), threading.get_ident()

    def interrupt():
        started.wait()
        while True:
            code = sys._current_frames()[main].f_code
            if code.co_name == "prefill" and code.co_filename.endswith(os.path.join("qwen3layer", "layer.py")):
                break
            time.sleep(0.001)
        _thread.interrupt_main()

    threading.Thread(target=interrupt).start()
    n = 8000
    with pytest.raises(KeyboardInterrupt):
        layer.prefill(Announcing(x_of(n, H, seed=3), started), cache, chunk_size=1,
                      token_mask=torch.arange(n) % 2 == 0)  # every other token hidden
    assert cache.lengths == (3,) and cache.hidden == ((1,),)
    x = x_of(5, H, seed=4)
    fresh = layer.new_cache(16)
    layer.prefill(first, fresh, token_mask=token_mask(3, [1]))
    assert torch.equal(layer.prefill(x, cache), layer.prefill(x, fresh))
