"""The model cache's entries of a patched model hold the C cache's keys and values.

transformers keeps each layer's K and V in a cache layer (its `keys` and `values`,
[batch, kv_heads, tokens, head_dim]); the drop-in's K and V live in the layer's C cache
(KVCache, the same layout per sequence). After each call the entry's keys and values become
zero-copy views of the C cache (KVCache.all_keys / all_values): a DynamicLayer's as wide as
the tokens held, a StaticLayer's as wide as its max_cache_len (its cumulative_length counted
as transformers' update counts it), so everything that reads the model cache (its
get_seq_length, the masks it sizes, a user reading the keys) sees the real K and V, and no
step copies them. Keys are stored after QK-norm and RoPE, as transformers stores them.

The entry also carries the C cache (`_q3_cache`), and its class becomes a subclass that mirrors
on the C cache every operation generation performs on an entry: reorder_cache (beam search),
crop (assisted and prompt-lookup decoding), batch_repeat_interleave, batch_select_indices and
reset; the views are then taken anew, so none of them copies K and V in torch. copy.deepcopy
of the model cache copies the C cache with it (KVCache.__deepcopy__). What cannot be mirrored
(offloading, quantized or sliding-window layers) raises NotImplementedError naming it.

A decode step's later layers leave a DynamicLayer's views to be made when first read (_Lazy):
importing a view into torch costs ~1 us, two a layer a step, and nothing reads them while the
model runs but layer 0's width (get_seq_length, which the tied class answers without them).
"""
from __future__ import annotations

import ctypes
import weakref
from typing import Any, Callable, Dict, Optional

import torch

from . import op
from .._C import CacheFullError

# the cache-layer classes whose bookkeeping the drop-in keeps (by name: 4.57 and 5.x alike)
_KEPT = ("DynamicLayer", "StaticLayer")
_BASE_NAMES: Dict[type, str] = {}  # cache-layer class -> the name of the class it is (or mirrors)


def entry_of(model_cache: Any, layer_idx: int) -> Any:
    """the model cache's entry (a cache layer) for layer_idx, None before it has one"""
    layers = getattr(model_cache, "layers", None)
    if layers is None:
        raise NotImplementedError(f"qwen3layer: a model cache of type {type(model_cache).__name__} (without cache "
                                  "layers) cannot be mirrored on the C cache")
    return layers[layer_idx] if layer_idx < len(layers) else None


def _base_name(entry: Any) -> str:
    cls = type(entry)
    name = _BASE_NAMES.get(cls)
    if name is None:
        name = _BASE_NAMES[cls] = cls.__mro__[1].__name__ if getattr(cls, "_q3_mirrors", False) else cls.__name__
    return name


def check_entry(entry: Any) -> None:
    """NotImplementedError for a cache layer whose bookkeeping the drop-in does not keep"""
    if entry is not None and _base_name(entry) not in _KEPT:
        raise NotImplementedError(f"qwen3layer: a model cache layer of type {_base_name(entry)} cannot hold the C "
                                  f"cache's keys and values (supported: {', '.join(_KEPT)}: DynamicCache, StaticCache)")


def is_static(entry: Any) -> bool:
    return entry is not None and _base_name(entry) == "StaticLayer"


def static_length(entry: Any) -> Optional[int]:
    """a StaticLayer's max_cache_len (the width of its keys and of transformers' masks)"""
    return int(entry.max_cache_len) if is_static(entry) else None


def seen_tokens(model_cache: Any, layer_idx: int, entry: Any) -> int:
    """the tokens the model cache holds for the layer: an entry tied to a C cache counts what
    the C cache holds (host memory: no read of a device tensor, no stream synchronisation per
    layer), after checking that a DynamicLayer's keys still are its views' width; else what
    the model cache says (an entry this layer never filled: the caller refuses it)"""
    if model_cache is None:
        return 0
    kv = getattr(entry, "_q3_cache", None) if getattr(entry, "is_initialized", False) else None
    if kv is None:
        return int(model_cache.get_seq_length(layer_idx))
    held = kv.lengths[0]
    if not is_static(entry):  # the keys' width; views not made yet (_LazyView) of this C cache tell it unmade
        d = entry.__dict__
        lazy = d.get("_q3_lazy") if d.get("keys") is _LAZY else None
        width = lazy[1] if lazy is not None and lazy[0] is kv else entry.keys.shape[-2]
        if width != held:
            raise RuntimeError(f"qwen3layer layer {layer_idx}: the model cache's keys hold {width} tokens, this "
                               f"layer's C cache {held} (were the entry's keys replaced?)")
    return held


