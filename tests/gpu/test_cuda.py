"""The CUDA backend: built wherever nvcc is, loadable without a GPU, and on a GPU every
kernel matches its CPU twin. GPU tests skip, saying why, on machines without a CUDA device."""
import os
import shutil

import pytest

import qwen3layer as q3
from qwen3layer import _C

NVCC = shutil.which("nvcc") or (os.path.exists("/usr/local/cuda/bin/nvcc") and "/usr/local/cuda/bin/nvcc")


@pytest.mark.skipif(not NVCC, reason="nvcc is not installed: this build is CPU-only by design")
def test_cuda_backend_is_built_and_loads_without_a_gpu():
    assert q3.cuda.built()
    assert "cuda" in q3.build_info()["backends"]
    assert q3.cuda.device_count() >= 0  # the library loads where no driver or GPU is (0: not made the backend)


@pytest.mark.skipif(not NVCC, reason="nvcc is not installed: this build is CPU-only by design")
def test_build_info_lists_the_gpu_targets_the_build_compiled():
    # the list comes from the library itself (a string compiled into it from setup.py's list);
    # tests/tools/test_sass_check.py also holds it against the fatbinary's own list (cuobjdump)
    import importlib.util
    spec = importlib.util.spec_from_file_location("q3_setup", os.path.join(os.path.dirname(__file__), "..", "..", "setup.py"))
    setup = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(setup)
    targets = q3.build_info()["cuda_targets"]
    assert targets == setup.cuda_targets() == q3.cuda.targets()
    # Ampere to Blackwell, the ARM boards' (Orin sm_87, Thor sm_110, GB10 sm_121) among them; PTX after
    assert targets == ["sm_80", "sm_87", "sm_90", "sm_100", "sm_110", "sm_120", "sm_121", "compute_121"]


def test_devices_that_are_not_there_are_refused_clearly():
    cfg = q3.LayerConfig.tiny()
    n = q3.cuda.device_count()
    with pytest.raises(ValueError, match=f"device: 'cuda:{n}': "):
        q3.DecoderLayer.random(cfg, device=f"cuda:{n}")
    with pytest.raises(ValueError, match="device: expected 'cpu', 'cuda' or 'cuda:N', got 'tpu'"):
        q3.DecoderLayer.random(cfg, device="tpu")


HAS_GPU = q3.cuda.built() and q3.cuda.device_count() > 0


@pytest.mark.skipif(not HAS_GPU, reason="no CUDA device on this machine (the kernels are checked by "
                                        "benchmarks/gpu_check.sh where one is lent)")
