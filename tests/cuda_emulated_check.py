"""Run by test_cuda_emulated.py in a fresh process: the CUDA path of the engine and glue on
an emulated device (host memory, CPU kernels), against the CPU layer. Prints a JSON dict."""
import json
import sys

import numpy as np
import torch

sys.path.insert(0, sys.argv[1])
import qwen3layer as q3  # noqa: E402
from qwen3layer import _C  # noqa: E402

_C.cuda_emulate()
CFG = q3.LayerConfig(hidden_size=64, num_attention_heads=8, num_key_value_heads=2, head_dim=24,
                     num_experts=8, num_experts_per_tok=2, moe_intermediate_size=48)


def host(t):
    return torch.from_dlpack(_C.copy_tensor(t, -1) if t.device != "cpu" else t).double().numpy()


def rel(a, b):
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


out = {}
for dtype in ("float32", "bfloat16"):
    w = _C.random_weights(CFG, 3, dtype)
    cpu, gpu = _C.Layer(CFG, w, None, -1), _C.Layer(CFG, w, None, 0)
    out[f"{dtype} uploaded"] = len(gpu.converted)
    x = _C.random_tensor((2, 21, 64), 4, dtype)
    cc, cg = cpu.new_cache(32, 2), gpu.new_cache(32, 2)
    errs = [rel(host(gpu.prefill(_C.copy_tensor(x, 0), cg, None, 8)), host(cpu.prefill(x, cc, None, 8)))]
    for t in range(3):
        s = _C.random_tensor((2, 64), 10 + t, dtype)
        errs.append(rel(host(gpu.decode(_C.copy_tensor(s, 0), cg)), host(cpu.decode(s, cc))))
    out[f"{dtype} max rel err"] = max(errs)
    out[f"{dtype} lengths"] = [list(cg.lengths), list(cc.lengths)]
    out[f"{dtype} output device"] = str(gpu.decode(_C.copy_tensor(s, 0), cg).device)

# weights already on the device are borrowed
w_dev = {k: _C.copy_tensor(v, 0) for k, v in _C.random_weights(CFG, 5, "bfloat16").items()}
layer = _C.Layer(CFG, w_dev, None, 0)
out["device weights borrowed"] = layer.converted == () and all(
    layer.weight_ptrs[k] == v.data_ptr for k, v in w_dev.items())

# rejected calls leave the cache as it was
cache = layer.new_cache(8)
errors = []
for bad in (lambda: layer.prefill(_C.random_tensor((2, 64), 1, "bfloat16"), cache),
            lambda: layer.prefill(_C.copy_tensor(_C.random_tensor((9, 64), 1, "bfloat16"), 0), cache),
            lambda: layer.prefill(_C.copy_tensor(_C.random_tensor((2, 64), 1, "bfloat16"), 0),
                                  _C.Layer(CFG, w, None, -1).new_cache(8))):
    try:
        bad()
        errors.append("accepted")
    except Exception as e:  # noqa: BLE001 - the message is what is checked
        errors.append(f"{type(e).__name__}: {e}")
out["errors"] = errors
out["lengths after errors"] = list(cache.lengths)

# per-stage timing on the device path (events; host clock when emulated)
emulated = q3.DecoderLayer.random(CFG, seed=2, dtype="bfloat16", device="cuda")
profiles = [emulated.profile("prefill", tokens=40, chunk_size=16, repeat=1),
            emulated.profile("decode", tokens=2, context=20, repeat=1)]
out["profile stages"] = [[s.name for s in p.stages] for p in profiles]
out["device workspace"] = emulated.workspace_bytes
out["random input device"] = str(emulated.random_input((2, 64), 1).device)
out["profile seconds"] = [[s.seconds for s in p.stages] for p in profiles]
print(json.dumps(out))
