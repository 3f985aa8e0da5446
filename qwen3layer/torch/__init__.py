"""Drop-in use inside transformers models: qwen3layer.torch.DecoderLayer is a torch.nn.Module
with Qwen3MoeDecoderLayer's forward signature that runs the C layer, sharing the transformers
layer's weights without copies; patch_model swaps every decoder layer of a Qwen3MoeModel or
Qwen3MoeForCausalLM in place, unpatch_model puts the originals back.

A patched layer holds the original's submodules as its own (self_attn, mlp and the norms),
so the model's state_dict, save_pretrained and load_state_dict see every weight under its own
name; the C layer reads those very tensors, and a call after they were replaced (model.to(),
.half(), a reassigned parameter) raises instead of computing with the old ones.

What each call asks for is read off the mask the model gives its layers, its position_ids and
transformers' padding-free kwargs (qwen3layer.torch.masks): causal attention, left or right
padding, packed sequences (each run as a sequence of its own), or a refusal naming the mask.
The keys and values live in the layer's own C cache, and the model cache's entries hold
zero-copy views of them (qwen3layer.torch.cache), for DynamicCache and StaticCache. The first
layer of a model call plans it; a later layer's call that continues its C cache (a decode
step) repeats that plan once it has checked that nothing the plan and the full path's checks
read differs (DecoderLayer._repeat), and otherwise runs the full path.
The insides (router logits, attention maps, hidden states) reach the model's outputs where
transformers records them (qwen3layer.torch.record). Padding query rows are the one
difference: transformers' eager attention gives a fully masked row a uniform 1/context row,
the C layer has a padding token look at itself only (1 on its own position; a right-padding
row attends causally), so those rows of the outputs, router logits and hidden states differ
(transformers' aux_loss leaves them out through the attention mask; no real token looks at
them).

With patch_model(ep_group=), each layer's experts are split over the ranks of a
torch.distributed group (qwen3layer.parallel.ExpertParallelLayer), each rank running its own
prompts; a call refused on one rank is refused on all, and generate syncs the ranks' calls.

Inference only: a call in training mode with gradients enabled raises before any work (the
model's forward is guarded as well as each layer); an eval-mode call with gradients enabled
works and warns once that no gradient flows through the layer.
"""
from __future__ import annotations

import threading
import warnings
import weakref
from typing import Any, Dict, List, Mapping, Optional

import torch

from . import cache as _cache
from . import held as _held
from . import masks as _masks
from . import op as _op
from . import record as _rec
from . import repeat as _fast
from ..layer import DecoderLayer as _CoreLayer
from ..layer import check_expert_device

_GRAD_WARNED = [False]
_FLAGS = {"router_logits": "output_router_logits", "attentions": "output_attentions",
          "hidden_states": "output_hidden_states"}  # the call's and the config's names of what it asks for
_MISSING = object()


class _ModelCall:
    """What the layers of one model call read alike off the model's config (its output_*
    flags, its attention implementation): read by the first layer that asks, kept for the
    others. It is bound to the call's position_embeddings, which the model makes once a call
    and hands to every layer: a layer call with other ones (a layer called on its own, the
    layers of another model) reads the config itself."""
    __slots__ = ("cos", "config", "values", "repeat")

    def __init__(self) -> None:
        self.cos: Any = None  # weak reference to the call's cos tensor, once a layer bound it
        self.config: Any = None
        self.values: Dict[str, Any] = {}
        self.repeat: Optional[_fast.Repeat] = None  # the plan a layer of the call continued its C cache with


_is_compiling = torch.compiler.is_compiling  # (one look-up less a call; Dynamo knows the function)
_CALL = threading.local()  # .now: the _ModelCall of this thread's model call in progress (set by _guard)


