"""DecoderLayer: the Python face of the engine layer (qwen3layer._C.Layer).

No math here: the engine does the work; this module names things, builds layers from
transformers modules or random weights, and hands outputs back as the kind of tensor
that came in (torch in, torch out; numpy in, numpy out), sharing the extension's memory.
"""
from __future__ import annotations

import sys
import warnings
from typing import TYPE_CHECKING, Any, Mapping, Optional, Sequence

from . import _C
from .config import LayerConfig, expert_ids, pass_tokens
from .devices import check_torch_device, device_index, stream_of
from .weights import canonical_weights, expert_id_list, expert_weights, gptq_attention_dense, held_expert_views
from .checkpoint.quantization import GPTQ, gptq_settings

if TYPE_CHECKING:
    from .analysis.profile import Profile

KVCache = _C.KVCache
Tensor = _C.Tensor


def _like(x: Any, y: Any) -> Any:
    """y (an extension Tensor) as the same kind of array as x, zero-copy."""
    kind = type(x).__module__.partition(".")[0]
    if kind in ("torch", "numpy") and kind in sys.modules:
        return sys.modules[kind].from_dlpack(y)
    return y


def check_expert_device(expert_device: Any) -> None:
    """the expert_device of a split layer (asked for by expert_device or gpu_experts): 'cpu', the
    one place the split takes"""
    if expert_device != "cpu":
        raise ValueError(f"expert_device: expected 'cpu' (the experts not in gpu_experts in host memory), got "
                         f"{expert_device!r}")


def _split_placement(config: LayerConfig, index: int, experts: Any, expert_device: Any, gpu_experts: Any,
                     expert_counts: Any) -> tuple:
    """(the GPU's expert ids, the host's) of a layer split over a CUDA device and the host"""
    check_expert_device(expert_device)
    if index < 0:
        raise ValueError("expert_device='cpu': splits a layer on a CUDA device between it and the host; device is "
                         "'cpu' (every expert is on the host already: leave expert_device out)")
    if experts is not None:
        raise ValueError("experts: a layer split over the GPU and the host holds every expert (gpu_experts says "
                         "which on the GPU); got experts= too")
    E = config.num_experts
    if gpu_experts is None:
        gpu_experts = []
    if isinstance(gpu_experts, int) and not isinstance(gpu_experts, bool):
        from .placement.hybrid import choose_gpu_experts
        gpu = choose_gpu_experts(gpu_experts, expert_counts, E)
    else:
        if expert_counts is not None:
            raise ValueError("expert_counts: chooses gpu_experts=N; got a list of gpu_experts too")
        gpu = sorted(expert_ids(gpu_experts, E, "gpu_experts"))
    return gpu, [e for e in range(E) if e not in set(gpu)]


def hf_layer_parts(hf_layer: Any) -> tuple:
    """(LayerConfig, weights) of a transformers Qwen3MoeDecoderLayer: its model's config read
    with the layer's index, and its state_dict's tensors (detached, shared, not copied)"""
    attn = getattr(hf_layer, "self_attn", None)
    cfg = getattr(attn, "config", None)
    if cfg is None or not hasattr(hf_layer, "mlp"):
        raise TypeError(f"hf_layer: expected a transformers Qwen3MoeDecoderLayer, got {type(hf_layer).__name__}")
    config = LayerConfig.from_hf(cfg, layer_idx=getattr(attn, "layer_idx", None))
    if not hasattr(hf_layer.mlp, "experts"):
        raise TypeError(f"hf_layer: expected a transformers Qwen3MoeDecoderLayer with a MoE block, "
                        f"got one whose mlp is a {type(hf_layer.mlp).__name__}")
    state = hf_layer.state_dict()
    packed = sorted({name.rpartition(".")[0] for name in state if name.endswith(".qweight")})
    if packed:  # (before the weight table, whose message would name the modules' tensors one by one)
        kinds = sorted({type(hf_layer.get_submodule(name)).__name__ for name in packed})
        raise ValueError(f"hf_layer: its {', '.join(packed[:4])}{', ...' if len(packed) > 4 else ''} are 4-bit GPTQ "
                         f"modules ({', '.join(kinds)}), as transformers loads a GPTQ checkpoint through optimum and "
                         "GPTQModel; the drop-in takes a layer of dense weights (and transformers 5.24 loads such a "
                         "checkpoint's fused experts as new random weights: its load report lists them MISSING). "
                         "Read the checkpoint with qwen3layer.DecoderLayer.from_checkpoint(path, layer_idx)")
    return config, {name: t.detach() for name, t in state.items()}


def _gptq_settings(weight_format: Optional[str], quantization_config: Optional[Mapping[str, Any]],
                   config: LayerConfig, layer_idx: Optional[int] = None) -> dict:
    """the engine's gptq_int4 settings of a GPTQ quantization_config ({} without one: group 128,
    "gptq" zeros, every projection 4-bit); ValueError for one given with another format"""
    if quantization_config is None:
        return {}
    if weight_format != GPTQ:
        raise ValueError(f"quantization_config: read for weight_format='{GPTQ}' (a GPTQ checkpoint's), got it with "
                         f"weight_format={weight_format!r}")
    return gptq_settings(dict(quantization_config), num_experts=getattr(config, "num_experts", None),
                         layer_idx=layer_idx)


