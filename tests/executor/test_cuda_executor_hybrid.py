"""A layer split over one GPU and the host (DecoderLayer(..., device="cuda",
expert_device="cpu", gpu_experts=...): attention, router and the GPU's experts on the CUDA
device, the other experts on the CPU kernels) on the SIMT executor, against the CPU layer of
the same seed; in a subprocess of its own (conftest.py).

For fp32 and bf16 and gpu_experts none, all and a mixed set: 2 sequences, the second with 3
tokens of left padding, a prefill of 7 tokens in chunks of 3 and two decode steps; the rows
and choices each side ran against the router's own choices (the host side's counted at the
host layer's expert half itself); the same bits on a second run; the insides against the CPU
layer's; gpu_experts=N from a calibration call's counts; FP8 and GPTQ int4 weights; and what is
refused."""
import pytest
import torch

import qwen3layer as q3
from executor_arrays import host, rel
from qwen3layer import _C
from qwen3layer.analysis.costs import cost_model
from qwen3layer.analysis.costs_hybrid import hybrid_split, link_bytes

pytestmark = pytest.mark.executor_subprocess
TIMEOUT = 600
CFG = q3.LayerConfig(hidden_size=64, num_attention_heads=8, num_key_value_heads=2, head_dim=24,
                     num_experts=8, num_experts_per_tok=2, moe_intermediate_size=48)
H, K, E, PAD = 64, 2, 8, 3
TOL = {"float32": 1e-5, "bfloat16": 5e-3}  # the CPU's bf16 paths round activations first, CUDA's not
SETS = {"none": [], "all": list(range(E)), "mixed": [1, 4, 6]}


def _inputs(dtype):
    g = torch.Generator().manual_seed(9)
    xs = [torch.randn(2, 7, H, generator=g)] + [torch.randn(2, H, generator=g) for _ in range(2)]
    return [x.to(getattr(torch, dtype)) for x in xs]


def _on(layer, x):
    """x in the layer's memory: the executor's device, or the host"""
    if layer.device == "cpu":
        return x
    raw = x.view(torch.int16) if x.dtype == torch.bfloat16 else x
    return _C.copy_tensor(_C.buffer_view(raw.numpy(), 0, list(x.shape), str(x.dtype)[6:]), 0)


def _run(layer, dtype):
    cache = layer.new_cache(16, batch=2)
    cache.set_padding(PAD, 1)
    outs, xs = [], _inputs(dtype)
    outs.append(layer.prefill(_on(layer, xs[0]), cache, chunk_size=3))
    for x in xs[1:]:
        outs.append(layer.decode(_on(layer, x), cache))
    return [y.double().numpy() if isinstance(y, torch.Tensor) else host(y) for y in outs]


class _Counting:
    """the host layer's expert half, counting the rows it is handed (and the most at once)"""

    def __init__(self, core):
        self.core, self.rows, self.most = core, 0, 0

    def expert_half(self, rows, *args, **kw):
        self.rows += rows.shape[0]
        self.most = max(self.most, rows.shape[0])
        return self.core.expert_half(rows, *args, **kw)


def _passes(trace, chunk):
    """a call's [.., tokens, k] expert ids, pass by pass (chunk tokens of each sequence), as [rows, k]"""
    ids = torch.from_dlpack(trace.experts)
    if ids.dim() == 2:  # a decode step: one pass
        return [ids]
    return [ids[:, c:c + chunk].reshape(-1, K) for c in range(0, ids.shape[1], chunk)]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("which", ["none", "all", "mixed"])
