"""A call's token_mask and positions (issue 42) on a CUDA layer run by the SIMT executor,
against the CPU layer on the same weights and inputs; in a subprocess of its own
(conftest.py).

Three sequences, the second with 2 tokens of left padding: a prefill of 20 tokens in chunks
of 8 whose mask hides holes, a right-padded end (hidden queries, which still see the keys
before them), the padding and the first rows after it (queries before the first key, which
see only themselves), and nothing of the third sequence (its flags stay NULL); positions of
the caller's, not the cache's rule. Then decode steps with positions (staged on the host, not
by decode_prepare), one also hiding a token, and one with neither (the cache's hidden tokens
alone send it to the host's staging). The outputs, the maps of a call asking for them, the
cached keys (after RoPE: the positions show there) and the cache's hidden tokens agree with
the CPU layer's. A decode graph refuses a cache holding hidden tokens, at capture and at a
replay after a masked call, naming the sequence. A call's tree (a verify's): a prefill given
trees and positions, chunked and not, verify, accept and decode steps, as the CPU layer."""
import numpy as np
import pytest
import torch

import qwen3layer as q3
from executor_arrays import errors_of, executor_view, host, rel
from qwen3layer import _C

pytestmark = pytest.mark.executor_subprocess
TIMEOUT = 600
CFG = q3.LayerConfig(hidden_size=64, num_attention_heads=8, num_key_value_heads=2, head_dim=24,
                     num_experts=8, num_experts_per_tok=2, moe_intermediate_size=48)
TOL = {"float32": 1e-5, "bfloat16": 5e-3}  # the CPU's bf16 paths round activations, the CUDA path does not
MAPS_TOL = {"float32": 1e-5, "bfloat16": 2e-2}  # probabilities: an absolute bound
PAD = 2  # sequence 1's left padding


def prefill_inputs():
    """the prefill's token_mask [3, 20] (False: hidden) and positions [3, 20]"""
    mask = torch.ones(3, 20, dtype=torch.bool)
    mask[0, [3, 7, 8, 9]] = False    # holes
    mask[0, 16:] = False             # right padding: the last 4 queries hidden
    mask[1, :PAD + 3] = False        # the padding and the 3 rows after it: first key at row 5
    positions = torch.stack([torch.arange(5, 25),                          # shifted
                             torch.cat([torch.zeros(PAD, dtype=torch.int64), torch.arange(0, 18)]),
                             torch.arange(0, 40, 2)])                      # every other position
    return mask, positions