def test_the_device_runs_a_target_of_the_build():
    # SASS of the device's own major version (a cubin runs on later minors of its major), or
    # PTX of an older architecture, which the driver compiles for it at load time
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("torch without CUDA: the device's compute capability is not known")
    major, minor = torch.cuda.get_device_capability(0)
    cc = major * 10 + minor
    targets = q3.build_info()["cuda_targets"]
    sass = [int(t[3:]) for t in targets if t.startswith("sm_")]
    ptx = [int(t[8:]) for t in targets if t.startswith("compute_")]
    assert any(s // 10 == major and s <= cc for s in sass) or any(p <= cc for p in ptx), (cc, targets)


@pytest.mark.skipif(not HAS_GPU, reason="no CUDA device on this machine (the kernels are checked by "
                                        "benchmarks/gpu_check.sh where one is lent)")
def test_the_stage_profile_times_the_stages_on_the_gpu():
    # what benchmarks/bench_cuda.py sets beside each stage's floor: CUDA events at the boundaries
    from qwen3layer.analysis.costs import STAGES
    layer = q3.DecoderLayer.random(q3.LayerConfig.tiny(), seed=0, device="cuda", dtype="bfloat16")
    for mode, tokens in (("decode", 1), ("prefill", 17)):
        p = layer.profile(mode, tokens, context=33, repeat=2, batch=3)
        assert [s.name for s in p.stages] == list(STAGES)
        assert all(s.seconds >= 0 for s in p.stages)
        assert all(p.cost.stage(name).flops > 0 and s.seconds > 0 for name, s in zip(STAGES, p.stages)
                   if name in ("qkv_proj", "attention", "o_proj", "experts"))


@pytest.mark.skipif(not HAS_GPU, reason="no CUDA device on this machine (the kernels are checked by "
                                        "benchmarks/gpu_check.sh where one is lent)")
def test_every_cuda_kernel_matches_its_cpu_twin():
    results = q3.cuda.check_kernels(0)
    assert len(results) >= 643  # 645 where cuBLAS is found (test_cuda_executor.py: the same cases)
    assert len({r["case"] for r in results}) == len(results) and all(r["kernel"] for r in results)
    bad = [r for r in results if not r["ok"]]
    assert not bad, bad


# ---- the layer on a GPU ------------------------------------------------------------------

needs_gpu = pytest.mark.skipif(not HAS_GPU, reason="no CUDA device on this machine (run benchmarks/gpu_check.sh "
                                                   "where one is lent)")
CFG = q3.LayerConfig(hidden_size=64, num_attention_heads=8, num_key_value_heads=2, head_dim=24,
                     num_experts=8, num_experts_per_tok=2, moe_intermediate_size=48)


def rel(a, b):
    return float((a.double().cpu() - b.double().cpu()).norm() / b.double().cpu().norm())


@needs_gpu
@pytest.mark.parametrize("dtype,tol", [("float32", 1e-5), ("bfloat16", 1e-2), ("float16", 2e-3)])
def test_cuda_layer_matches_cpu_layer(dtype, tol):
    import torch

    cpu = q3.DecoderLayer.random(CFG, seed=3, dtype=dtype)
    gpu = q3.DecoderLayer.random(CFG, seed=3, dtype=dtype, device="cuda")
    assert gpu.device == "cuda:0"
    tdt = getattr(torch, dtype)
    x = torch.randn(2, 21, CFG.hidden_size, generator=torch.Generator().manual_seed(4)).to(tdt)
    steps = torch.randn(3, 2, CFG.hidden_size, generator=torch.Generator().manual_seed(5)).to(tdt)
    c_cpu, c_gpu = cpu.new_cache(32, batch=2), gpu.new_cache(32, batch=2)
    y_cpu = cpu.prefill(x, c_cpu, chunk_size=8)
    y_gpu = gpu.prefill(x.cuda(), c_gpu, chunk_size=8)
    assert y_gpu.is_cuda and y_gpu.dtype == tdt
    assert rel(y_gpu, y_cpu) <= tol
    for t in range(3):
        assert rel(gpu.decode(steps[t].cuda(), c_gpu), cpu.decode(steps[t], c_cpu)) <= tol
    assert c_gpu.lengths == c_cpu.lengths == (24, 24)
    for b in range(2):
        assert rel(torch.from_dlpack(c_gpu.keys(b)), torch.from_dlpack(c_cpu.keys(b))) <= tol


# a geometry the tensor-core paths take: attention (bf16 cache, D % 16 == 0) and the grouped
# prefill MoE (bf16 weights, I % 32 == 0)
CFG_TC = q3.LayerConfig(hidden_size=256, num_attention_heads=8, num_key_value_heads=2, head_dim=64,
                        num_experts=8, num_experts_per_tok=2, moe_intermediate_size=64)


@needs_gpu
@pytest.mark.parametrize("chunk", [None, 24])
def test_cuda_tensor_core_prefill_matches_cpu_layer(chunk):
    import torch

    cpu = q3.DecoderLayer.random(CFG_TC, seed=12, dtype="bfloat16")
    gpu = q3.DecoderLayer.random(CFG_TC, seed=12, dtype="bfloat16", device="cuda")
    # fp32 activations on bf16 weights: no output rounding to hide the update in
    x = torch.randn(2, 70, CFG_TC.hidden_size, generator=torch.Generator().manual_seed(13))
    c_cpu, c_gpu = cpu.new_cache(80, batch=2), gpu.new_cache(80, batch=2)
    for c in (c_cpu, c_gpu):
        c.set_padding(5, 1)
    y_cpu = cpu.prefill(x, c_cpu, chunk_size=chunk)
    y_gpu = gpu.prefill(x.cuda(), c_gpu, chunk_size=chunk)
    # the layer's update y - x, where a wrong attention or expert term shows
    assert rel(y_gpu - x.cuda(), y_cpu - x) <= 2e-2
    for b in range(2):
        assert rel(torch.from_dlpack(c_gpu.keys(b)), torch.from_dlpack(c_cpu.keys(b))) <= 1e-2


# head_dim 256, the most the CUDA layer takes: the attention kernel's shared memory past the
# 48 KiB default (66 KiB at G = 1, 83 KiB at G = 16); G = 4 and 16
CFG_WIDE = [q3.LayerConfig(hidden_size=128, num_attention_heads=h, num_key_value_heads=kv, head_dim=256,
                           num_experts=4, num_experts_per_tok=2, moe_intermediate_size=64) for h, kv in ((8, 2), (16, 1))]


@needs_gpu
@pytest.mark.parametrize("cfg", CFG_WIDE, ids=["G=4", "G=16"])
@pytest.mark.parametrize("dtype,tol", [("float32", 1e-5), ("bfloat16", 1e-2)])
def test_cuda_head_dim_256_decode_matches_cpu_layer(cfg, dtype, tol):
    """Prefill (too wide for tensor cores), plain decode steps (unsplit, then split-KV past
    512 keys) and decode-graph replays (split: max_keys is the capacity) against the CPU."""
    import torch

    tdt = torch.float32 if dtype == "float32" else torch.bfloat16
    cpu = q3.DecoderLayer.random(cfg, seed=15, dtype=dtype)
    gpu = q3.DecoderLayer.random(cfg, seed=15, dtype=dtype, device="cuda")
    gen = torch.Generator().manual_seed(16)
    c_cpu, c_gpu = cpu.new_cache(1200, batch=2), gpu.new_cache(1200, batch=2)
    for c in (c_cpu, c_gpu):
        c.set_padding(3, 1)
    x = torch.randn(2, 600, cfg.hidden_size, generator=gen).to(tdt)
    assert rel(gpu.prefill(x.cuda(), c_gpu, chunk_size=256), cpu.prefill(x, c_cpu, chunk_size=256)) <= tol
    graph = gpu.decode_graph(c_gpu)
    for t in range(4):
        s = torch.randn(2, cfg.hidden_size, generator=gen).to(tdt)
        y = gpu.decode(s.cuda(), c_gpu) if t % 2 else graph(s.cuda()).clone()
        assert rel(y, cpu.decode(s, c_cpu)) <= tol
    assert c_gpu.lengths == c_cpu.lengths == (604, 604)


@needs_gpu
def test_cuda_layer_refuses_head_dims_its_kernels_cannot_run():
    cfg = q3.LayerConfig(hidden_size=64, num_attention_heads=2, num_key_value_heads=1, head_dim=272,
                         num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32)
    with pytest.raises(ValueError, match="head_dim: expected at most 256 on a CUDA device, got 272"):
        q3.DecoderLayer.random(cfg, device="cuda")
    assert q3.DecoderLayer.random(cfg).device == "cpu"


@needs_gpu
@pytest.mark.parametrize("dtype,tol", [("float32", 1e-5), ("bfloat16", 1e-2), ("float16", 2e-3)])
def test_cuda_batch_32_decode_matches_cpu_layer(dtype, tol):
    """A decode batch of 32 sequences (different lengths), plain and captured in a graph: its
    projections take the multi-row GEMV (one 32-token block column, csrc/cuda/passes.c
    GEMV_MAX_ROWS) at a geometry the tensor cores would also take (N % 16, K % 32 == 0; a
    float16 layer's take the SIMT kernels: the tensor-core paths are bf16's)."""
    import torch

    tdt = getattr(torch, dtype)
    cpu = q3.DecoderLayer.random(CFG_TC, seed=14, dtype=dtype)
    gpu = q3.DecoderLayer.random(CFG_TC, seed=14, dtype=dtype, device="cuda")
    caches = [cpu.new_cache(16, 32), gpu.new_cache(16, 32), gpu.new_cache(16, 32)]
    gen = torch.Generator().manual_seed(15)
    prompts = [torch.randn(1 + s % 5, CFG_TC.hidden_size, generator=gen).to(tdt) for s in range(32)]
    for c in caches:
        for s, p in enumerate(prompts):
            (cpu if c is caches[0] else gpu).prefill(p if c is caches[0] else p.cuda(), c, s)
    graph = gpu.decode_graph(caches[2])
    for t in range(3):
        x = torch.randn(32, CFG_TC.hidden_size, generator=gen).to(tdt)
        want = cpu.decode(x, caches[0])
        assert rel(gpu.decode(x.cuda(), caches[1]), want) <= tol
        assert rel(graph(x.cuda()).clone(), want) <= tol
    torch.cuda.synchronize()
    assert caches[0].lengths == caches[1].lengths == caches[2].lengths


def growing_scores_weights(cfg, seed):
    """Random bf16 weights (torch tensors) whose attention scores grow along the keys for
    inputs on a line (x_t = a + s_t u with s_t increasing): each query head's q_proj rows are its
    KV head's k_proj rows, so a query and a key score by the angle between their inputs'
    projections, which closes as the key's s_t nears the query's; only the pairs RoPE turns
    slowest are kept (with rope_theta 1e12 they turn by < 1e-2 over 2048 positions); QK-norm
    weights of 2 put the scores in the tens (about -24 to 32 for a last query)."""
    import torch

    w = {k: torch.from_dlpack(v).clone() for k, v in _C.random_weights(cfg, seed, "bfloat16").items()}
    D, G = cfg.head_dim, cfg.num_attention_heads // cfg.num_key_value_heads
    k = w["self_attn.k_proj.weight"].view(cfg.num_key_value_heads, D, -1)
    slow = torch.zeros(D, dtype=torch.bool)
    slow[D // 4:D // 2] = slow[3 * D // 4:] = True
    k[:, ~slow] = 0
    w["self_attn.q_proj.weight"] = k.repeat_interleave(G, 0).reshape(-1, k.shape[-1]).clone()
    for name in ("self_attn.q_norm.weight", "self_attn.k_norm.weight"):
        w[name] = torch.full((D,), 2.0, dtype=torch.bfloat16)
    return w


@needs_gpu
def test_single_pass_tensor_core_attention_at_2048_tokens_with_scores_growing_along_the_keys():
    """The tensor-core attention's online softmax over 64 key tiles, each raising the rows'
    maxima (so the output is rescaled tile after tile), against the CPU layer: a 2048-token
    prompt on inputs whose scores grow along the keys. The same on the SIMT executor (52 s
    there, too long for CI): 1.7e-3 of the update."""
    import torch

    cfg = q3.LayerConfig(hidden_size=256, num_attention_heads=8, num_key_value_heads=2, head_dim=64,
                         num_experts=8, num_experts_per_tok=2, moe_intermediate_size=64, rope_theta=1e12)
    w = growing_scores_weights(cfg, 21)
    cpu, gpu = q3.DecoderLayer(cfg, w), q3.DecoderLayer(cfg, w, device="cuda")
    L, g = 2048, torch.Generator().manual_seed(22)
    a, u = torch.randn(cfg.hidden_size, generator=g), torch.randn(cfg.hidden_size, generator=g)
    x = a + torch.linspace(-2, 2, L)[:, None] * u + 0.05 * torch.randn(L, cfg.hidden_size, generator=g)
    y_cpu = cpu.prefill(x, cpu.new_cache(L), chunk_size=L)  # one pass: 2048 queries over 2048 keys
    y_gpu = gpu.prefill(x.cuda(), gpu.new_cache(L), chunk_size=L)
    assert rel(y_gpu - x.cuda(), y_cpu - x) <= 2e-2


@needs_gpu
def test_prefill_moe_path_is_measured_once_per_size_class_on_the_gpu():
    """By default a CUDA layer's first prefill of a size class times each MoE path it can
    take (CUDA events) and keeps the fastest: the choice is the fastest of its times, the
    output still the CPU layer's, and a second prefill of the class keeps the same entry."""
    import torch

    cpu = q3.DecoderLayer.random(CFG_TC, seed=31, dtype="bfloat16")
    gpu = q3.DecoderLayer.random(CFG_TC, seed=31, dtype="bfloat16", device="cuda")
    assert q3.cuda.moe_path(gpu) == "measured"
    x = torch.randn(300, CFG_TC.hidden_size, generator=torch.Generator().manual_seed(32))
    y_cpu = cpu.prefill(x, cpu.new_cache(300))
    y_gpu = gpu.prefill(x.cuda(), gpu.new_cache(300))
    assert rel(y_gpu - x.cuda(), y_cpu - x) <= 2e-2
    choice = q3.cuda.moe_path_choice(gpu)
    chosen, times = choice[(256, 511)]
    assert {"per_expert_wmma", "grouped_wmma"} <= set(times) and chosen == min(times, key=times.get)
    gpu.prefill(x[:260].cuda(), gpu.new_cache(300))
    assert q3.cuda.moe_path_choice(gpu) == choice


@needs_gpu
def test_cuda_prefill_then_decode_equals_longer_prefill():
    import torch

    layer = q3.DecoderLayer.random(CFG, seed=6, dtype="float32", device="cuda")
    x = torch.randn(30, CFG.hidden_size, device="cuda")
    full = layer.prefill(x, layer.new_cache(32))
    cache = layer.new_cache(32)
    layer.prefill(x[:29], cache, chunk_size=7)
    assert rel(layer.decode(x[29:], cache)[0], full[29]) <= 1e-5


@needs_gpu
def test_cuda_layer_matches_transformers_on_the_gpu():
    from hf_reference import draw_input, hf_model, rel_err, run

    model = hf_model("gqa4_topk_norm", seed=1)
    x = draw_input(model, (1, 17, model.config.hidden_size), seed=1)
    ref = run(model, x)
    gpu_model = model.cuda()
    layer = q3.DecoderLayer.from_hf(gpu_model.model.layers[0], device="cuda")
    assert layer.converted == ()  # the model's CUDA weights are borrowed
    y = layer.prefill(x[0].cuda(), layer.new_cache(32))
    assert rel_err(y.cpu(), ref.y[0]) <= 1e-5


@needs_gpu
def test_cuda_layer_rejects_tensors_on_another_device():
    import torch

    layer = q3.DecoderLayer.random(CFG, seed=7, dtype="float32", device="cuda")
    cache = layer.new_cache(8)
    # refused by the layer before torch is asked for the stream, naming both devices
    with pytest.raises(ValueError, match=r"^x: expected a tensor on cuda:0 \(the layer's device\), got a torch tensor "
                       "on cpu$"):
        layer.prefill(torch.randn(2, CFG.hidden_size), cache)
    with pytest.raises(ValueError, match=r"^out: expected a tensor on cuda:0 \(the layer's device\), got a torch "
                       "tensor on cpu$"):
        layer.decode(torch.randn(1, CFG.hidden_size, device="cuda"), cache, out=torch.empty(1, CFG.hidden_size))
    cpu_cache = q3.DecoderLayer.random(CFG, dtype="float32").new_cache(8)
    with pytest.raises(ValueError, match="cache: expected a cache on cuda:0"):
        layer.prefill(torch.randn(2, CFG.hidden_size, device="cuda"), cpu_cache)
    if torch.cuda.device_count() > 1:
        with pytest.raises(ValueError, match="got a torch tensor on cuda:1$"):
            layer.prefill(torch.randn(2, CFG.hidden_size, device="cuda:1"), cache)
    assert cache.lengths == (0,)


@needs_gpu
@pytest.mark.parametrize("dtype,tol", [("float32", 1e-5), ("bfloat16", 1e-2), ("float16", 2e-3)])
def test_cuda_graph_decode_matches_plain_decode_and_the_cpu(dtype, tol):
    """A captured decode step, replayed on torch's stream, against plain decode calls on a
    second cache with the same history (GPU) and against the CPU layer; sequences of
    different lengths, one with padding; a plain call and a reset mixed in."""
    import torch

    tdt = getattr(torch, dtype)
    cpu = q3.DecoderLayer.random(CFG, seed=9, dtype=dtype)
    gpu = q3.DecoderLayer.random(CFG, seed=9, dtype=dtype, device="cuda")
    caches = [cpu.new_cache(48, 3), gpu.new_cache(48, 3), gpu.new_cache(48, 3)]
    gen = torch.Generator().manual_seed(10)
    prompts = [torch.randn(n, CFG.hidden_size, generator=gen).to(tdt) for n in (5, 9, 1)]
    for c in caches:
        c.set_padding(2, 1)
        for s, p in enumerate(prompts):
            (cpu if c is caches[0] else gpu).prefill(p if c is caches[0] else p.cuda(), c, s)
    graph = gpu.decode_graph(caches[1])
    assert graph.batch == 3 and caches[1].lengths == (5, 9, 1)
    for t in range(6):
        x = torch.randn(3, CFG.hidden_size, generator=gen).to(tdt)
        if t == 3:  # a plain call on the graph's cache: the next replay picks up its lengths
            y = gpu.decode(x.cuda(), caches[1])
        else:
            y = graph(x.cuda()).clone()
        assert y.is_cuda and y.dtype == tdt
        assert rel(y, gpu.decode(x.cuda(), caches[2])) <= tol
        assert rel(y, cpu.decode(x, caches[0])) <= tol
        assert caches[1].lengths == caches[2].lengths == caches[0].lengths
    torch.cuda.synchronize()


@needs_gpu
def test_cuda_graph_replays_on_a_side_stream_and_refuses_a_full_cache():
    import torch

    layer = q3.DecoderLayer.random(CFG, seed=11, dtype="bfloat16", device="cuda")
    cache = layer.new_cache(4)
    layer.prefill(torch.randn(3, CFG.hidden_size, device="cuda", dtype=torch.bfloat16), cache)
    graph = layer.decode_graph(cache)
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        y = graph(torch.randn(1, CFG.hidden_size, device="cuda", dtype=torch.bfloat16))
    side.synchronize()
    assert torch.isfinite(y.float()).all() and cache.lengths == (4,)
    with pytest.raises(q3.CacheFullError, match="sequence 0 holds 4 of 4 tokens"):
        graph()
    assert cache.lengths == (4,)


@needs_gpu
def test_drop_in_generation_on_the_gpu_is_identical():
    """patch_model on a model that lives on the GPU: the C layers run there, sharing the
    model's CUDA weights, and greedy generation gives transformers' tokens."""
    import torch
    from hf_reference import greedy, tiny_model

    import qwen3layer.torch as q3t

    model = tiny_model(0).cuda()
    ids = torch.randint(1, 101, (1, 9), generator=torch.Generator().manual_seed(0)).cuda()
    ref = greedy(model, ids, 16)
    q3t.patch_model(model)
    layer = model.model.layers[0]
    assert layer.core.device == "cuda:0" and layer.core.converted == ()
    assert torch.equal(greedy(model, ids, 16), ref)


@needs_gpu
@pytest.mark.parametrize("gpu_experts", [[], [1, 4], {0: [2], 1: [0, 5, 7]}])
def test_drop_in_split_over_the_gpu_and_the_host_generates_transformers_tokens(gpu_experts):
    """patch_model(expert_device="cpu", gpu_experts=...) on a model whose attention, norms and
    routers are on the GPU and whose experts are in host memory (as a device_map places them):
    greedy generation gives the tokens of the model wholly on the GPU, the host's experts ran
    on the CPU (hybrid_stats), and a model on the GPU alone is refused naming its experts"""
    import torch
    from hf_reference import greedy, tiny_model

    import qwen3layer.torch as q3t

    model = tiny_model(0).cuda()
    ids = torch.randint(1, 101, (1, 9), generator=torch.Generator().manual_seed(0)).cuda()
    ref = greedy(model, ids, 16)
    with pytest.raises(ValueError, match=r"layer 0's mlp\.experts\..* is on cuda:0; expected the experts in host"):
        q3t.patch_model(model, expert_device="cpu")
    for layer in model.model.layers:
        layer.mlp.experts.to("cpu")
    q3t.patch_model(model, expert_device="cpu", gpu_experts=gpu_experts)
    assert torch.equal(greedy(model, ids, 16), ref)
    for i, layer in enumerate(model.model.layers):
        want = gpu_experts.get(i) if isinstance(gpu_experts, dict) else gpu_experts
        st = layer.core.hybrid_stats
        assert layer.core.gpu_experts == tuple(want) and st["host_choices"] > 0
        assert (st["device_choices"] > 0) == bool(want)


def host_weights(seed, dtype):
    """random weights of CFG as torch tensors on the host"""
    import torch

    return {k: torch.from_dlpack(v) for k, v in q3._C.random_weights(CFG, seed, dtype).items()}


@needs_gpu
def test_cuda_workspace_only_grows_across_alternating_shapes():
    """Issue 13, item 4 on the hardware: a one-sequence prefill (40 rows), a batched decode (4
    sequences), a batched prefill (4 x 6) and a chunked one, round after round: the layer's
    device workspace is sized in the first round and then keeps its size (sized to each call,
    it was freed and reallocated on each switch; the executor test counts the cudaMalloc
    calls themselves: none after the first round), and every round matches the CPU layer."""
    import torch

    w = host_weights(15, "bfloat16")
    cpu = q3.DecoderLayer(CFG, w)
    gpu = q3.DecoderLayer(CFG, {k: v.cuda() for k, v in w.items()}, device="cuda")
    assert gpu.converted == ()
    gen = torch.Generator().manual_seed(16)
    xs = [torch.randn(*s, CFG.hidden_size, generator=gen).to(torch.bfloat16) for s in ((40,), (4,), (4, 6), (24,))]
    xs_dev = [x.cuda() for x in xs]

    def round_of(layer, xs, one, batch):
        one.reset()
        batch.reset()
        return [layer.prefill(xs[0], one), layer.decode(xs[1], batch), layer.prefill(xs[2], batch),
                layer.decode(xs[1], batch), layer.prefill(xs[3], one, chunk_size=16)]

    want = round_of(cpu, xs, cpu.new_cache(64), cpu.new_cache(64, batch=4))
    one, batch = gpu.new_cache(64), gpu.new_cache(64, batch=4)
    held = []
    for _ in range(3):
        got = round_of(gpu, xs_dev, one, batch)
        held.append(gpu.workspace_bytes)
        assert all(rel(g, c) <= 1e-2 for g, c in zip(got, want))
    assert held[0] > 0 and held == [held[0]] * 3

    # the split-KV partials grow as their own dimension (min(rows, 16 seqs) of each call): a
    # decode of 8 sequences after a one-sequence prefill of 200 rows adds less than one row
    # of them (heads x 32 slices x (D + 2) floats), not the 112 rows of min(200, 16 x 8) - 16
    wide = q3.DecoderLayer(CFG, {k: v.cuda() for k, v in w.items()}, device="cuda")
    wide.prefill(torch.randn(200, CFG.hidden_size, device="cuda").to(torch.bfloat16), wide.new_cache(200))
    after_prefill = wide.workspace_bytes
    wide.decode(torch.randn(8, CFG.hidden_size, device="cuda").to(torch.bfloat16), wide.new_cache(4, batch=8))
    row = CFG.num_attention_heads * 32 * (CFG.head_dim + 2) * 4
    assert after_prefill <= wide.workspace_bytes < after_prefill + row


@needs_gpu
@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_cuda_misaligned_weight_views_are_copied_once_and_match_the_cpu(dtype):
    """Issue 13, item 5 on the hardware: weights that are views one element into a CUDA block
    (+2 bytes for bf16, which its 16-byte loads fault on; +4 for fp32, which today's 4-byte
    loads would take, off the 16-byte rule all the same) are copied once, with the warning,
    and listed in `converted`; the aligned ones are borrowed; the layer matches the CPU."""
    import torch

    tdt = torch.bfloat16 if dtype == "bfloat16" else torch.float32
    w = host_weights(21, dtype)
    odd = ["self_attn.q_proj.weight", "self_attn.o_proj.weight", "mlp.gate.weight", "mlp.experts.gate_up_proj",
           "mlp.experts.down_proj", "input_layernorm.weight"]
    w_dev = {}
    for k, v in w.items():
        if k in odd:
            w_dev[k] = torch.empty(v.numel() + 1, dtype=tdt, device="cuda")[1:].view(v.shape)
            w_dev[k].copy_(v)
            assert w_dev[k].data_ptr() % 16 != 0
        else:
            w_dev[k] = v.cuda()
    with pytest.warns(UserWarning, match=f"copied {len(odd)} weight\\(s\\) to contiguous, 16-byte aligned {dtype} "
                                         "on cuda:0 once at construction"):
        gpu = q3.DecoderLayer(CFG, w_dev, device="cuda")
    assert sorted(gpu.converted) == sorted(odd)
    ptrs = gpu._core.weight_ptrs
    assert all(ptrs[k] % 16 == 0 and ptrs[k] != w_dev[k].data_ptr() for k in odd)
    assert all(ptrs[k] == w_dev[k].data_ptr() for k in w if k not in odd)
    cpu = q3.DecoderLayer(CFG, w)
    tol = 1e-2 if dtype == "bfloat16" else 1e-5
    gen = torch.Generator().manual_seed(22)
    c_cpu, c_gpu = cpu.new_cache(48, batch=2), gpu.new_cache(48, batch=2)
    for shape in ((2, 5), (2, 12)):  # the GEMV, then (bf16) the tensor-core GEMM
        x = torch.randn(*shape, CFG.hidden_size, generator=gen).to(tdt)
        assert rel(gpu.prefill(x.cuda(), c_gpu), cpu.prefill(x, c_cpu)) <= tol
    for _ in range(2):
        x = torch.randn(2, CFG.hidden_size, generator=gen).to(tdt)
        assert rel(gpu.decode(x.cuda(), c_gpu), cpu.decode(x, c_cpu)) <= tol


@needs_gpu
@pytest.mark.parametrize("dtype,tol", [("float32", 1e-5), ("bfloat16", 1e-2)])
def test_cuda_fp8_layer_matches_the_cpu_fp8_layer(dtype, tol):
    """An FP8 layer (e4m3 weights with 128 x 128 block scales, fused experts with bf16 scales,
    hidden 320 / moe_inter 160: partial scale blocks) on the GPU against the CPU FP8 layer on
    the same weights: host weights uploaded once, device weights borrowed; prefill in chunks
    of 8 (the FP8 GEMV) and all 40 (bf16: dequantized to bf16 for the tensor cores), decode
    steps (the FP8 GEMV and grouped FP8 experts) and decode-graph replays."""
    import sys

    import torch

    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "helpers"))
    from fp8_weights import fp8_weights

    cfg = q3.LayerConfig(hidden_size=320, num_attention_heads=4, num_key_value_heads=2, head_dim=48,
                         num_experts=8, num_experts_per_tok=2, moe_intermediate_size=160)
    layers_match_on_the_gpu(cfg, fp8_weights(cfg, dtype, torch.bfloat16, True, 7), "fp8_e4m3_block128", dtype, tol)


