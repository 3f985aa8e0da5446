"""The CUDA backend's library (libq3cuda.so, built beside the extension where nvcc was
found). It is opened only when asked for, so `import qwen3layer` works without CUDA."""
from __future__ import annotations

import glob
import importlib.util
import os
from typing import Optional, Sequence

from . import _C

LIBRARY = os.path.join(os.path.dirname(os.path.abspath(__file__)), "libq3cuda.so")
# the same kernels built for the SIMT executor, which runs them on the CPU (kernels/simt)
SIMT_LIBRARY = os.path.join(os.path.dirname(os.path.abspath(__file__)), "libq3simt.so")
_blas: Optional[str] = None
_targets: Optional[list] = None
_emulated = False


def _cublas_candidates() -> list:
    """Where cuBLAS may be: QWEN3LAYER_CUBLAS, the nvidia-cublas wheel, then the loader's
    search path (None)."""
    found = [os.environ["QWEN3LAYER_CUBLAS"]] if os.environ.get("QWEN3LAYER_CUBLAS") else []
    spec = importlib.util.find_spec("nvidia")
    for root in (spec.submodule_search_locations or []) if spec else []:
        found += sorted(glob.glob(os.path.join(root, "*", "lib", "libcublas.so*")), reverse=True)
    return found + [None]


def built() -> bool:
    """Whether this build has the CUDA backend (nvcc was found when it was built)."""
    return os.path.exists(LIBRARY)


def targets() -> list[str]:
    """The GPU targets the CUDA library holds code for, as the build recorded them in it
    (q3_cuda_targets(), kernels/cuda/runtime.cu): SASS first ('sm_80', ...), then 'compute_NN'
    for the PTX a later GPU compiles when it loads the library; [] without a CUDA library.
    Reading it opens the library but initialises no CUDA."""
    global _targets
    if _targets is None:
        if not built():
            return []
        import ctypes
        get = ctypes.CDLL(LIBRARY).q3_cuda_targets
        get.restype = ctypes.c_char_p
        _targets = [t for t in get().decode().split(",") if t]
    return list(_targets)


_NO_DEVICE = "no CUDA device on this machine (0 found)"


def _no_device(what: str, expected: str = "") -> str:
    """`what`'s refusal where the machine has no CUDA device, with what it takes instead"""
    hint = "call qwen3layer.cuda.emulate() first to run the CUDA path on the CPU's SIMT executor" \
        if os.path.exists(SIMT_LIBRARY) else ""
    instead = ", or ".join(t for t in (f"expected {expected}" if expected else "", hint) if t)
    return f"{what}: {_NO_DEVICE}" + (f"; {instead}" if instead else "")


def _open() -> int:
    """The CUDA devices of the open backend, opening the GPU library if none is open yet (it
    becomes the backend only where it sees a device, so emulate() may follow a 0); 0 where
    this build has no CUDA library."""
    n = _C.cuda_device_count()  # nonzero once a backend is open
    if n or not built():
        return n
    global _blas
    n = _C.cuda_open(LIBRARY)
    if n and _blas is None:
        for path in _cublas_candidates():
            if _C.cuda_blas_open(path):
                _blas = path or "libcublas (default search path)"
                break
        else:
            _blas = ""
    return n


def _require(what: str, device: int = 0) -> None:
    """RuntimeError naming `what` unless a backend is open (or opens now) with `device`"""
    n = _open()
    if n == 0:
        raise RuntimeError(_no_device(what) if built() else
                           f"{what}: this build has no CUDA backend (nvcc was not found when it was built)")
    if not 0 <= device < n:
        raise ValueError(f"{what}: device: expected a CUDA device index below {n} (the CUDA devices this "
                         f"machine has), got {device}")


def load() -> None:
    """Opens the CUDA library as the backend; RuntimeError if this build has none, it cannot
    be loaded, or it sees no CUDA device (no driver or no GPU: it is then not the backend, and
    emulate() may still be called)."""
    _require("qwen3layer.cuda.load()")


def emulate(path: Optional[str] = None, cublas: bool = False) -> None:
    """Makes CUDA device 0 the SIMT executor: the real CUDA kernels (kernels/cuda/*.cu, built
    for the CPU) run on the CPU under CUDA's execution model, with what the hardware would
    reject reported as an error naming the kernel, block and thread. Instead of load(), once
    per process: for tests and for stepping through a kernel without a GPU. RuntimeError if
    this build has no executor (the CUDA toolkit's headers were not found when it was built).
    path: another build of the executor (benchmarks/simt_check.py's variants with a planted
    defect) instead of the package's libq3simt.so. cublas=True also opens the executor's
    stand-in for cuBLAS (a plain CPU GEMM behind cuBLAS's entry points), so the prefill GEMMs
    take the cuBLAS path as on a GPU that has it."""
    global _blas, _emulated
    if path is None and not os.path.exists(SIMT_LIBRARY):
        raise RuntimeError("cuda: this build has no SIMT executor (the CUDA toolkit's headers were not found when "
                           "it was built)")
    library = os.path.abspath(path) if path is not None else SIMT_LIBRARY
    _C.cuda_open(library)
    _emulated = True
    if cublas:
        if not _C.cuda_blas_open(library):
            raise RuntimeError(f"cuda: {library} has no cuBLAS stand-in")
        _blas = "the SIMT executor's stand-in"
    elif _blas is None:
        _blas = ""


def emulated() -> bool:
    """Whether the CUDA device is the SIMT executor (emulate() was called): its tensors live in
    host memory, so no other library may take them as device memory."""
    return _emulated