# the tokens a sequence of a generation's C cache holds at first, unless its prompt is longer or
# the limit lower: growing from there doubles (KVCache.grow copies the tokens held once a growth)
FIRST_CAPACITY = 256


def first_capacity(tokens: int, limit: int) -> int:
    """the capacity of a generation's new C cache for a prompt of `tokens` tokens: the power
    of two at least max(tokens, FIRST_CAPACITY), at most `limit` (the caller checked tokens
    <= limit)"""
    return min(limit, 1 << (max(tokens, FIRST_CAPACITY) - 1).bit_length())


def check_room(entry: Any, need: int, limit: int, why: Callable[[], str]) -> None:
    """CacheFullError where a call would bring each sequence of a generation to `need` tokens:
    past a StaticLayer's max_cache_len, or past `limit` (why() names what sets it) for a
    DynamicLayer's (or a new entry's) C cache, which grows up to it"""
    static = static_length(entry)
    if static is not None and need > static:
        raise CacheFullError(f"StaticCache: max_cache_len={static} tokens a sequence, and this call brings them to "
                             f"{need} (a static cache does not grow: make it with a larger max_cache_len)")
    if static is None and need > limit:
        raise CacheFullError(f"the sequences would hold {need} tokens, past {why()}")


def make_room(entry: Any, kv: Any, need: int, limit: int) -> None:
    """before a call that brings each sequence of kv to `need` tokens (check_room passed): a
    DynamicLayer's C cache grows to max(need, twice its capacity), at most `limit`, and the
    entry's views are taken anew. Amortized: a generation of n tokens grows
    log2(n / FIRST_CAPACITY) times, each copying the tokens held once (never a copy a step)."""
    if need > kv.capacity:
        kv.grow(min(limit, max(need, 2 * kv.capacity)), **_stream(kv))
        _repoint(entry)


# torch's import of a DLPack capsule: torch.from_dlpack, given a capsule rather than a tensor,
# hands it to this function (after a hasattr test that costs a caught AttributeError)
_FROM_CAPSULE = getattr(torch._C, "_from_dlpack", torch.from_dlpack)


def host_tensor(t: Any) -> torch.Tensor:
    """an extension tensor in host memory (a layer's output, a view of a C cache) as a torch
    tensor, zero-copy: what torch.from_dlpack does for it, without its device and stream
    look-ups (a host tensor has no stream). The capsule is the legacy one: parsing
    max_version=(1, 0) costs more than the import, and what the versioned one adds is the
    read-only flag, which these writable tensors do not carry (the extension refuses a legacy
    export of read-only memory)."""
    return _FROM_CAPSULE(t.__dlpack__())


class _Lazy:
    """_LAZY, the value a tied DynamicLayer's keys or values hold in its __dict__ until first read
    (republish leaves it, with the C cache and width in `_q3_lazy`); it copies and pickles as
    itself"""
    __slots__ = ()

    def __reduce__(self) -> str:
        return "_LAZY"


_LAZY = _Lazy()


class _LazyView:
    """a tied DynamicLayer's keys or values (a data descriptor of its mirroring class: every read
    and write of entry.keys passes here): what the entry's __dict__ holds, where that is _LAZY
    the view of `_q3_lazy`'s C cache and width, made now and kept. Made when read, the view
    holds the C cache's K or V as a view made at republish would: the C cache's memory moves
    only when it grows, and growing copies what it held; an operation that changes what the
    entry holds (crop, reorder, select, reset) sets keys and values anew."""
    __slots__ = ("name", "values")

    def __init__(self, name: str) -> None:
        self.name, self.values = name, name == "values"

    def __get__(self, entry: Any, owner: Any = None) -> Any:
        if entry is None:
            return self
        d = entry.__dict__
        try:
            t = d[self.name]
        except KeyError:
            raise AttributeError(f"'{type(entry).__name__}' object has no attribute '{self.name}'") from None
        if t is _LAZY:
            kv, tokens = d["_q3_lazy"]
            view = kv.all_values(tokens) if self.values else kv.all_keys(tokens)
            t = d[self.name] = host_tensor(view) if kv.device == "cpu" else torch.from_dlpack(view)
        return t

    def __set__(self, entry: Any, value: Any) -> None:
        entry.__dict__[self.name] = value

    def __delete__(self, entry: Any) -> None:
        try:
            del entry.__dict__[self.name]
        except KeyError:
            raise AttributeError(self.name) from None


