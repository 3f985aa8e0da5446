"""The drop-in's fast path (qwen3layer.torch.DecoderLayer._repeat): the decode steps of a layer
after the first of a model call repeat the plan that first layer made. Each test changes one
thing the plan or the full path's checks read, between the model call's first layer and a
later one (a forward pre-hook on that layer), and asserts what the full path gives for it:
transformers' numbers, or its refusal. Without the fast path's guard for that thing, the
changed call would run on the repeated plan (checked by hand: each test fails with its guard
removed). A 3-layer tiny model (layer 0 plans, layers 1 and 2 repeat), the hook on layer 2."""
import copy
import gc
import itertools
import weakref

import pytest
import torch

import qwen3layer.torch as q3t
from hf_reference import greedy, left_padded, tiny_model

LAYER = 2  # the layer whose call the hooks change (layer 0 makes the model call's plan)


def rel(a, b):
    a, b = a.detach().double(), b.detach().double()
    return float((a - b).norm() / b.norm())


def pair(seed, **config):
    model = tiny_model(seed, num_hidden_layers=3, **config)
    ref = copy.deepcopy(model)
    return q3t.patch_model(model), ref


def on_layer(model, change):
    """a forward pre-hook on layer LAYER: change(layer, args, kwargs) -> (args, kwargs) or None"""
    return model.model.layers[LAYER].register_forward_pre_hook(
        lambda layer, args, kwargs: change(layer, args, kwargs), with_kwargs=True)


PROMPT = torch.randint(1, 101, (1, 6), generator=torch.Generator().manual_seed(3))


def prefilled(model, ids=PROMPT, **kw):
    """the model's cache after a prefill of ids and one decode step (whose layers after the
    first take the fast path), and the next step's input"""
    with torch.no_grad():
        out = model(ids, use_cache=True, **kw)
        step = out.logits[:, -1:].argmax(-1)
        out = model(step, past_key_values=out.past_key_values)
    return out.past_key_values, out.logits[:, -1:].argmax(-1)


def decode(model, cache, step, change, **kw):
    handle = on_layer(model, change)
    try:
        with torch.no_grad():
            return model(step, past_key_values=cache, **kw)
    finally:
        handle.remove()


@pytest.fixture
def fast_calls(monkeypatch):
    """the calls the fast path served (layer index, per call)"""
    served = []
    repeat = q3t.DecoderLayer._repeat

    def counted(self, *args):
        y = repeat(self, *args)
        if y is not None:
            served.append(self.layer_idx)
        return y

    monkeypatch.setattr(q3t.DecoderLayer, "_repeat", counted)
    return served


@pytest.mark.parametrize("static", [False, True])
@torch.no_grad()
def test_later_layers_decode_on_the_fast_path_with_transformers_numbers(fast_calls, static):
    model, ref = pair(21)
    kw = dict(max_new_tokens=6, do_sample=False, pad_token_id=0, return_dict_in_generate=True)
    if static:
        kw["cache_implementation"] = "static"
    ours, theirs = model.generate(PROMPT, **kw), ref.generate(PROMPT, **kw)
    assert torch.equal(ours.sequences, theirs.sequences)
    for a, b in zip(ours.past_key_values.layers, theirs.past_key_values.layers):
        assert a.keys.shape == b.keys.shape and rel(a.keys, b.keys) < 1e-6 and rel(a.values, b.values) < 1e-6
        assert int(a.get_seq_length()) == int(b.get_seq_length())
    assert sorted(fast_calls) == [1] * 5 + [2] * 5  # the 5 decode steps of layers 1 and 2; layer 0 plans


