"""The layer with numpy alone, no torch: an fp32 layer's prefill, chunked prefill and decode
against a float64 reference of transformers' qwen3_moe math (float64_layer.py), on the CPU
path this machine chose. benchmarks/arm_python.py runs this folder under emulation on aarch64,
with an arm64 CPython and numpy (test_under_qemu.py)."""
import json
import os
import platform

import numpy as np
import pytest

import qwen3layer as q3
from float64_layer import Float64Layer, random_weights
from qwen3layer.checkpoint.writer import GPTQ_CONFIG, write_random_checkpoint

CONFIG = q3.LayerConfig.tiny()
TOL = 1e-4  # max |fp32 - float64| over max |float64|: seen ~1e-6 on x86-64 and under qemu


def rel_err(got, want):
    return float(np.abs(np.asarray(got, dtype=np.float64) - want).max() / np.abs(want).max())


def made(seed):
    w = random_weights(CONFIG, seed)
    return q3.DecoderLayer(CONFIG, w, dtype="float32"), Float64Layer(CONFIG, w)


def draw(seed, shape):
    return np.random.default_rng(seed).normal(size=shape).astype(np.float32)


def test_the_machine_and_path_it_runs_on():
    """the path QWEN3LAYER_CPU_PATH names, else the default: on aarch64 (every Linux CPU there
    has ASIMD) neon or neon_bf16, never the opt-in sve"""
    info = q3.build_info()
    assert info["cpu_path"] in info["cpu_paths"] and "portable" in info["cpu_paths"]
    if os.environ.get("QWEN3LAYER_CPU_PATH"):
        assert info["cpu_path"] == os.environ["QWEN3LAYER_CPU_PATH"], info
    elif platform.machine() == "aarch64":
        assert info["cpu_path"] in ("neon", "neon_bf16") and "neon" in info["cpu_paths"], info


def test_prefill_matches_float64():
    layer, ref = made(1)
    x = draw(2, (13, CONFIG.hidden_size))
    y = layer.prefill(x, layer.new_cache(32))
    want, logits = ref(x)
    assert ref.routing_margin(logits) > 1e-3  # fp32 rounding cannot swap an expert
    assert isinstance(y, np.ndarray) and y.dtype == np.float32 and y.shape == x.shape
    assert rel_err(y, want) < TOL


def test_chunked_prefill_then_decode_match_float64():
    layer, ref = made(3)
    cache = layer.new_cache(32)
    x = draw(4, (11, CONFIG.hidden_size))
    y = layer.prefill(x, cache, chunk_size=4)  # passes of 4, 4 and 3 tokens
    want, logits = ref(x)
    margins = [ref.routing_margin(logits)]
    assert rel_err(y, want) < TOL and cache.lengths == (11,)
    for step in range(5):
        x = draw(10 + step, (1, CONFIG.hidden_size))
        y = layer.decode(x, cache)
        want, logits = ref(x)
        margins.append(ref.routing_margin(logits))
        assert rel_err(y, want) < TOL, step
    assert cache.lengths == (16,) and min(margins) > 1e-3


def test_the_tolerance_sees_a_token_out_of_place():
    """the comparison can fail: the same decode step against a reference whose cache holds one
    token more (every later position off by one) is far outside TOL"""
    layer, ref = made(5)
    x = draw(6, (9, CONFIG.hidden_size))
    layer.prefill(x, cache := layer.new_cache(32))
    ref(np.concatenate([x, draw(7, (1, CONFIG.hidden_size))]))
    step = draw(8, (1, CONFIG.hidden_size))
    assert rel_err(layer.decode(step, cache), ref(step)[0]) > 100 * TOL


@pytest.mark.parametrize("fmt,qc", [("dense", None), ("fp8_e4m3_block128", None), ("gptq_int4", dict(GPTQ_CONFIG, group_size=32))])
def test_a_written_checkpoint_reads_back_as_the_layers_it_was_drawn_from(tmp_path, fmt, qc):
    """write_random_checkpoint, then DecoderLayer.from_checkpoint (memory-mapped safetensors):
    each layer's output bit for bit that of DecoderLayer.random with the same seed"""
    path = write_random_checkpoint(str(tmp_path / "ckpt"), CONFIG, num_layers=2, seed=3, dtype="float32",
                                   weight_format=fmt, quantization_config=qc)
    for i in range(2):
        read = q3.DecoderLayer.from_checkpoint(path, i)
        drawn = q3.DecoderLayer.random(CONFIG, seed=3 + i, dtype="float32", weight_format=fmt, quantization_config=qc)
        assert read.weight_format == drawn.weight_format == fmt
        x = drawn.random_input((7, CONFIG.hidden_size), seed=i)
        got, want = (np.from_dlpack(layer.prefill(x, layer.new_cache(8))) for layer in (read, drawn))
        assert np.isfinite(want).all() and np.array_equal(got, want), (fmt, i)


def test_a_shard_whose_header_reaches_past_its_file_is_refused(tmp_path):
    path = write_random_checkpoint(str(tmp_path / "ckpt"), CONFIG, num_layers=1, dtype="float32")
    shards = sorted(f for f in os.listdir(path) if f.endswith(".safetensors"))
    name = os.path.join(path, shards[0])
    with open(name, "rb") as f:
        blob = f.read()
    size = int.from_bytes(blob[:8], "little")
    header = json.loads(blob[8:8 + size])
    victim = next(k for k in header if k != "__metadata__")
    header[victim]["data_offsets"][1] += 1 << 20  # a megabyte past the file's end
    text = json.dumps(header).encode()
    with open(name, "wb") as f:
        f.write(len(text).to_bytes(8, "little") + text + blob[8 + size:])
    with pytest.raises(q3.CheckpointError) as e:
        q3.DecoderLayer.from_checkpoint(path, 0)
    assert shards[0] in str(e.value), str(e.value)
