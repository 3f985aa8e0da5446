"""One GPU and the host: a layer whose attention, router and `gpu_experts` run on a CUDA
device and whose other experts stay in host memory, run by the CPU kernels
(DecoderLayer(..., device="cuda", expert_device="cpu")). Built on the layer's two halves: no
second implementation of either.

A call (a decode step, or a prefill pass by pass: chunk_size tokens of each sequence a pass,
over the device layer's attention passes, which check the whole call first, so that each side
holds a pass's activations, not the call's; qwen3layer.placement.passes runs them, and a
failure in any pass aborts the call, the cache rolled back by the engine):
  1. the device layer's attention pass;
  2. the router's choices copied to the host; each goes to the side holding its expert (-1
     on the other);
  3. on the device, the rows with a host expert taken out (_C.take_rows: their normed input
     and router weights) and copied to the host (pinned buffers, an async copy, for torch
     tensors); the device layer's experts queued on the rows with a device expert, added into
     the residual there, while the host layer's experts run on the rows taken (each host
     expert's weights read once a pass, from host memory);
  4. the host sums copied back and added into the residual on the device, in row order
     (_C.combine_rows), which writes the output there.
Only the rows that chose a host expert cross, each way. The order of every sum is fixed (the
device's experts in expert order, then the host's), so a call gives the same bits from run to
run. Device tensors are torch CUDA tensors or, on the SIMT executor, the extension's own.
`stats` counts the calls, the passes (and the most token rows one held), the rows and choices
each side ran and the bytes each way over the link (qwen3layer.analysis.costs_hybrid.link_bytes
models them, pass by pass).
"""
from __future__ import annotations

import math
import time
from typing import Any, Optional, Sequence

import torch

from .. import _C, cuda
from ..analysis.routing import RoutingSummary
from ..config import LayerConfig
from .passes import run_passes

STAT_KEYS = ("calls", "passes", "largest_pass_rows", "device_rows", "device_choices", "host_rows", "host_choices", "link_down_bytes",
             "link_up_bytes")


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


class _Link:
    """The copies between the device and the host, counted (stats' link_*_bytes). Torch
    tensors go through pinned host buffers kept from call to call (grown, never shrunk): down
    as async copies ended by one event, up as async copies on the stream (a buffer is written
    again only in a later call, after that call's first copy down, which the stream orders after
    them). The executor's tensors are copied as they are asked for."""

    def __init__(self, index: int, stats: dict) -> None:
        self.index, self.stats = index, stats
        self.pinned: dict = {}
        self.event: Any = None

    def _buffer(self, key: str, shape: Sequence[int], dtype: torch.dtype) -> torch.Tensor:
        n = math.prod(shape)
        got = self.pinned.get((key, dtype))
        if got is None or got.numel() < n:
            got = torch.empty(max(n, 1), dtype=dtype, pin_memory=True)
            self.pinned[(key, dtype)] = got
        return got[:n].view(tuple(shape))

    def down(self, t: Any, key: str, wait: bool = True) -> torch.Tensor:
        """t on the host; wait=False: the copy queued (torch tensors), ended by wait_down()"""
        self.stats["link_down_bytes"] += _bytes(t)
        if not isinstance(t, torch.Tensor):
            return _host(t)
        if wait:
            return t.cpu()
        h = self._buffer(key, t.shape, t.dtype)
        h.copy_(t, non_blocking=True)
        self.event = torch.cuda.Event()
        self.event.record(torch.cuda.current_stream(t.device))
        return h

    def wait_down(self) -> None:
        if self.event is not None:
            self.event.synchronize()
            self.event = None

    def host(self, key: str, shape: tuple, like: Any) -> torch.Tensor:
        """a host fp32 tensor to fill and send up under `key` (pinned for torch tensors)"""
        return self._buffer(key, shape, torch.float32) if isinstance(like, torch.Tensor) else torch.empty(shape)

    def up(self, h: torch.Tensor, like: Any, key: str) -> Any:
        """host tensor h on like's device, as like's kind"""
        self.stats["link_up_bytes"] += h.numel() * h.element_size()
        if not isinstance(like, torch.Tensor):
            return _to_device(h, like, self.index)
        p = self._buffer(key, h.shape, h.dtype)
        if p.data_ptr() != h.data_ptr():
            p.copy_(h)
        return p.to(like.device, non_blocking=True)