@torch.no_grad()
def test_host_layers_take_their_input_as_a_capsule_without_torchs_export(monkeypatch):
    """a host layer's C call is handed its input's capsule (cache._TO_CAPSULE), not the tensor,
    whose __dlpack_device__ and __dlpack__ the extension would call (~6 us of Python a call);
    the tokens are transformers', and a torch without the capsule maker hands the tensor over"""
    model, ref = pair(23)
    exports = []
    for name in ("__dlpack__", "__dlpack_device__"):
        original = getattr(torch.Tensor, name)
        monkeypatch.setattr(torch.Tensor, name, lambda t, *a, _o=original, _n=name, **k: (exports.append(_n),
                                                                                           _o(t, *a, **k))[1])
    kw = dict(max_new_tokens=4, do_sample=False, pad_token_id=0)
    want = ref.generate(PROMPT, **kw)
    exports.clear()
    assert torch.equal(model.generate(PROMPT, **kw), want)
    assert exports == []
    monkeypatch.setattr(q3t._fast, "_TO_CAPSULE", lambda t: t)
    assert torch.equal(model.generate(PROMPT, **kw), want)
    assert exports.count("__dlpack__") == 3 * 4  # 3 layers, the prompt's call and 3 decode steps


class Exporting(torch.Tensor):
    """a tensor subclass that counts its own __dlpack__ calls (a subclass's export may differ from
    torch's: the drop-in must not read its memory past it)"""
    exports = 0

    def __dlpack__(self, *args, **kwargs):
        type(self).exports += 1
        return super().__dlpack__(*args, **kwargs)


@torch.no_grad()
def test_a_tensor_subclass_input_is_exported_by_its_own_dlpack():
    """the full path's host call hands a subclass over as itself (its __dlpack__ asked), a plain
    tensor as its capsule (none asked); the same numbers either way"""
    model, _ = pair(24)
    layer = model.model.layers[0]
    x = torch.randn(1, 5, layer.core.config.hidden_size, generator=torch.Generator().manual_seed(4))
    kw = dict(position_embeddings=model.model.rotary_emb(x, torch.arange(5)[None]), position_ids=torch.arange(5)[None])
    first = lambda y: y[0] if isinstance(y, tuple) else y  # noqa: E731
    Exporting.exports = 0
    plain = first(layer(x, **kw))
    assert Exporting.exports == 0
    got = first(layer(x.as_subclass(Exporting), **kw))
    assert Exporting.exports == 1 and torch.equal(got.as_subclass(torch.Tensor), plain)


@torch.no_grad()
def test_a_left_padded_batch_takes_the_fast_path_with_transformers_numbers(fast_calls):
    model, ref = pair(22)
    ids, mask = left_padded([3, 6], 6, seed=5)
    kw = dict(attention_mask=mask, max_new_tokens=4, do_sample=False, pad_token_id=0)
    assert torch.equal(model.generate(ids, **kw), ref.generate(ids, **kw))
    assert len(fast_calls) == 2 * 3


HOLE = "not the cache's causal attention: query 0 of batch row 0 .* attends to keys 1-7"  # the full path's refusal


def hole(mask):
    """mask with key 0 masked for every query (a cached token hidden: the full path refuses it)"""
    if mask.dtype == torch.bool:
        mask[..., 0] = False
    else:
        mask[..., 0] = torch.finfo(mask.dtype).min
    return mask


def test_a_mask_changed_in_place_is_planned_again():  # the mask's stamp (its version)
    model, _ = pair(23)
    cache, step = prefilled(model)

    def change(layer, args, kwargs):
        hole(kwargs["attention_mask"])

    with pytest.raises(ValueError, match=HOLE):
        decode(model, cache, step, change)


def test_another_mask_is_planned_again():  # the mask's identity (a new tensor's version is 0, as the model's)
    model, _ = pair(23)
    cache, step = prefilled(model)

    def change(layer, args, kwargs):
        mask = kwargs["attention_mask"]
        assert mask._version == 0
        return args, dict(kwargs, attention_mask=hole(mask.clone()).clone())  # (the hole made in place: version 1)

    with pytest.raises(ValueError, match=HOLE):
        decode(model, cache, step, change)