def layers_match_on_the_gpu(cfg, w, fmt, dtype, tol):
    """the layer of host weights w (format fmt) on the GPU (w uploaded once) and on the GPU
    borrowing w's device copies (nothing converted) against the CPU layer: prefill of 2
    sequences of 40 tokens in chunks of 8 and all 40, each followed by 4 decode steps, plain
    calls and replays of a decode graph in turn"""
    import torch

    cpu = q3.DecoderLayer(cfg, w)
    gpu = q3.DecoderLayer(cfg, w, device="cuda")
    borrowed = q3.DecoderLayer(cfg, {k: v.cuda() for k, v in w.items()}, device="cuda")
    assert cpu.weight_format == gpu.weight_format == fmt and gpu.weight_bytes == cpu.weight_bytes
    assert len(gpu.converted) == len(w) and borrowed.converted == ()  # host ones uploaded, device ones borrowed
    tdt = getattr(torch, dtype)
    for chunk in (8, None):
        x = torch.randn(2, 40, cfg.hidden_size, generator=torch.Generator().manual_seed(8)).to(tdt)
        c_cpu, c_gpu, c_b = cpu.new_cache(48, batch=2), gpu.new_cache(48, batch=2), borrowed.new_cache(48, batch=2)
        want = cpu.prefill(x, c_cpu, chunk_size=chunk)
        assert rel(gpu.prefill(x.cuda(), c_gpu, chunk_size=chunk), want) <= tol
        assert rel(borrowed.prefill(x.cuda(), c_b, chunk_size=chunk), want) <= tol
        graph = gpu.decode_graph(c_gpu)
        for t in range(4):
            s = torch.randn(2, cfg.hidden_size, generator=torch.Generator().manual_seed(9 + t)).to(tdt)
            want = cpu.decode(s, c_cpu)
            got = gpu.decode(s.cuda(), c_gpu) if t % 2 else graph(s.cuda()).clone()
            assert rel(got, want) <= tol, (chunk, t)
        assert c_gpu.lengths == c_cpu.lengths == (44, 44)


