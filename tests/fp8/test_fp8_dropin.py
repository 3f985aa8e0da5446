"""FP8 weights from torch: q3.DecoderLayer(cfg, weights) with float8_e4m3fn tensors and their
scales, DecoderLayer.from_hf and the drop-in module (qwen3layer.torch) on a transformers model
whose layers hold FP8 modules (FP8Linear: weight + weight_scale_inv; 5.x FP8Experts: gate_up_proj,
down_proj and their _scale_inv), and on a model transformers loaded from an FP8 checkpoint
(dequantized at load on the CPU: a dense model). Each rejected input names the tensor."""
import pytest
import torch
from transformers import FineGrainedFP8Config, Qwen3MoeForCausalLM
from transformers.integrations.finegrained_fp8 import replace_with_fp8_linear

import qwen3layer as q3
import qwen3layer.torch as q3t
from fp8_reference import ALIGNED, ODD, dequantize, layer_matrices, quantize, quantize_model, random_model, \
    write_checkpoint
from hf_reference import rel_err

# moe_inter 64: transformers' fused gate_up scale then has the gate's block and the up's
# (FP8Experts keeps at least 2 scale rows), the layout the engine reads
DROPIN = ODD | {"moe_intermediate_size": 64}
KEEP = ["lm_head", "mlp.gate"]  # as transformers' quantizer keeps them (the router: 4.57's is a Linear)


def fp8_module_model(seed, geometry=DROPIN):
    """(dense twin, the same model with FP8 modules): the twin's projections are the FP8
    weights dequantized; the FP8 model's modules hold the e4m3 bytes and scales"""
    dense = random_model(geometry, seed, layers=2, vocab=101)
    tensors = quantize_model(dense)
    fp8 = Qwen3MoeForCausalLM(dense.config).eval()
    fp8.load_state_dict(dense.state_dict())
    replace_with_fp8_linear(fp8, KEEP, FineGrainedFP8Config(modules_to_not_convert=KEEP))  # new ones on meta
    for i, layer in enumerate(fp8.model.layers):
        for name, module in layer.named_modules():
            if any(p.is_meta for p in module.parameters(recurse=False)):
                module.to_empty(device="cpu", recurse=False)
        state = {}
        for name in layer.state_dict():
            full = f"model.layers.{i}.{name}"
            if full in tensors:
                state[name] = tensors[full]
        experts = layer.mlp.experts
        if hasattr(experts, "gate_up_proj"):  # 5.x FP8Experts: fused [E, 2I, H], scales gate's blocks then up's
            E = experts.gate_up_proj.shape[0]
            for part, names in (("gate_up_proj", ("gate_proj", "up_proj")), ("down_proj", ("down_proj",))):
                for suffix in ("", "_scale_inv"):
                    state[f"mlp.experts.{part}{suffix}"] = torch.stack([torch.cat(
                        [tensors[f"model.layers.{i}.mlp.experts.{e}.{n}.weight{suffix}"] for n in names])
                        for e in range(E)])
        missing = {n for n in set(layer.state_dict()) - set(state) if "proj" in n}
        assert not missing, missing  # every FP8 parameter filled (the rest came with the dense state)
        layer.load_state_dict(state, strict=False)
        assert layer.self_attn.q_proj.weight.dtype == torch.float8_e4m3fn
    return dense, fp8


def test_from_hf_borrows_fp8_modules():
    dense, fp8 = fp8_module_model(0)
    hf_layer = fp8.model.layers[1]
    layer = q3.DecoderLayer.from_hf(hf_layer)
    assert layer.weight_format == "fp8_e4m3_block128" and layer.dtype == "float32" and layer.converted == ()
    assert layer.weight_ptrs["self_attn.q_proj.weight"] == hf_layer.self_attn.q_proj.weight.data_ptr()
    assert layer.weight_ptrs["self_attn.q_proj.weight_scale_inv"] == hf_layer.self_attn.q_proj.weight_scale_inv.data_ptr()
    if hasattr(hf_layer.mlp.experts, "gate_up_proj"):
        assert layer.weight_ptrs["mlp.experts.gate_up_proj"] == hf_layer.mlp.experts.gate_up_proj.data_ptr()
    twin = q3.DecoderLayer.from_hf(dense.model.layers[1])
    x = torch.randn(9, DROPIN["hidden_size"])
    y, y_twin = layer.prefill(x, layer.new_cache(16)), twin.prefill(x, twin.new_cache(16))
    assert rel_err(y, y_twin) <= 1e-6


def greedy(model, ids, n=24):
    return model.generate(ids, max_new_tokens=n, do_sample=False, pad_token_id=0)


def test_a_model_of_fp8_modules_patched_generates_like_its_dense_twin():
    """transformers' FP8 modules cannot run on the CPU; patched, none of them runs: the layers
    are ours, reading the e4m3 bytes, and the tokens are those of the dequantized twin"""
    dense, fp8 = fp8_module_model(1)
    ids = torch.randint(1, 101, (1, 7), generator=torch.Generator().manual_seed(1))
    ref = greedy(dense, ids)
    assert len(set(ref[0, 7:].tolist())) >= 6
    q3t.patch_model(fp8)
    assert all(layer.core.weight_format == "fp8_e4m3_block128" for layer in fp8.model.layers)
    assert torch.equal(greedy(fp8, ids), ref)