def _views(kv: Any, tokens: int) -> tuple:
    if kv.device == "cpu":
        return host_tensor(kv.all_keys(tokens)), host_tensor(kv.all_values(tokens))
    return torch.from_dlpack(kv.all_keys(tokens)), torch.from_dlpack(kv.all_values(tokens))


class _Taken:
    """the views an entry was last given (_set_views) and of which C cache: a StaticLayer's
    keep their width, so the next call keeps them. A copy of the entry (copy.deepcopy of
    the model cache) gets none: its keys are then copies, not views of its C cache."""
    __slots__ = ("kv", "width", "keys", "values")

    def __init__(self, kv: Any = None, width: int = -1, keys: Any = None, values: Any = None) -> None:
        self.kv, self.width, self.keys, self.values = kv, width, keys, values

    def __reduce__(self) -> tuple:  # copy.deepcopy and pickle make an empty one
        return _Taken, ()


def _set_views(entry: Any, kv: Any, width: int, again: bool) -> None:
    """the entry's keys and values become views of kv, `width` tokens wide; again=False: a
    StaticLayer's are kept where they are the views it was given last, of kv, that wide (a
    DynamicLayer's widen every call)"""
    static = is_static(entry)
    taken = entry.__dict__.get("_q3_taken") if static else None
    if not again and taken is not None and taken.kv is kv and taken.width == width and \
            entry.keys is taken.keys and entry.values is taken.values:
        return
    entry.keys, entry.values = _views(kv, width)
    if static:
        entry._q3_taken = _Taken(kv, width, entry.keys, entry.values)


_INT64 = torch.int64
_COUNTS: Dict[int, torch.Tensor] = {}  # n -> a 0-dim int64 host tensor holding n (_count)


def _count(entry: Any, counter: torch.Tensor, n: int) -> None:
    """counter (the entry's cumulative_length) += n, as transformers' StaticLayer.update counts
    it. A plain host int64 scalar (the counter of a cache on the CPU) is added to in its
    memory, read through ctypes at the address it had when first counted here (_Counter):
    0.1 us against add_'s 1-2.5 us a call; add_ counts any other (a 0-dim host tensor added,
    not a Python int, which torch wraps in a new tensor each call). An add in memory leaves
    the tensor's _version as it was: nothing reads a counter's version."""
    held = entry.__dict__.get("_q3_counter")
    if held is not None and held.counter is counter and counter.data_ptr() == held.address and \
            counter.dtype is torch.int64:
        held.cell.value += n
        return
    by = _COUNTS.get(n)
    if by is None:
        with torch.inference_mode(False):  # an ordinary tensor, usable in and out of inference mode
            by = _COUNTS[n] = torch.tensor(n, dtype=torch.int64)
    counter.add_(by)  # (refuses what transformers' add_ would, e.g. an inference tensor outside inference mode)
    if type(counter) is torch.Tensor and counter.device.type == "cpu" and counter.dtype is torch.int64 and \
            counter.dim() == 0 and not counter.is_inference() and not counter.requires_grad:
        entry._q3_counter = _Counter(counter)


class _Counter:
    """a host int64 scalar tensor and its value's memory (ctypes), valid while the tensor is
    counter and its data_ptr() address (_count checks both each call: the tensor, held here,
    keeps that memory alive while its data_ptr is unchanged). A copy of the entry
    (copy.deepcopy of the model cache) gets none."""
    __slots__ = ("counter", "address", "cell")

    def __init__(self, counter: Any = None) -> None:
        self.counter = counter
        self.address = counter.data_ptr() if counter is not None else -1
        self.cell = ctypes.c_int64.from_address(self.address) if counter is not None else None

    def __reduce__(self) -> tuple:
        return _Counter, ()


class _Owner(tuple):
    """an entry's (weakref of the model cache, layer_idx[, kv, kv.growths, keys]): the model
    cache and layer it belongs to, and where republish may skip the registry, the C cache, its
    growths and the keys registered. A copy of the entry (copy.deepcopy of the model cache) gets
    none: its C cache is a copy, which its next call registers."""
    __slots__ = ()

    def __deepcopy__(self, memo: Any) -> None:
        return None


