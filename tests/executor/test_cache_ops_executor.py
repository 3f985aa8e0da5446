"""The KV cache operations for generation on a CUDA cache of the SIMT executor (device memory
is host memory), against the same operations on a host cache holding the same bytes, and
decoding after them on the emulated CUDA layer against the CPU layer; in a subprocess of its
own (conftest.py). The operations on host caches: tests/cache/test_cache_ops.py."""
import copy
import ctypes
import functools
import os
import random

import numpy as np
import pytest

import qwen3layer as q3
from qwen3layer import _C

pytestmark = [pytest.mark.executor_subprocess,
              pytest.mark.skipif(not os.path.exists(q3.cuda.SIMT_LIBRARY), reason="this build has no SIMT executor")]
TIMEOUT = 600


@functools.cache
def simt():
    """the library emulate() opened: its streams and captures"""
    return ctypes.CDLL(q3.cuda.SIMT_LIBRARY)


CFG = q3.LayerConfig(hidden_size=64, num_attention_heads=8, num_key_value_heads=2, head_dim=24,
                     num_experts=8, num_experts_per_tok=2, moe_intermediate_size=48)
H = CFG.hidden_size
LENGTHS, PADS = [3, 7, 0, 5, 2, 6], [1, 0, 0, 2, 0, 3]


def raw(t):
    """the bits of a cache view [kv_heads, length, head_dim] (strided: a head's capacity apart),
    read in place on either side: the executor's device memory is host memory"""
    size = 4 if t.dtype == "float32" else 2
    span = 1 + sum((n - 1) * s for n, s in zip(t.shape, t.strides))
    buf = (ctypes.c_char * (span * size)).from_address(t.data_ptr)
    v = np.frombuffer(buf, np.uint32 if size == 4 else np.uint16)
    return np.lib.stride_tricks.as_strided(v, t.shape, [s * size for s in t.strides]).copy()


def state(cache):
    """lengths, padding, the bits of each sequence's keys and values (as lists, for JSON), and
    the first positions"""
    kv = [[raw(cache.keys(s)).tolist(), raw(cache.values(s)).tolist()] for s in range(cache.batch)]
    return [list(cache.lengths), list(cache.padding), kv, list(cache.first_positions)]


@functools.cache
def layers_of(dtype, seed=3):
    """a CPU and a CUDA layer on the same weights"""
    w = _C.random_weights(CFG, seed, dtype)
    return _C.Layer(CFG, w, None, -1), _C.Layer(CFG, w, None, 0)


def fill(layer, device, lengths, pads, capacity, dtype, seed=0):
    cache = layer.new_cache(capacity, len(lengths), dtype)
    for s, (n, p) in enumerate(zip(lengths, pads)):
        if p:
            cache.set_padding(p, s)
        cache.set_first_position(3 * s, s)  # the decodes after the operations read them too
        if n:
            x = _C.random_tensor((n, H), seed + s, dtype)
            layer.prefill(_C.copy_tensor(x, 0) if device >= 0 else x, cache, s)
    return cache


def twins(dtype, lengths=LENGTHS, pads=PADS, capacity=16):
    """a host cache and a device cache with the same lengths, padding and bytes (the device
    cache's K/V overwritten with the host's, head by head); the usual ones are copies of one
    pair made once (copy() on both sides is checked first, on a pair made afresh)"""
    if (dtype, lengths, pads, capacity) == (dtype, LENGTHS, PADS, 16):
        hc, dc = template(dtype)
        return hc.copy(), dc.copy()
    return fresh_twins(dtype, lengths, pads, capacity)


@functools.cache
def template(dtype):
    """the pair the usual twins are copies of, made once"""
    return fresh_twins(dtype)


def fresh_twins(dtype, lengths=LENGTHS, pads=PADS, capacity=16):
    cpu, gpu = layers_of(dtype)
    hc = fill(cpu, -1, lengths, pads, capacity, dtype)
    dc = fill(gpu, 0, lengths, pads, capacity, dtype)
    assert (hc.device, dc.device) == ("cpu", "cuda:0")
    size = 4 if dtype == "float32" else 2
    for s in range(hc.batch):
        for view in ("keys", "values"):
            src, dst = getattr(hc, view)(s), getattr(dc, view)(s)
            assert src.strides == dst.strides and src.shape == dst.shape
            for h in range(src.shape[0]):
                ctypes.memmove(dst.data_ptr + h * dst.strides[0] * size, src.data_ptr + h * src.strides[0] * size,
                               src.shape[1] * src.shape[2] * size)
    assert state(hc) == state(dc)
    return hc, dc