def _check_layer_idx(layer_idx: Any, quantization_config: Optional[Mapping[str, Any]]) -> None:
    """layer_idx: None, or a layer index where a GPTQ quantization_config is given: the index
    only picks which of that config's per-layer rules (dynamic, modules_to_not_convert,
    modules_in_block_to_quantize) apply, so without one it would be taken and do nothing"""
    if layer_idx is None:
        return
    if type(layer_idx) is not int or layer_idx < 0:
        raise ValueError(f"layer_idx: expected None or a non-negative int, got {layer_idx!r}")
    if quantization_config is None:
        raise ValueError(f"layer_idx: expected None without a GPTQ quantization_config, got {layer_idx!r} (it only "
                         "selects which of that config's per-layer rules apply: dynamic, modules_to_not_convert, "
                         "modules_in_block_to_quantize; a dense or FP8 layer, or GPTQ tensors without a config, "
                         "read the same at every index)")


def _gptq_attention(gptq: dict, weights: Mapping[str, Any], layer_idx: Optional[int]) -> dict:
    """gptq with gptq_dense_attention as the weights hold q_proj (dense or 4-bit); ValueError
    where the quantization_config said the other"""
    held = gptq_attention_dense(weights)
    said = gptq.get("gptq_dense_attention")
    if said is not None and said != held:
        raise ValueError(f"quantization_config: its rules leave layer {layer_idx or 0}'s q/k/v/o_proj "
                         f"{'dense' if said else '4-bit'}, but the weights hold self_attn.q_proj."
                         f"{'weight' if held else 'qweight'} (layer_idx: the layer's index the rules are tested with)")
    return dict(gptq, gptq_dense_attention=held)