class DecoderLayer(torch.nn.Module):
    """A Qwen3MoeDecoderLayer replacement backed by qwen3layer's C engine, for inference:
    its outputs carry no gradient."""

    def __init__(self, core: _CoreLayer, layer_idx: int, original: Optional[torch.nn.Module] = None,
                 max_tokens: Optional[int] = None, recordable: Optional[Dict[str, Any]] = None) -> None:
        super().__init__()
        self.core = core
        self.layer_idx = layer_idx
        if max_tokens is not None and (isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or
                                       max_tokens < 1):
            raise ValueError(f"max_tokens: expected a positive int or None (the model's context), got {max_tokens!r}")
        self.max_tokens = max_tokens  # a cap on the tokens a sequence of a generation may reach (None: none)
        self.kv_cache = None  # the C cache of the generation in progress
        self.attention_limit: Optional[int] = None  # bytes of maps one call may make (None: the C layer's default)
        # the original itself stays out of the module tree (the model lists each parameter once), its
        # submodules are this module's: the state_dict keeps transformers' names and tensors
        self.__dict__["original"] = original
        for name, child in (original.named_children() if original is not None else ()):
            self.add_module(name, child)
        # what the C layer reads of the original, as it was when it was made (HeldWeights)
        self.__dict__["_held"] = _held.HeldWeights(layer_idx, self, original, _copied_names(core)) \
            if original is not None else None
        # the model's config: its output_* flags are the defaults of the call's (as in transformers)
        self.__dict__["config"] = getattr(getattr(original, "self_attn", None), "config", None)
        self.__dict__["_handle"] = _op.register_layer(self)  # the custom op's way back to this layer
        self.recorders = torch.nn.ModuleDict()
        self.training = bool(getattr(original, "training", False))  # the mode of the layer it replaces
        for key, spec in (recordable or {}).items():
            target, index = _rec.recorder_spec(key, spec)
            counterpart = _rec.module_of(original, target) if target is not None else None
            if counterpart is not None:
                self.recorders[key] = _rec.recorder_class(target)(key, index)
                _rec.carry_hooks(counterpart, self.recorders[key])

    @classmethod
    def from_hf(cls, hf_layer: torch.nn.Module, max_tokens: Optional[int] = None,
                recordable: Optional[Dict[str, Any]] = None, ep_group: Any = None,
                ep_placement: Optional[List[List[int]]] = None, expert_device: Optional[str] = None,
                gpu_experts: Any = None, expert_counts: Any = None) -> "DecoderLayer":
        """From a transformers Qwen3MoeDecoderLayer; its weights are shared, not copied, and
        the C layer runs where they are (the CPU, or their CUDA device, on torch's stream).
        max_tokens: a cap on the longest sequence (prompt + generated) a generation may reach
        with a DynamicCache; None: the model's context (LayerConfig.context_length). The C
        cache grows to it as DynamicCache does (doubling); a StaticCache keeps its max_cache_len.
        recordable: the model's `_can_record_outputs` (patch_model passes it), which makes the
        layer hand its router logits, attention maps and hidden states to the model's outputs;
        without it, asking for them raises NotImplementedError.
        ep_group: a torch.distributed process group to split the layer's experts over
        (qwen3layer.parallel.ExpertParallelLayer, ep_placement its placement): each rank's C
        layer reads its own experts only, and every rank must call the layer alike.
        expert_device="cpu": the layer split over one GPU and the host
        (qwen3layer.placement.hybrid): its attention, norms and router where they are (a CUDA
        device), its experts in host memory, those of gpu_experts (ids, or N with
        expert_counts) copied to the GPU once."""
        layer_idx = getattr(hf_layer.self_attn, "layer_idx", 0)
        if expert_device is not None or gpu_experts is not None:
            if ep_group is not None:
                raise ValueError("expert_device: splits each layer over one GPU and the host, ep_group its experts "
                                 "over processes; got both (choose one)")
            check_expert_device(expert_device)  # before the placement's messages, which name 'cpu'
            device = _split_devices(hf_layer, layer_idx)
            core = _CoreLayer.from_hf(hf_layer, device=device, expert_device=expert_device, gpu_experts=gpu_experts,
                                      expert_counts=expert_counts)
            return cls(core, layer_idx, hf_layer, max_tokens, recordable)
        if ep_group is not None:
            from ..placement.parallel import ExpertParallelLayer
            core = ExpertParallelLayer.from_hf(hf_layer, group=ep_group, placement=ep_placement)
            return cls(core, layer_idx, hf_layer, max_tokens, recordable)
        where = next(hf_layer.parameters()).device
        device = "cpu" if where.type == "cpu" else f"cuda:{where.index or 0}"
        return cls(_CoreLayer.from_hf(hf_layer, device=device), layer_idx, hf_layer, max_tokens, recordable)

    @property
    def expert_parallel(self) -> bool:
        """whether the layer's experts are split over a process group (patch_model(ep_group=))"""
        return not isinstance(self.core, _CoreLayer)

    def check_inference(self) -> None:
        """RuntimeError for a call that expects to train through the layer (training mode with
        gradients enabled), before any work; a warning, once, for an eval-mode call with
        gradients enabled (its output has none)"""
        if self.training and torch.is_grad_enabled():
            raise RuntimeError(
                f"qwen3layer layer {self.layer_idx}: the C layer is inference-only (it has no backward), and the "
                "model is in training mode with gradients enabled (model.train(), gradient checkpointing or a loss "
                "to back-propagate): call model.eval() and run it under torch.no_grad() or torch.inference_mode()")
        dropout = float(getattr(self.config, "attention_dropout", 0.0) or 0.0) if self.training else 0.0
        if dropout > 0:
            raise RuntimeError(f"qwen3layer layer {self.layer_idx}: attention_dropout={dropout} in training mode: "
                               "transformers would drop attention probabilities, the C layer does not; call model.eval()")
        if torch.is_grad_enabled() and not _GRAD_WARNED[0] and not torch.compiler.is_compiling():
            _GRAD_WARNED[0] = True
            warnings.warn("qwen3layer: the patched layers run with gradients enabled but no gradient flows through "
                          "them (inference only); use torch.no_grad() or torch.inference_mode()", stacklevel=3)

    def _check_weights(self) -> None:
        held = self.__dict__["_held"]
        if held is not None:
            held.check()

    def _continued(self, entry: Any, seen: int, batch: int) -> Any:
        """the C cache riding on the model cache's entry for this layer, for a call after `seen`
        tokens"""
        kv = getattr(entry, "_q3_cache", None)
        if kv is None:
            raise RuntimeError(f"qwen3layer layer {self.layer_idx}: the model cache holds {seen} tokens this "
                               "layer never saw (was it patched in the middle of a generation?)")
        if kv.lengths != (seen,) * batch:
            raise RuntimeError(f"qwen3layer layer {self.layer_idx}: the model cache holds {seen} tokens for each of "
                               f"{batch} sequences, this layer's cache {kv.lengths}")
        return kv

    def _new_cache(self, max_tokens: int, batch: int, padding: List[int], first: List[int]) -> Any:
        """a C cache whose sequences start with `padding` tokens of padding and put their first
        real token at RoPE position `first` (transformers' position_ids)"""
        kv = self.core.new_cache(max_tokens, batch)
        for b, (pad, at) in enumerate(zip(padding, first)):
            if pad:
                kv.set_padding(pad, b)
            if at:
                kv.set_first_position(at, b)
        return kv

    def _model_call(self, position_embeddings: Any) -> Optional[_ModelCall]:
        """the model call this layer call is part of (_ModelCall), None when it is not known"""
        now = getattr(_CALL, "now", None)
        if now is None or not isinstance(position_embeddings, tuple) or not position_embeddings:
            return None
        cos = position_embeddings[0]
        if now.cos is None and isinstance(cos, torch.Tensor):  # the model call's first layer
            now.cos, now.config = weakref.ref(cos), self.config
        return now if now.cos is not None and now.cos() is cos and now.config is self.config else None

    def _config_value(self, name: str, default: Any, call: Optional[_ModelCall]) -> Any:
        """the model config's `name` (default without it), read once a model call"""
        if call is None:
            return getattr(self.config, name, default)
        value = call.values.get(name, _MISSING)
        if value is _MISSING:
            value = call.values[name] = getattr(self.config, name, default)
        return value

    def _wants(self, key: str, kwargs: Dict[str, Any], call: Optional[_ModelCall] = None) -> bool:
        """whether the call asks for output_<key>: the call's flag, else the config's (as
        transformers decides); 5.x's output_hidden_states may be a list of indices"""
        name = _FLAGS[key]
        flag = kwargs.get(name)
        if flag is None:
            flag = self._config_value(name, False, call)
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

    def _plan(self, mask: Any, position_ids: Any, batch: int, length: int, past: int, kv: Any,
              kwargs: Dict[str, Any], call: Optional[_ModelCall] = None) -> _masks.CallPlan:
        """the call's plan, made once per model call (every layer gets the same mask:
        masks.planned)"""
        cu = kwargs.get("cu_seq_lens_q")
        if cu is not None and kwargs.get("cu_seq_lens_k") is not None and \
                not torch.equal(torch.as_tensor(cu), torch.as_tensor(kwargs["cu_seq_lens_k"])):
            raise ValueError("cu_seq_lens_k: expected the same sequences as cu_seq_lens_q (no cache in a packed call), "
                             f"got {kwargs['cu_seq_lens_k'].tolist()} and {cu.tolist()}")
        impl = self._config_value("_attn_implementation", None, call)
        padding = kv.padding if kv is not None else None
        hidden = kv.hidden if kv is not None else None
        return _masks.planned(mask, position_ids, batch, length, past, padding, impl, cu, kwargs.get("cache_position"),
                              call, hidden)

    def forward(self, hidden_states: torch.Tensor, attention_mask: Optional[torch.Tensor] = None,
                position_ids: Optional[torch.LongTensor] = None, past_key_values: Any = None,
                use_cache: Optional[bool] = False, cache_position: Optional[torch.LongTensor] = None,
                position_embeddings: Any = None, cache: Any = None, **kwargs: Any) -> torch.Tensor:
        # transformers' attention appends to the cache it is given, whatever use_cache says
        model_cache = cache if cache is not None else past_key_values
        if _is_compiling():
            if cache_position is not None:
                kwargs = dict(kwargs, cache_position=cache_position)
            return self._traced(hidden_states, attention_mask, position_ids, model_cache, kwargs)
        now = getattr(_CALL, "now", None)
        if now is not None and now.repeat is not None and type(position_embeddings) is tuple and \
                position_embeddings and now.cos is not None and now.cos() is position_embeddings[0] and \
                now.config is self.__dict__["config"] and "cache_position" not in kwargs:
            # a later layer of a model call whose planning layer left a plan (_model_call's test,
            # inline): the fast path straight away, and the full path only where it declines
            y = self._repeat(hidden_states, attention_mask, position_ids, model_cache, kwargs, now, cache_position)
            if y is not None:
                return y
            repeated = True
        else:
            repeated = False
        if cache_position is not None:  # where transformers would write the keys: checked with the plan
            kwargs = dict(kwargs, cache_position=cache_position)
        return self.call(hidden_states, attention_mask, position_ids, model_cache, kwargs, position_embeddings,
                         repeated=repeated)

    def _traced(self, hidden_states: torch.Tensor, attention_mask: Any, position_ids: Any, model_cache: Any,
                kwargs: Dict[str, Any]) -> torch.Tensor:
        """the call as Dynamo traces it: one custom op (qwen3layer.torch.op), which makes the
        eager call at run time"""
        for key in ("router_logits", "attentions", "hidden_states"):
            if self._wants(key, kwargs):
                raise NotImplementedError(f"qwen3layer layer {self.layer_idx}: output_{key} under torch.compile")
        if self.training and torch.is_grad_enabled():
            raise RuntimeError(f"qwen3layer layer {self.layer_idx}: the C layer is inference-only: call model.eval() "
                               "and compile under torch.no_grad() or torch.inference_mode()")
        keys = None
        if model_cache is not None:
            layers = getattr(model_cache, "layers", [])
            entry = layers[self.layer_idx] if self.layer_idx < len(layers) else None
            if entry is not None and getattr(entry, "is_initialized", False):
                keys = _cache.compiled_keys(entry)
        return _op.decoder_layer(hidden_states, attention_mask, position_ids, kwargs.get("cu_seq_lens_q"),
                                 kwargs.get("cache_position"), keys, self._handle, model_cache is not None)

    def call(self, hidden_states: torch.Tensor, attention_mask: Any, position_ids: Any, model_cache: Any,
             kwargs: Dict[str, Any], position_embeddings: Any = None, repeated: bool = False) -> torch.Tensor:
        """the layer's call, eager: the plan of the call, the C layer, the insides recorded and
        the model cache's entry updated. Split over a group, a call refused before the C layer
        is refused on every rank (ExpertParallelLayer.refuse): none waits for it.
        position_embeddings: the model call's (which tell the layers of one model call);
        repeated: the fast path was tried already (by forward) and declined."""
        call = self._model_call(position_embeddings)
        if call is not None and call.repeat is not None and not repeated:
            y = self._repeat(hidden_states, attention_mask, position_ids, model_cache, kwargs, call)
            if y is not None:
                return y
        try:
            x, kv, plan, wants = self._prepare(hidden_states, attention_mask, position_ids, model_cache, kwargs, call)
        except Exception as e:
            if not self.expert_parallel:
                raise
            self.core.refuse("prefill", e, hidden_states.dtype)
            raise  # refuse raised it; not reached
        return self._run(hidden_states, x, kv, plan, model_cache, *wants)

    _repeat = _fast.run  # the fast path of a decode step (qwen3layer.torch.repeat)

    def _prepare(self, hidden_states: torch.Tensor, attention_mask: Any, position_ids: Any, model_cache: Any,
                 kwargs: Dict[str, Any], call: Optional[_ModelCall] = None) -> tuple:
        """the call's checks and plan, before the C layer: (x, its C cache, the plan, (router
        logits, maps) wanted); call: the model call it is part of, if known. The weight check
        comes last, after the reads that may run code not the drop-in's (the mask's, the model
        cache's), before make_room and the C call."""
        self.check_inference()
        if not isinstance(hidden_states, torch.Tensor):
            raise TypeError(f"hidden_states: expected a torch.Tensor, got {type(hidden_states).__name__}")
        B, L, _ = hidden_states.shape
        want_router, want_maps = self._wants("router_logits", kwargs, call), self._wants("attentions", kwargs, call)
        want_hidden = self._wants("hidden_states", kwargs, call)
        if want_router or want_maps or want_hidden:
            for key, wanted in (("router_logits", want_router), ("attentions", want_maps),
                                ("hidden_states", want_hidden)):
                if wanted:
                    self._refuse_unrecorded(key)
        entry = _cache.entry_of(model_cache, self.layer_idx) if model_cache is not None else None
        _cache.check_entry(entry)
        past = _cache.seen_tokens(model_cache, self.layer_idx, entry)
        kv = self._continued(entry, past, B) if past else None
        limit, why = self._cached_limit(), self._limit_words
        if model_cache is not None:
            _cache.check_room(entry, past + L, limit, why)
        plan = self._plan(attention_mask, position_ids, B, L, past, kv, kwargs, call)
        if plan.packed is not None and model_cache is not None:
            raise ValueError(f"attention_mask: {plan.kind}: packed sequences cannot continue in one model cache "
                             "(each is a sequence of its own): call the model with use_cache=False")
        if kv is not None and plan.positions is None and tuple(plan.offsets) != kv.first_positions:
            raise ValueError(f"position_ids: the sequences' first real tokens are at positions {plan.offsets} for this "
                             f"call, at {list(kv.first_positions)} in the cache it continues")
        if plan.packed is not None and self.expert_parallel:
            raise NotImplementedError(f"attention_mask: {plan.kind}: packed sequences are not run with the experts "
                                      "split over a group (each would be a call of its own, and the ranks' calls "
                                      "would differ in number): pass a padded batch")
        # inference only: the C layer has no backward (detached where there is a graph to cut)
        x = (hidden_states.detach() if hidden_states.requires_grad else hidden_states).contiguous()
        if kv is not None and call is not None and plan.positions is None and not (want_router or want_maps or
                                                                                   want_hidden):
            # the plan for the model call's next layers (_repeat), with what it was made of: a
            # continuing call's plan is never packed (plan_call refuses it); _repeat itself
            # leaves a call with cu_seq_lens_q to the full path
            call.repeat = _fast.Repeat.of(call, attention_mask, position_ids, kwargs, hidden_states.shape,
                                            (past,) * B, kv)
        # the weights, after everything above that may run code not the drop-in's (a tensor subclass's
        # methods on the mask or positions, a model cache's or its entries' attributes): what the C
        # layer reads next is what was checked
        self._check_weights()
        if kv is not None:
            _cache.make_room(entry, kv, past + L, limit)
        elif plan.packed is None:
            static = _cache.static_length(entry)
            kv = self._new_cache(static or (_cache.first_capacity(L, limit) if model_cache is not None else L), B,
                                 plan.padding, plan.offsets if plan.positions is None else [0] * B)
        return x, kv, plan, (want_router, want_maps)

    def _token_limit(self) -> int:
        """the tokens a sequence of a generation may reach with a DynamicCache: the model's
        context (LayerConfig.context_length), or patch_model's max_tokens below it"""
        context, cap = self.core.config.context_length, self.max_tokens
        return context if cap is None or cap >= context else cap

    def _cached_limit(self) -> int:
        """_token_limit(), kept on the layer with the core and max_tokens it was found for (the
        fast path reads the same: qwen3layer.torch.repeat.run)"""
        d = self.__dict__
        limit = d.get("_limit")
        if limit is None or limit[0] is not d["core"] or limit[1] is not d["max_tokens"]:
            limit = d["_limit"] = (d["core"], d["max_tokens"], self._token_limit())
        return limit[2]

    def _limit_words(self) -> str:
        """what sets _token_limit, in words (made only for an error)"""
        cfg = self.core.config
        context, cap = cfg.context_length, self.max_tokens
        what = (f"the model's context of {context} positions (max_position_embeddings={cfg.max_position_embeddings}"
                + (f", YaRN factor {cfg.rope_factor:g}" if cfg.rope_type == "yarn" else "") + ")")
        return what if cap is None or cap >= context else f"patch_model(max_tokens={cap}) (below {what})"

    def _run(self, hidden_states: torch.Tensor, x: torch.Tensor, kv: Any, plan: _masks.CallPlan, model_cache: Any,
             want_router: bool, want_maps: bool) -> torch.Tensor:
        """the C layer on the prepared call, the insides recorded, the model cache updated"""
        B, L, _ = x.shape
        limit = self.attention_limit if want_maps else None
        core = self.core
        if plan.packed is None and plan.positions is None and not (want_router or want_maps) and \
                type(core) is _CoreLayer and core._hybrid is None:
            y = _fast.plain_prefill(core, x, kv)
        elif plan.packed is None:
            tokens = {} if plan.positions is None else dict(token_mask=plan.token_mask, positions=plan.positions,
                                                            tree=plan.tree)
            y = core.prefill(x, kv, return_router=want_router, return_attention=want_maps, attention_limit=limit,
                             **tokens)
            if want_router or want_maps:
                y, logits, maps = y.output, y.router_logits, y.attention
        else:
            y, logits, maps = _run_packed(self, x, plan, want_router, want_maps, limit)
        if want_router:  # transformers' router logits: [batch * tokens, experts] in the model's dtype
            _rec.record(self.recorders["router_logits"], x, logits.reshape(B * L, -1).to(x.dtype))
        if want_maps:  # [batch, heads, tokens, keys], as eager attention's probabilities (a static cache's width)
            maps = torch.nn.functional.pad(maps, (0, plan.key_width - maps.shape[-1]))
            _rec.record(self.recorders["attentions"], x, maps.to(x.dtype))
        rec = self._modules["recorders"]._modules.get("hidden_states")  # (Module.__getattr__ is slow)
        if rec is not None:  # its hooks decide whether it is asked for
            _rec.record(rec, hidden_states, y)
        if model_cache is not None:
            _cache.publish(model_cache, self.layer_idx, kv, L)
            if self.__dict__["kv_cache"] is not kv:  # (Module.__setattr__ is slow; kv is neither tensor nor module)
                self.kv_cache = kv  # the last one used, for inspection
        return y