def masked_calls(dtype, seed):
    w = _C.random_weights(CFG, seed, dtype)
    cpu, gpu = _C.Layer(CFG, w, None, -1), _C.Layer(CFG, w, None, 0)
    cc, cg = cpu.new_cache(32, 3), gpu.new_cache(32, 3)
    for c in (cc, cg):
        c.set_padding(PAD, 1)
    mask, positions = prefill_inputs()
    x = _C.random_tensor((3, 20, 64), seed + 1, dtype)
    errs = {"prefill": rel(host(gpu.prefill(_C.copy_tensor(x, 0), cg, None, 8, token_mask=mask, positions=positions)),
                           host(cpu.prefill(x, cc, None, 8, token_mask=mask, positions=positions)))}
    hidden_after_prefill = [cg.hidden, cc.hidden]
    steps = (("decode, positions", {"positions": torch.tensor([25, 18, 40])}),
             ("decode, positions and a hidden token", {"positions": torch.tensor([26, 19, 42]),
                                                       "token_mask": torch.tensor([True, True, False])}),
             ("decode, neither", {}))
    for t, (name, kw) in enumerate(steps):
        s = _C.random_tensor((3, 64), seed + 10 + t, dtype)
        errs[name] = rel(host(gpu.decode(_C.copy_tensor(s, 0), cg, **kw)), host(cpu.decode(s, cc, **kw)))
    # a chunked prefill asking for the maps: rows over hidden keys are 0, the padding's one-hot
    x = _C.random_tensor((3, 3, 64), seed + 20, dtype)
    kw = {"token_mask": torch.tensor([[True, False, True]] * 3), "positions": torch.tensor([[27, 28, 29]] * 3),
          "return_attention": True}
    got, want = gpu.prefill(_C.copy_tensor(x, 0), cg, None, 2, **kw), cpu.prefill(x, cc, None, 2, **kw)
    errs["prefill asking for the maps"] = rel(host(got[0]), host(want[0]))
    keys = max(rel(executor_view(cg.keys(b)), torch.from_dlpack(cc.keys(b)).double().numpy()) for b in range(3))
    return {"errors": errs, "maps": float(np.abs(host(got[4]) - host(want[4])).max()), "keys": keys,
            "hidden after prefill": hidden_after_prefill, "hidden": [cg.hidden, cc.hidden],
            "lengths": [list(cg.lengths), list(cc.lengths)]}


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_token_mask_and_positions_on_the_executor_match_the_cpu_layer(dtype):
    """token_mask and positions on a CUDA layer (issue 42, requirement 1): a chunked prefill
    whose mask hides holes, a right-padded end, the padding and the rows after it, with the
    caller's positions; decode steps with positions, one hiding a token, one with neither
    over the hidden tokens; a prefill asking for the maps. Outputs, maps and cached keys
    within the dtype's tolerance of the CPU layer's, the same hidden tokens and lengths."""
    run = masked_calls(dtype, {"float32": 50, "bfloat16": 51}[dtype])
    assert list(run["errors"]) == ["prefill", "decode, positions", "decode, positions and a hidden token",
                                   "decode, neither", "prefill asking for the maps"]
    assert max(run["errors"].values()) <= TOL[dtype], run["errors"]
    assert run["keys"] <= TOL[dtype] and run["maps"] <= MAPS_TOL[dtype], run
    assert run["hidden after prefill"][0] == run["hidden after prefill"][1] == \
        ((3, 7, 8, 9, 16, 17, 18, 19), (0, 1, 2, 3, 4), ())
    assert run["hidden"][0] == run["hidden"][1] == ((3, 7, 8, 9, 16, 17, 18, 19, 24), (0, 1, 2, 3, 4, 24),
                                                    (21, 24))
    assert run["lengths"] == [[26, 26, 26], [26, 26, 26]]


def test_a_decode_graph_refuses_a_cache_holding_hidden_tokens():
    """A graph's steps take their positions and cache rows on the device, without the hidden
    flags: capturing over a cache that holds hidden tokens, or replaying after a call hid one,
    is a ValueError naming the sequence, the cache left as it was; tokens hidden inside the
    left padding (which no query reads) do not count. The same cache decodes with plain calls."""
    w = _C.random_weights(CFG, 60, "float32")
    gpu = _C.Layer(CFG, w, None, 0)
    cache = gpu.new_cache(16, 2)
    cache.set_padding(2, 0)
    x = _C.copy_tensor(_C.random_tensor((2, 4, 64), 61, "float32"), 0)
    gpu.prefill(x, cache, token_mask=torch.tensor([[False, False, True, True], [True, True, True, True]]))
    graph = gpu.decode_graph(cache)  # hidden tokens only in sequence 0's padding: none to refuse
    step = _C.copy_tensor(_C.random_tensor((2, 64), 62, "float32"), 0)
    graph.replay(step)
    gpu.decode(step, cache, token_mask=torch.tensor([True, False]))  # hides sequence 1's token
    lengths = list(cache.lengths)
    errors = errors_of((lambda: graph.replay(step), lambda: gpu.decode_graph(cache)))
    assert errors == [
        "ValueError: cache: expected no hidden tokens to replay a decode graph over, got sequence 1 holding some "
        "(a call's token_mask hid them; a graph does not read them): decode it with plain calls",
        "ValueError: cache: expected no hidden tokens to capture a decode graph over, got sequence 1 holding some "
        "(a call's token_mask hid them; a graph does not read them): decode it with plain calls"]
    assert list(cache.lengths) == lengths == [6, 6] and cache.hidden == ((0, 1), (5,))
    gpu.decode(step, cache)
    assert list(cache.lengths) == [7, 7]


# Tree verification (issue 42, requirement 2) on a CUDA layer: two draft trees of 9 tokens
# (tests/layer/test_tree_verify.py's), the second sequence's branching at its root
PARENTS = torch.tensor([[-1, 0, 0, 1, 1, 2, 5, -1, 7], [-1, 0, 1, 2, 0, 4, 4, 6, 3]])
KEPT = ([0, 2, 5, 6], [0, 4, 5])  # an accepted path of each tree


