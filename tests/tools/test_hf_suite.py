"""benchmarks/hf_suite.py without transformers' suite or the network: its junit parsing, grouping
and report on canned junit xml, the stubs it writes for an assembled tree, and the plugin it
writes (hf_suite_plugin.py with its settings), loaded in a subprocess: a Qwen3MoeModel patched at
its first call and only in the patched run, the tester's hidden_act set to silu, the compat
names added, the same seeds for the same test."""
import importlib.util
import json
import os
import subprocess
import sys
import textwrap
import unittest

import pytest

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..")
spec = importlib.util.spec_from_file_location("hf_suite", os.path.join(ROOT, "benchmarks", "hf_suite.py"))
hf_suite = importlib.util.module_from_spec(spec)
spec.loader.exec_module(hf_suite)

CLS = "tests.models.qwen3_moe.test_modeling_qwen3_moe.Qwen3MoeModelTest"
PLAIN = f"""<?xml version="1.0" encoding="utf-8"?>
<testsuites><testsuite name="pytest" errors="0" failures="1" skipped="2" tests="8">
<testcase classname="{CLS}" name="test_greedy_generate" time="0.1" />
<testcase classname="{CLS}" name="test_problem_types" time="0.1" />
<testcase classname="{CLS}" name="test_training" time="0.2" />
<testcase classname="{CLS}" name="test_eager_matches_sdpa_inference_01_fp16_pad_left" time="0.1" />
<testcase classname="{CLS}" name="test_flaky_upstream" time="0.1"><failure message="AssertionError: 3 != 4">long
traceback</failure></testcase>
<testcase classname="{CLS}" name="test_flash_attn_2" time="0.0"><skipped type="pytest.skip" message="requires a GPU">skip</skipped></testcase>
<testcase classname="{CLS}" name="test_keep_in_fp32_modules" time="0.0"><skipped message="no fp32 modules" /><skipped message="no fp32 modules" /></testcase>
<testcase classname="tests.models.qwen3_moe.test_modeling_qwen3_moe" name="test_module_level" time="0.0" />
</testsuite></testsuites>
"""
MASK = ("ValueError: attention_mask: cached tokens masked (right padding of an earlier call, or a hole): query 0 of "
        "batch row 0 (cache position 7) attends to keys 0, 7")
TRAINING = ("RuntimeError: qwen3layer layer 0: the C layer is inference-only (it has no backward), and the model is in "
            "training mode with gradients enabled")
FP16 = "TypeError: weights['self_attn.q_proj.weight']: expected dtype float32, bfloat16 or float8_e4m3fn, got float16"
PATCHED = f"""<?xml version="1.0" encoding="utf-8"?>
<testsuites><testsuite name="pytest" errors="1" failures="5" skipped="3" tests="8">
<testcase classname="{CLS}" name="test_problem_types" time="0.1"><skipped message="a subtest skipped" /><failure message="{TRAINING}">tb</failure></testcase>
<testcase classname="{CLS}" name="test_greedy_generate" time="0.1"><failure message="{MASK}&#10;second line of the message">tb</failure></testcase>
<testcase classname="{CLS}" name="test_training" time="0.2"><failure message="{TRAINING}">a</failure><failure message="{TRAINING}">b</failure></testcase>
<testcase classname="{CLS}" name="test_eager_matches_sdpa_inference_01_fp16_pad_left" time="0.1"><error message="failed on setup with &quot;{FP16}&quot;">tb</error></testcase>
<testcase classname="{CLS}" name="test_flaky_upstream" time="0.1" />
<testcase classname="{CLS}" name="test_flash_attn_2" time="0.0"><skipped type="pytest.skip" message="requires a GPU">skip</skipped></testcase>
<testcase classname="{CLS}" name="test_keep_in_fp32_modules" time="0.0"><skipped message="no fp32 modules" /></testcase>
<testcase classname="tests.models.qwen3_moe.test_modeling_qwen3_moe" name="test_module_level" time="0.0"><failure message="AssertionError: Expected 'mock' to have been called.">tb</failure></testcase>
</testsuite></testsuites>
"""


def parsed(tmp_path, name, text):
    path = tmp_path / name
    path.write_text(text)
    return hf_suite.parse_junit(path)


