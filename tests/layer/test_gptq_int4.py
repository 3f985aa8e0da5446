"""GPTQ int4 layers (weight_format gptq_int4) against transformers' layer run on the
dequantized weights, the packing read by tests/helpers/gptq_reference.py (written from the
packing rules, not from the library): fp32 layers to 1e-5 of a float64 run, bf16 layers within
twice transformers' own bf16 error. Projections of normal(0, 1/sqrt(fan_in)) scale, so that a
misread nibble, zero or group shows. And the refusals of what a file may hold."""
import pytest
import torch

import qwen3layer as q3
import qwen3layer.testing
from gptq_reference import dequantize, gptq_model, prefill_then_decode_error, quantize, random_model, unpack
from hf_reference import converted, draw_input, rel_err, run

BEST = q3.build_info()["cpu_paths"][-1]
# every matrix's inputs a multiple of the group (128) and its outputs of 8
G128 = dict(hidden_size=256, num_attention_heads=4, num_key_value_heads=2, head_dim=64, num_experts=6,
            num_experts_per_tok=2, moe_intermediate_size=128, norm_topk_prob=True)


@pytest.fixture(autouse=True, params=sorted({"portable", BEST}))
def cpu_path(request):
    """Every test runs on the portable C kernels and on the best path of this CPU."""
    q3.set_cpu_path(request.param)
    yield request.param
    q3.set_cpu_path(BEST)


def gptq_pair(seed, desc_act=False, dtype=torch.float32, **quant):
    """(fp32 model holding the dequantized weights, the GPTQ tensors), norms and router of dtype;
    quant: gptq_model's group, v1, sym"""
    model = random_model(G128, seed)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(p.to(dtype).float())
    tensors = gptq_model(model, desc_act=desc_act, seed=seed, **quant)
    return model, {k: v.to(dtype) if v.is_floating_point() and v.dtype != torch.float16 else v
                   for k, v in tensors.items()}


@pytest.mark.parametrize("desc_act", [False, True])
def test_float32_gptq_layer_matches_float64_on_the_dequantized_weights(desc_act):
    """prefill of two sequences, then a decode step each, against fp64 over every position;
    desc_act: each matrix's g_idx a permutation of its groups (the kernels read g_idx)"""
    model, tensors = gptq_pair(3, desc_act)
    layer = q3.DecoderLayer(q3.LayerConfig.from_hf(model.config), tensors, weight_format="gptq_int4")
    assert layer.weight_format == "gptq_int4" and layer.dtype == "float32" and layer.converted == ()
    S = 13
    x = draw_input(model, (2, S + 1, G128["hidden_size"]), seed=1)
    exact = run(converted(model, torch.float64), x.double())
    cache = layer.new_cache(32, batch=2)
    y = layer.prefill(x[:, :S].contiguous(), cache)
    y_dec = layer.decode(x[:, S].contiguous(), cache)
    assert rel_err(y - x[:, :S], exact.y[:, :S] - x[:, :S].double()) <= 1e-5  # the layer's own update
    assert rel_err(y_dec, exact.y[:, S]) <= 1e-5
    for b in range(2):
        assert rel_err(torch.from_dlpack(cache.keys(b)), exact.keys[b]) <= 1e-5


def test_bfloat16_gptq_layer_error_at_most_twice_transformers():
    """bf16 activations, norms and router: judged with transformers' bf16 layer on the
    dequantized weights (rounded to bf16) against fp64"""
    model, tensors = gptq_pair(4, dtype=torch.bfloat16)
    layer = q3.DecoderLayer(q3.LayerConfig.from_hf(model.config), tensors, weight_format="gptq_int4")
    assert layer.dtype == "bfloat16" and layer.converted == ()
    x = draw_input(model, (1, 18, G128["hidden_size"]), seed=2, dtype=torch.bfloat16)
    q3.testing.assert_matches(layer, model.model.layers[0], x, torch.bfloat16, calls=(17, 1))


