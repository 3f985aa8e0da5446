"""CUDA benchmark: the device's own copy bandwidth; the decode GEMV (1 or 16 tokens, bf16
weights) at the real geometry's shapes in TB/s against that copy rate; then the layer itself,
real geometry, bf16, on the GPU against transformers' layer on the same GPU and the same
weights (ours borrows its CUDA parameters), medians of CUDA-synchronised wall time: decode
batch 1 and 16 at context 8192 (plain calls, and the step captured in a CUDA graph: time per
token over runs of consecutive steps; batch 1 also with the same weights in FP8, e4m3 with
128 x 128 block scales, and in 4-bit GPTQ, group 128, no transformers peer), prefill of 8192 tokens in chunks of
2048 and 8192 with the device memory beyond weights and cache (and once with one MoE launch per expert, to
compare with the grouped MoE). Needs a CUDA device and torch with CUDA; prints
the tables last.

Beside them, the per-stage model: for each stage of the engine's forward (q3.cost_model's
stages, the ones layer.profile times) of decode batch 1 and batch 16 at context 8192 and of
a prefill of 8192 tokens in one chunk, the bytes it moves and the FLOPs it does, the time
the measured copy rate and matrix rate allow (max of bytes / copy rate and FLOPs / matrix
rate: its floor), the time the layer's stage profile measures (CUDA events at each stage
boundary) and their ratio. The layer table's rows also carry their model floor (the sum of
the stages' floors).

    python benchmarks/bench_cuda.py --predict

prints the per-stage model alone, with no GPU and nothing measured: the floors at an H200's
copy rate and bf16 matrix rate as qwen3layer/analysis/gpu_figures.py holds them (with their
sources), the table benchmarks/RESULTS.md holds until a GPU run replaces it.
"""
from __future__ import annotations

import argparse
import os
import sys
from typing import Dict, Optional

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import qwen3layer as q3  # noqa: E402
from qwen3layer import _C  # noqa: E402
from qwen3layer.analysis.costs import CostModel, decode_weight_bytes  # noqa: E402
from qwen3layer.analysis.gpu_figures import H200_BF16_FLOPS, H200_COPY_BYTES_PER_S  # noqa: E402

# (name, N, K) of y = x W^T for one layer of Qwen3-235B-A22B
SHAPES = [("q_proj", 8192, 4096), ("k_proj / v_proj", 512, 4096), ("o_proj", 4096, 8192),
          ("router", 128, 4096), ("expert gate / up", 1536, 4096), ("expert down", 4096, 1536)]


# the rows the per-stage model is printed for: (title, q3.cost_model / layer.profile arguments)
MODEL_ROWS = [("decode batch 1, context 8192", dict(mode="decode", tokens=1, context=8192, batch=1)),
              ("decode batch 16, context 8192", dict(mode="decode", tokens=1, context=8192, batch=16)),
              ("prefill 8192 tokens, one chunk of 8192", dict(mode="prefill", tokens=8192, context=0,
                                                              chunk_size=8192))]


def stage_floor(nbytes: float, flops: float, copy_tbs: float, mm_tflops: float) -> float:
    """Seconds a stage needs at least: moving its bytes at the copy rate or doing its FLOPs at
    the matrix rate, whichever takes longer (one stage does not overlap the next)."""
    return max(nbytes / (copy_tbs * 1e12), flops / (mm_tflops * 1e12))


def model_floor(cost: CostModel, copy_tbs: float, mm_tflops: float) -> float:
    return sum(stage_floor(s.bytes, s.flops, copy_tbs, mm_tflops) for s in cost.stages)


