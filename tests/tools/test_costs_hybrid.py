"""qwen3layer.analysis.costs_hybrid: the GPU + host split's bytes against routings drawn at
random (uniform, and from skewed shares), its ends (every expert on one side), its bounds, and
its refusals."""
import math

import pytest
import torch

import qwen3layer as q3
from qwen3layer.analysis.costs import cost_model
from qwen3layer.analysis.costs_hybrid import Machine, hybrid_split, split_cost_model

REAL = q3.LayerConfig.qwen3_235b_a22b()
SMALL = q3.LayerConfig(hidden_size=64, num_attention_heads=8, num_key_value_heads=2, head_dim=24, num_experts=16,
                       num_experts_per_tok=4, moe_intermediate_size=48)


def _drawn(cfg, rows, gpu, shares, trials, seed):
    """mean rows with a host expert and mean distinct host experts hit, over routings drawn
    by independent choices of `shares` (uniform: k distinct experts a row)"""
    g = torch.Generator().manual_seed(seed)
    E, k = cfg.num_experts, cfg.num_experts_per_tok
    host = torch.ones(E, dtype=torch.bool)
    host[list(gpu)] = False
    p = torch.full((E,), 1.0 / E) if shares is None else torch.tensor(shares, dtype=torch.float64)
    to_host = hit = 0.0
    for _ in range(trials):
        if shares is None:
            ids = torch.rand(rows, E, generator=g).argsort(1)[:, :k]  # k distinct, uniform
        else:
            ids = torch.multinomial(p.expand(rows, E), k, replacement=True, generator=g)
        on_host = host[ids]
        to_host += on_host.any(1).sum().item()
        hit += host[ids.unique()].sum().item()
    return to_host / trials, hit / trials


@pytest.mark.parametrize("rows,gpu", [(1, range(4)), (3, range(8)), (12, [0, 5, 9]), (40, range(12))])
def test_uniform_routing_bytes_match_drawn_routings(rows, gpu):
    s = hybrid_split(SMALL, rows, list(gpu), mode="prefill")
    want_rows, want_hit = _drawn(SMALL, rows, gpu, None, 4000, rows)
    assert s.rows_to_host == pytest.approx(want_rows, rel=0.03, abs=0.02)
    per_expert = 3 * SMALL.hidden_size * SMALL.moe_intermediate_size * 2
    assert s.host_expert_bytes / per_expert == pytest.approx(want_hit, rel=0.03, abs=0.02)
    # what qwen3layer.placement.hybrid moves: every row's ids down, the rows with a host expert
    # (their normed input and weights) down, their index and fp32 sums up, the device ids up
    H, k, n = SMALL.hidden_size, SMALL.num_experts_per_tok, s.rows_to_host
    assert s.link_down_bytes == pytest.approx(rows * 4 * k + n * (2 * H + 4 * k))
    assert s.link_up_bytes == pytest.approx(n * (4 + 4 * H) + rows * 4 * k)


def test_skewed_shares_with_the_hottest_on_the_gpu_send_fewer_rows_and_match_drawn_routings():
    shares = [2.0 ** -(e / 3) for e in range(SMALL.num_experts)]  # expert 0 hottest
    hot, cold = list(range(4)), list(range(12, 16))
    s_hot = hybrid_split(SMALL, 10, hot, shares=shares)
    s_cold = hybrid_split(SMALL, 10, cold, shares=shares)
    assert s_hot.rows_to_host < s_cold.rows_to_host and s_hot.host_expert_bytes < s_cold.host_expert_bytes
    want_rows, _ = _drawn(SMALL, 10, hot, shares, 4000, 7)
    assert s_hot.rows_to_host == pytest.approx(want_rows, rel=0.03)  # independent draws: the model's premise


def test_the_ends_every_expert_on_one_side():
    E = REAL.num_experts
    whole = cost_model(REAL, "decode", 1, 0, batch=4)
    gpu = hybrid_split(REAL, 4, list(range(E)))
    host = hybrid_split(REAL, 4, [])
    assert gpu.rows_to_host == 0 and gpu.host_expert_bytes == 0 and gpu.bound == "device"
    assert host.rows_to_host == 4 and host.device_expert_bytes == 0 and host.bound == "host"
    H, k = REAL.hidden_size, REAL.num_experts_per_tok  # all on the GPU: only the ids cross
    assert (gpu.link_down_bytes, gpu.link_up_bytes) == (4 * 4 * k, 4 * 4 * k)
    assert (host.link_down_bytes, host.link_up_bytes) == (4 * (8 * k + 2 * H), 4 * (4 + 4 * H))
    # either way the experts read are the whole layer's (cost_model rounds the experts hit)
    per_expert = whole.stage("experts").weight_bytes / round(E * (1 - (1 - 8 / E) ** 4))
    for s in (gpu, host):
        assert abs(s.host_expert_bytes + s.device_expert_bytes - whole.stage("experts").weight_bytes) < per_expert


