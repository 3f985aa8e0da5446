"""Absurd sizes and hostile arguments: every size product is checked before memory is
reached, a failed call leaves nothing half-done, and a Ctrl-C stops a long prefill at the
next chunk with the cache rolled back. Each case here read or wrote out of bounds, gave a
wrong answer or a misleading error before it was fixed."""
import _thread
import ctypes
import dataclasses
import os
import sys
import threading
import time

import numpy as np
import pytest
import torch

import qwen3layer as q3
from qwen3layer import _C

CFG = q3.LayerConfig.tiny()
H = CFG.hidden_size


@pytest.fixture(scope="module")
def layer():
    return q3.DecoderLayer.random(CFG, seed=21, dtype="float32")


# ---- buffer views ---------------------------------------------------------------------------

@pytest.mark.parametrize("offset,shape", [
    (2**63 - 8, [4]),            # offset + bytes overflowed int64 and passed the bounds check
    (2**62, [2**61]),            # bytes of the shape overflow
    (0, [2**62, 8]),             # the element count overflows
    (0, [-1]),
    (-8, [1]),
    (60, [2]),                   # one element past the end
])
def test_buffer_view_out_of_range_is_rejected(offset, shape):
    with pytest.raises((ValueError, OverflowError), match="buffer|shape|offset"):
        _C.buffer_view(bytearray(64), offset, shape, "float32")


@pytest.mark.parametrize("shape", [
    [0, 2**70],                  # a dim past int64 beside a 0: raised OverflowError, not the shape's error
    [0, 2**40, 2**40],           # 0 elements, but the stride of dim 0 overflowed int64 (signed overflow)
    [0, 2**31, 2**31, 2],        # the same, its bytes overflowing only with the item size
])
def test_buffer_view_of_an_empty_shape_with_huge_dims_is_a_value_error(shape):
    """Found by fuzz_checkpoint: a header entry of shape [0, 2**70] passed the loader's size
    check (0 bytes) and reached the view as an OverflowError no caller expects."""
    with pytest.raises(ValueError, match="shape"):
        _C.buffer_view(bytearray(64), 0, shape, "float32")


def test_buffer_view_of_an_empty_shape_with_fitting_dims_works():
    t = torch.from_dlpack(_C.buffer_view(bytearray(64), 0, [3, 0, 2**20], "float32"))
    assert t.shape == (3, 0, 2**20) and t.numel() == 0


def test_buffer_view_in_range_still_works():
    buf = bytearray(np.arange(16, dtype=np.float32).tobytes())
    t = _C.buffer_view(buf, 8, [2, 3], "float32")
    assert torch.equal(torch.from_dlpack(t), torch.arange(2, 8, dtype=torch.float32).reshape(2, 3))


def test_read_only_buffer_is_never_exported_writable():
    """The legacy DLPack capsule has no read-only flag: a view of a read-only buffer (a
    memory-mapped checkpoint) is refused there; the versioned capsule carries the flag."""
    view = _C.buffer_view(bytes(64), 0, [4], "float32")
    with pytest.raises(BufferError, match="read-only"):
        view.__dlpack__()
    cap = view.__dlpack__(max_version=(1, 0))
    assert "dltensor_versioned" in repr(cap)
    writable = _C.buffer_view(bytearray(64), 0, [4], "float32")
    assert "dltensor" in repr(writable.__dlpack__())


# ---- caches, tensors, configs ------------------------------------------------------------------

@pytest.mark.parametrize("max_tokens,batch", [(2**62, 1), (2**40, 2**20), (2**31, 2**31 - 1)])
def test_cache_whose_size_overflows_is_rejected(layer, max_tokens, batch):
    """2**62 tokens made a 0-byte cache that the next prefill overran."""
    with pytest.raises((ValueError, MemoryError), match="max_tokens|batch|KV cache"):
        layer.new_cache(max_tokens, batch)


@pytest.mark.parametrize("shape", [(2**31, 2**31), (2**40, 2**40, 2**40), (2**62, 4)])
def test_random_tensor_whose_size_overflows_is_rejected(layer, shape):
    with pytest.raises((ValueError, MemoryError), match="shape"):
        layer.random_input(shape, 0)


