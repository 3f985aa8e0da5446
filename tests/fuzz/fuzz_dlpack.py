"""Fuzzer: DLPack import (csrc/python/py_dlpack.c) with producers whose every field is fuzzed.

    python tests/fuzz/fuzz_dlpack.py -max_total_time=60 CORPUS_DIR
    python tests/fuzz/fuzz_dlpack.py FILE...          # reproduce

(tests/fuzz/fuzz_common.py: the runner, the seeds, the findings log.) Each input describes one
producer, an object with __dlpack_device__ and __dlpack__ that hands out a capsule built here
with ctypes, "dltensor_versioned" or legacy "dltensor", whose fields come from the input:
ndim, shape, strides (or NULL), dtype code/bits/lanes, device type/id (in the capsule and,
separately, from __dlpack_device__), byte_offset, flags, version; how __dlpack__ answers
max_version (a 1.x producer, a legacy one that raises TypeError for it, one that returns the
other kind of capsule, a wrong capsule name, not a capsule) is fuzzed too. The producer is
then passed as
  x of layer.prefill / layer.decode, as out= of either (x valid), or as one weight of the
  DecoderLayer constructor (then a prefill and a decode run on the layer)
of a tiny layer (float32 or bfloat16) with a small cache, or as the chosen experts of
_C.expert_counts (int32 [tokens, top_k] mostly; it reads every element of any shape it
accepts, so the producer then holds the strides' whole extent, or refuses past 64 MiB).

The producer is honest about its memory and the input decides everything the extension can
check: the struct, shape and strides arrays and the data are malloc'd at their exact sizes
(so AddressSanitizer sees any read past them) and freed by the deleter (so a use after the
deleter is a use-after-free). The deleters and the capsule destructor are C
(tests/fuzz/fuzz_dlpack_producer.c, built here with the system's cc): a consumer may call them
with a Python exception set, which a ctypes callback would lose. The data holds as much as the tensor describes, capped by what
any call could accept (the cache's tokens for x and out; the weight's own shape, with the
strides' extent, for a weight): a call the extension must refuse can describe more than
there is. byte_offset stays within the buffer (the extension cannot check a producer's
pointer), possibly not a multiple of the element size (it can check alignment).

Findings: a crash (ASan, UBSan, a signal) or a hang; an exception other than TypeError,
ValueError, BufferError, IndexError or CacheFullError (a RuntimeError); any other
RuntimeError; a deleter not called exactly once per capsule made (counted per managed
tensor, after the layer and everything holding a capsule are gone: every capsule is either
consumed, and its deleter is the consumer's to call, or not, and its destructor calls it).
"""
from __future__ import annotations

import ctypes
import gc
import os
import struct
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))

import fuzz_common  # noqa: E402

NAME = "fuzz_dlpack"
GEOMETRY = dict(hidden_size=16, num_attention_heads=4, num_key_value_heads=2, head_dim=8, num_experts=4,
                num_experts_per_tok=2, moe_intermediate_size=16)
H = GEOMETRY["hidden_size"]
CAPACITY = 4  # tokens per sequence of the cache: at most this many can be accepted
TARGETS = ("prefill x", "decode x", "prefill out", "decode out", "weight", "experts")


# ---- the DLPack ABI, from the specification (not the project's header) -------------------

class DLDevice(ctypes.Structure):
    _fields_ = [("device_type", ctypes.c_int32), ("device_id", ctypes.c_int32)]


class DLDataType(ctypes.Structure):
    _fields_ = [("code", ctypes.c_uint8), ("bits", ctypes.c_uint8), ("lanes", ctypes.c_uint16)]


class DLTensor(ctypes.Structure):
    _fields_ = [("data", ctypes.c_void_p), ("device", DLDevice), ("ndim", ctypes.c_int32),
                ("dtype", DLDataType), ("shape", ctypes.c_void_p), ("strides", ctypes.c_void_p),
                ("byte_offset", ctypes.c_uint64)]


class DLManagedTensor(ctypes.Structure):
    _fields_ = [("dl_tensor", DLTensor), ("manager_ctx", ctypes.c_void_p), ("deleter", ctypes.c_void_p)]