def test_the_bound_moves_to_the_device_as_experts_move_there():
    fast_host = Machine(host_read=400e9, host_flops=4e12)
    bounds = [hybrid_split(REAL, 1, list(range(n)), context=512, machine=fast_host).bound for n in (0, 64, 120, 128)]
    assert bounds[0] == "host" and bounds[-1] == "device"
    times = [hybrid_split(REAL, 1, list(range(n)), context=512).pass_s for n in (0, 32, 64, 96, 128)]
    assert times == sorted(times, reverse=True)  # the default host is the slower side: each expert moved helps


def test_fp8_halves_the_expert_bytes():
    dense = hybrid_split(REAL, 1, list(range(16)))
    fp8 = hybrid_split(REAL, 1, list(range(16)), weight_format="fp8_e4m3_block128")
    assert fp8.host_expert_bytes / dense.host_expert_bytes == pytest.approx(0.5, rel=0.01)


def test_int4_expert_bytes_are_the_gptq_tensors():
    """gptq_int4: an expert's bytes are its three matrices' nibbles, fp16 scales, packed zeros
    and g_idx (group 128: cost_model's and the engine's count), not FP8's"""
    int4 = hybrid_split(REAL, 1, [], weight_format="gptq_int4")
    H, I = REAL.hidden_size, REAL.moe_intermediate_size

    def gptq(n, k):
        return k // 8 * n * 4 + k // 128 * n * 2 + k // 128 * (n // 8) * 4 + k * 4
    per_expert = 2 * gptq(I, H) + gptq(H, I)
    assert int4.host_expert_bytes == pytest.approx(per_expert * REAL.num_experts_per_tok)  # a row's k experts


def test_split_cost_model_counts_a_dense_attention_at_the_layers_dtype():
    args = (REAL, "decode", 1, 100, None, "bfloat16", 1, "gptq_int4", "float32", [0, 5])
    packed, dense = split_cost_model(*args), split_cost_model(*args, dense_attention=True)
    whole = cost_model(REAL, "decode", 1, 100, None, "bfloat16", 1, "gptq_int4", "float32", True)
    for name in ("qkv_proj", "o_proj"):
        assert dense.stage(name).weight_bytes == whole.stage(name).weight_bytes > packed.stage(name).weight_bytes


@pytest.mark.parametrize("kwargs,needle", [
    (dict(rows=0), "rows: expected a positive int, got 0"),
    (dict(gpu_experts=[1, 1]), "expert 1 is listed twice"),
    (dict(gpu_experts=[16]), "expected expert ids in [0, 16), got 16"),
    (dict(gpu_experts=[True]), "got True"),
    (dict(shares=[1.0] * 15), "expected 16 non-negative numbers"),
    (dict(shares=[0.0] * 16), "summing to 0.0"),
    (dict(shares=[math.nan] + [1.0] * 15), "expected 16 non-negative numbers"),
    (dict(mode="train"), "mode: expected 'prefill' or 'decode', got 'train'"),
    (dict(weight_format="int4"), "weight_format: expected one of"),
])
def test_refusals_name_the_argument(kwargs, needle):
    args = dict(rows=2, gpu_experts=[0])
    args.update(kwargs)
    with pytest.raises(ValueError) as e:
        hybrid_split(SMALL, args.pop("rows"), args.pop("gpu_experts"), **args)
    assert needle in str(e.value)


