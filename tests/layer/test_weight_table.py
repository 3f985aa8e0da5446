"""The engine's one table of a layer's tensors (_C.weight_table): the names, shapes and storage a
layer reads, per weight format. Random weights, a layer's construction and the Python name
matching all follow it, so what it lists is what each of them makes, takes and expects."""
import ctypes
import gc

import pytest

import qwen3layer as q3
from qwen3layer import _C
from qwen3layer.weights import canonical_weights, names, scales

CFG = q3.LayerConfig.tiny()
FP8 = "fp8_e4m3_block128"
DTYPE_OF = {"layer": "bfloat16", "e4m3": "float8_e4m3fn", "scale": "float32", "qweight": "int32", "gscales": "float16",
            "qzeros": "int32", "g_idx": "int32"}
# GPTQ's groups of 128 inputs need every matrix's inputs a multiple of 128 (the tiny geometry's are not)
GPTQ_CFG = q3.LayerConfig(hidden_size=128, num_attention_heads=2, num_key_value_heads=1, head_dim=64, num_experts=8,
                          num_experts_per_tok=2, moe_intermediate_size=128)


def cfg_of(fmt):
    return GPTQ_CFG if fmt == "gptq_int4" else CFG


def test_the_formats_are_the_tables_rows():
    assert _C.weight_formats() == ("dense", FP8, "gptq_int4")
    with pytest.raises(ValueError, match=r"weight_format: expected None, 'dense', 'fp8_e4m3_block128' or 'gptq_int4', "
                                         r"got 'int3'"):
        _C.weight_table(CFG, "int3")


@pytest.mark.parametrize("fmt", _C.weight_formats())
@pytest.mark.parametrize("experts", [None, [1, 5]], ids=["fused", "a subset per expert"])
def test_random_weights_are_the_table_in_its_order(fmt, experts):
    """random_weights makes exactly the table's tensors, in its order, of its shapes and of the
    dtype each entry's storage says (every expert: fused; a subset: per expert)"""
    table = _C.weight_table(cfg_of(fmt), fmt, experts, experts is None)
    got = _C.random_weights(cfg_of(fmt), 3, "bfloat16", fmt, experts)
    assert list(got) == [name for name, *_ in table]
    for name, shape, storage, of in table:
        assert tuple(got[name].shape) == shape and got[name].dtype == DTYPE_OF[storage], name
        assert (of >= 0) == (storage in ("scale", "gscales", "qzeros", "g_idx")), name  # what stands beside a matrix


@pytest.mark.parametrize("fmt", _C.weight_formats())
def test_random_weights_lie_in_one_block_in_table_order(fmt):
    """random_weights' tensors are views of one block (q3_weight_table_layout: tensors too small
    for huge pages of their own share the block's): each starts on a 64-byte boundary right
    after the one before it, none overlaps another, and a tensor kept alone keeps its values
    (the block lives while any view does)"""
    table = _C.weight_table(cfg_of(fmt), fmt, None, True)
    got = _C.random_weights(cfg_of(fmt), 3, "bfloat16", fmt)
    spans = [(t.data_ptr, t.data_ptr + t.nbytes, name) for name, t in got.items()]
    assert [name for *_, name in spans] == [name for name, *_ in table]
    assert all("view" in repr(t) for t in got.values())
    for (start, end, name), (nxt, _, after) in zip(spans, spans[1:]):
        assert start % 64 == 0 and end <= nxt, (name, after)
        assert nxt - end < 64, f"{after} does not follow {name} ({nxt - end} bytes between)"
    kept = got[spans[-1][2]]
    expected = bytes((ctypes.c_char * kept.nbytes).from_address(kept.data_ptr))
    del got
    gc.collect()
    assert bytes((ctypes.c_char * kept.nbytes).from_address(kept.data_ptr)) == expected


def test_a_scale_follows_its_matrix_with_the_block_shape():
    """each FP8 matrix is followed by its scale_inv, one entry per 128 x 128 block of each
    matrix it holds (a fused gate_up_proj: the gate's blocks, then the up's)"""
    big = q3.LayerConfig(hidden_size=256, num_attention_heads=4, num_key_value_heads=2, head_dim=64, num_experts=4,
                         num_experts_per_tok=2, moe_intermediate_size=200)
    for fused in (False, True):
        table = _C.weight_table(big, FP8, None, fused)
        for i, (name, shape, storage, of) in enumerate(table):
            if storage != "scale":
                continue
            m_name, m_shape, m_storage, _ = table[of]
            assert of == i - 1 and m_storage == "e4m3" and name == m_name + "_scale_inv"
            parts = 2 if m_name == "mlp.experts.gate_up_proj" else 1
            rows = m_shape[-2] // parts
            assert shape == m_shape[:-2] + (parts * -(-rows // 128), -(-m_shape[-1] // 128)), name
    assert dict(scales(big, FP8, None, True))["mlp.experts.gate_up_proj_scale_inv"] == "mlp.experts.gate_up_proj"
    assert scales(big, "dense") == {}


def test_the_table_lists_the_held_experts_only_and_the_experts_alone():
    per_expert = names(CFG, "dense", [2], experts_only=True)
    assert per_expert == [f"mlp.experts.2.{p}.weight" for p in ("gate_proj", "up_proj", "down_proj")]
    assert names(CFG, "dense", [], True, True) == ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]
    dense = names(CFG, "dense", [])
    assert dense[0] == "input_layernorm.weight" and len(dense) == 9 and not any("experts" in n for n in dense)


@pytest.mark.parametrize("fmt", _C.weight_formats())
def test_name_matching_expects_the_tables_names(fmt):
    """canonical_weights takes the table's names, with a prefix or without, and names the first
    missing one in the table's order"""
    cfg = cfg_of(fmt)
    w = _C.random_weights(cfg, 4, "bfloat16", fmt)
    assert list(canonical_weights({f"model.layers.3.{n}": t for n, t in w.items()}, cfg)) == list(w)
    first = names(cfg, fmt, None, True)[1]
    del w[first]
    with pytest.raises(ValueError, match=f"weights: missing '{first}'"):
        canonical_weights(w, cfg)
