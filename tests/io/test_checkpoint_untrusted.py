"""DecoderLayer.from_checkpoint on files nobody vouches for: every header entry, the index and
config.json are checked before a byte is borrowed, and each bad file gives a CheckpointError
(a ValueError) naming the file and, where there is one, the tensor; never a crash, a hang, a
huge allocation or a bare TypeError / KeyError / JSONDecodeError."""
import json
import os
import shutil
import signal
import struct
import subprocess
import sys
from contextlib import contextmanager

import pytest
import torch

import qwen3layer as q3
from hf_reference import hf_config
from qwen3layer.checkpoint import CheckpointError

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..")

Q_NORM = "model.layers.0.self_attn.q_norm.weight"  # [24] F32: 96 bytes
K_NORM = "model.layers.0.self_attn.k_norm.weight"  # [24] F32
GATE = "model.layers.0.mlp.gate.weight"            # [8, 64] F32: 2048 bytes


def tiny_model(layers: int):
    from transformers import Qwen3MoeForCausalLM

    cfg = hf_config("gqa4_topk_norm")
    cfg.num_hidden_layers = layers
    torch.manual_seed(0)
    return Qwen3MoeForCausalLM(cfg).eval()


@pytest.fixture(scope="module")
def single(tmp_path_factory):
    """A 1-layer tiny model saved as one model.safetensors (F32)."""
    path = tmp_path_factory.mktemp("single")
    tiny_model(1).save_pretrained(path, max_shard_size="1GB")
    assert os.path.exists(path / "model.safetensors")
    return path


@pytest.fixture(scope="module")
def sharded(tmp_path_factory):
    """A 1-layer tiny model saved in 100 KB shards with model.safetensors.index.json."""
    path = tmp_path_factory.mktemp("sharded")
    tiny_model(1).save_pretrained(path, max_shard_size="100KB")
    assert os.path.exists(path / "model.safetensors.index.json")
    return path


def copy_of(src, tmp_path):
    dst = tmp_path / "ckpt"
    shutil.copytree(src, dst)
    return dst


def read_shard(path):
    raw = path.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    return json.loads(raw[8:8 + n]), raw[8 + n:]


def header_bytes(header) -> bytes:
    text = header if isinstance(header, bytes) else json.dumps(header).encode()
    return text + b" " * (-len(text) % 8)  # the data stays 8-byte aligned, as safetensors writes it


def framed(header, data: bytes = b"", length=None) -> bytes:
    """A safetensors file by hand: 8 bytes of little-endian header length, the header, the data."""
    text = header_bytes(header)
    return struct.pack("<Q", len(text) if length is None else length) + text + data


def write_shard(path, header, data: bytes = b""):
    path.write_bytes(framed(header, data))


def load(path, layer=0):
    return q3.DecoderLayer.from_checkpoint(str(path), layer)


def expect(path, *names, kind=CheckpointError, match=None):
    """Loading fails with `kind`, its message naming each of `names` (a file, a tensor)."""
    with pytest.raises(kind, match=match) as e:
        load(path)
    for name in names:
        assert name in str(e.value), (name, str(e.value))
    return str(e.value)


@contextmanager
def no_hang(seconds=20):
    def fail(*_):
        raise TimeoutError(f"the loader hung for {seconds} s")

    old = signal.signal(signal.SIGALRM, fail)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)


def test_the_valid_bases_load(single, sharded):
    for path in (single, sharded):
        layer = load(path)
        x = torch.randn(3, 64)
        assert layer.prefill(x, layer.new_cache(4)).shape == (3, 64)


def test_checkpoint_error_is_a_value_error_exported_by_the_package():
    assert q3.CheckpointError is CheckpointError and issubclass(CheckpointError, ValueError)


