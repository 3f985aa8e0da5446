"""Prefill, chunked prefill and decode are one function: their results agree."""
import pytest
import torch

import qwen3layer as q3

CFG = q3.LayerConfig(hidden_size=64, num_attention_heads=8, num_key_value_heads=2, head_dim=24,
                     num_experts=8, num_experts_per_tok=2, moe_intermediate_size=48)
TOL = 1e-5


def rel(a, b):
    return float((a.double() - b.double()).norm() / b.double().norm())


@pytest.fixture(scope="module")
def layer():
    return q3.DecoderLayer.random(CFG, seed=7, dtype="float32")


def x_of(*shape, seed=0, dtype=torch.float32):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(dtype)


def test_prefill_then_decode_equals_longer_prefill(layer):
    S = 37
    x = x_of(S + 1, CFG.hidden_size, seed=1)
    full = layer.prefill(x, layer.new_cache(64))
    cache = layer.new_cache(64)
    layer.prefill(x[:S], cache)
    last = layer.decode(x[S:], cache)
    assert rel(last[0], full[S]) <= TOL


@pytest.mark.parametrize("chunk", [1, 7, 64, 113])
def test_chunked_prefill_equals_unchunked(layer, chunk):
    S = 113
    x = x_of(S, CFG.hidden_size, seed=2)
    c_full, c_chunk = layer.new_cache(128), layer.new_cache(128)
    y_full = layer.prefill(x, c_full, chunk_size=S)
    y_chunk = layer.prefill(x, c_chunk, chunk_size=chunk)
    assert rel(y_chunk, y_full) <= TOL
    assert rel(torch.from_dlpack(c_chunk.keys()), torch.from_dlpack(c_full.keys())) <= TOL
    assert rel(torch.from_dlpack(c_chunk.values()), torch.from_dlpack(c_full.values())) <= TOL


def test_prefill_in_separate_calls_equals_one_call(layer):
    x = x_of(50, CFG.hidden_size, seed=3)
    y_full = layer.prefill(x, layer.new_cache(64))
    cache = layer.new_cache(64)
    parts = [layer.prefill(x[a:b], cache) for a, b in ((0, 13), (13, 14), (14, 50))]
    assert rel(torch.cat(parts), y_full) <= TOL
    assert cache.lengths == (50,)


def test_alternating_shapes_grow_the_workspace_once_and_change_no_result():
    """The workspace only grows, to the larger of the rows and of the sequences held and
    asked (csrc/engine/workspace.c; the CUDA layer's likewise, counted on the executor in
    test_cuda_executor.py): a one-sequence prefill (40 rows, 1 sequence) alternating with a
    batched decode (4 rows, 4 sequences) sizes it once, in the first round, and then it
    keeps its size; each result is bitwise that of a fresh layer making the call alone."""
    layer = q3.DecoderLayer.random(CFG, seed=7, dtype="float32")
    prompt, steps = x_of(40, CFG.hidden_size, seed=30), x_of(4, CFG.hidden_size, seed=31)

    def prefill(lay):
        return lay.prefill(prompt, lay.new_cache(64))

    def decode(lay):
        return lay.decode(steps, lay.new_cache(8, batch=4))

    alone = {}
    for call in (prefill, decode):
        fresh = q3.DecoderLayer.random(CFG, seed=7, dtype="float32")
        alone[call] = (call(fresh), fresh.workspace_bytes)
    held = []
    for _ in range(3):
        for call in (prefill, decode):
            assert torch.equal(call(layer), alone[call][0])
            held.append(layer.workspace_bytes)
    assert held[1] >= max(size for _, size in alone.values())
    assert set(held[1:]) == {held[1]}  # sized to each call, it would alternate


def test_batched_decode_of_different_lengths_equals_each_alone(layer):
    lengths = (5, 17, 1)
    prompts = [x_of(n, CFG.hidden_size, seed=10 + i) for i, n in enumerate(lengths)]
    steps = x_of(4, 3, CFG.hidden_size, seed=20)
    batched = layer.new_cache(32, batch=3)
    for b, p in enumerate(prompts):
        layer.prefill(p, batched, seq=b)
    assert batched.lengths == lengths
    outs = [layer.decode(steps[t], batched) for t in range(4)]
    for b, p in enumerate(prompts):
        alone = layer.new_cache(32)
        layer.prefill(p, alone)
        for t in range(4):
            y = layer.decode(steps[t, b:b + 1], alone)
            assert rel(outs[t][b], y[0]) <= TOL
        assert torch.equal(torch.from_dlpack(batched.keys(b)), torch.from_dlpack(alone.keys()))
    assert batched.lengths == tuple(n + 4 for n in lengths)