def test_split_layer_equals_the_cpu_layer(dtype, which):
    gpu = SETS[which]
    split = q3.DecoderLayer.random(CFG, 3, dtype, device="cuda", expert_device="cpu", gpu_experts=gpu)
    assert split.gpu_experts == tuple(gpu) and split.expert_device == "cpu"
    # the host side holds its experts alone: no attention, norms or router in host memory
    assert split._hybrid.host.weight_bytes == (E - len(gpu)) * 3 * H * 48 * (4 if dtype == "float32" else 2)
    cpu = q3.DecoderLayer.random(CFG, 3, dtype)
    counting = _Counting(split._hybrid.host)
    split._hybrid.host = counting
    got = _run(split, dtype)
    want = _run(cpu, dtype)
    for i, (g, w) in enumerate(zip(got, want)):
        assert g.shape == w.shape
        assert rel(g[1, PAD:] if g.ndim == 3 else g, w[1, PAD:] if w.ndim == 3 else w) <= TOL[dtype], (i, which)
        assert rel(g[0], w[0]) <= TOL[dtype], (i, which)
    # the choices each side ran are the router's: the CPU layer's own, call by call
    ref_cache = cpu.new_cache(16, batch=2)
    ref_cache.set_padding(PAD, 1)
    xs = _inputs(dtype)
    traces = [cpu.prefill(xs[0], ref_cache, chunk_size=3, return_router=True)]
    traces += [cpu.decode(x, ref_cache, return_router=True) for x in xs[1:]]
    ids = torch.cat([torch.from_dlpack(t.experts).reshape(-1, K) for t in traces])
    on_gpu = torch.isin(ids, torch.tensor(gpu, dtype=ids.dtype))
    st = split.hybrid_stats
    # the prefill ran pass by pass (3, 3 and 1 tokens of each sequence), then two decode steps:
    # no pass held more than a chunk of each sequence's rows, on either side
    assert (st["calls"], st["passes"], st["largest_pass_rows"]) == (3, 5, 2 * 3)
    assert counting.most <= 2 * 3
    assert st["device_choices"] == int(on_gpu.sum()) and st["host_choices"] == int((~on_gpu).sum())
    assert st["device_rows"] == int(on_gpu.any(1).sum()) and st["host_rows"] == int((~on_gpu).any(1).sum())
    assert counting.rows == st["host_rows"]  # the host's rows went through the CPU layer's experts
    # only the rows with a host expert crossed: the bytes, pass by pass, as the cost model counts them
    down = up = 0
    for ids in (p for t in traces for p in _passes(t, 3)):
        side = torch.isin(ids, torch.tensor(gpu, dtype=torch.int32))
        d, u = link_bytes(CFG, side.shape[0], int((~side).any(1).sum()), bool(side.any()), dtype)
        down, up = down + d, up + u
    assert (st["link_down_bytes"], st["link_up_bytes"]) == (down, up)
    if which == "mixed":
        assert st["device_rows"] > 0 and st["host_rows"] > 0
    # the same bits again: every sum in a fixed order
    again = _run(q3.DecoderLayer.random(CFG, 3, dtype, device="cuda", expert_device="cpu", gpu_experts=gpu), dtype)
    assert all((a == b).all() for a, b in zip(got, again))


def test_gpu_experts_n_from_a_calibration_call():
    cpu = q3.DecoderLayer.random(CFG, 3, "float32")
    x = torch.randn(40, H, generator=torch.Generator().manual_seed(2))
    summary = cpu.prefill(x, cpu.new_cache(40), return_router=True).routing()
    split = q3.DecoderLayer.random(CFG, 3, "float32", device="cuda", expert_device="cpu", gpu_experts=3,
                                   expert_counts=summary)
    assert split.gpu_experts == tuple(sorted(summary.ranking()[:3]))
    same = q3.DecoderLayer.random(CFG, 3, "float32", device="cuda", expert_device="cpu", gpu_experts=3,
                                  expert_counts=list(summary.counts))
    assert same.gpu_experts == split.gpu_experts


@pytest.mark.parametrize("kwargs,exc,needle", [
    (dict(device="cpu", expert_device="cpu"), ValueError, "device is 'cpu'"),
    (dict(expert_device="cuda"), ValueError, "expert_device: expected 'cpu'"),
    (dict(expert_device="cpu", gpu_experts=[8]), ValueError, "expected expert ids in [0, 8), got 8"),
    (dict(expert_device="cpu", gpu_experts=[1, 1]), ValueError, "expert 1 is listed twice"),
    (dict(expert_device="cpu", gpu_experts=2), ValueError, "expected expert_counts"),
    (dict(expert_device="cpu", gpu_experts=2, expert_counts=[1] * 7), ValueError, "expected 8 non-negative ints"),
    (dict(expert_device="cpu", gpu_experts=9, expert_counts=[1] * 8), ValueError, "expected an int in [0, 8]"),
    (dict(expert_device="cpu", experts=[0, 1]), ValueError, "got experts= too"),
])
def test_refusals_name_the_argument(kwargs, exc, needle):
    kw = dict(device="cuda")
    kw.update(kwargs)
    with pytest.raises(exc) as e:
        q3.DecoderLayer.random(CFG, 3, "float32", **kw)
    assert needle in str(e.value)


