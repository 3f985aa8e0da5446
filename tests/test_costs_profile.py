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


def run_cli(*args, env=None, timeout=180):
    return subprocess.run([sys.executable, "-m", "qwen3layer", *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=timeout, env=env)


def test_map_writes_svg_png_and_the_sweep(tmp_path):
    r = run_cli("map", "--geometry", "tiny", "--tokens", "48", "--chunk-size", "16", "--sweep-chunk", "8,48",
                "--out", str(tmp_path))
    assert r.returncode == 0, r.stderr
    for name in ("map.svg", "map.png", "sweep.svg", "sweep.png"):
        assert (tmp_path / name).stat().st_size > 1000, name
    assert (tmp_path / "map.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert b"<svg" in (tmp_path / "map.svg").read_bytes()[:1000]
    assert "prefill: 48 token(s)" in r.stdout and "decode: 1 token(s)" in r.stdout
    assert "chunk size | prefill s" in r.stdout


TINY_CHECK = ("check", "--geometry", "tiny", "--tokens", "64", "--chunk-size", "16", "--context", "40",
              "--latency-factor", "1e6", "--json")  # a tiny layer is overhead, not memory: latency is not its ruler


def test_check_passes_and_speaks_json():
    import json

    r = run_cli(*TINY_CHECK)
    assert r.returncode == 0, r.stdout + r.stderr
    out = json.loads(r.stdout)
    assert out["pass"] is True
    assert [x["name"] for x in out["rulers"]] == ["accuracy against transformers", "decode latency", "prefill memory"]
    assert all(x["passed"] for x in out["rulers"])


def test_check_fails_when_a_weight_is_perturbed():
    import json

    r = run_cli(*TINY_CHECK, "--perturb", "self_attn.o_proj.weight")
    assert r.returncode == 1
    out = json.loads(r.stdout)
    assert out["pass"] is False and out["rulers"][0]["passed"] is False


def test_check_without_transformers_says_so(tmp_path):
    shim = tmp_path / "transformers"
    shim.mkdir()
    (shim / "__init__.py").write_text("raise ImportError('transformers is hidden for this test')\n")
    env = dict(os.environ, PYTHONPATH=str(tmp_path))
    r = run_cli(*TINY_CHECK[:-1], env=env)
    assert r.returncode == 0, r.stderr
    assert "NOT RUN accuracy against transformers: transformers and torch are needed" in r.stdout
    assert "Traceback" not in r.stderr


def test_cli_names_a_device_it_cannot_use():
    r = run_cli("run", "--geometry", "tiny", "--device", "tpu")
    assert r.returncode == 2
    assert "python -m qwen3layer run: device: expected 'cpu', 'cuda' or 'cuda:N', got 'tpu'" in r.stderr
    assert "Traceback" not in r.stderr
