"""qwen3layer.checkpoint.writer and `python -m qwen3layer write-checkpoint`: checkpoint folders of
random layers, read back by from_checkpoint as the layers DecoderLayer.random makes from the
same seeds, read by transformers as a model, and written whole or not at all."""
import json
import os

import pytest
import torch

import qwen3layer as q3
import qwen3layer.checkpoint.writer as writer
from hf_reference import rel_err, run
from qwen3layer.checkpoint.writer import write_random_checkpoint
from qwen3layer.cli import main

G128 = q3.LayerConfig(hidden_size=256, num_attention_heads=4, num_key_value_heads=2, head_dim=64, num_experts=6,
                      num_experts_per_tok=2, moe_intermediate_size=128)
YARN = q3.LayerConfig(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_experts=6,
                      num_experts_per_tok=2, moe_intermediate_size=32, rope_type="yarn", rope_factor=4.0,
                      rope_original_max_position_embeddings=128, max_position_embeddings=512)


def prefill(layer, x):
    return torch.from_dlpack(layer.prefill(x, layer.new_cache(x.shape[-2] + 1)))


@pytest.mark.parametrize("fmt,quant", [(None, None), ("fp8_e4m3_block128", None),
                                       ("gptq_int4", None),
                                       ("gptq_int4", writer.GPTQ_CONFIG | {"group_size": 64,
                                                                           "checkpoint_format": "gptq_v2"})])
def test_each_layer_read_back_is_the_random_layer_of_its_seed(tmp_path, fmt, quant):
    path = write_random_checkpoint(tmp_path / "ck", G128, num_layers=2, seed=5, weight_format=fmt,
                                   quantization_config=quant, shard_bytes=200_000)
    x = torch.randn(1, 6, 256, generator=torch.Generator().manual_seed(0)).bfloat16()
    for i in range(2):
        read = q3.DecoderLayer.from_checkpoint(path, i)
        made = q3.DecoderLayer.random(G128, 5 + i, weight_format=fmt, quantization_config=quant)
        assert read.weight_format == made.weight_format == (fmt or "dense")
        assert torch.equal(prefill(read, x), prefill(made, x)), i
    other = q3.DecoderLayer.random(G128, 7, weight_format=fmt, quantization_config=quant)  # the test can tell
    assert not torch.equal(prefill(q3.DecoderLayer.from_checkpoint(path, 0), x), prefill(other, x))


@pytest.mark.parametrize("fmt", [None, "gptq_int4"])
def test_a_float16_checkpoint_reads_back_as_the_float16_random_layer(tmp_path, fmt):
    """dense tensors in F16 (a GPTQ checkpoint's norms and router, as Qwen publishes them):
    a float16 layer, the random one of the seed"""
    path = write_random_checkpoint(tmp_path / "ck", G128, num_layers=1, seed=5, dtype="float16", weight_format=fmt)
    read = q3.DecoderLayer.from_checkpoint(path, 0)
    made = q3.DecoderLayer.random(G128, 5, dtype="float16", weight_format=fmt)
    assert read.dtype == made.dtype == "float16" and read.converted == ()
    x = torch.randn(1, 6, 256, generator=torch.Generator().manual_seed(0)).half()
    assert torch.equal(prefill(read, x), prefill(made, x))
    assert prefill(read, x).dtype == torch.float16


def test_a_rule_naming_one_layer_leaves_that_layers_attention_dense(tmp_path):
    """config.json's rules are each layer's: layer 1's q/k/v/o_proj written dense (the dense
    draws), layer 0's 4-bit, and each read back as the layer of its seed"""
    rule = writer.GPTQ_CONFIG | {"dynamic": {r"-:model\.layers\.1\.self_attn\..*": {}}}
    path = write_random_checkpoint(tmp_path / "ck", G128, num_layers=2, seed=5, weight_format="gptq_int4",
                                   quantization_config=rule)
    x = torch.randn(1, 6, 256, generator=torch.Generator().manual_seed(0)).bfloat16()
    for i, dense in ((0, False), (1, True)):
        read = q3.DecoderLayer.from_checkpoint(path, i)
        assert ("self_attn.q_proj.weight" in read.weight_ptrs) == dense
        assert ("self_attn.q_proj.qweight" in read.weight_ptrs) != dense
        made = q3.DecoderLayer(G128, q3._C.random_weights(G128, 5 + i, "bfloat16", "gptq_int4",
                                                          gptq_dense_attention=dense),
                               quantization_config=rule, layer_idx=i)
        assert torch.equal(prefill(read, x), prefill(made, x)), i


def test_the_shards_and_the_index_are_as_transformers_writes_them(tmp_path):
    path = write_random_checkpoint(tmp_path / "ck", G128, num_layers=3, seed=1, weight_format="gptq_int4",
                                   shard_bytes=100_000)
    index = json.load(open(os.path.join(path, "model.safetensors.index.json")))
    files = sorted(f for f in os.listdir(path) if f.endswith(".safetensors"))
    n = len(files)
    assert n > 3 and files == [f"model-{i:05d}-of-{n:05d}.safetensors" for i in range(1, n + 1)]
    assert set(index["weight_map"].values()) == set(files)
    layers_of = {}
    for name, file in index["weight_map"].items():
        if name.startswith("model.layers."):
            layers_of.setdefault(file, set()).add(name.split(".")[2])
    assert all(len(v) == 1 for v in layers_of.values())  # no shard holds two layers' tensors
    data = sum(os.path.getsize(os.path.join(path, f)) for f in files)
    assert index["metadata"]["total_size"] < data  # the tensors' bytes, the headers not counted
    assert not [f for f in os.listdir(tmp_path) if f != "ck"]  # no work folder left


