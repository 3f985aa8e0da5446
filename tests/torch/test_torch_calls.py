"""qwen3layer.torch under transformers' own ways of calling a model: packed sequences, custom 4D
masks, right padding, static caches, the model cache's keys and values. Each case either
gives transformers' numbers (real tokens; fp32 1e-5, bf16 within twice transformers' bf16
error against fp32) or a ValueError naming what it got. The tiny model's matrices are drawn
N(0, 1/in) (0.125 at hidden 64: attention weights where a wrong mask shows)."""
import copy

import pytest
import torch

import qwen3layer.testing
import qwen3layer.torch as q3t
from hf_reference import left_padded, tiny_model

MIN = torch.finfo(torch.float32).min


def rel(a, b):
    a, b = a.detach().double(), b.detach().double()
    return float((a - b).norm() / b.norm())


def pair(seed, dtype=torch.float32, impl="eager"):
    model = tiny_model(seed, dtype)
    model.config._attn_implementation = impl
    ref = copy.deepcopy(model)
    return q3t.patch_model(model), ref


def additive(allowed):
    """[q, k] bool -> transformers' eager mask [1, 1, q, k]"""
    return torch.zeros(1, 1, *allowed.shape).masked_fill(~allowed, MIN)


PACKED_IDS = torch.randint(1, 101, (1, 9), generator=torch.Generator().manual_seed(1))
PACKED_POS = torch.tensor([[0, 1, 2, 3, 4, 0, 1, 2, 3]])


@pytest.mark.parametrize("impl", ["eager", "sdpa"])
@torch.no_grad()
def test_packed_sequences_equal_running_them_separately(impl):
    model, ref = pair(5, impl=impl)
    ours = model(PACKED_IDS, position_ids=PACKED_POS, use_cache=False).logits
    theirs = ref(PACKED_IDS, position_ids=PACKED_POS, use_cache=False).logits
    apart = torch.cat([ref(PACKED_IDS[:, :5]).logits, ref(PACKED_IDS[:, 5:]).logits], 1)
    assert rel(ours, theirs) < 1e-5 and rel(ours, apart) < 1e-5
    # each token of the second sequence against the first: a wrong mask would move them
    assert rel(ours[:, 5:], apart[:, 5:]) < 1e-5


@torch.no_grad()
def test_packed_sequences_with_padding_free_kwargs():
    model, ref = pair(5)
    cu = torch.tensor([0, 5, 9], dtype=torch.int32)
    kw = dict(position_ids=PACKED_POS, use_cache=False, cu_seq_lens_q=cu, cu_seq_lens_k=cu, max_length_q=5,
              max_length_k=5)
    assert rel(model(PACKED_IDS, **kw).logits, ref(PACKED_IDS, **kw).logits) < 1e-5
    wrong = torch.tensor([0, 4, 9], dtype=torch.int32)
    with pytest.raises(ValueError, match=r"cu_seq_lens_q: sequences \[\(0, 4\), \(4, 9\)\] differ"):
        model(PACKED_IDS, **{**kw, "cu_seq_lens_q": wrong, "cu_seq_lens_k": wrong})


@torch.no_grad()
def test_packed_sequences_in_bfloat16():
    model, ref = pair(6, torch.bfloat16)
    inputs = dict(input_ids=PACKED_IDS, position_ids=PACKED_POS, use_cache=False)
    result = qwen3layer.testing.assert_matches(model, ref, inputs, torch.bfloat16, wide=torch.float32)
    assert [o.name for o in result.outputs] == ["logits"]


@torch.no_grad()
def test_packed_positions_under_a_causal_mask_are_refused():
    """with a cache (use_cache's default) transformers does not separate packed sequences: the
    mask is causal over the row, the positions restart, and the C layer cannot run that"""
    model, _ = pair(5)
    with pytest.raises(ValueError, match="position_ids: token 5 of batch row 0 is at position 0, expected 5"):
        model(PACKED_IDS, position_ids=PACKED_POS)


@torch.no_grad()
def test_a_block_diagonal_4d_mask_is_computed():
    model, ref = pair(7)
    ids = PACKED_IDS[:, :6]
    allowed = torch.ones(6, 6, dtype=torch.bool).tril()
    allowed[3:, :3] = False
    kw = dict(attention_mask=additive(allowed), position_ids=torch.tensor([[0, 1, 2, 0, 1, 2]]), use_cache=False)
    assert rel(model(ids, **kw).logits, ref(ids, **kw).logits) < 1e-5
    with pytest.raises(ValueError, match="packed sequences cannot continue in one model cache"):
        model(ids, **{**kw, "use_cache": True})


