"""Loading one decoder layer from a transformers safetensors checkpoint (a folder with
config.json and model.safetensors, or model.safetensors.index.json and its shards) without
reading the rest: each shard that holds one of the layer's tensors is memory-mapped, its
header (8 bytes of length, then JSON) parsed, and the layer borrows its tensors straight
from the mapping, zero-copy. Only the layer's own pages are ever read; the mapping stays
open while the layer lives.

The files are untrusted data: config.json and the index must be JSON objects of the expected
form, a shard must be a regular file inside the folder, and every entry of the layer is
checked (qwen3layer.safetensors) before a byte is borrowed. Anything else is a
CheckpointError naming the file and, where there is one, the tensor; the mappings opened so
far are closed before it is raised.

FP8 checkpoints (config.json's quantization_config, read by qwen3layer.quantization): each
projection matrix is F8_E4M3 and has a "<matrix>_scale_inv" of F32 or BF16 beside it, of shape
[ceil(out/128), ceil(in/128)]; both are borrowed from the mapping like any other tensor, nothing
is dequantized at load."""
from __future__ import annotations

import os
from typing import Dict, List, Optional, Tuple

from .. import _C
from ..config import LayerConfig
from .quantization import weight_format
from .safetensors import (DTYPES, FLOAT, FP8, HALF, SCALES, WORDS, CheckpointError, Entry, Shard, UnsupportedDtypeError,
                          check_entry, check_no_overlap, map_spans, open_shard, read_json, show)
from ..weights import valid_expert_ids

__all__ = ["CheckpointError", "UnsupportedDtypeError", "load_layer_weights"]

INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"


def _read_config(path: str) -> Tuple[str, dict, LayerConfig]:
    """(config.json's path, its fields, the LayerConfig: built, and so checked by the engine,
    whose limits bound num_experts before any per-expert list is made)"""
    cfg_path = os.path.join(path, "config.json")
    if not os.path.lexists(cfg_path):
        raise CheckpointError(f"checkpoint {path!r}: missing config.json")
    raw = read_json(cfg_path, "the model's config")
    try:
        cfg = LayerConfig.from_hf(raw)
    except (ValueError, TypeError, AttributeError, OverflowError) as e:
        raise CheckpointError(f"{cfg_path}: {e}") from e
    return cfg_path, raw, cfg


def _check_layer_idx(cfg_path: str, raw: dict, layer_idx: int) -> None:
    layers = raw.get("num_hidden_layers")
    if layers is not None and type(layers) is not int:
        raise CheckpointError(f"{cfg_path}: num_hidden_layers: expected an int, got {show(layers)}")
    if not isinstance(layer_idx, int) or layer_idx < 0 or (layers is not None and layer_idx >= layers):
        raise IndexError(f"layer_idx: expected 0 <= layer_idx < {layers} (num_hidden_layers), got {layer_idx!r}")


def _read_index(index: str) -> Dict[str, str]:
    """tensor name -> shard file name, as the index gives them"""
    data = read_json(index, "the checkpoint's index")
    weight_map = data.get("weight_map")
    if not isinstance(weight_map, dict):
        raise CheckpointError(f'{index}: expected a "weight_map" object of tensor name -> shard file, '
                              f"got {show(weight_map) if 'weight_map' in data else 'none'}")
    for name, file in weight_map.items():
        if not isinstance(file, str):
            raise CheckpointError(f"{index}: weight_map: {name}: expected a shard file name, got {show(file)}")
    return weight_map


def _trusted_roots(folder: str) -> List[str]:
    """Where a shard may really be: the checkpoint folder; and for a Hugging Face cache
    snapshot (<repo>/snapshots/<revision>/, whose files are links into <repo>/blobs/), that
    repository's blobs folder as well."""
    root = os.path.realpath(folder)
    roots = [root]
    parent = os.path.dirname(root)
    blobs = os.path.join(os.path.dirname(parent), "blobs")
    if os.path.basename(parent) == "snapshots" and os.path.isdir(blobs):
        roots.append(os.path.realpath(blobs))
    return roots


def _shard_path(folder: str, name: str, named_by: str) -> str:
    """The path of shard `name` (named by `named_by`: the index and a tensor), refused unless it
    stays inside the checkpoint folder (or a cache snapshot's blobs), symbolic links followed."""
    where = f"{named_by}: shard {show(name)}"
    if not name or "\x00" in name:
        raise CheckpointError(f"{where}: expected a file name")
    if os.path.isabs(name) or ".." in name.replace("\\", "/").split("/"):
        raise CheckpointError(f"{where} is outside the checkpoint folder (expected a path relative to it, "
                              "without '..')")
    full = os.path.join(folder, name)
    real = os.path.realpath(full)
    if not any(os.path.commonpath([real, root]) == root for root in _trusted_roots(folder)):
        raise CheckpointError(f"{where} is outside the checkpoint folder: a link to {real}")
    return full


