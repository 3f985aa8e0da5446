"""A safetensors file nobody vouches for: opened only when it is a regular file, its header
length checked against the file before it is read, the header a JSON object, and each entry
the layer uses checked before the engine borrows its bytes. No torch, no safetensors package:
the format is 8 bytes of little-endian header length, a JSON header of
{name: {"dtype", "shape", "data_offsets": [begin, end]}} (offsets relative to the end of the
header), then the data. Dtypes taken: BF16, F32 and F16, F8_E4M3 (float8_e4m3fn) for the
projection matrices of an FP8 checkpoint (their block scales F32 or BF16), and a GPTQ
checkpoint's I32 words (qweight, qzeros, g_idx) and F16 scales; which of them a tensor may have is the caller's choice (check_entry's
`dtypes`)."""
from __future__ import annotations

import json
import math
import mmap
import os
import reprlib
import stat
import struct
from typing import Any, List, NamedTuple, Tuple

DTYPES = {"BF16": "bfloat16", "F32": "float32", "F8_E4M3": "float8_e4m3fn", "I32": "int32", "F16": "float16"}
ITEMSIZE = {"BF16": 2, "F32": 4, "F8_E4M3": 1, "I32": 4, "F16": 2}
FLOAT = ("BF16", "F32", "F16")  # the layer's dtypes: norms, the router, dense matrices
FP8 = ("F8_E4M3",)       # an FP8 checkpoint's projection matrices
SCALES = ("BF16", "F32")  # an FP8 matrix's block scales
WORDS = ("I32",)         # a GPTQ matrix's packed nibbles and zeros, and its g_idx
HALF = ("F16",)          # a GPTQ matrix's group scales
INT64_MAX = 2**63 - 1
MAX_DIMS = 8                  # the engine's Q3_MAX_DIM
MAX_JSON_BYTES = 100_000_000  # a header (safetensors' own limit), an index or a config.json

_repr = reprlib.Repr()
_repr.maxlist = _repr.maxdict = 10
_repr.maxstring, _repr.maxother = 400, 80  # strings: file names, kept whole


class CheckpointError(ValueError):
    """A checkpoint that cannot give the layer: what is wrong and where (the file, the tensor)."""


class UnsupportedDtypeError(CheckpointError, TypeError):
    """A tensor of the layer in a dtype the engine does not take (a TypeError too)."""


class Shard(NamedTuple):
    path: str
    entries: dict    # tensor name -> its header entry, as read (check_entry checks one)
    start: int       # file offset of the data: 8 + header length
    mm: mmap.mmap    # the whole file, read-only


class Entry(NamedTuple):
    dtype: str
    shape: List[int]
    begin: int       # data_offsets, relative to Shard.start
    end: int


def show(value: Any) -> str:
    """A value read from a file, for a message: its repr, cut short."""
    return _repr.repr(value)


# ---- files ----------------------------------------------------------------------------------

def _regular_file(path: str, what: str) -> None:
    """Refuses `path` before it is opened unless it is a regular file (a FIFO would block the open)."""
    try:
        mode = os.stat(path).st_mode
    except FileNotFoundError:
        raise CheckpointError(f"{path}: missing ({what})") from None
    except (OSError, ValueError) as e:
        raise CheckpointError(f"{path}: cannot be read ({what}): {e}") from None
    if not stat.S_ISREG(mode):
        raise CheckpointError(f"{path}: not a regular file ({what})")


def _open_regular(path: str, what: str) -> int:
    """A file descriptor of regular file `path`, opened without blocking, checked again once open
    (the name may have been replaced in between)."""
    _regular_file(path, what)
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0))
    except OSError as e:
        raise CheckpointError(f"{path}: cannot be read ({what}): {e}") from None
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise CheckpointError(f"{path}: not a regular file ({what})")
    return fd