def test_position_ids_changed_in_place_are_planned_again():
    model, _ = pair(24)
    cache, step = prefilled(model)

    def change(layer, args, kwargs):
        kwargs["position_ids"].add_(1)

    with pytest.raises(ValueError, match=r"first real tokens are at positions \[1\] for this call, at \[0\]"):
        decode(model, cache, step, change)


def test_other_position_ids_are_planned_again():
    model, _ = pair(24)
    cache, step = prefilled(model)

    def change(layer, args, kwargs):
        return args, dict(kwargs, position_ids=kwargs["position_ids"] + 1)

    with pytest.raises(ValueError, match=r"first real tokens are at positions \[1\] for this call, at \[0\]"):
        decode(model, cache, step, change)


@pytest.mark.parametrize("how", ["in place", "replaced"])
def test_cache_position_changed_is_planned_again(how):  # transformers 4.57 passes it, 5.x passes it on
    model, _ = pair(25)
    cache, step = prefilled(model)

    def change(layer, args, kwargs):
        if how == "in place":
            kwargs["cache_position"].add_(1)
        else:
            return args, dict(kwargs, cache_position=kwargs["cache_position"] + 1)

    with pytest.raises(ValueError, match=r"cache_position: expected 7 to 7 .*, got \[8\]"):
        decode(model, cache, step, change, cache_position=torch.tensor([7]))


@torch.no_grad()
def test_a_decode_step_asking_for_the_insides_gives_every_layers():  # such a call's plan is not repeated
    model, ref = pair(26)
    cache, step = prefilled(model)
    ref_cache, _ = prefilled(ref)
    kw = dict(output_attentions=True, output_router_logits=True, output_hidden_states=True)
    ours, theirs = model(step, past_key_values=cache, **kw), ref(step, past_key_values=ref_cache, **kw)
    for key in ("attentions", "router_logits", "hidden_states"):
        a, b = getattr(ours, key), getattr(theirs, key)
        assert len(a) == len(b) == (4 if key == "hidden_states" else 3)
        assert all(x.shape == y.shape and rel(x, y) < 1e-5 for x, y in zip(a, b))


@pytest.mark.parametrize("key", ["router_logits", "attentions", "hidden_states"])
def test_insides_asked_of_one_layer_leave_the_fast_path(key):
    model, _ = pair(26)
    cache, step = prefilled(model)

    def change(layer, args, kwargs):
        return args, dict(kwargs, **{f"output_{key}": True})  # no transformers recorder listens

    with pytest.raises(NotImplementedError, match=f"layer {LAYER}: output_{key}: no recorder"):
        decode(model, cache, step, change)


def test_cu_seq_lens_given_to_one_layer_leave_the_fast_path():
    model, _ = pair(26)
    cache, step = prefilled(model)

    def change(layer, args, kwargs):
        return args, dict(kwargs, cu_seq_lens_q=torch.tensor([0, 2], dtype=torch.int32))

    with pytest.raises(ValueError, match=r"cu_seq_lens_q: expected increasing offsets from 0 to 1 .*, got \[0, 2\]"):
        decode(model, cache, step, change)


@pytest.mark.parametrize("static", [False, True])
def test_a_layer_whose_c_cache_holds_other_lengths_leaves_the_fast_path(static):
    from transformers import StaticCache

    model, _ = pair(27)
    cache, step = prefilled(model, **({"past_key_values": StaticCache(config=model.config, max_cache_len=16)}
                                      if static else {}))

    def change(layer, args, kwargs):
        cache.layers[LAYER]._q3_cache.crop(-1)  # that layer's C cache alone one token shorter

    if static:  # the mask's query sees key 7, which the C cache does not hold
        with pytest.raises(ValueError, match="not a contiguous run of keys ending at the query"):
            decode(model, cache, step, change)
    else:  # seen_tokens: the entry's keys still hold 7
        with pytest.raises(RuntimeError, match=f"layer {LAYER}: the model cache's keys hold 7 tokens, this layer's C "
                                               "cache 6"):
            decode(model, cache, step, change)


