"""The CUDA path of the engine and the glue (device workspace, host staging, grouping by
expert, cache and outputs on the device, uploads, device checks, decode graphs) and the real
CUDA kernels (kernels/cuda/*.cu), run on the SIMT executor (libq3simt.so: the kernels built
for the CPU, run under CUDA's execution model), against the CPU layer. It runs wherever the
CUDA toolkit's headers were found at build time; test_cuda.py runs the same kernels on a
GPU. In a subprocess: the executor is the backend of the whole process."""
import pytest

from executor_checks import run_check


@pytest.fixture(scope="module")
def out():
    return run_check("cuda_executor_check.py", 900)


def test_cuda_path_on_the_executor_matches_the_cpu_layer(out):
    assert out["float32 uploaded"] == 11 and out["bfloat16 uploaded"] == 11  # host weights copied once
    assert out["float32 max rel err"] <= 1e-5
    # the CPU's bf16 paths round activations to bf16 before their dot products; the CUDA path does not
    assert out["bfloat16 max rel err"] <= 5e-3
    assert out["float32 lengths"] == [[24, 24], [24, 24]] and out["bfloat16 lengths"] == [[24, 24], [24, 24]]
    assert out["bfloat16 output device"] == "cuda:0"
    assert out["device weights borrowed"] is True
    assert out["errors"][0] == "ValueError: x: expected a tensor on device cuda:0, got cpu"
    assert out["errors"][1].startswith("CacheFullError: sequence 0 holds 0 of 8 tokens: 9 more do not fit")
    assert out["errors"][2].startswith("ValueError: cache: expected a cache on cuda:0 (this layer's device), got one on cpu")
    assert out["lengths after errors"] == [0]
    from qwen3layer.costs import STAGES

    assert out["profile stages"] == [list(STAGES), list(STAGES)]
    assert out["device workspace"] > 0
    assert out["random input device"] == "cuda:0"
    for seconds in out["profile seconds"]:
        assert all(t >= 0 for t in seconds) and seconds[STAGES.index("experts")] > 0



def test_head_dim_256_on_the_executor_matches_the_cpu_layer(out):
    """head_dim 256, the most the CUDA layer takes: the attention kernel needs more than the
    48 KiB of shared memory a launch gets by default (the executor refuses such a launch, as a
    GPU does, unless the kernel's limit was raised). Prefill (not tensor cores: D > 128), a
    plain decode step and decode-graph replays (split-KV) match the CPU layer. A head_dim past
    256, or more than 32 query heads a KV head, is refused when the CUDA layer is made, with
    the limit and the value; the CPU layer takes both."""
    for dtype, tol in (("float32", 1e-5), ("bfloat16", 5e-3)):
        *errs, lengths_agree = out["head_dim 256"][dtype]
        assert len(errs) == 4 and max(errs) <= tol and lengths_agree, (dtype, errs)
    assert out["refused geometries"] == [
        "ValueError: head_dim: expected at most 256 on a CUDA device, got 272", "accepted",
        "ValueError: num_attention_heads / num_key_value_heads: expected at most 32 on a CUDA device, got 64",
        "accepted"]
def test_batched_decode_of_many_sequences_on_the_executor_matches_the_cpu_layer(out):
    """Decode batches of 17 and 64 sequences: their projections take the multi-row GEMV
    (csrc/cuda/passes.c, GEMV_MAX_ROWS), 32- and 64-token block columns of matmul.cu."""
    for B in (17, 64):
        assert out[f"batch {B} float32 max rel err"] <= 1e-5
        assert out[f"batch {B} bfloat16 max rel err"] <= 5e-3
        assert out[f"batch {B} float32 lengths agree"] and out[f"batch {B} bfloat16 lengths agree"]



