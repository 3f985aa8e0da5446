"""Every Qwen3-MoE config field is honoured, refused by name or without effect on the layer
(issue 21): docs/config_fields.md's tables against transformers' classes (5.24's fields and
RoPE keys, 4.57's constructor), each refusal with the field and value in its message (config
objects, config.json dicts, the layers of a model, patch_model), the fields of no effect
accepted without changing the LayerConfig, and the honoured ones read with the class's
defaults in both versions."""
import dataclasses
import inspect
import os
import re

import pytest
import torch
import transformers
from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

import qwen3layer as q3

V5 = int(transformers.__version__.split(".")[0]) >= 5
DOC = os.path.join(os.path.dirname(__file__), "..", "..", "docs", "config_fields.md")
transformers.logging.set_verbosity_error()

GEOMETRY = dict(hidden_size=64, num_attention_heads=8, num_key_value_heads=2, head_dim=16, num_experts=8,
                num_experts_per_tok=2, moe_intermediate_size=32)


def doc_tables() -> dict:
    """section title -> {field: (effect, what happens)} of docs/config_fields.md"""
    tables, section = {}, None
    with open(DOC) as f:
        for line in f:
            if line.startswith("## "):
                section = line[3:].strip()
            m = re.match(r"\| `(\w+)` \| ([^|]+) \| (.+) \|$", line.strip())
            if m and section:
                tables.setdefault(section, {})[m[1]] = (m[2].strip(), m[3].strip())
    return tables


TABLES = doc_tables()
OWN, BASE, BESIDE, ROPE = (TABLES[k] for k in ("Qwen3MoeConfig's own fields", "PreTrainedConfig's fields",
                                               "Keys read beside the declared fields",
                                               "The RoPE keys (`rope_parameters`, or `rope_scaling` beside `rope_theta`)"))


def test_every_row_says_honoured_refused_or_no_effect():
    for table in TABLES.values():
        for field, (effect, _) in table.items():
            assert effect.startswith(("honoured", "refused", "no effect")), (field, effect)


@pytest.mark.skipif(not V5, reason="the 5.x classes are dataclasses")
def test_tables_list_exactly_the_5x_fields():
    """Qwen3MoeConfig's own dataclass fields, PreTrainedConfig's, and RopeParameters' keys:
    each in its table, and every row a field of the class."""
    base = {f.name for f in dataclasses.fields(transformers.PreTrainedConfig)}
    own = {f.name for f in dataclasses.fields(Qwen3MoeConfig)} - base
    assert set(OWN) == own
    assert set(BASE) == base
    from transformers.modeling_rope_utils import RopeParameters

    assert set(ROPE) == set(RopeParameters.__annotations__) | {"type"}


@pytest.mark.skipif(V5, reason="4.57's class takes its fields as constructor arguments")
def test_tables_cover_the_457_constructor():
    params = set(inspect.signature(Qwen3MoeConfig.__init__).parameters) - {"self", "kwargs"}
    assert params <= set(OWN) | set(BESIDE)
    assert params - {"rope_theta", "rope_scaling"} == set(OWN) - {"rope_parameters", "pad_token_id", "bos_token_id",
                                                                  "eos_token_id"}


def test_keys_read_beside_the_fields_are_transformers_own():
    """Each such key is read by transformers' qwen3_moe, its RoPE or its config code, but the
    one the table says qwen3_moe does not read, which it does not."""
    import transformers.configuration_utils as cu
    import transformers.modeling_rope_utils as ru
    import transformers.models.qwen3_moe.configuration_qwen3_moe as qc
    import transformers.models.qwen3_moe.modeling_qwen3_moe as qm

    qwen3_moe = inspect.getsource(qm) + inspect.getsource(qc)
    everywhere = qwen3_moe + inspect.getsource(cu) + inspect.getsource(ru)
    for key, (_, what) in BESIDE.items():
        if key == "num_local_experts" and not V5:  # 5.x's spelling
            continue
        if "not read by transformers' qwen3_moe" in what:
            assert key not in qwen3_moe, key
        else:
            assert key in everywhere, key