def model_table(title: str, cost: CostModel, copy_tbs: float, mm_tflops: float,
                measured: Optional[Dict[str, float]] = None) -> str:
    """One row per stage and a total: MB moved, GFLOP, what bounds it (memory or matrix), its
    floor in us; with `measured` (stage -> seconds) also the measured us and measured / floor."""
    head = ["stage", "MB", "GFLOP", "bound", "floor us"] + (["measured us", "measured/floor"] if measured else [])
    rows, tot = [], [0, 0.0, 0.0, 0.0]
    for s in cost.stages:
        floor = stage_floor(s.bytes, s.flops, copy_tbs, mm_tflops)
        bound = "matrix" if s.flops / (mm_tflops * 1e12) > s.bytes / (copy_tbs * 1e12) else "memory"
        row = [s.name, f"{s.bytes / 1e6:.3f}", f"{s.flops / 1e9:.3f}", bound, f"{floor * 1e6:.2f}"]
        tot = [tot[0] + s.bytes, tot[1] + s.flops, tot[2] + floor, tot[3]]
        if measured:
            t = measured.get(s.name, 0.0)
            tot[3] += t
            row += [f"{t * 1e6:.2f}", f"{t / floor:.2f}" if floor > 0 else "-"]
        rows.append(row)
    total = ["total", f"{tot[0] / 1e6:.3f}", f"{tot[1] / 1e9:.3f}", "", f"{tot[2] * 1e6:.2f}"]
    if measured:
        total += [f"{tot[3] * 1e6:.2f}", f"{tot[3] / tot[2]:.2f}"]
    rows.append(total)
    widths = [max(len(r[i]) for r in rows + [head]) for i in range(len(head))]
    lines = [title, " | ".join(h.ljust(w) for h, w in zip(head, widths)), "-|-".join("-" * w for w in widths)]
    lines += [" | ".join(v.ljust(w) for v, w in zip(r, widths)) for r in rows]
    return "\n".join(lines)


def predict() -> int:
    copy_tbs, mm_tflops = H200_COPY_BYTES_PER_S / 1e12, H200_BF16_FLOPS / 1e12
    cfg = q3.LayerConfig.qwen3_235b_a22b()
    print(f"per-stage model, real geometry, bf16; predicted, no GPU run: floors at the H200's {copy_tbs:g} TB/s copy "
          f"and {mm_tflops:g} TFLOP/s bf16 matrix rate (qwen3layer/analysis/gpu_figures.py)")
    for title, args in MODEL_ROWS:
        print()
        print(model_table(title, q3.cost_model(cfg, **args), copy_tbs, mm_tflops))
    return 0


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--predict", action="store_true",
                        help="print the per-stage model alone, at the H200 figures of "
                             "qwen3layer/analysis/gpu_figures.py (no GPU)")
    args = parser.parse_args(argv)
    if args.predict:
        return predict()
    if q3.cuda.device_count() == 0:
        print("bench_cuda: no CUDA device on this machine (0 found); --predict prints the per-stage model alone",
              file=sys.stderr)
        return 2
    copy_bytes = 4 << 30
    copy_ms = q3.cuda.testing_module().cuda_time("copy", bytes=copy_bytes, repeats=10)
    copy_tbs = 2 * copy_bytes / copy_ms / 1e9  # read + write
    rows = []
    per_token_ms = 0.0
    uses = {"q_proj": 1, "k_proj / v_proj": 2, "o_proj": 1, "router": 1, "expert gate / up": 16, "expert down": 8}
    for name, N, K in SHAPES:
        for T in (1, 16):
            ms = q3.cuda.testing_module().cuda_time("matmul", T=T, N=N, K=K, dtype="bfloat16", repeats=50)
            tbs = N * K * 2 / ms / 1e9
            rows.append((f"{name} [{N} x {K}]", T, f"{ms * 1e3:.1f} us", f"{tbs:.2f} TB/s", f"{tbs / copy_tbs:.0%}"))
            if T == 1:
                per_token_ms += uses[name] * ms
    cfg = q3.LayerConfig.qwen3_235b_a22b()
    floor_ms = decode_weight_bytes(cfg) / (copy_tbs * 1e9)
    print(f"device copy: {copy_tbs:.2f} TB/s (read + write of {copy_bytes >> 30} GiB, CUDA events)\n")
    head = ("matmul (bf16 weights)", "tokens", "time", "weights read", "of copy rate")
    widths = [max(len(str(r[i])) for r in rows + [head]) for i in range(5)]
    print(" | ".join(h.ljust(w) for h, w in zip(head, widths)))
    print("-|-".join("-" * w for w in widths))
    for r in rows:
        print(" | ".join(str(v).ljust(w) for v, w in zip(r, widths)))
    print(f"\none decode token's weight GEMVs (sum of kernel times): {per_token_ms * 1e3:.0f} us; "
          f"read floor at the copy rate: {floor_ms * 1e3:.0f} us ({floor_ms / per_token_ms:.0%} of it reached)")
    layer_table(copy_tbs)
    return 0


