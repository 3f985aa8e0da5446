"""The CUDA backend: built wherever nvcc is, loadable without a GPU, and on a GPU every
kernel matches its CPU twin. GPU tests skip, saying why, on machines without a CUDA device."""
import os
import shutil

import pytest

import qwen3layer as q3

NVCC = shutil.which("nvcc") or (os.path.exists("/usr/local/cuda/bin/nvcc") and "/usr/local/cuda/bin/nvcc")


@pytest.mark.skipif(not NVCC, reason="nvcc is not installed: this build is CPU-only by design")
def test_cuda_backend_is_built_and_loads_without_a_gpu():
    assert q3.cuda.built()
    assert "cuda" in q3.build_info()["backends"]
    assert q3.cuda.device_count() >= 0  # the library opens even where no driver or GPU is


def test_layer_refuses_cuda_device_clearly():
    cfg = q3.LayerConfig.tiny()
    with pytest.raises(ValueError, match="device: 'cuda:0'"):
        q3.DecoderLayer.random(cfg, device="cuda:0")
    with pytest.raises(ValueError, match="device: expected 'cpu' .*got 'tpu'"):
        q3.DecoderLayer.random(cfg, device="tpu")


HAS_GPU = q3.cuda.built() and q3.cuda.device_count() > 0


@pytest.mark.skipif(not HAS_GPU, reason="no CUDA device on this machine (the kernels are checked by "
                                        "benchmarks/gpu_check.sh where one is lent)")
def test_every_cuda_kernel_matches_its_cpu_twin():
    results = q3.cuda.check_kernels(0)
    assert len(results) >= 13
    bad = [r for r in results if not r["ok"]]
    assert not bad, bad