def test_parse_junit_gives_one_outcome_a_test_and_the_first_line_of_its_message(tmp_path):
    plain = parsed(tmp_path, "plain.xml", PLAIN)
    assert plain == {
        "Qwen3MoeModelTest::test_greedy_generate": ("passed", ""),
        "Qwen3MoeModelTest::test_problem_types": ("passed", ""),
        "Qwen3MoeModelTest::test_training": ("passed", ""),
        "Qwen3MoeModelTest::test_eager_matches_sdpa_inference_01_fp16_pad_left": ("passed", ""),
        "Qwen3MoeModelTest::test_flaky_upstream": ("failed", "AssertionError: 3 != 4"),
        "Qwen3MoeModelTest::test_flash_attn_2": ("skipped", "requires a GPU"),
        "Qwen3MoeModelTest::test_keep_in_fp32_modules": ("skipped", "no fp32 modules"),
        "test_modeling_qwen3_moe::test_module_level": ("passed", ""),
    }
    patched = parsed(tmp_path, "patched.xml", PATCHED)
    assert patched["Qwen3MoeModelTest::test_greedy_generate"] == ("failed", MASK)  # the first line only
    assert patched["Qwen3MoeModelTest::test_training"] == ("failed", TRAINING)  # two failing subtests, one test
    assert patched["Qwen3MoeModelTest::test_problem_types"] == ("failed", TRAINING)  # a skipped subtest, a failing one
    assert patched["Qwen3MoeModelTest::test_eager_matches_sdpa_inference_01_fp16_pad_left"].status == "error"
    assert hf_suite.counts(plain) == {"passed": 5, "failed": 1, "skipped": 2}
    assert hf_suite.counts(patched) == {"passed": 1, "failed": 4, "error": 1, "skipped": 2}


def test_differences_are_grouped_by_the_kind_of_the_patched_error(tmp_path):
    plain, patched = parsed(tmp_path, "plain.xml", PLAIN), parsed(tmp_path, "patched.xml", PATCHED)
    groups = hf_suite.differences(plain, patched)
    assert list(groups) == ["training refused", "fp16 refused", "masks refused",
                            "a mock of transformers' code not called", "passed patched"]
    assert groups["masks refused"] == [("Qwen3MoeModelTest::test_greedy_generate", "passed", "failed", MASK)]
    assert groups["fp16 refused"][0][:3] == ("Qwen3MoeModelTest::test_eager_matches_sdpa_inference_01_fp16_pad_left",
                                             "passed", "error")
    assert groups["passed patched"] == [("Qwen3MoeModelTest::test_flaky_upstream", "failed", "passed", "")]
    assert all(row[0] != "Qwen3MoeModelTest::test_keep_in_fp32_modules" for rows in groups.values() for row in rows)

    text = hf_suite.report(plain, patched, (50.4, 61.6))
    assert "unpatched: 5 passed, 1 failed, 2 skipped, 0 errors (50 s)" in text
    assert "patched:   1 passed, 4 failed, 2 skipped, 1 errors (62 s)" in text
    assert "6 tests differ" in text and "\ntraining refused: 2\n" in text
    assert "second line of the message" not in text


def test_kind_of_reads_the_drop_ins_refusals():
    assert hf_suite.kind_of("qwen3layer.CacheFullError: the sequences would hold 768 tokens, past the model's "
                            "context of 512 positions") == "past the context"
    assert hf_suite.kind_of("ValueError: config.sliding_window: a sliding window of 3 tokens (use_sliding_window="
                            "True) is not implemented") == "config refused"
    assert hf_suite.kind_of("ValueError: position_ids: batch row 1 puts its first real token at 3") == \
        "positions refused"
    assert hf_suite.kind_of("AssertionError: Tensor-likes are not close!") == "other"


def test_stubs_cover_only_the_missing_modules_and_skip_their_callers(tmp_path):
    tests = tmp_path / "tests"
    tests.mkdir()
    (tests / "__init__.py").write_text("")
    (tests / "present.py").write_text("z = 1\n")
    (tests / "test_mixin.py").write_text("from .missing import run_distributed, _helper\nfrom .present import z\n"
                                         "from . import present\n")
    assert hf_suite.stub_missing_modules(tests, "a test's reason") == {"missing": ["_helper", "run_distributed"]}
    assert (tests / "present.py").read_text() == "z = 1\n"
    namespace = {}
    exec(compile((tests / "missing.py").read_text(), "missing.py", "exec"), namespace)
    with pytest.raises(unittest.SkipTest, match="missing.py is not in this tree .a test's reason."):
        namespace["run_distributed"](1, world_size=2)


