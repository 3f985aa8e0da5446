"""The layer's two halves (attention_half, expert_half) and layers holding a subset of the
experts on a CUDA layer on the SIMT executor (issue 24, requirement 1), against the CPU
layer's halves on the same weights and inputs; in a subprocess of its own (conftest.py).

The attention half: 2 sequences, the second with 3 tokens of left padding, a prefill of 7
tokens in chunks of 3, a one-sequence prefill of 2 tokens, and two decode steps. The expert
half: rows of 5 (grouped on the device, as a decode pass groups them) and 70 (on the host,
as a prefill pass), with entries of -1 (skipped: their weights NaN, so a skipped entry
computed shows), accumulating into out or not. Then the halves against the CUDA layer's own
prefill and decode, two layers of disjoint experts against the whole layer, and what is
refused. Device tensors are made and reshaped by DLPack producers over executor device
memory, which is host memory there."""
import ctypes

import numpy as np
import pytest
import torch

import qwen3layer as q3
from dlpack_ctypes import DELETER, DLDataType, DLDevice, DLManagedTensor, DLTensor, capsule_new
from executor_arrays import errors_of, host, rel
from qwen3layer import _C

pytestmark = pytest.mark.executor_subprocess
TIMEOUT = 600
CFG = q3.LayerConfig(hidden_size=64, num_attention_heads=8, num_key_value_heads=2, head_dim=24,
                     num_experts=8, num_experts_per_tok=2, moe_intermediate_size=48)
H, K, E = 64, 2, 8
PAD = 3
# the CPU's bf16 paths round activations to bf16 before their dot products, the CUDA path does
# not (test_cuda_executor_insides.py's tolerances); fp16 is summed in fp32 on both, its outputs
# an fp16 ulp (2^-11) apart where the two sums round to either side of a rounding boundary
TOL = {"float32": 1e-5, "bfloat16": 5e-3, "float16": 1e-3}
# logits closer than this (relative to the row's largest) may order differently on the devices
MARGIN = {"float32": 1e-4, "bfloat16": 2e-2, "float16": 2e-3}
_DL = {"float32": (2, 32), "bfloat16": (4, 16), "float16": (2, 16), "int32": (0, 32)}  # (DLPack type code, bits)
_TORCH = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16, "int32": torch.int32}


class DeviceView:
    """a contiguous DLPack producer on cuda:0 over executor device memory at owner.data_ptr,
    of another shape (and dtype) than owner's: a reshape without a copy; holds owner alive"""

    def __init__(self, owner, shape, dtype):
        self.owner, self.dims = owner, (ctypes.c_int64 * len(shape))(*shape)
        self.deleter = DELETER(lambda _: None)
        self.managed = DLManagedTensor(DLTensor(owner.data_ptr, DLDevice(2, 0), len(shape), DLDataType(*_DL[dtype], 1),
                                                self.dims, None, 0), None, self.deleter)

    def __dlpack_device__(self):
        return (2, 0)

    def __dlpack__(self, **kw):
        return capsule_new(ctypes.addressof(self.managed), b"dltensor", None)


