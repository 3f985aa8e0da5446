"""Writing a checkpoint of random layers, as transformers lays one out: config.json (a
Qwen3MoeConfig of the geometry, with the format's quantization_config) and sharded
safetensors (model-0000i-of-0000n.safetensors and model.safetensors.index.json), so that tests,
benchmarks and users without the real 235 B checkpoint make their own and read it back with
DecoderLayer.from_checkpoint, or with transformers where it reads the format.

Layer i holds the weights of DecoderLayer.random(config, seed + i, dtype, weight_format=...,
quantization_config=...): dense, FP8 (fp8_e4m3_block128) or 4-bit GPTQ (gptq_int4: the dense
draws rounded to nearest, RTN, into GPTQ's layout; not GPTQ's error-compensating algorithm),
each expert's matrices under their own names as the published checkpoints store them. The
model's embed_tokens, final norm and lm_head (vocab_size rows) are random too, so that
transformers can build the whole model from the folder.

The tensors' bytes are written from the extension's memory without a copy; one layer is in
memory at a time. The folder appears whole or not at all: everything is written into a
sibling folder first and renamed at the end, and that folder is removed on an error.
"""
from __future__ import annotations

import ctypes
import json
import os
import shutil
from typing import Any, Callable, Dict, List, Mapping, Optional, Tuple

from .. import _C
from ..config import LayerConfig
from ..hf_config import hf_rope_kwargs
from .quantization import DENSE, FP8, GPTQ, gptq_settings

__all__ = ["write_random_checkpoint", "hf_config_dict"]

SAFETENSORS_DTYPE = {"bfloat16": "BF16", "float32": "F32", "float8_e4m3fn": "F8_E4M3", "int32": "I32",
                     "float16": "F16"}
ITEMSIZE = {"bfloat16": 2, "float32": 4, "float8_e4m3fn": 1, "int32": 4, "float16": 2}
FP8_CONFIG = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [128, 128]}
GPTQ_CONFIG = {"quant_method": "gptq", "bits": 4, "group_size": 128, "sym": True, "desc_act": False,
               "checkpoint_format": "gptq", "pack_dtype": "int32"}
DEFAULT_SHARD_BYTES = 5_000_000_000  # transformers' save_pretrained default (max_shard_size "5GB")


def hf_config_dict(config: LayerConfig, num_layers: int, vocab_size: int, dtype: str,
                   quantization_config: Optional[Mapping[str, Any]] = None) -> dict:
    """config.json of a Qwen3-MoE model of `num_layers` layers of this geometry: the fields
    LayerConfig.from_hf reads give back `config`; the rest (the dense MLP's
    intermediate_size, which no layer here uses) as Qwen3-235B-A22B's config.json has them."""
    out = dict(architectures=["Qwen3MoeForCausalLM"], model_type="qwen3_moe", hidden_act="silu",
               hidden_size=config.hidden_size, num_attention_heads=config.num_attention_heads,
               num_key_value_heads=config.num_key_value_heads, head_dim=config.head_dim,
               num_experts=config.num_experts, num_experts_per_tok=config.num_experts_per_tok,
               moe_intermediate_size=config.moe_intermediate_size, intermediate_size=8 * config.moe_intermediate_size,
               norm_topk_prob=config.norm_topk_prob, rms_norm_eps=config.rms_norm_eps,
               max_position_embeddings=config.max_position_embeddings, num_hidden_layers=num_layers,
               vocab_size=vocab_size, attention_bias=False, attention_dropout=0.0, decoder_sparse_step=1,
               mlp_only_layers=[], use_sliding_window=False, sliding_window=None, tie_word_embeddings=False,
               output_router_logits=False, router_aux_loss_coef=0.001, initializer_range=0.02, use_cache=True,
               torch_dtype=dtype, **hf_rope_kwargs(config))
    if quantization_config is not None:
        out["quantization_config"] = dict(quantization_config)
    return out


