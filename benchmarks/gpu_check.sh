#!/usr/bin/env bash
# The one command that checks the CUDA backend on a GPU machine (the device tool's H200):
# build with the machine's own python3 and nvcc (no network there: no build isolation),
# run the GPU tests (every CUDA kernel against its CPU twin), every kernel path once under
# compute-sanitizer's memory checker, then the CUDA benchmark; its table is printed last.
# The CPU suite (the same kernels on the SIMT executor included) runs in CI, not here. The
# steps' own time limits sum to 540 s (120 + 90 + 60 + 80 + 40 + 30 + 120), so one device call
# of 600 s always gets to the end. Logs go to $OUT if set.
set -uo pipefail
cd "$(dirname "$0")/.."
out=${OUT:-/tmp}
mkdir -p "$out"
export PYTHONUNBUFFERED=1
status=0

echo "== machine"
nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv,noheader || true
python3 --version; nvcc --version | tail -1

echo "== build"
timeout 120 python3 -m pip install --no-build-isolation --no-deps -q -e . > "$out/build.log" 2>&1 \
    || { tail -30 "$out/build.log"; exit 1; }
python3 -c "import qwen3layer as q3, qwen3layer._testing; print(q3.build_info()); print('cuda devices:', q3.cuda.device_count(), '- cuBLAS:', repr(q3.cuda.blas()))"

echo "== GPU tests"
timeout 90 python3 -m pytest -q -rs tests/gpu/test_cuda.py 2>&1 | tee "$out/gpu_tests.log" || status=1
timeout 60 python3 - <<'PY' 2>&1 | tee "$out/kernel_check.txt" || status=1
import sys
import qwen3layer as q3
rows = sorted(q3.cuda.check_kernels(0), key=lambda r: r["kernel"])  # grouped by launcher, stable
w, wk = max(len(r["case"]) for r in rows), max(len(r["kernel"]) for r in rows)
print(f"{'launcher'.ljust(wk)} | {'kernel vs CPU twin'.ljust(w)} | max rel err | tolerance | ok")
for r in rows:
    print(f"{r['kernel'].ljust(wk)} | {r['case'].ljust(w)} | {r['max_err']:11.2e} | {r['tol']:9.0e} | "
          f"{'yes' if r['ok'] else 'NO'}")
sys.exit(0 if all(r["ok"] for r in rows) else 1)
PY

echo "== memory checker over every kernel path (compute-sanitizer, where it runs)"
if command -v compute-sanitizer > /dev/null; then
    timeout 80 compute-sanitizer --tool memcheck --print-limit 20 python3 benchmarks/sanitize_check.py 2>&1 \
        | tee "$out/memcheck.log" | grep -E "ERROR SUMMARY|Invalid|kernel self-check|ran;|Error" | head -40
    if grep -q "Device not supported" "$out/memcheck.log"; then
        echo "compute-sanitizer: skipped (it answers 'Device not supported' on this runtime; not a kernel failure)"
    else
        grep -q "ERROR SUMMARY: 0 errors" "$out/memcheck.log" || status=1
    fi
else
    echo "compute-sanitizer not found: skipped"
fi

echo "== expert parallelism over NCCL (2 GPUs or more)"
gpus=$(nvidia-smi --list-gpus 2> /dev/null | wc -l)
if [ "$gpus" -ge 2 ]; then
    timeout 40 python3 -m pytest -q -rs tests/gpu/test_nccl_ep.py 2>&1 | tee "$out/nccl_ep.log" || status=1
else
    echo "skipped: $gpus GPU(s) on this machine, NCCL expert parallelism needs 2"
fi

echo "== one GPU and the host's experts: the split layer measured beside its model (docs/hybrid.md)"
timeout 30 python3 -m qwen3layer run --device cuda --expert-device cpu --gpu-experts 16 --tokens 256 \
    --chunk-size 256 --new-tokens 4 2>&1 | tee "$out/hybrid.txt" || status=1

echo "== CUDA benchmark"
timeout 120 python3 benchmarks/bench_cuda.py 2>&1 | tee "$out/bench_cuda.txt" || status=1
exit $status
