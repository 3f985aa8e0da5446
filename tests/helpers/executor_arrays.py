"""Arrays out of the SIMT executor's device for the executor's cases (tests/executor/, run in a
process of their own): a tensor as float64 numpy, a strided device view read in place, the
relative error they are compared by, the errors a list of calls raised, and whether the CPU
layer here rounds activations as the tensor cores do."""
import ctypes

import numpy as np
import torch

from qwen3layer import _C


def host(t):
    """a tensor of the extension (host or emulated device) as a float64 numpy array"""
    return torch.from_dlpack(_C.copy_tensor(t, -1) if t.device != "cpu" else t).double().numpy()


def executor_view(t):
    """A strided view on the executor's device (cache keys: [kv_heads, length, head_dim] with a
    stride of the capacity), read in place: the executor's device memory is host memory, and
    copy_tensor takes contiguous tensors only"""
    span = 1 + sum((n - 1) * s for n, s in zip(t.shape, t.strides))
    size = 4 if t.dtype == "float32" else 2
    raw = np.frombuffer((ctypes.c_char * (span * size)).from_address(t.data_ptr), np.uint32 if size == 4 else np.uint16)
    v = np.lib.stride_tricks.as_strided(raw, t.shape, [s * size for s in t.strides])
    return (v if size == 4 else v.astype(np.uint32) << 16).view(np.float32).astype(np.float64)


def rel(a, b):
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


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
