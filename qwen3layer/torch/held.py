"""What a patched layer's C layer reads of the transformers layer it replaces, as it was when
the C layer was made, and the test, each call, that it still is (qwen3layer.torch.DecoderLayer):

- each parameter: still its module's (not reassigned: setattr, load_state_dict(assign=True)),
  at the address, of the dtype and as contiguous as the C layer read it (not moved:
  model.to(), .half(); not the same memory read transposed: .data = .data.t());
- each submodule on the way to them: still where it was (not replaced by a wrapper, e.g. a LoRA
  adapter, whose code the C layer would not run);
- each parameter the C layer copied once at construction (converted: another dtype or layout):
  unchanged in place since (its version counter), since the copy would not see the change. A
  borrowed parameter changed in place is fine: the C layer reads its memory;
- no forward hook or pre-hook on a submodule but transformers' own output recording (which the
  layer's recorders serve), and none on every module (torch's global registries): the C layer
  runs the whole layer, so a hook on a part (an activation probe, a steering pre-hook) would
  never run. The hooks are read again only when a hook was registered anywhere since they
  were last read (torch's handle counter moved).

held() is the per-call test (the extension's _C.still_held over tuples); check() raises, naming
what changed."""
from __future__ import annotations

import itertools
import operator
from typing import Any, Iterable

import torch

from .._C import still_held as _still_held
from .record import _is_recording

_DATA_PTR, _DTYPE, _VERSION = torch.Tensor.data_ptr, operator.attrgetter("dtype"), operator.attrgetter("_version")
_CONTIGUOUS = torch.Tensor.is_contiguous
# still_held's readers: the tensor base class's own descriptors, which it calls without looking
# them up on each tensor (what a subclass does through __torch_function__ they do too)
_READERS = tuple(torch._C.TensorBase.__dict__[name] for name in ("data_ptr", "dtype", "is_contiguous", "_version"))

_RESTART = "call qwen3layer.torch.unpatch_model(model) and patch_model(model) again"

# torch's count of hook handles made so far (any module's or tensor's): while it stands still no
# hook was registered anywhere; a torch without it has every call read the hooks
_HANDLES = torch.utils.hooks.RemovableHandle


def _handles_made() -> int:
    return getattr(_HANDLES, "next_id", -2)


# torch's registries of forward pre-hooks and hooks on every module (register_module_forward_pre_hook,
# register_module_forward_hook), changed in place; None where this torch has neither
_GLOBAL_HOOKS = tuple(getattr(torch.nn.modules.module, name, None)
                      for name in ("_global_forward_pre_hooks", "_global_forward_hooks"))
_GLOBAL_HOOKS = _GLOBAL_HOOKS if all(isinstance(d, dict) for d in _GLOBAL_HOOKS) else None


def copied_parameters(names: Iterable[str], copied: Iterable[str]) -> set:
    """the parameter names (of `names`) whose tensors the C layer copied, from the names it
    copied (`copied`): the same name, or for a weight the C layer names per expert
    ("mlp.experts.3.gate_proj.weight") where the parameter holds every expert
    (transformers 5's fused "mlp.experts.gate_up_proj"), each parameter under the name's
    part before its first index ("mlp.experts")"""
    names = list(names)
    found = set()
    for c in copied:
        if c in names:
            found.add(c)
            continue
        stem = ".".join(itertools.takewhile(lambda part: not part.isdigit(), c.split(".")))
        found.update(n for n in names if n == stem or n.startswith(stem + "."))
    return found