def test_a_model_transformers_dequantized_from_an_fp8_checkpoint_is_dense(tmp_path):
    model = random_model(ALIGNED, 2, layers=2, vocab=101)
    path = write_checkpoint(tmp_path, model, quantize_model(model))
    hf = Qwen3MoeForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    ids = torch.randint(1, 101, (1, 7), generator=torch.Generator().manual_seed(2))
    ref = greedy(hf, ids)
    q3t.patch_model(hf)
    assert all(layer.core.weight_format == "dense" for layer in hf.model.layers)
    assert torch.equal(greedy(hf, ids), ref)


# ---- rejected FP8 weights from torch ----------------------------------------------------------

@pytest.fixture(scope="module")
def fp8_weights():
    """(config, per-expert FP8 weights of one layer)"""
    model = random_model(ODD, 3)
    hf_layer = model.model.layers[0]
    weights = {k: v.detach() for k, v in hf_layer.state_dict().items() if "proj" not in k}
    for name, w in layer_matrices(hf_layer).items():
        weights[name], weights[name + "_scale_inv"] = quantize(w)
    return q3.LayerConfig.from_hf(model.config), weights


def test_per_expert_fp8_weights_from_torch_are_borrowed(fp8_weights):
    cfg, w = fp8_weights
    layer = q3.DecoderLayer(cfg, w)
    assert layer.weight_format == "fp8_e4m3_block128" and layer.converted == ()
    assert layer.weight_ptrs["mlp.experts.5.down_proj.weight"] == w["mlp.experts.5.down_proj.weight"].data_ptr()


Q = "self_attn.q_proj.weight"


def test_an_fp8_matrix_without_its_scale(fp8_weights):
    cfg, w = fp8_weights
    w = dict(w)
    del w[Q + "_scale_inv"]
    with pytest.raises(ValueError, match=rf"missing '{Q}_scale_inv'"):
        q3.DecoderLayer(cfg, w)


def test_an_fp8_layer_without_any_scale(fp8_weights):
    cfg, w = fp8_weights
    w = {k: v for k, v in w.items() if not k.endswith("_scale_inv")}
    with pytest.raises(ValueError, match=rf"weights\['{Q}'\]: an FP8 weight without its scale: missing '{Q}_scale_inv'"):
        q3.DecoderLayer(cfg, w)


def test_a_scale_of_the_wrong_shape(fp8_weights):
    cfg, w = fp8_weights
    bad = w | {"mlp.experts.2.up_proj.weight_scale_inv": w["mlp.experts.2.up_proj.weight_scale_inv"][:1]}
    with pytest.raises(ValueError, match=r"weights\['mlp.experts.2.up_proj.weight_scale_inv'\]: expected shape "
                                         r"\[2, 2\], got \[1, 2\]"):
        q3.DecoderLayer(cfg, bad)


def test_a_bf16_matrix_in_an_fp8_layer(fp8_weights):
    cfg, w = fp8_weights
    bad = w | {Q: dequantize(w[Q], w[Q + "_scale_inv"]).bfloat16()}
    with pytest.raises(ValueError, match=rf"weights\['{Q}'\]: an fp8_e4m3_block128 layer expected a contiguous "
                                         "float8_e4m3fn tensor on cpu, got a bfloat16 tensor"):
        q3.DecoderLayer(cfg, bad, weight_format="fp8_e4m3_block128")


def test_a_non_contiguous_fp8_matrix(fp8_weights):
    cfg, w = fp8_weights
    bad = w | {Q: w[Q].t().contiguous().t()}
    with pytest.raises(ValueError, match=rf"weights\['{Q}'\]: .*expected a contiguous float8_e4m3fn tensor on cpu, "
                                         "got a non-contiguous float8_e4m3fn tensor"):
        q3.DecoderLayer(cfg, bad)


def test_a_fused_gate_up_scale_over_the_fused_rows(fp8_weights):
    """moe_inter 136: transformers' FP8Experts scale gate_up_proj [E, 272, H] in ceil(272/128) = 3
    row blocks, the second holding gate rows 128..135 and up rows 0..119"""
    cfg, w = fp8_weights
    E, fused = cfg.num_experts, {k: v for k, v in w.items() if ".experts." not in k}
    gate_up = torch.stack([torch.cat([dequantize(w[f"mlp.experts.{e}.{p}.weight"],
                                                 w[f"mlp.experts.{e}.{p}.weight_scale_inv"])
                                      for p in ("gate_proj", "up_proj")]) for e in range(E)])
    quantized = [quantize(gate_up[e]) for e in range(E)]
    fused["mlp.experts.gate_up_proj"] = torch.stack([q for q, _ in quantized])
    fused["mlp.experts.gate_up_proj_scale_inv"] = torch.stack([s for _, s in quantized])
    for suffix in ("", "_scale_inv"):
        fused["mlp.experts.down_proj" + suffix] = torch.stack([w[f"mlp.experts.{e}.down_proj.weight{suffix}"]
                                                               for e in range(E)])
    assert fused["mlp.experts.gate_up_proj_scale_inv"].shape == (E, 3, 2)
    with pytest.raises(ValueError, match=r"weights\['mlp.experts.gate_up_proj_scale_inv'\]: expected shape \[6, 4, 2\] "
                                         r"\(the gate's ceil\(I/128\) = 2 row blocks, then the up's\), got \[6, 3, 2\]: "
                                         r"3 blocks over the fused 2I = 272 rows.*not supported"):
        q3.DecoderLayer(cfg, fused)