def test_decode_graphs_on_the_executor(out):
    """Capture is modelled strictly (launches recorded, not run; host syncs, host copies and
    allocations refused and the capture invalidated), so a graph that captures at all queued
    nothing that needs the host; its replays must then decode as the CPU layer does, step
    after step, with plain calls and a reset of one sequence in between. The cached keys
    agree too: sequence 1 starts with padding, and only its keys show whether the positions
    (passes.c for prefill, decode_prepare for decode) count from its first real token."""
    for dtype, tol in (("float32", 1e-6), ("bfloat16", 5e-3)):
        g = out[f"graph {dtype}"]
        assert g["created lengths"] == [5, 9, 1]  # capturing appends nothing
        assert g["max rel err"] <= tol
        assert g["keys max rel err"] <= tol
        assert g["lengths agree"] and g["final lengths"] == [13, 17, 7]
        assert (g["batch"], g["dtype"], g["output device"], g["output shape"]) == (3, dtype, "cuda:0", [3, 64])
    errors = out["graph errors"]
    assert errors[0] == "CacheFullError: sequence 0 holds 6 of 6 tokens: 1 more does not fit"
    assert errors[1] == "ValueError: x: expected shape [batch=1, hidden=64], got [2, 64]"
    assert errors[2] == "TypeError: x: expected dtype bfloat16 (the graph's), got float32"
    assert errors[3] == "ValueError: x: expected a tensor on device cuda:0, got cpu"
    assert errors[4] == "ValueError: batch: expected 1 to 1 (the cache's batch, at most 64), got 2"
    assert errors[5].endswith("got 0") and errors[6].endswith("got -5")
    assert errors[7] == "TypeError: batch: expected an int or None, got str"
    assert errors[8] == "TypeError: dtype: expected 'float32' or 'bfloat16', got 'int8'"
    assert errors[9] == "ValueError: decode_graph: expected a layer on a CUDA device, got a cpu layer"
    assert errors[10].startswith("ValueError: cache: expected a cache on cuda:0")
    assert out["graph lengths after errors"] == [6]
    assert out["synchronize errors"] == ["RuntimeError: cuda_synchronize(1): invalid device ordinal"]
    assert out["wrapped graph"] == ["Tensor", [1, 1], "DecodeGraph(batch=2, dtype=bfloat16, device=cuda:0)"]


def cpu_bound(out) -> float:
    """the bound on the emulated CUDA layer's bf16 prefill against the CPU layer, relative to
    the update: the CPU's bf16 paths (avx512bf16, amx) round the experts' inputs to bf16 as
    the tensor cores do, and on an Intel Xeon with AMX both give 2.39e-3 to 2.53e-3 (one
    sequence, two in chunks; 2.44e-3 through the measured path choice): bound 3e-3 (the 2e-3
    before was exceeded there); the fp32 paths move the update by the rounding
    itself (4.0e-3 measured on an AMD EPYC's avx2, 4.2e-3 on the Xeon's portable, avx2 and
    avx512): bound 8e-3"""
    return 3e-3 if out["cpu path"] in ("avx512bf16", "amx") else 8e-3


def test_grouped_prefill_moe_on_the_executor(out):
    """The prefill MoE in batches of experts (a few launches per batch: tiles, token lists
    made on the host) computes what one launch per expert does, step for step in the same
    order (experts here all get >= 16 tokens, so both round to bf16 for the tensor cores),
    with experts of two tiles and tokens with two slots in one batch. Errors are relative to
    the layer's update y - x, where a wrong expert term would show. The CPU layer rounds the
    experts' inputs to bf16 as the tensor cores do only on its bf16 paths (avx512bf16, amx);
    the others keep them in fp32, which moves the update by the rounding itself, so they get
    a wider bound (cpu_bound)."""
    tol = cpu_bound(out)
    for name in ("one sequence", "two sequences in chunks", "three tokens: batches of at most 3 pairs"):
        grouped_vs_cpu, per_expert_vs_cpu, grouped_vs_per_expert = out["grouped prefill"][name]
        assert grouped_vs_cpu <= tol and per_expert_vs_cpu <= tol, (name, out["cpu path"])
        if name.startswith("three"):  # experts of < 16 tokens: the per-expert path skips the bf16 rounding
            continue
        assert grouped_vs_per_expert <= 1e-6, name
    assert out["grouped prefill setting"] == [False, True]


