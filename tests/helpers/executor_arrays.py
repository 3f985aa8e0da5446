"""Arrays out of the SIMT executor's device for the executor's cases (tests/executor/, run in a
process of their own): a tensor as float64 numpy, a strided device view read in place, the
relative error they are compared by, the calls that compare an emulated layer with a CPU layer
on the same weights, the errors a list of calls raised, and whether the CPU layer here rounds
activations as the tensor cores do."""
import ctypes

import numpy as np
import torch

from qwen3layer import _C


def host(t):
    """a tensor of the extension (host or emulated device) as a float64 numpy array"""
    return torch.from_dlpack(_C.copy_tensor(t, -1) if t.device != "cpu" else t).double().numpy()


def executor_view(t):
    """A strided view on the executor's device (cache keys: [kv_heads, length, head_dim] with a
    stride of the capacity; float32, bfloat16 or float16), read in place: the executor's device
    memory is host memory, and copy_tensor takes contiguous tensors only"""
    span = 1 + sum((n - 1) * s for n, s in zip(t.shape, t.strides))
    size = 4 if t.dtype == "float32" else 2
    raw = np.frombuffer((ctypes.c_char * (span * size)).from_address(t.data_ptr), np.uint32 if size == 4 else np.uint16)
    v = np.lib.stride_tricks.as_strided(raw, t.shape, [s * size for s in t.strides])
    if t.dtype == "float16":
        return v.view(np.float16).astype(np.float64)
    return (v if size == 4 else v.astype(np.uint32) << 16).view(np.float32).astype(np.float64)


def rel(a, b):
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


def compare_layers(cpu, gpu, H, dtype, seed, chunks=(5, 16, None)):
    """(the relative errors, whether the cache lengths agree) of an emulated layer's calls against
    the CPU layer's (_C.Layer both, on the same weights): per chunk size, a prefill of 2
    sequences of 40 tokens in chunks of it, two decode steps of both sequences, and after the
    last chunk size two replays of a decode graph; then a prompt of 7 tokens and two decode
    steps of batch 1. Inputs drawn from seed."""
    errs, lengths = [], True
    for i, chunk in enumerate(chunks):
        x = _C.random_tensor((2, 40, H), seed + 1, dtype)
        cc, cg = cpu.new_cache(48, 2), gpu.new_cache(48, 2)
        errs.append(rel(host(gpu.prefill(_C.copy_tensor(x, 0), cg, None, chunk)), host(cpu.prefill(x, cc, None, chunk))))
        for t in range(2):  # decode steps of both sequences
            s = _C.random_tensor((2, H), seed + 10 + t, dtype)
            errs.append(rel(host(gpu.decode(_C.copy_tensor(s, 0), cg)), host(cpu.decode(s, cc))))
        if i == len(chunks) - 1:  # two replays of a decode graph (capture refuses anything that needs the host)
            graph = gpu.decode_graph(cg)
            for t in range(2):
                s = _C.random_tensor((2, H), seed + 15 + t, dtype)
                errs.append(rel(host(graph.replay(_C.copy_tensor(s, 0))), host(cpu.decode(s, cc))))
            del graph
        lengths &= list(cg.lengths) == list(cc.lengths)
    cc, cg = cpu.new_cache(16, 1), gpu.new_cache(16, 1)  # batch 1: a prompt of 7, two decode steps
    x = _C.random_tensor((1, 7, H), seed + 2, dtype)
    errs.append(rel(host(gpu.prefill(_C.copy_tensor(x, 0), cg)), host(cpu.prefill(x, cc))))
    for t in range(2):
        s = _C.random_tensor((1, H), seed + 20 + t, dtype)
        errs.append(rel(host(gpu.decode(_C.copy_tensor(s, 0), cg)), host(cpu.decode(s, cc))))
    lengths &= list(cg.lengths) == list(cc.lengths)
    return errs, lengths


def errors_of(calls):
    """'Type: message' of what each call raised ('accepted' if it did not)"""
    found = []
    for call in calls:
        try:
            call()
            found.append("accepted")
        except Exception as e:  # noqa: BLE001 - the message is what is checked
            found.append(f"{type(e).__name__}: {e}")
    return found


def cpu_rounds_like_tensor_cores() -> bool:
    """whether the CPU layer's path here is a bf16 one (avx512bf16, amx), which rounds a matmul's
    activations to bf16 as the tensor cores do (the fp32 paths keep them in fp32)"""
    import qwen3layer as q3

    return q3.build_info()["cpu_path"] in ("avx512bf16", "amx")
