"""Fuzzer: safetensors files -> qwen3layer.DecoderLayer.from_checkpoint -> one prefill.

    python tests/fuzz/fuzz_checkpoint.py -max_total_time=60 CORPUS_DIR
    python tests/fuzz/fuzz_checkpoint.py FILE...          # reproduce

(tests/fuzz/fuzz_common.py: the runner, the seeds, the findings log.) Each input becomes the
model.safetensors of a one-layer checkpoint of a tiny geometry (config.json fixed, below:
dense, or FP8 with its quantization_config when byte // 6 is odd), written to a temporary
folder; the first byte chooses how:
  0 (mod 3)  the rest is the whole file;
  1          the rest is the header's JSON, given its 8-byte length and spliced onto the data
             of a valid tiny checkpoint (float32 data, or bfloat16 when byte // 3 is odd; for
             FP8, e4m3 matrices with scales and norms of that dtype);
  2          a valid tiny checkpoint's header edited field by field from the rest (offsets
             and shapes from a list of extremes and near-misses, dtypes, junk entries, a wrong
             length prefix, truncated data), the same splice.
Seeds: valid tiny checkpoints in float32 and bfloat16, dense and FP8, written by hand, and the
one transformers' save_pretrained writes for the same geometry (when transformers is there),
in each mode.

The entry point is the public one, DecoderLayer.from_checkpoint(path, layer_idx). Documented
outcomes: a layer, CheckpointError (a ValueError), ValueError (the constructor's shape
checks), TypeError (an unsupported dtype), IndexError (layer_idx). Findings:
- any other exception type (KeyError, AttributeError, OverflowError, RecursionError, ...);
- a loaded layer whose tensors reach past their own declared bytes (data_offsets) or past the
  file: checked on every view the loader makes (qwen3layer._C.buffer_view, watched while
  the loader runs) and on every borrowed weight's address against the file's mapping
  (/proc/self/maps). AddressSanitizer cannot see these reads: the file is mmapped, not
  heap;
- an exception from the prefill of a loaded layer;
- crashes (under the sanitized build: ASan, UBSan) and hangs, which stop the fuzzer.
The stats (<findings>.stats) count each outcome, non-CheckpointError ValueErrors and
TypeErrors by message, so the undocumented ones are visible though tolerated.
"""
from __future__ import annotations

import json
import os
import random
import re
import struct
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))

import fuzz_common  # noqa: E402

NAME = "fuzz_checkpoint"
GEOMETRY = dict(hidden_size=8, num_attention_heads=2, num_key_value_heads=1, head_dim=4, num_experts=4,
                num_experts_per_tok=2, moe_intermediate_size=8)
CONFIG = dict(GEOMETRY, model_type="qwen3_moe", num_hidden_layers=1, vocab_size=16, intermediate_size=16,
              norm_topk_prob=True, rms_norm_eps=1e-6, rope_theta=1e6, max_position_embeddings=64)
