"""torch.compile of a patched model: the layer call is one custom op
(torch.ops.qwen3layer.decoder_layer, qwen3layer/torch/op.py), so a forward and a decode step
compile with fullgraph=True (a graph break would fail the compile), without a graph per
sequence length (Dynamo's frame counter), and give the eager drop-in's numbers. Most cases run
the aot_eager backend (fake tensors, functionalisation: what inductor sees, without its C++
build); one runs inductor itself."""
import copy

import pytest
import torch
import transformers
from torch._dynamo.testing import CompileCounterWithBackend

import qwen3layer.torch as q3t
from hf_reference import tiny_model


def rel(a, b):
    a, b = a.detach().double(), b.detach().double()
    return float((a - b).norm() / b.norm())


@pytest.fixture(autouse=True)
def fresh_dynamo():
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    yield
    torch._dynamo.reset()


def pair(seed):
    model = tiny_model(seed)
    ref = copy.deepcopy(model)
    return q3t.patch_model(model), ref


def ids_of(batch, n, seed):
    return torch.randint(1, 101, (batch, n), generator=torch.Generator().manual_seed(seed))


def transformers_compiles(ref, *args, **kwargs):
    """skips where transformers cannot compile the same call of its own model (4.57 cannot
    compile its forward with fullgraph=True: its cache_position arange is data-dependent)"""
    try:
        torch.compile(copy.deepcopy(ref), fullgraph=True, backend="aot_eager")(*args, **kwargs)
    except Exception as e:  # noqa: BLE001  (whatever transformers' own compile raises)
        pytest.skip(f"transformers {transformers.__version__} does not compile this call itself: {type(e).__name__}")
    finally:
        torch._dynamo.reset()
        torch._dynamo.utils.counters.clear()


def no_graph_breaks():
    return sum(torch._dynamo.utils.counters["graph_break"].values()) == 0


@torch.no_grad()
def test_a_forward_compiles_once_for_every_length():
    model, ref = pair(20)
    transformers_compiles(ref, ids_of(2, 5, 5), use_cache=False)
    counter = CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(model, fullgraph=True, backend=counter)
    for n in (5, 6, 7, 9, 12):
        ids = ids_of(2, n, n)
        assert rel(compiled(ids, use_cache=False).logits, ref(ids, use_cache=False).logits) < 1e-5
    # the first length, then one graph with a symbolic length (automatic dynamic shapes)
    assert counter.frame_count == 2 and no_graph_breaks()
    ops = [n for g in counter.graphs for n in g.graph.nodes if "decoder_layer" in str(n.target)]
    assert len(ops) == 2 * 2  # one op per layer in each graph: the C layer, nothing else


@torch.no_grad()
def test_static_cache_decode_steps_compile_once():
    from transformers import StaticCache
    model, ref = pair(21)
    ids = ids_of(1, 7, 1)
    cache = StaticCache(config=model.config, max_cache_len=24)
    token = model(ids, past_key_values=cache).logits[:, -1:].argmax(-1)  # the prefill, eager
    counter = CompileCounterWithBackend("aot_eager")
    step = torch.compile(model.forward, fullgraph=True, backend=counter)
    tokens = [token]
    for i in range(5):
        where = dict(position_ids=torch.tensor([[7 + i]]))
        if transformers.__version__.startswith("4."):  # 4.57 compiles its step only when told the cache position
            where["cache_position"] = torch.tensor([7 + i])
        token = step(token, past_key_values=cache, **where).logits[:, -1:].argmax(-1)
        tokens.append(token)
    expected = ref.generate(ids, max_new_tokens=6, do_sample=False, pad_token_id=0)[:, 7:]
    assert torch.equal(torch.cat(tokens, 1), expected)
    assert counter.frame_count == 1 and no_graph_breaks()
    assert int(cache.get_seq_length()) == 12


@torch.no_grad()
def test_dynamic_cache_decode_steps_compile():
    model, ref = pair(22)
    ids = ids_of(2, 6, 2)
    ours, theirs = model(ids), ref(ids)
    transformers_compiles(ref, torch.tensor([[1], [2]]), past_key_values=copy.deepcopy(theirs.past_key_values))
    counter = CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(model, fullgraph=True, backend=counter)
    mine, their_cache = ours.past_key_values, theirs.past_key_values
    for i in range(4):
        step = torch.tensor([[3 + i], [9 + i]])
        a = compiled(step, past_key_values=mine).logits
        b = ref(step, past_key_values=their_cache).logits
        assert rel(a, b) < 1e-5
    assert counter.frame_count <= 2 and no_graph_breaks()
    assert mine.get_seq_length() == 10