def _copied_names(core: Any) -> tuple:
    """the names of the parameters the C layer copied at construction (DecoderLayer.converted),
    of each C layer a core holds (an expert-parallel rank's, a split layer's two sides)"""
    layer = getattr(core, "layer", core)  # ExpertParallelLayer: its rank's DecoderLayer
    names = tuple(layer.converted)
    hybrid = getattr(layer, "_hybrid", None)
    return names + (tuple(hybrid.host.converted) if hybrid is not None else ())


def _split_devices(hf_layer: torch.nn.Module, layer_idx: int) -> str:
    """the CUDA device of a layer to split over it and the host (its attention's), checked:
    the attention, norms and router there, the experts in host memory"""
    attn = hf_layer.self_attn.q_proj.weight.device
    if attn.type != "cuda":
        raise ValueError(f"expert_device='cpu': layer {layer_idx}'s attention (self_attn.q_proj.weight) is on {attn}; "
                         "a split layer runs its attention on a CUDA device (place the layer's non-expert weights "
                         "there and its experts in host memory, e.g. with a device_map)")
    for name, p in hf_layer.named_parameters():
        expert = name.startswith("mlp.experts.")
        if expert and p.device.type != "cpu":
            raise ValueError(f"expert_device='cpu': layer {layer_idx}'s {name} is on {p.device}; expected the experts "
                             "in host memory (gpu_experts says which are copied to the GPU)")
        if not expert and p.device != attn:
            raise ValueError(f"expert_device='cpu': layer {layer_idx}'s {name} is on {p.device}, its attention on "
                             f"{attn}; expected every non-expert weight on that device")
    return f"cuda:{attn.index or 0}"