class HeldWeights:
    """patched: the patched layer (the original's children are its children); original: the
    transformers layer; copied: the names of the parameters the C layer copied (its `converted`)"""

    def __init__(self, layer_idx: int, patched: torch.nn.Module, original: torch.nn.Module,
                 copied: Iterable[str]) -> None:
        self.layer_idx = layer_idx
        named = list(original.named_parameters())
        self.names = [name for name, _ in named]
        self.params = tuple(p for _, p in named)
        self.ptrs = list(map(_DATA_PTR, self.params))
        self.dtypes = list(map(_DTYPE, self.params))
        self.devices = [p.device for p in self.params]
        # the layout: each call tests contiguity alone (a shape and strides test costs 2-3 us a call,
        # the budget of the whole drop-in being ~10); a transposed view of the same memory shows in it
        self.layouts = ([p.shape for p in self.params], [p.stride() for p in self.params])
        self.contiguous = list(map(_CONTIGUOUS, self.params))
        # the parameter dict of the module holding each, and its name there
        self.holders = [original.get_submodule(name.rpartition(".")[0])._parameters for name in self.names]
        self.keys = [name.rpartition(".")[2] for name in self.names]
        # each submodule and the module dict it sits in: the patched layer's for the original's
        # children (the model's tree goes through it), its parent's below
        subs = [(name, m) for name, m in original.named_modules() if name]
        self.sub_names = [name for name, _ in subs]
        self.subs = tuple(m for _, m in subs)
        self.sub_dicts = [(patched if "." not in name else original.get_submodule(name.rpartition(".")[0]))._modules
                          for name in self.sub_names]
        self.sub_keys = [name.rpartition(".")[2] for name in self.sub_names]
        copied = copied_parameters(self.names, copied)
        self.copied = tuple(p for name, p in named if name in copied)
        self.copied_names = [name for name in self.names if name in copied]
        self.versions = list(map(_VERSION, self.copied))
        # what held() compares, in the extension (_C.still_held: the same test as Python maps costs
        # ten times as much): (the dict, the key, what it must hold) of each submodule, then of
        # each parameter; each parameter's address, dtype and contiguity; each copy's version
        self.watch = (tuple(self.sub_dicts + self.holders), tuple(self.sub_keys + self.keys), self.subs + self.params,
                      self.params, tuple(self.ptrs), tuple(self.dtypes), tuple(self.contiguous), self.copied,
                      tuple(self.versions), _READERS)
        # each submodule's forward pre-hooks and hooks (dicts torch changes in place), read when a
        # hook was registered since `hooks_read` (the handle count when they were last found clean)
        self.hook_dicts = [(name, m._forward_pre_hooks, m._forward_hooks) for name, m in subs]
        if _GLOBAL_HOOKS is not None:  # torch's hooks on every module: they too would run on each part
            self.hook_dicts.append((None, *_GLOBAL_HOOKS))
        self.hooks_read = -1

    def _hooks_clean(self) -> bool:
        """no hook on a submodule but transformers' recording ones; remembers the handle count"""
        made = _handles_made()
        for _, pre, post in self.hook_dicts:
            if pre or any(not _is_recording(h) for h in post.values()):
                return False
        self.hooks_read = made if made >= 0 else -1
        return True

    def held(self) -> bool:  # (qwen3layer.torch.repeat.run makes the same test inline)
        return _still_held(self.watch) and \
            (getattr(_HANDLES, "next_id", -2) == self.hooks_read or self._hooks_clean())  # (_handles_made, inline)

    def check(self) -> None:
        """RuntimeError naming the first thing the C layer no longer reads as it was"""
        if self.held():
            return
        where = f"qwen3layer layer {self.layer_idx}"
        for name, d, key, m in zip(self.sub_names, self.sub_dicts, self.sub_keys, self.subs):
            now = d.get(key)
            if now is not m:
                what = "removed" if now is None else f"now a {type(now).__name__}"
                raise RuntimeError(
                    f"{where}: its submodule {name} was replaced after the layer was patched ({type(m).__name__}, "
                    f"{what}): the C layer reads the weights it held then and runs none of a replacement's code "
                    f"(an adapter such as LoRA: merge it into the weights first); {_RESTART}")
        for name, p, ptr, dtype, device, holder, key, shape, stride in zip(
                self.names, self.params, self.ptrs, self.dtypes, self.devices, self.holders, self.keys, *self.layouts):
            now = holder.get(key)
            if now is not p:
                was = f"the module's parameter was {dtype} on {device}, it is " + \
                    ("removed" if now is None else f"now another tensor ({now.dtype} on {now.device})")
                how = "reassigned, e.g. by load_state_dict(assign=True) or setattr"
            elif p.data_ptr() != ptr or p.dtype != dtype or p.device != device:
                was = f"it was {dtype} on {device}, it is {p.dtype} on {p.device}"
                how = "moved or replaced, e.g. by model.to() or .half()"
            elif (p.shape, p.stride()) != (shape, stride):
                was = f"it was of shape {list(shape)} and strides {stride}, it is {list(p.shape)} and {p.stride()}"
                how = "the same memory read another way, e.g. by param.data = param.data.t()"
            else:
                continue
            raise RuntimeError(f"{where}: {name} is no longer the tensor the C layer reads ({was}: {how}); {_RESTART}")
        for name, pre, post in self.hook_dicts:
            hooks = list(pre.values()) + [h for h in post.values() if not _is_recording(h)]
            if hooks and name is None:
                kind = "pre_hook" if pre else "hook"
                raise RuntimeError(
                    f"{where}: a forward {kind.replace('_', '-')} on every module is registered "
                    f"({getattr(hooks[0], '__name__', hooks[0])}, torch.nn.modules.module.register_module_forward_"
                    f"{kind}): transformers would run it on each of the layer's parts, the C layer runs none of their "
                    "forwards; remove it, or unpatch_model(model) to run transformers' layer")
            if hooks:
                kind = "pre-hook" if pre else "hook"
                raise RuntimeError(
                    f"{where}: its submodule {name} has a forward {kind} ({getattr(hooks[0], '__name__', hooks[0])}), "
                    "which would never run: the C layer runs the whole layer, none of its parts' forwards; register "
                    "it on the decoder layer itself, or remove it (or unpatch_model(model) to run transformers' layer)")
        for name, p, version in zip(self.copied_names, self.copied, self.versions):
            if p._version != version:
                raise RuntimeError(
                    f"{where}: {name} was changed in place (e.g. by load_state_dict or an optimizer step), and the "
                    "C layer reads a copy of it made when the layer was patched (its dtype or layout was not one the "
                    f"C layer reads in place: DecoderLayer.converted); {_RESTART}")