@needs_gpu
@pytest.mark.parametrize("dense_attention", [False, True])
@pytest.mark.parametrize("dtype,tol", [("float32", 1e-5), ("bfloat16", 1e-2)])
def test_cuda_int4_layer_matches_the_cpu_int4_layer(dtype, tol, dense_attention):
    """A GPTQ int4 layer (4-bit weights, group 128, "gptq" zeros; dense_attention: q/k/v/o_proj
    dense, the experts 4-bit) on the GPU against the CPU int4 layer on the same weights: host
    weights uploaded once, device weights borrowed; prefill in chunks of 8 (the int4 GEMV) and
    all 40 (bf16: dequantized to bf16 for the tensor cores), decode steps (the GEMV and the
    grouped int4 experts) and decode-graph replays (the executor's twin:
    tests/executor/test_cuda_executor_int4.py)."""
    import torch

    cfg = q3.LayerConfig(hidden_size=256, num_attention_heads=4, num_key_value_heads=2, head_dim=64,
                         num_experts=8, num_experts_per_tok=2, moe_intermediate_size=128)
    w = {k: torch.from_dlpack(v) for k, v in
         _C.random_weights(cfg, 7, dtype, "gptq_int4", gptq_dense_attention=dense_attention).items()}
    assert ("self_attn.q_proj.weight" in w) == dense_attention
    layers_match_on_the_gpu(cfg, w, "gptq_int4", dtype, tol)


