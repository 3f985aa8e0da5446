"""map --machine: a layer predicted on a machine from its published figures
(qwen3layer.analysis.machines). The arithmetic (each stage at the larger of its bytes over the
bandwidth and its FLOPs over the peak), a decode step's weight bytes over each machine's
bandwidth, the GPU tables and the GH200 split at NVLink-C2C's rate, and the refusals."""
import os
import subprocess
import sys

import pytest

import qwen3layer as q3
from qwen3layer.analysis.costs import cost_model, decode_weight_bytes
from qwen3layer.analysis.machines import MACHINES, machine, predict

REAL = q3.LayerConfig.qwen3_235b_a22b()
ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..")


@pytest.mark.parametrize("name", sorted(MACHINES))
@pytest.mark.parametrize("mode,tokens,context", [("prefill", 512, 0), ("decode", 1, 4096)])
def test_each_stage_is_its_roofline_floor(name, mode, tokens, context):
    m = MACHINES[name]
    for on_gpu in (False, True) if m.has_gpu else (False,):
        read, peak = (m.gpu_read, m.gpu_bf16) if on_gpu else (m.read, m.fp32)
        model, times = predict(REAL, m, mode, tokens, context=context, chunk_size=512, on_gpu=on_gpu)
        assert [t.name for t in times] == [s.name for s in model.stages]
        for s, t in zip(model.stages, times):
            assert t.seconds == pytest.approx(max(s.bytes / read, s.flops / peak), rel=1e-12)
            assert t.bound == ("compute" if s.flops / peak > s.bytes / read else "memory")


@pytest.mark.parametrize("name", sorted(MACHINES))
@pytest.mark.parametrize("fmt", ["dense", "fp8_e4m3_block128", "gptq_int4"])
def test_a_decode_step_at_no_context_reads_its_weights_at_the_bandwidth_where_the_cpu_keeps_up(name, fmt):
    """a decode step's matrix stages do 2 FLOPs a weight: 1 a byte in bf16, 2 in FP8, 4 in 4
    bits. Where the CPU's fp32 peak over its bandwidth is above that, the step is its bytes over
    the bandwidth; Orin's CPU (2.1 FLOPs a byte) is not fast enough for 4 bits, whose experts
    are then bound by the peak"""
    m = machine(name)
    model, times = predict(REAL, m, "decode", 1, dtype="bfloat16", weight_format=fmt)
    per_byte = {"dense": 1.0, "fp8_e4m3_block128": 2.0, "gptq_int4": 4.0}[fmt]
    experts = next(t for t in times if t.name == "experts")
    if m.fp32 / m.read > per_byte:
        assert all(t.bound == "memory" for t in times)
        total = sum(t.seconds for t in times)
        assert total == pytest.approx(model.bytes / m.read, rel=1e-12)
        weights = decode_weight_bytes(REAL, "bfloat16", fmt)
        assert weights / m.read < total < 1.01 * weights / m.read
    else:
        assert (name, fmt) == ("orin", "gptq_int4") and experts.bound == "compute"
        assert experts.seconds == pytest.approx(experts.flops / m.fp32, rel=1e-12)


def test_the_published_figures_are_as_documented():
    """the table of docs/cli.md, one figure a machine checked against its definition"""
    assert MACHINES["grace"].fp32 == pytest.approx(7.14e12, rel=1e-3)  # 72 x 3.1 GHz x 32 FLOP
    assert MACHINES["graviton4"].read == 536.7e9 and MACHINES["orin"].read == 204.8e9
    assert MACHINES["gb10"].read == MACHINES["gb10"].gpu_read == 273e9 and not MACHINES["gb10"].link
    assert MACHINES["gh200"].link == 450e9 and MACHINES["gh200"].gpu_read == 4.0e12
    docs = open(os.path.join(ROOT, "docs", "cli.md")).read()
    for name in MACHINES:
        assert f"| `{name}` |" in docs, name


def test_refusals_name_what_they_got():
    with pytest.raises(ValueError, match="--machine: expected one of grace, gh200, gb10, orin, graviton4, got 'h100'"):
        machine("h100")
    with pytest.raises(ValueError, match="--machine graviton4: it has no GPU"):
        predict(REAL, MACHINES["graviton4"], "decode", 1, on_gpu=True)
    with pytest.raises(ValueError, match="--machine orin: the GPU \\+ host split needs a GPU reached over a link"):
        MACHINES["orin"].split()
    split = MACHINES["gh200"].split()
    assert (split.link, split.host_read, split.device_read) == (450e9, 500e9, 4.0e12)


def cli(*args):
    return subprocess.run([sys.executable, "-m", "qwen3layer", "map", *args], cwd=ROOT, capture_output=True,
                          text=True, timeout=120)


def test_map_machine_prints_predicted_tables_and_measures_nothing():
    r = cli("--machine", "orin", "--geometry", "tiny", "--tokens", "64")
    assert r.returncode == 0, r.stderr
    assert r.stdout.count("PREDICTED from published figures") == 4  # CPU and GPU, prefill and decode
    assert "orin CPU: a decode step at context 64" in r.stdout and "orin GPU: prefill of 64 tokens" in r.stdout
    assert "measuring" not in r.stdout and "building" not in r.stdout
    for flags, needle in ((["--hidden-keys", "0.5"], "--hidden-keys: measures this machine"),
                          (["--device", "cuda"], "--device cuda: with --machine"),
                          (["--repeat", "5"], "--repeat 5: with --machine orin no layer is built"),
                          (["--out", "elsewhere"], "--out elsewhere: with --machine orin no layer is built"),
                          (["--seed", "3"], "--seed 3: with --machine orin no layer is built"),
                          (["--expert-device", "cpu"], "--machine orin: the GPU + host split needs a GPU reached")):
        r = cli("--machine", "orin", "--geometry", "tiny", *flags)
        assert r.returncode == 2 and needle in r.stderr, r.stderr


def test_gh200s_split_is_priced_at_its_link():
    """NVLink-C2C's 450 GB/s each way in the split's tables, where PCIe 5's 50 stood"""
    r = cli("--machine", "gh200", "--geometry", "tiny", "--tokens", "64", "--expert-device", "cpu",
            "--gpu-experts", "2")
    assert r.returncode == 0, r.stderr
    assert "link 450 GB/s each way" in r.stdout and "host 500 GB/s read" in r.stdout
    assert "probing this machine" not in r.stdout
    cfg = q3.LayerConfig.tiny()
    assert cost_model(cfg, "decode", 1).weight_bytes > 0