def _missing(path: str, names: List[str], scales: Dict[str, str]) -> None:
    """names: those missing; scales: {side tensor name: its matrix's} of the layer's format"""
    if names:
        why = ("" if names[0] not in scales else
               " (the block scales of an FP8 matrix: config.json declares an FP8 quantization_config)"
               if names[0].endswith("_scale_inv") else
               " (a 4-bit matrix's qweight, qzeros, scales and g_idx: config.json declares a GPTQ quantization_config)")
        raise CheckpointError(f"checkpoint {path!r}: missing {', '.join(names[:3])}"
                              + (f" and {len(names) - 3} more" if len(names) > 3 else "") + why)


def _layer_shards(path: str, names: List[str], scales: Dict[str, str], opened: List[Shard]) -> Dict[str, Shard]:
    """{tensor name: its opened shard} for the layer's (prefixed) tensor names; each shard
    opened is appended to `opened` as soon as it is (for the caller to close on an error)"""
    index = os.path.join(path, INDEX)
    if os.path.lexists(index):
        weight_map = _read_index(index)
        _missing(path, [n for n in names if n not in weight_map], scales)
        shard_of: Dict[str, Shard] = {}  # shard name in the index -> the shard
        by_real: Dict[str, Shard] = {}   # real path -> the shard: one mapping however it is named
        for n in names:
            file = weight_map[n]
            if file not in shard_of:
                full = _shard_path(path, file, f"{index}: {n}")
                real = os.path.realpath(full)
                if real not in by_real:
                    by_real[real] = open_shard(full, f"the shard of {n} in {index}")
                    opened.append(by_real[real])
                shard_of[file] = by_real[real]
        return {n: shard_of[weight_map[n]] for n in names}
    single = os.path.join(path, SINGLE)
    if not os.path.lexists(single):
        raise CheckpointError(f"checkpoint {path!r}: expected {INDEX} or {SINGLE}")
    shard = open_shard(_shard_path(path, SINGLE, f"checkpoint {path!r}"), "the checkpoint's only shard")
    opened.append(shard)
    _missing(path, [n for n in names if n not in shard.entries], scales)
    return {n: shard for n in names}


# a quantized storage of the engine's weight table: the dtypes its tensor may have in a file
_STORED = {"e4m3": FP8, "scale": SCALES, "qweight": WORDS, "qzeros": WORDS, "g_idx": WORDS, "gscales": HALF}
GPTQ_STORAGE = ("qweight", "qzeros", "g_idx", "gscales")


def _wanted(fmt: str, cfg: LayerConfig, experts: Optional[List[int]] = None,
            settings: Optional[dict] = None) -> Tuple[Dict[str, tuple], Dict[str, str], Dict[str, list]]:
    """({per-layer tensor name: the dtypes it may have}, {side tensor name: its matrix's}, {GPTQ
    tensor name: its shape}) for a layer of weight format `fmt` (with the engine's `settings`
    of it) holding `experts` (None: all), from the engine's table: a tensor of the layer's
    dtype is any float, an e4m3 one FP8, an FP8 scale F32 or BF16, a GPTQ one as _STORED says"""
    table = _C.weight_table(cfg, fmt, experts, gptq_group=(settings or {}).get("gptq_group", 0),
                            gptq_dense_attention=(settings or {}).get("gptq_dense_attention", False))
    wanted = {name: _STORED.get(storage, FLOAT) for name, _, storage, _ in table}
    sides = {name: table[of][0] for name, _, storage, of in table if storage == "scale" or
             (storage in GPTQ_STORAGE and storage != "qweight")}
    shapes = {name: list(shape) for name, shape, storage, _ in table if storage in GPTQ_STORAGE}
    return wanted, sides, shapes