def json_object(raw: bytes, where: str) -> dict:
    """`raw` as a JSON object (UTF-8)."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise CheckpointError(f"{where}: not valid UTF-8 ({e.reason} at byte {e.start})") from None
    try:
        value = json.loads(text)
    except (ValueError, RecursionError) as e:  # ValueError: also a number of over 4300 digits
        raise CheckpointError(f"{where}: not valid JSON ({str(e)[:200]})") from None
    if not isinstance(value, dict):
        raise CheckpointError(f"{where}: expected a JSON object, got {show(value)}")
    return value


def read_json(path: str, what: str) -> dict:
    """The JSON object in the small regular file `path`."""
    with os.fdopen(_open_regular(path, what), "rb") as f:
        size = os.fstat(f.fileno()).st_size
        if size > MAX_JSON_BYTES:
            raise CheckpointError(f"{path}: {size} bytes, expected at most {MAX_JSON_BYTES} ({what})")
        return json_object(f.read(MAX_JSON_BYTES + 1), path)


def open_shard(path: str, what: str) -> Shard:
    """The file memory-mapped and its header parsed; the header length is checked against the
    file size before the header is read."""
    fd = _open_regular(path, what)
    try:
        size = os.fstat(fd).st_size
        if size < 8:
            raise CheckpointError(f"{path}: truncated: {size} bytes, no header (expected 8 bytes of length)")
        mm = mmap.mmap(fd, 0, access=mmap.ACCESS_READ)
    finally:
        os.close(fd)
    try:
        (n,) = struct.unpack("<Q", mm[:8])
        if n > len(mm) - 8:
            raise CheckpointError(f"{path}: header length {n} runs past the end of the {len(mm)}-byte file")
        if n > MAX_JSON_BYTES:
            raise CheckpointError(f"{path}: header length {n}, expected at most {MAX_JSON_BYTES}")
        header = json_object(mm[8:8 + n], path)
    except BaseException:
        mm.close()
        raise
    header.pop("__metadata__", None)
    return Shard(path, header, 8 + n, mm)


def map_spans(shard: Shard, spans: List[Tuple[int, int]]) -> List[Tuple[int, int, int, mmap.mmap]]:
    """Read-only mappings of the file covering the data byte ranges [begin, end) (relative to
    Shard.start, checked against the file by check_entry) and no other tensor's: spans that
    touch share one mapping, each from the allocation-granularity boundary at or below its
    first byte (so a mapping may begin inside the page of the tensor before it).
    Returns (data begin, data end, file offset of the mapping's byte 0, mapping) for each. The
    file must be as long as it was when its header was read."""
    spans = sorted((b, e) for b, e in spans if e > b)
    merged: List[List[int]] = []
    for b, e in spans:
        if merged and b <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], e)
        else:
            merged.append([b, e])
    fd = _open_regular(shard.path, "a shard, mapped again for its tensors")
    maps: List[Tuple[int, int, int, mmap.mmap]] = []
    try:
        if os.fstat(fd).st_size != len(shard.mm):
            raise CheckpointError(f"{shard.path}: changed size while it was being read "
                                  f"({len(shard.mm)} bytes, now {os.fstat(fd).st_size})")
        for b, e in merged:
            first = (shard.start + b) // mmap.ALLOCATIONGRANULARITY * mmap.ALLOCATIONGRANULARITY
            maps.append((b, e, first, mmap.mmap(fd, shard.start + e - first, access=mmap.ACCESS_READ, offset=first)))
    except BaseException:
        for *_, mm in maps:
            mm.close()
        raise
    finally:
        os.close(fd)
    return maps


# ---- entries --------------------------------------------------------------------------------

def _check_dtype(where: str, dtype: Any, allowed: Tuple[str, ...]) -> str:
    if not isinstance(dtype, str):
        raise CheckpointError(f"{where}: dtype: expected a string, got {show(dtype)}")
    if dtype not in allowed:
        why = ""
        if dtype.startswith("F8_") and allowed == FP8:
            why = " (of the FP8 formats only e4m3, float8_e4m3fn, is taken)"
        elif dtype.startswith("F8_"):
            why = " (an FP8 tensor where config.json declares no FP8 quantization_config)"
        elif allowed == FLOAT and dtype == "I32":
            why = " (GPTQ words where config.json declares no GPTQ quantization_config)"
        listed = " or ".join(allowed) if len(allowed) < 3 else ", ".join(allowed[:-1]) + " or " + allowed[-1]
        raise UnsupportedDtypeError(f"{where}: expected dtype {listed}, got {dtype[:40]}{why}")
    return dtype


def _check_shape(where: str, shape: Any, dtype: str) -> List[int]:
    """a list of at most MAX_DIMS non-negative ints whose byte count, and strides, fit in int64"""
    if not isinstance(shape, list) or not all(type(d) is int and d >= 0 for d in shape[:MAX_DIMS + 1]):
        raise CheckpointError(f"{where}: shape: expected a list of non-negative ints, got {show(shape)}")
    if len(shape) > MAX_DIMS:
        raise CheckpointError(f"{where}: shape: expected at most {MAX_DIMS} dims, got {len(shape)}")
    # a 0 dim empties the tensor but its other dims still make strides: they too must fit
    nbytes = math.prod(d or 1 for d in shape) * ITEMSIZE[dtype]
    if nbytes > INT64_MAX:
        raise CheckpointError(f"{where}: shape {show(shape)} of {dtype} spans {nbytes} bytes (its dims' product, a 0 "
                              "counted as 1), "
                              f"expected at most {INT64_MAX} (int64)")
    return shape


def _check_offsets(where: str, offsets: Any, data_size: int) -> Tuple[int, int]:
    """two ints with 0 <= begin <= end <= the bytes after the header"""
    if not (isinstance(offsets, list) and len(offsets) == 2 and all(type(o) is int for o in offsets)):
        raise CheckpointError(f"{where}: data_offsets: expected two ints [begin, end], got {show(offsets)}")
    begin, end = offsets
    if begin < 0 or end < 0 or begin > end:
        problem = "a negative offset" if begin < 0 or end < 0 else "begin after end"
        raise CheckpointError(f"{where}: data_offsets {show(offsets)}: expected 0 <= begin <= end, got {problem}")
    if end > data_size:
        raise CheckpointError(f"{where}: data_offsets {show(offsets)} run past the end of the {data_size} bytes of "
                              f"data after the header (expected end <= {data_size}): truncated or corrupt")
    return begin, end


def _check_byte_count(where: str, begin: int, end: int, shape: List[int], dtype: str) -> None:
    nbytes = math.prod(shape) * ITEMSIZE[dtype]
    if end - begin != nbytes:
        raise CheckpointError(f"{where}: data_offsets [{begin}, {end}] hold {end - begin} bytes, "
                              f"shape {show(shape)} of {dtype} needs {nbytes}")


def _check_alignment(where: str, begin: int, file_offset: int, dtype: str) -> None:
    if file_offset % ITEMSIZE[dtype]:
        raise CheckpointError(f"{where}: data_offsets begin {begin} puts {dtype} data at file byte {file_offset}, "
                              f"expected a multiple of {ITEMSIZE[dtype]}")


def check_entry(shard: Shard, name: str, dtypes: Tuple[str, ...] = FLOAT) -> Entry:
    """Entry `name` of the shard's header, every field checked; raises CheckpointError naming the
    file and the tensor (UnsupportedDtypeError, a TypeError too, for a dtype not in `dtypes`)."""
    where, entry = f"{shard.path}: {name}", shard.entries[name]
    if not isinstance(entry, dict):
        raise CheckpointError(f"{where}: expected an object with dtype, shape and data_offsets, got {show(entry)}")
    for key in ("dtype", "shape", "data_offsets"):
        if key not in entry:
            raise CheckpointError(f"{where}: missing '{key}' (expected dtype, shape and data_offsets)")
    dtype = _check_dtype(where, entry["dtype"], dtypes)
    shape = _check_shape(where, entry["shape"], dtype)
    begin, end = _check_offsets(where, entry["data_offsets"], len(shard.mm) - shard.start)
    _check_byte_count(where, begin, end, shape, dtype)
    _check_alignment(where, begin, shard.start + begin, dtype)
    return Entry(dtype, shape, begin, end)


def check_no_overlap(path: str, spans: List[Tuple[int, int, str]]) -> None:
    """No two of the (begin, end, name) byte ranges of one file overlap (empty ones never do)."""
    spans = sorted(s for s in spans if s[0] < s[1])
    for (b0, e0, n0), (b1, e1, n1) in zip(spans, spans[1:]):
        if b1 < e0:
            raise CheckpointError(f"{path}: {n0} (data bytes [{b0}, {e0})) and {n1} "
                                  f"(data bytes [{b1}, {e1})) overlap")