def generate_positions(mask):
    """position_ids as generate makes them for a left-padded batch: from 0 at the first real token"""
    return (mask.cumsum(-1) - 1).clamp(min=0)


def test_a_layer_whose_cache_holds_other_padding_leaves_the_fast_path():
    model, _ = pair(28)
    ids, mask = left_padded([3, 6], 6, seed=6)  # padding (3, 0), first positions (0, 0) as generate puts them
    with torch.no_grad():
        cache = model(ids, attention_mask=mask, position_ids=generate_positions(mask), use_cache=True).past_key_values
    more = torch.cat([mask, torch.ones(2, 1, dtype=torch.long)], 1)
    step = torch.tensor([[1], [2]])
    pos = generate_positions(more)[:, -1:]
    assert model.model.layers[LAYER].kv_cache.padding == (3, 0)
    assert model.model.layers[LAYER].kv_cache.first_positions == (0, 0)

    def change(layer, args, kwargs):
        cache.layers[LAYER].reorder_cache(torch.tensor([1, 0]))  # that layer's sequences swapped

    with pytest.raises(ValueError, match="not the cache's causal attention"):
        decode(model, cache, step, change, attention_mask=more, position_ids=pos)


def test_a_layer_whose_cache_starts_at_other_positions_leaves_the_fast_path():
    model, _ = pair(28)
    ids = torch.randint(1, 101, (2, 5), generator=torch.Generator().manual_seed(7))
    pos = torch.tensor([[0, 1, 2, 3, 4], [3, 4, 5, 6, 7]])  # first positions (0, 3), no padding
    with torch.no_grad():
        out = model(ids, position_ids=pos, use_cache=True)
    cache, step = out.past_key_values, torch.tensor([[1], [2]])
    assert model.model.layers[LAYER].kv_cache.first_positions == (0, 3)

    def change(layer, args, kwargs):
        cache.layers[LAYER].reorder_cache(torch.tensor([1, 0]))

    with pytest.raises(ValueError, match=r"first real tokens are at positions \[0, 3\] for this call, at \[3, 0\]"):
        decode(model, cache, step, change, position_ids=torch.tensor([[5], [8]]))


def test_a_layer_whose_cache_hides_other_tokens_leaves_the_fast_path(fast_calls):
    """the same lengths, padding and first positions, but its last cached token hidden (by a
    core call's token_mask): the plan reads the hidden tokens too (plan_state), and the full
    path refuses the mask that shows that token"""
    model, _ = pair(29)
    cache, step = prefilled(model)
    layer = model.model.layers[LAYER]

    def change(_, args, kwargs):
        kv = cache.layers[LAYER]._q3_cache
        kv.crop(kv.lengths[0] - 1)  # that token written again, hidden from later queries
        layer.core.prefill(torch.randn(1, 1, layer.core.config.hidden_size), kv, token_mask=torch.tensor([[False]]))
        assert kv.plan_state == ((7,), (0,), (0,), ((6,),))

    fast_calls.clear()
    with pytest.raises(ValueError, match="batch row 0 shows cached token 6, which the C cache shows .*hidden tokens "
                                         r"\[6\]"):
        decode(model, cache, step, change)
    assert fast_calls == [1]


@pytest.mark.parametrize("how", ["data", "reassigned"])
def test_weights_replaced_between_layers_are_refused(how):
    model, _ = pair(29)
    cache, step = prefilled(model)

    def change(layer, args, kwargs):
        proj = layer.self_attn.q_proj
        if how == "data":
            proj.weight.data = proj.weight.data.clone()
        else:
            proj.weight = torch.nn.Parameter(proj.weight.detach().clone())

    with pytest.raises(RuntimeError, match=f"layer {LAYER}: self_attn.q_proj.weight is no longer the tensor"):
        decode(model, cache, step, change)


def test_a_layer_put_in_training_mode_leaves_the_fast_path():
    model, _ = pair(30, attention_dropout=0.1)
    cache, step = prefilled(model)

    def change(layer, args, kwargs):
        layer.train()

    with pytest.raises(RuntimeError, match=f"layer {LAYER}: attention_dropout=0.1 in training mode"):
        decode(model, cache, step, change)