@torch.no_grad()
def test_a_tree_mask_of_three_branches_is_computed():
    """a shared prefix with three branches (tree-style speculative decoding): once refused,
    now the C layer's tree (issue 42)"""
    model, ref = pair(7)
    allowed = torch.ones(6, 6, dtype=torch.bool).tril()
    allowed[4, 3] = allowed[5, 3] = allowed[5, 4] = False
    kw = dict(attention_mask=additive(allowed), position_ids=torch.tensor([[0, 1, 2, 3, 3, 3]]))
    assert rel(model(PACKED_IDS[:, :6], **kw).logits, ref(PACKED_IDS[:, :6], **kw).logits) < 1e-5


@torch.no_grad()
def test_a_mask_seeing_a_later_token_within_a_tree_is_refused_by_name():
    model, _ = pair(7)
    allowed = torch.ones(6, 6, dtype=torch.bool).tril()
    allowed[4, 3] = allowed[5, 3] = allowed[5, 4] = False
    allowed[2, 4] = True  # query 2 sees a later token: not causal, not a tree
    with pytest.raises(ValueError, match=r"attention_mask: .*query 2 of batch row 0 .* attends to keys 0-2, 4"):
        model(PACKED_IDS[:, :6], attention_mask=additive(allowed), position_ids=torch.tensor([[0, 1, 2, 3, 3, 3]]))


@torch.no_grad()
def test_an_explicit_causal_4d_mask_is_computed():
    model, ref = pair(8)
    kw = dict(attention_mask=additive(torch.ones(6, 6, dtype=torch.bool).tril()))
    ids = PACKED_IDS[:, :6]
    assert rel(model(ids, **kw).logits, ref(ids, **kw).logits) < 1e-5


@pytest.mark.parametrize("impl", ["eager", "sdpa"])
@torch.no_grad()
def test_right_padding_matches_and_continues(impl):
    """right padding's tokens are hidden keys of the C cache (issue 42): every row matches,
    the padding rows too (each sees the real tokens before it), and a call continuing the
    cache keeps them hidden"""
    model, ref = pair(9, impl=impl)
    ids = torch.randint(1, 101, (2, 7), generator=torch.Generator().manual_seed(2))
    mask = torch.ones(2, 7, dtype=torch.long)
    mask[0, 4:] = 0
    ours, theirs = model(ids, attention_mask=mask), ref(ids, attention_mask=mask)
    assert rel(ours.logits, theirs.logits) < 1e-5
    assert model.model.layers[0].kv_cache.hidden == ((4, 5, 6), ())
    more = torch.cat([mask, torch.ones(2, 1, dtype=torch.long)], 1)
    step = torch.tensor([[3], [4]])
    ours2 = model(step, attention_mask=more, past_key_values=ours.past_key_values)
    theirs2 = ref(step, attention_mask=more, past_key_values=theirs.past_key_values)
    assert rel(ours2.logits, theirs2.logits) < 1e-5


@torch.no_grad()
def test_the_model_cache_holds_the_real_keys_and_values():
    model, ref = pair(10)
    ids = torch.randint(1, 101, (2, 6), generator=torch.Generator().manual_seed(3))
    ours, theirs = model(ids), ref(ids)
    step = torch.tensor([[7], [8]])
    ours2 = model(step, past_key_values=ours.past_key_values)
    theirs2 = ref(step, past_key_values=theirs.past_key_values)
    for i, (a, b) in enumerate(zip(ours2.past_key_values.layers, theirs2.past_key_values.layers)):
        assert a.keys.shape == b.keys.shape == (2, 2, 7, 24)
        assert rel(a.keys, b.keys) < 1e-6 and rel(a.values, b.values) < 1e-6
        c = model.model.layers[i].kv_cache  # a view of the C cache, not a copy
        assert a.keys.data_ptr() == torch.from_dlpack(c.keys(0)).data_ptr()
        assert a.values.data_ptr() == torch.from_dlpack(c.values(0)).data_ptr()
    assert rel(ours2.logits, theirs2.logits) < 1e-5