def test_bfloat16_gptq_decode_steps_error_at_most_twice_transformers():
    """decode steps of a bf16 layer (on avx512bf16, the VNNI GEMV holding x as two 8-bit digits
    a block of 128 inputs: kernels/cpu/matmul_int4_vnni.c), judged as above step by step"""
    model, tensors = gptq_pair(7, dtype=torch.bfloat16)
    layer = q3.DecoderLayer(q3.LayerConfig.from_hf(model.config), tensors, weight_format="gptq_int4")
    x = draw_input(model, (2, 9, G128["hidden_size"]), seed=6, dtype=torch.bfloat16)
    q3.testing.assert_matches(layer, model.model.layers[0], x, torch.bfloat16, calls=(3, 1, 1, 1, 1, 1, 1))


def test_a_long_prefill_takes_the_chunked_kernel_with_the_same_numbers():
    """40 tokens a pass (the prefill kernel, from 16 rows) against fp64"""
    model, tensors = gptq_pair(5)
    layer = q3.DecoderLayer(q3.LayerConfig.from_hf(model.config), tensors, weight_format="gptq_int4")
    x = draw_input(model, (1, 40, G128["hidden_size"]), seed=3)
    exact = run(converted(model, torch.float64), x.double())
    y = layer.prefill(x, layer.new_cache(40))
    assert rel_err(y - x, exact.y - x.double()) <= 1e-5


