"""The cost model's view of expert parallelism (qwen3layer.analysis.costs.ep_exchange) and
the CLI's `run --ep N`, which measures it."""
import math
import os
import subprocess
import sys

import pytest

import qwen3layer as q3
from qwen3layer.analysis.costs import ep_exchange

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..")
CFG = q3.LayerConfig(hidden_size=64, num_attention_heads=8, num_key_value_heads=2, head_dim=24,
                     num_experts=4, num_experts_per_tok=2, moe_intermediate_size=48)


def test_one_rank_moves_nothing_and_holds_every_expert():
    x = ep_exchange(CFG, 1, 100)
    assert x.rows_out == [0.0] and x.rows_in == [0.0] and x.bytes_sent == [0.0]
    whole = q3.DecoderLayer.random(CFG, seed=0, dtype="bfloat16")
    none = q3.DecoderLayer.random(CFG, seed=0, dtype="bfloat16", experts=[])
    assert x.expert_bytes == [whole.weight_bytes - none.weight_bytes]


def test_two_ranks_of_two_experts_each():
    """a row's 2 of 4 experts miss rank d's 2 only when they are the other 2: 1 of C(4, 2) = 6"""
    x = ep_exchange(CFG, 2, 12, "bfloat16")
    assert x.rows_out == [pytest.approx(10.0)] * 2 and x.rows_in == [pytest.approx(10.0)] * 2
    out, back = 64 * 2 + 8 * 2, 64 * 2
    assert x.bytes_sent == [pytest.approx(10 * out + 10 * back)] * 2 == x.bytes_received


def test_uneven_placement_is_asymmetric():
    x = ep_exchange(CFG, 2, 6, "float32", placement=[[0, 1, 2], [3]])
    reach = [1 - math.comb(1, 2) / 6, 1 - math.comb(3, 2) / 6]  # rank 0: always; rank 1: half the rows
    assert x.rows_in == [pytest.approx(6 * reach[0]), pytest.approx(6 * reach[1])]
    assert x.rows_out == [pytest.approx(6 * reach[1]), pytest.approx(6 * reach[0])]
    assert x.expert_bytes[0] == 3 * x.expert_bytes[1]
    with pytest.raises(ValueError, match="expert 2 placed on ranks 0 and 1"):
        ep_exchange(CFG, 2, 6, placement=[[0, 1, 2], [2, 3]])


def test_run_ep_spawns_the_ranks_and_prints_their_phases():
    r = subprocess.run([sys.executable, "-m", "qwen3layer", "run", "--ep", "2", "--geometry", "tiny", "--tokens", "24",
                        "--chunk-size", "8", "--new-tokens", "2"], cwd=ROOT, capture_output=True, text=True,
                       timeout=240)
    assert r.returncode == 0, r.stderr
    assert "expert parallelism: 2 local processes (gloo)" in r.stdout
    lines = r.stdout.splitlines()
    for phase in ("prefill:", "decode:"):
        i = lines.index(phase)
        assert lines[i + 1].startswith("0    | 0..3 (4)") and lines[i + 2].startswith("1    | 4..7 (4)"), lines[i:i + 3]
        assert "(model " in lines[i + 1]
    assert "prefill: 3 pass(es) a rank" in r.stdout


def test_run_ep_refuses_what_it_cannot_do():
    r = subprocess.run([sys.executable, "-m", "qwen3layer", "run", "--ep", "0"], cwd=ROOT, capture_output=True,
                       text=True, timeout=60)
    assert r.returncode == 2 and "--ep: expected a number of processes >= 1, got 0" in r.stderr
    r = subprocess.run([sys.executable, "-m", "qwen3layer", "run", "--ep", "2", "--device", "cuda", "--geometry",
                        "tiny"], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "random weights on the CPU only (so far): no --checkpoint or --device" in r.stderr


def test_run_ep_of_4_bit_weights(tmp_path):
    """run --ep 2 --int4: each rank's share of a random gptq_int4 layer (its weight bytes the
    4-bit ones: a quarter of bf16's and more, scales and zeros)"""
    cfg = tmp_path / "config.json"
    cfg.write_text('{"hidden_size": 256, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 64, '
                   '"num_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 128}')
    runs = {}
    for fmt in ([], ["--int4"]):
        r = subprocess.run([sys.executable, "-m", "qwen3layer", "run", "--ep", "2", "--geometry", str(cfg), "--tokens",
                            "12", "--chunk-size", "8", "--new-tokens", "1", *fmt], cwd=ROOT, capture_output=True,
                           text=True, timeout=240)
        assert r.returncode == 0, r.stderr
        runs[bool(fmt)] = r.stdout
    assert "random bfloat16 weights (gptq_int4 matrices)" in runs[True]
    rank0 = {k: next(line for line in v.splitlines() if line.startswith("0    |")) for k, v in runs.items()}
    assert rank0[True].split("|")[1] == rank0[False].split("|")[1]  # the same experts
    assert rank0[True].split("|")[2] != rank0[False].split("|")[2], rank0  # fewer weight bytes


def test_the_real_geometry_figures_of_the_docs():
    x = ep_exchange(q3.LayerConfig.qwen3_235b_a22b(), 2, 512)
    assert x.rows_out[0] == pytest.approx(510.4, abs=0.05)
    assert x.bytes_sent[0] == pytest.approx(8.40e6, rel=1e-3) and x.expert_bytes[0] == 64 * 3 * 1536 * 4096 * 2


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_the_device_combine_adds_as_combine_rows_to_the_bit(dtype):
    """the combine a CUDA rank runs (one index_add_ a rank's block, in rank order), here on
    host tensors, against _C.combine_rows: rows named by several blocks, a block of none"""
    import torch
    from qwen3layer import _C
    from qwen3layer.placement.parallel import _combine_blocks

    g = torch.Generator().manual_seed(3)
    R, H, dt = 9, 64, getattr(torch, dtype)
    split = [4, 0, 6, 3]
    rows = torch.cat([torch.randperm(R, generator=g)[:n] for n in split]).to(torch.int64)
    parts = (100 * torch.randn(len(rows), H, generator=g)).to(dt)  # large parts: an order change would show
    resid = torch.randn(R, H, generator=g)
    want = torch.empty(R, H, dtype=dt)
    _C.combine_rows(resid.clone(), parts, rows.to(torch.int32), want)
    got = _combine_blocks(resid.clone(), parts, rows, split, dt)
    assert got.dtype == dt and torch.equal(got, want)
