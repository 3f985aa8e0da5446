"""Tree verification for speculative decoding (issue 42): DecoderLayer.verify runs a draft
tree (each token sees the cache and its ancestors, at the next position plus its depth) and
KVCache.accept keeps the accepted path's K/V, compacted. Against transformers' layer under the
equivalent 4D mask and position_ids (float64, normal(0, 0.15) attention weights), then the
same decode continuing both; and the prefill's tree argument across passes."""
import pytest
import torch
from transformers.cache_utils import DynamicCache

import qwen3layer as q3
from hf_reference import converted, rel_err, sharp_attention_model
from qwen3layer.testing.runs import run_hf_layer

from test_parity_hf import cpu_path  # noqa: F401  (autouse: the portable path and this CPU's best)


@pytest.fixture(scope="module")
def model():
    return sharp_attention_model()


def ancestors(parents):
    """the tree [T, T] (a token sees its ancestors and itself) and depths [T], written out"""
    T = len(parents)
    tree, depth = torch.zeros(T, T, dtype=torch.bool), []
    for t in range(T):
        u = t
        while u >= 0:
            tree[t, u] = True
            u = int(parents[u])
        depth.append(0 if parents[t] < 0 else depth[int(parents[t])] + 1)
    return tree, torch.tensor(depth)


PARENTS = [torch.tensor([-1, 0, 0, 1, 1, 2, 5, -1, 7]), torch.tensor([-1, 0, 1, 2, 0, 4, 4, 6, 3])]


def prompts(model, lengths, seed):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(n, model.config.hidden_size, generator=g) for n in lengths]


def test_verify_matches_transformers_under_the_tree_mask_then_accept_continues_as_a_plain_decode(model):
    ref = converted(model, torch.float64)
    layer = q3.DecoderLayer.from_hf(model.model.layers[0])
    lengths = [6, 11]
    prefix = prompts(model, lengths, seed=1)
    draft = torch.stack(prompts(model, [9, 9], seed=2))
    cache = layer.new_cache(32, batch=2)
    for s, p in enumerate(prefix):
        layer.prefill(p, cache, s)
    y = layer.verify(draft, cache, torch.stack(PARENTS))
    assert cache.lengths == (15, 20)
    paths = [[0, 2, 5, 6], []]  # sequence 1 accepts nothing
    for s in range(2):
        hf_cache = DynamicCache(config=ref.config)
        run_hf_layer(ref.model.layers[0], ref.model.rotary_emb, prefix[s][None].double(), ref.config, hf_cache)
        tree, depth = ancestors(PARENTS[s])
        allowed = torch.cat([torch.ones(9, lengths[s], dtype=torch.bool), tree], 1)[None]
        want = run_hf_layer(ref.model.layers[0], ref.model.rotary_emb, draft[s][None].double(), ref.config, hf_cache,
                            lengths[s], allowed=allowed, positions=(lengths[s] + depth)[None])
        assert rel_err(y[s], want.y[0]) <= 1e-5
        causal = run_hf_layer(ref.model.layers[0], ref.model.rotary_emb, torch.cat([prefix[s], draft[s]])[None].double(),
                              ref.config)
        assert rel_err(want.y[0], causal.y[0, lengths[s]:]) > 1e-2  # the tree matters at this scale
        cache.accept(s, paths[s])
    assert cache.lengths == (10, 11)
    # continuing: the accepted tokens sit where a plain prefill of them puts them (to the last
    # bits that a call of another size may round differently: tests/layer/test_invariance.py)
    fresh = layer.new_cache(32, batch=2)
    for s in range(2):
        layer.prefill(torch.cat([prefix[s], draft[s][paths[s]]]), fresh, s)
        assert rel_err(torch.from_dlpack(cache.keys(s)), torch.from_dlpack(fresh.keys(s))) <= 1e-6
        assert rel_err(torch.from_dlpack(cache.values(s)), torch.from_dlpack(fresh.values(s))) <= 1e-6
    # transformers, given the accepted path as plain tokens, decodes what the cache decodes
    g = torch.Generator().manual_seed(3)
    xt = torch.randn(2, model.config.hidden_size, generator=g)
    hf_cache = DynamicCache(config=ref.config)
    run_hf_layer(ref.model.layers[0], ref.model.rotary_emb, torch.cat([prefix[0], draft[0][paths[0]]])[None].double(),
                 ref.config, hf_cache)
    want = run_hf_layer(ref.model.layers[0], ref.model.rotary_emb, xt[:1, None].double(), ref.config, hf_cache, 10)
    for step in range(3):
        a, b = layer.decode(xt, cache), layer.decode(xt, fresh)
        assert rel_err(a, b) <= 1e-6
        if step == 0:
            assert rel_err(a[0], want.y[0, 0]) <= 1e-5
        xt = torch.randn(2, model.config.hidden_size, generator=g)