def test_a_layer_called_with_gradients_enabled_leaves_the_fast_path(monkeypatch):
    model, ref = pair(30)
    cache, step = prefilled(model)
    ref_cache, _ = prefilled(ref)
    monkeypatch.setattr(q3t, "_GRAD_WARNED", [False])  # the warning is given once a process

    def change(layer, args, kwargs):
        torch.set_grad_enabled(True)  # until the test's no_grad ends: layer 2 only

    with pytest.warns(UserWarning, match="run with gradients enabled but no gradient flows"):
        ours = decode(model, cache, step, change).logits
    with torch.no_grad():
        assert rel(ours, ref(step, past_key_values=ref_cache).logits) < 1e-5


def test_hidden_states_that_require_grad_are_detached_as_the_full_path_does():
    model, ref = pair(31)
    cache, step = prefilled(model)
    ref_cache, _ = prefilled(ref)

    def change(layer, args, kwargs):
        return (args[0].detach().clone().requires_grad_(),) + args[1:], kwargs

    ours = decode(model, cache, step, change).logits
    with torch.no_grad():
        assert rel(ours, ref(step, past_key_values=ref_cache).logits) < 1e-5


def test_hidden_states_of_another_shape_or_kind_leave_the_fast_path():
    model, _ = pair(31)
    cache, step = prefilled(model)

    def longer(layer, args, kwargs):
        return (torch.cat([args[0], args[0]], 1),) + args[1:], kwargs

    def not_torch(layer, args, kwargs):
        return (args[0].numpy(),) + args[1:], kwargs

    with pytest.raises(ValueError, match=r"position_ids: expected \[1, 2\]"):
        decode(model, cache, step, longer)
    cache, step = prefilled(model)  # (layers 0 and 1 took the refused call's token)
    with pytest.raises(TypeError, match="hidden_states: expected a torch.Tensor, got ndarray"):
        decode(model, cache, step, not_torch)


def test_an_entry_of_another_class_is_refused():
    model, _ = pair(32)
    cache, step = prefilled(model)

    def change(layer, args, kwargs):
        entry = cache.layers[LAYER]
        entry.__class__ = type("OffloadedLayer", (type(entry),), {})

    with pytest.raises(NotImplementedError, match="cache layer of type Q3MirroredDynamicLayer cannot hold"):
        decode(model, cache, step, change)


def test_an_entry_not_initialized_or_without_its_c_cache_leaves_the_fast_path():
    model, _ = pair(32)
    cache, step = prefilled(model)

    def uninitialized(layer, args, kwargs):
        cache.layers[LAYER].is_initialized = False

    with pytest.raises(ValueError, match="not a contiguous run of keys ending at the query"):
        decode(model, cache, step, uninitialized)
    cache, step = prefilled(model)

    def without(layer, args, kwargs):
        del cache.layers[LAYER]._q3_cache

    with pytest.raises(RuntimeError, match=f"layer {LAYER}: the model cache holds 7 tokens this layer never saw"):
        decode(model, cache, step, without)


def test_an_entry_whose_keys_were_replaced_is_refused():
    model, _ = pair(33)
    cache, step = prefilled(model)

    def change(layer, args, kwargs):
        entry = cache.layers[LAYER]
        entry.keys = entry.keys[..., :-1, :].clone()

    with pytest.raises(RuntimeError, match=f"layer {LAYER}: the model cache's keys hold 6 tokens, this layer's C"):
        decode(model, cache, step, change)


def test_a_static_entry_of_another_length_is_refused():
    from transformers import StaticCache

    model, _ = pair(33)
    cache = StaticCache(config=model.config, max_cache_len=16)
    cache, step = prefilled(model, past_key_values=cache)

    def change(layer, args, kwargs):
        cache.layers[LAYER].max_cache_len = 12

    with pytest.raises(RuntimeError, match=f"layer {LAYER}: the C cache holds 16 tokens a sequence, the static "
                                           "cache 12"):
        decode(model, cache, step, change)