def test_insides_are_the_cpu_layers_and_the_output_unchanged():
    """return_router and return_attention on the split layer: the CPU layer's logits, weights
    and maps (fp32), the chosen experts equal, the output the bits of the call asking nothing"""
    split = q3.DecoderLayer.random(CFG, 3, "float32", device="cuda", expert_device="cpu", gpu_experts=[1, 4, 6])
    cpu = q3.DecoderLayer.random(CFG, 3, "float32")
    x = _inputs("float32")[0]
    caches = []
    for layer in (split, cpu, split):
        c = layer.new_cache(16, batch=2)
        c.set_padding(PAD, 1)
        caches.append(c)
    got = split.prefill(_on(split, x), caches[0], chunk_size=3, return_router=True, return_attention=True)
    want = cpu.prefill(x, caches[1], chunk_size=3, return_router=True, return_attention=True)
    plain = split.prefill(_on(split, x), caches[2], chunk_size=3)
    assert (host(got.output) == host(plain)).all()
    for name in ("router_logits", "expert_weights", "attention"):
        assert rel(host(getattr(got, name)), getattr(want, name).double().numpy()) <= 1e-5, name
    assert (host(got.experts) == want.experts.double().numpy()).all()
    t = torch.randn(2, H)
    step = split.decode(_on(split, t), caches[0], return_router=True)
    assert rel(host(step.router_logits), cpu.decode(t, caches[1], return_router=True).router_logits.double().numpy()) \
        <= 1e-5 and step.attention is None


def test_a_failure_in_the_host_experts_leaves_the_cache_as_it_was():
    split = q3.DecoderLayer.random(CFG, 3, "float32", device="cuda", expert_device="cpu", gpu_experts=[0])
    cache = split.new_cache(16, batch=2)
    split.prefill(_on(split, torch.randn(2, 3, H)), cache)

    class Failing:
        def expert_half(self, *args, **kw):
            raise OSError("planted in the host's experts")

    real, split._hybrid.host = split._hybrid.host, Failing()
    with pytest.raises(OSError, match="planted"):
        split.decode(_on(split, torch.randn(2, H)), cache)
    assert cache.lengths == (3, 3)  # the attention half's K/V taken back
    split._hybrid.host = real
    split.decode(_on(split, torch.randn(2, H)), cache)
    assert cache.lengths == (4, 4)


def test_a_long_prefill_runs_pass_by_pass_and_fails_as_one_call():
    """one sequence's prefill of 11 tokens in chunks of 4: passes of 4, 4 and 3 rows (never the
    call's 11 on either side), equal to the CPU layer's chunked prefill; a failure in the host's
    experts of the second pass leaves the cache where the call began and a rerun gives the same
    bits; a call that cannot fit is refused before any pass runs"""
    split = q3.DecoderLayer.random(CFG, 3, "float32", device="cuda", expert_device="cpu", gpu_experts=[1, 4, 6])
    cpu = q3.DecoderLayer.random(CFG, 3, "float32")
    counting = _Counting(split._hybrid.host)
    split._hybrid.host = counting
    x = torch.randn(11, H, generator=torch.Generator().manual_seed(13))
    cache = split.new_cache(16)
    split.prefill(_on(split, x[:2]), cache)  # the call starts at position 2
    first = split.hybrid_stats
    got = host(split.prefill(_on(split, x), cache, chunk_size=4))
    ref_cache = cpu.new_cache(16)
    cpu.prefill(x[:2], ref_cache)
    assert rel(got, cpu.prefill(x, ref_cache, chunk_size=4).double().numpy()) <= 1e-5
    st = split.hybrid_stats
    assert st["passes"] - first["passes"] == 3 and st["largest_pass_rows"] == 4 and counting.most <= 4

    class FailingSecond:
        def __init__(self, core):
            self.core, self.calls = core, 0

        def expert_half(self, *args, **kw):
            self.calls += 1
            if self.calls == 2:
                raise OSError("planted in the second pass")
            return self.core.expert_half(*args, **kw)

    again = split.new_cache(16)
    split.prefill(_on(split, x[:2]), again)
    split._hybrid.host = FailingSecond(counting.core)
    with pytest.raises(OSError, match="second pass"):
        split.prefill(_on(split, x), again, chunk_size=4)
    assert again.lengths == (2,)  # the first pass's K/V taken back
    split._hybrid.host = counting.core
    assert (host(split.prefill(_on(split, x), again, chunk_size=4)) == got).all()
    before = split.hybrid_stats
    with pytest.raises(q3.CacheFullError):
        split.prefill(_on(split, x), again, chunk_size=2)  # 13 + 11 tokens in 16 (the first pass of 2 fits)
    assert again.lengths == (13,) and split.hybrid_stats["passes"] == before["passes"]