@pytest.mark.parametrize("field,value", [
    ("moe_intermediate_size", 2**31),
    ("num_attention_heads", 2**31),
    ("num_key_value_heads", 2**31),
    ("hidden_size", 2**40),
    ("head_dim", 2**31),
    ("num_experts", 10**9),
    ("num_experts", 2**32 + 8),
    ("max_position_embeddings", 2**62),
])
def test_config_beyond_the_engine_limits_is_rejected(field, value):
    """num_attention_heads = 2**31 was reported as -2147483648; sizes that overflow the
    products the engine forms were accepted."""
    kwargs = dataclasses.asdict(CFG) | {field: value}
    if field == "num_attention_heads":
        kwargs["num_key_value_heads"] = 1
    with pytest.raises(ValueError, match=rf"{field}: expected at most \d+, got {value}"):
        q3.LayerConfig(**kwargs)


def test_experts_with_huge_products_are_rejected():
    """Each size within its limit, but the experts' weights past any memory: the product is
    checked too."""
    with pytest.raises(ValueError, match="weights"):
        q3.LayerConfig(hidden_size=2**20, num_attention_heads=64, num_key_value_heads=4, head_dim=4096,
                       num_experts=4096, num_experts_per_tok=8, moe_intermediate_size=2**20)


# ---- calls ---------------------------------------------------------------------------------------

def test_seq_that_is_a_bool_is_rejected(layer):
    cache = layer.new_cache(8)
    with pytest.raises(TypeError, match="seq: expected an int, got bool"):
        layer.prefill(torch.randn(2, H), cache, seq=True)
    assert cache.lengths == (0,)


def test_out_partly_overlapping_x_is_rejected(layer):
    big = torch.randn(8, H)
    cache = layer.new_cache(16)
    with pytest.raises(ValueError, match="out: overlaps x"):
        layer.prefill(big[0:6], cache, out=big[1:7])
    assert cache.lengths == (0,)


def test_out_that_is_x_gives_the_same_result(layer):
    x = torch.randn(6, H)
    want = layer.prefill(x.clone(), layer.new_cache(16), chunk_size=4)
    got = layer.prefill(x, layer.new_cache(16), chunk_size=4, out=x)
    assert got is x and torch.equal(x, want)


# ---- DLPack producers ------------------------------------------------------------------------------

from dlpack_ctypes import Announcing, DELETER as _DELETER  # noqa: E402
from dlpack_ctypes import DLDataType as _DLDataType  # noqa: E402
from dlpack_ctypes import DLDevice as _DLDevice  # noqa: E402
from dlpack_ctypes import DLManagedTensor as _DLManaged  # noqa: E402
from dlpack_ctypes import DLTensor as _DLTensor  # noqa: E402
from dlpack_ctypes import capsule_new as _capsule_new  # noqa: E402


class PythonDeleterProducer:
    """A legacy DLPack producer whose deleter is Python code (a ctypes callback), holding a
    tensor of the given dtype code/bits and shape."""

    def __init__(self, code, bits, shape, byte_offset=0):
        self.buffer = (ctypes.c_uint8 * 4096)()
        self.shape = (ctypes.c_int64 * len(shape))(*shape)
        self.deleted = 0

        def deleter(_):
            self.deleted += 1  # Python code: fails with SystemError if an exception is pending

        self.deleter = _DELETER(deleter)
        self.managed = _DLManaged(_DLTensor(ctypes.cast(self.buffer, ctypes.c_void_p), _DLDevice(1, 0), len(shape),
                                            _DLDataType(code, bits, 1), self.shape, None, byte_offset), None,
                                  self.deleter)

    def __dlpack_device__(self):
        return (1, 0)

    def __dlpack__(self, **kw):
        if "max_version" in kw:
            raise TypeError("a legacy producer")
        return _capsule_new(ctypes.addressof(self.managed), b"dltensor", None)


def test_a_python_deleter_does_not_hide_the_real_error(layer):
    """The deleter of a rejected tensor runs with the pending exception saved: the caller sees
    the TypeError about the dtype, not a SystemError from the deleter."""
    cache = layer.new_cache(8)
    producer = PythonDeleterProducer(0, 32, [2, H])  # int32
    with pytest.raises(TypeError, match="x: expected dtype float32, bfloat16 or float16, got int32"):
        layer.prefill(producer, cache)
    assert producer.deleted == 1
    negative = PythonDeleterProducer(2, 32, [-2, H])
    with pytest.raises(ValueError, match=r"x: expected non-negative dimensions, got \[-2, 64\]"):
        layer.prefill(negative, cache)
    assert negative.deleted == 1 and cache.lengths == (0,)