def _per_layer(value: Any, layer_idx: int, arg: str) -> Any:
    """a patch_model argument for one layer: a mapping's entry for its index (which must be
    there), else the value itself (every layer the same)"""
    if not isinstance(value, Mapping):
        return value
    if layer_idx not in value:
        raise ValueError(f"{arg}: a mapping of layer index -> value, without layer {layer_idx} (has "
                         f"{sorted(value)[:8]})")
    return value[layer_idx]


def _run_packed(layer: DecoderLayer, x: torch.Tensor, plan: _masks.CallPlan, want_router: bool,
                want_maps: bool, limit: Optional[int]) -> tuple:
    """each packed sequence as a C call of its own, on rows of x in place (views: no copy),
    its output into the rows of y; the insides gathered into the whole call's shapes"""
    B, L, _ = x.shape
    y = torch.empty_like(x)
    logits = maps = None
    first = iter(plan.offsets)
    for b, segments in enumerate(plan.packed):
        for s in segments:
            n = s.end - s.start
            kv = layer._new_cache(n, 1, [s.padding], [next(first)])
            r = layer.core.prefill(x[b, s.start:s.end], kv, out=y[b, s.start:s.end], return_router=want_router,
                                   return_attention=want_maps, attention_limit=limit)
            if want_router:
                if logits is None:
                    logits = torch.zeros(B, L, r.router_logits.shape[-1], dtype=torch.float32, device=x.device)
                logits[b, s.start:s.end] = r.router_logits.reshape(n, -1)
            if want_maps:
                if maps is None:
                    maps = torch.zeros(B, r.attention.shape[1], L, plan.key_width, dtype=torch.float32,
                                       device=x.device)
                maps[b, :, s.start:s.end, s.start:s.end] = r.attention[0, :, :, :n]
    return y, logits, maps