def test_what_it_does_not_run_is_refused_before_any_work():
    split = q3.DecoderLayer.random(CFG, 3, "float32", device="cuda", expert_device="cpu", gpu_experts=[0])
    cache = split.new_cache(8)
    x = _on(split, torch.randn(2, H))
    with pytest.raises(NotImplementedError, match="out: a layer split over the GPU and the host writes into torch"):
        split.prefill(x, cache, out=x)
    assert cache.lengths == (0,)
    with pytest.raises(ValueError, match="cannot be captured"):
        split.decode_graph(cache)


def test_fp8_split_layer_equals_the_cpu_fp8_layer():
    """FP8 weights (fp8_e4m3_block128) on both sides: the GPU's experts and the host's each from
    their e4m3 bytes and block scales, as the CPU FP8 layer"""
    cfg = q3.LayerConfig(hidden_size=128, num_attention_heads=8, num_key_value_heads=2, head_dim=32, num_experts=8,
                         num_experts_per_tok=2, moe_intermediate_size=128)
    fmt = "fp8_e4m3_block128"
    split = q3.DecoderLayer.random(cfg, 3, "bfloat16", device="cuda", weight_format=fmt, expert_device="cpu",
                                   gpu_experts=[1, 5])
    cpu = q3.DecoderLayer.random(cfg, 3, "bfloat16", weight_format=fmt)
    assert split.weight_format == fmt
    x = torch.randn(6, 128, generator=torch.Generator().manual_seed(5)).bfloat16()
    y = split.prefill(_on(split, x), split.new_cache(8))
    assert rel(host(y), cpu.prefill(x, cpu.new_cache(8)).double().numpy()) <= TOL["bfloat16"]
    st = split.hybrid_stats
    assert st["device_choices"] > 0 and st["host_choices"] > 0


@pytest.mark.parametrize("dense_attention", [False, True])
def test_int4_split_layer_equals_the_cpu_int4_layer(dense_attention):
    """GPTQ int4 weights (gptq_int4) on both sides: the GPU's experts from their nibbles (the
    int4 GEMV and dequantization in the expert half), the host's on the CPU's int4 kernels, as
    the CPU int4 layer; the attention 4-bit, or dense (gptq_dense_attention); a prefill, and a
    decode step whose rows the GPU side groups on the device once every expert is there"""
    cfg = q3.LayerConfig(hidden_size=128, num_attention_heads=8, num_key_value_heads=2, head_dim=32, num_experts=8,
                         num_experts_per_tok=2, moe_intermediate_size=128)
    fmt = "gptq_int4"
    qc = {"quant_method": "gptq", "bits": 4, "group_size": 64, "sym": True, "desc_act": False}
    if dense_attention:
        qc["dynamic"] = {"-:.*self_attn.*": {}}
    cpu = q3.DecoderLayer.random(cfg, 3, "bfloat16", weight_format=fmt, quantization_config=qc)
    x = torch.randn(6, 128, generator=torch.Generator().manual_seed(5)).bfloat16()
    t = torch.randn(1, 128, generator=torch.Generator().manual_seed(6)).bfloat16()
    want_cache = cpu.new_cache(8)
    want = [cpu.prefill(x, want_cache).double().numpy(), cpu.decode(t, want_cache).double().numpy()]
    for gpu in ([1, 5], list(range(8))):
        split = q3.DecoderLayer.random(cfg, 3, "bfloat16", device="cuda", weight_format=fmt, expert_device="cpu",
                                       gpu_experts=gpu, quantization_config=qc)
        assert split.weight_format == fmt and split._hybrid.host.weight_format == fmt
        assert ("self_attn.q_proj.weight" in split.weight_ptrs) == dense_attention
        cache = split.new_cache(8)
        got = [host(split.prefill(_on(split, x), cache)), host(split.decode(_on(split, t), cache))]
        assert all(rel(a, b) <= TOL["bfloat16"] for a, b in zip(got, want)), gpu
        st = split.hybrid_stats
        assert st["device_choices"] > 0 and (st["host_choices"] > 0) == (len(gpu) < 8)