@torch.no_grad()
def test_a_left_padded_forward_keeps_transformers_keys():
    """a plain forward's position_ids count the padding (0, 1, ... over the row): the C cache
    puts each sequence's first real token at its position_id, so the stored keys are
    transformers' too, and a decode step continues from there"""
    model, ref = pair(18)
    ids, mask = left_padded([3, 6], 6, seed=7)
    ours, theirs = model(ids, attention_mask=mask), ref(ids, attention_mask=mask)
    assert model.model.layers[0].kv_cache.first_positions == (3, 0)
    real = mask.bool()
    for a, b in zip(ours.past_key_values.layers, theirs.past_key_values.layers):
        assert rel(a.keys.transpose(1, 2)[real], b.keys.transpose(1, 2)[real]) < 1e-6
    more = torch.cat([mask, torch.ones(2, 1, dtype=torch.long)], 1)
    step = torch.tensor([[4], [5]])
    a = model(step, attention_mask=more, past_key_values=ours.past_key_values).logits
    b = ref(step, attention_mask=more, past_key_values=theirs.past_key_values).logits
    assert rel(a, b) < 1e-5
    with pytest.raises(ValueError, match=r"first real tokens are at positions \[4, 1\] for this call, at \[3, 0\]"):
        model(step, attention_mask=torch.cat([more, torch.ones(2, 1, dtype=torch.long)], 1),
              past_key_values=ours.past_key_values, position_ids=torch.tensor([[8], [8]]))


@pytest.mark.parametrize("impl", ["eager", "sdpa"])
@torch.no_grad()
def test_generate_with_a_left_padded_batch_keeps_transformers_keys(impl):
    model, ref = pair(11, impl=impl)
    ids, mask = left_padded([4, 7], 7, seed=4)
    kw = dict(attention_mask=mask, max_new_tokens=4, do_sample=False, pad_token_id=0, return_dict_in_generate=True)
    ours, theirs = model.generate(ids, **kw), ref.generate(ids, **kw)
    assert torch.equal(ours.sequences, theirs.sequences)
    real = torch.cat([mask, torch.ones(2, 3, dtype=torch.long)], 1).bool()  # the last token is not cached
    for a, b in zip(ours.past_key_values.layers, theirs.past_key_values.layers):
        assert a.keys.shape == b.keys.shape
        k_ours, k_theirs = a.keys.transpose(1, 2)[real], b.keys.transpose(1, 2)[real]
        assert rel(k_ours, k_theirs) < 1e-6
        assert rel(a.values.transpose(1, 2)[real], b.values.transpose(1, 2)[real]) < 1e-6


@torch.no_grad()
def test_static_cache_generation_maps_and_keys():
    model, ref = pair(12)
    ids = torch.randint(1, 101, (1, 7), generator=torch.Generator().manual_seed(5))
    kw = dict(max_new_tokens=2, do_sample=False, pad_token_id=0, cache_implementation="static",
              output_attentions=True, return_dict_in_generate=True)
    ours, theirs = model.generate(ids, **kw), ref.generate(ids, **kw)
    assert torch.equal(ours.sequences, theirs.sequences)
    assert len(ours.attentions) == len(theirs.attentions) == 2
    for step_ours, step_theirs in zip(ours.attentions, theirs.attentions):
        assert len(step_ours) == len(step_theirs) == 2  # every layer's, each step
        for a, b in zip(step_ours, step_theirs):
            assert a.shape == b.shape  # the static length's keys, as transformers gives them
            assert rel(a, b) < 1e-5
    assert type(ours.past_key_values.layers[0]).__name__ == "Q3MirroredStaticLayer"
    width = ours.past_key_values.layers[0].max_cache_len
    for a, b in zip(ours.past_key_values.layers, theirs.past_key_values.layers):
        assert a.keys.shape == b.keys.shape == (1, 2, width, 24)
        assert rel(a.keys, b.keys) < 1e-6 and rel(a.values, b.values) < 1e-6
        assert int(a.get_seq_length()) == int(b.get_seq_length()) == 8


def test_the_patched_model_keeps_its_whole_state_dict(tmp_path):
    model, ref = pair(13)
    ours, theirs = model.state_dict(), ref.state_dict()
    assert ours.keys() == theirs.keys()
    assert all(torch.equal(ours[k], theirs[k]) for k in theirs)
    model.save_pretrained(tmp_path)
    from transformers import Qwen3MoeForCausalLM
    again = Qwen3MoeForCausalLM.from_pretrained(tmp_path)
    assert all(torch.equal(again.state_dict()[k], theirs[k]) for k in theirs)
    # load_state_dict copies in place: the C layer reads the new weights
    other = tiny_model(14)
    model.load_state_dict(other.state_dict())
    ids = PACKED_IDS[:, :5]
    with torch.no_grad():
        assert rel(model(ids).logits, other(ids).logits) < 1e-5
    q3t.unpatch_model(model)
    assert model.state_dict().keys() == theirs.keys()