# ---- KV cache operations for generation on a device cache ---------------------------------


def cache_pair(dtype, lengths=(3, 7, 0, 5, 2, 6), pads=(1, 0, 0, 2, 0, 3)):
    """a CPU layer's host cache and a CUDA layer's device cache with the same lengths, padding
    and bytes (the device one's K/V overwritten with the host's through its views)"""
    import torch

    cpu = q3.DecoderLayer.random(CFG, seed=3, dtype=dtype)
    gpu = q3.DecoderLayer.random(CFG, seed=3, dtype=dtype, device="cuda")
    hc, dc = cpu.new_cache(16, batch=len(lengths)), gpu.new_cache(16, batch=len(lengths))
    for s, (n, p) in enumerate(zip(lengths, pads)):
        for layer, cache, dev in ((cpu, hc, "cpu"), (gpu, dc, "cuda")):
            if p:
                cache.set_padding(p, s)
            if n:
                layer.prefill(torch.randn(n, CFG.hidden_size, generator=torch.Generator().manual_seed(s))
                              .to(getattr(torch, dtype)).to(dev), cache, s)
    torch.cuda.synchronize()
    for s in range(hc.batch):
        torch.from_dlpack(dc.keys(s)).copy_(torch.from_dlpack(hc.keys(s)))
        torch.from_dlpack(dc.values(s)).copy_(torch.from_dlpack(hc.values(s)))
    torch.cuda.synchronize()
    return (cpu, hc), (gpu, dc)


def cache_state(cache):
    import torch

    torch.cuda.synchronize()
    kv = [(torch.from_dlpack(cache.keys(s)).cpu(), torch.from_dlpack(cache.values(s)).cpu())
          for s in range(cache.batch)]
    return cache.lengths, cache.padding, kv


def assert_same_state(a, b):
    import torch

    assert a[0] == b[0] and a[1] == b[1]
    for (ka, va), (kb, vb) in zip(a[2], b[2]):
        assert torch.equal(ka, kb) and torch.equal(va, vb)


@needs_gpu
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("where", ["none", "current", "side"])
def test_cuda_cache_operations_equal_the_host_ones(dtype, where):
    """each copying operation on a device cache leaves what it leaves on a host cache of the
    same bytes: no stream (the device synchronized around it), torch's current stream, a side
    stream (queued there, read after it is synchronized)"""
    import copy

    import torch

    ops = [lambda c, **k: c.reorder([1, 2, 0, 4, 5, 3], **k), lambda c, **k: c.reorder([1, 0, 0, 1, 5, 5], **k),
           lambda c, **k: c.reorder([3] * 6, **k), lambda c, **k: c.select([5, 5, 0, 2, 1, 1, 3, 4, 0], **k),
           lambda c, **k: c.repeat_interleave(3, **k), lambda c, **k: c.copy(**k),
           lambda c, **k: copy.deepcopy(c),
           lambda c, **k: [c.copy_prefix(1, 2, 5, **k), c.copy_prefix(5, 0, 4, **k), c.copy_prefix(3, 3, 4, **k)]]
    side = torch.cuda.Stream()
    for op in ops:
        (_, hc), (_, dc) = cache_pair(dtype)
        rh = op(hc)
        if where == "none":
            rd = op(dc)
        elif where == "current":
            rd = op(dc, stream=torch.cuda.current_stream().cuda_stream)
        else:
            side.wait_stream(torch.cuda.current_stream())
            rd = op(dc, stream=side.cuda_stream)
            side.synchronize()
        assert_same_state(cache_state(dc), cache_state(hc))
        if isinstance(rh, q3.KVCache):
            assert torch.from_dlpack(rd.keys(0)).is_cuda and rd.capacity == dc.capacity
            assert_same_state(cache_state(rd), cache_state(rh))


@needs_gpu
def test_cuda_decode_after_cache_operations_matches_the_cpu_layer():
    """reorder (a cycle through the device spare block), repeat_interleave and copy_prefix on
    the caller's stream, then decode: the CUDA layer equals the CPU layer doing the same"""
    import torch

    for op in (lambda c, **k: (c.reorder([1, 2, 0, 4, 5, 3], **k), c)[1],
               lambda c, **k: c.repeat_interleave(2, **k),
               lambda c, **k: (c.copy_prefix(1, 2, 5, **k), c)[1]):
        (cpu, hc), (gpu, dc) = cache_pair("float32")
        hc, dc = op(hc), op(dc, stream=torch.cuda.current_stream().cuda_stream)
        for t in range(3):
            x = torch.randn(hc.batch, CFG.hidden_size, generator=torch.Generator().manual_seed(20 + t))
            assert rel(gpu.decode(x.cuda(), dc), cpu.decode(x, hc)) <= 1e-5
        assert dc.lengths == hc.lengths