def _check_scale(shard: Shard, name: str, matrix: Entry, scale: Entry) -> None:
    """scale [ceil(out/128), ceil(in/128)] for matrix [out, in] (a matrix of another rank is
    left to the engine, which names the shape it expects)"""
    if len(matrix.shape) != 2:
        return
    want = [-(-d // 128) for d in matrix.shape]
    if scale.shape != want:
        raise CheckpointError(f"{shard.path}: {name}: expected shape {want} (one scale per 128 x 128 block of "
                              f"the {matrix.shape} matrix), got {show(scale.shape)}")


def _check_entries(shards: Dict[str, Shard], prefix: str, wanted: Dict[str, tuple],
                   scales: Dict[str, str], shapes: Dict[str, list]) -> Dict[str, Entry]:
    """every entry checked, FP8 scales against their matrices, GPTQ tensors against the shapes
    the geometry and the group give, no two overlapping"""
    entries, spans = {}, {}
    for name, dtypes in wanted.items():
        shard = shards[prefix + name]
        if prefix + name not in shard.entries:
            raise CheckpointError(f"{shard.path}: the index names it for {prefix + name}, its header does not")
        entries[name] = entry = check_entry(shard, prefix + name, dtypes)
        spans.setdefault(shard.path, []).append((entry.begin, entry.end, prefix + name))
    for name, matrix in scales.items():
        if name.endswith("_scale_inv"):
            _check_scale(shards[prefix + name], prefix + name, entries[matrix], entries[name])
    for name, shape in shapes.items():
        if entries[name].shape != shape:
            raise CheckpointError(f"{shards[prefix + name].path}: {prefix + name}: expected shape {shape} (of the "
                                  f"layer's geometry, 4-bit GPTQ), got {show(entries[name].shape)}")
    for shard_path, ranges in spans.items():
        check_no_overlap(shard_path, ranges)
    return entries


def _borrow(shards: Dict[str, Shard], prefix: str, entries: Dict[str, Entry]) -> Tuple[Dict[str, object], list, list]:
    """the views of the entries, from mappings of their own bytes only (map_spans: a file's
    other tensors, another layer's or another rank's experts, are not mapped), the mappings,
    and the (file, first byte, end) each covers; each file's mapping of the whole, used to read
    its header, closed after"""
    by_shard: Dict[int, List[str]] = {}
    for name in entries:
        by_shard.setdefault(id(shards[prefix + name]), []).append(name)
    weights, maps, spans = {}, [], []
    try:
        for names in by_shard.values():
            shard = shards[prefix + names[0]]
            mapped = map_spans(shard, [(entries[n].begin, entries[n].end) for n in names])
            maps.extend(mm for *_, mm in mapped)
            spans.extend((shard.path, shard.start + b, shard.start + e) for b, e, _, _ in mapped)
            for n in names:
                e = entries[n]
                home = next((m for m in mapped if m[0] <= e.begin and e.end <= m[1]), None)
                if home is None:  # no bytes: nothing to map
                    weights[n] = _C.buffer_view(b"", 0, e.shape, DTYPES[e.dtype])
                else:
                    _, _, first, mm = home
                    weights[n] = _C.buffer_view(mm, shard.start + e.begin - first, e.shape, DTYPES[e.dtype])
    except BaseException:
        weights.clear()
        for mm in maps:
            mm.close()
        raise
    finally:
        for shard in {id(s): s for s in shards.values()}.values():
            shard.mm.close()
    return weights, maps, spans


def load_layer_weights(path: str, layer_idx: int,
                       experts: Optional[List[int]] = None
                       ) -> Tuple[LayerConfig, Dict[str, object], list, str, Optional[dict], list]:
    """(config, {per-layer name: zero-copy tensor}, open mappings, weight format, the
    quantization_config a GPTQ layer is made with (checked: None for other formats), the
    (file, first byte, end) of the tensors each mapping covers) for layer
    `layer_idx`, of its experts `experts` only (None: all; the others' tensors are neither
    checked nor mapped). Only the layer's own bytes are mapped. On an error the mappings
    opened so far are closed (no view of them exists yet: every entry is checked before the
    first is borrowed)."""
    cfg_path, raw, cfg = _read_config(path)
    _check_layer_idx(cfg_path, raw, layer_idx)
    try:  # the layer's own rules: a dense Qwen3MoeMLP layer (mlp_only_layers, decoder_sparse_step) is refused by name
        LayerConfig.from_hf(raw, layer_idx=layer_idx)
    except ValueError as e:
        raise CheckpointError(f"{cfg_path}: {e}") from e
    fmt, settings = weight_format(cfg_path, raw, layer_idx, cfg.num_experts)
    prefix = f"model.layers.{layer_idx}."
    try:  # a geometry the group does not divide: the engine's table names it
        wanted, scales, shapes = _wanted(fmt, cfg, valid_expert_ids(experts, cfg.num_experts), settings)
    except ValueError as e:
        raise CheckpointError(f"{cfg_path}: {e}") from None
    opened: List[Shard] = []
    try:
        shards = _layer_shards(path, [prefix + n for n in wanted], {prefix + s: m for s, m in scales.items()}, opened)
        entries = _check_entries(shards, prefix, wanted, scales, shapes)
    except BaseException:
        for shard in opened:
            shard.mm.close()
        raise
    weights, maps, spans = _borrow(shards, prefix, entries)
    return cfg, weights, maps, fmt, raw["quantization_config"] if settings else None, spans