# ---- refusals --------------------------------------------------------------------------

# field -> (config changes, the message's pattern, layer_idx)
REFUSALS = {
    "hidden_act": (dict(hidden_act="gelu"), r"config.hidden_act: expected 'silu' .*, got 'gelu'", None),
    "attention_bias": (dict(attention_bias=True), r"config.attention_bias: expected False .*, got True", None),
    "use_sliding_window": (dict(use_sliding_window=True, sliding_window=128),
                           r"config.sliding_window: a sliding window of 128 tokens \(use_sliding_window=True\) is "
                           r"not implemented", None),
    "sliding_window": (dict(use_sliding_window=True),
                       r"config.sliding_window: a sliding window of 4096 tokens \(use_sliding_window=True\)", None),
    "mlp_only_layers": (dict(mlp_only_layers=[0, 2], num_hidden_layers=3),
                        r"config.mlp_only_layers: layer 2 is in it \(\[0, 2\]\), so it is a dense Qwen3MoeMLP layer", 2),
    "decoder_sparse_step": (dict(decoder_sparse_step=2, num_hidden_layers=2),
                            r"config.decoder_sparse_step: 2 makes layer 0 a dense Qwen3MoeMLP layer \(\(layer_idx \+ 1\)"
                            r" % decoder_sparse_step = 1, not 0\)", 0),
    "partial_rotary_factor": (dict(partial_rotary_factor=0.5),
                              r"partial_rotary_factor'?\]?: expected 1 \(RoPE over all of head_dim.*got 0.5", None),
}


def test_every_refused_field_has_a_case():
    refused = {f for t in TABLES.values() for f, (effect, _) in t.items() if effect.startswith("refused")}
    assert refused == set(REFUSALS)  # the RoPE's are test_rope_scaling.py's


@pytest.mark.parametrize("field", REFUSALS)
def test_refused_in_a_config_object_and_a_config_json(field):
    change, match, idx = REFUSALS[field]
    hc = Qwen3MoeConfig(**GEOMETRY, **change)
    raw = dict(GEOMETRY, **change)
    for source in (hc, raw):
        with pytest.raises(ValueError, match=match):
            q3.LayerConfig.from_hf(source, layer_idx=idx)
    if idx is not None:  # the other layers are sparse: taken
        other = 1
        q3.LayerConfig.from_hf(hc, layer_idx=other)
        q3.LayerConfig.from_hf(hc)  # without the index, nothing is known of the layer


@pytest.mark.parametrize("field", ["hidden_act", "attention_bias", "use_sliding_window", "mlp_only_layers",
                                   "decoder_sparse_step"])
def test_refused_when_a_layer_is_taken_and_at_patch_time(field):
    """DecoderLayer.from_hf reads the layer's index; patch_model raises at the model's first
    refused layer, before it swaps any."""
    change, match, idx = REFUSALS[field]
    torch.manual_seed(0)
    model = Qwen3MoeForCausalLM(Qwen3MoeConfig(**GEOMETRY, **(dict(num_hidden_layers=3) | change),
                                               vocab_size=16, intermediate_size=64)).eval()
    layer = model.model.layers[idx if idx is not None else 0]
    with pytest.raises(ValueError, match=match):
        q3.DecoderLayer.from_hf(layer)
    import qwen3layer.torch as qt

    with pytest.raises(ValueError, match=re.escape(match.split(":")[0])):  # the model's first refused layer
        qt.patch_model(model)
    assert all(type(m).__name__ == "Qwen3MoeDecoderLayer" for m in model.model.layers)  # none swapped