def rel(a, b):
    a = torch_free(a)
    b = torch_free(b)
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


def torch_free(t):
    """an extension tensor (host or device) as float64 numpy"""
    t = _C.copy_tensor(t, -1) if t.device != "cpu" else t
    size = 4 if t.dtype == "float32" else 2
    v = raw_flat(t, size)
    return (v if size == 4 else v.astype(np.uint32) << 16).view(np.float32).astype(np.float64)


def raw_flat(t, size):
    n = int(np.prod(t.shape))
    buf = (ctypes.c_char * (n * size)).from_address(t.data_ptr)
    return np.frombuffer(buf, np.uint32 if size == 4 else np.uint16).copy()


def outcome(call):
    try:
        r = call()
        return ["accepted", r]
    except Exception as e:  # noqa: BLE001 - the type and message are what is compared
        return [f"{type(e).__name__}: {e}", None]


@functools.cache
def streams():
    """the streams an operation is given: None, 0 and one of the executor's own"""
    stream = ctypes.c_void_p()
    assert simt().cudaStreamCreate(ctypes.byref(stream)) == 0
    return {"none": None, "zero": 0, "own": stream.value}


# ---- content: each operation on the device cache equals it on the host cache --------------
OPS = {
    "reorder identity": lambda c, st: c.reorder([0, 1, 2, 3, 4, 5], stream=st),
    "reorder cycles": lambda c, st: c.reorder([1, 2, 0, 4, 5, 3], stream=st),
    "reorder reverse": lambda c, st: c.reorder(range(5, -1, -1), stream=st),
    "reorder one": lambda c, st: c.reorder([3] * 6, stream=st),
    "reorder repeats": lambda c, st: c.reorder([1, 0, 0, 1, 5, 5], stream=st),
    "reorder repeats and a cycle": lambda c, st: c.reorder([2, 0, 1, 1, 4, 4], stream=st),
    "reorder chain": lambda c, st: c.reorder([0, 0, 1, 2, 3, 4], stream=st),
    "select": lambda c, st: c.select([5, 5, 0, 2, 1, 1, 3, 4, 0], stream=st),
    "select one": lambda c, st: c.select([4], stream=st),
    "repeat_interleave 1": lambda c, st: c.repeat_interleave(1, stream=st),
    "repeat_interleave 3": lambda c, st: c.repeat_interleave(3, stream=st),
    "copy": lambda c, st: c.copy(stream=st),
    "copy.copy": lambda c, st: copy.copy(c),
    "copy.deepcopy": lambda c, st: copy.deepcopy({"c": c})["c"],
    "copy_prefix": lambda c, st: [c.copy_prefix(1, 2, 5, stream=st), c.copy_prefix(5, 0, 4, stream=st),
                                  c.copy_prefix(3, 3, 4, stream=st), c.copy_prefix(4, 4, 2, stream=st),
                                  c.copy_prefix(3, 1, 1, stream=st), c.copy_prefix(0, 5, 0, stream=st)],
    "crop": lambda c, st: [c.crop(4, 1), c.crop(-1, 3), c.crop(2)],
    "grow": lambda c, st: [c.grow(40, stream=st), c.grow(40, stream=st), c.grow(97, stream=st)],
}