def _bytes(t: Any) -> int:
    return math.prod(t.shape) * (t.element_size() if isinstance(t, torch.Tensor) else {"float32": 4, "bfloat16": 2, "float16": 2, "int32": 4}[
        str(t.dtype).replace("torch.", "")])


def _to_device(h: torch.Tensor, like: Any, index: int) -> Any:
    """host tensor h on like's device, as like's kind"""
    if isinstance(like, torch.Tensor):
        return h.to(like.device)
    h = h.contiguous()
    raw = h.view(torch.int16) if h.dtype == torch.bfloat16 else h
    name = str(h.dtype).replace("torch.", "")
    return _C.copy_tensor(_C.buffer_view(raw.numpy(), 0, list(h.shape), name), index)


class HybridRunner:
    """The calls of a split layer: `device` (a CUDA _C.Layer holding gpu_experts) and `host`
    (a CPU _C.Layer holding the others)."""

    def __init__(self, device: Any, host: Any, gpu_experts: Sequence[int], config: LayerConfig) -> None:
        self.device, self.host, self.config = device, host, config
        self.index = device.device
        mask = torch.zeros(config.num_experts, dtype=torch.bool)
        mask[list(gpu_experts)] = True
        self.on_gpu = mask
        self.stats = {k: 0 for k in STAT_KEYS}
        self.link = _Link(self.index, self.stats)

    def call(self, x: Any, cache: Any, decode: bool, seq: Optional[int] = None, chunk_size: Optional[int] = None,
             out: Any = None, **insides: Any) -> tuple:
        """(y on the device, the call's insides: the engine's (router logits, experts, weights,
        maps), or None when none was asked); y is `out` (a contiguous torch tensor of x's shape
        and dtype) when given. The device layer's attention passes (the whole call checked once,
        qwen3layer.placement.passes.run_passes), each pass's experts on both sides before the
        next: the device and the host hold a pass's activations, never the call's."""
        on_torch = isinstance(x, torch.Tensor)
        # torch tensors: the device's work on the caller's current stream, as DecoderLayer queues it
        stream = torch.cuda.current_stream(self.index).cuda_stream if on_torch else None
        kw = {} if decode else {"seq": seq, "chunk_size": chunk_size}
        passes = self.device.attention_passes(x, cache, decode=decode, stream=stream, **kw, **insides)
        self.stats["calls"] += 1
        if on_torch:
            y = out if isinstance(out, torch.Tensor) and out.is_contiguous() else _empty_like(x, self.index)
        else:  # the executor's tensors have no views: a call of passes is put together on the host
            y = None if passes.passes == 1 else torch.empty(tuple(x.shape), dtype=getattr(torch, str(x.dtype)))
        last: list = []

        def experts(halves: tuple, into: Any) -> Any:
            y_p = self._experts(halves, on_torch, stream, into if on_torch else None)  # y on the host: not `into`
            if y is None:
                last.append(y_p)
            return y_p if on_torch or y is None else _host(y_p)

        trace = run_passes(passes, y, experts, decode=decode)
        if y is None:
            return last[0], trace
        return (y if on_torch else _to_device(y, x, self.index)), trace

    def device_input(self, t: Any) -> Any:
        """an extension tensor made on the device (random_input) as the calls of users take
        it: a torch CUDA tensor (zero-copy) where torch has CUDA, so that the pinned async
        copies run; on the SIMT executor (host memory), itself"""
        return torch.from_dlpack(t) if torch.cuda.is_available() and not cuda.emulated() else t

    def synchronize(self) -> None:
        """waits for all the device's queued work, torch's streams included (a call on torch
        tensors returns before its combine has run)"""
        _C.cuda_synchronize(self.index)

    def profiled(self, call: Any) -> dict:
        """stage -> seconds of call() (DecoderLayer.profile's) with both sides profiling: the
        device layer's stages, its experts as gpu_experts (CUDA events); the host layer's
        experts and conversions as host_experts (its clock); link, the rest of the call's time
        (the copies, takes, combine and the Python between them). Each side's timing waits for
        its own work, so here the two sides' experts run one after the other."""
        self.device.set_profiling(True)
        self.host.set_profiling(True)
        try:
            t = time.perf_counter()
            call()
            wall = time.perf_counter() - t
            seconds, host = self.device.profile_seconds(), self.host.profile_seconds()
        finally:
            self.device.set_profiling(False)
            self.host.set_profiling(False)
        seconds["gpu_experts"] = seconds.pop("experts")
        seconds["host_experts"] = host["experts"] + host["io"]
        seconds["link"] = max(0.0, wall - sum(seconds.values()))
        return seconds

    def _experts(self, halves: tuple, on_torch: bool, stream: Optional[int], into: Any) -> Any:
        """one pass's experts on both sides and the combine: the pass's output rows (into, when
        given: a contiguous torch view of the call's output)"""
        resid, normed, ids, w = (torch.from_dlpack(t) for t in halves) if on_torch else halves
        H, k, link = resid.shape[-1], ids.shape[-1], self.link
        ids_h = link.down(ids, "ids").reshape(-1, k)
        gpu = self.on_gpu[ids_h.long()]
        none = torch.full_like(ids_h, -1)
        dev_rows = gpu.any(1)
        host_rows = (~gpu).any(1).nonzero()[:, 0].to(torch.int32)
        n, on_device = len(host_rows), bool(dev_rows.any())
        st = self.stats
        st["passes"] += 1
        st["largest_pass_rows"] = max(st["largest_pass_rows"], ids_h.shape[0])
        st["device_rows"] += int(dev_rows.sum())
        st["device_choices"] += int(gpu.sum())
        st["host_rows"] += n
        st["host_choices"] += int((~gpu).sum())
        place = {"device": self.index, "stream": stream}
        rows_d = link.up(host_rows, ids, "rows")
        if n:  # the rows with a host expert, taken out on the device (each take reads rows_d back
            # and waits for the stream: both before the copies down are queued), then copied down
            taken = _take(normed, rows_d, n, place), _take(w, rows_d, n, place)
            normed_h, w_h = (link.down(t, key, wait=False) for t, key in zip(taken, ("normed", "weights")))
        if on_device:  # queued on the device; the host's experts run meanwhile
            self.device.expert_half(normed, link.up(torch.where(gpu, ids_h, none), ids, "gpu_ids"), w, out=resid,
                                    accumulate=True, stream=stream)
        part = link.host("part", (n, H), resid)
        if n:
            link.wait_down()
            self.host.expert_half(normed_h, torch.where(gpu, none, ids_h)[host_rows.long()].contiguous(), w_h,
                                  out=part)
        y = into if into is not None else _empty_like(normed, self.index)  # the pass's x's shape and dtype
        _C.combine_rows(resid, link.up(part, resid, "part"), rows_d, out=y, **place)
        return y


def _host(t: Any) -> torch.Tensor:
    """an executor's tensor copied to the host, as a torch tensor"""
    return torch.from_dlpack(_C.copy_tensor(t, -1))


def _take(src: Any, rows: Any, n: int, place: dict) -> Any:
    """src's rows `rows` on its device, as src's kind"""
    if isinstance(src, torch.Tensor):
        out = torch.empty(n, src.shape[-1], dtype=src.dtype, device=src.device)
        return _C.take_rows(src, rows, out=out, **place)
    return _C.take_rows(src, rows, **place)


def _empty_like(x: Any, index: int) -> Any:
    """a new tensor of x's shape and dtype on device `index` (the executor's: a host one copied there)"""
    if isinstance(x, torch.Tensor):
        return torch.empty_like(x, memory_format=torch.contiguous_format)
    return _to_device(torch.empty(tuple(x.shape), dtype=getattr(torch, str(x.dtype))), x, index)