def test_the_prefill_moe_path_is_the_measured_fastest_per_size_class(out):
    """With injected times (the executor's event times mean nothing), a layer's first prefill
    of a size class times every path it can take (the four here: bf16 weights, H and I
    multiples of 32, the cuBLAS stand-in open, with its grouped GEMM) and keeps the fastest; its output is that
    path's forced output and the CPU layer's; the class keeps its choice under other times
    while another class is measured anew with them. With the events' times the choice is
    their fastest. Decode steps and graphs never measure. A cuBLAS that refuses the grouped
    GEMM costs that candidate only."""
    paths = {"per_expert_wmma", "per_expert_cublas", "grouped_wmma", "grouped_cublas"}
    tol = cpu_bound(out)
    choice = out["moe path choice"]
    for fastest in paths:
        c = choice[fastest]
        [[size_class, chosen, times]] = c["first"]
        assert size_class == [128, 255] and chosen == fastest and set(times) == paths, c
        assert c["kept"] and c["classes after 40 rows"] == [[32, 63], [128, 255]], c
        assert c["40 rows"] != fastest  # the times injected after the first pass favour the others
        assert c["vs forced"] <= 1e-6 and c["vs cpu"] <= tol, c
    events = choice["events"]
    assert set(events["times"]) == paths and all(t >= 0 for t in events["times"].values())
    assert events["chosen"] == min(events["times"], key=events["times"].get) and events["vs cpu"] <= tol
    assert choice["decode only"] == {}
    # a cuBLAS refusing its grouped GEMM: that candidate dropped, the next fastest kept
    assert choice["refused"]["chosen"] == "per_expert_wmma" and choice["refused"]["vs cpu"] <= tol
    assert choice["refused"]["times"] == sorted(paths - {"grouped_cublas"})
    assert out["moe path setting"] == ["grouped_cublas", "measured", False]


def test_router_ties_on_the_device_path_follow_the_lower_index_rule(out):
    """The tie layer of router_ties.py (exact ties, straddling the k-th place, and all
    experts equal) in a prefill (grouping on the host) and a decode step (grouping on the
    device) against the fp64 reference with the documented rule. The router kernel here is
    the CPU twin; router.cu is held to the rule by the kernel self-check's tie case."""
    prefill_err, decode_err = out["router ties"]
    assert prefill_err <= 1e-5 and decode_err <= 1e-5, out["router ties"]


# the kernel launchers of kernels/cuda/ops_cuda.h: each is exercised by some case
LAUNCHERS = {"rmsnorm", "add_rmsnorm", "matmul", "gate_up", "matmul_tc", "matmul_wmma", "qk_rope_kv", "attention",
             "attention_probs", "router_topk", "decode_prepare", "moe_route", "moe_gate_up", "moe_down", "moe_combine", "moe_gate_up_tc",
             "moe_down_tc", "moe_combine_csr", "swiglu", "gather_rows", "scatter_add_rows", "to_f32", "from_f32",
             "matmul_fp8", "fp8_dequant", "moe_gate_up_fp8", "moe_down_fp8"}