def test_device_cache_operations_equal_the_host_ones():
    """each operation on a device cache leaves the same bytes, lengths and padding as on a host
    cache that held the same bytes (a new cache: on the device, of the same capacity), float32,
    bfloat16 and float16, with stream=None (the device synchronized around the copies), 0 (the same) and
    a stream of the executor's own (queued there); random maps one after another; a reorder of
    sequences of 300 tokens"""
    content = {}
    for dtype in ("float32", "bfloat16", "float16"):
        hc, dc = template(dtype)
        content[f"{dtype} copy of a fresh pair"] = state(hc.copy()) == state(dc.copy()) == state(hc)
        for name, op in OPS.items():
            for sname, st in streams().items():
                hc, dc = twins(dtype)
                rh, rd = op(hc, None), op(dc, st)
                same = state(hc) == state(dc)
                if isinstance(rh, q3.KVCache):  # a new cache: it is what is compared, on its device
                    same = (state(rh) == state(rd) and rd.keys(0).device == "cuda:0" and rd.capacity == dc.capacity
                            and state(dc) == state(hc))
                content[f"{dtype} {name} stream {sname}"] = same
    # random maps, one after the other on one pair (cycles, chains, repeats)
    rng = random.Random(0)
    hc, dc = twins("float32")
    agree = []
    for trial in range(24):
        index = [rng.randrange(6) for _ in range(6)] if trial % 2 else rng.sample(range(6), 6)
        hc.reorder(index)
        dc.reorder(index, stream=streams()["own"] if trial % 3 else None)
        agree.append(state(hc) == state(dc))
    content["float32 random reorders"] = all(agree)
    # long sequences: a head block past what one 2-D row of a small cache holds
    hc, dc = twins("bfloat16", lengths=[300, 1, 299], pads=[0, 0, 5], capacity=301)
    hc.reorder([2, 0, 1])
    dc.reorder([2, 0, 1])
    content["bfloat16 long reorder"] = state(hc) == state(dc)

    ops = ["reorder identity", "reorder cycles", "reorder reverse", "reorder one", "reorder repeats",
           "reorder repeats and a cycle", "reorder chain", "select", "select one", "repeat_interleave 1",
           "repeat_interleave 3", "copy", "copy.copy", "copy.deepcopy", "copy_prefix", "crop", "grow"]
    expected = [f"{dt} {op} stream {st}"
                for dt in ("float32", "bfloat16", "float16") for op in ops for st in ("none", "zero", "own")]
    expected += ["float32 copy of a fresh pair", "bfloat16 copy of a fresh pair", "float16 copy of a fresh pair",
                 "float32 random reorders", "bfloat16 long reorder"]
    assert sorted(content) == sorted(expected)
    assert [k for k, same in content.items() if not same] == []

# ---- behaviour: decoding after each operation, CUDA layer against the CPU layer ----------


def decode_steps(layer, device, cache, steps=2, seed=100, dtype="float32"):
    ys = []
    for t in range(steps):
        x = _C.random_tensor((cache.batch, H), seed + t, dtype)
        ys.append(layer.decode(_C.copy_tensor(x, 0) if device >= 0 else x, cache))
    return ys


def prefill(layer, device, x, cache, seq):
    return layer.prefill(_C.copy_tensor(x, 0) if device >= 0 else x, cache, seq)


def test_decoding_after_device_cache_operations_equals_the_cpu_layer():
    """the emulated CUDA layer decoding after reorder (repeats; a cycle through the spare block),
    select, repeat_interleave, copy, copy_prefix (then the prefix's tail prefilled) and a
    deepcopy branch equals the CPU layer doing the same on its host cache; so do a decode
    graph's replays across a reorder and a copy_prefix"""
    decoding = {}
    cpu, gpu = layers_of("float32")
    lens, pads = [5, 9, 3, 7], [0, 2, 0, 1]
    for name, op in {
        "reorder": lambda c, st: (c.reorder([3, 1, 1, 0], stream=st), c)[1],
        "reorder cycle": lambda c, st: (c.reorder([1, 2, 3, 0], stream=st), c)[1],
        "select": lambda c, st: c.select([2, 0], stream=st),
        "repeat_interleave": lambda c, st: c.repeat_interleave(3, stream=st),
        "copy": lambda c, st: c.copy(stream=st),
    }.items():
        for sname, st in (("none", None), ("own", streams()["own"])):
            hc, dc = fill(cpu, -1, lens, pads, 16, "float32"), fill(gpu, 0, lens, pads, 16, "float32")
            hc, dc = op(hc, None), op(dc, st)
            errs = [rel(a, b) for a, b in zip(decode_steps(gpu, 0, dc), decode_steps(cpu, -1, hc))]
            decoding[f"{name} stream {sname}"] = [max(errs), list(dc.lengths) == list(hc.lengths)]
    # prefix reuse: slot 1 takes slot 0's first 6 tokens, then its own tail
    for sname, st in (("none", None), ("own", streams()["own"])):
        caches = []
        for layer, device in ((cpu, -1), (gpu, 0)):
            c = layer.new_cache(24, 2)
            prefill(layer, device, _C.random_tensor((9, H), 60, "float32"), c, 0)
            prefill(layer, device, _C.random_tensor((5, H), 61, "float32"), c, 1)
            c.copy_prefix(0, 1, 6, **({"stream": st} if device >= 0 else {}))
            tail = prefill(layer, device, _C.random_tensor((4, H), 62, "float32"), c, 1)
            caches.append((c, tail))
        (hc, ht), (dc, dt) = caches
        errs = [rel(dt, ht)] + [rel(a, b) for a, b in zip(decode_steps(gpu, 0, dc), decode_steps(cpu, -1, hc))]
        # 9 and 6 + 4 tokens, then two decode steps
        decoding[f"copy_prefix stream {sname}"] = [max(errs), list(dc.lengths) == list(hc.lengths) == [11, 12]]
    # a copy, then diverging decodes: the original is untouched
    hc, dc = fill(cpu, -1, [5, 7], [0, 3], 16, "float32"), fill(gpu, 0, [5, 7], [0, 3], 16, "float32")
    before = state(dc)
    branch = copy.deepcopy(dc)
    a = decode_steps(gpu, 0, branch, seed=200)
    untouched = state(dc) == before
    errs = [rel(x, y) for x, y in zip(a, decode_steps(cpu, -1, copy.deepcopy(hc), seed=200))]
    errs += [rel(x, y) for x, y in zip(decode_steps(gpu, 0, dc, seed=300), decode_steps(cpu, -1, hc, seed=300))]
    decoding["deepcopy branches"] = [max(errs), untouched]
    # a decode graph replayed across a reorder (the graph reads each slot's blocks, which now hold
    # other sequences) and a copy_prefix (new lengths: uploaded at the next replay)
    hc, dc = fill(cpu, -1, lens, pads, 16, "float32"), fill(gpu, 0, lens, pads, 16, "float32")
    graph = gpu.decode_graph(dc)
    errs = []
    for t, op in enumerate((lambda c, **k: c.reorder([3, 1, 1, 0], **k), lambda c, **k: c.copy_prefix(0, 2, 4, **k),
                            lambda c, **k: None)):
        x = _C.random_tensor((4, H), 400 + t, "float32")
        errs.append(rel(graph.replay(_C.copy_tensor(x, 0)), cpu.decode(x, hc)))
        op(hc)
        op(dc, stream=streams()["own"])
    decoding["decode graph replays"] = [max(errs), list(dc.lengths) == list(hc.lengths)]
    del graph

    assert len(decoding) == 14
    for name, (err, agree) in decoding.items():
        assert err <= 1e-5 and agree, (name, err, agree)