def test_moved_weights_are_refused():
    model, _ = pair(13)
    model.to(torch.bfloat16)
    with pytest.raises(RuntimeError, match=r"layer 0: .*weight is no longer the tensor the C layer reads"):
        with torch.no_grad():
            model(PACKED_IDS[:, :5])


@pytest.mark.parametrize("how", ["setattr", "load_state_dict(assign=True)", "deleted"])
def test_a_reassigned_parameter_is_refused(how):
    """the C layer reads the tensor it borrowed: a module given another parameter in its place
    (a new address or the same one) is refused, naming it"""
    model, _ = pair(13)
    gate = model.model.layers[0].mlp.gate
    if how == "setattr":
        gate.weight = torch.nn.Parameter(gate.weight.detach().clone())
    elif how == "deleted":
        del gate.weight
    else:
        gate.load_state_dict({"weight": torch.zeros_like(gate.weight)}, assign=True)
    what = "removed" if how == "deleted" else r"now another tensor \(torch.float32 on cpu\)"
    with pytest.raises(RuntimeError, match=rf"layer 0: mlp.gate.weight is no longer the tensor .* it is {what}"):
        with torch.no_grad():
            model(PACKED_IDS[:, :5])


class _Adapter(torch.nn.Module):
    """a LoRA-like wrapper: the base projection plus a low-rank delta the C layer would not run"""

    def __init__(self, base):
        super().__init__()
        self.base_layer = base
        self.delta = torch.nn.Linear(base.in_features, base.out_features, bias=False)

    def forward(self, x):
        return self.base_layer(x) + self.delta(x)


@pytest.mark.parametrize("where", ["self_attn.q_proj", "mlp"])
def test_a_replaced_submodule_is_refused_on_either_path(where):
    """a submodule replaced after patching (an adapter wrapping a projection, or a whole block)
    is refused naming it, on the full path (layer 0 plans each call) and on the fast path of a
    decode step (layer 1 repeats the plan: its test fails, and the full path refuses)"""
    model, _ = pair(13)
    ids = PACKED_IDS[:, :5]
    with torch.no_grad():
        out = model(ids, use_cache=True)
    layer = model.model.layers[1]
    parent, _, name = where.rpartition(".")
    holder = layer.get_submodule(parent) if parent else layer
    old = holder.get_submodule(name)
    setattr(holder, name, _Adapter(old) if isinstance(old, torch.nn.Linear) else copy.deepcopy(old))
    with pytest.raises(RuntimeError, match=rf"layer 1: its submodule {where} was replaced .* patch_model"):
        with torch.no_grad():
            model(ids[:, :1] + 1, past_key_values=out.past_key_values, use_cache=True)


@pytest.mark.parametrize("index,where,kind", [(0, "mlp", "hook"), (1, "mlp", "hook"), (1, "input_layernorm", "pre-hook"),
                                              (1, "self_attn.q_proj", "hook")])
def test_a_hook_on_a_part_of_the_layer_is_refused_on_either_path(index, where, kind):
    """transformers runs a hook on a submodule (an activation probe, a steering pre-hook); the C
    layer runs none of its parts' forwards, so such a hook would silently not run: refused,
    naming the submodule, on the full path (the first call after it) and on the fast path of a
    decode step (layer 1 repeats layer 0's plan); removed, the calls run again with
    transformers' numbers, and a hook on the decoder layer itself runs"""
    model, ref = pair(13)
    ids = PACKED_IDS[:, :5]
    seen = []
    with torch.no_grad():
        out, ref_out = model(ids, use_cache=True), ref(ids, use_cache=True)
    part = model.model.layers[index].get_submodule(where)
    if kind == "hook":
        handle = part.register_forward_hook(lambda m, args, y: seen.append(where))
    else:
        handle = part.register_forward_pre_hook(lambda m, args: (args[0] * 0,))
    step = ids[:, :1] + 1
    with pytest.raises(RuntimeError, match=rf"layer {index}: its submodule {where} has a forward {kind} .* never run"):
        with torch.no_grad():
            model(step, past_key_values=out.past_key_values, use_cache=True)
    assert seen == []  # (layer 0 ran: a refusal in the layer loop stops it there, as any exception would)
    handle.remove()
    whole = model.model.layers[1].register_forward_hook(lambda m, args, y: seen.append("layer"))
    with torch.no_grad():
        out = model(ids, use_cache=True)
        ours = model(step, past_key_values=out.past_key_values, use_cache=True).logits
        theirs = ref(step, past_key_values=ref_out.past_key_values, use_cache=True).logits
    whole.remove()
    assert seen == ["layer", "layer"] and rel(ours, theirs) < 1e-5