class DecoderLayer:
    """One Qwen3-MoE decoder layer: RMSNorm, GQA attention with QK-norm and RoPE over a
    KV cache, RMSNorm, top-k routed SwiGLU experts, both with residuals.

    weights: mapping from the per-layer checkpoint names (with or without the
    "model.layers.N." prefix; per-expert or transformers 5.x fused expert names) to tensors
    with __dlpack__. Contiguous weights of the layer's dtype are borrowed without a copy
    (their owners are kept alive); others are converted once, here, with a warning.
    dtype: 'float32', 'bfloat16' or 'float16' (float16: fp32 sums over fp16 weights and an fp16
    cache, on the host and on a CUDA device); default: the dtype of self_attn.q_proj.weight.
    weight_format: how the projection matrices (q/k/v/o_proj, the experts' gate/up/down_proj)
    are stored: 'dense' (of the layer's dtype) or 'fp8_e4m3_block128' (float8_e4m3fn, each
    with a "<name>_scale_inv" of fp32 or bf16 block scales [ceil(out/128), ceil(in/128)], as
    in the fine-grained FP8 checkpoints; borrowed as they are, never quantized here; on CUDA,
    host ones are uploaded once, still FP8); default: FP8 when self_attn.q_proj.weight is float8_e4m3fn;
    or 'gptq_int4' (4-bit GPTQ as GPTQModel writes it, group 128, "gptq" v1 zeros: each
    projection module's "<module>.qweight" int32 [in/8, out], ".scales" float16 [in/128, out],
    ".qzeros" int32 [in/128, out/8] and ".g_idx" int32 [in], borrowed as they are, never
    converted; on CUDA, host ones are uploaded once, still 4-bit; every g_idx in range and every
    scale finite, checked here; the default where the weights hold a "<module>.qweight";
    quantization_config: the checkpoint's GPTQ quantization_config, for another group_size
    (-1 or a multiple of 8), checkpoint_format 'gptq_v2', sym false or desc_act true, each
    field checked: qwen3layer.checkpoint.quantization.gptq_settings). `dtype` is then the
    activations' (and the norms' and router's), by default input_layernorm.weight's. A GPTQ
    layer quantized to its experts alone holds q/k/v/o_proj dense ("<module>.weight" of the
    layer's dtype, as those checkpoints store them): the weights say which; a
    quantization_config whose rules (dynamic "-:" regexes, modules_to_not_convert,
    modules_in_block_to_quantize) say the other raises ValueError. layer_idx: the layer's
    index in its model, the module names those rules are tested on (default: 0); taken only
    with a quantization_config (ValueError without one: a dense or FP8 layer, or GPTQ tensors
    without a config, has no per-layer rules for it to select).
    experts: the expert ids a layer holding a subset holds (default: all): the other experts'
    weights are neither needed nor read, prefill and decode refuse to run (the whole layer needs
    every expert), and attention_half / expert_half run the layer split (qwen3layer.parallel).
    On a CUDA device only the held experts are uploaded (fused host torch or numpy tensors as
    views of their slices; the extension's own fused tensors are refused).
    device: 'cpu', or 'cuda' / 'cuda:N' where the build has the CUDA backend: weights on that
    device are borrowed as above if their address is 16-byte aligned (the kernels' vector
    loads; a view at an odd offset is copied once, with the warning), host weights are
    copied there once; inputs and outputs live on it, and the work is queued on the
    caller's current torch stream.
    copy_weights: True copies every weight once, now, into one block the layer owns, laid out
    in the engine's table order (each tensor 64-byte aligned) and on huge pages where the
    system gives them; nothing is borrowed, so the caller's tensors may go. Memory: the layer's
    weight bytes. For weights on 4 KiB pages, as a checkpoint's mapping is (from_checkpoint's
    mmap=False) or many small tensors are: decode reads them faster from huge pages. A host
    layer's option: ValueError on a CUDA device.
    """

    def __init__(self, config: LayerConfig, weights: Mapping[str, Any], device: str = "cpu",
                 dtype: Optional[str] = None, weight_format: Optional[str] = None,
                 experts: Optional[Sequence[int]] = None, expert_device: Optional[str] = None,
                 gpu_experts: Any = None, expert_counts: Any = None,
                 quantization_config: Optional[Mapping[str, Any]] = None, layer_idx: Optional[int] = None,
                 copy_weights: bool = False) -> None:
        if not isinstance(config, LayerConfig):
            raise TypeError(f"config: expected a qwen3layer.LayerConfig, got {type(config).__name__}")
        if weight_format is None and isinstance(weights, Mapping) and \
                any(isinstance(k, str) and k.endswith(".qweight") for k in weights):
            weight_format = GPTQ  # (no q_proj.weight whose dtype would say so, as an FP8 one's does)
        _check_layer_idx(layer_idx, quantization_config)
        gptq = _gptq_settings(weight_format, quantization_config, config, layer_idx)
        if weight_format == GPTQ and isinstance(weights, Mapping):
            gptq = _gptq_attention(gptq, weights, layer_idx)
        index = device_index(device)
        self.device = "cpu" if index < 0 else f"cuda:{index}"
        self.config = config
        self._hybrid = None
        ids = expert_id_list(experts)
        split = expert_device is not None or gpu_experts is not None
        if split:
            ids, host_ids = _split_placement(config, index, experts, expert_device, gpu_experts, expert_counts)
        group = gptq.get("gptq_group", 0)  # the names of a GPTQ geometry that 128 does not divide need it
        dense_attention = gptq.get("gptq_dense_attention", False)
        mine = canonical_weights(weights, config, ids, gptq_group=group, gptq_dense_attention=dense_attention)
        if index >= 0 and ids is not None:  # a CUDA subset: the held experts' slices of fused host tensors
            mine = held_expert_views(mine, config, ids)
        self._core = _C.Layer(config, mine, dtype, index, weight_format, ids, copy_weights=copy_weights, **gptq)
        self._gptq_dense_attention = dense_attention  # q/k/v/o_proj dense in a gptq_int4 layer (the cost model's)
        if split:
            from .placement.hybrid import HybridRunner
            host_weights = canonical_weights(weights, config, host_ids, gptq_group=group,
                                             gptq_dense_attention=dense_attention)
            host = _C.Layer(config, expert_weights(host_weights, config, gptq_group=group),
                            self._core.dtype, -1,
                            self._core.weight_format, host_ids, experts_only=True, **gptq)
            self._hybrid = HybridRunner(self._core, host, ids, config)
            self.expert_device, self.gpu_experts = "cpu", tuple(ids)
        if self._core.converted and not copy_weights:
            where = "" if index < 0 else f" on {self.device}"
            aligned = "" if index < 0 else ", 16-byte aligned"
            kept = self._core.dtype if self._core.weight_format == "dense" else \
                f"{self._core.dtype} ({self._core.weight_format} matrices kept as they are)"
            warnings.warn(f"DecoderLayer: copied {len(self._core.converted)} weight(s) to contiguous{aligned} "
                          f"{kept}{where} once at construction: {', '.join(self._core.converted[:4])}"
                          + (" ..." if len(self._core.converted) > 4 else ""), stacklevel=2)

    @classmethod
    def from_hf(cls, hf_layer: Any, device: str = "cpu", expert_device: Optional[str] = None,
                gpu_experts: Any = None, expert_counts: Any = None) -> "DecoderLayer":
        """From a transformers Qwen3MoeDecoderLayer (4.57 or 5.x), sharing its weights. Its
        model's config is read by LayerConfig.from_hf with the layer's index: a field the C
        layer does not implement, a dense (Qwen3MoeMLP) layer of mlp_only_layers or
        decoder_sparse_step among them, raises ValueError naming it. expert_device="cpu" (with
        gpu_experts, expert_counts as for the constructor): split over `device` and the host,
        the host's experts borrowed from the layer's (which must be in host memory)."""
        config, weights = hf_layer_parts(hf_layer)
        return cls(config, weights, device=device, expert_device=expert_device, gpu_experts=gpu_experts,
                   expert_counts=expert_counts)

    @classmethod
    def from_checkpoint(cls, path: str, layer_idx: int, device: str = "cpu",
                        dtype: Optional[str] = None, experts: Optional[Sequence[int]] = None,
                        expert_device: Optional[str] = None, gpu_experts: Any = None,
                        expert_counts: Any = None, mmap: bool = True) -> "DecoderLayer":
        """Layer `layer_idx` of a transformers safetensors checkpoint (the folder with
        config.json and the shards), its geometry from config.json. Only this layer's tensors
        are memory-mapped (with experts=, only those experts' besides the attention and the
        router: the others are neither read, checked nor mapped), and only they are read; bf16/fp32 tensors of the
        layer's dtype are used from the mapping without a copy. An FP8 checkpoint
        (quantization_config with quant_method "fp8", e4m3, 128 x 128 blocks) gives an
        fp8_e4m3_block128 layer: its e4m3 matrices and their scales are borrowed the same way,
        nothing is dequantized; `dtype` is then the activations' (default: the norms' dtype).
        A 4-bit GPTQ checkpoint (quant_method "gptq", bits 4; its fields read as
        quantization_config is for the constructor) gives a gptq_int4 layer, its qweight,
        qzeros, scales and g_idx borrowed the same way. The files are checked as untrusted data first: a bad one raises CheckpointError naming
        the file and the tensor (or config.json and the field); no layer is made and the
        mappings are closed. mmap=False: the layer's tensors are read, once, into one block the
        layer owns (copy_weights), and the mappings closed: the layer's weight bytes of memory,
        for decode read from huge pages (the page cache maps files in 4 KiB pages). A host
        layer's option."""
        from .checkpoint import load_layer_weights

        if not mmap and str(device) != "cpu":  # before anything is read or mapped
            raise ValueError(f"mmap: False is a host layer's option (device='cpu': a CUDA layer's weights are copied "
                             f"to its device anyway), got device={device!r}")
        device_index(device)
        ids = expert_id_list(experts)
        cfg, weights, maps, fmt, quant, spans = load_layer_weights(path, layer_idx, ids)
        try:
            layer = cls(cfg, weights, device=device, dtype=dtype, weight_format=fmt, experts=ids,
                        expert_device=expert_device, gpu_experts=gpu_experts, expert_counts=expert_counts,
                        quantization_config=quant,
                        # the index picks a GPTQ config's per-layer rules; dense and FP8 ones have none (quant
                        # None), and the constructor refuses an index that would do nothing
                        layer_idx=layer_idx if quant is not None else None, copy_weights=not mmap)
        except BaseException:
            weights.clear()  # the views, so that the mappings can close now rather than at collection
            for mm in maps:
                try:
                    mm.close()
                except BufferError:  # a view still held (by the traceback): it closes when that goes
                    pass
            raise
        if not mmap:  # the layer holds copies: nothing of the files is read again
            weights.clear()
            for mm in maps:
                mm.close()
            maps, spans = [], []
        layer._mappings = maps  # the borrowed views keep them alive too; this makes it explicit
        layer._mapped_spans = spans  # (file, first byte, end) of the tensors each mapping covers
        return layer

    @classmethod
    def random(cls, config: LayerConfig, seed: int = 0, dtype: str = "bfloat16",
               device: str = "cpu", weight_format: Optional[str] = None,
               experts: Optional[Sequence[int]] = None, expert_device: Optional[str] = None,
               gpu_experts: Any = None, expert_counts: Any = None,
               quantization_config: Optional[Mapping[str, Any]] = None) -> "DecoderLayer":
        """Random weights in extension memory, scaled like a trained layer (matrices
        N(0, 0.02), norm weights N(1, 0.1)); the same seed gives the same weights. They are
        made on the host; a CUDA layer copies them to its device once. weight_format
        'fp8_e4m3_block128': the projection matrices are float8_e4m3fn with fp32 block scales,
        quantized (in C) from the same draws; 'gptq_int4': the same draws quantized by
        round-to-nearest (RTN, not GPTQ's error-compensating algorithm) into the GPTQ layout,
        symmetric, group 128; `dtype` is then the activations'. experts: a
        layer holding only these expert ids (the others never made), each equal to that
        expert of the whole layer of the same seed."""
        device_index(device)
        ids = expert_id_list(experts)
        split = expert_device is not None or gpu_experts is not None  # per-expert tensors, for each side's share
        weights = _C.random_weights(config, seed, dtype, weight_format, list(range(config.num_experts)) if split else ids,
                                    **_gptq_settings(weight_format, quantization_config, config))
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # the copy to the device is the point here
            return cls(config, weights, device=device, dtype=dtype, weight_format=weight_format, experts=ids,
                       expert_device=expert_device, gpu_experts=gpu_experts, expert_counts=expert_counts,
                       quantization_config=quantization_config)

    def random_input(self, shape, seed: int, dtype: Optional[str] = None) -> Tensor:
        """Random N(0, 1) activations of `shape` in extension memory on the layer's device
        (no torch or numpy needed)."""
        t = _C.random_tensor(tuple(shape), seed, dtype or self.dtype)
        return t if self._core.device < 0 else _C.copy_tensor(t, self._core.device)

    def new_cache(self, max_tokens: int, batch: int = 1, dtype: Optional[str] = None) -> KVCache:
        """A KV cache for `batch` sequences of up to `max_tokens` tokens each, allocated
        now (dtype defaults to the layer's); KVCache.grow gives it more room later."""
        return self._core.new_cache(max_tokens, batch, dtype)

    def prefill(self, x: Any, cache: KVCache, seq: Optional[int] = None,
                chunk_size: Optional[int] = None, *, out: Any = None, return_router: bool = False,
                return_attention: bool = False, attention_limit: Optional[int] = None, token_mask: Any = None,
                positions: Any = None, tree: Any = None) -> Any:
        """Appends tokens to the cache and returns the layer's output for them.

        x [S, hidden]: S tokens of sequence `seq` (default 0), at positions
        [cache.lengths[seq], + S). x [B, S, hidden] with B = cache.batch: S tokens to each
        sequence. chunk_size bounds the tokens per sequence in one pass (default
        build_info()['default_chunk']): activation memory grows with it, not with S.
        Raises CacheFullError (cache unchanged) when the tokens do not fit. Ctrl-C stops it at
        the next chunk boundary, with the cache rolled back to where the call began.

        return_router / return_attention: return a LayerTrace (qwen3layer.trace) instead of
        the output alone, with the router's logits, choices and weights taken from the call's
        own passes, and/or the attention probabilities [batch, heads, S, context], computed for
        this call only. The maps may take at most attention_limit bytes (default 2**30); a call
        asking for more raises ValueError with their shape and size before anything runs.

        token_mask (x's shape less hidden: [S] or [B, S]; bool or uint8, host memory): False
        hides a token from every query after it, in this call and later ones (right padding, a
        hole: the new tokens' part of transformers' 2D attention_mask); the cache keeps the
        flag through its operations. A hidden token's own query sees the visible keys before
        it (only itself when there are none). positions (same shape, int64, host memory): each
        token's RoPE position (default: the cache's rule, first position + row - padding).
        tree ([S, S] or [B, S, S] bool, host memory): a per-query mask among the call's tokens
        (tree attention): token t sees the cached tokens and the call's tokens u with
        tree[t, u], u <= t and u = t always (not with token_mask); verify() makes one.
        """
        if self._hybrid is not None:
            return self._split_call(x, cache, False, out, seq=seq, chunk_size=chunk_size, return_router=return_router,
                                    return_attention=return_attention, attention_limit=attention_limit,
                                    token_mask=token_mask, positions=positions, tree=tree)
        check_torch_device("out", out, self._core.device)
        y = self._core.prefill(x, cache, seq, chunk_size, out=out, stream=stream_of(x, self._core.device),
                               return_router=return_router, return_attention=return_attention,
                               attention_limit=attention_limit, token_mask=token_mask, positions=positions,
                               tree=tree)
        return self._result(x, y, out)

    def decode(self, x: Any, cache: KVCache, *, out: Any = None, return_router: bool = False,
               return_attention: bool = False, attention_limit: Optional[int] = None, token_mask: Any = None,
               positions: Any = None) -> Any:
        """One new token for each sequence of the cache: x [cache.batch, hidden]. The insides
        as for prefill (router rows [batch, ...], attention [batch, heads, 1, context]);
        token_mask and positions [batch] as prefill's."""
        if self._hybrid is not None:
            return self._split_call(x, cache, True, out, return_router=return_router,
                                    return_attention=return_attention, attention_limit=attention_limit,
                                    token_mask=token_mask, positions=positions)
        check_torch_device("out", out, self._core.device)
        y = self._core.decode(x, cache, out=out, stream=stream_of(x, self._core.device),
                              return_router=return_router, return_attention=return_attention,
                              attention_limit=attention_limit, token_mask=token_mask, positions=positions)
        return self._result(x, y, out)

    def verify(self, x: Any, cache: KVCache, parents: Any, seq: Optional[int] = None, *, out: Any = None,
               return_router: bool = False, return_attention: bool = False,
               attention_limit: Optional[int] = None) -> Any:
        """A speculative decoder's verify step: x [T, hidden] (sequence `seq`, default 0) or
        [B, T, hidden] (every sequence), a draft tree of T tokens given by parents [T] or
        [B, T] (an int64 tensor: -1 for a token that follows the cached ones, else the index of
        its parent among the T). Each token sees the cache and its ancestors, itself included,
        at the sequence's next position plus its depth. Returns the layer's output for the T
        tokens as prefill does; their K/V are appended to the cache, and cache.accept(seq,
        kept) then keeps the accepted path's. The insides as prefill's."""
        tokens, given = getattr(x, "shape", (0, 0))[-2], getattr(parents, "shape", (None,))[-1]
        if given != tokens:
            raise ValueError(f"parents: expected one entry a token of x ({tokens} a sequence), got shape "
                             f"{list(getattr(parents, 'shape', []))}")
        tree, positions = cache._tree_inputs(parents, seq)
        return self.prefill(x, cache, seq, out=out, return_router=return_router, return_attention=return_attention,
                            attention_limit=attention_limit, tree=tree, positions=positions)

    def attention_half(self, x: Any, cache: KVCache, seq: Optional[int] = None,
                       chunk_size: Optional[int] = None, *, decode: bool = False, return_router: bool = False,
                       return_attention: bool = False, attention_limit: Optional[int] = None, token_mask: Any = None,
                       positions: Any = None, tree: Any = None) -> tuple:
        """The layer up to its experts, for x as prefill takes it (decode=True: as decode):
        the tokens' K/V appended to the cache as prefill/decode append them. Returns (resid,
        normed, experts, weights): x + attention (fp32) and post_attention_layernorm of it
        (x's dtype), both of x's shape, and the router's top-k expert ids (int32, by
        descending weight) and weights (fp32), [..., top_k]. With expert_half on those rows,
        and resid + its output, it is the layer: prefill is the two halves run pass by pass.
        A layer holding a subset of the experts runs it like any other. CPU and CUDA layers
        (on a CUDA layer: x on its device, the outputs made there, the forward's own passes).
        return_router / return_attention: a fifth element, a LayerTrace (output None) of the
        insides prefill would give for the call. token_mask, positions, tree: as prefill's (no
        tree with decode=True)."""
        r = self._core.attention_half(x, cache, seq, chunk_size, decode=decode, return_router=return_router,
                                      return_attention=return_attention, attention_limit=attention_limit,
                                      stream=stream_of(x, self._core.device), token_mask=token_mask,
                                      positions=positions, tree=tree)
        if len(r) == 4:
            return tuple(_like(x, t) for t in r)
        from .trace import LayerTrace

        halves, *insides = r
        return (*(_like(x, t) for t in halves), LayerTrace(None, *(None if t is None else _like(x, t) for t in insides)))

    def expert_half(self, rows: Any, experts: Any, weights: Any, *, out: Any = None,
                    accumulate: bool = False) -> Any:
        """The layer's experts on rows [n, hidden] (fp32 or bf16, post-attention-normed),
        routed by experts [n, top_k] (int32: -1 for an expert held elsewhere, every other id
        one this layer holds) with weights [n, top_k] (fp32): out [n, hidden] = (or += with
        accumulate) sum_j weights[i, j] expert_{experts[i, j]}(rows[i]), the experts' outputs
        summed in expert order as the whole layer sums them. out: fp32 or bf16 (default: a new
        tensor of rows' dtype). Each expert's weights are read once per call. CPU and CUDA
        layers (on a CUDA layer every tensor on its device; a skipped entry is never computed)."""
        for name, t in (("experts", experts), ("weights", weights), ("out", out)):
            check_torch_device(name, t, self._core.device)
        y = self._core.expert_half(rows, experts, weights, out=out, accumulate=accumulate,
                                   stream=stream_of(rows, self._core.device, "rows"))
        return y if out is not None else _like(rows, y)

    @property
    def held_experts(self) -> tuple:
        """The ids of the experts this layer holds (all of them unless made with experts=)."""
        return self._core.held_experts

    def _split_call(self, x: Any, cache: KVCache, decode: bool, out: Any, seq: Optional[int] = None,
                    chunk_size: Optional[int] = None, **insides: Any) -> Any:
        """prefill or decode of a layer split over the GPU and the host
        (qwen3layer.placement.hybrid)"""
        check_torch_device("x", x, self._core.device)
        check_torch_device("out", out, self._core.device)
        if out is not None and not (type(out).__module__.startswith("torch") and type(x).__module__.startswith("torch")):
            raise NotImplementedError(f"out: a layer split over the GPU and the host writes into torch tensors only "
                                      f"(copied in), got x of {type(x).__name__} and out of {type(out).__name__}")
        if out is not None and (tuple(out.shape) != tuple(x.shape) or out.dtype != x.dtype or out.device != x.device):
            raise ValueError(f"out: expected x's shape {list(x.shape)}, dtype {x.dtype} and device {x.device}, got "
                             f"{list(out.shape)} {out.dtype} on {out.device}")
        y, trace = self._hybrid.call(x, cache, decode, seq, chunk_size, out=out, **insides)
        if out is not None and y is not out:  # a strided out: written whole from the call's own output
            out.copy_(_like(x, y))
        y = out if out is not None else _like(x, y)
        if trace is None:
            return y
        from .trace import LayerTrace

        return LayerTrace(y, *(None if t is None else _like(x, t) for t in trace))

    @property
    def hybrid_stats(self) -> Optional[dict]:
        """A layer split over the GPU and the host: the calls, the passes they ran in (a prefill
        of more than chunk_size tokens runs pass by pass) and largest_pass_rows (the most token
        rows one pass held), the rows and (row, slot) choices each side's experts ran (a row with
        experts on both sides counts on both), and the bytes copied each way (link_down_bytes:
        GPU to host; link_up_bytes: back); None for other layers."""
        return None if self._hybrid is None else dict(self._hybrid.stats)

    @staticmethod
    def _result(x: Any, y: Any, out: Any) -> Any:
        """The output as x's kind (or out itself); a LayerTrace when the call returned insides."""
        if not isinstance(y, tuple):
            return y if out is not None else _like(x, y)
        from .trace import LayerTrace

        output, *insides = y
        return LayerTrace(output if out is not None else _like(x, output),
                          *(None if t is None else _like(x, t) for t in insides))

    def decode_graph(self, cache: KVCache, batch: Optional[int] = None,
                     dtype: Optional[str] = None) -> "DecodeGraph":
        """Captures one decode step of sequences 0 .. batch - 1 (default: all, at most 64) of
        `cache` in a CUDA graph, for a CUDA layer. Each call of the graph then decodes one
        token per sequence with a single launch and no host synchronisation: positions,
        expert groups and cache lengths are tracked on the device. The graph owns its input
        and output buffers ([batch, hidden] of `dtype`, default the layer's) and keeps the
        layer and the cache alive; calls of the layer on the same cache may be mixed with it.
        """
        if self._hybrid is not None:
            raise ValueError("decode_graph: a layer split over the GPU and the host (expert_device='cpu') cannot be "
                             "captured: its host experts run on the CPU between the device's kernels; call decode")
        return DecodeGraph(self._core.decode_graph(cache, batch, dtype), self._core.device)

    def profile(self, mode: str = "decode", tokens: int = 1, context: int = 0, chunk_size: Optional[int] = None,
                repeat: int = 3, batch: int = 1, hidden_keys: float = 0.0) -> "Profile":
        """Times every stage of `tokens` new tokens per sequence (prefill in passes of
        chunk_size, by default build_info()['default_chunk'] as prefill's, or `tokens` decode
        steps) for `batch` sequences holding `context` tokens of random input, against the
        cost model: median of `repeat` profiled calls per stage (a
        monotonic clock on the CPU, CUDA events on a GPU), and the median of as many unprofiled
        calls for comparison.

        A layer split over the GPU and the host: its calls (qwen3layer.placement.hybrid), with
        the experts stage in three: gpu_experts (CUDA events), host_experts (the CPU's clock)
        and link (the copies, takes and combine: the profiled call's time less the two sides'
        stages). The profiled calls run the two sides' experts one after the other (each side's
        timing waits for its own work); the unprofiled ones overlap them.

        hidden_keys: the fraction of the context's tokens its prefill hides from every later
        query (a token_mask with that many holes, spread evenly): masked attention's cost. The
        kernels still read and score a hidden key (they drop it from the softmax), so the
        model counts every key; the title says how many were hidden."""
        import statistics
        import time

        from .analysis.costs import cost_model
        from .analysis.profile import Profile, join

        if isinstance(hidden_keys, bool) or not isinstance(hidden_keys, (int, float)) or not 0 <= hidden_keys < 1:
            raise ValueError(f"hidden_keys: expected a fraction of the context in [0, 1), got {hidden_keys!r}")
        scale_dtype = self._core.scale_dtype or "float32"
        if mode == "prefill" and chunk_size is None:  # the passes the calls below make, modelled alike
            chunk_size = pass_tokens(None)
        if self._hybrid is None:
            cost = cost_model(self.config, mode, tokens, context, chunk_size, self.dtype, batch, self.weight_format,
                              scale_dtype, self._gptq_dense_attention)
        else:
            from .analysis.costs_hybrid import split_cost_model

            cost = split_cost_model(self.config, mode, tokens, context, chunk_size, self.dtype, batch,
                                    self.weight_format, scale_dtype, self.gpu_experts, self._gptq_dense_attention)
        H = self.config.hidden_size
        rand = self.random_input if self._hybrid is None else \
            (lambda shape, seed: self._hybrid.device_input(self.random_input(shape, seed)))

        run = self if self._hybrid is not None else self._core  # a split layer's calls are Python's
        cache = self.new_cache(context + tokens, batch)
        hidden = [int((t + 1) * hidden_keys) > int(t * hidden_keys) for t in range(context)]  # evenly spread
        for t0 in range(0, context, 512):  # the context, through the layer itself (not timed)
            n = min(512, context - t0)
            mask = {}
            if any(hidden[t0:t0 + n]):  # uint8 0 where hidden (numpy: matplotlib's dependency)
                import numpy as np
                mask = {"token_mask": np.tile(np.array([not h for h in hidden[t0:t0 + n]], np.uint8),
                                              (batch, 1) if batch > 1 else 1)}
            run.prefill(rand((batch, n, H) if batch > 1 else (n, H), 7 + t0), cache, None, 512, **mask)
        if mode == "prefill":
            xs = [rand((batch, tokens, H) if batch > 1 else (tokens, H), 11)]
        else:
            xs = [rand((batch, H), 13 + i) for i in range(tokens)]

        def call():
            for x in xs:
                if mode == "prefill":
                    run.prefill(x, cache, None, chunk_size)
                else:
                    run.decode(x, cache)
            if self._hybrid is not None:  # its torch calls return before the device is done
                self._hybrid.synchronize()
            for b in range(batch):
                cache.truncate(context, b)

        call()  # warm-up: workspace sized, caches warm
        unprofiled, per_stage = [], []
        for _ in range(max(1, repeat)):
            t = time.perf_counter()
            call()
            unprofiled.append(time.perf_counter() - t)
            per_stage.append(self._profiled(call))
        median = {name: statistics.median(p[name] for p in per_stage) for name in per_stage[0]}
        return Profile(mode, cost, join(cost, median), statistics.median(unprofiled), self.workspace_bytes,
                       cache.nbytes, len(cache.hidden[0]))  # what the C cache holds hidden

    def _profiled(self, call: Any) -> dict:
        """stage -> seconds of call() with profiling on (a split layer:
        qwen3layer.placement.hybrid's)"""
        if self._hybrid is not None:
            return self._hybrid.profiled(call)
        self._core.set_profiling(True)
        try:
            call()
            return self._core.profile_seconds()
        finally:
            self._core.set_profiling(False)

    @property
    def dtype(self) -> str:
        return self._core.dtype

    @property
    def rope_inv_freq(self) -> tuple:
        """The RoPE table the layer rotates by: inv_freq [head_dim / 2] as fp32 values (the
        engine's, computed once from the config as transformers computes its
        rotary_emb.inv_freq: the angle of dim pair i at position p is p * inv_freq[i])."""
        return _C.rope_table(self.config)[0]

    @property
    def rope_attention_scaling(self) -> float:
        """The fp32 factor of cos and sin (transformers' rotary_emb.attention_scaling): 1 but
        for YaRN."""
        return _C.rope_table(self.config)[1]

    @property
    def weight_ptrs(self) -> dict:
        """Weight name -> the address the engine reads (equal to the caller's tensor's
        data pointer when the weight was borrowed without a copy)."""
        return self._core.weight_ptrs

    @property
    def converted(self) -> tuple:
        """Names of the weights that had to be converted at construction."""
        return self._core.converted

    @property
    def workspace_bytes(self) -> int:
        """Activation workspace held now (grows with the largest chunk run so far)."""
        return self._core.workspace_bytes

    @property
    def weight_format(self) -> str:
        """'dense', 'fp8_e4m3_block128' or 'gptq_int4' (see the class docstring)."""
        return self._core.weight_format

    @property
    def weight_bytes(self) -> int:
        """Bytes of all the layer's weights as the engine reads them (FP8: the e4m3 bytes and
        the scales)."""
        return self._core.weight_bytes

    def __repr__(self) -> str:
        c = self.config
        size = self.weight_bytes
        size_text = f"{size / 1e9:.2f} GB" if size >= 1e9 else f"{size / 1e6:.1f} MB"
        return (f"DecoderLayer(hidden={c.hidden_size}, heads={c.num_attention_heads}/"
                f"{c.num_key_value_heads}x{c.head_dim}, experts={c.num_experts} top-{c.num_experts_per_tok}"
                f" x {c.moe_intermediate_size}, dtype={self.dtype}"
                + (f", weights {self.weight_format}" if self.weight_format != "dense" else "")
                + f", device={self.device}, weights {size_text})")