class DLPackVersion(ctypes.Structure):
    _fields_ = [("major", ctypes.c_uint32), ("minor", ctypes.c_uint32)]


class DLManagedTensorVersioned(ctypes.Structure):
    _fields_ = [("version", DLPackVersion), ("manager_ctx", ctypes.c_void_p), ("deleter", ctypes.c_void_p),
                ("flags", ctypes.c_uint64), ("dl_tensor", DLTensor)]


libc = ctypes.CDLL(None)
libc.malloc.restype = ctypes.c_void_p
libc.malloc.argtypes = [ctypes.c_size_t]
libc.free.argtypes = [ctypes.c_void_p]
api = ctypes.pythonapi
api.PyCapsule_New.restype = ctypes.py_object
api.PyCapsule_New.argtypes = [ctypes.c_void_p, ctypes.c_char_p, ctypes.c_void_p]
api.PyCapsule_SetContext.restype = ctypes.c_int
api.PyCapsule_SetContext.argtypes = [ctypes.py_object, ctypes.c_void_p]


class Record(ctypes.Structure):
    """q3fuzz_record of fuzz_dlpack_producer.c: releases counted, blocks freed on the first"""
    _fields_ = [("calls", ctypes.c_int), ("n", ctypes.c_int), ("blocks", ctypes.c_void_p * 4)]


def producer_library():
    """fuzz_dlpack_producer.c built with the system's cc (once per source version)."""
    import hashlib
    import subprocess
    import tempfile

    src = os.path.join(os.path.dirname(os.path.abspath(__file__)), "fuzz_dlpack_producer.c")
    with open(src, "rb") as f:
        digest = hashlib.sha1(f.read()).hexdigest()[:12]
    lib = os.path.join(tempfile.gettempdir(), f"q3fuzz_producer_{digest}.so")
    if not os.path.exists(lib):
        env = {k: v for k, v in os.environ.items() if k != "LD_PRELOAD"}  # cc is not Python
        subprocess.check_call([os.environ.get("CC", "cc"), "-shared", "-fPIC", "-O1", "-g", src, "-o",
                               lib + f".{os.getpid()}"], env=env)
        os.replace(lib + f".{os.getpid()}", lib)
    return ctypes.CDLL(lib)


HELPER = producer_library()
DELETERS = {v: ctypes.cast(getattr(HELPER, f"q3fuzz_delete_{'versioned' if v else 'legacy'}"), ctypes.c_void_p).value
            for v in (True, False)}
DESTRUCTOR = ctypes.cast(HELPER.q3fuzz_capsule_destructor, ctypes.c_void_p).value

# capsule names: kept alive for the capsules' lifetime (a capsule keeps only the pointer)
NAMES = {n: ctypes.create_string_buffer(n) for n in (b"dltensor", b"dltensor_versioned", b"dltensor_wrong")}
MANAGED: list = []  # (record address, description) of every managed tensor made


def malloc(n: int) -> int:
    p = libc.malloc(max(1, n))
    if not p:
        raise MemoryError(n)
    return p


class ProducerError(Exception):
    """Raised by a producer on purpose: the consumer must let it through."""


# ---- the producer --------------------------------------------------------------------------

INT64_EXTREMES = [0, 1, -1, 2, 3, 2**31 - 1, 2**31, 2**32, 2**32 + 1, 2**62, 2**63 - 1, -2**63, -2**31,
                  2**61 + 1, 2**48]


def i64(v: int) -> int:
    return (v + 2**63) % 2**64 - 2**63