@pytest.mark.parametrize("kind", ["hook", "pre_hook"])
def test_a_hook_on_every_module_is_refused(kind):
    """torch's global module hooks run on every submodule transformers calls; the C layer calls
    none of a patched layer's parts: refused by name (on a decode step's fast path too), and the
    calls run again once it is removed"""
    model, _ = pair(13)
    ids = PACKED_IDS[:, :5]
    with torch.no_grad():
        out = model(ids, use_cache=True)
    register = getattr(torch.nn.modules.module, f"register_module_forward_{kind}")
    handle = register((lambda m, args: None) if kind == "pre_hook" else (lambda m, args, y: None))
    try:
        with pytest.raises(RuntimeError, match=rf"layer 0: a forward {kind.replace('_', '-')} on every module .*"
                                               rf"register_module_forward_{kind}\)"):
            with torch.no_grad():
                model(ids[:, :1] + 1, past_key_values=out.past_key_values, use_cache=True)
    finally:
        handle.remove()
    with torch.no_grad():
        model(ids)


def test_a_copied_weight_changed_in_place_is_refused_and_a_borrowed_one_is_read():
    """a weight the C layer had to copy (here a transposed view) does not see an in-place
    change: refused, naming it; a borrowed one is read where it is (the new numbers)"""
    model = tiny_model(13)
    q = model.model.layers[0].self_attn.q_proj
    q.weight.data = q.weight.data.t().contiguous().t()  # not contiguous: copied at construction
    ref = copy.deepcopy(model)
    with pytest.warns(UserWarning, match="copied 1 weight"):
        q3t.patch_model(model)
    ids = PACKED_IDS[:, :5]
    with torch.no_grad():
        for m in (model, ref):  # a borrowed weight changed in place: read
            m.model.layers[0].self_attn.k_proj.weight.mul_(1.5)
        assert rel(model(ids).logits, ref(ids).logits) < 1e-5
        q.weight.mul_(1.5)
        with pytest.raises(RuntimeError, match=r"layer 0: self_attn.q_proj.weight was changed in place .* a copy"):
            model(ids)


def test_copied_parameters_map_the_c_layers_names_to_the_modules():
    from qwen3layer.torch.held import copied_parameters
    names = ["self_attn.q_proj.weight", "mlp.experts.gate_up_proj", "mlp.experts.down_proj", "mlp.gate.weight"]
    assert copied_parameters(names, ["self_attn.q_proj.weight"]) == {"self_attn.q_proj.weight"}
    assert copied_parameters(names, ["mlp.experts.3.gate_proj.weight"]) == {"mlp.experts.gate_up_proj",
                                                                             "mlp.experts.down_proj"}
    assert copied_parameters(names, []) == set()


def test_the_same_memory_read_another_way_is_refused():
    """.data = .data.t() keeps the address and dtype: the C layer would read the old layout"""
    model, _ = pair(13)
    o = model.model.layers[0].self_attn.o_proj
    o.weight.data = o.weight.data.t()
    with pytest.raises(RuntimeError, match=r"layer 0: self_attn.o_proj.weight is no longer .* strides"):
        with torch.no_grad():
            model(PACKED_IDS[:, :5])


def test_the_same_memory_read_as_another_dtype_is_refused():
    """.data = .data.view(torch.int32) keeps the address and the layout: the C layer would read
    float32 bits the model now calls int32"""
    model, _ = pair(13)
    gate = model.model.layers[0].mlp.gate
    gate.weight.requires_grad_(False)  # (torch gives integer data only to a tensor without gradients)
    gate.weight.data = gate.weight.data.view(torch.int32)
    with pytest.raises(RuntimeError, match=r"layer 0: mlp.gate.weight .*it was torch.float32 on cpu, it is torch.int32"):
        with torch.no_grad():
            model(PACKED_IDS[:, :5])