def test_a_static_entry_whose_keys_were_replaced_gets_the_c_cache_views_back():
    from transformers import StaticCache

    model, ref = pair(33)
    cache, step = prefilled(model, past_key_values=StaticCache(config=model.config, max_cache_len=16))
    ref_cache, _ = prefilled(ref, past_key_values=StaticCache(config=ref.config, max_cache_len=16))

    def change(layer, args, kwargs):  # the full path's publish takes the views again
        cache.layers[LAYER].keys = torch.zeros_like(cache.layers[LAYER].keys)

    ours = decode(model, cache, step, change).logits
    with torch.no_grad():
        assert rel(ours, ref(step, past_key_values=ref_cache).logits) < 1e-5
    a, b = cache.layers[LAYER], ref_cache.layers[LAYER]
    assert rel(a.keys, b.keys) < 1e-6 and a.keys.data_ptr() == a._q3_cache.all_keys().data_ptr


def test_the_compiled_op_finds_the_model_cache_a_decode_step_used():
    from qwen3layer.torch import op

    model, _ = pair(34)
    cache, step = prefilled(model)
    other = copy.copy(cache)  # another model cache object holding the same entries
    with torch.no_grad():
        model(step, past_key_values=other)
    entry = other.layers[LAYER]
    assert op._model_cache(entry.keys, LAYER) is other
    entry.crop(-1)  # new views: registered for the entry's model cache, the one of its last call
    assert op._model_cache(entry.keys, LAYER) is other


def test_a_lower_token_limit_of_one_layer_is_refused():
    model, _ = pair(34)
    cache, step = prefilled(model)

    def change(layer, args, kwargs):
        layer.max_tokens = 7

    from qwen3layer import CacheFullError
    with pytest.raises(CacheFullError, match=r"8 tokens, past patch_model\(max_tokens=7\)"):
        decode(model, cache, step, change)


@torch.no_grad()
def test_growing_past_the_first_capacity_gives_transformers_tokens():
    model, ref = pair(35)
    ids = torch.randint(1, 101, (1, 253), generator=torch.Generator().manual_seed(8))  # 256 reached mid-way
    assert torch.equal(greedy(model, ids, 6), greedy(ref, ids, 6))
    assert model.model.layers[LAYER].kv_cache.capacity == 512


@torch.no_grad()
def test_a_hook_on_the_hidden_states_recorder_sees_every_decode_step():
    model, ref = pair(36)
    seen, theirs = [], []
    model.model.layers[LAYER].recorders["hidden_states"].register_forward_hook(
        lambda m, args, kwargs, out: seen.append(out[-1].clone()), with_kwargs=True)  # (..., the layer's output)
    ref.model.layers[LAYER].register_forward_hook(
        lambda m, args, out: theirs.append((out[0] if isinstance(out, tuple) else out).clone()))
    assert torch.equal(greedy(model, PROMPT, 4), greedy(ref, PROMPT, 4))
    assert len(seen) == len(theirs) == 4
    assert all(rel(a, b) < 1e-5 for a, b in zip(seen, theirs))


@torch.no_grad()
def test_a_selected_batch_continues_on_its_new_c_caches():
    model, ref = pair(37)
    ids = torch.randint(1, 101, (2, 5), generator=torch.Generator().manual_seed(9))
    ours, theirs = model(ids, use_cache=True), ref(ids, use_cache=True)
    for out in (ours, theirs):
        out.past_key_values.batch_select_indices(torch.tensor([1]))
    step = torch.tensor([[7]])
    a = model(step, past_key_values=ours.past_key_values).logits
    b = ref(step, past_key_values=theirs.past_key_values).logits
    assert rel(a, b) < 1e-5
    for i, layer in enumerate(model.model.layers):
        assert layer.kv_cache is ours.past_key_values.layers[i]._q3_cache and layer.kv_cache.batch == 1


