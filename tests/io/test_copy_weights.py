"""copy_weights, and from_checkpoint(mmap=False) on it: every tensor of a layer copied once into
one block the layer owns, laid out as the engine's q3_weight_table_layout says (table order,
each 64-byte aligned: huge pages for all, where a checkpoint's mapping gives 4 KiB ones). The
layer equals the borrowing one bit for bit and no longer reads the files or tensors it was
made from; the checks it makes are the borrowing layer's."""
import os
import subprocess
import sys
import warnings

import pytest
import torch

import qwen3layer as q3
from qwen3layer import _C
from qwen3layer.checkpoint.writer import write_random_checkpoint

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..")
FORMATS = _C.weight_formats()  # dense, fp8_e4m3_block128, gptq_int4
# GPTQ's groups of 128 inputs need every matrix's inputs a multiple of 128 (the tiny geometry's are not)
GPTQ_CFG = q3.LayerConfig(hidden_size=128, num_attention_heads=2, num_key_value_heads=1, head_dim=64, num_experts=8,
                          num_experts_per_tok=2, moe_intermediate_size=128)
BYTES = {"e4m3": 1, "qweight": 4, "gscales": 2, "qzeros": 4, "g_idx": 4}


def cfg_of(fmt):
    return GPTQ_CFG if fmt == "gptq_int4" else q3.LayerConfig.tiny()


def write(path, fmt):
    return write_random_checkpoint(str(path), cfg_of(fmt), 1, seed=5, weight_format=fmt, shard_bytes=32 << 10)


def outputs(layer, seed=0):
    """a 6-token prefill and two decode steps after it, concatenated"""
    x = torch.randn(6, layer.config.hidden_size, generator=torch.Generator().manual_seed(seed)).bfloat16()
    cache = layer.new_cache(8)
    ys = [layer.prefill(x, cache), layer.decode(x[:1], cache), layer.decode(x[1:2], cache)]
    return torch.cat([y.float() for y in ys])


def block_offsets(layer, fmt):
    """each weight's offset in its block as the engine's layout places it: the table's entries in
    order, each at the end of the one before rounded up to 64 bytes"""
    held = list(layer.weight_ptrs)
    table = next(t for t in (_C.weight_table(layer.config, fmt, None, fused) for fused in (False, True))
                 if [name for name, *_ in t] == held)
    sizes = dict(BYTES, layer=2, scale=4 if layer._core.scale_dtype == "float32" else 2)
    at, offsets = 0, {}
    for name, shape, storage, _ in table:
        offsets[name] = at
        at += sizes[storage] * int(torch.tensor(shape).prod())
        at = -(-at // 64) * 64
    return offsets


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    base = tmp_path_factory.mktemp("copy_weights")
    return {fmt: write(base / fmt, fmt) for fmt in FORMATS}


@pytest.mark.parametrize("fmt", FORMATS)
def test_a_checkpoint_read_into_one_block_equals_the_mapped_layer(checkpoints, fmt):
    mapped = q3.DecoderLayer.from_checkpoint(checkpoints[fmt], 0)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # asked for: no "copied N weights" warning
        copied = q3.DecoderLayer.from_checkpoint(checkpoints[fmt], 0, mmap=False)
    assert copied.weight_format == fmt and copied._mappings == [] and mapped._mappings
    assert mapped.converted == () and sorted(copied.converted) == sorted(copied.weight_ptrs)
    ptrs = copied.weight_ptrs
    first = next(iter(ptrs.values()))
    assert first % 64 == 0
    assert {name: p - first for name, p in ptrs.items()} == block_offsets(copied, fmt)
    assert not set(ptrs.values()) & set(mapped.weight_ptrs.values())
    assert torch.equal(outputs(copied), outputs(mapped))


@pytest.mark.parametrize("fmt", FORMATS)
def test_the_copied_layer_no_longer_reads_the_files(tmp_path, fmt):
    """the shards' tensor bytes overwritten after loading: the mapped layer reads the new bytes
    (so this test sees a layer that still reads its files), the copied one does not"""
    path = write(tmp_path / fmt, fmt)
    mapped = q3.DecoderLayer.from_checkpoint(path, 0)
    copied = q3.DecoderLayer.from_checkpoint(path, 0, mmap=False)
    before = outputs(copied)
    assert torch.equal(outputs(mapped), before)
    for name in os.listdir(path):
        if name.endswith(".safetensors"):
            with open(os.path.join(path, name), "r+b") as f:
                header = 8 + int.from_bytes(f.read(8), "little")
                size = f.seek(0, os.SEEK_END) - header
                f.seek(header)
                f.write(bytes([0x11]) * size)
    assert torch.equal(outputs(copied), before)
    assert not torch.equal(outputs(mapped), before)


def test_copy_weights_takes_the_callers_tensors_once():
    """DecoderLayer(copy_weights=True) from torch tensors: the caller's tensors changed in place
    afterwards change the borrowing layer, not the copying one"""
    cfg = q3.LayerConfig.tiny()
    weights = {n: torch.from_dlpack(t).clone() for n, t in _C.random_weights(cfg, 2, "bfloat16").items()}
    borrowed = q3.DecoderLayer(cfg, weights)
    copied = q3.DecoderLayer(cfg, weights, copy_weights=True)
    before = outputs(copied)
    assert torch.equal(outputs(borrowed), before)
    for t in weights.values():
        t.mul_(0.5)
    assert torch.equal(outputs(copied), before)
    assert not torch.equal(outputs(borrowed), before)


def test_the_checks_are_the_borrowing_layers():
    """a copying layer refuses what a borrowing one does, naming the tensor, before any copy;
    on a CUDA device the option is refused by name before the device is looked at"""
    cfg = q3.LayerConfig.tiny()
    weights = {n: torch.from_dlpack(t).clone() for n, t in _C.random_weights(cfg, 2, "bfloat16").items()}
    short = dict(weights, **{"self_attn.k_proj.weight": weights["self_attn.k_proj.weight"][:3]})
    for copy in (False, True):
        with pytest.raises(ValueError, match=r"weights\['self_attn.k_proj.weight'\]: expected shape \[\d+, \d+\], "
                                             r"got \[3, \d+\]"):
            q3.DecoderLayer(cfg, short, copy_weights=copy)
    with pytest.raises(ValueError, match=r"copy_weights: a host layer's option \(device=-1.*\), got device=0"):
        _C.Layer(cfg, weights, None, 0, copy_weights=True)
    with pytest.raises(ValueError, match=r"mmap: False is a host layer's option \(device='cpu'.*\), got "
                                         r"device='cuda:0'"):
        q3.DecoderLayer.from_checkpoint("no such folder", 0, device="cuda:0", mmap=False)


def test_run_reads_a_checkpoint_into_one_block(checkpoints):
    r = subprocess.run([sys.executable, "-m", "qwen3layer", "run", "--checkpoint", checkpoints["gptq_int4"],
                        "--no-mmap", "--tokens", "12", "--chunk-size", "8", "--new-tokens", "2"], cwd=ROOT,
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert "loading layer 0 of" in r.stdout and "(read into one block)" in r.stdout
    r = subprocess.run([sys.executable, "-m", "qwen3layer", "run", "--geometry", "tiny", "--no-mmap"], cwd=ROOT,
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and "--no-mmap: with --checkpoint only" in r.stderr