@needs_gpu
def test_cuda_beam_search_on_a_patched_gpu_model_matches_transformers():
    """beam search on a model on the GPU: the C caches on the device follow every reorder"""
    import torch
    from hf_reference import left_padded, tiny_model

    import qwen3layer.torch as q3t

    model = tiny_model(0).cuda()
    ids, mask = left_padded([5, 8], 8, seed=0)
    ids, mask = ids.cuda(), mask.cuda()

    def run():
        return model.generate(ids, attention_mask=mask, max_new_tokens=12, num_beams=5, num_return_sequences=2,
                              do_sample=False, pad_token_id=0, output_scores=True, return_dict_in_generate=True)

    ref = run()
    q3t.patch_model(model)
    out = run()
    assert torch.equal(out.sequences, ref.sequences)
    torch.testing.assert_close(out.sequences_scores, ref.sequences_scores, rtol=1e-4, atol=1e-4)


@needs_gpu
def test_routing_of_a_gpu_trace_counts_the_finished_call():
    """A CUDA trace's experts stay on the GPU; routing() copies them to the host after a
    synchronisation of the device, so a call still queued on a side stream is counted whole.
    The counts equal a bincount of the same experts on the host; the CPU layer routes alike."""
    import torch

    layer = q3.DecoderLayer.random(CFG, seed=9, dtype="float32", device="cuda")
    cpu = q3.DecoderLayer.random(CFG, seed=9, dtype="float32")
    cache, cpu_cache = layer.new_cache(64, batch=2), cpu.new_cache(64, batch=2)
    x = torch.randn(2, 37, CFG.hidden_size, generator=torch.Generator().manual_seed(4))
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        xd = x.cuda()
        trace = layer.prefill(xd, cache, return_router=True)
        r = trace.routing()  # no synchronisation of the side stream before this
    assert trace.experts.device.type == "cuda"
    host = trace.experts.cpu()
    assert r.counts == tuple(torch.bincount(host.flatten().long(), minlength=CFG.num_experts).tolist())
    assert r.tokens == 74 and r.top_k == 2
    assert r.counts == cpu.prefill(x, cpu_cache, return_router=True).routing().counts
    d = layer.decode(torch.randn(2, CFG.hidden_size, device="cuda"), cache, return_router=True)
    assert sum(d.routing().counts) == 4 == d.routing().choices
    with pytest.raises(ValueError, match="experts: expected a contiguous tensor on a CUDA device"):
        q3.routing_summary(trace.experts[:, ::2], CFG.num_experts)


# ---- the layer's insides on request (issue 15, requirement 4) -----------------------------

def experts_differ(got, want, logits, k, margin):
    """rows whose top k + 1 logits are apart by more than margin (relative to the row's
    largest) and whose chosen experts still differ"""
    logits = logits.double().cpu().reshape(-1, logits.shape[-1])
    top = logits.sort(dim=1, descending=True).values[:, :k + 1]
    clear = ((top[:, :-1] - top[:, 1:]) > margin * top.abs().max(dim=1, keepdim=True).values).all(dim=1)
    differ = (got.cpu().reshape(-1, k) != want.cpu().reshape(-1, k)).any(dim=1)
    return int((clear & differ).sum()), int(clear.sum())


def check_insides(got, want, tol, maps_tol, margin, k):
    """a CUDA call's LayerTrace against the CPU's: output, logits, weights within tol, the
    experts on the rows clear of the margin, maps within maps_tol (absolute) and rows summing
    to 1; returns the count of rows whose experts were compared"""
    assert got.output.is_cuda and got.router_logits.is_cuda and got.experts.is_cuda
    assert rel(got.output, want.output) <= tol
    assert rel(got.router_logits, want.router_logits) <= tol
    assert rel(got.expert_weights, want.expert_weights) <= tol
    differ, clear = experts_differ(got.experts, want.experts, want.router_logits, k, margin)
    assert differ == 0
    if want.attention is not None:
        maps = got.attention.double().cpu()
        assert maps.shape == want.attention.shape
        assert float((maps - want.attention.double()).abs().max()) <= maps_tol
        assert float((maps.sum(dim=-1) - 1).abs().max()) <= 1e-5
    return clear


@needs_gpu
@pytest.mark.parametrize("cfg", [CFG, CFG_TC], ids=["block-per-token attention", "tensor-core attention"])
@pytest.mark.parametrize("dtype,tol,maps_tol,margin", [("float32", 1e-5, 1e-5, 1e-4), ("bfloat16", 2e-2, 2e-2, 2e-2)])
def test_cuda_layer_insides_match_the_cpu_layer(cfg, dtype, tol, maps_tol, margin):
    """return_router and return_attention on the GPU: a prefill of 2 sequences (the second with
    3 tokens of left padding) of 40 tokens in chunks of 20 (for CFG_TC in bf16, passes the
    tensor cores take) and two plain decode steps give the CPU layer's output, router logits,
    weights and maps, and its experts where the logits are clear of each other; the maps come
    from their own fp32 kernel whichever path the attention takes. bf16: the tensor-core
    attention's tolerance (it rounds q and the probabilities to bf16)."""
    import torch

    cpu = q3.DecoderLayer.random(cfg, seed=11, dtype=dtype)
    gpu = q3.DecoderLayer.random(cfg, seed=11, dtype=dtype, device="cuda")
    tdt = getattr(torch, dtype)
    gen = torch.Generator().manual_seed(12)
    c_cpu, c_gpu = cpu.new_cache(48, batch=2), gpu.new_cache(48, batch=2)
    for c in (c_cpu, c_gpu):
        c.set_padding(3, 1)
    ask = {"return_router": True, "return_attention": True}
    x = torch.randn(2, 40, cfg.hidden_size, generator=gen).to(tdt)
    compared = check_insides(gpu.prefill(x.cuda(), c_gpu, chunk_size=20, **ask),
                             cpu.prefill(x, c_cpu, chunk_size=20, **ask), tol, maps_tol, margin, cfg.num_experts_per_tok)
    for _ in range(2):
        s = torch.randn(2, cfg.hidden_size, generator=gen).to(tdt)
        compared += check_insides(gpu.decode(s.cuda(), c_gpu, **ask), cpu.decode(s, c_cpu, **ask), tol, maps_tol,
                                  margin, cfg.num_experts_per_tok)
    assert compared >= 50  # of 84 rows
    assert c_gpu.lengths == c_cpu.lengths == (42, 42)


@needs_gpu
def test_cuda_attention_maps_over_a_long_context_match_the_cpu_layer():
    """A decode step over 3000 cached tokens at head_dim 128 with 8 query heads a KV head:
    each map row crosses the kernel's block loop a dozen times (256 keys an iteration)."""
    import torch

    cfg = q3.LayerConfig(hidden_size=128, num_attention_heads=16, num_key_value_heads=2, head_dim=128,
                         num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32)
    cpu = q3.DecoderLayer.random(cfg, seed=13, dtype="float32")
    gpu = q3.DecoderLayer.random(cfg, seed=13, dtype="float32", device="cuda")
    gen = torch.Generator().manual_seed(14)
    c_cpu, c_gpu = cpu.new_cache(3008), gpu.new_cache(3008)
    x = torch.randn(3000, cfg.hidden_size, generator=gen)
    cpu.prefill(x, c_cpu)
    gpu.prefill(x.cuda(), c_gpu)
    s = torch.randn(1, cfg.hidden_size, generator=gen)
    want, got = cpu.decode(s, c_cpu, return_attention=True), gpu.decode(s.cuda(), c_gpu, return_attention=True)
    assert got.attention.shape == (1, 16, 1, 3001) and got.router_logits is None
    assert float((got.attention.cpu() - want.attention).abs().max()) <= 1e-5
    assert rel(got.output, want.output) <= 1e-5