def tree_calls(dtype, seed, chunk):
    """a CUDA layer's and a CPU layer's (the same weights) errors over: prompts of 6 and 11
    tokens with a hole each (hidden keys in the cached part), a prefill given a tree and its
    positions (in passes of `chunk` tokens) asking for the maps, accept; verify, accept; two
    decode steps"""
    cpu = q3.DecoderLayer.random(CFG, seed, dtype)
    gpu = q3.DecoderLayer.random(CFG, seed, dtype, device="cuda")
    cc, cg = cpu.new_cache(40, 2), gpu.new_cache(40, 2)
    errs = {}
    for s, n in enumerate((6, 11)):
        x = _C.random_tensor((n, 64), seed + 1 + s, dtype)
        mask = torch.ones(n, dtype=torch.bool)
        mask[2 + s] = False
        errs[f"prompt {s}"] = rel(host(gpu.prefill(_C.copy_tensor(x, 0), cg, s, token_mask=mask)),
                                  host(cpu.prefill(x, cc, s, token_mask=mask)))
    tree, positions = cc._tree_inputs(PARENTS, None)
    x = _C.random_tensor((2, 9, 64), seed + 5, dtype)
    kw = {"tree": tree, "positions": positions, "return_attention": True}
    got, want = gpu.prefill(_C.copy_tensor(x, 0), cg, None, chunk, **kw), cpu.prefill(x, cc, None, chunk, **kw)
    errs["prefill with a tree"] = rel(host(got.output), host(want.output))
    maps = float(np.abs(host(got.attention) - host(want.attention)).max())
    # the probability of a token off the query's branch: sequence 0's token 3 (parent 1) on token
    # 2 (cache row 6 + 2), sequence 1's token 4 (parent 0) on token 1 (row 11 + 1)
    got_maps = host(got.attention)
    off_tree = float(np.abs(got_maps[0, :, 3, 8]).max() + np.abs(got_maps[1, :, 4, 12]).max())
    lengths = [list(cg.lengths), list(cc.lengths)]
    for c in (cg, cc):
        for s in range(2):
            c.accept(s, KEPT[s])
    x = _C.random_tensor((2, 9, 64), seed + 6, dtype)
    errs["verify"] = rel(host(gpu.verify(_C.copy_tensor(x, 0), cg, PARENTS)), host(cpu.verify(x, cc, PARENTS)))
    for c in (cg, cc):
        c.accept(0, [1, 3])
        c.accept(1, [])
    for t in range(2):
        s = _C.random_tensor((2, 64), seed + 7 + t, dtype)
        errs[f"decode {t}"] = rel(host(gpu.decode(_C.copy_tensor(s, 0), cg)), host(cpu.decode(s, cc)))
    keys = max(rel(executor_view(cg.keys(b)), torch.from_dlpack(cc.keys(b)).double().numpy()) for b in range(2))
    return {"errors": errs, "keys": keys, "maps": maps, "off the tree": off_tree, "lengths after the tree": lengths,
            "lengths": [list(cg.lengths), list(cc.lengths)], "hidden": [cg.hidden, cc.hidden]}


@pytest.mark.parametrize("chunk", [3, None])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_a_tree_on_the_executor_matches_the_cpu_layer_through_verify_accept_and_decode(dtype, chunk):
    """A call's tree on a CUDA layer (issue 42, requirement 2): after prompts whose masks hid a
    token each, a prefill given two different trees and their positions, in passes of 3 tokens
    (a pass's queries see the call's earlier passes through the tree) or in one; accept of a
    path of each; verify of two more trees, accept (nothing of the second); decode steps.
    Outputs, the prefill's maps (0 on a token off a query's branch) and cached keys within the
    dtype's tolerance of the CPU layer's, the same lengths and hidden tokens."""
    run = tree_calls(dtype, {"float32": 70, "bfloat16": 71}[dtype], chunk)
    assert list(run["errors"]) == ["prompt 0", "prompt 1", "prefill with a tree", "verify", "decode 0", "decode 1"]
    assert max(run["errors"].values()) <= TOL[dtype], run["errors"]
    assert run["keys"] <= TOL[dtype] and run["maps"] <= MAPS_TOL[dtype], run
    assert run["off the tree"] == 0.0, run
    assert run["lengths after the tree"] == [[15, 20], [15, 20]]
    assert run["lengths"] == [[14, 16], [14, 16]]
    assert run["hidden"][0] == run["hidden"][1] == ((2,), (3,))