def test_dense_layers_named_with_their_index_and_sparse_ones_taken():
    """mlp_only_layers [1] and decoder_sparse_step 1: layers 0 and 2 are MoE layers and are taken,
    layer 1 is refused naming itself."""
    torch.manual_seed(0)
    model = Qwen3MoeForCausalLM(Qwen3MoeConfig(**GEOMETRY, num_hidden_layers=3, mlp_only_layers=[1], vocab_size=16,
                                               intermediate_size=64)).eval()
    for i in (0, 2):
        assert q3.DecoderLayer.from_hf(model.model.layers[i]).config == q3.LayerConfig.from_hf(model.config)
    with pytest.raises(ValueError, match=r"layer 1 is in it \(\[1\]\)"):
        q3.DecoderLayer.from_hf(model.model.layers[1])


@pytest.mark.parametrize("change,match", [
    (dict(decoder_sparse_step=0), r"config.decoder_sparse_step: expected a positive int, got 0"),
    (dict(mlp_only_layers="0"), r"config.mlp_only_layers: expected a list of layer indices, got '0'"),
])
def test_refused_layer_rules(change, match):
    with pytest.raises(ValueError, match=match):
        q3.LayerConfig.from_hf(dict(GEOMETRY, **change), layer_idx=0)


@pytest.mark.parametrize("idx", [-1, 1.0, True, "0"])
def test_refused_layer_idx(idx):
    with pytest.raises(ValueError, match=rf"layer_idx: expected an int >= 0 or None, got {re.escape(repr(idx))}"):
        q3.LayerConfig.from_hf(GEOMETRY, layer_idx=idx)


def test_a_window_without_use_sliding_window_has_no_effect():
    """The class drops sliding_window unless use_sliding_window (both versions); so does the
    reader of a config.json."""
    assert q3.LayerConfig.from_hf(dict(GEOMETRY, sliding_window=128)) == q3.LayerConfig.from_hf(GEOMETRY)
    assert q3.LayerConfig.from_hf(Qwen3MoeConfig(**GEOMETRY, sliding_window=128)) == q3.LayerConfig.from_hf(GEOMETRY)
    assert q3.LayerConfig.from_hf(dict(GEOMETRY, use_sliding_window=True, sliding_window=None)) == \
        q3.LayerConfig.from_hf(GEOMETRY)


# ---- fields of no effect and honoured ones -------------------------------------------------

NO_EFFECT_VALUES = dict(vocab_size=7, intermediate_size=12, num_hidden_layers=5, max_position_embeddings=1000,
                        initializer_range=0.5, use_cache=False, tie_word_embeddings=True, attention_dropout=0.3,
                        output_router_logits=True, router_aux_loss_coef=0.5, pad_token_id=3, bos_token_id=1,
                        eos_token_id=2, max_window_layers=2, torch_dtype="float16", model_type="qwen3_moe",
                        architectures=["Qwen3MoeForCausalLM"], transformers_version="4.51.0",
                        output_hidden_states=True, return_dict=False, chunk_size_feed_forward=3,
                        is_encoder_decoder=False, problem_type="regression", dtype="float16")


def test_every_field_of_no_effect_is_accepted_and_changes_nothing():
    """Each no-effect field of the tables at a non-default value: the same LayerConfig (but
    max_position_embeddings, which LayerConfig keeps; it changes no table of the default RoPE)."""
    none = {f for t in (OWN, BASE, BESIDE) for f, (effect, _) in t.items() if effect == "no effect"}
    assert none - {"id2label", "label2id"} == set(NO_EFFECT_VALUES)
    base = q3.LayerConfig.from_hf(GEOMETRY)
    for field, value in NO_EFFECT_VALUES.items():
        got = q3.LayerConfig.from_hf(dict(GEOMETRY, **{field: value}), layer_idx=0)
        want = dataclasses.replace(base, max_position_embeddings=value) if field == "max_position_embeddings" else base
        assert got == want, field
        assert q3._C.rope_table(got) == q3._C.rope_table(base)
    hc = Qwen3MoeConfig(**GEOMETRY, **{k: v for k, v in NO_EFFECT_VALUES.items()
                                       if k in OWN and k != "max_position_embeddings"})
    assert q3.LayerConfig.from_hf(hc, layer_idx=0) == dataclasses.replace(base, max_position_embeddings=32768)


