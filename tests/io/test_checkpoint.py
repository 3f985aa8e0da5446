"""DecoderLayer.from_checkpoint: one layer of a transformers safetensors checkpoint, memory-
mapped and borrowed without a copy; every bad checkpoint gets a clear error."""
import json
import os
import shutil
import subprocess
import sys

import pytest
import torch

import qwen3layer as q3
from hf_reference import hf_config

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..")


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """A 2-layer tiny model saved in 100 KB shards, and the model."""
    path = tmp_path_factory.mktemp("ckpt")
    cfg = hf_config("gqa4_topk_norm")
    cfg.num_hidden_layers = 2
    from transformers import Qwen3MoeForCausalLM

    torch.manual_seed(0)
    model = Qwen3MoeForCausalLM(cfg).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.1) if p.dim() > 1 else p.copy_(1 + 0.1 * torch.randn_like(p))
    model.save_pretrained(path, max_shard_size="100KB")
    assert len([f for f in os.listdir(path) if f.endswith(".safetensors")]) > 2
    return str(path), model


def mapped_ranges(layer):
    return [(q3._C.buffer_view(mm, 0, (1,), "float32").data_ptr, len(mm)) for mm in layer._mappings]


@pytest.mark.parametrize("idx", [0, 1])
def test_layer_from_sharded_checkpoint_equals_the_model_layer(saved, idx):
    path, model = saved
    layer = q3.DecoderLayer.from_checkpoint(path, idx)
    assert layer.converted == ()
    ranges = mapped_ranges(layer)
    for name, ptr in layer.weight_ptrs.items():  # every weight is read from the mapped file
        assert any(a <= ptr < a + n for a, n in ranges), name
    ref = q3.DecoderLayer.from_hf(model.model.layers[idx])
    x = torch.randn(7, model.config.hidden_size)
    assert torch.equal(layer.prefill(x, layer.new_cache(8)), ref.prefill(x, ref.new_cache(8)))


def test_single_file_checkpoint(saved, tmp_path):
    _, model = saved
    model.save_pretrained(tmp_path, max_shard_size="1GB")
    assert os.path.exists(tmp_path / "model.safetensors")
    layer = q3.DecoderLayer.from_checkpoint(str(tmp_path), 1)
    ref = q3.DecoderLayer.from_hf(model.model.layers[1])
    x = torch.randn(3, model.config.hidden_size)
    assert torch.equal(layer.prefill(x, layer.new_cache(4)), ref.prefill(x, ref.new_cache(4)))


def copy_of(saved, tmp_path):
    dst = tmp_path / "copy"
    shutil.copytree(saved[0], dst)
    return dst


def test_missing_config(saved, tmp_path):
    dst = copy_of(saved, tmp_path)
    os.remove(dst / "config.json")
    with pytest.raises(ValueError, match="missing config.json"):
        q3.DecoderLayer.from_checkpoint(str(dst), 0)


def test_layer_index_out_of_range(saved):
    with pytest.raises(IndexError, match=r"layer_idx: expected 0 <= layer_idx < 2 \(num_hidden_layers\), got 2"):
        q3.DecoderLayer.from_checkpoint(saved[0], 2)


