"""The drop-in's fast path (qwen3layer.torch.DecoderLayer._repeat): the decode steps of a
generation. Every layer of a model call is handed the same mask and positions, so the first
layer plans the call (the full path: DecoderLayer._prepare and _run), and when its call
continues its C cache without asking for insides, it keeps on the model call what that plan was
made of (Repeat). A later layer's call repeats the plan once it has checked, cheaply, that
nothing the plan and the full path's checks read differs; anything else returns None having
done nothing, and the full path gives its numbers or its refusal."""
from __future__ import annotations

import weakref
from typing import Any, Dict, Optional

import torch

from . import cache as _cache
from . import masks as _masks
from . import record as _rec
from .held import _HANDLES, _still_held
from ..devices import stream_of
from ..layer import DecoderLayer as _CoreLayer

_OUTPUT_FLAGS = ("output_router_logits", "output_attentions", "output_hidden_states")


class Repeat:
    """What a layer call that continued its C cache with an ordinary plan (one C call over the
    batch: not packed, no insides asked for) was planned from, kept on its model call for
    the call's next layers, which are handed the same arguments: run() runs
    such a layer's call as the full path would once it has checked that everything the
    plan and the checks read is what it was here. refs: weak references (a finished
    generation's mask is not kept alive) to the mask, position_ids and cache_position (the
    plan's tensors; the model cache is not one: what the plan reads of it, each layer reads
    off its own entry); stamps: masks._stamp of the three tensors (an in-place change
    shows); flags: the call's output_* arguments (_OUTPUT_FLAGS' order), which asked for nothing;
    shape: the hidden states'; state: the C cache's plan_state (lengths, padding, first
    positions, hidden tokens), as the plan was made for it (first: the plan's offsets)."""
    __slots__ = ("refs", "stamps", "flags", "shape", "state")

    def __init__(self, refs: tuple, stamps: tuple, flags: tuple, shape: Any, state: tuple) -> None:
        self.refs, self.stamps, self.flags, self.shape, self.state = refs, stamps, flags, shape, state

    @classmethod
    def of(cls, call: Any, attention_mask: Any, position_ids: Any, kwargs: Dict[str, Any], shape: Any,
           lengths: tuple, kv: Any) -> "Repeat":
        """what a continuing call of `call` without insides was planned from (kv: its C cache)"""
        get, stamp = kwargs.get, _masks._stamp
        cache_position = get("cache_position")
        return cls((_ref(attention_mask), _ref(position_ids), _ref(cache_position)),
                   (stamp(attention_mask, call), stamp(position_ids, call), stamp(cache_position, call)),
                   (get(_OUTPUT_FLAGS[0]), get(_OUTPUT_FLAGS[1]), get(_OUTPUT_FLAGS[2])), shape,
                   (lengths,) + kv.plan_state[1:])


def _ref(obj: Any) -> Any:
    """a weak reference to obj, or for None a callable that returns None (as masks' memo does)"""
    return _masks._no_tensor if obj is None else weakref.ref(obj)


def plain_prefill(core: _CoreLayer, x: torch.Tensor, kv: Any) -> torch.Tensor:
    """core.prefill(x, kv) of a core without host experts (core._hybrid None), asking for no
    insides: its device check and stream (stream_of), the extension's call, and the output
    as a torch tensor, zero-copy; for a host layer and input, what stream_of and the imports
    do for them without their look-ups (a plain tensor handed over as its capsule: _TO_CAPSULE; a
    subclass, whose __dlpack__ may differ, and a tensor with a gradient, which torch's export
    refuses, as themselves)"""
    ext = core._core
    if ext.device < 0 and x.is_cpu:
        plain = type(x) is _Tensor and not x.requires_grad
        return _cache.host_tensor(ext.prefill(_TO_CAPSULE(x) if plain else x, kv))
    return torch.from_dlpack(ext.prefill(x, kv, stream=stream_of(x, ext.device)))


_UNSET = object()  # run's cache_position when kwargs holds it (if anywhere)
_NO_FLAGS = (None, None, None)
# what run reads each call, bound once (a module's attribute is a look-up a call)
_TIED, _LAZY, _FROM_CAPSULE = _cache.TIED, _cache._LAZY, _cache._FROM_CAPSULE
_grad_enabled, _Tensor = torch.is_grad_enabled, torch.Tensor
# a plain host tensor's versioned capsule, as its __dlpack__(max_version=(1, 0)) makes it after ~6 us
# of checks in Python (with __dlpack_device__'s) that a drop-in call has made already (no gradient;
# a host tensor has no stream); a torch without it hands the extension the tensor
_TO_CAPSULE = getattr(torch._C, "_to_dlpack_versioned", None) or (lambda t: t)


