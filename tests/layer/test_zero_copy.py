"""Tensors cross the boundary without copies: outputs in extension memory, weights
borrowed, cache views live, DLPack capsules handled by the protocol, no leaked references."""
import ctypes
import gc
import sys
import warnings

import numpy as np
import pytest
import torch

import qwen3layer as q3
from hf_reference import hf_model

CFG = q3.LayerConfig.tiny()

_capsule_name = ctypes.pythonapi.PyCapsule_GetName
_capsule_name.restype = ctypes.c_char_p
_capsule_name.argtypes = [ctypes.py_object]


@pytest.fixture
def outputs(monkeypatch):
    """The extension Tensors the layer's calls return, as made by _C, before they are handed
    over as the caller's kind of array (qwen3layer.layer._like): the proof of no copy is the
    caller's array at the data pointer of one of them, kept alive by it alone. (The extension
    keeps no list of its tensors: nothing per output exists for the tests' sake.)"""
    made = []
    like = q3.layer._like

    def spy(x, y):
        made.append(y)
        return like(x, y)

    monkeypatch.setattr(q3.layer, "_like", spy)
    return made


@pytest.fixture(scope="module")
def layer():
    return q3.DecoderLayer.random(CFG, seed=1, dtype="float32")


def test_torch_output_lives_in_extension_memory(layer, outputs):
    y = layer.prefill(torch.randn(4, CFG.hidden_size), layer.new_cache(8))
    assert isinstance(y, torch.Tensor)
    [t] = outputs
    assert isinstance(t, q3._C.Tensor) and y.data_ptr() == t.data_ptr
    held = sys.getrefcount(t)  # ours, the argument's and the one y's DLPack capsule holds
    del y
    gc.collect()
    assert sys.getrefcount(t) == held - 1  # torch let go of the memory's owner


def test_numpy_in_numpy_out_in_extension_memory(layer, outputs):
    x = np.random.default_rng(0).standard_normal((3, CFG.hidden_size), dtype=np.float32)
    y = layer.prefill(x, layer.new_cache(8))
    assert isinstance(y, np.ndarray) and y.dtype == np.float32 and y.shape == x.shape
    [t] = outputs
    assert y.__array_interface__["data"][0] == t.data_ptr


def test_out_argument_is_written_in_place(layer):
    x = torch.randn(5, CFG.hidden_size)
    ref = layer.prefill(x, layer.new_cache(8))
    out = torch.empty_like(x)
    got = layer.prefill(x, layer.new_cache(8), out=out)
    assert got is out and torch.equal(out, ref)
    out2 = torch.empty(1, CFG.hidden_size)
    c = layer.new_cache(8)
    layer.prefill(x, c)
    assert layer.decode(x[:1], c, out=out2) is out2


def test_hf_weights_are_borrowed_not_copied():
    hf_layer = hf_model("gqa4_topk_norm").model.layers[0]
    layer = q3.DecoderLayer.from_hf(hf_layer)
    assert layer.converted == ()
    sd = hf_layer.state_dict()
    for name, ptr in layer.weight_ptrs.items():
        assert ptr == sd[name].data_ptr(), name
    assert set(layer.weight_ptrs) == set(sd)


def test_random_weights_are_borrowed_from_extension_memory():
    weights = q3._C.random_weights(CFG, 0, "bfloat16")
    layer = q3.DecoderLayer(CFG, weights)
    assert layer.dtype == "bfloat16" and layer.converted == ()
    for name, t in weights.items():
        assert layer.weight_ptrs[name] == t.data_ptr


def test_unfitting_weights_are_converted_once_with_a_warning():
    hf_layer = hf_model("gqa4_topk_norm").model.layers[0]
    sd = {k: v.detach() for k, v in hf_layer.state_dict().items()}
    sd["self_attn.o_proj.weight"] = sd["self_attn.o_proj.weight"].t().contiguous().t()  # same values, transposed layout
    cfg = q3.LayerConfig.from_hf(hf_layer.self_attn.config)
    with pytest.warns(UserWarning, match="copied 1 weight"):
        layer = q3.DecoderLayer(cfg, sd)
    assert layer.converted == ("self_attn.o_proj.weight",)
    assert layer.weight_ptrs["self_attn.o_proj.weight"] != sd["self_attn.o_proj.weight"].data_ptr()
    ref = q3.DecoderLayer.from_hf(hf_layer)
    x = torch.randn(6, cfg.hidden_size)
    assert torch.equal(layer.prefill(x, layer.new_cache(8)), ref.prefill(x, ref.new_cache(8)))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        bf = q3.DecoderLayer(cfg, {k: v.bfloat16() for k, v in sd.items() if k != "self_attn.o_proj.weight"}
                             | {"self_attn.o_proj.weight": sd["self_attn.o_proj.weight"].bfloat16().contiguous()})
    assert bf.converted == ()


