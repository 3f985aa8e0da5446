"""The layer's two halves (attention_half, expert_half) and layers holding a subset of the
experts: the halves run back to back are the layer, to the bit in fp32; experts split over
subset layers sum to the whole layer's; a subset layer never needs the others' weights and
refuses what it cannot run, naming it, before any work."""
import pytest
import torch

import qwen3layer as q3
from qwen3layer import _C
from qwen3layer.weights import canonical_weights, expert_weights

# 16 experts top-4: a row's experts fall on both sides of any split
CFG = q3.LayerConfig(hidden_size=64, num_attention_heads=8, num_key_value_heads=2, head_dim=24,
                     num_experts=16, num_experts_per_tok=4, moe_intermediate_size=48)
E, K, H = CFG.num_experts, CFG.num_experts_per_tok, CFG.hidden_size
DT = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def x_of(*shape, seed=0, dtype="float32"):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(DT[dtype])


@pytest.fixture(scope="module", params=["float32", "bfloat16"])
def whole(request):
    return q3.DecoderLayer.random(CFG, seed=5, dtype=request.param)


def halves_prefill(layer, x, cache, chunk_size=None):
    """prefill as the halves, pass by pass: each chunk of tokens through the attention half,
    then its rows through the expert half (a matmul over other rows may round otherwise)"""
    step = chunk_size or x.shape[-2]
    outs = []
    for t0 in range(0, x.shape[-2], step):
        resid, normed, experts, weights = layer.attention_half(x[..., t0:t0 + step, :].contiguous(), cache)
        out = resid.reshape(-1, H).clone()
        layer.expert_half(normed.reshape(-1, H), experts.reshape(-1, K), weights.reshape(-1, K), out=out,
                          accumulate=True)
        outs.append(out.reshape(resid.shape))
    return torch.cat(outs, dim=-2)


def kv(cache, batch):
    return [(torch.from_dlpack(cache.keys(s)).clone(), torch.from_dlpack(cache.values(s)).clone())
            for s in range(batch)]


def assert_same_output(got, want, dtype):
    """fp32: the same code on the same rows, to the bit. bf16: the experts read the normed rows
    rounded to bf16 and the sum is rounded once more: within bf16 rounding"""
    if dtype == "float32":
        assert torch.equal(got, want)
    else:
        assert torch.allclose(got.to(torch.bfloat16).float(), want.float(), rtol=2 ** -7, atol=2 ** -7)


@pytest.mark.parametrize("chunk", [None, 16])
def test_the_two_halves_are_the_layer_in_prefill(whole, chunk):
    x = x_of(37, H, seed=1, dtype=whole.dtype)
    c_whole, c_half = whole.new_cache(64), whole.new_cache(64)
    y = whole.prefill(x, c_whole, chunk_size=chunk)
    got = halves_prefill(whole, x, c_half, chunk_size=chunk)
    assert got.dtype == torch.float32 and got.shape == x.shape
    assert_same_output(got, y, whole.dtype)
    for (k0, v0), (k1, v1) in zip(kv(c_whole, 1), kv(c_half, 1)):  # the K/V: the attention half's own
        assert torch.equal(k0, k1) and torch.equal(v0, v1)
    assert c_half.lengths == c_whole.lengths


def test_the_halves_over_a_left_padded_batch_then_decode(whole):
    """3-D x over every sequence, left padding, then decode steps of few rows (the experts then
    split over threads whole, the other code path of the expert block)"""
    x = x_of(3, 9, H, seed=2, dtype=whole.dtype)
    caches = [whole.new_cache(16, batch=3) for _ in range(2)]
    for c in caches:
        c.set_padding(4, 1)
    y = whole.prefill(x, caches[0], chunk_size=4)
    assert_same_output(halves_prefill(whole, x, caches[1], chunk_size=4), y, whole.dtype)
    assert caches[1].lengths == caches[0].lengths == (9, 9, 9)
    for step in range(3):
        t = x_of(3, H, seed=10 + step, dtype=whole.dtype)
        y = whole.decode(t, caches[0])
        resid, normed, experts, weights = whole.attention_half(t, caches[1], decode=True)
        assert resid.shape == (3, H) and experts.shape == (3, K)
        out = whole.expert_half(normed, experts, weights, out=resid.clone(), accumulate=True)
        assert_same_output(out, y, whole.dtype)
    for (k0, v0), (k1, v1) in zip(kv(caches[0], 3), kv(caches[1], 3)):
        assert torch.equal(k0, k1) and torch.equal(v0, v1)