@pytest.mark.parametrize("fmt", [None, "fp8_e4m3_block128"])
def test_fused_host_experts_are_sliced_for_the_gpu_side(fmt):
    """transformers 5.x's fused expert tensors (mlp.experts.gate_up_proj [E, 2I, H], down_proj
    [E, H, I], FP8 scales alike) in host memory: a split layer's GPU side takes its experts'
    slices only (views, uploaded), and the layer equals the CPU layer on the same tensors"""
    cfg = q3.LayerConfig(hidden_size=128, num_attention_heads=8, num_key_value_heads=2, head_dim=32, num_experts=8,
                         num_experts_per_tok=2, moe_intermediate_size=128)
    fused = {n: torch.from_dlpack(t) for n, t in _C.random_weights(cfg, 4, "float32", fmt).items()}
    assert "mlp.experts.gate_up_proj" in fused
    split = q3.DecoderLayer(cfg, fused, device="cuda", dtype="float32", weight_format=fmt, expert_device="cpu",
                            gpu_experts=[2, 7])
    whole_gpu = q3.DecoderLayer(cfg, fused, device="cuda", dtype="float32", weight_format=fmt)
    assert split._core.weight_bytes < whole_gpu._core.weight_bytes  # 2 experts uploaded, not 8
    cpu = q3.DecoderLayer(cfg, fused, dtype="float32", weight_format=fmt)
    x = torch.randn(5, 128, generator=torch.Generator().manual_seed(6))
    y = split.prefill(_on(split, x), split.new_cache(8))
    assert rel(host(y), cpu.prefill(x, cpu.new_cache(8)).double().numpy()) <= 1e-5
    assert split.hybrid_stats["device_choices"] > 0


def test_from_hf_split_equals_the_cpu_layer_of_the_same_transformers_layer():
    """DecoderLayer.from_hf(hf_layer, device="cuda", expert_device="cpu", gpu_experts=...) of a
    transformers layer in host memory (what patch_model(expert_device=) builds on a GPU, whose
    drop-in test is tests/gpu/test_cuda.py: a CPU build of torch holds no device tensor): the
    attention and the GPU's experts copied to the device once, with the warning; the host's
    experts borrowed from the layer's own tensors (nothing converted); equal to the CPU layer
    from_hf of the same layer over a prefill and a decode step (fp32 1e-5)"""
    from hf_reference import tiny_model

    hf_layer = tiny_model(0).model.layers[1]
    with pytest.warns(UserWarning, match="copied .* weight"):
        split = q3.DecoderLayer.from_hf(hf_layer, device="cuda", expert_device="cpu", gpu_experts=[2, 5])
    assert split._hybrid.host.converted == () and split.gpu_experts == (2, 5)
    cpu = q3.DecoderLayer.from_hf(hf_layer)
    g = torch.Generator().manual_seed(8)
    xs = [torch.randn(2, 5, H, generator=g), torch.randn(2, H, generator=g)]
    caches = [layer.new_cache(8, batch=2) for layer in (split, cpu)]
    got = [host(split.prefill(_on(split, xs[0]), caches[0])), host(split.decode(_on(split, xs[1]), caches[0]))]
    want = [cpu.prefill(xs[0], caches[1]).double().numpy(), cpu.decode(xs[1], caches[1]).double().numpy()]
    assert all(rel(a, b) <= 1e-5 for a, b in zip(got, want))
    st = split.hybrid_stats
    assert st["device_choices"] > 0 and st["host_choices"] > 0