def test_still_held_compares_every_part():
    """the extension's per-call test of what a patched layer holds (HeldWeights.held): true when
    each dict still holds its object and each tensor its address, dtype and contiguity, each
    copy its version (read by the tensor base class's own descriptors, handed in the watch); false
    when any one differs; a malformed watch is refused"""
    from qwen3layer._C import still_held
    from qwen3layer.torch.held import _READERS
    t, u = torch.zeros(4, 3), torch.zeros(2, 2)
    held = {"w": t}

    def watch(**change):
        parts = dict(dicts=(held,), keys=("w",), objects=(t,), tensors=(t,), data_ptrs=(t.data_ptr(),),
                     dtypes=(t.dtype,), contiguous=(True,), copied=(u,), versions=(u._version,),
                     readers=_READERS)
        parts.update(change)
        return tuple(parts.values())

    assert still_held(watch()) is True
    for change in (dict(objects=(u,)), dict(keys=("other",)), dict(data_ptrs=(t.data_ptr() + 4,)),
                   dict(dtypes=(torch.int32,)), dict(contiguous=(False,)), dict(versions=(u._version + 1,))):
        assert still_held(watch(**change)) is False, change
    taken = watch()
    u.add_(1)  # a copied tensor changed in place
    assert still_held(taken) is False
    with pytest.raises(TypeError, match="expected a tuple of 10 tuples"):
        still_held(watch()[:9])
    with pytest.raises(ValueError, match="unequal lengths"):
        still_held(watch(keys=("w", "v")))
    with pytest.raises(ValueError, match="not 4 readers"):
        still_held(watch(readers=_READERS[:3]))
    with pytest.raises(TypeError):  # a reader checks the class of what it reads
        still_held(watch(tensors=(object(),)))
    with pytest.raises(TypeError, match=r"dicts\[0\]: expected a dict, got list"):
        still_held(watch(dicts=([],)))


@pytest.mark.parametrize("checkpointing", [None, True, False])
def test_training_is_refused_before_any_work(checkpointing):
    model, _ = pair(15)
    if checkpointing is not None:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": checkpointing})
    model.train()
    ran = []
    model.model.embed_tokens.register_forward_hook(lambda *a: ran.append(1))
    with pytest.raises(RuntimeError, match="inference-only .* model.eval\\(\\)"):
        model(PACKED_IDS[:, :5], labels=PACKED_IDS[:, :5])
    assert ran == []
    with torch.no_grad():  # training mode without gradients: runs
        model(PACKED_IDS[:, :5])


def test_eval_with_gradients_warns_once_and_works():
    model, ref = pair(16)
    q3t._GRAD_WARNED[0] = False
    with pytest.warns(UserWarning, match="no gradient flows through them"):
        out = model(PACKED_IDS[:, :5]).logits
    import warnings
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        model(PACKED_IDS[:, :5])
    assert rel(out, ref(PACKED_IDS[:, :5]).logits) < 1e-5


# ---- the planner alone (qwen3layer.torch.masks) ----
from qwen3layer.torch.masks import plan_call  # noqa: E402


def causal(n, past=0):
    return torch.ones(n, past + n, dtype=torch.bool).tril(past)


def test_plan_reads_left_padding_and_segments():
    m = causal(5)[None, None].clone()
    m[..., :2] = False  # two leading padding keys
    plan = plan_call(m, None, 1, 5, 0, None)
    assert plan.padding == [2] and plan.packed is None
    bd = causal(6)
    bd[3:, :3] = False
    plan = plan_call(bd[None, None], torch.tensor([[0, 1, 2, 0, 1, 2]]), 1, 6, 0, None)
    assert [(s.start, s.end, s.padding) for s in plan.packed[0]] == [(0, 3, 0), (3, 6, 0)]
    # a 2D key-padding mask (flash attention's) as well
    plan = plan_call(torch.tensor([[0, 0, 1, 1, 1]]), None, 1, 5, 0, None)
    assert plan.padding == [2]


def test_plan_continues_the_cache_and_keeps_a_static_width():
    m = causal(1, past=6)
    m = torch.cat([m, torch.zeros(1, 3, dtype=torch.bool)], 1)  # a static cache of 10
    m[:, :2] = False
    plan = plan_call(m[None, None], None, 1, 1, 6, (2,))
    assert plan.key_width == 10 and plan.padding == [2]


def test_one_row_of_positions_serves_every_batch_row():
    """position_ids [1, length] with a batch of 2: each row planned with them, as [2, length]
    repeating them is (packed segments and offsets alike), and each row its own list"""
    bd = causal(6)
    bd[3:, :3] = False
    mask = bd[None, None].expand(2, 1, 6, 6)
    pos = torch.tensor([[0, 1, 2, 0, 1, 2]])
    one, two = plan_call(mask, pos, 2, 6, 0, None), plan_call(mask, pos.expand(2, -1), 2, 6, 0, None)
    assert one.offsets == two.offsets and one.packed is not None
    assert [[(s.start, s.end) for s in row] for row in one.packed] == [[(0, 3), (3, 6)]] * 2
    assert [[(s.start, s.end) for s in row] for row in two.packed] == [[(0, 3), (3, 6)]] * 2
    from qwen3layer.torch.masks import _rows
    rows = _rows(torch.tensor([[4, 5]]), 3)
    assert rows == [[4, 5]] * 3 and rows[0] is not rows[1]