def run(layer: Any, hidden_states: torch.Tensor, attention_mask: Any, position_ids: Any, model_cache: Any,
        kwargs: Dict[str, Any], call: Any, cache_position: Any = _UNSET) -> Optional[torch.Tensor]:
    """The call's fast path, for the decode steps of a generation: a layer call that
    continues its C cache, repeating the plan an earlier layer of the same model call
    made (call.repeat: the model hands each layer the same mask and positions). It runs
    the C layer and updates the model cache's entry as the full path (DecoderLayer._prepare,
    _run)
    would, and returns the output; or returns None having done nothing, wherever
    anything the full path reads may differ from what that plan was made of: the full
    path then runs, with its numbers or its refusal. cache_position: the call's, where
    kwargs does not hold it (forward passes it apart: no dict made for a fast call).
    What it checks instead of each of the full path's steps:
    - the plan (masks.planned's inputs): the same mask, position_ids and cache_position
      objects with the same stamps (masks._stamp), no cu_seq_lens_q (without it _plan
      reads no cu_seq_lens_k), the same model call
      (its attention implementation, read once a call), the hidden states' shape (batch,
      tokens), and this layer's C cache holding the lengths, padding, first positions and
      hidden tokens the plan was made for (plan_state); with the full path's offsets check,
      first positions == the plan's offsets;
    - the insides asked for: the same output_* objects, which asked for none (calls that
      ask are not repeated); the hidden-states recorder is fed as _run feeds it;
    - check_inference: eval mode with gradients off (nothing to refuse or warn of);
      _check_weights: HeldWeights.held, its own test, last before the C layer (inline: a
      change to held() is made here too);
    - the entry (check_entry, seen_tokens, _continued): of a class cache.TIED holds (the
      one attach made for a kept class), initialized, tied to a C cache; a DynamicLayer's
      keys as wide as the tokens held (views not yet made: the width they will have);
    - check_room and make_room: room in the C cache as it is (a StaticLayer's
      max_cache_len its capacity, as publish checks; a DynamicLayer's C cache within
      _token_limit), so that nothing grows;
    - the core: a plain DecoderLayer (no expert split, no host experts), called as the
      full path calls it (_plain_prefill)."""
    r = call.repeat
    refs, ld = r.refs, layer.__dict__
    core = ld["core"]
    if cache_position is _UNSET:
        cache_position = kwargs.get("cache_position")
    if refs[0]() is not attention_mask or refs[1]() is not position_ids or refs[2]() is not cache_position or \
            type(core) is not _CoreLayer or core._hybrid is not None or ld["training"] or _grad_enabled() or \
            type(hidden_states) is not _Tensor or hidden_states.requires_grad or hidden_states.shape != r.shape:
        return None
    if kwargs:  # (a decode step's are mostly empty)
        get, flags = kwargs.get, r.flags
        if get("cu_seq_lens_q") is not None or get("output_router_logits") is not flags[0] or \
                get("output_attentions") is not flags[1] or get("output_hidden_states") is not flags[2]:
            return None
    elif r.flags != _NO_FLAGS:
        return None
    # masks._stamp of each, against the plan's: the same tensors (above), so an inference tensor's
    # stamp is this call (its own, as the plan was made in it) and another's its version
    stamps = r.stamps
    if (stamps[0] is not None and stamps[0] is not call and attention_mask._version != stamps[0]) or \
            (stamps[1] is not None and stamps[1] is not call and position_ids._version != stamps[1]) or \
            (stamps[2] is not None and stamps[2] is not call and cache_position._version != stamps[2]):
        return None
    layer_idx = ld["layer_idx"]
    try:  # the model cache's own list (transformers' Cache sets it on the instance): a class whose
        # `layers` runs code when read (a property) is left to the full path
        entry = model_cache.__dict__["layers"][layer_idx]
    except (AttributeError, KeyError, IndexError, TypeError):  # no model cache, no entry yet
        return None
    static = _TIED.get(type(entry))
    d = entry.__dict__  # (what attach and transformers set on the entry; a class's default declines)
    kv = d.get("_q3_cache")
    if static is None or kv is None or d.get("is_initialized") is not True or \
            kv.plan_state != r.state:
        return None
    past, new, capacity = r.state[0][0], r.shape[1], kv.capacity
    if static:
        if past + new > capacity or d.get("max_cache_len") != capacity:
            return None
    else:  # a DynamicLayer's keys' width; views left to be made (cache._LazyView) tell it unmade
        lazy = d.get("_q3_lazy") if d.get("keys") is _LAZY else None
        width = entry.keys.shape[-2] if lazy is None else lazy[1] if lazy[0] is kv else -1
        limit = ld.get("_limit")  # (layer._cached_limit(), inline: (the core, max_tokens, the limit))
        cap = limit[2] if limit is not None and limit[0] is core and limit[1] is ld["max_tokens"] else \
            layer._cached_limit()
        if width != past or past + new > capacity or past + new > cap:
            return None
    held = ld["_held"]  # (None: a layer made without an original, nothing borrowed)
    if held is not None and not (_still_held(held.watch) and (getattr(_HANDLES, "next_id", -2) == held.hooks_read or
                                                                held._hooks_clean())):  # held.held(), inline
        return None
    x, ext = hidden_states.contiguous(), core._core  # not detached: it has no gradient (checked)
    if ext.device < 0 and x.is_cpu:  # plain_prefill's host case, inline (host_tensor: the output, zero-copy)
        y = _FROM_CAPSULE(ext.prefill(_TO_CAPSULE(x), kv).__dlpack__())
    else:
        y = plain_prefill(core, x, kv)
    rec = layer._modules["recorders"]._modules.get("hidden_states")
    if rec is not None and _rec.listened(rec):
        _rec.record(rec, hidden_states, y)
        _cache.publish(model_cache, layer_idx, kv, new)  # after a hook's code: found and checked anew
    else:
        _cache.republish(model_cache, layer_idx, entry, d, kv, past + new, new, static)
    if ld["kv_cache"] is not kv:
        layer.kv_cache = kv
    return y