def _guard(model: torch.nn.Module, args: Any) -> None:
    """the model's forward pre-hook: a training call is refused before the embeddings run;
    a new model call begins (_ModelCall: what its layers read alike)"""
    if not torch.compiler.is_compiling():
        _CALL.now = _ModelCall()
    layers = [m for m in _layers(model) if isinstance(m, DecoderLayer)]
    if layers:
        layers[0].check_inference()


def _layers(model: torch.nn.Module) -> torch.nn.ModuleList:
    inner = getattr(model, "model", model)
    layers = getattr(inner, "layers", None)
    if not isinstance(layers, torch.nn.ModuleList):
        raise TypeError(f"model: expected a Qwen3MoeModel or Qwen3MoeForCausalLM, got {type(model).__name__}")
    return layers


def _check_rotary(model: torch.nn.Module, core: _CoreLayer) -> None:
    """ValueError when the model's rotary embedding (whose cos and sin the layers are handed)
    is not the RoPE the C layers compute from the config: an inv_freq buffer changed after
    loading, or a rotary class of another kind. 2 ulp of slack: torch's vector pow. A buffer
    that model.to(bfloat16) rounded (transformers then rotates by the rounded frequencies, the
    C layer by the fp32 ones) is taken with a warning saying so."""
    rotary = getattr(getattr(model, "model", model), "rotary_emb", None)
    inv_freq = getattr(rotary, "inv_freq", None)
    if not isinstance(inv_freq, torch.Tensor):
        return
    theirs = inv_freq.detach().float().cpu()
    ours = torch.tensor(core.rope_inv_freq, dtype=torch.float32)
    scaling = float(getattr(rotary, "attention_scaling", 1.0))
    if inv_freq.dtype != torch.float32 and theirs.shape == ours.shape and \
            torch.equal(theirs, ours.to(inv_freq.dtype).float()):
        warnings.warn(f"qwen3layer: model.rotary_emb.inv_freq is in {inv_freq.dtype} (rounded by model.to()): "
                      "transformers rotates by the rounded frequencies, the C layers by the config's fp32 ones; load "
                      "the model in that dtype (from_pretrained(dtype=...)) to keep the buffer in fp32", stacklevel=3)
        return
    if theirs.shape != ours.shape or not torch.allclose(theirs, ours, rtol=2.5e-7, atol=0.0) or \
            abs(scaling - core.rope_attention_scaling) > 1e-7 * abs(scaling):
        worst = int((theirs - ours).abs().argmax()) if theirs.shape == ours.shape else -1
        raise ValueError(f"model.rotary_emb: its inv_freq {list(theirs.shape)} (at {worst}: "
                         f"{theirs.flatten()[worst].item() if worst >= 0 else '-'}) and attention_scaling {scaling} are "
                         f"not the RoPE of the config ({ours[worst].item() if worst >= 0 else list(ours.shape)}, "
                         f"{core.rope_attention_scaling}), which the C layers compute")