@needs_gpu
@pytest.mark.parametrize("dtype,tol", [("float32", 1e-5), ("bfloat16", 1e-2)])
def test_cuda_fp8_layer_router_outputs_match_the_cpu_fp8_layer(dtype, tol):
    """An FP8 layer's router outputs on the GPU (a chunked prefill, a decode step) against the
    CPU FP8 layer's on the same weights."""
    import sys

    import torch

    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "helpers"))
    from fp8_weights import fp8_weights

    cfg = q3.LayerConfig(hidden_size=320, num_attention_heads=4, num_key_value_heads=2, head_dim=48,
                         num_experts=8, num_experts_per_tok=2, moe_intermediate_size=160)
    w = fp8_weights(cfg, dtype, torch.bfloat16, True, 15)
    cpu, gpu = q3.DecoderLayer(cfg, w), q3.DecoderLayer(cfg, w, device="cuda")
    c_cpu, c_gpu = cpu.new_cache(24, batch=2), gpu.new_cache(24, batch=2)
    gen = torch.Generator().manual_seed(16)
    tdt = getattr(torch, dtype)
    margin = 1e-4 if dtype == "float32" else 2e-2
    x = torch.randn(2, 17, cfg.hidden_size, generator=gen).to(tdt)
    compared = check_insides(gpu.prefill(x.cuda(), c_gpu, chunk_size=8, return_router=True),
                             cpu.prefill(x, c_cpu, chunk_size=8, return_router=True), tol, 0.0, margin, 2)
    s = torch.randn(2, cfg.hidden_size, generator=gen).to(tdt)
    compared += check_insides(gpu.decode(s.cuda(), c_gpu, return_router=True),
                              cpu.decode(s, c_cpu, return_router=True), tol, 0.0, margin, 2)
    assert compared >= 30  # of 36 rows (the CPU layer's logits clear the margin on 36 and 33 of them)



@needs_gpu
def test_drop_in_calls_on_the_gpu_match_transformers():
    """the drop-in on a GPU model: packed sequences, right padding, the model cache's keys as
    device views of the C cache, a static cache's generate, a compiled decode step"""
    import copy

    import torch
    from hf_reference import tiny_model

    import qwen3layer.torch as q3t

    model = tiny_model(3).cuda()
    ref = copy.deepcopy(model)
    q3t.patch_model(model)
    ids = torch.randint(1, 101, (1, 9), generator=torch.Generator().manual_seed(3)).cuda()
    pos = torch.tensor([[0, 1, 2, 3, 4, 0, 1, 2, 3]]).cuda()
    with torch.no_grad():
        assert rel(model(ids, position_ids=pos, use_cache=False).logits,
                   ref(ids, position_ids=pos, use_cache=False).logits) <= 1e-5
        mask = torch.ones(1, 9, dtype=torch.long).cuda()
        mask[0, 6:] = 0
        ours, theirs = model(ids, attention_mask=mask), ref(ids, attention_mask=mask)
        real = mask.bool()
        assert rel(ours.logits[real], theirs.logits[real]) <= 1e-5
        keys = ours.past_key_values.layers[0].keys
        assert keys.is_cuda and keys.data_ptr() == torch.from_dlpack(model.model.layers[0].kv_cache.keys(0)).data_ptr()
        kw = dict(max_new_tokens=6, do_sample=False, pad_token_id=0)
        assert torch.equal(model.generate(ids, cache_implementation="static", **kw), ref.generate(ids, **kw))


# ---- the layer's halves on a GPU (tests/executor/test_cuda_executor_halves.py's twins) -----

@needs_gpu
@pytest.mark.parametrize("dtype,tol", [("float32", 1e-5), ("bfloat16", 1e-2)])
def test_cuda_halves_match_the_cpu_halves_and_the_cuda_forward(dtype, tol):
    """attention_half on the GPU gives the CPU's resid, normed and weights; resid + expert_half
    of its rows (added into resid on the device) is the GPU layer's own prefill and decode;
    expert_half with entries of -1 (NaN weights: a skipped entry computed would show) is the
    CPU's on the same rows"""
    import torch

    H = CFG.hidden_size
    cpu = q3.DecoderLayer.random(CFG, seed=3, dtype=dtype)
    gpu = q3.DecoderLayer.random(CFG, seed=3, dtype=dtype, device="cuda")
    tdt = torch.float32 if dtype == "float32" else torch.bfloat16
    cc, cg, cf = cpu.new_cache(16, batch=2), gpu.new_cache(16, batch=2), gpu.new_cache(16, batch=2)
    gen = torch.Generator().manual_seed(4)
    for x, kw in ((torch.randn(2, 9, H, generator=gen).to(tdt), {"chunk_size": 4}),
                  (torch.randn(2, H, generator=gen).to(tdt), {"decode": True})):
        want = cpu.attention_half(x, cc, **kw)
        got = gpu.attention_half(x.cuda(), cg, **kw)
        assert all(t.is_cuda for t in got) and [t.dtype for t in got] == [torch.float32, tdt, torch.int32,
                                                                           torch.float32]
        assert max(rel(got[i], want[i]) for i in (0, 1, 3)) <= tol
        assert (got[2].cpu() == want[2]).all(-1).float().mean() >= 0.5  # ties may order apart
        y = gpu.decode(x.cuda(), cf) if kw.get("decode") else gpu.prefill(x.cuda(), cf, chunk_size=4)
        resid, normed, experts, weights = (t.reshape(-1, t.shape[-1]) for t in got)
        out = resid.clone()
        assert gpu.expert_half(normed, experts, weights, out=out, accumulate=True) is out
        assert rel(out, y.reshape(-1, H)) <= (1e-5 if dtype == "float32" else 2 ** -8)
        ids, w = experts.clone(), weights.clone()
        ids[::2, 1], w[::2, 1] = -1, float("nan")
        part = gpu.expert_half(normed, ids, w)
        assert part.is_cuda and torch.isfinite(part).all()
        assert rel(part, cpu.expert_half(normed.cpu(), ids.cpu(), w.cpu())) <= tol
    assert cg.lengths == cc.lengths == cf.lengths == (10, 10)


@needs_gpu
def test_cuda_layers_of_disjoint_experts_are_the_whole_layer_and_refuse_the_whole_call():
    """two GPU layers holding disjoint experts (only theirs uploaded), their expert halves
    added into resid in turn, give the whole GPU layer's prefill; a subset layer refuses
    prefill and decode graphs, an expert it does not hold and host tensors"""
    import torch

    H = CFG.hidden_size
    a_ids, b_ids = [0, 2, 5], [1, 3, 4, 6, 7]
    whole = q3.DecoderLayer.random(CFG, seed=5, dtype="float32", device="cuda")
    a = q3.DecoderLayer.random(CFG, seed=5, dtype="float32", device="cuda", experts=a_ids)
    b = q3.DecoderLayer.random(CFG, seed=5, dtype="float32", device="cuda", experts=b_ids)
    assert a.held_experts == tuple(a_ids) and a.weight_bytes < whole.weight_bytes
    x = torch.randn(9, H, generator=torch.Generator().manual_seed(6)).cuda()
    y = whole.prefill(x, whole.new_cache(16), chunk_size=4)
    resid, normed, experts, weights = a.attention_half(x, a.new_cache(16), chunk_size=4)
    in_a = torch.isin(experts, torch.tensor(a_ids, device="cuda"))
    a.expert_half(normed, torch.where(in_a, experts, -1), weights, out=resid, accumulate=True)
    b.expert_half(normed, torch.where(in_a, -1, experts), weights, out=resid, accumulate=True)
    assert rel(resid, y) <= 1e-5
    wrong = torch.where(in_a, experts, -1)
    wrong[0, 0] = 1  # held by b
    with pytest.raises(ValueError, match=r"experts\[0, 0\]: expert 1 is not held by this layer"):
        a.expert_half(normed, wrong, weights)
    with pytest.raises(ValueError, match=r"rows: expected a tensor on cuda:0 \(the layer's device\), got a torch tensor "
                       "on cpu"):
        a.expert_half(normed.cpu(), experts, weights)
    cache = a.new_cache(16)
    with pytest.raises(ValueError, match="layer: holds 3 of the 8 experts"):
        a.prefill(x, cache)
    with pytest.raises(ValueError, match="layer: holds 3 of the 8 experts"):
        a.decode_graph(cache)
    assert cache.lengths == (0,)