def test_random_gptq_weights_are_the_dense_draws_rounded_to_nearest():
    """DecoderLayer.random(weight_format='gptq_int4'): the dense layer's draws of the same
    seed, quantized by RTN in the v1 layout: each weight within half a scale of its draw, zeros
    stored as 7, g_idx k // 128; and the layer equals transformers on the dequantized weights"""
    cfg = q3.LayerConfig(**{**G128, "num_experts": 4})
    dense = {k: torch.from_dlpack(v) for k, v in q3._C.random_weights(cfg, 7, "float32", None, [0, 1, 2, 3]).items()}
    gptq = {k: torch.from_dlpack(v) for k, v in q3._C.random_weights(cfg, 7, "float32", "gptq_int4").items()}
    for module in ("self_attn.o_proj", "mlp.experts.2.down_proj"):
        t = {n: gptq[f"{module}.{n}"] for n in ("qweight", "qzeros", "scales", "g_idx")}
        assert (unpack(t["qzeros"], 1) == 7).all()
        assert torch.equal(t["g_idx"], (torch.arange(t["g_idx"].numel()) // 128).to(torch.int32))
        w, w_q = dense[f"{module}.weight"], dequantize(t)
        half = t["scales"].float()[t["g_idx"].long()].t() / 2
        assert ((w - w_q).abs() <= half * 1.01).all()  # (the top of the range, +7.5 steps, clamps to +7)
        assert torch.equal(quantize(w, 128)["qweight"], t["qweight"])  # the same rounding, independently
    layer = q3.DecoderLayer.random(cfg, 7, "float32", weight_format="gptq_int4")
    assert layer.weight_format == "gptq_int4"
    with torch.no_grad():
        ref = {k: v for k, v in dense.items()}
        for name in list(ref):
            if name.endswith("proj.weight"):
                module = name[:-len(".weight")]
                ref[name] = dequantize({n: gptq[f"{module}.{n}"] for n in ("qweight", "qzeros", "scales", "g_idx")})
    twin = q3.DecoderLayer(cfg, ref)
    x = torch.randn(1, 5, cfg.hidden_size, generator=torch.Generator().manual_seed(1))
    y, y_ref = layer.prefill(x, layer.new_cache(8)), twin.prefill(x, twin.new_cache(8))
    assert rel_err(torch.from_dlpack(y) - x, torch.from_dlpack(y_ref) - x) <= 1e-5


def _layer(tensors, cfg=None):
    return q3.DecoderLayer(cfg or q3.LayerConfig(**G128), tensors, weight_format="gptq_int4")


@pytest.fixture(scope="module")
def good():
    _, tensors = gptq_pair(6)
    return tensors


@pytest.mark.parametrize("what,change,message", [
    ("g_idx out of range", lambda t: t["self_attn.k_proj.g_idx"].__setitem__(5, 2),
     r"self_attn.k_proj.g_idx: expected groups in \[0, 2\), got 2 at input 5"),
    ("negative g_idx", lambda t: t["mlp.experts.3.down_proj.g_idx"].__setitem__(0, -1),
     r"mlp.experts.3.down_proj.g_idx: expected groups in \[0, 1\), got -1 at input 0"),
    ("NaN scale", lambda t: t["self_attn.q_proj.scales"].__setitem__((1, 3), float("nan")),
     r"self_attn.q_proj.scales: expected finite scales, got NaN at \[1, 3\]"),
    ("Inf scale", lambda t: t["mlp.experts.0.up_proj.scales"].__setitem__((0, 0), float("inf")),
     r"mlp.experts.0.up_proj.scales: expected finite scales, got Inf at \[0, 0\]"),
])
def test_values_a_file_may_hold_are_checked_before_any_work(good, what, change, message):
    tensors = {k: v.clone() for k, v in good.items()}
    change(tensors)
    with pytest.raises(ValueError, match=message):
        _layer(tensors)


def test_tensors_of_another_dtype_shape_or_name_are_refused(good):
    t = dict(good, **{"self_attn.q_proj.qweight": good["self_attn.q_proj.qweight"].float()})
    with pytest.raises(TypeError, match=r"weights\['self_attn.q_proj.qweight'\]: expected dtype int32, got float32"):
        _layer(t)
    t = dict(good, **{"self_attn.q_proj.scales": good["self_attn.q_proj.scales"].float()})
    with pytest.raises(TypeError, match=r"weights\['self_attn.q_proj.scales'\]: expected dtype float16, got float32"):
        _layer(t)
    t = dict(good, **{"self_attn.v_proj.qzeros": good["self_attn.v_proj.qzeros"][:, :4].contiguous()})
    with pytest.raises(ValueError, match=r"weights\['self_attn.v_proj.qzeros'\]: expected shape \[2, 16\], got \[2, 4\]"):
        _layer(t)
    t = dict(good, **{"self_attn.o_proj.qweight": good["self_attn.o_proj.qweight"].t().contiguous().t()})
    with pytest.raises(ValueError, match=r"a gptq_int4 layer expected a contiguous int32 tensor on cpu, got a "
                                         r"non-contiguous int32"):
        _layer(t)
    t = {k: v for k, v in good.items() if k != "mlp.experts.1.gate_proj.g_idx"}
    with pytest.raises(ValueError, match=r"missing 'mlp.experts.1.gate_proj.g_idx'"):
        _layer(t)


def test_a_geometry_the_groups_do_not_divide_is_refused():
    cfg = q3.LayerConfig(**{**G128, "moe_intermediate_size": 96})
    with pytest.raises(ValueError, match=r"weight_format 'gptq_int4': every matrix's inputs must be a multiple of the "
                                         r"group \(128\) .* moe_intermediate 96"):
        q3.DecoderLayer.random(cfg, 0, "float32", weight_format="gptq_int4")


def test_the_weight_table_names_the_gptq_tensors():
    table = q3._C.weight_table(q3.LayerConfig(**G128), "gptq_int4")
    rows = {name: (shape, storage, of) for name, shape, storage, of in table}
    assert rows["self_attn.q_proj.qweight"][:2] == ((32, 256), "qweight")
    assert rows["self_attn.q_proj.scales"][:2] == ((2, 256), "gscales")
    assert rows["self_attn.q_proj.qzeros"][:2] == ((2, 32), "qzeros")
    assert rows["self_attn.q_proj.g_idx"][:2] == ((256,), "g_idx")
    assert rows["mlp.experts.5.down_proj.qweight"][:2] == ((16, 256), "qweight")
    assert table[rows["mlp.experts.5.down_proj.g_idx"][2]][0] == "mlp.experts.5.down_proj.qweight"
    assert rows["mlp.gate.weight"][1] == "layer" and "self_attn.q_proj.weight" not in rows
    # asked fused (transformers 5.x's layout), a GPTQ layer still names each expert's modules
    assert [r[0] for r in q3._C.weight_table(q3.LayerConfig(**G128), "gptq_int4", None, True)] == [r[0] for r in table]


QC = {"quant_method": "gptq", "bits": 4, "group_size": 128, "sym": True, "desc_act": False,
      "checkpoint_format": "gptq"}


@pytest.mark.parametrize("case,quant,qc", [
    ("group 64", dict(group=64), {"group_size": 64}),
    ("one group a matrix", dict(group=-1), {"group_size": -1}),
    ("gptq_v2 zeros", dict(v1=False), {"checkpoint_format": "gptq_v2"}),
    ("asymmetric zeros, desc_act", dict(sym=False, desc_act=True), {"sym": False, "desc_act": True}),
])
def test_what_a_quantization_config_says_is_read(case, quant, qc):
    """each field a GPTQ checkpoint's quantization_config may set, against transformers on the
    dequantized weights (fp32, 1e-5 of a float64 run): a prefill and a decode step"""
    model, tensors = gptq_pair(8, **quant)
    layer = q3.DecoderLayer(q3.LayerConfig.from_hf(model.config), tensors, weight_format="gptq_int4",
                            quantization_config=QC | qc)
    x = draw_input(model, (1, 21, G128["hidden_size"]), seed=4)
    exact = run(converted(model, torch.float64), x.double())
    cache = layer.new_cache(24)
    y = torch.cat([torch.from_dlpack(layer.prefill(x[:, :20].contiguous(), cache)),
                   torch.from_dlpack(layer.decode(x[:, 20].contiguous(), cache)).unsqueeze(1)], dim=1)
    assert rel_err(y - x, exact.y - x.double()) <= 1e-5, case
    if "v1" in quant:  # read as v1, the same tensors are another layer
        v1 = q3.DecoderLayer(q3.LayerConfig.from_hf(model.config), tensors, weight_format="gptq_int4")
        assert rel_err(torch.from_dlpack(v1.prefill(x[:, :20].contiguous(), v1.new_cache(24))) - x[:, :20],
                       exact.y[:, :20] - x[:, :20].double()) > 1e-3


def test_random_weights_follow_the_quantization_config():
    cfg = q3.LayerConfig(**{**G128, "num_experts": 4})
    qc = QC | {"group_size": 64, "checkpoint_format": "gptq_v2"}
    layer = q3.DecoderLayer.random(cfg, 3, "float32", weight_format="gptq_int4", quantization_config=qc)
    w = q3._C.random_weights(cfg, 3, "float32", "gptq_int4", gptq_group=64, gptq_v2=True)
    assert tuple(w["self_attn.q_proj.scales"].shape) == (4, 256)  # 256 inputs in groups of 64
    assert (unpack(torch.from_dlpack(w["self_attn.q_proj.qzeros"]), 1) == 8).all()  # v2: stored as it is
    assert layer.weight_format == "gptq_int4"


@pytest.mark.parametrize("qc,message", [
    (QC | {"bits": 8}, r"quantization_config.bits: expected 4, got 8 \(only 4-bit GPTQ weights are read\)"),
    (QC | {"group_size": 100}, r"quantization_config.group_size: expected -1 \(one group a matrix\) or a positive "
                               r"multiple of 8, got 100"),
    (QC | {"checkpoint_format": "marlin"}, r"checkpoint_format: expected 'gptq' or 'gptq_v2', got 'marlin'"),
    (QC | {"dynamic": {"-:.*experts.*": {}}}, r"quantization_config.dynamic: leaves "
                                              r"model.layers.0.mlp.experts.0.gate_proj dense; expected every expert's"),
    (QC | {"dynamic": {r".*down_proj": {"bits": 8}}}, r"quantization_config.dynamic\['.\*down_proj'\].bits: 8 for "
                                                     r"model.layers.0.mlp.experts.0.down_proj, where the layer's others "
                                                     r"have 4"),
    (QC | {"dynamic": {"-:.*experts.*": "x["}}, r"quantization_config.dynamic: leaves"),
    (QC | {"dynamic": {"-:(": {}}}, r"quantization_config.dynamic: '-:\(' is not a regular expression"),
    (QC | {"modules_to_not_convert": ["lm_head", "self_attn.o_proj"]},
     r"modules_to_not_convert: leaves model.layers.0.self_attn.o_proj dense and model.layers.0.self_attn.q_proj "
     r"4-bit; expected q/k/v/o_proj all 4-bit or all dense"),
    (QC | {"quant_method": "awq"}, r"quantization_config.quant_method: expected 'gptq', got 'awq'"),
    (QC | {"sym": "yes"}, r"quantization_config.sym: expected true or false, got 'yes'"),
])
def test_a_quantization_config_the_layer_cannot_read_is_refused_naming_the_field(good, qc, message):
    with pytest.raises(ValueError, match=message):
        q3.DecoderLayer(q3.LayerConfig(**G128), good, weight_format="gptq_int4", quantization_config=qc)


def test_a_quantization_config_with_another_format_is_refused(good):
    with pytest.raises(ValueError, match=r"quantization_config: read for weight_format='gptq_int4' .* got it with "
                                         r"weight_format='fp8_e4m3_block128'"):
        q3.DecoderLayer.random(q3.LayerConfig(**G128), 0, weight_format="fp8_e4m3_block128", quantization_config=QC)


def test_gptq_tensors_given_without_a_format_make_a_gptq_layer(good):
    """a GPTQ checkpoint has no q_proj.weight whose dtype would name the format: its qweight
    names it; the same layer as with weight_format='gptq_int4'"""
    layer = q3.DecoderLayer(q3.LayerConfig(**G128), good)
    named = q3.DecoderLayer(q3.LayerConfig(**G128), good, weight_format="gptq_int4")
    assert layer.weight_format == "gptq_int4"
    x = torch.randn(1, 3, G128["hidden_size"], generator=torch.Generator().manual_seed(2))
    assert torch.equal(torch.from_dlpack(layer.prefill(x, layer.new_cache(4))),
                       torch.from_dlpack(named.prefill(x, named.new_cache(4))))


def test_dequantize_int4_reads_the_packing_as_the_reference_does(good):
    """_C.dequantize_int4 (the check command's reference weights) against gptq_reference's
    reading, v1 and v2 zeros; what a layer refuses in a matrix, it refuses too"""
    t = {n: good[f"mlp.experts.2.down_proj.{n}"] for n in ("qweight", "qzeros", "scales", "g_idx")}
    got = torch.from_dlpack(q3._C.dequantize_int4(t["qweight"], t["qzeros"], t["scales"], t["g_idx"]))
    assert torch.equal(got, dequantize(t))
    v2 = torch.from_dlpack(q3._C.dequantize_int4(t["qweight"], t["qzeros"], t["scales"], t["g_idx"], gptq_v2=True))
    assert torch.equal(v2, dequantize(t, v1=False)) and not torch.equal(v2, got)
    with pytest.raises(ValueError, match=r"the matrix.g_idx: expected groups in \[0, 1\), got 1 at input 3"):
        q3._C.dequantize_int4(t["qweight"], t["qzeros"], t["scales"], t["g_idx"].index_fill(0, torch.tensor([3]), 1))
    with pytest.raises(TypeError, match=r"scales: expected dtype float16, got float32"):
        q3._C.dequantize_int4(t["qweight"], t["qzeros"], t["scales"].float(), t["g_idx"])
    with pytest.raises(ValueError, match=r"qzeros: expected a contiguous host int32 tensor \[1, 32\], got a host "
                                         r"int32 \[1, 16\]"):
        q3._C.dequantize_int4(t["qweight"], t["qzeros"][:, :16].contiguous(), t["scales"], t["g_idx"])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_experts_alone_in_4_bits_with_the_attention_dense(dtype):
    """a checkpoint quantized to its experts (q/k/v/o_proj "<module>.weight" of the layer's
    dtype, as such checkpoints store them): the weights say so, the attention runs dense and the
    experts 4-bit; fp32 within 1e-5 of a float64 run over a prefill and a decode step, bf16
    within twice transformers' own bf16 error; its bytes are the dense attention's and the
    4-bit experts'"""
    model = random_model(G128, 9)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(p.to(dtype).float())
    tensors = {k: v.to(dtype) if v.is_floating_point() and v.dtype != torch.float16 else v
               for k, v in gptq_model(model, seed=9, dense_attention=True).items()}
    assert "self_attn.q_proj.weight" in tensors and "self_attn.q_proj.qweight" not in tensors
    cfg = q3.LayerConfig.from_hf(model.config)
    layer = q3.DecoderLayer(cfg, tensors)
    assert layer.weight_format == "gptq_int4" and layer.dtype == str(dtype).split(".")[1] and layer.converted == ()
    whole = q3.DecoderLayer.random(cfg, 0, layer.dtype, weight_format="gptq_int4")
    attention = sum(tensors[f"self_attn.{a}.weight"].numel() for a in ("q_proj", "k_proj", "v_proj", "o_proj"))
    packed = [torch.from_dlpack(v) for k, v in q3._C.random_weights(cfg, 0, layer.dtype, "gptq_int4").items()
              if k.startswith("self_attn.") and k.rsplit(".", 1)[1] in ("qweight", "scales", "qzeros", "g_idx")]
    assert len(packed) == 16
    assert layer.weight_bytes - whole.weight_bytes == attention * dtype.itemsize - sum(
        t.numel() * t.element_size() for t in packed)
    if dtype == torch.bfloat16:
        x = draw_input(model, (1, 18, G128["hidden_size"]), seed=5, dtype=torch.bfloat16)
        q3.testing.assert_matches(layer, model.model.layers[0], x, torch.bfloat16, calls=(17, 1))
        return
    assert prefill_then_decode_error(layer, model, 21, seed=5) <= 1e-5


@pytest.mark.parametrize("rule", [{"dynamic": {"-:.*self_attn.*": {}}}, {"modules_to_not_convert": ["self_attn"]},
                                  {"modules_in_block_to_quantize": [[f"mlp.experts.{e}.{p}" for e in range(6)
                                                                     for p in ("gate_proj", "up_proj", "down_proj")]]}])
def test_a_quantization_config_that_leaves_the_attention_dense_is_honoured(rule):
    """each of the three ways a config leaves q/k/v/o_proj dense: random() makes them dense
    draws (those of the dense layer of the same seed), the weights are read so; a config that
    says the other of what the weights hold is refused, naming both"""
    cfg = q3.LayerConfig(**G128)
    layer = q3.DecoderLayer.random(cfg, 4, "float32", weight_format="gptq_int4", quantization_config=QC | rule)
    assert "self_attn.o_proj.weight" in layer.weight_ptrs and "self_attn.o_proj.qweight" not in layer.weight_ptrs
    assert "mlp.experts.5.down_proj.qweight" in layer.weight_ptrs
    mixed = {k: torch.from_dlpack(v) for k, v in
             q3._C.random_weights(cfg, 4, "float32", "gptq_int4", gptq_dense_attention=True).items()}
    dense = torch.from_dlpack(q3._C.random_weights(cfg, 4, "float32")["self_attn.o_proj.weight"])
    assert torch.equal(mixed["self_attn.o_proj.weight"], dense)
    x = layer.random_input((1, 5, G128["hidden_size"]), seed=1)
    again = q3.DecoderLayer(cfg, mixed, quantization_config=QC | rule)
    assert torch.equal(torch.from_dlpack(layer.prefill(x, layer.new_cache(8))),
                       torch.from_dlpack(again.prefill(x, again.new_cache(8))))
    with pytest.raises(ValueError, match=r"quantization_config: its rules leave layer 0's q/k/v/o_proj 4-bit, but "
                                         r"the weights hold self_attn.q_proj.weight"):
        q3.DecoderLayer(cfg, mixed, quantization_config=QC)
    with pytest.raises(ValueError, match=r"its rules leave layer 3's q/k/v/o_proj dense, but the weights hold "
                                         r"self_attn.q_proj.qweight"):
        q3.DecoderLayer(cfg, q3._C.random_weights(cfg, 4, "float32", "gptq_int4"), quantization_config=QC | rule,
                        layer_idx=3)


@pytest.mark.parametrize("fmt", ["dense", "fp8_e4m3_block128", "gptq_int4"])
def test_layer_idx_without_a_gptq_quantization_config_is_refused(fmt):
    """layer_idx only selects which of a GPTQ quantization_config's per-layer rules apply: a
    dense or FP8 layer, or GPTQ tensors without a config, would take it and do nothing. Refused
    by name whether the format is given or read from the weights; the layer is made without it"""
    cfg = q3.LayerConfig(**G128)
    weights = q3._C.random_weights(cfg, 2, "float32", fmt)
    for given in (fmt, None):
        for idx in (0, 3):
            with pytest.raises(ValueError, match=rf"layer_idx: expected None without a GPTQ quantization_config, got "
                                                 rf"{idx} \(it only selects which of that config's per-layer rules "
                                                 r"apply: dynamic, modules_to_not_convert, modules_in_block_to_quantize"):
                q3.DecoderLayer(cfg, weights, weight_format=given, layer_idx=idx)
    assert q3.DecoderLayer(cfg, weights).weight_format == fmt
    with pytest.raises(ValueError, match=r"layer_idx: expected None or a non-negative int, got -1"):
        q3.DecoderLayer(cfg, weights, layer_idx=-1)


def test_the_cost_model_counts_a_dense_attention_at_the_layers_dtype():
    """cost_model(dense_attention=True): q/k/v/o_proj read as the dense format's bytes, the
    experts as 4-bit ones, which is what such a layer's weight_bytes holds"""
    from qwen3layer.analysis.costs import cost_model
    cfg = q3.LayerConfig(**G128)
    stages = {m: {s.name: s.weight_bytes for s in cost_model(cfg, "prefill", 64, dtype="bfloat16", **kw).stages}
              for m, kw in (("dense", {}), ("int4", dict(weight_format="gptq_int4")),
                            ("mixed", dict(weight_format="gptq_int4", dense_attention=True)))}
    for s in ("qkv_proj", "o_proj"):
        assert stages["mixed"][s] == stages["dense"][s] > stages["int4"][s]
    assert stages["mixed"]["experts"] == stages["int4"]["experts"] < stages["dense"]["experts"]
    layer = q3.DecoderLayer.random(cfg, 1, weight_format="gptq_int4",
                                   quantization_config=QC | {"modules_to_not_convert": ["self_attn"]})
    int4 = q3.DecoderLayer.random(cfg, 1, weight_format="gptq_int4")
    assert layer.weight_bytes - int4.weight_bytes == sum(stages["mixed"][s] - stages["int4"][s]
                                                         for s in ("qkv_proj", "o_proj"))