def test_every_kernel_matches_its_twin_on_the_executor_under_every_schedule(out):
    """q3.cuda.check_kernels() on the executor: each real kernel against its CPU twin within
    its tolerance, and under each of the three thread schedules (forward, reverse, a seeded
    shuffle) bitwise equal results: a missing barrier would show as a difference. The cases
    cover the shapes of issue 12 (1 and 17 tokens, contexts 1, 33, 100, batches 1, 3, 5,
    head dims 64 and 128, top-k 1 to 8, left padding); each names its launcher(s), and every
    launcher has a case."""
    cases = out["kernel check"]
    assert len(cases) == 420  # with the cuBLAS stand-in open; 418 without cuBLAS
    assert len({case[0] for case in cases}) == len(cases)
    for name, err, tol, schedules, agree, kernel in cases:
        assert err <= tol and schedules == 3 and agree, (name, kernel, err, tol, schedules, agree)
    kernels = {part for case in cases for part in case[5].split("+")}
    assert kernels == LAUNCHERS
    names = [case[0] for case in cases]
    for shape in ("context=1 batch=1 D=64 pad=0", "context=33 batch=3 D=128 pad=5", "context=100 batch=5 D=128 pad=5"):
        for path in ("attention tc, tokens=17 ", "attention f32 G=2, tokens=17 ", "attention, tokens=1 ",
                     "attention split-KV, tokens=1 ", "qk_rope_kv, tokens=1 ", "qk_rope_kv, tokens=17 "):
            assert path + shape in names
    # the attention maps: hand-made passes (decode, prefill, chunks of a longer call, padding,
    # head dims 18 to 256, G = 1 to 16, 3000 keys) and the batches of the lists
    assert sum(name.startswith("attention probs, ") for name in names) == 13
    for B in (1, 3, 5):
        for T in (1, 17):
            assert f"attention probs, tokens={T} context=33 batch={B} D=64 pad=5" in names
    # the tensor-core attention's online softmax, rescaling on every key tile
    assert sum(name.startswith(("attention tc, scores growing", "attention tc, scores in the thousands"))
               for name in names) == 4
    for k, E in ((1, 60), (8, 60), (32, 60), (1, 128), (8, 128), (32, 128), (8, 4096), (32, 4096)):
        assert any(n.startswith(f"router top-k, tied logits, k={k} E={E} ") for n in names)
    for D in (128, 24):
        assert f"qk_rope_kv at positions 1e5 to 2^40, D={D}" in names
        # the scaled RoPE tables (csrc/engine/rope_table.c) at the same far positions
        assert f"qk_rope_kv linear RoPE x4 at positions 1e5 to 2^40, D={D}" in names
        assert f"qk_rope_kv YaRN x4 of 4096 at positions 1e5 to 2^40, D={D}" in names
    for k in range(1, 9):
        assert f"router top-k, k={k} E=60 T=17, renormalised" in names
        for T in (1, 17):
            assert f"moe_route, T={T} k={k} E=60" in names
            assert f"moe gate_up + down + combine, T={T} k={k} E=12" in names
            assert f"moe prefill tiles + combine_csr, T={T} k={k} E=12" in names
    # the FP8 kernels: both scale dtypes, each path (16-byte loads with partial blocks, one
    # element a lane, unaligned operands, NaN codes)
    for sdt in ("f32", "bf16"):
        for T in (1, 7, 9, 17, 33):
            assert f"fp8 matmul GEMV {sdt} scales T={T} N=300 K=400" in names
        for case in ("K=400, w unaligned", "K=256, x unaligned", "K=400, NaN codes", "K=100, NaN codes"):
            assert any(n.startswith(f"fp8 matmul GEMV {sdt} scales") and n.endswith(case) for n in names), case
        assert sum(n.startswith(f"fp8 dequant to bf16, {sdt} scales") for n in names) == 3
        assert sum(n.startswith(f"fp8 moe gate_up + down, {sdt} scales") for n in names) == 3


def test_the_cli_run_on_a_cuda_layer_also_times_graph_decode(out):
    code, *lines = out["cli run"]
    assert code == 0
    assert lines[0].startswith("decode   3 steps at context 40..42: median ")
    assert lines[1].startswith("decode   3 more steps replaying a CUDA graph of the step: ")
    assert lines[1].endswith(" ms/token (wall clock, launches included)")
    assert "filled=43/43 tokens" in lines[2]  # the graph's steps went over the plain steps' positions