@torch.no_grad()
def test_generate_with_a_static_cache_and_compile():
    from transformers import CompileConfig
    model, ref = pair(23)
    ids = ids_of(1, 7, 3)
    config = CompileConfig(fullgraph=True, backend="aot_eager")
    config._compile_all_devices = True  # generate compiles on CUDA only, unless told
    kw = dict(max_new_tokens=6, do_sample=False, pad_token_id=0)
    ours = model.generate(ids, cache_implementation="static", compile_config=config, **kw)
    assert torch.equal(ours, ref.generate(ids, **kw))
    assert no_graph_breaks()


@torch.no_grad()
def test_a_compiled_first_call_with_a_cache_is_refused():
    model, _ = pair(24)
    compiled = torch.compile(model, fullgraph=True, backend="aot_eager")
    with pytest.raises(RuntimeError, match="run the first call with a cache .* uncompiled"):
        compiled(ids_of(1, 5, 4))


@torch.no_grad()
def test_inductor_compiles_the_forward():
    model, ref = pair(26)
    transformers_compiles(ref, ids_of(2, 6, 6), use_cache=False)
    compiled = torch.compile(model, fullgraph=True)
    ids = ids_of(2, 6, 6)
    assert rel(compiled(ids, use_cache=False).logits, ref(ids, use_cache=False).logits) < 1e-5
    assert no_graph_breaks()


@torch.no_grad()
def test_compiled_decode_steps_after_a_batch_expansion():
    """beam search's batch_repeat_interleave makes new C caches: compiled steps find them"""
    model, ref = pair(27)
    ids = ids_of(1, 6, 7)
    ours, theirs = model(ids), ref(ids)
    ours.past_key_values.batch_repeat_interleave(2)
    theirs.past_key_values.batch_repeat_interleave(2)
    compiled = torch.compile(model, fullgraph=True, backend="aot_eager")
    step = torch.tensor([[3], [4]])
    a = compiled(step, past_key_values=ours.past_key_values).logits
    assert rel(a, ref(step, past_key_values=theirs.past_key_values).logits) < 1e-5
    assert no_graph_breaks()


@torch.no_grad()
def test_compiled_decode_steps_after_eager_ones():
    """eager decode steps leave the later layers' DynamicLayer views unmade (cache._LazyView,
    whose making Dynamo cannot trace): a compile that starts then traces without a break and
    gives transformers' numbers, the entries' keys too"""
    from qwen3layer.torch import cache
    model, ref = pair(28)
    ids = ids_of(2, 6, 8)
    mine, theirs = model(ids).past_key_values, ref(ids).past_key_values
    for i in range(2):
        step = torch.tensor([[3 + i], [9 + i]])
        assert rel(model(step, past_key_values=mine).logits, ref(step, past_key_values=theirs).logits) < 1e-5
    assert mine.layers[1].__dict__["keys"] is cache._LAZY  # the fast path's layer: views unmade
    compiled = torch.compile(model, fullgraph=True, backend="aot_eager")
    for i in range(2):
        step = torch.tensor([[5 + i], [11 + i]])
        a = compiled(step, past_key_values=mine).logits
        assert rel(a, ref(step, past_key_values=theirs).logits) < 1e-5
    assert no_graph_breaks() and mine.get_seq_length() == 10
    for ours, their in zip(mine.layers, theirs.layers):
        assert rel(ours.keys, their.keys) < 1e-5 and rel(ours.values, their.values) < 1e-5


@pytest.mark.parametrize("flag", ["output_attentions", "output_router_logits", "output_hidden_states"])
@torch.no_grad()
def test_recorded_insides_do_not_compile_with_fullgraph(flag):
    """torch._dynamo's Unsupported: under transformers 5.x from its own output recording (the
    unpatched model fails the same), under 4.57 from the layer's NotImplementedError naming the
    output, which Dynamo reports so"""
    model, ref = pair(28)
    ids = ids_of(2, 5, 8)
    compiled = torch.compile(model, fullgraph=True, backend="aot_eager")
    with pytest.raises(torch._dynamo.exc.Unsupported) as raised:
        compiled(ids, use_cache=False, **{flag: True})
    if transformers.__version__.startswith("4."):
        assert f"{flag} under torch.compile" in str(raised.value)
    torch._dynamo.reset()
    with pytest.raises(torch._dynamo.exc.TorchDynamoException):  # transformers' own model does not compile either
        torch.compile(ref, fullgraph=True, backend="aot_eager")(ids, use_cache=False, **{flag: True})
