"""qwen3layer.testing itself: compare() and assert_matches() pass a layer and a patched model
that match transformers, fail naming the output, token and values of a planted difference
(a perturbed weight, one perturbed output element), hold the rule's boundary (twice the
reference's error, the values' floor, NaN), and refuse bad arguments by name; the example of
docs/testing.md runs."""
import copy
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import qwen3layer as q3
import qwen3layer.testing as qt
import qwen3layer.torch as q3t
from hf_reference import converted, draw_input, hf_model, tiny_model

BF16 = torch.bfloat16


@pytest.fixture(scope="module")
def bf16_pair():
    """(our bf16 layer, the transformers bf16 layer it shares weights with, x [1, 13, 64] bf16
    drawn with a routing margin)"""
    model = hf_model("gqa4_topk_norm", seed=7)
    x = draw_input(model, (1, 13, 64), seed=7, dtype=BF16)
    hf = converted(model, BF16)
    return q3.DecoderLayer.from_hf(hf.model.layers[0]), hf.model.layers[0], x


def test_a_matching_layer_passes_with_its_errors_beside_the_references(bf16_pair):
    layer, hf_layer, x = bf16_pair
    result = qt.assert_matches(layer, hf_layer, x, BF16, calls=(9, 3, 1))
    assert result.ok and not result.failures and (result.dtype, result.wide_dtype) == (BF16, torch.float64)
    assert [o.name for o in result.outputs] == ["y", "keys", "values"]
    for o in result.outputs:  # bf16's errors: far above float64's, below a wrong layer's
        assert 1e-4 < o.error <= o.allowed < 0.05 and 1e-4 < o.reference_error and o.ratio <= 2, o
        assert o.max_abs == pytest.approx(abs(o.ours - o.wide)) and o.max_abs > 0
    assert result["values"].floor == 2 ** -9 and result["y"].floor == result["keys"].floor == 0
    assert result["y"].index[1] == result["y"].token and result["keys"].index[2] == result["keys"].token
    text = str(result)
    assert "torch.bfloat16" in text and "torch.float64" in text and text.count(": ok;") == 3


def test_a_perturbed_weight_fails_naming_the_output_and_the_column(bf16_pair):
    """o_proj's column 5 moved in ours: y's hidden unit 5 differs, the cache does not"""
    _, hf_layer, x = bf16_pair
    planted = copy.deepcopy(hf_layer)
    with torch.no_grad():
        planted.self_attn.o_proj.weight[5] += 0.05
    with pytest.raises(AssertionError) as failed:
        qt.assert_matches(q3.DecoderLayer.from_hf(planted), hf_layer, x, BF16)
    message = str(failed.value)
    assert message.startswith("qwen3layer.testing.assert_matches: y: error ")
    first = message.split("\n")[0]
    assert "keys" not in first and "values" not in first and ", 5)): ours " in first
    result = qt.compare(q3.DecoderLayer.from_hf(planted), hf_layer, x, BF16)
    assert [o.name for o in result.failures] == ["y"] and result["y"].index[2] == 5 and result["y"].ratio > 2


def test_a_failure_with_tied_routing_points_at_the_margin(bf16_pair):
    """every router row equal: all experts tie (margin 0), and the message says so"""
    _, hf_layer, x = bf16_pair
    tied = copy.deepcopy(hf_layer)
    with torch.no_grad():
        tied.mlp.gate.weight[:] = tied.mlp.gate.weight[0]
    planted = copy.deepcopy(tied)
    with torch.no_grad():
        planted.self_attn.o_proj.weight[5] += 0.05
    layer = q3.DecoderLayer.from_hf(planted)
    assert qt.compare(layer, tied, x, BF16).routing_margin == 0.0
    assert qt.compare(*bf16_pair, BF16).routing_margin >= 1e-4  # draw_input's margin
    with pytest.raises(AssertionError, match="the wide run's routing margin is 0: a top-k choice"):
        qt.assert_matches(layer, tied, x, BF16)


