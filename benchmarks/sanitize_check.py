"""Every CUDA kernel once, small, for a memory checker (gpu_check.sh runs this under
compute-sanitizer --tool memcheck): the kernel self-check, then tiny layers through
prefill (whole and chunked, the tensor-core attention and grouped MoE geometry and one they
do not take), plain decode and CUDA-graph decode steps, the prefill and a decode step asking
for the layer's insides (router outputs, attention maps). Prints one line per part."""
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import qwen3layer as q3  # noqa: E402

bad = [r["case"] for r in q3.cuda.check_kernels(0) if not r["ok"]]
print("kernel self-check:", "all cases within tolerance" if not bad else f"out of tolerance: {bad}", flush=True)
GEOMETRIES = {
    "tensor-core paths": q3.LayerConfig(hidden_size=256, num_attention_heads=8, num_key_value_heads=2, head_dim=64,
                                        num_experts=8, num_experts_per_tok=2, moe_intermediate_size=64),
    "GEMV and scalar paths": q3.LayerConfig(hidden_size=64, num_attention_heads=8, num_key_value_heads=2,
                                            head_dim=24, num_experts=8, num_experts_per_tok=2,
                                            moe_intermediate_size=48),
}
for name, cfg in GEOMETRIES.items():
    for dtype in ("bfloat16", "float32"):
        layer = q3.DecoderLayer.random(cfg, seed=1, dtype=dtype, device="cuda")
        cache = layer.new_cache(64, batch=2)
        cache.set_padding(3, 1)
        # the layer's insides too: the router's rows copied out, the maps' kernel pass by pass
        layer.prefill(layer.random_input((2, 40, cfg.hidden_size), 2), cache, chunk_size=24, return_router=True,
                      return_attention=True)
        for i in range(2):
            layer.decode(layer.random_input((2, cfg.hidden_size), 3 + i), cache, return_router=i == 1,
                         return_attention=i == 1)
        graph = layer.decode_graph(cache)
        for i in range(3):
            graph()
        q3.cuda.synchronize(0)
        print(f"{name}, {dtype}: prefill, decode and graph steps ran; lengths {cache.lengths}", flush=True)