def test_dead_outputs_device_blocks_serve_the_next_outputs(out):
    """Freeing a device output every decode step would call cudaFree, which waits for the
    whole device: a dead output's block goes to the next output of its size instead, never
    to one while it is alive; q3.cuda.empty_cache frees the kept blocks. With all 16 slots
    holding blocks of other sizes, the oldest is freed for the newly dead block (it used to
    be freed itself, and the test passed only when the allocator happened to hand the same
    address back)."""
    blocks = out["output blocks"]
    assert blocks["kept before"] == [4 * (8 + i) for i in range(16)]
    assert blocks["kept after"] == [4 * (8 + i) for i in range(1, 16)] + [2 * 64]
    assert blocks["newest kept is the dead output"] and blocks["oldest evicted"]
    assert blocks["reused"] and blocks["live ones distinct"]
    assert blocks["kept after empty_cache"] == 0


def test_the_kernel_check_runs_its_cublas_cases_and_leaves_cublas_as_it_was(out):
    """With cuBLAS open (the executor's stand-in), check_kernels runs the two cuBLAS cases and
    restores the setting it found: it used to read the new state as the old one, so it never
    ran them and left cuBLAS off for the rest of the process. A prefill through blas.cu's
    path matches the CPU layer."""
    blas = out["cublas stand-in"]
    assert blas["enabled before"] is True and blas["enabled after"] is True
    assert [c[0] for c in blas["cases"]] == ["matmul cuBLAS T=70 N=80 K=96", "matmul cuBLAS T=512 N=4096 K=1536"]
    assert all(err <= tol and agree for _, err, tol, agree in blas["cases"]), blas["cases"]
    assert blas["prefill rel err"] < 2e-2


def test_a_steady_state_allocates_nothing_on_the_device(out):
    """Issue 13, item 4: the layer's device workspace and host staging only grow (to the
    larger of the rows, of the sequences and of the split-KV rows held and asked), so
    alternating shapes that no one dominates (a one-sequence prefill of 40 rows, a decode of
    4 sequences, a prefill of 4 sequences of 6 tokens, a chunked prefill) stops allocating
    after the first call of each;
    sized to each call, the workspace was freed (cudaFree waits for the whole device) and
    reallocated on every switch. Counted by the executor: [call, cudaMalloc calls, cudaFree
    calls during the call, cudaFree calls when its output is dropped]. Outputs are the other
    device allocations a call makes: a dead output's block is kept (py_tensor.c) for the next
    output of its size, so in round 1 each new output size allocates once (the chunked
    prefill's [24, 64] output takes the batched prefill's [4, 6, 64] block), and in rounds 2
    and 3 every output is a kept block: nothing allocated, nothing freed."""
    steady = out["steady state"]
    first, *later = steady["rounds"]
    # prefill: the workspace (40 rows, 1 sequence, 16 split-KV rows) and its output; decode:
    # the workspace grown to 4 sequences (the old one freed) and its output; batched prefill:
    # grown to 24 split-KV rows (6 tokens a sequence: all its 24 rows may split) and its output
    assert [call[1:3] for call in first] == [[2, 0], [2, 1], [2, 1], [0, 0], [0, 0]], first
    for calls in later:
        assert [call[1:] for call in calls] == [[0, 0, 0]] * 5, calls
    assert steady["workspace bytes"][0] > 0 and len(set(steady["workspace bytes"])) == 1
    assert steady["rounds equal"]  # a larger workspace than the call needs changes nothing
    assert max(steady["max rel err"]) <= 5e-3  # against the CPU layer (bf16 weights)



def test_the_workspace_grows_the_split_kv_partials_as_their_own_dimension(out):
    """Growing only, the workspace keeps the larger rows and the larger sequences of the
    calls; the split-KV partials, which calls of at most 16 tokens per sequence use
    (min(rows, 16 seqs) query rows of a call), keep the largest of those instead: after a
    one-sequence prefill of 200 rows (16) a decode of 8 sequences (8) adds only its
    per-sequence arrays, less than one row of partials (from min(200, 16 x 8) = 128 rows it
    would add 112; at the real geometry a 512-token prefill and a 64-sequence decode would
    hold 545 MB of partials where either call alone needs under 70 MB)."""
    split = out["split-KV partials"]
    assert split["after prefill"] <= split["after decode"] < split["after prefill"] + split["row bytes"], split

