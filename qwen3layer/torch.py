"""Drop-in use inside transformers models: qwen3layer.torch.DecoderLayer is a torch.nn.Module
with Qwen3MoeDecoderLayer's forward signature that runs the C layer, sharing the transformers
layer's weights without copies; patch_model swaps every decoder layer of a Qwen3MoeModel or
Qwen3MoeForCausalLM in place, unpatch_model puts the originals back.

The keys and values live in the layer's own C cache. The model's cache (transformers'
DynamicCache, passed as `cache` or `past_key_values`) still drives its bookkeeping
(get_seq_length, the masks it builds), so each call also appends placeholders of one
element per token to it: 4 bytes per token, sequence and layer in fp32, instead of a second
copy of K and V (2 * num_kv_heads * head_dim elements per token). Left-padded batches work:
each sequence's padding is read off the mask the model gives its layers (else generate's
position_ids) and set on the C cache, so real tokens neither attend to the padding nor count it
in their positions (RoPE's scores depend on position differences only, so a plain forward that
counts the padding in the positions gives the same real-token outputs).

Each layer's C cache rides on the model cache's entry for that layer (its `_q3_cache`), and the
entry's class is swapped for a subclass that mirrors on the C cache every operation
generation performs on the entry: reorder_cache (beam search), crop (assisted and
prompt-lookup decoding), batch_repeat_interleave, batch_select_indices and reset; and
copy.deepcopy of the model cache copies the C cache with it (KVCache.__deepcopy__). An
operation it cannot mirror (offloading) raises NotImplementedError naming it.

The layer's insides reach the model's outputs where transformers collects them. transformers
(4.57 and 5.x) records output_router_logits, output_attentions and output_hidden_states from
the modules of the classes its model lists in `_can_record_outputs` (the router or the MoE
block, the attention, the decoder layer), by wrapping their forward for the call (4.57) or by
forward hooks installed once per model (5.x). Each patched layer holds a parameter-free
stand-in of each such class (`recorders`), and after the C layer ran (asked for its router
logits and attention maps from the same pass when the model wants them) it calls each
stand-in with the value transformers would have read off the original module: router logits
[tokens, experts] with the batch flattened, attention maps [batch, heads, new, context], the
layer's input and output, in the model's dtype (the C layer hands them over in fp32).
5.x's hooks move with the layers: patch_model puts those on the originals onto the stand-ins,
unpatch_model those on the stand-ins onto the originals. Left padding's query rows are the one
difference: transformers' eager attention gives a fully masked row a uniform 1/context row, the
C layer has a padding token look at itself only (1 on its own position), and so those rows of
the router logits and hidden states differ too (transformers' aux_loss leaves them out through
the attention mask; no real token looks at them).
"""
from __future__ import annotations

from typing import Any, Dict, Optional, Tuple

import torch

from .layer import DecoderLayer as _CoreLayer


