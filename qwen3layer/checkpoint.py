"""Loading one decoder layer from a transformers safetensors checkpoint (a folder with
config.json and model.safetensors, or model.safetensors.index.json and its shards) without
reading the rest: each shard that holds one of the layer's tensors is memory-mapped, its
header (8 bytes of length, then JSON) parsed, and the layer borrows its tensors straight
from the mapping, zero-copy. Only the layer's own pages are ever read; the mapping stays
open while the layer lives."""
from __future__ import annotations

import json
import mmap
import os
import struct
from typing import Dict, Tuple

from . import _C
from .config import LayerConfig
from .weights import DENSE, expert_names

DTYPES = {"BF16": "bfloat16", "F32": "float32"}


class CheckpointError(ValueError):
    """A checkpoint that cannot give the layer: what is wrong and where."""


def _read_config(path: str) -> dict:
    cfg_path = os.path.join(path, "config.json")
    if not os.path.exists(cfg_path):
        raise CheckpointError(f"checkpoint {path!r}: missing config.json")
    with open(cfg_path) as f:
        return json.load(f)


def _weight_map(path: str) -> Dict[str, str]:
    """tensor name -> shard file name"""
    index = os.path.join(path, "model.safetensors.index.json")
    if os.path.exists(index):
        with open(index) as f:
            return json.load(f)["weight_map"]
    single = os.path.join(path, "model.safetensors")
    if not os.path.exists(single):
        raise CheckpointError(f"checkpoint {path!r}: expected model.safetensors.index.json or model.safetensors")
    return {name: "model.safetensors" for name in _header(single)[0]}


def _header(shard: str) -> Tuple[dict, int]:
    """(tensor entries, byte offset of the data) of a safetensors file"""
    with open(shard, "rb") as f:
        raw = f.read(8)
        if len(raw) < 8:
            raise CheckpointError(f"{shard}: truncated (no header)")
        (n,) = struct.unpack("<Q", raw)
        text = f.read(n)
    if len(text) < n:
        raise CheckpointError(f"{shard}: truncated header ({len(text)} of {n} bytes)")
    header = json.loads(text)
    header.pop("__metadata__", None)
    return header, 8 + n


def load_layer_weights(path: str, layer_idx: int) -> Tuple[LayerConfig, Dict[str, object], list]:
    """(config, {per-layer name: zero-copy tensor}, open mappings) for layer `layer_idx`."""
    raw = _read_config(path)
    cfg = LayerConfig.from_hf(raw)
    layers = raw.get("num_hidden_layers")
    if not isinstance(layer_idx, int) or layer_idx < 0 or (layers is not None and layer_idx >= layers):
        raise IndexError(f"layer_idx: expected 0 <= layer_idx < {layers} (num_hidden_layers), got {layer_idx!r}")
    prefix = f"model.layers.{layer_idx}."
    wanted = list(DENSE) + expert_names(cfg.num_experts)
    where = _weight_map(path)
    missing = [prefix + n for n in wanted if prefix + n not in where]
    if missing:
        raise CheckpointError(f"checkpoint {path!r}: missing {', '.join(missing[:3])}"
                              + (f" and {len(missing) - 3} more" if len(missing) > 3 else ""))
    weights, maps, opened = {}, [], {}
    for name in wanted:
        shard = os.path.join(path, where[prefix + name])
        if shard not in opened:
            header, start = _header(shard)
            with open(shard, "rb") as f:
                mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
            opened[shard] = (header, start, mm)
            maps.append(mm)
        header, start, mm = opened[shard]
        entry = header.get(prefix + name)
        if entry is None:
            raise CheckpointError(f"{shard}: the index names it for {prefix + name}, its header does not")
        if entry["dtype"] not in DTYPES:
            raise TypeError(f"{prefix + name} in {shard}: expected dtype BF16 or F32, got {entry['dtype']}")
        begin, end = entry["data_offsets"]
        if start + end > len(mm):
            raise CheckpointError(f"{shard}: truncated: {prefix + name} ends at byte {start + end} "
                                  f"of a {len(mm)}-byte file")
        weights[name] = _C.buffer_view(mm, start + begin, entry["shape"], DTYPES[entry["dtype"]])
    return cfg, weights, maps
