"""qwen3layer.torch: the layer dropped into a transformers Qwen3-MoE model, generating the
same tokens, with the model's own cache bookkeeping intact and no weight copied."""
import pytest
import torch

import qwen3layer.torch as q3t
from hf_reference import greedy, left_padded, tiny_model


@pytest.mark.parametrize("seed", [0, 1])
def test_float32_generation_is_identical(seed):
    model = tiny_model(seed)
    ids = torch.randint(1, 101, (1, 9), generator=torch.Generator().manual_seed(seed))
    ref = greedy(model, ids)
    assert len(set(ref[0, 9:].tolist())) >= 8  # a sequence that can tell implementations apart
    q3t.patch_model(model)
    assert all(isinstance(layer, q3t.DecoderLayer) for layer in model.model.layers)
    assert torch.equal(greedy(model, ids), ref)
    assert torch.equal(greedy(model, ids), ref)  # a second generation starts a fresh cache


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_generation_agrees_on_the_first_tokens(dtype):
    model = tiny_model(1, dtype)
    ids = torch.randint(1, 101, (1, 9), generator=torch.Generator().manual_seed(1))
    ref = greedy(model, ids, 8)
    q3t.patch_model(model)
    assert torch.equal(greedy(model, ids, 8), ref)


def test_patching_shares_weights_and_unpatching_restores():
    model = tiny_model(2)
    originals = list(model.model.layers)
    before = {n: p.data_ptr() for n, p in model.named_parameters()}
    q3t.patch_model(model)
    layer = model.model.layers[0]
    assert layer.core.converted == ()
    assert layer.core.weight_ptrs["self_attn.q_proj.weight"] == originals[0].self_attn.q_proj.weight.data_ptr()
    # the patched model lists every parameter under its own name, once, and copies none
    names = [n for n, _ in model.named_parameters()]
    assert len(names) == len(set(names))
    assert {n: p.data_ptr() for n, p in model.named_parameters()} == before
    q3t.unpatch_model(model)
    assert list(model.model.layers) == originals


def test_model_cache_bookkeeping_is_kept():
    model = tiny_model(3)
    q3t.patch_model(model)
    ids = torch.randint(1, 101, (2, 7), generator=torch.Generator().manual_seed(3))
    out = model(ids, use_cache=True)
    model_cache = out.past_key_values
    assert model_cache.get_seq_length() == 7
    assert model.model.layers[1].kv_cache.lengths == (7, 7)
    # past_key_values: 4.57's name, still accepted by 5.x (which calls it cache)
    nxt = model(torch.tensor([[5], [6]]), past_key_values=model_cache, use_cache=True)
    assert nxt.past_key_values.get_seq_length() == 8
    assert model.model.layers[0].kv_cache.lengths == (8, 8)
    # the real K and V, views of the C cache: [batch, kv_heads, tokens, head_dim]
    assert model_cache.layers[0].keys.shape == (2, 2, 8, 24)
    assert model_cache.layers[0].keys.data_ptr() == torch.from_dlpack(model.model.layers[0].kv_cache.keys(0)).data_ptr()
    full = tiny_model(3)(torch.cat([ids, torch.tensor([[5], [6]])], 1)).logits[:, -1]
    assert torch.allclose(nxt.logits[:, -1], full, rtol=1e-4, atol=1e-4)


def test_patch_rejects_other_models():
    with pytest.raises(TypeError, match="model: expected a Qwen3MoeModel or Qwen3MoeForCausalLM, got Linear"):
        q3t.patch_model(torch.nn.Linear(2, 2))


def test_batch_of_left_padded_prompts_generates_identically():
    model = tiny_model(2)
    ids, mask = left_padded([5, 11, 8], 11, seed=2)
    ref = model.generate(ids, attention_mask=mask, max_new_tokens=32, do_sample=False, pad_token_id=0)
    assert all(len(set(row[11:].tolist())) >= 8 for row in ref)
    q3t.patch_model(model)
    out = model.generate(ids, attention_mask=mask, max_new_tokens=32, do_sample=False, pad_token_id=0)
    assert torch.equal(out, ref)
    assert model.model.layers[0].kv_cache.padding == (6, 0, 3)


@pytest.mark.parametrize("kw,match", [
    (dict(expert_device="cpu"), r"expert_device='cpu': layer 0's attention \(self_attn.q_proj.weight\) is on cpu; a "
     "split layer runs its attention on a CUDA device"),
    (dict(gpu_experts=[1]), r"expert_device: expected 'cpu' \(the experts not in gpu_experts in host memory\), got None$"),
    (dict(expert_device="cuda"), r"expert_device: expected 'cpu' \(the experts not in gpu_experts in host memory\), "
     "got 'cuda'$"),
    (dict(expert_counts=[1] * 8), "expert_counts: chooses gpu_experts=N of a layer split over the GPU and the host"),
    (dict(expert_device="cpu", gpu_experts={1: [0]}), r"gpu_experts: a mapping of layer index -> value, without "
     r"layer 0 \(has \[1\]\)"),
    (dict(expert_device="cpu", ep_group=object()), "splits each layer over one GPU and the host, ep_group its experts"),
])
def test_a_split_patch_is_refused_before_the_model_changes(kw, match):
    """patch_model(expert_device="cpu", ...) on a model whose attention is in host memory (the
    split needs it on a GPU), and its arguments' misuses: each named, no layer swapped (the
    drop-in on a GPU: tests/gpu/test_cuda.py)"""
    model = tiny_model(0)
    before = list(model.model.layers)
    with pytest.raises(ValueError, match=match):
        q3t.patch_model(model, **kw)
    assert list(model.model.layers) == before and not any(isinstance(m, q3t.DecoderLayer) for m in model.modules())


class _PackedLinear(torch.nn.Module):
    """a 4-bit GPTQ module as GPTQModel's stand in for nn.Linear in a model transformers loads
    from a GPTQ checkpoint: qweight, qzeros, scales and g_idx buffers, no weight"""

    def __init__(self, n_in, n_out, group=16):
        super().__init__()
        self.register_buffer("qweight", torch.zeros(n_in // 8, n_out, dtype=torch.int32))
        self.register_buffer("qzeros", torch.zeros(n_in // group, n_out // 8, dtype=torch.int32))
        self.register_buffer("scales", torch.ones(n_in // group, n_out, dtype=torch.float16))
        self.register_buffer("g_idx", torch.arange(n_in, dtype=torch.int32) // group)


def test_a_layer_of_gptq_modules_is_refused_by_name():
    """a model transformers loaded from a GPTQ checkpoint holds GPTQModel's modules where
    nn.Linear was (and, in 5.24, its fused experts newly initialized): refused naming the
    modules, pointing to from_checkpoint, before the model changes"""
    model = tiny_model(0)
    attn = model.model.layers[1].self_attn
    attn.q_proj = _PackedLinear(64, 8 * 24)
    attn.o_proj = _PackedLinear(8 * 24, 64)
    before = list(model.model.layers)
    with pytest.raises(ValueError, match=r"hf_layer: its self_attn.o_proj, self_attn.q_proj are 4-bit GPTQ modules "
                       r"\(_PackedLinear\).*DecoderLayer.from_checkpoint\(path, layer_idx\)"):
        q3t.patch_model(model)
    assert list(model.model.layers) == before and not any(isinstance(m, q3t.DecoderLayer) for m in model.modules())