def test_map_and_run_take_the_split_flags():
    """map --expert-device cpu prints the predicted split (no GPU needed); run with them on a
    CPU device is refused, naming the flag"""
    import os
    import subprocess
    import sys
    root = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..")
    r = subprocess.run([sys.executable, "-m", "qwen3layer", "map", "--geometry", "tiny", "--tokens", "64",
                        "--expert-device", "cpu", "--gpu-experts", "1,3"], cwd=root, capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 0, r.stderr
    rows = [line for line in r.stdout.splitlines() if line.strip().startswith("2*")]
    assert len(rows) == 2, r.stdout  # the prefill and the decode table, this run's 2 experts marked
    assert "predicted pass: prefill of 64 row(s)" in r.stdout and "predicted pass: decode of 1 row(s)" in r.stdout
    r = subprocess.run([sys.executable, "-m", "qwen3layer", "run", "--geometry", "tiny", "--tokens", "8",
                        "--expert-device", "cpu", "--gpu-experts", "2"], cwd=root, capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 2 and "expert_device='cpu'" in r.stderr and "device is 'cpu'" in r.stderr, r.stderr


def test_gpu_experts_help_says_what_n_means_on_the_command_line(capsys):
    """--gpu-experts N is experts 0..N-1 (random weights), not the API's N hottest: the help says so"""
    from qwen3layer.cli import build_parser
    from qwen3layer.cli.hybrid import gpu_expert_ids

    parser = build_parser()
    for command in ("run", "map"):
        args = parser.parse_args([command, "--expert-device", "cpu", "--gpu-experts", "3"])
        assert gpu_expert_ids(args, 16) == [0, 1, 2]
        with pytest.raises(SystemExit):
            parser.parse_args([command, "--help"])
        text = " ".join(capsys.readouterr().out.split())
        assert "--gpu-experts N|IDS with --expert-device: N puts experts 0..N-1 on the GPU" in text
        assert "the API's gpu_experts=N instead takes the N hottest of expert_counts" in text


@pytest.mark.parametrize("gpu", [[], [0, 5, 9], list(range(128))])
@pytest.mark.parametrize("mode,tokens,chunk,batch", [("prefill", 1100, 512, 1), ("prefill", 40, 16, 3),
                                                     ("decode", 3, None, 8)])
def test_split_cost_model_is_the_layers_with_its_experts_by_side(gpu, mode, tokens, chunk, batch):
    """a split layer's profile model: the whole layer's stages but its experts, which become
    the GPU's experts, the link and the host's; the FLOPs divided by the experts each side
    holds, the bytes those of hybrid_split's passes (1100 tokens in chunks of 512: 512, 512,
    76), the activations on the GPU side"""
    whole = cost_model(REAL, mode, tokens, 100, chunk, "bfloat16", batch)
    m = split_cost_model(REAL, mode, tokens, 100, chunk, "bfloat16", batch, "dense", "float32", gpu)
    assert [s.name for s in m.stages] == [s.name for s in whole.stages if s.name != "experts"] + \
        ["gpu_experts", "link", "host_experts"]
    assert (m.passes, m.chunk_size) == (whole.passes, whole.chunk_size)
    st, ex = {s.name: s for s in m.stages}, whole.stage("experts")
    assert st["gpu_experts"].flops + st["host_experts"].flops == pytest.approx(ex.flops)
    assert st["gpu_experts"].flops == pytest.approx(ex.flops * len(gpu) / 128)
    step = 1 if mode == "decode" else chunk
    rows = [batch * (1 if mode == "decode" else min(step, tokens - p * step)) for p in range(whole.passes)]
    passes = [hybrid_split(REAL, r, gpu, mode=mode, context=100 + p * step) for p, r in enumerate(rows)]
    assert st["link"].act_read == round(sum(p.link_down_bytes for p in passes))
    assert st["link"].act_written == round(sum(p.link_up_bytes for p in passes))
    assert st["host_experts"].weight_bytes == round(sum(p.host_expert_bytes for p in passes))
    assert st["gpu_experts"].weight_bytes == round(sum(p.device_expert_bytes for p in passes))
    assert (st["host_experts"].weight_bytes == 0) == (len(gpu) == 128)
    assert (st["gpu_experts"].weight_bytes == 0) == (not gpu)
    assert st["gpu_experts"].act_read == ex.act_read and st["host_experts"].act_read == 0


def test_split_cost_model_refuses_what_hybrid_split_refuses():
    with pytest.raises(ValueError, match="expected expert ids in \\[0, 128\\), got 128"):
        split_cost_model(REAL, "decode", 1, 0, None, "bfloat16", 1, "dense", "float32", [128])
    with pytest.raises(ValueError, match="expert 3 is listed twice"):
        split_cost_model(REAL, "decode", 1, 0, None, "bfloat16", 1, "dense", "float32", [3, 3])