@pytest.mark.parametrize("make, message", [
    (lambda: torch.ones(4, 4).tril().log()[None, None] * 0 + torch.tensor(-1.0), "a value other than 0 and -inf"),
    (lambda: torch.stack([causal(4), causal(4).T]).unsqueeze(0), "differs between heads"),
    (lambda: torch.ones(1, 1, 3, 2, dtype=torch.bool), "expected a 4D mask"),
    (lambda: torch.ones(1, 1, 3, 4, dtype=torch.bool), "attends to keys 0-3, expected keys 0-0"),
])
def test_plan_refuses_what_it_cannot_run(make, message):
    m = make()
    n = m.shape[-2]
    with pytest.raises(ValueError, match=message):
        plan_call(m, None, 1, n, 0, None)


def test_a_sliding_window_is_a_tree_within_a_call_and_refused_over_a_cache():
    """a window's mask within one call is a tree (each query sees some of the call's tokens up to
    itself): computed as given; continuing a cache, a query that sees only some of the cached
    keys is refused by name"""
    window = (causal(6) & ~causal(6, past=0).tril(-3))[None, None]
    plan = plan_call(window, None, 1, 6, 0, None)
    assert plan.tree is not None and torch.equal(plan.tree[0], window[0, 0])
    assert plan.positions.tolist() == [list(range(6))]
    later = torch.ones(1, 1, 1, 7, dtype=torch.bool)
    later[..., :4] = False  # the window over the cache
    with pytest.raises(ValueError, match=r"not the cache's causal attention: query 0 .* attends to keys 4-6"):
        plan_call(later, None, 1, 1, 6, (0,))


def test_plan_reads_flash_attentions_packing_off_the_positions():
    pos = torch.tensor([[0, 1, 2, 0, 1, 0, 1, 2, 3]])
    plan = plan_call(None, pos, 1, 9, 0, None, "flash_attention_2")
    assert [(s.start, s.end) for s in plan.packed[0]] == [(0, 3), (3, 5), (5, 9)]
    # sdpa and eager see no packing without a mask saying so: restarting positions are refused
    with pytest.raises(ValueError, match="position_ids: token 3 of batch row 0 is at position 0, expected 3"):
        plan_call(None, pos, 1, 9, 0, None, "sdpa")
    # a jump inside one of flash's sequences cannot be run
    with pytest.raises(ValueError, match="token 2 of batch row 0 is at position 5, expected 2"):
        plan_call(None, torch.tensor([[0, 1, 5, 6]]), 1, 4, 0, None, "flash_attention_2")


def test_plan_refuses_no_mask_over_a_padded_cache():
    with pytest.raises(ValueError, match=r"None .* padding \[0, 3\]"):
        plan_call(None, None, 2, 1, 5, (0, 3))


# ---- bf16 and fp16: within twice transformers' error in that dtype against its fp32 model ----
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@torch.no_grad()
def test_half_precision_right_padding_and_the_cache(dtype):
    model, ref = pair(17, dtype)
    ids = torch.randint(1, 101, (2, 7), generator=torch.Generator().manual_seed(6))
    mask = torch.ones(2, 7, dtype=torch.long)
    mask[1, 5:] = 0
    assert all(e.keys.dtype == dtype for e in model(ids, attention_mask=mask).past_key_values.layers)
    assert all(layer.kv_cache.dtype == str(dtype).removeprefix("torch.") for layer in model.model.layers)
    # logits and both layers' keys and values, on the real tokens (the mask's 1s)
    result = qwen3layer.testing.assert_matches(model, ref, dict(input_ids=ids, attention_mask=mask), dtype,
                                               wide=torch.float32)
    assert [o.name for o in result.outputs] == ["logits"] + [f"layers.{i}.{kv}" for i in (0, 1)
                                                             for kv in ("keys", "values")]


# ---- arguments transformers hands the layers that the C layer must not ignore ----
@torch.no_grad()
def test_a_cache_position_other_than_the_next_rows_is_refused():
    model, _ = pair(19)
    ids = PACKED_IDS[:, :5]
    out = model(ids)
    layer = model.model.layers[0]
    with pytest.raises(ValueError, match=r"cache_position: expected 5 to 5 \(the C cache appends after the 5 tokens"):
        layer(torch.zeros(1, 1, 64), position_ids=torch.tensor([[5]]), past_key_values=out.past_key_values,
              cache_position=torch.tensor([3]))
    assert layer.kv_cache.lengths == (5,)