def test_missing_tensor(saved, tmp_path):
    dst = copy_of(saved, tmp_path)
    index = json.loads((dst / "model.safetensors.index.json").read_text())
    del index["weight_map"]["model.layers.1.mlp.gate.weight"]
    (dst / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(ValueError, match="missing model.layers.1.mlp.gate.weight"):
        q3.DecoderLayer.from_checkpoint(str(dst), 1)


def test_wrong_shape(saved, tmp_path):
    dst = copy_of(saved, tmp_path)
    cfg = json.loads((dst / "config.json").read_text())
    cfg["moe_intermediate_size"] = 16
    (dst / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match=r"expected shape \[16, 64\], got \[32, 64\]"):
        q3.DecoderLayer.from_checkpoint(str(dst), 0)


def test_truncated_shard(saved, tmp_path):
    dst = copy_of(saved, tmp_path)
    index = json.loads((dst / "model.safetensors.index.json").read_text())
    shard = dst / index["weight_map"]["model.layers.1.self_attn.q_proj.weight"]
    data = shard.read_bytes()
    shard.write_bytes(data[: len(data) - 100])
    with pytest.raises(ValueError, match="truncated"):
        q3.DecoderLayer.from_checkpoint(str(dst), 1)


def test_float16_checkpoint_is_a_float16_layer(saved, tmp_path):
    """save_pretrained of a .half() model: borrowed from the mapping as it is, the very layer
    from_hf makes of the half model's modules; a float64 one is refused naming the tensor"""
    _, model = saved
    import copy

    half = copy.deepcopy(model).half()
    half.save_pretrained(tmp_path / "f16", max_shard_size="1GB")
    layer = q3.DecoderLayer.from_checkpoint(str(tmp_path / "f16"), 0)
    assert layer.dtype == "float16" and layer.converted == ()
    x = torch.randn(5, model.config.hidden_size, generator=torch.Generator().manual_seed(3)).half()
    want = q3.DecoderLayer.from_hf(half.model.layers[0])
    assert torch.equal(layer.prefill(x, layer.new_cache(8)), want.prefill(x, want.new_cache(8)))
    copy.deepcopy(model).double().save_pretrained(tmp_path / "f64", max_shard_size="1GB")
    with pytest.raises(TypeError, match="input_layernorm.weight: expected dtype BF16, F32 or F16, got F64"):
        q3.DecoderLayer.from_checkpoint(str(tmp_path / "f64"), 0)


def test_run_uses_the_checkpoint(saved):
    r = subprocess.run([sys.executable, "-m", "qwen3layer", "run", "--checkpoint", saved[0], "--layer", "1",
                        "--tokens", "20", "--chunk-size", "8", "--new-tokens", "2"], cwd=ROOT, capture_output=True,
                       text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert "loading layer 1 of" in r.stdout and "prefill  20 tokens in chunks of 8" in r.stdout
    assert "dtype=float32" in r.stdout


def test_more_than_64_experts(tmp_path):
    """Every other checkpoint test has at most 16 experts: 72 (top-2) in a sharded checkpoint,
    layer 1, its router tilted so that experts past 64 are chosen, against the same layer
    built from the transformers module."""
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    from hf_reference import run

    cfg = Qwen3MoeConfig(vocab_size=16, hidden_size=32, intermediate_size=32, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=8, num_experts=72,
                         num_experts_per_tok=2, moe_intermediate_size=16, norm_topk_prob=True,
                         max_position_embeddings=256, rms_norm_eps=1e-6, attn_implementation="eager")
    torch.manual_seed(0)
    model = Qwen3MoeForCausalLM(cfg).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, p.shape[-1] ** -0.5) if p.dim() > 1 else p.copy_(1 + 0.1 * torch.randn_like(p))
        model.model.layers[1].mlp.gate.weight[64:] *= 2
    model.save_pretrained(tmp_path, max_shard_size="100KB")
    assert len([f for f in os.listdir(tmp_path) if f.endswith(".safetensors")]) > 2

    x, step = torch.randn(6, 32), torch.randn(1, 32)
    chosen = run(model, x[None], layer_idx=1).router_logits.topk(2).indices
    assert (chosen >= 64).any() and (chosen < 64).any(), chosen

    layer = q3.DecoderLayer.from_checkpoint(str(tmp_path), 1)
    ref = q3.DecoderLayer.from_hf(model.model.layers[1])
    assert layer.config.num_experts == 72 and layer.converted == ()
    cache, ref_cache = layer.new_cache(8), ref.new_cache(8)
    assert torch.equal(layer.prefill(x, cache), ref.prefill(x, ref_cache))
    assert torch.equal(layer.decode(step, cache), ref.decode(step, ref_cache))


def _tensor_spans(path, idx):
    """{name: (file, first byte, end)} of layer idx's tensors, from the shards' headers"""
    import struct
    out = {}
    for f in os.listdir(path):
        if not f.endswith(".safetensors"):
            continue
        with open(os.path.join(path, f), "rb") as fh:
            (n,) = struct.unpack("<Q", fh.read(8))
            header = json.loads(fh.read(n))
        for name, e in header.items():
            if name.startswith(f"model.layers.{idx}."):
                b, end = e["data_offsets"]
                out[name[len(f"model.layers.{idx}."):]] = (os.path.join(path, f), 8 + n + b, 8 + n + end)
    return out


def test_a_subset_of_the_experts_maps_only_their_bytes(saved):
    """what each rank of qwen3layer.parallel loads: the attention and router weights and its
    experts' bytes; no other expert's byte is mapped (nor checked, nor read)"""
    path, model = saved
    mine = [1, 3]
    layer = q3.DecoderLayer.from_checkpoint(path, 1, experts=mine)
    assert layer.held_experts == (1, 3)
    spans = _tensor_spans(path, 1)
    wanted = {n for n in spans if not n.startswith("mlp.experts.") or n.split(".")[2] in ("1", "3")}
    others = set(spans) - wanted
    assert others and len(wanted) == 9 + 3 * len(mine)
    mapped = layer._mapped_spans
    for f, b, e in mapped:  # each mapping covers whole wanted tensors and nothing of another
        assert not any(sf == f and sb < e and b < se for sf, sb, se in (spans[n] for n in others)), (f, b, e)
    for n in wanted:  # and every wanted tensor is inside one
        sf, sb, se = spans[n]
        assert any(f == sf and b <= sb and se <= e for f, b, e in mapped), n
    ranges = mapped_ranges(layer)
    for name, ptr in layer.weight_ptrs.items():
        assert any(a <= ptr < a + n for a, n in ranges), name
    whole = q3.DecoderLayer.from_checkpoint(path, 1)
    assert layer.weight_bytes < whole.weight_bytes
    x = torch.randn(5, model.config.hidden_size)
    a = layer.attention_half(x, layer.new_cache(8))
    b = whole.attention_half(x, whole.new_cache(8))
    assert all(torch.equal(u, v) for u, v in zip(a, b))
    ids = torch.where((a[2] == 1) | (a[2] == 3), a[2], -1)
    assert torch.equal(layer.expert_half(a[1], ids, a[3]), whole.expert_half(a[1], ids, a[3]))