class Spec:
    """Every field of one producer, read from the fuzzer's bytes."""

    def __init__(self, fdp, wanted_shape, layer_dtype):
        self.fdp = fdp
        f = fdp
        pick = f.ConsumeIntInRange
        # dtype: mostly the two the extension takes (int32 for the experts)
        kind = pick(0, 9)
        if kind <= 6 and layer_dtype == "int32":
            self.dtype = (0, 32, 1)
        elif kind <= 3:
            self.dtype = (2, 32, 1)
        elif kind <= 6:
            self.dtype = (4, 16, 1)
        elif kind == 7:
            self.dtype = f.PickValueInList([(2, 16, 1), (2, 64, 1), (0, 32, 1), (1, 8, 1), (5, 64, 1), (6, 8, 1),
                                            (2, 32, 4), (4, 16, 2), (3, 32, 1), (2, 32, 0)])
        else:
            self.dtype = (pick(0, 255), pick(0, 255), pick(0, 65535))
        # shape: the expected one, a near miss, or anything
        how = pick(0, 7)
        if how <= 2:
            shape = list(wanted_shape)
        elif how <= 4:
            shape = list(wanted_shape)
            for _ in range(pick(1, 2)):
                if shape:
                    d = pick(0, len(shape) - 1)
                    shape[d] = self.dim(shape[d])
        elif how == 5:
            shape = list(wanted_shape)
            if pick(0, 1) and shape:
                shape.pop(pick(0, len(shape) - 1))
            else:
                shape.insert(pick(0, len(shape)), pick(0, 3))
        else:
            shape = [self.dim(None) for _ in range(pick(0, 10))]
        self.shape = shape
        # ndim: len(shape) mostly; else a lie in either direction (the arrays stay honest:
        # they hold max(0, min(ndim, 16)) entries)
        self.ndim = len(shape) if pick(0, 7) != 7 else f.PickValueInList([-1, 0, 9, 16, 2**31 - 1, -2**31,
                                                                          len(shape) + 1, max(0, len(shape) - 1)])
        # strides: NULL, compact, or fuzzed
        how = pick(0, 5)
        if how <= 1:
            self.strides = None
        elif how <= 3:
            self.strides = self.compact(shape)
        elif how == 4:
            self.strides = self.compact(shape)
            if self.strides:
                d = pick(0, len(self.strides) - 1)
                self.strides[d] = f.PickValueInList([0, -1, -self.strides[d], self.strides[d] * 2, 2**62, -2**63, 1])
        else:
            self.strides = [f.PickValueInList(INT64_EXTREMES + [pick(-64, 64)]) for _ in shape]
        self.misaligned = pick(0, 7) == 7 and os.environ.get("Q3_FUZZ_MISALIGNED", "1") == "1"
        self.offset_share = pick(0, 3)  # how much of the first element's offset goes to byte_offset
        dev = pick(0, 15)
        self.device = (1, 0) if dev <= 11 else f.PickValueInList([(2, 0), (1, 1), (3, 0), (13, 0), (4, 0), (1, -1),
                                                                   (pick(-5, 40), pick(-2, 2))])
        self.device_query = self.device if pick(0, 7) != 7 else f.PickValueInList([(1, 0), (2, 0), (3, 0), (1, 5)])
        self.query_junk = pick(0, 31) == 31
        self.major, self.minor = ((1, pick(0, 3)) if pick(0, 7) != 7
                                  else (f.PickValueInList([0, 2, 2**32 - 1]), pick(0, 9)))
        self.flags = 0 if pick(0, 3) != 3 else f.PickValueInList([1, 2, 3, 2**64 - 1, pick(0, 2**64 - 1)])
        # 0: 1.x producer; 1: legacy (TypeError on max_version); 2: versioned capsule always;
        # 3: legacy capsule always; 4: a wrongly named capsule; 5: not a capsule; 6: raises
        self.protocol = pick(0, 6) if pick(0, 3) == 3 else pick(0, 1)
        self.fill = pick(0, 3)
        self.fill_bytes = f.ConsumeBytes(16)
        self.layer_dtype = layer_dtype

    def dim(self, near):
        f = self.fdp
        how = f.ConsumeIntInRange(0, 4)
        if how == 0:
            return f.PickValueInList(INT64_EXTREMES)
        if how == 1 and near is not None:
            return near + f.ConsumeIntInRange(-2, 2)
        if how == 2:
            return f.ConsumeIntInRange(-2**63, 2**63 - 1)
        return f.ConsumeIntInRange(0, 2 * H)

    @staticmethod
    def compact(shape):
        out, n = [], 1
        for s in reversed(shape):
            out.append(n)
            n = i64(n * s)
        return out[::-1]