class OneElementOff(q3.DecoderLayer):
    """a layer whose prefill output is 1 higher at token 4, hidden unit 7"""

    def prefill(self, x, cache, *args, **kwargs):
        y = super().prefill(x, cache, *args, **kwargs)
        y[4, 7] += 1.0
        return y


def test_one_output_element_off_is_named_by_token_and_value(bf16_pair):
    layer, hf_layer, x = bf16_pair
    odd = OneElementOff.from_hf(hf_layer)
    right = qt.compare(layer, hf_layer, x, BF16)["y"]
    with pytest.raises(AssertionError, match=r"y: error .* at sequence 0, token 4 \(index \(0, 4, 7\)\): ours "):
        qt.assert_matches(odd, hf_layer, x, BF16)
    off = qt.compare(odd, hf_layer, x, BF16)["y"]
    assert (off.sequence, off.token, off.index) == (0, 4, (0, 4, 7))
    assert off.ours - off.reference == pytest.approx(1.0, abs=0.05)
    assert off.reference_error == right.reference_error and off.error > right.error


def test_float32_layer_against_float64():
    model = hf_model("mha_no_norm", seed=8)
    x = draw_input(model, (2, 6, 48), seed=8)
    layer = q3.DecoderLayer.from_hf(model.model.layers[0])
    result = qt.assert_matches(layer, model.model.layers[0], x, torch.float32)
    assert all(o.error < 1e-5 for o in result.outputs) and result["values"].floor == 2 ** -25


def rule(error, reference_error, floor=0.0):
    return qt.OutputError("y", error, reference_error, floor, 0.0, (0, 0, 0), 0, 0, 0.0, 0.0, 0.0)


def test_the_rule_is_twice_the_references_error_or_its_floor():
    assert rule(2e-3, 1e-3).ok and not rule(2.001e-3, 1e-3).ok
    assert rule(2e-3, 1e-4, floor=1e-3).ok and not rule(2.1e-3, 1e-4, floor=1e-3).ok
    assert not rule(float("nan"), 1e-3).ok and rule(0.0, 0.0).ok and not rule(1e-9, 0.0).ok
    assert rule(3e-3, 1e-3).ratio == pytest.approx(3.0)


@pytest.fixture(scope="module")
def model_pair():
    model = tiny_model(9, BF16)
    ref = copy.deepcopy(model)
    with pytest.warns(UserWarning, match="inv_freq is in torch.bfloat16"):
        return q3t.patch_model(model), ref


def test_a_patched_model_passes_on_the_real_tokens(model_pair):
    model, ref = model_pair
    ids = torch.randint(1, 101, (2, 6), generator=torch.Generator().manual_seed(9))
    mask = torch.ones(2, 6, dtype=torch.long)
    mask[0, :2] = 0  # left padding: those rows differ by design (qwen3layer/torch/__init__.py)
    result = qt.assert_matches(model, ref, dict(input_ids=ids, attention_mask=mask), BF16, wide=torch.float32)
    assert [o.name for o in result.outputs] == ["logits", "layers.0.keys", "layers.0.values", "layers.1.keys",
                                                "layers.1.values"]
    assert all(o.sequence == 1 or o.token >= 2 for o in result.outputs)
    assert qt.compare(model, ref, ids, BF16)["logits"].error == pytest.approx(
        qt.compare(model, ref, {"input_ids": ids}, BF16)["logits"].error)


def test_a_perturbed_lm_head_row_fails_naming_logits_and_the_column(model_pair):
    model, ref = model_pair
    ids = torch.randint(1, 101, (1, 5), generator=torch.Generator().manual_seed(10))
    saved = model.lm_head.weight.detach().clone()
    try:
        with torch.no_grad():
            model.lm_head.weight[17] += 3.0  # the row's own size (tiny_model draws it N(0, 9))
        with pytest.raises(AssertionError, match=r"logits: error .*index \(0, \d, 17\)\)"):
            qt.assert_matches(model, ref, ids, BF16, wide=torch.float32)
        failures = qt.compare(model, ref, ids, BF16, wide=torch.float32).failures
        assert [o.name for o in failures] == ["logits"]
    finally:
        with torch.no_grad():
            model.lm_head.weight.copy_(saved)


