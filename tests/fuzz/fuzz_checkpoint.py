"""Fuzzer: safetensors files -> qwen3layer.DecoderLayer.from_checkpoint -> one prefill.

    python tests/fuzz/fuzz_checkpoint.py -max_total_time=60 CORPUS_DIR
    python tests/fuzz/fuzz_checkpoint.py FILE...          # reproduce

(tests/fuzz/fuzz_common.py: the runner, the seeds, the findings log.) Each input becomes the
model.safetensors of a one-layer checkpoint of a tiny geometry, written to a temporary folder
whose config.json (fixed, CONFIGS below) the first byte, the mode byte, chooses:
  below 128  dense, or FP8 with its quantization_config when byte // 6 is odd (hidden 8, 2
             heads, 1 KV head, head_dim 4, 4 experts, top-2, moe_intermediate 8);
  128 up     4-bit GPTQ (hidden 16, 2 KV heads, head_dim 8, else the same, so that every
             matrix's inputs are a multiple of the group and its outputs of 8): group_size 8,
             sym, "gptq" (v1) zeros; or, when byte // 6 is odd, group_size -1 (one group a
             matrix), sym false, desc_act, "gptq_v2" zeros.
(Bytes below 128, those of every seed before GPTQ, mean what they did then; an older corpus's
input whose byte is from 128 becomes a GPTQ one.) The mode byte mod 3 chooses how the rest
makes the file:
  0  the rest is the whole file;
  1  the rest is the header's JSON, given its 8-byte length and spliced onto the data of a
     valid tiny checkpoint of the format (float32 data, or bfloat16 when byte // 3 is odd: the
     norms and router, and the dense matrices or FP8 scales; FP8's matrices e4m3, GPTQ's
     qweight, qzeros and g_idx I32 and scales F16);
  2  a valid tiny checkpoint's header edited field by field from the rest (offsets and shapes
     from a list of extremes and near-misses, dtypes (I32 and F16 among them), junk entries,
     a wrong length prefix, truncated data), the same splice; for GPTQ also an element of a
     g_idx, qzeros or scales poked (a group out of range, int32's extremes, NaN, Inf).
Seeds: valid tiny checkpoints in float32 and bfloat16 of each format, written by hand (GPTQ's
also with its g_idx shuffled, as desc_act leaves them), and the one transformers'
save_pretrained writes for the dense geometry (when transformers is there), in each mode.
tests/io/test_fuzz_seeds.py loads each hand-written seed of modes 0 and 1 (no atheris needed):
they stay valid checkpoints.

The entry point is the public one, DecoderLayer.from_checkpoint(path, layer_idx). Documented
outcomes: a layer, CheckpointError (a ValueError), ValueError (the constructor's checks: shapes,
a GPTQ g_idx out of range, a scale not finite), TypeError (an unsupported dtype), IndexError
(layer_idx). Findings:
- any other exception type (KeyError, AttributeError, OverflowError, RecursionError, ...);
- a loaded layer whose tensors reach past their own declared bytes (data_offsets) or past the
  file: checked on every view the loader makes (qwen3layer._C.buffer_view, watched while
  the loader runs) and on every borrowed weight's address against the file's mapping
  (/proc/self/maps). AddressSanitizer cannot see these reads: the file is mmapped, not
  heap;
- an exception from the prefill of a loaded layer;
- crashes (under the sanitized build: ASan, UBSan) and hangs, which stop the fuzzer.
The stats (<findings>.stats) count each outcome, the layers loaded by format, non-CheckpointError
ValueErrors and TypeErrors by message, so the undocumented ones are visible though tolerated.
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
# GPTQ's: every matrix's inputs a multiple of the group (8) and outputs of 8, and two groups in
# the inputs of 16 (one in the down_proj's 8), so that g_idx says something
GPTQ_GEOMETRY = dict(GEOMETRY, hidden_size=16, num_key_value_heads=2, head_dim=8)
REST = dict(model_type="qwen3_moe", num_hidden_layers=1, vocab_size=16, intermediate_size=16, norm_topk_prob=True,
            rms_norm_eps=1e-6, rope_theta=1e6, max_position_embeddings=64)
CONFIG = dict(GEOMETRY, **REST)
GPTQ = {"quant_method": "gptq", "bits": 4, "group_size": 8, "sym": True, "desc_act": False,
        "checkpoint_format": "gptq"}
CONFIGS = {  # format -> config.json
    "dense": CONFIG,
    "fp8": dict(CONFIG, quantization_config={"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                             "weight_block_size": [128, 128]}),
    "gptq": dict(GPTQ_GEOMETRY, **REST, quantization_config=GPTQ),
    "gptq-v2": dict(GPTQ_GEOMETRY, **REST, quantization_config=dict(GPTQ, group_size=-1, sym=False, desc_act=True,
                                                                    checkpoint_format="gptq_v2")),
}
MODE_BASE = {"dense": 0, "fp8": 6, "gptq": 132, "gptq-v2": 138}  # the mode byte of a whole-file F32 input
PREFIX = "model.layers.0."


def layer_shapes(g: dict) -> dict:
    """per-layer name -> shape, as a dense checkpoint of geometry `g` holds them"""
    H, HEADS, KV, D, E, I = (g[k] for k in ("hidden_size", "num_attention_heads", "num_key_value_heads", "head_dim",
                                            "num_experts", "moe_intermediate_size"))
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


def layout(fmt: str) -> dict:
    """per-layer name -> (stored dtype, shape) of a checkpoint of format `fmt`; the dtype None
    for a tensor of the layer's dtype (norms, router, dense matrices), "scale" for an FP8
    matrix's [1, 1] scale (of the layer's dtype in the seeds, any float in a file). The
    projection matrices (not mlp.gate) are FP8 e4m3, or GPTQ's four tensors of module <m>:
    <m>.qweight I32 [in/8, out], <m>.qzeros I32 [groups, out/8], <m>.scales F16 [groups, out],
    <m>.g_idx I32 [in]."""
    cfg = CONFIGS[fmt]
    out = {}
    for name, shape in layer_shapes(cfg).items():
        if not name.endswith("proj.weight") or fmt == "dense":
            out[name] = (None, shape)
        elif fmt == "fp8":
            out[name] = ("F8_E4M3", shape)
            out[name + "_scale_inv"] = ("scale", [1, 1])
        else:
            (n, k), group = shape, cfg["quantization_config"]["group_size"]
            groups = 1 if group == -1 else k // group
            m = name[:-len(".weight")]
            out.update({m + ".qweight": ("I32", [k // 8, n]), m + ".qzeros": ("I32", [groups, n // 8]),
                        m + ".scales": ("F16", [groups, n]), m + ".g_idx": ("I32", [k])})
    return out


LAYOUTS = {fmt: layout(fmt) for fmt in CONFIGS}
SIZES = {"F32": 4, "BF16": 2, "F8_E4M3": 1, "I32": 4, "F16": 2}
VIEW_SIZES = {"float32": 4, "bfloat16": 2, "float8_e4m3fn": 1, "int32": 4, "float16": 2}


def _floats(vals, dtype: str) -> bytes:
    if dtype == "F16":
        return struct.pack(f"<{len(vals)}e", *vals)
    raw = struct.pack(f"<{len(vals)}f", *vals)
    return b"".join(raw[i + 2:i + 4] for i in range(0, len(raw), 4)) if dtype == "BF16" else raw


def _numel(shape) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


def _gptq_words(rng, name: str, shape, fmt: str, permuted: bool) -> bytes:
    """the I32 words of GPTQ tensor `name`: random nibbles (qweight; qzeros of an asymmetric
    config; a symmetric one's zero is 8, stored as 7 in "gptq" v1), g_idx input k's group
    k // group, or a permutation of those (as desc_act's reordering leaves them)"""
    qc = CONFIGS[fmt]["quantization_config"]
    n = _numel(shape)
    if name.endswith(".g_idx"):
        group = n if qc["group_size"] == -1 else qc["group_size"]
        words = [k // group for k in range(n)]
        if permuted:
            rng.shuffle(words)
    elif name.endswith(".qzeros") and qc["sym"]:
        words = [0x77777777 if qc["checkpoint_format"] == "gptq" else 0x88888888] * n
    else:
        words = [rng.getrandbits(32) for _ in range(n)]
    return struct.pack(f"<{n}I", *words)


def tiny_checkpoint(dtype: str, seed: int = 0, fmt: str = "dense", permuted: bool = False):
    """(header dict, data bytes) of a valid one-layer safetensors file of format `fmt` (the
    layout above; `dtype`: the layer's, F32 or BF16), written as the safetensors library does
    (sorted names, contiguous data). FP8 matrices: bytes of magnitude below 16, never NaN, each
    with a [1, 1] scale of `dtype`. GPTQ: scales of 0.01 to 0.03; permuted: g_idx shuffled."""
    rng = random.Random(seed)
    tensors = {}
    for name, (kind, shape) in LAYOUTS[fmt].items():
        n = _numel(shape)
        if kind == "F8_E4M3":
            raw = bytes(rng.randrange(0x58) | rng.choice((0, 0x80)) for _ in range(n))
        elif kind == "scale":
            kind, raw = dtype, _floats([0.02], dtype)
        elif kind == "I32":
            raw = _gptq_words(rng, name, shape, fmt, permuted)
        elif kind == "F16":
            raw = _floats([rng.uniform(0.01, 0.03) for _ in range(n)], "F16")
        else:
            vals = [(1.0 + 0.1 * rng.gauss(0, 1)) if len(shape) == 1 else 0.3 * rng.gauss(0, 1) for _ in range(n)]
            kind, raw = dtype, _floats(vals, dtype)
        tensors[name] = (kind, shape, raw)
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


BASES = {(fmt, dt): tiny_checkpoint(dt, fmt=fmt) for fmt in CONFIGS for dt in ("F32", "BF16")}


def transformers_checkpoints() -> dict:
    """model.safetensors as transformers' save_pretrained writes it for the dense geometry
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


def seeds(with_transformers: bool = True) -> dict:
    """every format in every mode: the valid hand-written files whole (mode 0), their headers
    (mode 1, spliced onto the same data), a few edit streams (mode 2); a GPTQ file whose g_idx
    are shuffled (desc_act's order) whole; transformers' dense files whole and their headers"""
    out = {}
    for fmt, base in MODE_BASE.items():
        tag = "" if fmt == "dense" else fmt + "-"
        for dt, mode in (("F32", base), ("BF16", base + 3)):
            name = f"hand-{tag}{dt.lower()}"
            data = file_bytes(*BASES[fmt, dt])
            out[f"whole-{name}"] = bytes([base]) + data  # (a whole file's mode byte: its format only)
            (n,) = struct.unpack("<Q", data[:8])
            out[f"header-{name}"] = bytes([mode + 1]) + data[8:8 + n]
            for i, blob in enumerate((b"", b"\x00" * 16, bytes(range(64)), b"\xff" * 32)):
                out[f"edit-{tag}{dt.lower()}-{i}"] = bytes([mode + 2]) + blob
    for dt in ("F32", "BF16"):
        out[f"whole-hand-gptq-{dt.lower()}-desc-act"] = bytes([MODE_BASE["gptq"]]) + file_bytes(
            *tiny_checkpoint(dt, seed=1, fmt="gptq", permuted=True))
    for name, data in (transformers_checkpoints() if with_transformers else {}).items():
        out[f"whole-{name}"] = bytes([0]) + data
        (n,) = struct.unpack("<Q", data[:8])
        out[f"header-{name}"] = bytes([1 if name.endswith("f32") else 4]) + data[8:8 + n]
    return out


# ---- the structured edits (mode 2) -------------------------------------------------------

EXTREMES = [0, 1, -1, 2, 7, 8, 2**31 - 1, 2**31, 2**32 - 1, 2**32, 2**53, 2**62, 2**63 - 1, 2**63,
            2**64 - 1, 2**64, -2**31, -2**63, -2**63 - 1]
DTYPE_NAMES = ["F32", "BF16", "F16", "F64", "I8", "U8", "I32", "I64", "BOOL", "F8_E4M3", "F8_E5M2", "", "f32", "bf16",
               None, 4, [], {}]
# values poked into a GPTQ file's data: g_idx and qzeros words (a group past the last, negative,
# the extremes of int32), F16 scales (NaN, +-Inf, the largest, a subnormal, -0, 0)
WORDS = [-1, 1, 2, 3, 7, 8, 15, 16, 0x7FFFFFFF, -0x80000000, 0x77777777]
HALVES = [0x7E00, 0xFFFF, 0x7C00, 0xFC00, 0x7BFF, 0x0001, 0x8000, 0x0000, 0xFBFF]


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


def poked(fdp, data: bytes, entry: dict) -> bytes:
    """`data` with one element of a valid file's GPTQ tensor `entry` (its header entry: I32
    words, F16 scales) replaced by a value of WORDS or HALVES, or any of its width"""
    size = SIZES[entry["dtype"]]
    begin, end = entry["data_offsets"]
    at = begin + size * fdp.ConsumeIntInRange(0, (end - begin) // size - 1)
    if at + size > len(data):
        return data
    if size == 4:
        value = fdp.PickValueInList(WORDS) if fdp.ConsumeBool() else fdp.ConsumeIntInRange(-2**31, 2**31 - 1)
        raw = struct.pack("<i", value)
    else:
        raw = struct.pack("<H", fdp.PickValueInList(HALVES) if fdp.ConsumeBool() else fdp.ConsumeIntInRange(0, 0xFFFF))
    return data[:at] + raw + data[at + size:]


def edited(fdp, base: tuple) -> bytes:
    """a valid file of BASES[base] ((format, dtype)) edited: 1 to 4 edits of its header, or
    of a GPTQ one's data (a g_idx, qzeros or scales element poked), then maybe the header's
    form itself"""
    original, data = BASES[base]
    header = json.loads(json.dumps(original))
    names = [n for n in header if n != "__metadata__"]
    offsets = sorted({v for n in names for v in header[n]["data_offsets"]} | {len(data)})
    dims = sorted({s for n in names for s in header[n]["shape"]} | {64, 4096})
    last = 12 if base[0].startswith("gptq") else 11  # (dense and FP8 streams read as they always have)
    length = None
    for _ in range(fdp.ConsumeIntInRange(1, 4)):
        name = fdp.PickValueInList(names)
        entry = header.get(name)
        what = fdp.ConsumeIntInRange(0, last)
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
        elif what == 11:
            length = fuzz_int(fdp, [len(header_bytes(header))])
        elif original[name]["dtype"] in ("I32", "F16"):  # 12: a GPTQ tensor's value (the layer checks g_idx, scales)
            data = poked(fdp, data, original[name])
    if fdp.ConsumeIntInRange(0, 15) == 0:
        header = fdp.PickValueInList([[header], 1, "x", None, {"__metadata__": header}])
    if fdp.ConsumeIntInRange(0, 15) == 0 and isinstance(header, dict):
        header["__metadata__"] = junk(fdp)
    text = header_bytes(header)
    n = len(text) if length is None else length
    return struct.pack("<Q", n % 2**64) + text + data


def input_format(data: bytes) -> str:
    """the format of the input's checkpoint (its config.json, CONFIGS): a mode byte below 128
    dense, or FP8 where byte // 6 is odd; from 128 GPTQ, group 8 ("gptq"), or group -1
    ("gptq-v2": gptq_v2 zeros, sym false, desc_act) where byte // 6 is odd"""
    if not data:
        return "dense"
    odd = (data[0] // 6) % 2 == 1
    if data[0] >= 128:
        return "gptq-v2" if odd else "gptq"
    return "fp8" if odd else "dense"


def checkpoint_bytes(data: bytes) -> bytes:
    if not data:
        return b""
    mode, rest = data[0], data[1:]
    base = (input_format(data), "BF16" if (mode // 3) % 2 else "F32")
    if mode % 3 == 0:
        return rest
    if mode % 3 == 1:
        return struct.pack("<Q", len(rest)) + rest + BASES[base][1]
    import atheris  # (only mode 2 needs it: the other modes run without it, tests/io/test_fuzz_seeds.py)

    return edited(atheris.FuzzedDataProvider(rest), base)


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
    for fmt, config in CONFIGS.items():
        dirs[fmt] = os.path.join(d, fmt)
        os.mkdir(dirs[fmt])
        with open(os.path.join(dirs[fmt], "config.json"), "w") as f:
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
    fmt = input_format(data)
    folder = STATE["dirs"][fmt]
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
    log.outcome(f"loaded ({fmt})")
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
        kind, shape = LAYOUTS[fmt].get(name, ("scale", None))
        if name in layer.converted or kind == "scale":  # (FP8 scales, of any float: their views checked above)
            continue
        size = SIZES[kind] if kind else 2 if layer.dtype == "bfloat16" else 4
        n = _numel(shape)
        if n == 0:
            continue
        home = [(a, off) for a, b, off in maps if a <= ptr and ptr + n * size <= b]
        if not home or home[0][1] + (ptr - home[0][0]) + n * size > len(raw):
            log.finding("a borrowed weight lies outside the file",
                        f"{name}: {n * size} bytes at {ptr:#x}, in no mapping of the {len(raw)}-byte file within it "
                        f"(mappings {maps[:8]})", data)
    try:
        hidden = CONFIGS[fmt]["hidden_size"]
        layer.prefill(_C.random_tensor((3, hidden), 1, layer.dtype), layer.new_cache(4))
        layer.decode(_C.random_tensor((1, hidden), 2, layer.dtype), layer.new_cache(1))
    except Exception as e:  # noqa: BLE001
        log.finding(f"prefill of a loaded layer raised {type(e).__name__}", message_key(e), data, e)
    del layer


if __name__ == "__main__":
    fuzz_common.run(NAME, test_one_input, seeds, setup)