@needs_gpu
@pytest.mark.parametrize("dtype,tol", [("float32", 1e-5), ("bfloat16", 5e-3)])
@pytest.mark.parametrize("gpu_experts", [[], [1, 4, 6], list(range(8))])
def test_layer_split_over_the_gpu_and_the_host_matches_the_cpu_layer(dtype, tol, gpu_experts):
    """DecoderLayer(device="cuda", expert_device="cpu", gpu_experts=...) on torch CUDA tensors:
    a left-padded chunked prefill and decode steps against the CPU layer, the output on the
    GPU, out= and the router's logits, the rows each side ran counted (the executor's twin:
    tests/executor/test_cuda_executor_hybrid.py)"""
    import torch

    H = CFG.hidden_size
    cpu = q3.DecoderLayer.random(CFG, seed=3, dtype=dtype)
    split = q3.DecoderLayer.random(CFG, seed=3, dtype=dtype, device="cuda", expert_device="cpu",
                                   gpu_experts=gpu_experts)
    tdt = torch.float32 if dtype == "float32" else torch.bfloat16
    cc, cs = cpu.new_cache(16, batch=2), split.new_cache(16, batch=2)
    for c in (cc, cs):
        c.set_padding(3, 1)
    gen = torch.Generator().manual_seed(4)
    x = torch.randn(2, 7, H, generator=gen).to(tdt)
    y = split.prefill(x.cuda(), cs, chunk_size=3)
    assert y.is_cuda and y.dtype == tdt
    want = cpu.prefill(x, cc, chunk_size=3)
    assert rel(y[0], want[0]) <= tol and rel(y[1, 3:], want[1, 3:]) <= tol
    for _ in range(2):
        t = torch.randn(2, H, generator=gen).to(tdt)
        assert rel(split.decode(t.cuda(), cs), cpu.decode(t, cc)) <= tol
    t = torch.randn(2, H, generator=gen).to(tdt)
    o = torch.empty_like(t).cuda()
    got, want = split.decode(t.cuda(), cs, out=o, return_router=True), cpu.decode(t, cc, return_router=True)
    assert got.output is o and rel(o, want.output) <= tol and rel(got.router_logits, want.router_logits) <= tol
    st = split.hybrid_stats
    assert st["device_choices"] + st["host_choices"] == (14 + 6) * CFG.num_experts_per_tok
    assert (st["device_choices"] == 0) == (not gpu_experts) and (st["host_choices"] == 0) == (len(gpu_experts) == 8)
    # the same bits on a second layer of the same seed (its pinned buffers fresh, these reused)
    again = q3.DecoderLayer.random(CFG, seed=3, dtype=dtype, device="cuda", expert_device="cpu",
                                   gpu_experts=gpu_experts)
    ca = again.new_cache(16, batch=2)
    ca.set_padding(3, 1)
    assert torch.equal(again.prefill(x.cuda(), ca, chunk_size=3), y)


@needs_gpu
@pytest.mark.parametrize("dtype,tol", [("float32", 1e-5), ("bfloat16", 5e-3)])
def test_split_layer_prefill_runs_pass_by_pass_into_out(dtype, tol):
    """a split layer's prefill of one sequence's 11 tokens in chunks of 4 on torch CUDA tensors:
    three passes of at most 4 rows, each pass's output written into its rows of out in place;
    equal to the CPU layer, and with the insides asked for, the same output bits and the CPU
    layer's router logits and maps (the executor's twin: tests/executor/test_cuda_executor_hybrid.py)"""
    import torch

    cpu = q3.DecoderLayer.random(CFG, seed=3, dtype=dtype)
    split = q3.DecoderLayer.random(CFG, seed=3, dtype=dtype, device="cuda", expert_device="cpu",
                                   gpu_experts=[1, 4, 6])
    x = torch.randn(11, CFG.hidden_size, generator=torch.Generator().manual_seed(5)).to(getattr(torch, dtype))
    out = torch.empty_like(x).cuda()
    assert split.prefill(x.cuda(), split.new_cache(16), chunk_size=4, out=out) is out
    assert rel(out, cpu.prefill(x, cpu.new_cache(16), chunk_size=4)) <= tol
    st = split.hybrid_stats
    assert (st["calls"], st["passes"], st["largest_pass_rows"]) == (1, 3, 4)
    got = split.prefill(x.cuda(), split.new_cache(16), chunk_size=4, return_router=True, return_attention=True)
    want = cpu.prefill(x, cpu.new_cache(16), chunk_size=4, return_router=True, return_attention=True)
    assert torch.equal(got.output, out)
    assert rel(got.router_logits, want.router_logits) <= tol and rel(got.attention, want.attention) <= tol


@needs_gpu
@pytest.mark.parametrize("mode,kw", [("prefill", dict(tokens=40, chunk_size=16)), ("decode", dict(tokens=3, context=9))])
def test_split_layer_profile_times_each_side_on_torch_tensors(mode, kw):
    """profile() of a split layer on the GPU: its calls on torch CUDA tensors (the pinned async
    copies), each side's experts and the link timed, every stage of the model there (the
    executor's twin: tests/executor/test_cuda_executor_hybrid.py)"""
    split = q3.DecoderLayer.random(CFG, seed=3, dtype="bfloat16", device="cuda", expert_device="cpu",
                                   gpu_experts=[1, 4, 6])
    p = split.profile(mode, repeat=1, **kw)
    st = {s.name: s for s in p.stages}
    assert [s.name for s in p.stages] == [s.name for s in p.cost.stages]
    assert st["gpu_experts"].seconds > 0 and st["host_experts"].seconds > 0 and st["attention"].seconds > 0
    assert split.hybrid_stats["link_down_bytes"] > 0 and p.call_seconds > 0


@needs_gpu
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_take_and_combine_rows_on_torch_cuda_tensors_give_the_hosts_bits(dtype):
    """_C.take_rows and _C.combine_rows with device= on torch CUDA tensors, on the current
    stream, against the host's (the executor's twin: tests/executor/test_cuda_executor_halves.py)"""
    import torch

    from qwen3layer import _C
    H, tdt = CFG.hidden_size, getattr(torch, dtype)
    dev, stream = torch.cuda.current_device(), torch.cuda.current_stream().cuda_stream
    g = torch.Generator().manual_seed(31)
    src, rows = torch.randn(2, 3, H, generator=g).to(tdt), torch.tensor([5, 0, 3], dtype=torch.int32)
    out = torch.empty(3, H, dtype=tdt, device="cuda")
    _C.take_rows(src.cuda(), rows.cuda(), out=out, device=dev, stream=stream)
    assert torch.equal(out.cpu(), src.reshape(6, H)[rows.long()])
    resid, parts = torch.randn(6, H, generator=g), torch.randn(3, H, generator=g).to(tdt)
    r_host, y_host = resid.clone(), torch.empty(6, H, dtype=tdt)
    _C.combine_rows(r_host, parts, rows, y_host)
    r_dev, y_dev = resid.cuda(), torch.empty(6, H, dtype=tdt, device="cuda")
    _C.combine_rows(r_dev, parts.cuda(), rows.cuda(), out=y_dev, device=dev, stream=stream)
    assert torch.equal(r_dev.cpu(), r_host) and torch.equal(y_dev.cpu(), y_host)
    with pytest.raises(ValueError, match="row 0 is named twice"):
        _C.combine_rows(r_dev, parts.cuda(), torch.tensor([0, 0, 1], dtype=torch.int32).cuda(), device=dev)
    assert torch.equal(r_dev.cpu(), r_host)