class Rows(list):
    """The layer table's rows, each also printed as it is measured (a run cut short by a
    timeout still shows what it got)."""

    def append(self, row) -> None:
        print("measured: " + " | ".join(str(v) for v in row), flush=True)
        super().append(row)


def layer_table(copy_tbs: float) -> None:
    import statistics
    import time

    import torch
    from transformers import Qwen3MoeConfig
    from transformers.cache_utils import DynamicCache
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeDecoderLayer, Qwen3MoeRotaryEmbedding

    cfg = q3.LayerConfig.qwen3_235b_a22b()
    hc = Qwen3MoeConfig(hidden_size=4096, num_attention_heads=64, num_key_value_heads=4, head_dim=128,
                        num_experts=128, num_experts_per_tok=8, moe_intermediate_size=1536, norm_topk_prob=True,
                        num_hidden_layers=1, vocab_size=16, intermediate_size=64, rope_theta=1e6)
    hc._attn_implementation, hc._experts_implementation = "sdpa", "grouped_mm"
    weights = _C.random_weights(cfg, 0, "bfloat16")
    with torch.device("meta"):
        hf = Qwen3MoeDecoderLayer(hc, 0)
    hf.load_state_dict({k: torch.from_dlpack(v).cuda() for k, v in weights.items()}, assign=True)
    hf.eval()
    layer = q3.DecoderLayer.from_hf(hf, device="cuda")
    assert layer.converted == ()
    rope = Qwen3MoeRotaryEmbedding(hc).cuda()

    def wall(fn, repeats):
        fn()
        torch.cuda.synchronize()
        ts = []
        for _ in range(repeats):
            t = time.perf_counter()
            fn()
            torch.cuda.synchronize()
            ts.append(time.perf_counter() - t)
        return statistics.median(ts)

    # the machine's bf16 matrix rate, measured here: cuBLAS through torch on 8192^3
    square = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    mm_tflops = 2 * 8192**3 / wall(lambda: square @ square, 10) / 1e12
    print(f"\nbf16 matrix rate (torch matmul 8192^3): {mm_tflops:.0f} TFLOP/s")
    rows = Rows()
    steps = 8  # consecutive decode steps per timed run, then the caches are cut back
    for batch, ctx in ((1, 8192), (16, 8192)):
        cache = layer.new_cache(ctx + steps, batch=batch)
        for t0 in range(0, ctx, 2048):  # fill the cache through the layer itself
            n = min(2048, ctx - t0)
            layer.prefill(torch.randn(batch, n, 4096, device="cuda", dtype=torch.bfloat16), cache)
        hfc = DynamicCache(config=hc)
        kv = (batch, 4, ctx, 128)
        hfc.update(torch.randn(kv, device="cuda", dtype=torch.bfloat16), torch.randn(kv, device="cuda", dtype=torch.bfloat16), 0)
        x = torch.randn(batch, 4096, device="cuda", dtype=torch.bfloat16)
        pos = torch.full((batch, 1), ctx, device="cuda")
        cos, sin = rope(x[:, None], pos)
        graph = layer.decode_graph(cache)

        def cut_back():
            for b in range(batch):
                cache.truncate(ctx, b)

        def ours():
            for _ in range(steps):
                layer.decode(x, cache)
            cut_back()

        def ours_graph():
            for _ in range(steps):
                graph(x)
            cut_back()

        def theirs():
            with torch.no_grad():
                for _ in range(steps):
                    hf(x[:, None], position_ids=pos, position_embeddings=(cos, sin), cache=hfc, use_cache=True)
            hfc.crop(-steps)

        t_ours, t_graph, t_hf = (wall(f, 10) / steps for f in (ours, ours_graph, theirs))
        nbytes = decode_weight_bytes(cfg) + batch * ctx * 2048
        floor = model_floor(q3.cost_model(cfg, "decode", 1, ctx, batch=batch), copy_tbs, mm_tflops)
        for name, t in (("plain calls", t_ours), ("CUDA graph", t_graph)):
            rows.append((f"decode batch {batch}, context {ctx}, {name}", f"{t * 1e6:.0f} us", f"{t_hf * 1e6:.0f} us",
                         f"{t_hf / t:.2f}x", f"{nbytes / t / 1e12:.2f} TB/s ({nbytes / t / 1e12 / copy_tbs:.0%} of copy)",
                         f"{floor * 1e6:.0f} us (measured {t / floor:.2f}x)"))
    fp8_decode_rows(rows, weights, copy_tbs, steps, wall)
    S = 8192
    x = torch.randn(S, 4096, device="cuda", dtype=torch.bfloat16)
    pos = torch.arange(S, device="cuda")[None]
    cos, sin = rope(x[None], pos)
    with torch.no_grad():
        t_hf = wall(lambda: hf(x[None], position_ids=pos, position_embeddings=(cos, sin)), 3)
    from qwen3layer.analysis.costs import prefill_flops
    for chunk, grouped in ((2048, True), (8192, True), (2048, False)):
        fresh = q3.DecoderLayer.from_hf(hf, device="cuda")  # its own workspace: what this prefill needs
        # False: one launch per expert and step through matmul_tc (cuBLAS where open), for comparison
        q3.cuda.moe_path(fresh, "grouped_wmma" if grouped else "per_expert_cublas")
        t_ours = wall(lambda f=fresh, c=chunk: f.prefill(x, f.new_cache(S), chunk_size=c), 3)
        io = 2 * x.numel() * x.element_size()  # the caller's input and the output
        moe = "grouped MoE" if grouped else "MoE launch per expert"
        floor = model_floor(q3.cost_model(cfg, "prefill", S, 0, chunk), copy_tbs, mm_tflops)
        rows.append((f"prefill {S} tokens, chunks of {chunk}, {moe}", f"{t_ours * 1e3:.1f} ms",
                     f"{t_hf * 1e3:.1f} ms", f"{t_hf / t_ours:.2f}x",
                     f"{prefill_flops(cfg, S) / t_ours / 1e12:.1f} TFLOP/s "
                     f"({prefill_flops(cfg, S) / t_ours / 1e12 / mm_tflops:.0%} of matrix rate); "
                     f"beyond weights and cache: {fresh.workspace_bytes / 2**20:.0f} MiB of workspace "
                     f"(+ {io / 2**20:.0f} MiB input and output)",
                     f"{floor * 1e3:.2f} ms (measured {t_ours / floor:.2f}x)"))
    int4_decode_rows(rows, weights, copy_tbs, steps, wall)  # after the bf16 rows: a run cut short keeps them
    print_moe_path_choice(hf, x)
    head = ("layer, real geometry, bf16", "qwen3layer", "transformers", "speed-up", "achieved", "model floor")
    widths = [max(len(str(r[i])) for r in rows + [head]) for i in range(len(head))]
    print()
    print(" | ".join(h.ljust(w) for h, w in zip(head, widths)))
    print("-|-".join("-" * w for w in widths))
    for r in rows:
        print(" | ".join(str(v).ljust(w) for v, w in zip(r, widths)))
    print(f"(model floor: the sum of the stages' floors at the measured {copy_tbs:.2f} TB/s copy and "
          f"{mm_tflops:.0f} TFLOP/s matrix rates, per step for decode; the stages follow)")
    for title, args in MODEL_ROWS:  # each printed as it is measured
        p = layer.profile(repeat=3, **args)
        print()
        print(model_table(f"{title}: measured by layer.profile (CUDA events at each stage boundary; the "
                          f"unprofiled call {p.call_seconds * 1e6:.0f} us)", p.cost, copy_tbs, mm_tflops,
                          {st.name: st.seconds for st in p.stages}), flush=True)