def test_the_attention_half_gives_the_routers_choices(whole):
    x = x_of(11, H, seed=3, dtype=whole.dtype)
    trace = whole.prefill(x, whole.new_cache(16), return_router=True)
    _, _, experts, weights = whole.attention_half(x, whole.new_cache(16))
    assert torch.equal(experts, trace.experts) and torch.equal(weights, trace.expert_weights)


@pytest.mark.parametrize("split", [[0, 16], [0, 7, 16], [0, 1, 2, 16], [0, 0, 16]])
def test_experts_split_over_subset_layers_sum_to_the_whole_layer(whole, split):
    """contiguous shards, uneven, one of a single expert, one holding none"""
    x = x_of(23, H, seed=4, dtype=whole.dtype)
    y = whole.prefill(x, whole.new_cache(32))
    resid, normed, experts, weights = whole.attention_half(x, whole.new_cache(32))
    out = resid.clone()
    for lo, hi in zip(split, split[1:]):
        part = q3.DecoderLayer.random(CFG, seed=5, dtype=whole.dtype, experts=range(lo, hi))
        assert part.held_experts == tuple(range(lo, hi))
        mine = (experts >= lo) & (experts < hi)
        part.expert_half(normed, torch.where(mine, experts, -1), weights, out=out, accumulate=True)
    if whole.dtype == "float32":  # the same products, summed in another order
        assert torch.allclose(out, y, rtol=1e-6, atol=1e-6)
    else:
        assert_same_output(out, y, whole.dtype)


def test_a_subset_layer_runs_the_attention_half_as_the_whole_one(whole):
    part = q3.DecoderLayer.random(CFG, seed=5, dtype=whole.dtype, experts=[3, 9])
    x = x_of(13, H, seed=6, dtype=whole.dtype)
    a = whole.attention_half(x, whole.new_cache(16))
    b = part.attention_half(x, part.new_cache(16))
    assert all(torch.equal(u, v) for u, v in zip(a, b))


def test_rows_whose_experts_are_all_elsewhere_get_zero(whole):
    rows = x_of(5, H, seed=7, dtype=whole.dtype)
    experts = torch.full((5, K), -1, dtype=torch.int32)
    experts[2, 1] = 4
    weights = torch.rand(5, K)
    got = whole.expert_half(rows, experts, weights)
    assert got.dtype == rows.dtype and got.shape == (5, H)
    assert torch.all(got[[0, 1, 3, 4]] == 0) and torch.any(got[2] != 0)
    empty = whole.expert_half(rows[:0], experts[:0], weights[:0])
    assert empty.shape == (0, H)


def test_expert_half_without_accumulate_overwrites_out_and_bf16_out_works(whole):
    rows = x_of(6, H, seed=8, dtype=whole.dtype)
    experts = torch.randint(0, E, (6, K), generator=torch.Generator().manual_seed(1), dtype=torch.int32)
    weights = torch.rand(6, K)
    want = whole.expert_half(rows, experts, weights, out=torch.zeros(6, H))
    out = torch.full((6, H), 7.0)
    assert whole.expert_half(rows, experts, weights, out=out) is out and torch.equal(out, want)
    b = torch.full((6, H), 1.0, dtype=torch.bfloat16)
    whole.expert_half(rows, experts, weights, out=b, accumulate=True)
    assert torch.equal(b, (want + 1.0).to(torch.bfloat16))