@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_misaligned_device_weights_are_copied_once_to_aligned_memory(out, dtype):
    """Issue 13, item 5: bf16 weight rows are read with 16-byte loads (row_dots.cuh, K % 8 ==
    0); a borrowed device weight at executor memory + 2 bytes used to reach them, which the
    executor reports as the hardware does ("misaligned address": `error` here). Every device
    weight off the 16-byte rule (Q3_CUDA_WEIGHT_ALIGN: bf16 at +2; fp32 at +4, +8 and +12,
    which today's 4-byte loads would take) is now copied once into a cudaMalloc block, with
    the warning and the `converted` entries of the other conversions: fused experts (whose
    per-expert pointers follow the copy's base), per-expert weights, a norm. Aligned ones are still borrowed, the producers' views of the copied ones
    released, and the outputs are bitwise those of the same weights borrowed aligned (prefill
    of 2 x 5 tokens: the GEMV; 2 x 12: the tensor-core GEMM for bf16; decode)."""
    case = out["misaligned weights"][dtype]
    assert case["error"] is None, case["error"]
    expected = {"bfloat16": ["input_layernorm.weight", "mlp.experts.down_proj", "mlp.experts.gate_up_proj",
                             "mlp.gate.weight", "self_attn.o_proj.weight", "self_attn.q_proj.weight"],
                "float32": ["mlp.experts.3.down_proj.weight", "mlp.experts.5.gate_proj.weight",
                            "self_attn.k_proj.weight", "self_attn.q_proj.weight", "self_attn.v_proj.weight"]}[dtype]
    assert case["converted"] == expected
    assert case["producer addresses mod 16"] == ([2] if dtype == "bfloat16" else [4, 8, 12])
    assert case["aligned converted"] == []
    assert len(case["warnings"]) == 1
    assert case["warnings"][0].startswith(f"DecoderLayer: copied {len(expected)} weight(s) to contiguous, 16-byte "
                                          f"aligned {dtype} on cuda:0 once at construction: ")
    assert case["copies aligned"] and case["others borrowed"] and case["copied producers released"]
    assert case["max abs diff"] == 0.0


@pytest.fixture(scope="module")
def fp8():
    return run_check("cuda_executor_fp8_check.py", 900)


def test_fp8_layers_on_the_executor_match_the_cpu_fp8_layer(fp8):
    """FP8 layers (e4m3 weights with 128 x 128 block scales) on the emulated device against the
    CPU FP8 layer on the same weights: prefill in chunks of 5, 16 and 40 tokens of 2 sequences,
    decode steps of 2 sequences (plain, and replays of a decode graph) and of 1, at hidden 320 / moe_inter 160 (16-byte FP8 loads,
    partial scale blocks) and 200 / 130 (one element a lane), fp32 and bf16 scales, experts per
    expert and fused. fp32 layers stream FP8 everywhere (the GEMV, the grouped decode
    experts): as exact as the CPU's up to summation order. bf16 layers' prefill dequantizes to
    bf16 for the tensor cores, which round the activations and the dequantized weights to
    bf16 where the CPU keeps fp32 products: the dense bf16 layer's tolerance."""
    cases = {k: v for k, v in fp8.items() if k != "borrowed"}
    assert len(cases) == 8
    for name, c in cases.items():
        tol = 1e-5 if name.split()[1] == "float32" else 5e-3  # the layer dtype
        assert c["max rel err"] <= tol and c["lengths agree"], (name, c)
        assert c["format"] == "fp8_e4m3_block128" and c["weight bytes equal"], (name, c)
        # host weights are uploaded once each: 4 attention matrices and their scales, 4 norms,
        # the router; the experts' matrices and scales (2 fused tensors and their scales, or
        # 3 of each per expert)
        E = 8 if "h320" in name else 6
        assert c["uploaded"] == 13 + (4 if "fused" in name else 6 * E), (name, c)


