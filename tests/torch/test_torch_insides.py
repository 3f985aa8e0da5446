"""qwen3layer.torch: the layer's insides through the model's own outputs. A patched model asked
for output_router_logits, output_attentions or output_hidden_states gives what transformers
gives (eager attention): per layer, router logits [batch * tokens, experts], attention maps
[batch, heads, new, context], hidden states [batch, tokens, hidden], in the model's dtype, and
the same aux_loss; what it cannot give raises NotImplementedError. Left padding's rows are
compared on the real tokens only: transformers' eager attention gives a padding query (all
keys masked) a uniform row, the C layer has it look at itself (see qwen3layer/torch/__init__.py)."""
import copy

import pytest
import torch
import transformers

import qwen3layer as q3
import qwen3layer.torch as q3t
from hf_reference import converted
from hf_reference import left_padded, tiny_model

ASK = dict(output_router_logits=True, output_attentions=True, output_hidden_states=True)


def patched_and_reference(seed, dtype=torch.float32):
    model = tiny_model(seed, dtype)
    ref = copy.deepcopy(model)
    return q3t.patch_model(model), ref


def padded_batch(seed):
    """two prompts of 8 tokens, the first left-padded by 3"""
    return left_padded([5, 8], 8, seed)


def rel(a, b):
    a, b = a.detach().double(), b.detach().double()
    return float((a - b).norm() / b.norm())


def assert_insides_close(ours, theirs, mask, tol):
    """router logits, maps and hidden states of the real tokens within tol (relative)"""
    real = mask.bool()  # [batch, tokens]
    assert len(ours.router_logits) == len(theirs.router_logits) == 2
    for a, b in zip(ours.router_logits, theirs.router_logits):
        assert a.shape == b.shape and a.dtype == b.dtype
        assert rel(a[real.reshape(-1)], b[real.reshape(-1)]) < tol
    assert len(ours.attentions) == len(theirs.attentions) == 2
    for a, b in zip(ours.attentions, theirs.attentions):
        assert a.shape == b.shape and a.dtype == b.dtype
        assert rel(a.transpose(1, 2)[real], b.transpose(1, 2)[real]) < tol
    assert len(ours.hidden_states) == len(theirs.hidden_states) == 3
    for a, b in zip(ours.hidden_states, theirs.hidden_states):
        assert rel(a[real], b[real]) < tol


@pytest.mark.parametrize("padded", [False, True])
def test_float32_insides_and_aux_loss_match_transformers(padded):
    model, ref = patched_and_reference(4)
    ids, mask = padded_batch(4)
    if not padded:
        mask = torch.ones_like(mask)
    ours, theirs = model(ids, attention_mask=mask, **ASK), ref(ids, attention_mask=mask, **ASK)
    assert_insides_close(ours, theirs, mask, 1e-5)
    assert abs(ours.aux_loss.item() - theirs.aux_loss.item()) <= 1e-5 * theirs.aux_loss.item()
    # the maps are probabilities: each real query's row sums to 1, a padding query looks at itself
    rows = ours.attentions[0].sum(-1).transpose(1, 2)  # [batch, tokens, heads]
    assert torch.allclose(rows[mask.bool()], torch.ones(()), atol=1e-5)
    pads = int((mask[0] == 0).sum())
    assert torch.equal(ours.attentions[1][0, :, :pads, :pads], torch.eye(pads).expand(8, pads, pads))


def test_float32_maps_of_a_decode_step_match_transformers():
    model, ref = patched_and_reference(5)
    ids, mask = padded_batch(5)
    ours, theirs = model(ids, attention_mask=mask, use_cache=True), ref(ids, attention_mask=mask, use_cache=True)
    step, mask = torch.tensor([[7], [9]]), torch.cat([mask, torch.ones(2, 1, dtype=mask.dtype)], 1)
    # the inner model: transformers' own aux loss cannot take a decode step's mask
    ours = model.model(step, attention_mask=mask, past_key_values=ours.past_key_values, use_cache=True, **ASK)
    theirs = ref.model(step, attention_mask=mask, past_key_values=theirs.past_key_values, use_cache=True, **ASK)
    assert ours.attentions[0].shape == (2, 8, 1, 9)  # the context includes the padding's positions
    assert_insides_close(ours, theirs, torch.ones(2, 1), 1e-5)
    assert not ours.attentions[1][0, :, :, :3].any()  # nor does a new token look at the padding


def test_bfloat16_insides_within_twice_transformers_error():
    """bf16: our error against the float64 model at most twice transformers' bf16 error (and the
    model's dtype: the C layer's fp32 insides are converted, as transformers' are bf16). No
    padding: float64 transformers turns a padding row into NaN (its mask's minimum plus a score
    overflows), which then reaches the real rows through 0 * NaN."""
    model, ref = patched_and_reference(6, torch.bfloat16)
    exact = converted(ref, torch.float64)
    ids = torch.randint(1, 101, (2, 8), generator=torch.Generator().manual_seed(6))
    ours, theirs, best = (m(ids, **ASK) for m in (model, ref, exact))
    for name in ("router_logits", "attentions", "hidden_states"):
        for a, b, e in zip(getattr(ours, name), getattr(theirs, name), getattr(best, name)):
            assert a.dtype == torch.bfloat16 and a.shape == e.shape
            assert rel(a, e) <= 2 * rel(b, e), name
    err_ours, err_theirs = (abs(out.aux_loss.item() - best.aux_loss.item()) for out in (ours, theirs))
    assert err_ours <= max(2 * err_theirs, 1e-3 * best.aux_loss.item())