@pytest.mark.parametrize("chunk", [None, 2, 5])
def test_a_prefill_tree_across_passes_and_its_maps(model, chunk):
    """the tree's rows are the call's, whatever the pass: a chunked call gives the whole
    call's numbers, and the maps put no weight outside the tree"""
    ref = converted(model, torch.float64)
    layer = q3.DecoderLayer.from_hf(model.model.layers[0])
    x = prompts(model, [9], seed=5)[0]
    tree, depth = ancestors(PARENTS[1])
    positions = 3 + depth
    cache = layer.new_cache(16)
    trace = layer.prefill(x, cache, chunk_size=chunk, tree=tree, positions=positions, return_attention=True)
    want = run_hf_layer(ref.model.layers[0], ref.model.rotary_emb, x[None].double(), ref.config, allowed=tree[None],
                        positions=positions[None])
    assert rel_err(trace.output, want.y[0]) <= 1e-5
    assert torch.all(trace.attention[0].masked_select(~tree[None]) == 0)
    assert rel_err(trace.attention[0], want.attention[0].float()) <= 1e-5


def test_accept_refuses_what_is_not_after_a_verify_and_changes_nothing(model):
    layer = q3.DecoderLayer.from_hf(model.model.layers[0])
    cache = layer.new_cache(32, batch=2)
    x = prompts(model, [4], seed=6)[0]
    layer.prefill(x, cache, 0)
    with pytest.raises(RuntimeError, match="accept: sequence 0's last call was not a verify"):
        cache.accept(0, [0])
    layer.verify(x, cache, PARENTS[0][:4], 0)
    before = (cache.lengths, torch.from_dlpack(cache.keys(0)).clone())
    for kept, message in (([1, 1], r"kept\[1\]: expected increasing indices of the 4 tokens of the verify \(0 to 3\), "
                                   r"got 1"),
                          ([0, 4], r"kept\[1\]: expected increasing indices .* got 4"),
                          ([-1], r"kept\[0\]: .* got -1")):
        with pytest.raises(ValueError, match=message):
            cache.accept(0, kept)
    with pytest.raises(IndexError, match="seq: expected 0 <= seq < 2"):
        cache.accept(2, [0])
    assert cache.lengths == before[0] and torch.equal(torch.from_dlpack(cache.keys(0)), before[1])
    cache.reorder([0, 1])  # any operation forgets the verify
    with pytest.raises(RuntimeError, match="accept: sequence 0's last call was not a verify"):
        cache.accept(0, [0])
    layer.verify(x, cache, PARENTS[0][:4], 0)
    layer.decode(torch.randn(2, model.config.hidden_size), cache)  # and so does any call
    with pytest.raises(RuntimeError, match="accept: sequence 0's last call was not a verify"):
        cache.accept(0, [0])