class DecoderLayer(torch.nn.Module):
    """A Qwen3MoeDecoderLayer replacement backed by qwen3layer's C engine, for inference:
    its outputs carry no gradient."""

    def __init__(self, core: _CoreLayer, layer_idx: int, original: Optional[torch.nn.Module] = None,
                 max_tokens: int = 4096, recordable: Optional[Dict[str, Any]] = None) -> None:
        super().__init__()
        self.core = core
        self.layer_idx = layer_idx
        self.max_tokens = max_tokens
        self.kv_cache = None  # the C cache of the generation in progress
        self.attention_limit: Optional[int] = None  # bytes of maps one call may make (None: the C layer's default)
        # kept out of the module tree so that the model's parameters are not listed twice
        self.__dict__["original"] = original
        # the model's config: its output_* flags are the defaults of the call's (as in transformers)
        self.__dict__["config"] = getattr(getattr(original, "self_attn", None), "config", None)
        self.recorders = torch.nn.ModuleDict()
        for key, spec in (recordable or {}).items():
            target, index = _recorder_spec(key, spec)
            counterpart = _module_of(original, target) if target is not None else None
            if counterpart is not None:
                self.recorders[key] = _recorder_class(target)(key, index)
                _carry_hooks(counterpart, self.recorders[key])

    @classmethod
    def from_hf(cls, hf_layer: torch.nn.Module, max_tokens: int = 4096,
                recordable: Optional[Dict[str, Any]] = None) -> "DecoderLayer":
        """From a transformers Qwen3MoeDecoderLayer; its weights are shared, not copied, and
        the C layer runs where they are (the CPU, or their CUDA device, on torch's stream).
        max_tokens: the longest sequence (prompt + generated) a generation may reach.
        recordable: the model's `_can_record_outputs` (patch_model passes it), which makes the
        layer hand its router logits, attention maps and hidden states to the model's outputs;
        without it, asking for them raises NotImplementedError."""
        layer_idx = getattr(hf_layer.self_attn, "layer_idx", 0)
        where = next(hf_layer.parameters()).device
        device = "cpu" if where.type == "cpu" else f"cuda:{where.index or 0}"
        return cls(_CoreLayer.from_hf(hf_layer, device=device), layer_idx, hf_layer, max_tokens, recordable)

    def _cache_for(self, model_cache: Any, batch: int, padding: list):
        """The C cache riding on the model cache's entry for this layer, or a new one when a
        generation starts (with each sequence's left padding)."""
        seen = model_cache.get_seq_length(self.layer_idx) if model_cache is not None else 0
        entry = _entry(model_cache, self.layer_idx)
        kv = getattr(entry, "_q3_cache", None)
        if seen == 0 or kv is None:
            if seen:
                raise RuntimeError(f"qwen3layer layer {self.layer_idx}: the model cache holds {seen} tokens this "
                                   "layer never saw (was it patched in the middle of a generation?)")
            kv = self._new_cache(self.max_tokens, batch, padding)
        elif kv.lengths != (seen,) * batch:
            raise RuntimeError(f"qwen3layer layer {self.layer_idx}: the model cache holds {seen} tokens, this "
                               f"layer's cache {kv.lengths}")
        self.kv_cache = kv  # the last one used, for inspection
        return kv

    def _new_cache(self, max_tokens: int, batch: int, padding: list):
        kv = self.core.new_cache(max_tokens, batch)
        for b, pad in enumerate(padding):
            if pad:
                kv.set_padding(pad, b)
        return kv

    def _wants(self, key: str, kwargs: Dict[str, Any]) -> bool:
        """whether the call asks for output_<key>: the call's flag, else the config's (as
        transformers decides); 5.x's output_hidden_states may be a list of indices"""
        flag = kwargs.get(f"output_{key}")
        if flag is None:
            flag = getattr(self.config, f"output_{key}", False)
        return flag is not None and flag is not False

    def _refuse_unrecorded(self, key: str) -> None:
        """NotImplementedError when the call asks for output_<key> and nothing would record it
        from this layer: no stand-in, or one that neither 5.x's hooks nor 4.57's wrapped
        forward listen on (never an empty or a missing result)"""
        rec = self.recorders[key] if key in self.recorders else None
        if rec is None or not (rec._forward_hooks or "forward" in rec.__dict__):
            import transformers
            raise NotImplementedError(
                f"qwen3layer layer {self.layer_idx}: output_{key}: no recorder of transformers "
                f"{transformers.__version__} listens on this layer (made without the model's _can_record_outputs, "
                "or recorded in a way the drop-in does not feed)")

    def forward(self, hidden_states: torch.Tensor, attention_mask: Optional[torch.Tensor] = None,
                position_ids: Optional[torch.LongTensor] = None, past_key_values: Any = None,
                use_cache: Optional[bool] = False, cache_position: Optional[torch.LongTensor] = None,
                position_embeddings: Any = None, cache: Any = None, **kwargs: Any) -> torch.Tensor:
        model_cache = cache if cache is not None else past_key_values
        B, L, _ = hidden_states.shape
        x = hidden_states.detach().contiguous()  # inference only: the C layer has no backward
        padding = _left_padding(attention_mask, position_ids, B)
        want_router, want_maps = self._wants("router_logits", kwargs), self._wants("attentions", kwargs)
        for key, wanted in (("router_logits", want_router), ("attentions", want_maps),
                            ("hidden_states", self._wants("hidden_states", kwargs))):
            if wanted:
                self._refuse_unrecorded(key)
        keep = model_cache is not None and use_cache
        kv = self._cache_for(model_cache, B, padding) if keep else self._new_cache(L, B, padding)
        y = self.core.prefill(x, kv, return_router=want_router, return_attention=want_maps,
                              attention_limit=self.attention_limit if want_maps else None)
        if want_router or want_maps:
            trace, y = y, y.output
            if want_router:  # transformers' router logits: [batch * tokens, experts] in the model's dtype
                _record(self.recorders["router_logits"], x, trace.router_logits.reshape(B * L, -1).to(x.dtype))
            if want_maps:  # [batch, heads, tokens, context], as eager attention's probabilities
                _record(self.recorders["attentions"], x, trace.attention.to(x.dtype))
        if "hidden_states" in self.recorders:  # its hooks decide whether it is asked for
            _record(self.recorders["hidden_states"], hidden_states, y)
        if keep:
            marker = torch.zeros(B, 1, L, 1, dtype=hidden_states.dtype, device=hidden_states.device)
            model_cache.update(marker, marker, self.layer_idx)
            _attach(_entry(model_cache, self.layer_idx), kv)
        return y


