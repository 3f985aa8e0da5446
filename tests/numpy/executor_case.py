"""The SIMT executor's smallest layer case, as a program (not a pytest module: the executor
becomes the CUDA backend of the whole process that opens it): a tiny fp32 layer's prefill of
5 tokens and 2 decode steps with the real CUDA kernels run on the executor, against the same
layer on the CPU. Prints the machine, the time and the worst error; exits 1 on a mismatch.
tests/ops/test_arm_python.py runs it under emulation on aarch64 (benchmarks/arm_python.py
build --simt); on x86-64 tests/executor covers the executor itself."""
import platform
import sys
import time

import numpy as np

import qwen3layer as q3

TOL = 1e-5  # max |executor - cpu| / max |cpu|: the same fp32 math in another order


def main() -> int:
    q3.cuda.emulate()
    cfg = q3.LayerConfig.tiny()
    host = q3.DecoderLayer.random(cfg, seed=1, dtype="float32")
    dev = q3.DecoderLayer.random(cfg, seed=1, dtype="float32", device="cuda")
    host_cache, dev_cache = host.new_cache(8), dev.new_cache(8)
    start, worst = time.perf_counter(), 0.0
    for step, shape in enumerate([(5, cfg.hidden_size), (1, cfg.hidden_size), (1, cfg.hidden_size)]):
        x = host.random_input(shape, seed=step)
        call = host.prefill if step == 0 else host.decode
        want = np.from_dlpack(call(x, host_cache))
        call = dev.prefill if step == 0 else dev.decode
        got = np.from_dlpack(q3.cuda.to_host(call(q3.cuda.to_device(x), dev_cache)))
        worst = max(worst, float(np.abs(got - want).max() / np.abs(want).max()))
    ok = worst <= TOL and host_cache.lengths == dev_cache.lengths == (7,)
    print(f"executor on {platform.machine()} ({q3.build_info()['cpu_path']}): prefill 5 tokens and 2 decode steps "
          f"in {time.perf_counter() - start:.2f} s, worst error {worst:.3g} (tolerance {TOL:g}): "
          f"{'OK' if ok else 'FAIL'}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