def test_decoding_past_a_grown_device_cache_equals_the_cpu_layer_and_a_graph_refuses():
    """a device cache grown (on each stream) takes the tokens the old capacity refused, and
    decoding on equals the CPU layer on its host cache grown alike; a decode graph captured
    before the growth refuses to replay (it holds the old blocks' addresses), before any work,
    and one captured after replays as the CPU layer decodes"""
    cpu, gpu = layers_of("float32")
    errs, growths = [], []
    for st in (None, streams()["own"]):
        hc, dc = fill(cpu, -1, [5, 9], [0, 2], 10, "float32"), fill(gpu, 0, [5, 9], [0, 2], 10, "float32")
        graph = gpu.decode_graph(dc)
        hc.grow(12)
        dc.grow(12, stream=st)
        growths.append((dc.capacity, dc.growths, list(dc.lengths)))
        errs += [rel(a, b) for a, b in zip(decode_steps(gpu, 0, dc, steps=3), decode_steps(cpu, -1, hc, steps=3))]
        before = state(dc)
        refused = outcome(lambda: graph.replay(_C.copy_tensor(_C.random_tensor((2, H), 7, "float32"), 0)))[0]
        assert refused == ("RuntimeError: decode graph: the cache grew from 10 to 12 tokens a sequence after the "
                           "capture (the graph holds the old blocks' addresses); capture a new graph")
        assert state(dc) == before
        del graph
        hc.grow(20)
        dc.grow(20, stream=st)
        graph = gpu.decode_graph(dc)
        for t in range(3):
            x = _C.random_tensor((2, H), 500 + t, "float32")
            errs.append(rel(graph.replay(_C.copy_tensor(x, 0)), cpu.decode(x, hc)))
        del graph
    assert growths == [(12, 1, [5, 9])] * 2
    assert max(errs) <= 1e-5, errs


# ---- rejections: the same error as on the host, the cache as it was ------------------------
BAD = [
    lambda c: c.reorder([0, 1, 2, 3, 4, 6]),
    lambda c: c.reorder([0, 1, 2]),
    lambda c: c.reorder([0, 1, 2.0, 3, 4, 5]),
    lambda c: c.select([]),
    lambda c: c.select([7]),
    lambda c: c.repeat_interleave(0),
    lambda c: c.crop(-6, 1),
    lambda c: c.copy_prefix(6, 0, 1),
    lambda c: c.copy_prefix(0, -1, 1),
    lambda c: c.copy_prefix(0, 1, 4),
]


