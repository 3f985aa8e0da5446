"""One GPU and the host: a layer whose attention, router and `gpu_experts` run on a CUDA
device and whose other experts stay in host memory, run by the CPU kernels
(DecoderLayer(..., device="cuda", expert_device="cpu")). Built on the layer's two halves: no
second implementation of either.

A call (prefill, chunked or not, or a decode step):
  1. the device layer's attention half over the call (its passes chunk by chunk);
  2. the router's choices and weights, the normed rows and the residual copied to the host;
     each choice goes to the side holding its expert (-1 on the other);
  3. the device layer's experts on the rows with a device expert, added into the residual
     on the device, queued, while the host layer's experts run on the rows with a host expert
     (one read of each host expert's weights, from host memory);
  4. the residual back on the host, the host experts' sums added in row order
     (_C.combine_rows), the output copied to the device.
The order of every sum is fixed (the device's experts in expert order, then the host's), so a
call gives the same bits from run to run. Device tensors are torch CUDA tensors or, on the SIMT
executor, the extension's own. `stats` counts the rows and choices each side ran.
"""
from __future__ import annotations

from typing import Any, Optional, Sequence

import torch

from . import _C
from .layer import rewind
from .routing import RoutingSummary

STAT_KEYS = ("calls", "device_rows", "device_choices", "host_rows", "host_choices")


def choose_gpu_experts(n: int, counts: Any, num_experts: int) -> list:
    """The n experts most often routed to in a calibration call: counts a RoutingSummary
    (LayerTrace.routing()) or a sequence of num_experts counts; ties to the lower id."""
    got = getattr(counts, "counts", counts)
    if got is None:
        raise ValueError(f"gpu_experts={n}: expected expert_counts (a RoutingSummary or {num_experts} counts of a "
                         "calibration call) to choose them by, got none")
    got = tuple(got)
    if len(got) != num_experts or any(not isinstance(c, int) or isinstance(c, bool) or c < 0 for c in got):
        raise ValueError(f"expert_counts: expected {num_experts} non-negative ints, got {len(got)} values")
    if not isinstance(n, int) or isinstance(n, bool) or not 0 <= n <= num_experts:
        raise ValueError(f"gpu_experts: expected an int in [0, {num_experts}] or a list of expert ids, got {n!r}")
    return sorted(RoutingSummary(got, 1).ranking()[:n])


def _to_host(t: Any) -> torch.Tensor:
    if isinstance(t, torch.Tensor):
        return t.cpu()
    return torch.from_dlpack(_C.copy_tensor(t, -1))


def _to_device(h: torch.Tensor, like: Any, index: int) -> Any:
    """host tensor h on like's device, as like's kind"""
    if isinstance(like, torch.Tensor):
        return h.to(like.device)
    h = h.contiguous()
    raw = h.view(torch.int16) if h.dtype == torch.bfloat16 else h
    name = str(h.dtype).replace("torch.", "")
    return _C.copy_tensor(_C.buffer_view(raw.numpy(), 0, list(h.shape), name), index)


def _rows2d(dev: Any, host: torch.Tensor, index: int) -> Any:
    """dev as [n, last] on the device: a view of a torch tensor, else (an extension tensor of
    more dims, which has no reshape) the host copy uploaded"""
    if isinstance(dev, torch.Tensor):
        return dev.reshape(-1, dev.shape[-1])
    return dev if len(dev.shape) == 2 else _to_device(host.reshape(-1, host.shape[-1]), dev, index)


class HybridRunner:
    """The calls of a split layer: `device` (a CUDA _C.Layer holding gpu_experts) and `host`
    (a CPU _C.Layer holding the others)."""

    def __init__(self, device: Any, host: Any, gpu_experts: Sequence[int], num_experts: int) -> None:
        self.device, self.host = device, host
        self.index = device.device
        mask = torch.zeros(num_experts, dtype=torch.bool)
        mask[list(gpu_experts)] = True
        self.on_gpu = mask
        self.stats = {k: 0 for k in STAT_KEYS}

    def call(self, x: Any, cache: Any, decode: bool, seq: Optional[int] = None, chunk_size: Optional[int] = None,
             **insides: Any) -> tuple:
        """(y on the device, the call's insides from the attention half: (router logits,
        experts, weights, maps) as the extension's tensors, or None when none was asked)"""
        kw = {} if decode else {"seq": seq, "chunk_size": chunk_size}
        # torch tensors: the device's work on the caller's current stream, as DecoderLayer queues it
        stream = torch.cuda.current_stream(self.index).cuda_stream if isinstance(x, torch.Tensor) else None
        lengths = list(cache.lengths)
        try:
            return self._call(x, cache, decode, stream, kw, insides)
        except BaseException:  # nothing half-written: the cache back to where the call began
            rewind(cache, lengths)
            raise

    def _call(self, x: Any, cache: Any, decode: bool, stream: Optional[int], kw: dict, insides: dict) -> tuple:
        r = self.device.attention_half(x, cache, decode=decode, stream=stream, **kw, **insides)
        (resid, normed, ids, w), trace = (r, None) if len(r) == 4 else (r[0], tuple(r[1:]))
        shape = tuple(resid.shape)
        H = shape[-1]
        ids_h, w_h = _to_host(ids).reshape(-1, ids.shape[-1]), _to_host(w).reshape(-1, ids.shape[-1])
        normed_h, resid_h = _to_host(normed).reshape(-1, H), _to_host(resid).reshape(-1, H)
        gpu = self.on_gpu[ids_h.long()]
        none = torch.full_like(ids_h, -1)
        gpu_ids, host_ids = torch.where(gpu, ids_h, none), torch.where(gpu, none, ids_h)
        dev_rows = gpu.any(1)
        host_rows = (~gpu).any(1).nonzero()[:, 0]
        st = self.stats
        st["calls"] += 1
        st["device_rows"] += int(dev_rows.sum())
        st["device_choices"] += int(gpu.sum())
        st["host_rows"] += len(host_rows)
        st["host_choices"] += int((~gpu).sum())
        total, on_device = resid_h, bool(dev_rows.any())
        if on_device:  # queued on the device; the host's experts run meanwhile
            acc = _rows2d(resid, resid_h, self.index)
            self.device.expert_half(_rows2d(normed, normed_h, self.index), _to_device(gpu_ids, ids, self.index),
                                    _rows2d(w, w_h, self.index), out=acc, accumulate=True, stream=stream)
        part = None
        if len(host_rows):
            part = torch.empty(len(host_rows), H)
            self.host.expert_half(normed_h[host_rows], host_ids[host_rows].contiguous(),
                                  w_h[host_rows].contiguous(), out=part)
        if on_device:
            total = _to_host(acc).reshape(-1, H)
        y_h = torch.empty(total.shape, dtype=normed_h.dtype)
        if part is None:
            y_h.copy_(total)
        else:
            _C.combine_rows(total, part, host_rows.to(torch.int32), y_h)
        return _to_device(y_h.reshape(shape), x, self.index), trace