def _as_bytes(t: Any) -> Any:
    """the bytes of a contiguous host tensor of the extension, as a buffer over its memory (no
    copy; the caller keeps `t` alive while the buffer is used)"""
    shape, strides = list(t.shape), list(t.strides)
    expected = 1
    for d in range(len(shape) - 1, -1, -1):
        if shape[d] != 1 and strides[d] != expected:
            raise ValueError(f"a tensor to write is not contiguous: shape {shape}, strides {strides}")
        expected *= shape[d]
    return (ctypes.c_char * t.nbytes).from_address(t.data_ptr) if t.nbytes else b""


def _header(tensors: List[Tuple[str, Any]]) -> bytes:
    """the safetensors header of `tensors` in that order: 8 bytes of length, then the JSON,
    padded with spaces to a multiple of 8 bytes (so that every tensor's data stays aligned)"""
    header: Dict[str, Any] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for name, t in tensors:
        header[name] = {"dtype": SAFETENSORS_DTYPE[t.dtype], "shape": list(t.shape),
                        "data_offsets": [offset, offset + t.nbytes]}
        offset += t.nbytes
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    return len(text).to_bytes(8, "little") + text


class _Shards:
    """tensors gathered into shards of at most `limit` bytes (a larger tensor alone in one),
    each written as soon as it is full; names are fixed once the count is known"""

    def __init__(self, folder: str, limit: int) -> None:
        self.folder, self.limit = folder, limit
        self.pending: List[Tuple[str, Any]] = []
        self.files: List[List[str]] = []  # the tensor names of each shard written
        self.total = 0

    def add(self, name: str, t: Any) -> None:
        if self.pending and sum(p.nbytes for _, p in self.pending) + t.nbytes > self.limit:
            self.flush()
        self.pending.append((name, t))

    def flush(self) -> None:
        if not self.pending:
            return
        with open(os.path.join(self.folder, f"shard-{len(self.files)}.tmp"), "wb") as f:
            f.write(_header(self.pending))
            for _, t in self.pending:
                f.write(_as_bytes(t))
        self.total += sum(t.nbytes for _, t in self.pending)
        self.files.append([name for name, _ in self.pending])
        self.pending = []

    def finish(self) -> None:
        """the shards renamed model-0000i-of-0000n.safetensors and the index written"""
        self.flush()
        n, weight_map = len(self.files), {}
        for i, names in enumerate(self.files):
            final = f"model-{i + 1:05d}-of-{n:05d}.safetensors"
            os.rename(os.path.join(self.folder, f"shard-{i}.tmp"), os.path.join(self.folder, final))
            weight_map.update((name, final) for name in names)
        index = {"metadata": {"total_size": self.total}, "weight_map": dict(sorted(weight_map.items()))}
        with open(os.path.join(self.folder, "model.safetensors.index.json"), "w") as f:
            json.dump(index, f, indent=2)


def _quantization(weight_format: Optional[str], quantization_config: Optional[Mapping[str, Any]],
                  config: LayerConfig) -> Tuple[Optional[dict], dict]:
    """(config.json's quantization_config, random_weights' settings) of a weight format"""
    if weight_format in (None, DENSE):
        if quantization_config is not None:
            raise ValueError(f"quantization_config: given for weight_format={weight_format!r}, which has none")
        return None, {}
    if weight_format == FP8:
        if quantization_config is not None:
            raise ValueError(f"quantization_config: the FP8 format's is fixed ({FP8_CONFIG}), got one given")
        return dict(FP8_CONFIG), {}
    if weight_format == GPTQ:
        qc = dict(GPTQ_CONFIG, **(quantization_config or {}))
        settings = gptq_settings(qc, num_experts=config.num_experts)
        for key, wrote in (("sym", True), ("desc_act", False)):  # what RTN writes: config.json must not say otherwise
            if qc[key] is not wrote:
                raise ValueError(f"quantization_config.{key}: expected {str(wrote).lower()} (the writer rounds to "
                                 f"nearest with zero 8 and g_idx in order), got {qc[key]!r}")
        return qc, settings
    raise ValueError(f"weight_format: expected None, 'dense', '{FP8}' or '{GPTQ}', got {weight_format!r}")


