"""What an emulated CUDA layer (q3.cuda.emulate(): the SIMT executor is cuda:0, its memory the
host's) takes, in a subprocess of its own (conftest.py): a torch tensor, which torch cannot see
as the executor's memory, is refused by the layer, naming the argument and both devices, before
torch is asked anything (a CPU-only torch would raise its own AssertionError); host data goes in
with q3.cuda.to_device and comes back with q3.cuda.to_host, and gives the CPU layer's output;
random_input makes the same draws on the device as on the host."""
import pytest
import torch

import qwen3layer as q3
from executor_arrays import host, rel
from qwen3layer import _C

pytestmark = pytest.mark.executor_subprocess
TIMEOUT = 300
CFG = q3.LayerConfig.tiny()
H = CFG.hidden_size
REFUSED = ("{name}: expected a tensor on cuda:0, the SIMT executor's (q3.cuda.emulate()), whose tensors are host "
           "memory, got a torch tensor on cpu: pass qwen3layer.cuda.to_device({name}) (a copy there), and read an "
           "output back with qwen3layer.cuda.to_host(y)")


@pytest.fixture(scope="module")
def layers():
    gpu = q3.DecoderLayer.random(CFG, seed=3, dtype="float32", device="cuda")
    cpu = q3.DecoderLayer.random(CFG, seed=3, dtype="float32")
    return gpu, cpu


def torch_calls(layer):
    """(argument, call) of every way a torch host tensor can reach the emulated layer"""
    cache = layer.new_cache(8)
    x = layer.random_input((1, H), 1)
    ids, weights = q3.cuda.to_device(torch.zeros(1, 2, dtype=torch.int32)), layer.random_input((1, 2), 2)
    graph = layer.decode_graph(layer.new_cache(4))
    split = q3.DecoderLayer.random(CFG, seed=3, dtype="float32", device="cuda", expert_device="cpu", gpu_experts=[0])
    t = torch.zeros(1, H)
    return [("x", lambda: layer.prefill(t, cache)),
            ("x", lambda: layer.decode(t, cache)),
            ("out", lambda: layer.decode(x, cache, out=torch.zeros(1, H))),
            ("out", lambda: layer.prefill(x, cache, out=torch.zeros(1, H))),
            ("x", lambda: layer.attention_half(t, cache)),
            ("rows", lambda: layer.expert_half(t, ids, weights)),
            ("experts", lambda: layer.expert_half(x, torch.zeros(1, 2, dtype=torch.int32), weights)),
            ("weights", lambda: layer.expert_half(x, ids, torch.ones(1, 2))),
            ("x", lambda: graph(t)),
            ("x", lambda: split.decode(t, split.new_cache(4)))]


def test_a_torch_tensor_is_refused_by_the_layer_naming_the_argument_and_both_devices(layers):
    gpu, _ = layers
    for name, call in torch_calls(gpu):
        with pytest.raises(ValueError) as e:
            call()
        assert str(e.value) == REFUSED.format(name=name)


def test_host_data_through_to_device_and_to_host_gives_the_cpu_layers_output(layers):
    gpu, cpu = layers
    x = torch.randn(5, H, generator=torch.Generator().manual_seed(4))
    dev = q3.cuda.to_device(x)
    assert (dev.device, dev.shape, dev.dtype) == ("cuda:0", (5, H), "float32")
    y = gpu.prefill(dev, gpu.new_cache(8))
    assert y.device == "cuda:0"
    theirs = cpu.prefill(x, cpu.new_cache(8)).numpy()
    assert rel(torch.from_dlpack(q3.cuda.to_host(y)).double().numpy(), theirs) < 1e-5
    # int32 expert ids and fp32 weights of the caller's own, for the expert half
    ids, w = torch.tensor([[0, 3], [5, -1]], dtype=torch.int32), torch.tensor([[0.7, 0.3], [1.0, 0.0]])
    mine = gpu.expert_half(q3.cuda.to_device(x[:2]), q3.cuda.to_device(ids), q3.cuda.to_device(w))
    assert rel(host(mine), cpu.expert_half(x[:2], ids, w).double().numpy()) < 1e-5


def test_random_input_draws_on_the_device_what_it_draws_on_the_host(layers):
    gpu, cpu = layers
    d, h = gpu.random_input((3, H), 7), cpu.random_input((3, H), 7)
    assert d.device == "cuda:0" and h.device == "cpu"
    assert torch.equal(torch.from_dlpack(q3.cuda.to_host(d)), torch.from_dlpack(h))


def test_to_device_and_to_host_refuse_what_they_cannot_copy():
    cases = [(lambda: q3.cuda.to_device(torch.zeros(2, dtype=torch.int64)), TypeError,
              "tensor: expected dtype float32, bfloat16, float16, float8_e4m3fn or int32, got int64"),
             (lambda: q3.cuda.to_device([1.0]), TypeError,
              "tensor: expected a qwen3layer Tensor or a host tensor with __dlpack__ (torch, numpy), got list"),
             (lambda: q3.cuda.to_device(torch.zeros(4, 4)[:, ::2]), ValueError,
              "tensor: expected a contiguous tensor, got strides [4, 2] (call .contiguous())"),
             (lambda: q3.cuda.to_device(torch.zeros(2), 1), ValueError,
              "qwen3layer.cuda.to_device(device=1): device: expected a CUDA device index below 1 (the CUDA devices "
              "this machine has), got 1"),
             (lambda: q3.cuda.to_host(torch.zeros(2)), ValueError,
              "tensor: expected a qwen3layer Tensor on a CUDA device, got tensor([0., 0.])"),
             (lambda: q3.cuda.to_host(_C.random_tensor((2,), 0, "float32")), ValueError,
              "tensor: expected a qwen3layer Tensor on a CUDA device, got qwen3layer.Tensor(shape=[2], "
              "dtype=float32, device=cpu)")]
    for call, kind, message in cases:
        with pytest.raises(kind) as e:
            call()
        assert str(e.value) == message


def test_another_backend_is_refused_saying_how_to_get_it(tmp_path):
    other = str(tmp_path / "libother.so")
    with pytest.raises(RuntimeError) as e:
        q3.cuda.emulate(other)
    assert str(e.value) == (f"cuda: {q3.cuda.SIMT_LIBRARY} is the CUDA backend of this process already; cannot also "
                            f"open {other} (one backend a process: call qwen3layer.cuda.emulate() before any CUDA "
                            "device is used, or in a new process)")