def extent(shape, strides, cap_elems):
    """(lowest, highest) element offsets the tensor reaches, each clipped to cap_elems, or
    None for an empty one; a negative dimension counts as none."""
    if any(s <= 0 for s in shape):
        return None
    lo = hi = 0
    strides = strides if strides is not None else Spec.compact(shape)
    for s, st in zip(shape, strides):
        reach = (s - 1) * st
        if reach < 0:
            lo += reach
        else:
            hi += reach
    return max(lo, -cap_elems), min(hi, cap_elems)


class Producer:
    """An object with __dlpack_device__ and __dlpack__, a fresh capsule each call."""

    def __init__(self, spec: Spec, cap_bytes: int, read_whole=None):
        """cap_bytes: the most data any accepted call reads; read_whole: a shape that, when the
        tensor has it, makes the extension read every element wherever the strides put it
        (a weight), so the data then spans the strides' whole extent; ANY_SHAPE: so for every
        shape (the experts)."""
        self.spec = spec
        self.cap_bytes = cap_bytes
        self.read_whole = read_whole
        self.made = 0

    def __dlpack_device__(self):
        if self.spec.query_junk:
            return self.spec.fdp.PickValueInList([None, (1,), ("cpu", 0), (1, 0, 0), (2**40, 0), 1])
        return self.spec.device_query

    def __dlpack__(self, *args, **kw):
        s = self.spec
        asked_versioned = "max_version" in kw
        p = s.protocol
        if p == 1 and asked_versioned:
            raise TypeError("__dlpack__() got an unexpected keyword argument 'max_version'")
        if p == 5:
            return object()
        if p == 6:
            raise ProducerError("this producer refuses")
        versioned = {0: asked_versioned, 1: False, 2: True, 3: False, 4: asked_versioned}[p]
        return self.capsule(versioned, wrong_name=p == 4)

    def capsule(self, versioned: bool, wrong_name: bool):
        s = self.spec
        blocks = []
        elem = max(1, s.dtype[1] // 8) if s.dtype[0] in (2, 4) else 4
        # what the consumer will see: the arrays hold max(0, min(ndim, 16)) entries
        n_arr = max(0, min(s.ndim, 16))
        shape = [i64(v) for v in (s.shape + [1] * n_arr)[:n_arr]]
        strides = None if s.strides is None else [i64(v) for v in (s.strides + [1] * n_arr)[:n_arr]]
        cap_elems = max(1, self.cap_bytes // elem)
        if self.read_whole is ANY_SHAPE or (self.read_whole is not None and shape == list(self.read_whole)
                                             and s.ndim == len(shape)):
            whole = extent(shape, strides, 2**62)
            if whole is not None and (whole[1] - whole[0] + 1) * elem > 64 << 20:
                strides = None  # no honest producer has that much memory: compact instead
                whole = extent(shape, strides, 2**62)
                if whole is not None and (whole[1] - whole[0] + 1) * elem > 64 << 20:
                    raise ProducerError("no memory for a tensor of that shape")
            cap_elems = 2**62
        reach = extent(shape, strides, cap_elems)
        lo, hi = reach if reach is not None else (0, -1)
        first = -lo * elem + (s.fdp.ConsumeIntInRange(1, 3) if s.misaligned else 0)
        size = first + (hi + 1) * elem if hi >= 0 else first
        data = malloc(size)
        blocks.append(data)
        self.fill(data, size)
        shape_p = malloc(8 * n_arr) if n_arr else 0
        if shape_p:
            blocks.append(shape_p)
            ctypes.memmove(shape_p, struct.pack(f"<{n_arr}q", *shape), 8 * n_arr)
        strides_p = 0
        if strides is not None and n_arr:
            strides_p = malloc(8 * n_arr)
            blocks.append(strides_p)
            ctypes.memmove(strides_p, struct.pack(f"<{n_arr}q", *strides), 8 * n_arr)
        byte_offset = first * s.offset_share // 3
        t = DLTensor(data=data + first - byte_offset, device=DLDevice(*s.device), ndim=s.ndim,
                     dtype=DLDataType(*s.dtype), shape=shape_p or None, strides=strides_p or None,
                     byte_offset=byte_offset)
        record = malloc(ctypes.sizeof(Record))
        if versioned:
            m = DLManagedTensorVersioned(version=DLPackVersion(s.major % 2**32, s.minor % 2**32), manager_ctx=record,
                                         deleter=DELETERS[True], flags=s.flags % 2**64, dl_tensor=t)
        else:
            m = DLManagedTensor(dl_tensor=t, manager_ctx=record, deleter=DELETERS[False])
        addr = malloc(ctypes.sizeof(m))
        ctypes.memmove(addr, ctypes.addressof(m), ctypes.sizeof(m))
        blocks.append(addr)
        rec = Record.from_address(record)
        rec.calls, rec.n = 0, len(blocks)
        for i, p in enumerate(blocks):
            rec.blocks[i] = p
        MANAGED.append((record, f"{'versioned' if versioned else 'legacy'} capsule of {describe(s)}"))
        self.made += 1
        name = b"dltensor_wrong" if wrong_name else (b"dltensor_versioned" if versioned else b"dltensor")
        cap = api.PyCapsule_New(addr, NAMES[name], DESTRUCTOR)
        api.PyCapsule_SetContext(cap, record)
        return cap

    def fill(self, data: int, size: int):
        s = self.spec
        if s.fill == 0:
            ctypes.memset(data, 0, size)
            return
        if s.fill == 1:  # N(0, 1)-ish float32 values
            pattern = struct.pack("<4f", 0.5, -1.25, 0.75, -0.125)
        elif s.fill == 2:  # specials
            pattern = struct.pack("<4f", float("nan"), float("inf"), -float("inf"), 3e38)
        else:
            pattern = s.fill_bytes or b"\x00"
        reps = size // len(pattern) + 1
        ctypes.memmove(data, (pattern * reps)[:size], size)


def describe(s: Spec) -> str:
    return (f"dtype={s.dtype} ndim={s.ndim} shape={s.shape} strides={s.strides} device={s.device} "
            f"query={s.device_query} version={s.major}.{s.minor} flags={s.flags} protocol={s.protocol} "
            f"misaligned={s.misaligned}")


# ---- the calls -----------------------------------------------------------------------------

ANY_SHAPE = object()  # Producer's read_whole: the consumer reads every element of any shape

STATE: dict = {}


def setup():
    import qwen3layer as q3
    from qwen3layer import _C

    cfg = q3.LayerConfig(**GEOMETRY)
    weights = {dt: _C.random_weights(cfg, 1, dt) for dt in ("float32", "bfloat16")}
    layers = {dt: q3.DecoderLayer(cfg, weights[dt]) for dt in weights}
    STATE.update(q3=q3, _C=_C, cfg=cfg, weights=weights, layers=layers, log=fuzz_common.Log(NAME),
                 names=sorted(weights["float32"]))


def attempt(fdp, q3, _C) -> tuple:
    """One call with a fuzzed producer; returns (target, producer). Its locals (the layer,
    the cache, the capsules' owners) are gone when it returns or raises."""
    target = TARGETS[fdp.ConsumeIntInRange(0, len(TARGETS) - 1)]
    dtype = "bfloat16" if fdp.ConsumeBool() else "float32"
    layer = STATE["layers"][dtype]
    batch = fdp.ConsumeIntInRange(1, 2)
    decode = target.startswith("decode")
    tokens = fdp.ConsumeIntInRange(1, CAPACITY)
    batched = not decode and batch > 1 and fdp.ConsumeBool()
    x_shape = [batch, H] if decode else ([batch, tokens, H] if batched else [tokens, H])
    filled = fdp.ConsumeIntInRange(0, CAPACITY)  # tokens already in the cache
    chunk = fdp.PickValueInList([None, None, 1, 2, 3])
    STATE["target"] = target
    if target == "experts":
        spec = Spec(fdp, [tokens, GEOMETRY["num_experts_per_tok"]], "int32")
        STATE["producer"] = producer = Producer(spec, 0, read_whole=ANY_SHAPE)
        _C.expert_counts(producer, fdp.PickValueInList([GEOMETRY["num_experts"], 1, 256, 0]))
        return
    if target == "weight":
        weights = dict(STATE["weights"][dtype])
        name = fdp.PickValueInList(STATE["names"])
        wanted = list(weights[name].shape)
        n = 1
        for v in wanted:
            n *= v
        spec = Spec(fdp, wanted, dtype)
        STATE["producer"] = producer = Producer(spec, n * 4, read_whole=wanted)
        weights[name] = producer
        as_dtype = fdp.PickValueInList([None, None, "float32", "bfloat16"])
        built = q3.DecoderLayer(STATE["cfg"], weights, dtype=as_dtype)
        cache = built.new_cache(CAPACITY, batch)
        built.prefill(_C.random_tensor([batch, 2, H] if batch > 1 else [2, H], 3, built.dtype), cache)
        built.decode(_C.random_tensor([batch, H], 4, built.dtype), cache)
        return
    cache = layer.new_cache(CAPACITY, batch)
    if filled:
        layer.prefill(_C.random_tensor([batch, filled, H] if batch > 1 else [filled, H], 5, dtype), cache)
    spec = Spec(fdp, x_shape, dtype)
    STATE["producer"] = producer = Producer(spec, batch * CAPACITY * H * 4)
    if target.endswith("x"):
        x, out = producer, None
    else:
        x, out = _C.random_tensor(x_shape, 6, dtype), producer
    if decode:
        layer.decode(x, cache, out=out)
    else:
        seq = None if batched or fdp.ConsumeIntInRange(0, 7) != 7 else fdp.ConsumeIntInRange(-1, batch)
        layer.prefill(x, cache, seq, chunk, out=out)


def test_one_input(data: bytes) -> None:
    import atheris

    q3, _C, log = STATE["q3"], STATE["_C"], STATE["log"]
    STATE["producer"] = None
    STATE["target"] = "?"
    outcome = "accepted"
    try:
        attempt(atheris.FuzzedDataProvider(data), q3, _C)
    except q3.CacheFullError:
        outcome = "CacheFullError"
    except (TypeError, ValueError, BufferError, IndexError, ProducerError) as e:
        outcome = f"{type(e).__name__}: {str(e)[:60]}"
    except Exception as e:  # noqa: BLE001
        p = STATE["producer"]
        log.finding(f"undocumented exception {type(e).__name__} ({STATE['target']})",
                    f"{type(e).__name__}: {e}\nproducer: {describe(p.spec) if p else '-'}", data, e)
        outcome = None
    target = STATE["target"]
    if outcome:
        log.outcome(f"{target}: {outcome}"[:110])
    made = STATE["producer"].made if STATE["producer"] else 0
    STATE["producer"] = None
    if any(Record.from_address(r).calls == 0 for r, _ in MANAGED):
        gc.collect()  # a reference cycle may still hold a capsule's owner
    for record, made_as in MANAGED:
        rec = Record.from_address(record)
        if rec.calls != 1:
            log.finding(f"deleter called {'more than once' if rec.calls > 1 else 'never'} ({target})",
                        f"{rec.calls} calls for a {made_as} ({made} capsules made)", data)
            if rec.calls == 0:
                for i in range(rec.n):
                    libc.free(rec.blocks[i])
        libc.free(record)
    MANAGED.clear()


def seeds() -> dict:
    """One input per target and dtype that the extension accepts (all zero bytes pick the
    expected shape, compact strides or NULL, float32, cpu, version 1.0), and a few others."""
    out = {}
    for t in range(len(TARGETS)):
        for dt in (0, 1):
            # ConsumeIntInRange reads little-endian bytes from the front; 0 picks the first choice
            out[f"{TARGETS[t].replace(' ', '-')}-{'bf16' if dt else 'f32'}"] = bytes([t, dt]) + bytes(62)
    out["random-1"] = bytes(range(256))
    out["random-2"] = bytes(range(255, -1, -1))
    return out


if __name__ == "__main__":
    fuzz_common.run(NAME, test_one_input, seeds, setup)