def test_literal_constants_keeps_literals_only():
    source = 'A = {"hidden_act": "gelu", "n": 2}\nB = f()\nC: int = 3\n_D = (1, 2)\nE = F = 4\n'
    assert hf_suite.literal_constants(source) == {"A": {"hidden_act": "gelu", "n": 2}, "_D": (1, 2)}


PROBE = textwrap.dedent("""
    import json, sys, types
    import torch
    import qwen3layer_hf_suite as plugin
    import transformers.testing_utils as tu
    from transformers import Qwen3MoeConfig, Qwen3MoeModel
    import qwen3layer.torch as q3t

    plugin.pytest_configure(None)
    out = {"settings": plugin.SETTINGS, "compat": getattr(tu, "HF_SUITE_PROBE", None)}
    cfg = Qwen3MoeConfig(vocab_size=101, hidden_size=64, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=8, num_key_value_heads=2, head_dim=24, num_experts=8,
                         num_experts_per_tok=2, moe_intermediate_size=48, max_position_embeddings=64,
                         attn_implementation="eager")
    model = Qwen3MoeModel(cfg).eval()
    out["before"] = type(model.layers[0]).__name__
    with torch.no_grad():
        model(torch.arange(1, 6)[None])
        model(torch.arange(1, 6)[None])
    out["after"] = [type(layer).__name__ for layer in model.layers]
    out["patched_class"] = isinstance(model.layers[1], q3t.DecoderLayer)

    class Tester:
        def __init__(self, parent):
            self.hidden_act = "gelu"

    class Test:
        model_tester_class = Tester

    item = types.SimpleNamespace(cls=Test)
    plugin.pytest_collection_modifyitems(None, None, [item, item])
    out["hidden_act"] = Tester(None).hidden_act
    draws = []
    for nodeid in ("a::test_x", "a::test_y", "a::test_x"):
        plugin.pytest_runtest_setup(types.SimpleNamespace(nodeid=nodeid))
        draws.append(torch.rand(3).tolist())
    out["seeded"] = [draws[0] == draws[2], draws[0] == draws[1]]
    print(json.dumps(out))
""")


@pytest.mark.parametrize("patch", [True, False])
def test_the_written_plugin_patches_at_first_call_only_in_the_patched_run(tmp_path, patch):
    pytest.importorskip("transformers")
    path = hf_suite.write_plugin(tmp_path, patch, {"HF_SUITE_PROBE": [1, 2]})
    assert path.name == "qwen3layer_hf_suite.py"
    assert json.loads(path.with_suffix(".json").read_text()) == {"patch": patch, "compat": {"HF_SUITE_PROBE": [1, 2]}}
    notes = tmp_path / "notes"
    notes.mkdir()
    env = dict(os.environ, HF_SUITE_NOTES=str(notes),
               PYTHONPATH=os.pathsep.join([str(tmp_path), os.path.abspath(ROOT), os.environ.get("PYTHONPATH", "")]))
    r = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, env=env, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    out = json.loads(r.stdout.strip().splitlines()[-1])
    assert out["settings"] == {"patch": patch, "compat": {"HF_SUITE_PROBE": [1, 2]}}
    assert out["compat"] == [1, 2]
    assert out["before"] == "Qwen3MoeDecoderLayer"  # never at construction
    assert out["after"] == (["DecoderLayer"] * 2 if patch else ["Qwen3MoeDecoderLayer"] * 2)
    assert out["patched_class"] is patch
    assert out["hidden_act"] == "silu"
    assert out["seeded"] == [True, False]
    noted = hf_suite.read_notes(notes)
    assert noted["patched"] == (1 if patch else 0)  # once a model, not once a call
    assert noted["hidden_act Tester gelu"] == 1 and noted["compat HF_SUITE_PROBE"] == 1
    assert hf_suite.notes_line("patched", noted).startswith("patched: hidden_act -> silu in Tester (was gelu)")