def _record(recorder: torch.nn.Module, x: torch.Tensor, value: torch.Tensor) -> None:
    """calls the stand-in as transformers' recording expects its class's output: value at the
    recorder's index of a tuple (the original's other outputs are None: not recorded)"""
    recorder(x, output=(None,) * recorder.index + (value,))


def _recorder_spec(key: str, spec: Any) -> Tuple[Optional[type], int]:
    """(class, output index) transformers records `key` from; (None, 0) for what the drop-in
    cannot stand in for (several classes, a name or a layer name instead of a class)"""
    if isinstance(spec, type):
        return spec, 0 if "hidden_states" in key else 1  # transformers' default for a bare class
    target = getattr(spec, "target_class", None)
    if isinstance(target, type) and getattr(spec, "layer_name", None) is None:
        return target, int(getattr(spec, "index", 0))
    return None, 0


def _module_of(layer: Optional[torch.nn.Module], target: type) -> Optional[torch.nn.Module]:
    """the module of class `target` in the original layer (the layer itself included)"""
    for module in (layer.modules() if layer is not None else ()):
        if isinstance(module, target):
            return module
    return None


_RECORDER_CLASSES: Dict[type, type] = {}


def _recorder_class(target: type) -> type:
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


def _carry_hooks(src: Optional[torch.nn.Module], dst: Optional[torch.nn.Module]) -> None:
    """transformers 5.x installs its recording hooks once per model, on the modules of the
    recorded classes it finds then: those on src, which dst replaces in the model, go to dst"""
    if src is None or dst is None:
        return
    have = set(dst._forward_hooks.values())
    for hook in list(src._forward_hooks.values()):
        if getattr(hook, "__name__", "") == "output_capturing_hook" and hook not in have:
            dst.register_forward_hook(hook)


def _entry(model_cache: Any, layer_idx: int) -> Any:
    """the model cache's entry (a cache layer) for layer_idx, None before it has one"""
    layers = getattr(model_cache, "layers", None)
    if layers is None:
        raise NotImplementedError(f"qwen3layer: a model cache of type {type(model_cache).__name__} (without cache "
                                  "layers) cannot be mirrored on the C cache")
    return layers[layer_idx] if layer_idx < len(layers) else None


def _attach(entry: Any, kv: Any) -> None:
    """ties the C cache kv to the model cache's entry: the entry's class becomes one that
    mirrors generation's operations on it"""
    cls = type(entry)
    if not getattr(cls, "_q3_mirrors", False):
        entry.__class__ = _mirroring(cls)
    entry._q3_cache = kv


_MIRRORING: Dict[type, type] = {}