def test_the_cli_reports_a_bad_checkpoint_naming_the_file(single, tmp_path):
    dst = copy_of(single, tmp_path)
    corrupt_entry(dst, GATE, lambda e, n: e.update(data_offsets=[-1, 2047]))
    r = subprocess.run([sys.executable, "-m", "qwen3layer", "run", "--checkpoint", str(dst), "--layer", "0"],
                       cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert r.returncode == 2, r.stderr
    assert f"{dst / 'model.safetensors'}: {GATE}: data_offsets [-1, 2047]" in r.stderr


# ---- one entry of a valid header corrupted -------------------------------------------------

def corrupt_entry(path, name, change):
    """Rewrites model.safetensors with change(entry, data_size) applied to entry `name`."""
    shard = path / "model.safetensors"
    header, data = read_shard(shard)
    new = change(header[name], len(data))
    header[name] = header[name] if new is None else new
    write_shard(shard, header, data)
    return header


def offsets(value):
    def change(entry, size):
        entry["data_offsets"] = value(entry["data_offsets"], size) if callable(value) else value
    return change


def shape(value):
    def change(entry, size):
        entry["shape"] = value
    return change


ENTRY_CASES = {
    "offsets_near_int64_max": (offsets([2**63 - 1 - 20000, 0]), r"data_offsets \[9223372036854755807, 0\]"),
    "begin_after_end": (offsets(lambda o, n: [o[1], o[0]]), "begin after end"),
    "end_past_the_file": (offsets(lambda o, n: [n - 48, n + 48]), "past the end"),
    "negative_offsets": (offsets(lambda o, n: [-96, 0]), "negative"),
    "float_offsets": (offsets(lambda o, n: [float(o[0]), float(o[1])]), "expected two ints"),
    "str_offsets": (offsets(lambda o, n: [str(o[0]), str(o[1])]), "expected two ints"),
    "bool_offsets": (offsets([False, True]), "expected two ints"),
    "three_offsets": (offsets(lambda o, n: o + [o[1]]), "expected two ints"),
    "offsets_not_a_list": (offsets(96), "expected two ints"),
    "too_few_bytes_for_the_shape": (offsets(lambda o, n: [o[0], o[0] + 16]),
                                    r"hold 16 bytes, shape \[24\] of F32 needs 96"),
    "negative_dim": (shape([-24]), "non-negative"),
    "float_dim": (shape([24.0]), "non-negative ints"),
    "bool_dim": (shape([True]), "non-negative ints"),
    "shape_not_a_list": (shape(24), "non-negative ints"),
    "dims_overflow_int64": (shape([2**40, 2**40]), "int64"),
    "bytes_overflow_int64": (shape([2**62]), "int64"),
    "a_dim_past_int64_beside_a_zero": (shape([0, 2**70]), "int64"),       # fuzz_checkpoint's finding
    "strides_overflow_beside_a_zero": (shape([0, 2**40, 2**40]), "int64"),
    "too_many_dims": (shape([1] * 9 + [24]), "at most 8 dims"),
    "misaligned_offset": (offsets(lambda o, n: [o[0] + 2, o[1] + 2]), "multiple of 4"),
    "dtype_not_a_string": (lambda e, n: e.update(dtype=5), "dtype: expected a string"),
    "entry_a_list": (lambda e, n: [e["dtype"], e["shape"], e["data_offsets"]], "expected an object"),
    "entry_a_string": (lambda e, n: "F32", "expected an object"),
    "entry_without_dtype": (lambda e, n: e.pop("dtype") and None, "missing 'dtype'"),
    "entry_without_shape": (lambda e, n: e.pop("shape") and None, "missing 'shape'"),
    "entry_without_data_offsets": (lambda e, n: e.pop("data_offsets") and None, "missing 'data_offsets'"),
}


@pytest.mark.parametrize("case", sorted(ENTRY_CASES))
def test_a_corrupted_entry_is_refused_naming_file_and_tensor(single, tmp_path, case):
    change, match = ENTRY_CASES[case]
    dst = copy_of(single, tmp_path)
    corrupt_entry(dst, Q_NORM, change)
    expect(dst, str(dst / "model.safetensors"), Q_NORM, match=match)


def test_a_shape_over_too_few_bytes_gets_the_whole_story(single, tmp_path):
    dst = copy_of(single, tmp_path)
    begin = read_shard(dst / "model.safetensors")[0][GATE]["data_offsets"][0]
    corrupt_entry(dst, GATE, lambda e, n: e.update(shape=[64, 64], data_offsets=[begin, begin + 16]))
    assert expect(dst) == (f"{dst / 'model.safetensors'}: {GATE}: data_offsets [{begin}, {begin + 16}] hold 16 bytes, "
                           "shape [64, 64] of F32 needs 16384")


def test_two_tensors_overlapping_are_refused_naming_both(single, tmp_path):
    dst = copy_of(single, tmp_path)
    shard = dst / "model.safetensors"
    header, data = read_shard(shard)
    header[K_NORM]["data_offsets"] = list(header[Q_NORM]["data_offsets"])
    write_shard(shard, header, data)
    expect(dst, str(shard), Q_NORM, K_NORM, match="overlap")


def test_partly_overlapping_tensors_are_refused(single, tmp_path):
    dst = copy_of(single, tmp_path)
    shard = dst / "model.safetensors"
    header, data = read_shard(shard)
    b, e = header[Q_NORM]["data_offsets"]
    header[K_NORM]["data_offsets"] = [b + 48, e + 48]
    write_shard(shard, header, data)
    expect(dst, str(shard), Q_NORM, K_NORM, match="overlap")


def test_overlap_is_found_across_two_spellings_of_one_shard(single, tmp_path):
    """An index naming one file twice ("model.safetensors", "./model.safetensors") gets one
    mapping, and the overlap check sees both tensors."""
    dst = copy_of(single, tmp_path)
    shard = dst / "model.safetensors"
    header, data = read_shard(shard)
    header[K_NORM]["data_offsets"] = list(header[Q_NORM]["data_offsets"])
    write_shard(shard, header, data)
    weight_map = {name: "model.safetensors" for name in header if name != "__metadata__"}
    weight_map[K_NORM] = "./model.safetensors"
    set_index(dst, {"weight_map": weight_map})
    expect(dst, str(shard), Q_NORM, K_NORM, match="overlap")


def test_zero_length_tensors_never_overlap(single, tmp_path):
    """An empty tensor at the same offset as another is no overlap: the check gets as far as the
    engine, which wants a [24] q_norm."""
    dst = copy_of(single, tmp_path)
    shard = dst / "model.safetensors"
    header, data = read_shard(shard)
    b, _ = header[K_NORM]["data_offsets"]
    header[Q_NORM].update(shape=[0], data_offsets=[b, b])
    write_shard(shard, header, data)
    msg = expect(dst, kind=ValueError, match="q_norm")
    assert "overlap" not in msg


def test_unsupported_dtype_is_a_type_error_naming_file_and_tensor(single, tmp_path):
    dst = copy_of(single, tmp_path)
    corrupt_entry(dst, Q_NORM, lambda e, n: e.update(dtype="F64"))
    expect(dst, str(dst / "model.safetensors"), Q_NORM, kind=TypeError, match="expected dtype BF16, F32 or F16, got F64")
    expect(dst, kind=CheckpointError)  # a CheckpointError too


def test_bf16_offsets_need_2_byte_alignment(single, tmp_path):
    dst = copy_of(single, tmp_path)
    shard = dst / "model.safetensors"
    header, data = read_shard(shard)
    b, e = header[Q_NORM]["data_offsets"]
    header[Q_NORM].update(dtype="BF16", shape=[24], data_offsets=[b + 1, b + 49])
    write_shard(shard, header, data)
    expect(dst, str(shard), Q_NORM, match="multiple of 2")


# ---- the header as a whole ------------------------------------------------------------------

def crafted(tmp_path, single, content: bytes):
    """A checkpoint folder: the tiny config.json and a model.safetensors of `content`."""
    dst = tmp_path / "crafted"
    dst.mkdir()
    shutil.copy(single / "config.json", dst / "config.json")
    (dst / "model.safetensors").write_bytes(content)
    return dst


HEADER_CASES = {
    "a_json_list": (framed(b"[1, 2]"), "expected a JSON object"),
    "a_json_string": (framed(b'"model"'), "expected a JSON object"),
    "not_json": (framed(b"{not json"), "not valid JSON"),
    "not_utf8": (framed(b'{"\xff\xfe": 1}'), "not valid UTF-8"),
    "a_5000_digit_number": (framed(b'{"x": {"dtype": "F32", "shape": [1], "data_offsets": [0, '
                                   + b"9" * 5000 + b"]}}"), "not valid JSON"),
    "nested_100000_deep": (framed(b"[" * 100000 + b"]" * 100000), "not valid JSON"),
    "length_past_the_file": (framed(b"{}", b"", length=1000), "past the end"),
    "length_2_pow_63": (framed(b"{}", b"", length=2**63), "past the end"),
    "length_2_pow_64_minus_1": (framed(b"{}", b"", length=2**64 - 1), "past the end"),
    "shorter_than_8_bytes": (b"\x10\x00\x00", "no header"),
    "empty": (b"", "no header"),
}


@pytest.mark.parametrize("case", sorted(HEADER_CASES))
def test_a_bad_header_is_refused_naming_the_file(single, tmp_path, case):
    content, match = HEADER_CASES[case]
    dst = crafted(tmp_path, single, content)
    expect(dst, str(dst / "model.safetensors"), match=match)


def test_a_crafted_shard_with_a_bad_entry_names_the_tensor(single, tmp_path):
    """Written from scratch: the single file's header with every layer tensor listed, one of
    them reaching past the data."""
    header, data = read_shard(single / "model.safetensors")
    header[GATE]["data_offsets"] = [len(data), len(data) + 2048]
    dst = crafted(tmp_path, single, framed(header, data))
    expect(dst, str(dst / "model.safetensors"), GATE, match=f"past the end of the {len(data)} bytes of data")


# ---- the index and the shard paths ----------------------------------------------------------

INDEX = "model.safetensors.index.json"


def set_index(dst, text):
    (dst / INDEX).write_text(text if isinstance(text, str) else json.dumps(text))


def index_of(dst):
    return json.loads((dst / INDEX).read_text())


def point_layer_at(dst, shard_name, tensors=None):
    """Rewrites the index so that the layer's tensors (default: all) live in `shard_name`."""
    index = index_of(dst)
    for name in list(index["weight_map"]):
        if name.startswith("model.layers.0.") and (tensors is None or name in tensors):
            index["weight_map"][name] = shard_name
    set_index(dst, index)


@pytest.mark.parametrize("text, match", [
    ("{not json", "not valid JSON"),
    ("[1, 2]", "expected a JSON object"),
    ('{"metadata": {}}', "expected a \"weight_map\" object"),
    ('{"weight_map": ["model.safetensors"]}', "expected a \"weight_map\" object"),
], ids=["not_json", "a_list", "no_weight_map", "weight_map_a_list"])
def test_a_bad_index_is_refused_naming_it(sharded, tmp_path, text, match):
    dst = copy_of(sharded, tmp_path)
    set_index(dst, text)
    expect(dst, str(dst / INDEX), match=match)


def test_an_index_value_not_a_string_is_refused(sharded, tmp_path):
    dst = copy_of(sharded, tmp_path)
    index = index_of(dst)
    index["weight_map"][GATE] = 5
    set_index(dst, index)
    expect(dst, str(dst / INDEX), GATE, match="expected a shard file name")


@pytest.mark.parametrize("kind", ["dotdot", "absolute", "symlink_out"])
def test_a_shard_outside_the_folder_is_refused(single, sharded, tmp_path, kind):
    dst = copy_of(sharded, tmp_path)
    outside = tmp_path / "outside.safetensors"
    shutil.copy(single / "model.safetensors", outside)  # a valid shard holding the whole layer
    name = {"dotdot": "../outside.safetensors", "absolute": str(outside), "symlink_out": "link.safetensors"}[kind]
    if kind == "symlink_out":
        os.symlink(outside, dst / "link.safetensors")
    point_layer_at(dst, name)
    msg = expect(dst, str(dst / INDEX), name, match="outside the checkpoint folder")
    assert kind != "dotdot" or "'..'" in msg


def test_a_dotdot_that_comes_back_is_still_refused(sharded, tmp_path):
    dst = copy_of(sharded, tmp_path)
    shard = index_of(dst)["weight_map"][GATE]
    point_layer_at(dst, f"../{dst.name}/{shard}", tensors={GATE})
    expect(dst, str(dst / INDEX), GATE, f"../{dst.name}/{shard}", match="outside the checkpoint folder")


def test_a_symlink_inside_the_folder_is_followed(single, tmp_path):
    dst = copy_of(single, tmp_path)
    os.rename(dst / "model.safetensors", dst / "real.safetensors")
    os.symlink("real.safetensors", dst / "model.safetensors")
    layer = load(dst)
    assert layer.converted == ()


def test_a_hugging_face_cache_snapshot_loads_and_other_links_out_do_not(sharded, tmp_path):
    """A snapshot folder of the Hugging Face cache holds links into its repository's blobs/:
    those are followed; a link from it anywhere else is still refused."""
    repo = tmp_path / "models--org--name"
    snap, blobs = repo / "snapshots" / "0123abc", repo / "blobs"
    snap.mkdir(parents=True)
    blobs.mkdir()
    for f in os.listdir(sharded):
        shutil.copy(sharded / f, blobs / f"blob-{f}")
        os.symlink(os.path.join("..", "..", "blobs", f"blob-{f}"), snap / f)
    layer = load(snap)
    assert layer.converted == ()
    outside = tmp_path / "elsewhere"
    outside.mkdir()
    shard = index_of(snap)["weight_map"][GATE]
    shutil.copy(blobs / f"blob-{shard}", outside / shard)
    os.remove(snap / shard)
    os.symlink(outside / shard, snap / shard)
    expect(snap, str(snap / INDEX), shard, match="outside the checkpoint folder")


def test_a_fifo_named_as_shard_is_refused_without_opening_it(sharded, tmp_path):
    dst = copy_of(sharded, tmp_path)
    os.mkfifo(dst / "fifo.safetensors")
    point_layer_at(dst, "fifo.safetensors", tensors={GATE})
    with no_hang():
        expect(dst, str(dst / "fifo.safetensors"), match="not a regular file")


def test_a_fifo_named_config_or_single_shard_is_refused(single, tmp_path):
    dst = copy_of(single, tmp_path)
    os.remove(dst / "model.safetensors")
    os.mkfifo(dst / "model.safetensors")
    with no_hang():
        expect(dst, str(dst / "model.safetensors"), match="not a regular file")
    os.remove(dst / "config.json")
    os.mkfifo(dst / "config.json")
    with no_hang():
        expect(dst, str(dst / "config.json"), match="not a regular file")


def test_a_directory_named_as_shard_is_refused(sharded, tmp_path):
    dst = copy_of(sharded, tmp_path)
    (dst / "sub.safetensors").mkdir()
    point_layer_at(dst, "sub.safetensors", tensors={GATE})
    expect(dst, str(dst / "sub.safetensors"), match="not a regular file")


@pytest.mark.parametrize("name", ["nope.safetensors", "", "a\x00b.safetensors"], ids=["missing", "empty", "nul"])
def test_a_missing_or_unusable_shard_name_is_refused(sharded, tmp_path, name):
    dst = copy_of(sharded, tmp_path)
    point_layer_at(dst, name, tensors={GATE})
    msg = expect(dst, GATE)
    if name == "nope.safetensors":
        assert str(dst / name) in msg and "missing" in msg


# ---- config.json ----------------------------------------------------------------------------

@pytest.mark.parametrize("text, match", [("{not json", "not valid JSON"), ("[64, 8]", "expected a JSON object"),
                                         ("\"qwen3_moe\"", "expected a JSON object")],
                         ids=["not_json", "a_list", "a_string"])
def test_a_bad_config_is_refused_naming_it(single, tmp_path, text, match):
    dst = copy_of(single, tmp_path)
    (dst / "config.json").write_text(text)
    expect(dst, str(dst / "config.json"), match=match)


@pytest.mark.parametrize("key", ["num_local_experts", "num_experts"])
def test_a_billion_experts_is_refused_before_any_per_expert_list(single, tmp_path, key, monkeypatch):
    dst = copy_of(single, tmp_path)
    cfg = json.loads((dst / "config.json").read_text())
    cfg.pop("num_local_experts", None)
    cfg[key] = 10**9
    (dst / "config.json").write_text(json.dumps(cfg))
    import qwen3layer.checkpoint as ck

    def no_list(fmt, cfg, experts=None):
        raise AssertionError(f"the table of {cfg.num_experts} experts built")
    monkeypatch.setattr(ck, "_wanted", no_list)
    with pytest.raises(ValueError, match="num_experts"):
        load(dst)


def test_num_hidden_layers_not_an_int_is_refused(single, tmp_path):
    dst = copy_of(single, tmp_path)
    cfg = json.loads((dst / "config.json").read_text())
    cfg["num_hidden_layers"] = "2"
    (dst / "config.json").write_text(json.dumps(cfg))
    expect(dst, str(dst / "config.json"), match="num_hidden_layers")