def test_a_rotary_embedding_other_than_the_configs_is_refused_at_patch_time():
    model = tiny_model(19)
    originals = list(model.model.layers)
    with torch.no_grad():
        model.model.rotary_emb.inv_freq.mul_(1.5)
    with pytest.raises(ValueError, match=r"model.rotary_emb: its inv_freq \[12\] .* not the RoPE of the config"):
        q3t.patch_model(model)
    assert list(model.model.layers) == originals  # nothing swapped


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_a_half_precision_rounded_rotary_buffer_is_taken_with_a_warning(dtype):
    with pytest.warns(UserWarning, match=rf"inv_freq is in {dtype} \(rounded by model.to\(\)\)"):
        q3t.patch_model(tiny_model(19, dtype))


@torch.no_grad()
def test_replaced_keys_in_the_model_cache_are_refused():
    model, _ = pair(19)
    out = model(PACKED_IDS[:, :5])
    entry = out.past_key_values.layers[0]
    entry.keys = entry.keys[:, :, :3]
    with pytest.raises(RuntimeError, match="the model cache's keys hold 3 tokens, this layer's C cache 5"):
        model(torch.tensor([[4]]), past_key_values=out.past_key_values)


def test_calls_under_inference_mode_match_no_grad():
    # the plan's memo cannot read an inference tensor's version: it holds within one model call
    model, ref = pair(17)
    ids, mask = left_padded([3, 5], 5, seed=2)
    with torch.inference_mode():
        mask = mask.clone()
        first = model(ids, attention_mask=mask).logits
        mask[0, 1] = 1  # the same mask tensor, changed in place: the next call is planned anew
        second = model(ids, attention_mask=mask).logits
    with torch.no_grad():
        assert rel(first[:, -3:], ref(ids, attention_mask=left_padded([3, 5], 5, seed=2)[1]).logits[:, -3:]) < 1e-5
        assert rel(second[0, -4:], ref(ids, attention_mask=mask.clone()).logits[0, -4:]) < 1e-5


def test_a_config_flag_set_between_model_calls_is_read():
    # what the layers of one model call read off the config once is read again by the next call
    model, ref = pair(18)
    ids = PACKED_IDS[:, :5]
    with torch.no_grad():
        assert model(ids).attentions is None
        model.config.output_attentions = ref.config.output_attentions = True
        ours, theirs = model(ids).attentions, ref(ids).attentions
    assert ours is not None and len(ours) == len(theirs)
    assert all(rel(a, b) < 1e-5 for a, b in zip(ours, theirs))


def test_a_deep_copied_static_cache_holds_views_of_its_own_c_cache():
    from transformers import StaticCache
    model, _ = pair(19)
    ids = PACKED_IDS[:, :5]
    cache = StaticCache(config=model.config, max_cache_len=16)
    with torch.no_grad():
        model(ids, past_key_values=cache, use_cache=True)
        branch = copy.deepcopy(cache)
        model(PACKED_IDS[:, 5:6], past_key_values=branch, use_cache=True)
    for entry in branch.layers:
        held = torch.from_dlpack(entry._q3_cache.all_keys(16))
        assert entry.keys.data_ptr() == held.data_ptr()  # a view, not the copy deepcopy made
        assert torch.equal(entry.keys, held)


@pytest.mark.parametrize("impl", ["eager", "sdpa"])
@torch.no_grad()
def test_a_tree_mask_of_branches_over_a_shared_prefix_matches(impl):
    """transformers' custom 4D masks (its test_custom_4d_attention_mask): a prefix of 3 tokens
    and two branches of 2, each branch at the positions after the prefix; then a decode step
    continuing the cache the tree call made (every cached token seen, as transformers sees it)"""
    model, ref = pair(21, impl=impl)
    ids = torch.randint(1, 101, (1, 7), generator=torch.Generator().manual_seed(8))
    pos = torch.tensor([[0, 1, 2, 3, 4, 3, 4]])
    allowed = torch.ones(7, 7, dtype=torch.bool).tril()
    allowed[5:, 3:5] = False  # the second branch does not see the first
    mask = torch.where(allowed, 0.0, torch.finfo(torch.float32).min)[None, None]
    ours, theirs = model(ids, attention_mask=mask, position_ids=pos), ref(ids, attention_mask=mask, position_ids=pos)
    assert rel(ours.logits, theirs.logits) < 1e-5
    with pytest.raises(ValueError, match="attention_mask"):  # a query seeing some of the cached keys only
        bad = torch.ones(1, 1, 1, 8, dtype=torch.bool)
        bad[..., 2] = False
        model(torch.tensor([[5]]), attention_mask=bad, position_ids=torch.tensor([[7]]),
              past_key_values=ours.past_key_values)