def test_a_continuing_calls_plan_takes_the_masks_the_row_by_row_reading_takes():
    """masks.plan_call reads a call continuing a cache with one comparison over the batch
    (masks._continues); it must accept exactly the masks whose every row masks._plan_row
    accepts (random rows, rows of the expected run with one key flipped, the expected run;
    padding up to one past the tokens held)"""
    from qwen3layer.torch import masks

    g = torch.Generator().manual_seed(10)
    seen = {True: 0, False: 0}
    for batch, length, past in [(1, 1, 0), (1, 1, 3), (2, 1, 4), (1, 2, 2), (2, 3, 1), (2, 2, 0)]:
        width = past + length + 1
        for pads in itertools.product(range(past + 2), repeat=batch):
            for trial in range(24):
                allowed = torch.rand(batch, length, width, generator=g) < 0.6
                for b in range(batch):
                    for t in range(length):
                        if trial % 3:
                            allowed[b, t] = False
                            allowed[b, t, pads[b]:past + t + 1] = True
                if trial % 3 == 1:
                    b, t, k = (int(torch.randint(n, (1,), generator=g)) for n in (batch, length, width))
                    allowed[b, t, k] = not allowed[b, t, k]
                try:
                    rows = [masks._plan_row(allowed[b], b, past, pads[b]) for b in range(batch)]
                    accepted = all(all(real) for _, real in rows)
                except ValueError:
                    accepted = False
                assert masks._continues(allowed, past, pads) == accepted, (past, pads, allowed)
                seen[accepted] += 1
    assert min(seen.values()) > 100


def test_a_finished_generation_is_not_kept_alive_by_its_last_plan():
    model, _ = pair(38)
    masks = []
    model.model.layers[LAYER].register_forward_pre_hook(
        lambda m, args, kwargs: masks.append(weakref.ref(kwargs["attention_mask"])), with_kwargs=True)
    with torch.no_grad():
        out = greedy(model, PROMPT, 3)
    del out
    gc.collect()
    assert len(masks) == 3 and all(ref() is None for ref in masks)


class _Watched:
    """a model cache's class made so that reading its `layers` runs code (a property): once
    armed, the next read replaces layer LAYER's q_proj weight by a copy"""

    def __init__(self, model, cache):
        self.model, self.armed, self.replaced = model, False, []
        entries = cache.__dict__.pop("layers")
        watch = self

        def layers(_):
            if watch.armed:
                watch.armed = False
                proj = watch.model.model.layers[LAYER].self_attn.q_proj
                watch.replaced.append(proj.weight.data)  # (kept alive: the C layer may still read it)
                proj.weight.data = proj.weight.data.clone()
            return entries

        cache.__class__ = type("Watched" + type(cache).__name__, (type(cache),), {"layers": property(layers)})

    def arm(self, layer, args, kwargs):
        self.armed = True


@pytest.mark.parametrize("when", ["prefill", "decode"])
def test_weights_replaced_by_the_model_caches_code_are_refused(when):
    """the full path checks the weights after it read the model cache (whose code may change
    them), before the C layer: layer LAYER's call, whose reading of `layers` replaces its
    weight, is refused (checked before that reading, it would run on the replaced one)"""
    from transformers import DynamicCache

    model, _ = pair(39)
    if when == "prefill":
        cache, ids = DynamicCache(config=model.config), PROMPT
    else:
        cache, ids = prefilled(model)
    watch = _Watched(model, cache)
    with pytest.raises(RuntimeError, match=f"layer {LAYER}: self_attn.q_proj.weight is no longer the tensor"):
        decode(model, cache, ids, watch.arm)
    assert len(watch.replaced) == 1


