"""benchmarks/bench_cuda.py's per-stage model: `--predict` (no GPU) prints, for the issue's
rows, every stage's bytes, FLOPs and floor at the H200 figures of
qwen3layer/analysis/gpu_figures.py; the figures here are q3.cost_model's, recomputed, and the
floors the project planned with (107 us, 6.0 ms). The measured columns (a GPU run) are checked
on the emulated device's stage profile."""
import os
import subprocess
import sys

import pytest

import qwen3layer as q3
from qwen3layer.analysis import gpu_figures
from qwen3layer.analysis.costs import STAGES
from qwen3layer.analysis.costs_hybrid import Machine

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..")
BENCH = os.path.join(ROOT, "benchmarks", "bench_cuda.py")
ROWS = {"decode batch 1, context 8192": dict(mode="decode", tokens=1, context=8192, batch=1),
        "decode batch 16, context 8192": dict(mode="decode", tokens=1, context=8192, batch=16),
        "prefill 8192 tokens, one chunk of 8192": dict(mode="prefill", tokens=8192, context=0, chunk_size=8192)}
COPY, MATRIX = 4.3e12, 790e12  # an H200's copy and bf16 matrix rates (gpu_figures.py, checked below)


def tables(text):
    """{title: {stage: [cells]}} of the model tables in bench_cuda's output."""
    out, rows = {}, None
    for line in text.splitlines():
        cells = [c.strip() for c in line.split("|")]
        if line.split(":")[0] in ROWS:
            rows = out.setdefault(line.split(":")[0], {})
        elif rows is not None and len(cells) > 1 and cells[0] not in ("stage", "") and not set(line) <= set("-| "):
            rows[cells[0]] = cells[1:]
    return out