@pytest.mark.parametrize("fmt", ["dense", "fp8_e4m3_block128"])
def test_random_subset_experts_are_the_whole_layers(fmt):
    whole = _C.random_weights(CFG, 11, "bfloat16", fmt)
    part = _C.random_weights(CFG, 11, "bfloat16", fmt, [2, 13])
    I = CFG.moe_intermediate_size
    assert not any(n.startswith("mlp.experts.") and n.split(".")[2] not in ("2", "13") for n in part)
    suffixes = ["", "_scale_inv"] if fmt != "dense" else [""]
    blocks = -(-I // 128)
    for e in (2, 13):
        for s in suffixes:
            gu = torch.from_dlpack(whole["mlp.experts.gate_up_proj" + s])[e]
            down = torch.from_dlpack(whole["mlp.experts.down_proj" + s])[e]
            half = blocks if s else I
            gate = torch.from_dlpack(part[f"mlp.experts.{e}.gate_proj.weight{s}"])
            up = torch.from_dlpack(part[f"mlp.experts.{e}.up_proj.weight{s}"])
            mine = torch.from_dlpack(part[f"mlp.experts.{e}.down_proj.weight{s}"])
            for a, b in ((gate, gu[:half]), (up, gu[half:]), (mine, down)):
                assert torch.equal(a.view(torch.uint8), b.contiguous().view(torch.uint8))
    for name in part:
        if not name.startswith("mlp.experts."):
            assert torch.equal(torch.from_dlpack(part[name]).view(torch.uint8),
                               torch.from_dlpack(whole[name]).view(torch.uint8))


def test_a_subset_layer_counts_only_its_experts_bytes():
    whole = q3.DecoderLayer.random(CFG, seed=1, dtype="bfloat16")
    none = q3.DecoderLayer.random(CFG, seed=1, dtype="bfloat16", experts=[])
    three = q3.DecoderLayer.random(CFG, seed=1, dtype="bfloat16", experts=[0, 5, 15])
    per_expert = 3 * H * CFG.moe_intermediate_size * 2
    assert none.weight_bytes == whole.weight_bytes - E * per_expert
    assert three.weight_bytes == none.weight_bytes + 3 * per_expert
    assert none.held_experts == () and whole.held_experts == tuple(range(E))


def test_a_subset_layer_from_a_full_weights_dict_takes_only_its_experts():
    """per-expert weights of the other experts are left alone (not imported), fused tensors
    are sliced for the held ones"""
    per = {k: torch.from_dlpack(v) for k, v in _C.random_weights(CFG, 2, "float32", None, list(range(E))).items()}
    part = q3.DecoderLayer(CFG, per, experts=[1, 2])
    assert not any(n.startswith("mlp.experts.") and n.split(".")[2] not in ("1", "2") for n in part.weight_ptrs)
    fused = q3.DecoderLayer(CFG, {k: torch.from_dlpack(v) for k, v in _C.random_weights(CFG, 2, "float32").items()},
                            experts=[1, 2])
    rows = x_of(4, H, seed=9)
    experts = torch.tensor([[1, 2, -1, -1]] * 4, dtype=torch.int32)
    weights = torch.rand(4, K)
    assert torch.equal(part.expert_half(rows, experts, weights), fused.expert_half(rows, experts, weights))


# ---- refusals ----------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def part():
    return q3.DecoderLayer.random(CFG, seed=5, dtype="float32", experts=range(8))


def test_prefill_and_decode_refuse_a_subset_layer(part):
    cache = part.new_cache(8)
    with pytest.raises(ValueError, match=r"holds 8 of the 16 experts.*attention_half, then expert_half"):
        part.prefill(x_of(3, H), cache)
    with pytest.raises(ValueError, match="holds 8 of the 16 experts"):
        part.decode(x_of(1, H), cache)
    assert cache.lengths == (0,)


@pytest.mark.parametrize("bad,err,match", [
    (9, ValueError, r"experts\[1, 2\]: expert 9 is not held by this layer \(it holds 8 of the 16"),
    (16, IndexError, r"experts\[1, 2\]: expected -1 \(held elsewhere\) or an expert index in \[0, 16\), got 16"),
    (-2, IndexError, r"got -2"),
])
def test_an_expert_id_the_layer_cannot_run_is_refused_before_any_write(part, bad, err, match):
    rows = x_of(3, H)
    experts = torch.zeros(3, K, dtype=torch.int32)
    experts[1, 2] = bad
    out = torch.full((3, H), 2.0)
    with pytest.raises(err, match=match):
        part.expert_half(rows, experts, torch.rand(3, K), out=out, accumulate=True)
    assert torch.all(out == 2.0)


def test_expert_half_takes_rows_with_leading_dims_in_row_order(whole):
    """rows [2, 3, hidden] with experts and weights [2, 3, top_k] (an attention half's outputs
    of a batch) are its 6 rows in order: the bits of the same call on [6, ...] views"""
    rows = x_of(2, 3, H, seed=9, dtype=whole.dtype)
    experts = torch.randint(0, E, (2, 3, K), generator=torch.Generator().manual_seed(2), dtype=torch.int32)
    weights = torch.rand(2, 3, K)
    want = whole.expert_half(rows.reshape(6, H), experts.reshape(6, K), weights.reshape(6, K))
    got = whole.expert_half(rows, experts, weights)
    assert tuple(got.shape) == (6, H) and torch.equal(torch.from_dlpack(got), torch.from_dlpack(want))
    want32 = whole.expert_half(rows.reshape(6, H), experts.reshape(6, K), weights.reshape(6, K),
                               out=torch.full((6, H), 2.0), accumulate=True)
    out = torch.full((2, 3, H), 2.0)
    whole.expert_half(rows, experts, weights, out=out, accumulate=True)
    assert torch.equal(out.reshape(6, H), want32)


@pytest.mark.parametrize("call,err,match", [
    (lambda l, r, e, w: l.expert_half(r[:, :5], e, w), ValueError, r"rows: expected shape \[n, hidden=64\], got \[3, 5\]"),
    (lambda l, r, e, w: l.expert_half(r, e[:2], w), ValueError, r"experts: expected shape \[3, top_k=4\] \(rows'\), got \[2, 4\]"),
    (lambda l, r, e, w: l.expert_half(r, e, w[:, :3]), ValueError, r"weights: expected shape \[3, top_k=4\]"),
    (lambda l, r, e, w: l.expert_half(r, e.long(), w), TypeError, "experts"),
    (lambda l, r, e, w: l.expert_half(r, e, w.bfloat16()), TypeError, r"weights: expected dtype float32"),
    (lambda l, r, e, w: l.expert_half(r, e, w, accumulate=True), ValueError, "accumulate=True adds into out, got out=None"),
    (lambda l, r, e, w: l.expert_half(r, e, w, out=torch.zeros(2, H)), ValueError, r"out: expected shape \[3, hidden=64\]"),
    (lambda l, r, e, w: l.expert_half(r, e, w, out=r), ValueError, "out: overlaps rows"),
    (lambda l, r, e, w: l.expert_half(r.t().contiguous().t(), e, w), ValueError, "rows: expected a contiguous"),
    (lambda l, r, e, w: l.attention_half(r, l.new_cache(4), decode=True, seq=0), ValueError, "decode=True takes no seq"),
])
def test_bad_expert_half_arguments_are_named(part, call, err, match):
    rows, experts, weights = x_of(3, H), torch.zeros(3, K, dtype=torch.int32), torch.rand(3, K)
    with pytest.raises(err, match=match):
        call(part, rows, experts, weights)


@pytest.mark.parametrize("experts,err,match", [
    ([1, 1], ValueError, r"experts\[1\]: expert 1 appears twice"),
    ([0, 16], ValueError, r"experts\[1\]: expected an expert id in \[0, 16\) \(num_experts\), got 16"),
    ([-1], ValueError, r"got -1"),
    ([2 ** 70], ValueError, r"got 1180591620717411303424"),
    ([1.0], TypeError, r"experts\[0\]: expected an int, got float"),
    ([True], TypeError, r"experts\[0\]: expected an int, got bool"),
    (3, TypeError, "experts: expected a sequence of expert ids, got int"),
    ("01", TypeError, "experts: expected a sequence of expert ids, got str"),
])
def test_bad_experts_lists_are_refused_naming_the_entry(experts, err, match):
    with pytest.raises(err, match=match):
        q3.DecoderLayer.random(CFG, seed=1, dtype="float32", experts=experts)


# ---- the combine, the checks alone ----------------------------------------------------------

def test_combine_rows_adds_each_part_at_its_row_in_turn_then_writes_out():
    resid = x_of(4, H, seed=20)
    parts = x_of(5, H, seed=21)
    rows = torch.tensor([2, 0, 2, 3, 2], dtype=torch.int32)
    want = resid.clone()
    for i, r in enumerate(rows.tolist()):
        want[r] += parts[i]
    out = torch.empty(4, H, dtype=torch.bfloat16)
    _C.combine_rows(resid, parts, rows, out)
    assert torch.equal(resid, want) and torch.equal(out, want.to(torch.bfloat16))
    again, expect = want.clone(), want.clone()
    _C.combine_rows(again, parts.bfloat16(), rows)  # bf16 parts, no out
    for i, r in enumerate(rows.tolist()):
        expect[r] += parts[i].bfloat16().float()
    assert torch.equal(again, expect)


@pytest.mark.parametrize("resid,parts,rows,err,match", [
    (torch.zeros(4, H), torch.zeros(2, H), torch.tensor([1, 4], dtype=torch.int32), IndexError,
     r"rows\[1\]: expected a row in \[0, 4\), got 4"),
    (torch.zeros(4, H), torch.zeros(2, H), torch.tensor([1], dtype=torch.int32), ValueError, r"rows: expected .*\[2\]"),
    (torch.zeros(4, H).bfloat16(), torch.zeros(2, H), torch.tensor([1, 2], dtype=torch.int32), ValueError,
     "resid: expected a writable contiguous float32"),
    (torch.zeros(4, H), torch.zeros(2, 5), torch.tensor([1, 2], dtype=torch.int32), ValueError, "parts: expected shape"),
])
def test_combine_rows_refuses_before_any_write(resid, parts, rows, err, match):
    before = resid.clone()
    with pytest.raises(err, match=match):
        _C.combine_rows(resid, parts, rows)
    assert torch.equal(resid, before)


def test_empty_views_count_as_contiguous(whole):
    """a 0-row slice of a wider tensor keeps its strides: it was refused as not contiguous
    (an EP rank receiving no rows hit it)"""
    meta = torch.empty(0, 2 * K, dtype=torch.int32)
    got = whole.expert_half(torch.empty(0, H, dtype=DT[whole.dtype]), meta[:, :K], meta[:, K:].view(torch.float32))
    assert got.shape == (0, H)


def test_attention_passes_check_the_whole_call_before_any_pass(whole):
    """the whole call's checks when the passes open: 5 tokens into room for 4 are refused
    though each pass of 2 would fit, and nothing is appended"""
    cache = whole.new_cache(4)
    with pytest.raises(q3.CacheFullError, match="5 more do not fit"):
        whole._core.attention_passes(x_of(5, H, dtype=whole.dtype), cache, chunk_size=2)
    assert cache.lengths == (0,)
    passes = whole._core.attention_passes(x_of(3, H, dtype=whole.dtype), cache, chunk_size=2)
    assert (passes.passes, passes.done, passes.open, cache.lengths) == (2, 0, True, (0,))
    passes.abort()


@pytest.mark.parametrize("shape, chunk", [((7, H), 3), ((2, 5, H), 2), ((2, H), None)])
def test_attention_passes_give_the_attention_halfs_rows_pass_by_pass(whole, shape, chunk):
    """each pass's halves are the whole call's rows of that pass, bit for bit, and the call's
    insides at close are the whole call's; [2, H] is a decode step of 2 sequences"""
    decode = len(shape) == 2 and chunk is None
    batch = shape[0] if len(shape) == 3 or decode else 1
    x = x_of(*shape, seed=40, dtype=whole.dtype)
    kw = {"decode": True} if decode else {"chunk_size": chunk}
    want_cache, cache = whole.new_cache(16, batch=batch), whole.new_cache(16, batch=batch)
    *want, trace = whole.attention_half(x, want_cache, return_router=True, return_attention=True, **kw)
    passes = whole._core.attention_passes(x, cache, return_router=True, return_attention=True, **kw)
    got, first = [], 0
    for halves in passes:
        assert (passes.done, cache.lengths[0]) == (len(got) + 1, passes.next_token)
        got.append((first, passes.next_token, [torch.from_dlpack(t) for t in halves]))
        first = passes.next_token
    assert len(got) == passes.passes == (1 if decode else -(-shape[-2] // chunk)) and passes.open
    for first, last, halves in got:
        for g, w in zip(halves, want):
            assert torch.equal(g, w if decode else w[..., first:last, :])
    insides = passes.close()
    assert not passes.open and cache.lengths == want_cache.lengths
    for g, name in zip(insides, ("router_logits", "experts", "expert_weights", "attention")):
        assert torch.equal(torch.from_dlpack(g), getattr(trace, name)), name


def test_an_aborted_or_dropped_call_rolls_the_cache_back_and_an_open_one_holds_it(whole):
    cache = whole.new_cache(16, batch=1)
    whole.prefill(x_of(2, H, seed=1, dtype=whole.dtype), cache)
    keys = torch.from_dlpack(cache.keys(0)).clone()
    passes = whole._core.attention_passes(x_of(5, H, seed=2, dtype=whole.dtype), cache, chunk_size=2)
    next(passes), next(passes)
    assert cache.lengths == (6,)
    for call in (lambda: whole.prefill(x_of(1, H, dtype=whole.dtype), cache), lambda: cache.truncate(1),
                 lambda: whole._core.attention_passes(x_of(1, H, dtype=whole.dtype), cache)):
        with pytest.raises(RuntimeError, match="in the middle of a layer call run pass by pass"):
            call()
    with pytest.raises(RuntimeError, match="2 of the call's 3 passes have run"):
        passes.close()
    passes.abort()
    assert cache.lengths == (2,) and not passes.open and list(passes) == []
    assert torch.equal(torch.from_dlpack(cache.keys(0)), keys)
    with pytest.raises(RuntimeError, match="not open"):
        passes.close()
    passes = whole._core.attention_passes(x_of(5, H, seed=2, dtype=whole.dtype), cache, chunk_size=2)
    next(passes)
    del passes  # dropped open: rolled back
    assert cache.lengths == (2,)
    with whole._core.attention_passes(x_of(3, H, dtype=whole.dtype), cache) as passes:
        next(passes)
    assert cache.lengths == (2,)  # a with block left open aborts
    whole.prefill(x_of(1, H, dtype=whole.dtype), cache)  # the cache takes calls again
    assert cache.lengths == (3,)


def test_the_attention_half_gives_prefills_insides(whole):
    x = x_of(2, 7, H, seed=30, dtype=whole.dtype)
    want = whole.prefill(x, whole.new_cache(8, batch=2), return_router=True, return_attention=True)
    *halves, trace = whole.attention_half(x, whole.new_cache(8, batch=2), return_router=True, return_attention=True)
    assert trace.output is None and len(halves) == 4
    for name in ("router_logits", "experts", "expert_weights", "attention"):
        assert torch.equal(getattr(trace, name), getattr(want, name)), name


@pytest.mark.parametrize("fmt", [None, "fp8_e4m3_block128"])
def test_held_expert_views_are_the_held_experts_slices_of_the_fused_tensors(fmt):
    """what a CUDA subset layer takes of fused host tensors (weights.held_expert_views): each
    held expert's gate, up and down (and FP8 scales) as views, equal to that expert's own
    tensors drawn per expert; nothing of the other experts; the extension's tensors left alone"""
    from qwen3layer.weights import canonical_weights, held_expert_views

    cfg = q3.LayerConfig(hidden_size=128, num_attention_heads=8, num_key_value_heads=2, head_dim=32, num_experts=8,
                         num_experts_per_tok=2, moe_intermediate_size=256)
    ids = [2, 7]
    raw = _C.random_weights(cfg, 4, "bfloat16", fmt)
    fused = canonical_weights({n: torch.from_dlpack(t) for n, t in raw.items()}, cfg, ids)
    per = {n: torch.from_dlpack(t) for n, t in _C.random_weights(cfg, 4, "bfloat16", fmt, ids).items()}
    got = held_expert_views(fused, cfg, ids)
    assert set(got) == set(per)
    for name, t in per.items():
        assert got[name].shape == t.shape and got[name].is_contiguous() and torch.equal(got[name], t), name
        if name.startswith("mlp.experts."):  # a view into the fused tensor, not a copy
            which = "mlp.experts.down_proj" if "down" in name else "mlp.experts.gate_up_proj"
            base = fused[which + ("_scale_inv" if name.endswith("_scale_inv") else "")]
            assert got[name].untyped_storage().data_ptr() == base.untyped_storage().data_ptr()
    assert held_expert_views(canonical_weights(raw, cfg, ids), cfg, ids)["mlp.experts.gate_up_proj"] is \
        raw["mlp.experts.gate_up_proj"]


# ---- an expert-only host layer (the host side of a layer split over a GPU and the host) -------

@pytest.mark.parametrize("fmt", ["dense", "fp8_e4m3_block128"])
@pytest.mark.parametrize("held", [None, [0, 3, 9, 15]])
def test_an_expert_only_layer_gives_the_whole_layers_expert_half(fmt, held):
    """_C.Layer(..., experts_only=True) takes the experts alone (no attention, norms or router:
    qwen3layer.weights.expert_weights drops them), fused or per expert, all or a subset: its
    expert half is the whole layer's to the bit, its weight bytes the experts' only, and its
    prefill and attention half are refused naming why"""
    names = list(range(E)) if held is None else held
    full = canonical_weights(_C.random_weights(CFG, 12, "bfloat16", fmt), CFG)
    whole = _C.Layer(CFG, full, "bfloat16", -1, fmt)
    per = canonical_weights(_C.random_weights(CFG, 12, "bfloat16", fmt, names), CFG, held)
    only = _C.Layer(CFG, expert_weights(per if held else full, CFG), "bfloat16", -1, fmt, held, experts_only=True)
    assert only.held_experts == tuple(names)
    rows = x_of(5, H, seed=13, dtype="bfloat16")
    experts = torch.tensor(names[:K], dtype=torch.int32).repeat(5, 1)
    experts[1, 0], experts[3, 2] = -1, -1
    weights = torch.rand(5, K, generator=torch.Generator().manual_seed(3))
    assert torch.equal(torch.from_dlpack(only.expert_half(rows, experts, weights)),
                       torch.from_dlpack(whole.expert_half(rows, experts, weights)))
    per_expert = (whole.weight_bytes - _C.Layer(CFG, full, "bfloat16", -1, fmt, [0]).weight_bytes) / (E - 1)
    assert only.weight_bytes == pytest.approx(len(names) * per_expert)
    cache = only.new_cache(8)
    for call in (lambda: only.prefill(rows, cache), lambda: only.attention_half(rows, cache)):
        with pytest.raises(ValueError, match=r"holds the experts alone \(experts_only: no attention weights\)"):
            call()
    assert cache.lengths == (0,)


@pytest.mark.parametrize("kw,match", [
    (dict(dtype=None), "given its dtype and weight_format"),
    (dict(weight_format=None), "given its dtype and weight_format"),
    (dict(device=0), r"an expert-only layer is a host layer \(device=-1\).*got device=0"),
])
def test_an_expert_only_layer_needs_its_dtype_and_format(kw, match):
    args = dict(dtype="bfloat16", weight_format="dense", device=-1)
    args.update(kw)
    w = expert_weights(canonical_weights(_C.random_weights(CFG, 12, "bfloat16"), CFG), CFG)
    with pytest.raises(ValueError, match=match):
        _C.Layer(CFG, w, args["dtype"], args["device"], args["weight_format"], experts_only=True)


@pytest.mark.parametrize("by_pass", [False, True])
def test_a_decode_half_refuses_a_tree_before_any_work(whole, by_pass):
    """attention_half / attention_passes with decode=True take no tree (one token a sequence:
    nothing for a tree to order); refused by name, the cache as it was"""
    cache = whole.new_cache(4, batch=2)
    call = whole._core.attention_passes if by_pass else whole._core.attention_half
    with pytest.raises(ValueError, match="decode=True takes no seq, chunk_size or tree"):
        call(x_of(2, H), cache, decode=True, tree=torch.ones(2, 2, dtype=torch.bool).tril())
    assert cache.lengths == (0, 0)