def publish(model_cache: Any, layer_idx: int, kv: Any, new_tokens: int) -> None:
    """after a call that appended new_tokens to the C cache kv: the entry's keys and values
    become views of it (the entry is made first where the model cache has none yet)"""
    entry = entry_of(model_cache, layer_idx)
    check_entry(entry)
    if entry is None or not getattr(entry, "is_initialized", False):
        k0, v0 = _views(kv, 0)
        # the model cache makes and initialises its entry as it would for the layer's first keys
        # (0 tokens of them: nothing is copied); 4.57's static layer reads a cache_position
        model_cache.update(k0, v0, layer_idx, {"cache_position": torch.zeros(0, dtype=torch.long,
                                                                               device=k0.device)})
        entry = entry_of(model_cache, layer_idx)
        check_entry(entry)
        if is_static(entry) and hasattr(entry, "cumulative_length"):
            entry.cumulative_length.zero_()
    if is_static(entry):
        if kv.capacity != entry.max_cache_len:
            raise RuntimeError(f"qwen3layer layer {layer_idx}: the C cache holds {kv.capacity} tokens a sequence, the "
                               f"static cache {entry.max_cache_len}")
        _set_views(entry, kv, entry.max_cache_len, again=False)
        if isinstance(getattr(entry, "cumulative_length", None), torch.Tensor):
            _count(entry, entry.cumulative_length, new_tokens)
    else:
        _set_views(entry, kv, kv.lengths[0], again=False)
    attach(entry, kv)
    keys = entry.keys
    op.register_cache(keys, model_cache, layer_idx)  # a compiled call finds the model cache by it
    # the owner, with the C cache and growths whose keys the registry now names, and those keys
    # (republish's test; compiled_keys)
    held = (kv, kv.growths, keys) if keys.numel() else ()
    entry._q3_owner = _Owner((weakref.ref(model_cache), layer_idx) + held)


def republish(model_cache: Any, layer_idx: int, entry: Any, d: Dict[str, Any], kv: Any, tokens: int,
              new_tokens: int, static: bool) -> None:
    """publish after a call whose caller found the model cache's entry for layer_idx (d: its
    __dict__) tied to kv already (initialized, of a class of TIED, `static` its kind, a
    StaticLayer's max_cache_len kv's capacity), nothing run between its look-ups and the C call,
    which appended new_tokens and brought each sequence to `tokens` (> 0): the views and counts
    publish would update, without its look-ups and checks (the fast path of
    qwen3layer.torch.DecoderLayer). What publish calls is inline here: _set_views' test
    for a StaticLayer's views kept (its class is known), _views and host_tensor for a host
    cache, and op.register_cache's test for a cache the registry names already (the keys
    are never empty: tokens > 0, or a StaticLayer's max_cache_len). A DynamicLayer's views are
    left to be made when read (_LazyView). The owner it sets carries the C cache and its
    growths: while they and the owner stand, the keys' address is the one registered (the C
    cache's memory moves only when it grows), and nothing is looked up."""
    if static:  # (a StaticLayer's keys and values are plain attributes)
        width, taken = d["max_cache_len"], d.get("_q3_taken")
        if taken is None or taken.kv is not kv or taken.width != width or d.get("keys") is not taken.keys or \
                d.get("values") is not taken.values:
            _set_views(entry, kv, width, again=True)
        counter, held = d.get("cumulative_length"), d.get("_q3_counter")
        if counter is None:  # (not an attribute of the entry's own: its class's, if any)
            counter = getattr(entry, "cumulative_length", None)
        if held is not None and held.counter is counter and counter.data_ptr() == held.address and \
                counter.dtype is _INT64:  # _count's own test, inline
            held.cell.value += new_tokens
        elif isinstance(counter, torch.Tensor):
            _count(entry, counter, new_tokens)
    else:  # the views made when first read (_LazyView: a tied DynamicLayer's class reads them so)
        d["keys"] = d["values"] = _LAZY
        d["_q3_lazy"] = (kv, tokens)
    # the owner and the registry: as publish leaves them, unless the owner says that this model
    # cache and layer registered this C cache's keys since it last grew (their address)
    owner = d.get("_q3_owner")
    if owner is None or len(owner) != 5 or owner[2] is not kv or owner[3] != kv.growths or \
            owner[0]() is not model_cache or owner[1] != layer_idx:
        keys = entry.keys
        op.register_cache(keys, model_cache, layer_idx)  # a compiled call finds the model cache by it
        entry._q3_owner = _Owner((weakref.ref(model_cache), layer_idx, kv, kv.growths, keys))


def compiled_keys(entry: Any) -> Any:
    """the entry's keys as a traced call hands them to the custom op (op.decoder_layer, which
    finds the model cache by their address): a tied DynamicLayer's views not made yet
    (_LazyView, whose making calls the extension, which Dynamo cannot trace) are stood in for
    by the keys the owner registered, views of the same C cache's memory (until it grows,
    when _repoint makes the views)"""
    d = entry.__dict__
    owner = d.get("_q3_owner")
    return owner[4] if d.get("keys") is _LAZY and owner is not None and len(owner) == 5 else entry.keys


