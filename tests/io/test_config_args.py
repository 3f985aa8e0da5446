"""A LayerConfig's fields as the engine checks them (csrc/engine/config.c q3_config_make: the glue,
csrc/python/py_config.c, converts each attribute by one table and checks nothing the engine
checks): each count once, in [1, its limit], named "config.<field>" with the value given; past
int64 the conversion names it the same way; the RoPE variants by the engine's names."""
import dataclasses

import pytest

import qwen3layer as q3
from qwen3layer import _C

CFG = q3.LayerConfig.tiny()


def refused(**fields):
    with pytest.raises((ValueError, TypeError)) as e:
        q3.LayerConfig(**(dataclasses.asdict(CFG) | fields))
    return e.type, str(e.value)


@pytest.mark.parametrize("field, limit", [("hidden_size", 1 << 20), ("num_attention_heads", 1 << 12),
                                          ("num_experts", 1 << 12), ("max_position_embeddings", 1 << 40)])
def test_each_count_is_checked_once_and_named_as_a_field(field, limit):
    assert refused(**{field: limit + 1}) == (ValueError, f"config.{field}: expected at most {limit}, got {limit + 1}")
    assert refused(**{field: 2**63}) == (ValueError, f"config.{field}: expected at most {limit}, got {2**63}")
    assert refused(**{field: -7}) == (ValueError, f"config.{field}: expected a positive integer, got -7")
    assert refused(**{field: -2**64}) == (ValueError, f"config.{field}: expected a positive integer, got {-2**64}")
    assert refused(**{field: 2.0}) == (TypeError, f"config.{field}: expected an int, got float")


def test_original_max_none_is_unset_and_a_given_one_is_checked():
    yarn = dict(rope_type="yarn", rope_factor=4.0)
    assert q3.LayerConfig(**(dataclasses.asdict(CFG) | yarn)).rope_original_max_position_embeddings is None
    name = "rope_original_max_position_embeddings"
    assert refused(**yarn, **{name: 0}) == (ValueError, f"config.{name}: expected a positive integer, got 0")
    assert refused(**yarn, **{name: 2**41}) == (ValueError, f"config.{name}: expected at most {2**40}, got {2**41}")


def test_rope_types_are_the_engines():
    assert refused(rope_type="ntk") == (ValueError, "config.rope_type: expected 'default', 'linear' or 'yarn', "
                                                    "got 'ntk'")
    for name in ("default", "linear", "yarn"):
        factor = 1.0 if name == "default" else 2.0
        assert q3.LayerConfig(**(dataclasses.asdict(CFG) | dict(rope_type=name, rope_factor=factor))).rope_type == name


def test_rope_defaults_are_the_engines_unused_values():
    assert _C.rope_defaults() == {
        "rope_type": "default", "rope_factor": 1.0, "rope_original_max_position_embeddings": None,
        "rope_attention_factor": None, "rope_beta_fast": 32.0, "rope_beta_slow": 1.0, "rope_mscale": None,
        "rope_mscale_all_dim": None, "rope_truncate": True}