def test_a_model_cache_whose_layers_run_code_leaves_the_fast_path(fast_calls):
    """the fast path reads the model cache's own list of entries (its __dict__): a class
    whose `layers` is a property, whose code runs when read, is left to the full path, with
    transformers' numbers"""
    model, ref = pair(39)
    cache, step = prefilled(model)
    ref_cache, _ = prefilled(ref)
    _Watched(model, cache)
    fast_calls.clear()
    with torch.no_grad():
        ours = model(step, past_key_values=cache).logits
        assert rel(ours, ref(step, past_key_values=ref_cache).logits) < 1e-5
    assert fast_calls == []


def test_a_static_entrys_views_are_kept_by_the_fast_path(fast_calls):
    """a StaticLayer's keys and values are as wide as its max_cache_len whatever the tokens
    held: a decode step on the fast path keeps the views it was given (no new tensor a step),
    and they stay views of its C cache, with transformers' numbers"""
    from transformers import StaticCache

    model, ref = pair(40)
    cache, step = prefilled(model, past_key_values=StaticCache(config=model.config, max_cache_len=16))
    ref_cache, _ = prefilled(ref, past_key_values=StaticCache(config=ref.config, max_cache_len=16))
    entry = cache.layers[LAYER]
    keys, values = entry.keys, entry.values
    fast_calls.clear()
    with torch.no_grad():
        ours = model(step, past_key_values=cache).logits
        assert rel(ours, ref(step, past_key_values=ref_cache).logits) < 1e-5
    assert fast_calls == [1, LAYER]
    assert entry.keys is keys and entry.values is values
    assert keys.data_ptr() == entry._q3_cache.all_keys().data_ptr and rel(keys, ref_cache.layers[LAYER].keys) < 1e-6
    assert int(entry.cumulative_length) == int(ref_cache.layers[LAYER].cumulative_length) == 8


@pytest.mark.parametrize("how", ["replaced", "moved"])
def test_a_static_counter_replaced_or_moved_is_counted_where_it_now_is(fast_calls, how):
    """a StaticLayer's cumulative_length is counted in its memory once the fast path has
    counted it: a counter replaced by another tensor, or given other memory (.data =), is
    counted where it now is, the old one left alone, as transformers' add_ would"""
    from transformers import StaticCache

    model, ref = pair(42)
    cache, step = prefilled(model, past_key_values=StaticCache(config=model.config, max_cache_len=16))
    ref_cache, _ = prefilled(ref, past_key_values=StaticCache(config=ref.config, max_cache_len=16))
    entry = cache.layers[LAYER]
    old = entry.cumulative_length
    if how == "replaced":
        entry.cumulative_length = old.clone()
    else:
        keep = old.data
        old.data = keep.clone()
    fast_calls.clear()
    with torch.no_grad():
        for _ in range(2):
            ours = model(step, past_key_values=cache).logits
            assert rel(ours, ref(step, past_key_values=ref_cache).logits) < 1e-5
            step = ours[:, -1:].argmax(-1)
    assert fast_calls == [1, LAYER] * 2
    assert int(entry.cumulative_length) == int(ref_cache.layers[LAYER].cumulative_length) == 9
    assert int(old if how == "replaced" else keep) == 7  # counted no more where it was


def test_a_declined_fast_call_is_not_tried_twice(monkeypatch):
    """a later layer's decode call goes to the fast path from forward, and where it declines
    (here: hidden states that need a gradient) to the full path without trying it again"""
    model, ref = pair(41)
    cache, step = prefilled(model)
    ref_cache, _ = prefilled(ref)
    tried = []
    repeat = q3t.DecoderLayer._repeat

    def counted(self, *args):
        y = repeat(self, *args)
        tried.append((self.layer_idx, y is not None))
        return y

    monkeypatch.setattr(q3t.DecoderLayer, "_repeat", counted)

    def change(layer, args, kwargs):
        return (args[0].detach().clone().requires_grad_(),) + args[1:], kwargs

    ours = decode(model, cache, step, change).logits
    with torch.no_grad():
        assert rel(ours, ref(step, past_key_values=ref_cache).logits) < 1e-5
    assert tried == [(1, True), (LAYER, False)]