def test_fp8_device_weights_are_borrowed_and_misaligned_ones_copied_once(fp8):
    """Device float8_e4m3fn matrices at 16-byte aligned addresses are borrowed (nothing in
    `converted`); one at + 8 bytes is copied once to an aligned block and named there, and the
    layer's outputs are bitwise those of the aligned one."""
    b = fp8["borrowed"]
    assert b["aligned converted"] == [] and b["odd converted"] == ["self_attn.o_proj.weight"]
    assert b["outputs equal"]


@pytest.fixture(scope="module")
def insides():
    return run_check("cuda_executor_insides_check.py", 600)


# the CPU's bf16 paths round activations to bf16 before their dot products, the CUDA path does
# not: the router's logits and weights move as the layer's output does (5e-3), the maps' scores
# with q (an absolute bound on probabilities)
INSIDES_TOL = {"float32": {"rel": 1e-5, "maps": 1e-5}, "bfloat16": {"rel": 5e-3, "maps": 2e-2}}


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_the_layers_insides_on_the_executor_match_the_cpu_layers(insides, dtype):
    """return_router and return_attention on an emulated CUDA layer (issue 15, requirement 4):
    a prefill of 2 sequences (one left-padded) in chunks of 4, each pass writing its rows of
    the maps, a second chunked prefill after the first, and two plain decode steps give the
    CPU layer's output, router logits, expert weights and maps within the dtype's tolerance,
    the same experts on every row whose top k + 1 logits are clear of each other, tensors of
    the documented shapes on the device; the CUDA maps keep their own rules (rows sum to 1,
    zero outside the keys the query sees, a padding query's row one-hot at itself), and the
    outputs are bit for bit those of the same calls asking for nothing."""
    tol = INSIDES_TOL[dtype]
    run = insides[dtype]
    assert run["lengths agree"] and run["outputs as without insides"] == [True] * 4
    names = [name for name, _ in run["calls"]]
    assert names == ["prefill 11 in chunks of 4", "prefill 5 more in chunks of 3", "decode step 0", "decode step 1"]
    contexts = [11, 16, 17, 18]
    clear_rows = 0
    for (name, c), context in zip(run["calls"], contexts):
        rows = [2, 11] if name.startswith("prefill 11") else [2, 5] if name.startswith("prefill 5") else [2]
        tokens = rows[1] if len(rows) == 2 else 1
        assert c["shapes"] == [rows + [8], rows + [2], rows + [2], [2, 8, tokens, context]], (name, c["shapes"])
        assert c["devices"] == ["cuda:0"] * 5, name
        assert max(c["output"], c["logits"], c["weights"]) <= tol["rel"], (name, c)
        differ, within = c["experts"]
        assert differ == 0, (name, c)
        clear_rows += 2 * tokens - within
        assert c["maps"] <= tol["maps"] and c["structure"] <= 1e-5, (name, c)
    assert clear_rows >= 24  # of 36 rows: the experts were compared on most of them


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_fp8_layers_router_outputs_on_the_executor_match_the_cpu_fp8_layer(insides, dtype):
    """FP8 layers (e4m3, 128 x 128 block scales): a chunked prefill and a decode step asking for
    the router's outputs only give the CPU FP8 layer's, and no maps."""
    tol = INSIDES_TOL[dtype]["rel"]
    prefill, decode = insides["fp8"][dtype]
    for c in (prefill, decode):
        assert max(c["output"], c["logits"], c["weights"]) <= tol and c["experts"][0] == 0 and c["no maps"], c


def test_the_wrapper_returns_the_insides_of_a_cuda_layer_on_the_device(insides):
    """DecoderLayer on cuda: a prefill asking for the maps only and a decode asking for the
    router only return LayerTraces with what was asked on the device, None for the rest."""
    assert insides["wrapper"]["prefill"] == ["LayerTrace", True, [2, 8, 6, 6], "cuda:0"]
    assert insides["wrapper"]["decode"] == ["LayerTrace", True, [2, 8], [2, 2], "int32", "cuda:0"]