def _mirroring(base: type) -> type:
    """the subclass of a cache-layer class that mirrors its operations on `_q3_cache`"""
    if base in _MIRRORING:
        return _MIRRORING[base]

    def mirrored_length(self) -> None:
        """crop: whatever the transformers version's argument meant, the entry's new length is
        what the C cache keeps"""
        kv = getattr(self, "_q3_cache", None)
        if kv is not None:
            kv.crop(self.get_seq_length())

    def stream(kv: Any) -> dict:
        """a device cache's copies go on torch's current stream, after the layer calls queued
        there (KVCache's stream rule); a host cache takes none"""
        return {} if kv.device == "cpu" else {"stream": torch.cuda.current_stream(torch.device(kv.device)).cuda_stream}

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        base.reorder_cache(self, beam_idx)
        if getattr(self, "_q3_cache", None) is not None:
            self._q3_cache.reorder(beam_idx.tolist(), **stream(self._q3_cache))

    def crop(self, *args: Any, **kwargs: Any) -> None:
        base.crop(self, *args, **kwargs)
        mirrored_length(self)

    def batch_repeat_interleave(self, repeats: int) -> None:
        base.batch_repeat_interleave(self, repeats)
        if getattr(self, "_q3_cache", None) is not None:
            self._q3_cache = self._q3_cache.repeat_interleave(repeats, **stream(self._q3_cache))

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        base.batch_select_indices(self, indices)
        if getattr(self, "_q3_cache", None) is not None:
            idx = torch.as_tensor(indices)
            if idx.dtype == torch.bool:
                idx = idx.nonzero().flatten()
            self._q3_cache = self._q3_cache.select(idx.flatten().tolist(), **stream(self._q3_cache))

    def reset(self) -> None:
        base.reset(self)
        if getattr(self, "_q3_cache", None) is not None:
            self._q3_cache.reset()

    def refuse(name: str):
        def method(self, *args: Any, **kwargs: Any) -> None:
            raise NotImplementedError(f"qwen3layer: {name} of a cache layer cannot be mirrored on the C cache")
        method.__name__ = name
        return method

    ns: Dict[str, Any] = {"_q3_mirrors": True, "reorder_cache": reorder_cache, "crop": crop,
                          "batch_repeat_interleave": batch_repeat_interleave,
                          "batch_select_indices": batch_select_indices, "reset": reset}
    for name in ("offload", "prefetch"):
        if hasattr(base, name):
            ns[name] = refuse(name)
    _MIRRORING[base] = type(f"Q3Mirrored{base.__name__}", (base,), ns)
    return _MIRRORING[base]


def _left_padding(mask: Optional[torch.Tensor], position_ids: Optional[torch.Tensor], batch: int) -> list:
    """Leading padding tokens of each sequence, for a generation's first call. From the 4D
    mask transformers gives the layers when it has one ([batch, 1, new, context], bool or
    additive): the keys masked at the start of the last query row (a real token when the
    batch is left padded). Else from generate's position_ids: a left-padded sequence's real
    tokens have positions 0, 1, ... and its padding 0 (transformers 5) or 1 (4.57), so the
    padding ends at the last position 0."""
    if isinstance(mask, torch.Tensor) and mask.dim() == 4:
        last = mask[:, 0, -1, :].expand(batch, -1)
        masked = ~last if last.dtype == torch.bool else last < torch.finfo(last.dtype).min / 2
        seen = torch.cumprod(masked.to(torch.int32), dim=1)  # 1 while the leading run lasts
        return seen.sum(dim=1).tolist()
    if position_ids is None or position_ids.dim() != 2:
        return [0] * batch
    pads = []
    for row in position_ids.expand(batch, -1).tolist():
        zeros = [i for i, p in enumerate(row) if p == 0]
        pads.append(zeros[-1] if zeros else 0)
    return pads


def _layers(model: torch.nn.Module) -> torch.nn.ModuleList:
    inner = getattr(model, "model", model)
    layers = getattr(inner, "layers", None)
    if not isinstance(layers, torch.nn.ModuleList):
        raise TypeError(f"model: expected a Qwen3MoeModel or Qwen3MoeForCausalLM, got {type(model).__name__}")
    return layers


def patch_model(model: torch.nn.Module, max_tokens: int = 4096,
                attention_limit: Optional[int] = None) -> torch.nn.Module:
    """Replaces every decoder layer of the model by a qwen3layer one (in place; returns the model).
    attention_limit: the bytes of attention maps one layer call may make when the model asks
    for output_attentions (None: the C layer's default, 2**30); above it the call raises
    ValueError with the maps' shape and size."""
    layers = _layers(model)
    recordable = getattr(model, "_can_record_outputs", None)
    for i, layer in enumerate(layers):
        if not isinstance(layer, DecoderLayer):
            layers[i] = DecoderLayer.from_hf(layer, max_tokens, recordable)
        layers[i].attention_limit = attention_limit
    return model


def unpatch_model(model: torch.nn.Module) -> torch.nn.Module:
    """Puts the original transformers layers back (in place; returns the model)."""
    layers = _layers(model)
    for i, layer in enumerate(layers):
        if isinstance(layer, DecoderLayer):
            for rec in layer.recorders.values():  # 5.x's hooks installed while it was patched
                _carry_hooks(rec, _module_of(layer.original, type(rec).__mro__[1]))
            layers[i] = layer.original
    return model