@pytest.mark.parametrize("kw, error, message", [
    (dict(parents=torch.tensor([-1, 0, 2, 1])), ValueError,
     r"parents\[0, 2\]: expected -1 \(a root, after the cache\) or an earlier token of the tree \(0 to 1\), got 2"),
    (dict(parents=torch.tensor([-1, -2, 0, 1])), ValueError, r"parents\[0, 1\]: .* got -2"),
    (dict(parents=torch.tensor([-1, 0, 0], dtype=torch.int64)), ValueError,
     r"parents: expected one entry a token of x \(4 a sequence\), got shape \[3\]"),
    (dict(parents=torch.tensor([-1, 0, 0, 1], dtype=torch.int32)), TypeError, "parents: expected dtype int64"),
])
def test_verify_refuses_a_bad_tree_before_any_work(model, kw, error, message):
    layer = q3.DecoderLayer.from_hf(model.model.layers[0])
    cache = layer.new_cache(16)
    with pytest.raises(error, match=message):
        layer.verify(prompts(model, [4], seed=7)[0], cache, **kw)
    assert cache.lengths == (0,)


@pytest.mark.parametrize("edit, message", [
    (lambda t: t.fill_diagonal_(False), r"tree\[0, 0, 0\]: expected True \(a token sees itself and tokens before it "
                                        r"only\), got False"),
    (lambda t: t.__setitem__((1, 3), True), r"tree\[0, 1, 3\]: expected False .* got True"),
])
def test_a_tree_must_see_itself_and_only_earlier_tokens(model, edit, message):
    layer = q3.DecoderLayer.from_hf(model.model.layers[0])
    cache = layer.new_cache(16)
    tree = torch.ones(4, 4, dtype=torch.bool).tril()
    edit(tree)
    with pytest.raises(ValueError, match=message):
        layer.prefill(prompts(model, [4], seed=8)[0], cache, tree=tree)
    with pytest.raises(ValueError, match="tree: given with token_mask"):
        layer.prefill(prompts(model, [4], seed=8)[0], cache, tree=torch.ones(4, 4, dtype=torch.bool).tril(),
                      token_mask=torch.ones(4, dtype=torch.bool))
    assert cache.lengths == (0,)


@pytest.mark.parametrize("tree, error, message", [
    (torch.ones(4, 3, dtype=torch.bool).tril(), ValueError, r"tree: expected shape \[4, 4\], got \[4, 3\]"),
    (torch.ones(2, 4, 4, dtype=torch.bool).tril(), ValueError, r"tree: expected shape \[4, 4\], got \[2, 4, 4\]"),
    (torch.ones(4, 4, dtype=torch.float32).tril(), TypeError, "tree: expected dtype bool"),
    (torch.ones(4, 4, dtype=torch.bool).tril().t().contiguous().t(), ValueError, "tree: .*contiguous"),
])
def test_a_tree_of_another_shape_dtype_or_layout_is_refused_by_name(model, tree, error, message):
    """q3_call_check_tree_input: the tree is [tokens, tokens] as x ([batch, tokens, tokens] for
    a [batch, tokens, hidden] x), bool, contiguous; refused before any work"""
    layer = q3.DecoderLayer.from_hf(model.model.layers[0])
    cache = layer.new_cache(16)
    with pytest.raises(error, match=message):
        layer.prefill(prompts(model, [4], seed=9)[0], cache, tree=tree)
    assert cache.lengths == (0,) and cache.hidden == ((),)


@pytest.mark.parametrize("seq", [2, -1, 5])
def test_verify_of_a_sequence_outside_the_batch_is_refused_before_its_state_is_read(model, seq):
    """q3_tree_inputs reads the sequence's length and padding: its index is checked first (an
    out-of-range seq read past the cache's arrays before)"""
    layer = q3.DecoderLayer.from_hf(model.model.layers[0])
    cache = layer.new_cache(16, batch=2)
    message = rf"seq: expected 0 <= seq < 2 \(the cache's batch\), got {seq}"
    with pytest.raises(IndexError, match=message):
        cache._tree_inputs(torch.tensor([-1, 0]), seq)  # returned, having read past the arrays, before
    with pytest.raises(IndexError, match=message):
        layer.verify(prompts(model, [2], seed=10)[0], cache, torch.tensor([-1, 0]), seq=seq)
    assert cache.lengths == (0, 0)