def patch_model(model: torch.nn.Module, max_tokens: Optional[int] = None, attention_limit: Optional[int] = None,
                ep_group: Any = None, ep_placement: Optional[List[List[int]]] = None,
                expert_device: Optional[str] = None, gpu_experts: Any = None,
                expert_counts: Any = None) -> torch.nn.Module:
    """Replaces every decoder layer of the model by a qwen3layer one (in place; returns the model).
    max_tokens: a cap on the tokens a sequence (prompt + generated) may reach in a generation with
    a DynamicCache, whose C caches grow as the DynamicCache does (doubling); None: the model's
    context (max_position_embeddings, or the YaRN-scaled context). Past it, CacheFullError
    naming what set the limit.
    attention_limit: the bytes of attention maps one layer call may make when the model asks
    for output_attentions (None: the C layer's default, 2**30); above it the call raises
    ValueError with the maps' shape and size.
    ep_group: a torch.distributed process group (torch.distributed.group.WORLD for all of
    them): each layer's experts are split over its ranks (ExpertParallelLayer, placement
    ep_placement, contiguous by default), each rank running its own prompts through its own
    copy of the model. Every rank must make the same forward calls in number: the model's
    generate then defaults to synced_gpus=True (a rank whose sequences all ended keeps
    stepping until every rank's have; transformers syncs over the world group).
    expert_device="cpu": each layer split over one GPU and the host (docs/hybrid.md), for a
    model whose non-expert weights are on a CUDA device and whose experts are in host memory
    (a device_map can place them so). gpu_experts: expert ids copied to the GPU, or N with
    expert_counts (a RoutingSummary or counts of a calibration call); either may be a mapping
    of layer index -> value (the layers' hot experts differ), else every layer takes the same."""
    layers = _layers(model)
    recordable = getattr(model, "_can_record_outputs", None)
    if ep_group is None and ep_placement is not None:
        raise ValueError("ep_placement: given without ep_group (the process group to split the experts over)")
    split = expert_device is not None or gpu_experts is not None
    if expert_counts is not None and not split:
        raise ValueError("expert_counts: chooses gpu_experts=N of a layer split over the GPU and the host; got it "
                         "without expert_device='cpu' and gpu_experts")
    made = [layer if isinstance(layer, DecoderLayer) else
            DecoderLayer.from_hf(layer, max_tokens, recordable, ep_group, ep_placement, expert_device,
                                 _per_layer(gpu_experts, i, "gpu_experts") if split else None,
                                 _per_layer(expert_counts, i, "expert_counts") if split else None)
            for i, layer in enumerate(layers)]  # every layer made (and its config checked) before the model changes
    if made:
        _check_rotary(model, made[0].core)
    for i, layer in enumerate(made):
        layers[i] = layer
        layer.attention_limit = attention_limit
    if getattr(model, "_q3_guard", None) is None:
        model._q3_guard = model.register_forward_pre_hook(_guard)
    if any(layer.expert_parallel for layer in made) and "generate" not in model.__dict__ and \
            hasattr(model, "generate"):
        model.generate = _synced_generate(model.generate)
    return model


def _synced_generate(generate: Any) -> Any:
    """the model's generate with synced_gpus=True unless the call says otherwise"""
    import functools

    @functools.wraps(generate)
    def synced(*args: Any, **kwargs: Any) -> Any:
        kwargs.setdefault("synced_gpus", True)
        return generate(*args, **kwargs)

    synced._q3_synced = True
    return synced


def unpatch_model(model: torch.nn.Module) -> torch.nn.Module:
    """Puts the original transformers layers back (in place; returns the model)."""
    layers = _layers(model)
    for i, layer in enumerate(layers):
        if isinstance(layer, DecoderLayer):
            for rec in layer.recorders.values():  # 5.x's hooks installed while it was patched
                _rec.carry_hooks(rec, _rec.module_of(layer.original, type(rec).__mro__[1]), replace=True)
            layers[i] = layer.original
    guard = getattr(model, "_q3_guard", None)
    if guard is not None:
        guard.remove()
        del model._q3_guard
    if getattr(model.__dict__.get("generate"), "_q3_synced", False):
        del model.__dict__["generate"]
    return model