def rows_of(t, cols, dtype):
    """extension device Tensor t as [n, cols] of dtype"""
    return DeviceView(t, [t.nbytes // (cols * _DL[dtype][1] // 8), cols], dtype)


def to_device(a, dtype):
    """host torch tensor a (float32, bfloat16, float16 or int32) copied into a new executor device block"""
    raw = a.contiguous().view(-1).view(torch.uint8).numpy()
    block = _C.copy_tensor(_C.random_tensor((raw.nbytes // 2 + 1,), 0, "bfloat16"), 0)
    ctypes.memmove(block.data_ptr, raw.ctypes.data, raw.nbytes)
    return DeviceView(block, list(a.shape), dtype)


def on_host(view_or_tensor, shape, dtype):
    """a device tensor's contents as a host torch tensor of shape (any producer on the executor)"""
    n = int(np.prod(shape)) * _DL[dtype][1] // 8
    buf = (ctypes.c_char * n).from_address(view_or_tensor.data_ptr if hasattr(view_or_tensor, "data_ptr")
                                           else view_or_tensor.owner.data_ptr)
    tdt = _TORCH[dtype]
    return torch.frombuffer(bytearray(buf.raw), dtype=tdt).reshape(shape)


def experts_differ(got, want, logits, margin):
    """rows clear of the margin (their top k + 1 logits apart) whose experts differ"""
    logits = logits.reshape(-1, E)
    top = -np.sort(-logits, axis=1)[:, :K + 1]
    clear = (np.diff(-top, axis=1) > margin * np.abs(top).max(axis=1, keepdims=True)).all(axis=1)
    return int((clear & (got.reshape(-1, K) != want.reshape(-1, K)).any(axis=1)).sum()), int(clear.sum())


def calls():
    """(name, x shape, kwargs of attention_half): the calls of the attention half's case"""
    return [("prefill 7 in chunks of 3", (2, 7, H), {"chunk_size": 3}),
            ("prefill 2 of sequence 0", (2, H), {"seq": 0}),
            ("decode step 0", (2, H), {"decode": True}),
            ("decode step 1", (2, H), {"decode": True})]


def call_kw(kw):
    return kw.get("seq"), kw.get("chunk_size"), {"decode": kw.get("decode", False)}


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
def test_the_attention_half_on_the_executor_matches_the_cpu_layers(dtype):
    """attention_half on an emulated CUDA layer gives the CPU layer's resid, normed, experts
    and weights (within the dtype's tolerance; the same experts on every row whose top k + 1
    logits are clear of each other), as tensors on the device of the CPU contract's shapes and
    dtypes, and appends the same tokens to the cache; its router insides are its own experts
    and weights."""
    w = _C.random_weights(CFG, 11, dtype)
    cpu, gpu = _C.Layer(CFG, w, None, -1), _C.Layer(CFG, w, None, 0)
    cc, cg = cpu.new_cache(16, 2), gpu.new_cache(16, 2)
    for c in (cc, cg):
        c.set_padding(PAD, 1)
    clear = 0
    for i, (name, shape, kw) in enumerate(calls()):
        x = _C.random_tensor(shape, 20 + i, dtype)
        seq, chunk, flags = call_kw(kw)
        want = cpu.attention_half(x, cc, seq, chunk, return_router=True, **flags)
        got = gpu.attention_half(_C.copy_tensor(x, 0), cg, seq, chunk, return_router=True, **flags)
        (g_resid, g_normed, g_experts, g_weights), g_logits, g_rexp, g_rw, g_maps = got
        (c_resid, c_normed, c_experts, c_weights), c_logits = want[0], want[1]
        lead = list(shape[:-1])
        assert [list(t.shape) for t in got[0]] == [lead + [H], lead + [H], lead + [K], lead + [K]], name
        assert [t.dtype for t in got[0]] == ["float32", dtype, "int32", "float32"], name
        assert {str(t.device) for t in got[0] + got[1:4]} == {"cuda:0"} and g_maps is None, name
        for g, c in ((g_resid, c_resid), (g_normed, c_normed), (g_weights, c_weights), (g_logits, c_logits)):
            assert rel(host(g), host(c)) <= TOL[dtype], name
        differ, n_clear = experts_differ(host(g_experts), host(c_experts), host(c_logits), MARGIN[dtype])
        assert differ == 0, name
        clear += n_clear
        assert np.array_equal(host(g_rexp), host(g_experts)) and np.array_equal(host(g_rw), host(g_weights)), name
        assert list(cg.lengths) == list(cc.lengths), name
    assert clear >= 12  # of 20 rows: the experts were compared on most of them
    assert list(cg.lengths) == [11, 9]


def routes(n, seed, skip_every=0):
    """[n, K] expert ids (distinct per row) and weights, every skip_every-th entry -1 with a
    NaN weight (a skipped entry that were computed would make NaN)"""
    g = torch.Generator().manual_seed(seed)
    ids = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(n)]).to(torch.int32)
    weights = torch.rand(n, K, generator=g)
    if skip_every:
        flat_ids, flat_w = ids.view(-1), weights.view(-1)
        flat_ids[::skip_every] = -1
        flat_w[::skip_every] = float("nan")
    return ids, weights


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
def test_the_expert_half_on_the_executor_matches_the_cpu_layers(dtype):
    """expert_half on an emulated CUDA layer gives the CPU layer's output for rows grouped on
    the device (5 rows, every entry held) and on the host (70 rows; 5 rows with entries of -1),
    skipped entries not computed (their NaN weights never read), into a new tensor of rows'
    dtype, into out, or added to out (fp32 and bf16 out); 0 rows give an empty output."""
    w = _C.random_weights(CFG, 12, dtype)
    cpu, gpu = _C.Layer(CFG, w, None, -1), _C.Layer(CFG, w, None, 0)
    tdt = _TORCH[dtype]
    for n, skip in ((5, 0), (70, 0), (5, 3), (70, 4)):
        rows = torch.from_dlpack(_C.random_tensor((n, H), n + skip, dtype))
        ids, weights = routes(n, 100 + n + skip, skip)
        want = torch.from_dlpack(cpu.expert_half(rows, ids, weights)).double()
        d_rows, d_ids, d_w = to_device(rows, dtype), to_device(ids, "int32"), to_device(weights, "float32")
        got = gpu.expert_half(d_rows, d_ids, d_w)
        assert (list(got.shape), got.dtype, str(got.device)) == ([n, H], dtype, "cuda:0")
        assert np.isfinite(host(got)).all() and rel(host(got), want.numpy()) <= TOL[dtype], (n, skip)
        for out_dtype in ("float32", "bfloat16", "float16"):
            base = torch.from_dlpack(_C.random_tensor((n, H), 7, out_dtype))
            want_acc = torch.from_dlpack(cpu.expert_half(rows, ids, weights, out=base.clone(), accumulate=True))
            out = to_device(base, out_dtype)
            assert gpu.expert_half(d_rows, d_ids, d_w, out=out, accumulate=True) is out
            got_acc = on_host(out, [n, H], out_dtype).double()
            assert rel(got_acc.numpy(), want_acc.double().numpy()) <= TOL[dtype] + TOL[out_dtype], (n, skip, out_dtype)
            gpu.expert_half(d_rows, d_ids, d_w, out=out)  # = (not +=)
            tol = TOL[dtype] + (TOL[out_dtype] if out_dtype != dtype else 0)
            assert rel(on_host(out, [n, H], out_dtype).double().numpy(), want.numpy()) <= tol, (n, skip, out_dtype)
    assert rows.dtype == tdt
    empty = gpu.expert_half(to_device(torch.zeros(0, H, dtype=tdt), dtype), to_device(torch.zeros(0, K, dtype=torch.int32),
                                                                                     "int32"),
                            to_device(torch.zeros(0, K), "float32"))
    assert list(empty.shape) == [0, H]
    # every entry elsewhere: nothing added
    rows = torch.from_dlpack(_C.random_tensor((3, H), 1, dtype))
    base = torch.from_dlpack(_C.random_tensor((3, H), 2, "float32"))
    out = to_device(base, "float32")
    gpu.expert_half(to_device(rows, dtype), to_device(torch.full((3, K), -1, dtype=torch.int32), "int32"),
                    to_device(torch.full((3, K), float("nan")), "float32"), out=out, accumulate=True)
    assert torch.equal(on_host(out, [3, H], "float32"), base)


def half_then_experts(layer, cache, x, seq, chunk, flags, dtype, accumulate):
    """attention_half then expert_half on its rows: resid + the experts [rows, H] as float64
    numpy (accumulate: added into resid on the device; else a new output added on the host)"""
    resid, normed, experts, weights = layer.attention_half(_C.copy_tensor(x, 0), cache, seq, chunk, **flags)
    r, nr = rows_of(resid, H, "float32"), rows_of(normed, H, dtype)
    ex, wt = rows_of(experts, K, "int32"), rows_of(weights, K, "float32")
    if accumulate:
        layer.expert_half(nr, ex, wt, out=r, accumulate=True)
        return host(resid).reshape(-1, H)
    n = r.dims[0]
    part = layer.expert_half(nr, ex, wt, out=to_device(torch.zeros(n, H), "float32"))
    return host(resid).reshape(-1, H) + on_host(part, [n, H], "float32").double().numpy()


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
def test_the_halves_on_the_executor_are_the_cuda_layers_forward(dtype):
    """resid + expert_half(attention_half's rows) is the CUDA layer's own prefill and decode
    output (fp32: within 1e-5; bf16 and fp16: within the rounding of normed and of the output),
    whether the experts add into resid on the device or into a new output; the caches agree."""
    w = _C.random_weights(CFG, 13, dtype)
    gpu = _C.Layer(CFG, w, None, 0)
    whole, halves, halves2 = gpu.new_cache(16, 2), gpu.new_cache(16, 2), gpu.new_cache(16, 2)
    for c in (whole, halves, halves2):
        c.set_padding(PAD, 1)
    tol = {"float32": 1e-5, "bfloat16": 2 ** -8, "float16": 2 ** -10}[dtype]
    for i, (name, shape, kw) in enumerate(calls()):
        x = _C.random_tensor(shape, 30 + i, dtype)
        seq, chunk, flags = call_kw(kw)
        if flags["decode"]:
            y = gpu.decode(_C.copy_tensor(x, 0), whole)
        else:
            y = gpu.prefill(_C.copy_tensor(x, 0), whole, seq, chunk)
        want = host(y).reshape(-1, H)
        for cache, acc in ((halves, True), (halves2, False)):
            got = half_then_experts(gpu, cache, x, seq, chunk, flags, dtype, acc)
            assert rel(got, want) <= tol, (name, acc, rel(got, want))
    assert list(whole.lengths) == list(halves.lengths) == list(halves2.lengths) == [11, 9]


def test_two_layers_of_disjoint_experts_on_the_executor_are_the_whole_layer():
    """Layers holding experts {0, 2, 5} and {1, 3, 4, 6, 7} (random(experts=...): each expert
    that of the whole layer of the same seed) hold only their experts' weights, run the
    attention half as the whole layer does, and their expert halves (the other layer's
    entries -1), added into resid one after the other on the device, or combined on the host
    with combine_rows, give the whole layer's prefill; each subset layer's expert half is the
    CPU subset layer's."""
    a_ids, b_ids = [0, 2, 5], [1, 3, 4, 6, 7]
    whole = q3.DecoderLayer.random(CFG, seed=14, dtype="float32", device="cuda")
    a = q3.DecoderLayer.random(CFG, seed=14, dtype="float32", device="cuda", experts=a_ids)
    b = q3.DecoderLayer.random(CFG, seed=14, dtype="float32", device="cuda", experts=b_ids)
    a_cpu = q3.DecoderLayer.random(CFG, seed=14, dtype="float32", experts=a_ids)
    assert (a.held_experts, b.held_experts) == (tuple(a_ids), tuple(b_ids))
    ptrs = a._core.weight_ptrs
    assert sorted({int(n.split(".")[2]) for n in ptrs if n.startswith("mlp.experts.")}) == a_ids
    per_expert = (whole._core.weight_bytes - a._core.weight_bytes) // len(b_ids)
    assert per_expert == 3 * H * CFG.moe_intermediate_size * 4
    assert b._core.weight_bytes == whole._core.weight_bytes - len(a_ids) * per_expert
    x = _C.random_tensor((9, H), 40, "float32")
    cw, ca = whole.new_cache(16), a.new_cache(16)
    y = host(whole.prefill(_C.copy_tensor(x, 0), cw, chunk_size=4))
    resid, normed, experts, weights = a.attention_half(_C.copy_tensor(x, 0), ca, chunk_size=4)
    ref = whole.attention_half(_C.copy_tensor(x, 0), whole.new_cache(16), chunk_size=4)
    assert all(np.array_equal(host(g), host(r)) for g, r in zip((resid, normed, experts, weights), ref))
    ids = torch.from_numpy(host(experts)).to(torch.int32)
    mask_a = sum(ids == e for e in a_ids).bool()
    ids_a, ids_b = torch.where(mask_a, ids, -1), torch.where(mask_a, -1, ids)
    assert (ids_a >= 0).any() and (ids_b >= 0).any()
    nr, wt = rows_of(normed, H, "float32"), rows_of(weights, K, "float32")
    part_a = a.expert_half(nr, to_device(ids_a, "int32"), wt)
    part_b = b.expert_half(nr, to_device(ids_b, "int32"), wt)
    host_rows = torch.from_numpy(host(normed)).float()
    want_a = torch.from_dlpack(a_cpu.expert_half(host_rows, ids_a, torch.from_numpy(host(weights)).float()))
    assert rel(host(part_a), want_a.double().numpy()) <= 1e-5
    # on the host: combine_rows of both parts into resid
    r_host = torch.from_numpy(host(resid)).float().contiguous()
    parts = torch.cat([torch.from_numpy(host(part_a)).float(), torch.from_numpy(host(part_b)).float()])
    _C.combine_rows(r_host, parts, torch.arange(9, dtype=torch.int32).repeat(2))
    assert rel(r_host.double().numpy(), y) <= 1e-5
    # on the device: each layer adds its experts into resid in turn
    r = rows_of(resid, H, "float32")
    a.expert_half(nr, to_device(ids_a, "int32"), wt, out=r, accumulate=True)
    b.expert_half(nr, to_device(ids_b, "int32"), wt, out=r, accumulate=True)
    assert rel(host(resid), y) <= 1e-5


def test_the_halves_on_the_executor_refuse_what_they_cannot_run():
    """An expert the layer does not hold or no expert at all, named by its entry, before out
    is written; host tensors for a CUDA layer's halves (never copied); combine_rows on device
    tensors; a subset CUDA layer's prefill, decode and decode graph, and its fused host
    experts (which would upload every one); a stream for a CPU layer's expert half."""
    sub = _C.Layer(CFG, _C.random_weights(CFG, 15, "float32", None, [1, 5]), None, 0, None, [1, 5])
    rows = to_device(torch.ones(2, H), "float32")
    w = to_device(torch.ones(2, K), "float32")
    base = torch.full((2, H), 3.0)
    out = to_device(base, "float32")
    ids = torch.tensor([[1, -1], [5, 2]], dtype=torch.int32)
    cache = sub.new_cache(8)
    x = _C.copy_tensor(_C.random_tensor((3, H), 1, "float32"), 0)
    fused = _C.random_weights(CFG, 15, "float32")
    found = errors_of([
        lambda: sub.expert_half(rows, to_device(ids, "int32"), w, out=out, accumulate=True),
        lambda: sub.expert_half(rows, to_device(torch.tensor([[1, 8], [5, 5]], dtype=torch.int32), "int32"), w),
        lambda: sub.expert_half(torch.ones(2, H), to_device(ids, "int32"), w),
        lambda: sub.expert_half(rows, ids, w),
        lambda: sub.expert_half(rows, to_device(ids, "int32"), w, out=torch.zeros(2, H)),
        lambda: sub.attention_half(_C.random_tensor((3, H), 1, "float32"), cache),
        lambda: sub.attention_half(x, _C.Layer(CFG, _C.random_weights(CFG, 15, "float32"), None, -1).new_cache(8)),
        lambda: _C.combine_rows(rows, rows, to_device(torch.tensor([0, 1], dtype=torch.int32), "int32")),
        lambda: sub.prefill(x, cache),
        lambda: sub.decode(_C.copy_tensor(_C.random_tensor((1, H), 1, "float32"), 0), cache),
        lambda: sub.decode_graph(cache),
        lambda: _C.Layer(CFG, fused, None, 0, None, [1, 5]),
        lambda: _C.Layer(CFG, fused, None, -1).expert_half(torch.ones(2, H), ids, torch.ones(2, K), stream=1),
    ])
    holds = ("expert 2 is not held by this layer (it holds 2 of the 8; mark an expert held elsewhere -1)")
    assert found == [
        f"ValueError: experts[1, 1]: {holds}",
        "IndexError: experts[0, 1]: expected -1 (held elsewhere) or an expert index in [0, 8), got 8",
        "ValueError: rows: expected a tensor on device cuda:0, got cpu",
        "ValueError: experts: expected a tensor on device cuda:0, got cpu",
        "ValueError: out: expected a tensor on device cuda:0, got cpu",
        "ValueError: x: expected a tensor on device cuda:0, got cpu",
        "ValueError: cache: expected a cache on cuda:0 (this layer's device), got one on cpu",
        "ValueError: resid: expected a tensor on device cpu, got cuda:0",
    ] + ["ValueError: layer: holds 2 of the 8 experts, and the whole layer needs every one (run its halves: "
         "attention_half, then expert_half where the experts are)"] * 3 + [
        "ValueError: mlp.experts.gate_up_proj: a CUDA layer holding a subset of the experts takes host experts per "
        "expert (mlp.experts.{e}.*.weight, only the held ones uploaded), got the fused host tensor of all 8",
        "ValueError: stream: expected None for a cpu layer"], found
    assert torch.equal(on_host(out, [2, H], "float32"), base)  # the refused call wrote nothing
    ok = torch.tensor([[1, -1], [5, 1]], dtype=torch.int32)
    sub.expert_half(rows, to_device(ok, "int32"), w, out=out, stream=0)  # 0: the default stream, as None
    assert not torch.equal(on_host(out, [2, H], "float32"), base)
    assert list(cache.lengths) == [0]
    # the fused experts already on the device are borrowed whole (nothing allocated)
    dev = {k: _C.copy_tensor(v, 0) for k, v in fused.items()}
    assert _C.Layer(CFG, dev, None, 0, None, [1, 5]).held_experts == (1, 5)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
def test_take_and_combine_rows_on_the_device_give_the_hosts_bits(dtype):
    """_C.take_rows and _C.combine_rows with device=0 (a split layer's rows:
    qwen3layer/placement/hybrid.py) against the host's: the rows taken as they are, the parts
    added in fp32, the out rounded alike; a [2, 3, hidden] source taken as its 6 rows"""
    tdt = getattr(torch, dtype)
    g = torch.Generator().manual_seed(31)
    src, rows = torch.randn(2, 3, H, generator=g).to(tdt), torch.tensor([5, 0, 3], dtype=torch.int32)
    want = torch.from_dlpack(_C.take_rows(src, rows))
    assert torch.equal(want, src.reshape(6, H)[rows.long()])
    got = _C.take_rows(to_device(src, dtype), to_device(rows, "int32"), device=0)
    assert torch.equal(on_host(got, [3, H], dtype), want)
    resid, parts = torch.randn(6, H, generator=g), torch.randn(3, H, generator=g).to(tdt)
    r_host, y_host = resid.clone(), torch.empty(6, H, dtype=tdt)
    _C.combine_rows(r_host, parts, rows, y_host)
    r_dev, y_dev = to_device(resid, "float32"), to_device(torch.zeros(6, H, dtype=tdt), dtype)
    _C.combine_rows(r_dev, to_device(parts, dtype), to_device(rows, "int32"), out=y_dev, device=0)
    assert torch.equal(on_host(r_dev, [6, H], "float32"), r_host)
    assert torch.equal(on_host(y_dev, [6, H], dtype), y_host)


def test_take_and_combine_rows_refuse_before_any_write():
    """a row outside the source, a row named twice on the device (its kernel adds parts in
    parallel), tensors on another device than device=, a stream for host tensors, an out of
    another dtype than the source's: each named, nothing written"""
    resid = torch.randn(4, H)
    r_dev, parts = to_device(resid, "float32"), to_device(torch.ones(2, H), "float32")
    src = to_device(torch.ones(4, H), "float32")
    dev_rows = lambda r: to_device(torch.tensor(r, dtype=torch.int32), "int32")  # noqa: E731
    found = errors_of([
        lambda: _C.combine_rows(r_dev, parts, dev_rows([1, 4]), device=0),
        lambda: _C.combine_rows(r_dev, parts, dev_rows([2, 2]), device=0),
        lambda: _C.take_rows(src, dev_rows([0, -1]), device=0),
        lambda: _C.take_rows(torch.ones(4, H), dev_rows([0]), device=0),
        lambda: _C.take_rows(torch.ones(4, H), torch.tensor([0], dtype=torch.int32), stream=0),
        lambda: _C.take_rows(torch.ones(4, H), torch.tensor([0], dtype=torch.int32),
                             out=torch.empty(1, H, dtype=torch.bfloat16)),
        lambda: _C.take_rows(torch.ones(4, H), torch.tensor([0], dtype=torch.int32), device=True),
    ])
    assert found == [
        "IndexError: rows[1]: expected a row in [0, 4), got 4",
        "ValueError: rows[1]: row 2 is named twice; on a device each part adds to a row of its own (combine twice, "
        "or on the host)",
        "IndexError: rows[1]: expected a row in [0, 4), got -1",
        "ValueError: src: expected a tensor on device cuda:0, got cpu",
        "ValueError: stream: expected None for host tensors (device=-1)",
        "TypeError: out: expected dtype float32 (src's: rows are moved, not converted), got bfloat16",
        "TypeError: device: expected an int (-1: the host, else a CUDA device), got bool",
    ], found
    assert torch.equal(on_host(r_dev, [4, H], "float32"), resid)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
def test_attention_passes_on_the_executor_give_the_attention_halfs_rows(dtype):
    """an emulated CUDA layer's attention passes (the split layer's runner): each pass's rows
    (a batch of 2, each pass's rows s * L + t copied in one piece) are its attention half's rows
    of that pass, bit for bit, the insides the whole call's, and an abort takes every pass back"""
    w = _C.random_weights(CFG, 11, dtype)
    gpu = _C.Layer(CFG, w, None, 0)
    whole, cache = gpu.new_cache(16, 2), gpu.new_cache(16, 2)
    x = _C.copy_tensor(_C.random_tensor([2, 7, H], 5, dtype), 0)
    want = gpu.attention_half(x, whole, None, 3, return_router=True)
    passes = gpu.attention_passes(x, cache, None, 3, return_router=True)
    first = 0
    for halves in passes:
        last = passes.next_token
        for g, wnt in zip(halves, want[0]):
            assert np.array_equal(host(g), host(wnt)[:, first:last]), (first, last)
        first = last
    assert first == 7 and passes.passes == 3
    got = passes.close()
    assert np.array_equal(host(got[0]), host(want[1])) and list(cache.lengths) == [7, 7]
    again = gpu.attention_passes(x, cache, None, 3)
    next(again)
    assert list(cache.lengths) == [10, 10]
    again.abort()
    assert list(cache.lengths) == [7, 7]
