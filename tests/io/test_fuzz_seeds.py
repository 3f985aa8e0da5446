"""The checkpoint fuzzer's hand-written seeds (tests/fuzz/fuzz_checkpoint.py, which .ci/sanitize
runs) are valid checkpoints: each whole file (mode 0) and each header spliced onto its data
(mode 1), dense, FP8 and 4-bit GPTQ, loads in its format and dtype, borrowing every tensor,
and runs, so that the fuzzer starts from layers that load. (Modes 0 and 1 need no atheris.)"""
import json
import os
import sys

import pytest
import torch

import qwen3layer as q3

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "fuzz"))
import fuzz_checkpoint as fc  # noqa: E402

SEEDS = fc.seeds(with_transformers=False)
LOADABLE = sorted(n for n in SEEDS if not n.startswith("edit-"))
FORMATS = {"dense": "dense", "fp8": "fp8_e4m3_block128", "gptq": "gptq_int4", "gptq-v2": "gptq_int4"}


def test_the_seeds_cover_every_format_in_every_mode():
    assert {(fc.input_format(d), d[0] % 3) for d in SEEDS.values()} == {(f, m) for f in FORMATS for m in range(3)}


@pytest.mark.parametrize("name", LOADABLE)
def test_a_hand_written_seed_loads_and_runs(tmp_path, name):
    data = SEEDS[name]
    fmt = fc.input_format(data)
    (tmp_path / "config.json").write_text(json.dumps(fc.CONFIGS[fmt]))
    (tmp_path / "model.safetensors").write_bytes(fc.checkpoint_bytes(data))
    layer = q3.DecoderLayer.from_checkpoint(str(tmp_path), 0)
    assert (layer.weight_format, layer.dtype) == (FORMATS[fmt], "bfloat16" if "bf16" in name else "float32")
    assert layer.converted == () and set(layer.weight_ptrs) == set(fc.LAYOUTS[fmt])
    hidden = fc.CONFIGS[fmt]["hidden_size"]
    y = torch.from_dlpack(layer.prefill(q3._C.random_tensor((3, hidden), 1, layer.dtype), layer.new_cache(4)))
    assert y.shape == (3, hidden) and torch.isfinite(y.float()).all()