def _layer_settings(qc: Optional[dict], config: LayerConfig, layer_idx: int, settings: dict) -> dict:
    """random_weights' settings of layer layer_idx: a GPTQ config's rules may leave one layer's
    attention dense and not another's"""
    if qc is None or qc.get("quant_method") != "gptq":
        return settings
    return gptq_settings(qc, num_experts=config.num_experts, layer_idx=layer_idx)


def write_random_checkpoint(path: str, config: LayerConfig, num_layers: int = 1, seed: int = 0,
                            dtype: str = "bfloat16", weight_format: Optional[str] = None,
                            quantization_config: Optional[Mapping[str, Any]] = None, vocab_size: int = 256,
                            shard_bytes: int = DEFAULT_SHARD_BYTES,
                            progress: Optional[Callable[[int, int], None]] = None) -> str:
    """Writes a new checkpoint folder `path` of `num_layers` random layers (layer i: the weights
    of DecoderLayer.random(config, seed + i, dtype, weight_format=..., quantization_config=...))
    and returns it. weight_format: None/'dense', 'fp8_e4m3_block128' or 'gptq_int4' (its
    quantization_config: GPTQ_CONFIG's fields, each overridable, e.g. {"group_size": 64,
    "checkpoint_format": "gptq_v2"}, or {"dynamic": {"-:.*self_attn.*": {}}} for 4-bit experts
    with the attention dense). Shards hold at most shard_bytes each (a larger tensor
    alone) and never two layers' tensors. progress(layers written, num_layers) after each layer. `path` must not exist:
    nothing is overwritten."""
    if not isinstance(config, LayerConfig):
        raise TypeError(f"config: expected a qwen3layer.LayerConfig, got {type(config).__name__}")
    for name, value, low in (("num_layers", num_layers, 1), ("vocab_size", vocab_size, 1),
                             ("shard_bytes", shard_bytes, 1), ("seed", seed, 0)):
        if type(value) is not int or value < low:
            raise ValueError(f"{name}: expected an int >= {low}, got {value!r}")
    if dtype not in ("bfloat16", "float32", "float16"):
        raise ValueError(f"dtype: expected 'bfloat16', 'float32' or 'float16', got {dtype!r}")
    qc, settings = _quantization(weight_format, quantization_config, config)
    fmt = weight_format or DENSE
    for i in range(num_layers if fmt == GPTQ else 0):  # each layer's own verdict of the rules (dense attention)
        own = _layer_settings(qc, config, i, settings)  # a geometry the format refuses: here, before any file
        _C.weight_table(config, fmt, None, gptq_group=own["gptq_group"], gptq_dense_attention=own["gptq_dense_attention"])
    if fmt != GPTQ:
        _C.weight_table(config, fmt, None)
    path = os.fspath(path)
    if os.path.lexists(path):
        raise FileExistsError(f"path: {path!r} exists; expected a new folder (nothing is overwritten)")
    work = os.path.join(os.path.dirname(os.path.abspath(path)), f".{os.path.basename(path)}.partial-{os.getpid()}")
    os.makedirs(work)
    try:
        with open(os.path.join(work, "config.json"), "w") as f:
            json.dump(hf_config_dict(config, num_layers, vocab_size, dtype, qc), f, indent=2)
        shards = _Shards(work, shard_bytes)
        H = config.hidden_size
        head = [("model.embed_tokens.weight", (vocab_size, H)), ("model.norm.weight", (H,)),
                ("lm_head.weight", (vocab_size, H))]
        for k, (name, shape) in enumerate(head):  # seeds of their own, apart from the layers'
            shards.add(name, _C.random_tensor(shape, seed * 1000003 + 999983 + k, dtype))
        everyone = list(range(config.num_experts))  # per-expert tensors, as checkpoints store them
        for i in range(num_layers):
            weights = _C.random_weights(config, seed + i, dtype, fmt, everyone, **_layer_settings(qc, config, i, settings))
            for name, t in weights.items():
                shards.add(f"model.layers.{i}.{name}", t)
            shards.flush()  # this layer's bytes written before the next is drawn
            if progress:
                progress(i + 1, num_layers)
        shards.finish()
        os.rename(work, path)
    except BaseException:
        shutil.rmtree(work, ignore_errors=True)
        raise
    return path

