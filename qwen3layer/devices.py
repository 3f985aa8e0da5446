"""Where a layer and its tensors live: a `device` argument read as the engine's index (-1 the
host, N the CUDA device N), and a torch tensor's device held against its layer's before torch
is asked for anything about CUDA (a CPU-only torch answers any such question with its own
AssertionError: "Torch not compiled with CUDA enabled")."""
from __future__ import annotations

import sys
from typing import Any, Optional

from . import cuda


def device_index(device: Any) -> int:
    """'cpu' -> -1; 'cuda' or 'cuda:N' -> N, once the CUDA backend is loaded and sees that device."""
    name = str(device)
    if name == "cpu":
        return -1
    kind, _, index = name.partition(":")
    if kind != "cuda" or (index and not index.isdigit()):
        raise ValueError(f"device: expected 'cpu', 'cuda' or 'cuda:N', got {name!r}")
    count = cuda.device_count()
    if count == 0 and not cuda.built():
        raise ValueError(f"device: {name!r}: this build has no CUDA backend (nvcc was not found when it was "
                         "built); expected 'cpu'")
    if count == 0:
        raise ValueError(cuda._no_device(f"device: {name!r}", "'cpu'"))
    n = int(index or 0)
    if n >= count:
        raise ValueError(f"device: {name!r}: expected a CUDA device index below {count} "
                         f"(the CUDA devices this machine has), got {n}")
    return n


def is_torch(x: Any) -> bool:
    return type(x).__module__.partition(".")[0] == "torch"


def check_torch_device(name: str, x: Any, device: int) -> None:
    """ValueError naming `name` and both devices where x, a torch tensor, is not on the layer's
    device `device` (or is a torch CUDA tensor, device memory, for the SIMT executor's device,
    whose tensors are host memory); other kinds of tensor the engine checks itself"""
    if x is None or not is_torch(x):
        return
    want = "cpu" if device < 0 else f"cuda:{device}"
    on = x.device  # a torch.device: reading it asks torch nothing about CUDA
    if device >= 0 and cuda.emulated():
        raise ValueError(f"{name}: expected a tensor on {want}, the SIMT executor's (q3.cuda.emulate()), whose "
                         f"tensors are host memory, got a torch tensor on {on}: pass qwen3layer.cuda.to_device({name}) "
                         "(a copy there), and read an output back with qwen3layer.cuda.to_host(y)")
    if on.type != ("cpu" if device < 0 else "cuda") or (device >= 0 and on.index != device):
        raise ValueError(f"{name}: expected a tensor on {want} (the layer's device), got a torch tensor on {on}")


def stream_of(x: Any, device: int, name: str = "x") -> Optional[int]:
    """The caller's current CUDA stream, for a CUDA layer called with torch tensors (None for
    others); x on another device than the layer's is refused first (check_torch_device)."""
    check_torch_device(name, x, device)
    if device < 0 or not is_torch(x):
        return None
    return sys.modules["torch"].cuda.current_stream(device).cuda_stream
