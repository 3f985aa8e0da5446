"""The CUDA path of the engine and the glue (device workspace, host staging, grouping by
expert, cache and outputs on the device, uploads, device checks) run on an emulated device
whose memory is host memory and whose kernels are the CPU twins, against the CPU layer. It
runs everywhere; the .cu kernels themselves are checked against the same twins on a GPU
(test_cuda.py). In a subprocess: the emulated backend is installed process-wide."""
import json
import os
import subprocess
import sys

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")


def test_cuda_path_on_an_emulated_device_matches_the_cpu_layer():
    r = subprocess.run([sys.executable, os.path.join(ROOT, "tests", "cuda_emulated_check.py"), ROOT],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
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
