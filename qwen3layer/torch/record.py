"""Recording the C layer's insides where transformers collects them (output_router_logits,
output_attentions, output_hidden_states).

transformers (4.57 and 5.x) records them from the modules of the classes its model lists in
`_can_record_outputs` (the router or the MoE block, the attention, the decoder layer), by
wrapping their forward for the call (4.57) or by forward hooks installed once per model (5.x).
Each patched layer holds a parameter-free stand-in of each such class (a recorder), and after
the C layer ran (asked for its router logits and attention maps from the same pass when the
model wants them) it calls each stand-in with the value transformers would have read off the
original module. 5.x's hooks move with the layers: patch_model puts those on the originals onto
the stand-ins, unpatch_model those on the stand-ins onto the originals.
"""
from __future__ import annotations

from typing import Any, Dict, Optional, Tuple

import torch


def record(recorder: torch.nn.Module, x: torch.Tensor, value: torch.Tensor) -> None:
    """calls the stand-in as transformers' recording expects its class's output: value at the
    recorder's index of a tuple (the original's other outputs are None: not recorded); a call
    nothing would see (listened) is not made"""
    if listened(recorder):
        recorder(x, output=(None,) * recorder.index + (value,))


# torch's hooks on every module (torch.nn.modules.module's registries, changed in place); one
# missing from a version of torch: every recorder counts as listened to
_GLOBAL_FORWARD, _GLOBAL_FORWARD_PRE, _GLOBAL_BACKWARD, _GLOBAL_BACKWARD_PRE = (
    getattr(torch.nn.modules.module, name, True) for name in
    ("_global_forward_hooks", "_global_forward_pre_hooks", "_global_backward_hooks", "_global_backward_pre_hooks"))


def listened(recorder: torch.nn.Module) -> bool:
    """whether calling the stand-in could be seen: a hook on it (5.x's, installed once the
    model was first asked for an output) or on every module, or 4.57's wrapped forward;
    without any, torch's call would run its forward alone, which returns what it is given"""
    d = recorder.__dict__  # (torch's Module keeps its hook dicts there)
    return bool(d["_forward_hooks"] or d["_forward_pre_hooks"] or d["_backward_hooks"] or d["_backward_pre_hooks"] or
                "forward" in d or _GLOBAL_FORWARD or _GLOBAL_FORWARD_PRE or _GLOBAL_BACKWARD or _GLOBAL_BACKWARD_PRE)


def recorder_spec(key: str, spec: Any) -> Tuple[Optional[type], int]:
    """(class, output index) transformers records `key` from; (None, 0) for what the drop-in
    cannot stand in for (several classes, a name or a layer name instead of a class)"""
    if isinstance(spec, type):
        return spec, 0 if "hidden_states" in key else 1  # transformers' default for a bare class
    target = getattr(spec, "target_class", None)
    if isinstance(target, type) and getattr(spec, "layer_name", None) is None:
        return target, int(getattr(spec, "index", 0))
    return None, 0


def module_of(layer: Optional[torch.nn.Module], target: type) -> Optional[torch.nn.Module]:
    """the module of class `target` in the original layer (the layer itself included)"""
    for module in (layer.modules() if layer is not None else ()):
        if isinstance(module, target):
            return module
    return None


_RECORDER_CLASSES: Dict[type, type] = {}


def recorder_class(target: type) -> type:
    """A parameter-free subclass of `target` whose call returns the output it is given: the
    modules transformers records from are found by isinstance, and no code of the original
    class runs (torch's plain Module.__call__, so that its hooks run and 4.57's wrapped
    forward is what is called)."""
    if target not in _RECORDER_CLASSES:
        def __init__(self, key: str, index: int) -> None:
            torch.nn.Module.__init__(self)
            self.key, self.index = key, index

        def forward(self, *args: Any, output: Any = None) -> Any:
            return output

        def extra_repr(self) -> str:
            return f"records {self.key}"

        ns = {"__init__": __init__, "forward": forward, "extra_repr": extra_repr,
              "__call__": torch.nn.Module.__call__}
        _RECORDER_CLASSES[target] = type(f"Q3Recorder{target.__name__}", (target,), ns)
    return _RECORDER_CLASSES[target]


def _is_recording(hook: Any) -> bool:
    return getattr(hook, "__name__", "") == "output_capturing_hook"


def carry_hooks(src: Optional[torch.nn.Module], dst: Optional[torch.nn.Module], replace: bool = False) -> None:
    """transformers 5.x installs its recording hooks once per model, on the modules of the
    recorded classes it finds then: those on src, which dst replaces in the model, go to dst.
    replace: dst's own recording hooks go first (unpatching: the original submodules sat in
    the patched model's tree, so hooks installed meanwhile reached them too, and one call
    must be recorded once)"""
    if src is None or dst is None:
        return
    if replace:
        for key in [k for k, hook in dst._forward_hooks.items() if _is_recording(hook)]:
            del dst._forward_hooks[key]
    have = set(dst._forward_hooks.values())
    for hook in list(src._forward_hooks.values()):
        if _is_recording(hook) and hook not in have:
            dst.register_forward_hook(hook)