def test_reference_counts_are_stable_over_1000_calls(layer, outputs):
    x = torch.randn(1, CFG.hidden_size)
    cache = layer.new_cache(1100)
    core = layer._core
    before = (sys.getrefcount(x), sys.getrefcount(cache), sys.getrefcount(core))
    out = torch.empty_like(x)
    for i in range(1000):
        if i % 2:
            layer.decode(x, cache, out=out)
        else:
            y = layer.decode(x, cache)
    del y
    gc.collect()
    after = (sys.getrefcount(x), sys.getrefcount(cache), sys.getrefcount(core))
    assert before == after
    assert cache.lengths == (1000,)
    # every output the calls made is dead but for our list: none leaked (held by the list and
    # getrefcount's argument alone), so each buffer is freed with it
    assert len(outputs) == 500 and {sys.getrefcount(outputs[i]) for i in range(500)} == {2}


def test_cache_views_are_live_and_keep_the_cache_alive():
    layer = q3.DecoderLayer.random(CFG, seed=2, dtype="float32")
    cache = layer.new_cache(16)
    layer.prefill(torch.randn(3, CFG.hidden_size), cache)
    keys = torch.from_dlpack(cache.keys())
    assert keys.shape == (CFG.num_key_value_heads, 3, CFG.head_dim)
    assert keys.stride() == (16 * CFG.head_dim, CFG.head_dim, 1)
    before = keys.clone()
    cache.truncate(1)
    layer.prefill(torch.randn(2, CFG.hidden_size), cache)  # overwrites positions 1 and 2
    assert torch.equal(keys[:, :1], before[:, :1]) and not torch.equal(keys[:, 1:], before[:, 1:])
    del layer, cache
    gc.collect()
    assert torch.isfinite(keys).all()  # memory still valid: the view holds the cache


def capsule_of(obj, **kw):
    cap = obj.__dlpack__(**kw)
    return cap, _capsule_name(cap)


def test_export_versioned_and_legacy_capsules(layer):
    y = layer._core.prefill(torch.randn(2, CFG.hidden_size), layer.new_cache(4))
    assert isinstance(y, q3.Tensor) and y.__dlpack_device__() == (1, 0)
    assert capsule_of(y)[1] == b"dltensor"
    assert capsule_of(y, max_version=(1, 0))[1] == b"dltensor_versioned"
    assert capsule_of(y, max_version=(0, 8))[1] == b"dltensor"
    with pytest.raises(BufferError, match="stream"):
        y.__dlpack__(stream=1)
    with pytest.raises(BufferError, match="device type 2"):
        y.__dlpack__(dl_device=(2, 0))
    copy = torch.from_dlpack(np.from_dlpack(y, copy=True))
    assert copy.data_ptr() != y.data_ptr and torch.equal(copy, torch.from_dlpack(y))


class Producer:
    """A DLPack producer handing out a fixed capsule, legacy or versioned."""

    def __init__(self, t, legacy):
        self.t, self.legacy = t, legacy
        self.capsule = None

    def __dlpack_device__(self):
        return self.t.__dlpack_device__()

    def __dlpack__(self, *, stream=None, max_version=None, dl_device=None, copy=None):
        if self.legacy and max_version is not None:
            raise TypeError("__dlpack__() got an unexpected keyword argument 'max_version'")
        self.capsule = self.t.__dlpack__() if self.legacy else self.t.__dlpack__(max_version=max_version)
        return self.capsule


@pytest.mark.parametrize("legacy", [False, True])
def test_import_renames_the_consumed_capsule(layer, legacy):
    x = torch.randn(3, CFG.hidden_size)
    ref = layer.prefill(x, layer.new_cache(4))
    p = Producer(x, legacy)
    y = layer.prefill(p, layer.new_cache(4))
    assert isinstance(y, q3.Tensor)
    assert _capsule_name(p.capsule) == (b"used_dltensor" if legacy else b"used_dltensor_versioned")
    assert torch.equal(torch.from_dlpack(y), ref)