@pytest.mark.parametrize("which", ["all", "mixed"])
def test_a_decode_step_of_64_sequences_equals_the_cpu_layer(which):
    """the widest decode step (64 sequences: Q3_DECODE_MAX_ROWS, where the GPU's expert half
    groups the rows on the device when no entry is -1, as with every expert there) after a
    prefill of 3 tokens each, against the CPU layer; the rows that crossed as link_bytes counts
    them"""
    gpu = SETS[which]
    split = q3.DecoderLayer.random(CFG, 3, "float32", device="cuda", expert_device="cpu", gpu_experts=gpu)
    cpu = q3.DecoderLayer.random(CFG, 3, "float32")
    g = torch.Generator().manual_seed(12)
    xs = [torch.randn(64, 3, H, generator=g), torch.randn(64, H, generator=g)]
    caches = [layer.new_cache(8, batch=64) for layer in (split, cpu)]
    split.prefill(_on(split, xs[0]), caches[0])
    cpu.prefill(xs[0], caches[1])
    before = split.hybrid_stats
    got = host(split.decode(_on(split, xs[1]), caches[0]))
    want = cpu.decode(xs[1], caches[1], return_router=True)
    assert rel(got, want.output.double().numpy()) <= 1e-5
    side = torch.isin(torch.from_dlpack(want.experts).reshape(-1, K), torch.tensor(gpu, dtype=torch.int32))
    st = split.hybrid_stats
    down, up = link_bytes(CFG, 64, int((~side).any(1).sum()), bool(side.any()), "float32")
    assert (st["link_down_bytes"] - before["link_down_bytes"], st["link_up_bytes"] - before["link_up_bytes"]) == \
        (down, up)
    assert (st["host_rows"] - before["host_rows"] == 0) == (which == "all")


@pytest.mark.parametrize("which", ["none", "mixed", "all"])
@pytest.mark.parametrize("mode,kw", [("prefill", dict(tokens=7, chunk_size=3, batch=2)),
                                     ("decode", dict(tokens=2, context=5, batch=2))])
def test_profile_splits_the_experts_stage_by_side(which, mode, kw):
    """profile() of a split layer: the whole layer's stages with its experts stage in three,
    gpu_experts, link and host_experts, each timed where a side ran (a side with no experts
    reads 0 s), and the model's split: the experts' FLOPs by the share each side holds, the
    link's bytes as hybrid_split expects them pass by pass, no host bytes with every expert on
    the GPU"""
    gpu = SETS[which]
    split = q3.DecoderLayer.random(CFG, 3, "float32", device="cuda", expert_device="cpu", gpu_experts=gpu)
    t = split.random_input((2, H), 1)
    assert q3.cuda.emulated() and split._hybrid.device_input(t) is t  # the executor's memory: never torch's
    p = split.profile(mode, repeat=1, **kw)
    names = [s.name for s in p.stages]
    whole = cost_model(CFG, mode, dtype="float32", **kw)
    assert names == [s.name for s in whole.stages if s.name != "experts"] + ["gpu_experts", "link", "host_experts"]
    st = {s.name: s for s in p.stages}
    assert st["attention"].seconds > 0 and st["qkv_proj"].seconds > 0
    assert (st["gpu_experts"].seconds > 0) == bool(gpu) and (st["host_experts"].seconds > 0) == (len(gpu) < E)
    model = {s.name: s for s in p.cost.stages}
    flops = whole.stage("experts").flops
    assert model["gpu_experts"].flops == pytest.approx(flops * len(gpu) / E)
    assert model["host_experts"].flops == pytest.approx(flops * (E - len(gpu)) / E)
    rows = [kw["batch"]] * kw["tokens"] if mode == "decode" else [6, 6, 2]
    splits = [hybrid_split(CFG, r, gpu, mode=mode, dtype="float32") for r in rows]
    assert model["link"].act_read == round(sum(s.link_down_bytes for s in splits))
    assert model["link"].act_written == round(sum(s.link_up_bytes for s in splits))
    assert (model["host_experts"].weight_bytes == 0) == (which == "all")
    assert (model["gpu_experts"].weight_bytes == 0) == (which == "none")


class _Calls:
    """a _C.Layer (or the AttentionPasses it opens, side "passes") whose C calls are logged by
    name into `log` (with `side`); each pass of an AttentionPasses is logged as passes.next"""

    def __init__(self, core, side, log):
        self.core, self.side, self.log = core, side, log

    def __next__(self):
        self.log.append(f"{self.side}.next")
        return next(self.core)

    def __getattr__(self, name):
        attr = getattr(self.core, name)
        if not callable(attr):
            return attr

        def logged(*args, **kw):
            self.log.append(f"{self.side}.{name}")
            got = attr(*args, **kw)
            return _Calls(got, "passes", self.log) if name == "attention_passes" else got
        return logged