FP8_CONFIG = dict(CONFIG, quantization_config={"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                               "weight_block_size": [128, 128]})
H, HEADS, KV, D, E, I = (GEOMETRY[k] for k in ("hidden_size", "num_attention_heads", "num_key_value_heads",
                                                "head_dim", "num_experts", "moe_intermediate_size"))
PREFIX = "model.layers.0."


def layer_shapes() -> dict:
    """per-layer name -> shape"""
    shapes = {
        "input_layernorm.weight": [H], "self_attn.q_proj.weight": [HEADS * D, H],
        "self_attn.k_proj.weight": [KV * D, H], "self_attn.v_proj.weight": [KV * D, H],
        "self_attn.o_proj.weight": [H, HEADS * D], "self_attn.q_norm.weight": [D],
        "self_attn.k_norm.weight": [D], "post_attention_layernorm.weight": [H], "mlp.gate.weight": [E, H],
    }
    for e in range(E):
        shapes[f"mlp.experts.{e}.gate_proj.weight"] = [I, H]
        shapes[f"mlp.experts.{e}.up_proj.weight"] = [I, H]
        shapes[f"mlp.experts.{e}.down_proj.weight"] = [H, I]
    return shapes


SHAPES = layer_shapes()
MATRICES = {n for n in SHAPES if n.endswith("proj.weight")}  # an FP8 layer's e4m3 ones (not mlp.gate)
SIZES = {"F32": 4, "BF16": 2}
VIEW_SIZES = {"float32": 4, "bfloat16": 2, "float8_e4m3fn": 1}


def _floats(vals, dtype: str) -> bytes:
    raw = struct.pack(f"<{len(vals)}f", *vals)
    return b"".join(raw[i + 2:i + 4] for i in range(0, len(raw), 4)) if dtype == "BF16" else raw


def tiny_checkpoint(dtype: str, seed: int = 0, fp8: bool = False):
    """(header dict, data bytes) of a valid one-layer safetensors file, written as the
    safetensors library does (sorted names, contiguous data). fp8: the projection matrices
    F8_E4M3 (bytes of magnitude below 16, never NaN) with a [1, 1] scale of `dtype` each."""
    rng = random.Random(seed)
    tensors = {}
    for name, shape in SHAPES.items():
        n = 1
        for s in shape:
            n *= s
        if fp8 and name in MATRICES:
            tensors[name] = ("F8_E4M3", shape, bytes(rng.randrange(0x58) | rng.choice((0, 0x80)) for _ in range(n)))
            tensors[name + "_scale_inv"] = (dtype, [1, 1], _floats([0.02], dtype))
        else:
            vals = [(1.0 + 0.1 * rng.gauss(0, 1)) if len(shape) == 1 else 0.3 * rng.gauss(0, 1) for _ in range(n)]
            tensors[name] = (dtype, shape, _floats(vals, dtype))
    header, chunks, at = {}, [], 0
    for name in sorted(tensors):
        kind, shape, raw = tensors[name]
        header[PREFIX + name] = {"dtype": kind, "shape": shape, "data_offsets": [at, at + len(raw)]}
        chunks.append(raw)
        at += len(raw)
    return {"__metadata__": {"format": "pt"}, **header}, b"".join(chunks)


def header_bytes(header) -> bytes:
    text = json.dumps(header, separators=(",", ":")).encode()
    return text + b" " * (-len(text) % 8)  # the safetensors library pads to 8 bytes


def file_bytes(header, data: bytes) -> bytes:
    text = header_bytes(header)
    return struct.pack("<Q", len(text)) + text + data


BASES = {dt: tiny_checkpoint(dt) for dt in ("F32", "BF16")}
BASES.update({"FP8-" + dt: tiny_checkpoint(dt, fp8=True) for dt in ("F32", "BF16")})


def transformers_checkpoints() -> dict:
    """model.safetensors as transformers' save_pretrained writes it for this geometry
    (float32 and bfloat16), or {} without torch and transformers."""
    try:
        import torch
        from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM
    except ImportError:
        return {}
    out = {}
    torch.manual_seed(0)
    cfg = {k: v for k, v in CONFIG.items() if k != "model_type"}
    model = Qwen3MoeForCausalLM(Qwen3MoeConfig(**cfg)).eval()
    for tag, dtype in (("f32", torch.float32), ("bf16", torch.bfloat16)):
        with tempfile.TemporaryDirectory() as d:
            model.to(dtype).save_pretrained(d)
            with open(os.path.join(d, "model.safetensors"), "rb") as f:
                out[f"transformers-{tag}"] = f.read()
    return out


def seeds() -> dict:
    files = {f"hand-{dt.lower()}": file_bytes(*BASES[dt]) for dt in BASES}
    files.update(transformers_checkpoints())
    out = {}
    for name, data in files.items():
        fp8 = 6 if name.startswith("hand-fp8") else 0  # the mode byte's FP8 bit: its config.json
        out[f"whole-{name}"] = bytes([fp8]) + data
        (n,) = struct.unpack("<Q", data[:8])
        if name.endswith("f32"):  # the splice modes append the hand-written data of their dtype
            out[f"header-{name}"] = bytes([fp8 + 1]) + data[8:8 + n]
        elif name.endswith("bf16"):
            out[f"header-{name}"] = bytes([fp8 + 4]) + data[8:8 + n]
    for i, blob in enumerate((b"", b"\x00" * 16, bytes(range(64)), b"\xff" * 32)):
        for fp8, tag in ((0, ""), (6, "fp8-")):
            out[f"edit-{tag}f32-{i}"] = bytes([fp8 + 2]) + blob
            out[f"edit-{tag}bf16-{i}"] = bytes([fp8 + 5]) + blob
    return out


# ---- the structured edits (mode 2) -------------------------------------------------------

EXTREMES = [0, 1, -1, 2, 7, 8, 2**31 - 1, 2**31, 2**32 - 1, 2**32, 2**53, 2**62, 2**63 - 1, 2**63,
            2**64 - 1, 2**64, -2**31, -2**63, -2**63 - 1]
DTYPE_NAMES = ["F32", "BF16", "F16", "F64", "I8", "U8", "I32", "I64", "BOOL", "F8_E4M3", "F8_E5M2", "", "f32", "bf16",
               None, 4, [], {}]


def fuzz_int(fdp, near=()) -> int:
    how = fdp.ConsumeIntInRange(0, 6)
    if how == 0:
        return fdp.PickValueInList(EXTREMES)
    if how == 1:
        return fdp.PickValueInList(EXTREMES) - fdp.ConsumeIntInRange(0, 1 << 16)
    if how == 2 and near:
        return fdp.PickValueInList(list(near)) + fdp.ConsumeIntInRange(-64, 64)
    if how == 3:
        return fdp.ConsumeIntInRange(-2**63, 2**63 - 1)
    if how == 4 and near:
        return fdp.PickValueInList(list(near)) * fdp.ConsumeIntInRange(0, 16)
    return fdp.ConsumeIntInRange(0, 1 << 20)


def junk(fdp):
    return fdp.PickValueInList([None, True, 1.5, "1", [], {}, [1], [1, 2, 3], "x" * 8, -1, 2**64, float("nan")])


def edited(fdp, dtype: str) -> bytes:
    header, data = BASES[dtype]
    header = json.loads(json.dumps(header))
    names = [n for n in header if n != "__metadata__"]
    offsets = sorted({v for n in names for v in header[n]["data_offsets"]} | {len(data)})
    dims = sorted({s for n in names for s in header[n]["shape"]} | {64, 4096})
    length = None
    for _ in range(fdp.ConsumeIntInRange(1, 4)):
        name = fdp.PickValueInList(names)
        entry = header.get(name)
        what = fdp.ConsumeIntInRange(0, 11)
        if not isinstance(entry, dict) and what <= 9:
            continue
        if what <= 2:
            entry["data_offsets"] = [fuzz_int(fdp, offsets), fuzz_int(fdp, offsets)]
        elif what == 3:
            entry["data_offsets"] = fdp.PickValueInList([[], [0], [0, 1, 2], junk(fdp), [junk(fdp), 0],
                                                         [0, junk(fdp)]])
        elif what <= 5:
            entry["shape"] = [fuzz_int(fdp, dims) for _ in range(fdp.ConsumeIntInRange(0, 4))]
        elif what == 6:
            entry["dtype"] = fdp.PickValueInList(DTYPE_NAMES)
        elif what == 7:
            entry.pop(fdp.PickValueInList(["dtype", "shape", "data_offsets"]), None)
        elif what == 8:
            header[name] = junk(fdp)
        elif what == 9:  # two tensors trade their bytes
            other = header.get(fdp.PickValueInList(names))
            if isinstance(other, dict) and "data_offsets" in other and "data_offsets" in entry:
                entry["data_offsets"], other["data_offsets"] = other["data_offsets"], entry["data_offsets"]
        elif what == 10:
            cut = fuzz_int(fdp, offsets)
            data = data[:max(0, cut)] if cut < len(data) else data + b"\0" * min(cut - len(data), 1 << 16)
        else:
            length = fuzz_int(fdp, [len(header_bytes(header))])
    if fdp.ConsumeIntInRange(0, 15) == 0:
        header = fdp.PickValueInList([[header], 1, "x", None, {"__metadata__": header}])
    if fdp.ConsumeIntInRange(0, 15) == 0 and isinstance(header, dict):
        header["__metadata__"] = junk(fdp)
    text = header_bytes(header)
    n = len(text) if length is None else length
    return struct.pack("<Q", n % 2**64) + text + data


def is_fp8(data: bytes) -> bool:
    """the input's checkpoint has the FP8 config.json"""
    return bool(data) and (data[0] // 6) % 2 == 1


def checkpoint_bytes(data: bytes) -> bytes:
    import atheris

    if not data:
        return b""
    mode, rest = data[0], data[1:]
    dtype = ("FP8-" if is_fp8(data) else "") + ("BF16" if (mode // 3) % 2 else "F32")
    if mode % 3 == 0:
        return rest
    if mode % 3 == 1:
        return struct.pack("<Q", len(rest)) + rest + BASES[dtype][1]
    return edited(atheris.FuzzedDataProvider(rest), dtype)


# ---- the oracle ----------------------------------------------------------------------------

def parse(raw: bytes):
    """(header, data start) as the safetensors format defines them, or None."""
    if len(raw) < 8:
        return None
    (n,) = struct.unpack("<Q", raw[:8])
    if 8 + n > len(raw):
        return None
    try:
        header = json.loads(raw[8:8 + n])
    except (ValueError, RecursionError):
        return None
    return (header, 8 + n) if isinstance(header, dict) else None


def declared_regions(raw: bytes):
    """[(begin, end)] file byte ranges of the well-formed entries"""
    parsed = parse(raw)
    if parsed is None:
        return None
    header, start = parsed
    regions = []
    for entry in header.values():
        if isinstance(entry, dict):
            off = entry.get("data_offsets")
            if (isinstance(off, list) and len(off) == 2 and all(type(v) is int for v in off)
                    and 0 <= off[0] <= off[1]):
                regions.append((start + off[0], start + off[1]))
    return regions


def mappings_of(path: str):
    """[(start, end, file offset)] of the live mappings of `path` (the loader maps each run of
    the layer's tensors on its own, from an allocation-granularity boundary)"""
    real = os.path.realpath(path)
    out = []
    with open("/proc/self/maps") as f:
        for line in f:
            parts = line.split(None, 5)
            if len(parts) == 6 and parts[5].strip() == real:
                a, b = (int(v, 16) for v in parts[0].split("-"))
                out.append((a, b, int(parts[2], 16)))
    return out


STATE = {}


def setup():
    import qwen3layer as q3
    from qwen3layer import _C
    from qwen3layer.checkpoint import CheckpointError

    d = tempfile.mkdtemp(prefix="fuzz-checkpoint-")
    dirs = {}
    for fp8, config in ((False, CONFIG), (True, FP8_CONFIG)):
        dirs[fp8] = os.path.join(d, "fp8" if fp8 else "dense")
        os.mkdir(dirs[fp8])
        with open(os.path.join(dirs[fp8], "config.json"), "w") as f:
            json.dump(config, f)
    views = []
    real_view = _C.buffer_view
    firsts = {}  # id of a mapping the loader made -> the file offset of its byte 0
    import qwen3layer.checkpoint as checkpoint
    real_map_spans = checkpoint.map_spans

    def watched_map_spans(shard, spans):
        mapped = real_map_spans(shard, spans)
        for _, _, first, mm in mapped:
            firsts[id(mm)] = first
        return mapped

    def watched_view(obj, offset, shape, dtype):
        t = real_view(obj, offset, shape, dtype)
        n = 1
        for s in shape:
            n *= s
        # the view's bytes as file offsets (a view of no bytes is made over b"")
        views.append((firsts.get(id(obj), 0) + offset, n * VIEW_SIZES[dtype]))
        return t

    _C.buffer_view = watched_view  # the loader looks it up on the module at each call
    checkpoint.map_spans = watched_map_spans
    STATE.update(q3=q3, _C=_C, CheckpointError=CheckpointError, dirs=dirs, views=views, firsts=firsts,
                 log=fuzz_common.Log(NAME))


def message_key(e: BaseException) -> str:
    text = re.sub(r"\d+", "N", str(e).split("\n")[0])
    text = re.sub(r"'[^']*'", "'…'", text)
    return f"{type(e).__name__}: {text[:70]}"


def test_one_input(data: bytes) -> None:
    q3, _C, log, views = STATE["q3"], STATE["_C"], STATE["log"], STATE["views"]
    raw = checkpoint_bytes(data)
    folder = STATE["dirs"][is_fp8(data)]
    path = os.path.join(folder, "model.safetensors")
    with open(path + ".new", "wb") as f:
        f.write(raw)
    os.replace(path + ".new", path)  # a new inode: the last layer's mapping (if alive) keeps the old one
    views.clear()
    STATE["firsts"].clear()
    try:
        layer = q3.DecoderLayer.from_checkpoint(folder, 0)
    except STATE["CheckpointError"]:
        log.outcome("CheckpointError")
        return
    except (ValueError, TypeError, IndexError) as e:  # documented types; the message says which check
        log.outcome(message_key(e))
        return
    except Exception as e:  # noqa: BLE001
        log.finding(f"undocumented exception {type(e).__name__} from from_checkpoint", message_key(e), data, e)
        return
    log.outcome("loaded")
    # every view within the bytes its entry declares, and within the file
    regions = declared_regions(raw)
    if regions is not None:
        for offset, nbytes in views:
            ok = nbytes == 0 or (any(b == offset and offset + nbytes <= e for b, e in regions)
                                 and offset + nbytes <= len(raw))
            if not ok:
                log.finding("a loaded tensor reaches past its declared bytes",
                            f"view of bytes [{offset}, {offset + nbytes}) of a {len(raw)}-byte file; declared "
                            f"regions {sorted(regions)[:20]}", data)
    maps = mappings_of(path)
    for name, ptr in layer.weight_ptrs.items():
        if name in layer.converted or name not in SHAPES:  # (scales: not in SHAPES, their views checked above)
            continue
        fp8 = layer.weight_format != "dense" and name in MATRICES
        size = 1 if fp8 else 2 if layer.dtype == "bfloat16" else 4
        n = 1
        for s in SHAPES[name]:
            n *= s
        if n == 0:
            continue
        home = [(a, off) for a, b, off in maps if a <= ptr and ptr + n * size <= b]
        if not home or home[0][1] + (ptr - home[0][0]) + n * size > len(raw):
            log.finding("a borrowed weight lies outside the file",
                        f"{name}: {n * size} bytes at {ptr:#x}, in no mapping of the {len(raw)}-byte file within it "
                        f"(mappings {maps[:8]})", data)
    try:
        x = _C.random_tensor((3, H), 1, layer.dtype)
        layer.prefill(x, layer.new_cache(4))
        layer.decode(_C.random_tensor((1, H), 2, layer.dtype), layer.new_cache(1))
    except Exception as e:  # noqa: BLE001
        log.finding(f"prefill of a loaded layer raised {type(e).__name__}", message_key(e), data, e)
    del layer


if __name__ == "__main__":
    fuzz_common.run(NAME, test_one_input, seeds, setup)