@pytest.mark.parametrize("legacy", [False, True])
def test_a_capsule_itself_is_taken_once_and_checked(layer, legacy):
    """the extension's call takes a capsule as __dlpack__ returns it (the drop-in hands it one,
    skipping torch's export checks): the same numbers, the capsule consumed, a used capsule and
    a capsule of another dtype refused by name before anything is written"""
    x = torch.randn(3, CFG.hidden_size)
    ref = layer._core.prefill(x, layer.new_cache(4))
    cap = x.__dlpack__() if legacy else x.__dlpack__(max_version=(1, 0))
    kv = layer.new_cache(4)
    y = layer._core.prefill(cap, kv)
    assert _capsule_name(cap) == (b"used_dltensor" if legacy else b"used_dltensor_versioned")
    assert torch.equal(torch.from_dlpack(y), torch.from_dlpack(ref)) and kv.lengths == (3,)
    with pytest.raises(TypeError, match=r"x: expected an unused DLPack capsule, got <capsule object \"used_dltensor"):
        layer._core.prefill(cap, kv)
    wrong = torch.randn(3, CFG.hidden_size, dtype=torch.float64)
    with pytest.raises(TypeError, match="x: expected dtype .* got float64"):
        layer._core.prefill(wrong.__dlpack__() if legacy else wrong.__dlpack__(max_version=(1, 0)), kv)
    assert kv.lengths == (3,)


def test_reprs_say_what_a_notebook_user_needs():
    layer = q3.DecoderLayer.random(CFG, seed=1, dtype="bfloat16")
    assert "dtype=bfloat16, device=cpu, weights" in repr(layer)
    assert layer.weight_bytes == sum(t.nbytes for t in q3._C.random_weights(CFG, 0, "bfloat16").values())
    cache = layer.new_cache(16, batch=2)
    layer.prefill(torch.randn(3, CFG.hidden_size, dtype=torch.bfloat16), cache, seq=1)
    assert "filled=3/32 tokens" in repr(cache) and "batch=2" in repr(cache)


def test_the_extension_has_type_stubs():
    import os

    pkg = os.path.dirname(q3.__file__)
    assert os.path.exists(os.path.join(pkg, "py.typed"))
    with open(os.path.join(pkg, "_C.pyi")) as f:
        stub = f.read()
    for name in ("class KVCache", "class Layer", "def build_info", "def set_padding", "def prefill"):
        assert name in stub, name
    import re

    stubbed = set(re.findall(r"^def (\w+)", stub, re.M))
    actual = {n for n in dir(q3._C) if not n.startswith("_") and callable(getattr(q3._C, n))
              and not isinstance(getattr(q3._C, n), type)}
    assert stubbed == actual
    from qwen3layer import _testing  # the test module's stubs too

    with open(os.path.join(pkg, "_testing.pyi")) as f:
        assert set(re.findall(r"^def (\w+)", f.read(), re.M)) == {n for n in dir(_testing) if not n.startswith("_")}
    for cls in ("Tensor", "KVCache", "Layer"):
        body = stub.split(f"class {cls}")[1].split("\nclass ")[0]
        members = set(re.findall(r"^    (?:def )?(\w+)", body, re.M))
        public = {n for n in dir(getattr(q3._C, cls)) if not n.startswith("_")}
        assert public <= members, (cls, public - members)


def test_big_tensors_start_on_a_huge_page_and_small_ones_on_a_line():
    """the engine's allocator: 4 MiB and more aligned to 2 MiB (the whole 2 MiB pages asked to
    be huge pages, csrc/engine/status.c), smaller ones to a cache line; both exactly as long
    as asked (AddressSanitizer sees one byte past)"""
    big = q3._C.random_tensor((1024, 1024), 1, "float32")  # 4 MiB
    small = q3._C.random_tensor((3, 5), 1, "float32")
    assert big.data_ptr % (2 << 20) == 0, hex(big.data_ptr)
    assert small.data_ptr % 64 == 0, hex(small.data_ptr)
    values = np.from_dlpack(big)
    assert values.shape == (1024, 1024) and np.isfinite(values).all()