@pytest.fixture(scope="module")
def predicted():
    run = subprocess.run([sys.executable, BENCH, "--predict"], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    return run.stdout


def test_the_figures_are_the_h200s_and_the_split_models_defaults():
    assert (gpu_figures.H200_COPY_BYTES_PER_S, gpu_figures.H200_BF16_FLOPS) == (COPY, MATRIX)
    machine = Machine()
    assert (machine.device_read, machine.device_flops, machine.link) == \
        (COPY, MATRIX, gpu_figures.PCIE5_X16_BYTES_PER_S) == (4.3e12, 790e12, 50e9)


def test_predict_prints_every_stage_of_each_row_from_the_cost_model(predicted):
    assert ("4.3 TB/s copy and 790 TFLOP/s bf16 matrix rate (qwen3layer/analysis/gpu_figures.py)"
            in predicted.splitlines()[0])
    got = tables(predicted)
    assert list(got) == list(ROWS)
    cfg = q3.LayerConfig.qwen3_235b_a22b()
    for title, args in ROWS.items():
        cost = q3.cost_model(cfg, **args)
        rows = got[title]
        assert list(rows) == list(STAGES) + ["total"]
        floors = 0.0
        for s in cost.stages:
            mb, gflop, bound, floor_us = rows[s.name]  # the predicted column alone: nothing measured
            floor = max(s.bytes / COPY, s.flops / MATRIX)
            floors += floor
            assert float(mb) == pytest.approx(s.bytes / 1e6, abs=6e-4)
            assert float(gflop) == pytest.approx(s.flops / 1e9, abs=6e-4)
            assert float(floor_us) == pytest.approx(floor * 1e6, abs=6e-3)
            assert bound == ("matrix" if s.flops / MATRIX > s.bytes / COPY else "memory")
        mb, gflop, _, floor_us = rows["total"]
        assert float(mb) == pytest.approx(cost.bytes / 1e6, abs=6e-4)
        assert float(gflop) == pytest.approx(cost.flops / 1e9, abs=6e-4)
        assert float(floor_us) == pytest.approx(floors * 1e6, abs=6e-3)


def test_predicted_totals_are_the_planned_floors(predicted):
    got = tables(predicted)
    # decode batch 1 at 8192: 462 MB read, >= 107 us; every stage memory-bound
    d1 = got["decode batch 1, context 8192"]
    assert 462 <= float(d1["total"][0]) < 463 and 107 <= float(d1["total"][3]) < 108
    assert {r[2] for s, r in d1.items() if s != "total"} == {"memory"}
    assert float(d1["experts"][0]) == pytest.approx(8 * 3 * 4096 * 1536 * 2 / 1e6, rel=1e-3)  # 8 experts' weights
    # batch 16: the weights once for all 16 (82 experts expected hit); attention reads each
    # sequence's cache (2 KiB a token, 8193 tokens) and its q, writes its output (fp32, 8192 each)
    d16 = got["decode batch 16, context 8192"]
    assert float(d16["attention"][0]) == pytest.approx(16 * (8193 * 2048 + 2 * 8192 * 4) / 1e6, abs=1e-3)
    hit = round(128 * (1 - (1 - 8 / 128) ** 16))
    assert hit == 82 and float(d16["experts"][0]) == pytest.approx(hit * 3 * 4096 * 1536 * 2 / 1e6, rel=1e-3)
    assert float(d1["total"][3]) < float(d16["total"][3]) < 16 * float(d1["total"][3]) / 2
    # prefill of 8192 tokens: 4.75 TFLOP, >= 6.0 ms; the projections, attention and experts matrix-bound
    p = got["prefill 8192 tokens, one chunk of 8192"]
    assert float(p["total"][1]) == pytest.approx(4750, abs=1)
    assert 6000 <= float(p["total"][3]) < 7000
    assert {s for s, r in p.items() if r[2] == "matrix"} == {"qkv_proj", "attention", "o_proj", "experts"}


def test_results_md_holds_the_predicted_tables_until_a_gpu_run(predicted):
    results = open(os.path.join(ROOT, "benchmarks", "RESULTS.md")).read()
    if "predicted, no GPU run yet" not in results:
        pytest.skip("benchmarks/RESULTS.md holds a GPU run")
    for block in predicted.split("\n\n")[1:]:
        assert block.strip() in results, block.splitlines()[0]


@pytest.mark.skipif(not os.path.exists(q3.cuda.SIMT_LIBRARY), reason="no SIMT executor in this build")
def test_the_measured_columns_are_the_stage_profile_against_the_floors():
    # what a GPU run prints beside the floors, here from the emulated device's stage profile
    code = f"""
import sys
sys.path.insert(0, {os.path.join(ROOT, 'benchmarks')!r})
import bench_cuda, qwen3layer as q3
q3.cuda.emulate()
layer = q3.DecoderLayer.random(q3.LayerConfig.tiny(), seed=0, device="cuda", dtype="bfloat16")
p = layer.profile("decode", 1, 33, None, repeat=1, batch=3)
print(repr({{s.name: s.seconds for s in p.stages}}))
print(bench_cuda.model_table("decode batch 1, context 8192: tiny", p.cost, 4.3, 790,
                             {{s.name: s.seconds for s in p.stages}}))
"""
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr
    measured = eval(run.stdout.splitlines()[0])
    assert list(measured) == list(STAGES) and all(t > 0 for t in measured.values())
    rows = tables(run.stdout)["decode batch 1, context 8192"]
    cost = q3.cost_model(q3.LayerConfig.tiny(), "decode", 1, 33, dtype="bfloat16", batch=3)
    for s in cost.stages:
        mb, _, _, floor_us, measured_us, ratio = rows[s.name]
        floor = max(s.bytes / COPY, s.flops / MATRIX)
        assert float(measured_us) == pytest.approx(measured[s.name] * 1e6, abs=6e-3)
        assert float(ratio) == pytest.approx(measured[s.name] / floor, rel=1e-3, abs=6e-3)
    total = rows["total"]
    assert float(total[4]) == pytest.approx(sum(measured.values()) * 1e6, abs=6e-3)


@pytest.mark.skipif(q3.cuda.device_count() > 0, reason="this machine has a CUDA device")
def test_without_a_device_the_benchmark_says_so_and_points_at_predict():
    run = subprocess.run([sys.executable, BENCH], capture_output=True, text=True, timeout=120)
    assert run.returncode == 2 and run.stdout == ""
    assert run.stderr == ("bench_cuda: no CUDA device on this machine (0 found); --predict prints the per-stage model "
                          "alone\n")


def test_the_int4_rows_weights_are_the_engines_rtn_quantization():
    """bench_cuda's GPTQ weights (quantized by torch on the GPU there, on the host here) are the
    tensors the engine's RTN makes of the same draws (random_weights 'gptq_int4'), bit for bit"""
    import torch

    sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
    import bench_cuda

    cfg = q3.LayerConfig(hidden_size=256, num_attention_heads=4, num_key_value_heads=2, head_dim=64, num_experts=4,
                         num_experts_per_tok=2, moe_intermediate_size=128)
    packed = bench_cuda.int4_weights_on_gpu(q3._C.random_weights(cfg, 5, "float32"), device="cpu")
    want = {k: torch.from_dlpack(v) for k, v in q3._C.random_weights(cfg, 5, "float32", "gptq_int4").items()}
    assert sorted(packed) == sorted(want)
    for name, t in want.items():
        assert packed[name].dtype == t.dtype and torch.equal(packed[name], t), name
