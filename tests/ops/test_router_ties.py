"""The router's tie rule (kernels/router.h): experts of equal probability are taken in
ascending expert index, also when the tie straddles the k-th place. Through the layer, on the
portable kernels and on the best path of this CPU, in prefill (experts one after the other)
and decode (experts across threads). The CUDA router is held to the same rule by the kernel
self-check's tie case (csrc/check/kernel_check.c), on a GPU."""
import pytest

import qwen3layer as q3
import router_ties as rt

_PATHS = q3.build_info()["cpu_paths"]
BEST = _PATHS[-1]
TOL = 1e-5


@pytest.fixture(autouse=True, params=sorted({"portable", BEST}))
def cpu_path(request):
    q3.set_cpu_path(request.param)
    yield request.param
    q3.set_cpu_path(BEST)


def update_err(y, ref, x):
    """relative error of the layer's update y - x (the residual would hide an expert)"""
    d = (y.double() - x.double()) - (ref - x.double())
    return float(d.norm() / (ref - x.double()).norm())


@pytest.fixture(scope="module")
def setup():
    w = rt.weights()
    return w, q3.DecoderLayer(rt.config(q3), w)


def test_the_reference_sees_the_ties_and_the_rule_matters(setup):
    """The tokens tie as designed (so the tests below test ties), and the other tie rule
    would change each kind of token's output far beyond the tolerance."""
    w, _ = setup
    x = rt.tokens("ABC")
    ref, chosen = rt.reference(w, x)
    assert chosen == [rt.CHOSEN["A"], rt.CHOSEN["B"], rt.CHOSEN["C"]]
    other, other_chosen = rt.reference(w, x, lower_first=False)
    assert other_chosen == [[4, 2, 1, 5], [5, 1, 6, 3], [7, 6, 5, 4]]
    for t in range(3):
        assert update_err(other[t], ref[t], x[t]) > 1e-2, t


def test_prefill_breaks_ties_towards_the_lower_expert_index(setup):
    """Experts 3 and 5 tie for the last slot (3 is taken), four experts tie for two slots
    (0 and 2), and all eight tie (0 to 3): 21 tokens, 7 of each kind, in one pass."""
    w, layer = setup
    x = rt.tokens("ABC" * 7)
    ref, _ = rt.reference(w, x)
    y = layer.prefill(x, layer.new_cache(32))
    for t in range(x.shape[0]):
        assert update_err(y[t], ref[t], x[t]) <= TOL, (t, "ABC"[t % 3])


def test_decode_breaks_ties_towards_the_lower_expert_index(setup):
    """One token of each kind in a decode step of 3 sequences."""
    w, layer = setup
    x = rt.tokens("ABC", seed=2)
    ref, _ = rt.reference(w, x)
    cache = layer.new_cache(8, batch=3)
    layer.prefill(rt.tokens("CAB" * 3, seed=3).reshape(3, 3, rt.HIDDEN), cache)
    y = layer.decode(x, cache)
    for t in range(3):
        assert update_err(y[t], ref[t], x[t]) <= TOL, (t, "ABC"[t])