def test_bad_arguments_are_refused_by_name(bf16_pair, model_pair):
    layer, hf_layer, x = bf16_pair
    model, ref = model_pair
    cases = [
        (("a layer", hf_layer, x, BF16), {}, TypeError, "layer_or_patched_model: expected a qwen3layer.DecoderLayer"),
        ((ref, ref, x, BF16), {}, TypeError, "layer_or_patched_model: .* got a model with no qwen3layer layers"),
        ((layer, "hf", x, BF16), {}, TypeError, "reference: expected the transformers Qwen3MoeDecoderLayer .* got str"),
        ((layer, hf_layer, x, torch.float32), {}, ValueError, "dtype: expected torch.bfloat16, the dtype of the "
                                                              "layer, got torch.float32"),
        ((layer, hf_layer, x, torch.int8), {}, ValueError, r"dtype: expected one of \['bfloat16'.* got torch.int8"),
        ((layer, hf_layer, x, BF16), dict(wide=torch.float16), ValueError, "wide: expected .* got torch.float16"),
        ((layer, hf_layer, x, BF16), dict(wide=hf_layer), ValueError, "wide: expected .* got torch.bfloat16"),
        ((layer, hf_layer, x[..., :32], BF16), {}, ValueError, r"inputs: expected .* \[tokens, 64\] .* shape "
                                                               r"\[1, 13, 32\]"),
        ((layer, hf_layer, x, BF16), dict(calls=(9, 3)), ValueError, r"calls: expected token counts adding up to "
                                                                     r"the input's 13 tokens, got \[9, 3\]"),
        ((layer, hf_layer, x, BF16), dict(calls=(13, 0)), ValueError, r"calls\[1\]: .* got 0"),
        ((layer, hf_layer, x, BF16), dict(calls=(3, (10, "a"))), ValueError, r"calls\[1\]: .* got \(10, 'a'\)"),
        ((model, model, torch.ones(1, 3, dtype=torch.long), BF16), {}, TypeError,
         "reference: expected the unpatched transformers model, got a patched model"),
        ((model, ref, {"input_ids": torch.ones(1, 3, dtype=torch.long), "past_key_values": None}, BF16), {},
         ValueError, r"inputs: expected .* without a cache .* keys \['input_ids', 'past_key_values'\]"),
        ((model, ref, torch.ones(1, 3, dtype=torch.long), BF16), dict(calls=(3,)), ValueError,
         "calls: a patched model"),
    ]
    for args, kwargs, kind, match in cases:
        with pytest.raises(kind, match=match):
            qt.compare(*args, **kwargs)
    with pytest.raises(KeyError, match=r"name: expected one of \['y', 'keys', 'values'\], got 'logits'"):
        qt.compare(layer, hf_layer, x, BF16)["logits"]


def test_import_qwen3layer_loads_neither_torch_nor_transformers():
    code = "import sys, qwen3layer; print('torch' in sys.modules, 'transformers' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          check=True).stdout.split() == ["False", "False"]


def test_the_example_in_docs_testing_md_passes(capsys):
    """the pytest example of docs/testing.md, its test functions called as pytest would"""
    page = (Path(__file__).parents[2] / "docs" / "testing.md").read_text()
    blocks = [b.split("```")[0] for b in page.split("```python\n")[1:]]
    (example,) = [b for b in blocks if "q3.testing.assert_matches" in b]
    scope = {"__name__": "docs_testing_example"}
    exec(compile(example, "docs/testing.md", "exec"), scope)
    tests = [f for name, f in scope.items() if name.startswith("test_")]
    assert len(tests) == 2
    for test in tests:
        test()
    assert "y: error" in capsys.readouterr().out