def test_transformers_reads_a_dense_checkpoint_as_the_same_model(tmp_path):
    from transformers import Qwen3MoeForCausalLM

    path = write_random_checkpoint(tmp_path / "ck", YARN, num_layers=2, seed=2, dtype="float32")
    assert q3.LayerConfig.from_hf(json.load(open(os.path.join(path, "config.json")))) == YARN
    model = Qwen3MoeForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="eager").eval()
    ours = q3.DecoderLayer.from_checkpoint(path, 1)
    x = torch.randn(1, 7, 64, generator=torch.Generator().manual_seed(3))
    ref = run(model, x, layer_idx=1)
    assert rel_err(prefill(ours, x) - x, ref.y - x) <= 1e-5


def test_a_failure_leaves_nothing_and_an_existing_folder_is_not_touched(tmp_path, monkeypatch):
    real = writer._C.random_weights
    calls = []

    def failing(*args, **kw):
        calls.append(1)
        if len(calls) == 2:
            raise MemoryError("planted: the second layer's draws")
        return real(*args, **kw)

    monkeypatch.setattr(writer._C, "random_weights", failing)
    with pytest.raises(MemoryError, match="planted"):
        write_random_checkpoint(tmp_path / "ck", G128, num_layers=3)
    assert os.listdir(tmp_path) == []
    (tmp_path / "ck").mkdir()
    (tmp_path / "ck" / "mine.txt").write_text("kept")
    with pytest.raises(FileExistsError, match=r"path: '.*ck' exists; expected a new folder"):
        write_random_checkpoint(str(tmp_path / "ck"), G128)
    assert os.listdir(tmp_path / "ck") == ["mine.txt"]


@pytest.mark.parametrize("kw,error,message", [
    (dict(weight_format="gptq_int4", quantization_config={"bits": 8}), ValueError,
     r"quantization_config.bits: expected 4, got 8"),
    (dict(weight_format="fp8_e4m3_block128", quantization_config={"fmt": "e5m2"}), ValueError,
     r"quantization_config: the FP8 format's is fixed"),
    (dict(weight_format="q4_0"), ValueError, r"weight_format: expected None, 'dense', .* got 'q4_0'"),
    (dict(weight_format="gptq_int4", quantization_config={"sym": False}), ValueError,
     r"quantization_config.sym: expected true \(the writer rounds to nearest with zero 8 and g_idx in order\), "
     r"got False"),
    (dict(weight_format="gptq_int4", quantization_config={"desc_act": True}), ValueError,
     r"quantization_config.desc_act: expected false .* got True"),
    (dict(num_layers=0), ValueError, r"num_layers: expected an int >= 1, got 0"),
    (dict(dtype="float64"), ValueError, r"dtype: expected 'bfloat16', 'float32' or 'float16', got 'float64'"),
])
def test_arguments_are_checked_before_anything_is_written(tmp_path, kw, error, message):
    with pytest.raises(error, match=message):
        write_random_checkpoint(tmp_path / "ck", G128, **kw)
    with pytest.raises(ValueError, match=r"every matrix's inputs must be a multiple of the group \(128\)"):
        write_random_checkpoint(tmp_path / "ck", q3.LayerConfig.tiny(), weight_format="gptq_int4")
    assert os.listdir(tmp_path) == []


def test_the_command_writes_a_checkpoint_run_reads(tmp_path, capsys):
    assert main(["write-checkpoint", str(tmp_path / "ck"), "--layers", "2", "--seed", "4", "--fp8"]) == 0
    assert "wrote" in capsys.readouterr().out
    read = q3.DecoderLayer.from_checkpoint(str(tmp_path / "ck"), 1)
    made = q3.DecoderLayer.random(q3.LayerConfig.tiny(), 5, weight_format="fp8_e4m3_block128")
    x = torch.randn(1, 3, 64).bfloat16()
    assert torch.equal(prefill(read, x), prefill(made, x))
    assert main(["write-checkpoint", str(tmp_path / "ck")]) == 2
    assert "exists" in capsys.readouterr().err
    assert main(["write-checkpoint", str(tmp_path / "mixed"), "--int4", "--group-size", "32", "--dense-attention"]) == 0
    assert "gptq_int4 experts, bfloat16 attention" in capsys.readouterr().out
    read = q3.DecoderLayer.from_checkpoint(str(tmp_path / "mixed"), 0)
    assert read.weight_format == "gptq_int4" and "self_attn.o_proj.weight" in read.weight_ptrs
    assert main(["write-checkpoint", str(tmp_path / "no"), "--dense-attention"]) == 2
    assert "--dense-attention are read with --int4 only" in capsys.readouterr().err