def _repoint(entry: Any) -> None:
    """the entry's views taken anew after an operation on its C cache"""
    kv = entry._q3_cache
    _set_views(entry, kv, entry.max_cache_len if is_static(entry) else kv.lengths[0], again=True)
    owner = getattr(entry, "_q3_owner", None)  # (weakref of the model cache, layer_idx[, kv, growths, keys])
    model_cache, layer_idx = (owner[0](), owner[1]) if owner is not None else (None, 0)
    if model_cache is not None:  # a new C cache (select, repeat_interleave) at a new address
        op.register_cache(entry.keys, model_cache, layer_idx)


def attach(entry: Any, kv: Any) -> None:
    """ties the C cache kv to the model cache's entry: the entry's class becomes one that
    mirrors generation's operations on it"""
    cls = type(entry)
    if not getattr(cls, "_q3_mirrors", False):
        entry.__class__ = _mirroring(cls)
    entry._q3_cache = kv


_MIRRORING: Dict[type, type] = {}
# the classes _mirroring made for the cache layers check_entry keeps -> whether the class is a
# StaticLayer's (else a DynamicLayer's): an entry of one of them passed check_entry when it was
# tied to its C cache, and its class says which it is (a fast call's look-up for both)
TIED: Dict[type, bool] = {}


def _stream(kv: Any) -> dict:
    """a device cache's copies go on torch's current stream, after the layer calls queued
    there (KVCache's stream rule); a host cache takes none"""
    return {} if kv.device == "cpu" else {"stream": torch.cuda.current_stream(torch.device(kv.device)).cuda_stream}


def _mirroring(base: type) -> type:
    """the subclass of a cache-layer class that mirrors its operations on `_q3_cache`"""
    if base in _MIRRORING:
        return _MIRRORING[base]

    def held(self) -> Any:
        return getattr(self, "_q3_cache", None) if getattr(self, "is_initialized", False) else None

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        kv = held(self)
        if kv is None:
            return base.reorder_cache(self, beam_idx)
        kv.reorder(beam_idx.tolist(), **_stream(kv))
        _repoint(self)

    def crop(self, *args: Any, **kwargs: Any) -> None:
        base.crop(self, *args, **kwargs)  # the entry's own bookkeeping (a view's slice, a length)
        kv = held(self)
        if kv is not None:  # whatever the version's argument meant, the C cache keeps what the entry says
            kv.crop(int(self.get_seq_length()))
            _repoint(self)

    def batch_repeat_interleave(self, repeats: int) -> None:
        kv = held(self)
        if kv is None:
            return base.batch_repeat_interleave(self, repeats)
        self._q3_cache = kv.repeat_interleave(repeats, **_stream(kv))
        _repoint(self)

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        kv = held(self)
        if kv is None:
            return base.batch_select_indices(self, indices)
        idx = torch.as_tensor(indices)
        if idx.dtype == torch.bool:
            idx = idx.nonzero().flatten()
        self._q3_cache = kv.select(idx.flatten().tolist(), **_stream(kv))
        _repoint(self)

    def reset(self) -> None:
        kv = getattr(self, "_q3_cache", None)
        base.reset(self)
        if kv is not None:
            kv.reset()

    def refuse(name: str):
        def method(self, *args: Any, **kwargs: Any) -> None:
            raise NotImplementedError(f"qwen3layer: {name} of a cache layer cannot be mirrored on the C cache")
        method.__name__ = name
        return method

    def get_seq_length(self, *args: Any, **kwargs: Any) -> int:  # (a DynamicLayer's: its keys' width)
        lazy = self.__dict__.get("_q3_lazy") if self.__dict__.get("keys") is _LAZY else None
        return lazy[1] if lazy is not None and self.is_initialized else base.get_seq_length(self, *args, **kwargs)

    ns: Dict[str, Any] = {"_q3_mirrors": True, "reorder_cache": reorder_cache, "crop": crop,
                          "batch_repeat_interleave": batch_repeat_interleave,
                          "batch_select_indices": batch_select_indices, "reset": reset}
    if base.__name__ == "DynamicLayer":  # views made when read, and the width they will have
        ns.update(keys=_LazyView("keys"), values=_LazyView("values"), get_seq_length=get_seq_length)
    for name in ("offload", "prefetch"):
        if hasattr(base, name):
            ns[name] = refuse(name)
    cls = _MIRRORING[base] = type(f"Q3Mirrored{base.__name__}", (base,), ns)
    if base.__name__ in _KEPT:
        TIED[cls] = base.__name__ == "StaticLayer"
    return cls