def test_device_caches_reject_what_host_caches_reject():
    rejections = []
    for call in BAD:
        hc, dc = twins("float32", lengths=[3, 2, 0, 5, 1, 4], pads=[1, 0, 0, 2, 0, 0])
        rh, rd = outcome(lambda: call(hc))[0], outcome(lambda: call(dc))[0]
        rejections.append([rd, rh == rd, state(hc) == state(dc)])
    hc, dc = twins("float32")
    stream_errors = [outcome(lambda: hc.reorder(range(6), stream=streams()["own"]))[0],
                     outcome(lambda: dc.reorder(range(6), stream="0"))[0],
                     outcome(lambda: hc.copy(stream=1))[0]]

    for message, same_as_host, unchanged in rejections:
        assert same_as_host and unchanged, message
    assert len(rejections) == 10
    assert stream_errors == ["ValueError: stream: expected None for a cache on the cpu",
                             "TypeError: stream: expected an int (a cudaStream_t) or None, got str",
                             "ValueError: stream: expected None for a cache on the cpu"]


def test_a_device_layer_call_names_a_stream_that_is_no_int_and_leaves_the_cache():
    """prefill and decode of a CUDA layer with stream="0": the TypeError of the cache
    operations, naming stream, before any work (the device cache's lengths and bytes as they were)"""
    _, gpu = layers_of("float32")
    _, dc = twins("float32")
    before = state(dc)
    x = _C.copy_tensor(_C.random_tensor((2, H), 5, "float32"), 0)
    x1 = _C.copy_tensor(_C.random_tensor((dc.batch, H), 6, "float32"), 0)
    errors = [outcome(lambda: gpu.prefill(x, dc, 0, stream="0"))[0],
              outcome(lambda: gpu.decode(x1, dc, stream=1.0))[0]]
    assert errors == ["TypeError: stream: expected an int (a cudaStream_t) or None, got str",
                      "TypeError: stream: expected an int (a cudaStream_t) or None, got float"]
    assert state(dc) == before


# ---- a CUDA error: while this thread captures a graph, synchronizing the device fails -------
def test_a_cuda_error_leaves_the_device_cache_as_it_was():
    """while the thread captures a CUDA graph, the device cannot be synchronized (nor memory
    allocated): each operation fails with CUDA's text, lengths, padding and bytes unchanged, and
    the cache works once the capture is over"""
    capture = ctypes.c_void_p()
    assert simt().cudaStreamCreate(ctypes.byref(capture)) == 0
    hc, dc = twins("float32")
    before = state(dc)
    failures = []
    assert simt().cudaStreamBeginCapture(capture, 1) == 0  # cudaStreamCaptureModeThreadLocal
    for call in (lambda: dc.reorder([1, 1, 2, 3, 4, 5]), lambda: dc.reorder([1, 0, 2, 3, 4, 5]),
                 lambda: dc.copy_prefix(1, 2, 5), lambda: dc.copy(), lambda: dc.grow(64)):
        failures.append(outcome(call)[0])
    graph = ctypes.c_void_p()
    simt().cudaStreamEndCapture(capture, ctypes.byref(graph))
    left_as_it_was = state(dc) == before
    dc.reorder([1, 0, 2, 3, 4, 5])  # and it works again once the capture is over
    hc.reorder([1, 0, 2, 3, 4, 5])
    works_after = state(dc) == state(hc)

    sync = "cuda: synchronizing device 0 failed: cudaDeviceSynchronize while this thread captures a CUDA graph"
    reorder, spare, prefix, copied, grown = failures
    assert reorder.startswith(f"RuntimeError: reorder: {sync}")
    assert spare == "MemoryError: reorder: cannot allocate a spare block of 3 tokens on the CUDA device"
    assert prefix.startswith(f"RuntimeError: copy_prefix: {sync}")
    assert copied.startswith("MemoryError: KV cache: cannot allocate")
    assert grown.startswith("MemoryError: max_tokens: cannot allocate 2 x ")
    assert left_as_it_was and works_after and dc.capacity == 16 and dc.growths == 0


# ---- the executor's cudaMemcpy2DAsync checks its pitches as CUDA does ----------------------
def test_the_executors_2d_copy_checks_its_pitches_as_cuda():
    simt().cudaGetErrorString.restype = ctypes.c_char_p
    buf = ctypes.create_string_buffer(64)
    code = simt().cudaMemcpy2DAsync(buf, ctypes.c_size_t(8), buf, ctypes.c_size_t(16), ctypes.c_size_t(16),
                                    ctypes.c_size_t(2), 3, None)
    text = simt().cudaGetErrorString(code).decode()
    simt().cudaGetLastError()
    assert code == 12  # cudaErrorInvalidPitchValue
    assert text.startswith("cudaMemcpy2DAsync: width 16 bytes, dpitch 8, spitch 16")
