"""The SIMT executor's own contract with the thread that launches (in a subprocess of its own,
conftest.py): kernels run under the default floating-point environment (round to nearest, no
flush-to-zero), whatever the calling thread set, as CUDA kernels have no such state; and the
caller's environment is its own again after the launch (kernels/simt/context.h, FloatControl)."""
import ctypes
import ctypes.util
import platform

import numpy as np
import pytest

import qwen3layer as q3
from executor_arrays import host
from qwen3layer import _C

pytestmark = [pytest.mark.executor_subprocess,
              pytest.mark.skipif(platform.machine() != "x86_64", reason="the rounding modes' values are x86-64's")]
TIMEOUT = 300
FE_UPWARD, FE_TOWARDZERO = 0x800, 0xC00  # <fenv.h> on x86-64
LIBM = ctypes.CDLL(ctypes.util.find_library("m"))
CFG = q3.LayerConfig(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_experts=4,
                     num_experts_per_tok=2, moe_intermediate_size=32)


def prefill(layer, x):
    return host(layer.prefill(_C.copy_tensor(x, 0), layer.new_cache(16)))


@pytest.mark.parametrize("mode", [FE_UPWARD, FE_TOWARDZERO], ids=["upward", "toward zero"])
def test_kernels_round_to_nearest_whatever_the_caller_set(mode):
    """A float32 layer's prefill on the executor under the caller's rounding `mode` gives the
    bits it gives under round-to-nearest (blocks run on the calling thread and on threads it
    starts, which inherit its environment), and the caller's mode is still set afterwards."""
    layer = _C.Layer(CFG, _C.random_weights(CFG, 3, "float32"), None, 0)
    x = _C.random_tensor((1, 12, CFG.hidden_size), 4, "float32")
    nearest = prefill(layer, x)
    assert LIBM.fesetround(mode) == 0
    try:
        under_mode = prefill(layer, x)
        after = LIBM.fegetround()
    finally:
        LIBM.fesetround(0)
    assert after == mode
    assert np.isfinite(nearest).all() and np.array_equal(under_mode, nearest)