def test_batched_prefill_equals_each_sequence_alone(layer):
    x = x_of(3, 20, CFG.hidden_size, seed=30)
    cache = layer.new_cache(32, batch=3)
    y = layer.prefill(x, cache, chunk_size=6)
    for b in range(3):
        alone = layer.prefill(x[b], layer.new_cache(32))
        assert rel(y[b], alone) <= TOL


def test_bfloat16_chunked_equals_unchunked():
    layer = q3.DecoderLayer.random(CFG, seed=8, dtype="bfloat16")
    x = x_of(40, CFG.hidden_size, seed=4, dtype=torch.bfloat16)
    y_full = layer.prefill(x, layer.new_cache(64), chunk_size=40)
    y_chunk = layer.prefill(x, layer.new_cache(64), chunk_size=9)
    # the cache holds bf16 K/V either way; only fp32 summation order differs
    assert rel(y_chunk, y_full) <= 1e-2
    assert (y_chunk.float() - y_full.float()).abs().max() <= 2 ** -6 * y_full.float().abs().max()


@pytest.mark.parametrize("path", sorted({"portable", q3.build_info()["cpu_paths"][-1]}))
def test_float16_chunked_and_decoded_equal_unchunked(path):
    """a float16 layer (fp16 weights and cache, fp32 sums): 40 tokens in one pass, in chunks of
    9, and 37 then 3 decode steps"""
    q3.set_cpu_path(path)
    try:
        layer = q3.DecoderLayer.random(CFG, seed=8, dtype="float16")
        x = x_of(40, CFG.hidden_size, seed=4, dtype=torch.float16)
        y_full = layer.prefill(x, layer.new_cache(64), chunk_size=40)
        y_chunk = layer.prefill(x, layer.new_cache(64), chunk_size=9)
        cache = layer.new_cache(64)
        y_steps = torch.cat([layer.prefill(x[:37], cache)] + [layer.decode(x[i:i + 1], cache) for i in (37, 38, 39)])
    finally:
        q3.set_cpu_path(q3.build_info()["cpu_paths"][-1])
    assert y_full.dtype == torch.float16 and cache.dtype == "float16"
    for y in (y_chunk, y_steps):  # the cache holds fp16 K/V either way; only fp32 summation order differs
        assert rel(y, y_full) <= 2e-3
        assert (y.float() - y_full.float()).abs().max() <= 2 ** -8 * y_full.float().abs().max()


def test_truncate_then_redo_equals_first_pass(layer):
    """the redo after a truncate is the same call on the same cache as the first pass's second
    call: equal to the bit (the whole 12 tokens in one call take another matmul kernel on some
    CPU paths, from 8 tokens on: equal within TOL)"""
    x = x_of(12, CFG.hidden_size, seed=5)
    cache = layer.new_cache(16)
    y1 = torch.cat([layer.prefill(x[:8], cache), layer.prefill(x[8:], cache)])
    cache.truncate(8)
    assert cache.lengths == (8,)
    y2 = layer.prefill(x[8:], cache)
    assert torch.equal(y2, y1[8:])
    cache.reset()
    assert cache.lengths == (0,)
    whole = layer.prefill(x, cache)
    assert torch.equal(layer.prefill(x, layer.new_cache(16)), whole)
    assert rel(whole, y1) <= TOL


def test_random_layer_is_deterministic_in_its_seed():
    a = q3.DecoderLayer.random(CFG, seed=3, dtype="float32")
    b = q3.DecoderLayer.random(CFG, seed=3, dtype="float32")
    c = q3.DecoderLayer.random(CFG, seed=4, dtype="float32")
    x = x_of(5, CFG.hidden_size, seed=6)
    ya, yb, yc = (l.prefill(x, l.new_cache(8)) for l in (a, b, c))
    assert torch.equal(ya, yb)
    assert not torch.allclose(ya, yc)