def test_the_c_calls_of_a_split_layers_pass_are_counted(monkeypatch):
    """Issue 40, requirement 1: the C calls of the split layer, counted. A prefill of 7 tokens
    of 2 sequences in chunks of 3 (3 passes) and a decode step, with experts on both sides: the
    call's passes opened once (the engine's checks of the whole call), then per pass the
    attention pass, two takes of the rows with a host expert, each side's expert half and the
    combine, and the call closed. 6 C calls a pass, as before the engine's pass runner (the
    attention half a pass, and once a prefill its checks alone: check_only), plus 2 a call;
    the whole layer on one device makes 1 a call."""
    log = []
    split = q3.DecoderLayer.random(CFG, 3, "float32", device="cuda", expert_device="cpu", gpu_experts=SETS["mixed"])
    runner = split._hybrid
    runner.device, runner.host = _Calls(runner.device, "device", log), _Calls(runner.host, "host", log)
    for fn in ("take_rows", "combine_rows"):
        real = getattr(_C, fn)
        monkeypatch.setattr(_C, fn, lambda *a, _f=real, _n=fn, **kw: (log.append(_n), _f(*a, **kw))[1])
    cache = split.new_cache(16, batch=2)
    xs = _inputs("float32")
    split.prefill(_on(split, xs[0]), cache, chunk_size=3)
    prefill, log[:] = list(log), []
    split.decode(_on(split, xs[1]), cache)
    decode = list(log)
    one_pass = ["passes.next", "take_rows", "take_rows", "device.expert_half", "host.expert_half", "combine_rows"]
    assert split.hybrid_stats["passes"] == 4 and split.hybrid_stats["host_rows"] > 0
    assert prefill == ["device.attention_passes"] + one_pass * 3 + ["passes.close"], prefill
    assert decode == ["device.attention_passes"] + one_pass + ["passes.close"], decode


@pytest.mark.parametrize("which", ["mixed", "all"])
def test_token_mask_positions_and_a_tree_on_a_split_layer_equal_the_cpu_layer(which):
    """issue 42's per-token inputs on the split layer: its device side's attention passes take
    them as a whole CUDA layer's calls do (a token mask with holes across passes, explicit
    positions, a tree verify, then masked decode steps); against the CPU layer of the seed"""
    split = q3.DecoderLayer.random(CFG, 5, "float32", device="cuda", expert_device="cpu", gpu_experts=SETS[which])
    cpu = q3.DecoderLayer.random(CFG, 5, "float32")
    g = torch.Generator().manual_seed(21)
    prompt, draft = torch.randn(2, 7, H, generator=g), torch.randn(4, H, generator=g)
    steps = [torch.randn(2, H, generator=g) for _ in range(2)]
    mask = torch.tensor([[True, False, True, True, False, True, True], [True, True, True, False, True, True, True]])
    positions = torch.tensor([[0, 1, 1, 2, 3, 3, 4], [5, 6, 7, 8, 8, 9, 10]])
    parents = torch.tensor([-1, 0, 0, 1])
    outs = {}
    for name, layer in (("split", split), ("cpu", cpu)):
        cache = layer.new_cache(24, batch=2)
        ys = [layer.prefill(_on(layer, prompt), cache, chunk_size=3, token_mask=mask, positions=positions)]
        ys.append(layer.verify(_on(layer, draft), cache, parents, seq=1))
        cache.accept(1, [0, 1, 3])
        for i, x in enumerate(steps):
            ys.append(layer.decode(_on(layer, x), cache, token_mask=torch.tensor([i == 0, True])))
        outs[name] = ([y.double().numpy() if isinstance(y, torch.Tensor) else host(y) for y in ys],
                      cache.lengths, cache.hidden)
    assert outs["split"][1:] == outs["cpu"][1:] == ((9, 12), ((1, 4, 8), (3,)))
    for i, (got, want) in enumerate(zip(outs["split"][0], outs["cpu"][0])):
        assert rel(got, want) <= TOL["float32"], i