def test_generate_returns_the_maps_of_every_step():
    """a left-padded batch of 2: the prompt's maps on its real rows, then every new token's"""
    model, ref = patched_and_reference(7)
    ids, mask = padded_batch(7)
    ask = dict(attention_mask=mask, max_new_tokens=4, do_sample=False, pad_token_id=0,
               return_dict_in_generate=True, output_attentions=True)
    ours, theirs = model.generate(ids, **ask), ref.generate(ids, **ask)
    assert torch.equal(ours.sequences, theirs.sequences)
    assert len(ours.attentions) == 4
    for step, (step_ours, step_theirs) in enumerate(zip(ours.attentions, theirs.attentions)):
        real = mask.bool() if step == 0 else torch.ones(2, 1, dtype=torch.bool)
        for a, b in zip(step_ours, step_theirs):
            assert a.shape == b.shape == (2, 8, real.shape[1], 8 + step)
            assert rel(a.transpose(1, 2)[real], b.transpose(1, 2)[real]) < 1e-5


def test_generate_with_router_logits_behaves_as_transformers():
    """generate passes output_router_logits to each step's forward: 5.x runs it (the aux loss
    is computed and dropped), 4.57 fails in its own aux loss; the drop-in does the same"""
    model, ref = patched_and_reference(8)
    ids = torch.randint(1, 101, (1, 6), generator=torch.Generator().manual_seed(8))
    ask = dict(max_new_tokens=4, do_sample=False, pad_token_id=0, return_dict_in_generate=True,
               output_router_logits=True)
    try:
        theirs = ref.generate(ids, **ask)
    except RuntimeError as error:
        with pytest.raises(type(error)):
            model.generate(ids, **ask)
        return
    assert torch.equal(model.generate(ids, **ask).sequences, theirs.sequences)


def test_recording_survives_patching_in_either_order():
    """transformers 5.x installs its recording hooks once per model: whether that happened
    before patching, while patched, or not at all, the patched and the unpatched model record"""
    ids = torch.randint(1, 101, (2, 5), generator=torch.Generator().manual_seed(9))
    for first in ("reference", "patched"):
        model = tiny_model(9)
        theirs = model(ids, output_router_logits=True).router_logits
        if first == "patched":
            model = tiny_model(9)
        q3t.patch_model(model)
        ours = model(ids, output_router_logits=True).router_logits
        q3t.unpatch_model(model)
        again = model(ids, output_router_logits=True).router_logits
        assert len(ours) == len(again) == 2
        for a, b, c in zip(ours, theirs, again):
            assert rel(a, b) < 1e-5 and torch.equal(b, c)


def test_maps_above_the_limit_are_refused_with_their_size():
    model = q3t.patch_model(tiny_model(12), attention_limit=1000)
    ids = torch.randint(1, 101, (2, 8), generator=torch.Generator().manual_seed(12))
    with pytest.raises(ValueError, match=r"\[2, 8, 8, 8\] .* fp32 would take 4096 bytes"):
        model(ids, output_attentions=True)
    assert model(ids, output_router_logits=True).router_logits[0].shape == (16, 8)  # no maps, no limit
    q3t.patch_model(model, attention_limit=4096)
    assert model(ids, output_attentions=True).attentions[1].shape == (2, 8, 8, 8)


def test_what_nothing_records_raises():
    model = tiny_model(10)
    layer = q3t.DecoderLayer.from_hf(model.model.layers[0])  # without the model's recorders
    x = torch.randn(1, 3, 64)
    for key in ("router_logits", "attentions", "hidden_states"):
        with pytest.raises(NotImplementedError, match=f"qwen3layer layer 0: output_{key}: no recorder of "
                                                      f"transformers {transformers.__version__}"):
            layer(x, **{f"output_{key}": True})
    assert torch.equal(layer(x, output_attentions=False), layer(x))  # asking for nothing is fine
    # the config's flags are the defaults, as in transformers
    model.config.output_attentions = True
    model.model.layers[0] = layer
    with pytest.raises(NotImplementedError, match="output_attentions"):
        model(torch.tensor([[1, 2, 3]]))


@pytest.mark.skipif(not (q3.cuda.built() and q3.cuda.device_count() > 0),
                    reason="no CUDA device on this machine (the CUDA layer's insides: tests/gpu/test_cuda.py)")
def test_insides_on_the_gpu_match_transformers():
    """the model on the GPU: the C layers' router rows and maps come from the CUDA passes"""
    model = tiny_model(11).cuda()
    ref = copy.deepcopy(model)
    q3t.patch_model(model)
    ids, mask = (t.cuda() for t in padded_batch(11))
    ours, theirs = model(ids, attention_mask=mask, **ASK), ref(ids, attention_mask=mask, **ASK)
    assert ours.attentions[0].device == ids.device
    assert_insides_close(ours, theirs, mask, 1e-4)
    assert abs(ours.aux_loss.item() - theirs.aux_loss.item()) <= 1e-4 * theirs.aux_loss.item()