@pytest.mark.parametrize("dtype_bits,offset", [(32, 1), (32, 2), (16, 1)])
def test_misaligned_data_is_rejected(layer, dtype_bits, offset):
    """The kernels load whole elements (and 16-byte vectors): data not aligned to its element
    size is refused (a fuzzer found it read and written)."""
    cache = layer.new_cache(8)
    code = 2 if dtype_bits == 32 else 4
    x = PythonDeleterProducer(code, dtype_bits, [2, H], byte_offset=offset)
    with pytest.raises(ValueError, match=rf"x: expected data aligned to its {dtype_bits // 8}-byte elements"):
        layer.prefill(x, cache)
    out = PythonDeleterProducer(code, dtype_bits, [2, H], byte_offset=offset)
    dt = torch.float32 if dtype_bits == 32 else torch.bfloat16
    with pytest.raises(ValueError, match="out: expected data aligned"):
        layer.prefill(torch.zeros(2, H, dtype=dt), cache, out=out)
    assert x.deleted == 1 and out.deleted == 1 and cache.lengths == (0,)


def test_a_call_that_cannot_fit_allocates_no_output(layer):
    """The capacity is checked before the output is made: x claiming 2**40 tokens (its
    memory never read) against a cache of 8 is a CacheFullError, not a MemoryError from
    allocating a 2**48-byte output first."""
    cache = layer.new_cache(8)
    claim = PythonDeleterProducer(2, 32, [2**40, H])
    with pytest.raises(q3.CacheFullError, match="sequence 0 holds 0 of 8 tokens"):
        layer.prefill(claim, cache)
    assert claim.deleted == 1 and cache.lengths == (0,)


def test_a_pass_too_large_to_index_is_rejected(layer):
    """A pass of rows x top_k (token, expert) pairs is indexed by int32: a chunk_size past
    that is refused, naming the largest that works, before anything is read."""
    cache = layer.new_cache(8)
    claim = PythonDeleterProducer(2, 32, [2**40, H])
    with pytest.raises(ValueError, match=r"chunk_size: a pass of 1099511627776 tokens x 1 sequences routes more "
                                         r"than 2\^31 - 1 .* expected at most 1073741823 tokens a pass"):
        layer.prefill(claim, cache, chunk_size=2**40)
    assert claim.deleted == 1 and cache.lengths == (0,)


def test_producer_shape_whose_size_overflows_is_rejected(layer):
    cache = layer.new_cache(8)
    huge = PythonDeleterProducer(2, 32, [2**62, H])
    with pytest.raises(ValueError, match="x: .*overflow"):
        layer.prefill(huge, cache)
    assert huge.deleted == 1 and cache.lengths == (0,)
    # an empty tensor whose other dims overflow when multiplied (a fuzzer's find)
    empty = PythonDeleterProducer(2, 32, [0, 2**31, 2**63 - 1])
    with pytest.raises(ValueError, match=r"x: expected shape"):
        layer.prefill(empty, cache)
    assert empty.deleted == 1 and cache.lengths == (0,)


# ---- Ctrl-C ----------------------------------------------------------------------------------------

def test_ctrl_c_stops_a_prefill_at_a_chunk_boundary_and_rolls_the_cache_back(layer):
    """The interrupt arrives while the engine runs with the GIL released: the engine stops at
    the next chunk, the cache goes back to where the call began, and the KeyboardInterrupt
    says so. The layer and cache work normally afterwards."""
    cache = layer.new_cache(8192)
    first = torch.randn(3, H)
    layer.prefill(first, cache)
    started = threading.Event()


    main = threading.get_ident()

    def interrupt():
        """once the main thread is inside the C call (x imported, its Python frame the
        wrapper's), where nothing but the engine's poll handles signals"""
        started.wait()
        while True:
            frame = sys._current_frames()[main]
            code = frame.f_code
            if code.co_name == "prefill" and code.co_filename.endswith(os.path.join("qwen3layer", "layer.py")):
                break
            time.sleep(0.001)
        _thread.interrupt_main()

    threading.Thread(target=interrupt).start()
    x = torch.randn(8000, H)
    with pytest.raises(KeyboardInterrupt) as info:
        layer.prefill(Announcing(x, started), cache, chunk_size=1)
    assert cache.lengths == (3,)
    assert any("rolled back to where the call began" in note for note in getattr(info.value, "__notes__", []))
    # the cache is as if the call never happened: the same tokens again give a fresh cache's result
    fresh = layer.new_cache(16)
    layer.prefill(first, fresh)
    assert torch.equal(layer.prefill(x[:5], cache), layer.prefill(x[:5], fresh))
    assert cache.lengths == (8,)