def test_honoured_fields_with_the_class_defaults():
    """A config object and a dict without the optional fields give the class's defaults in both
    versions: norm_topk_prob False, rms_norm_eps 1e-6, rope_theta 10000, max_position_embeddings
    32768, the default RoPE, head_dim hidden // heads."""
    sparse = {k: v for k, v in GEOMETRY.items() if k != "head_dim"}
    for source in (Qwen3MoeConfig(**sparse), sparse):
        cfg = q3.LayerConfig.from_hf(source)
        assert (cfg.norm_topk_prob, cfg.rms_norm_eps, cfg.rope_theta, cfg.max_position_embeddings, cfg.rope_type,
                cfg.head_dim) == (False, 1e-6, 10000.0, 32768, "default", 8)
    assert Qwen3MoeConfig().norm_topk_prob is False
    cfg = q3.LayerConfig.from_hf(Qwen3MoeConfig(**GEOMETRY, norm_topk_prob=True, rms_norm_eps=1e-5, rope_theta=5e6))
    assert (cfg.norm_topk_prob, cfg.rms_norm_eps, cfg.rope_theta) == (True, 1e-5, 5e6)
    assert q3.LayerConfig.from_hf(dict(GEOMETRY, num_experts=None, num_local_experts=8)).num_experts == 8


# Qwen/Qwen3-235B-A22B's config.json, and its YaRN form from the model card
REAL = {"architectures": ["Qwen3MoeForCausalLM"], "attention_bias": False, "attention_dropout": 0.0,
        "bos_token_id": 151643, "decoder_sparse_step": 1, "eos_token_id": 151645, "head_dim": 128,
        "hidden_act": "silu", "hidden_size": 4096, "initializer_range": 0.02, "intermediate_size": 12288,
        "max_position_embeddings": 40960, "max_window_layers": 94, "mlp_only_layers": [], "model_type": "qwen3_moe",
        "moe_intermediate_size": 1536, "norm_topk_prob": True, "num_attention_heads": 64, "num_experts": 128,
        "num_experts_per_tok": 8, "num_hidden_layers": 94, "num_key_value_heads": 4, "output_router_logits": False,
        "rms_norm_eps": 1e-06, "rope_scaling": None, "rope_theta": 1000000.0, "router_aux_loss_coef": 0.001,
        "sliding_window": None, "tie_word_embeddings": False, "torch_dtype": "bfloat16",
        "transformers_version": "4.51.0", "use_cache": True, "use_sliding_window": False, "vocab_size": 151936}


def test_the_real_config_json_and_its_yarn_form():
    assert q3.LayerConfig.from_hf(REAL, layer_idx=93) == q3.LayerConfig.qwen3_235b_a22b()
    yarn = dict(REAL, rope_scaling={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768})
    cfg = q3.LayerConfig.from_hf(yarn)
    assert cfg == dataclasses.replace(q3.LayerConfig.qwen3_235b_a22b(), rope_type="yarn", rope_factor=4.0,
                                      rope_original_max_position_embeddings=32768)
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeRotaryEmbedding

    emb = Qwen3MoeRotaryEmbedding(Qwen3MoeConfig.from_dict(yarn))
    inv_freq, scale = q3._C.rope_table(cfg)
    assert max(abs(a - b) / b for a, b in zip(inv_freq, emb.inv_freq.tolist())) <= 2 ** -22
    assert scale == float(torch.tensor(emb.attention_scaling, dtype=torch.float32))


def test_from_checkpoint_refuses_a_dense_layer_before_reading_shards(tmp_path):
    import json

    from qwen3layer.checkpoint import CheckpointError

    (tmp_path / "config.json").write_text(json.dumps(dict(GEOMETRY, num_hidden_layers=2, mlp_only_layers=[1])))
    with pytest.raises(CheckpointError, match=r"config.json: config.mlp_only_layers: layer 1 is in it \(\[1\]\)"):
        q3.DecoderLayer.from_checkpoint(str(tmp_path), 1)