def test_left_padding_is_neither_attended_nor_counted(layer):
    real = x_of(9, CFG.hidden_size, seed=40)
    pads = x_of(4, CFG.hidden_size, seed=41)
    cache = layer.new_cache(32)
    cache.set_padding(4)
    y = layer.prefill(torch.cat([pads, real]), cache, chunk_size=5)
    alone = layer.new_cache(32)
    ref = layer.prefill(real, alone)
    assert cache.padding == (4,) and torch.isfinite(y).all()
    assert rel(y[4:], ref) <= TOL
    step = x_of(1, CFG.hidden_size, seed=42)
    assert rel(layer.decode(step, cache), layer.decode(step, alone)) <= TOL
    cache.reset()
    assert cache.padding == (0,)


def test_padding_only_on_an_empty_sequence(layer):
    cache = layer.new_cache(8)
    layer.prefill(x_of(2, CFG.hidden_size), cache)
    with pytest.raises(RuntimeError, match="padding: sequence 0 already holds 2 tokens"):
        cache.set_padding(1)
    with pytest.raises(ValueError, match=r"n: expected 0 <= n < 8 \(the capacity\), got 8"):
        layer.new_cache(8).set_padding(8)


def test_truncating_one_sequence_of_a_batch_changes_only_that_sequence(layer):
    """truncate(n, seq=1) in a batch of 3: only sequence 1 shortens (sequence 0's padding,
    longer than n, stays); redoing its dropped tokens gives what the first pass gave, and the
    other sequences' keys, values and next decode outputs are those of a cache never truncated."""
    S, n, pad0 = 12, 7, 9
    x = x_of(3, S, CFG.hidden_size, seed=60)
    cache, kept = layer.new_cache(16, batch=3), layer.new_cache(16, batch=3)
    for c in (cache, kept):
        c.set_padding(pad0, 0)
    y1 = layer.prefill(x, cache)
    layer.prefill(x, kept)
    cache.truncate(n, seq=1)
    assert cache.lengths == (S, n, S) and cache.padding == (pad0, 0, 0)
    y2 = layer.prefill(x[1, n:], cache, seq=1)
    assert cache.lengths == (S, S, S)
    assert rel(y2, y1[1, n:]) <= TOL
    for b in range(3):
        for get in (lambda c: c.keys(b), lambda c: c.values(b)):
            got, want = torch.from_dlpack(get(cache)), torch.from_dlpack(get(kept))
            assert got.shape == want.shape == (CFG.num_key_value_heads, S, CFG.head_dim)
            if b == 1:  # recomputed, possibly in another summation order
                assert rel(got, want) <= TOL
            else:  # never touched
                assert torch.equal(got, want), b
    step = x_of(3, CFG.hidden_size, seed=61)
    got, want = layer.decode(step, cache), layer.decode(step, kept)
    for b in range(3):
        assert rel(got[b], want[b]) <= TOL, b
    assert cache.lengths == kept.lengths == (S + 1,) * 3


def test_left_padded_keys_equal_the_unpadded_sequences_keys(layer):
    """Keys are cached after RoPE, at positions counted from the first real token: a padded
    sequence's real keys equal those of the same tokens without padding, in prefill (chunks
    that straddle the padding) and in decode. Outputs cannot show a position shifted by the
    padding (RoPE sees only position differences); the keys can."""
    P, S = 5, 11
    real, pads = x_of(S, CFG.hidden_size, seed=70), x_of(P, CFG.hidden_size, seed=71)
    cache = layer.new_cache(32, batch=2)
    cache.set_padding(P, 0)
    layer.prefill(torch.cat([pads, real]), cache, seq=0, chunk_size=4)
    layer.prefill(real, cache, seq=1)
    layer.decode(x_of(1, CFG.hidden_size, seed=72).expand(2, -1).contiguous(), cache)
    assert cache.lengths == (P + S + 1, S + 1)
    padded, alone = torch.from_dlpack(cache.keys(0)), torch.from_dlpack(cache.keys(1))
    assert padded.shape == (CFG.num_key_value_heads, P + S + 1, CFG.head_dim)
    assert rel(padded[:, P:P + S], alone[:, :S]) <= TOL  # prefill
    assert rel(padded[:, P + S], alone[:, S]) <= TOL  # decode