class DecodeGraph:
    """One decode step captured in a CUDA graph (DecoderLayer.decode_graph).

    graph(x) copies x ([batch, hidden] on the layer's device, the graph's dtype) into the
    graph's input on the caller's current torch stream, replays the step there and returns
    the output as the same kind of tensor as x. The output is the graph's own buffer,
    overwritten by the next step: clone it to keep it. graph() replays on whatever the input
    holds (write it in place through graph.input to avoid the copy). Raises CacheFullError,
    with nothing queued, when a sequence is full.
    """

    def __init__(self, core: Any, device_index: int) -> None:
        self._core = core
        self._device = device_index

    def __call__(self, x: Any = None, *, stream: Optional[int] = None) -> Any:
        if stream is None and x is not None:
            stream = stream_of(x, self._device)
        y = self._core.replay(x, stream=stream)
        return y if x is None else _like(x, y)

    @property
    def input(self) -> Tensor:
        """[batch, hidden] device tensor each step reads."""
        return self._core.input

    @property
    def output(self) -> Tensor:
        """[batch, hidden] device tensor each step writes."""
        return self._core.output

    @property
    def batch(self) -> int:
        return self._core.batch

    @property
    def dtype(self) -> str:
        return self._core.dtype

    @property
    def cache(self) -> KVCache:
        return self._core.cache

    def __repr__(self) -> str:
        return f"DecodeGraph(batch={self.batch}, dtype={self.dtype}, device={self.input.device})"