def fp8_weights_on_gpu(weights) -> dict:
    """the layer's bf16 weights quantized on the GPU to e4m3 with one fp32 scale_inv per
    128 x 128 block (each block's largest magnitude to 448), experts fused as transformers 5.x
    holds them; norms and the router stay bf16"""
    import torch

    out = {}
    for k, v in weights.items():
        t = torch.from_dlpack(v).cuda()
        if not ((k.startswith("self_attn.") and k.endswith("proj.weight")) or k.startswith("mlp.experts.")):
            out[k] = t
            continue
        *lead, N, K = t.shape  # multiples of 128 at the real geometry
        for e in range(lead[0] if lead else 1):  # an expert at a time: fp32 blocks of one matrix
            m = t[e] if lead else t
            b = m.float().reshape(N // 128, 128, K // 128, 128)
            scale = b.abs().amax(dim=(1, 3)) / 448
            q = (b / scale.clamp(min=1e-30)[:, None, :, None]).reshape(N, K).to(torch.float8_e4m3fn)
            if lead:
                out.setdefault(k, torch.empty(t.shape, device="cuda", dtype=torch.float8_e4m3fn))[e] = q
                out.setdefault(k + "_scale_inv", torch.empty((lead[0], N // 128, K // 128), device="cuda"))[e] = scale
            else:
                out[k], out[k + "_scale_inv"] = q, scale
    return out


def fp8_decode_weight_bytes(cfg) -> int:
    """the weight bytes a decode token reads from an FP8 layer: e4m3 matrices and their fp32
    scales (attention, and the top-k experts' three), the router and norms in bf16"""
    def matrix(n, k):
        return n * k + -(-n // 128) * -(-k // 128) * 4
    H, I, D = cfg.hidden_size, cfg.moe_intermediate_size, cfg.head_dim
    QD, KVD = cfg.num_attention_heads * D, cfg.num_key_value_heads * D
    attention = matrix(QD, H) + 2 * matrix(KVD, H) + matrix(H, QD)
    experts = cfg.num_experts_per_tok * (2 * matrix(I, H) + matrix(H, I))
    return attention + experts + 2 * (cfg.num_experts * H + 2 * H + 2 * D)


def fp8_decode_rows(rows, weights, copy_tbs, steps, wall) -> None:
    """decode batch 1 at context 8192 on the same weights in FP8 (issue 14's target on an H200:
    <= 75 us a token), plain calls and a CUDA graph; the cache filled through the FP8 layer"""
    cfg = q3.LayerConfig.qwen3_235b_a22b()
    layer = q3.DecoderLayer(cfg, fp8_weights_on_gpu(weights), device="cuda")
    assert layer.weight_format == "fp8_e4m3_block128" and layer.converted == ()
    nbytes = fp8_decode_weight_bytes(cfg) + 8192 * 2048
    decode_rows(rows, layer, "FP8 weights", nbytes, f"target <= 75 us ({nbytes / 1e6:.0f} MB a token)", copy_tbs,
                steps, wall)


def gptq_on_gpu(w):
    """one matrix w [N, K] (on the GPU) as GPTQ tensors, as kernels/int4.h's q3_int4_quantize_rtn
    makes them: round to nearest in groups of 128 inputs, symmetric (fp16 scale 2 amax / 15, zero
    8, stored as 7: "gptq" v1), g_idx k // 128"""
    import torch

    N, K = w.shape
    G = K // 128
    b = w.float().reshape(N, G, 128)
    amax = b.abs().amax(-1)
    scale = (2 * amax.masked_fill(amax == 0, 1.0) / 15).half()
    q = (b / scale.float()[..., None]).round().add(8).clamp(0, 15).to(torch.int64).reshape(N, K)
    shifts = 4 * torch.arange(8, device=w.device, dtype=torch.int64)
    words = (q.t().reshape(K // 8, 8, N) << shifts[None, :, None]).sum(1)  # lowest nibble first
    return {"qweight": (words - (words >= 2**31).long() * 2**32).to(torch.int32),
            "scales": scale.t().contiguous(),
            "qzeros": torch.full((G, N // 8), 0x77777777, device=w.device, dtype=torch.int32),
            "g_idx": (torch.arange(K, device=w.device) // 128).to(torch.int32)}


def int4_weights_on_gpu(weights, device="cuda") -> dict:
    """the layer's bf16 weights quantized on the GPU (`device`) to 4-bit GPTQ tensors
    (gptq_on_gpu), per projection module (the experts per expert, as GPTQ checkpoints hold
    them); norms and the router stay bf16"""
    import torch

    out = {}
    for k, v in weights.items():
        t = torch.from_dlpack(v).to(device)
        if k.startswith("self_attn.") and k.endswith("proj.weight"):
            modules = {k[:-len(".weight")]: t}
        elif k == "mlp.experts.gate_up_proj":  # [E, 2I, H]: gate rows, then up rows
            half = t.shape[1] // 2
            modules = {f"mlp.experts.{e}.{p}": t[e, i * half:(i + 1) * half] for e in range(t.shape[0])
                       for i, p in enumerate(("gate_proj", "up_proj"))}
        elif k == "mlp.experts.down_proj":
            modules = {f"mlp.experts.{e}.down_proj": t[e] for e in range(t.shape[0])}
        else:
            out[k] = t
            continue
        for module, m in modules.items():
            out.update({f"{module}.{n}": packed for n, packed in gptq_on_gpu(m).items()})
    return out


def int4_decode_rows(rows, weights, copy_tbs, steps, wall) -> None:
    """decode batch 1 at context 8192 on the same weights in 4-bit GPTQ (issue 41), plain calls
    and a CUDA graph, with the floor of its bytes (nibbles, fp16 scales, zeros, g_idx: the cost
    model's) at the copy rate; the cache filled through the int4 layer"""
    cfg = q3.LayerConfig.qwen3_235b_a22b()
    layer = q3.DecoderLayer(cfg, int4_weights_on_gpu(weights), device="cuda")
    assert layer.weight_format == "gptq_int4" and layer.converted == ()
    nbytes = decode_weight_bytes(cfg, "bfloat16", "gptq_int4") + 8192 * 2048
    decode_rows(rows, layer, "GPTQ int4 weights", nbytes,
                f"read floor {nbytes / (copy_tbs * 1e12) * 1e6:.0f} us ({nbytes / 1e6:.0f} MB a token)", copy_tbs,
                steps, wall)


def decode_rows(rows, layer, label, nbytes, note, copy_tbs, steps, wall) -> None:
    """decode batch 1 at context 8192 on `layer` (its weights `label`), plain calls and a CUDA
    graph, `nbytes` read a token; the cache filled through the layer"""
    import torch

    ctx = 8192
    cache = layer.new_cache(ctx + steps)
    for t0 in range(0, ctx, 2048):
        layer.prefill(torch.randn(1, 2048, 4096, device="cuda", dtype=torch.bfloat16), cache)
    x = torch.randn(1, 4096, device="cuda", dtype=torch.bfloat16)
    graph = layer.decode_graph(cache)

    def run(step):
        for _ in range(steps):
            step()
        cache.truncate(ctx, 0)

    for name, step in (("plain calls", lambda: layer.decode(x, cache)), ("CUDA graph", lambda: graph(x))):
        t = wall(lambda s=step: run(s), 10) / steps
        rows.append((f"decode batch 1, context {ctx}, {label}, {name}", f"{t * 1e6:.0f} us", "-", "-",
                     f"{nbytes / t / 1e12:.2f} TB/s ({nbytes / t / 1e12 / copy_tbs:.0%} of copy)", note))


def print_moe_path_choice(hf, x) -> None:
    """The prefill MoE path each size class gets by measured speed: a fresh layer's prefill of
    x in one chunk of 8192 tokens, then in chunks of 2048 (one size class each; larger first, so
    that the workspace is allocated once: the choices made carry over a growth anyway) times
    every path the pass can take on its first pass of the class; prints the choice and the
    times."""
    layer = q3.DecoderLayer.from_hf(hf, device="cuda")  # measured: a fresh layer's default
    for chunk in (8192, 2048):
        layer.prefill(x, layer.new_cache(x.shape[0]), chunk_size=chunk)
    print("\nprefill MoE path by measured speed (CUDA events, first pass of each size class):")
    for (lo, hi), (chosen, times) in sorted(q3.cuda.moe_path_choice(layer).items()):
        spread = ", ".join(f"{path} {ms:.2f} ms" for path, ms in sorted(times.items(), key=lambda t: t[1]))
        print(f"  rows {lo}..{hi}: {chosen} ({spread})")


if __name__ == "__main__":
    raise SystemExit(main())
