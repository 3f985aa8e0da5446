"""The cost model against the hand counts, the stage profile's structure, and the main job
on a tiny geometry. (Nothing here asserts a timing.)"""
import os
import subprocess
import sys

import pytest

import qwen3layer as q3
from qwen3layer.costs import STAGES

REAL = q3.LayerConfig.qwen3_235b_a22b()
ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")


def test_decode_token_touches_the_hand_counted_weight_bytes():
    m = q3.cost_model(REAL, "decode", tokens=1)
    assert m.weight_bytes == 445_661_696
    assert m.stage("qkv_proj").weight_bytes + m.stage("o_proj").weight_bytes == 142_606_336
    assert m.stage("experts").weight_bytes == 8 * 3 * 4096 * 1536 * 2


def test_prefill_of_8192_tokens_is_the_hand_counted_flops():
    m = q3.cost_model(REAL, "prefill", tokens=8192)
    assert round(m.flops / 1e12, 3) == 4.750
    assert round((m.stage("qkv_proj").flops + m.stage("o_proj").flops) / 1e12, 3) == 1.168
    assert round(m.stage("router").flops / 1e12, 3) == 0.009
    assert round(m.stage("experts").flops / 1e12, 3) == 2.474
    assert round(m.stage("attention").flops / 1e12, 3) == 1.100
    assert [s.name for s in m.stages] == list(STAGES)


def test_chunks_change_the_bytes_not_the_flops():
    whole = q3.cost_model(REAL, "prefill", tokens=8192)
    chunked = q3.cost_model(REAL, "prefill", tokens=8192, chunk_size=2048)
    assert chunked.passes == 4 and chunked.flops == pytest.approx(whole.flops, rel=1e-12)
    # every chunk of 2048 tokens hits all 128 experts: four passes read the weights four times
    assert chunked.weight_bytes == pytest.approx(4 * whole.weight_bytes, rel=1e-6)
    assert q3.cost_model(REAL, "decode", tokens=4, context=100).passes == 4


@pytest.mark.parametrize("kwargs,msg", [(dict(mode="train"), "mode: expected 'prefill' or 'decode', got 'train'"),
                                        (dict(tokens=0), "tokens: expected a positive int, got 0"),
                                        (dict(context=-1), "context: expected a non-negative int, got -1"),
                                        (dict(chunk_size=0), "chunk_size: expected a positive int or None, got 0"),
                                        (dict(dtype="int8"), "dtype: expected 'float32' or 'bfloat16', got 'int8'")])
def test_cost_model_rejects_bad_arguments(kwargs, msg):
    with pytest.raises(ValueError, match=msg):
        q3.cost_model(REAL, **({"mode": "decode"} | kwargs))


def test_profile_times_every_stage_of_the_cost_model():
    layer = q3.DecoderLayer.random(q3.LayerConfig.tiny(), dtype="float32")
    for mode, tokens in (("prefill", 40), ("decode", 3)):
        p = layer.profile(mode, tokens=tokens, context=9, chunk_size=16, repeat=2)
        assert [s.name for s in p.stages] == list(STAGES)
        assert all(s.seconds >= 0 for s in p.stages)
        assert p.stage_seconds > 0 and p.call_seconds > 0
        assert sum(s.share for s in p.stages) == pytest.approx(1.0)
        assert p.cost.tokens == tokens and p.cache_bytes > 0
        assert "dominant" in p.table()


def test_main_job_runs_on_a_tiny_geometry():
    r = subprocess.run([sys.executable, "-m", "qwen3layer", "run", "--geometry", "tiny", "--tokens", "40",
                        "--chunk-size", "16", "--new-tokens", "3"], cwd=ROOT, capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 0, r.stderr
    assert "prefill  40 tokens in chunks of 16" in r.stdout
    assert "the map, prefill of 40 tokens in 3 chunk(s) of 16" in r.stdout
    assert "the map, decode: 3 steps from context 40" in r.stdout
    assert "40/40 tokens" in r.stderr  # the progress line


def test_main_job_rejects_bad_options():
    r = subprocess.run([sys.executable, "-m", "qwen3layer", "run", "--tokens", "0"], cwd=ROOT,
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "--tokens: expected a positive int, got 0" in r.stderr