def to_device(tensor, device: int = 0) -> "_C.Tensor":
    """A contiguous copy of `tensor` (a host tensor: torch, numpy or the extension's; float32,
    bfloat16, float16, float8_e4m3fn or int32) on CUDA device `device`, as an extension Tensor:
    how host data reaches the SIMT executor's device (its layers take no torch tensors: torch
    sees its memory as neither host nor CUDA memory); on a GPU, torch's own .cuda() serves as well."""
    _require(f"qwen3layer.cuda.to_device(device={device!r})", device)
    return _C.copy_tensor(tensor, device)


def to_host(tensor) -> "_C.Tensor":
    """A host copy of an extension Tensor on a CUDA device (a layer's output on the SIMT
    executor's device), for torch.from_dlpack or numpy.from_dlpack."""
    if not isinstance(tensor, _C.Tensor) or tensor.device == "cpu":
        raise ValueError(f"tensor: expected a qwen3layer Tensor on a CUDA device, got {tensor!r}")
    return _C.copy_tensor(tensor, -1)


def blas() -> Optional[str]:
    """The cuBLAS the prefill GEMMs use ('' if none was found: the WMMA kernel then), or None
    before the backend is loaded."""
    return _blas


def device_count() -> int:
    """CUDA devices visible to the backend (0 without a backend, a driver or a GPU; then no
    backend is opened, and emulate() may still be called)."""
    return _open()


def synchronize(device: int = 0) -> None:
    """Waits until all the work queued on CUDA device `device` has run (for timings).
    RuntimeError where the machine has no CUDA device."""
    _require(f"qwen3layer.cuda.synchronize(device={device!r})", device)
    _C.cuda_synchronize(device)


def empty_cache() -> None:
    """Frees the device memory of dead outputs that the extension keeps for reuse (a new
    output of the same size takes such a block instead of a cudaMalloc, and freeing one does
    not wait for the device as cudaFree does)."""
    _C.cuda_empty_cache()


def cached_blocks() -> list[tuple[int, int, int]]:
    """(device, nbytes, address) of each device block kept for reuse, oldest first: at most
    16 blocks and 512 MiB; when full, the oldest is freed to keep a newly dead one."""
    return _C.cuda_cached_blocks()


def testing_module():
    """qwen3layer._testing: the kernel check harness and the test-only entries, a module of
    its own beside _C (built by setup.py unless Q3_TESTING=0), bound at import to _C's engine
    (the backend emulate() or load() opened). ImportError naming how to build it if absent."""
    try:
        from . import _testing
    except ImportError as e:
        raise ImportError(f"qwen3layer._testing (the kernel check harness) cannot be imported: {e}; build it with "
                          "`python setup.py build_ext --inplace` or `pip install -e \".[test]\"` (without "
                          "Q3_TESTING=0)", name="qwen3layer._testing") from e
    return _testing


def check_kernels(device: int = 0, kernels: Optional[Sequence[str]] = None) -> list[dict]:
    """Runs every CUDA kernel against its CPU twin on random inputs on `device` (loading the
    GPU library unless emulate() made the SIMT executor the backend): [{'case', 'kernel',
    'max_err', 'tol', 'schedules', 'agree', 'ok'}], max_err being max |cuda - cpu| / max |cpu|
    and kernel the launcher(s) of the case (as kernels/cuda/ops_cuda.h names them, e.g.
    'attention', 'moe_route'), to group cases by. On the executor each case runs under 3
    thread schedules and `agree` says whether their results were bitwise equal (a race shows
    as not); on a GPU, schedules is 1. kernels: the cases of these launchers alone (a case
    runs where one of its launchers is named; e.g. ['attention_probs']), ValueError for a name
    no case has. The harness is qwen3layer._testing's (testing_module()): ImportError where
    that module was not built."""
    if kernels is not None:
        if isinstance(kernels, str) or not kernels or not all(isinstance(k, str) and k and "," not in k
                                                              for k in kernels):
            raise ValueError(f"kernels: expected a non-empty list of launcher names, got {kernels!r}")
    harness = testing_module()
    _require(f"qwen3layer.cuda.check_kernels(device={device!r})", device)
    rows = harness.cuda_check(device, None if kernels is None else ",".join(kernels))
    if kernels is not None:
        found = {name for row in rows for name in row[5].split("+")}
        unknown = [k for k in kernels if k not in found]
        if unknown:
            raise ValueError(f"kernels: no case exercises {', '.join(map(repr, unknown))} "
                             f"(cases ran for {sorted(found) or 'none'})")
    return [{"case": c, "kernel": kern, "max_err": e, "tol": t, "schedules": n, "agree": a, "ok": e <= t and a}
            for c, e, t, n, a, kern in rows]


def moe_path(layer, path: Optional[str] = None) -> str:
    """The prefill MoE path of a CUDA layer (a DecoderLayer or a _C.Layer): 'measured' (the
    default: on the layer's first prefill pass of a size class of rows, every path the pass
    can take is timed with CUDA events and the fastest kept for the class), or one forced:
    'per_expert_wmma', 'per_expert_cublas', 'grouped_wmma' or 'grouped_cublas' (cuBLAS's
    grouped GEMM, where the found cuBLAS has cublasGemmGroupedBatchedEx). None only reads it.
    Returns the setting. Each layer has its own; ValueError for a CPU layer."""
    return _C.cuda_moe_path(getattr(layer, "_core", layer), path)


def moe_path_choice(layer) -> dict:
    """A CUDA layer's measured prefill MoE paths (a DecoderLayer or a _C.Layer):
    {(lo, hi): (chosen, {path: ms})} for each size class measured (passes of lo..hi rows)."""
    return _C.cuda_moe_choice(getattr(layer, "_core", layer))
